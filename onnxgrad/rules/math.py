"""Gradient rules: elementwise arithmetic and transcendental functions.

Each entry is ``op: lambda n, g: <gradient of each input>``; ``n.x`` is input 0, ``n.y`` output 0,
``n.ins[i]`` input i, and ``S(t, x)`` sums a broadcast gradient ``t`` back to x's shape.
"""
import math

import numpy as np

from ..registry import register, table
from .spec import no_gradient


def S(n, t, i):
    """Gradient ``t`` of the output, summed back to input i's shape (None if i is absent)."""
    x = n.input(i)
    return None if x is None or t is None else n.sum_to(t, x)


def _mask(n, cond, g):
    """g where cond holds, 0 elsewhere."""
    return n.e.Where(cond, g, n.e.const(0, g.dtype))


def _zeros(n, g):
    return n.e.zeros_like(n.x)


table({
    "Identity": lambda n, g: g,
    "Neg": lambda n, g: -g,
    "Add": lambda n, g: (S(n, g, 0), S(n, g, 1)),
    "Sub": lambda n, g: (S(n, g, 0), S(n, -g, 1)),
    "Mul": lambda n, g: (S(n, g * n.ins[1], 0), S(n, g * n.ins[0], 1)),
    "Div": lambda n, g: (S(n, g / n.ins[1], 0), S(n, -g * n.y / n.ins[1], 1)),
    "Abs": lambda n, g: g * n.e.Sign(n.x),
    "Reciprocal": lambda n, g: -g * n.y * n.y,
    "Sqrt": lambda n, g: g * 0.5 / n.y,
    "Exp": lambda n, g: g * n.y,
    "Log": lambda n, g: g / n.x,
    "Erf": lambda n, g: g * (2 / math.sqrt(math.pi)) * n.e.Exp(-(n.x * n.x)),
    "Sin": lambda n, g: g * n.e.Cos(n.x),
    "Cos": lambda n, g: -g * n.e.Sin(n.x),
    "Tan": lambda n, g: g * (1 + n.y * n.y),
    "Asin": lambda n, g: g / n.e.Sqrt(1 - n.x * n.x),
    "Acos": lambda n, g: -g / n.e.Sqrt(1 - n.x * n.x),
    "Atan": lambda n, g: g / (1 + n.x * n.x),
    "Sinh": lambda n, g: g * n.e.Cosh(n.x),
    "Cosh": lambda n, g: g * n.e.Sinh(n.x),
    "Asinh": lambda n, g: g / n.e.Sqrt(n.x * n.x + 1),
    "Acosh": lambda n, g: g / n.e.Sqrt(n.x * n.x - 1),
    "Atanh": lambda n, g: g / (1 - n.x * n.x),
    "Sum": lambda n, g: tuple(S(n, g, i) for i in range(len(n.ins))),
    "Mean": lambda n, g: tuple(S(n, g / len(n.ins), i) for i in range(len(n.ins))),
    "Where": lambda n, g: (None, S(n, _mask(n, n.x, g), 1), S(n, _mask(n, n.e.Not(n.x), g), 2)),
    # rounding is piecewise constant: its gradient is zero (not "unconnected")
    "Floor": _zeros, "Ceil": _zeros, "Round": _zeros, "Sign": _zeros,
})
# a 0/1 draw from the probabilities x: piecewise constant in x, so zero (not unconnected)
register("Bernoulli", _zeros, since=15)
# only x's shape and dtype are read, as Shape reads them: no gradient flows (TF's
# random_normal(shape(x)) has none either); torch.onnx writes RandomNormalLike for randn_like
_SHAPE_ONLY = ["RandomNormalLike", "RandomUniformLike", "EyeLike"]
register(_SHAPE_ONLY, lambda n, g: None)
for _op in _SHAPE_ONLY:
    no_gradient(_op, input="only its shape and dtype are read")


@register("Pow")
def _pow(n, g):
    a, b = n.ins
    bf = b if b.dtype == a.dtype else n.e.Cast(b, to=a.dtype)
    da = g * bf * n.e.Pow(a, bf - 1)
    known = n.const(1)
    if known is None or not np.all(known != 0):  # a^0 is 1: 0, not 0 * 0^-1 = NaN, at a = 0
        da = _mask(n, n.e.Not(n.e.Equal(bf, n.e.const(0, a.dtype))), da)
    # d/db a^b = a^b log a; defined as 0 where a <= 0 (as TF does) instead of NaN
    db = _mask(n, n.e.Greater(a, n.e.const(0, a.dtype)), g * n.y * n.e.Log(a))
    if b.dtype != a.dtype:  # a float exponent of another float type gets a gradient of its type
        db = n.e.Cast(db, to=b.dtype)
    return S(n, da, 0), S(n, db, 1)


@register(["Cast", "CastLike"])
def _cast(n, g):
    return n.e.Cast(g, to=n.x.dtype)


no_gradient("CastLike", target_type="only its type is read")


@register(["Min", "Max"])
def _min_max(n, g):
    # the gradient goes to the inputs equal to the result, split evenly among ties (as PyTorch)
    hits = [n.e.Cast(n.e.Equal(x, n.y), to=g.dtype) for x in n.ins]
    if len(hits) == 1:
        return g
    share = g / n.e.Sum(*hits)
    return tuple(S(n, share * h, i) for i, h in enumerate(hits))


@register("Clip")
def _clip(n, g):
    """y = min(max(x, lo), hi): with t = max(x, lo), y is hi where t > hi, else t; t is lo
    where x < lo, else x. So min > max gives all of the gradient to max (as torch.clamp)."""
    x, lo, hi = n.x, n.input(1), n.input(2)
    e, zero = n.e, n.e.const(0, g.dtype)
    d_hi = None
    if hi is not None:
        over = e.Greater(x if lo is None else e.Max(x, lo), hi)
        d_hi = e.ReduceSum(e.Where(over, g, zero), keepdims=0)
        g = e.Where(over, zero, g)
    d_lo = None
    if lo is not None:
        under = e.Less(x, lo)
        d_lo = e.ReduceSum(e.Where(under, g, zero), keepdims=0)
        g = e.Where(under, zero, g)
    return g, d_lo, d_hi


@register("Mod")
def _mod(n, g):
    # y = a - k b with k = trunc(a / b) (fmod=1) or floor(a / b) (fmod=0, floats from opset 28):
    # da = g, db = -g k; k read back from the forward's y (rounded: it is a whole number)
    a, b = n.ins
    k = n.e.Round((a - n.y) / b)
    return S(n, g, 0), S(n, -g * k, 1)
