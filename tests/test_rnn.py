"""The CudnnRNN op family (domain onnxgrad): params layout, NumPy reference, ONNX function bodies
on onnxruntime, and the gradient rule -- against torch.nn.LSTM/GRU/RNN autograd."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import onnxgrad
from onnxgrad.rnn import canonical_to_params, params_size, params_to_canonical
from onnxgrad.rnn.ops import attach_functions, make_function, make_node
from onnxgrad.rnn.params import layout, per_layer
from onnxgrad.rnn.reference import rnn_backward, rnn_forward

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

MODES = ["lstm", "gru", "rnn_tanh", "rnn_relu"]
G = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
UNI, BI = "unidirectional", "bidirectional"
T, B, I, H = 4, 3, 5, 6


def _nd(direction):
    return 2 if direction == BI else 1


def torch_module(mode, L, direction, dtype=torch.float64, input_size=I, seed=0):
    torch.manual_seed(seed)
    bi = direction == BI
    if mode == "lstm":
        m = torch.nn.LSTM(input_size, H, L, bidirectional=bi)
    elif mode == "gru":
        m = torch.nn.GRU(input_size, H, L, bidirectional=bi)
    else:
        m = torch.nn.RNN(input_size, H, L, nonlinearity=mode[4:], bidirectional=bi)
    return m.to(dtype)


def torch_canonical(m, mode, L, direction, grad=False):
    """torch's weights (or their .grad) as cuDNN canonical lists: per (layer, dir) the G
    input matrices, then the G recurrent ones; then the biases in the same order."""
    get = (lambda k: getattr(m, k).grad.numpy()) if grad else \
        (lambda k: getattr(m, k).detach().numpy())
    ws, bs = [], []
    for layer in range(L):
        for d in range(_nd(direction)):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            ws += np.split(get("weight_ih" + sfx), G[mode]) + np.split(get("weight_hh" + sfx),
                                                                        G[mode])
            bs += np.split(get("bias_ih" + sfx), G[mode]) + np.split(get("bias_hh" + sfx), G[mode])
    return ws, bs


def torch_run(m, mode, x, h0, c0, gy, ghn, gcn):
    """torch's outputs and the gradients of <y,gy> + <hn,ghn> (+ <cn,gcn>)."""
    xt = torch.tensor(x, requires_grad=True)
    states = None if h0 is None else torch.tensor(h0, requires_grad=True)
    cs = None if c0 is None else torch.tensor(c0, requires_grad=True)
    m.zero_grad()
    if mode == "lstm":
        y, (hn, cn) = m(xt, None if states is None else (states, cs))
    else:
        y, hn = m(xt, states)
        cn = None
    loss = (y * torch.tensor(gy)).sum() + (hn * torch.tensor(ghn)).sum()
    if cn is not None:
        loss = loss + (cn * torch.tensor(gcn)).sum()
    loss.backward()
    out = dict(y=y.detach().numpy(), hn=hn.detach().numpy(),
               cn=None if cn is None else cn.detach().numpy(), dx=xt.grad.numpy())
    out["dh0"] = None if states is None else states.grad.numpy()
    out["dc0"] = None if cs is None else cs.grad.numpy()
    return out


def rnn_model(op, mode, L, direction, dtype=TP.FLOAT, input_mode="linear_input", dims=None,
              attach=True, **attrs):
    """A one-node model: inputs x, h0, c0, p; outputs y, hn, cn, rs[, hr]."""
    nd = _nd(direction)
    t, b, i, h = dims or (T, B, I, H)
    P = params_size(mode, L, H, I if isinstance(i, str) else i, direction, input_mode)
    ins = [helper.make_tensor_value_info("x", dtype, [t, b, i]),
           helper.make_tensor_value_info("h0", dtype, [L * nd, b, h]),
           helper.make_tensor_value_info("c0", dtype, [L * nd, b, h]),
           helper.make_tensor_value_info("p", dtype, [P])]
    outs = ["y", "hn", "cn", "rs"] + (["hr"] if op.endswith("V2") else [])
    node = make_node(op, ["x", "h0", "c0", "p"], outs, name="rnn", rnn_mode=mode,
                     direction=direction, input_mode=input_mode, **attrs)
    shapes = {"y": [t, b, nd * h], "hn": [L * nd, b, h],
              "cn": [L * nd, b, h] if mode == "lstm" else [], "rs": [None], "hr": [None]}
    g = helper.make_graph([node], "rnn", ins, [helper.make_tensor_value_info(
        o, TP.INT8 if o == "hr" else dtype, shapes[o]) for o in outs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                            helper.make_opsetid("onnxgrad", 1)], ir_version=10)
    return attach_functions(m) if attach else m


def session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def inputs(mode, L, direction, dtype, rng, input_size=I, scale=0.5):
    nd = _nd(direction)
    x = rng.standard_normal((T, B, input_size)).astype(dtype)
    h0 = rng.standard_normal((L * nd, B, H)).astype(dtype)
    c0 = rng.standard_normal((L * nd, B, H)).astype(dtype)
    return x, h0, c0


def cotangents(mode, L, direction, dtype, rng):
    nd = _nd(direction)
    return (rng.standard_normal((T, B, nd * H)).astype(dtype),
            rng.standard_normal((L * nd, B, H)).astype(dtype),
            rng.standard_normal((L * nd, B, H)).astype(dtype))


# -- params ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("L,direction", [(1, UNI), (3, BI)])
def test_params_match_torch_and_round_trip(mode, L, direction):
    m = torch_module(mode, L, direction)
    ws, bs = torch_canonical(m, mode, L, direction)
    p = canonical_to_params(ws, bs, mode, L, H, I, direction)
    assert p.shape == (params_size(mode, L, H, I, direction),)
    assert p.size == sum(t.numel() for t in m.parameters())
    ws2, bs2 = params_to_canonical(p, mode, L, H, I, direction)
    assert len(ws2) == len(ws) == L * _nd(direction) * 2 * G[mode] == len(bs2)
    for a, b in zip(ws + bs, ws2 + bs2):
        np.testing.assert_array_equal(a, b)
    # whole blocks are torch's weight_ih / weight_hh / bias_ih / bias_hh
    for (layer, d), (wx, rh, bx, bh) in per_layer(p, mode, L, H, I, direction).items():
        sfx = f"_l{layer}" + ("_reverse" if d else "")
        for got, name in [(wx, "weight_ih"), (rh, "weight_hh"), (bx, "bias_ih"), (bh, "bias_hh")]:
            np.testing.assert_array_equal(got, getattr(m, name + sfx).detach().numpy())
    # all weights come before all biases
    regions = layout(mode, L, H, I, direction)
    kinds = [r.kind for r in regions]
    assert kinds == sorted(kinds, key=lambda k: k == "bias")


def test_params_skip_input_and_errors():
    lin = params_size("lstm", 2, H, H, BI)
    skip = params_size("lstm", 2, H, H, BI, "skip_input")
    assert lin - skip == 2 * 4 * H * H  # no input matrices on layer 0, both directions
    assert params_size("gru", 1, H, H, UNI, "auto_select") == params_size("gru", 1, H, H, UNI,
                                                                          "skip_input")
    assert params_size("gru", 1, H, I, UNI, "auto_select") == params_size("gru", 1, H, I, UNI)
    ws, bs = params_to_canonical(np.arange(skip, dtype=np.float32), "lstm", 2, H, H, BI,
                                 "skip_input")
    assert len(ws) == 2 * 2 * 8 - 2 * 4 and len(bs) == 2 * 2 * 8
    with pytest.raises(ValueError, match="input_size == num_units"):
        params_size("lstm", 1, H, I, UNI, "skip_input")
    with pytest.raises(ValueError, match="rnn_mode"):
        params_size("lstmx", 1, H, I)
    with pytest.raises(ValueError, match="1-D buffer of"):
        params_to_canonical(np.zeros(3), "lstm", 1, H, I)
    with pytest.raises(ValueError, match="expected 8 weights"):
        canonical_to_params([np.zeros((H, I))], [], "lstm", 1, H, I)


# -- the NumPy reference against torch ---------------------------------------------------------
REF_CASES = [(1, UNI, True, np.float64), (2, BI, False, np.float32), (2, UNI, True, np.float32),
             (1, BI, False, np.float64), (3, BI, True, np.float64)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("L,direction,init,dtype", REF_CASES)
def test_reference_matches_torch(mode, L, direction, init, dtype):
    rng = np.random.default_rng(1)
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    m = torch_module(mode, L, direction, tdtype)
    p = canonical_to_params(*torch_canonical(m, mode, L, direction), mode, L, H, I, direction)
    x, h0, c0 = inputs(mode, L, direction, dtype, rng)
    if not init:
        h0, c0 = np.zeros_like(h0), np.zeros_like(c0)
    gy, ghn, gcn = cotangents(mode, L, direction, dtype, rng)
    want = torch_run(m, mode, x, h0 if init else None, c0 if init and mode == "lstm" else None,
                     gy, ghn, gcn)
    y, hn, cn, rs = rnn_forward(x, h0, c0, p, mode, direction)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)
    assert y.dtype == dtype and rs.dtype == dtype
    np.testing.assert_allclose(y, want["y"], **tol)
    np.testing.assert_allclose(hn, want["hn"], **tol)
    if mode == "lstm":
        np.testing.assert_allclose(cn, want["cn"], **tol)
    else:
        assert cn.shape == ()
    dx, dh0, dc0, dp = rnn_backward(x, h0, c0, p, gy, ghn, gcn, rs, mode, direction)
    np.testing.assert_allclose(dx, want["dx"], **tol)
    if init:
        np.testing.assert_allclose(dh0, want["dh0"], **tol)
        if mode == "lstm":
            np.testing.assert_allclose(dc0, want["dc0"], **tol)
    dp_want = canonical_to_params(*torch_canonical(m, mode, L, direction, grad=True), mode, L, H,
                                  I, direction)
    np.testing.assert_allclose(dp, dp_want, **tol)


# -- the ONNX functions on onnxruntime -----------------------------------------------------------
ORT_CASES = [("CudnnRNNV2", 1, UNI, "linear_input", np.float32),
             ("CudnnRNN", 2, BI, "linear_input", np.float32),
             ("CudnnRNNV2", 2, UNI, "skip_input", np.float64),
             ("CudnnRNNV2", 1, BI, "auto_select", np.float64)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op,L,direction,input_mode,dtype", ORT_CASES)
def test_forward_function_matches_reference(mode, op, L, direction, input_mode, dtype):
    rng = np.random.default_rng(2)
    i = H if input_mode != "linear_input" else I
    ttype = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = rnn_model(op, mode, L, direction, ttype, input_mode, dims=(T, B, i, H))
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model, full_check=True)
    resolved = "skip_input" if input_mode == "auto_select" else input_mode  # i == H here
    assert {f.overload for f in model.functions} == {f"{mode}.{direction}.{resolved}.L{L}"}
    x, h0, c0 = inputs(mode, L, direction, dtype, rng, input_size=i)
    p = (rng.standard_normal(params_size(mode, L, H, i, direction, input_mode)) * 0.5).astype(dtype)
    got = session(model).run(None, {"x": x, "h0": h0, "c0": c0, "p": p})
    want = rnn_forward(x, h0, c0, p, mode, direction, input_mode)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for name, a, b in zip(["output", "output_h", "output_c", "reserve_space"], got, want):
        assert a.dtype == dtype and a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)
    if op == "CudnnRNNV2":
        assert got[4].dtype == np.int8 and got[4][0] == 111


def test_forward_symbolic_dims():
    """seq_length, batch and input_size may be symbolic; one session serves several shapes."""
    model = rnn_model("CudnnRNNV2", "gru", 2, BI, dims=("T", "B", I, H))
    s = session(model)
    rng = np.random.default_rng(3)
    p = (rng.standard_normal(params_size("gru", 2, H, I, BI)) * 0.5).astype(np.float32)
    for t, b in [(1, 2), (7, 1)]:
        x = rng.standard_normal((t, b, I)).astype(np.float32)
        h0 = rng.standard_normal((4, b, H)).astype(np.float32)
        got = s.run(None, {"x": x, "h0": h0, "c0": h0, "p": p})
        want = rnn_forward(x, h0, h0, p, "gru", BI)
        for a, w in zip(got, want):
            np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)


GRAD_CASES = [("CudnnRNNV2", 1, UNI, True, np.float32), ("CudnnRNNV2", 2, BI, False, np.float32),
              ("CudnnRNN", 2, UNI, True, np.float64)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op,L,direction,init,dtype", GRAD_CASES)
def test_backward_function_matches_torch(mode, op, L, direction, init, dtype):
    """gradients() emits CudnnRNNBackprop[V2]; with its function body on onnxruntime it gives
    torch's gradients for every input."""
    rng = np.random.default_rng(4)
    ttype = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    fwd = rnn_model(op, mode, L, direction, ttype, attach=False)
    ys = ["y", "hn"] + (["cn"] if mode == "lstm" else [])
    res = onnxgrad.gradients(fwd, ys, ["x", "h0", "c0", "p"], grad_ys=["g_" + y for y in ys])
    want_op = "CudnnRNNBackpropV2" if op == "CudnnRNNV2" else "CudnnRNNBackprop"
    assert [n.op_type for n in res.model.graph.node if n.domain == "onnxgrad"] == [op, want_op]
    model = res.model
    onnx.checker.check_model(model, full_check=True)
    m = torch_module(mode, L, direction, torch.float64 if dtype == np.float64 else torch.float32)
    p = canonical_to_params(*torch_canonical(m, mode, L, direction), mode, L, H, I, direction)
    x, h0, c0 = inputs(mode, L, direction, dtype, rng)
    if not init:
        h0, c0 = np.zeros_like(h0), np.zeros_like(c0)
    gy, ghn, gcn = cotangents(mode, L, direction, dtype, rng)
    feeds = {"x": x, "h0": h0, "c0": c0, "p": p, "g_y": gy, "g_hn": ghn}
    if mode == "lstm":
        feeds["g_cn"] = gcn
    dx, dh0, dc0, dp = session(model).run(res.grads, feeds)
    want = torch_run(m, mode, x, h0 if init else None, c0 if init and mode == "lstm" else None,
                     gy, ghn, gcn)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dx, want["dx"], **tol)
    if init:
        np.testing.assert_allclose(dh0, want["dh0"], **tol)
        if mode == "lstm":
            np.testing.assert_allclose(dc0, want["dc0"], **tol)
    if mode != "lstm":
        np.testing.assert_array_equal(dc0, np.zeros_like(c0))
    dp_want = canonical_to_params(*torch_canonical(m, mode, L, direction, grad=True), mode, L, H,
                                  I, direction)
    np.testing.assert_allclose(dp, dp_want, **tol)


@pytest.mark.parametrize("mode", MODES)
def test_backward_function_finite_differences(mode):
    """float64 central differences of the ONNX forward function, along random directions, against
    the ONNX backward function (skip_input, bidirectional, 2 layers: the less common paths)."""
    rng = np.random.default_rng(5)
    L, direction, n = 2, BI, H
    fwd = rnn_model("CudnnRNNV2", mode, L, direction, TP.DOUBLE, "skip_input", dims=(2, 2, n, H))
    ys = ["y", "hn"] + (["cn"] if mode == "lstm" else [])
    res = onnxgrad.gradients(fwd, ys, ["x", "h0", "c0", "p"], grad_ys=["g_" + y for y in ys])
    bwd = session(res.model)
    f = session(fwd)
    prim = {"x": rng.standard_normal((2, 2, n)), "h0": rng.standard_normal((4, 2, H)),
            "c0": rng.standard_normal((4, 2, H)),
            "p": rng.standard_normal(params_size(mode, L, H, n, direction, "skip_input")) * 0.5}
    cot = {"g_y": rng.standard_normal((2, 2, 2 * H)), "g_hn": rng.standard_normal((4, 2, H)),
           "g_cn": rng.standard_normal((4, 2, H))}
    cot = {k: v for k, v in cot.items() if k[2:] in ys}
    assert_directional_fd(f, bwd, res.grads, ys, prim, cot, rng)


@pytest.mark.parametrize("op,mode,L,direction,input_mode,attrs", [
    ("CudnnRNNV2", "lstm", 2, BI, "linear_input", dict(dropout=0.5, seed=3)),
    ("CudnnRNN", "gru", 1, UNI, "skip_input", {}),
    ("CudnnRNNV2", "rnn_relu", 3, UNI, "linear_input", {})])
@pytest.mark.parametrize("xs", [["h0", "c0", "p"], ["x", "h0"], ["c0"]])
def test_outputs_not_asked_for_are_not_computed(op, mode, L, direction, input_mode, attrs, xs):
    """Without x's (p's) gradient, the backward node leaves input_backprop (params_backprop)
    unnamed and gets the ``.nodx`` (``.nodp``) body; the gradients asked for are those of the
    call that asks for every input. Such an overload on a node that names the output is
    refused."""
    rng = np.random.default_rng(14)
    n_in = H if input_mode == "skip_input" else I
    fwd = rnn_model(op, mode, L, direction, TP.DOUBLE, input_mode, dims=(T, B, n_in, H),
                    attach=False, **attrs)
    ys = ["y", "hn"] + (["cn"] if mode == "lstm" else [])
    cot = dict(zip(["g_y", "g_hn", "g_cn"], cotangents(mode, L, direction, np.float64, rng)))
    cot = {k: v for k, v in cot.items() if k[2:] in ys}
    x, h0, c0 = inputs(mode, L, direction, np.float64, rng, input_size=n_in)
    p = rng.standard_normal(params_size(mode, L, H, n_in, direction, input_mode)) * 0.5
    feeds = {"x": x, "h0": h0, "c0": c0, "p": p, **cot}
    every = ["x", "h0", "c0", "p"]
    part = onnxgrad.gradients(fwd, ys, xs, grad_ys=list(cot))
    full = onnxgrad.gradients(fwd, ys, every, grad_ys=list(cot))
    onnx.checker.check_model(part.model, full_check=True)
    bwd = next(n for n in part.model.graph.node if "Backprop" in n.op_type)
    flags = bwd.overload.split(".")
    for k, name, flag in ((0, "x", "nodx"), (3, "p", "nodp")):
        assert (bwd.output[k] == "", flag in flags) == (name not in xs,) * 2
    got = session(part.model).run(part.grads, feeds)
    want = dict(zip(every, session(full.model).run(full.grads, feeds)))
    for name, a in zip(xs, got):
        np.testing.assert_allclose(a, want[name], rtol=1e-12, atol=1e-14, err_msg=name)
    k, out = (0, "input_backprop") if "x" not in xs else (3, "params_backprop")
    bwd.output[k] = "named"
    with pytest.raises(ValueError, match=f"leaves {out} empty"):
        attach_functions(part.model)


@pytest.mark.parametrize("op,outs", [("CudnnRNNV2", ["y", "hn"]), ("CudnnRNN", ["y"]),
                                     ("CudnnRNNBackprop", ["dx", "dh"])])
def test_trailing_outputs_may_be_left_out(op, outs):
    """A node that leaves out trailing outputs (inference: no reserve_space) gets them back as
    "" when its function is attached: onnx's inference of a function call needs them all."""
    from onnxgrad.rnn.ops import op_inputs
    rng = np.random.default_rng(15)
    x, h0, c0 = inputs("lstm", 1, UNI, np.float64, rng)
    p = rng.standard_normal(params_size("lstm", 1, H, I)) * 0.5
    y, hn, cn, rs = rnn_forward(x, h0, c0, p, "lstm", UNI)
    gy = rng.standard_normal(y.shape)
    vals = {"input": x, "input_h": h0, "input_c": c0, "params": p, "output": y, "output_h": hn,
            "output_c": cn, "output_backprop": gy, "output_h_backprop": np.zeros_like(hn),
            "output_c_backprop": np.zeros_like(cn), "reserve_space": rs}
    names = op_inputs(op)
    node = make_node(op, names, outs, name="n")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(k, TP.DOUBLE,
                                                                      np.shape(vals[k]))
                                        for k in names],
                          [helper.make_tensor_value_info(o, TP.DOUBLE, np.shape(v))
                           for o, v in zip(outs, [x, h0] if "dx" in outs else [y, hn])])
    m = attach_functions(helper.make_model(g, opset_imports=[
        helper.make_opsetid("", 18), helper.make_opsetid("onnxgrad", 1)], ir_version=10))
    assert len(m.graph.node[0].output) == 4 + op.endswith("V2") and \
        list(m.graph.node[0].output[:len(outs)]) == outs
    onnx.checker.check_model(m, full_check=True)
    got = session(m).run(outs, {k: vals[k] for k in names})
    if op.startswith("CudnnRNNBackprop"):
        want = rnn_backward(x, h0, c0, p, gy, None, None, rs, "lstm", UNI)
    else:
        want = (y, hn)
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=1e-10, atol=1e-12)


def test_nodx_is_a_backward_variant():
    from onnxgrad.rnn.ops import Variant
    with pytest.raises(ValueError, match="backward op's variant"):
        make_function("CudnnRNNV2", variant=Variant(nodx=True))
    f = make_function("CudnnRNNBackpropV2", "gru", variant=Variant(nodx=True))
    assert f.overload == "gru.unidirectional.linear_input.L1.nodx"


def assert_directional_fd(f, bwd, grads, ys, prim, cot, rng, eps=1e-6):
    """float64 central differences of <outputs of session f, cot> along two random directions
    per input in ``prim`` (x, h0, c0, p) against the gradients ``grads`` of session bwd."""
    def objective(feeds):
        outs = dict(zip(ys, f.run(ys, feeds)))
        return sum(float((outs[k[2:]] * v).sum()) for k, v in cot.items())

    got = dict(zip(["x", "h0", "c0", "p"], bwd.run(grads, {**prim, **cot})))
    for name in prim:
        for _ in range(2):
            v = rng.standard_normal(prim[name].shape)
            fd = (objective({**prim, name: prim[name] + eps * v})
                  - objective({**prim, name: prim[name] - eps * v})) / (2 * eps)
            an = float((got[name] * v).sum())
            assert abs(fd - an) <= 1e-6 * max(1.0, abs(fd)), (name, fd, an)


# -- errors --------------------------------------------------------------------------------------
def test_rule_needs_is_training():
    fwd = rnn_model("CudnnRNNV2", "lstm", 1, UNI, attach=False, is_training=0)
    with pytest.raises(ValueError, match=r"To use CudnnRNNV2 in gradients, is_training must be "
                                         r"set to True\."):
        onnxgrad.gradients(fwd, "y", "x")
    fwd = rnn_model("CudnnRNN", "gru", 1, UNI, attach=False, is_training=0)
    with pytest.raises(ValueError, match="To use CudnnRNN in gradients"):
        onnxgrad.gradients(fwd, "y", "x")


@pytest.mark.parametrize("op", ["CudnnRNNV2", "LSTM"])
def test_second_order_is_refused_not_taken_through_the_body(op):
    """The gradient model holds the backward op's function body (attach_functions), which the
    model-function fallback could differentiate. It must not: the forward rule gives
    reserve_space no gradient, so that body's gradient misses terms (the fuzzer found
    second-order gradients through it 0 or off, seed 1902, before onnxgrad's own ops were kept
    out of the fallback). Refused instead, and the same for reserve_space read by the graph."""
    if op == "LSTM":
        nodes = [helper.make_node("LSTM", ["x", "w", "r"], ["y"], hidden_size=H)]
        ins = [helper.make_tensor_value_info("x", TP.DOUBLE, [T, B, I]),
               helper.make_tensor_value_info("w", TP.DOUBLE, [1, 4 * H, I]),
               helper.make_tensor_value_info("r", TP.DOUBLE, [1, 4 * H, H])]
        fwd = helper.make_model(helper.make_graph(nodes, "lstm", ins, [
            helper.make_tensor_value_info("y", TP.DOUBLE, [T, 1, B, H])]),
            opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
        xs = ["x", "w"]
    else:
        fwd, xs = rnn_model(op, "lstm", 1, UNI, dtype=TP.DOUBLE), ["x", "p"]
    first = onnxgrad.gradients(fwd, "y", xs)
    assert first.model.functions  # the backward's body is in the model
    with pytest.raises(onnxgrad.NotDifferentiableError, match="CudnnRNNBackpropV2"):
        onnxgrad.gradients(first.model, first.grads[0], xs)
    if op == "CudnnRNNV2":
        sq = helper.make_node("ReduceSum", ["rs"], ["rsum"], keepdims=0)
        m = onnx.ModelProto()
        m.CopyFrom(fwd)
        m.graph.node.append(sq)
        m.graph.output.append(helper.make_tensor_value_info("rsum", TP.DOUBLE, []))
        with pytest.raises(onnxgrad.NotDifferentiableError, match="reserve_space is the "
                                                                  "workspace"):
            onnxgrad.gradients(m, ["y", "rsum"], "x")
        res = onnxgrad.gradients(m, ["y", "rsum"], "x", stop_gradients=["rs"])
        assert res.grads[0] is not None


def test_attach_errors_and_idempotence():
    key = lambda m: m.graph.node[0].overload  # noqa: E731
    assert key(rnn_model("CudnnRNNV2", "lstm", 2, UNI, dropout=0.5)).endswith(".L2.drop")
    # no dropout with one layer (as cuDNN), nor in inference
    assert key(rnn_model("CudnnRNNV2", "lstm", 1, UNI, dropout=0.5)).endswith(".L1")
    assert key(rnn_model("CudnnRNNV2", "lstm", 2, UNI, dropout=0.5, is_training=0)).endswith(
        ".L2")
    with pytest.raises(ValueError, match=r"dropout=1\.0 must be in \[0, 1\)"):
        rnn_model("CudnnRNNV2", "lstm", 2, UNI, dropout=1.0)
    with pytest.raises(NotImplementedError, match="num_proj"):
        rnn_model("CudnnRNNV2", "lstm", 1, UNI, num_proj=3)
    with pytest.raises(ValueError, match="input_size == num_units"):
        attach_functions(onnx.ModelProto.FromString(_skip_mismatch()))
    m = rnn_model("CudnnRNNV2", "lstm", 1, UNI, dims=(T, B, I, H), attach=False)
    m.graph.input[1].type.tensor_type.shape.dim[0].dim_param = "N"
    with pytest.raises(ValueError, match="num_layers comes from input_h's first dim"):
        attach_functions(m)
    m.graph.node[0].overload = "lstm.unidirectional.linear_input.L1"  # an explicit overload works
    a = attach_functions(m)
    assert len(a.functions) == 1 and attach_functions(a).SerializeToString() == \
        a.SerializeToString()
    with pytest.raises(ValueError, match="opset >= 14"):
        make_function("CudnnRNN", opset=13)


def _skip_mismatch():
    """A skip_input model whose input_size (I) differs from num_units (H)."""
    m = rnn_model("CudnnRNNV2", "lstm", 1, UNI, attach=False)
    for a in m.graph.node[0].attribute:
        if a.name == "input_mode":
            a.s = b"skip_input"
    return m.SerializeToString()


@pytest.mark.parametrize("opset,mode", [(13, "rnn_relu"), (14, "lstm"), (21, "gru")])
def test_function_bodies_follow_the_model_opset(opset, mode):
    """The bodies are written at the model's own ai.onnx opset (no CastLike before 15); a model
    at 13 is upgraded to 14, the bodies' least (see rnn.ops.MIN_OPSET)."""
    fwd = rnn_model("CudnnRNNV2", mode, 2, BI, TP.DOUBLE, attach=False)
    fwd.opset_import[0].version = opset
    res = onnxgrad.gradients(fwd, "y", ["x", "p"])
    model = res.model
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == max(opset, 14)
    assert all(f.opset_import[0].version == max(opset, 14) for f in model.functions)
    rng = np.random.default_rng(6)
    x, h0, c0 = inputs(mode, 2, BI, np.float64, rng)
    p = rng.standard_normal(params_size(mode, 2, H, I, BI)) * 0.5
    dx, dp = session(model).run(res.grads, {"x": x, "h0": h0, "c0": c0, "p": p})
    y, _, _, rs = rnn_forward(x, h0, c0, p, mode, BI)
    want = rnn_backward(x, h0, c0, p, np.ones_like(y), None, None, rs, mode, BI)
    np.testing.assert_allclose(dx, want[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dp, want[3], rtol=1e-10, atol=1e-12)


# -- validation: host_reserved and forward/backward mismatches -----------------------------------
def _backward_model(mode, fwd_attrs, bwd_attrs, host_input=False):
    """Forward CudnnRNNV2 feeding a CudnnRNNBackpropV2 (host_reserved from a graph input when
    ``host_input``)."""
    L, nd = 1, 1
    P = params_size(mode, L, H, I)
    dt = TP.DOUBLE
    ins = [helper.make_tensor_value_info("x", dt, [T, B, I]),
           helper.make_tensor_value_info("h0", dt, [L * nd, B, H]),
           helper.make_tensor_value_info("c0", dt, [L * nd, B, H]),
           helper.make_tensor_value_info("p", dt, [P]),
           helper.make_tensor_value_info("gy", dt, [T, B, H])]
    if host_input:
        ins.append(helper.make_tensor_value_info("hr_in", TP.INT8, ["n"]))
    fwd = make_node("CudnnRNNV2", ["x", "h0", "c0", "p"], ["y", "hn", "cn", "rs", "hr"],
                    name="fwd", **fwd_attrs)
    bwd = make_node("CudnnRNNBackpropV2", ["x", "h0", "c0", "p", "y", "hn", "cn", "gy", "h0", "c0",
                                           "rs", "hr_in" if host_input else "hr"],
                    ["dx", "dh", "dc", "dp"], name="bwd", **bwd_attrs)
    g = helper.make_graph([fwd, bwd], "g", ins, [helper.make_tensor_value_info("dx", dt, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                               helper.make_opsetid("onnxgrad", 1)], ir_version=10)


def test_forward_backward_mismatch_is_a_build_time_error():
    m = _backward_model("lstm", dict(rnn_mode="lstm"), dict(rnn_mode="gru"))
    with pytest.raises(ValueError, match=r"bwd.*reads 'rs' of CudnnRNNV2 'fwd'.*rnn_mode: "
                                         r"'lstm' vs 'gru'"):
        attach_functions(m)
    m = _backward_model("lstm", dict(rnn_mode="lstm", seed=1), dict(rnn_mode="lstm"))
    with pytest.raises(ValueError, match="seed: 1 vs 0"):
        attach_functions(m)
    attach_functions(_backward_model("gru", dict(rnn_mode="gru"), dict(rnn_mode="gru")))


@pytest.mark.parametrize("bad", [[111, 3, 0, 0, 1], [111, 2, 0, 0, 2], [0, 2, 0, 0, 1]])
def test_host_reserved_is_checked_at_run_time(bad):
    rng = np.random.default_rng(10)
    m = attach_functions(_backward_model("lstm", dict(rnn_mode="lstm"), dict(rnn_mode="lstm"),
                                         host_input=True))
    s = session(m)
    x, h0, c0 = inputs("lstm", 1, UNI, np.float64, rng)
    feeds = {"x": x, "h0": h0, "c0": c0, "p": rng.standard_normal(params_size("lstm", 1, H, I)),
             "gy": rng.standard_normal((T, B, H))}
    good = s.run(None, {**feeds, "hr_in": np.array([111, 2, 0, 0, 1], np.int8)})[0]
    assert good.shape == x.shape
    with pytest.raises(Exception, match="reserve_space_does_not_match_this_configuration_or_the_"
                                        "forward_op_host_reserved"):
        s.run(None, {**feeds, "hr_in": np.array(bad, np.int8)})
    with pytest.raises(Exception, match="host_reserved_must_have_5_entries"):
        s.run(None, {**feeds, "hr_in": np.array([111, 2], np.int8)})


# -- CUDA ----------------------------------------------------------------------------------------
def test_cuda_backward_matches_cpu():
    """The same gradient graph on onnxruntime's CUDA provider gives the CPU numbers (skipped
    without a GPU; bench/rnn_gpu.py checks node placement and times it against cuDNN)."""
    from onnxgrad.runtime import cuda_available, session as make_session
    if not cuda_available():
        pytest.skip("no CUDA session can be created here")
    rng = np.random.default_rng(11)
    fwd = rnn_model("CudnnRNNV2", "lstm", 2, BI, TP.FLOAT, attach=False)
    res = onnxgrad.gradients(fwd, ["y", "hn", "cn"], ["x", "h0", "c0", "p"])
    x, h0, c0 = inputs("lstm", 2, BI, np.float32, rng)
    p = (rng.standard_normal(params_size("lstm", 2, H, I, BI)) * 0.5).astype(np.float32)
    feeds = {"x": x, "h0": h0, "c0": c0, "p": p}
    cpu = make_session(res.model, "cpu").run(res.grads, feeds)
    gpu = make_session(res.model, "cuda").run(res.grads, feeds)
    for a, b in zip(cpu, gpu):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_float16_backward(mode):
    """float16 end to end on onnxruntime CPU (the bodies are polymorphic in T): within float16's
    precision of the float64 reference."""
    rng = np.random.default_rng(12)
    fwd = rnn_model("CudnnRNNV2", mode, 2, BI, TP.FLOAT16, attach=False)
    res = onnxgrad.gradients(fwd, "y", ["x", "h0", "p"])
    x, h0, c0 = inputs(mode, 2, BI, np.float64, rng)
    p = rng.standard_normal(params_size(mode, 2, H, I, BI)) * 0.5
    f16 = lambda a: a.astype(np.float16)  # noqa: E731
    got = session(res.model).run(res.grads, {"x": f16(x), "h0": f16(h0), "c0": f16(c0),
                                             "p": f16(p)})
    up = lambda a: a.astype(np.float16).astype(np.float64)  # noqa: E731
    y, _, _, rs = rnn_forward(up(x), up(h0), up(c0), up(p), mode, BI)
    want = rnn_backward(up(x), up(h0), up(c0), up(p), np.ones_like(y), None, None, rs, mode, BI)
    for a, w in zip(got, [want[0], want[1], want[3]]):
        assert a.dtype == np.float16
        assert np.abs(a - w).max() <= 1e-2 * max(1.0, np.abs(w).max())
