"""Gradients of ONNX LSTM/GRU/RNN with a run-time ``sequence_lens`` (variable-length batches),
against torch autograd on packed sequences (torch.nn.utils.rnn.pack_padded_sequence)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import onnxgrad

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from test_onnx_rnn import onnx_weights, session, without_forward  # noqa: E402

T, B, I, H = 5, 4, 3, 4
LENS = np.array([5, 2, 4, 1], np.int32)  # unsorted, one full, one of length 1


def torch_module(op, dtype, mode="tanh"):
    torch.manual_seed(1)
    if op == "RNN":
        m = torch.nn.RNN(I, H, 1, nonlinearity=mode, bidirectional=True)
    else:
        m = getattr(torch.nn, op)(I, H, 1, bidirectional=True)
    return m.to(dtype)


def torch_packed(m, op, x, h0, c0, lens, cots):
    """torch's outputs (zero-padded) and the gradients of sum(out * cot), on packed sequences."""
    pack = torch.nn.utils.rnn.pack_padded_sequence
    xt = torch.tensor(x, requires_grad=True)
    ht = torch.tensor(h0, requires_grad=True)
    ct = torch.tensor(c0, requires_grad=True)
    m.zero_grad()
    packed = pack(xt, torch.tensor(lens, dtype=torch.int64), enforce_sorted=False)
    if op == "LSTM":
        y, (hn, cn) = m(packed, (ht, ct))
        outs = [hn, cn]
    else:
        y, hn = m(packed, ht)
        outs = [hn]
    y, _ = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=x.shape[0])
    outs = [y.reshape(T, B, 2, H).permute(0, 2, 1, 3)] + outs  # ONNX's Y [T, nd, B, H]
    sum((o * torch.tensor(c)).sum() for o, c in zip(outs, cots)).backward()
    return ([o.detach().numpy() for o in outs],
            dict(X=xt.grad.numpy(), initial_h=ht.grad.numpy(),
                 initial_c=None if ct.grad is None else ct.grad.numpy()))


def seq_model(op, feeds, dtype, direction, mode, const=False):
    names = ["X", "W", "R", "B", "sequence_lens", "initial_h"] + (["initial_c"] if op == "LSTM"
                                                                  else [])
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    attrs = {"activations": [mode.capitalize()] * (2 if direction == "bidirectional" else 1)} \
        if op == "RNN" else {}
    if op == "GRU":
        attrs["linear_before_reset"] = 1  # torch's GRU
    node = helper.make_node(op, names, outs, name="rnn", hidden_size=H, direction=direction,
                            **attrs)
    ins = [helper.make_tensor_value_info(k, dtype, feeds[k].shape) for k in names
           if k != "sequence_lens"]
    inits = []
    if const:  # a constant that is not T everywhere
        inits.append(onnx.numpy_helper.from_array(LENS, "sequence_lens"))
    else:
        ins.append(helper.make_tensor_value_info("sequence_lens", TP.INT32, ["batch"]))
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info(o, dtype, None)
                                              for o in outs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return onnx.shape_inference.infer_shapes(m)


CASES = [(op, mode, d) for op, mode in [("LSTM", None), ("GRU", None), ("RNN", "tanh"),
                                        ("RNN", "relu")]
         for d in ("forward", "reverse", "bidirectional")]


@pytest.mark.parametrize("op,direction", [("LSTM", "bidirectional"), ("GRU", "reverse")])
def test_constant_sequence_lens_matches_torch_packed(op, direction):
    rng = np.random.default_rng(4)
    m = torch_module(op, torch.float64)
    w = onnx_weights(m, op, 0)
    dirs = {"reverse": [1], "bidirectional": [0, 1]}[direction]
    x, h0, c0 = (rng.standard_normal(s) for s in [(T, B, I), (2, B, H), (2, B, H)])
    feeds = {"X": x, "W": w["W"][dirs], "R": w["R"][dirs], "B": w["B"][dirs],
             "initial_h": h0[dirs]}
    if op == "LSTM":
        feeds["initial_c"] = c0[dirs]
    gy = np.zeros((T, 2, B, H))
    gy[:, dirs] = rng.standard_normal((T, len(dirs), B, H))
    outs_t = [gy] + [np.zeros((2, B, H))] * (2 if op == "LSTM" else 1)
    _, grads_t = torch_packed(m, op, x, h0, c0, LENS, outs_t)
    model = seq_model(op, feeds, TP.DOUBLE, direction, "tanh", const=True)
    res = onnxgrad.gradients(model, "Y", ["X", "W"], grad_ys="g_Y")
    run = without_forward(res.model, res.grads)
    got = session(run).run(res.grads, {**feeds, "g_Y": gy[:, dirs]})
    np.testing.assert_allclose(got[0], grads_t["X"], rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(got[1], onnx_weights(m, op, 0, grad=True)["W"][dirs], rtol=1e-9,
                               atol=1e-11)


@pytest.mark.parametrize("op,mode,direction", CASES)
def test_sequence_lens_at_run_time_matches_torch_packed(op, mode, direction):
    rng = np.random.default_rng(3)
    m = torch_module(op, torch.float64, mode or "tanh")
    w = onnx_weights(m, op, 0)  # both directions of torch's bidirectional layer
    dirs = {"forward": [0], "reverse": [1], "bidirectional": [0, 1]}[direction]
    nd = len(dirs)
    x = rng.standard_normal((T, B, I))
    h0 = rng.standard_normal((2, B, H))
    c0 = rng.standard_normal((2, B, H))
    feeds = {"X": x, "W": w["W"][dirs], "R": w["R"][dirs], "B": w["B"][dirs],
             "initial_h": h0[dirs]}
    if op == "LSTM":
        feeds["initial_c"] = c0[dirs]
    # cotangents for ONNX's outputs; torch's are the same on the used directions, 0 elsewhere
    cot_onnx = [rng.standard_normal((T, nd, B, H)), rng.standard_normal((nd, B, H))]
    if op == "LSTM":
        cot_onnx.append(rng.standard_normal((nd, B, H)))
    cot_torch = [np.zeros((T, 2, B, H))] + [np.zeros((2, B, H)) for _ in cot_onnx[1:]]
    for ct, co in zip(cot_torch, cot_onnx):
        if ct.ndim == 4:
            ct[:, dirs] = co
        else:
            ct[dirs] = co
    outs_t, grads_t = torch_packed(m, op, x, h0, c0, LENS, cot_torch)

    # onnxruntime's own forward (float32) has torch's packed semantics
    model32 = seq_model(op, feeds, TP.FLOAT, direction, mode or "tanh")
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    got = session(model32).run(None, {**f32, "sequence_lens": LENS})
    for g_, t_ in zip(got, outs_t):
        want = t_[:, dirs] if t_.ndim == 4 else t_[dirs]
        np.testing.assert_allclose(g_, want, rtol=1e-4, atol=1e-5)

    model = seq_model(op, feeds, TP.DOUBLE, direction, mode or "tanh")
    names = list(feeds)
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    res = onnxgrad.gradients(model, outs, names, grad_ys=["g_" + o for o in outs])
    onnx.checker.check_model(res.model, full_check=True)
    # the ONNX node itself cannot run in float64 on onnxruntime; the gradient graph does not
    # read its outputs (the forward is recomputed by OnnxRNN with the lengths)
    run = without_forward(res.model, res.grads)
    assert not {i.name for i in run.graph.input} & set(outs)
    cot = {"g_" + o: c for o, c in zip(outs, cot_onnx)}
    got = dict(zip(names, session(run).run(res.grads, {**feeds, **cot,
                                                       "sequence_lens": LENS})))
    # the node was replaced by OnnxRNN: the gradient model's own Y, Y_h[, Y_c] (float64) are
    # torch's packed outputs too
    fwd = session(res.model).run(outs, {**feeds, **cot, "sequence_lens": LENS})
    for g_, t_ in zip(fwd, outs_t):
        want = t_[:, dirs] if t_.ndim == 4 else t_[dirs]
        np.testing.assert_allclose(g_, want, rtol=1e-9, atol=1e-11)
    tw = onnx_weights(m, op, 0, grad=True)
    tol = dict(rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(got["X"], grads_t["X"], **tol)
    np.testing.assert_allclose(got["initial_h"], grads_t["initial_h"][dirs], **tol)
    if op == "LSTM":
        np.testing.assert_allclose(got["initial_c"], grads_t["initial_c"][dirs], **tol)
    for k in ("W", "R", "B"):
        np.testing.assert_allclose(got[k], tw[k][dirs], **tol, err_msg=k)
    # other lengths at run time through the same gradient model: all full = no masking
    full = np.full(B, T, np.int32)
    _, grads_full = torch_packed(m, op, x, h0, c0, full, cot_torch)
    got = session(run).run(["X"] if "X" in res.grads else res.grads[:1],
                           {**feeds, **cot, "sequence_lens": full})
    np.testing.assert_allclose(got[0], grads_full["X"], **tol)
