"""Gradient rules: reductions.

Every rule brings the output gradient back to the input's rank with one helper (:class:`_Reduce`):
``Unsqueeze`` with the reduced axes when keepdims=0 (the axes may be a run-time tensor), then a
broadcast against x. Both forms of the forward node are handled: axes as an attribute (opset < 18,
ReduceSum < 13) or as an input (constant or computed at run time), absent axes (reduce all),
``noop_with_empty_axes`` and negative axes (Unsqueeze reads them against x's rank, as Reduce does).

``noop_with_empty_axes=1`` with empty axes skips the reduction but not the elementwise part
(onnxruntime and onnx.reference: ReduceL1 gives |x|, ReduceSumSquare x^2, ReduceLogSum log x, as
the ops' function bodies say); every formula below stays right in that case, so run-time axes
that turn out empty need no special branch.
"""
from __future__ import annotations

import numpy as np

from ..registry import register
from .spec import attr


class _Reduce:
    """How a forward ReduceXxx node reduced, and the helpers its gradient needs.

    ``axes`` is a list of ints (static), a V (run-time tensor) or None (all axes);
    ``identity`` is True when the node statically reduces nothing.
    """

    def __init__(self, n):
        self.n, self.e = n, n.e
        self.keepdims = int(attr(n, "keepdims"))
        self.noop = int(attr(n, "noop_with_empty_axes", 0))  # absent before opset 18
        attr_axes = n.attr("axes")
        if attr_axes is not None:
            axes = [int(a) for a in attr_axes]
        elif n.input(1) is None:
            axes = None
        else:
            c = n.const(1)
            axes = n.input(1) if c is None else [int(a) for a in np.asarray(c).reshape(-1)]
        if isinstance(axes, list) and not axes:
            axes = None  # empty axes: all of them, or nothing when noop_with_empty_axes
        self.identity = axes is None and self.noop == 1
        self.axes = axes

    # -- shapes ----------------------------------------------------------------------------
    def to_rank(self, t):
        """A y-shaped tensor t brought to x's rank (size 1 on the reduced axes); it broadcasts
        against x."""
        if self.keepdims or self.identity or self.axes is None:
            return t  # same rank already, or a scalar (everything reduced)
        return self.e.Unsqueeze(t, self.axes)

    def expand(self, t):
        """A y-shaped tensor t broadcast to x's shape."""
        if self.identity:
            return t
        return self.e.broadcast_to(self.to_rank(t), self.n.x)

    def same(self, op_type: str, t, keepdims=None):
        """``op_type`` over the forward's axes (written in the form the opset wants)."""
        kd = self.keepdims if keepdims is None else keepdims
        if self.axes is None:
            return self.e.op(op_type, t, keepdims=kd)
        if isinstance(self.axes, list):
            return self.e.reduce(op_type, t, self.axes, keepdims=kd)
        return self.e.op(op_type, t, self.axes, keepdims=kd, noop_with_empty_axes=self.noop)

    def count(self):
        """How many elements each output reduces: a python number when static, else an int64
        tensor."""
        x, y = self.n.x, self.n.y
        xs = x.shape
        if xs is not None:
            axes = range(len(xs)) if self.axes is None else (
                self.axes if isinstance(self.axes, list) else None)
            if axes is not None:
                sizes = [xs[a] for a in axes]
                if all(isinstance(d, int) for d in sizes):
                    return int(np.prod(sizes, dtype=np.int64))
        e = self.e
        if y.shape is not None and all(d == 1 for d in y.shape):  # one output: all of x
            return e.Size(x)
        one = e.const(np.array(1, np.int64))
        return e.Div(e.Size(x), e.Max(e.Size(y), one))


@register("ReduceSum")
def _reduce_sum(n, g):
    r = _Reduce(n)
    return r.expand(g)


@register("ReduceMean")
def _reduce_mean(n, g):
    r = _Reduce(n)
    if r.identity:
        return g
    return r.expand(r.e.over_count(g, r.count()))


@register(["ReduceMax", "ReduceMin"])
def _reduce_max_min(n, g):
    # the gradient goes to the positions equal to the result, split evenly among ties (as
    # PyTorch's amax/amin do)
    r = _Reduce(n)
    if r.identity:
        return g
    e, x = n.e, n.x
    hit = e.Cast(e.Equal(x, r.to_rank(n.y)), to=x.dtype)
    share = g / r.same("ReduceSum", hit)
    return hit * r.to_rank(share)


@register("ReduceProd")
def _reduce_prod(n, g):
    # d prod / d x_i = prod of the others: y / x_i where x_i != 0; where x_i == 0 it is the
    # product of the non-zero entries if x_i is the slice's only zero, else 0
    r = _Reduce(n)
    if r.identity:
        return g
    e, x, y = n.e, n.x, n.y
    zero = e.Equal(x, e.const(0, x.dtype))
    safe = e.Where(zero, e.const(1, x.dtype), x)
    zeros = r.same("ReduceSum", e.Cast(zero, to=x.dtype))
    others = r.same("ReduceProd", safe)
    lone = e.Where(e.Equal(zeros, e.const(1, x.dtype)), others, e.const(0, x.dtype))
    return e.Where(zero, r.to_rank(g * lone), r.to_rank(g * y) / safe)


@register("ReduceL1")
def _reduce_l1(n, g):
    r = _Reduce(n)
    return r.to_rank(g) * n.e.Sign(n.x)


@register("ReduceL2")
def _reduce_l2(n, g):
    # x / ||x||, taken as 0 where the norm is 0 (as PyTorch's norm); divided by a safe norm so
    # that the second order does not meet 0 * inf in the branch Where leaves out
    r = _Reduce(n)
    e, y = n.e, n.y
    zero = e.Equal(y, e.const(0, y.dtype))
    share = e.Where(zero, e.const(0, y.dtype), g / e.Where(zero, e.const(1, y.dtype), y))
    return n.x * r.to_rank(share)


@register("ReduceSumSquare")
def _reduce_sum_square(n, g):
    r = _Reduce(n)
    return n.x * r.to_rank(g * 2)


@register("ReduceLogSum")
def _reduce_log_sum(n, g):
    # y = log(sum x): the sum is exp(y)
    r = _Reduce(n)
    if r.identity:
        return g / n.x
    return r.expand(g / n.e.Exp(n.y))


@register("ReduceLogSumExp")
def _reduce_log_sum_exp(n, g):
    # softmax of x over the axes, from the forward's y
    r = _Reduce(n)
    if r.identity:
        return g
    return r.to_rank(g) * n.e.Exp(n.x - r.to_rank(n.y))
