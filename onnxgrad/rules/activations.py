"""Gradient rules: activations, Softmax and LogSoftmax (these reuse the forward output).

Attribute defaults come from the ONNX schema (``spec.attr``): the float32 constants the forward
uses, not more exact ones."""
import math

from ..errors import NotDifferentiableError
from ..registry import register, table
from .spec import attr


def _where(n, cond, a, b):
    return n.e.Where(cond, a, b)


def _pos(n):
    return n.e.Greater(n.x, n.e.const(0, n.x.dtype))


def _relu(n, g):
    """TF's ReluGrad, g * (x > 0) as a 0/1 tensor: onnxruntime runs Cast and Mul on every
    thread and Where on one (a [16, 16, 64, 64] mask: 0.55 against 0.99 ms at 2 threads, 0.70
    against 1.16 at one; measured). As in TF, a non-finite g where x <= 0 gives NaN, not 0."""
    return g * n.e.Cast(_pos(n), to=g.dtype)


def _leaky_relu(n, g):
    """g where x > 0, g * alpha elsewhere. For 0 <= alpha <= 1 as g * Max(Cast(x > 0), alpha),
    the same numbers (inf and NaN too) without a Where, which onnxruntime runs on one thread
    ([32, 64, 64, 64]: 25.4 -> 15.9 ms at 1 thread, 18.5 -> 8.1 at 2; measured)."""
    alpha = attr(n, "alpha")
    if not 0 <= alpha <= 1:
        return _where(n, _pos(n), g, g * alpha)
    return g * n.e.Max(n.e.Cast(_pos(n), to=g.dtype), n.e.const(alpha, g.dtype))


def _gelu(n, g):
    e, x = n.e, n.x
    if attr(n, "approximate") == "tanh":
        k = math.sqrt(2 / math.pi)
        t = e.Tanh(k * (x + 0.044715 * x * x * x))
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x))
    cdf = 0.5 * (1 + e.Erf(x * (1 / math.sqrt(2))))
    return g * (cdf + x * e.Exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi)))


def _hard_swish(n, g):
    """d/dx x * hardsigmoid(x) = hardsigmoid(x) + x / 6 inside (-3, 3): 0 up to -3, x / 3 + 1/2
    between, 1 from 3 (torch's hardswish_backward, and TF's through Relu6Grad, at the kinks
    too), with x / 6 clipped so that an infinite x times the 0 of the mask stays 0. Arithmetic,
    not nested Wheres, which onnxruntime runs on one thread (a [32, 16, 32, 32] gradient: 1.59
    -> 1.16 ms at 1 thread, 1.21 -> 0.53 at 2; measured)."""
    e, x = n.e, n.x
    inside = e.Cast(e.Less(e.Abs(x), e.const(3, x.dtype)), to=x.dtype)
    part = e.Clip(x * (1 / 6), e.const(-0.5, x.dtype), e.const(0.5, x.dtype))
    return g * (e.HardSigmoid(x, alpha=1 / 6, beta=0.5) + part * inside)


def _sigmoid_by_softplus(n, x, sp):
    """sigmoid(x) given sp = softplus(x): exp(x - sp) below 0, where onnxruntime's Sigmoid is
    exact to ~1e-7 absolute only (2e-4 relative at -8; 0 from -20 in float32, -100 in
    float64), and Sigmoid itself above (x - sp cancels there; sp overflows at +inf)."""
    e = n.e
    return _where(n, e.Less(x, e.const(0, x.dtype)), e.Exp(x - sp), e.Sigmoid(x))


def _mish(n, g):
    sp = n.e.Softplus(n.x)
    t = n.e.Tanh(sp)
    return g * (t + n.x * _sigmoid_by_softplus(n, n.x, sp) * (1 - t * t))


def _swish(n, g):
    a = attr(n, "alpha")
    s = n.e.Sigmoid(n.x * a)
    return g * (s + a * n.x * s * (1 - s))


def _hard_sigmoid(n, g):
    e, y = n.e, n.y
    inside = e.And(e.Greater(y, e.const(0, y.dtype)), e.Less(y, e.const(1, y.dtype)))
    return _where(n, inside, g * attr(n, "alpha"), e.const(0, g.dtype))


def _shrink(n, g):
    e, x, lambd = n.e, n.x, attr(n, "lambd")
    out = e.Or(e.Less(x, e.const(-lambd, x.dtype)), e.Greater(x, e.const(lambd, x.dtype)))
    return _where(n, out, g, e.const(0, g.dtype))


def _prelu(n, g):
    x, slope = n.x, n.ins[1]
    xs, ss = x.shape, slope.shape
    if xs is not None and ss is not None and (len(ss) > len(xs) or any(
            isinstance(a, int) and isinstance(b, int) and a not in (1, b)
            for a, b in zip(reversed(list(ss)), reversed(list(xs))))):
        # onnxruntime broadcasts both ways, making y larger than X: out of the schema, and
        # onnx's inference (y is X's shape) then types the gradient wrongly
        raise NotDifferentiableError(
            n.node.op_type, n.node.domain, n.opset, n.node.name, [],
            reason=f"its slope {list(ss)} does not broadcast to X {list(xs)}, as the schema "
                   "requires")
    return (_where(n, _pos(n), g, g * slope),
            n.sum_to(_where(n, _pos(n), n.e.const(0, g.dtype), g * x), slope))


table({
    "Relu": _relu,
    "LeakyRelu": _leaky_relu,
    "PRelu": _prelu,
    "Elu": lambda n, g: _where(n, _pos(n), g, g * (n.y + attr(n, "alpha"))),
    "Selu": lambda n, g: _where(n, _pos(n), g * attr(n, "gamma"),
                                g * (n.y + attr(n, "gamma") * attr(n, "alpha"))),
    "Celu": lambda n, g: _where(n, _pos(n), g, g * (n.y / attr(n, "alpha") + 1)),
    "ThresholdedRelu": lambda n, g: _where(
        n, n.e.Greater(n.x, n.e.const(attr(n, "alpha"), n.x.dtype)), g, n.e.const(0, g.dtype)),
    "Sigmoid": lambda n, g: g * n.y * (1 - n.y),
    "Tanh": lambda n, g: g * (1 - n.y * n.y),
    "Softplus": lambda n, g: g * _sigmoid_by_softplus(n, n.x, n.y),
    "Softsign": lambda n, g: g / ((1 + n.e.Abs(n.x)) * (1 + n.e.Abs(n.x))),
    "HardSigmoid": _hard_sigmoid,
    "HardSwish": _hard_swish,
    "Mish": _mish,
    "Gelu": _gelu,
    "Shrink": _shrink,
    "Swish": _swish,
})


@register("Softmax", since=13)
def _softmax(n, g):
    axis = attr(n, "axis")
    return n.y * (g - n.e.reduce("ReduceSum", g * n.y, [axis], keepdims=1))


@register("LogSoftmax", since=13)
def _log_softmax(n, g):
    axis = attr(n, "axis")
    return g - n.e.Exp(n.y) * n.e.reduce("ReduceSum", g, [axis], keepdims=1)
