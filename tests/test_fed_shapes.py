"""Tensors fed at run time beside the model's own inputs (a gradients() call's new grad_ys
inputs, the loss's target), whose dims are symbolic like y's: onnxruntime binds a symbolic dim
per input, so nothing tied a cotangent or target of batch 1 to predictions of batch 4, and the
rules and the loss broadcast it silently (a wrong gradient, a wrong training step; the ONNX
SoftmaxCrossEntropyLoss kernel read past a short target). Drawn models and shapes: a fed shape
that differs from y's in any dim fails, by a node that names the check; the right shape gives
the numbers it gave before (against central differences, and torch for the losses)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from util import stock_session

import onnxgrad
from onnxgrad.training.losses import attach_loss
from onnxgrad.training.step import build_train_step, with_defaults

UNARY = ["Tanh", "Sigmoid", "Sin", "Relu", "Abs"]


def _wrong(shape, dim, other):
    bad = list(shape)
    bad[dim] = other
    return bad


@st.composite
def _fed(draw):
    """(y's shape, the dims of y that are symbolic, a dim to get wrong and its wrong size)."""
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    symbolic = draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    dim = draw(st.integers(0, len(shape) - 1))
    symbolic[dim] = True  # (a static dim is checked by onnxruntime itself)
    other = draw(st.sampled_from([1, shape[dim] + 1] if shape[dim] > 1 else [2, 3]))
    return shape, symbolic, dim, other, draw(st.sampled_from(UNARY)), draw(st.booleans())


@settings(max_examples=40, deadline=None, derandomize=True)
@given(_fed())
# a cotangent of batch 1 for a y of batch 4: it broadcast (the gradient of 4 rows from one)
@example(([4, 3], [True, False], 0, 1, "Tanh", False))
def test_grad_ys_of_another_shape_fail(case):
    shape, symbolic, dim, other, op, existing = case
    dims = [f"d{i}" if s else n for i, (n, s) in enumerate(zip(shape, symbolic))]
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.DOUBLE, dims)  # noqa: E731
    ins = [vi("x")] + ([vi("gy")] if existing else [])
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g", ins, [vi("y")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])  # a new input, or the existing one
    onnx.checker.check_model(res.model, full_check=True)
    rng = np.random.default_rng(0)
    x = rng.uniform(0.1, 1.0, shape)
    s = stock_session(res.model)
    gy = rng.standard_normal(shape)
    got = s.run([res.grads[0]], {"x": x, "gy": gy})[0]
    eps, want = 1e-6, np.zeros(shape)
    f = stock_session(m)
    for k in np.ndindex(*shape):
        hi, lo = x.copy(), x.copy()
        hi[k] += eps
        lo[k] -= eps
        feeds = (lambda v: {"x": v, "gy": gy}) if existing else (lambda v: {"x": v})
        want[k] = ((f.run(["y"], feeds(hi))[0] - f.run(["y"], feeds(lo))[0]) * gy).sum() / (
            2 * eps)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    with pytest.raises(Exception, match="grad_ys_gy_must_have_the_shape_of_y"):
        s.run([res.grads[0]], {"x": x, "gy": np.ones(_wrong(shape, dim, other))})


@st.composite
def _losses(draw):
    kind = draw(st.sampled_from(["mse", "l1", "bce", "cross_entropy"]))
    rank = draw(st.integers(2, 4))
    shape = [draw(st.integers(2, 4)) for _ in range(rank)]
    axis = draw(st.sampled_from([1, -1])) if kind == "cross_entropy" else None
    target = list(shape)
    if kind == "cross_entropy":
        del target[axis % rank]
    dim = draw(st.integers(0, len(target) - 1)) if len(target) > 1 else 0
    other = draw(st.sampled_from([1, target[dim] + 1]))
    return kind, shape, axis, dim, other, draw(st.booleans())


@settings(max_examples=30, deadline=None, derandomize=True)
@given(_losses())
# a target of batch 1 beside predictions of batch 4: each loss broadcast it, and
# SoftmaxCrossEntropyLoss read labels past it
@example(("mse", [4, 3], None, 0, 1, False))
@example(("cross_entropy", [4, 3], 1, 0, 1, True))
def test_a_target_of_another_shape_fails(case):
    """The loss of a model whose dims are all symbolic, as a train step exports it; the right
    target gives torch's loss."""
    torch = pytest.importorskip("torch")
    kind, shape, axis, dim, other, step = case
    rank = len(shape)
    dims = [f"d{i}" for i in range(rank)]
    g = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["p"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, dims)],
        [numpy_helper.from_array(np.array(1.5, np.float32), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    opts = {"class_axis": axis} if kind == "cross_entropy" else {}
    lm = attach_loss(m, kind, **opts)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    tshape = list(shape)
    if kind == "cross_entropy":
        classes = tshape.pop(axis % rank)
        t = rng.integers(0, classes, tshape).astype(np.int64)
    else:
        t = rng.uniform(0, 1, tshape).astype(np.float32)
    if step:  # the exported training step carries the same check
        ts = build_train_step(lm, "loss")
        s = stock_session(with_defaults(ts.model, {**ts.initial_params, **ts.initial_state()}))
        feeds = {"x": x, "target": t, "lr": np.array(1e-3), "step": np.array(1, np.int64)}
    else:
        s = stock_session(lm)
        feeds = {"x": x, "target": t}
    loss = s.run(["loss"], feeds)[0]
    p = torch.tensor(x * 1.5)
    tt = torch.tensor(t)
    want = {"mse": lambda: torch.nn.functional.mse_loss(p, tt),
            "l1": lambda: torch.nn.functional.l1_loss(p, tt),
            "bce": lambda: torch.nn.functional.binary_cross_entropy_with_logits(p, tt),
            "cross_entropy": lambda: torch.nn.functional.cross_entropy(
                p if axis == 1 else p.movedim(-1, 1), tt)}[kind]()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    bad = np.zeros(_wrong(tshape, dim, other), t.dtype)
    with pytest.raises(Exception, match="target_must_have_the_shape_of_p"):
        s.run(["loss"], {**feeds, "target": bad})
