"""Outputs a node computes but leaves unnamed ("", as exporters leave unused ones): a rule that
reads one (the shape of a zero cotangent, a saved activation) used to emit a node reading "",
an invalid model written without an error (Scan, Loop, CudnnRNNV2), or to crash (Split).
Generated nodes with random outputs left unnamed: the gradient model passes the full check and
agrees with finite differences."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper

import onnxgrad
from onnxgrad.check import check_gradients

ort = pytest.importorskip("onnxruntime")

D = TP.DOUBLE


def _vi(name, shape):
    return helper.make_tensor_value_info(name, D, shape)


def _model(nodes, inputs, outputs, opset=18):
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _split(draw):
    k, axis = draw(st.integers(2, 4)), draw(st.integers(0, 1))
    named = draw(st.lists(st.booleans(), min_size=k, max_size=k).filter(any))
    outs = [f"p{i}" if keep else "" for i, keep in enumerate(named)]
    shape = [2 * k, 3] if axis == 0 else [3, 2 * k]
    nodes = [helper.make_node("Split", ["x"], outs, axis=axis, num_outputs=k)]
    nodes += [helper.make_node("Mul", [o, o], [f"y{o}"]) for o in outs if o]
    ys = [f"y{o}" for o in outs if o]
    return _model(nodes, [_vi("x", shape)], [_vi(y, None) for y in ys]), ys, ["x"]


def _body(carried):
    """s2 = tanh(s + x_t), o = s2 * x_t; Loop's body also takes (i, cond) and returns cond."""
    nodes = [helper.make_node("Add", ["s", "xt"], ["a"]), helper.make_node("Tanh", ["a"], ["s2"]),
             helper.make_node("Mul", ["s2", "xt"], ["o"])]
    ins, outs = [_vi("s", [3]), _vi("xt", [3])], [_vi("s2", [3]), _vi("o", [3])]
    if not carried:  # Loop: x_t is read from the outer scope's x by the iteration number
        nodes.insert(0, helper.make_node("Gather", ["x", "i"], ["xt"], axis=0))
        nodes.append(helper.make_node("Identity", ["cond"], ["c2"]))
        ins = [helper.make_tensor_value_info("i", TP.INT64, []),
               helper.make_tensor_value_info("cond", TP.BOOL, []), _vi("s", [3])]
        outs = [helper.make_tensor_value_info("c2", TP.BOOL, [])] + outs
    return helper.make_graph(nodes, "body", ins, outs)


def _loop(draw, op):
    named = draw(st.lists(st.booleans(), min_size=2, max_size=2).filter(any))
    outs = [n if keep else "" for n, keep in zip(["final", "seq"], named)]
    if op == "Scan":
        node = helper.make_node("Scan", ["s0", "x"], outs, body=_body(True), num_scan_inputs=1)
        nodes = [node]
    else:
        nodes = [helper.make_node("Constant", [], ["n"], value=helper.make_tensor("n", TP.INT64,
                                                                                   [], [4])),
                 helper.make_node("Loop", ["n", "", "s0"], outs, body=_body(False))]
    ys = [o for o in outs if o]
    return _model(nodes, [_vi("s0", [3]), _vi("x", [4, 3])], [_vi(y, None) for y in ys]), \
        ys, ["s0", "x"]


def _cudnn(draw):
    from onnxgrad.rnn import params_size
    from onnxgrad.rnn.ops import make_node, op_inputs
    mode = draw(st.sampled_from(["lstm", "gru", "rnn_tanh"]))
    n_out = draw(st.integers(1, 5))  # the trailing ones left out
    named = [True] + draw(st.lists(st.booleans(), min_size=n_out - 1, max_size=n_out - 1))
    outs = [o if keep else "" for o, keep in zip(["y", "hn", "cn", "rs", "hr"], named)]
    names = op_inputs("CudnnRNNV2")
    shapes = {"input": [3, 2, 4], "input_h": [1, 2, 5], "input_c": [1, 2, 5],
              "params": [params_size(mode, 1, 5, 4)]}
    ys = ["y"] + (["hn"] if outs[1:2] == ["hn"] else [])
    m = _model([make_node("CudnnRNNV2", names, outs, rnn_mode=mode)],
               [_vi(k, shapes[k]) for k in names],
               [_vi(y, {"y": [3, 2, 5], "hn": [1, 2, 5]}[y]) for y in ys])
    m.opset_import.append(helper.make_opsetid("onnxgrad", 1))
    return m, ys, ["input", "input_h", "params"]


def _to_canonical(draw):
    """CudnnRNNParamsToCanonical of a one-layer rnn_tanh (W, R, b_W, b_R) with parts unnamed."""
    from onnxgrad.rnn import params_size
    from onnxgrad.rnn.ops import make_node
    named = draw(st.lists(st.booleans(), min_size=4, max_size=4).filter(any))
    outs = [o if keep else "" for o, keep in zip(["w", "r", "bw", "br"], named)]
    sizes = [helper.make_tensor(k, TP.INT32, [], [v]) for k, v in zip("LHI", (1, 3, 2))]
    m = _model([make_node("CudnnRNNParamsToCanonical", ["L", "H", "I", "p"], outs,
                          rnn_mode="rnn_tanh", num_params=2)],
               [_vi("p", [params_size("rnn_tanh", 1, 3, 2)])],
               [_vi(o, {"w": [3, 2], "r": [3, 3], "bw": [3], "br": [3]}[o]) for o in outs if o])
    m.graph.initializer.extend(sizes)
    m.opset_import.append(helper.make_opsetid("onnxgrad", 1))
    return m, [o for o in outs if o], ["p"]


@st.composite
def _cases(draw):
    kind = draw(st.sampled_from(["Split", "Scan", "Loop", "CudnnRNNV2", "ToCanonical"]))
    if kind == "Split":
        return _split(draw)
    if kind == "CudnnRNNV2":
        return _cudnn(draw)
    if kind == "ToCanonical":
        return _to_canonical(draw)
    return _loop(draw, kind)


def _named(model):
    """The same model with every output named (the forward ops' trailing ones too)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for n in m.graph.node:
        if n.op_type == "CudnnRNNV2":
            n.output.extend([""] * (5 - len(n.output)))
        n.output[:] = [o or f"{n.op_type}_out{i}" for i, o in enumerate(n.output)]
    from onnxgrad.rnn.ops import attach_functions  # (for the finite differences)
    return attach_functions(m)


def _run(model, names, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    return sess.run(names, {i.name: feeds[i.name] for i in sess.get_inputs()})


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_outputs_left_unnamed(case):
    """(onnxruntime 1.31 itself crashes running a Scan or Loop that leaves an output unnamed:
    the oracle is the same model with every output named, checked against finite
    differences; the gradient model names what it reads, so it runs.)"""
    model, ys, xs = case
    before = model.SerializeToString()
    res = onnxgrad.gradients(model, ys, xs)
    assert model.SerializeToString() == before  # the input model is not touched
    onnx.checker.check_model(res.model, full_check=True)
    named = _named(model)
    report = check_gradients(named, ys, xs, seed=1)
    assert report.ok, str(report)
    ref = onnxgrad.gradients(named, ys, xs)
    feeds = {**report.feeds, **{f"{y}_grad": np.ones(1) for y in ys}}
    for k, (a, w) in enumerate(zip(_run(res.model, res.grads, feeds),
                                   _run(ref.model, ref.grads, feeds))):
        np.testing.assert_allclose(a, w, rtol=1e-12, atol=1e-14, err_msg=xs[k])


@pytest.mark.parametrize("outs", [["y", "", "rs"], ["y", "hn", "", "", "hr"]])
def test_unnamed_outputs_get_names_only_where_they_are_always_computed(outs):
    """The returned model names the outputs it had to (the forward op's, computed by its body
    anyway); optional outputs stay unnamed (LayerNormalization's statistics: naming one may
    change what an op computes, as BatchNormalization's did before training_mode)."""
    from onnxgrad.rnn import params_size
    from onnxgrad.rnn.ops import make_node, op_inputs
    names = op_inputs("CudnnRNNV2")
    shapes = {"input": [3, 2, 4], "input_h": [1, 2, 5], "input_c": [1, 2, 5],
              "params": [params_size("lstm", 1, 5, 4)]}
    nodes = [make_node("CudnnRNNV2", names, outs, name="rnn"),
             helper.make_node("LayerNormalization", ["y", "s", "b"], ["z", "", ""], name="ln")]
    inputs = [_vi(k, shapes[k]) for k in names] + [_vi(k, [5]) for k in "sb"]
    m = _model(nodes, inputs, [_vi("z", [3, 2, 5])])
    m.graph.value_info.append(_vi("y", [3, 2, 5]))
    m.opset_import.append(helper.make_opsetid("onnxgrad", 1))
    res = onnxgrad.gradients(m, "z", "params")
    got = {n.name: list(n.output) for n in res.model.graph.node if n.name in ("rnn", "ln")}
    assert len(got["rnn"]) == 5 and all(got["rnn"]) and got["rnn"][0] == "y"
    assert got["ln"][0] == "z" and not any(got["ln"][1:])
    onnx.checker.check_model(res.model, full_check=True)


def test_unnamed_output_inside_a_loop_body():
    """The same inside a body: a Loop whose body splits x_t and leaves a part unnamed."""
    body = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["xt"], axis=0),
         helper.make_node("Split", ["xt"], ["a", ""], axis=0, num_outputs=2),
         helper.make_node("Mul", ["s", "a"], ["s2"]), helper.make_node("Identity", ["cond"], ["c2"]),
         helper.make_node("Tanh", ["s2"], ["o"])], "body",
        [helper.make_tensor_value_info("i", TP.INT64, []),
         helper.make_tensor_value_info("cond", TP.BOOL, []), _vi("s", [2])],
        [helper.make_tensor_value_info("c2", TP.BOOL, []), _vi("s2", [2]), _vi("o", [2])])
    nodes = [helper.make_node("Constant", [], ["n"], value=helper.make_tensor("n", TP.INT64, [],
                                                                              [3])),
             helper.make_node("Loop", ["n", "", "s0"], ["final", "seq"], body=body)]
    model = _model(nodes, [_vi("s0", [2]), _vi("x", [3, 4])], [_vi("seq", None)])
    res = onnxgrad.gradients(model, "seq", ["s0", "x"])
    onnx.checker.check_model(res.model, full_check=True)
    named = onnx.ModelProto()
    named.CopyFrom(model)
    named.graph.node[1].attribute[0].g.node[1].output[1] = "b"
    report = check_gradients(named, "seq", ["s0", "x"], seed=2)
    assert report.ok, str(report)
    for a, w in zip(_run(res.model, res.grads, report.feeds),
                    _run(onnxgrad.gradients(named, "seq", ["s0", "x"]).model, res.grads,
                         report.feeds)):
        np.testing.assert_allclose(a, w, rtol=1e-12, atol=1e-14)
