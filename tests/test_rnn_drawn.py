"""The CudnnRNN op family at drawn sizes: every mode, 1 to 3 layers, both directions, sequence
lengths, batches, input and hidden sizes from 1 up (one-element dims, input size equal to the
hidden size or not), static or symbolic dims, CudnnRNN and CudnnRNNV2. The forward and
``onnxgrad.gradients`` through the backward op (wrt the input, both initial states and the flat
cuDNN params), run on onnxruntime in float64, against torch.nn.LSTM/GRU/RNN autograd in
float64 with the same weights (test_rnn.py holds the fixed cases and the layout's own tests)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper

import onnxgrad
from onnxgrad.rnn import canonical_to_params, params_size
from onnxgrad.rnn.ops import attach_functions, make_node

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

G = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


@st.composite
def configs(draw):
    return dict(mode=draw(st.sampled_from(sorted(G))), L=draw(st.integers(1, 3)),
                bi=draw(st.booleans()), T=draw(st.integers(1, 5)), B=draw(st.integers(1, 3)),
                I=draw(st.integers(1, 5)), H=draw(st.integers(1, 5)),
                op=draw(st.sampled_from(["CudnnRNN", "CudnnRNNV2"])),
                symbolic=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def _model(c):
    nd, lstm = 1 + c["bi"], c["mode"] == "lstm"
    t, b, i, h = ("T", "B", "I", "H") if c["symbolic"] else (c["T"], c["B"], c["I"], c["H"])
    P = params_size(c["mode"], c["L"], c["H"], c["I"], "bidirectional" if c["bi"] else
                    "unidirectional")
    vi = lambda n, s: helper.make_tensor_value_info(n, TP.DOUBLE, s)  # noqa: E731
    ins = [vi("x", [t, b, i]), vi("h0", [c["L"] * nd, b, h]), vi("c0", [c["L"] * nd, b, h]),
           vi("p", [P])]
    outs = ["y", "hn", "cn", "rs"] + (["hr"] if c["op"].endswith("V2") else [])
    node = make_node(c["op"], ["x", "h0", "c0", "p"], outs, name="rnn", rnn_mode=c["mode"],
                     direction="bidirectional" if c["bi"] else "unidirectional")
    shapes = {"y": [t, b, nd * h], "hn": [c["L"] * nd, b, h],
              "cn": [c["L"] * nd, b, h] if lstm else [], "rs": [None], "hr": [None]}
    g = helper.make_graph([node], "rnn", ins, [helper.make_tensor_value_info(
        o, TP.INT8 if o == "hr" else TP.DOUBLE, shapes[o]) for o in outs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                            helper.make_opsetid("onnxgrad", 1)], ir_version=10)
    return attach_functions(m)


def _torch(c):
    torch.manual_seed(c["seed"])
    kw = dict(num_layers=c["L"], bidirectional=c["bi"])
    if c["mode"] == "lstm":
        m = torch.nn.LSTM(c["I"], c["H"], **kw)
    elif c["mode"] == "gru":
        m = torch.nn.GRU(c["I"], c["H"], **kw)
    else:
        m = torch.nn.RNN(c["I"], c["H"], nonlinearity=c["mode"][4:], **kw)
    return m.double()


def _flat(c, m, grad=False):
    """torch's weights (or their gradients) as the flat cuDNN params buffer."""
    ws, bs = [], []
    for layer in range(c["L"]):
        for d in range(1 + c["bi"]):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            get = lambda k: (getattr(m, k + sfx).grad if grad else  # noqa: E731
                             getattr(m, k + sfx)).detach().numpy()
            ws += np.split(get("weight_ih"), G[c["mode"]]) + np.split(get("weight_hh"),
                                                                      G[c["mode"]])
            bs += np.split(get("bias_ih"), G[c["mode"]]) + np.split(get("bias_hh"), G[c["mode"]])
    return canonical_to_params(ws, bs, c["mode"], c["L"], c["H"], c["I"],
                               "bidirectional" if c["bi"] else "unidirectional")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(configs())
def test_rnn_ops_match_torch_at_drawn_sizes(c):
    lstm, nd = c["mode"] == "lstm", 1 + c["bi"]
    m = _model(c)
    xs = ["x", "h0", "c0", "p"] if lstm else ["x", "h0", "p"]
    ys = ["y", "hn", "cn"] if lstm else ["y", "hn"]
    res = onnxgrad.gradients(m, ys, xs, grad_ys=[f"g{y}" for y in ys])
    onnx.checker.check_model(res.model, full_check=True)
    rng = np.random.default_rng(c["seed"])
    tm = _torch(c)
    x = rng.standard_normal((c["T"], c["B"], c["I"]))
    h0, c0 = (rng.standard_normal((c["L"] * nd, c["B"], c["H"])) for _ in range(2))
    cot = {"y": rng.standard_normal((c["T"], c["B"], nd * c["H"])),
           "hn": rng.standard_normal(h0.shape), "cn": rng.standard_normal(h0.shape)}
    feeds = {"x": x, "h0": h0, "c0": c0, "p": _flat(c, tm), **{f"g{y}": cot[y] for y in ys}}
    s = ort.InferenceSession(res.model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip(ys + xs, s.run(ys + res.grads, feeds)))
    tx, th, tc = (torch.tensor(v, requires_grad=True) for v in (x, h0, c0))
    out = tm(tx, (th, tc)) if lstm else tm(tx, th)
    y, states = out[0], (out[1] if lstm else (out[1],))
    loss = (y * torch.tensor(cot["y"])).sum()
    for s_, k in zip(states, ["hn", "cn"]):
        loss = loss + (s_ * torch.tensor(cot[k])).sum()
    loss.backward()
    want = {"y": y, "hn": states[0], "x": tx.grad, "h0": th.grad, "p": _flat(c, tm, grad=True)}
    if lstm:
        want.update(cn=states[1], c0=tc.grad)
    for k in ys + xs:
        w = want[k].detach().numpy() if hasattr(want[k], "detach") else want[k]
        np.testing.assert_allclose(got[k], w, rtol=1e-9, atol=1e-10, err_msg=f"{k} ({c})")
