"""Gradient rules of onnxgrad/rules/activations.py against float64 central finite differences.

Each activation is checked with ``util.assert_gradients`` (random-cotangent central differences in
float64, the full ONNX checker, the float32 graph on onnxruntime) on inputs kept away from its
kinks, at the opsets it exists in; then the same gradient graph is built in float16 and float64
and must agree with float32 and emit constants of the model's dtype only.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper
from util import assert_dtypes_agree, assert_gradients, grads_of, make_model, rand, run_grads

import onnxgrad
from onnxgrad.check import check_gradients
from onnxgrad.runtime import run

F32 = np.float32


def act_model(op, attrs, opset, shape=(2, 3), dtype=F32, extra=None):
    """y = op(x, *extra inputs) with attributes; IR 11 for the opsets that need it."""
    ins = {"x": (dtype, list(shape)), **(extra or {})}
    node = helper.make_node(op, list(ins), ["y"], **attrs)
    return make_model([node], ins, ["y"], opset=opset, ir_version=11 if opset >= 23 else 10)


# id: (op, attrs, opsets, lo, hi, kinks, check kwargs)
ACTS = {
    "Relu": ("Relu", {}, [13, 18], -2, 2, (0,), {}),
    "LeakyRelu": ("LeakyRelu", {}, [13, 18], -2, 2, (0,), {}),
    "LeakyRelu_alpha": ("LeakyRelu", {"alpha": 0.3}, [13, 18], -2, 2, (0,), {}),
    "LeakyRelu_steep": ("LeakyRelu", {"alpha": 1.5}, [13, 18], -2, 2, (0,), {}),
    "LeakyRelu_negative": ("LeakyRelu", {"alpha": -0.2}, [13, 18], -2, 2, (0,), {}),
    "Elu": ("Elu", {}, [13, 18], -2, 2, (0,), {}),
    "Elu_alpha": ("Elu", {"alpha": 0.6}, [13, 18], -2, 2, (0,), {}),
    "Selu": ("Selu", {}, [13, 18], -2, 2, (0,), {}),
    "Selu_params": ("Selu", {"alpha": 1.3, "gamma": 0.8}, [13, 18], -2, 2, (0,), {}),
    "Celu": ("Celu", {}, [13, 18], -2, 2, (0,), {}),
    "Celu_alpha": ("Celu", {"alpha": 0.7}, [13, 18], -2, 2, (0,), {}),
    "Sigmoid": ("Sigmoid", {}, [13, 18], -4, 4, (), {}),
    "HardSigmoid": ("HardSigmoid", {}, [13, 18], -4, 4, (-2.5, 2.5), {}),
    "HardSigmoid_params": ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, [13, 18], -3, 3,
                           (-4 / 3, 2), {}),
    "Tanh": ("Tanh", {}, [13, 18], -3, 3, (), {}),
    "Softplus": ("Softplus", {}, [13, 18], -4, 4, (), {}),
    "Softsign": ("Softsign", {}, [13, 18], -3, 3, (), {}),
    "HardSwish": ("HardSwish", {}, [14, 22], -5, 5, (-3, 3), {}),
    "Mish": ("Mish", {}, [18, 22], -3, 3, (), {}),
    "Gelu": ("Gelu", {}, [20], -3, 3, (), {}),
    "Gelu_tanh": ("Gelu", {"approximate": "tanh"}, [20], -3, 3, (), {}),
    "ThresholdedRelu": ("ThresholdedRelu", {}, [13, 18], -2, 3, (1,), {}),
    "ThresholdedRelu_alpha": ("ThresholdedRelu", {"alpha": 0.4}, [13, 18], -2, 2, (0.4,), {}),
    # onnxruntime's float64 Shrink goes through float32: finite differences on onnx.reference
    "Shrink": ("Shrink", {}, [13, 18], -2, 2, (-0.5, 0.5), {"runtime": "reference"}),
    "Shrink_params": ("Shrink", {"lambd": 0.3, "bias": 0.2}, [13, 18], -2, 2, (-0.3, 0.3),
                      {"runtime": "reference"}),
    "Swish": ("Swish", {}, [24], -4, 4, (), {}),
    "Swish_alpha": ("Swish", {"alpha": 0.7}, [24], -4, 4, (), {}),
}
ACT_CASES = [(k, o) for k, v in ACTS.items() for o in v[2]]


@pytest.mark.parametrize("case,opset", ACT_CASES, ids=[f"{k}-{o}" for k, o in ACT_CASES])
def test_activation(case, opset):
    op, attrs, _, lo, hi, away, kw = ACTS[case]
    x = rand([3, 4], lo, hi, away, seed=len(case))
    if away:  # both sides of every kink are exercised
        assert all((x < k).any() and (x > k).any() for k in away if lo < k < hi)
    m = act_model(op, attrs, opset, shape=(3, 4))
    assert_gradients(m, "y", "x", {"x": x}, **kw)


@pytest.mark.parametrize("case", ["Relu", "Sigmoid", "Gelu", "HardSwish", "Swish"])
def test_activation_symbolic_batch(case):
    op, attrs, opsets, lo, hi, away, kw = ACTS[case]
    m = act_model(op, attrs, opsets[-1], shape=("N", 3))
    assert_gradients(m, "y", "x", {"x": rand([5, 3], lo, hi, away, seed=2)}, **kw)


SECOND_ORDER = ["Sigmoid", "Tanh", "Softplus", "Elu", "Selu", "Celu", "Gelu", "Gelu_tanh", "Mish",
                "Swish_alpha", "LeakyRelu", "HardSwish", "Softsign"]


@pytest.mark.parametrize("case", SECOND_ORDER)
def test_activation_second_order(case):
    """The gradient graph is differentiable again (d/dx of g * f'(x), and d/dg)."""
    op, attrs, opsets, lo, hi, away, kw = ACTS[case]
    m = act_model(op, attrs, opsets[-1])
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
    away = tuple(away) + ((0,) if op == "Softsign" else ())  # f'' has a kink there
    feeds = {"x": rand([2, 3], lo, hi, away, seed=5), "gy": rand([2, 3], seed=6)}
    assert_gradients(res.model, res.grads, ["x", "gy"], feeds, **kw)


def test_relu_gradient_is_zero_below():
    """Relu's gradient is exactly the cotangent above 0 and exactly 0 below (no leaks)."""
    m = act_model("Relu", {}, 18, shape=(6,))
    x = np.array([-2, -0.5, -1e-3, 1e-3, 0.5, 2], F32)
    (gx,), _ = grads_of(m, "y", ["x"], {"x": x})
    np.testing.assert_array_equal(gx, [0, 0, 0, 1, 1, 1])


@pytest.mark.parametrize("dtype", [F32, np.float64, np.float16])
def test_hard_swish_gradient_at_its_kinks_and_infinities(dtype):
    """torch's hardswish_backward at the kinks (0 at -3, 1 at 3: x / 3 + 1/2 only strictly
    between; before session 33 onnxgrad gave -0.5 and 1.5 there), beyond them and at +-inf (0
    and 1, not the NaN of inf * 0)."""
    torch = pytest.importorskip("torch")
    x = np.array([-np.inf, -4, -3, -1.5, 0, 1.5, 3, 4, np.inf], dtype)
    m = act_model("HardSwish", {}, 18, shape=x.shape, dtype=dtype)
    (gx,), _ = grads_of(m, "y", ["x"], {"x": x})
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    torch.nn.functional.hardswish(tx).sum().backward()
    got, want = gx.astype(np.float64), tx.grad.numpy()
    edge = np.abs(x) >= 3  # exactly 0 or 1 there; inside, within rounding of x / 3 + 1/2
    np.testing.assert_array_equal(got[edge], want[edge])
    np.testing.assert_allclose(got[~edge], want[~edge], rtol=0, atol=2e-3 if dtype == np.float16
                               else 1e-6)


@pytest.mark.parametrize("alpha", [0.01, 0.0, 1.0, 1.5, -0.2])
def test_leaky_relu_gradient_is_g_or_g_alpha(alpha):
    """Exactly g above 0 and g * alpha at and below it, for non-finite g too (the product form
    for 0 <= alpha <= 1, Where otherwise)."""
    x = np.array([-2, -1e-30, 0, 1e-30, 2, -1, 1, -3], F32)
    g = np.array([1.5, -2, 3, np.inf, -np.inf, np.inf, np.nan, np.nan], F32)
    m = act_model("LeakyRelu", {"alpha": alpha}, 18, shape=x.shape)
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["g"])
    (gx,) = run(res.model, {"x": x, "g": g}, outputs=res.grads)
    want = np.where(x > 0, g, g * F32(alpha))
    np.testing.assert_array_equal(gx, want)


_EDGES = [0.0, -0.0, 1e-30, -1e-30, np.inf, -np.inf, np.nan, 3.5, -2.25]


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_relu_gradient_is_tf_relu_grad_generated(data):
    """Relu's gradient is TF's ReluGrad, g * (x > 0), bit for bit in float32 and float64: the
    mask's edges (x = +-0, tiny x = +-1e-30), and non-finite cotangents, which give NaN where
    x <= 0 as in TF (0 * inf), never a silently dropped inf above 0. No subnormal values: TF's
    CPU kernels flush them to zero (ReluGrad of x = 1e-40 is 0 there), onnxruntime does not."""
    tf = pytest.importorskip("tensorflow")
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    shape = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    size = int(np.prod(shape))
    value = st.floats(-4, 4, width=32, allow_subnormal=False)
    draw = st.lists(st.one_of(st.sampled_from(_EDGES), value), min_size=size, max_size=size)
    x = np.array(data.draw(draw), dtype).reshape(shape)
    g = np.array(data.draw(draw), dtype).reshape(shape)
    m = act_model("Relu", {}, 18, shape=shape, dtype=dtype)
    res = onnxgrad.gradients(m, ["y"], ["x"], grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    (gx,) = run(res.model, {"x": x, "gy": g}, outputs=[res.grads[0]])
    want = tf.raw_ops.ReluGrad(gradients=g, features=x).numpy()
    np.testing.assert_array_equal(gx, want)  # NaN where TF has NaN, exact elsewhere


# -- PRelu: slope broadcasting --------------------------------------------------------------------
PRELU = {  # id: (x shape, slope shape, opsets)
    "per_channel_last": ([2, 3, 4], [4], [13, 18]),
    "per_channel_col": ([2, 3, 4], [3, 1], [13, 18]),
    "single": ([2, 3, 4], [1], [13, 18]),
    "scalar": ([2, 3, 4], [], [18]),
    "full": ([2, 3, 4], [2, 3, 4], [13, 18]),
    "rank3_slope": ([2, 3, 4], [1, 3, 1], [18]),
    "symbolic_batch": (["N", 3, 4], [3, 1], [18]),
}
PRELU_CASES = [(k, o) for k, v in PRELU.items() for o in v[2]]


@pytest.mark.parametrize("case,opset", PRELU_CASES, ids=[f"{k}-{o}" for k, o in PRELU_CASES])
def test_prelu(case, opset):
    sx, ss, _ = PRELU[case]
    m = act_model("PRelu", {}, opset, shape=sx, extra={"slope": (F32, ss)})
    x = rand([2 if d == "N" else d for d in sx], -2, 2, (0,), seed=4)
    slope = np.asarray(rand(ss, 0.05, 0.6, seed=5))
    # check_gradients turns a 0-d x into a numpy scalar, which onnxruntime refuses
    kw = {"runtime": "reference"} if not ss else {}
    assert_gradients(m, "y", ["x", "slope"], {"x": x, "slope": slope}, **kw)


def test_prelu_constant_slope():
    m = make_model([helper.make_node("PRelu", ["x", "slope"], ["y"])], {"x": (F32, ["N", 3])},
                   ["y"], inits={"slope": np.array([0.1, 0.2, 0.3], F32)})
    assert_gradients(m, "y", ["x", "slope"], {"x": rand([4, 3], away=(0,), seed=1)})


@pytest.mark.parametrize("sx,ss", [([3, 4], [2, 3, 4]), ([1, 4], [3, 4])])
def test_prelu_slope_that_does_not_broadcast_to_x_is_refused(sx, ss):
    """onnxruntime broadcasts PRelu both ways (y larger than X, out of the schema); the gradient
    model, typed by onnx's inference as X's shape, failed the checker and onnxruntime."""
    g = helper.make_graph([helper.make_node("PRelu", ["x", "s"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", 1, sx),
                           helper.make_tensor_value_info("s", 1, ss)],
                          [helper.make_tensor_value_info("y", 1, sx)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 16)], ir_version=8)
    with pytest.raises(onnxgrad.NotDifferentiableError, match="does not broadcast to X"):
        onnxgrad.gradients(m, "y", ["x", "s"])


# -- Softmax / LogSoftmax -------------------------------------------------------------------------
SOFTMAX_AXES = [None, 0, 1, 2, -1, -2, -3]
SM_CASES = [(op, a, o) for op in ["Softmax", "LogSoftmax"] for a in SOFTMAX_AXES for o in (13, 18)]


@pytest.mark.parametrize("op,axis,opset", SM_CASES,
                         ids=[f"{op}-axis{a}-{o}" for op, a, o in SM_CASES])
def test_softmax(op, axis, opset):
    attrs = {} if axis is None else {"axis": axis}
    m = act_model(op, attrs, opset, shape=(2, 3, 4))
    assert_gradients(m, "y", "x", {"x": rand([2, 3, 4], -3, 3, seed=7)})


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [0, -1])
def test_softmax_symbolic(op, axis):
    m = act_model(op, {"axis": axis}, 18, shape=("N", 5))
    assert_gradients(m, "y", "x", {"x": rand([3, 5], -3, 3, seed=8)})


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_second_order(op):
    m = act_model(op, {"axis": 1}, 18, shape=(2, 4))
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
    assert_gradients(res.model, res.grads, ["x", "gy"],
                     {"x": rand([2, 4], -2, 2, seed=9), "gy": rand([2, 4], seed=10)})


def test_softmax_rows_sum_invariance():
    """Softmax is invariant to adding a constant along its axis: the gradient sums to 0 there
    (a property the finite-difference check with sum(y) alone would not see)."""
    m = act_model("Softmax", {"axis": 1}, 18, shape=(3, 5))
    x = rand([3, 5], seed=11)
    gy = rand([3, 5], seed=12)
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
    (gx,) = run(res.model, {"x": x, "gy": gy}, outputs=res.grads)
    np.testing.assert_allclose(gx.sum(axis=1), 0, atol=1e-6)


def test_activation_chain():
    """A small network of activations: Softmax(Gelu(PRelu(x)) + Tanh(x)) then LogSoftmax."""
    nodes = [helper.make_node("PRelu", ["x", "slope"], ["p"]),
             helper.make_node("Gelu", ["p"], ["g"]),
             helper.make_node("Tanh", ["x"], ["t"]),
             helper.make_node("Add", ["g", "t"], ["s"]),
             helper.make_node("Softmax", ["s"], ["sm"], axis=-1),
             helper.make_node("Sigmoid", ["sm"], ["sg"]),
             helper.make_node("LogSoftmax", ["sg"], ["y"], axis=0)]
    m = make_model(nodes, {"x": (F32, ["N", 4]), "slope": (F32, [4])}, ["y"], opset=20)
    feeds = {"x": rand([3, 4], away=(0,), seed=13), "slope": rand([4], 0.1, 0.5, seed=14)}
    assert_gradients(m, "y", ["x", "slope"], feeds)


# -- dtypes: float16 / float64 graphs agree with float32 ------------------------------------------
DTYPE_CASES = {k: v for k, v in ACTS.items() if v[0] != "Celu"}  # Celu-12 is float32 only
DTYPE_CASES.update({
    "PRelu": ("PRelu", {}, [18], -2, 2, (0,), {}),
    "Softmax": ("Softmax", {"axis": 0}, [18], -2, 2, (), {}),
    "LogSoftmax": ("LogSoftmax", {"axis": -1}, [13], -2, 2, (), {}),
})


def run_in_dtype(case, dtype):
    """Gradient graph of the case built in ``dtype``, run on onnxruntime CPU (onnx.reference only
    where onnxruntime has no kernel for the forward op itself in that dtype)."""
    op, attrs, opsets, lo, hi, away, _ = DTYPE_CASES[case]
    extra = {"slope": (dtype, [3])} if op == "PRelu" else None
    m = act_model(op, attrs, opsets[-1], dtype=dtype, extra=extra)
    xs = ["x"] + list(extra or {})
    res = onnxgrad.gradients(m, "y", xs, grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)

    def exact(a):  # values that float16, float32 and float64 all hold exactly
        return np.asarray(a).astype(np.float16).astype(dtype)

    fd = {"x": exact(rand([2, 3], lo, hi, away, gap=0.15, seed=1)),
          "gy": exact(rand([2, 3], -1, 1, seed=2))}
    if extra:
        fd["slope"] = exact(rand([3], 0.1, 0.5, seed=3))
    return res, run_grads(res, m, fd)


@pytest.mark.parametrize("case", list(DTYPE_CASES))
def test_dtypes_agree_with_float32(case):
    assert_dtypes_agree(lambda dtype: run_in_dtype(case, dtype))


# -- attribute defaults: the forward's float32 constants (issue 12, item 5) ---------------------
# An absent attribute means the schema's default, a float32 (AttributeProto.f): Selu's alpha is
# 1.67326319217681884765625, LeakyRelu's 0.009999999776482582. A derivative built from the
# more exact constants is off by 1e-8 .. 5e-8 relative, which float64 differences resolve: the
# piecewise linear ones with a wide step (exact away from the kink), the smooth ones with 1e-5.
@pytest.mark.parametrize("op,opset,eps", [
    ("Selu", 18, 1e-5), ("Elu", 18, 1e-5), ("Celu", 18, 1e-5),
    ("LeakyRelu", 18, 1e-3), ("HardSigmoid", 18, 1e-3), ("ThresholdedRelu", 18, 1e-3)])
def test_default_attributes_are_the_forwards_constants(op, opset, eps):
    m = act_model(op, {}, opset, shape=(4, 6))
    # away from every kink by more than the step: 0, ThresholdedRelu's 1, HardSigmoid's +-2.5
    x = rand((4, 6), -3, 3, away=(0, 1, -2.5, 2.5), gap=0.2, seed=1)
    report = check_gradients(m, "y", "x", {"x": x}, eps=eps, rtol=2e-9, atol=1e-13)
    assert report.ok, str(report)


def test_spec_defaults_are_float32():
    from onnxgrad.rules.spec import default
    assert default("", "Selu", 18, "alpha") == float(np.float32(1.6732632423543772))
    assert default("", "LeakyRelu", 18, "alpha") == float(np.float32(0.01))
    assert default("", "GridSample", 16, "mode") == "bilinear"
    assert default("", "GridSample", 20, "mode") == "linear"
    assert default("", "Conv", 18, "pads") is None
    assert default("", "NoSuchOp", 18, "alpha") is None



@settings(derandomize=True, max_examples=25, deadline=None)
@given(xs=st.lists(st.floats(-80, 80, width=32), min_size=1, max_size=8),
       case=st.sampled_from([("Softplus", np.float32), ("Softplus", np.float64),
                             ("Mish", np.float32)]))
def test_softplus_and_mish_gradients_are_relatively_exact_in_the_tail(xs, case):
    """Their derivatives hold sigmoid(x), which onnxruntime's Sigmoid computes to ~1e-7 absolute
    only (2e-4 relative at -8, 0 from -20 in float32): the rules read it from the softplus
    below 0. Against a 50-digit reference, d softplus = sigmoid and d mish = tanh(sp) +
    x sigmoid(x) (1 - tanh(sp)^2), sp = softplus(x), to a few ulp of the terms' size (Mish's
    two terms cancel near its minimum). Not Mish in float64: onnxruntime's float64 Softplus is
    log(1 + exp(x)) (2e-3 relative at -30, 0 from -37), which the gradient shares with the
    forward."""
    import mpmath
    mpmath.mp.dps = 50
    op, dtype = case
    x = np.array(xs + [-30.0, -20.0, -7.9, 0.0, 10.0], dtype)
    m = act_model(op, {}, 18, shape=(len(x),), dtype=dtype)
    (gx,), _ = grads_of(m, ["y"], ["x"], {"x": x})
    want, scale = [], []
    for v in x.astype(np.float64):
        v = mpmath.mpf(float(v))
        s = 1 / (1 + mpmath.exp(-v))
        if op == "Softplus":
            want.append(s)
            scale.append(s)
        else:
            t = mpmath.tanh(mpmath.log1p(mpmath.exp(v)))
            want.append(t + v * s * (1 - t * t))
            scale.append(abs(t) + abs(v * s * (1 - t * t)))
    want, scale = (np.array([float(w) for w in a]) for a in (want, scale))
    keep = scale > np.finfo(dtype).tiny * 1e3  # below: denormals
    rtol = 2e-6 if dtype == np.float32 else 1e-12
    assert np.all(np.abs(gx - want)[keep] <= rtol * scale[keep]), (x, gx, want)
