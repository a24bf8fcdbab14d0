"""Gradient rules of onnxgrad/rules/math.py against float64 central finite differences.

Every test builds a small ONNX model, asks onnxgrad for its gradient graph and checks it with
``util.assert_gradients``: random-cotangent central differences in float64, the full ONNX checker on
the gradient model and the same graph run in float32 on onnxruntime. Inputs are drawn where the
function is smooth (positive for Log/Sqrt, |x| < 1 for Asin/Acos/Atanh, away from kinks) so that
finite differences are a valid oracle.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from util import (assert_dtypes_agree, assert_gradients, grads_of, make_model, op_model, rand,
                  run_grads)

import onnxgrad
from onnxgrad.runtime import run, session

F32 = np.float32
OPSETS = [13, 18]


def nonzero(shape, lo=0.4, hi=2.0, seed=0, dtype=F32):
    """Values with lo <= |x| <= hi and random signs."""
    rng = np.random.default_rng(seed + 100)
    return np.asarray(rand(shape, lo, hi, seed=seed, dtype=np.float64)
                      * rng.choice([-1.0, 1.0], size=shape), dtype)


def distinct(shapes, seed=0):
    """Arrays of the given shapes whose values are all different (at least 0.05 apart)."""
    rng = np.random.default_rng(seed)
    total = sum(int(np.prod(s)) for s in shapes)
    vals = (rng.permutation(total) - total / 2) * 0.1 + rng.uniform(-0.02, 0.02, total)
    out, k = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(vals[k:k + n].reshape(s).astype(F32))
        k += n
    return out


def scalar_kw(*shapes):
    """check_gradients perturbs a 0-d x into a numpy scalar, which onnxruntime refuses
    ("Unable to handle object of type numpy.float64"); onnx.reference takes it."""
    return {"runtime": "reference"} if any(len(s) == 0 for s in shapes) else {}


def concrete(shape, sizes):
    return [sizes[d] if isinstance(d, str) else d for d in shape]


def gradient_ops(model):
    """op types of the nodes onnxgrad added (under the "gradients" scope)."""
    return [n.op_type for n in model.graph.node if n.name.startswith("gradients/")]


# -- unary elementwise ----------------------------------------------------------------------------
UNARY = {  # op: (lo, hi, kinks to stay away from)
    "Identity": (-2, 2, ()),
    "Neg": (-2, 2, ()),
    "Abs": (-2, 2, (0,)),
    "Reciprocal": (-2, 2, (0,)),
    "Sqrt": (0.2, 3, ()),
    "Exp": (-2, 2, ()),
    "Log": (0.2, 3, ()),
    "Erf": (-2, 2, ()),
    "Sin": (-3, 3, ()),
    "Cos": (-3, 3, ()),
    "Tan": (-1.2, 1.2, ()),
    "Asin": (-0.85, 0.85, ()),
    "Acos": (-0.85, 0.85, ()),
    "Atan": (-3, 3, ()),
    "Sinh": (-2, 2, ()),
    "Cosh": (-2, 2, ()),
    "Asinh": (-3, 3, ()),
    "Acosh": (1.2, 3, ()),
    "Atanh": (-0.85, 0.85, ()),
}


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("op", list(UNARY))
def test_unary(op, opset):
    lo, hi, away = UNARY[op]
    m = op_model(op, {"x": (F32, [2, 3])}, opset=opset)
    assert_gradients(m, "y", "x", {"x": rand([2, 3], lo, hi, away, seed=len(op))})


@pytest.mark.parametrize("op", ["Exp", "Sqrt", "Log", "Erf", "Atan", "Acosh"])
def test_unary_symbolic_batch(op):
    lo, hi, away = UNARY[op]
    m = op_model(op, {"x": (F32, ["N", 3])})
    assert_gradients(m, "y", "x", {"x": rand([5, 3], lo, hi, away)})


@pytest.mark.parametrize("op", ["Sin", "Sqrt", "Reciprocal", "Asin", "Atanh", "Abs", "Erf", "Cosh"])
def test_unary_second_order(op):
    """The gradient graph is itself differentiable: d(g * f'(x))/dx = g * f''(x), d/dg = f'(x)."""
    lo, hi, away = UNARY[op]
    m = op_model(op, {"x": (F32, [2, 3])})
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
    feeds = {"x": rand([2, 3], lo, hi, away, seed=3), "gy": rand([2, 3], seed=4)}
    assert_gradients(res.model, res.grads, ["x", "gy"], feeds)


# -- Add / Sub / Mul / Div / Pow with broadcasting ------------------------------------------------
BCAST = {
    "same": ([2, 3], [2, 3]),
    "scalar_b": ([2, 3], []),
    "scalar_a": ([], [2, 3]),
    "trailing": ([2, 3], [3]),
    "leading": ([3], [2, 3]),
    "column": ([2, 3], [2, 1]),
    "both_sides": ([2, 1], [1, 3]),
    "rank3x2": ([2, 1, 3], [4, 1]),
    "ones_rank3": ([1, 3], [2, 1, 1]),
}


def binary_feeds(op, sa, sb, seed=0):
    a = rand(sa, -2, 2, seed=seed)
    b = rand(sb, -2, 2, seed=seed + 1)
    if op == "Div":
        b = nonzero(sb, 0.5, 2, seed=seed + 1)
    if op == "Pow":
        a = rand(sa, 0.3, 2.5, seed=seed)
    return {"a": a, "b": b}


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("case", list(BCAST))
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow"])
def test_binary_broadcast(op, case, opset):
    sa, sb = BCAST[case]
    m = op_model(op, {"a": (F32, sa), "b": (F32, sb)}, opset=opset)
    assert_gradients(m, "y", ["a", "b"], binary_feeds(op, sa, sb), **scalar_kw(sa, sb))


SYMBOLIC = {  # id: (shape a, shape b, run-time sizes, dynamic reduction expected)
    "N_vs_static_row": (["N", 3], [1, 3], {"N": 4}, False),
    "N_vs_trailing": (["N", 3], [3], {"N": 4}, False),
    "N_both_same_symbol": (["N", 3], ["N", 3], {"N": 4}, False),
    "N_vs_M_b_broadcasts": (["N", 3], ["M", 3], {"N": 4, "M": 1}, True),
    "N_vs_M_a_broadcasts": (["N", 3], ["M", 3], {"N": 1, "M": 4}, True),
    "N_vs_M_rank3": (["N", 1, 3], ["M", 3], {"N": 2, "M": 4}, False),  # [N,M,3]: all known
    "N_vs_M_equal": (["N", 2], ["M", 2], {"N": 3, "M": 3}, True),
}


@pytest.mark.parametrize("case", list(SYMBOLIC))
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow"])
def test_binary_symbolic(op, case):
    sa, sb, sizes, dynamic = SYMBOLIC[case]
    m = op_model(op, {"a": (F32, sa), "b": (F32, sb)})
    feeds = binary_feeds(op, concrete(sa, sizes), concrete(sb, sizes), seed=7)
    assert_gradients(m, "y", ["a", "b"], feeds)
    res = onnxgrad.gradients(m, "y", ["a", "b"])
    # different symbols can only be reduced from run-time shapes; known ones never need it
    assert ("NonZero" in gradient_ops(res.model)) == dynamic


def test_binary_symbolic_one_graph_two_sizes():
    """The same gradient graph is right for two different run-time broadcasts."""
    m = op_model("Mul", {"a": (F32, ["N", 3]), "b": (F32, ["M", 3])})
    res = onnxgrad.gradients(m, "y", ["a", "b"])
    for n, mm in [(4, 1), (1, 4), (3, 3)]:
        a, b = rand([n, 3], seed=n), rand([mm, 3], seed=mm + 10)
        ga, gb = run(res.model, {"a": a, "b": b}, outputs=res.grads)
        ones = np.ones(np.broadcast_shapes(a.shape, b.shape))
        np.testing.assert_allclose(ga, (ones * b).sum(0, keepdims=True) if n == 1 else ones * b,
                                   rtol=1e-6)
        np.testing.assert_allclose(gb, (ones * a).sum(0, keepdims=True) if mm == 1 else ones * a,
                                   rtol=1e-6)


def test_same_input_twice():
    """x * x and x / x: both inputs are one tensor, the gradients add up."""
    m = make_model([helper.make_node("Mul", ["x", "x"], ["p"]),
                    helper.make_node("Div", ["p", "x"], ["y"])],
                   {"x": (F32, [2, 3])}, ["y"])
    assert_gradients(m, "y", "x", {"x": nonzero([2, 3])})


# -- Pow ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("int_type", [np.int64, np.int32])
def test_pow_int_exponent_tensor(int_type, opset):
    m = op_model("Pow", {"a": (F32, [2, 3]), "b": (int_type, [3])}, opset=opset)
    feeds = {"a": nonzero([2, 3], 0.5, 1.5), "b": np.array([1, 2, 3], int_type)}
    assert_gradients(m, "y", "a", feeds)  # negative bases too: the exponents are integers
    # an integer exponent is a constant: no gradient flows to it
    assert onnxgrad.gradients(m, "y", ["a", "b"]).grads[1] is None


@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5, -1.5])
def test_pow_constant_exponent(exponent):
    """x ** c with c an initializer (the LayerNorm x**2 idiom); negative x for integer c."""
    m = op_model("Pow", {"a": (F32, [2, 3])}, inits={"c": np.array(exponent, F32)})
    a = nonzero([2, 3], 0.4, 2) if float(exponent).is_integer() else rand([2, 3], 0.4, 2)
    assert_gradients(m, "y", "a", {"a": a})


@pytest.mark.parametrize("ta,tb", [(np.float32, np.float64), (np.float64, np.float32),
                                   (np.float16, np.float32), (np.float32, np.float16)])
def test_pow_mixed_float_types(ta, tb):
    """Pow lets base and exponent have different float types: each gradient has its input's."""
    m = op_model("Pow", {"a": (ta, [2, 3]), "b": (tb, [3])})
    feeds = {"a": rand([2, 3], 0.5, 2).astype(np.float16).astype(ta),
             "b": rand([3], -1, 2, seed=1).astype(np.float16).astype(tb)}
    assert_gradients(m, "y", ["a", "b"], feeds)
    res = onnxgrad.gradients(m, "y", ["a", "b"])
    types = {o.name: o.type.tensor_type.elem_type for o in res.model.graph.output}
    assert [types[g] for g in res.grads] == [helper.np_dtype_to_tensor_dtype(np.dtype(t))
                                             for t in (ta, tb)]


def test_pow_exponent_gradient_at_nonpositive_base_is_zero():
    """d(a**b)/db = a**b log a is undefined for a <= 0; like TF it is 0 there, never NaN."""
    m = op_model("Pow", {"a": (F32, [4]), "b": (F32, [4])})
    a = np.array([-2.0, 0.0, 1.5, 2.0], F32)
    b = np.array([2.0, 3.0, 2.0, 0.5], F32)
    (ga, gb), _ = grads_of(m, "y", ["a", "b"], {"a": a, "b": b})
    np.testing.assert_allclose(gb, [0, 0, 1.5**2 * np.log(1.5), 2**0.5 * np.log(2)], rtol=1e-5)
    np.testing.assert_allclose(ga, b * a ** (b - 1), rtol=1e-5)


# -- variadic: Sum, Mean, Min, Max ----------------------------------------------------------------
VARIADIC = {
    "one": [[2, 3]],
    "two_same": [[2, 3], [2, 3]],
    "two_bcast": [[2, 3], [3]],
    "three_bcast": [[2, 1, 3], [4, 1], []],
    "three_both_sides": [[2, 1], [1, 3], [2, 3]],
}


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("case", list(VARIADIC))
@pytest.mark.parametrize("op", ["Sum", "Mean", "Min", "Max"])
def test_variadic(op, case, opset):
    shapes = VARIADIC[case]
    names = [f"x{i}" for i in range(len(shapes))]
    m = op_model(op, {n: (F32, s) for n, s in zip(names, shapes)}, opset=opset)
    feeds = dict(zip(names, distinct(shapes, seed=len(shapes))))
    if op == "Mean" and len({tuple(s) for s in shapes}) > 1:
        # onnxruntime has no float64 Mean and onnx.reference's Mean cannot broadcast when the
        # first input is the smaller one: finite differences of numpy's mean instead
        numpy_fd_check(m, names, feeds, lambda *xs: sum(np.broadcast_arrays(*xs)) / len(xs))
    else:
        assert_gradients(m, "y", names, feeds, **scalar_kw(*shapes))


def numpy_fd_check(model, xs, feeds, fn, eps=1e-6):
    """onnxgrad's gradient (float32, onnxruntime) against central differences of the numpy
    function ``fn`` in float64, projected on a random cotangent."""
    res = onnxgrad.gradients(model, "y", xs, grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    x64 = [np.asarray(feeds[x], np.float64) for x in xs]
    cot = np.random.default_rng(0).standard_normal(np.shape(fn(*x64)))
    got = session(res.model).run(res.grads, {**feeds, "gy": cot.astype(F32)})
    for i, (name, g) in enumerate(zip(xs, got)):
        num = np.zeros(x64[i].shape)
        for idx in np.ndindex(x64[i].shape):
            plus, minus = [a.copy() for a in x64], [a.copy() for a in x64]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            num[idx] = np.sum(cot * (fn(*plus) - fn(*minus))) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("op", ["Min", "Max"])
def test_min_max_symbolic(op):
    m = op_model(op, {"a": (F32, ["N", 3]), "b": (F32, ["M", 3]), "c": (F32, [3])})
    a, b, c = distinct([[1, 3], [4, 3], [3]], seed=5)
    assert_gradients(m, "y", ["a", "b", "c"], {"a": a, "b": b, "c": c})


@pytest.mark.parametrize("op", ["Min", "Max"])
def test_min_max_two_way_tie(op):
    """At a two-way tie the central difference of min/max is 1/2 for each input: the gradient
    is shared evenly (as PyTorch does)."""
    m = op_model(op, {"a": (F32, [4]), "b": (F32, [4])})
    feeds = {"a": np.array([1.0, -0.5, 2.0, 0.3], F32), "b": np.array([1.0, 0.7, -1.0, 0.3], F32)}
    assert_gradients(m, "y", ["a", "b"], feeds)
    (ga, gb), _ = grads_of(m, "y", ["a", "b"], feeds)
    np.testing.assert_allclose(ga[[0, 3]], 0.5)
    np.testing.assert_allclose(gb[[0, 3]], 0.5)


def test_sum_symbolic():
    m = op_model("Sum", {"a": (F32, ["N", 3]), "b": (F32, ["M", 3]), "c": (F32, [1])})
    feeds = {"a": rand([1, 3]), "b": rand([4, 3], seed=1), "c": rand([1], seed=2)}
    assert_gradients(m, "y", ["a", "b", "c"], feeds)


# -- Where ----------------------------------------------------------------------------------------
WHERE = {  # cond, a, b
    "same": ([2, 3], [2, 3], [2, 3]),
    "ab_broadcast": ([2, 3], [3], []),
    "cond_largest": ([2, 3], [1, 3], [2, 1]),
    "cond_broadcast": ([3], [2, 3], [2, 1]),
    "rank3": ([2, 1, 3], [4, 1], [4, 3]),
}


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("case", list(WHERE))
def test_where(case, opset):
    sc, sa, sb = WHERE[case]
    m = op_model("Where", {"c": (np.bool_, sc), "a": (F32, sa), "b": (F32, sb)}, opset=opset)
    cond = np.random.default_rng(1).random(sc) < 0.5
    assert_gradients(m, "y", ["a", "b"], {"c": cond, "a": rand(sa), "b": rand(sb, seed=1)},
                     **scalar_kw(sa, sb))
    # the condition is bool: no gradient
    assert onnxgrad.gradients(m, "y", ["c", "a"]).grads[0] is None


def test_where_symbolic():
    m = op_model("Where", {"c": (np.bool_, ["N", 3]), "a": (F32, ["M", 3]), "b": (F32, [3])})
    cond = np.array([[True, False, True], [False, False, True], [True, True, False]])
    assert_gradients(m, "y", ["a", "b"], {"c": cond, "a": rand([1, 3]), "b": rand([3], seed=2)})


# -- Clip with tensor bounds ----------------------------------------------------------------------
def clip_model(lo, hi, opset, shape=(2, 4)):
    ins = {"x": (F32, list(shape))}
    names = ["x", "lo" if lo else "", "hi" if hi else ""]
    if lo:
        ins["lo"] = (F32, [])
    if hi:
        ins["hi"] = (F32, [])
    while names[-1] == "":
        names.pop()
    return make_model([helper.make_node("Clip", names, ["y"])], ins, ["y"], opset=opset)


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("lo,hi", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["both", "min_only", "max_only", "none"])
def test_clip(lo, hi, opset):
    m = clip_model(lo, hi, opset)
    feeds = {"x": rand([2, 4], -1.5, 1.5, away=(-0.5, 0.6), seed=2)}
    xs = ["x"]
    if lo:
        feeds["lo"], xs = np.array(-0.5, F32), xs + ["lo"]
    if hi:
        feeds["hi"], xs = np.array(0.6, F32), xs + ["hi"]
    # some elements below, inside and above the bounds
    assert (feeds["x"] < -0.5).any() and (feeds["x"] > 0.6).any()
    assert_gradients(m, "y", xs, feeds, **scalar_kw(*(() for _ in xs[1:])))


@pytest.mark.parametrize("lo,hi", [(0.6, -0.5), (0.3, 0.2)])
@pytest.mark.parametrize("symbolic", [False, True])
def test_clip_min_above_max(lo, hi, symbolic):
    """min > max: y = max everywhere (min(max(x, lo), hi)), so all of the gradient goes to max;
    the same with torch.clamp, and by float64 differences."""
    torch = pytest.importorskip("torch")
    m = clip_model(True, True, 18, shape=("N", 4) if symbolic else (2, 4))
    feeds = {"x": rand([2, 4], -1.5, 1.5, away=(lo, hi), seed=2), "lo": np.array(lo, F32),
             "hi": np.array(hi, F32)}
    assert_gradients(m, "y", ["x", "lo", "hi"], feeds, **scalar_kw((), ()))
    cot = rand([2, 4], seed=3)
    res = onnxgrad.gradients(m, "y", ["x", "lo", "hi"], grad_ys=["cot"])
    got = run(res.model, {**feeds, "cot": cot}, res.grads)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    want = torch.autograd.grad(torch.clamp(t["x"], t["lo"], t["hi"]), list(t.values()),
                               torch.tensor(cot))
    for k, a, b in zip(feeds, got, want):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-6, atol=1e-6, err_msg=k)


def test_clip_opset6_attribute_bounds():
    """Clip-6 keeps its bounds in attributes; onnxgrad upgrades the model to opset 13 first."""
    m = op_model("Clip", {"x": (F32, [2, 4])}, opset=6, min=-0.5, max=0.6)
    x = rand([2, 4], -1.5, 1.5, away=(-0.5, 0.6), seed=2)
    assert_gradients(m, "y", "x", {"x": x})


def test_clip_opset6_float64_model():
    """onnx's Clip 6->11 adapter writes float32 bound Constants; the engine retypes them."""
    m = op_model("Clip", {"x": (np.float64, [2, 4])}, opset=6, min=-0.5, max=0.6)
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    x = np.linspace(-1, 1, 8).reshape(2, 4)
    g, = run(res.model, {"x": x}, [res.grads[0]])
    np.testing.assert_array_equal(g, ((x >= -0.5) & (x <= 0.6)).astype(np.float64))


def test_clip_constant_bounds():
    """Bounds as initializers: only x gets a gradient."""
    m = op_model("Clip", {"x": (F32, ["N", 3])},
                 inits={"lo": np.array(-0.3, F32), "hi": np.array(0.4, F32)})
    assert_gradients(m, "y", "x", {"x": rand([4, 3], -1, 1, away=(-0.3, 0.4), seed=5)})


# -- Identity, Cast, CastLike ---------------------------------------------------------------------
CASTS = {  # id: (x dtype, to dtype)
    "f32_to_f64": (np.float32, TensorProto.DOUBLE),
    "f64_to_f32": (np.float64, TensorProto.FLOAT),
    "f32_to_f16": (np.float32, TensorProto.FLOAT16),
    "f16_to_f32": (np.float16, TensorProto.FLOAT),
    "f64_to_f16": (np.float64, TensorProto.FLOAT16),
}


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("case", list(CASTS))
def test_cast(case, opset):
    """y = Sin(Cast(x)) * Cast(x): the gradient is cast back to x's dtype."""
    xt, to = CASTS[case]
    m = make_model([helper.make_node("Cast", ["x"], ["c"], to=to),
                    helper.make_node("Sin", ["c"], ["s"]),
                    helper.make_node("Mul", ["s", "c"], ["y"])],
                   {"x": (xt, [2, 3])}, ["y"], opset=opset)
    x = rand([2, 3], -1.5, 1.5).astype(np.float16).astype(xt)  # exact in every dtype
    rep = assert_gradients(m, "y", "x", {"x": x})
    res = onnxgrad.gradients(m, "y", "x")
    grad = next(o for o in res.model.graph.output if o.name == res.grads[0])
    assert grad.type.tensor_type.elem_type == helper.np_dtype_to_tensor_dtype(np.dtype(xt))
    assert rep.results[0].checked == 6


@pytest.mark.parametrize("target", [np.float64, np.float16])
def test_castlike(target):
    m = make_model([helper.make_node("CastLike", ["x", "t"], ["c"]),
                    helper.make_node("Mul", ["c", "c"], ["y"])],
                   {"x": (F32, [2, 3]), "t": (target, [1])}, ["y"])
    x = rand([2, 3]).astype(np.float16).astype(F32)
    assert_gradients(m, "y", "x", {"x": x, "t": np.zeros(1, target)})
    # the target only supplies a dtype: its values do not matter
    assert onnxgrad.gradients(m, "y", ["x", "t"]).grads[1] is None


def test_cast_to_int_stops_gradient():
    m = make_model([helper.make_node("Cast", ["x"], ["i"], to=TensorProto.INT64),
                    helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
                    helper.make_node("Mul", ["f", "x"], ["y"])],
                   {"x": (F32, [2, 3])}, ["y"])
    x = rand([2, 3], -3, 3, away=(-2, -1, 0, 1, 2), seed=1)
    assert_gradients(m, "y", "x", {"x": x})  # d(trunc(x) * x)/dx = trunc(x) away from integers


# -- piecewise-constant: Floor, Ceil, Round, Sign -------------------------------------------------
STEPS = {"Floor": (-2, -1, 0, 1, 2), "Ceil": (-2, -1, 0, 1, 2), "Round": (-1.5, -0.5, 0.5, 1.5),
         "Sign": (0,)}


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("op", list(STEPS))
def test_piecewise_constant_is_zero(op, opset):
    m = op_model(op, {"x": (F32, ["N", 3])}, opset=opset)
    x = rand([2, 3], -2.4, 2.4, away=STEPS[op], seed=3)
    assert_gradients(m, "y", "x", {"x": x})
    (gx,), _ = grads_of(m, "y", ["x"], {"x": x})
    assert gx is not None and gx.shape == x.shape and gx.dtype == np.float32
    assert not np.any(gx), gx  # exactly zero, not "unconnected"


@pytest.mark.parametrize("op", list(STEPS))
def test_piecewise_constant_in_product(op):
    """d(x * step(x))/dx = step(x): the zero path adds to the live one."""
    m = make_model([helper.make_node(op, ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])],
                   {"x": (F32, [2, 3])}, ["y"])
    assert_gradients(m, "y", "x", {"x": rand([2, 3], -2.4, 2.4, away=STEPS[op], seed=4)})


# -- a composite of everything above --------------------------------------------------------------
def test_composite_chain():
    """y = Where(x > 0, sqrt(x*x + 1) * exp(-x), sin(x) / (1 + Clip(x)**2)) - Max(x, z) etc."""
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["x2"]),
        helper.make_node("Add", ["x2", "one"], ["x2p1"]),
        helper.make_node("Sqrt", ["x2p1"], ["r"]),
        helper.make_node("Neg", ["x"], ["nx"]),
        helper.make_node("Exp", ["nx"], ["e"]),
        helper.make_node("Mul", ["r", "e"], ["p"]),
        helper.make_node("Sin", ["x"], ["s"]),
        helper.make_node("Clip", ["x", "lo", "hi"], ["cx"]),
        helper.make_node("Pow", ["cx", "two"], ["c2"]),
        helper.make_node("Add", ["c2", "one"], ["den"]),
        helper.make_node("Div", ["s", "den"], ["q"]),
        helper.make_node("Greater", ["x", "zero"], ["pos"]),
        helper.make_node("Where", ["pos", "p", "q"], ["w"]),
        helper.make_node("Max", ["x", "z"], ["mx"]),
        helper.make_node("Mean", ["w", "mx", "z"], ["m"]),
        helper.make_node("Sub", ["m", "z"], ["y"]),
    ]
    inits = {"one": np.array(1, F32), "two": np.array(2, F32), "zero": np.array(0, F32),
             "lo": np.array(-0.5, F32), "hi": np.array(0.5, F32)}
    m = make_model(nodes, {"x": (F32, ["N", 4]), "z": (F32, [4])}, ["y"], inits=inits)
    x = rand([3, 4], -2, 2, away=(-0.5, 0, 0.5), seed=9)
    z = rand([4], -2, 2, seed=10)
    while np.min(np.abs(x - z)) < 0.1:
        z = z + 0.05
    assert_gradients(m, "y", ["x", "z", "lo", "hi"], {"x": x, "z": z}, runtime="reference")


# -- dtypes: float16 / float64 graphs agree with float32 ------------------------------------------
def _unary_case(op):
    lo, hi, away = UNARY[op]
    return ([helper.make_node(op, ["x"], ["y"])], {"x": [2, 3]}, {},
            {"x": rand([2, 3], lo, hi, away, gap=0.15, seed=1)}, 18)


DTYPE_CASES = {op: _unary_case(op) for op in UNARY}
DTYPE_CASES.update({
    op: ([helper.make_node(op, ["a", "b"], ["y"])], {"a": [2, 1, 3], "b": [4, 1]}, {},
         binary_feeds(op, [2, 1, 3], [4, 1], seed=3), 18)
    for op in ["Add", "Sub", "Mul", "Div", "Pow"]})
DTYPE_CASES.update({
    op: ([helper.make_node(op, ["a", "b", "c"], ["y"])], {"a": [2, 3], "b": [3], "c": []}, {},
         dict(zip("abc", distinct([[2, 3], [3], []], seed=2))), 18)
    for op in ["Min", "Max", "Sum", "Mean"]})
DTYPE_CASES["Where"] = ([helper.make_node("Where", ["c", "a", "b"], ["y"])],
                        {"a": [2, 3], "b": [3]}, {"c": ([True, False, True], np.bool_)},
                        {"a": rand([2, 3]), "b": rand([3], seed=1)}, 18)
DTYPE_CASES["Clip"] = ([helper.make_node("Clip", ["x", "lo", "hi"], ["y"])],
                       {"x": [2, 4], "lo": [], "hi": []}, {},
                       {"x": rand([2, 4], -1.5, 1.5, away=(-0.5, 0.625), gap=0.15, seed=2),
                        "lo": np.array(-0.5, F32), "hi": np.array(0.625, F32)}, 18)
DTYPE_CASES["PowInt"] = ([helper.make_node("Pow", ["a", "k"], ["y"])], {"a": [2, 3]},
                         {"k": ([1, 2, 3], np.int64)}, {"a": nonzero([2, 3], 0.5, 1.5)}, 18)
DTYPE_CASES["Floor"] = ([helper.make_node("Floor", ["x"], ["f"]),
                         helper.make_node("Mul", ["f", "x"], ["y"])], {"x": [2, 3]}, {},
                        {"x": rand([2, 3], -2.4, 2.4, away=STEPS["Floor"], seed=1)}, 18)


def dtype_model(case, dtype):
    nodes, floats, fixed, _, opset = DTYPE_CASES[case]
    ins = {k: (dtype, s) for k, s in floats.items()}
    ins.update({k: (t, [len(v)]) for k, (v, t) in fixed.items()})
    return make_model(nodes, ins, ["y"], opset=opset)


def run_in_dtype(case, dtype):
    """Gradient graph of the case built in ``dtype``, run on onnxruntime CPU (onnx.reference only
    where onnxruntime has no kernel for the forward op itself in that dtype)."""
    _, floats, fixed, feeds, _ = DTYPE_CASES[case]
    m = dtype_model(case, dtype)
    xs = list(floats)
    res = onnxgrad.gradients(m, "y", xs, grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    rng = np.random.default_rng(0)
    y_shape = run(m, {**{k: np.asarray(v, np.float64).astype(dtype) for k, v in feeds.items()},
                      **{k: np.asarray(v, t) for k, (v, t) in fixed.items()}},
                  outputs=["y"])[0].shape
    cot = rng.uniform(-1, 1, y_shape)
    fd = {k: np.asarray(v, np.float64).astype(np.float16).astype(dtype) for k, v in feeds.items()}
    fd.update({k: np.asarray(v, t) for k, (v, t) in fixed.items()})
    fd["gy"] = cot.astype(np.float16).astype(dtype)  # exact in all three dtypes
    return res, run_grads(res, m, fd)


@pytest.mark.parametrize("case", list(DTYPE_CASES))
def test_dtypes_agree_with_float32(case):
    assert_dtypes_agree(lambda dtype: run_in_dtype(case, dtype))


# -- Mod ------------------------------------------------------------------------------------------
def _mod_inputs(seed=0):
    rng = np.random.default_rng(seed)
    a = rng.uniform(-5, 5, (3, 4))
    b = rng.uniform(0.7, 1.9, 4) * rng.choice([-1.0, 1.0], 4)
    q = a / b  # away from the jumps of trunc / floor (a / b a whole number)
    a = np.where(np.abs(q - np.round(q)) < 0.05, a + 0.1 * np.abs(b), a)
    return a.astype(F32), b.astype(F32)


@pytest.mark.parametrize("fmod,opset", [(1, 13), (0, 28)])
def test_mod(fmod, opset):
    """y = a - k b with k = trunc(a / b) (fmod=1) or floor (fmod=0, floats from opset 28); b
    broadcast. Opset 28 is newer than onnxruntime runs, so that graph is checked on reference."""
    a, b = _mod_inputs()
    m = op_model("Mod", {"a": (F32, [3, 4]), "b": (F32, [4])}, opset=opset, fmod=fmod)
    assert_gradients(m, "y", ["a", "b"], feeds={"a": a, "b": b}, f32=opset <= 26)


def test_mod_torch():
    torch = pytest.importorskip("torch")
    a, b = _mod_inputs(1)
    m = op_model("Mod", {"a": (F32, [3, 4]), "b": (F32, [4])}, opset=13, fmod=1)
    (ga, gb), _ = grads_of(m, "y", ["a", "b"], {"a": a, "b": b})
    ta, tb = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (a, b))
    torch.fmod(ta, tb).sum().backward()
    np.testing.assert_allclose(ga, ta.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gb, tb.grad.numpy(), rtol=1e-5, atol=1e-5)


from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _leading_broadcasts(draw):
    """x [*lead, *trail] (its first dim maybe symbolic) against b of shape trail or
    [1] * len(lead) + trail: b's gradient sums over x's leading axes, on tensors both under and
    over the 32768 elements from which that sum is a product with ones."""
    lead = draw(st.lists(st.integers(1, 48), min_size=1, max_size=3))
    trail = draw(st.lists(st.integers(1, 5), min_size=1, max_size=2))
    if draw(st.booleans()):  # over the threshold (by the static dims, where there are two)
        lead[-1] = max(lead[-1], -(-40000 // int(np.prod(lead[:-1] + trail))))
    return (lead, trail, draw(st.sampled_from(["Add", "Sub", "Mul", "Div"])),
            draw(st.booleans()), draw(st.booleans()), draw(st.sampled_from([F32, np.float64])))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_leading_broadcasts())
@example(([16384], [3], "Mul", False, False, F32))           # [R] @ [R, C]: no Reshape
@example(([16384], [3], "Div", True, False, np.float64))     # [1, R] @ [R, C], keepdims
@example(([3, 4096], [2, 5], "Div", False, True, F32))       # rows counted at run time
@example(([3, 4096], [2, 5], "Mul", True, True, np.float64))
@example(([64, 64], [5], "Mul", False, False, F32))          # under the threshold
@example(([1, 40000], [1], "Add", True, False, F32))         # axes [1]: 0 has size 1
def test_bias_gradients_summed_over_leading_axes_generated(case):
    """The gradient of a broadcast operand b (a bias: x's trailing dims, with or without leading
    1s) sums over x's leading axes (those of size 1 summing nothing): exact against numpy
    (float64 sums) and finite differences (float32 and float64, static or symbolic batch). From
    32768 elements (by the static dims) a float sum is ones @ x as one MatMul, which
    onnxruntime runs faster than its ReduceSum over leading axes; below, a ReduceSum."""
    lead, trail, op, keep, symbolic, dt = case
    b_shape = [1] * len(lead) + trail if keep else trail
    x_dims = (["N"] if symbolic else lead[:1]) + lead[1:] + trail
    m = make_model([helper.make_node(op, ["x", "b"], ["y"])],
                   {"x": (dt, x_dims), "b": (dt, b_shape)}, ["y"])
    rng = np.random.default_rng(len(lead) * 100 + sum(lead) + sum(trail))
    x = rng.uniform(-2, 2, lead + trail).astype(dt)
    b = rng.uniform(0.5, 2, b_shape).astype(dt)
    res = onnxgrad.gradients(m, ["y"], ["b"])
    onnx.checker.check_model(res.model, full_check=True)
    got = run(res.model, {"x": x, "b": b}, [res.grads[0]])[0]
    x64, b64, k = x.astype(np.float64), b.astype(np.float64), tuple(range(len(lead)))
    terms = {"Add": np.ones_like(x64), "Sub": -np.ones_like(x64), "Mul": x64 + 0 * b64,
             "Div": -x64 / (b64 * b64)}[op]
    want = terms.sum(axis=k, keepdims=keep)
    assert got.shape == want.shape and got.dtype == dt
    scale = np.abs(terms).sum(axis=k, keepdims=keep)
    np.testing.assert_array_less(np.abs(got - want), scale * (1e-5 if dt == F32 else 1e-13) + 1e-30)
    static = int(np.prod([d for d in x_dims if isinstance(d, int)]))
    added = [n.op_type for n in res.model.graph.node if n.name.startswith("gradients/")]
    if static < 32768:
        assert "MatMul" not in added
    else:  # (with the seed of ones, Add's and Sub's sums are constants)
        assert "ReduceSum" not in added and ("MatMul" in added or op in ("Add", "Sub"))
    assert_gradients(m, "y", ["b"], {"x": x, "b": b})


@st.composite
def _leading_reductions(draw):
    """x of rank 2 to 4 (each leading dim maybe 1, the first maybe symbolic), axes a set of its
    first k axes holding every one of size > 1 among them (negative or not), keepdims."""
    rank = draw(st.integers(2, 4))
    k = draw(st.integers(1, rank - 1))
    lead = [draw(st.sampled_from([1, 3, 40, 300])) for _ in range(k)]
    lead[-1] = max(lead[-1], -(-33000 // int(np.prod(lead[:-1]))))
    dims = lead + [draw(st.integers(1, 3)) for _ in range(rank - k)]
    axes = [i for i in range(k) if dims[i] > 1 or i == k - 1 or draw(st.booleans())]
    axes = [a - rank if draw(st.booleans()) else a for a in axes]
    return dims, axes, draw(st.sampled_from([0, 1])), draw(st.booleans())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_leading_reductions())
@example(([1, 40000, 3], [1], 0, False))       # a size-1 axis left out, keepdims=0
@example(([1, 40000, 3], [-2], 1, False))
@example(([3, 1, 20000, 2], [0, 2], 0, True))  # rows counted at run time
@example(([40000, 2], [0], 0, False))           # [R] @ [R, C]: no Reshape
def test_emitter_sums_over_leading_axes_as_a_product_generated(case):
    """``Emitter.reduce("ReduceSum", ...)`` over leading axes (some of size 1 left out, keepdims
    0 or 1, a symbolic first dim) equals numpy's sum; from 32768 elements by the static dims it
    is one MatMul with ones, whose output shape the emitter knows."""
    import onnx_ir as ir
    from onnxgrad.emitter import Emitter
    dims, axes, keepdims, symbolic = case
    xv = np.random.default_rng(sum(dims)).uniform(-1, 1, dims)
    want = xv.sum(axis=tuple(a % len(dims) for a in axes), keepdims=bool(keepdims))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.DOUBLE),
                 shape=ir.Shape((["N"] if symbolic else dims[:1]) + dims[1:]))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 18}, name="g")
    e = Emitter(graph, "s", 18)
    y = e.reduce("ReduceSum", e.wrap(x), axes, keepdims=keepdims)
    y.value.shape = ir.Shape(want.shape)
    graph.outputs.append(y.value)
    model = ir.serde.serialize_model(ir.Model(graph, ir_version=10))
    onnx.checker.check_model(model, full_check=True)
    # (a symbolic first dim left out of the axes may not be 1: the ReduceSum stays)
    product = int(np.prod(dims[1:] if symbolic else dims)) >= 32768 and \
        (not symbolic or 0 in {a % len(dims) for a in axes})
    assert ("MatMul" in {n.op_type for n in model.graph.node}) == product
    if product:
        assert y.shape == want.shape
    (got,) = session(model).run(None, {"x": xv})
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.0, 0.5]), min_size=4, max_size=4),
       st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0, -1.0]), min_size=4, max_size=4),
       st.sampled_from(["input", "constant", "int64"]))
def test_pow_matches_torch_at_zero_bases_and_exponents(a, b, form):
    """0 ** 0 is 1 for every base: its gradient is 0 there (torch, TF), not 0 * 0 ** -1 = NaN.
    Exponents fed, constant or integer; the bases include 0 and negatives."""
    torch = pytest.importorskip("torch")
    a, b = np.array(a, F32), np.array(b, F32)
    if form == "input":
        m = op_model("Pow", {"a": (F32, [4]), "b": (F32, [4])})
        feeds = {"a": a, "b": b}
    else:
        bv = b.astype(np.int64) if form == "int64" else b
        m = op_model("Pow", {"a": (F32, [4])}, inits={"c": bv})
        feeds = {"a": a}
    (ga,), res = grads_of(m, "y", ["a"], feeds)
    ta = torch.tensor(a, requires_grad=True)
    torch.pow(ta, torch.tensor(b)).sum().backward()
    np.testing.assert_allclose(ga, ta.grad.numpy(), rtol=1e-6, atol=0)
    # the same graph at onnxruntime's default level (ORT_ENABLE_ALL): the same numbers
    (full,) = session(res.model).run(res.grads, feeds)
    np.testing.assert_allclose(full, ta.grad.numpy(), rtol=1e-6, atol=0)
