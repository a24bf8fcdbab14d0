"""Lgamma, Digamma, Polygamma, Erfinv, Ndtri, BesselI0e and BesselI1e, which the converter
refused ("no converter for TensorFlow op"). It computes them in float64 from ops that
onnxruntime's CPU has float64 kernels for (:mod:`onnxgrad.converters.tensorflow.special_gamma`),
and casts float32 and float16 back. TensorFlow is the oracle: the converted forward,
``onnxgrad.gradients`` of it, and TF's own gradient graph converted (Digamma for lgamma,
Polygamma for digamma and Polygamma(a + 1) for polygamma) against TF's values and tf.gradients,
at edge points and at drawn ones (hypothesis, derandomized).

Tolerances:
- float64: 1e-13 relative (measured: values within 1.6e-14 of TF's, gradients 7e-14, both
  near psi's zero, where TF's digamma is the less exact; against mpmath the converted values
  are within 4e-15, the gradients 2e-14), plus 8 ulp of the terms a formula subtracts where
  they are larger than its result, which TF's kernels and these lose alike (``_scale``):
  lgamma's and psi's reflection near their negative zeros, psi near its zero 1.4616, TF's
  Bessel gradients i1e - i0e and i0e - i1e (x + 1/x).
- erfinv: TF's kernel is ndtri((x + 1) / 2) / sqrt(2), and x + 1 rounds: an error of up to
  2^-53 in x, eps (sqrt(pi) / 2) exp(y^2) in y (TF's erfinv(1e-30) is 0), which is the
  tolerance against TF; against mpmath the converted erfinv is within 2 ulp. Its gradient,
  ndtri's and TF's formulas exp(y^2) and exp(y^2 / 2), are exact to y^2 ulp.
- float32 and float16: computed in float64 and rounded, so within an ulp of TF's float64
  results. TF's own float32 kernels are compared (``test_float32_against_tf_float32``) where
  they are right: its float32 polygamma is inf, NaN or wrong below about -7 (-0.048 at -20.5
  for trigamma), its float32 digamma loses 7e-4 near psi's zeros, its float32 erfinv is inf at
  1 - 2^-24 and at 1 + 2^-23 ((x + 1) / 2 rounds to 1), its float32 Bessel kernels (Cephes'
  single precision series) are exact to 1.5e-6.

Known differences from TF, where the converter is exact: TF's polygamma(m, x) is 0 where x^(m+1)
overflows (x > 1e154 for trigamma), not x^-m; TF's kernels flush subnormal inputs to 0 (not
compared). At the poles, where TF's value is NaN, the gradient is not compared (TF's is its
formula's: polygamma(1, 0) = inf for digamma).
"""
from __future__ import annotations

import functools
import math

import mpmath
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
inf, nan = np.inf, np.nan
RTOL = 1e-13
EPS = 2.0 ** -52
TINY = 2.3e-308  # TF flushes subnormals


def _polygamma(m):
    return lambda x: tf.math.polygamma(tf.constant(m, x.dtype), x)


OPS = {"Lgamma": tf.math.lgamma, "Digamma": tf.math.digamma, "Trigamma": _polygamma(1),
       "Polygamma2": _polygamma(2), "Polygamma3": _polygamma(3), "Erfinv": tf.math.erfinv,
       "Ndtri": tf.math.ndtri, "BesselI0e": tf.math.bessel_i0e, "BesselI1e": tf.math.bessel_i1e}
ORDER = {"Digamma": 0, "Trigamma": 1, "Polygamma2": 2, "Polygamma3": 3}  # psi's m

EDGES = [0.0, -0.0, inf, -inf, nan, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 0.5, -0.5, -2.5, 1.5,
         1 + 2 ** -52, 1 - 2 ** -53, 2 + 2 ** -51, 2 - 2 ** -52, 1.4616321449683622,
         -2.4570247382208006, -2.7476826467274127, -3.1435808883499798, 0.9, 0.7316, 0.23164,
         1.7316, 1.23164, 7.999, 8.0, 8.5, 10.0, 1e-30, -1e-30, 1e-300, -1e-300, 2.0 ** -70,
         1e30, -1e30 - 2 ** 48, 1e300, -1e300, 2.0 ** 52 + 0.5, -(2.0 ** 51 + 0.5), 2.0 ** 58,
         -100.5, -7.25, 700.0, -700.3, 1e15 + 0.5]
UNIT_EDGES = [0.0, -0.0, 1.0, -1.0, 1 - 2 ** -53, -(1 - 2 ** -53), 1 + 2 ** -52, 2.0, inf, -inf,
              nan, 0.5, -0.5, 0.25, 0.75, 1e-30, -1e-300, 0.9966, 0.99999, 1 - 1e-8, 1 - 1e-12,
              0.84375, 1.25, 1e-8, 0.999999999999, -0.5 + 2 ** -54]
PROB_EDGES = [0.0, -0.0, 1.0, 0.5, 1e-300, 2.3e-308, 1e-30, 1 - 2 ** -53, 2 ** -53, 0.25, 0.75,
              0.0017, 0.9983, 1e-8, -0.1, 1.1, inf, -inf, nan, 0.2, 0.8, 0.5 - 2 ** -54]


def _edges(op):
    return {"Erfinv": UNIT_EDGES, "Ndtri": PROB_EDGES}.get(op, EDGES)


@functools.lru_cache(maxsize=None)
def _converted(op, dtype):
    """(TF graph, tensors, onnxruntime sessions: forward with onnxgrad's dy/dx, TF's gradient
    graph converted; onnxgrad's gradient name). float16: the forward only (TF's Polygamma, in
    digamma's gradient, takes no float16)."""
    def build():
        x = v1.placeholder(dtype, [None], name="x")
        y = tf.identity(OPS[op](x), name="y")
        gy = v1.placeholder(dtype, [None], name="gy")
        return x, y, gy, None if dtype == tf.float16 else tf.gradients(y, x, grad_ys=gy)[0]
    graph, tensors = tf1_graph(build)
    gd = graph.as_graph_def(add_shapes=True)
    model = convert(gd, inputs=["x:0"], outputs=["y:0"])
    onnx.checker.check_model(model, full_check=True)
    if dtype == tf.float16:
        return graph, tensors, [ort_module().InferenceSession(
            model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])], None
    res = onnxgrad.gradients(model, "y:0", ["x:0"], grad_ys=["gy"])
    tf_grad = convert(gd, inputs=["x:0", "gy:0"], outputs=[tensors[3].name])
    sessions = [ort_module().InferenceSession(m.SerializeToString(), session_options(),
                                              providers=["CPUExecutionProvider"])
                for m in (res.model, tf_grad)]
    return graph, tensors, sessions, res.grads[0]


def _run(op, x, dtype=tf.float64, tf_too=True):
    """(TF's y and dy/dx or None, onnxgrad's y and dy/dx, TF's gradient graph converted, the
    upstream gradient) at x."""
    graph, (xp, y, gy, gx), sessions, grad_name = _converted(op, dtype)
    np_type = dtype.as_numpy_dtype
    x = np.asarray(x, np_type)
    if grad_name is None:
        return None, sessions[0].run(["y:0"], {"x:0": x}), None, None
    ours, theirs = sessions
    gys = np.linspace(0.5, 1.5, x.size).astype(np_type)
    want = tf_run(graph, [y, gx], {xp: x, gy: gys}) if tf_too else None
    got = ours.run(["y:0", grad_name], {"x:0": x, "gy": gys})
    got_tf_graph = theirs.run(None, {"x:0": x, "gy:0": gys})[0]
    return want, got, got_tf_graph, gys


def _psi_scale(x, m):
    """A bound on the terms psi^(m)(x) is a sum of: the recurrence's m! / |z + i|^(m+1) and log,
    and for x < 0 the reflection's pi^(m+1) |P_m(cot pi x)| <= pi^(m+1) m! 2^m (1 + |t|)^(m+1)."""
    with np.errstate(all="ignore"):
        z = np.where(x < 0, 1 - x, x)
        rec = sum(math.factorial(m) / np.abs(z + i) ** (m + 1) for i in range(10))
        t = 1 / np.tan(np.pi * (x - np.round(x)))
        refl = np.pi ** (m + 1) * math.factorial(m) * 2 ** m * (1 + np.abs(t)) ** (m + 1)
        s = rec + np.log1p(np.abs(z)) + np.where(x < 0, refl, 0)
    return np.nan_to_num(s, nan=0, posinf=0)


def _lgamma_scale(x):
    """x < 0: |lgamma(-x)| + |log(pi / |x sin(pi x)|)| (the reflection's terms); x > 0: 0
    (fdlibm's polynomials keep lgamma's relative accuracy at its zeros 1 and 2, as glibc's)."""
    out = np.zeros_like(x)
    for i, v in enumerate(x):
        if v < 0 and math.isfinite(v) and v != math.floor(v):
            s = abs(math.sin(math.pi * (v - round(v))))
            out[i] = abs(math.lgamma(-v)) + abs(math.log(math.pi / abs(v * s)))
    return out


def _bessel_scale(x):
    return 1 / np.sqrt(1 + np.abs(x))  # ~ i0e(x), the size of TF's gradients' terms


def _scale(op, x, grad):
    """The absolute size (see the module docstring) of the value's or the gradient's terms."""
    if op == "Lgamma":
        return _psi_scale(x, 0) if grad else _lgamma_scale(x)
    if op in ORDER:
        return _psi_scale(x, ORDER[op] + grad)
    if op.startswith("Bessel"):
        return _bessel_scale(x) if grad else np.zeros_like(x)
    return np.zeros_like(x)


def _close(got, want, what, rtol=RTOL, atol=0.0, rtol_each=None, grad=False):
    """The same NaNs and infinities; finite values within rtol |want| + atol (arrays allowed),
    values under TINY counted as 0. ``grad``: NaN allowed where want is infinite (a gradient
    that overflows: inf - inf)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if grad:
        got = np.where(np.isnan(got) & np.isinf(want), want, got)
    assert np.array_equal(np.isnan(got), np.isnan(want)), (what, got, want)
    odd = np.isinf(want)
    assert np.array_equal(got[odd], want[odd]), (what, got[odd], want[odd])
    ok = np.isfinite(want) & ((np.abs(want) >= TINY) | (np.abs(got) >= TINY))
    bound = rtol * np.abs(want) + atol + (0 if rtol_each is None else rtol_each * np.abs(want))
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want)
    bad = ok & ~(err <= bound)
    assert not bad.any(), (what, got[bad], want[bad], (err / np.abs(want))[bad])


def _erfinv_atol(y, eps=EPS):
    """TF's erfinv error: x + 1 rounded (eps / 2 of it), times erfinv' = sqrt(pi)/2 exp(y^2)."""
    with np.errstate(over="ignore"):
        return eps * math.sqrt(math.pi) / 2 * np.exp(np.minimum(y * y, 700.0))


def _tolerances(op, x, y, gys, eps=EPS):
    """(atol of the value, atol and extra rtol of the gradient) for TF's kernels or formulas
    computed in a type of epsilon eps, at x where the value is y (see the module docstring)."""
    atol = _scale(op, x, False) * 8 * eps
    gatol = _scale(op, x, True) * 8 * eps * gys
    y = np.nan_to_num(np.asarray(y, np.float64), posinf=0, neginf=0)
    grtol = 0 * x
    if op == "Erfinv":
        atol = _erfinv_atol(y, eps)
        grtol = 4 * (2 * np.abs(y) * atol + y * y * eps)
    elif op == "Ndtri":
        grtol = 4 * y * y * eps
    return atol, gatol, grtol


def _check_float64(op, x):
    """Forward, onnxgrad's gradient and TF's gradient graph against TF (float64)."""
    x = np.asarray(x, np.float64)
    (want_y, want_g), (got_y, got_g), got_tf_graph, gys = _run(op, x)
    if op == "Erfinv":  # TF's inf where x + 1 rounds to 2 or 0 (1 - 2^-53, 1 + 2^-52)
        quirk = np.isinf(want_y) & (np.abs(x) != 1)
        x, want_y, want_g, got_y, got_g, got_tf_graph, gys = (
            v[~quirk] for v in (x, want_y, want_g, got_y, got_g, got_tf_graph, gys))
    atol, gatol, grtol = _tolerances(op, x, want_y, gys)
    _close(got_y, want_y, f"{op} forward at {x.tolist()}", atol=atol)
    # the gradient where TF's value is not NaN (at a pole TF's gradient is its formula's)
    keep = ~np.isnan(want_y) & ~np.isnan(want_g) & ((np.abs(x) >= TINY) | (x == 0))
    for what, g in (("onnxgrad gradient", got_g), ("TF's gradient graph", got_tf_graph)):
        _close(g[keep], want_g[keep], f"{op} {what} at {x[keep].tolist()}", atol=gatol[keep],
               rtol_each=grtol[keep], grad=True)


@pytest.mark.parametrize("op", sorted(OPS))
def test_float64_at_edges(op):
    """Signed zeros, infinities, NaN, poles, the zeros of lgamma and psi, the branch points,
    tiny and huge values, the domains' ends."""
    _check_float64(op, _tf_polygamma_range(op, _edges(op)))


def _tf_polygamma_range(op, x):
    """x without the values where TF's polygamma (psi's value or gradient) takes minutes (its
    sum runs from x < 0 up to 9 one term at a time: below -1e6) or is 0 (x^(m+1) overflows)."""
    x = np.asarray(x, np.float64)
    if op not in ORDER:
        return x
    big = 1e300 if ORDER[op] == 0 else 1e30
    return x[~((x < -1e6) & (x != np.floor(x)) | (np.abs(x) > big)) | ~np.isfinite(x)]


def _magnitudes(draws):
    return [m * 2.0 ** e * (-1 if neg else 1) for m, e, neg in draws]


# (fixed draws: magnitudes from 2^-60 to 2^60 of both signs, and the domains of erfinv, ndtri)
@settings(max_examples=100, deadline=None, derandomize=True)
@given(op=st.sampled_from(sorted(OPS)),
       mags=st.lists(st.tuples(st.floats(1, 2), st.integers(-60, 60), st.booleans()),
                     min_size=1, max_size=6),
       near=st.lists(st.floats(-12, 12, allow_subnormal=False), min_size=1, max_size=6),
       unit=st.lists(st.one_of(st.floats(-1, 1), st.integers(1, 52).map(lambda k: 1 - 2.0 ** -k)),
                     min_size=1, max_size=6))
def test_against_tf_generated(op, mags, near, unit):
    """float64 against TF, and float32 within an ulp of it, at drawn points."""
    if op == "Erfinv":
        x = unit
    elif op == "Ndtri":
        x = [(u + 1) / 2 for u in unit] + [abs(v) * 1e-200 for v in near]
    else:
        x = _tf_polygamma_range(op, _magnitudes(mags) + near)
    _check_float64(op, x)
    _ulp_check(op, tf.float32, np.asarray(x, np.float32))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(op=st.sampled_from(["Erfinv", "Ndtri"]),
       ks=st.lists(st.tuples(st.floats(1, 2), st.integers(-1000, -2)), min_size=1, max_size=8))
def test_erfinv_ndtri_against_mpmath(op, ks):
    """The converted erfinv and ndtri within 2 ulp of the exact inverse (TF's erfinv is not: see
    the module docstring): mpmath's erf (ncdf) of the result is the argument to 2 ulp of y times
    the derivative, near 0 and near the ends (erfinv's 1 - t, ndtri's t)."""
    t = np.array([m * 2.0 ** e for m, e in ks])
    if op == "Erfinv":
        t = t[t > 2 ** -53]
        x = np.concatenate([t, 1 - t, -(1 - t)])
    else:
        x = np.concatenate([t, 1 - t[t > 2 ** -53]])
    _, (got, _), _, _ = _run(op, x, tf_too=False)
    mpmath.mp.dps = 50
    for v, y in zip(x.tolist(), got.tolist()):
        f, df = ((mpmath.erf(y), 2 / mpmath.sqrt(mpmath.pi) * mpmath.exp(-y * y)) if op == "Erfinv"
                 else (mpmath.ncdf(y), mpmath.npdf(y)))
        assert abs(f - v) <= 2 * EPS * (abs(y) + TINY) * df, (op, v, y, float(f))


def test_polygamma_orders_and_errors():
    """The order a: a constant (any shape, one value) or arithmetic on constants (a + 1, as in
    TF's gradient of Polygamma: the third derivative of lgamma converts); a non-integer or
    negative a gives TF's NaN; a computed a, or a constant with two values, is an error naming
    the node."""
    x = np.array([0.3, 2.5, -1.7, 9.0], np.float64)

    def build():
        p = v1.placeholder(tf.float64, [4], name="x")
        g1 = tf.gradients(tf.math.lgamma(p), p)[0]
        g2 = tf.gradients(g1, p)[0]
        g3 = tf.identity(tf.gradients(g2, p)[0], name="d3")
        vec = tf.identity(tf.math.polygamma(tf.constant([2.0] * 4, tf.float64), p), name="vec")
        odd = tf.identity(tf.math.polygamma(tf.constant(1.5, tf.float64), p), name="half")
        return g3, vec, odd
    graph, outs = tf1_graph(build)
    names = ["d3:0", "vec:0", "half:0"]
    want = tf_run(graph, names, {"x:0": x})
    got = ort_run(convert(graph.as_graph_def(), inputs=["x:0"], outputs=names), {"x:0": x}, names)
    for name, g, w in zip(names, got, want):
        _close(g, w, name, atol=_psi_scale(x, 3) * 8 * EPS)
    assert {nd.op for nd in graph.as_graph_def().node} >= {"Polygamma", "AddV2"}
    for order, match in ((lambda: v1.placeholder(tf.float64, [], name="a"), "must be a constant"),
                         (lambda: tf.constant([1.0, 2.0], tf.float64), "one value")):
        g, _ = tf1_graph(lambda: tf.identity(tf.math.polygamma(
            order(), v1.placeholder(tf.float64, [2], name="x"), name="pg"), name="y"))
        with pytest.raises(ConversionError, match=f"Polygamma node 'pg'.*{match}"):
            convert(g.as_graph_def(), inputs=["x:0"], outputs=["y:0"])


# -- float32, float16 ------------------------------------------------------------------------
def _ulp_check(op, dtype, x):
    """The converted op in dtype within an ulp (of dtype, plus the float64 terms' bound) of
    TF's float64 values at the same inputs; onnxgrad's gradient within two, and TF's gradient
    graph converted within two and its formula's error in dtype."""
    np_type = dtype.as_numpy_dtype
    x = np.asarray(x, np_type)
    x64 = x.astype(np.float64)
    want, _, _, gys = _run(op, x64)
    _, got, got_tf_graph, _ = _run(op, x, dtype, tf_too=False)
    fi = np.finfo(np_type)
    eps, tiny = float(fi.eps), float(fi.tiny)
    with np.errstate(over="ignore"):  # (a float64 value beyond dtype's range: inf)
        want = [w.astype(np_type).astype(np.float64) for w in want]
    ok = (np.abs(x64) >= tiny) | (x64 == 0)
    if op == "Erfinv":
        ok &= ~(np.isinf(want[0]) & (np.abs(x64) != 1))  # (TF's float64 quirk)
    atol, gatol, grtol = _tolerances(op, x64, want[0], gys)
    _close(got[0][ok], want[0][ok], f"{op} {dtype.name} forward at {x[ok].tolist()}", rtol=eps,
           atol=tiny + atol[ok])
    if got_tf_graph is None:
        return
    keep = ok & ~np.isnan(want[0]) & ~np.isnan(want[1])
    _close(got[1][keep], want[1][keep], f"{op} {dtype.name} onnxgrad gradient", rtol=2 * eps,
           atol=tiny + gatol[keep], rtol_each=grtol[keep], grad=True)
    atol, gatol, grtol = _tolerances(op, x64, want[0], gys, eps)
    _close(got_tf_graph[keep], want[1][keep], f"{op} {dtype.name} TF's gradient graph",
           rtol=2 * eps, atol=tiny + gatol[keep], rtol_each=grtol[keep], grad=True)


@pytest.mark.parametrize("op", sorted(OPS))
def test_float32_within_an_ulp(op):
    x = np.array(_edges(op) + list(np.linspace(-9.7, 9.7, 23)), np.float64)
    if op in ("Erfinv", "Ndtri"):
        x = np.concatenate([x[np.abs(x) <= 1], np.linspace(-0.999, 0.999, 23)])
        if op == "Ndtri":
            x = np.abs(x)
    _ulp_check(op, tf.float32, _tf_polygamma_range(op, x.astype(np.float32)).astype(np.float32))


@pytest.mark.parametrize("op", ["Lgamma", "Digamma", "Erfinv", "Ndtri", "BesselI0e",
                                "BesselI1e"])
def test_float16_within_an_ulp(op):
    """float16, computed in float64 (TF has no CPU float16 kernel for erfinv and ndtri: the
    reference is its float64 value at the same inputs)."""
    x = np.array(_edges(op) + list(np.linspace(-9.7, 9.7, 23)), np.float64)
    if op in ("Erfinv", "Ndtri"):
        x = np.abs(x[np.abs(x) <= 1]) if op == "Ndtri" else x[np.abs(x) <= 1]
    _ulp_check(op, tf.float16, x.astype(np.float16))


# where TF's float32 kernels are exact to their single-precision series (see the docstring)
TF32 = {"Lgamma": 4, "Digamma": 8, "Trigamma": 8, "Polygamma2": 8, "Polygamma3": 8,
        "Erfinv": 4, "Ndtri": 4, "BesselI0e": 16, "BesselI1e": 16}  # ulp


@pytest.mark.parametrize("op", sorted(OPS))
def test_float32_against_tf_float32(op):
    x = np.linspace(-7.9, 30, 97) if op not in ("Erfinv", "Ndtri") else np.linspace(-1, 1, 97)
    x = np.abs(x) if op == "Ndtri" else x
    if op in ORDER and ORDER[op] > 0:  # (TF's float32 polygamma: wrong below about -7)
        x = x[x > -6.5]
    x = x.astype(np.float32)
    (want_y, _), (got_y, _), _, _ = _run(op, x, tf.float32)
    eps = float(np.finfo(np.float32).eps)
    atol = _scale(op, x.astype(np.float64), False) * 8 * eps
    if op == "Erfinv":
        atol = _erfinv_atol(np.nan_to_num(want_y.astype(np.float64)), eps)
        keep = np.abs(x) < 1 - 2 ** -23  # (TF: inf at 1 - 2^-24)
        got_y, want_y, atol = got_y[keep], want_y[keep], atol[keep]
    _close(got_y, want_y, f"{op} float32 vs TF's float32 kernel", rtol=TF32[op] * eps, atol=atol)
