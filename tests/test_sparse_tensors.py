"""Sparse tensors: sparse initializers and Constant(sparse_value), in any of the forms the ONNX
spec allows (linear or coordinate indices, no stored values at all).

onnx-ir reads neither: a sparse initializer was dropped ("no tensor named 'W' in the graph", or
a refusal for an operand without a rank) and a sparse Constant raised onnx-ir's own SerdeError.
gradients() now reads them as dense tensors; the result keeps the sparse Constants and stores
the initializers dense (onnx's shape inference types a sparse initializer as a sparse tensor,
which no op takes: the model would fail check_model(full_check=True), as the input does)."""
import numpy as np
import onnx
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

import pytest

import onnxgrad
from onnxgrad.check import check_gradients
from onnxgrad.runtime import session
from onnxgrad.training import build_gradient_model

F64 = onnx.TensorProto.DOUBLE


@st.composite
def sparse_cases(draw):
    dims = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    size = int(np.prod(dims))
    flat = sorted(draw(st.lists(st.integers(0, size - 1), unique=True, max_size=size)))
    values = draw(st.lists(st.floats(-2, 2, allow_nan=False, width=32), min_size=len(flat),
                           max_size=len(flat)))
    coords = draw(st.booleans()) and len(dims) > 1
    where = draw(st.sampled_from(["initializer", "constant"]))
    return dims, np.array(flat, np.int64), np.array(values, np.float64), coords, where


def _models(dims, flat, values, coords, where):
    """(the model with W sparse, the same model with W dense, W's dense value):
    y = Tanh(x * W) + W * W, over x of W's shape."""
    dense = np.zeros(dims)
    dense.reshape(-1)[flat] = values
    idx = np.stack(np.unravel_index(flat, dims), axis=1) if coords else flat
    name = "W" if where == "initializer" else "W_values"
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(values, name),
                                       numpy_helper.from_array(idx.astype(np.int64), "idx"),
                                       dims)
    nodes = [helper.make_node("Mul", ["x", "W"], ["m"]), helper.make_node("Tanh", ["m"], ["t"]),
             helper.make_node("Mul", ["W", "W"], ["w2"]), helper.make_node("Add", ["t", "w2"],
                                                                           ["y"])]
    io = ([helper.make_tensor_value_info("x", F64, dims)],
          [helper.make_tensor_value_info("y", F64, dims)])

    def model(sparse_form):
        inits, sparse_inits, head = [], [], []
        if where == "initializer":
            (sparse_inits if sparse_form else inits).append(
                sparse if sparse_form else numpy_helper.from_array(dense, "W"))
        else:
            head = [helper.make_node("Constant", [], ["W"], **(
                {"sparse_value": sparse} if sparse_form else
                {"value": numpy_helper.from_array(dense, "W")}))]
        g = helper.make_graph(head + nodes, "sparse", *io, inits,
                              sparse_initializer=sparse_inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)

    return model(True), model(False), dense


@settings(max_examples=60, deadline=None, derandomize=True)
@given(sparse_cases())
def test_sparse_tensors_read_as_dense(case):
    m, m_dense, w = _models(*case)
    before = m.SerializeToString()
    res = onnxgrad.gradients(m, "y", ["x", "W"])
    assert m.SerializeToString() == before  # the input model is never changed
    onnx.checker.check_model(res.model, full_check=True)
    assert not res.model.graph.sparse_initializer
    if case[-1] == "constant":  # the forward keeps its own Constant
        assert [a.name for a in res.model.graph.node[0].attribute] == ["sparse_value"]
    x = np.random.default_rng(0).standard_normal(w.shape)
    got = session(res.model).run(res.grads, {"x": x})
    want = onnxgrad.gradients(m_dense, "y", ["x", "W"])
    for g, ref in zip(got, session(want.model).run(want.grads, {"x": x})):
        np.testing.assert_array_equal(g, ref)
    # and by the math: dy/dx = W (1 - t^2), dy/dW = x (1 - t^2) + 2 W (cotangent of ones)
    t = np.tanh(x * w)
    np.testing.assert_allclose(got[0], w * (1 - t * t), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], x * (1 - t * t) + 2 * w, rtol=1e-12, atol=1e-12)


def test_sparse_initializer_checked_and_trained():
    m, _, w = _models([2, 3], np.array([1, 5]), np.array([0.5, -1.5]), True, "initializer")
    report = check_gradients(m, ["y"], ["x", "W"])  # finite differences, W as an x
    assert report.ok, str(report)
    m.graph.node.append(helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0))
    m.graph.output.append(helper.make_tensor_value_info("loss", F64, []))
    step = build_gradient_model(m, "loss")
    assert list(step.initial_params) == ["W"]
    np.testing.assert_array_equal(step.initial_params["W"], w)


@pytest.mark.parametrize("idx,values,why", [
    ([0, 99], [1.0, 2.0], "out of range"),  # past the 2 x 3 elements
    ([[0, 0], [1, 7]], [1.0, 2.0], "out of range"),
    ([0, 5], [1.0], "NNZ is 1"),  # two indices for one value: numpy would broadcast it
])
def test_malformed_sparse_tensor_named(idx, values, why):
    m, _, _ = _models([2, 3], np.array([0, 1]), np.array([1.0, 2.0]), False, "initializer")
    sp = m.graph.sparse_initializer[0]
    sp.values.CopyFrom(numpy_helper.from_array(np.array(values), "W"))
    sp.indices.CopyFrom(numpy_helper.from_array(np.array(idx, np.int64), "idx"))
    with pytest.raises(onnxgrad.InvalidModelError, match=f"sparse tensor 'W' is malformed.*{why}"):
        onnxgrad.gradients(m, "y", ["x"])
