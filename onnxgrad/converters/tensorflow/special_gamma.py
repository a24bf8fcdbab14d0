"""Lgamma, Digamma, Polygamma, Erfinv, Ndtri, BesselI0e and BesselI1e from ops that onnxruntime's
CPU runs in float64 (Exp, Log, Sqrt, Sin, Floor, Round, Reciprocal, Where and arithmetic; no Erf,
Tan or Pow), with the same rules as :mod:`.special`: every branch of a Where computed on inputs
where it is finite ("double where"), so the gradient is finite wherever TF's is.

Every dtype is computed in float64 and cast back: float32, float16 and bfloat16 results are then
correctly rounded (but for float64's few ulp), where a float32 evaluation would be a few ulp off,
and much worse near the functions' zeros; the cost is float64 arithmetic on these nodes.

- lgamma: fdlibm's e_lgamma_r.c (Sun Microsystems 1993, "permission to use, copy, modify, and
  distribute this software is freely granted, provided that this notice is preserved"), the
  algorithm of glibc's lgamma, which TF's float64 kernel calls: polynomials around lgamma's
  minimum and its zeros 1 and 2 (relative accuracy there), a rational function on [2, 3] with
  lgamma(x + 1) = log(x) + lgamma(x) up to 8, Stirling's series with a polynomial correction up
  to 2^58, x (log x - 1) beyond; x < 0 by reflection, log(pi / |x sin(pi x)|) - lgamma(-x), which
  loses digits near lgamma's negative zeros (about 1e-16 of |lgamma(-x)| absolute, where glibc
  has a special case). +inf at 0 and the negative integers, and at -inf (C's).
- digamma and polygamma(m, x) for a constant integer m >= 1: the recurrence psi(x) = psi(x + N)
  - sum 1 / (x + i) (and its m-th derivative) up to a T where the asymptotic series, 10 terms,
  is exact to 2^-57 (T from m at conversion time); x < 0 by reflection, psi^(m)(x) =
  (-1)^m psi^(m)(1 - x) - pi^(m+1) P_m(cot(pi x)), P_m the polynomial with
  d^m/du^m cot(u) = P_m(cot u). At 0, the negative integers and -inf TF's NaN (m even) or inf (m
  odd). TF's polygamma is 0 where x^(m+1) overflows (x > 1e154 for trigamma); this one is not.
- erfinv and ndtri: a start (Giles' single-precision polynomial, "Approximating the erfinv
  function", 2010, where w = -log(1 - x^2) < 5; beyond, erfc(y) ~ exp(-y^2) / (y sqrt(pi))
  solved for y^2 by fixed-point steps), then two Halley steps on erf(y) = |x| (or erfc(y) = 1 -
  |x| from 1/2, where 1 - |x| is exact; fdlibm's erf and erfc from :mod:`.special`). Halley's
  error is cubed per step, and its derivative is exact to the start's error squared, so the
  value and the gradient are float64-exact. +-inf at +-1 (with TF's infinite gradient), NaN
  beyond. TF's own erfinv is ndtri((x + 1) / 2) / sqrt(2), which rounds x + 1 (an absolute
  error of 2^-53: TF's erfinv(1e-30) is 0, and in float32 its erfinv(1 - 2^-24) is inf).
- bessel_i0e, bessel_i1e: Cephes' Chebyshev series (Cephes Math Library, Stephen L. Moshier,
  as in TF's kernels), on [0, 8] and in 32 / x beyond.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np

from . import special
from .proto import DT, AttrValue
from .special import DOUBLE, _k, _poly, _where


def in_float64(c, n, fn, *xs):
    """fn(c, n, *xs) computed in float64 and cast back to node n's dtype T."""
    t = c.onnx_type(n)
    if t == DOUBLE:
        return fn(c, n, *xs)
    n64 = dataclasses.replace(n, attr={**n.attr, "T": AttrValue(type=DT["DT_DOUBLE"])})
    return c.op("Cast", [fn(c, n64, *(c.op("Cast", [x], to=DOUBLE) for x in xs))], to=t)


def _ipow(c, v, k):
    """v ** k for an integer k >= 1, by squaring (onnxruntime's Pow: no float64 gradient ops
    needed, and exact for small k)."""
    out = None
    while True:
        if k & 1:
            out = v if out is None else c.op("Mul", [out, v])
        k >>= 1
        if not k:
            return out
        v = c.op("Mul", [v, v])


def _cot_pi(c, n, x):
    """cot(pi x) for a non-integer x: r = x - round(x) is exact and |r| <= 1/2; cos(pi r) as
    sin(pi (1/2 - |r|)), exactly 0 at |r| = 1/2 (cos(pi / 2) is 6e-17)."""
    r = c.op("Sub", [x, c.op("Round", [x])])
    cos = c.op("Sin", [c.op("Mul", [c.op("Sub", [_k(c, n, 0.5), c.op("Abs", [r])]),
                                    _k(c, n, np.pi)])])
    return c.op("Div", [cos, c.op("Sin", [c.op("Mul", [r, _k(c, n, np.pi)])])])


def _not_nan(c, x, out):
    return _where(c, c.op("IsNaN", [x]), x, out)


# -- lgamma: fdlibm's e_lgamma_r.c ---------------------------------------------------------------
def _high_word(h):
    """The double whose high 32 bits are h (fdlibm's thresholds compare high words)."""
    return float(np.array([h << 32], np.uint64).view(np.float64)[0])


LG_A = (7.72156649015328655494e-02, 3.22467033424113591611e-01, 6.73523010531292681824e-02,
        2.05808084325167332806e-02, 7.38555086081402883957e-03, 2.89051383673415629091e-03,
        1.19270763183362067845e-03, 5.10069792153511336608e-04, 2.20862790713908385557e-04,
        1.08011567247583939954e-04, 2.52144565451257326939e-05, 4.48640949618915160150e-05)
LG_TC, LG_TF, LG_TT = (1.46163214496836224576e+00, -1.21486290535849611461e-01,
                       -3.63867699703950536541e-18)  # lgamma's minimum: where, value (2 parts)
LG_T = (4.83836122723810047042e-01, -1.47587722994593911752e-01, 6.46249402391333854778e-02,
        -3.27885410759859649565e-02, 1.79706750811820387126e-02, -1.03142241298341437450e-02,
        6.10053870246291332635e-03, -3.68452016781138256760e-03, 2.25964780900612472250e-03,
        -1.40346469989232843813e-03, 8.81081882437654011382e-04, -5.38595305356740546715e-04,
        3.15632070903625950361e-04, -3.12754168375120860518e-04, 3.35529192635519073543e-04)
LG_U = (-7.72156649015328655494e-02, 6.32827064025093366517e-01, 1.45492250137234768737e+00,
        9.77717527963372745603e-01, 2.28963728064692451092e-01, 1.33810918536787660377e-02)
LG_V = (1.0, 2.45597793713041134822e+00, 2.12848976379893395361e+00, 7.69285150456672783825e-01,
        1.04222645593369134254e-01, 3.21709242282423911810e-03)
LG_S = (-7.72156649015328655494e-02, 2.14982415960608852501e-01, 3.25778796408930981787e-01,
        1.46350472652464452805e-01, 2.66422703033638609560e-02, 1.84028451407337715652e-03,
        3.19475326584100867617e-05)
LG_R = (1.0, 1.39200533467621045958e+00, 7.21935547567138069525e-01, 1.71933865632803078993e-01,
        1.86459191715652901344e-02, 7.77942496381893596434e-04, 7.32668430744625636189e-06)
LG_W = (4.18938533204672725052e-01, 8.33333333333329678849e-02, -2.77777777728775536470e-03,
        7.93650558643019558500e-04, -5.95187557450339963135e-04, 8.36339918996282139126e-04,
        -1.63092934096575273989e-03)
# fdlibm's branch points: 0.9, 0.7316, 0.23164 (below 0.9), 1.7316, 1.23164 (from 0.9 to 2)
LG_SMALL, LG_0A, LG_1A, LG_0B, LG_1B = (_high_word(h) for h in (
    0x3feccccd, 0x3FE76944, 0x3FCDA661, 0x3FFBB4C3, 0x3FF3B4C4))
LG_TINY, LG_HUGE, LG_INTEGRAL = 2.0 ** -70, 2.0 ** 58, 2.0 ** 52


def _lgamma_below_2(c, n, a):
    """lgamma(a) for 2^-70 <= a < 2: -log(a) + lgamma(a + 1) below 0.9, and a polynomial in
    the distance to 1 or 2 (near lgamma's zeros, relative accuracy there) or to its minimum, or a
    rational function of a - 1 or a."""
    small = c.op("Less", [a, _k(c, n, LG_SMALL)])
    one = _k(c, n, 1)
    r0 = _where(c, small, c.op("Neg", [c.op("Log", [a])]), _k(c, n, 0))
    i0, i1 = (c.op("GreaterOrEqual", [a, _where(c, small, _k(c, n, lo), _k(c, n, hi))])
              for lo, hi in ((LG_0A, LG_0B), (LG_1A, LG_1B)))
    # i0: y = 1 - a or 2 - a
    y = c.op("Sub", [_where(c, small, one, _k(c, n, 2)), a])
    z = c.op("Mul", [y, y])
    p = c.op("Add", [c.op("Mul", [y, _poly(c, n, z, LG_A[0::2])]),
                     c.op("Mul", [z, _poly(c, n, z, LG_A[1::2])])])
    case0 = c.op("Sub", [p, c.op("Mul", [y, _k(c, n, 0.5)])])
    # i1: y = a - tc (or a - (tc - 1)), lgamma = tf + y^2 P(y^3), tf + tt to 2^-113
    y = c.op("Sub", [a, _where(c, small, _k(c, n, LG_TC - 1), _k(c, n, LG_TC))])
    z = c.op("Mul", [y, y])
    w = c.op("Mul", [z, y])
    p1, p2, p3 = (_poly(c, n, w, LG_T[i::3]) for i in range(3))
    p = c.op("Sub", [c.op("Mul", [z, p1]), c.op("Sub", [_k(c, n, LG_TT), c.op("Mul", [
        w, c.op("Add", [p2, c.op("Mul", [y, p3])])])])])
    case1 = c.op("Add", [_k(c, n, LG_TF), p])
    # i2: y = a or a - 1
    y = _where(c, small, a, c.op("Sub", [a, one]))
    case2 = c.op("Add", [c.op("Mul", [y, _k(c, n, -0.5)]),
                         c.op("Div", [c.op("Mul", [y, _poly(c, n, y, LG_U)]),
                                      _poly(c, n, y, LG_V)])])
    return c.op("Add", [r0, _where(c, i0, case0, _where(c, i1, case1, case2))])


def _lgamma_2_to_8(c, n, a):
    """lgamma(2 + y) by a rational function of y = a - floor(a), plus log((y + 2) ... (y + i -
    1)) for i = floor(a)."""
    i = c.op("Floor", [a])
    y = c.op("Sub", [a, i])
    r = c.op("Add", [c.op("Mul", [y, _k(c, n, 0.5)]),
                     c.op("Div", [c.op("Mul", [y, _poly(c, n, y, LG_S)]), _poly(c, n, y, LG_R)])])
    z = None
    for k in range(2, 7):
        f = _where(c, c.op("Greater", [i, _k(c, n, k)]), c.op("Add", [y, _k(c, n, k)]),
                   _k(c, n, 1))
        z = f if z is None else c.op("Mul", [z, f])
    return c.op("Add", [r, c.op("Log", [z])])


def lgamma(c, n, x):
    zero, one = _k(c, n, 0), _k(c, n, 1)
    a = c.op("Abs", [x])
    tiny = c.op("Less", [a, _k(c, n, LG_TINY)])  # -log|x| (inf at 0)
    lt2, lt8, lt58 = (c.op("Less", [a, _k(c, n, v)]) for v in (2, 8, LG_HUGE))
    below2 = _lgamma_below_2(c, n, _where(c, c.op("And", [lt2, c.op("Not", [tiny])]), a,
                                          _k(c, n, 1.5)))
    mid = _lgamma_2_to_8(c, n, _where(c, c.op("And", [lt8, c.op("Not", [lt2])]), a,
                                      _k(c, n, 3)))
    # Stirling: (a - 1/2)(log a - 1) + w(1 / a)
    ac = _where(c, c.op("And", [lt58, c.op("Not", [lt8])]), a, _k(c, n, 8))
    iv = c.op("Reciprocal", [ac])
    w = c.op("Add", [_k(c, n, LG_W[0]), c.op("Mul", [iv, _poly(c, n, c.op("Mul", [iv, iv]),
                                                                LG_W[1:])])])
    stirling = c.op("Add", [c.op("Mul", [c.op("Sub", [ac, _k(c, n, 0.5)]),
                                         c.op("Sub", [c.op("Log", [ac]), one])]), w])
    inf = c.op("IsInf", [a])
    ad = _where(c, c.op("Or", [lt58, inf]), _k(c, n, LG_HUGE), a)
    huge = c.op("Mul", [ad, c.op("Sub", [c.op("Log", [ad]), one])])
    # inf at inf as a^2: the gradient inf (TF's digamma(inf)), where a (log(a) - 1) has inf * 0
    ai = _where(c, inf, a, one)
    huge = _where(c, inf, c.op("Mul", [ai, ai]), huge)
    pos = _where(c, lt2, below2, _where(c, lt8, mid, _where(c, lt58, stirling, huge)))
    # x < 0: log(pi / |x sin(pi x)|) - lgamma(|x|); inf at the integers (sin = 0), all of them
    # from 2^52 on
    neg = c.op("Less", [x, zero])
    integral = c.op("And", [neg, c.op("GreaterOrEqual", [a, _k(c, n, LG_INTEGRAL)])])
    an = _where(c, c.op("And", [neg, c.op("Not", [c.op("Or", [integral, tiny])])]), a,
                _k(c, n, 0.5))  # (x sin(pi x) underflows for a tiny x)
    r = c.op("Sub", [an, c.op("Round", [an])])
    sin = c.op("Sin", [c.op("Mul", [r, _k(c, n, np.pi)])])
    nadj = c.op("Log", [c.op("Div", [_k(c, n, np.pi), c.op("Abs", [c.op("Mul", [sin, an])])])])
    out = _where(c, neg, c.op("Sub", [nadj, pos]), pos)
    out = _where(c, tiny, c.op("Neg", [c.op("Log", [_where(c, tiny, a, one)])]), out)
    return _not_nan(c, x, _where(c, integral, _k(c, n, np.inf), out))


# -- digamma, polygamma --------------------------------------------------------------------------
BERNOULLI = (Fraction(1, 6), Fraction(-1, 30), Fraction(1, 42), Fraction(-1, 30), Fraction(5, 66),
             Fraction(-691, 2730), Fraction(7, 6), Fraction(-3617, 510), Fraction(43867, 798),
             Fraction(-174611, 330), Fraction(854513, 138))  # B_2 ... B_22
TERMS = 10  # of the asymptotic series (B_2 ... B_20; B_22 bounds the error)


def asymptotic_series(m):
    """(c_1 ... c_10, T) for psi^(m)(s) ~ (-1)^(m+1) s^-m ((m-1)! + m! / (2 s) + sum c_k s^-2k)
    (psi(s) ~ log(s) - 1 / (2 s) + sum c_k s^-2k for m = 0), and the smallest T >= 6 from which
    the first term left out (the error bound) is under 2^-57 of the value."""
    f = math.factorial
    if m == 0:
        coefs = [-b / (2 * k) for k, b in enumerate(BERNOULLI, 1)]
        lead = 1  # (psi(s) > 1.7 for s >= 6)
    else:
        coefs = [b * Fraction(f(2 * k + m - 1), f(2 * k)) for k, b in enumerate(BERNOULLI, 1)]
        lead = f(m - 1)
    rest = abs(coefs[TERMS]) / lead
    t = next(t for t in range(6, 10 ** 6) if rest / Fraction(t) ** (2 * TERMS + 2) < 2.0 ** -57)
    return [float(v) for v in coefs[:TERMS]], t


def cot_derivative(m):
    """Coefficients (constant first) of P_m, d^m/du^m cot(u) = P_m(cot(u)): P_0(t) = t,
    P_(k+1)(t) = -(1 + t^2) P_k'(t)."""
    p = [0, 1]
    for _ in range(m):
        d = [k * v for k, v in enumerate(p)][1:]
        p = [0] * (len(d) + 2)
        for k, v in enumerate(d):
            p[k] -= v
            p[k + 2] -= v
    return p


def polygamma(c, n, x, m: int):
    """psi^(m)(x) for an integer m >= 0 (digamma for m = 0); see the module docstring."""
    f = math.factorial
    sign = 1 if m % 2 else -1  # (-1)^(m+1)
    coefs, t = asymptotic_series(m)
    zero, one = _k(c, n, 0), _k(c, n, 1)
    pole = c.op("And", [c.op("LessOrEqual", [x, zero]), c.op("Equal", [c.op("Floor", [x]), x])])
    refl = c.op("And", [c.op("Less", [x, zero]), c.op("Not", [pole])])
    xr = _where(c, refl, x, _k(c, n, -0.25))
    z = _where(c, refl, c.op("Sub", [one, xr]), _where(c, c.op("Greater", [x, zero]), x, one))
    # z >= t: the series; below: the series at z + t, less the recurrence's t terms
    small = c.op("Less", [z, _k(c, n, t)])
    zs = _where(c, small, z, one)
    total = None
    for i in reversed(range(t)):  # (smallest first)
        v = _ipow(c, c.op("Reciprocal", [c.op("Add", [zs, _k(c, n, i)])]), m + 1)
        total = v if total is None else c.op("Add", [total, v])
    s = _where(c, small, c.op("Add", [zs, _k(c, n, t)]), z)
    iv = c.op("Reciprocal", [s])
    z2 = c.op("Mul", [iv, iv])
    series = c.op("Mul", [z2, _poly(c, n, z2, coefs)])
    if m == 0:
        asym = c.op("Add", [c.op("Sub", [c.op("Log", [s]), c.op("Mul", [iv, _k(c, n, 0.5)])]),
                            series])
    else:
        bracket = c.op("Add", [c.op("Add", [_k(c, n, f(m - 1)),
                                            c.op("Mul", [iv, _k(c, n, f(m) / 2)])]), series])
        asym = c.op("Mul", [c.op("Mul", [_ipow(c, iv, m), bracket]), _k(c, n, sign)])
    pos = c.op("Add", [asym, c.op("Mul", [_where(c, small, total, zero),
                                          _k(c, n, sign * f(m))])])
    # x < 0: (-1)^m psi^(m)(1 - x) - pi^(m+1) P_m(cot(pi x))
    cot = _poly(c, n, _cot_pi(c, n, xr), [float(v) for v in cot_derivative(m)])
    reflected = c.op("Sub", [c.op("Mul", [pos, _k(c, n, (-1) ** m)]),
                             c.op("Mul", [cot, _k(c, n, np.pi ** (m + 1))])])
    out = _where(c, refl, reflected, pos)
    return _not_nan(c, x, _where(c, pole, _k(c, n, np.inf if m % 2 else np.nan), out))


def digamma(c, n, x):
    return polygamma(c, n, x, 0)


# -- erfinv, ndtri -------------------------------------------------------------------------------
GILES = (1.50140941, 0.246640727, -0.00417768164, -0.00125372503, 0.00021858087,
         -4.39150654e-06, -3.5233877e-06, 3.43273939e-07, 2.81022636e-08)  # in w - 2.5, w < 5
TWO_OVER_ROOT_PI = 2 / math.sqrt(math.pi)


def _erfinv_core(c, n, a, t):
    """erfinv(a) for 0 <= a < 1, given t = 1 - a exact where a >= 1/2 (ndtri's 2p, erfinv's
    1 - |x|): the start, then two Halley steps (see the module docstring)."""
    w = c.op("Neg", [c.op("Log", [c.op("Mul", [t, c.op("Sub", [_k(c, n, 2), t])])])])
    central = c.op("Less", [w, _k(c, n, 5)])
    wc = c.op("Sub", [_where(c, central, w, _k(c, n, 2.5)), _k(c, n, 2.5)])
    y_central = c.op("Mul", [a, _poly(c, n, wc, GILES)])
    # erfc(y) = t, y^2 = v: v = L - log(v) / 2 + log(1 - 1 / (2v) + 3 / (4 v^2)), L = -log(t
    # sqrt(pi)) (the asymptotic series' first terms: the start within 0.3%)
    big_l = c.op("Neg", [c.op("Log", [c.op("Mul", [_where(c, central, _k(c, n, 1e-3), t),
                                                   _k(c, n, math.sqrt(math.pi))])])])
    v = big_l
    for _ in range(3):
        iv = c.op("Reciprocal", [v])
        corr = c.op("Add", [_k(c, n, 1), c.op("Mul", [iv, _poly(c, n, iv, (-0.5, 0.75))])])
        v = c.op("Add", [c.op("Sub", [big_l, c.op("Mul", [c.op("Log", [v]), _k(c, n, 0.5)])]),
                         c.op("Log", [corr])])
    y = _where(c, central, y_central, c.op("Sqrt", [v]))
    near = c.op("Less", [a, _k(c, n, 0.5)])
    for _ in range(2):  # Halley: y -= u / (1 + y u), u = f / f', f = erf(y) - a
        e, ec = special.erf_and_erfc(c, n, y)
        f = _where(c, near, c.op("Sub", [e, a]), c.op("Sub", [t, ec]))
        df = c.op("Mul", [c.op("Exp", [c.op("Neg", [c.op("Mul", [y, y])])]),
                          _k(c, n, TWO_OVER_ROOT_PI)])
        u = c.op("Div", [f, df])
        y = c.op("Sub", [y, c.op("Div", [u, c.op("Add", [_k(c, n, 1), c.op("Mul", [y, u])])])])
    return y


def _edges(c, n, x, inside, at_end, value):
    """value inside the domain; x / (1 - |x|) at its ends x = +-1 (+-inf, with TF's infinite
    gradient; x is 0 where it is not taken: x * inf would send 0 * inf = NaN into the
    gradient), NaN elsewhere (beyond, NaN)."""
    xe = _where(c, at_end, x, _k(c, n, 0))
    end = c.op("Div", [xe, c.op("Sub", [_k(c, n, 1), c.op("Abs", [xe])])])
    return _where(c, inside, value, _where(c, at_end, end, _k(c, n, np.nan)))


def _magnitude(c, n, x):
    """|x| with the gradient sign(x) at +-0 too (Abs's is 0 there: erfinv' and i1e' are not)."""
    return _where(c, c.op("Less", [x, _k(c, n, 0)]), c.op("Neg", [x]), x)


def erfinv(c, n, x):
    one = _k(c, n, 1)
    a = _magnitude(c, n, x)
    inside = c.op("Less", [a, one])
    a_in = _where(c, inside, a, _k(c, n, 0))
    y = _erfinv_core(c, n, a_in, c.op("Sub", [one, a_in]))
    y = _where(c, c.op("Less", [x, _k(c, n, 0)]), c.op("Neg", [y]), y)
    y = c.op("Add", [y, _k(c, n, 0)])  # (+0 at -0, as TF)
    return _edges(c, n, x, inside, c.op("Equal", [a, one]), y)


def ndtri(c, n, p):
    """sqrt(2) erfinv(2p - 1), with 1 - |2p - 1| = 2 min(p, 1 - p) exact."""
    zero, one, two = _k(c, n, 0), _k(c, n, 1), _k(c, n, 2)
    inside = c.op("And", [c.op("Greater", [p, zero]), c.op("Less", [p, one])])
    ps = _where(c, inside, p, _k(c, n, 0.5))
    lower = c.op("Less", [ps, _k(c, n, 0.5)])
    twice = c.op("Mul", [ps, two])
    a = _where(c, lower, c.op("Sub", [one, twice]), c.op("Sub", [twice, one]))
    t = _where(c, lower, twice, c.op("Sub", [two, twice]))
    y = c.op("Mul", [_erfinv_core(c, n, a, t), _k(c, n, math.sqrt(2))])
    y = _where(c, lower, c.op("Neg", [y]), y)
    ends = c.op("Or", [c.op("Equal", [p, zero]), c.op("Equal", [p, one])])
    return _edges(c, n, c.op("Sub", [c.op("Mul", [p, two]), one]), inside, ends, y)


# -- exponentially scaled modified Bessel functions (Cephes i0.c, i1.c) -------------------------
I0_A = (-4.41534164647933937950E-18, 3.33079451882223809783E-17, -2.43127984654795469359E-16,
        1.71539128555513303061E-15, -1.16853328779934516808E-14, 7.67618549860493561688E-14,
        -4.85644678311192946090E-13, 2.95505266312963983461E-12, -1.72682629144155570723E-11,
        9.67580903537323691224E-11, -5.18979560163526290666E-10, 2.65982372468238665035E-9,
        -1.30002500998624804212E-8, 6.04699502254191894932E-8, -2.67079385394061173391E-7,
        1.11738753912010371815E-6, -4.41673835845875056359E-6, 1.64484480707288970893E-5,
        -5.75419501008210370398E-5, 1.88502885095841655729E-4, -5.76375574538582365885E-4,
        1.63947561694133579842E-3, -4.32430999505057594430E-3, 1.05464603945949983183E-2,
        -2.37374148058994688156E-2, 4.93052842396707084878E-2, -9.49010970480476444210E-2,
        1.71620901522208775349E-1, -3.04682672343198398683E-1, 6.76795274409476084995E-1)
I0_B = (-7.23318048787475395456E-18, -4.83050448594418207126E-18, 4.46562142029675999901E-17,
        3.46122286769746109310E-17, -2.82762398051658348494E-16, -3.42548561967721913462E-16,
        1.77256013305652638360E-15, 3.81168066935262242075E-15, -9.55484669882830764870E-15,
        -4.15056934728722208663E-14, 1.54008621752140982691E-14, 3.85277838274214270114E-13,
        7.18012445138366623367E-13, -1.79417853150680611778E-12, -1.32158118404477131188E-11,
        -3.14991652796324136454E-11, 1.18891471078464383424E-11, 4.94060238822496958910E-10,
        3.39623202570838634515E-9, 2.26666899049817806459E-8, 2.04891858946906374183E-7,
        2.89137052083475648297E-6, 6.88975834691682398426E-5, 3.36911647825569408990E-3,
        8.04490411014108831608E-1)
I1_A = (2.77791411276104639959E-18, -2.11142121435816608115E-17, 1.55363195773620046921E-16,
        -1.10559694773538630805E-15, 7.60068429473540693410E-15, -5.04218550472791168711E-14,
        3.22379336594557470981E-13, -1.98397439776494371520E-12, 1.17361862988909016308E-11,
        -6.66348972350202774223E-11, 3.62559028155211703701E-10, -1.88724975172282928790E-9,
        9.38153738649577178388E-9, -4.44505912879632808065E-8, 2.00329475355213526229E-7,
        -8.56872026469545474066E-7, 3.47025130813767847674E-6, -1.32731636560394358279E-5,
        4.78156510755005422638E-5, -1.61760815825896745588E-4, 5.12285956168575772895E-4,
        -1.51357245063125314899E-3, 4.15642294431288815669E-3, -1.05640848946261981558E-2,
        2.47264490306265168283E-2, -5.29459812080949914269E-2, 1.02643658689847095384E-1,
        -1.76416518357834055153E-1, 2.52587186443633654823E-1)
I1_B = (7.51729631084210481353E-18, 4.41434832307170791151E-18, -4.65030536848935832153E-17,
        -3.20952592199342395980E-17, 2.96262899764595013876E-16, 3.30820231092092828324E-16,
        -1.88035477551078244854E-15, -3.81440307243700780478E-15, 1.04202769841288027642E-14,
        4.27244001671195135429E-14, -2.10154184277266431302E-14, -4.08355111109219731823E-13,
        -7.19855177624590851209E-13, 2.03562854414708950722E-12, 1.41258074366137813316E-11,
        3.25260358301548823856E-11, -1.89749581235054123450E-11, -5.58974346219658380687E-10,
        -3.83538038596423702205E-9, -2.63146884688951950684E-8, -2.51223623787020892529E-7,
        -3.88256480887769039346E-6, -1.10588938762623716291E-4, -9.76109749136146840777E-3,
        7.78576235018280120474E-1)


def _chebyshev(c, n, x, coefs):
    """Cephes' chbevl: sum' coefs[k] T_k(x / 2), highest order first (Clenshaw's recurrence)."""
    b0, b1 = _k(c, n, coefs[0]), None
    for a in coefs[1:]:
        b2, b1 = b1, b0
        b0 = c.op("Add", [c.op("Mul", [x, b1]), _k(c, n, a)])
        if b2 is not None:
            b0 = c.op("Sub", [b0, b2])
    return c.op("Mul", [c.op("Sub", [b0, b2]), _k(c, n, 0.5)])


def _bessel_ie(c, n, x, near, far, times_x):
    """|x| <= 8: near(|x| / 2 - 2) (times |x| for i1e: times_x); beyond, far(32 / |x| - 2) /
    sqrt(|x|) (0 at inf)."""
    # (i1e'(0) = 1/2; i0e has a kink at 0, where TF's gradient is 0, Abs's)
    a = _magnitude(c, n, x) if times_x else c.op("Abs", [x])
    small = c.op("LessOrEqual", [a, _k(c, n, 8)])
    a_in = _where(c, small, a, _k(c, n, 0))
    v = _chebyshev(c, n, c.op("Sub", [c.op("Mul", [a_in, _k(c, n, 0.5)]), _k(c, n, 2)]), near)
    if times_x:
        v = c.op("Mul", [v, a_in])
    a_out = _where(c, small, _k(c, n, 8), a)  # (NaN: here, where it stays NaN)
    w = _chebyshev(c, n, c.op("Sub", [c.op("Div", [_k(c, n, 32), a_out]), _k(c, n, 2)]), far)
    return _where(c, small, v, c.op("Div", [w, c.op("Sqrt", [a_out])]))


def bessel_i0e(c, n, x):
    return _bessel_ie(c, n, x, I0_A, I0_B, False)


def bessel_i1e(c, n, x):
    """Odd: -i1e(|x|) for x < 0 (+0 at -0, as TF)."""
    v = _bessel_ie(c, n, x, I1_A, I1_B, True)
    return c.op("Add", [_where(c, c.op("Less", [x, _k(c, n, 0)]), c.op("Neg", [v]), v),
                        _k(c, n, 0)])


UNARY = {"Lgamma": lgamma, "Digamma": digamma, "Erfinv": erfinv, "Ndtri": ndtri,
         "BesselI0e": bessel_i0e, "BesselI1e": bessel_i1e}
