"""Gradient rules for the Reduce* family: both forms of the axes (attribute before opset 18, input
from 18; ReduceSum's input from 13), keepdims, absent/empty/negative/run-time axes,
noop_with_empty_axes, symbolic dims, ties, zeros, second order."""
import numpy as np
import onnx
import pytest
from onnx import helper
from util import assert_gradients, grads_of, make_model, op_model

import onnxgrad
from onnxgrad.registry import lookup

OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
       "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]
SHAPE = (2, 3, 4)


def _x(op, shape=SHAPE, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape)
    if op == "ReduceLogSum":  # log of a sum: keep the sums positive
        x = np.abs(x) + 0.5
    return x.astype(np.float32)


def _model(op, form, axes, keepdims, shape=SHAPE, **attrs):
    """form: 'attr' (opset 13 / 17 attribute; ReduceSum opset 12 attribute, upgraded by the
    engine) or 'input' (opset 18; ReduceSum opset 13), the axes as a constant initializer."""
    inputs = {"x": (np.float32, list(shape))}
    if form.startswith("attr"):
        opset = 12 if op == "ReduceSum" else int(form[4:])
        if axes is not None:
            attrs["axes"] = axes
        return op_model(op, inputs, opset=opset, keepdims=keepdims, **attrs)
    opset = 13 if op == "ReduceSum" else 18
    inits = None if axes is None else {"axes": np.array(axes, np.int64)}
    return op_model(op, inputs, opset=opset, inits=inits, keepdims=keepdims, **attrs)


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[1], [2, -3], None], ids=str)
@pytest.mark.parametrize("form", ["attr13", "input"])
@pytest.mark.parametrize("op", OPS)
def test_reduce(op, form, axes, keepdims):
    assert_gradients(_model(op, form, axes, keepdims), "y", "x", feeds={"x": _x(op)})


@pytest.mark.parametrize("op", OPS)
def test_reduce_opset17_negative_axis(op):
    assert_gradients(_model(op, "attr17", [-1], 0), "y", "x", feeds={"x": _x(op)})


@pytest.mark.parametrize("noop", [0, 1])
@pytest.mark.parametrize("empty", ["absent", "empty_const"])
@pytest.mark.parametrize("op", OPS)
def test_empty_axes(op, empty, noop):
    """No axes (absent input, or a constant []): reduce everything, or with noop=1 skip the
    reduction but keep the elementwise part (onnxruntime: ReduceL1 gives |x|, ReduceSumSquare
    x^2, ReduceLogSum log x, the others x)."""
    opset = 13 if op == "ReduceSum" else 18
    inits = {"axes": np.zeros((0,), np.int64)} if empty == "empty_const" else None
    m = op_model(op, {"x": (np.float32, [3, 4])}, opset=opset, inits=inits, keepdims=0,
                 noop_with_empty_axes=noop)
    x = _x(op, (3, 4))
    report = assert_gradients(m, "y", "x", feeds={"x": x})
    if noop:  # the exact derivative of the elementwise part
        cot, x = next(iter(report.cotangents.values())), x.astype(np.float64)
        slope = {"ReduceLogSum": 1 / x, "ReduceL1": np.sign(x), "ReduceL2": np.sign(x),
                 "ReduceSumSquare": 2 * x}.get(op, 1.0)
        np.testing.assert_allclose(report.results[0].grad, cot * slope, rtol=1e-9)


@pytest.mark.parametrize("axes,noop,keepdims", [
    ([1], 0, 1), ([0, -1], 0, 0), ([0, -1], 1, 1), ([], 0, 0), ([], 1, 0), ([], 1, 1)], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_runtime_axes(op, axes, noop, keepdims):
    """Axes fed at run time (the rule cannot see them): Unsqueeze with a tensor, and a
    run-time choice of the identity when they are empty under noop_with_empty_axes."""
    opset = 13 if op == "ReduceSum" else 18
    node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims,
                            noop_with_empty_axes=noop)
    # shape inference cannot tell y's shape; the checker wants one on a graph output
    x = _x(op)
    reduced = () if not axes and noop else (tuple(a % 3 for a in axes) or None)
    y_shape = list(np.sum(x, axis=reduced, keepdims=bool(keepdims)).shape)
    g = helper.make_graph(
        [node], "test",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x.shape)),
         helper.make_tensor_value_info("axes", onnx.TensorProto.INT64, [len(axes)])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, y_shape)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(m, full_check=True)
    assert_gradients(m, "y", "x", feeds={"x": x, "axes": np.array(axes, np.int64)})


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("op", OPS)
def test_symbolic_dims(op, keepdims):
    """Symbolic dims: counts (ReduceMean) and broadcasts come from run-time shapes."""
    m = _model(op, "input", [0, 2], keepdims, shape=("N", 3, "M"))
    report = assert_gradients(m, "y", "x", feeds={"x": _x(op, (2, 3, 5))})
    assert report.results[0].grad.shape == (2, 3, 5)


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceLogSumExp", "ReduceMax", "ReduceSumSquare"])
def test_float16(op):
    node = helper.make_node(op, ["x"], ["y"], axes=[1], keepdims=0)
    m = make_model([node], {"x": (np.float16, [3, 4])}, ["y"], opset=17)
    assert_gradients(m, "y", "x", feeds={"x": _x(op, (3, 4)).astype(np.float16)})


# -- exact values where finite differences cannot judge ---------------------------------------
@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_ties_split_evenly(op, keepdims):
    x = np.array([[1, 3, 3, 0], [2, 2, 2, 2], [-1, 5, 0, -1]], np.float32)
    m = op_model(op, {"x": (np.float32, [3, 4])}, opset=18, keepdims=keepdims,
                 inits={"axes": np.array([1], np.int64)})
    gy = np.array([1.0, 2.0, 3.0], np.float32).reshape((3, 1) if keepdims else (3,))
    (gx,), _ = grads_of(m, "y", "x", {"x": x, "gy": gy}, grad_ys=["gy"])
    pick = np.max if op == "ReduceMax" else np.min
    hit = (x == pick(x, axis=1, keepdims=True)).astype(np.float64)
    want = hit / hit.sum(axis=1, keepdims=True) * gy.reshape(3, 1)
    np.testing.assert_allclose(gx, want, rtol=1e-6)
    torch = pytest.importorskip("torch")
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    fn = torch.amax if op == "ReduceMax" else torch.amin
    fn(t, dim=1, keepdim=bool(keepdims)).backward(torch.tensor(gy, dtype=torch.float64))
    np.testing.assert_allclose(gx, t.grad.numpy(), rtol=1e-6)


@pytest.mark.parametrize("keepdims", [0, 1])
def test_prod_with_zeros(keepdims):
    """One zero in a row: only it gets the product of the others; two zeros: all zero."""
    x = np.array([[2, 0, 3, 4], [0, 5, 0, 1], [1, 2, 3, 0.5], [-2, 0.5, 3, 1]], np.float32)
    m = op_model("ReduceProd", {"x": (np.float32, [4, 4])}, opset=18, keepdims=keepdims,
                 inits={"axes": np.array([1], np.int64)})
    assert_gradients(m, "y", "x", feeds={"x": x})  # a polynomial: differences are exact
    (gx,), _ = grads_of(m, "y", "x", {"x": x})
    want = np.array([[np.prod(np.delete(row, j)) for j in range(4)] for row in x])
    np.testing.assert_allclose(gx, want, rtol=1e-6)
    torch = pytest.importorskip("torch")
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    t.prod(dim=1).sum().backward()
    np.testing.assert_allclose(gx, t.grad.numpy(), rtol=1e-6)


def test_l2_at_zero_norm():
    """||x|| is not differentiable at 0: the gradient is taken as 0 there (as PyTorch)."""
    x = np.array([[0, 0, 0], [3, 4, 0]], np.float32)
    m = op_model("ReduceL2", {"x": (np.float32, [2, 3])}, opset=17, axes=[1], keepdims=0)
    (gx,), _ = grads_of(m, "y", "x", {"x": x})
    np.testing.assert_allclose(gx, [[0, 0, 0], [0.6, 0.8, 0]], rtol=1e-6)
    assert np.isfinite(gx).all()


def test_mean_uses_count_of_reduced_axes():
    x = np.ones((2, 3, 5), np.float32)
    m = op_model("ReduceMean", {"x": (np.float32, [2, 3, 5])}, opset=17, axes=[0, 2], keepdims=0)
    (gx,), _ = grads_of(m, "y", "x", {"x": x})
    np.testing.assert_allclose(gx, np.full((2, 3, 5), 0.1), rtol=1e-6)


def test_reuses_forward_output():
    """ReduceLogSumExp's gradient reads y instead of recomputing the reduction."""
    m = op_model("ReduceLogSumExp", {"x": (np.float32, [3, 4])}, opset=17, axes=[1])
    res = onnxgrad.gradients(m, "y", "x")
    added = [nd for nd in res.model.graph.node if nd.name.startswith("gradients/")]
    assert not any(nd.op_type.startswith("Reduce") for nd in added)
    assert any("y" in nd.input for nd in added)


# -- second order ------------------------------------------------------------------------------
def _needs(*ops):
    missing = [op for op in ops if lookup("", op, 18) is None]
    assert not missing, f"second order needs gradient rules for {missing}"


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("op", OPS)
def test_second_order(op, keepdims):
    """The gradient graph is itself differentiable (wrt x and the incoming gradient)."""
    _needs("Unsqueeze", "Expand", "Squeeze", "Reshape")
    m = _model(op, "input", [1], keepdims)
    first = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
    m2 = onnx.shape_inference.infer_shapes(first.model)
    x = _x(op) + (0.3 if op == "ReduceL1" else 0)
    assert_gradients(m2, first.grads[0], ["x", "gy"], feeds={"x": x})
