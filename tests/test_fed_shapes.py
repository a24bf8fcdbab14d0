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


# -- initializers that are also graph inputs: defaults a caller may override ----------------------
def _i64(*v):
    return np.array(v, np.int64)


@st.composite
def _reader(draw):
    """(node, x's shape, {input: (default, fed)}): an op that reads a value it does not
    differentiate (a shape, axes, indices, pads, repeats, k, a factor of x) from an initializer
    that is also a graph input, fed another value at run time."""
    kind = draw(st.sampled_from(["Slice", "Expand", "Reshape", "Pad", "Tile", "Gather",
                                 "ReduceSum", "Unsqueeze", "TopK", "CumSum", "Mul", "Split"]))
    ax = draw(st.integers(0, 1))
    node = helper.make_node(kind, ["x", "d"], ["y"])
    shape = [4, 5]
    if kind == "Slice":
        lo, hi = sorted(draw(st.lists(st.integers(0, 4), min_size=2, max_size=2, unique=True)))
        node.input.extend(["e", "a"])
        return node, shape, {"d": (_i64(0), _i64(lo)), "e": (_i64(2), _i64(hi + 1)),
                             "a": (_i64(0), _i64(ax))}
    if kind == "Expand":
        return node, [4, 1], {"d": (_i64(1, 4, 2), _i64(draw(st.integers(1, 3)), 4, 5))}
    if kind == "Reshape":
        return node, shape, {"d": (_i64(4, 5), draw(st.sampled_from([_i64(5, 4), _i64(2, 10)])))}
    if kind == "Pad":
        node.attribute.append(helper.make_attribute(
            "mode", draw(st.sampled_from(["constant", "edge", "reflect"]))))
        pads = draw(st.lists(st.integers(0, 2), min_size=4, max_size=4))
        return node, shape, {"d": (_i64(0, 0, 0, 0), _i64(*pads))}
    if kind == "Tile":
        return node, shape, {"d": (_i64(1, 1), _i64(draw(st.integers(1, 3)), 2))}
    if kind == "Gather":
        node.attribute.append(helper.make_attribute("axis", ax))
        idx = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
        return node, shape, {"d": (_i64(0, 1), _i64(*idx))}
    if kind == "ReduceSum":
        return node, shape, {"d": (_i64(ax), _i64(1 - ax))}
    if kind == "Unsqueeze":
        return node, shape, {"d": (_i64(0), _i64(draw(st.integers(1, 2))))}
    if kind == "TopK":
        node.output.append("i")
        node.attribute.append(helper.make_attribute("axis", ax))
        return node, shape, {"d": (_i64(1), _i64(draw(st.integers(2, 4))))}
    if kind == "CumSum":
        return node, shape, {"d": (np.array(ax, np.int64), np.array(1 - ax, np.int64))}
    if kind == "Mul":
        return node, shape, {"d": (np.ones(5), np.linspace(-2, 3, 5))}
    node.output.append("z")
    node.attribute.append(helper.make_attribute("axis", 1))
    return node, shape, {"d": (_i64(2, 3), _i64(4, 1))}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_reader(), st.booleans(), st.integers(0, 2**16))
@example((helper.make_node("Slice", ["x", "d", "e"], ["y"]), [6],
          {"d": (_i64(1), _i64(2)), "e": (_i64(4), _i64(6))}), False, 0)
@example((helper.make_node("Expand", ["x", "d"], ["y"]), [3],
          {"d": (_i64(1, 3), _i64(4, 3))}), False, 0)
@example((helper.make_node("Split", ["x", "d"], ["y", "z"], axis=1), [4, 5],
          {"d": (_i64(2, 3), _i64(4, 1))}), True, 0)
def test_overridable_initializers_are_read_at_run_time(case, inferred, seed):
    """An initializer that is also a graph input (IR 4 and later) is a default the caller may
    override; onnx's shape inference and the rules read it as a constant: a Slice's starts fed
    at run time gave a gradient of another length, an Expand's shape one of its default's
    values; and where the model holds what onnx's inference wrote (``inferred``), that came
    from the default (a Split's parts). The gradient is now right for the fed values (float64
    central differences) and for the defaults, which the result keeps."""
    node, shape, values = case
    inputs = [helper.make_tensor_value_info("x", TensorProto.DOUBLE, shape)]
    inits = []
    for k, (default, _) in values.items():  # (of the default's rank and, but for indices, size)
        inputs.append(helper.make_tensor_value_info(
            k, helper.np_dtype_to_tensor_dtype(default.dtype),
            ["n"] if node.op_type == "Gather" else default.shape))
        inits.append(numpy_helper.from_array(default, k))
    g = helper.make_graph([node], "g", inputs,
                          [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    rank = stock_session(m).run(["y"], {"x": np.zeros(shape)})[0].ndim
    m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.DOUBLE,
                                                             [f"y{j}" for j in range(rank)]))
    if inferred:
        m = onnx.shape_inference.infer_shapes(m)
    onnx.checker.check_model(m, full_check=True)
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    assert {t.name for t in res.model.graph.initializer} >= set(values)
    x = np.random.default_rng(seed).permutation(np.prod(shape)).reshape(shape) * 0.37 + 0.1
    forward, backward = stock_session(m), stock_session(res.model)
    for feeds in ({"x": x}, {"x": x, **{k: fed for k, (_, fed) in values.items()}}):
        got = backward.run([res.grads[0]], feeds)[0]
        want = np.zeros_like(x)
        for i in np.ndindex(*shape):  # (y is piecewise linear in x here: steps of 1e-3 are exact)
            for sign in (1, -1):
                xi = x.copy()
                xi[i] += sign * 1e-3
                want[i] += sign * forward.run(["y"], {**feeds, "x": xi})[0].sum() / 2e-3
        np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9, err_msg=str(feeds))


@pytest.mark.parametrize("kind", ["Expand", "Reshape", "Tile", "Gather", "Mul"])
def test_ir3_initializers_are_the_results_constants(kind):
    """Below IR 4 every initializer is a graph input too (the IR's rule; onnxruntime refuses a
    value fed for one): gradients() reads those it does not differentiate as constants, so the
    result (IR 7) takes none of them as inputs, where it took them as defaults to override and
    ran the forward with a fed value and the gradient with the default (Expand: a gradient of 1
    for 4). An x among them stays an input the result computes at."""
    values = {"Expand": np.array([1, 3]), "Reshape": np.array([3, 1]), "Tile": np.array([2]),
              "Gather": np.array([0, 2, 2]), "Mul": np.array([0.5, -1.0, 2.0])}
    d = values[kind]
    node = helper.make_node(kind, ["x", "d"], ["y"])
    w = numpy_helper.from_array(np.array([0.3, 0.2, 0.1]), "w")  # (an x that is initialized)
    xw = helper.make_node("Mul", ["x0", "w"], ["x"])
    g = helper.make_graph([xw, node], "g", [
        helper.make_tensor_value_info("x0", TensorProto.DOUBLE, [3]),
        helper.make_tensor_value_info("w", TensorProto.DOUBLE, [3]),
        helper.make_tensor_value_info("d", helper.np_dtype_to_tensor_dtype(d.dtype), d.shape)],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)],
        [numpy_helper.from_array(d, "d"), w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 8)], ir_version=3)
    res = onnxgrad.gradients(m, "y", ["x0", "w"])
    onnx.checker.check_model(res.model, full_check=True)
    assert [v.name for v in res.model.graph.input] == ["x0", "w"]
    backward = stock_session(res.model)  # (which computes y too: the model's session takes no w)
    x0, w2 = np.array([1.0, 2.0, 3.0]), np.array([1.5, -0.5, 0.25])
    for feeds in ({"x0": x0}, {"x0": x0, "w": w2}):
        got = backward.run(res.grads, feeds)
        for k, v in feeds.items():
            want = np.zeros(3)
            for i in range(3):
                for sign in (1, -1):
                    shifted = dict(feeds, **{k: v + sign * 1e-3 * np.eye(3)[i]})
                    want[i] += sign * backward.run(["y"], shifted)[0].sum() / 2e-3
            np.testing.assert_allclose(got[["x0", "w"].index(k)], want, rtol=1e-7)
    with pytest.raises(Exception, match="d"):
        backward.run(res.grads, {"x0": x0, "d": d})
