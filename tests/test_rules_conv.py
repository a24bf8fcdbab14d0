"""Gradient rules of onnxgrad/rules/conv.py: convolutions and pooling.

Three oracles:
- float64 central finite differences (``util.assert_gradients``; onnxruntime has no float64 Conv,
  ConvTranspose, AveragePool or LpPool kernels, so those run on onnx.reference), which also runs
  the same gradient graph in float32 on onnxruntime;
- PyTorch autograd in float32 on onnxruntime, to 1e-4 relative, with random cotangents;
- PyTorch double backward for second-order gradients (gradient of gradient).

onnx.reference's ConvTranspose mishandles group > 1 and output_shape without auto_pad SAME (onnx
1.23); check_gradients runs a spec-following version (onnxgrad/runtime.py, checked against
onnxruntime below).
onnx.reference's LpPool with ceil_mode disagrees with onnxruntime (and with the spec), and neither
runtime has a float64 GlobalLpPool, so those cases use float32 differences on onnxruntime.
(onnx.reference's MaxPool with SAME_LOWER is off too, but MaxPool runs on onnxruntime in float64.)
onnx's shape inference overestimates a ceil_mode pool's output when the last window would start in
the end padding (onnxruntime drops that window and folds Shape() of the wrongly typed value), so
such configurations are left out here.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import helper
from onnx.reference import ReferenceEvaluator
from util import assert_gradients, make_model, op_model

import onnxgrad
import onnxgrad.runtime as runtime
from onnxgrad.runtime import run, session

F32 = np.float32


# -- helpers ---------------------------------------------------------------------------------------
def rnd(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(F32)


def sym(shape, names="NCDHW"):
    """A symbolic version of a shape: batch, channels and spatial dims all named."""
    return [names[i] if i < 2 else f"S{i}" for i in range(len(shape))]


def model_of(op, feeds, symbolic=(), opset=18, n_out=1, **attrs):
    """A one-node model whose inputs are ``feeds`` (names in order), dims named where asked:
    symbolic = 'batch' (dim 0) and/or 'spatial' (dims 2..)."""
    ins = {}
    for name, v in feeds.items():
        shape = list(v.shape)
        if name == "x":
            if "batch" in symbolic:
                shape[0] = "N"
            if "spatial" in symbolic:
                shape[2:] = [f"S{i}" for i in range(len(shape) - 2)]
        ins[name] = (v.dtype.type, shape)
    return op_model(op, ins, n_out=n_out, opset=opset, **attrs)


def fd(model, feeds, xs=None, ys="y", **kw):
    return assert_gradients(model, ys, xs or list(feeds), feeds, **kw)


def versus_torch(model, feeds, xs, fn, seed=1, ys="y"):
    """onnxgrad's gradients in float32 on onnxruntime against torch autograd, same cotangent."""
    torch = pytest.importorskip("torch")
    y = run(model, feeds, outputs=[ys])[0]
    cot = rnd(y.shape, seed)
    res = onnxgrad.gradients(model, ys, xs, grad_ys=["cot"])
    got = session(res.model).run(res.grads, {**feeds, "cot": cot})
    t = {k: torch.tensor(v, requires_grad=k in xs) for k, v in feeds.items()}
    ty = fn(**t)
    np.testing.assert_allclose(ty.detach().numpy(), y, rtol=1e-4, atol=1e-4, err_msg="forward")
    want = torch.autograd.grad(ty, [t[k] for k in xs], torch.tensor(cot))
    for k, a, b in zip(xs, got, want):
        b = b.numpy()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(b).max()),
                                   err_msg=f"grad of {k}")


def second_order_versus_torch(model, feeds, xs, fn, seed=2):
    """The gradient of <first gradients, v> with respect to xs and the cotangent, against torch's
    double backward: every op a first-order rule emits must have a rule of its own."""
    torch = pytest.importorskip("torch")
    y = run(model, feeds, outputs=["y"])[0]
    gy = rnd(y.shape, seed)
    first = onnxgrad.gradients(model, "y", xs, grad_ys=["gy"])
    vs = {f"v{i}": rnd(feeds[x].shape, seed + 1 + i) for i, x in enumerate(xs)}
    second = onnxgrad.gradients(first.model, first.grads, [*xs, "gy"], grad_ys=list(vs),
                                unconnected_gradients="zero")
    onnx.checker.check_model(second.model, full_check=True)
    got = session(second.model).run(second.grads, {**feeds, "gy": gy, **vs})
    t = {k: torch.tensor(v, requires_grad=k in xs) for k, v in feeds.items()}
    tg = torch.tensor(gy, requires_grad=True)
    g1 = torch.autograd.grad(fn(**t), [t[k] for k in xs], tg, create_graph=True)
    srcs = [t[k] for k in xs] + [tg]
    g2 = torch.autograd.grad(g1, srcs, [torch.tensor(v) for v in vs.values()], allow_unused=True)
    for name, a, b, src in zip([*xs, "gy"], got, g2, srcs):
        b = np.zeros(src.shape, F32) if b is None else b.detach().numpy()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(b).max()),
                                   err_msg=f"second-order grad of {name}")


def tconv(nsp):
    import torch.nn.functional as F
    return [F.conv1d, F.conv2d, F.conv3d][nsp - 1]


def opset_of(m):
    return next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))


# -- the spec-following reference ConvTranspose itself ---------------------------------------------
@pytest.mark.parametrize("attrs", [
    dict(group=2, strides=[2, 1], pads=[1, 0, 0, 1], output_padding=[1, 0]),
    dict(strides=[2, 2], output_shape=[9, 8]),
    dict(strides=[2, 2], output_shape=[10, 9]),
    dict(strides=[2, 3], auto_pad="SAME_UPPER", output_shape=[9, 10]),
    dict(strides=[2, 2], auto_pad="SAME_LOWER", dilations=[1, 2]),
    dict(strides=[3, 2], auto_pad="VALID", group=2),
])
def test_reference_conv_transpose_fix_matches_onnxruntime(attrs):
    ConvTranspose = next(c for c in runtime._exact_ops() if c.__name__ == "ConvTranspose")
    x, w, b = rnd((2, 4, 4, 4)), rnd((4, 3, 3, 2), 1), rnd((3 * attrs.get("group", 1),), 2)
    m = model_of("ConvTranspose", {"x": x, "w": w, "b": b}, **attrs)
    want = session(m).run(None, {"x": x, "w": w, "b": b})[0]
    got = ReferenceEvaluator(m, new_ops=[ConvTranspose]).run(None, {"x": x, "w": w, "b": b})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# -- Conv ------------------------------------------------------------------------------------------
CONV = {  # name: (x shape, w shape, bias, attrs)
    "1d": ((1, 2, 7), (3, 2, 3), True, {}),
    "1d-stride-dil-asym": ((2, 2, 9), (2, 2, 3), False, dict(strides=[2], pads=[1, 2],
                                                             dilations=[2])),
    "2d-group": ((1, 4, 5, 6), (4, 2, 3, 2), True, dict(group=2, strides=[2, 1],
                                                       pads=[1, 0, 0, 1])),
    "2d-depthwise": ((2, 3, 6, 5), (6, 1, 3, 3), True, dict(group=3, strides=[2, 2],
                                                           pads=[1, 1, 1, 1], dilations=[1, 2])),
    "2d-same-upper": ((1, 2, 6, 7), (3, 2, 3, 3), False, dict(auto_pad="SAME_UPPER",
                                                              strides=[2, 2])),
    "2d-same-lower": ((1, 2, 6, 7), (3, 2, 2, 3), True, dict(auto_pad="SAME_LOWER",
                                                             strides=[2, 3])),
    "2d-valid": ((1, 2, 7, 6), (2, 2, 3, 3), False, dict(auto_pad="VALID", strides=[2, 2])),
    "2d-stride-over-kernel": ((1, 2, 8, 7), (2, 2, 2, 2), True, dict(strides=[3, 3],
                                                                     pads=[0, 1, 0, 0])),
    "2d-pads-over-kernel": ((1, 2, 4, 4), (2, 2, 2, 2), False, dict(pads=[3, 0, 1, 2])),
    "3d": ((1, 2, 4, 5, 4), (2, 2, 2, 3, 2), True, dict(strides=[2, 1, 2],
                                                       pads=[1, 0, 0, 0, 1, 1])),
    "3d-group-dil": ((1, 4, 3, 5, 3), (4, 2, 2, 2, 2), False, dict(group=2,
                                                                  dilations=[1, 2, 1])),
}


def conv_feeds(case, seed=0):
    xs, ws, bias, attrs = CONV[case]
    feeds = {"x": rnd(xs, seed), "w": rnd(ws, seed + 1)}
    if bias:
        feeds["b"] = rnd((ws[0],), seed + 2)
    return feeds, attrs


@pytest.mark.parametrize("case", list(CONV))
def test_conv_finite_differences(case):
    feeds, attrs = conv_feeds(case)
    fd(model_of("Conv", feeds, **attrs), feeds)


@pytest.mark.parametrize("case", ["1d-stride-dil-asym", "2d-depthwise", "2d-same-upper",
                                  "2d-same-lower", "2d-stride-over-kernel", "3d"])
def test_conv_symbolic_batch_and_spatial(case):
    feeds, attrs = conv_feeds(case, seed=3)
    fd(model_of("Conv", feeds, symbolic=("batch", "spatial"), **attrs), feeds)


def test_conv_same_with_dilation():
    """onnxruntime's Conv refuses auto_pad SAME with dilations; onnx.reference computes it."""
    feeds, _ = conv_feeds("2d-same-upper")
    fd(model_of("Conv", feeds, auto_pad="SAME_UPPER", strides=[2, 1], dilations=[2, 1]), feeds,
       f32=False)


TORCH_CONV = [  # (nsp, groups, stride, padding, dilation)
    (1, 1, 2, 1, 1), (1, 2, 1, 2, 2), (2, 1, 1, 1, 1), (2, 2, 2, 1, 1), (2, 4, 2, 0, 2),
    (2, 1, 3, 2, 1), (3, 1, 2, 1, 1), (3, 2, 1, 1, 2)]


@pytest.mark.parametrize("nsp,groups,stride,padding,dilation", TORCH_CONV)
@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
def test_conv_versus_torch(nsp, groups, stride, padding, dilation, symbolic):
    d = {1: 11, 2: 9, 3: 6}[nsp]
    feeds = {"x": rnd((2, 4) + (d,) * nsp), "w": rnd((8, 4 // groups) + (3,) * nsp, 1),
             "b": rnd((8,), 2)}
    m = model_of("Conv", feeds, symbolic=symbolic, group=groups, strides=[stride] * nsp,
                 pads=[padding] * 2 * nsp, dilations=[dilation] * nsp)
    versus_torch(m, feeds, ["x", "w", "b"], lambda x, w, b: tconv(nsp)(
        x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups))


# ungrouped 1-D, 2-D and 3-D convolutions with static shapes take dW as one Gemm per kernel tap
# (up to 49 taps), or as one Gemm over the stacked tap slices when Co (K-1) > 2 K C (few input
# channels; strided 1-D and 2-D ones gather them instead, as a stem); (x shape, kernel,
# strides, pads, dilations, form), Co = 5
PER_TAP = {
    "3x3-pad": ((2, 3, 8, 7), (3, 3), [1, 1], [1, 1, 1, 1], [1, 1], "taps"),
    "stride-dil-asym": ((2, 3, 9, 8), (3, 2), [2, 3], [1, 0, 2, 1], [2, 1], "taps"),
    "stride-over-kernel": ((1, 2, 8, 7), (2, 2), [3, 3], [0, 1, 0, 0], [1, 1], "taps"),
    "pads-over-kernel": ((1, 2, 4, 4), (2, 2), [1, 1], [3, 0, 1, 2], [1, 1], "taps"),
    "1x1-stride": ((2, 4, 6, 5), (1, 1), [2, 2], [0, 0, 0, 0], [1, 1], "taps"),
    "7x7": ((1, 2, 9, 9), (7, 7), [2, 2], [3, 3, 3, 3], [1, 1], "gather"),  # strided: gathered
    "7x7-wide": ((1, 4, 9, 9), (7, 7), [2, 2], [3, 3, 3, 3], [1, 1], "taps"),
    "1d": ((2, 3, 11), (3,), [2], [2, 1], [2], "taps"),
    "1d-one-channel": ((2, 1, 11), (3,), [2], [2, 1], [2], "gather"),
    "1d-one-channel-unit": ((2, 1, 11), (3,), [1], [2, 1], [2], "stacked"),
    "first-layer": ((3, 1, 8, 7), (3, 3), [1, 1], [1, 1, 1, 1], [1, 1], "stacked"),
    "first-layer-stride-dil": ((2, 1, 9, 8), (3, 2), [2, 3], [1, 0, 2, 1], [2, 1], "gather"),
    "small-image": ((1, 4, 2, 2), (3, 3), [1, 1], [1, 1, 1, 1], [1, 1], "stacked"),  # N*O < Co
    "small-image-stride": ((1, 3, 4, 3), (3, 2), [2, 2], [1, 0, 1, 1], [1, 1], "gather"),
    "7x8-fallback": ((1, 2, 9, 10), (7, 8), [1, 1], [0, 0, 0, 0], [1, 1], "conv"),
    # strided, more than 256 output positions: the strided windows' rows gathered per tap
    "stride-2-large": ((2, 3, 34, 34), (3, 3), [2, 2], [1, 1, 1, 1], [1, 1], "batched"),
    "tiles-2x2-large": ((2, 3, 34, 34), (2, 2), [2, 2], [0, 0, 0, 0], [1, 1], "batched"),
    # windows that tile the image, on fewer: SpaceToDepth's columns
    "tiles-2x2": ((2, 3, 16, 18), (2, 2), [2, 2], [0, 0, 0, 0], [1, 1], "tiles"),
    "tiles-3x3-crop": ((1, 3, 26, 25), (3, 3), [3, 3], [0, 0, 0, 0], [1, 1], "tiles"),
    # 3-D: per tap only with unit strides on at least 256 output positions per image
    "3d-3x3x3-pad": ((1, 3, 4, 8, 8), (3, 3, 3), [1, 1, 1], [1] * 6, [1, 1, 1], "taps"),
    "3d-dil-asym": ((1, 3, 5, 9, 9), (2, 3, 2), [1, 1, 1], [0, 1, 1, 1, 0, 2], [2, 1, 1],
                    "taps"),
    "3d-first-layer": ((2, 1, 4, 8, 8), (3, 3, 3), [1, 1, 1], [1] * 6, [1, 1, 1], "stacked"),
    "3d-strided-fallback": ((1, 2, 4, 8, 8), (3, 3, 3), [1, 2, 2], [1] * 6, [1, 1, 1], "conv"),
    "3d-small-fallback": ((2, 2, 2, 4, 4), (3, 3, 3), [1, 1, 1], [1] * 6, [1, 1, 1], "conv"),
    "3d-3x7x7-fallback": ((1, 2, 3, 8, 8), (3, 7, 7), [1, 2, 2], [1, 3, 3, 1, 3, 3], [1, 1, 1],
                          "conv"),
    # 1-D and 2-D with >= 16 input channels on images of <= 256 output positions: one Gather of
    # channels-last rows and one Gemm
    "gather-3x3-pad": ((2, 16, 8, 7), (3, 3), [1, 1], [1, 1, 1, 1], [1, 1], "gather"),
    "gather-no-pad": ((2, 17, 6, 6), (3, 3), [1, 1], [0, 0, 0, 0], [1, 1], "gather"),
    "gather-stride-dil-asym": ((2, 16, 9, 8), (3, 2), [2, 3], [1, 0, 2, 1], [2, 1], "gather"),
    "gather-crop": ((1, 16, 8, 8), (3, 3), [2, 2], [0, 0, 0, 0], [1, 1], "gather"),
    "gather-pads-over-kernel": ((1, 16, 4, 4), (2, 2), [1, 1], [3, 0, 1, 2], [1, 1], "gather"),
    "gather-1x1-stride": ((2, 16, 6, 5), (1, 1), [2, 2], [0, 0, 0, 0], [1, 1], "gather"),
    "gather-1d": ((2, 16, 11), (3,), [2], [2, 1], [2], "gather"),
    "1x1-whole": ((2, 16, 6, 5), (1, 1), [1, 1], [0, 0, 0, 0], [1, 1], "taps"),
    # 1-D and 2-D on images of > 256 output positions: per tap, one batched MatMul over the
    # images of g and the tap's (strided) rows gathered from the channels-last image
    "batched-3x3-pad": ((1, 16, 17, 16), (3, 3), [1, 1], [1, 1, 1, 1], [1, 1], "batched"),
    "batched-dil-asym": ((2, 3, 18, 17), (2, 3), [1, 1], [0, 2, 1, 0], [2, 1], "batched"),
    "batched-1d": ((2, 4, 300), (3,), [1], [1, 2], [1], "batched"),
    "batched-stride": ((1, 16, 36, 34), (3, 3), [2, 2], [1, 1, 1, 1], [1, 1], "batched"),
    "batched-stride-1d-dil": ((2, 4, 700), (3,), [2], [1, 0], [2], "batched"),
    "3d-taps-not-gather": ((1, 16, 4, 8, 8), (3, 3, 3), [1, 1, 1], [1] * 6, [1, 1, 1], "taps"),
}


@pytest.mark.parametrize("case", list(PER_TAP))
def test_conv_weight_gradient_per_tap_versus_torch(case):
    """The per-tap weight gradient (strided slices of the padded input, one Gemm each, or one
    Gemm of them all stacked) against torch autograd, and by finite differences; kernels over
    49 taps keep the Conv form."""
    import torch.nn.functional as F
    xs, k, s, p, d, form = PER_TAP[case]
    nsp = len(k)
    feeds = {"x": rnd(xs), "w": rnd((5, xs[1], *k), 1), "b": rnd((5,), 2)}
    m = model_of("Conv", feeds, strides=s, pads=p, dilations=d)
    res = onnxgrad.gradients(m, "y", ["w"])
    ops = [n.op_type for n in res.model.graph.node]
    assert ops.count("Gemm") == {"taps": int(np.prod(k)), "stacked": 1, "gather": 1,
                                 "conv": 0, "batched": 0, "tiles": 1}[form]
    assert ("SpaceToDepth" in ops) == (form == "tiles")
    if form == "tiles":  # no strided Slice; one that crops what no window reads
        assert ops.count("Slice") == int(any(n % ki for n, ki in zip(xs[2:], k)))
    assert ops.count("Gather") == {"gather": 1, "batched": int(np.prod(k))}.get(form, 0)
    assert ops.count("MatMul") == (int(np.prod(k)) if form == "batched" else 0)
    torch_pad = [v for i in reversed(range(nsp)) for v in (p[i], p[nsp + i])]
    versus_torch(m, feeds, ["x", "w", "b"], lambda x, w, b: tconv(nsp)(
        F.pad(x, torch_pad), w, b, stride=s, dilation=d))
    fd(m, feeds)


@st.composite
def conv_geometries(draw):
    """An ungrouped 1-D or 2-D Conv whose static geometry picks any of the dW forms (per tap,
    stacked, gathered, the Conv form): channel counts on both sides of the gathered form's
    16, images on both sides of its 256 output positions, pads that reach past the kernel,
    strides above it, and inputs whose last elements no window reads."""
    nsp = draw(st.integers(1, 2))
    k = [draw(st.integers(1, 4)) for _ in range(nsp)]
    s = [draw(st.integers(1, 3)) for _ in range(nsp)]
    d = [draw(st.integers(1, 2)) for _ in range(nsp)]
    p = [draw(st.integers(0, 4)) for _ in range(2 * nsp)]
    big = draw(st.booleans())
    dims = []
    for j in range(nsp):
        ek = d[j] * (k[j] - 1) + 1
        lo = max(1, ek - p[j] - p[nsp + j])  # at least one window
        dims.append(draw(st.integers(lo, lo + (18 if big and nsp == 2 else 40 if big else 6))))
    c = draw(st.integers(16, 20) if draw(st.booleans()) else st.integers(1, 15))
    co = draw(st.integers(1, 24))
    n = draw(st.integers(1, 3))
    return (n, c, *dims), (co, c, *k), s, p, d, draw(st.booleans())


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(geo=conv_geometries(), seed=st.integers(0, 2**16))
def test_conv_weight_gradient_forms_versus_torch_generated(geo, seed):
    """Every dW form (chosen from the geometry alone) against torch autograd, with a symbolic
    batch half the time."""
    import torch.nn.functional as F
    xs, ws, s, p, d, symbolic = geo
    nsp = len(s)
    feeds = {"x": rnd(xs, seed), "w": rnd(ws, seed + 1)}
    m = model_of("Conv", feeds, symbolic=("batch",) if symbolic else (), strides=s, pads=p,
                 dilations=d)
    torch_pad = [v for i in reversed(range(nsp)) for v in (p[i], p[nsp + i])]
    versus_torch(m, feeds, ["x", "w"], lambda x, w: tconv(nsp)(
        F.pad(x, torch_pad), w, stride=s, dilation=d), seed=seed + 2)


@st.composite
def strided_geometries(draw):
    """A strided Conv on images of more than 256 output positions (1-D or 2-D: kernel, stride,
    dilation, pads, unread last elements), or a ConvTranspose whose windows tile its output."""
    op = draw(st.sampled_from(["Conv", "Conv", "ConvTranspose"]))
    nsp = 2 if op == "ConvTranspose" else draw(st.integers(1, 2))
    c, co, n = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.integers(1, 2))
    if op == "ConvTranspose":
        k = draw(st.integers(2, 4))
        return op, (n, c, *[draw(st.integers(15, 20)) for _ in range(2)]), (c, co, k, k), \
            {"strides": [k, k]}
    k = [draw(st.integers(1, 4)) for _ in range(nsp)]
    s = [draw(st.integers(2, 3)) for _ in range(nsp)]
    d = [draw(st.integers(1, 2)) for _ in range(nsp)]
    p = [draw(st.integers(0, 2)) for _ in range(2 * nsp)]
    o = [draw(st.integers(260, 300))] if nsp == 1 else [draw(st.integers(17, 20)) for _ in k]
    dims = [s[j] * (o[j] - 1) + d[j] * (k[j] - 1) + 1 - p[j] - p[nsp + j] +
            draw(st.integers(0, s[j] - 1)) for j in range(nsp)]
    return op, (n, c, *dims), (co, c, *k), {"strides": s, "dilations": d, "pads": p}


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(geo=strided_geometries(), symbolic=st.booleans(), seed=st.integers(0, 2**16))
def test_strided_weight_gradient_forms_versus_torch_generated(geo, symbolic, seed):
    """Strided windows on large images take dW from Gathers of the strided window's rows (or,
    for windows that tile the image, SpaceToDepth's columns), never from strided Slices (which
    onnxruntime runs on one thread), against torch autograd, a symbolic batch half the time."""
    import torch.nn.functional as F
    op, xs, ws, attrs = geo
    feeds = {"x": rnd(xs, seed), "w": rnd(ws, seed + 1)}
    m = model_of(op, feeds, symbolic=("batch",) if symbolic else (), **attrs)
    nodes = onnxgrad.gradients(m, "y", ["w"]).model.graph.node
    assert not any(nd.op_type == "Slice" and len(nd.input) == 5 for nd in nodes)
    if op == "ConvTranspose":
        k = attrs["strides"][0]
        fn = lambda x, w: F.conv_transpose2d(x, w, stride=k)  # noqa: E731
    else:
        nsp, p = len(xs) - 2, attrs["pads"]
        pad = [v for i in reversed(range(nsp)) for v in (p[i], p[nsp + i])]
        fn = lambda x, w: tconv(nsp)(F.pad(x, pad), w, stride=attrs["strides"],  # noqa: E731
                                     dilation=attrs["dilations"])
    versus_torch(m, feeds, ["x", "w"], fn, seed=seed + 2)


def test_conv_stacked_taps_inception_stem_versus_torch():
    """inception_v1's (and ResNet's) stem at full size: 7x7, stride 2, pads 3, 3 -> 64 channels
    on 224x224 takes the stacked-tap dW; float32 against torch in float64 (measured 5e-7
    relative; the 7.7e-3 the model-zoo oracle once saw came from a MaxPool near-tie)."""
    torch = pytest.importorskip("torch")
    feeds = {"x": rnd((1, 3, 224, 224)), "w": rnd((64, 3, 7, 7), 1)}
    m = model_of("Conv", feeds, strides=[2, 2], pads=[3, 3, 3, 3])
    res = onnxgrad.gradients(m, "y", ["x", "w"], grad_ys=["cot"])
    assert sum(n.op_type == "Gemm" for n in res.model.graph.node) == 1
    cot = rnd((1, 64, 112, 112), 2)
    got = session(res.model).run(res.grads, {**feeds, "cot": cot})
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in feeds.items()}
    y = torch.nn.functional.conv2d(t["x"], t["w"], stride=2, padding=3)
    want = torch.autograd.grad(y, [t["x"], t["w"]], torch.tensor(cot, dtype=torch.float64))
    for name, a, b in zip("xw", got, want):
        b = b.numpy()
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), name


# Conv's dx on small images (<= 64 output positions) in float32 is one Gemm over all images and
# a Col2Im; (x shape, w shape, strides, pads, dilations)
COLS = {
    "3x3-pad": ((3, 4, 4, 4), (5, 4, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1]),
    "stride2": ((2, 3, 7, 6), (4, 3, 3, 3), [2, 2], [1, 1, 1, 1], [1, 1]),
    "cropped-end": ((2, 3, 8, 7), (4, 3, 2, 3), [3, 2], [0, 1, 0, 0], [1, 1]),
    "dilated-asym": ((2, 2, 6, 5), (3, 2, 2, 3), [1, 2], [1, 0, 2, 1], [2, 1]),
    "1x1-stride2": ((2, 6, 4, 4), (5, 6, 1, 1), [2, 2], [0, 0, 0, 0], [1, 1]),
}


@pytest.mark.parametrize("case", list(COLS))
@pytest.mark.parametrize("symbolic", [(), ("batch",)])
def test_conv_dx_by_cols_versus_torch(case, symbolic):
    import torch.nn.functional as F
    xs, ws, s, p, d = COLS[case]
    feeds = {"x": rnd(xs), "w": rnd(ws, 1), "b": rnd((ws[0],), 2)}
    m = model_of("Conv", feeds, symbolic=symbolic, strides=s, pads=p, dilations=d)
    res = onnxgrad.gradients(m, "y", ["x"])
    assert sum(n.op_type == "Col2Im" for n in res.model.graph.node) == 1
    torch_pad = [p[1], p[3], p[0], p[2]]
    versus_torch(m, feeds, ["x", "w", "b"], lambda x, w, b: F.conv2d(
        F.pad(x, torch_pad), w, b, stride=s, dilation=d))


@pytest.mark.parametrize("xs, s, cols", [((2, 4, 8, 8), [1, 1], False), ((2, 4, 7, 9), [1, 1], True),
                                         ((2, 4, 16, 16), [2, 2], True)])
def test_conv_dx_form_at_the_blocked_conv_boundary(xs, s, cols):
    """Unit strides on images of 64 output positions or more take the flipped Conv (the
    Trainer runs it in onnxruntime's blocked layout, faster there); fewer positions (7x9), or
    strides (16x16 / 2: 8x8 outputs), the columns and Col2Im; against torch and finite
    differences."""
    import torch.nn.functional as F
    feeds = {"x": rnd(xs), "w": rnd((5, 4, 3, 3), 1), "b": rnd((5,), 2)}
    m = model_of("Conv", feeds, strides=s, pads=[1, 1, 1, 1])
    res = onnxgrad.gradients(m, "y", ["x"])
    assert sum(n.op_type == "Col2Im" for n in res.model.graph.node) == int(cols)
    versus_torch(m, feeds, ["x", "w", "b"], lambda x, w, b: F.conv2d(x, w, b, stride=s,
                                                                     padding=1))
    fd(m, feeds)


def test_conv_dx_by_cols_second_order_versus_torch():
    import torch.nn.functional as F
    xs, ws, s, p, d = COLS["dilated-asym"]
    feeds = {"x": rnd(xs), "w": rnd(ws, 1)}
    m = model_of("Conv", feeds, symbolic=("batch",), strides=s, pads=p, dilations=d)
    second_order_versus_torch(m, feeds, ["x", "w"], lambda x, w: F.conv2d(
        F.pad(x, [p[1], p[3], p[0], p[2]]), w, stride=s, dilation=d))


@pytest.mark.parametrize("w_shape,gemms", [((3, 4, 3, 2), 6), ((6, 1, 3, 2), 1)])
def test_conv_transpose_weight_gradient_per_tap(w_shape, gemms):
    """ConvTranspose's dW takes the same per-tap or stacked form (g is the long side)."""
    import torch.nn.functional as F
    feeds = {"x": rnd((2, w_shape[0], 4, 5)), "w": rnd(w_shape, 1)}
    m = model_of("ConvTranspose", feeds, strides=[2, 1], pads=[1, 0, 0, 1], dilations=[1, 2],
                 output_padding=[1, 0])
    res = onnxgrad.gradients(m, "y", ["w"])
    assert sum(n.op_type == "Gemm" for n in res.model.graph.node) == gemms
    versus_torch(m, feeds, ["x", "w"], lambda x, w: F.conv_transpose2d(
        x, w, stride=(2, 1), padding=0, output_padding=(1, 0), dilation=(1, 2))[..., 1:, :-1])
    fd(m, feeds)


def test_conv_transpose_tiles_weight_gradient():
    """A 2x2 / 2 ConvTranspose (a U-Net's upsampling): its output is tiled by the windows, so
    dW is one Gemm over SpaceToDepth's columns of g, no strided Slice."""
    import torch.nn.functional as F
    feeds = {"x": rnd((2, 3, 16, 17)), "w": rnd((3, 4, 2, 2), 1), "b": rnd((4,), 2)}
    m = model_of("ConvTranspose", feeds, strides=[2, 2])
    ops = [n.op_type for n in onnxgrad.gradients(m, "y", ["w"]).model.graph.node]
    assert "SpaceToDepth" in ops and "Slice" not in ops and ops.count("Gemm") == 1
    versus_torch(m, feeds, ["x", "w", "b"], lambda x, w, b: F.conv_transpose2d(
        x, w, b, stride=2))
    fd(m, feeds)
    second_order_versus_torch(m, feeds, ["x", "w", "b"], lambda x, w, b: F.conv_transpose2d(
        x, w, b, stride=2))


def test_conv_transpose_3d_weight_gradient_per_tap():
    """A 3-D ConvTranspose's dW: one Gemm per tap too (unit strides, x of 256 positions)."""
    import torch.nn.functional as F
    feeds = {"x": rnd((1, 3, 4, 8, 8)), "w": rnd((3, 2, 2, 3, 2), 1)}
    m = model_of("ConvTranspose", feeds, pads=[1, 0, 0, 0, 1, 1])
    res = onnxgrad.gradients(m, "y", ["w"])
    assert sum(n.op_type == "Gemm" for n in res.model.graph.node) == 12
    versus_torch(m, feeds, ["x", "w"], lambda x, w: F.conv_transpose3d(
        x, w)[..., 1:, :-1, :-1])
    fd(m, feeds)


@pytest.mark.parametrize("c", [3, 1, 16])  # per tap; stacked; gathered
def test_conv_per_tap_second_order_versus_torch(c):
    feeds = {"x": rnd((2, c, 7, 6)), "w": rnd((4, c, 3, 2), 1), "b": rnd((4,), 2)}
    m = model_of("Conv", feeds, strides=[2, 1], pads=[1, 1, 0, 1], dilations=[1, 2])
    import torch.nn.functional as F
    second_order_versus_torch(m, feeds, ["x", "w", "b"], lambda x, w, b: F.conv2d(
        F.pad(x, (1, 1, 1, 0)), w, b, stride=(2, 1), dilation=(1, 2)))


# depthwise convolutions with unit strides on images of >= 256 output positions take dW per
# tap as Mul + ReduceSum per channel, the others the Conv form; (x shape, kernel, strides, pads,
# dilations, output channels, ReduceSums)
DEPTHWISE = {
    "3x3": ((2, 4, 16, 16), (3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 4, 9),
    "dilated-asym": ((1, 3, 18, 17), (3, 2), [1, 1], [1, 0, 2, 1], [2, 1], 3, 6),
    "1d": ((2, 3, 300), (5,), [1], [2, 2], [1], 3, 5),
    "strided-fallback": ((2, 4, 32, 32), (3, 3), [2, 2], [1, 1, 1, 1], [1, 1], 4, 0),
    "small-fallback": ((2, 4, 8, 8), (3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 4, 0),
    "multiplier-2-fallback": ((1, 3, 16, 16), (3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 6, 0),
}


@pytest.mark.parametrize("case", list(DEPTHWISE))
def test_depthwise_weight_gradient_versus_torch(case):
    xs, k, s, p, d, co, sums = DEPTHWISE[case]
    nsp, c = len(k), xs[1]
    feeds = {"x": rnd(xs), "w": rnd((co, 1, *k), 1)}
    m = model_of("Conv", feeds, group=c, strides=s, pads=p, dilations=d)
    res = onnxgrad.gradients(m, "y", ["w"])
    assert sum(n.op_type == "ReduceSum" for n in res.model.graph.node) == sums
    torch_pad = [v for i in reversed(range(nsp)) for v in (p[i], p[nsp + i])]
    import torch.nn.functional as F
    versus_torch(m, feeds, ["x", "w"], lambda x, w: tconv(nsp)(
        F.pad(x, torch_pad), w, stride=s, dilation=d, groups=c))
    fd(m, feeds)


def test_depthwise_per_tap_second_order_versus_torch():
    import torch.nn.functional as F
    feeds = {"x": rnd((1, 3, 16, 16)), "w": rnd((3, 1, 3, 3), 1)}
    m = model_of("Conv", feeds, group=3, pads=[1] * 4)
    second_order_versus_torch(m, feeds, ["x", "w"], lambda x, w: F.conv2d(
        x, w, padding=1, groups=3))


def test_conv_3d_per_tap_second_order_versus_torch():
    """The 3-D per-tap dW (unit strides, 256 output positions) differentiated again."""
    import torch.nn.functional as F
    feeds = {"x": rnd((1, 3, 4, 8, 8)), "w": rnd((4, 3, 3, 3, 3), 1)}
    m = model_of("Conv", feeds, pads=[1] * 6)
    assert sum(n.op_type == "Gemm"
               for n in onnxgrad.gradients(m, "y", ["w"]).model.graph.node) == 27
    second_order_versus_torch(m, feeds, ["x", "w"], lambda x, w: F.conv3d(x, w, padding=1))


@pytest.mark.parametrize("wide", [False, True])  # True: 16 channels, the gathered dW
def test_conv_float16_matches_float32(wide):
    feeds, attrs = conv_feeds("2d-group")
    if wide:
        feeds = {"x": rnd((2, 16, 6, 6)) * 0.25, "w": rnd((4, 16, 3, 3), 1) * 0.25}
        attrs = dict(pads=[1, 1, 1, 1])
    grads = []
    for dt in (np.float16, np.float32):
        f = {k: v.astype(dt) for k, v in feeds.items()}
        m = model_of("Conv", f, **attrs)
        res = onnxgrad.gradients(m, "y", list(f))
        assert wide == any(n.op_type == "Gather" for n in res.model.graph.node)
        grads.append(session(res.model).run(res.grads, f))
    for a, b in zip(*grads):
        assert a.dtype == np.float16
        np.testing.assert_allclose(a.astype(F32), b, rtol=2e-2, atol=2e-2)


def test_conv_opset13_model_stays_opset13():
    feeds, attrs = conv_feeds("2d-depthwise")
    m = model_of("Conv", feeds, symbolic=("batch", "spatial"), opset=13, **attrs)
    res = onnxgrad.gradients(m, "y", list(feeds))
    assert opset_of(res.model) == 13
    fd(m, feeds)


def test_conv_second_order_versus_torch():
    feeds = {"x": rnd((2, 4, 7, 6)), "w": rnd((6, 2, 3, 3), 1), "b": rnd((6,), 2)}
    m = model_of("Conv", feeds, symbolic=("batch",), group=2, strides=[2, 1], pads=[1, 1, 0, 1])
    import torch.nn.functional as F
    second_order_versus_torch(m, feeds, ["x", "w", "b"], lambda x, w, b: F.conv2d(
        F.pad(x, (1, 1, 1, 0)), w, b, stride=(2, 1), groups=2))


def test_conv_second_order_symbolic_same():
    """Symbolic spatial dims with SAME: the first-order graph pads and slices at run time."""
    feeds = {"x": rnd((1, 2, 7, 6)), "w": rnd((3, 2, 3, 3), 1)}
    m = model_of("Conv", feeds, symbolic=("batch", "spatial"), auto_pad="SAME_UPPER",
                 strides=[2, 2])
    import torch.nn.functional as F

    def same(x, w):  # SAME_UPPER for 7x6, k3, s2: total pads 2 and 1 -> (1, 1) and (0, 1)
        return F.conv2d(F.pad(x, (0, 1, 1, 1)), w, stride=2)
    second_order_versus_torch(m, feeds, ["x", "w"], same)


# -- ConvTranspose ---------------------------------------------------------------------------------
CONVT = {  # name: (x shape, w shape, bias, attrs)
    "1d": ((1, 2, 5), (2, 3, 3), True, dict(strides=[2], pads=[1, 0])),
    "2d-group-outpad": ((1, 4, 3, 4), (4, 1, 3, 2), True, dict(group=2, strides=[2, 3],
                                                              output_padding=[1, 2],
                                                              pads=[1, 0, 0, 1])),
    "2d-dil": ((2, 2, 3, 3), (2, 2, 2, 3), False, dict(dilations=[2, 1], strides=[1, 2],
                                                      pads=[0, 1, 1, 1])),
    "2d-same-upper": ((1, 2, 3, 4), (2, 2, 3, 3), False, dict(auto_pad="SAME_UPPER",
                                                              strides=[2, 2])),
    "2d-same-lower": ((1, 2, 4, 3), (2, 3, 2, 3), True, dict(auto_pad="SAME_LOWER",
                                                             strides=[2, 1])),
    "2d-output-shape": ((1, 2, 3, 3), (2, 2, 3, 3), False, dict(strides=[2, 2],
                                                                output_shape=[6, 7])),
    "2d-output-shape-beyond": ((1, 2, 3, 3), (2, 2, 3, 3), True, dict(strides=[2, 2],
                                                                      output_shape=[8, 8])),
    "2d-output-shape-same": ((1, 2, 3, 3), (2, 2, 3, 3), False, dict(
        strides=[2, 2], output_shape=[5, 6], auto_pad="SAME_UPPER")),
    "2d-valid": ((1, 2, 3, 3), (2, 2, 2, 2), False, dict(auto_pad="VALID", strides=[3, 2])),
    "3d": ((1, 2, 2, 3, 2), (2, 2, 2, 2, 3), True, dict(strides=[2, 1, 2],
                                                       pads=[0, 1, 1, 1, 0, 0])),
}


def convt_feeds(case, seed=0):
    xs, ws, bias, attrs = CONVT[case]
    feeds = {"x": rnd(xs, seed), "w": rnd(ws, seed + 1)}
    if bias:
        feeds["b"] = rnd((ws[1] * attrs.get("group", 1),), seed + 2)
    return feeds, attrs


@pytest.mark.parametrize("case", list(CONVT))
def test_conv_transpose_finite_differences(case):
    feeds, attrs = convt_feeds(case)
    fd(model_of("ConvTranspose", feeds, **attrs), feeds)


@pytest.mark.parametrize("case", ["2d-group-outpad", "2d-same-lower", "2d-output-shape",
                                  "2d-output-shape-beyond"])
def test_conv_transpose_symbolic(case):
    feeds, attrs = convt_feeds(case, seed=4)
    symbolic = ("batch",) if "output_shape" in attrs else ("batch", "spatial")
    fd(model_of("ConvTranspose", feeds, symbolic=symbolic, **attrs), feeds)


def test_conv_transpose_output_shape_symbolic_spatial():
    """output_shape with a symbolic input size: the pads come from run-time shapes."""
    feeds, attrs = convt_feeds("2d-output-shape")
    m = model_of("ConvTranspose", feeds, symbolic=("spatial",), **attrs)
    fd(m, feeds)


@pytest.mark.parametrize("groups,stride,padding,out_pad,dilation", [
    (1, 2, 1, 1, 1), (2, 2, 0, 0, 2), (4, 3, 1, 2, 1), (1, 1, 2, 0, 1)])
def test_conv_transpose_versus_torch(groups, stride, padding, out_pad, dilation):
    import torch.nn.functional as F
    feeds = {"x": rnd((2, 4, 5, 4)), "w": rnd((4, 8 // groups, 3, 3), 1), "b": rnd((8,), 2)}
    m = model_of("ConvTranspose", feeds, symbolic=("batch", "spatial"), group=groups,
                 strides=[stride] * 2, pads=[padding] * 4, output_padding=[out_pad] * 2,
                 dilations=[dilation] * 2)
    versus_torch(m, feeds, ["x", "w", "b"], lambda x, w, b: F.conv_transpose2d(
        x, w, b, stride=stride, padding=padding, output_padding=out_pad, groups=groups,
        dilation=dilation))


def test_conv_transpose_second_order_versus_torch():
    import torch.nn.functional as F
    feeds = {"x": rnd((2, 4, 4, 3)), "w": rnd((4, 3, 3, 2), 1), "b": rnd((6,), 2)}
    m = model_of("ConvTranspose", feeds, symbolic=("batch",), group=2, strides=[2, 2],
                 pads=[1, 0, 1, 0], output_padding=[1, 1])
    second_order_versus_torch(m, feeds, ["x", "w", "b"], lambda x, w, b: F.conv_transpose2d(
        x, w, b, stride=2, padding=(1, 0), output_padding=1, groups=2))


# -- AveragePool -----------------------------------------------------------------------------------
AVG = {  # name: (x shape, attrs)
    "2x2": ((1, 2, 6, 6), dict(kernel_shape=[2, 2], strides=[2, 2])),
    "pads-excl": ((1, 2, 5, 6), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 0])),
    "pads-incl": ((1, 2, 5, 6), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 1],
                                     count_include_pad=1)),
    "ceil-excl": ((1, 2, 6, 5), dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 0],
                                     ceil_mode=1)),
    "ceil-incl": ((1, 2, 6, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                                     ceil_mode=1, count_include_pad=1)),
    "dilations": ((1, 2, 7, 6), dict(kernel_shape=[2, 3], dilations=[2, 1], strides=[1, 2],
                                     pads=[1, 1, 0, 1])),
    "same-upper": ((1, 2, 5, 6), dict(kernel_shape=[3, 2], strides=[2, 2],
                                      auto_pad="SAME_UPPER")),
    "same-upper-incl": ((1, 2, 5, 6), dict(kernel_shape=[3, 3], strides=[2, 2],
                                           auto_pad="SAME_UPPER", count_include_pad=1)),
    "same-lower": ((1, 2, 7, 6), dict(kernel_shape=[3, 3], strides=[2, 2],
                                      auto_pad="SAME_LOWER")),
    "1d": ((2, 2, 9), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    "3d": ((1, 1, 5, 5, 3), dict(kernel_shape=[2, 3, 2], strides=[2, 1, 1], pads=[0, 1, 0, 1, 1, 0],
                                 ceil_mode=1)),
}


@pytest.mark.parametrize("case", list(AVG))
@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
def test_average_pool_finite_differences(case, symbolic):
    shape, attrs = AVG[case]
    feeds = {"x": rnd(shape)}
    fd(model_of("AveragePool", feeds, symbolic=symbolic, opset=19, **attrs), feeds)


@pytest.mark.parametrize("kernel,stride,padding,ceil,incl", [
    (2, 2, 0, False, True), (3, 2, 1, False, True), (3, 2, 1, False, False),
    (3, 2, 1, True, True), (3, 2, 1, True, False), (2, 3, 1, True, False)])
@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
def test_average_pool_versus_torch(kernel, stride, padding, ceil, incl, symbolic):
    import torch.nn.functional as F
    feeds = {"x": rnd((2, 3, 9, 12))}  # no ceil_mode window starts in the end padding
    m = model_of("AveragePool", feeds, symbolic=symbolic, kernel_shape=[kernel] * 2,
                 strides=[stride] * 2, pads=[padding] * 4, ceil_mode=int(ceil),
                 count_include_pad=int(incl))
    versus_torch(m, feeds, ["x"], lambda x: F.avg_pool2d(x, kernel, stride, padding, ceil, incl))


# -- LpPool and the global pools -------------------------------------------------------------------
LP = {
    "p2": ((1, 2, 5, 6), dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1], p=2)),
    "p1": ((1, 2, 5, 5), dict(kernel_shape=[2, 2], strides=[1, 2], p=1)),
    "p3-dil": ((1, 2, 6, 5), dict(kernel_shape=[2, 2], dilations=[2, 1], p=3)),
    "1d": ((2, 2, 7), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
}


@pytest.mark.parametrize("case", list(LP))
@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
def test_lp_pool_finite_differences(case, symbolic):
    shape, attrs = LP[case]
    feeds = {"x": rnd(shape)}
    fd(model_of("LpPool", feeds, symbolic=symbolic, **attrs), feeds)


def test_lp_pool_ceil_mode():
    """onnx.reference's LpPool ignores the clipped last window with ceil_mode: float32 on ORT."""
    feeds = {"x": rnd((1, 2, 7, 6))}
    m = model_of("LpPool", feeds, kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1, p=2)
    fd(m, feeds, dtype="float32")


def test_lp_pool_versus_torch():
    import torch.nn.functional as F
    feeds = {"x": rnd((2, 3, 8, 7))}
    m = model_of("LpPool", feeds, symbolic=("batch", "spatial"), kernel_shape=[3, 2],
                 strides=[2, 2], p=2)
    versus_torch(m, feeds, ["x"], lambda x: F.lp_pool2d(x, 2, (3, 2), (2, 2)))


def test_lp_pool_zero_window_has_finite_gradient():
    x = rnd((1, 1, 4, 4))
    x[..., :2, :2] = 0
    m = model_of("LpPool", {"x": x}, kernel_shape=[2, 2], strides=[2, 2], p=2)
    res = onnxgrad.gradients(m, "y", "x")
    (g,) = session(res.model).run(res.grads, {"x": x})
    assert np.isfinite(g).all() and (g[..., :2, :2] == 0).all()


@pytest.mark.parametrize("op,attrs", [("GlobalAveragePool", {}), ("GlobalMaxPool", {}),
                                      ("GlobalLpPool", {"p": 3}), ("GlobalLpPool", {})])
@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
def test_global_pools_finite_differences(op, attrs, symbolic):
    feeds = {"x": rnd((2, 3, 4, 3))}
    # GlobalLpPool has neither a float64 kernel in onnxruntime nor one in onnx.reference
    kw = {"dtype": "float32"} if op == "GlobalLpPool" else {}
    fd(model_of(op, feeds, symbolic=symbolic, **attrs), feeds, **kw)


def test_global_pools_versus_torch():
    feeds = {"x": rnd((2, 3, 5, 4))}
    for symbolic in [("batch", "spatial"), ("batch",)]:  # static spatial dims: an outer product
        versus_torch(model_of("GlobalAveragePool", feeds, symbolic=symbolic), feeds,
                     ["x"], lambda x: x.mean((2, 3), keepdim=True))
    second_order_versus_torch(model_of("GlobalAveragePool", feeds, symbolic=("batch",)), feeds,
                              ["x"], lambda x: x.mean((2, 3), keepdim=True))
    versus_torch(model_of("GlobalMaxPool", feeds, symbolic=("batch", "spatial")), feeds,
                 ["x"], lambda x: x.amax((2, 3), keepdim=True))
    versus_torch(model_of("GlobalLpPool", feeds, symbolic=("batch", "spatial")), feeds,
                 ["x"], lambda x: x.norm(dim=(2, 3), keepdim=True))


def test_global_max_pool_splits_ties():
    x = np.array([[[[1.0, 3.0], [3.0, 2.0]], [[5.0, 0.0], [1.0, 1.0]]]], F32)
    m = model_of("GlobalMaxPool", {"x": x})
    res = onnxgrad.gradients(m, "y", "x")
    (g,) = session(res.model).run(res.grads, {"x": x})
    np.testing.assert_array_equal(g, [[[[0, 0.5], [0.5, 0]], [[1, 0], [0, 0]]]])


# -- MaxPool ---------------------------------------------------------------------------------------
MAX = {  # name: (x shape, attrs)
    "2x2": ((2, 2, 6, 6), dict(kernel_shape=[2, 2], strides=[2, 2])),
    "overlap-pads": ((1, 2, 7, 6), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 0])),
    "dilations": ((1, 2, 7, 7), dict(kernel_shape=[2, 2], dilations=[2, 2], strides=[1, 2],
                                     pads=[1, 0, 0, 1])),
    "ceil": ((1, 2, 7, 6), dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 0],
                                ceil_mode=1)),
    "same-upper": ((1, 2, 7, 6), dict(kernel_shape=[3, 3], strides=[2, 2],
                                      auto_pad="SAME_UPPER")),
    "same-lower": ((1, 2, 7, 6), dict(kernel_shape=[3, 3], strides=[2, 2],
                                      auto_pad="SAME_LOWER")),
    "1d": ((2, 3, 9), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    "3d": ((1, 2, 4, 5, 4), dict(kernel_shape=[2, 3, 2], strides=[2, 2, 1])),
    # onnx's test_maxpool_3d_dilations configuration (its input has tied maxima)
    "3d-dilations": ((1, 1, 4, 4, 4), dict(kernel_shape=[2, 2, 2], dilations=[2, 2, 2])),
}


@pytest.mark.parametrize("case", list(MAX))
@pytest.mark.parametrize("indices", [False, True])
@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
def test_max_pool_finite_differences(case, indices, symbolic):
    shape, attrs = MAX[case]
    feeds = {"x": rnd(shape)}
    m = model_of("MaxPool", feeds, symbolic=symbolic, n_out=2 if indices else 1, **attrs)
    fd(m, feeds, ys="y0" if indices else "y")


@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
@pytest.mark.parametrize("shape,kernel", [((2, 2, 5, 4), [2, 3]), ((1, 2, 3, 4, 5), [2, 2, 3])])
@pytest.mark.parametrize("n_out", [1, 2])
def test_max_pool_storage_order_column_major(symbolic, shape, kernel, n_out):
    feeds = {"x": rnd(shape)}
    nsp = len(shape) - 2
    m = model_of("MaxPool", feeds, symbolic=symbolic, n_out=n_out, kernel_shape=kernel,
                 strides=[1] * nsp, storage_order=1)
    y = "y0" if n_out == 2 else "y"
    fd(m, feeds, ys=y)
    res = onnxgrad.gradients(m, y, "x")  # the forward's indices are reused when it has them
    assert sum(nd.op_type == "MaxPool" for nd in res.model.graph.node) == 3 - n_out


def test_max_pool_reuses_indices_and_keeps_opset():
    feeds = {"x": rnd((1, 2, 6, 6))}
    m = model_of("MaxPool", feeds, opset=13, n_out=2, kernel_shape=[2, 2], strides=[2, 2])
    res = onnxgrad.gradients(m, "y0", "x")
    assert sum(nd.op_type == "MaxPool" for nd in res.model.graph.node) == 1
    assert opset_of(res.model) == 13  # windows do not overlap: no reduction="add" needed
    m = model_of("MaxPool", feeds, opset=13, kernel_shape=[3, 3], strides=[2, 2])
    res = onnxgrad.gradients(m, "y", "x")
    assert opset_of(res.model) == 16  # overlapping windows: ScatterElements(reduction="add")
    fd(m, feeds)


@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil", [
    (2, 2, 0, 1, False), (3, 2, 1, 1, False), (3, 1, 1, 2, False), (3, 2, 1, 1, True),
    (2, 1, 0, 1, False)])
@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
def test_max_pool_versus_torch(kernel, stride, padding, dilation, ceil, symbolic):
    import torch.nn.functional as F
    feeds = {"x": rnd((2, 3, 9, 12))}
    m = model_of("MaxPool", feeds, symbolic=symbolic, kernel_shape=[kernel] * 2,
                 strides=[stride] * 2, pads=[padding] * 4, dilations=[dilation] * 2,
                 ceil_mode=int(ceil))
    versus_torch(m, feeds, ["x"], lambda x: F.max_pool2d(x, kernel, stride, padding, dilation,
                                                         ceil))


@pytest.mark.parametrize("outputs", [["y"], ["y", "i"]])
def test_max_pool_second_order_versus_torch(outputs):
    import torch.nn.functional as F
    feeds = {"x": rnd((2, 2, 7, 6))}
    m = make_model([helper.make_node("MaxPool", ["x"], outputs, kernel_shape=[3, 3],
                                     strides=[2, 2], pads=[1, 1, 1, 1])],
                   {"x": (F32, ["N", "C", "H", "W"])}, outputs)
    second_order_versus_torch(m, feeds, ["x"], lambda x: F.max_pool2d(x, 3, 2, 1))


@pytest.mark.parametrize("symbolic", [(), ("batch",), ("batch", "spatial")])
def test_max_pool_tiles_second_order_versus_torch(symbolic):
    import torch.nn.functional as F
    feeds = {"x": rnd((2, 2, 7, 6))}  # the last row is in no tile
    m = model_of("MaxPool", feeds, symbolic=symbolic, kernel_shape=[2, 2], strides=[2, 2])
    second_order_versus_torch(m, feeds, ["x"], lambda x: F.max_pool2d(x, 2))


def _tiles_and_indices_grads(x, k, symbolic, dtype=F32, opset=18, form=None):
    """dx of MaxPool k x k / stride k without Indices (the tiles form) and with them, and the
    cotangent: the two must agree bit for bit, ties included. ``form``: the op that the tiles
    form must put the tiles back with (Col2Im or DepthToSpace)."""
    feeds = {"x": x.astype(dtype)}
    cot = None
    out = []
    for n_out in (1, 2):
        m = model_of("MaxPool", feeds, symbolic=symbolic, opset=opset, n_out=n_out,
                     kernel_shape=[k, k], strides=[k, k])
        y = "y" if n_out == 1 else "y0"
        res = onnxgrad.gradients(m, y, "x", grad_ys=["cot"])
        ops = {nd.op_type for nd in res.model.graph.node}
        assert ("ScatterElements" in ops) == (n_out == 2)  # the forward's Indices are reused
        if form is not None and n_out == 1:
            assert form in ops and not ({"Col2Im", "DepthToSpace"} - {form}) & ops, ops
        if cot is None:
            shape = run(m, feeds, outputs=[y])[0].shape
            cot = (np.arange(1, math.prod(shape) + 1).reshape(shape) % 7 + 1).astype(dtype)
        out.append(session(res.model).run(res.grads, {**feeds, "cot": cot})[0])
    return out[0], out[1], cot


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.sampled_from([2, 3]), n=st.integers(1, 2), c=st.integers(1, 3),
       h=st.integers(2, 9), w=st.integers(2, 9), levels=st.integers(1, 4),
       symbolic=st.sampled_from([(), ("batch",), ("batch", "spatial")]), seed=st.integers(0, 99))
def test_max_pool_tiles_ties_match_indices_and_torch(k, n, c, h, w, levels, symbolic, seed):
    """Pools over k x k tiles take their gradient without Indices: on inputs with few distinct
    values (ties in most windows) it equals the Indices form exactly and torch's max_pool2d,
    which also routes each window's gradient to its first maximum in row-major order."""
    torch = pytest.importorskip("torch")
    h, w = max(h, k), max(w, k)
    x = np.random.default_rng(seed).integers(0, levels, (n, c, h, w)).astype(F32)
    tiles, indices, cot = _tiles_and_indices_grads(x, k, symbolic)
    np.testing.assert_array_equal(tiles, indices)
    tx = torch.tensor(x, requires_grad=True)
    torch.nn.functional.max_pool2d(tx, k).backward(torch.tensor(cot))
    np.testing.assert_array_equal(tiles, tx.grad.numpy())


@pytest.mark.parametrize("dtype, opset, form", [
    (F32, 18, "Col2Im"), (np.float16, 18, "Col2Im"),  # float16 is pooled as float32
    (np.float64, 18, "DepthToSpace"),  # onnxruntime's Col2Im: float32 only
    (F32, 17, "DepthToSpace")])  # Col2Im is opset 18
def test_max_pool_tiles_forms_keep_ties(dtype, opset, form):
    """Each form of the tiles gradient routes a tile's gradient to its first maximum, as the
    Indices form and torch do, on an input of zeros and ones (ties in most tiles), with a row
    and a column in no tile."""
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(3).integers(0, 2, (2, 3, 7, 5)).astype(F32)
    tiles, indices, cot = _tiles_and_indices_grads(x, 2, ("batch",), dtype, opset, form)
    assert tiles.dtype == dtype
    np.testing.assert_array_equal(tiles, indices)
    tx = torch.tensor(x, requires_grad=True)
    torch.nn.functional.max_pool2d(tx, 2).backward(torch.tensor(cot.astype(F32)))
    np.testing.assert_array_equal(tiles, tx.grad.numpy().astype(dtype))


@pytest.mark.parametrize("opset", [18, 17])
def test_max_pool_tiles_non_finite_g(opset):
    """The tiles form spreads g by a 0/1 product (as ReLU's gradient does): a tile whose g is
    inf sends inf to its first maximum and 0 * inf = NaN to its other elements (torch sends 0
    there); finite tiles beside it are exact."""
    x = np.array([[[[1, 3, 0, 0], [2, 3, 5, 4]]]], F32)  # tiles: max 3 (first at (0, 1)), 5
    m = model_of("MaxPool", {"x": x}, opset=opset, kernel_shape=[2, 2], strides=[2, 2])
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["cot"])
    cot = np.array([[[[np.inf, 2]]]], F32)
    (dx,) = session(res.model).run(res.grads, {"x": x, "cot": cot})
    nan = np.nan
    np.testing.assert_array_equal(dx, [[[[nan, np.inf, 0, 0], [nan, nan, 2, 0]]]])


def test_average_and_lp_pool_second_order_versus_torch():
    import torch.nn.functional as F
    feeds = {"x": rnd((2, 2, 7, 6))}
    m = model_of("AveragePool", feeds, symbolic=("batch", "spatial"), kernel_shape=[3, 3],
                 strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)
    second_order_versus_torch(m, feeds, ["x"], lambda x: F.avg_pool2d(
        x, 3, 2, 1, ceil_mode=True, count_include_pad=False))
    m = model_of("LpPool", feeds, symbolic=("batch",), kernel_shape=[2, 2], strides=[2, 2])
    second_order_versus_torch(m, feeds, ["x"], lambda x: F.lp_pool2d(x, 2, 2, 2))


# -- MaxUnpool and Col2Im --------------------------------------------------------------------------
def test_max_unpool_finite_differences():
    x = rnd((2, 2, 6, 6))
    pooled, idx = session(model_of("MaxPool", {"x": x}, n_out=2, kernel_shape=[2, 2],
                                   strides=[2, 2])).run(None, {"x": x})
    feeds = {"x": pooled, "i": idx}
    m = model_of("MaxUnpool", feeds, symbolic=("batch",), kernel_shape=[2, 2], strides=[2, 2])
    fd(m, feeds, xs=["x"])


def test_max_unpool_output_shape_gathers_at_indices():
    """With output_shape the indices address y (onnxruntime and the spec; onnx.reference
    differs), so the oracle is numpy: dx[j] = g.flat[I[j]]."""
    x = rnd((2, 2, 7, 5))
    pooled, idx = session(model_of("MaxPool", {"x": x}, n_out=2, kernel_shape=[2, 2],
                                   strides=[2, 2])).run(None, {"x": x})
    g = helper.make_graph(
        [helper.make_node("MaxUnpool", ["x", "i", "s"], ["y"], kernel_shape=[2, 2],
                          strides=[2, 2])], "unpool",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 2, 3, 2]),
         helper.make_tensor_value_info("i", onnx.TensorProto.INT64, ["N", 2, 3, 2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 2, 7, 5])],
        [onnx.numpy_helper.from_array(np.array(x.shape, np.int64), "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.checker.check_model(m, full_check=True)
    cot = rnd(x.shape, 5)
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["cot"])
    (g,) = session(res.model).run(res.grads, {"x": pooled, "i": idx, "cot": cot})
    np.testing.assert_array_equal(g, cot.reshape(-1)[idx])


@settings(max_examples=30, deadline=None, derandomize=True)
@given(k=st.integers(1, 3), s=st.integers(1, 3), d=st.integers(1, 2), pad=st.integers(0, 1),
       hw=st.tuples(st.integers(3, 7), st.integers(3, 7)), opset=st.sampled_from([11, 18]),
       seed=st.integers(0, 2**16))
# overlapping windows (3x3 / 1): an element that is the max of two windows has its index twice,
# MaxUnpool writes it twice, and its gradient came out twice (as torch's max_unpool2d gives)
@example(k=3, s=1, d=1, pad=0, hw=(4, 4), opset=18, seed=0)
def test_max_pool_then_unpool_credits_each_element_once(k, s, d, pad, hw, opset, seed):
    """MaxPool with Indices, then MaxUnpool of its output at its indices, is the identity on
    the elements some window takes and 0 elsewhere: the gradient through both is the cotangent
    there, however many windows take an element. (Finite differences of onnxruntime's float32
    kernels agree; check_gradients' float64 oracle, onnx.reference, sizes MaxUnpool otherwise.)"""
    if min(hw) < (k - 1) * d + 1:
        k = 1
    pad = min(pad, (k - 1) * d // 2)
    x = np.random.default_rng(seed).permutation(2 * hw[0] * hw[1]).reshape(1, 2, *hw)
    x = (x / x.size).astype(F32)  # distinct values: no window has a tie
    attrs = dict(kernel_shape=[k, k], strides=[s, s], pads=[pad] * 4)
    nodes = [helper.make_node("MaxPool", ["x"], ["m", "i"], dilations=[d, d], **attrs),
             helper.make_node("MaxUnpool", ["m", "i", "shape"], ["y"], **attrs)]
    g = helper.make_graph(nodes, "pool_unpool",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, x.shape),
                           helper.make_tensor_value_info("i", onnx.TensorProto.INT64, None)],
                          [onnx.numpy_helper.from_array(np.array(x.shape, np.int64), "shape")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["cot"])
    onnx.checker.check_model(res.model, full_check=True)
    cot = rnd(x.shape, seed + 1)
    idx, got = session(res.model).run(["i", res.grads[0]], {"x": x, "cot": cot})
    taken = np.zeros(x.size, bool)
    taken[idx.reshape(-1)] = True
    # (an element taken by w windows gets w shares of g / w: equal up to rounding)
    np.testing.assert_allclose(got, np.where(taken.reshape(x.shape), cot, 0), rtol=1e-6)


def test_max_unpool_repeated_indices_credit_the_kept_write():
    """Indices that repeat with different values: g goes to the one MaxUnpool wrote last."""
    x = rnd((1, 1, 2, 2))
    feeds = {"x": x, "i": np.array([[[[4, 4], [0, 4]]]], np.int64)}
    m = model_of("MaxUnpool", feeds, kernel_shape=[2, 2], strides=[1, 1])
    fd(m, feeds, xs=["x"])


@pytest.mark.parametrize("attrs,image,block", [
    ({}, [4, 5], [2, 2]),
    (dict(strides=[2, 1], pads=[1, 0, 1, 1]), [5, 4], [2, 3]),
    (dict(dilations=[2, 1], strides=[1, 2]), [6, 5], [2, 2]),
])
@pytest.mark.parametrize("run_time", [False, True])
def test_col2im_finite_differences_and_torch(attrs, image, block, run_time):
    """image_shape and block_shape constants, or graph inputs only the run time knows."""
    s, d = attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1])
    p = attrs.get("pads", [0, 0, 0, 0])
    blocks = [(image[i] + p[i] + p[i + 2] - d[i] * (block[i] - 1) - 1) // s[i] + 1
              for i in range(2)]
    x = rnd((2, 3 * math.prod(block), math.prod(blocks)))
    shapes = {"image": np.array(image, np.int64), "block": np.array(block, np.int64)}
    ins = {"x": (F32, ["N", x.shape[1], x.shape[2]])}
    if run_time:
        ins.update({"image": (np.int64, [2]), "block": (np.int64, [2])})
    m = make_model([helper.make_node("Col2Im", ["x", "image", "block"], ["y"], **attrs)],
                   ins, ["y"], inits=None if run_time else shapes)
    feeds = {"x": x, **(shapes if run_time else {})}
    fd(m, feeds, xs=["x"])
    if run_time:
        return
    import torch.nn.functional as F
    padded = [image[0] + p[0] + p[2], image[1] + p[1] + p[3]]  # torch pads symmetrically only
    versus_torch(m, {"x": x}, ["x"], lambda x: F.fold(x, padded, block, dilation=d, stride=s)[
        ..., p[0]:p[0] + image[0], p[1]:p[1] + image[1]])


# -- models with several window ops ----------------------------------------------------------------
def test_small_cnn_versus_torch():
    """Conv -> Relu -> MaxPool -> Conv(depthwise) -> AveragePool -> ConvTranspose, all weights."""
    import torch.nn.functional as F
    feeds = {"x": rnd((2, 3, 12, 11)), "w1": rnd((8, 3, 3, 3), 1) * 0.3, "b1": rnd((8,), 2),
             "w2": rnd((8, 1, 3, 3), 3) * 0.3, "w3": rnd((8, 4, 2, 2), 4) * 0.3}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], group=8, auto_pad="SAME_UPPER"),
        helper.make_node("AveragePool", ["c2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2],
                         ceil_mode=1),
        helper.make_node("ConvTranspose", ["p2", "w3"], ["y"], strides=[2, 2]),
    ]
    m = make_model(nodes, {"x": (F32, ["N", 3, "H", "W"]), **{
        k: (F32, v.shape) for k, v in feeds.items() if k != "x"}}, ["y"])

    def net(x, w1, b1, w2, w3):
        h = F.max_pool2d(F.relu(F.conv2d(x, w1, b1, padding=1)), 3, 2, 1)
        h = F.avg_pool2d(F.conv2d(h, w2, padding=1, groups=8), 2, 2, ceil_mode=True)
        return F.conv_transpose2d(h, w3, stride=2)
    versus_torch(m, feeds, list(feeds), net)


# -- kernels whose shape only the run time knows ---------------------------------------------------
@pytest.mark.parametrize("op,case", [("Conv", "2d-group"), ("Conv", "2d-same-lower"),
                                     ("Conv", "1d-stride-dil-asym"),
                                     ("ConvTranspose", "2d-group-outpad"),
                                     ("ConvTranspose", "2d-same-upper"),
                                     ("ConvTranspose", "2d-output-shape-beyond")])
def test_run_time_kernel_shape(op, case):
    """A weight of unknown shape (a computed kernel, as in a gradient graph): the windows' reach
    comes from run-time shapes."""
    feeds, attrs = (conv_feeds if op == "Conv" else convt_feeds)(case, seed=6)
    shapes = {k: [f"{k}{i}" for i in range(v.ndim)] if k == "w" else
              (["N", *v.shape[1:]] if k == "x" else list(v.shape)) for k, v in feeds.items()}
    g = helper.make_graph(
        [helper.make_node(op, list(feeds), ["y"], **attrs)], "kernel",
        [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, v) for k, v in shapes.items()],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", "M", "Y0", "Y1"][
            :feeds["x"].ndim])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.checker.check_model(m, full_check=True)
    fd(m, feeds)


def test_conv_transpose_second_order_symbolic_spatial():
    import torch.nn.functional as F
    feeds = {"x": rnd((1, 2, 4, 3)), "w": rnd((2, 3, 3, 3), 1)}
    m = model_of("ConvTranspose", feeds, symbolic=("batch", "spatial"), strides=[2, 1],
                 pads=[1, 1, 0, 1], output_padding=[1, 0])
    second_order_versus_torch(m, feeds, ["x", "w"], lambda x, w: F.conv_transpose2d(
        x, w, stride=(2, 1), output_padding=(1, 0))[..., 1:, 1:-1])


def test_conv_second_order_symbolic_strided():
    import torch.nn.functional as F
    feeds = {"x": rnd((2, 2, 8, 7)), "w": rnd((4, 2, 3, 2), 1)}
    m = model_of("Conv", feeds, symbolic=("batch", "spatial"), strides=[2, 3], pads=[1, 0, 2, 1],
                 dilations=[1, 2])
    second_order_versus_torch(m, feeds, ["x", "w"], lambda x, w: F.conv2d(
        F.pad(x, (0, 1, 1, 2)), w, stride=(2, 3), dilation=(1, 2)))


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("op,attrs", [
    ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2])),
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("ConvTranspose", dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]))])
def test_other_float_types(dtype, op, attrs):
    """The gradient keeps the model's dtype (no float32 constants) and agrees with float32."""
    feeds = {"x": rnd((2, 4, 7, 6))}
    if op == "ConvTranspose":
        feeds["w"] = rnd((4, 2, 3, 3), 1)
    out = []
    for dt in (dtype, F32):
        f = {k: v.astype(dt) for k, v in feeds.items()}
        m = model_of(op, f, **attrs)
        res = onnxgrad.gradients(m, "y", list(f))
        out.append(run(res.model, f, outputs=res.grads))
    for a, b in zip(*out):
        assert a.dtype == dtype
        np.testing.assert_allclose(a.astype(F32), b, rtol=2e-2, atol=2e-2)


# -- CausalConvWithState (opset 27, through its function body) ------------------------------------
# The op's types are float, float16 and bfloat16, and both its function body (Cast to=FLOAT
# around the SiLU) and onnx.reference's kernel compute the activation in float32, so a float64
# copy of the model still rounds through float32: float64 finite differences are noise there
# (bench/conformance.py checks those cases in float32). The oracle here is torch in float64.
def _causal_conv_case(activation, bias, past, dtype=F32, seed=0):
    rng = np.random.default_rng(seed)
    b, c, n, k = 2, 4, 8, 4
    feeds = {"input": rng.standard_normal((b, c, n)), "weight": rng.standard_normal((c, 1, k))}
    ins = ["input", "weight", "bias" if bias else "", "past_state" if past else ""]
    if bias:
        feeds["bias"] = rng.standard_normal(c)
    if past:
        feeds["past_state"] = rng.standard_normal((b, c, k - 1))
    while not ins[-1]:
        ins.pop()
    feeds = {key: v.astype(dtype) for key, v in feeds.items()}
    attrs = {} if activation is None else {"activation": activation}
    node = helper.make_node("CausalConvWithState", ins, ["y", "state"], **attrs)
    m = make_model([node], {key: (dtype, v.shape) for key, v in feeds.items()}, ["y", "state"],
                   opset=27)
    return m, feeds


def _causal_conv_torch(feeds, activation, cot_y, cot_s):
    """torch float64 gradients of <y, cot_y> + <state, cot_s> for every float input."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    t = {key: torch.tensor(v.astype(np.float64), requires_grad=True) for key, v in feeds.items()}
    c, k = t["weight"].shape[0], t["weight"].shape[2]
    pad = t.get("past_state", torch.zeros(t["input"].shape[0], c, k - 1, dtype=torch.float64))
    padded = torch.cat([pad, t["input"]], dim=2)
    y = F.conv1d(padded, t["weight"], t.get("bias"), groups=c)
    if activation is not None:
        y = F.silu(y)
    state = padded[:, :, padded.shape[2] - (k - 1):]
    loss = (y * torch.tensor(cot_y, dtype=torch.float64)).sum() + (
        state * torch.tensor(cot_s, dtype=torch.float64)).sum()
    return dict(zip(t, torch.autograd.grad(loss, list(t.values()))))


@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize("bias,past", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [F32, np.float16])
def test_causal_conv_with_state_versus_torch(activation, bias, past, dtype):
    """Every input's gradient (past_state's too, though the schema calls it non-differentiable)
    through the expanded function body, against torch float64: to float32 round-off (the body's
    SiLU runs in float32), to float16 round-off for float16 models."""
    m, feeds = _causal_conv_case(activation, bias, past, dtype)
    rng = np.random.default_rng(5)
    cot_y = rng.standard_normal((2, 4, 8)).astype(dtype)
    cot_s = rng.standard_normal((2, 4, 3)).astype(dtype)
    res = onnxgrad.gradients(m, ["y", "state"], list(feeds), grad_ys=["cot_y", "cot_s"])
    onnx.checker.check_model(res.model, full_check=True)
    # onnxruntime 1.31 does not load opset 27: onnx.reference runs the gradient model
    got = run(res.model, {**feeds, "cot_y": cot_y, "cot_s": cot_s}, outputs=res.grads,
              prefer="reference")
    want = _causal_conv_torch(feeds, activation, cot_y, cot_s)
    tol = 2e-2 if dtype == np.float16 else 1e-5
    for key, a in zip(feeds, got):
        assert a.dtype == dtype
        b = want[key].numpy()
        np.testing.assert_allclose(a.astype(np.float64), b, rtol=tol,
                                   atol=tol * max(1.0, np.abs(b).max()), err_msg=f"grad of {key}")


@pytest.mark.parametrize("activation", ["silu", "swish"])
def test_causal_conv_with_state_silu_float32_differences(activation):
    """The conformance sweep's check for the activation cases: central differences in the
    model's own float32 (the float64 copy computes the SiLU in float32, see above)."""
    m, feeds = _causal_conv_case(activation, True, True)
    report = onnxgrad.check.check_gradients(m, ["y", "state"], list(feeds), feeds,
                                            dtype="float32", max_elements=16, directions=2)
    assert report.ok, str(report)


# -- windows that read only padding, empty crops (issue 12, item 9) ----------------------------
def _torch_conv(nsp, pads, stride, dilation, groups, transpose=False, output_padding=0):
    """torch's Conv / ConvTranspose with ONNX's (possibly asymmetric) pads."""
    import torch.nn.functional as F
    if not transpose:
        tpad = [v for i in reversed(range(nsp)) for v in (pads[i], pads[nsp + i])]
        return lambda x, w: tconv(nsp)(F.pad(x, tpad), w, stride=stride, dilation=dilation,
                                       groups=groups)
    fn = [F.conv_transpose1d, F.conv_transpose2d][nsp - 1]

    def run(x, w):  # the full output, cropped by the pads
        y = fn(x, w, stride=stride, dilation=dilation, groups=groups,
               output_padding=output_padding)
        crop = tuple(slice(pads[i], y.shape[2 + i] - pads[nsp + i]) for i in range(nsp))
        return y[(slice(None), slice(None)) + crop]
    return run


@pytest.mark.parametrize("xs,ws,group,stride,pads", [
    ((5, 3, 1), (6, 1, 1), 3, [2], [1, 0]),          # the case: "C: 0" in onnxruntime
    ((2, 3, 1), (6, 1, 1), 3, [3], [2, 0]),          # the pad reaches past the window: dW [6,1,2]
    ((2, 3, 1, 2), (6, 1, 1, 1), 3, [2, 1], [1, 0, 0, 0]),
    ((2, 2, 2), (4, 2, 1), 1, [3], [2, 0]),          # ungrouped: the per-tap Gemm form
])
@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
def test_conv_windows_in_padding_only(xs, ws, group, stride, pads, symbolic):
    """Every window starts in the front padding (pads >= the windows' reach): the weight
    gradient is exactly zero, and the graph must run (the cropped input is empty)."""
    feeds = {"x": rnd(xs), "w": rnd(ws, 1)}
    m = model_of("Conv", feeds, symbolic=symbolic, group=group, strides=stride, pads=pads)
    versus_torch(m, feeds, ["x", "w"], _torch_conv(len(xs) - 2, pads, stride, 1, group))
    fd(m, feeds)


@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
def test_conv_transpose_output_padding_only(symbolic):
    """y = output padding only along an axis (pads begin >= the kernel's reach): dx = dW = 0."""
    feeds = {"x": rnd((2, 3, 1)), "w": rnd((3, 2, 1), 1)}
    attrs = dict(group=3, strides=[2], pads=[1, 0], output_padding=[1])
    m = model_of("ConvTranspose", feeds, symbolic=symbolic, **attrs)
    versus_torch(m, feeds, ["x", "w"], _torch_conv(1, [1, 0], 2, 1, 3, True, 1))
    fd(m, feeds)


def _edge_geometry():
    from hypothesis import strategies as st

    @st.composite
    def geometry(draw):
        nsp = draw(st.integers(1, 2))
        k = draw(st.integers(1, 3))
        d = draw(st.integers(1, 2))
        s = draw(st.integers(1, 4))
        ek = d * (k - 1) + 1
        pads = [draw(st.integers(0, ek + 2)) for _ in range(2)]
        length = draw(st.integers(1, 3))
        if length + sum(pads) < ek:
            length = ek - sum(pads)
        group = draw(st.sampled_from([1, 3]))
        transpose = draw(st.booleans())
        op = draw(st.integers(0, s - 1)) if transpose else 0  # onnxruntime: op < stride
        if draw(st.booleans()):  # every window in the front padding (one window, pads >= ek)
            pads = [ek + draw(st.integers(0, 1)), 0]
            if transpose:
                length, s, op = 1, max(s, 2), 1
            else:
                s = max(s, length + pads[0] - ek + 1)
        if transpose and s * (length - 1) + op + ek - sum(pads) < 1:
            pads = [0, 0]
        symbolic = draw(st.sampled_from([(), ("batch", "spatial")]))
        return nsp, k, d, s, pads, length, group, transpose, op, symbolic
    return geometry()


def test_conv_edge_geometry_versus_torch():
    """Generated Conv / ConvTranspose geometries around the edges (kernels wider than the input
    with padding, strides over the kernel, pads past the kernel's reach, groups, dilations,
    symbolic dims) against torch autograd: every gradient graph runs and is right."""
    from hypothesis import given, settings, HealthCheck

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_edge_geometry())
    def check(geo):
        nsp, k, d, s, pads, length, group, transpose, op, symbolic = geo
        xs = (2, 3) + (length,) * nsp
        ws = ((3, 2) if transpose else (6, 3 // group)) + (k,) * nsp
        feeds = {"x": rnd(xs), "w": rnd(ws, 1)}
        allp = [pads[0]] * nsp + [pads[1]] * nsp
        attrs = dict(group=group, strides=[s] * nsp, pads=allp, dilations=[d] * nsp)
        if transpose:
            attrs["output_padding"] = [op] * nsp
        m = model_of("ConvTranspose" if transpose else "Conv", feeds, symbolic=symbolic, **attrs)
        versus_torch(m, feeds, ["x", "w"], _torch_conv(nsp, allp, s, d, group, transpose, op))
    check()


def _max_pool_grad_numpy(x, y_shape, g, kernel, strides, pads, dilations):
    """MaxPool's gradient from its definition: each window's g goes to the largest of the
    elements it reads (taps inside x); a window that reads no element passes nothing on."""
    dx = np.zeros_like(x, np.float64)
    for n_, c in np.ndindex(*x.shape[:2]):
        for o in np.ndindex(*y_shape[2:]):
            taps = [[o[a] * strides[a] - pads[a] + j * dilations[a] for j in range(kernel[a])]
                    for a in range(2)]
            inside = [(i, j) for i in taps[0] for j in taps[1]
                      if 0 <= i < x.shape[2] and 0 <= j < x.shape[3]]
            if inside:
                i, j = max(inside, key=lambda t: x[n_, c][t])
                dx[n_, c, i, j] += g[(n_, c) + o]
    return dx


@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
@pytest.mark.parametrize("shape,attrs", [
    ((2, 3, 1, 2), dict(kernel_shape=[2, 1], pads=[1, 0, 1, 0], dilations=[2, 1])),
    ((1, 2, 3, 3), dict(kernel_shape=[2, 2], pads=[1, 1, 1, 1], dilations=[2, 2], ceil_mode=1)),
    ((2, 2, 1, 4), dict(kernel_shape=[2, 2], pads=[1, 0, 1, 1], dilations=[2, 3],
                        strides=[1, 2])),
])
@pytest.mark.parametrize("n_out", [1, 2])
def test_max_pool_windows_in_padding_only(symbolic, shape, attrs, n_out):
    """A dilated window whose taps all fall in the padding: onnxruntime outputs -FLT_MAX (a
    constant) and an index off its window, which for later channels lands on another channel's
    elements; no gradient may flow from such a window. (Finite differences cannot judge: the
    outputs are -FLT_MAX. The definition, in numpy, can.)"""
    x = rnd(shape)
    ins = {"x": (F32, ["N", "C", "H", "W"] if symbolic else list(shape))}
    outs = ["y", "i"][:n_out]
    m = make_model([helper.make_node("MaxPool", ["x"], outs, **attrs)], ins, outs)
    y = session(m).run(["y"], {"x": x})[0]
    g = rnd(y.shape, 1)
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["g"])
    got = session(res.model).run(res.grads, {"x": x, "g": g})[0]
    want = _max_pool_grad_numpy(x, y.shape, g, attrs["kernel_shape"], attrs.get("strides", [1, 1]),
                                attrs["pads"], attrs["dilations"])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["AveragePool", "LpPool", "MaxPool"])
@pytest.mark.parametrize("shape,attrs", [
    ((1, 2, 1, 3), dict(kernel_shape=[3, 2], pads=[1, 1, 1, 0])),           # kernel > input
    ((1, 2, 2, 5), dict(kernel_shape=[2, 2], strides=[3, 4], pads=[1, 0, 0, 1])),  # stride > k
    ((1, 2, 4, 3), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[2, 2, 2, 2])),  # pads = k - 1
    ((2, 1, 5, 1), dict(kernel_shape=[4, 1], strides=[3, 1], pads=[0, 0, 3, 0])),
])
@pytest.mark.parametrize("symbolic", [(), ("batch", "spatial")])
def test_pool_edge_geometry(op, shape, attrs, symbolic):
    """Kernels wider than the input, strides over the kernel, pads up to the kernel: float32
    differences on onnxruntime (the runtime whose pools the rules follow; onnx.reference's
    pools differ from it at these edges)."""
    if op == "AveragePool":
        attrs = dict(attrs, count_include_pad=int(shape[0] == 1))
    x = rnd(shape)
    x = x + np.sign(x) * 0.2  # |x| >= 0.2: LpPool's kink at 0 stays out of the steps
    m = model_of(op, {"x": x}, symbolic=symbolic, **attrs)
    report = assert_gradients(m, "y", "x", {"x": x}, dtype="float32", f32=False)
    assert report.ok


def test_per_tap_3d_and_depthwise_geometries_versus_torch():
    """Generated geometries for the two forms that only images of >= 256 output positions take
    (the edge-geometry generator's images are too small to reach them): 3-D ungrouped and 1-D /
    2-D depthwise convolutions with unit strides, kernels of 1 to 3 per axis, dilations,
    asymmetric pads up to past the kernel's reach, symbolic batch; the form is asserted and the
    gradient checked against torch autograd."""
    import torch.nn.functional as F

    @st.composite
    def geometry(draw):
        depthwise = draw(st.booleans())
        nsp = draw(st.integers(1, 2)) if depthwise else 3
        k = [draw(st.integers(1, 3)) for _ in range(nsp)]
        d = [draw(st.integers(1, 2)) for _ in range(nsp)]
        pads = [draw(st.integers(0, di * (ki - 1) + 1)) for _ in range(2) for ki, di in zip(k, d)]
        side = {1: 260, 2: 20, 3: 11}[nsp]  # (side - 4)^nsp >= 256 output positions
        return depthwise, k, d, pads, side, draw(st.sampled_from([(), ("batch",)]))

    @settings(max_examples=16, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(geometry())
    def check(geo):
        depthwise, k, d, pads, side, symbolic = geo
        nsp, c = len(k), 3
        ws = (c, 1, *k) if depthwise else (4, c, *k)
        feeds = {"x": rnd((2, c) + (side,) * nsp), "w": rnd(ws, 1)}
        m = model_of("Conv", feeds, symbolic=symbolic, group=c if depthwise else 1, pads=pads,
                     dilations=d)
        nodes = onnxgrad.gradients(m, "y", ["w"]).model.graph.node
        taps = int(np.prod(k))
        if depthwise:
            assert sum(n.op_type == "ReduceSum" for n in nodes) == taps
        else:
            assert sum(n.op_type == "Gemm" for n in nodes) in (1, taps)  # stacked or per tap
        torch_pad = [v for i in reversed(range(nsp)) for v in (pads[i], pads[nsp + i])]
        versus_torch(m, feeds, ["x", "w"], lambda x, w: tconv(nsp)(
            F.pad(x, torch_pad), w, dilation=d, groups=c if depthwise else 1))
    check()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(["SAME_UPPER", "SAME_LOWER", "VALID", "NOTSET"]),
       st.tuples(st.integers(1, 3), st.integers(1, 3)), st.tuples(st.integers(1, 3),
                                                                  st.integers(1, 3)),
       st.tuples(st.integers(0, 2), st.integers(0, 2)), st.integers(0, 2**16))
def test_conv_transpose_gradient_is_the_adjoint_of_onnxruntimes_forward(auto, k, s, op, seed):
    """Every auto_pad with every kernel / stride / output_padding onnxruntime runs: either a
    clear refusal, or a valid model whose dx and dw are the adjoints of onnxruntime's own
    forward (<y(x), g> = <x, dx>, and in w). auto_pad SAME with output_padding, or with a
    kernel shorter than the stride, gave a model that failed the checker or onnxruntime."""
    op = tuple(min(o, si - 1) for o, si in zip(op, s))  # onnxruntime: output_padding < stride
    attrs = dict(kernel_shape=list(k), strides=list(s), auto_pad=auto,
                 output_padding=list(op))
    g = helper.make_graph([helper.make_node("ConvTranspose", ["x", "w"], ["y"], **attrs)], "g",
                          [helper.make_tensor_value_info("x", 1, [1, 2, 3, 4]),
                           helper.make_tensor_value_info("w", 1, [2, 3, *k])],
                          [helper.make_tensor_value_info("y", 1, None)])
    m = onnx.shape_inference.infer_shapes(helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    w = rng.standard_normal((2, 3, *k)).astype(np.float32)
    try:
        y = session(m).run(["y"], {"x": x, "w": w})[0]
    except Exception:  # noqa: BLE001  (a forward onnxruntime refuses is no case)
        return
    try:
        res = onnxgrad.gradients(m, "y", ["x", "w"], grad_ys=["gy"])
    except onnxgrad.NotDifferentiableError as err:
        assert "auto_pad SAME" in str(err), err
        return
    onnx.checker.check_model(res.model, full_check=True)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw = session(res.model).run(res.grads, {"x": x, "w": w, "gy": gy})
    assert dx.shape == x.shape and dw.shape == w.shape
    inner = float(np.sum(y.astype(np.float64) * gy))  # y is linear in x and in w
    np.testing.assert_allclose(np.sum(x.astype(np.float64) * dx), inner, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.sum(w.astype(np.float64) * dw), inner, rtol=1e-4, atol=1e-4)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.tuples(st.integers(1, 3), st.integers(1, 3)), st.tuples(st.integers(1, 2),
                                                                  st.integers(1, 2)),
       st.tuples(st.integers(1, 2), st.integers(1, 2)), st.sampled_from([1, 2]),
       st.tuples(st.integers(-2, 1), st.integers(-2, 1)), st.booleans(),
       st.sampled_from(["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]), st.integers(0, 2**16))
@example((1, 2), (1, 1), (2, 1), 1, (-1, -1), False, "NOTSET", 0)
def test_conv_transpose_output_shape_gradient_is_the_adjoint(k, s, d, group, delta, batch,
                                                            auto, seed):
    """output_shape cropping (delta < 0) or extending (delta > 0) the full output: onnx's
    inference types a cropping node's output [N, C] without its spatial dims, and the gradient
    built on that rank was an invalid model (onnx's InferenceError from gradients()). The
    result must run, compute onnxruntime's forward, and give dx, dw that are the adjoints of
    it (<y(x), g> = <x, dx>, and in w)."""
    xs, ws = (2, 2 * group, 4, 3), (2 * group, 2, *k)
    full = [si * (xi - 1) + (ki - 1) * di + 1 for si, xi, ki, di in zip(s, xs[2:], k, d)]
    attrs = dict(strides=list(s), dilations=list(d), group=group, auto_pad=auto,
                 output_shape=[f + dl for f, dl in zip(full, delta)])
    g = helper.make_graph([helper.make_node("ConvTranspose", ["x", "w"], ["y"], **attrs)], "g",
                          [helper.make_tensor_value_info("x", 1, ["N", *xs[1:]] if batch else xs),
                           helper.make_tensor_value_info("w", 1, ws)],
                          [helper.make_tensor_value_info("y", 1, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    try:
        y = session(m).run(["y"], {"x": x, "w": w})[0]
    except Exception:  # noqa: BLE001  (a forward onnxruntime refuses is no case)
        return
    res = onnxgrad.gradients(m, "y", ["x", "w"], grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    y2, dx, dw = session(res.model).run(["y", *res.grads], {"x": x, "w": w, "gy": gy})
    np.testing.assert_allclose(y2, y, rtol=1e-5, atol=1e-5)
    inner = float(np.sum(y.astype(np.float64) * gy))
    np.testing.assert_allclose(np.sum(x.astype(np.float64) * dx), inner, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.sum(w.astype(np.float64) * dw), inner, rtol=1e-4, atol=1e-4)
