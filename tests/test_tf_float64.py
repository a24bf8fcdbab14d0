"""float64 TF graphs with ops that onnxruntime's CPU has no float64 kernel for.

Tan, Asin, Acos, Atan, Sinh, Cosh, Asinh, Acosh, Atanh and Erf converted to their ONNX ops of the
same name: the model converted, then onnxruntime refused to run it (NOT_IMPLEMENTED). The
converter builds them in float64 from ops that have float64 kernels (Erfc and Atan2 too, which
used Erf and Atan), as exact as TF's float64 kernels; ops it cannot build so (Conv, ConvTranspose,
AveragePool, Det) are a clear error at conversion time.

References: TF itself (graph mode, float64), and Python's math module (the C library's
functions) with closed-form derivatives written where they are well conditioned. Known
differences from TF, where the C library is followed: TF's float64 erf is NaN above ~1.34e154
and at +-inf (C's: +-1); TF's CPU kernels flush subnormals to zero (values under 2.3e-308 count
as 0 here); outside an op's domain the value is NaN and the gradient is not compared (TF's is a
formula's, finite or not); near the ends of asin's, acos's and atanh's domains TF's gradient
formula (1 - x*x) loses digits, so the closed forms (1 - x)(1 + x) are the reference there.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_util import ort_run, tf, tf1_graph, tf_run

import onnxgrad
from onnxgrad.converters.tensorflow import ConversionError, convert
from onnxgrad.runtime import ort_module, session_options

v1 = tf.compat.v1
RTOL = 1e-12
TINY = 2.3e-308  # below: subnormal, which TF flushes to zero
inf, nan = np.inf, np.nan


PARTNERS = {"Atan2_x": [0.0, -0.0, 1.0, -1.0, 2.5, inf, -inf],  # y, cycling, in atan2(y, x)
            "Atan2_y": [0.0, -0.0, 1.0, -1.0, 0.3, inf, -inf]}  # x, in atan2(y, x)


def _partner(op, size):
    return np.resize(np.array(PARTNERS[op]), size)


def _atan2_x(x):
    ys = tf.constant(PARTNERS["Atan2_x"], tf.float64)
    return tf.math.atan2(tf.gather(ys, tf.range(tf.size(x)) % 7), x)


def _atan2_y(y):
    xs = tf.constant(PARTNERS["Atan2_y"], tf.float64)
    return tf.math.atan2(y, tf.gather(xs, tf.range(tf.size(y)) % 7))


OPS = {"Tan": tf.math.tan, "Asin": tf.math.asin, "Acos": tf.math.acos, "Atan": tf.math.atan,
       "Sinh": tf.math.sinh, "Cosh": tf.math.cosh, "Asinh": tf.math.asinh,
       "Acosh": tf.math.acosh, "Atanh": tf.math.atanh, "Erf": tf.math.erf, "Erfc": tf.math.erfc,
       "Atan2_y": _atan2_y, "Atan2_x": _atan2_x}


def _inverse_sqrt_one_minus_sq(x):
    return 1 / math.sqrt((1 - x) * (1 + x))


TWO_OVER_ROOT_PI = 2 / math.sqrt(math.pi)
# (the C library's value, its derivative in a well-conditioned closed form, the domain)
REFERENCE = {
    "Tan": (math.tan, lambda x: 1 + math.tan(x) ** 2, lambda x: True),
    "Asin": (math.asin, _inverse_sqrt_one_minus_sq, lambda x: abs(x) <= 1),
    "Acos": (math.acos, lambda x: -_inverse_sqrt_one_minus_sq(x), lambda x: abs(x) <= 1),
    "Atan": (math.atan, lambda x: 1 / (1 + x * x) if abs(x) < 1e150 else 1 / x / x,
             lambda x: True),
    "Sinh": (math.sinh, math.cosh, lambda x: True),
    "Cosh": (math.cosh, math.sinh, lambda x: True),
    "Asinh": (math.asinh, lambda x: 1 / math.hypot(1, x), lambda x: True),
    "Acosh": (math.acosh, lambda x: 1 / (math.sqrt(x - 1) * math.sqrt(x + 1)),
              lambda x: x >= 1),
    "Atanh": (math.atanh, lambda x: 1 / ((1 - x) * (1 + x)), lambda x: abs(x) <= 1),
    "Erf": (math.erf, lambda x: TWO_OVER_ROOT_PI * math.exp(-x * x), lambda x: True),
    "Erfc": (math.erfc, lambda x: -TWO_OVER_ROOT_PI * math.exp(-x * x), lambda x: True),
}
EDGE = {"Asin": 0.99, "Acos": 0.99, "Atanh": 0.99}  # |x| beyond: TF's gradient loses digits


@functools.lru_cache(maxsize=None)
def _converted(op):
    """(TF graph, its tensors, an onnxruntime session computing y and dy/dx by onnxgrad, TF's
    own gradient graph converted, as a session)."""
    def build():
        x = v1.placeholder(tf.float64, [None], name="x")
        y = tf.identity(OPS[op](x), name="y")
        gy = v1.placeholder(tf.float64, [None], name="gy")
        return x, y, gy, tf.gradients(y, x, grad_ys=gy)[0]
    graph, tensors = tf1_graph(build)
    gd = graph.as_graph_def(add_shapes=True)
    model = convert(gd, inputs=["x:0"], outputs=["y:0"])
    onnx.checker.check_model(model, full_check=True)
    res = onnxgrad.gradients(model, "y:0", ["x:0"], grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    tf_grad = convert(gd, inputs=["x:0", "gy:0"], outputs=[tensors[3].name])
    sessions = [ort_module().InferenceSession(m.SerializeToString(), session_options(),
                                              providers=["CPUExecutionProvider"])
                for m in (res.model, tf_grad)]
    return graph, tensors, sessions, res.grads[0]


def _run(op, x):
    """(TF's y and dy/dx, onnxgrad's y and dy/dx, TF's gradient graph converted) at x, with a
    non-uniform upstream gradient."""
    graph, (xp, y, gy, gx), (ours, theirs), grad_name = _converted(op)
    gys = np.linspace(0.5, 1.5, x.size)
    want = tf_run(graph, [y, gx], {xp: x, gy: gys})
    got = ours.run(["y:0", grad_name], {"x:0": x, "gy": gys})
    got_tf_graph = theirs.run(None, {"x:0": x, "gy:0": gys})[0]
    return want, got, got_tf_graph, gys


def _same(got, want, what, rtol=RTOL, signed_zeros=False):
    """The same NaNs and infinities, finite values to rtol (values under TINY count as 0), and
    with ``signed_zeros`` (values, not gradients) the same sign of zero."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)), (what, got, want)
    odd = np.isinf(want)
    assert np.array_equal(got[odd], want[odd]), (what, got[odd], want[odd])
    ok = np.isfinite(want)
    small = (np.abs(want) < TINY) & (np.abs(got) < TINY)
    np.testing.assert_allclose(np.where(small, 0, got)[ok], np.where(small, 0, want)[ok],
                               rtol=rtol, atol=0, err_msg=what)
    if signed_zeros:
        zero = (want == 0) & (got == 0)
        assert np.array_equal(np.signbit(got[zero]), np.signbit(want[zero])), (what, got, want)


def _samples(op):
    """Values over the whole range of op's argument: magnitudes from 1e-300 to 1e300 of both
    signs, and the domain's interior and edges."""
    rng = np.random.RandomState(sorted(OPS).index(op))
    mags = np.concatenate([10.0 ** rng.uniform(-300, 300, 40), 10.0 ** rng.uniform(-8, 3, 60),
                           rng.uniform(0, 4, 40)])
    x = mags * rng.choice([-1.0, 1.0], mags.size)
    if op in ("Asin", "Acos", "Atanh"):
        near = 1 - 10.0 ** rng.uniform(-16, -1, 30)
        x = np.concatenate([rng.uniform(-1, 1, 80), near, -near, 10.0 ** rng.uniform(-300, 0, 30)])
    elif op == "Acosh":
        x = np.concatenate([1 + 10.0 ** rng.uniform(-15, 1, 60), 10.0 ** rng.uniform(0, 300, 60)])
    elif op in ("Sinh", "Cosh"):
        x = np.concatenate([rng.uniform(-710.4, 710.4, 60), rng.uniform(-25, 25, 60),
                            10.0 ** rng.uniform(-300, 0, 30) * rng.choice([-1, 1], 30)])
    elif op in ("Erf", "Erfc"):
        x = np.concatenate([rng.uniform(-27, 27, 80), rng.uniform(-6, 6, 60),
                            10.0 ** rng.uniform(-300, 0, 30) * rng.choice([-1, 1], 30)])
    elif op == "Tan":  # and the doubles nearest to multiples of pi / 2 (tan's zeros and poles)
        k = rng.randint(-10 ** 7, 10 ** 7, 40)
        x = np.concatenate([rng.uniform(-10, 10, 60), 10.0 ** rng.uniform(-300, 8, 40),
                            k * np.pi / 2, np.nextafter(k * np.pi / 2, inf), [np.pi, -np.pi]])
    return x.astype(np.float64)


def _gradient_compared(op, x):
    """Where TF's gradient is the reference (see the module docstring; TF's atan2 gradient,
    (x, -y) / (x^2 + y^2), is NaN where x^2 + y^2 under- or overflows, or is infinite, where
    the derivative is 0)."""
    domain = REFERENCE[op][2] if op in REFERENCE else (lambda v: True)
    inside = np.array([bool(domain(v)) for v in x])
    if op in PARTNERS:
        with np.errstate(all="ignore"):
            norm = x * x + _partner(op, x.size) ** 2
        inside &= np.isfinite(norm) & (norm > TINY)
    return inside & (np.abs(x) <= EDGE.get(op, inf))


@pytest.mark.parametrize("op", sorted(OPS))
def test_float64_op_against_tf(op):
    """Forward and gradient (onnxgrad's, and TF's own gradient graph converted) equal TF's to
    1e-12 over the op's range; near the domain's ends the gradient equals the closed form."""
    x = _samples(op)
    (want_y, want_g), (got_y, got_g), got_tf_graph, gys = _run(op, x)
    _same(got_y, want_y, f"{op} forward", signed_zeros=True)
    keep = _gradient_compared(op, x)
    _same(got_g[keep], want_g[keep], f"{op} onnxgrad gradient")
    _same(got_tf_graph[keep], want_g[keep], f"{op} TF's gradient graph")
    if op in EDGE:
        edge = ~keep & np.array([bool(REFERENCE[op][2](v)) for v in x]) & (np.abs(x) < 1)
        closed = np.array([REFERENCE[op][1](v) for v in x[edge]]) * gys[edge]
        _same(got_g[edge], closed, f"{op} gradient near the domain's ends")


SPECIAL = [0.0, -0.0, inf, -inf, nan, 1.0, -1.0, 1 - 2 ** -53, -(1 - 2 ** -53), 1 + 2 ** -52,
           -(1 + 2 ** -52), 0.5, -0.5, 2.0, 1e-300, -1e-300, 2.0 ** -28, 2.0 ** 28, 3e-9, 0.84375,
           1.25, 1 / 0.35, 6.0, -6.0, 26.0, 28.0, -28.0, 20.0, -20.0, 709.7, 710.4, 710.5,
           -710.4, np.pi, np.pi / 2, 1e8, 1e8 + 1, 1e15, 1e150, -1e300, 0.7071067811865476]


@pytest.mark.parametrize("op", sorted(OPS))
def test_float64_op_at_special_values(op):
    """Signed zeros, infinities, NaN, the domain's edges, the approximations' breakpoints and
    overflow: TF's values (C's where TF's erf is NaN), and TF's gradient inside the domain."""
    x = np.array(SPECIAL, np.float64)
    (want_y, want_g), (got_y, got_g), got_tf_graph, _ = _run(op, x)
    if op == "Erf":  # TF's float64 erf: NaN at +-inf and above ~1.34e154
        want_y = np.where(np.isnan(want_y) & ~np.isnan(x), np.sign(x), want_y)
    _same(got_y, want_y, f"{op} forward at {x.tolist()}", signed_zeros=True)
    keep = _gradient_compared(op, x) & ~np.isnan(want_y)
    _same(got_g[keep], want_g[keep], f"{op} gradient at {x[keep].tolist()}")
    finite = keep & np.isfinite(want_g)
    assert np.isfinite(got_g[finite]).all(), (op, x[finite], got_g[finite])


# (fixed draws: magnitudes over the whole float64 range, both signs)
@settings(max_examples=80, deadline=None, derandomize=True)
@given(op=st.sampled_from(sorted(REFERENCE)),
       xs=st.lists(st.tuples(st.floats(1, 2), st.integers(-1000, 1000), st.booleans()),
                   min_size=1, max_size=8))
def test_float64_ops_against_the_c_library_generated(op, xs):
    """Value to 1e-12 of Python's math module (the C library), gradient to 1e-12 of the closed
    form, wherever both are finite, and NaN where the value is outside the domain."""
    x = np.array([m * 2.0 ** e * (-1 if neg else 1) for m, e, neg in xs], np.float64)
    x = np.where(np.abs(x) > 1e300, np.sign(x) * 1e300, x)
    if op == "Tan":  # (beyond 1e8 tan is sin / cos, exact to ~2e-16 of the angle, not relative)
        x = np.where(np.abs(x) > 1e8, np.sign(x) * 1e8, x)
    fn, dfn, domain = REFERENCE[op]
    (_, (got_y, got_g), _, gys) = _run(op, x)
    for v, y, g, gy in zip(x.tolist(), got_y, got_g, gys):
        if not domain(v):
            assert np.isnan(y), (op, v, y)
            continue
        try:
            want = fn(v)
        except (OverflowError, ValueError):  # sinh, cosh past overflow; atanh(+-1)
            want = inf if op == "Cosh" else math.copysign(inf, v)
        _same([y], [want], f"{op}({v!r})", signed_zeros=True)
        try:
            dwant = dfn(v) * gy
        except (OverflowError, ZeroDivisionError, ValueError):
            continue
        if math.isfinite(dwant) and abs(dwant) > TINY:
            _same([g], [dwant], f"{op}'({v!r})", rtol=2 * RTOL)


def test_float64_ops_without_a_decomposition_are_refused():
    """Conv2D, AvgPool and MatrixDeterminant in float64 converted to ONNX ops with no float64
    kernel in onnxruntime's CPU (a model that could not run): a clear error naming the node,
    its op and the dtype; float32 converts."""
    w = np.ones([1, 1, 2, 2])
    cases = {"Conv2D": lambda x: tf.nn.conv2d(x, w.astype(x.dtype.as_numpy_dtype), 1, "SAME",
                                              name="conv"),
             "AvgPool": lambda x: tf.nn.avg_pool2d(x, 2, 2, "SAME", name="conv"),
             "MatrixDeterminant": lambda x: tf.linalg.det(x[0, :, :, 0], name="conv")}
    for op, fn in cases.items():
        for dtype in (tf.float64, tf.float32):
            g, _ = tf1_graph(lambda: tf.identity(fn(v1.placeholder(dtype, [1, 2, 2, 2], name="x")),
                                                 name="y"))
            gd = g.as_graph_def(add_shapes=True)
            if dtype == tf.float32:
                ort_run(convert(gd, inputs=["x:0"], outputs=["y:0"]),
                        {"x:0": np.ones([1, 2, 2, 2], np.float32)}, ["y:0"])
                continue
            with pytest.raises(ConversionError, match=fr"{op} node 'conv'.*double.*onnxruntime"):
                convert(gd, inputs=["x:0"], outputs=["y:0"])


def test_float64_selu_has_tf_s_constants(monkeypatch):
    """ONNX's Selu holds alpha and gamma as float32 attributes (TF's float64 Selu was 3e-8
    off): float64 Selu is TF's kernel with TF's constants, to 1e-12 of TF's output; its
    gradient is the exact derivative (TF's SeluGrad reads y + scale alpha, which loses digits
    where y nears -scale alpha), and TF's SeluGrad graph converted gives TF's."""
    from onnxgrad.converters.tensorflow.nn_ops import SELU_ALPHA, SELU_SCALE
    monkeypatch.setitem(OPS, "Selu", tf.nn.selu)
    x = np.concatenate([np.linspace(-30, 30, 60), [1e-300, -1e-300, 1e-9, -1e-9, 700, -700]])
    want, got, got_tf_graph, gys = _run("Selu", x)
    _same(got[0], want[0], "selu")
    exact = gys * np.where(x > 0, SELU_SCALE, SELU_SCALE * SELU_ALPHA * np.exp(np.minimum(x, 0)))
    _same(got[1], exact, "dselu")
    _same(got_tf_graph, want[1], "SeluGrad")
