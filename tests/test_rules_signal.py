"""Gradient rules of onnxgrad/rules/signal.py (DFT, opsets 17 and 20, irfft included; STFT,
opset 17): the adjoint transforms, against float64 finite differences and torch.fft / torch.stft
autograd."""
import numpy as np
import onnx
import pytest
from onnx import helper
from util import assert_gradients, make_model, vi_model

import onnxgrad
from onnxgrad.check import check_gradients
from onnxgrad.runtime import run

F32 = np.float32


def dft_model(opset, c, n=6, length=None, axis=None, **attrs):
    """DFT of x [2, n, 3, c] (c = 1 real, 2 complex); axis an attribute (17) or input (20)."""
    ins, inits = ["x", ""], {}
    if length is not None:
        ins[1], inits["L"] = "L", np.array(length, np.int64)
    if axis is not None and opset >= 20:
        ins.append("ax")
        inits["ax"] = np.array(axis, np.int64)
    elif axis is not None:
        attrs["axis"] = axis
    while ins[-1] == "":
        ins.pop()
    node = helper.make_node("DFT", ins, ["y"], **attrs)
    return make_model([node], {"x": (F32, [2, n, 3, c])}, ["y"], inits=inits, opset=opset)


def x_of(c, n=6, seed=0):
    return np.random.default_rng(seed).standard_normal((2, n, 3, c)).astype(F32)


@pytest.mark.parametrize("c,attrs", [
    (2, {}), (2, {"inverse": 1}), (1, {}), (1, {"inverse": 1}), (1, {"onesided": 1}),
    (2, {"length": 4}), (2, {"length": 9, "inverse": 1}), (1, {"length": 9, "onesided": 1}),
    (2, {"axis": 2})], ids=str)
@pytest.mark.parametrize("opset", [17, 20])
def test_dft(opset, c, attrs):
    attrs = dict(attrs)
    axis = attrs.pop("axis", 1 if opset == 17 else -3)
    m = dft_model(opset, c, axis=axis, **attrs)
    assert_gradients(m, "y", "x", feeds={"x": x_of(c)})


def test_dft_default_axis_opset20():
    assert_gradients(dft_model(20, 2, n=3), "y", "x", feeds={"x": x_of(2, 3)})


@pytest.mark.parametrize("onesided", [0, 1])
def test_dft_torch(onesided):
    """Real input, along axis 1: torch.fft.fft / rfft autograd."""
    torch = pytest.importorskip("torch")
    x = x_of(1)
    m = dft_model(20, 1, axis=1, onesided=onesided)
    w = np.random.default_rng(1).standard_normal((2, 4 if onesided else 6, 3, 2))
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["w"])  # w: the cotangent, fed
    got = run(res.model, {"x": x, "w": w.astype(F32)}, outputs=res.grads)[0]
    t = torch.tensor(x[..., 0], dtype=torch.float64, requires_grad=True)
    y = (torch.fft.rfft if onesided else torch.fft.fft)(t, dim=1)
    wt = torch.tensor(w)
    (y.real * wt[..., 0] + y.imag * wt[..., 1]).sum().backward()
    np.testing.assert_allclose(got[..., 0], t.grad.numpy(), rtol=1e-4, atol=1e-4)


# -- irfft: DFT(inverse=1, onesided=1) ------------------------------------------------------------
def irfft_model(opset, n=4, length=None, axis=1, dtype=F32):
    """irfft of the half spectrum x [2, n, 3, 2] (n bins along axis 1) or [2, 3, n, 2] (axis 2)."""
    m = dft_model(opset, 2, n=n, length=length, axis=axis, inverse=1, onesided=1)
    if dtype != F32:
        m = make_model(list(m.graph.node), {"x": (dtype, [2, n, 3, 2])}, ["y"],
                       inits={t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer},
                       opset=opset)
    return m


@pytest.mark.parametrize("n,length,axis", [
    (4, None, 1),  # L = 2 (n - 1) = 6: even, bin 3 is the Nyquist bin
    (4, 7, 1),     # odd L: bins 1..3 all mirrored, no Nyquist bin
    (4, 6, 1),     # the default, given
    (4, None, 2),  # along axis 2 (3 bins): L = 4
    (4, 5, 2)], ids=str)
@pytest.mark.parametrize("opset", [17, 20])
def test_irfft(opset, n, length, axis):
    """x has the L // 2 + 1 bins the irfft reads: onnxruntime's forward follows the spec here, and
    its float64 central differences are the oracle (every element of x is probed)."""
    x = x_of(2, n)
    m = irfft_model(opset, n, length, axis)
    assert_gradients(m, "y", "x", feeds={"x": x}, max_elements=x.size)


def test_irfft_float64():
    x = x_of(2, 5).astype(np.float64)
    assert_gradients(irfft_model(20, 5, dtype=np.float64), "y", "x", feeds={"x": x})


def test_irfft_axis_input():
    """The axis a graph input (not a constant): the rule reads it at run time."""
    node = helper.make_node("DFT", ["x", "", "ax"], ["y"], inverse=1, onesided=1)
    m = make_model([node], {"x": (F32, [2, 4, 3, 2]), "ax": (np.int64, [])}, ["y"], opset=20)
    feeds = {"x": x_of(2, 4), "ax": np.array(1, np.int64)}
    assert_gradients(m, "y", "x", feeds=feeds, max_elements=48)


@pytest.mark.parametrize("length", [10, 4, 3], ids=lambda v: f"L{v}")
def test_irfft_other_bin_counts(length):
    """x with more (L = 10: zero-padded to 6 bins) or fewer (L = 4, 3: cropped to 3, 2) bins than
    the irfft reads. The ONNX spec, onnx.reference, numpy and torch crop or zero-pad x to
    L // 2 + 1 bins; onnxruntime 1.31 builds a different spectrum then (its L = 10 and L = 8
    outputs differ from numpy.fft.irfft), so the finite differences run on onnx.reference here;
    the gradient graph itself (an rfft, Slice, Pad) still runs on onnxruntime (assert_gradients'
    second check)."""
    m = irfft_model(20, 4, length)
    assert_gradients(m, "y", "x", feeds={"x": x_of(2, 4)}, runtime="reference",
                     max_elements=48)


@pytest.mark.parametrize("length", [None, 7, 10, 4], ids=str)
def test_irfft_torch(length):
    """torch.fft.irfft autograd (float64), every element: torch's backward is the rfft of g with
    bins 1 .. L - L // 2 - 1 doubled (fft_c2r_backward), so it too gives zero to the imaginary
    parts of bin 0 and the Nyquist bin (which the forward ignores); with L given, x is cropped
    or zero-padded to L // 2 + 1 bins first, as the spec says."""
    torch = pytest.importorskip("torch")
    x = x_of(2, 4)
    m = irfft_model(20, 4, length)
    L = 6 if length is None else length
    w = np.random.default_rng(1).standard_normal((2, L, 3, 1))
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["w"])
    got = run(res.model, {"x": x, "w": w.astype(F32)}, outputs=res.grads)[0]
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = torch.fft.irfft(torch.view_as_complex(t), n=length, dim=1)
    (y * torch.tensor(w[..., 0])).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-4, atol=1e-4)
    zero = lambda t: np.testing.assert_allclose(t, 0, atol=1e-5)  # noqa: E731  (round-off)
    zero(got[:, 0, :, 1])  # Im of bin 0: no gradient
    if L % 2 == 0 and L // 2 < 4:
        zero(got[:, L // 2, :, 1])  # nor Im of the Nyquist bin


# -- STFT ------------------------------------------------------------------------------------------
def stft_model(c, S, step, L, onesided=1, window=True, length=True, dtype=F32, batch=2,
               itype=np.int64, opset=17):
    """STFT of x [batch, S, c] with frame_step ``step``; the window w [L] a graph input (so it is
    differentiated too) or absent; frame_length L given as a constant (of ``itype``, as the
    step) or left out."""
    ins, inits = ["x", "step", "", ""], {"step": np.array(step, itype)}
    inputs = {"x": (dtype, [batch, S, c])}
    if window:
        ins[2], inputs["w"] = "w", (dtype, [L])
    if length:
        ins[3], inits["fl"] = "fl", np.array(L, itype)
    while ins[-1] == "":
        ins.pop()
    attrs = {} if onesided is None else {"onesided": onesided}
    node = helper.make_node("STFT", ins, ["y"], **attrs)
    return make_model([node], inputs, ["y"], inits=inits, opset=opset)


def vi(name, shape):
    return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)


def stft_feeds(c, S, L, window=True, seed=0, dtype=F32, batch=2):
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((batch, S, c)).astype(dtype)}
    if window:
        feeds["w"] = rng.standard_normal(L).astype(dtype)
    return feeds


FRAMES = [(11, 2, 5),   # step < frame_length: frames overlap (4 frames)
          (13, 4, 3)]   # step > frame_length: gaps no frame reads (3 frames; x[3, 7, 11, 12])


@pytest.mark.parametrize("S,step,L", FRAMES, ids=["overlap", "gaps"])
@pytest.mark.parametrize("window,length", [(True, False), (True, True), (False, True)],
                         ids=["window", "window+length", "length"])
@pytest.mark.parametrize("onesided", [0, 1])
@pytest.mark.parametrize("c", [1, 2], ids=["real", "complex"])
def test_stft(c, onesided, window, length, S, step, L):
    """Gradients of the signal and (when given) the window, every element probed. onnxruntime
    returns the first L // 2 + 1 bins of the full DFT for a complex signal with onesided=1 (the
    spec calls that case impossible); the rule is the adjoint of that, as the check confirms."""
    feeds = stft_feeds(c, S, L, window)
    m = stft_model(c, S, step, L, onesided, window, length)
    assert_gradients(m, "y", list(feeds), feeds=feeds, max_elements=64)


def test_stft_float64_int32():
    """A float64 model (onnxruntime has float64 STFT and DFT kernels), int32 step and length."""
    feeds = stft_feeds(1, 11, 5, dtype=np.float64)
    m = stft_model(1, 11, 2, 5, dtype=np.float64, itype=np.int32)
    assert_gradients(m, "y", ["x", "w"], feeds=feeds, max_elements=64)


@pytest.mark.parametrize("c", [1, 2], ids=["real", "complex"])
def test_stft_opset20(c):
    """In an opset-20 model the rule's DFTs take the axis as an input."""
    feeds = stft_feeds(c, 11, 5)
    assert_gradients(stft_model(c, 11, 2, 5, opset=20), "y", ["x", "w"], feeds=feeds,
                     max_elements=64)


def test_stft_default_onesided():
    """onesided absent means 1 (the schema's default; onnxruntime and onnx.reference agree), so
    the gradient is that of onesided=1. onnx 1.23's shape inference reads an absent onesided as 0
    (it would infer [2, 4, 5, 2] here, the run gives [2, 4, 3, 2]); onnxgrad writes the default
    out before inference, so a cotangent input declared with y's shape can be fed."""
    feeds = stft_feeds(1, 11, 5)
    gy = np.random.default_rng(7).standard_normal((2, 4, 3, 2)).astype(np.float32)
    got = []
    for onesided in (None, 1):
        m = stft_model(1, 11, 2, 5, onesided)
        m.graph.output[0].type.tensor_type.ClearField("shape")  # make_model's inference
        res = onnxgrad.gradients(m, "y", ["x", "w"], grad_ys=["gy"])
        got.append(run(res.model, {**feeds, "gy": gy}, outputs=res.grads))
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


def test_stft_whole_signal_reference():
    """Neither window nor frame_length: the spec makes the frame the whole signal (one frame).
    onnxruntime 1.31 cannot run that STFT ("Tensor shape.Size() must be >= 0"), so the check
    runs on onnx.reference."""
    feeds = stft_feeds(1, 9, None, window=False)
    m = vi_model([helper.make_node("STFT", ["x", "step"], ["y"])], [vi("x", [2, 9, 1])],
                 [vi("y", [2, 1, 5, 2])], inits={"step": np.array(2, np.int64)}, opset=17)
    report = check_gradients(m, "y", "x", feeds, runtime="reference")
    assert report.ok, str(report)


@pytest.mark.parametrize("S,step,L", FRAMES, ids=["overlap", "gaps"])
@pytest.mark.parametrize("c,onesided", [(1, 1), (1, 0), (2, 0)], ids=str)
def test_stft_torch(c, onesided, S, step, L):
    """torch.stft autograd (center=False, window given, return_complex; a complex signal needs
    onesided=False there): torch's [batch, bins, frames] complex output is y[..., 0] + i y[..., 1]
    transposed. Signal and window gradients, float64."""
    torch = pytest.importorskip("torch")
    feeds = stft_feeds(c, S, L)
    m = stft_model(c, S, step, L, onesided)
    F, bins = 1 + (S - L) // step, L // 2 + 1 if onesided else L
    cot = np.random.default_rng(1).standard_normal((2, F, bins, 2))
    res = onnxgrad.gradients(m, "y", ["x", "w"], grad_ys=["cot"])
    gx, gw = run(res.model, {**feeds, "cot": cot.astype(F32)}, outputs=res.grads)
    x = torch.tensor(feeds["x"], dtype=torch.float64, requires_grad=True)
    w = torch.tensor(feeds["w"], dtype=torch.float64, requires_grad=True)
    sig = x[..., 0] if c == 1 else torch.view_as_complex(x)
    y = torch.stft(sig, n_fft=L, hop_length=step, win_length=L, window=w, center=False,
                   onesided=bool(onesided), return_complex=True).transpose(1, 2)
    ct = torch.tensor(cot)
    (y.real * ct[..., 0] + y.imag * ct[..., 1]).sum().backward()
    np.testing.assert_allclose(gx, x.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, w.grad.numpy(), rtol=1e-4, atol=1e-4)


def np_stft(x, w, step):
    """numpy's STFT of x [batch, S, c] with window w: [batch, frames, L // 2 + 1, 2]."""
    z = x[..., 0] + (1j * x[..., 1] if x.shape[-1] == 2 else 0)
    L = len(w)
    frames = np.stack([z[:, f:f + L] * w for f in range(0, z.shape[1] - L + 1, step)], 1)
    y = np.fft.fft(frames, axis=-1)[..., :L // 2 + 1]
    return np.stack([y.real, y.imag], -1)


def test_stft_symbolic_batch_and_length():
    """One gradient graph, symbolic batch and signal length (so symbolic frames), fed two
    batch sizes and lengths; checked against the exact adjoints from numpy (y is linear in x
    and in w: each gradient element is <y of a unit vector, cotangent>). Every node is ai.onnx
    and the model passes the full checker."""
    node = helper.make_node("STFT", ["x", "step", "w"], ["y"], onesided=1)
    m = vi_model([node], [vi("x", ["B", "S", 1]), vi("w", [4])], [vi("y", ["B", "F", 3, 2])],
                 inits={"step": np.array(3, np.int64)}, opset=17)
    res = onnxgrad.gradients(m, "y", ["x", "w"], grad_ys=["cot"])
    onnx.checker.check_model(res.model, full_check=True)
    assert {nd.domain for nd in res.model.graph.node} <= {"", "ai.onnx"}
    for batch, S in [(2, 10), (3, 14)]:
        feeds = stft_feeds(1, S, 4, batch=batch, seed=batch)
        x, w = feeds["x"].astype(np.float64), feeds["w"].astype(np.float64)
        cot = np.random.default_rng(S).standard_normal(np_stft(x, w, 3).shape)
        gx, gw = run(res.model, {**feeds, "cot": cot.astype(F32)}, outputs=res.grads)
        unit = lambda shape, i: np.eye(np.prod(shape))[i].reshape(shape)  # noqa: E731
        want_x = [np.sum(np_stft(unit(x.shape, i), w, 3) * cot) for i in range(x.size)]
        want_w = [np.sum(np_stft(x, unit(w.shape, i), 3) * cot) for i in range(w.size)]
        np.testing.assert_allclose(gx, np.reshape(want_x, x.shape), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(gw, want_w, rtol=1e-4, atol=1e-4)


def test_stft_second_order():
    """The gradient graph (rfft adjoint, Gather, ScatterElements add) is itself differentiable:
    the signal's gradient is bilinear in the window and the cotangent."""
    m = stft_model(1, 11, 2, 5)
    res = onnxgrad.gradients(m, "y", ["x", "w"], grad_ys=["cot"])
    feeds = {**stft_feeds(1, 11, 5), "cot": np.random.default_rng(2).standard_normal(
        (2, 4, 3, 2)).astype(F32)}
    assert_gradients(res.model, res.grads[0], ["w", "cot"], feeds=feeds)
