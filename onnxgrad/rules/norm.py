"""Gradient rules: normalization layers, Dropout, LRN, and a few index-like ops.

The standardizing layers share one backward: with x̂ = (x - mean_A x) * r, r = (var_A x + eps)^-1/2
over the axes A, and ĝ = dL/dx̂,

    dL/dx = r * (ĝ - mean_A ĝ - x̂ * mean_A(ĝ x̂))

Means are ReduceMean (so symbolic dims need no static count, and float16 counts cannot overflow).
Forward outputs are reused where the node has them (LayerNormalization's Mean and InvStdDev,
unless they are narrower than the computation, and a node without them is given them; Dropout's
mask; the normalized output of LpNormalization, MeanVarianceNormalization and LRN);
the batch statistics that BatchNormalization, InstanceNormalization and GroupNormalization never
output are recomputed, except a training-mode BatchNormalization's from opset 14 on, whose node
the rule replaces by its definition in standard ops (the statistics then come from its forward).
Ops with a ``stash_type`` (LayerNormalization, GroupNormalization-21, RMSNormalization) compute
the gradient in the wider of the input type and the stash type, so float16 inputs are
differentiated in float32 as their forward is, and float64 inputs stay float64.
"""
import math

import numpy as np
import onnx_ir as ir

from ..registry import Grads, register, table
from .shape import HALF
from .spec import attr, no_gradient

_BITS = {ir.DataType.FLOAT16: 16, ir.DataType.BFLOAT16: 16, ir.DataType.FLOAT: 32,
         ir.DataType.DOUBLE: 64}
_INT64_MAX = int(np.iinfo(np.int64).max)


# -- helpers ---------------------------------------------------------------------------------
def _cast(e, v, dtype):
    """v as ``dtype`` (no node when it already is)."""
    if v is None or v.dtype == dtype:
        return v
    return e.Cast(v, to=dtype)


def _out(n, i):
    """Output i of the forward node, or None when it is absent (past the end or unnamed)."""
    if i >= len(n.outs) or n.outs[i] is None or not n.outs[i].name:
        return None
    return n.outs[i]


def _grad(n, i):
    return n.gs[i] if i < len(n.gs) else None


def _rank(n, v) -> int:
    r = v.rank
    if r is None:
        raise NotImplementedError(
            f"the gradient of {n.node.op_type} node {n.node.name!r} needs the rank of its input "
            f"{v.name!r}, which is unknown: declare the input's shape or run shape inference")
    return r


def _compute_dtype(n, x):
    """The wider of x's dtype and the node's stash_type (default float32)."""
    stash = ir.DataType(attr(n, "stash_type"))
    return stash if _BITS.get(stash, 0) > _BITS.get(x.dtype, 0) else x.dtype


def _precise(v, dtype):
    """A forward output v to reuse in a computation in ``dtype``: None (recompute it) when v
    is absent or narrower than dtype, whose precision it would cap."""
    return v if v is not None and _BITS.get(v.dtype, 0) >= _BITS.get(dtype, 0) else None


def _mean(e, t, axes):
    return e.reduce("ReduceMean", t, axes, keepdims=1)


def _standardize(e, x, axes, eps):
    """(mean, r, x̂) over ``axes``, with r = 1 / sqrt(var + eps) (keepdims shapes)."""
    mu = _mean(e, x, axes)
    c = x - mu
    r = e.Reciprocal(e.Sqrt(_mean(e, c * c, axes) + eps))
    return mu, r, c * r


def _std_backward(e, gxh, xh, r, axes):
    """dL/dx from dL/dx̂ for x̂ = (x - mean x) * r, r = (var x + eps)^-1/2 over ``axes``."""
    return r * (gxh - _mean(e, gxh, axes) - xh * _mean(e, gxh * xh, axes))


def _chan(e, p, rank):
    """A per-channel vector (C,) shaped (C, 1, ..., 1) to broadcast against (N, C, D1, ...)."""
    return p if rank <= 2 else e.Unsqueeze(p, list(range(1, rank - 1)))


def _dim1(e, x):
    """x's channel count at run time (an int64 scalar)."""
    return e.Gather(e.Shape(x), e.const(np.array(1, np.int64)))


def _inv_count(e, x, axes):
    """1 / the number of values of x over ``axes``: a number when those dims are static."""
    dims = x.shape
    if dims is not None and all(isinstance(dims[a], int) for a in axes):
        return 1.0 / math.prod(dims[a] for a in axes)
    return e.Reciprocal(e.Cast(e.Div(e.Size(x), _dim1(e, x)), to=x.dtype))


def _sum(e, t, axes):
    return e.reduce("ReduceSum", t, axes, keepdims=0)


_AFFINE = (ir.DataType.FLOAT, ir.DataType.DOUBLE)


def _affine(e, t, a, b):
    """t * a + b for per-channel a, b ([1, C, 1, ...]) and t [N, C, ...]: in float32 and
    float64 one inference-mode BatchNormalization, which onnxruntime runs in one pass where Mul
    and Add take two (a [16, 16, 64, 64] tensor 0.36 against 0.68 ms, measured). Its mean is 0
    and its variance 1 - 2^-16 with epsilon 2^-16: var + epsilon is exactly 1 in float32 and
    float64, so the op computes t * a + b (the same values as Mul and Add on onnxruntime's CPU,
    measured), and epsilon is above cuDNN's minimum (1e-5), which onnxruntime's CUDA kernel
    would otherwise raise it to."""
    if t.dtype not in _AFFINE or e.opset < 9:
        return t * a + b
    a, b = e.Reshape(a, [-1]), e.Reshape(b, [-1])
    return e.BatchNormalization(t, a, b, e.zeros_like(a), e.fill_like(a, 1 - 2.0**-16),
                                epsilon=2.0**-16)


# -- BatchNormalization ----------------------------------------------------------------------
def _batch_stats(e, x, axes, eps):
    """(1 / M, mean, c = x - mean, biased var, r = (var + eps)^-1/2) over ``axes``, M values
    each (keepdims shapes)."""
    inv_m = _inv_count(e, x, axes)
    mu = _mean(e, x, axes)
    c = x - mu
    # Σc² as ReduceSum(c c): onnxruntime's ReduceSumSquare over these axes is not
    # vectorised (1.0 against 0.2 ms for ReduceSum on [16, 16, 64, 64], measured)
    var = e.reduce("ReduceSum", c * c, axes, keepdims=1) * inv_m
    return inv_m, mu, c, var, e.Reciprocal(e.Sqrt(var + eps))


def _training_forward(n, e, axes, rank):
    """A training-mode node (opset 14 on) replaced by its definition in standard ops, whose
    batch statistics the backward then reads instead of recomputing them: y = c * (scale r) + B
    as one inference-mode node (:func:`_affine`), running_mean = mean * momentum + mean_A(x) *
    (1 - momentum) and running_var likewise with the biased variance. onnxruntime runs its
    training BatchNormalization on one thread, and the backward no longer recomputes the mean,
    x - mean and the variance (four passes over x): the gradient model of a [16, 32, 64, 64]
    node 9.2 -> 8.8 ms at one thread, 6.8 -> 6.3 at two; the U-Net row's step 1.00x at one
    thread, 1.03x at two; ResNet-18's 1.01x at two (measured). Returns (c, r, 1 / M)."""
    f = e.scratch()
    x, dt = f.adopt(n.x), n.x.dtype
    scale, bias, mean, var = (f.adopt(v) for v in n.ins[1:5])
    inv_m, mu, c, v, r = _batch_stats(f, x, axes, attr(n, "epsilon"))
    y = _affine(f, c, _chan(f, _cast(f, scale, dt), rank) * r, _chan(f, _cast(f, bias, dt), rank))
    momentum = attr(n, "momentum")

    def moved(old, batch):  # old * momentum + batch * (1 - momentum), in old's type
        return _cast(f, _cast(f, old, dt) * momentum + f.Reshape(batch, [-1]) * (1.0 - momentum),
                     old.dtype)
    new = [y, moved(mean, mu) if _out(n, 1) is not None else None,
           moved(var, v) if _out(n, 2) is not None else None]
    e.replace(n.node, f, new)
    return e.adopt(c), e.adopt(r), inv_m if isinstance(inv_m, float) else e.adopt(inv_m)


@register("BatchNormalization")
def _batch_norm(n, g):
    """Inference: y = (x - mean) / sqrt(var + eps) * scale + B with the mean/var inputs, all five
    inputs differentiable. Training (training_mode=1 from opset 14; before it, a node with its
    optional statistics outputs, as onnxruntime runs it): the batch mean and biased variance over
    all axes but 1 (as PyTorch's batch_norm). The running statistics outputs are functions of
    x too: running_mean = mean * momentum + mean_A(x) * (1 - momentum) and running_var =
    var * momentum + var_A(x) * (1 - momentum) (biased, as onnxruntime and onnx.reference
    compute it), so their gradients reach x, mean and var; BatchNormalization-9's saved
    statistics carry none. In training mode from opset 14 (float32, float64, in the graph being
    differentiated) the node is replaced by that definition (:func:`_training_forward`) and the
    backward reads its batch statistics; otherwise they are recomputed (BatchNormalization-9's
    saved_var is the inverse std on onnxruntime but the variance in onnx.reference, so it
    cannot be reused safely)."""
    g_rm, g_rv = _grad(n, 1), _grad(n, 2)
    if g is None and g_rm is None and g_rv is None:
        return (None,) * 5
    e, x = n.e, n.x
    scale, bias, mean, var = n.ins[1:5]
    eps = attr(n, "epsilon")
    rank = _rank(n, x)
    axes = [0] + list(range(2, rank))
    dt = x.dtype
    s = _cast(e, scale, dt)
    if n.opset >= 14:
        training = bool(attr(n, "training_mode"))
    else:  # BatchNormalization-9: the optional statistics outputs mean training mode
        training = any(_out(n, i) is not None for i in range(1, len(n.outs)))
    if training:
        if dt in HALF:
            # in float32, as cuDNN's kernels compute it: Σc² over N H W values passes float16's
            # 65504 at batch 32 of 56 x 56 (then r = 0, and every gradient with it)
            x, g, dt = _cast(e, x, ir.DataType.FLOAT), _cast(e, g, ir.DataType.FLOAT), \
                ir.DataType.FLOAT
            s = _cast(e, scale, dt)
        # with c = x - mean, r = (var + eps)^-1/2, x̂ = c r and M values per channel:
        # dL/dx = s r (g - Σg / M - x̂ Σ(g x̂) / M) = (g + c a + b) s r with the per-channel
        # a = -r² Σ(g c) / M, b = -Σg / M: x̂ and the other full-size terms are never made
        # (half the passes over x-sized tensors of the textbook form)
        replaced = None  # the node's inputs, when the rule replaced it
        if g is not None and n.opset >= 14 and n.x.dtype in _AFFINE and n.node.graph is e.graph:
            replaced = list(n.node.inputs)
            c, r, inv_m = _training_forward(n, e, axes, rank)
        else:
            inv_m, _, c, _, r = _batch_stats(e, x, axes, eps)
        gx = gs = gb = gm = gv = None
        if g is not None:
            sg = e.reduce("ReduceSum", g, axes, keepdims=1)
            sgc = e.reduce("ReduceSum", g * c, axes, keepdims=1)
            k = _chan(e, s, rank) * r
            gx = g * k + _affine(e, c, r * r * sgc * -inv_m * k, sg * -inv_m * k)
            gs = _cast(e, e.Reshape(sgc * r, [-1]), scale.dtype)
            gb = _cast(e, e.Reshape(sg, [-1]), bias.dtype)
        if g_rm is not None or g_rv is not None:
            momentum = attr(n, "momentum")
            # d mean_A(x)/dx = 1/M, d var_A(x)/dx = 2 (x - mean_A x) / M, M the count over A
            extra = None
            if g_rm is not None:
                extra = _chan(e, _cast(e, g_rm, dt), rank)
                gm = _cast(e, g_rm * momentum, mean.dtype)
            if g_rv is not None:
                t = _chan(e, _cast(e, g_rv, dt), rank) * 2.0 * c
                extra = t if extra is None else extra + t
                gv = _cast(e, g_rv * momentum, var.dtype)
            extra = extra * (1.0 - momentum) * inv_m
            if g_rv is None:
                extra = e.broadcast_to(extra, x)
            gx = extra if gx is None else gx + extra
        gx = _cast(e, gx, n.x.dtype)
        if replaced is not None:
            return Grads.by_value(e, replaced, [gx, gs, gb, gm, gv])
        return gx, gs, gb, gm, gv
    r = e.Reciprocal(e.Sqrt(_cast(e, var, dt) + eps))     # (C,)
    k = s * r
    gx = g * _chan(e, k, rank)
    sg = _sum(e, g, axes)                                  # dL/dB
    sgc = _sum(e, g * (x - _chan(e, _cast(e, mean, dt), rank)), axes)
    return (gx, _cast(e, sgc * r, scale.dtype), _cast(e, sg, bias.dtype),
            _cast(e, -(sg * k), mean.dtype), _cast(e, sgc * k * r * r * -0.5, var.dtype))


# -- InstanceNormalization -------------------------------------------------------------------
@register("InstanceNormalization")
def _instance_norm(n, g):
    e, x = n.e, n.x
    scale = n.ins[1]
    rank = _rank(n, x)
    if rank < 3:
        raise NotImplementedError(
            f"InstanceNormalization node {n.node.name!r}: input of rank {rank} has no spatial "
            f"axes to normalize over")
    axes = list(range(2, rank))
    _, r, xh = _standardize(e, x, axes, attr(n, "epsilon"))
    gx = _std_backward(e, g * _chan(e, scale, rank), xh, r, axes)
    return gx, _sum(e, g * xh, [0] + axes), _sum(e, g, [0] + axes)


# -- LayerNormalization ----------------------------------------------------------------------
def _sole_layer_norm(n, e) -> bool:
    """Whether nothing else may compute this LayerNormalization: onnxruntime's common
    subexpression elimination merges two on the same inputs whatever outputs each has, and
    failed to load the model ("Argument type mismatch when adding edge") where the one it kept
    had empty output slots for the other's Mean and InvStdDev (a model function's body,
    recomputed beside its call, given them; the call, inlined, still had the original). So not
    a node this gradients call made, nor, as a precaution, one whose x another
    LayerNormalization or a call of a model function also reads."""
    node = n.node
    if e.made(node):
        return False
    for user, _ in n.x.value.uses():
        if user is not node and (user.op_type == "LayerNormalization" or
                                 user.domain not in ("", "ai.onnx")):
            return False
    return True


def _with_statistics(n, e, stash):
    """A node without its Mean and InvStdDev outputs replaced by the same node with them, for
    the backward to read (onnxruntime's kernel computes them anyway; recomputing them took
    three passes over x). Returns (Mean, InvStdDev) as values of ``e``."""
    f = e.scratch()
    y, mean, inv = f.op("LayerNormalization", *(f.adopt(v) if v is not None else None
                                                 for v in n.ins), _outputs=3,
                        _dtype=[n.x.dtype, stash, stash], **dict(n.node.attributes))
    e.replace(n.node, f, [y])
    return e.adopt(mean), e.adopt(inv)


@register("LayerNormalization", since=17)
def _layer_norm(n, g):
    """Reuses the node's Mean / InvStdDev outputs when they are as precise as the gradient's
    dtype (a float64 node with the default float32 stash_type keeps float32 statistics:
    recomputed in float64 then); a node without them is given them (:func:`_with_statistics`;
    the transformer-ts row's step 1.04x / 1.01x at one / two threads in one A/B, 1.01x / 1.03x
    in another: a few per cent at most). Differentiates
    those outputs too (they are live in a second-order gradient that reuses them)."""
    e, x = n.e, n.x
    scale, bias = n.ins[1], n.input(2)
    rank = _rank(n, x)
    axis = attr(n, "axis")
    axes = list(range(axis + rank if axis < 0 else axis, rank))
    eps = attr(n, "epsilon")
    dt = _compute_dtype(n, x)
    xc = _cast(e, x, dt)
    mean_out, inv_out = (_precise(_out(n, i), dt) for i in (1, 2))
    stash = ir.DataType(attr(n, "stash_type"))
    replaced = None  # the node's inputs, when the rule replaced it
    if g is not None and mean_out is None and inv_out is None and n.node.graph is e.graph \
            and _BITS.get(stash, 0) >= _BITS.get(dt, 0) and _sole_layer_norm(n, e):
        replaced = list(n.node.inputs)
        mean_out, inv_out = _with_statistics(n, e, stash)
    mu = _cast(e, mean_out, dt) if mean_out is not None else _mean(e, xc, axes)
    c = xc - mu
    r = (_cast(e, inv_out, dt) if inv_out is not None
         else e.Reciprocal(e.Sqrt(_mean(e, c * c, axes) + eps)))
    xh = c * r
    gx = gscale = gb = None
    if g is not None:
        gc = _cast(e, g, dt)
        gx = _std_backward(e, gc * _cast(e, scale, dt), xh, r, axes)
        gscale = _cast(e, n.sum_to(gc * xh, scale), scale.dtype)
        gb = None if bias is None else _cast(e, n.sum_to(gc, bias), bias.dtype)
    g_mean, g_inv = _grad(n, 1), _grad(n, 2)
    if g_mean is not None or g_inv is not None:
        # Mean = mean_A(x): d/dx = 1/M; InvStdDev = r: dr/dx = -r^2 x̂ / M
        count = e.Cast(e.Div(e.Size(xc), e.Size(r)), to=dt)
        extra = None if g_inv is None else -(_cast(e, g_inv, dt) * r * r) * xh
        if g_mean is not None:
            gm = _cast(e, g_mean, dt)
            extra = gm if extra is None else extra + gm
        extra = extra / count
        if g_inv is None and gx is None:
            extra = e.broadcast_to(extra, xc)
        gx = extra if gx is None else gx + extra
    grads = (_cast(e, gx, x.dtype), gscale, gb)
    return grads if replaced is None else Grads.by_value(e, replaced, grads)


# -- GroupNormalization ----------------------------------------------------------------------
def _group_norm(n, g, per_channel):
    e, x = n.e, n.x
    scale, bias = n.ins[1], n.ins[2]
    groups = n.attr("num_groups")
    dt = _compute_dtype(n, x) if per_channel else x.dtype
    gc, s = _cast(e, g, dt), _cast(e, scale, dt)
    x3 = e.Reshape(_cast(e, x, dt), [0, groups, -1])   # (N, G, C/G * D1 * ...)
    _, r, xh3 = _standardize(e, x3, [2], attr(n, "epsilon"))
    if per_channel:  # opset 21: scale and bias per channel, on the (N, C, D1 * ...) view
        nc = e.Concat(e.Shape(x, end=2), [-1], axis=0)
        g_nc, xh_nc = e.Reshape(gc, nc), e.Reshape(xh3, nc)
        gscale, gb = _sum(e, g_nc * xh_nc, [0, 2]), _sum(e, g_nc, [0, 2])
        gxh3 = e.Reshape(g_nc * e.Unsqueeze(s, [1]), [0, groups, -1])
    else:  # opset 18: scale and bias per group, on the (N, G, -1) view
        g3 = e.Reshape(gc, [0, groups, -1])
        gscale, gb = _sum(e, g3 * xh3, [0, 2]), _sum(e, g3, [0, 2])
        gxh3 = g3 * e.Unsqueeze(s, [1])
    gx = e.Reshape(_std_backward(e, gxh3, xh3, r, [2]), e.Shape(x))
    return _cast(e, gx, x.dtype), _cast(e, gscale, scale.dtype), _cast(e, gb, bias.dtype)


register("GroupNormalization", lambda n, g: _group_norm(n, g, False), since=18, until=20)
register("GroupNormalization", lambda n, g: _group_norm(n, g, True), since=21)


# -- RMSNormalization ------------------------------------------------------------------------
@register("RMSNormalization", since=23)
def _rms_norm(n, g):
    e, x, scale = n.e, n.x, n.ins[1]
    rank = _rank(n, x)
    axis = attr(n, "axis")
    axes = list(range(axis + rank if axis < 0 else axis, rank))
    dt = _compute_dtype(n, x)
    xc, gc = _cast(e, x, dt), _cast(e, g, dt)
    r = e.Reciprocal(e.Sqrt(_mean(e, xc * xc, axes) + attr(n, "epsilon")))
    xh = xc * r
    gxh = gc * _cast(e, scale, dt)
    gx = r * (gxh - xh * _mean(e, gxh * xh, axes))
    return _cast(e, gx, x.dtype), _cast(e, n.sum_to(gc * xh, scale), scale.dtype)


# -- LpNormalization, MeanVarianceNormalization, LRN -----------------------------------------
@register("LpNormalization")
def _lp_norm(n, g):
    """y = x / ||x||_p along ``axis``: dx = (g - d||x||/dx * sum(g y)) / ||x||."""
    e, x, y = n.e, n.x, n.y
    axis, p = attr(n, "axis"), attr(n, "p")
    sgy = e.reduce("ReduceSum", g * y, [axis])
    if p == 2:   # ||x|| = sum(x * y); d||x||/dx = y
        return (g - y * sgy) / e.reduce("ReduceSum", x * y, [axis])
    if p == 1:   # d||x||_1/dx = sign(x)
        return (g - e.Sign(x) * sgy) / e.reduce("ReduceSum", e.Abs(x), [axis])
    raise NotImplementedError(f"LpNormalization node {n.node.name!r}: p={p} (ONNX allows 1, 2)")


@register("MeanVarianceNormalization")
def _mvn(n, g):
    """y = (x - m) / (s + 1e-9), s = sqrt(var) (ONNX's epsilon sits outside the root):
    dx = (g - mean(g) - mean(g y) (x - m) / s) / (s + 1e-9)."""
    e, x, y = n.e, n.x, n.y
    axes = attr(n, "axes")
    c = x - _mean(e, x, axes)
    s = e.Sqrt(_mean(e, c * c, axes))
    return (g - _mean(e, g, axes) - _mean(e, g * y, axes) * c / s) / (s + 1e-9)


@register("LRN")
def _lrn(n, g):
    """y = x s^-beta, s = bias + alpha/size * W(x^2), W the channel window [c - lo, c + hi]:
    dx = g s^-beta - 2 alpha beta / size * x * W'(g y / s), W' the mirrored window."""
    e, x, y = n.e, n.x, n.y
    size = n.attr("size")
    alpha, beta, bias = attr(n, "alpha"), attr(n, "beta"), attr(n, "bias")
    rank = _rank(n, x)
    lo = (size - 1) // 2
    hi = size - 1 - lo

    def window(t, before, after):  # out[c] = sum of t[c - before .. c + after] (zero outside)
        if size == 1:
            return t
        pads = [0] * (2 * rank)
        pads[1], pads[rank + 1] = before, after
        tp = e.Pad(t, pads)
        return e.Sum(*[e.Slice(tp, [k], [k - (size - 1) if k < size - 1 else _INT64_MAX], [1])
                       for k in range(size)])

    s = bias + (alpha / size) * window(x * x, lo, hi)
    return g * s ** (-beta) - (2 * alpha * beta / size) * x * window(g * y / s, hi, lo)


# -- Dropout ---------------------------------------------------------------------------------
@register("Dropout")
def _dropout(n, g):
    """Inference (training_mode absent or false): identity. Training: g * mask / (1 - ratio),
    with the node's own mask output; a training-mode node without that output cannot be
    differentiated (its random mask is gone) and raises. training_mode given at run time: a Where
    between the two. ratio gets no gradient (the mask is a random function of it)."""
    if g is None:
        return None
    e = n.e
    training = n.input(2)
    flag = n.const(2)
    if training is None or (flag is not None and not bool(flag)):
        return g, None, None
    fixed = n.const(1)  # the ratio, when constant
    if fixed is not None and float(fixed) == 0.0:
        # a constant ratio of 0 keeps every element (mask all true, scale 1): the identity,
        # as exporters write a training-mode Dropout(p=0) (TransformerEncoderLayer(dropout=0))
        return g, None, None
    mask = _out(n, 1)
    if mask is None:
        raise NotImplementedError(
            f"Dropout node {n.node.name!r} may run in training mode but has no mask output, so "
            f"its random mask cannot be recovered for the gradient: give the node its second "
            f"output (outputs=[output, mask]), or run it with training_mode false")
    ratio = n.input(1)
    if ratio is None:
        keep = e.const(2.0, g.dtype)
    elif fixed is not None:
        keep = e.const(1.0 / (1.0 - float(fixed)), g.dtype)
    else:
        keep = e.Reciprocal(1 - _cast(e, ratio, g.dtype))
    gx = g * e.Cast(mask, to=g.dtype) * keep
    if flag is None:   # decided at run time
        gx = e.Where(training, gx, g)
    return gx, None, None


no_gradient("Dropout", ratio="non-differentiable in the ONNX schema")


# -- Hardmax, OneHot (CenterCropPad's rule lives with the shape ops in shape.py) ----------
@register("OneHot")
def _one_hot(n, g):
    """y = where(one_hot(indices), values[1], values[0]): only ``values`` gets a gradient."""
    e = n.e
    hot = e.OneHot(n.ins[0], n.ins[1], e.const(np.array([0, 1]), g.dtype),
                   axis=attr(n, "axis"), _dtype=g.dtype)
    on = e.ReduceSum(g * hot, keepdims=0)
    off = e.ReduceSum(g, keepdims=0) - on
    values = e.Concat(e.Reshape(off, [1]), e.Reshape(on, [1]), axis=0)
    return None, None, _cast(e, values, n.ins[2].dtype)


# piecewise constant: a zero gradient (not an unconnected one)
table({"Hardmax": lambda n, g: n.e.zeros_like(n.x)})
