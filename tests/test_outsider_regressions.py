"""Defects outsiders found in gradients() itself (session 22), each fixed as a class: the model's
stop/prevent marks inside subgraphs, grad_ys of another shape or name, a declared elem_type 0,
ops that read only their input's shape (RandomNormalLike)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper

import onnxgrad
from onnxgrad.runtime import session

D = TP.DOUBLE


def _vi(name, shape, t=D):
    return helper.make_tensor_value_info(name, t, shape)


def _stop_model(where, stopped, meta_key="onnxgrad.stop_gradients", meta=None):
    """y = s * x with s = sin(x) made inside ``where`` (an If branch, a Loop body, or the main
    graph), s listed under ``meta_key``. d y / d x = s when s is held, s + x cos x when not."""
    inner = [helper.make_node("Sin", ["x"], ["s"]), helper.make_node("Mul", ["s", "x"], ["t"])]
    if where == "main":
        nodes = inner + [helper.make_node("Identity", ["t"], ["y"])]
    elif where in ("then", "else"):
        body = helper.make_graph(inner, "b", [], [_vi("t", [3])])
        other = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["o"])], "o", [],
                                  [_vi("o", [3])])
        branches = {"then_branch": body, "else_branch": other} if where == "then" else \
            {"then_branch": other, "else_branch": body}
        nodes = [helper.make_node("If", ["c"], ["y"], **branches)]
    else:  # a Loop of one trip: its scan output stacks t
        body = helper.make_graph(
            [*inner, helper.make_node("Identity", ["cond"], ["cond_out"])], "body",
            [_vi("i", [], TP.INT64), _vi("cond", [], TP.BOOL)],
            [_vi("cond_out", [], TP.BOOL), _vi("t", [3])])
        nodes = [helper.make_node("Constant", [], ["n"], value=helper.make_tensor(
                     "n", TP.INT64, [], [1])),
                 helper.make_node("Loop", ["n", "c"], ["ts"], body=body),
                 helper.make_node("Squeeze", ["ts", "ax"], ["y"])]
    g = helper.make_graph(nodes, "g", [_vi("x", [3]), _vi("c", [], TP.BOOL)], [_vi("y", [3])],
                          [onnx.numpy_helper.from_array(np.array([0], np.int64), "ax")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    if stopped:
        m.metadata_props.add(key=meta_key, value=json.dumps(meta if meta is not None else ["s"]))
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("where", ["main", "then", "else", "loop"])
@pytest.mark.parametrize("stopped", [True, False])
def test_stop_gradients_metadata_inside_subgraphs(where, stopped):
    """The converter lists TF's StopGradient outputs in the model's metadata; those inside a
    tf.cond branch or a while body (an If or Loop body) were dropped without a word, and the
    gradient flowed through them."""
    m = _stop_model(where, stopped)
    x = np.array([0.3, -1.2, 2.0])
    cond = np.array(where != "else")
    res = onnxgrad.gradients(m, "y", "x")
    (got,) = session(res.model).run([res.grads[0]], {"x": x, "c": cond})
    want = np.sin(x) + (0 if stopped else x * np.cos(x))
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("where", ["main", "then", "loop"])
def test_prevent_gradients_metadata_refuses_a_path_through_it(where):
    """TF's PreventGradient: a gradient reaching the marked tensor is an error naming it and the
    op's message (it was converted like StopGradient: a silently partial derivative)."""
    m = _stop_model(where, True, "onnxgrad.prevent_gradients", {"s": "no second order here"})
    with pytest.raises(onnxgrad.NotDifferentiableError, match="'s'.*explicitly disabled.*"
                                                              "no second order here"):
        onnxgrad.gradients(m, "y", "x")
    if where == "main":  # s held constant: no gradient reaches it, no refusal
        res = onnxgrad.gradients(m, "y", "x", stop_gradients=["s"])
        (got,) = session(res.model).run([res.grads[0]], {"x": np.ones(3), "c": np.array(True)})
        np.testing.assert_allclose(got, np.sin(np.ones(3)))


@pytest.mark.parametrize("meta,why", [
    ("not json", "must be JSON"), ("5", "must be JSON"), ('"s"', "must be JSON"),
    ('{"s": 1}', "must be JSON"), ('["nope"]', "names 'nope', which is no tensor")])
def test_malformed_stop_gradients_metadata_is_named(meta, why):
    m = _stop_model("main", False)
    m.metadata_props.add(key="onnxgrad.stop_gradients", value=meta)
    with pytest.raises(onnxgrad.InvalidModelError, match=f"onnxgrad.stop_gradients.*{why}"):
        onnxgrad.gradients(m, "y", "x")


@pytest.mark.parametrize("value", [0, False, {}, ""])
def test_falsy_stop_gradients_are_not_no_stops(value):
    m = _stop_model("main", False)
    with pytest.raises(onnxgrad.OnnxgradError, match="stop_gradients"):
        onnxgrad.gradients(m, "y", "x", stop_gradients=value)


_dims = st.lists(st.integers(1, 3), max_size=3)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(y_shape=_dims, g_shape=_dims)
def test_grad_ys_of_another_shape_is_refused(y_shape, g_shape):
    """An existing grad_ys tensor of another shape than its y wrote a model that fails
    onnx.checker (and a gradient of the wrong shape at run time); tf.gradients refuses it. Equal
    shapes work and scale the gradient."""
    g = helper.make_graph([helper.make_node("Sin", ["x"], ["y"])], "g",
                          [_vi("x", y_shape), _vi("gy", g_shape)], [_vi("y", y_shape)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    if g_shape != y_shape:
        with pytest.raises(onnxgrad.InvalidArgumentError, match="grad_ys: 'gy' has shape"):
            onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
        return
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    rng = np.random.default_rng(0)
    x, gy = rng.standard_normal(y_shape), rng.standard_normal(y_shape)
    (got,) = session(res.model).run([res.grads[0]], {"x": x, "gy": gy})
    np.testing.assert_allclose(got, gy * np.cos(x), rtol=1e-12)


def test_new_grad_ys_names_that_cannot_be_inputs():
    """A new grad_ys name used for two ys of different shapes, an empty name, and a name taken
    inside a subgraph each wrote a model onnx.checker refuses."""
    g = helper.make_graph([helper.make_node("Sin", ["x"], ["y1"]),
                           helper.make_node("ReduceSum", ["x"], ["y2"], keepdims=1)], "g",
                          [_vi("x", [3])], [_vi("y1", [3]), _vi("y2", [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    with pytest.raises(onnxgrad.InvalidArgumentError, match="'d' has shape"):
        onnxgrad.gradients(m, ["y1", "y2"], "x", grad_ys=["d", "d"])
    with pytest.raises(onnxgrad.InvalidArgumentError, match="it is no name"):
        onnxgrad.gradients(m, "y1", "x", grad_ys=[""])
    with pytest.raises(onnxgrad.InvalidArgumentError, match="'s'.*taken inside a subgraph"):
        onnxgrad.gradients(_stop_model("then", False), "y", "x", grad_ys=["s"])


def test_input_of_undefined_element_type_is_refused():
    """elem_type 0 on a graph input read on the path: refused as a value of unknown type (its
    gradient was None, as if y did not depend on it)."""
    g = helper.make_graph([helper.make_node("Sin", ["x"], ["s"]),
                           helper.make_node("Mul", ["s", "x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", 0, [3])], [_vi("y", [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    for unconnected in ("none", "zero"):
        with pytest.raises(onnxgrad.InvalidModelError, match="unknown"):
            onnxgrad.gradients(m, "y", "x", unconnected_gradients=unconnected)


@pytest.mark.parametrize("op", ["RandomNormalLike", "RandomUniformLike"])
def test_reparameterisation_through_random_like(op):
    """z = mu + std * RandomNormalLike(std) (torch.onnx's randn_like, a VAE's sampling) was
    refused: the op reads only std's shape, so dz/dstd = eps, the draw of the same run."""
    g = helper.make_graph([helper.make_node(op, ["std"], ["eps"], seed=1.0),
                           helper.make_node("Mul", ["std", "eps"], ["se"]),
                           helper.make_node("Add", ["mu", "se"], ["z"])], "g",
                          [_vi("mu", [4], TP.FLOAT), _vi("std", [4], TP.FLOAT)],
                          [_vi("z", [4], TP.FLOAT), _vi("eps", [4], TP.FLOAT)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    res = onnxgrad.gradients(m, "z", ["mu", "std"])
    onnx.checker.check_model(res.model, full_check=True)
    feeds = {"mu": np.zeros(4, np.float32), "std": np.full(4, 2.0, np.float32)}
    eps, dmu, dstd = session(res.model).run(["eps", *res.grads], feeds)
    np.testing.assert_array_equal(dmu, np.ones(4))
    np.testing.assert_array_equal(dstd, eps)
    res = onnxgrad.gradients(m, "eps", "std", unconnected_gradients="zero")
    (d,) = session(res.model).run(res.grads, feeds)
    np.testing.assert_array_equal(d, np.zeros(4))


def _optional_model(form):
    """y = x * x through an optional that an If or Loop passes: read inside a branch, returned
    by the branches, or carried by the loop."""
    ovi = helper.make_value_info(
        "o", helper.make_optional_type_proto(helper.make_tensor_type_proto(D, [3])))

    def named(vi, name):
        out = onnx.ValueInfoProto()
        out.CopyFrom(vi)
        out.name = name
        return out
    square = helper.make_node("Mul", ["x", "x"], ["t"])
    if form == "captured":
        then = helper.make_graph([helper.make_node("OptionalGetElement", ["o"], ["v"]),
                                  helper.make_node("Mul", ["v", "v"], ["r"])], "t", [],
                                 [_vi("r", [3])])
        other = helper.make_graph([helper.make_node("Identity", ["x"], ["r2"])], "e", [],
                                  [_vi("r2", [3])])
        nodes = [helper.make_node("Optional", ["x"], ["o"]),
                 helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    elif form == "returned":
        then = helper.make_graph([square, helper.make_node("Optional", ["t"], ["ot"])], "t", [],
                                 [named(ovi, "ot")])
        other = helper.make_graph([helper.make_node("Optional", ["x"], ["oe"])], "e", [],
                                  [named(ovi, "oe")])
        nodes = [helper.make_node("If", ["c"], ["o"], then_branch=then, else_branch=other),
                 helper.make_node("OptionalGetElement", ["o"], ["y"])]
    else:
        body = helper.make_graph(
            [helper.make_node("OptionalGetElement", ["ob"], ["v"]),
             helper.make_node("Mul", ["v", "x"], ["w"]), helper.make_node("Optional", ["w"], ["o2"]),
             helper.make_node("Identity", ["cb"], ["c2"])], "body",
            [_vi("i", [], TP.INT64), _vi("cb", [], TP.BOOL), named(ovi, "ob")],
            [_vi("c2", [], TP.BOOL), named(ovi, "o2")])
        nodes = [helper.make_node("Constant", [], ["n"], value=helper.make_tensor(
                     "n", TP.INT64, [], [1])),
                 helper.make_node("Optional", ["x"], ["o"]),
                 helper.make_node("Loop", ["n", "", "o"], ["of"], body=body),
                 helper.make_node("OptionalGetElement", ["of"], ["y"])]
    g = helper.make_graph(nodes, "g", [_vi("x", [3]), _vi("c", [], TP.BOOL)], [_vi("y", [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("form", ["captured", "returned", "carried"])
def test_optionals_through_control_flow_are_refused(form):
    """An optional read inside an If branch, returned by an If, or carried by a Loop got a zero
    gradient (or None) where y = x * x: refused now, naming the optional."""
    with pytest.raises(onnxgrad.NotDifferentiableError, match="the optional 'o"):
        onnxgrad.gradients(_optional_model(form), "y", "x")


@pytest.mark.parametrize("op", ["Scan", "SequenceMap"])
def test_sequence_read_from_outside_a_scan_or_sequence_map_is_refused(op):
    """A Scan or SequenceMap body reading an outer sequence (SequenceAt of it) wrote a model
    that onnx.checker and onnxruntime refuse: the sequence's gradient would be a Scan state or
    a SequenceMap element, which are tensors. Refused, naming the sequence. (A Loop or If body
    reading it is differentiated: test_control_flow.)"""
    n = helper.make_node
    one = onnx.numpy_helper.from_array(np.array(1, np.int64), "one")
    if op == "Scan":
        body = helper.make_graph([n("SequenceAt", ["T", "one"], ["t1"]), n("Mul", ["s", "t1"], ["st"]),
                                  n("Mul", ["st", "e"], ["s2"]), n("Sin", ["s2"], ["o"])], "body",
                                 [_vi("s", [3]), _vi("e", [3])], [_vi("s2", [3]), _vi("o", [3])])
        nodes = [n("Scan", ["a", "A"], ["sT", "y"], body=body, num_scan_inputs=1)]
        outs = [_vi("sT", [3]), _vi("y", [2, 3])]
    else:
        body = helper.make_graph([n("SequenceAt", ["T", "one"], ["t1"]), n("Mul", ["e", "t1"], ["o"])],
                                 "body", [_vi("e", [3])], [_vi("o", [3])])
        nodes = [n("SequenceMap", ["T"], ["ys"], body=body),
                 n("ConcatFromSequence", ["ys"], ["y"], axis=0)]
        outs = [_vi("y", [6])]
    g = helper.make_graph([n("SequenceConstruct", ["a", "b"], ["T"]), *nodes],
                          "g", [_vi("a", [3]), _vi("b", [3]), _vi("A", [2, 3])], outs, [one])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.checker.check_model(m, full_check=True)
    with pytest.raises(onnxgrad.NotDifferentiableError, match="the sequence 'T' is read inside"):
        onnxgrad.gradients(m, "y", ["a", "b"])


@pytest.mark.parametrize("declared", [None, [2, None, 4]])
def test_loop_concatenating_onto_its_carry_is_refused(declared):
    """acc = Concat(acc, 2x) in a Loop (TorchScript's scripted torch.cat accumulator, shapes
    left undeclared) was differentiated into a model whose saved per-iteration states have
    different shapes: onnxruntime failed at run time. Refused like a declared change of shape."""
    n = helper.make_node
    body = helper.make_graph(
        [n("Mul", ["x", "two"], ["x2"]), n("Concat", ["acc", "x2"], ["acc2"], axis=1),
         n("Identity", ["cond"], ["cond_out"])], "body",
        [_vi("i", [], TP.INT64), _vi("cond", [], TP.BOOL),
         helper.make_tensor_value_info("acc", D, declared)],
        [_vi("cond_out", [], TP.BOOL), helper.make_tensor_value_info("acc2", D, declared)])
    g = helper.make_graph(
        [n("Loop", ["trips", "c", "acc0"], ["acc_out"], body=body)], "g",
        [_vi("x", [2, 1, 4]), _vi("acc0", [2, 1, 4]), _vi("c", [], TP.BOOL)],
        [_vi("acc_out", [2, None, 4])],
        [onnx.numpy_helper.from_array(np.array(3, np.int64), "trips"),
         onnx.numpy_helper.from_array(np.array(2.0), "two")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    with pytest.raises(onnxgrad.NotDifferentiableError, match="'acc' changes shape between iterations .the body concatenates"):
        onnxgrad.gradients(m, "acc_out", ["x", "acc0"])
