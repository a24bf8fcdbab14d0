"""Elementwise special functions from ops that onnxruntime's CPU runs in every float type.

onnxruntime's CPU has no float64 kernel for Tan, Asin, Acos, Atan, Sinh, Cosh, Asinh, Acosh, Atanh
or Erf (float32 and float16 only), so the converter builds them for float64 (and Atan2 and Erfc,
which use Atan and Erf) from Exp, Log, Sqrt, Sin, Cos and arithmetic, which it has, as exact as
TF's float64 kernels (the C library's functions): about 1e-15 relative, the gradients too
(``tests/test_tf_float64.py``).

- atan of |t| <= 1: float32's Atan and one Newton step in float64 (the error squared); atan of
  larger |t| from atan(1 / t); atan2 from the smaller of |y|, |x| over the larger.
- asin(x) = atan2(x, s), acos(x) = atan2(s, x), s = sqrt(1 - x) sqrt(1 + x) (two roots: the
  product under one root would make the gradient 0 * inf at +-1, where TF's is infinite).
- tan: x reduced by k pi / 2 (pi / 2 in five pieces, Cody and Waite, exact for |x| < 1e8, where
  k < 2^26), then sin(r) / cos(r) or -cos(r) / sin(r); onnxruntime's own Sin and Cos lose their
  relative accuracy near their zeros (sin(pi) = 0), which tan would inherit. Beyond 1e8: sin(x) /
  cos(x) (absolute errors ~2e-16).
- sinh, cosh: Taylor series below 0.5 (exp(x) - exp(-x) cancels there), (e +- 1 / e) / 2 up to
  20, exp(|x|) / 2 beyond, as exp(|x| - L) exp(L - log(2)) with an exact subtraction (no
  overflow before sinh's and cosh's own, in the value or the gradient).
- log1p and expm1 (:func:`log1p`, :func:`expm1`; any float type, TF's Log1p and Expm1 too):
  Kahan's forms below 0.5 in magnitude, log(1 + x) and exp(x) - 1 beyond.
- asinh(|x|) = log1p(a + a^2 / (1 + sqrt(1 + a^2))), log(a) + log(2) above 2^28; acosh(x) =
  log1p(t + sqrt(t) sqrt(t + 2)), t = x - 1; atanh(a) = (log1p(a) - log1p(-a)) / 2 (the two
  logs have opposite signs: no cancellation); odd functions by their symmetry, and x itself
  below 2^-28, where the value is x (so -0 stays -0).
- erf, erfc: fdlibm's rational approximations (s_erf.c, Sun Microsystems 1993, "permission to
  use, copy, modify, and distribute this software is freely granted, provided that this notice
  is preserved"): below 0.84375 x + x R(x^2); to 1.25 around erf(1); to 28, where erfc underflows,
  erfc(x) = exp(-x^2 - 0.5625 + R(1 / x^2)) / x (with fdlibm's exact split of x^2).

A Where takes one branch, but the gradient flows into both (0 into the one not taken), and a
branch that is infinite or NaN where it is not taken turns that 0 into NaN: every branch is
computed on inputs where it is finite ("double where"), so the gradient is finite wherever TF's
is. NaN inputs give NaN, and the values at 0, -0, +-inf and the domain edges are the C library's.
onnxruntime's Where returns +0 where it picks a -0 from its second input (its third keeps the
sign), and its optimizer turns Where(Not(c), a, b) into Where(c, b, a): a value that may be -0 is
put last, under a condition computed by a comparison (NaN compares false: the -0 branch gets it,
and gives NaN).
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from .proto import dtype_info

DOUBLE = TensorProto.DOUBLE
LN2 = math.log(2.0)
LN2_HI = float.fromhex("0x1.62e42fefa38p-1")  # log(2) to 43 bits after the point
# 2 exp(LN2_HI - log(2)): e^a / 2 = (E / 2) * TWO_EXP_LN2_LO, E = exp(a - LN2_HI) (a product with
# exp(LN2_HI - log(2)) itself would be dropped by onnxruntime, whose optimizer takes a Mul by a
# double that rounds to 1 in float32 for a Mul by 1)
TWO_EXP_LN2_LO = 1.99999999999989
TINY, HUGE = 2.0 ** -28, 2.0 ** 28  # f(x) = x below TINY (asinh, atanh); log(2x) above HUGE
# pi / 2 = P1 + P2 + P3 + P4 + P5 (to 2e-51): 27 bits each but the last, so k * Pi is exact
# for |k| < 2^26
HALF_PI = tuple(map(float.fromhex, ("0x1.921fb54p+0", "0x1.10b461p-30", "0x1.a62633p-58",
                                     "0x1.45c06ep-86", "0x1.cd129024e088ap-115")))
TAN_REDUCED = 1e8  # |x| up to which tan reduces x exactly (k < 2^26)

# fdlibm's s_erf.c
ERX = 8.45062911510467529297e-01
PP = (1.28379167095512558561e-01, -3.25042107247001499370e-01, -2.84817495755985104766e-02,
      -5.77027029648944159157e-03, -2.37630166566501626084e-05)
QQ = (1.0, 3.97917223959155352819e-01, 6.50222499887672944485e-02, 5.08130628187576562776e-03,
      1.32494738004321644526e-04, -3.96022827877536812320e-06)
PA = (-2.36211856075265944077e-03, 4.14856118683748331666e-01, -3.72207876035701323847e-01,
      3.18346619901161753674e-01, -1.10894694282396677476e-01, 3.54783043256182359371e-02,
      -2.16637559486879084300e-03)
QA = (1.0, 1.06420880400844228286e-01, 5.40397917702171048937e-01, 7.18286544141962662868e-02,
      1.26171219808761642112e-01, 1.36370839120290507362e-02, 1.19844998467991074170e-02)
RA = (-9.86494403484714822705e-03, -6.93858572707181764372e-01, -1.05586262253232909814e+01,
      -6.23753324503260060396e+01, -1.62396669462573470355e+02, -1.84605092906711035994e+02,
      -8.12874355063065934246e+01, -9.81432934416914548592e+00)
SA = (1.0, 1.96512716674392571292e+01, 1.37657754143519042600e+02, 4.34565877475229228821e+02,
      6.45387271733267880336e+02, 4.29008140027567833386e+02, 1.08635005541779435134e+02,
      6.57024977031928170135e+00, -6.04244152148580987438e-02)
RB = (-9.86494292470009928597e-03, -7.99283237680523006574e-01, -1.77579549177547519889e+01,
      -1.60636384855821916062e+02, -6.37566443368389627722e+02, -1.02509513161107724954e+03,
      -4.83519191608651397019e+02)
SB = (1.0, 3.03380607434824582924e+01, 3.25792512996573918826e+02, 1.53672958608443695994e+03,
      3.19985821950859553908e+03, 2.55305040643316442583e+03, 4.74528541206955367215e+02,
      -2.24409524465858183362e+01)


def _k(c, n, value):
    """A scalar constant of node n's dtype T."""
    return c.const(value, dtype_info(n.attr["T"].type).np)


def _poly(c, n, z, coefs):
    """coefs[0] + z * (coefs[1] + z * (...)), by Horner's rule."""
    p = _k(c, n, coefs[-1])
    for a in reversed(coefs[:-1]):
        p = c.op("Add", [c.op("Mul", [p, z]), _k(c, n, a)])
    return p


def _ratio(c, n, z, num, den):
    return c.op("Div", [_poly(c, n, z, num), _poly(c, n, z, den)])


def _where(c, cond, a, b):
    """cond ? a : b (a value that may be -0 goes in b: see the module docstring)."""
    return c.op("Where", [cond, a, b])


def _at_least(c, n, v, bound):
    return c.op("GreaterOrEqual", [v, _k(c, n, bound)])


def _odd(c, n, x, v):
    """v (a function's value at |x|) with x's sign: -v for x < 0."""
    return _where(c, c.op("Less", [x, _k(c, n, 0)]), c.op("Neg", [v]), v)


# -- logarithm -----------------------------------------------------------------------------------
def log1p(c, n, x):
    """log(1 + x), any float type: Kahan's log(u) * x / (u - 1), u = 1 + x, where 1 + x loses
    digits (|x| < 0.5; x itself where 1 + x rounds to 1); log(1 + x) beyond, as exact there (1 + x
    is exact from -1 to -0.5), which reaches -inf at -1 and inf at inf (the ratio's inf / inf
    does not), with gradient 1 / (1 + x). The small branch runs on x clamped to where it is
    finite, and a value that may be -0 is Where's second choice."""
    one = _k(c, n, 1)
    big = _at_least(c, n, c.op("Abs", [x]), 0.5)
    xs = _where(c, big, _k(c, n, 0.25), x)
    u = c.op("Add", [xs, one])
    d = c.op("Sub", [u, one])
    inexact = c.op("Greater", [c.op("Abs", [d]), _k(c, n, 0)])
    ratio = c.op("Div", [c.op("Mul", [c.op("Log", [u]), xs]), _where(c, inexact, d, one)])
    direct = c.op("Log", [c.op("Add", [_where(c, big, x, one), one])])
    return _where(c, big, direct, _where(c, inexact, ratio, xs))


def expm1(c, n, x):
    """exp(x) - 1, any float type: Kahan's (u - 1) x / log(u), u = exp(x), where it matters
    (|x| < 0.5); exp(x) - 1 beyond, where it is as exact and reaches -1 and inf (the
    correction's log(0) and inf / inf do not). The small branch runs on x clamped to where it
    is finite."""
    one = _k(c, n, 1)
    small = c.op("Less", [c.op("Abs", [x]), _k(c, n, 0.5)])
    xs = _where(c, small, x, _k(c, n, 0.25))
    u = c.op("Exp", [xs])
    um1 = c.op("Sub", [u, one])
    exact = c.op("Equal", [um1, _k(c, n, 0)])  # exp(x) rounds to 1: expm1(x) = x
    lu = _where(c, exact, one, c.op("Log", [u]))
    kahan = _where(c, exact, xs, c.op("Div", [c.op("Mul", [um1, xs]), lu]))
    return _where(c, small, kahan, c.op("Sub", [c.op("Exp", [x]), one]))


# -- inverse trigonometric -----------------------------------------------------------------------
def atan_unit(c, n, t):
    """atan(t) for |t| <= 1. onnxruntime's CPU Atan takes float32 and float16 only: bfloat16 is
    computed in float32; float64 takes float32's atan a and one Newton step on
    sin(a) - t cos(a) = 0 in float64 (the error squared: ~1e-16 relative, the gradient too)."""
    t_type = c.onnx_type(n)
    if t_type in (TensorProto.FLOAT, TensorProto.FLOAT16):
        return c.op("Atan", [t])
    a = c.op("Cast", [c.op("Atan", [c.op("Cast", [t], to=TensorProto.FLOAT)])], to=t_type)
    if t_type != DOUBLE:
        return a
    sin, cos = c.op("Sin", [a]), c.op("Cos", [a])
    step = c.op("Div", [c.op("Sub", [sin, c.op("Mul", [t, cos])]),
                        c.op("Add", [cos, c.op("Mul", [t, sin])])])
    return c.op("Sub", [a, step])


def atan(c, n, x):
    """atan(x) = atan_unit(x) for |x| <= 1, else +-pi/2 - atan_unit(1 / x) (NaN where x is)."""
    one = _k(c, n, 1)
    steep = c.op("Greater", [c.op("Abs", [x]), one])
    near = atan_unit(c, n, _where(c, steep, _k(c, n, 0), x))
    half_pi = _where(c, c.op("Less", [x, _k(c, n, 0)]), _k(c, n, -np.pi / 2),
                     _k(c, n, np.pi / 2))
    far = c.op("Sub", [half_pi, atan_unit(c, n, c.op("Div", [one, _where(c, steep, x, one)]))])
    return _where(c, steep, far, near)


def atan2(c, n, y, x):
    """atan2(y, x) as C's atan2: atan of the smaller of |y|, |x| over the larger (an argument in
    [-1, 1], so no division by zero away from the origin), moved to its quadrant: where |x| >=
    |y|, atan(y / x), plus pi with y's sign (a signed zero's included) for an x with its sign bit
    set; elsewhere pi / 2 with y's sign, minus atan(x / y). Each branch runs on inputs made safe
    where it is not taken (double where), so the gradient (x, -y) / (x^2 + y^2) is finite
    wherever TF's is; at the origin the ratio 0 / 0 is replaced by y (+-0: the value is +-0 or
    +-pi, C's) and the gradient stays NaN, as TF's. Both infinite: +-pi/4, +-3pi/4."""
    zero, one = _k(c, n, 0), _k(c, n, 1)
    ax, ay = c.op("Abs", [x]), c.op("Abs", [y])
    flat = c.op("GreaterOrEqual", [ax, ay])  # |y / x| <= 1 (and the origin)
    steep_c = c.op("Less", [ax, ay])  # not flat, NaN aside (see the module docstring on -0)
    # the sign bit: -0's too (1 / -0 = -inf), and -inf's (1 / -inf = -0)
    neg_x, neg_y = (c.op("Or", [c.op("Less", [v, zero]),
                                c.op("Less", [c.op("Div", [one, v]), zero])]) for v in (x, y))
    pi_y = _where(c, neg_y, _k(c, n, -np.pi), _k(c, n, np.pi))
    yn = _where(c, steep_c, zero, y)
    ratio = c.op("Div", [yn, _where(c, steep_c, one, x)])
    # the origin: y (a signed zero, as the third input of a Where) for 0 / 0, whose gradient
    # stays NaN (TF's): the 0 / 0 is in the gradient of the branch not taken
    origin = c.op("And", [c.op("Equal", [x, zero]), c.op("Equal", [y, zero])])
    off = c.op("Or", [c.op("Greater", [ax, zero]), c.op("Greater", [ay, zero])])
    near = atan_unit(c, n, c.op("Mul", [_where(c, origin, one, ratio), _where(c, off, one, y)]))
    near = _where(c, neg_x, c.op("Add", [near, pi_y]), near)
    steep = atan_unit(c, n, c.op("Div", [_where(c, flat, zero, x), _where(c, flat, one, y)]))
    steep = c.op("Sub", [c.op("Mul", [pi_y, _k(c, n, 0.5)]), steep])
    out = _where(c, steep_c, steep, near)
    both_inf = c.op("And", [c.op("IsInf", [x]), c.op("IsInf", [y])])
    corner = _where(c, neg_x, _k(c, n, 0.75), _k(c, n, 0.25))
    return _where(c, both_inf, c.op("Mul", [corner, pi_y]), out)


def _cos_of_asin(c, n, x):
    """sqrt(1 - x^2) as sqrt(1 - x) sqrt(1 + x): exact factors (no 1 - x^2 cancellation), NaN
    for |x| > 1, and a gradient that is infinite, not NaN, at +-1."""
    one = _k(c, n, 1)
    return c.op("Mul", [c.op("Sqrt", [c.op("Sub", [one, x])]),
                        c.op("Sqrt", [c.op("Add", [one, x])])])


def asin(c, n, x):
    return atan2(c, n, x, _cos_of_asin(c, n, x))


def acos(c, n, x):
    return atan2(c, n, _cos_of_asin(c, n, x), x)


# -- trigonometric -------------------------------------------------------------------------------
def tan(c, n, x):
    """tan(x) from x = k pi/2 + r, |r| <= pi/4 (see the module docstring): sin(r) / cos(r) for
    an even k, -cos(r) / sin(r) for an odd one (never 0 / 0: r is 0 only for k = 0, where r is
    x itself, -0 included)."""
    zero = _k(c, n, 0)
    outside = c.op("Greater", [c.op("Abs", [x]), _k(c, n, TAN_REDUCED)])
    xr = _where(c, outside, zero, x)
    k = c.op("Round", [c.op("Mul", [xr, _k(c, n, 2 / np.pi)])])
    r = xr
    for p in HALF_PI:
        r = c.op("Sub", [r, c.op("Mul", [k, _k(c, n, p)])])
    r = _where(c, c.op("Greater", [c.op("Abs", [k]), zero]), r, xr)
    odd = c.op("Equal", [c.op("Abs", [c.op("Mod", [k, _k(c, n, 2)], fmod=1)]), _k(c, n, 1)])
    sin, cos = c.op("Sin", [r]), c.op("Cos", [r])
    reduced = c.op("Div", [_where(c, odd, c.op("Neg", [cos]), sin), _where(c, odd, sin, cos)])
    xb = _where(c, outside, x, zero)
    return _where(c, outside, c.op("Div", [c.op("Sin", [xb]), c.op("Cos", [xb])]), reduced)


# -- hyperbolic ----------------------------------------------------------------------------------
SINH_SERIES = [1 / math.factorial(2 * i + 3) for i in range(8)]  # x^3/3! ... x^17/17!, |x| < 0.5
COSH_SERIES = [1 / math.factorial(2 * i + 2) for i in range(8)]  # x^2/2! ... x^16/16!


def _hyperbolic(c, n, x, sign):
    """sinh (sign -1) or cosh (sign 1) of x: (taylor, exp, huge) branches, see the module
    docstring."""
    a = c.op("Abs", [x])
    beyond = _at_least(c, n, a, 0.5)  # (NaN: the series, which gives NaN)
    large = c.op("Greater", [a, _k(c, n, 20)])
    xs = _where(c, beyond, _k(c, n, 0), x)
    z = c.op("Mul", [xs, xs])
    if sign < 0:
        taylor = c.op("Add", [xs, c.op("Mul", [c.op("Mul", [xs, z]),
                                               _poly(c, n, z, SINH_SERIES)])])
    else:
        taylor = c.op("Add", [_k(c, n, 1), c.op("Mul", [z, _poly(c, n, z, COSH_SERIES)])])
    e = c.op("Exp", [_where(c, c.op("And", [beyond, c.op("Not", [large])]), x, _k(c, n, 1))])
    mid = c.op("Mul", [c.op("Add" if sign > 0 else "Sub", [e, c.op("Reciprocal", [e])]),
                       _k(c, n, 0.5)])
    # e^a / 2 = exp(a - L) * exp(L - log(2)), L = log(2) to 43 bits: a - L is exact for a >= 16
    # (L is a multiple of a's ulp), and neither the value nor its gradient overflows before
    # sinh and cosh do (exp(a / 2) squared would, in the gradient, above 709.78)
    big = c.op("Exp", [c.op("Sub", [_where(c, large, a, _k(c, n, 21)), _k(c, n, LN2_HI)])])
    huge = c.op("Mul", [c.op("Mul", [big, _k(c, n, 0.5)]), _k(c, n, TWO_EXP_LN2_LO)])
    if sign < 0:
        huge = _odd(c, n, x, huge)
    return _where(c, beyond, _where(c, large, huge, mid), taylor)


def sinh(c, n, x):
    return _hyperbolic(c, n, x, -1)


def cosh(c, n, x):
    return _hyperbolic(c, n, x, 1)


def asinh(c, n, x):
    a = c.op("Abs", [x])
    some = _at_least(c, n, a, TINY)  # (NaN: x itself)
    large = c.op("Greater", [a, _k(c, n, HUGE)])
    one = _k(c, n, 1)
    am = _where(c, c.op("And", [some, c.op("Not", [large])]), a, one)
    z = c.op("Mul", [am, am])
    mid = log1p(c, n, c.op("Add", [am, c.op("Div", [z, c.op("Add", [one, c.op("Sqrt", [
        c.op("Add", [one, z])])])])]))
    big = c.op("Add", [c.op("Log", [_where(c, large, a, _k(c, n, 2 * HUGE))]), _k(c, n, LN2)])
    return _where(c, some, _odd(c, n, x, _where(c, large, big, mid)), x)


def acosh(c, n, x):
    """NaN below 1 (sqrt(t) of t < 0), inf at inf."""
    large = c.op("Greater", [x, _k(c, n, HUGE)])
    t = c.op("Sub", [_where(c, large, _k(c, n, 2), x), _k(c, n, 1)])
    root = c.op("Mul", [c.op("Sqrt", [t]), c.op("Sqrt", [c.op("Add", [t, _k(c, n, 2)])])])
    mid = log1p(c, n, c.op("Add", [t, root]))
    big = c.op("Add", [c.op("Log", [_where(c, large, x, _k(c, n, 2 * HUGE))]), _k(c, n, LN2)])
    return _where(c, large, big, mid)


def atanh(c, n, x):
    """+-inf at +-1, NaN beyond."""
    a = c.op("Abs", [x])
    some = _at_least(c, n, a, TINY)  # (NaN: x itself)
    at = _where(c, some, a, _k(c, n, 0.5))
    v = c.op("Mul", [c.op("Sub", [log1p(c, n, at), log1p(c, n, c.op("Neg", [at]))]),
                     _k(c, n, 0.5)])
    return _where(c, some, _odd(c, n, x, v), x)


# -- error function ------------------------------------------------------------------------------
def _erf_pieces(c, n, x, top):
    """(a = |x|, a >= 0.84375, a >= 1.25, a >= top, x R(x^2) on |x| < 0.84375 (and x there),
    erf(a) - ERX on [0.84375, 1.25), erfc(a) on [1.25, top)), each on safe inputs. NaN is in no
    range but the first."""
    a = c.op("Abs", [x])
    b1, b2, b3 = (c.op("GreaterOrEqual", [a, _k(c, n, v)]) for v in (0.84375, 1.25, top))
    x1 = _where(c, b1, _k(c, n, 0), x)  # (x last: its -0 stays)
    z = c.op("Mul", [x1, x1])
    r1 = c.op("Mul", [x1, _ratio(c, n, z, PP, QQ)])
    s = c.op("Sub", [_where(c, c.op("And", [b1, c.op("Not", [b2])]), a, _k(c, n, 1)),
                     _k(c, n, 1)])
    pq = _ratio(c, n, s, PA, QA)
    a3 = _where(c, c.op("And", [b2, c.op("Not", [b3])]), a, _k(c, n, 2))
    sq = c.op("Mul", [a3, a3])
    w = c.op("Reciprocal", [sq])
    r = _where(c, c.op("Less", [a3, _k(c, n, 1 / 0.35)]), _ratio(c, n, w, RA, SA),
               _ratio(c, n, w, RB, SB))
    # exp(-a^2) as exp(-h^2) exp((h - a)(h + a)), h = a to 21 bits (Veltkamp's split): h^2 and
    # h^2 + 0.5625 are exact, which a^2 is not (its rounding, times a^2, would be the error)
    v = c.op("Mul", [a3, _k(c, n, 2.0 ** 32 + 1)])
    h = c.op("Sub", [v, c.op("Sub", [v, a3])])
    head = c.op("Exp", [c.op("Sub", [c.op("Neg", [c.op("Mul", [h, h])]), _k(c, n, 0.5625)])])
    fix = c.op("Exp", [c.op("Add", [c.op("Mul", [c.op("Sub", [h, a3]), c.op("Add", [h, a3])]),
                                    r])])
    tail = c.op("Div", [c.op("Mul", [head, fix]), a3])
    return b1, b2, b3, x1, r1, pq, tail


def erf(c, n, x, pieces=None):
    """1 - erfc(|x|) from 1.25 (1 from 6, but its gradient is not 0 until 28). ``pieces``:
    :func:`_erf_pieces` of x, already made (erf and erfc of one x share them)."""
    b1, b2, b3, x1, r1, pq, tail = pieces or _erf_pieces(c, n, x, 28.0)
    one = _k(c, n, 1)
    y = _where(c, b2, _where(c, b3, one, c.op("Sub", [one, tail])),
               c.op("Add", [_k(c, n, ERX), pq]))
    return _where(c, b1, _odd(c, n, x, y), c.op("Add", [x1, r1]))


def erfc(c, n, x, pieces=None):
    b1, b2, b3, x1, r1, pq, tail = pieces or _erf_pieces(c, n, x, 28.0)
    one, two, half = _k(c, n, 1), _k(c, n, 2), _k(c, n, 0.5)
    neg = c.op("Less", [x, _k(c, n, 0)])
    y1 = _where(c, c.op("Less", [x1, _k(c, n, 0.25)]), c.op("Sub", [one, c.op("Add", [x1, r1])]),
                c.op("Sub", [half, c.op("Add", [c.op("Sub", [x1, half]), r1])]))
    y2 = _where(c, neg, c.op("Add", [one, c.op("Add", [_k(c, n, ERX), pq])]),
                c.op("Sub", [_k(c, n, 1 - ERX), pq]))
    y3 = _where(c, neg, c.op("Sub", [two, tail]), tail)
    y4 = _where(c, neg, two, _k(c, n, 0))
    return _where(c, b1, _where(c, b2, _where(c, b3, y4, y3), y2), y1)


def erf_and_erfc(c, n, x):
    """(erf(x), erfc(x)) from one set of pieces."""
    pieces = _erf_pieces(c, n, x, 28.0)
    return erf(c, n, x, pieces), erfc(c, n, x, pieces)


FLOAT64 = {"Tan": tan, "Asin": asin, "Acos": acos, "Atan": atan, "Sinh": sinh, "Cosh": cosh,
           "Asinh": asinh, "Acosh": acosh, "Atanh": atanh, "Erf": erf, "Erfc": erfc}
