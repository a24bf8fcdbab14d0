"""Gradients of ONNX's own LSTM, GRU and RNN ops (through the onnxgrad CudnnRNN family): against
torch autograd (hand-built and torch.onnx-exported models), against finite differences of a NumPy
model of ONNX's semantics (itself checked against onnxruntime), and over the onnx backend node
test cases."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import onnxgrad
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

T, B, I, H = 4, 3, 5, 6
G = {"LSTM": 4, "GRU": 3, "RNN": 1}
_sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731


# -- a NumPy model of ONNX's LSTM/GRU/RNN (onnxruntime's semantics, clip included) ------------
def onnx_rnn_np(op, X, W, R, Bias=None, h0=None, c0=None, P=None, direction="forward",
                layout=0, clip=None, linear_before_reset=0, activations=None):
    """(Y, Y_h[, Y_c]) as onnxruntime computes them."""
    nd = 2 if direction == "bidirectional" else 1
    if layout:
        X = X.transpose(1, 0, 2)
        h0 = None if h0 is None else h0.transpose(1, 0, 2)
        c0 = None if c0 is None else c0.transpose(1, 0, 2)
    Tn, Bn = X.shape[:2]
    Hn = R.shape[-1]
    g = G[op]
    Bias = np.zeros((nd, 2 * g * Hn), X.dtype) if Bias is None else Bias
    h0 = np.zeros((nd, Bn, Hn), X.dtype) if h0 is None else h0
    c0 = np.zeros((nd, Bn, Hn), X.dtype) if c0 is None else c0
    P = np.zeros((nd, 3 * Hn), X.dtype) if P is None else P
    cl = (lambda v: v) if clip is None else (lambda v: np.clip(v, -clip, clip))  # noqa: E731
    act = np.tanh if not activations or activations[0].lower() == "tanh" else \
        (lambda v: np.maximum(v, 0))
    Y, Yh, Yc = np.zeros((Tn, nd, Bn, Hn), X.dtype), [], []
    for d in range(nd):
        rev = direction == "reverse" or d == 1
        w, r, wb, rb = W[d], R[d], Bias[d, :g * Hn], Bias[d, g * Hn:]
        h, c = h0[d], c0[d]
        for t in (reversed(range(Tn)) if rev else range(Tn)):
            xw = X[t] @ w.T + wb
            if op == "LSTM":
                gs = xw + h @ r.T + rb
                gi, go, gf, gc = np.split(gs, 4, 1)
                pi, po, pf = np.split(P[d], 3)
                i, f = _sig(cl(gi + pi * c)), _sig(cl(gf + pf * c))
                c = f * c + i * np.tanh(cl(gc))
                h = _sig(cl(go + po * c)) * np.tanh(c)
            elif op == "GRU":
                (xz, xr, xh), (rz, rr, rh), (bz, br, bh) = (np.split(a, 3, i) for a, i in
                                                            [(xw, 1), (r, 0), (rb, 0)])
                z, rr_ = _sig(cl(xz + h @ rz.T + bz)), _sig(cl(xr + h @ rr.T + br))
                if linear_before_reset:
                    nn_ = np.tanh(cl(xh + rr_ * (h @ rh.T + bh)))
                else:
                    nn_ = np.tanh(cl(xh + (rr_ * h) @ rh.T + bh))
                h = (1 - z) * nn_ + z * h
            else:
                h = act(cl(xw + h @ r.T + rb))
            Y[t, d] = h
        Yh.append(h)
        Yc.append(c)
    Yh, Yc = np.stack(Yh), np.stack(Yc)
    if layout:
        Y, Yh, Yc = Y.transpose(2, 0, 1, 3), Yh.transpose(1, 0, 2), Yc.transpose(1, 0, 2)
    return (Y, Yh, Yc) if op == "LSTM" else (Y, Yh)


ORDER = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]


def onnx_rnn_model(op, feeds, dtype=TP.DOUBLE, opset=18, seq_lens=None, **attrs):
    """A one-node model with the given inputs (names from ORDER) as graph inputs."""
    names = [k if k in feeds or (k == "sequence_lens" and seq_lens is not None) else ""
             for k in ORDER]
    while names[-1] == "":
        names.pop()
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    hid = feeds["R"].shape[-1]
    node = helper.make_node(op, names, outs, name="rnn", hidden_size=hid, **attrs)
    inits = [] if seq_lens is None else [numpy_helper.from_array(
        np.asarray(seq_lens, np.int32), "sequence_lens")]
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(k, dtype, v.shape)
                                        for k, v in feeds.items()],
                          [helper.make_tensor_value_info(o, dtype, None) for o in outs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return onnx.shape_inference.infer_shapes(m)


def rand_feeds(op, rng, dtype=np.float64, nd=1, layout=0, init=True, bias=True, peep=False,
               t=T, b=B, i=I, h=H, scale=0.5):
    g = G[op]
    r = lambda *s: (rng.standard_normal(s) * scale).astype(dtype)  # noqa: E731
    f = {"X": r(b, t, i) if layout else r(t, b, i), "W": r(nd, g * h, i), "R": r(nd, g * h, h)}
    if bias:
        f["B"] = r(nd, 2 * g * h)
    if init:
        f["initial_h"] = r(b, nd, h) if layout else r(nd, b, h)
        if op == "LSTM":
            f["initial_c"] = r(b, nd, h) if layout else r(nd, b, h)
    if peep:
        f["P"] = r(nd, 3 * h)
    return f


def without_forward(model, outputs, dtype=TP.DOUBLE):
    """The gradient model with the ONNX RNN node itself taken out (onnxruntime runs LSTM/GRU/RNN
    neither in float64 nor with layout=1) and only ``outputs`` kept; the node's outputs that the
    gradient graph reads (an RNN's Y) become graph inputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    fwd = next((n for n in m.graph.node if n.name == "rnn"), None)
    if fwd is not None:  # LSTM/GRU and clipped RNN nodes are replaced by the family's forward op
        m.graph.node.remove(fwd)
        used = {i for n in m.graph.node for i in n.input}
        declared = {v.name: v for v in [*m.graph.output, *m.graph.value_info]}
        m.graph.input.extend(onnx.ValueInfoProto.FromString(declared[o].SerializeToString())
                             if o in declared else helper.make_tensor_value_info(o, dtype, None)
                             for o in fwd.output if o in used)
    outs = [o for o in m.graph.output if o.name in outputs]
    del m.graph.output[:]
    m.graph.output.extend(outs)
    return m


def session(model):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _np_kwargs(feeds, attrs):
    kw = {"Bias": feeds.get("B"), "h0": feeds.get("initial_h"), "c0": feeds.get("initial_c"),
          "P": feeds.get("P")}
    kw.update({k: v for k, v in attrs.items() if k != "hidden_size"})
    return kw


def fd_check(op, feeds, attrs, rng, eps=1e-6, probes=2, seq_lens=None, xs=None):
    """onnxgrad's gradients (float64 on onnxruntime) against central differences of the NumPy
    model, along random directions, for every input in ``xs`` (all by default)."""
    model = onnx_rnn_model(op, feeds, seq_lens=seq_lens, **attrs)
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    xs = xs or list(feeds)
    t = feeds["X"].shape[1 if attrs.get("layout") else 0]
    assert not probes or seq_lens is None or np.all(np.asarray(seq_lens) == t), \
        "the NumPy model runs every step: no finite differences with shorter sequence_lens"
    res = onnxgrad.gradients(model, outs, xs, grad_ys=["g_" + o for o in outs])
    onnx.checker.check_model(res.model, full_check=True)
    ref = onnx_rnn_np(op, feeds["X"], feeds["W"], feeds["R"], **_np_kwargs(feeds, attrs))
    cot = {"g_" + o: rng.standard_normal(v.shape) for o, v in zip(outs, ref)}
    run_model = without_forward(res.model, res.grads)
    fwd_vals = {k: v for k, v in zip(outs, ref) if k in {i.name for i in run_model.graph.input}}
    got = dict(zip(xs, session(run_model).run(res.grads, {**feeds, **cot, **fwd_vals})))
    res.values = got  # (for callers comparing two calls)

    def objective(f):
        vals = onnx_rnn_np(op, f["X"], f["W"], f["R"], **_np_kwargs(f, attrs))
        return sum(float((v * cot["g_" + o]).sum()) for o, v in zip(outs, vals))

    for name in xs:
        assert got[name].shape == feeds[name].shape, name
        for _ in range(probes):
            v = rng.standard_normal(feeds[name].shape)
            fd = (objective({**feeds, name: feeds[name] + eps * v})
                  - objective({**feeds, name: feeds[name] - eps * v})) / (2 * eps)
            an = float((got[name] * v).sum())
            assert abs(fd - an) <= 1e-6 * max(1.0, abs(fd)), (name, fd, an)
    return res


# -- the NumPy model is onnxruntime's semantics --------------------------------------------------
@pytest.mark.parametrize("op,attrs,peep", [
    ("LSTM", dict(direction="bidirectional", clip=0.8), True),
    ("LSTM", dict(direction="reverse"), False),
    ("GRU", dict(direction="bidirectional", linear_before_reset=0, clip=0.7), False),
    ("GRU", dict(direction="reverse", linear_before_reset=1), False),
    ("RNN", dict(direction="bidirectional", clip=0.6, activations=["Relu", "Relu"]), False),
])
def test_numpy_model_matches_onnxruntime(op, attrs, peep):
    rng = np.random.default_rng(0)
    nd = 2 if attrs.get("direction") == "bidirectional" else 1
    feeds = rand_feeds(op, rng, np.float32, nd, attrs.get("layout", 0), peep=peep, scale=1.0)
    got = session(onnx_rnn_model(op, feeds, TP.FLOAT, **attrs)).run(None, feeds)
    want = onnx_rnn_np(op, feeds["X"], feeds["W"], feeds["R"], **_np_kwargs(feeds, attrs))
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)


# -- finite differences, every mode ------------------------------------------------------------
FD_CASES = [
    ("LSTM", dict(), dict()),
    ("LSTM", dict(direction="reverse", layout=1), dict(init=False)),
    ("LSTM", dict(direction="bidirectional", clip=0.9), dict(peep=True)),
    ("LSTM", dict(direction="forward"), dict(peep=True, bias=False)),
    ("LSTM", dict(direction="bidirectional", clip=0.7), dict(init=False)),
    ("GRU", dict(linear_before_reset=1), dict()),
    ("GRU", dict(linear_before_reset=0, direction="bidirectional"), dict()),
    ("GRU", dict(linear_before_reset=0, direction="reverse", clip=0.7, layout=1), dict()),
    ("GRU", dict(linear_before_reset=1, direction="bidirectional", clip=0.6), dict(bias=False)),
    ("RNN", dict(), dict()),
    ("RNN", dict(direction="bidirectional", activations=["Relu", "Relu"]), dict(init=False)),
    ("RNN", dict(direction="reverse", clip=0.5, layout=1), dict()),
]


@pytest.mark.parametrize("op,attrs,kw", FD_CASES,
                         ids=[f"{op}-{'-'.join(f'{k}={v}' for k, v in a.items())}-"
                              f"{'-'.join(k for k in kw)}" for op, a, kw in FD_CASES])
def test_finite_differences(op, attrs, kw):
    rng = np.random.default_rng(1)
    nd = 2 if attrs.get("direction") == "bidirectional" else 1
    feeds = rand_feeds(op, rng, np.float64, nd, attrs.get("layout", 0), **kw,
                       scale=1.0 if "clip" in attrs else 0.5)
    res = fd_check(op, feeds, attrs, rng)
    ops = [n.op_type for n in res.model.graph.node if n.domain == "onnxgrad"]
    ex = "clip" in attrs or kw.get("peep") or (op == "GRU" and not attrs["linear_before_reset"])
    if op == "RNN" and "clip" not in attrs:
        assert ops == ["CudnnRNNBackpropV2"]  # the RNN's Y is its reserve_space: no recompute
    else:
        assert ops == (["OnnxRNN", "OnnxRNNBackprop"] if ex else
                       ["CudnnRNNV2", "CudnnRNNBackpropV2"])


REPLACE_CASES = [
    ("LSTM", dict(), dict()),
    ("LSTM", dict(direction="reverse", layout=1), dict(peep=True)),
    ("LSTM", dict(direction="bidirectional", clip=0.9), dict(init=False, bias=False)),
    ("GRU", dict(linear_before_reset=0, direction="reverse"), dict()),
    ("GRU", dict(linear_before_reset=1, direction="bidirectional", layout=1), dict()),
    ("RNN", dict(direction="bidirectional", clip=0.5), dict()),
]


@pytest.mark.parametrize("op,attrs,kw", REPLACE_CASES)
def test_forward_node_is_replaced(op, attrs, kw):
    """The gradient of an LSTM/GRU node (and of a clipped RNN) puts the family's forward op in
    place of the node, so the forward runs once: the gradient model has no ai.onnx RNN node
    left, and its Y, Y_h[, Y_c] (under the node's names, graph outputs included, float64 on
    onnxruntime) are ONNX's outputs; a node the outputs feed reads the new values."""
    rng = np.random.default_rng(11)
    nd = 2 if attrs.get("direction") == "bidirectional" else 1
    feeds = rand_feeds(op, rng, np.float64, nd, attrs.get("layout", 0), **kw, scale=1.0)
    model = onnx_rnn_model(op, feeds, **attrs)
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    g = model.graph  # a consumer of Y_h, as a second graph output
    g.node.append(helper.make_node("Neg", ["Y_h"], ["negYh"]))
    g.output.append(helper.make_tensor_value_info("negYh", TP.DOUBLE, None))
    res = onnxgrad.gradients(model, outs + ["negYh"], list(feeds),
                             grad_ys=["g_" + o for o in outs + ["negYh"]])
    onnx.checker.check_model(res.model, full_check=True)
    assert not [n for n in res.model.graph.node if n.op_type in G and n.domain == ""]
    fwd_op = [n.op_type for n in res.model.graph.node if n.op_type in ("CudnnRNNV2", "OnnxRNN")]
    assert len(fwd_op) == 1
    ref = onnx_rnn_np(op, feeds["X"], feeds["W"], feeds["R"], **_np_kwargs(feeds, attrs))
    cot = {"g_" + o: rng.standard_normal(v.shape) for o, v in zip(outs, ref)}
    cot["g_negYh"] = rng.standard_normal(ref[1].shape)
    got = session(res.model).run(outs + ["negYh"], {**feeds, **cot})
    # clip is a float attribute: the bound is float32's nearest to it
    tol = dict(rtol=1e-6, atol=1e-7) if "clip" in attrs else dict(rtol=1e-10, atol=1e-12)
    for name, a, w in zip(outs + ["negYh"], got, list(ref) + [-ref[1]]):
        np.testing.assert_allclose(a, w, err_msg=name, **tol)


# -- against torch autograd ----------------------------------------------------------------------
def run_gradients(res, fwd_model, feeds, cot, fwd_vals=None):
    """res.grads on onnxruntime. float64: ONNX's LSTM/GRU/RNN nodes left in the gradient model
    (no float64 kernels in onnxruntime; LSTM and GRU nodes are replaced by the onnxgrad forward
    op, an RNN without clip stays) are evaluated by onnx.reference and fed in; everything else
    runs on onnxruntime."""
    if feeds[next(iter(feeds))].dtype != np.float64:
        return session(res.model).run(res.grads, {**feeds, **cot})
    from onnx.reference import ReferenceEvaluator
    m = onnx.ModelProto()
    m.CopyFrom(res.model)
    rnns = [n for n in m.graph.node if n.op_type in G and n.domain in ("", "ai.onnx")]
    names = [o for n in rnns for o in n.output if o]
    vals = fwd_vals or dict(zip(names, ReferenceEvaluator(fwd_model).run(names, feeds)))
    for n in rnns:
        m.graph.node.remove(n)
    used = {i for n in m.graph.node for i in n.input} | {o.name for o in m.graph.output}
    m.graph.input.extend(helper.make_tensor_value_info(o, TP.DOUBLE, np.shape(vals[o]))
                         for o in names if o in used)
    keep = [o for o in m.graph.output if o.name in res.grads]
    del m.graph.output[:]
    m.graph.output.extend(keep)
    extra = {k: v for k, v in vals.items() if k in used and k in names}
    return session(m).run(res.grads, {**feeds, **cot, **extra})


def torch_module(op, L, bi, dtype, mode="tanh", seed=0):
    torch.manual_seed(seed)
    if op == "RNN":
        m = torch.nn.RNN(I, H, L, nonlinearity=mode, bidirectional=bi)
    else:
        m = getattr(torch.nn, op)(I, H, L, bidirectional=bi)
    return m.to(dtype)


def onnx_weights(m, op, layer, grad=False):
    """torch's layer weights (or their grads) as ONNX's W, R, B (gate order iofc / zrh)."""
    perm = {"LSTM": [0, 3, 1, 2], "GRU": [1, 0, 2], "RNN": [0]}[op]  # ONNX gate k <- torch
    get = (lambda k: getattr(m, k).grad.numpy()) if grad else \
        (lambda k: getattr(m, k).detach().numpy())
    nd = 2 if m.bidirectional else 1
    re = lambda a: np.concatenate([np.split(a, G[op])[p] for p in perm])  # noqa: E731
    out = {"W": [], "R": [], "B": []}
    for d in range(nd):
        sfx = f"_l{layer}" + ("_reverse" if d else "")
        out["W"].append(re(get("weight_ih" + sfx)))
        out["R"].append(re(get("weight_hh" + sfx)))
        out["B"].append(np.concatenate([re(get("bias_ih" + sfx)), re(get("bias_hh" + sfx))]))
    return {k: np.stack(v) for k, v in out.items()}


def torch_grads(m, op, x, h0, c0, cots):
    xt = torch.tensor(x, requires_grad=True)
    ht = None if h0 is None else torch.tensor(h0, requires_grad=True)
    ct = None if c0 is None else torch.tensor(c0, requires_grad=True)
    m.zero_grad()
    if op == "LSTM":
        y, (hn, cn) = m(xt, None if ht is None else (ht, ct))
        outs = [y, hn, cn]
    else:
        y, hn = m(xt, ht)
        outs = [y, hn]
    sum(((o * torch.tensor(c)).sum() for o, c in zip(outs, cots))).backward()
    return xt.grad.numpy(), None if ht is None else ht.grad.numpy(), \
        None if ct is None else ct.grad.numpy()


@pytest.mark.parametrize("op,mode", [("LSTM", None), ("GRU", None), ("RNN", "tanh"),
                                     ("RNN", "relu")])
@pytest.mark.parametrize("bi,init,dtype", [(False, True, np.float32), (True, False, np.float64),
                                           (True, True, np.float64)])
def test_helper_model_matches_torch(op, mode, bi, init, dtype):
    """One ONNX node built with onnx.helper from a torch module's weights."""
    rng = np.random.default_rng(2)
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    m = torch_module(op, 1, bi, tdt, mode or "tanh")
    nd = 2 if bi else 1
    feeds = {"X": rng.standard_normal((T, B, I)).astype(dtype), **onnx_weights(m, op, 0)}
    if init:
        feeds["initial_h"] = rng.standard_normal((nd, B, H)).astype(dtype)
        if op == "LSTM":
            feeds["initial_c"] = rng.standard_normal((nd, B, H)).astype(dtype)
    attrs = {"direction": "bidirectional" if bi else "forward"}
    if op == "RNN":
        attrs["activations"] = [mode.capitalize()] * nd
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    ttype = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = onnx_rnn_model(op, feeds, ttype, **attrs)
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    xs = list(feeds)
    res = onnxgrad.gradients(model, outs, xs, grad_ys=["g_" + o for o in outs])
    shapes = {"Y": (T, nd, B, H), "Y_h": (nd, B, H), "Y_c": (nd, B, H)}
    cot = {"g_" + o: rng.standard_normal(shapes[o]).astype(dtype) for o in outs}
    ref = onnx_rnn_np(op, feeds["X"], feeds["W"], feeds["R"], **_np_kwargs(feeds, attrs))
    got = dict(zip(xs, run_gradients(res, model, feeds, cot, dict(zip(outs, ref)))))
    # torch's y is [T, B, nd*H]: ONNX's Y [T, nd, B, H] transposed
    tc = [cot["g_Y"].transpose(0, 2, 1, 3).reshape(T, B, nd * H), cot["g_Y_h"]] + \
        ([cot["g_Y_c"]] if op == "LSTM" else [])
    dx, dh0, dc0 = torch_grads(m, op, feeds["X"], feeds.get("initial_h"),
                               feeds.get("initial_c"), tc)
    want = {"X": dx, "initial_h": dh0, "initial_c": dc0, **onnx_weights(m, op, 0, grad=True)}
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)
    for k in xs:
        np.testing.assert_allclose(got[k], want[k], err_msg=k, **tol)


def export(m, op, init, dtype):
    import io
    import warnings
    x = torch.zeros(T, B, I, dtype=m.weight_ih_l0.dtype)
    nd = 2 if m.bidirectional else 1
    h = torch.zeros(m.num_layers * nd, B, H, dtype=x.dtype)
    args = (x,) if not init else ((x, (h, h)) if op == "LSTM" else (x, h))
    names = ["x"] + (["h0"] + (["c0"] if op == "LSTM" else []) if init else [])
    outs = ["y", "hn"] + (["cn"] if op == "LSTM" else [])
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, args, f, dynamo=False, opset_version=17, input_names=names,
                          output_names=outs)
    return onnx.load_from_string(f.getvalue()), names, outs


EXPORT_CASES = [("LSTM", 1, False, True, np.float32), ("LSTM", 2, True, True, np.float64),
                ("LSTM", 3, False, False, np.float32), ("GRU", 2, True, False, np.float32),
                ("GRU", 3, True, True, np.float64), ("RNN", 2, False, True, np.float64),
                ("RNN", 1, True, True, np.float32)]


@pytest.mark.parametrize("op,L,bi,init,dtype", EXPORT_CASES)
def test_torch_exported_model_matches_torch(op, L, bi, init, dtype):
    """torch.onnx.export (TorchScript exporter, dynamo=False) of nn.LSTM/GRU/RNN: stacked ONNX
    nodes with Transpose/Reshape between them; every gradient equals torch autograd's."""
    rng = np.random.default_rng(3)
    m = torch_module(op, L, bi, torch.float64 if dtype == np.float64 else torch.float32)
    model, names, outs = export(m, op, init, dtype)
    nd = 2 if bi else 1
    # the exporter's initializers, identified by value
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    want_w, xs_w = {}, []
    for layer in range(L):
        vals = onnx_weights(m, op, layer)
        for k, v in vals.items():
            name = next(n for n, a in inits.items() if a.shape == v.shape and np.array_equal(a, v))
            xs_w.append(name)
            want_w[name] = (layer, k)
    feeds = {"x": rng.standard_normal((T, B, I)).astype(dtype)}
    if init:
        feeds["h0"] = rng.standard_normal((L * nd, B, H)).astype(dtype)
        if op == "LSTM":
            feeds["c0"] = rng.standard_normal((L * nd, B, H)).astype(dtype)
    xs = names + xs_w
    res = onnxgrad.gradients(model, outs, xs, grad_ys=["g_" + o for o in outs])
    onnx.checker.check_model(res.model, full_check=True)
    shapes = {"y": (T, B, nd * H), "hn": (L * nd, B, H), "cn": (L * nd, B, H)}
    cot = {"g_" + o: rng.standard_normal(shapes[o]).astype(dtype) for o in outs}
    got = dict(zip(xs, run_gradients(res, model, feeds, cot)))
    dx, dh0, dc0 = torch_grads(m, op, feeds["x"], feeds.get("h0"), feeds.get("c0"),
                               [cot["g_" + o] for o in outs])
    tol = dict(rtol=2e-4, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(got["x"], dx, **tol)
    if init:
        np.testing.assert_allclose(got["h0"], dh0, **tol)
        if op == "LSTM":
            np.testing.assert_allclose(got["c0"], dc0, **tol)
    grads = {layer: onnx_weights(m, op, layer, grad=True) for layer in range(L)}
    for name, (layer, k) in want_w.items():
        np.testing.assert_allclose(got[name], grads[layer][k], err_msg=f"{k} of layer {layer}",
                                   **tol)


# -- the onnx backend node test cases, as a gradient sweep ---------------------------------------
def _node_cases():
    import importlib
    import warnings

    import onnx.backend.test.case.node as N
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mod in ("lstm", "gru", "rnn"):
            importlib.import_module(f"onnx.backend.test.case.node.{mod}")
    return {c.name: c for c in N._NodeTestCases if c.model.graph.node[0].op_type in G}


NODE_CASES = ["test_lstm_defaults", "test_lstm_with_initial_bias", "test_lstm_with_peepholes",
              "test_lstm_batchwise", "test_lstm_reverse", "test_lstm_bidirectional",
              "test_gru_defaults", "test_gru_with_initial_bias", "test_gru_seq_length",
              "test_gru_batchwise", "test_gru_reverse", "test_gru_bidirectional",
              "test_simple_rnn_defaults", "test_simple_rnn_with_initial_bias",
              "test_simple_rnn_batchwise", "test_rnn_seq_length", "test_simple_rnn_reverse",
              "test_simple_rnn_bidirectional"]


def test_node_cases_are_all_swept():
    assert set(_node_cases()) <= set(NODE_CASES), sorted(set(_node_cases()) - set(NODE_CASES))


@pytest.mark.parametrize("name", NODE_CASES)
def test_onnx_node_case_gradients(name):
    """Every onnx backend node case of LSTM/GRU/RNN: gradients of all outputs with respect to
    every float input, in float64, against finite differences (sequence_lens, where a case has
    it, is the full length and is given as the constant it is)."""
    case = _node_cases().get(name)
    if case is None:
        pytest.skip(f"{name} is not among this onnx version's node cases")
    node = case.model.graph.node[0]
    op = node.op_type
    inputs = dict(zip([i for i in node.input if i], case.data_sets[0][0]))
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: (v.decode() if isinstance(v, bytes) else
                 [s.decode() for s in v] if isinstance(v, list) and v and
                 isinstance(v[0], bytes) else v) for k, v in attrs.items()}
    attrs.pop("hidden_size", None)
    seq = inputs.pop("sequence_lens", None) if "sequence_lens" in node.input else None
    roles = dict(zip(node.input, ORDER))
    feeds = {roles[k]: np.asarray(v, np.float64) for k, v in inputs.items()}
    rng = np.random.default_rng(7)
    fd_check(op, feeds, attrs, rng, seq_lens=seq)


def test_sequence_lens_full_constant_takes_the_plain_path():
    """A constant sequence_lens equal to T everywhere needs no masking (cuDNN's cell, and an RNN
    reads its reserve_space off Y); other lengths are checked against torch's packed sequences
    in test_rnn_seqlens.py."""
    rng = np.random.default_rng(8)
    res = onnxgrad.gradients(onnx_rnn_model("LSTM", rand_feeds("LSTM", rng), seq_lens=[T] * B),
                             "Y", "X")
    ops = {n.op_type for n in res.model.graph.node}
    assert "CudnnRNNBackpropV2" in ops and "OnnxRNN" not in ops
    res = onnxgrad.gradients(onnx_rnn_model("LSTM", rand_feeds("LSTM", rng),
                                            seq_lens=[T, T - 1, T]), "Y", "X")
    assert any(n.op_type == "OnnxRNNBackprop" and "seq" in n.overload.split(".")
               for n in res.model.graph.node)
    res = onnxgrad.gradients(onnx_rnn_model("RNN", rand_feeds("RNN", rng), seq_lens=[T] * B),
                             "Y", "X")
    assert not any(n.op_type in ("CudnnRNNV2", "OnnxRNN") for n in res.model.graph.node)


@st.composite
def _configs(draw):
    """An ONNX LSTM/GRU/RNN node with every option the rule supports drawn at random."""
    op = draw(st.sampled_from(["LSTM", "GRU", "RNN"]))
    attrs = {"direction": draw(st.sampled_from(["forward", "reverse", "bidirectional"])),
             "layout": draw(st.sampled_from([0, 1]))}
    if draw(st.booleans()):
        attrs["clip"] = draw(st.sampled_from([0.6, 1.5]))
    if op == "GRU":
        attrs["linear_before_reset"] = draw(st.sampled_from([0, 1]))
    if op == "RNN" and draw(st.booleans()):
        attrs["activations"] = ["Relu"] * (2 if attrs["direction"] == "bidirectional" else 1)
    kw = {"init": draw(st.booleans()), "bias": draw(st.booleans()),
          "peep": op == "LSTM" and draw(st.booleans())}
    lens = draw(st.none() | st.lists(st.integers(1, T), min_size=B, max_size=B))
    wanted = draw(st.sets(st.sampled_from(ORDER[:3] + ["B", "initial_h", "initial_c", "P"])))
    return op, attrs, kw, lens, wanted


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_configs())
def test_gradients_not_asked_for_are_not_computed(cfg):
    """X as data, or W, R and B all frozen: the backward op leaves input_backprop (resp.
    params_backprop) unnamed and gets the ``.nodx`` (``.nodp``) body, which skips the input
    MatMul (the weight MatMuls and bias sums) over all steps. The gradients asked for are the
    ones of the call that asks for every input, and (without sequence_lens) are checked against
    finite differences."""
    op, attrs, kw, lens, wanted = cfg
    rng = np.random.default_rng(12)
    nd = 2 if attrs["direction"] == "bidirectional" else 1
    feeds = rand_feeds(op, rng, np.float64, nd, attrs["layout"], **kw,
                       scale=1.0 if "clip" in attrs else 0.5)
    xs = [k for k in feeds if k in wanted] or ["initial_h" if "initial_h" in feeds else "W"]
    # (the NumPy model has no sequence_lens: such draws are compared with the full call only,
    # which test_rnn_seqlens.py checks against torch's packed sequences)
    res = fd_check(op, feeds, attrs, np.random.default_rng(3), seq_lens=lens, xs=xs,
                   probes=2 if lens is None else 0)
    full = fd_check(op, feeds, attrs, np.random.default_rng(3), seq_lens=lens, probes=0)
    for k in xs:
        np.testing.assert_allclose(res.values[k], full.values[k], rtol=1e-12, atol=1e-14,
                                   err_msg=k)
    nodx, nodp = "X" not in xs, not {"W", "R", "B"} & set(xs)
    bwd = [n for n in res.model.graph.node if "Backprop" in n.op_type]
    assert len(bwd) == 1
    flags = bwd[0].overload.split(".")
    assert (bwd[0].output[0] == "", "nodx" in flags) == (nodx, nodx)
    assert (bwd[0].output[3] == "", "nodp" in flags) == (nodp, nodp)

    def matmuls(r):  # in the backward op's body
        body = next(f for f in r.model.functions if f.name == bwd[0].op_type)
        return sum(n.op_type == "MatMul" for n in body.node)
    # per direction: layer 0's input MatMul; the weight MatMuls (GRU lbr=0: R in two parts)
    per_dir = nodx + nodp * (3 if op == "GRU" and not attrs["linear_before_reset"] else 2)
    assert matmuls(res) == matmuls(full) - nd * per_dir


def test_unsupported_attributes_are_named():
    rng = np.random.default_rng(9)
    m = onnx_rnn_model("LSTM", rand_feeds("LSTM", rng), input_forget=1)
    with pytest.raises(NotImplementedError, match="input_forget=1"):
        onnxgrad.gradients(m, "Y", "X")
    m = onnx_rnn_model("GRU", rand_feeds("GRU", rng), activations=["HardSigmoid", "Tanh"])
    with pytest.raises(NotImplementedError, match="activations"):
        onnxgrad.gradients(m, "Y", "X")
