"""Neural-network ops: convolutions, pooling, batch norm, activations, losses, and the gradient
ops tf.gradients emits for them (Conv2DBackpropInput/Filter, MaxPoolGrad, ReluGrad, ...).

ONNX convolutions and pools are channels-first (NCHW, weights OIHW); TF's default is channels-last
(NHWC, filters HWIO), so channels-last nodes transpose in and out. Padding: TF's SAME pads each
spatial axis by max(total, 0), total = (ceil(in / s) - 1) * s + (k - 1) * d + 1 - in, the odd pixel
at the end. A stride larger than the window makes total negative, which ONNX's
``auto_pad=SAME_UPPER`` does not clamp (onnxruntime's pools refuse it), so every window op (Conv,
the pools, the gradients that recompute them) pads as :func:`_window` says: explicit pads from the
static spatial sizes, else SAME_UPPER where it cannot go negative (unit dilations, every window at
least its stride), else a Pad computed at run time from Shape. The gradients given the input's
sizes as a vector (Conv*BackpropInput, AvgPoolGrad) read them statically where they can, else
take the full transposed op and cut it to the run-time sizes (:func:`_crop`).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto
from onnx import helper as onnx_helper

from .core import handler
from .errors import ConversionError
from .ops import as_i64, gemm_plus, is_float, np_type, rank_of, scalar, static_shape


# -- layouts and conv geometry ------------------------------------------------------------------
def _channels_last(c, n) -> bool:
    return not c.attr(n, "data_format", "NHWC").startswith("NC")


def _spatial(c, n, vals) -> list:
    """The spatial entries of a per-dimension attribute or shape given in the node's data format
    (None for a dim not known statically)."""
    return [None if v is None or v < 0 else int(v)
            for v in (vals[1:-1] if _channels_last(c, n) else vals[2:])]


def _to_cf(c, n, x, r):  # channels-last -> channels-first
    return c.op("Transpose", [x], perm=[0, r - 1, *range(1, r - 1)]) if _channels_last(c, n) else x


def _from_cf(c, n, y, r):
    return c.op("Transpose", [y], perm=[0, *range(2, r), 1]) if _channels_last(c, n) else y


def _oihw(c, w, r):  # TF filter [*k, in, out] -> ONNX weight [out, in, *k]
    return c.op("Transpose", [w], perm=[r - 1, r - 2, *range(r - 2)])


class _Geom:
    """Strides, dilations and padding of a conv/pool node over its spatial dims."""

    def __init__(self, c, n, r, kernel=None):
        self.padding = c.attr(n, "padding")
        self.strides = _spatial(c, n, c.attr(n, "strides") or [1] * r)  # (V2 pools: an input)
        self.dilations = _spatial(c, n, c.attr(n, "dilations", [1] * r))
        self.kernel = kernel
        self.explicit = None
        if self.padding == "EXPLICIT":
            p = np.reshape(c.attr(n, "explicit_paddings"), (-1, 2))
            p = p[1:-1] if _channels_last(c, n) else p[2:]
            self.explicit = [(int(a), int(b)) for a, b in p]

    def pads(self, size: list[int], dilations=None):
        """(begins, ends, forward output sizes, output_padding that gives ``size`` back) for the
        forward op over input sizes ``size`` (with the node's dilations unless given)."""
        begins, ends, outs, extra = [], [], [], []
        dilations = self.dilations if dilations is None else dilations
        for i, (n_in, k, s, d) in enumerate(zip(size, self.kernel, self.strides, dilations)):
            eff = (k - 1) * d + 1
            if self.padding == "SAME":
                out = -(-n_in // s)
                total = max((out - 1) * s + eff - n_in, 0)
                b, e = total // 2, total - total // 2
            else:
                b, e = self.explicit[i] if self.explicit else (0, 0)
                out = (n_in + b + e - eff) // s + 1
            begins.append(b), ends.append(e), outs.append(out)
            extra.append(n_in - ((out - 1) * s + eff - b - e))
        return begins, ends, outs, extra


def _window(c, n, g, op, x, size, weight=None, dilations=True, **attrs):
    """ONNX ``op`` (Conv, MaxPool, AveragePool) over the channels-first ``x`` (and ``weight``,
    Conv's) with node n's strides, dilations and padding, ``size`` the static spatial sizes of x
    (None entries, or None, where unknown). SAME pads as TF (see the module docstring), from
    :func:`_pad_attrs` or else by a Pad at run time: zeros for Conv; -inf (the dtype's lowest)
    for MaxPool, where every window keeps a real element; zeros for AveragePool, whose result is
    then divided by the same pool of the padded ones (TF's count of the real pixels)."""
    ins = [x] if weight is None else [x, weight]
    pad = _pad_attrs(g, size, dilations)
    a = {"strides": g.strides, **({"dilations": g.dilations} if dilations else {}), **attrs}
    if pad is not None:
        return c.op(op, ins, **a, **pad)
    pads = _same_pads(c, n, g, _sizes(c, x), g.dilations if dilations else None, weight)
    if op == "MaxPool":
        return c.op(op, [_pad(c, n, x, pads, low=True)], **a)
    y = c.op(op, [_pad(c, n, x, pads), *ins[1:]], **a)
    if op != "AveragePool":
        return y
    return c.op("Div", [y, c.op(op, [_pad(c, n, _ones_image(c, n, _sizes(c, x)), pads)], **a)])


def _max_pool(c, n, g, x, size):
    """MaxPool with its indices over the channels-first x: (y, indices, pads), pads None where
    the indices count over x, else the run-time SAME pads (:func:`_same_pads`) of the padded x
    (-inf around x) that they count over."""
    a = {"kernel_shape": g.kernel, "strides": g.strides}
    pad = _pad_attrs(g, size, False)
    if pad is not None:
        y, idx = c.op("MaxPool", [x], n_out=2, **a, **pad)
        return y, idx, None
    pads = _same_pads(c, n, g, _sizes(c, x))
    y, idx = c.op("MaxPool", [_pad(c, n, x, pads, low=True)], n_out=2, **a)
    return y, idx, pads


def _pad_attrs(g, size, dilations=True) -> dict | None:
    """The padding attributes of the ONNX op (with dilations, or without: the pools'): TF's
    explicit pads; for SAME, pads from the static spatial sizes ``size`` and the kernel where
    both are known, else ``auto_pad=SAME_UPPER`` where its total cannot be negative (unit
    dilations, every window at least its stride); else None: the pads are the run time's."""
    if g.padding == "EXPLICIT":
        return {"pads": [b for b, _ in g.explicit] + [e for _, e in g.explicit]}
    if g.padding != "SAME":
        return {}
    d = g.dilations if dilations else [1] * len(g.strides)
    if size is not None and None not in size and g.kernel is not None:
        b, e, _, _ = g.pads(size, d)
        return {"pads": b + e}
    if set(d) == {1} and (set(g.strides) == {1} or g.kernel is not None and all(
            k >= s for k, s in zip(g.kernel, g.strides))):
        return {"auto_pad": "SAME_UPPER"}
    return None


def _pad(c, n, x, pads, low=False):
    """x padded by ``pads`` with zeros, or with ``low`` -inf (an integer dtype's lowest)."""
    fill = 0 if not low else -np.inf if is_float(n) else np.iinfo(np_type(n)).min
    return c.op("Pad", [x, pads, scalar(c, n, fill)])


def _sizes(c, x):
    """The run-time spatial sizes (int64) of the channels-first x."""
    return c.op("Shape", [x], start=2)


def _ones_image(c, n, size):
    """Ones of one image of one channel, of the spatial ``size`` (int64): padded and pooled,
    each window's count of real pixels."""
    return c.op("Expand", [scalar(c, n, 1), c.op("Concat", [c.i64(1, 1), size], axis=0)])


def _same_pads(c, n, g, size, dilations=None, weight=None):
    """The Pad pads (int64 [2 * rank]: zeros for N and C) of TF's SAME over the run-time spatial
    sizes ``size`` (``dilations`` None: unit ones; the kernel's sizes from the ONNX weight's
    shape when they are not known statically)."""
    dilations = dilations or [1] * len(g.strides)
    s = c.i64(*g.strides)
    if g.kernel is not None:
        eff = c.i64(*[(k - 1) * dd + 1 for k, dd in zip(g.kernel, dilations)])
    else:
        k = c.op("Shape", [weight], start=2)
        one = c.const(1, np.int64)
        eff = c.op("Add", [c.op("Mul", [c.op("Sub", [k, one]), c.i64(*dilations)]), one])
    out = c.op("Div", [c.op("Add", [size, c.op("Sub", [s, c.const(1, np.int64)])]), s])
    total = c.op("Sub", [c.op("Add", [c.op("Mul", [c.op("Sub", [out, c.const(1, np.int64)]), s]),
                                      eff]), size])
    total = c.op("Max", [total, c.const(0, np.int64)])
    begin = c.op("Div", [total, c.const(2, np.int64)])
    zeros = c.i64(0, 0)
    return c.op("Concat", [zeros, begin, zeros, c.op("Sub", [total, begin])], axis=0)


def _static_spatial(c, n, ref):
    """The static spatial sizes of tensor ``ref`` (None entries where unknown), or None."""
    s = static_shape(c, ref)
    return None if s is None else _spatial(c, n, s)


def _known(c, n, i, what=None, spatial=False):
    """A shape vector of a conv gradient known statically (all of it, or its spatial part):
    constant input i (input_sizes, filter_sizes), or else the node's own output shape. Where it
    is not: None, or (``what`` it is given) an error."""
    k = _shape_vector(c, n, i)
    part = None if k is None else (_spatial(c, n, k) if spatial else list(k))
    if part is None or None in part:
        if what is None:
            return None
        raise ConversionError(f"{n}: {what} must be known statically (export the graph with "
                              "add_shapes=True)")
    return [int(d) for d in part]


def _run_sizes(c, n, r):
    """The spatial sizes (int64, at run time) in the shape vector input 0 (input_sizes)."""
    lo = 1 if _channels_last(c, n) else 2
    return c.op("Slice", [as_i64(c, c.x(n, 0)), c.i64(lo), c.i64(lo + r - 2)])


def _run_pads(c, n, g, size):
    """The Pad pads of the forward window op (as :func:`_same_pads`) over the run-time spatial
    sizes ``size``: TF's SAME computed from them, else the explicit (VALID: zero) pads."""
    if g.padding == "SAME":
        return _same_pads(c, n, g, size, g.dilations)
    b, e = zip(*g.explicit) if g.explicit else ([0] * len(g.strides),) * 2
    return c.i64(0, 0, *b, 0, 0, *e)


def _cut(c, t, pads, size, r):
    """The part of the channels-first ``t`` (over an input padded by the Pad ``pads``) that
    lies over the input's spatial ``size`` (int64): the begin pads cut off, and what is past
    the size."""
    begin = c.op("Slice", [pads, c.i64(2), c.i64(r)])
    return c.op("Slice", [t, begin, c.op("Add", [begin, size]), c.i64(*range(2, r))])


def _crop(c, full, pads, size, r):
    """The gradient of the forward op's input from the full transposed window op (no pads, no
    output_padding, over the forward's padded input): cut from the begin pads to ``size``, and
    zeros after its end where the forward's last rows were in no window (VALID, or a stride past
    the window)."""
    y = _cut(c, full, pads, size, r)
    short = c.op("Sub", [size, _sizes(c, y)])
    return c.op("Pad", [y, c.op("Concat", [c.i64(*[0] * (r + 2)), short], axis=0)])


def _shape_vector(c, n, i):
    """Constant input i (input_sizes, filter_sizes), or else the node's own output shape (None
    for unknown dims), or None."""
    k = c.const_input(n, i)
    return (c.attr(n, "_output_shapes") or [None])[0] if k is None else k


def _filter_shape(c, n, ref) -> list[int]:
    s = static_shape(c, ref)
    if s is None or None in s:
        raise ConversionError(f"{n}: the filter's shape must be known statically")
    return [int(d) for d in s]


# -- convolutions --------------------------------------------------------------------------------
CONV = {"Conv2D": 4, "Conv3D": 5, "DepthwiseConv2dNative": 4}


@handler(*CONV)
def _conv(c, n):
    r = CONV[n.op]
    w, group = _weight(c, n, n.inputs[1], r, _channels(c, n, static_shape(c, n.inputs[0]), r))
    fs = static_shape(c, n.inputs[1])
    known = fs is not None and len(fs) == r and None not in fs[:r - 2]
    g = _Geom(c, n, r, [int(k) for k in fs[:r - 2]] if known else None)
    y = _window(c, n, g, "Conv", _to_cf(c, n, c.x(n, 0), r), _static_spatial(c, n, n.inputs[0]),
                weight=w, group=group)
    return [_from_cf(c, n, y, r)]


def _weight(c, n, ref, r, channels=None):
    """The ONNX weight of node n's filter and the group count (depthwise: one per channel;
    Conv2D/Conv3D: the input's ``channels`` over the filter's, TF's grouped convolution)."""
    w = c.value(ref)
    if "Depthwise" not in n.op:
        fs = static_shape(c, ref)
        return _oihw(c, w, r), _groups(n, channels, None if fs is None else fs[r - 2])
    kh, kw, cin, m = _filter_shape(c, n, ref)
    return _oihw(c, c.op("Reshape", [w, c.i64(kh, kw, 1, cin * m)]), r), cin


def _groups(n, channels, per) -> int:
    """TF convolves in groups when the input has a multiple of the filter's ``per`` input
    channels (ONNX needs the count as an attribute: an input whose channels are not known
    statically is taken as ungrouped, which onnxruntime checks when it runs)."""
    if channels is None or per is None or channels == per:
        return 1
    if channels % per:
        raise ConversionError(f"{n}: the input's {channels} channels are not a multiple of the "
                              f"filter's {per}")
    return channels // per


def _channels(c, n, shape, r):
    """The channel count in ``shape`` (the node's data format), or None where unknown."""
    if shape is None or len(shape) != r:
        return None
    ch = shape[-1] if _channels_last(c, n) else shape[1]
    return None if ch is None or ch < 0 else int(ch)


BACKPROP_INPUT = {"Conv2DBackpropInput": 4, "Conv3DBackpropInputV2": 5,
                  "DepthwiseConv2dNativeBackpropInput": 4}


@handler(*BACKPROP_INPUT)
def _conv_backprop_input(c, n):
    """(input_sizes, filter, dy) -> dx: the transposed convolution, padded like the forward
    (ConvTranspose's pads and output_padding are attributes: where the input's spatial sizes
    are the run time's, the full transposed convolution is cut to them, :func:`_crop`)."""
    r = BACKPROP_INPUT[n.op]
    channels = _channels(c, n, _shape_vector(c, n, 0), r)
    w, group = _weight(c, n, n.inputs[1], r, channels)
    g = _Geom(c, n, r, _filter_shape(c, n, n.inputs[1])[:r - 2])
    dy, a = _to_cf(c, n, c.x(n, 2), r), {"group": group, "strides": g.strides,
                                          "dilations": g.dilations}
    size = _known(c, n, 0, spatial=True)
    if size is not None:
        b, e, _, extra = g.pads(size)
        y = c.op("ConvTranspose", [dy, w], **a, pads=b + e, output_padding=extra)
    else:
        size = _run_sizes(c, n, r)
        y = _crop(c, c.op("ConvTranspose", [dy, w], **a), _run_pads(c, n, g, size), size, r)
    y = _from_cf(c, n, y, r)
    # (channels unknown: taken as ungrouped; the Reshape to input_sizes makes a grouped one
    # fail when it runs, rather than give a dx of the filter's input channels)
    return [y if channels is not None else c.op("Reshape", [y, as_i64(c, c.x(n, 0))])]


BACKPROP_FILTER = {"Conv2DBackpropFilter": 4, "Conv3DBackpropFilterV2": 5,
                   "DepthwiseConv2dNativeBackpropFilter": 4}


@handler(*BACKPROP_FILTER)
def _conv_backprop_filter(c, n):
    """(x, filter_sizes, dy) -> dfilter: a convolution of x (channels as the batch) with dy
    (batch as the channels) whose stride is the forward dilation and dilation the forward
    stride, cut to the kernel size. Grouped (TF's grouped Conv2D, with G * per input channels;
    depthwise, a group per channel of M outputs each) it is a grouped Conv: x as [per, G * N,
    *spatial], so that group k pairs x's channels k * per .. with dy's k-th block of outputs."""
    r = BACKPROP_FILTER[n.op]
    fshape = _known(c, n, 1, "the filter's shape")
    kernel, cin, cout = fshape[:r - 2], fshape[r - 2], fshape[r - 1]
    depthwise = "Depthwise" in n.op
    channels = _channels(c, n, static_shape(c, n.inputs[0]), r)
    group, per = (cin, 1) if depthwise else (_groups(n, channels, cin), cin)
    g = _Geom(c, n, r, kernel)
    perm = [r - 1, 0, *range(1, r - 1)] if _channels_last(c, n) else [1, 0, *range(2, r)]
    x = c.op("Transpose", [c.x(n, 0)], perm=perm)  # [C, N, *spatial]
    dy = c.op("Transpose", [c.x(n, 2)], perm=perm)  # [O, N, *out]
    # (channels unknown: taken as ungrouped; the Reshape to [per, -1, ...] makes a grouped x
    # fail in the Conv when it runs, rather than give a filter of the wrong shape)
    if group > 1 or channels is None:
        spatial = _sizes(c, x)
        if group > 1 and per > 1:  # [G * per, N, ...] -> [per, G, N, ...]
            x = c.op("Reshape", [x, c.op("Concat", [c.i64(group, per), c.op(
                "Shape", [x], start=1)], axis=0)])
            x = c.op("Transpose", [x], perm=[1, 0, *range(2, r + 1)])
        x = c.op("Reshape", [x, c.op("Concat", [c.i64(per, -1), spatial], axis=0)])
    size = _static_spatial(c, n, n.inputs[0])
    if g.padding == "SAME" and (size is None or None in size):  # SAME from the run-time sizes
        # (never SAME_UPPER: this Conv's windows are not the forward's)
        x, pads = _pad(c, n, x, _same_pads(c, n, g, _sizes(c, x), g.dilations)), {}
    else:
        pads = _pad_attrs(g, size)
    y = c.op("Conv", [x, dy], group=group, strides=g.dilations, dilations=g.strides, **pads)
    y = c.op("Slice", [y, c.i64(*[0] * (r - 2)), c.i64(*kernel), c.i64(*range(2, r))])
    if depthwise:
        y = c.op("Reshape", [y, c.i64(cin, cout, *kernel)])
    return [c.op("Transpose", [y], perm=[*range(2, r), 0, 1])]


# -- pooling -------------------------------------------------------------------------------------
POOL = {"MaxPool": ("MaxPool", 4), "MaxPool3D": ("MaxPool", 5), "MaxPoolV2": ("MaxPool", 4),
        "AvgPool": ("AveragePool", 4), "AvgPool3D": ("AveragePool", 5)}


def _ksize(c, n, i=None):
    k = c.attr(n, "ksize") if i is None else c.const_input(n, i, required="ksize")
    return _spatial(c, n, list(k))


@handler(*POOL)
def _pool(c, n):
    op, r = POOL[n.op]
    v2 = n.op.endswith("V2")
    g = _Geom(c, n, r, _ksize(c, n, 1 if v2 else None))
    if v2:
        g.strides = _spatial(c, n, list(c.const_input(n, 2, required="strides")))
    y = _window(c, n, g, op, _to_cf(c, n, c.x(n), r), _static_spatial(c, n, n.inputs[0]),
                dilations=False, kernel_shape=g.kernel)
    return [_from_cf(c, n, y, r)]


MAX_POOL_GRAD = {"MaxPoolGrad": 4, "MaxPool3DGrad": 5, "MaxPoolGradV2": 4}


@handler(*MAX_POOL_GRAD)
def _max_pool_grad(c, n):
    """(x, y, dy) -> dx: dy added onto the position of each window's maximum (MaxPool's
    indices count over the whole channels-first tensor: over x padded at run time where
    :func:`_max_pool` pads, which is then cut back to x)."""
    r = MAX_POOL_GRAD[n.op]
    x = _to_cf(c, n, c.x(n, 0), r)
    g = _Geom(c, n, r, _ksize(c, n, 3 if n.op.endswith("V2") else None))
    if n.op.endswith("V2"):
        g.strides = _spatial(c, n, list(c.const_input(n, 4, required="strides")))
    _, idx, pads = _max_pool(c, n, g, x, _static_spatial(c, n, n.inputs[0]))
    shape = c.op("Shape", [x])
    if pads is not None:
        shape = c.op("Add", [shape, c.op("Add", [c.op("Slice", [pads, c.i64(0), c.i64(r)]),
                                                 c.op("Slice", [pads, c.i64(r), c.i64(2 * r)])])])
    dx = _scatter_add(c, n, shape, idx, _to_cf(c, n, c.x(n, 2), r))
    if pads is not None:
        dx = _cut(c, dx, pads, _sizes(c, x), r)
    return [_from_cf(c, n, dx, r)]


@handler("MaxPoolWithArgmax")
def _max_pool_with_argmax(c, n):
    """x [B, H, W, C] -> (MaxPool's output, the flat index of each window's maximum in TF's
    layout: (y * W + x) * C + c, plus b * H * W * C with include_batch_in_index). ONNX's MaxPool
    counts its indices over the channels-first tensor, ((b * C + c) * H + y) * W + x: the position
    in the plane (its remainder by H * W) is kept, the channel and batch come from where the
    index sits. Both take the first maximum of a window in row-major order (ties). Where the
    pads are the run time's, the indices count over the padded plane: row and column move back
    by the begin pads."""
    x = c.x(n)
    g = _Geom(c, n, 4, _ksize(c, n))
    x_cf = _to_cf(c, n, x, 4)
    y, idx, pads = _max_pool(c, n, g, x_cf, _static_spatial(c, n, n.inputs[0]))
    y = _from_cf(c, n, y, 4)  # idx [B, C, OH, OW]
    shape = c.op("Shape", [x])
    hw = c.op("Mul", [c.op("Gather", [shape, c.i64(1)]), c.op("Gather", [shape, c.i64(2)])])
    ch = c.op("Gather", [shape, c.i64(3)])
    if pads is None:
        plane = c.op("Mod", [idx, c.op("Reshape", [hw, c.i64(1, 1, 1, 1)])])
    else:
        begin = c.op("Slice", [pads, c.i64(2), c.i64(4)])
        padded = c.op("Add", [c.op("Add", [_sizes(c, x_cf), begin]),
                              c.op("Slice", [pads, c.i64(6), c.i64(8)])])
        hp, wp = (c.op("Gather", [padded, c.const(k, np.int64)]) for k in (0, 1))
        at = c.op("Mod", [idx, c.op("Mul", [hp, wp])])
        row = c.op("Sub", [c.op("Div", [at, wp]), c.op("Gather", [begin, c.const(0, np.int64)])])
        col = c.op("Sub", [c.op("Mod", [at, wp]), c.op("Gather", [begin, c.const(1, np.int64)])])
        w = c.op("Gather", [shape, c.const(2, np.int64)])
        plane = c.op("Add", [c.op("Mul", [row, w]), col])
    zero, one = c.const(0, np.int64), c.const(1, np.int64)
    chan = c.op("Reshape", [c.op("Range", [zero, c.op("Squeeze", [ch]), one]), c.i64(1, -1, 1, 1)])
    flat = c.op("Add", [c.op("Mul", [plane, c.op("Reshape", [ch, c.i64(1, 1, 1, 1)])]), chan])
    if c.attr(n, "include_batch_in_index", False):
        b = c.op("Reshape", [c.op("Range", [zero, c.op("Squeeze", [c.op("Gather", [
            shape, c.i64(0)])]), one]), c.i64(-1, 1, 1, 1)])
        flat = c.op("Add", [flat, c.op("Mul", [b, c.op("Reshape", [c.op("Mul", [hw, ch]),
                                                                   c.i64(1, 1, 1, 1)])])])
    flat = c.op("Transpose", [flat], perm=[0, 2, 3, 1])
    t = c.onnx_type(n, "Targmax") if "Targmax" in n.attr else TensorProto.INT64
    return [y, flat if t == TensorProto.INT64 else c.op("Cast", [flat], to=t)]


@handler("MaxPoolGradWithArgmax")
def _max_pool_grad_with_argmax(c, n):
    """(x, dy, argmax) -> dx: dy added at the flat NHWC positions argmax names (offset by
    b * H * W * C per batch unless include_batch_in_index)."""
    x, dy = c.x(n, 0), c.x(n, 1)
    arg = c.op("Cast", [c.x(n, 2)], to=TensorProto.INT64)
    shape = c.op("Shape", [x])
    if not c.attr(n, "include_batch_in_index", False):
        per = c.op("ReduceProd", [c.op("Shape", [x], start=1)], keepdims=1)
        zero, one = c.const(0, np.int64), c.const(1, np.int64)
        b = c.op("Range", [zero, c.op("Squeeze", [c.op("Gather", [shape, c.i64(0)])]), one])
        off = c.op("Mul", [c.op("Reshape", [b, c.i64(-1, 1, 1, 1)]),
                           c.op("Reshape", [per, c.i64(1, 1, 1, 1)])])
        arg = c.op("Add", [arg, off])
    return [_scatter_add(c, n, shape, arg, dy)]


def _scatter_add(c, n, shape, idx, dy):
    """Zeros of ``shape`` with each element of dy added at the flat position idx names."""
    zeros = c.op("Expand", [scalar(c, n, 0), c.op("ReduceProd", [shape], keepdims=1)])
    flat = c.op("ScatterElements", [zeros, c.op("Reshape", [idx, c.i64(-1)]),
                                    c.op("Reshape", [dy, c.i64(-1)])], reduction="add")
    return c.op("Reshape", [flat, shape])


AVG_POOL_GRAD = {"AvgPoolGrad": 4, "AvgPool3DGrad": 5}


@handler(*AVG_POOL_GRAD)
def _avg_pool_grad(c, n):
    """(input_shape, dy) -> dx: dy over each window's count of real (unpadded) pixels, spread
    back by a transposed convolution with a kernel of ones, one channel at a time. Where the
    input's spatial sizes are the run time's, so are the counts (a sum pool of ones padded with
    zeros) and the cut of the full transposed convolution (:func:`_crop`)."""
    r = AVG_POOL_GRAD[n.op]
    kernel = _ksize(c, n)
    g = _Geom(c, n, r, kernel)
    g.dilations = [1] * (r - 2)
    dy = _to_cf(c, n, c.x(n, 1), r)
    ones = c.const(np.ones([1, 1, *kernel], np_type(n)))

    def per(count):  # dy of each channel apart, over the counts
        return c.op("Div", [c.op("Reshape", [dy, c.i64(-1, 1, *[0] * (r - 2))]), count])
    size = _known(c, n, 0, spatial=True)
    if size is not None:
        b, e, outs, extra = g.pads(size)
        count = np.ones((), np.float64)
        for o, k, s, bb, n_in in zip(outs, kernel, g.strides, b, size):
            lo = np.arange(o) * s - bb
            count = np.multiply.outer(count, np.minimum(lo + k, n_in) - np.maximum(lo, 0))
        dx = c.op("ConvTranspose", [per(c.const(count.astype(np_type(n)))), ones],
                  strides=g.strides, pads=b + e, output_padding=extra)
        size = c.i64(*size)
    else:
        size = _run_sizes(c, n, r)
        pads = _run_pads(c, n, g, size)
        count = c.op("Conv", [_pad(c, n, _ones_image(c, n, size), pads), ones],
                     strides=g.strides)
        dx = _crop(c, c.op("ConvTranspose", [per(count), ones], strides=g.strides), pads, size, r)
    shape = c.op("Concat", [c.op("Shape", [dy], end=2), size], axis=0)
    return [_from_cf(c, n, c.op("Reshape", [dx, shape]), r)]


# -- normalization -------------------------------------------------------------------------------
@handler("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
def _fused_batch_norm(c, n):
    """(x, scale, offset, mean, variance) -> y, batch mean, batch variance, reserves. Training
    mode normalizes with the batch's statistics and returns the (unbiased) batch variance."""
    x = c.x(n, 0)
    r = rank_of(c, n, 0)
    eps = scalar(c, n, c.attr(n, "epsilon", 1e-4), "U")

    def chan(v):  # a per-channel vector broadcast against x
        return _per_channel(c, n, v, x, r)

    scale, offset, mean, var = (c.x(n, i) for i in range(1, 5))
    c.statistics.update({mean: n.name, var: n.name})  # moved by statistics, not by training
    if c.attr(n, "is_training", True):
        flat, axes = _channels_view(c, n, x, r)
        mean_b = c.op("ReduceMean", [flat, axes], keepdims=0)
        d = c.op("Sub", [x, chan(mean_b)])
        flat_d, _ = _channels_view(c, n, c.op("Mul", [d, d]), r)
        var_b = c.op("ReduceMean", [flat_d, axes], keepdims=0)
        channels = c.op("Squeeze", [c.op("Shape", [scale]), c.i64(0)])
        m = c.op("Cast", [c.op("Div", [c.op("Size", [x]), channels])], to=c.onnx_type(n, "U"))
        one = scalar(c, n, 1, "U")
        unbiased = c.op("Div", [c.op("Mul", [var_b, m]),
                                c.op("Max", [c.op("Sub", [m, one]), one])])
        f = float(c.attr(n, "exponential_avg_factor", 1.0))
        out_mean, out_var = mean_b, unbiased
        if f != 1.0:
            out_mean, out_var = (c.op("Add", [c.op("Mul", [old, scalar(c, n, 1 - f, "U")]),
                                              c.op("Mul", [new, scalar(c, n, f, "U")])])
                                 for old, new in ((mean, mean_b), (var, unbiased)))
        mean, var = mean_b, var_b
    else:
        out_mean, out_var = mean, var
    inv = c.op("Div", [scale, c.op("Sqrt", [c.op("Add", [var, eps])])])
    y = c.op("Add", [c.op("Mul", [c.op("Sub", [x, chan(mean)]), chan(inv)]), chan(offset)])
    # the reserve outputs: copies (each output its own value, which the driver names)
    outs = [y, out_mean, out_var] + [c.op("Identity", [v]) for v in (mean, var)]
    return outs + [c.op("Identity", [mean])] if n.op == "FusedBatchNormV3" else outs


def _per_channel(c, n, v, x, r):
    """A per-channel vector v shaped to broadcast against x (channels last: as it is; first:
    [C, 1, ..., 1], computed from x's rank at run time when it is not known statically)."""
    if _channels_last(c, n):
        return v
    if r is not None:
        return c.op("Unsqueeze", [v, c.i64(*range(1, r - 1))]) if r > 2 else v
    ones = c.op("ConstantOfShape", [c.op("Reshape", [c.op("Sub", [
        c.op("Size", [c.op("Shape", [x])]), c.const(2, np.int64)]), c.i64(1)])],
        value=onnx_helper.make_tensor("one", TensorProto.INT64, [1], [1]))
    return c.op("Reshape", [v, c.op("Concat", [c.i64(-1), ones], axis=0)])


def _channels_view(c, n, x, r):
    """(x viewed so that one axis holds the channels, the axes to reduce for per-channel sums):
    x itself when its rank is known, else [-1, C] (channels last) or [N, C, -1] (first)."""
    last = _channels_last(c, n)
    if r is not None:
        keep = r - 1 if last else 1
        return x, c.i64(*[a for a in range(r) if a != keep])
    if last:
        shape = c.op("Concat", [c.i64(-1), c.op("Shape", [x], start=-1)], axis=0)
        return c.op("Reshape", [x, shape]), c.i64(0)
    shape = c.op("Concat", [c.op("Shape", [x], end=2), c.i64(-1)], axis=0)
    return c.op("Reshape", [x, shape]), c.i64(0, 2)


# -- activations ---------------------------------------------------------------------------------
@handler("Relu6")
def _relu6(c, n):
    return [c.op("Clip", [c.x(n), scalar(c, n, 0), scalar(c, n, 6)])]


@handler("LeakyRelu")
def _leaky(c, n):
    return [c.op("LeakyRelu", [c.x(n)], alpha=float(c.attr(n, "alpha", 0.2)))]


@handler("Softmax", "LogSoftmax")
def _softmax(c, n):
    return [c.op(n.op, [c.x(n)], axis=-1)]


@handler("BiasAdd", "BiasAddV1")
def _bias_add(c, n):
    x, r = c.x(n, 0), rank_of(c, n, 0)
    if r == 2 and _channels_last(c, n):
        y = gemm_plus(c, n, 0, c.x(n, 1))  # MatMul + bias: the Gemm's C
        if y is not None:
            return [y]
    y = c.op("Add", [x, _per_channel(c, n, c.x(n, 1), x, r)])
    # (channels first of unknown rank: the result has x's shape, which tells inference its rank)
    return [y if r is not None or _channels_last(c, n) else c.op("Reshape", [
        y, c.op("Shape", [x])])]


@handler("BiasAddGrad")
def _bias_add_grad(c, n):
    """The sum over every axis but the channels' (of any rank: TF's gradient of a while loop's
    BiasAdd may not know it)."""
    flat, axes = _channels_view(c, n, c.x(n), rank_of(c, n, 0))
    return [c.op("ReduceSum", [flat, axes], keepdims=0)]


@handler("L2Loss")
def _l2_loss(c, n):
    x = c.x(n)
    return [c.op("Div", [c.op("ReduceSum", [c.op("Mul", [x, x])], keepdims=0), scalar(c, n, 2)])]


# -- elementwise gradients (tf.gradients' *Grad ops) ---------------------------------------------
def _grad(*ops):
    """Register ``fn(c, n, a, b) -> value`` for gradient ops with two inputs (a, b)."""
    def deco(fn):
        return handler(*ops)(lambda c, n: [fn(c, n, c.x(n, 0), c.x(n, 1))])
    return deco


def _mul(c, *xs):
    y = xs[0]
    for x in xs[1:]:
        y = c.op("Mul", [y, x])
    return y


def _pick(c, n, cond, a, b=None):
    return c.op("Where", [cond, a, scalar(c, n, 0) if b is None else b])


@_grad("TanhGrad")
def _tanh_grad(c, n, y, dy):  # dy * (1 - y^2)
    return _mul(c, dy, c.op("Sub", [scalar(c, n, 1), _mul(c, y, y)]))


@_grad("SigmoidGrad")
def _sigmoid_grad(c, n, y, dy):  # dy * y * (1 - y)
    return _mul(c, dy, y, c.op("Sub", [scalar(c, n, 1), y]))


@_grad("RsqrtGrad")
def _rsqrt_grad(c, n, y, dy):  # -dy * y^3 / 2
    return _mul(c, dy, y, y, y, scalar(c, n, -0.5))


@_grad("SqrtGrad")
def _sqrt_grad(c, n, y, dy):  # dy / (2 y)
    return c.op("Div", [_mul(c, dy, scalar(c, n, 0.5)), y])


@_grad("ReciprocalGrad", "InvGrad")
def _reciprocal_grad(c, n, y, dy):  # -dy * y^2
    return c.op("Neg", [_mul(c, dy, y, y)])


@_grad("ReluGrad")
def _relu_grad(c, n, dy, x):
    return _pick(c, n, c.op("Greater", [x, scalar(c, n, 0)]), dy)


@_grad("Relu6Grad")
def _relu6_grad(c, n, dy, x):
    inside = c.op("And", [c.op("Greater", [x, scalar(c, n, 0)]), c.op("Less", [x, scalar(c, n, 6)])])
    return _pick(c, n, inside, dy)


@_grad("LeakyReluGrad")
def _leaky_relu_grad(c, n, dy, x):
    alpha = scalar(c, n, c.attr(n, "alpha", 0.2))
    return _pick(c, n, c.op("Greater", [x, scalar(c, n, 0)]), dy, _mul(c, dy, alpha))


# TF's EluGrad and SeluGrad take the negative branch where y < 0: at y = 0 (x = 0, or a tiny
# negative x whose output rounds to 0) Selu's is scale, not scale * alpha
@_grad("EluGrad")
def _elu_grad(c, n, dy, y):  # y < 0: dy * (y + 1), else dy
    return _pick(c, n, c.op("Less", [y, scalar(c, n, 0)]),
                 _mul(c, dy, c.op("Add", [y, scalar(c, n, 1)])), dy)


SELU_ALPHA, SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


@handler("Selu")
def _selu(c, n):
    """ONNX's Selu takes alpha and gamma as float32 attributes (TF's float64 Selu: 3e-8 off):
    float64 writes TF's kernel, x > 0 ? scale x : scale alpha (exp(x) - 1), with its constants
    (the exp on min(x, 0), so its gradient stays finite where it is not taken)."""
    x = c.x(n)
    if c.onnx_type(n) != TensorProto.DOUBLE:
        return [c.op("Selu", [x])]
    pos = c.op("Greater", [x, scalar(c, n, 0)])
    em1 = c.op("Sub", [c.op("Exp", [c.op("Where", [pos, scalar(c, n, 0), x])]),
                       scalar(c, n, 1)])
    return [c.op("Where", [pos, c.op("Mul", [x, scalar(c, n, SELU_SCALE)]),
                           c.op("Mul", [em1, scalar(c, n, SELU_SCALE * SELU_ALPHA)])])]


@_grad("SeluGrad")
def _selu_grad(c, n, dy, y):  # y < 0: dy * (y + scale * alpha), else dy * scale
    return _pick(c, n, c.op("Less", [y, scalar(c, n, 0)]),
                 _mul(c, dy, c.op("Add", [y, scalar(c, n, SELU_SCALE * SELU_ALPHA)])),
                 _mul(c, dy, scalar(c, n, SELU_SCALE)))


@_grad("SoftplusGrad")
def _softplus_grad(c, n, dy, x):
    """dy * sigmoid(x), sigmoid as exp(x - softplus(x)) below 0: onnxruntime's Sigmoid is exact
    to ~1e-7 absolute only there (2e-4 relative at -8, 0 from -20 in float32), as onnxgrad's
    own Softplus rule (rules/activations.py)."""
    below = c.op("Exp", [c.op("Sub", [x, c.op("Softplus", [x])])])
    neg = c.op("Less", [x, scalar(c, n, 0)])
    return _mul(c, dy, c.op("Where", [neg, below, c.op("Sigmoid", [x])]))


@_grad("SoftsignGrad")
def _softsign_grad(c, n, dy, x):  # dy / (1 + |x|)^2
    d = c.op("Add", [c.op("Abs", [x]), scalar(c, n, 1)])
    return c.op("Div", [dy, _mul(c, d, d)])


# -- losses --------------------------------------------------------------------------------------
@handler("SoftmaxCrossEntropyWithLogits")
def _softmax_xent(c, n):
    """(logits, labels) -> (loss = -sum(labels * log_softmax), backprop = softmax - labels)."""
    logits, labels = c.x(n, 0), c.x(n, 1)
    logp = c.op("LogSoftmax", [logits], axis=-1)
    loss = c.op("Neg", [c.op("ReduceSum", [_mul(c, labels, logp), c.i64(-1)], keepdims=0)])
    return [loss, c.op("Sub", [c.op("Softmax", [logits], axis=-1), labels])]


@handler("SparseSoftmaxCrossEntropyWithLogits")
def _sparse_softmax_xent(c, n):
    """(logits, class ids) -> (loss = -log_softmax[id], backprop = softmax - one_hot(id))."""
    logits, ids = c.x(n, 0), as_i64(c, c.x(n, 1))
    logp = c.op("LogSoftmax", [logits], axis=-1)
    col = c.op("Unsqueeze", [ids, c.i64(-1)])
    loss = c.op("Neg", [c.op("Squeeze", [c.op("GatherElements", [logp, col], axis=-1),
                                         c.i64(-1)])])
    depth = c.op("Squeeze", [c.op("Shape", [logits], start=-1)])
    classes = c.op("Range", [c.const(0, np.int64), depth, c.const(1, np.int64)])
    one_hot = c.op("Cast", [c.op("Equal", [col, classes])], to=c.onnx_type(n))
    return [loss, c.op("Sub", [c.op("Softmax", [logits], axis=-1), one_hot])]



@handler("LRN")
def _lrn(c, n):
    """TF's local response normalization over the last axis, x / (bias + alpha * sum of squares
    within depth_radius)^beta: ONNX's LRN over channels (NCHW) with size 2r + 1 and alpha times
    that size (ONNX divides alpha by it)."""
    r = int(c.attr(n, "depth_radius", 5))
    size = 2 * r + 1
    x = c.op("Transpose", [c.x(n)], perm=[0, 3, 1, 2])
    y = c.op("LRN", [x], size=size, alpha=float(c.attr(n, "alpha", 1.0)) * size,
             beta=float(c.attr(n, "beta", 0.5)), bias=float(c.attr(n, "bias", 1.0)))
    return [c.op("Transpose", [y], perm=[0, 2, 3, 1])]


@handler("LRNGrad")
def _lrn_grad(c, n):
    """(dy, x, y) -> dx as TF's kernel: with norm = bias + alpha * S(x^2), S the sum over the
    channels within depth_radius, dx = dy * norm^-beta - 2 alpha beta x S(dy y / norm) (the
    window is symmetric: the same S gathers each channel's terms back). S is a Conv of a row of
    ones over the channels of every pixel at once: x [N, H, W, C] viewed as one image [1, 1,
    N*H*W, C] (one large Conv; pixels as the batch would run N*H*W tiny ones)."""
    dy, x, y = (c.x(n, i) for i in range(3))
    rad = int(c.attr(n, "depth_radius", 5))
    alpha, beta = float(c.attr(n, "alpha", 1.0)), float(c.attr(n, "beta", 0.5))
    shape = c.op("Shape", [x])
    image = c.op("Concat", [c.i64(1, 1, -1), c.op("Shape", [x], start=-1)], axis=0)
    ones = c.const(np.ones([1, 1, 1, 2 * rad + 1], np_type(n)))

    def window(v):
        return c.op("Reshape", [c.op("Conv", [c.op("Reshape", [v, image]), ones],
                                     pads=[0, rad, 0, rad]), shape])
    norm = c.op("Add", [_mul(c, window(_mul(c, x, x)), scalar(c, n, alpha)),
                        scalar(c, n, float(c.attr(n, "bias", 1.0)))])
    back = window(c.op("Div", [_mul(c, dy, y), norm]))
    return [c.op("Sub", [_mul(c, dy, c.op("Pow", [norm, scalar(c, n, -beta)])),
                         _mul(c, x, back, scalar(c, n, 2 * alpha * beta))])]
