"""Gradient rules: convolutions and pooling.

Conv, ConvTranspose, AveragePool, LpPool, MaxPool, GlobalAveragePool, GlobalMaxPool, GlobalLpPool,
MaxUnpool and Col2Im, with standard ops of the same family, so that a gradient runs at the speed of
onnxruntime's own Conv/ConvTranspose kernels (MLAS) and has a gradient itself:

- Conv: dx is a ConvTranspose of g with W (same strides, dilations, group); with unit strides a
  Conv of g with W flipped in space and its channel axes swapped, which onnxruntime runs faster;
  on small images (up to 64 output positions, ungrouped 2-D float32; with unit strides fewer
  than 64, below the Trainer's blocked Conv) one Gemm of every image's columns with W and a
  Col2Im (:meth:`_Geo.long_from_cols`).
  dW of an ungrouped 1-D, 2-D or 3-D convolution with static geometry (up to 49 kernel taps) is
  one Gemm per tap: g [Co, N*O] times the strided slice of the padded x [C, N*O] that the tap
  sees, transposed (1.2x to 3x faster than the Conv form below on ResNet-sized layers in
  onnxruntime, one thread, measured; 3-D ones only with unit strides on images of at least 256
  output positions, where it is 1.4x to 2x faster, and slower otherwise); with few input
  channels (a first layer) the slices are stacked into one Gemm, which reads g once instead of
  once per tap; 1-D and 2-D ones with at least 16 input channels on images of at most 256
  output positions, or strided with few input channels (a stem), take one Gemm over
  channels-last im2col rows instead, made by one Gather,
  which onnxruntime runs on every thread where its Slice and Pad use one (ResNet-18's training
  step: 4 % less kernel time at 2 threads, the same at one, 23 MB less peak memory; measured).
  On images of more than 256 output positions each tap's (strided) rows are gathered from the
  channels-last image and multiplied per image, one batched MatMul per tap
  (:meth:`_Geo._weight_by_batched_taps`; no strided Slice, which onnxruntime runs on one
  thread: a 3x3 / 2 from 56x56, forward + dW 1.2x faster at one thread and 1.7x at two).
  Windows that tile the image (kernel = strides, no pads: a 2x2 / 2 ConvTranspose's output, a
  patchify Conv on a small image) take one Gemm over SpaceToDepth's columns where the per-tap
  form would cut strided Slices (2x to 2.6x faster, measured).
  dW of a depthwise convolution with unit strides on images of at least 256 output positions is
  per tap too: the slice times g, summed per channel (2x faster). Otherwise dW is a Conv of x
  with g as the kernel in which the images are the channels summed over (strides and dilations
  trade places); for 1-D and 2-D convolutions the channels become one more spatial axis in front
  (one large GEMM instead of one thin GEMM per channel: about 2x faster in onnxruntime,
  measured), for 3-D ones and depthwise kernels they become the batch. db is a ReduceSum of g.
- ConvTranspose: dx is the forward Conv of g with W; dW the same image/channel-swapped Conv with
  g as the image and x as the kernel; db a ReduceSum.
- AveragePool and LpPool: the adjoint of summing each window (a ConvTranspose with a ones kernel,
  or a Conv for unit strides) hands each window's share back to its elements, the channels folded
  into the batch so that C may be symbolic. AveragePool's divisors (count_include_pad, ceil_mode,
  dilations) are counted per axis: numpy constants for static shapes, else from run-time shapes.
- MaxPool: g is scattered to the argmax of each window. The forward's Indices output is reused when
  the node has one (made row-major for storage_order=1). Windows that are k x k tiles of the image
  (:func:`pool_tiles`: the usual MaxPool 2) need none: SpaceToDepth makes each tile a channel
  block, the first tap equal to the forward's y in row-major order is its first maximum (the
  element Indices names), g goes there and Col2Im (DepthToSpace in float64 or below opset 18)
  puts the tiles back (onnxruntime's MaxPool with Indices costs about 5x the one without;
  measured). Otherwise
  a second MaxPool with Indices recomputes the argmax on x. That is exact wherever a window sits
  (pads, dilations, ceil_mode) and breaks ties as the runtime's forward does, which comparing an
  upsampled y with x cannot do once windows overlap. Windows that cannot overlap (kernel extent
  <= stride) need a plain ScatterElements (opset 13); overlapping ones reduction="add" (opset 16;
  float16 adds in float32, which onnxruntime's CPU ScatterElements requires).
- GlobalMaxPool: g goes to the elements equal to the maximum, split evenly among ties.
- MaxUnpool: a Gather of g at the indices; Col2Im: a Conv of g with one-hot kernels (the im2col
  that Col2Im is the adjoint of).

Geometry. Along each spatial axis a strided window op ties a long side (Conv's and the pools' x,
ConvTranspose's y) to a short side (their y, ConvTranspose's x). The long side with ``b`` zeros in
front and ``e`` zeros behind it (e < 0: its last -e elements cut off) is exactly
``s*(O-1) + d*(k-1) + 1`` long, O the short side's length. :class:`_Geo` holds b and e:
- "static": b and e are numbers, every pad an attribute (static spatial dims, unit strides, and
  ConvTranspose without output_shape);
- "loose": symbolic spatial dims with explicit pads: b is known and e within s-1 of the end pad,
  so a pad that is sure to be enough, then a Slice to the run-time size;
- "runtime": auto_pad SAME with symbolic dims, ConvTranspose's output_shape with a symbolic input,
  or a kernel whose shape only the run time knows (as in second-order graphs): b and the windows'
  reach from Shape, an explicit Pad and Slice.
Batch dims are never read. The pads that auto_pad and output_shape imply follow the ONNX spec, as
onnxruntime does for Conv and ConvTranspose. onnxruntime's pools deviate from the spec for auto_pad
SAME with dilations > 1 (output size: those are refused) or a stride larger than the kernel
(negative pads: its MaxPool fails; the rule follows the spec). With ceil_mode, a last window that
would start in the end padding is dropped, as onnxruntime and onnx.reference do
(:func:`onnxgrad.inference.pool_out_len`). onnx's shape inference keeps that window, and
onnxruntime's static shapes with it, so such a pool is rewritten before any rule runs with the
equivalent pads and no ceil_mode (:func:`onnxgrad.inference.floor_pads`). Where no such pads
exist (AveragePool, count_include_pad=1, another axis with a partial last window) it averages
over x alone (count_include_pad=0) times constant factors, the divisors the runtimes use
(:func:`onnxgrad.inference.rescaled_floor_pads`); with dilations as well it is refused.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import onnx_ir as ir

from ..errors import NotDifferentiableError
from ..inference import floor_pads, pool_out_len
from ..registry import register
from .shape import END, HALF, INT64, kept_share
from .spec import attr

_MAX_TAPS = 49  # kernels up to 7x7 get the per-tap weight gradient (one Gemm per tap)
_TAPS_MIN = 256  # output positions per image from which a 3-D or depthwise dW pays per tap
_GATHER_MIN_C = 16  # dW from gathered channels-last rows (_Geo._weight_by_gather): channels
_GATHER_MAX = 256  # at least this many, output positions per image at most this many
_COLS_MAX = 64  # Conv's dx by one Gemm and Col2Im on images of up to 64 output positions,
BLOCKED_MIN = 64  # but with unit strides below this, where the Trainer blocks Convs (nchwc.py)


# -- helpers ---------------------------------------------------------------------------------------
def _auto_pad(n) -> str:
    a = attr(n, "auto_pad")
    return a.decode() if isinstance(a, bytes) else a


def _ints(v, count, default):
    return [int(i) for i in v] if v is not None else [default] * count


def _static_dims(v, nsp):
    """v's spatial dims as ints, or None when any is unknown."""
    s = v.shape
    if s is None or len(s) != nsp + 2 or not all(isinstance(i, int) for i in s[2:]):
        return None
    return list(s[2:])


def _kernel(n, w=None):
    """The kernel's spatial shape as ints, or None when only the run time knows it (a computed
    weight, as in the gradient graph of a Conv's weight gradient)."""
    k = n.attr("kernel_shape")
    if k is None and w is not None and w.shape is not None and len(w.shape) > 2 and all(
            isinstance(i, int) for i in w.shape[2:]):
        k = w.shape[2:]
    return None if k is None else [int(i) for i in k]


def _spatial_rank(n, k, w):
    if k is not None:
        return len(k)
    for v in (w, n.x):
        if v is not None and v.rank is not None:
            return v.rank - 2
    for name, per in (("strides", 1), ("dilations", 1), ("pads", 2), ("output_padding", 1)):
        if n.attr(name) is not None:
            return len(n.attr(name)) // per
    raise NotImplementedError(f"the gradient of {n.node.op_type} node {n.node.name!r} needs the "
                              "rank of its input: run onnx shape inference on the model first")


def _spatial_shape(e, v):
    """v's run-time spatial dims (1-D int64)."""
    return e.Slice(e.Shape(v), [2], [END])


def _dim(e, v, axis):
    """v's run-time dim at ``axis`` (a scalar int64)."""
    return e.Gather(e.Shape(v), e.const(np.array(axis, np.int64)))


def _bias_grad(n, g, nsp):
    if n.input(2) is None:
        return None
    return n.e.reduce("ReduceSum", g, [0, *range(2, 2 + nsp)], keepdims=0)


def _group_channels(w):
    """Channels per group of the long side: W's dim 1 for Conv and ConvTranspose alike."""
    if w.shape is not None and len(w.shape) > 1 and isinstance(w.shape[1], int):
        return w.shape[1]
    return None


def _out_channels(w):
    """W's dim 0 (the short side's channels in :meth:`_Geo.weight`) when static."""
    if w.shape is not None and len(w.shape) > 0 and isinstance(w.shape[0], int):
        return w.shape[0]
    return None


class _Geo:
    """Where a window op's windows fall along its spatial axes; see the module docstring."""

    def __init__(self, e, k, s, d, long, short, w=None):
        self.e, self.k, self.s, self.d = e, k, s, d
        self.nsp = len(s)
        if k is not None:  # the kernel's extent d*(k-1)+1: ints, or a run-time vector
            self.ek = [di * (ki - 1) + 1 for ki, di in zip(k, d)]
        else:
            self.ek = (_spatial_shape(e, w) - 1) * d + 1
        self.long, self.short = long, short
        self.axes = list(range(2, 2 + self.nsp))
        self.mode = None
        self.b = self.end = self.lo = self.hi = None  # static / loose
        self.bv = self.f0 = None  # runtime
        self.short_dims = None  # static short-side dims, when known
        self.pe = None  # the end pads of a pool (int list or run-time vector), for its counts

    def static(self, b, end, short_dims=None):
        self.mode, self.b, self.end, self.short_dims = "static", b, end, short_dims
        return self

    def loose(self, b, lo, hi):
        """b known; lo <= e <= hi."""
        self.mode, self.b, self.lo, self.hi = "loose", b, lo, hi
        return self

    def runtime(self, bv):
        e = self.e
        self.mode, self.bv = "runtime", bv
        self.f0 = (_spatial_shape(e, self.short) - 1) * self.s + self.ek
        return self

    def reads_nothing(self) -> bool:
        """Whether every window lies in the front padding along some axis (static geometry:
        b >= s*(O-1) + ek, so the long side cropped to the windows' reach is empty): then no
        product involves the long side, and the weight gradient is exactly zero."""
        dims = self._cropped_dims() if self.mode == "static" else None
        return dims is not None and any(d <= 0 for d in dims)

    def _attrs(self, pb, pe):
        return {"strides": self.s, "dilations": self.d, "pads": list(pb) + list(pe)}

    def _crop(self, t):
        """Static mode: t (long side) without its last -e elements where e < 0."""
        ends = [x if x < 0 else END for x in self.end]
        if all(x == END for x in ends):
            return t
        return self.e.Slice(t, [0] * self.nsp, ends, self.axes)

    def _fit(self, t):
        """Runtime mode: t (long side) padded by b in front and padded or cut to s*(O-1)+ek."""
        e = self.e
        tail = e.Max(self.f0 - self.bv - _spatial_shape(e, t), 0)
        padded = e.Pad(t, e.Concat([0, 0], self.bv, [0, 0], tail, axis=0))
        return e.Slice(padded, [0] * self.nsp, self.f0, self.axes)

    # -- the three linear maps ---------------------------------------------------------------
    def short_from_long(self, t, w, group):
        """Conv(t, w): t has the long side's length, the result the short side's."""
        e, zero = self.e, [0] * self.nsp
        if self.mode == "static":
            return e.Conv(self._crop(t), w, group=group,
                          **self._attrs(self.b, [max(x, 0) for x in self.end]))
        if self.mode == "runtime":
            return e.Conv(self._fit(t), w, group=group, **self._attrs(zero, zero))
        r = e.Conv(t, w, group=group, **self._attrs(self.b, [max(h, 0) for h in self.hi]))
        if any(h - lo >= s for h, lo, s in zip(self.hi, self.lo, self.s)):
            r = e.Slice(r, zero, _spatial_shape(e, self.short), self.axes)
        return r

    def long_from_short(self, t, w, group, flipped=None):
        """ConvTranspose(t, w): the adjoint of short_from_long. With unit strides, a Conv with
        the flipped kernel (``flipped()``: w's adjoint kernel, or None) where the pads allow:
        onnxruntime's Conv is faster than its ConvTranspose."""
        e, zero = self.e, [0] * self.nsp
        pads = self._flip_pads() if self.mode == "static" and flipped is not None else None
        if pads is not None:
            wf = flipped()
            if wf is not None:
                return e.Conv(t, wf, group=group, **self._attrs(*pads))
        if self.mode == "static":
            pe = [max(x, 0) for x in self.end]
            op = [max(-x, 0) for x in self.end]
            extra = [o if o >= s else 0 for o, s in zip(op, self.s)]  # keep output_padding < s
            op = [o - x for o, x in zip(op, extra)]
            r = e.ConvTranspose(t, w, group=group, output_padding=op if any(op) else None,
                                **self._attrs(self.b, pe))
            if any(extra):
                r = e.Pad(r, [0] * (self.nsp + 2) + [0, 0] + extra)
            return r
        if self.mode == "loose":
            pe = [max(lo, 0) for lo in self.lo]
            op = [p - lo for p, lo in zip(pe, self.lo)]  # < s: lo >= p_e - (s-1)
            r = e.ConvTranspose(t, w, group=group, output_padding=op if any(op) else None,
                                **self._attrs(self.b, pe))
            if any(h > lo for h, lo in zip(self.hi, self.lo)):
                r = e.Slice(r, zero, _spatial_shape(e, self.long), self.axes)
            return r
        full = e.ConvTranspose(t, w, group=group, **self._attrs(zero, zero))  # s*(O-1)+ek long
        dims = _spatial_shape(e, self.long)
        tail = e.Max(self.bv + dims - self.f0, 0)
        r = e.Pad(full, e.Concat([0] * (self.nsp + 2), [0, 0], tail, axis=0))
        return e.Slice(r, self.bv, self.bv + dims, self.axes)

    def cols_fit(self, t, w, group) -> bool:
        """Whether :meth:`long_from_cols` applies: an ungrouped 2-D float32 op with static
        geometry, W and images, and at most _COLS_MAX positions per short-side image. Not
        where the flipped Conv applies on images of BLOCKED_MIN positions or more: the Trainer
        runs that Conv in onnxruntime's blocked layout (training/nchwc.py), faster than the
        Gemm, Transpose and Col2Im (ResNet-18's 8x8 layers: its step 1.05x at 2 threads and
        1.03x at one; without the blocked layout the columns are 2 % faster at one thread)."""
        ws = w.shape
        if not (self.mode == "static" and self.nsp == 2 and group == 1 and self.e.opset >= 18
                and t.dtype == ir.DataType.FLOAT and self.short_dims is not None
                and math.prod(self.short_dims) <= _COLS_MAX
                and _static_dims(self.long, 2) is not None
                and ws is not None and len(ws) == 4 and all(isinstance(i, int) for i in ws)):
            return False
        return math.prod(self.short_dims) < BLOCKED_MIN or self._flip_pads() is None

    def _flip_pads(self) -> tuple[list, list] | None:
        """The pads (begin, end) of the flipped kernel's Conv that :meth:`long_from_short` takes
        (static geometry): unit strides, the forward's pads within the kernel; else None."""
        if any(s != 1 for s in self.s):
            return None
        pb = [k - 1 - b for k, b in zip(self.ek, self.b)]
        pe = [k - 1 - x for k, x in zip(self.ek, self.end)]
        return (pb, pe) if min(pb + pe) >= 0 else None

    def long_from_cols(self, t, w):
        """long_from_short as one Gemm and a Col2Im: the im2col columns of every image at once,
        t [N*O, Co] times W [Co, C*K], summed back into the images by Col2Im. onnxruntime's
        Conv and ConvTranspose run one GEMM per image, which re-reads W for each: on small
        images (ResNet-18's 2x2 and 4x4 layers at 64x64 input) that is 5x to 13x slower
        (measured, one thread), where this form is one GEMM over N*O rows."""
        e = self.e
        co, c, *k = w.shape
        o = math.prod(self.short_dims)
        rows = e.Reshape(e.Transpose(e.Reshape(t, [0, co, o]), perm=[0, 2, 1]), [-1, co])
        cols = e.Reshape(e.Gemm(rows, e.Reshape(w, [co, -1])), [-1, o, c * math.prod(k)])
        return e.Col2Im(e.Transpose(cols, perm=[0, 2, 1]), _static_dims(self.long, 2), k,
                        dilations=self.d, strides=self.s,
                        pads=list(self.b) + [max(x, 0) for x in self.end])

    def weight(self, inp, gy, group, cg, co=None):
        """dW [Co, cg, *k] of a window op with long side ``inp`` [N, group*cg, ...] and short side
        gradient ``gy`` [N, Co, ...] (``co``: Co when static): a Conv that sums over the images
        as its input channels, gy its kernel (strides and dilations trade places)."""
        e, zero = self.e, [0] * self.nsp
        if self.mode == "static":
            inp, pb, pe = self._crop(inp), self.b, [max(x, 0) for x in self.end]
            taps = math.prod(self.k) if self.k is not None else None  # None: a run-time kernel
            if taps is not None and taps <= _MAX_TAPS:
                if group == 1 and (self.nsp <= 2 or self.nsp == 3 and self._taps_pay()):
                    return self._weight_by_taps(inp, gy, pb, pe, cg, co)
                if cg == 1 and co == group > 1 and self.nsp <= 2 and self._taps_pay():
                    return self._weight_depthwise(inp, gy, pb, pe, co)
        elif self.mode == "loose":
            pb, pe = self.b, [max(h, 0) for h in self.hi]
        else:
            inp, pb, pe = self._fit(inp), zero, zero
        perm = [1, 0, *self.axes]
        if self.nsp <= 2 and cg != 1:
            # channels as one more spatial axis in front: one large GEMM for all channel pairs,
            # where channels as the batch (below) makes MLAS run one thin GEMM per channel
            # (about 2x slower, measured); depthwise kernels (cg = 1) gain nothing from it
            ker = e.Unsqueeze(e.Transpose(gy, perm=perm), [2])  # [Co, N, 1, *O]
            r = e.Conv(self._stack(inp, group, cg), ker, group=group, strides=[1, *self.d],
                       dilations=[1, *self.s], pads=[0, *pb, 0, *pe])
            r = e.Squeeze(r, [0])
        else:
            r = e.Conv(self._swap(inp, group, cg), e.Transpose(gy, perm=perm), group=group,
                       strides=self.d, dilations=self.s, pads=pb + pe)
            r = e.Transpose(r, perm=perm)
        if self.mode == "loose" and any(h - lo >= d for h, lo, d in zip(self.hi, self.lo, self.d)):
            r = e.Slice(r, zero, self.k, self.axes)
        return r

    def _tiles_pay(self, inp, pb, pe, c) -> bool:
        """Whether the windows are the s x s tiles of the long side (2-D, kernel = strides,
        unit dilations, no padding left after the crop: a 2x2 / 2 ConvTranspose, a patchify
        Conv), float32 or float64 (onnxruntime's CPU SpaceToDepth has no float16), for
        :meth:`_weight_by_tiles` where the per-tap form would take strided Slices. Where the
        gathered form applies it is as fast or faster (3x3-channel stems; 4x4 / 4 over 64
        channels of 32x32, 10.7 against 11.5 ms), and so is the Conv form of a 16x16 / 16
        ViT patch embedding (15.9 against 18.8 ms: SpaceToDepth with large blocks is slow)."""
        k = self.k
        return (self.nsp == 2 and c is not None and k is not None
                and k[0] == k[1] == self.s[0] == self.s[1] >= 2
                and all(di == 1 for di in self.d) and not any(pb) and not any(pe)
                and inp.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE))

    def _weight_by_tiles(self, inp, gt, c):
        """dW of a window op whose windows tile the long side (:meth:`_tiles_pay`): SpaceToDepth
        makes every window's s*s*C elements one column (tap-major, as its channel blocks are),
        and dW is one Gemm of gy [Co, N*O] with those columns. The per-tap form cuts s*s strided
        Slices, each reading the whole long side on one thread: a U-Net's 2x2 / 2 ConvTranspose
        from 32 channels of 32x32 to 16 of 64x64, batch 16, dW 4.5 -> 1.7 ms (2.1 at 2
        threads); a 2x2 / 2 Conv over 32 channels of 64x64, forward and dW 9.0 -> 5.5 ms
        (measured, one thread)."""
        e, s = self.e, self.k[0]
        t = e.Transpose(e.SpaceToDepth(inp, blocksize=s), perm=[1, 0, 2, 3])  # [s*s*C, N, *O]
        r = e.Gemm(gt, e.Reshape(t, [s * s * c, -1]), transB=1)                # [Co, s*s*C]
        return e.Transpose(e.Reshape(r, [0, s, s, c]), perm=[0, 3, 1, 2])

    def _weight_depthwise(self, inp, gy, pb, pe, co):
        """dW [C, 1, *k] of a depthwise window op (group = C = Co): per kernel tap, the tap's
        strided slice of the padded x times g, summed per channel over the images and
        positions. The Conv form of :meth:`weight` runs one GEMM per channel over im2col
        columns as large as the image: a 3x3 over 96 channels of 28x28, batch 8, 9.7 ms against
        3.6 ms this way (onnxruntime, one thread, measured; where it pays: :meth:`_taps_pay`)."""
        e = self.e
        gt = e.Transpose(gy, perm=[1, 0, *self.axes])              # [C, N, *O]
        sums = [e.reduce("ReduceSum", e.Reshape(cut * gt, [co, -1]), [1])   # [C, 1]
                for cut in self._tap_slices(inp, pb, pe)]
        r = sums[0] if len(sums) == 1 else e.Concat(*sums, axis=1)          # [C, K]
        return e.Reshape(r, [co, 1, *self.k])

    def _tap_slices(self, inp, pb, pe):
        """The strided slice [C, N, *O] of the long side inp [N, C, *L], channels first and
        padded by pb / pe, that each kernel tap sees, in row-major tap order."""
        e = self.e
        t = e.Transpose(inp, perm=[1, 0, *self.axes])              # [C, N, *L]
        if any(pb) or any(pe):
            t = e.Pad(t, [0, 0, *pb, 0, 0, *pe])
        steps = None if all(si == 1 for si in self.s) else self.s
        for starts, ends in self._tap_windows():
            if steps is None and all(st == 0 for st in starts) and all(x == END for x in ends):
                yield t                                            # a 1x1 kernel
            else:
                yield e.Slice(t, starts, ends, self.axes, steps)

    def _tap_windows(self):
        """Per kernel tap in row-major order, the Slice starts and ends along the spatial axes
        of the padded long side (END: to the end) that the tap's windows read."""
        reach = [di * (ki - 1) for ki, di in zip(self.k, self.d)]
        for tap in itertools.product(*[range(ki) for ki in self.k]):
            starts = [a * di for a, di in zip(tap, self.d)]
            yield starts, [st - r if st < r else END for st, r in zip(starts, reach)]

    def _taps_pay(self) -> bool:
        """Whether a 3-D or a depthwise window op's dW is faster per kernel tap than as the Conv
        form of :meth:`weight`: with unit strides over at least _TAPS_MIN output positions per
        image. Measured (onnxruntime, one thread, dW or fwd+dW): 3-D 3x3x3 layers, batch 2, 64
        channels on 8x28x28 42 -> 22 ms and 128 on 4x14x14 14 -> 10 ms, but 256 on 2x7x7 6.0
        -> 8.0 ms and stride 2 8.2 -> 10.3 and 3.2 -> 4.2 ms; depthwise, batch 8, 3x3 over 96
        channels of 28x28 6.7-7.1 -> 3.1-4.1 ms and 32 of 112x112 34-44 -> 26-29 ms, but stride
        2 on 56x56 7.6-8.9 -> 12-14 ms and 5x5 on 7x7 3.5-3.9 -> 4.4-4.8 ms."""
        dims = self.short_dims or _static_dims(self.short, self.nsp)
        return all(si == 1 for si in self.s) and dims is not None and \
            math.prod(dims) >= _TAPS_MIN

    def _weight_by_taps(self, inp, gy, pb, pe, c=None, co=None):
        """dW of an ungrouped 1-D, 2-D or 3-D window op, one Gemm per kernel tap: with the long side
        padded to exactly s*(O-1) + d*(k-1) + 1, tap a sees the strided slice starting at a*d,
        and dW[:, :, a] = gy [Co, N*O] times that slice [C, N*O] transposed. Each Gemm is one
        large MLAS GEMM (inner size N*O); onnxruntime runs the channels-as-spatial Conv of
        :meth:`weight` 1.2x to 3x slower on ResNet-sized layers (measured, one thread).
        Where few input channels meet many output channels (Co (K-1) > 2 K C for K taps: a
        network's first layer), or the slices are smaller than dW (N*O < Co: small images) the
        K slices are stacked into one [C*K, N*O] operand of a single Gemm instead, which reads
        gy once rather than K times and writes dW in place, with no Concat of K [Co, C] pieces
        (ResNet-18's 7x7 stem on 3x64x64, batch 32: 2.6x faster; the issue's 1->16 3x3 layer:
        3x; the dW of its 2x2 layer4 convolutions: 15% less kernel time, the Concat gone;
        measured one thread)."""
        e = self.e
        gt = e.Reshape(e.Transpose(gy, perm=[1, 0, *self.axes]), [0, -1])   # [Co, N*O]
        taps, cuts = [], []
        K = math.prod(self.k)
        n = gy.shape[0] if gy.shape is not None and isinstance(gy.shape[0], int) else None
        small = n is not None and self.short_dims is not None and \
            co is not None and n * math.prod(self.short_dims) < co
        stacked = K > 1 and c is not None and co is not None and (
            co * (K - 1) > 2 * K * c or small)
        if self._gather_pays(c, K, pb, pe, stacked):
            return self._weight_by_gather(inp, gt, pb, c, K)
        if not stacked and self._batched_pays(inp, c, K):
            return self._weight_by_batched_taps(inp, gy, pb, pe, c)
        if self._tiles_pay(inp, pb, pe, c):
            return self._weight_by_tiles(inp, gt, c)
        for cut in self._tap_slices(inp, pb, pe):                  # [C, N, *O]
            if stacked:
                cuts.append(e.Unsqueeze(cut, [1]))                 # [C, 1, N, *O]
            else:
                taps.append(e.Gemm(gt, e.Reshape(cut, [0, -1]), transB=1))  # [Co, C]
        if stacked:  # rows (c, tap): the Gemm's [Co, C*K] is dW's layout already
            r = e.Gemm(gt, e.Reshape(e.Concat(*cuts, axis=1), [c * K, -1]), transB=1)
            return e.Reshape(r, [0, c, *self.k])
        if len(taps) == 1:
            return e.Reshape(taps[0], [0, 0, *self.k])
        r = e.Concat(*[e.Unsqueeze(t_, [2]) for t_ in taps], axis=2)   # [Co, C, K]
        return e.Reshape(r, [0, 0, *self.k])

    def _batched_pays(self, inp, c, K) -> bool:
        """Whether :meth:`_weight_by_batched_taps` applies: a float32 or float64 1-D or 2-D op
        (not a 1x1 one with unit strides, which reads x as it is) with static channels and more
        than _GATHER_MAX output positions per image (large images, where the gathered form
        would copy x K times at once)."""
        return (self.nsp <= 2 and (K > 1 or any(si > 1 for si in self.s)) and c is not None
                and inp.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE)
                and self.short_dims is not None
                and math.prod(self.short_dims) > _GATHER_MAX
                and self._cropped_dims() is not None)

    def _weight_by_batched_taps(self, inp, gy, pb, pe, c):
        """dW per kernel tap on large images, each tap one batched MatMul over the images:
        g [N, Co, O] times the tap's slice of channels-last x [N, O, C], summed over N. The
        per-tap Gemm of :meth:`_weight_by_taps` has an inner size of N*O and an output of only
        Co x C, which MLAS cannot split well across threads; per image the GEMMs run on every
        thread, and channels-last slices copy rows of W*C floats. A U-Net's 3x3 layers on 32x32
        and 64x64 images (batch 16, 16 to 64 channels, forward + dW): 0.80x to 0.97x the time
        at 2 threads, 0.93x to 1.01x at one (measured). The tap's rows are a Gather from the
        flat padded image, not a Slice: onnxruntime runs Gather on every thread and Slice on
        one (the U-Net row's whole step 1.055x faster at 2 threads, 0.99x at one; ResNet-18's
        1.018x at 2; A/B in alternated processes, session 26). With strides the rows are the
        strided window's, where the per-tap form cut strided Slices on one thread: a ResNet's
        3x3 / 2 from 64 channels of 56x56 to 128, batch 16, forward + dW 48.7 -> 40.7 ms at one
        thread and 35.5 -> 20.7 ms at two (the gathered form, which would copy x 9 times at
        once: 45.8 and 22.7; measured). Every target shape is static (an empty batch reshapes
        without a -1)."""
        e = self.e
        o = math.prod(self.short_dims)
        t = e.Transpose(inp, perm=[0, *self.axes, 1])                   # [N, *L, C]
        if any(pb) or any(pe):
            t = e.Pad(t, [0, *pb, 0, 0, *pe, 0])
        padded = [n + b + a for n, b, a in zip(self._cropped_dims(), pb, pe)]
        t = e.Reshape(t, [0, math.prod(padded), c])                    # [N, Lp, C]
        g3 = e.Reshape(gy, [0, 0, o])                                   # [N, Co, O]
        # each tap's window as rows of the flat padded image: a Gather, which onnxruntime runs
        # on every thread (its Slice runs on one)
        pos = np.indices(self.short_dims).reshape(self.nsp, -1) * np.array(self.s)[:, None]
        at = np.ravel_multi_index(pos, padded)
        taps = []
        for starts, _ in self._tap_windows():
            rows = at + int(np.ravel_multi_index(starts, padded))
            cut = e.Gather(t, rows.astype(np.int64), axis=1)              # [N, O, C]
            taps.append(e.Unsqueeze(e.ReduceSum(e.MatMul(g3, cut), [0], keepdims=0), [2]))
        return e.Reshape(e.Concat(*taps, axis=2), [0, 0, *self.k])      # [Co, C, K]

    def _cropped_dims(self):
        """Static mode: the long side's spatial dims after :meth:`_crop`, when static."""
        dims = _static_dims(self.long, self.nsp)
        return None if dims is None else [n + min(x, 0) for n, x in zip(dims, self.end)]

    def _gather_pays(self, c, K, pb, pe, stacked) -> bool:
        """Whether :meth:`_weight_by_gather` applies and pays: a 1-D or 2-D op with static
        spatial dims and something to gather (not a 1x1 kernel that reads x as it is), with
        at least _GATHER_MIN_C channels (the rows the Gather copies) and at most _GATHER_MAX
        output positions per image, or with strides where the taps would be ``stacked``: a
        strided stem's K strided Slices run on one thread (ResNet-18's 7x7 / 2 on 3 channels:
        its step 1.04x at 2 threads and 1.02x at one with the Gather; MobileNetV3's 3x3 / 2
        1.01x; unit strides gain nothing, measured)."""
        whole = K == 1 and all(si == 1 for si in self.s) and not any(pb) and not any(pe)
        if self.nsp > 2 or whole or c is None or self.short_dims is None \
                or self._cropped_dims() is None:
            return False
        if stacked:
            return any(si > 1 for si in self.s)
        return c >= _GATHER_MIN_C and math.prod(self.short_dims) <= _GATHER_MAX

    def _weight_by_gather(self, inp, gt, pb, c, K):
        """dW as one Gemm over channels-last im2col rows: x made [N, L, C] (with a zero row
        behind it when a window reaches into the padding), one Gather of the rows that each
        output position's taps read, [N*O, K*C], and gt [Co, N*O] times that. onnxruntime
        runs Slice and Pad on one thread, Gather on all of them: ResNet-18's 3x3 layers on
        4x4 to 16x16 images (batch 32, forward + dW alone) take 0.65x to 0.81x the per-tap
        form's time at 2 threads and 0.88x to 1.08x at one. One Gemm of width K*C runs a
        little slower in MLAS than K of width C, so on larger images the per-tap form wins at
        one thread (32x32: this form 1.3x slower; measured)."""
        e, dims = self.e, self._cropped_dims()
        L = math.prod(dims)
        pos = np.indices([*self.short_dims, *self.k])  # each output position and tap
        at = [pos[j] * si + pos[self.nsp + j] * di - bj      # the input coordinate they read
              for j, (si, di, bj) in enumerate(zip(self.s, self.d, pb))]
        valid = np.all([(a >= 0) & (a < n) for a, n in zip(at, dims)], axis=0)
        flat = np.ravel_multi_index(at, dims, mode="clip")
        idx = np.where(valid, flat, L).reshape(math.prod(self.short_dims), K)
        t = e.Transpose(inp, perm=[0, *self.axes, 1])                  # [N, *L, C]
        t = e.Reshape(t, [0, L, c])
        if not valid.all():
            t = e.Pad(t, [0, 0, 0, 0, 1, 0])                            # [N, L+1, C]
        u = e.Reshape(e.Gather(t, idx, axis=1), [-1, K * c])         # [N*O, K*C]
        r = e.Reshape(e.Gemm(gt, u), [0, K, c])                      # [Co, K, C]
        return e.Reshape(e.Transpose(r, perm=[0, 2, 1]), [0, c, *self.k])

    def _grouped(self, t, group, cg):
        """[N, group*cg, *L] -> [N, group, cg, *L], and the [1] tensors N * group and cg. Every
        target dim is explicit (no -1): the long side may be empty (windows that read only
        padding crop it to length 0), where a -1 cannot be inferred and a 0 needs allowzero."""
        e, az = self.e, self._allowzero()
        static = t.shape is not None and all(isinstance(i, int) for i in t.shape)
        if static and cg is not None:
            n, *sp = t.shape[0], *t.shape[2:]
            return (e.Reshape(t, [n, group, cg, *sp], allowzero=az), e.const(np.array([n * group])),
                    e.const(np.array([cg])))
        cgv = [cg] if cg is not None else e.Reshape(e.Div(_dim(e, t, 1), group), [1])
        n = e.Slice(e.Shape(t), [0], [1])
        u = e.Reshape(t, e.Concat(n, [group], cgv, _spatial_shape(e, t), axis=0), allowzero=az)
        return u, n * group, e.Reshape(cgv, [1]) if cg is None else e.const(np.array([cg]))

    def _stack(self, t, group, cg):
        """[N, group*cg, *L] -> [1, group*N, cg, *L] with channel j*N + n = t[n, j*cg + c]."""
        e = self.e
        if group == 1:
            return e.Unsqueeze(t, [0])
        u, gn, cgv = self._grouped(t, group, cg)
        u = e.Transpose(u, perm=[1, 0, 2, *range(3, 3 + self.nsp)])       # [group, N, cg, *L]
        return e.Reshape(u, e.Concat([1], gn, cgv, _spatial_shape(e, t), axis=0),
                         allowzero=self._allowzero())

    def _swap(self, t, group, cg):
        """[N, group*cg, *L] -> [cg, group*N, *L] with channel j*N + n = t[n, j*cg + c]."""
        e = self.e
        if group == 1:
            return e.Transpose(t, perm=[1, 0, *self.axes])
        u, gn, cgv = self._grouped(t, group, cg)
        u = e.Transpose(u, perm=[2, 1, 0, *range(3, 3 + self.nsp)])       # [cg, group, N, *L]
        return e.Reshape(u, e.Concat(cgv, gn, _spatial_shape(e, t), axis=0),
                         allowzero=self._allowzero())

    def _allowzero(self):
        """allowzero=1 for a Reshape whose target may hold a 0 dim: the long side is cut to
        length 0 where every window starts in the front padding (pads >= the kernel's extent;
        Reshape-13 has no allowzero, so such a model is upgraded to opset 14)."""
        if self.e.opset >= 14:
            return 1
        if self.mode == "static" and any(b >= k for b, k in zip(self.b, self.ek)):
            self.e.need(14)
        return None


def _flipped(e, w, group, nsp):
    """Conv's kernel W [M, C/G, *k] as the kernel of its adjoint: [C, M/G, *k] reversed in
    space (None unless W's shape is static)."""
    if w.shape is None or not all(isinstance(i, int) for i in w.shape):
        return None
    m, cg, *k = w.shape
    if group == 1:
        t = e.Transpose(w, perm=[1, 0, *range(2, 2 + nsp)])
    else:
        t = e.Reshape(w, [group, m // group, cg, *k])
        t = e.Transpose(t, perm=[0, 2, 1, *range(3, 3 + nsp)])
        t = e.Reshape(t, [group * cg, m // group, *k])
    return e.Slice(t, [-1] * nsp, [np.iinfo(np.int64).min] * nsp, list(range(2, 2 + nsp)),
                   [-1] * nsp)


def _window_geo(n, k, s, d, x, g, ceil=False, w=None):
    """Geometry of Conv and the pools: the long side is x, the short side g."""
    e, nsp = n.e, len(s)
    geo = _Geo(e, k, s, d, long=x, short=g, w=w)
    ek, auto, dims = geo.ek, _auto_pad(n), _static_dims(x, nsp)
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        if dims is None or k is None:
            total = e.Max((_spatial_shape(e, g) - 1) * s + ek - _spatial_shape(e, x), 0)
            half = e.Div(total, 2)
            bv = half if auto == "SAME_UPPER" else total - half
            geo.pe = total - bv
            return geo.runtime(bv)
        out = [-(-di // si) for di, si in zip(dims, s)]
        total = [max(0, (o - 1) * si + eki - di) for o, si, eki, di in zip(out, s, ek, dims)]
        b = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in total]
        geo.pe = [t - bi for t, bi in zip(total, b)]
    else:
        pads = _ints(n.attr("pads") if auto == "NOTSET" else None, 2 * nsp, 0)
        b, geo.pe = pads[:nsp], pads[nsp:]
        if k is None:  # Conv only: pads known, the windows' reach from run-time shapes
            return geo.runtime(e.const(np.array(b, np.int64)))
        if dims is None and all(si == 1 for si in s):  # unit strides: e is the end pad
            return geo.static(b, list(geo.pe))
        if dims is None:
            return geo.loose(b, [p - (si - 1) for p, si in zip(geo.pe, s)],
                             [p + (si - 1 if ceil else 0) for p, si in zip(geo.pe, s)])
        out = [pool_out_len(di, bi, pi, eki, si, ceil)
               for di, bi, pi, eki, si in zip(dims, b, geo.pe, ek, s)]
    end = [si * (o - 1) + eki - di - bi for si, o, eki, di, bi in zip(s, out, ek, dims, b)]
    return geo.static(b, end, out)


def _conv_attrs(n, nsp):
    return (_ints(n.attr("strides"), nsp, 1), _ints(n.attr("dilations"), nsp, 1),
            int(attr(n, "group")))


# -- Conv and ConvTranspose ------------------------------------------------------------------------
@register("Conv")
def _conv(n, g):
    x, w = n.x, n.ins[1]
    k = _kernel(n, w)
    nsp = _spatial_rank(n, k, w)
    s, d, group = _conv_attrs(n, nsp)
    geo = _window_geo(n, k, s, d, x, g, w=w)
    if geo.cols_fit(g, w, group):
        dx = geo.long_from_cols(g, w)
    else:
        dx = geo.long_from_short(g, w, group, lambda: _flipped(n.e, w, group, nsp))
    dw = n.e.zeros_like(w) if geo.reads_nothing() else \
        geo.weight(x, g, group, _group_channels(w), _out_channels(w))
    return dx, dw, _bias_grad(n, g, nsp)


def _transpose_geo(n, k, s, d, x, g):
    """Geometry of ConvTranspose: the long side is y (g), the short side x."""
    e, nsp = n.e, len(s)
    geo = _Geo(e, k, s, d, long=g, short=x, w=n.ins[1])
    ek, auto = geo.ek, _auto_pad(n)
    op = _ints(n.attr("output_padding"), nsp, 0)
    out_shape = n.attr("output_shape")
    upper = auto == "SAME_UPPER"
    if out_shape is not None:  # pads from the spec's total_padding; the extra goes to the end
        out = [int(i) for i in out_shape[-nsp:]]  # for SAME_UPPER only, else to the beginning
        dims = _static_dims(x, nsp)
        if dims is None or k is None:
            full = (_spatial_shape(e, x) - 1) * s + op + ek
            total = e.Max(full - out, 0)
            half = e.Div(total, 2)
            return geo.runtime(half if upper else total - half)
        total = [max(0, si * (di - 1) + o + eki - oi)
                 for si, di, o, eki, oi in zip(s, dims, op, ek, out)]
        b = [t // 2 if upper else t - t // 2 for t in total]
        end = [si * (di - 1) + eki - bi - oi for si, di, eki, bi, oi in zip(s, dims, ek, b, out)]
    elif auto in ("SAME_UPPER", "SAME_LOWER"):  # y is x*s long
        if any(op) or (k is not None and any(eki < si for eki, si in zip(ek, s))):
            # onnx's shape inference makes y x*s + output_padding long, onnxruntime x*s; and
            # a kernel shorter than the stride pads by a negative amount, which onnxruntime
            # takes and the gradient's Conv cannot: a gradient sized either way is wrong
            raise NotDifferentiableError(
                n.node.op_type, n.node.domain, n.opset, n.node.name, [],
                reason=f"auto_pad {auto} with " + (
                    "output_padding: onnxruntime and onnx's shape inference size its output "
                    "differently" if any(op) else "a kernel shorter than the stride: "
                    "onnxruntime pads it by a negative amount") + "; give pads (auto_pad "
                "NOTSET) instead")
        if k is None:
            total = e.Max(ek + [o - si for o, si in zip(op, s)], 0)
            half = e.Div(total, 2)
            return geo.runtime(half if upper else total - half)
        total = [max(0, o + eki - si) for o, eki, si in zip(op, ek, s)]
        b = [t // 2 if upper else t - t // 2 for t in total]
        end = [eki - si - bi for eki, si, bi in zip(ek, s, b)]
    else:
        pads = _ints(n.attr("pads") if auto == "NOTSET" else None, 2 * nsp, 0)
        b = pads[:nsp]
        end = [p - o for p, o in zip(pads[nsp:], op)]
    return geo.static(b, end)


@register("ConvTranspose")
def _conv_transpose(n, g):
    x, w = n.x, n.ins[1]
    k = _kernel(n, w)
    nsp = _spatial_rank(n, k, w)
    s, d, group = _conv_attrs(n, nsp)
    geo = _transpose_geo(n, k, s, d, x, g)
    if geo.reads_nothing():  # y holds nothing but output padding (and bias) along some axis
        return n.e.zeros_like(x), n.e.zeros_like(w), _bias_grad(n, g, nsp)
    dx = geo.short_from_long(g, w, group)
    dw = geo.weight(g, x, group, _group_channels(w), _out_channels(w))
    return dx, dw, _bias_grad(n, g, nsp)


# -- average and Lp pooling ------------------------------------------------------------------------
def _pool_attrs(n):
    """kernel, strides, dilations; refuses auto_pad SAME with dilations, where onnxruntime sizes
    the output unlike the spec (and onnx.reference, whose shapes the rule would build on)."""
    k = n.attr("kernel_shape")
    nsp = len(k)
    s, d = _ints(n.attr("strides"), nsp, 1), _ints(n.attr("dilations"), nsp, 1)
    if _auto_pad(n).startswith("SAME") and any(di != 1 for di in d):
        raise NotDifferentiableError(
            n.node.op_type, n.node.domain, n.opset, n.node.name, [],
            reason="auto_pad SAME with dilations: onnxruntime sizes its output unlike the ONNX "
                   "spec, so no gradient graph matches both; give explicit pads instead")
    dims = _static_dims(n.x, nsp)
    attrs = {a: n.attr(a) for a in ("ceil_mode", "kernel_shape", "strides", "dilations", "pads",
                                    "count_include_pad")}
    attrs["auto_pad"] = _auto_pad(n)
    pads = None if dims is None else floor_pads(n.node.op_type, attrs, dims)
    if pads is not None:  # (the graphs' other such pools were rewritten without ceil_mode)
        raise NotDifferentiableError(
            n.node.op_type, n.node.domain, n.opset, n.node.name, [],
            reason="ceil_mode drops a last window that onnx's shape inference, and so "
                   "onnxruntime's static shapes, keep; " + (
                       "no equivalent pads exist with count_include_pad=1 here" if pads is False
                       else "the pool is in a model-local function, where it is not rewritten "
                            f"with the equivalent pads {pads} and no ceil_mode: inline the "
                            "function (onnx.inliner.inline_local_functions) or give the pool "
                            "those pads"))
    return k, s, d


def _pool_geo(n):
    k, s, d = _pool_attrs(n)
    return _window_geo(n, k, s, d, n.x, n.gs[0], ceil=bool(attr(n, "ceil_mode")))


def _spread(n, geo, t):
    """Every window's value of t handed to each element of x the window covers (the adjoint of
    summing over windows), channel by channel."""
    e = n.e
    ones = e.const(np.ones([1, 1, *geo.k]), t.dtype)
    if geo.short_dims is not None:
        flat = [-1, 1, *geo.short_dims]
    else:
        flat = e.Concat([-1, 1], _spatial_shape(e, t), axis=0)
    r = geo.long_from_short(e.Reshape(t, flat), ones, 1, lambda: ones)
    return e.Reshape(r, e.Shape(n.x))


def _counts_static(geo, dims, incl):
    """Per axis, how many taps of each window the divisor counts (numpy)."""
    out = []
    for i in range(geo.nsp):
        s, d, k, b = geo.s[i], geo.d[i], geo.k[i], geo.b[i]
        start = np.arange(geo.short_dims[i]) * s - b
        hi = dims[i] + geo.pe[i] if incl else dims[i]
        top = np.minimum(k, (np.maximum(hi - start, 0) + d - 1) // d)
        bottom = 0 if incl else (np.maximum(-start, 0) + d - 1) // d
        out.append(np.maximum(top - bottom, 0))
    return out


def _counts_runtime(n, geo, incl):
    """The same counts from run-time shapes (int64 vectors)."""
    e, x, g = n.e, n.x, n.gs[0]
    out = []
    for i in range(geo.nsp):
        s, d, k = geo.s[i], geo.d[i], geo.k[i]
        b = geo.b[i] if geo.bv is None else e.Gather(geo.bv, e.const(np.array(i)))
        start = e.Range(0, _dim(e, g, 2 + i), 1) * s - b
        hi = _dim(e, x, 2 + i)
        if incl:
            hi = hi + (geo.pe[i] if geo.bv is None else e.Gather(geo.pe, e.const(np.array(i))))
        top = e.Min(e.Div(e.Max(hi - start, 0) + (d - 1), d), k)
        if not incl:
            top = e.Max(top - e.Div(e.Max(-start, 0) + (d - 1), d), 0)
        out.append(top)
    return out


def _inverse_counts(n, geo, incl, dtype):
    """1 / the divisor of each window of AveragePool: a python number when every window counts
    prod(k) taps, else a tensor broadcasting against g."""
    nsp, full = geo.nsp, math.prod(geo.k)
    ceil = bool(attr(n, "ceil_mode"))
    padded = geo.bv is not None or any(geo.b) or any(geo.pe)
    if not ceil and (incl or not padded):  # every window lies inside the (padded) input
        return 1.0 / full
    e, w = n.e, None
    if geo.mode == "static" and geo.short_dims is not None:
        counts = _counts_static(geo, _static_dims(n.x, nsp), incl)
        if all((c == geo.k[i]).all() for i, c in enumerate(counts)):
            return 1.0 / full
        grid = np.ones([1, 1] + [1] * nsp)
        for i, c in enumerate(counts):
            grid = grid * c.reshape([1, 1] + [-1 if j == i else 1 for j in range(nsp)])
        return e.const(1.0 / grid, dtype)
    for i, c in enumerate(_counts_runtime(n, geo, incl)):
        c = e.Reshape(e.Cast(c, to=dtype), [1, 1] + [-1 if j == i else 1 for j in range(nsp)])
        w = c if w is None else w * c
    return e.Reciprocal(w)


@register("AveragePool")
def _average_pool(n, g):
    geo = _pool_geo(n)
    w = _inverse_counts(n, geo, bool(attr(n, "count_include_pad")), g.dtype)
    return _spread(n, geo, g * w)


def _lp_parts(n, g, y):
    """g / y^(p-1) and x|x|^(p-2) (sign(x) for p=1): their product is the Lp norm's gradient."""
    e, x = n.e, n.x
    p = attr(n, "p")
    p = int(p) if float(p).is_integer() else float(p)
    if p == 1:
        return g, e.Sign(x)
    # y = 0 only where every element of the window is 0, whose gradient factor is 0 as well
    safe = e.Where(e.Equal(y, e.const(0, y.dtype)), e.const(1, y.dtype), y)
    q = g / (safe if p == 2 else e.Pow(safe, e.const(p - 1, y.dtype)))
    return q, (x if p == 2 else e.Sign(x) * e.Pow(e.Abs(x), e.const(p - 1, x.dtype)))


@register("LpPool")
def _lp_pool(n, g):
    q, factor = _lp_parts(n, g, n.y)
    return _spread(n, _pool_geo(n), q) * factor


# -- global pools ----------------------------------------------------------------------------------
def _spatial_axes(n, x):
    if x.rank is not None:
        return list(range(2, x.rank))
    return n.e.Range(2, n.e.Size(n.e.Shape(x)), 1)


@register("GlobalAveragePool")
def _global_average_pool(n, g):
    e, x = n.e, n.x
    dims = x.shape[2:] if x.shape is not None else None
    static = dims is not None and all(isinstance(i, int) for i in dims)
    return e.broadcast_to(e.over_count(g, math.prod(dims) if static else
                                       e.Div(e.Size(x), e.Size(g))), x)


@register("GlobalMaxPool")
def _global_max_pool(n, g):
    e, x = n.e, n.x
    hit = e.Cast(e.Equal(x, n.y), to=g.dtype)
    return hit * (g / e.reduce("ReduceSum", hit, _spatial_axes(n, x), keepdims=1))


@register("GlobalLpPool")
def _global_lp_pool(n, g):
    q, factor = _lp_parts(n, g, n.y)
    return q * factor


# -- max pooling -----------------------------------------------------------------------------------
def _row_major(n, idx, x, nsp):
    """MaxPool indices of storage_order=1 (each image plane column-major) made row-major."""
    e = n.e
    dims = _static_dims(x, nsp)
    if dims is None:
        dims = [_dim(e, x, 2 + i) for i in range(nsp)]
    plane = dims[0]
    for dm in dims[1:]:
        plane = plane * dm
    rem = e.Mod(idx, plane)
    base = idx - rem
    coords = []
    for dm in dims[:-1]:  # the first spatial axis varies fastest
        coords.append(e.Mod(rem, dm))
        rem = e.Div(rem, dm)
    coords.append(rem)
    flat = coords[0]
    for c, dm in zip(coords[1:], dims[1:]):
        flat = flat * dm + c
    return base + flat


def _blind_windows(n, d):
    """Where MaxPool's windows read only padding (None when none can): with dilations a
    window's taps may all skip x. onnxruntime then outputs -FLT_MAX, a constant, and an index
    off its window, which may even fall into another image or channel, so those windows'
    gradients are dropped. A window sees x when each axis has a tap inside x: the pools'
    count of non-padding taps (:func:`_counts_static`, :func:`_counts_runtime`) is nonzero."""
    auto = _auto_pad(n)
    padded = auto.startswith("SAME") or (auto == "NOTSET" and any(n.attr("pads") or []))
    if all(di == 1 for di in d) or not padded:
        return None
    e, geo = n.e, _pool_geo(n)
    if geo.mode == "static" and geo.short_dims is not None:
        counts = _counts_static(geo, _static_dims(n.x, geo.nsp), False)
        seen = np.ones([1, 1] + [1] * geo.nsp, bool)
        for i, c in enumerate(counts):
            seen = seen & (c > 0).reshape([1, 1] + [-1 if j == i else 1 for j in range(geo.nsp)])
        return None if seen.all() else e.const(~seen)
    blind = None
    for i, c in enumerate(_counts_runtime(n, geo, False)):
        b = e.Reshape(e.Equal(c, 0), [1, 1] + [-1 if j == i else 1 for j in range(geo.nsp)])
        blind = b if blind is None else e.Or(blind, b)
    return blind


def pool_tiles(attrs: dict) -> int | None:
    """k when a MaxPool with these attributes ({name: value}) pools k x k tiles of the image
    from its corner (2-D, kernel_shape = strides = [k, k], no pads, dilations 1, floor mode):
    its gradient then needs no Indices output (see :func:`_max_pool`), else None."""
    k = [int(i) for i in attrs.get("kernel_shape") or []]
    auto = attrs.get("auto_pad") or "NOTSET"
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if len(k) != 2 or k[0] != k[1] or k[0] < 2 or auto not in ("NOTSET", "VALID"):
        return None
    if _ints(attrs.get("strides"), 2, 1) != k or _ints(attrs.get("dilations"), 2, 1) != [1, 1]:
        return None
    if any(_ints(attrs.get("pads"), 4, 0)) or attrs.get("ceil_mode"):
        return None
    return k[0]


def _tiles_grad(e, x, y, g, k):
    """dx of a MaxPool over k x k tiles (:func:`pool_tiles`) without Indices: each tile's
    gradient goes to its first maximum in row-major order (SpaceToDepth's channel blocks), as
    the forward's Indices send it; rows and columns past the last tile get zeros. The first
    maximum is found by comparing the taps with the forward's y (:func:`_first_max`), and the
    gradient spread by a 0/1 product: onnxruntime's ArgMax and Where run one element at a time
    (whole form on [64, 16, 28, 28]: 2.54 -> 1.73 ms at 1 thread, 2.10 -> 1.55 at 2; measured).
    In float32 from opset 18 the channels are folded into the batch first: SpaceToDepth of one
    channel and Col2Im (whose non-overlapping blocks each take one element) move blocks that
    stay together in memory, where a DepthToSpace over C channels gathers every element from C
    planes apart: onnxruntime's whole form 0.35x to 0.9x the time at 2 threads, 0.6x to 0.9x at
    1 (forward included, 14x14 to 112x112 images, 16 to 64 channels; measured)."""
    half = x.dtype in HALF  # onnxruntime's CPU SpaceToDepth has no float16
    xf, yf, gf = (e.Cast(v, to=ir.DataType.FLOAT) for v in (x, y, g)) if half else (x, y, g)
    xd, gd = _static_dims(x, 2), _static_dims(g, 2)
    tiles = [o * k for o in gd] if gd is not None else _spatial_shape(e, g) * k
    if xd is not None and gd is not None:
        rest = [dm - t for dm, t in zip(xd, tiles)]
    else:
        rest = _spatial_shape(e, x) - tiles
    if isinstance(rest, list) and not any(rest):
        rest = None
    else:
        xf = e.Slice(xf, [0, 0], tiles, [2, 3])
    if e.opset >= 18 and xf.dtype == ir.DataType.FLOAT:  # onnxruntime's Col2Im: float only
        fold = lambda v: e.Reshape(v, [-1, 1, 0, 0])  # noqa: E731  [N*C, 1, H, W]
        blocks = e.SpaceToDepth(fold(xf), blocksize=k)  # [N*C, k*k, Ho, Wo]
        spread = _first_max(e, blocks, fold(yf), k * k) * fold(gf)
        cols = e.Reshape(spread, e.Concat(e.Slice(e.Shape(gf), [0], [1]), [-1],
                                          e.reduce("ReduceProd", _spatial_shape(e, gf), [0]),
                                          axis=0))  # [N, C*k*k, Ho*Wo]
        dx = e.Col2Im(cols, tiles, [k, k], strides=[k, k])
    else:
        blocks = e.SpaceToDepth(xf, blocksize=k)                      # [N, k*k*C, Ho, Wo]
        by_pos = e.Reshape(blocks, [0, k * k, -1, *gd] if gd is not None else
                           e.Concat([0, k * k, -1], _spatial_shape(e, g), axis=0))
        spread = _first_max(e, by_pos, e.Unsqueeze(yf, [1]), k * k) * e.Unsqueeze(gf, [1])
        dx = e.DepthToSpace(e.Reshape(spread, e.Shape(blocks)), blocksize=k, mode="DCR")
    if rest is not None:
        dx = e.Pad(dx, [0] * 6 + rest if isinstance(rest, list) else
                   e.Concat([0] * 6, rest, axis=0))
    return e.Cast(dx, to=g.dtype) if half else dx


def _first_max(e, taps, y, count):
    """0/1 in taps' dtype, 1 at the first of ``count`` taps along axis 1 that equals y (the
    max over them; the last tap where none does, as when y is NaN)."""
    parts = e.Split(taps, axis=1, num_outputs=count if e.opset >= 18 else None, _outputs=count)
    found = e.Equal(parts[0], y)
    masks = [found]
    for t in parts[1:-1]:
        now = e.Or(found, e.Equal(t, y))
        masks.append(e.Xor(now, found))
        found = now
    masks.append(e.Not(found))
    return e.Cast(e.Concat(*masks, axis=1), to=taps.dtype)


@register("MaxPool")
def _max_pool(n, g):
    e, x = n.e, n.x
    k, s, d = _pool_attrs(n)
    nsp = len(k)
    idx = n.outs[1] if len(n.outs) > 1 and n.outs[1] is not None and n.outs[1].name else None
    tile = pool_tiles({a: n.attr(a) for a in ("kernel_shape", "auto_pad", "strides",
                                               "dilations", "pads", "ceil_mode")})
    if idx is None and tile is not None:
        return _tiles_grad(e, x, n.y, g, tile)
    overlap = _windows_overlap(k, s, d)
    blind = _blind_windows(n, d)
    overlap = overlap or blind is not None  # the blind windows' zeros are added, not written
    if overlap:
        e.need(16)  # ScatterElements reduction="add": one element may be the max of two windows
    if idx is None:  # recompute the argmax (row-major) with the forward's own attributes
        attrs = {a: v for a, v in n.node.attributes.items() if a != "storage_order"}
        _, idx = e.op("MaxPool", x, _outputs=2, _dtype=[x.dtype, INT64], **attrs)
    elif attr(n, "storage_order") == 1:
        idx = _row_major(n, idx, x, nsp)
    # onnxruntime's CPU ScatterElements adds no float16/bfloat16: those add in float32
    dtype = ir.DataType.FLOAT if overlap and g.dtype in HALF else g.dtype
    if blind is not None:  # no gradient from windows that see only padding
        g = e.Where(blind, e.const(0, g.dtype), g)
        idx = e.Where(blind, e.const(np.array(0, np.int64)), idx)
    src = e.Reshape(g if dtype == g.dtype else e.Cast(g, to=dtype), [-1])
    zeros = e.ConstantOfShape(e.Reshape(e.Size(x), [1]),
                              value=ir.tensor(np.zeros(1, dtype.numpy())), _dtype=dtype)
    flat = e.ScatterElements(zeros, e.Reshape(idx, [-1]), src, axis=0,
                             reduction="add" if overlap else None)
    if dtype != g.dtype:
        flat = e.Cast(flat, to=g.dtype)
    return e.Reshape(flat, e.Shape(x))


@register("MaxUnpool")
def _max_unpool(n, g):
    """y's flat element I[j] is x's element j (indices into y as a whole, as MaxPool makes them);
    where I repeats (an element that is the max of two overlapping windows), a write without
    reduction: g goes to the x the output holds (split among equal ones)."""
    e = n.e
    flat_x, flat_i = e.Reshape(n.x, [-1]), e.Reshape(n.ins[1], [-1])
    take = lambda t: e.Gather(t, flat_i, axis=0)  # noqa: E731
    taken = take(e.Reshape(g, [-1]))
    if not _distinct_windows(n.node.inputs[1]):
        flat_y = e.Reshape(n.y, [-1])
        taken = taken * kept_share(n, "ScatterElements", flat_y, flat_i, flat_x, flat_y, take,
                                   axis=0)
    return e.Reshape(taken, e.Shape(n.x)), None, None


def _windows_overlap(k, s, d) -> bool:
    """Whether a pool's windows (kernel, strides, dilations) share elements: a kernel's extent
    beyond its stride on some axis."""
    return any(di * (ki - 1) + 1 > si for ki, si, di in zip(k, s, d))


def _distinct_windows(idx) -> bool:
    """``idx`` is the Indices of a MaxPool whose windows do not overlap: no index repeats."""
    p = idx.producer()
    if p is None or p.op_type != "MaxPool" or p.domain not in ("", "ai.onnx") or \
            len(p.outputs) < 2 or p.outputs[1] is not idx:
        return False
    a = {k: v.value for k, v in p.attributes.items()}
    k = a.get("kernel_shape")
    return k is not None and not _windows_overlap(k, _ints(a.get("strides"), len(k), 1),
                                                  _ints(a.get("dilations"), len(k), 1))


# -- Col2Im ----------------------------------------------------------------------------------------
@register("Col2Im")
def _col2im(n, g):
    """Col2Im sums blocks into an image; its adjoint cuts the blocks out again (im2col), which is
    a Conv of each channel with one one-hot kernel per block position (image_shape and
    block_shape may be known only at run time)."""
    e = n.e
    block = n.const(2)
    if block is not None:
        k = [int(i) for i in block]
        nsp, kk = len(k), math.prod(k)
        eye = e.const(np.eye(kk).reshape(kk, 1, *k), g.dtype)
    else:  # block_shape known at run time: the same one-hot kernels, built there
        bs = n.ins[2].shape
        nsp = bs[0] if bs is not None and len(bs) == 1 and isinstance(bs[0], int) else (
            g.rank - 2 if g.rank is not None else None)
        if nsp is None:
            raise NotImplementedError(f"the gradient of Col2Im node {n.node.name!r} needs the "
                                      "length of its block_shape: run shape inference")
        kk = e.Reshape(e.reduce("ReduceProd", n.ins[2], [0], keepdims=1), [1])
        calc = ir.DataType.FLOAT if g.dtype in HALF else g.dtype  # onnxruntime's EyeLike
        zero = ir.tensor(np.zeros(1, calc.numpy()))
        eye = e.EyeLike(e.ConstantOfShape(e.Concat(kk, kk, axis=0), value=zero), _dtype=calc)
        eye = e.Reshape(eye, e.Concat(kk, [1], n.ins[2], axis=0))
        eye = eye if calc == g.dtype else e.Cast(eye, to=g.dtype)
    t = e.Reshape(g, e.Concat([-1, 1], _spatial_shape(e, g), axis=0))
    cols = e.Conv(t, eye, strides=_ints(n.attr("strides"), nsp, 1),
                  dilations=_ints(n.attr("dilations"), nsp, 1),
                  pads=_ints(n.attr("pads"), 2 * nsp, 0))
    return e.Reshape(cols, e.Shape(n.x)), None, None
