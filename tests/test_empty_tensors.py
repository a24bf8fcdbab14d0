"""Gradients through tensors with no elements (onnxgrad/empty.py).

onnxruntime's optimizers treat a broadcast to a zero-size dim as none (ExpandElimination,
NoopElimination): the gradient of a sum over a Slice that selects nothing came out one row too
long (bench/fuzz.py). Generated graphs: an empty Slice or Gather of x along one axis, maybe
broadcast against a one-wide slice of x, reduced over that axis, then through a nonlinearity and
broadcast back against x; first- and second-order gradients are checked against float64
finite differences and run at ORT_ENABLE_ALL. Besides reductions, the empty tensor goes into
a Concat beside x, a Pad that makes it whole again, or a MatMul that contracts the empty axis."""
from __future__ import annotations

import numpy as np
import onnx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxgrad
from util import assert_gradients

REDUCE = ("ReduceSum", "ReduceSumSquare", "ReduceProd", "ReduceL2", "ReduceL1")


def _model(shape, axis, how, broadcast, reduce, keepdims, act, consumer="reduce"):
    n = shape[axis]
    inits = {"axes": np.array([axis]), "one": np.array([1]), "zero": np.array([0])}
    nodes = []
    if how == "gather":  # an empty index list
        inits["none"] = np.zeros([0], np.int64)
        nodes.append(h.make_node("Gather", ["x", "none"], ["e"], axis=axis))
    else:
        start, end = {"past": (n, n + 3), "far": (1000, 1000), "before": (-1000, -999),
                      "reversed": (n - 1, 0)}[how]
        inits["s"], inits["t"] = np.array([start]), np.array([end])
        nodes.append(h.make_node("Slice", ["x", "s", "t", "axes"], ["e"]))
    if broadcast:  # [.., 0, ..] against a one-wide [.., 1, ..] slice of x
        nodes += [h.make_node("Slice", ["x", "zero", "one", "axes"], ["w"]),
                  h.make_node("Mul", ["e", "w"], ["e2"])]
    else:
        nodes.append(h.make_node("Identity", ["e"], ["e2"]))
    if consumer == "concat":  # [e, x, e] along the axis: x's shape again
        nodes += [h.make_node("Concat", ["e2", "x", "e2"], ["c"], axis=axis),
                  h.make_node(act, ["c"], ["m"])]
    elif consumer == "pad":  # two of Pad's zeros along the axis, summed: [.., 1, ..]
        pads = [0] * (2 * len(shape))
        pads[axis] = 2
        inits["pads"] = np.array(pads)
        nodes += [h.make_node("Pad", ["e2", "pads"], ["c"]), h.make_node(act, ["c"], ["c2"]),
                  h.make_node("ReduceSum", ["c2", "axes"], ["c3"], keepdims=1),
                  h.make_node("Mul", ["c3", "x"], ["m"])]
    elif consumer == "matmul":  # [.., a, 0] @ [.., 0, a]: zeros [.., a, a], then summed
        perm = list(range(len(shape)))
        perm[-2:] = perm[-1], perm[-2]
        nodes += [h.make_node("Transpose", ["e2"], ["t2"], perm=perm),
                  h.make_node("MatMul", ["e2", "t2"], ["p"]), h.make_node(act, ["p"], ["p2"]),
                  h.make_node("ReduceSum", ["p2"], ["m"], keepdims=0)]
    else:
        nodes.append(h.make_node(reduce, ["e2", "axes"], ["r"], keepdims=keepdims))
        nodes.append(h.make_node(act, ["r"], ["a"]))
        if not keepdims:
            nodes.append(h.make_node("Unsqueeze", ["a", "axes"], ["a1"]))
        nodes.append(h.make_node("Mul", ["a1" if not keepdims else "a", "x"], ["m"]))
    nodes += [h.make_node("Mul", ["x", "x"], ["q"]), h.make_node("Add", ["m", "q"], ["y"])]
    g = h.make_graph(nodes, "empty", [h.make_tensor_value_info("x", TP.DOUBLE, list(shape))],
                     [h.make_tensor_value_info("y", TP.DOUBLE, None)],
                     initializer=[nh.from_array(v, k) for k, v in inits.items()])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
    m.ir_version = 9
    return m


@st.composite
def cases(draw):
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    return dict(shape=shape, axis=draw(st.integers(0, rank - 1)),
                how=draw(st.sampled_from(["past", "far", "before", "reversed", "gather"])),
                broadcast=draw(st.booleans()), reduce=draw(st.sampled_from(REDUCE)),
                keepdims=draw(st.sampled_from([0, 1])), act=draw(st.sampled_from(["Sin", "Exp"])),
                consumer=draw(st.sampled_from(["reduce", "reduce", "concat", "pad"] + (
                    ["matmul"] if rank >= 2 else []))))


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example(dict(shape=(2, 10, 3), axis=1, how="far", broadcast=False, reduce="ReduceSum",
              keepdims=1, act="Sin", consumer="reduce"))  # the fuzzer's case, in small
def test_gradient_through_an_empty_tensor(case):
    if case["how"] == "reversed" and case["shape"][case["axis"]] == 1:
        case["how"] = "past"  # (a one-long axis has no reversed empty range here)
    if case["consumer"] == "matmul":
        case["axis"] = len(case["shape"]) - 1  # the contracted axis is the empty one
    m = _model(**case)
    x = np.random.default_rng(0).uniform(0.5, 1.5, case["shape"])
    assert_gradients(m, "y", "x", {"x": x})
    first = onnxgrad.gradients(m, ["y"], ["x"])
    assert_gradients(first.model, first.grads, "x", {"x": x})  # the second order


def test_empty_results_are_constants():
    """The empty Expand of the sum's gradient is a Constant in the result; the model the caller
    gave is unchanged."""
    m = _model((2, 10, 3), 1, "far", False, "ReduceSum", 1, "Sin")
    before = m.SerializeToString()
    res = onnxgrad.gradients(m, ["y"], ["x"])
    assert m.SerializeToString() == before
    made = {n.output[0]: n for n in res.model.graph.node}
    expands = [n for n in res.model.graph.node if n.op_type == "Expand"]
    assert not expands, [n.name for n in expands]
    empty = [n for n in made.values() if n.op_type == "Constant" and
             0 in onnx.numpy_helper.to_array(n.attribute[0].t).shape]
    assert empty, "no empty Constant"
