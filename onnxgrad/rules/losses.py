"""Gradient rules: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.

Both read scores/log-probabilities [N, C, d1, ...], integer labels [N, d1, ...] and optional class
weights [C]. With w_i = weights[label_i] (1 without weights) and w_i = 0 where label_i ==
ignore_index, the loss is l_i = -w_i * logp[i, label_i], reduced by "none", "sum", or "mean"
(sum(l) / sum(w), which is the count of non-ignored entries without weights) as onnxruntime and
onnx.reference compute it. The gradient of the scores is coef_i * (softmax_i - onehot_i) (for NLL:
-coef_i * onehot_i), coef being the loss gradient spread over the entries; SoftmaxCrossEntropyLoss
reuses its log_prob output when the node has one, and that output may carry a gradient too.
Labels get none; the weights get their (rarely wanted) gradient too.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..registry import register
from .shape import HALF
from .spec import attr


class _Loss:
    def __init__(self, n):
        self.n, self.e = n, n.e
        self.x, self.labels, self.w = n.ins[0], n.ins[1], n.input(2)
        self.dtype = self.x.dtype
        red = attr(n, "reduction")
        self.reduction = red.decode() if isinstance(red, bytes) else red
        if self.reduction not in ("none", "sum", "mean"):
            raise ValueError(f"{n.node.op_type} {n.node.name!r}: reduction={self.reduction!r}")
        self.ignore = n.attr("ignore_index")
        e, lab = self.e, self.labels
        ldt = lab.dtype.numpy()
        self.valid = None
        if self.ignore is not None:
            self.valid = e.Not(e.Equal(lab, e.const(np.array(self.ignore, ldt))))
        # per-entry weights w_i ([N, d...]) or None (all ones)
        self.wi = None
        if self.w is not None:
            safe = lab if self.valid is None else e.Where(self.valid, lab,
                                                           e.const(np.array(0, ldt)))
            self.wi = e.Gather(self.w, safe, axis=0)
            if self.valid is not None:
                self.wi = e.Where(self.valid, self.wi, e.const(0, self.dtype))
        elif self.valid is not None:
            self.wi = e.Cast(self.valid, to=self.dtype)

    def onehot(self):
        """labels == c along axis 1: bool [N, C, d1, ...]."""
        e, lab, x = self.e, self.labels, self.x
        ldt = lab.dtype.numpy()
        xs, rank = x.shape, x.rank
        classes = xs[1] if xs is not None else None
        if isinstance(classes, int) and rank is not None:
            cls = e.const(np.arange(classes, dtype=ldt).reshape([classes] + [1] * (rank - 2)))
        else:
            c = e.Gather(e.Shape(x), e.const(np.array(1, np.int64)))
            if ldt != np.int64:
                c = e.Cast(c, to=lab.dtype)
            cls = e.Range(e.const(np.array(0, ldt)), c, e.const(np.array(1, ldt)))
            if rank is not None:
                shape = [-1] + [1] * (rank - 2)
            else:  # [-1, 1, ..., 1] with rank(labels) entries
                ones = e.op("ConstantOfShape", e.Sub(e.Shape(e.Shape(lab)), [1]),
                            value=ir.tensor(np.array([1], np.int64)))
                shape = e.Concat(e.const(np.array([-1], np.int64)), ones, axis=0)
            cls = e.Reshape(cls, shape)
        return e.Equal(e.Unsqueeze(lab, [1]), cls)

    def denominator(self):
        """sum(w_i) for "mean": a python number when static, else a tensor (float32 for
        float16 and bfloat16 scores, whose sum of 65505 ones is inf)."""
        e = self.e
        if self.wi is not None:
            wi = self.wi if self.dtype not in HALF else e.Cast(self.wi, to=ir.DataType.FLOAT)
            return e.ReduceSum(wi, keepdims=0)
        s = self.labels.shape
        if s is not None and all(isinstance(d, int) for d in s):
            return int(np.prod(s, dtype=np.int64))
        return e.Size(self.labels)

    def over_total(self, g):
        """g / sum(w_i). A total of 0 (every entry ignored, or weighted 0) makes the mean 0 / 0,
        NaN, as in torch; its gradient is 0 there (torch: 0 for ignored entries), not 0 * inf:
        a NaN loss masked out downstream leaves every gradient finite."""
        e, d = self.e, self.denominator()
        if not isinstance(d, int) and d.dtype != ir.DataType.INT64:
            d = e.Where(e.Equal(d, e.const(0, d.dtype)), e.const(1, d.dtype), d)
        return e.over_count(g, d)

    def coef(self, g):
        """d loss / d l_i (l_i the unweighted -logp[i, label_i]) times w_i, and whether it is a
        scalar (the same for every entry)."""
        if self.reduction == "mean":
            g = self.over_total(g)
        if self.wi is not None:
            return g * self.wi, False
        return g, self.reduction != "none"

    def spread(self, g):
        """coef as a tensor that broadcasts against [N, C, d1, ...]."""
        c, scalar = self.coef(g)
        return c if scalar else self.e.Unsqueeze(c, [1])

    def weight_grad(self, g, logp, hot):
        """Gradient of the class weights ([C]), or None without weights."""
        if self.w is None or g is None:
            return None
        e, n = self.e, self.n
        zero = e.const(0, self.dtype)
        nll = -e.ReduceSum(e.Where(hot, logp, zero), [1], keepdims=0)  # unweighted l_i
        if self.reduction == "mean":
            c = (nll - n.y) * self.over_total(g)
        else:
            c = nll * g
        if self.valid is not None:
            c = e.Where(self.valid, c, zero)
        per = e.Where(hot, e.Unsqueeze(c, [1]), zero)        # [N, C, d...]
        per = e.ReduceSum(per, [0], keepdims=0)               # [C, d...]
        per = e.Reshape(per, [0, -1])                         # [C, prod(d)]
        return e.op("ReduceSum", per, [1], keepdims=0, _shape=self.w.shape)


@register("SoftmaxCrossEntropyLoss", since=12)
def _softmax_cross_entropy(n, g):
    L = _Loss(n)
    e = n.e
    g_lp = n.gs[1] if len(n.gs) > 1 else None
    lp = n.outs[1] if len(n.outs) > 1 and n.outs[1].name else None
    if lp is None:  # the node does not output log_prob: recompute it
        lp = e.LogSoftmax(n.x, axis=1)
    prob = e.Exp(lp)
    hot = L.onehot()
    dx, dw = None, None
    if g is not None:
        c = L.spread(g)
        zero = e.const(0, L.dtype)
        dx = c * prob - e.Where(hot, c, zero)
        dw = L.weight_grad(g, lp, hot)
    if g_lp is not None:  # the LogSoftmax part
        d = g_lp - prob * e.ReduceSum(g_lp, [1], keepdims=1)
        dx = d if dx is None else dx + d
    return dx, None, dw


@register("NegativeLogLikelihoodLoss", since=12)
def _negative_log_likelihood(n, g):
    L = _Loss(n)
    e = n.e
    hot = L.onehot()
    c = L.spread(g)
    dx = e.Where(hot, -c, e.const(0, L.dtype))
    return dx, None, L.weight_grad(g, n.x, hot)
