"""Image resampling and spatial rearrangement: ResizeBilinear / ResizeNearestNeighbor and their
gradients, SpaceToBatchND / BatchToSpaceND (how TF runs a dilated convolution).

TF's resize maps output pixel i of an axis to input coordinate ``in = (i + 0.5) * s - 0.5``
(half_pixel_centers), ``i * s`` (neither flag) or ``i * (n - 1) / (m - 1)`` (align_corners), with
``s = n / m``; bilinear takes ``lower = max(floor(in), 0)``, ``upper = min(ceil(in), n - 1)`` and
weight ``in - floor(in)``; nearest takes ``floor((i + 0.5) * s)`` with half pixel centers, else
``floor(i * s)`` or, aligned, ``round(i * s)``, clamped to ``n - 1``. Bilinear is ONNX ``Resize``
with the coordinate mode that says the same; nearest is a Gather per axis of those rows (ONNX's
nearest modes round ties differently). The gradients are the adjoints: each
resized axis is a linear map, an (m x n) interpolation matrix built at run time from those
formulas, so ``dx = einsum(dy, A_h, A_w)`` (sizes need not be known statically).

Bicubic (ResizeBicubic, what tf.image.resize(method="bicubic") and Keras's Resizing emit) is that
linear map forwards too, ``y = einsum(x, A_h, A_w)``, with TF's weights exactly: TF reads them from
a table of the cubic kernel at 1024 steps between pixels (the fraction rounded to the nearest
step), with a = -0.75 and clamped edge taps (repeated edge pixels) in the legacy modes, a = -0.5
(Keys) with half_pixel_centers, where taps outside the image get weight 0 and the other weights
are renormalized to sum 1. ONNX's Resize(cubic) computes the kernel at the exact fraction, so it
differs from TF by up to ~1e-3 of the pixel values; hence the matrices.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .core import handler
from .errors import ConversionError
from .ops import as_i64, np_type, rank_of

BIG = np.iinfo(np.int64).max


def _flags(c, n) -> tuple[bool, bool]:
    return bool(c.attr(n, "align_corners", False)), bool(c.attr(n, "half_pixel_centers", False))


@handler("ResizeBilinear")
def _resize_bilinear(c, n):
    """(images [B, H, W, C], size [2]) -> Resize (linear) to [B, *size, C]. The sizes of every
    axis, not ``axes=[1, 2]``: onnxruntime's layout optimizer (ORT_ENABLE_EXTENDED and above)
    moves a Transpose through a Resize with axes and leaves it empty sizes, and the model failed
    to load (a Keras Conv2D, ReLU, UpSampling2D(bilinear), Conv2D; bench/fuzz_keras.py)."""
    align, half = _flags(c, n)
    x = c.x(n, 0)
    if np_type(n) != np.float32:
        x = c.op("Cast", [x], to=TensorProto.FLOAT)  # TF's bilinear output is float32
    mode = "align_corners" if align else "half_pixel" if half else "asymmetric"
    sizes = c.op("Concat", [c.op("Shape", [x], start=0, end=1), as_i64(c, c.x(n, 1)),
                            c.op("Shape", [x], start=3, end=4)], axis=0)
    return [c.op("Resize", [x, "", "", sizes], mode="linear",
                 coordinate_transformation_mode=mode)]


@handler("ResizeNearestNeighbor")
def _resize_nearest(c, n):
    """A Gather per axis of the source rows TF picks, computed as TF does (float32): ONNX's
    nearest modes round differently (half to even) or are not standard any more
    (tf_half_pixel_for_nn)."""
    x = c.x(n, 0)
    size = as_i64(c, c.x(n, 1))
    for axis in (1, 2):
        n_in = c.op("Squeeze", [c.op("Shape", [x], start=axis, end=axis + 1), c.i64(0)])
        n_out = c.op("Squeeze", [c.op("Slice", [size, c.i64(axis - 1), c.i64(axis)]), c.i64(0)])
        x = c.op("Gather", [x, _nearest(c, n, n_in, n_out)], axis=axis)
    return [x]


def _scale(c, n, n_in, n_out, dtype=TensorProto.FLOAT):
    """TF's CalculateResizeScale: n_in / n_out, or (n_in - 1) / (n_out - 1) aligned."""
    f = lambda v: c.op("Cast", [v], to=dtype)  # noqa: E731
    one = c.const(1, np.int64)
    if not _flags(c, n)[0]:
        return c.op("Div", [f(n_in), f(n_out)])
    return c.op("Where", [c.op("Greater", [n_out, one]),
                          c.op("Div", [f(c.op("Sub", [n_in, one])),
                                       f(c.op("Max", [c.op("Sub", [n_out, one]), one]))]),
                          c.op("Cast", [c.const(0, np.int64)], to=dtype)])


def _nearest(c, n, n_in, n_out):
    """The int64 source index of each of the n_out output positions of one axis."""
    align, half = _flags(c, n)
    i = c.op("Cast", [c.op("Range", [c.const(0, np.int64), n_out, c.const(1, np.int64)])],
             to=TensorProto.FLOAT)
    if half:
        i = c.op("Add", [i, c.const(0.5, np.float32)])
    pos = c.op("Mul", [i, _scale(c, n, n_in, n_out)])
    if align:  # roundf: half away from zero (pos >= 0)
        pos = c.op("Add", [pos, c.const(0.5, np.float32)])
    src = c.op("Cast", [c.op("Floor", [pos])], to=TensorProto.INT64)
    return c.op("Min", [src, c.op("Sub", [n_in, c.const(1, np.int64)])])


def _axis_matrix(c, n, n_in, n_out, dtype):
    """The (n_out x n_in) matrix of one resized axis (see the module docstring), its weights
    computed in float32 as TF's kernels do; ``n_in`` and ``n_out`` are int64 scalars."""
    zero, one = c.const(0, np.int64), c.const(1, np.int64)
    if n.op.startswith("ResizeBicubic"):
        weights = _bicubic_taps(c, n, n_in, n_out)
    elif n.op.startswith("ResizeBilinear"):
        half = _flags(c, n)[1]
        i = c.op("Cast", [c.op("Range", [zero, n_out, one])], to=TensorProto.FLOAT)
        pos = c.op("Mul", [c.op("Add", [i, c.const(0.5, np.float32)]) if half else i,
                           _scale(c, n, n_in, n_out)])
        if half:
            pos = c.op("Sub", [pos, c.const(0.5, np.float32)])
        lo = c.op("Floor", [pos])
        lerp = c.op("Sub", [pos, lo])
        lower = c.op("Max", [c.op("Cast", [lo], to=TensorProto.INT64), zero])
        upper = c.op("Min", [c.op("Cast", [c.op("Ceil", [pos])], to=TensorProto.INT64),
                             c.op("Sub", [n_in, one])])
        weights = [(lower, c.op("Sub", [c.const(1.0, np.float32), lerp])), (upper, lerp)]
    else:
        weights = [(_nearest(c, n, n_in, n_out), None)]
    cols = c.op("Unsqueeze", [c.op("Range", [zero, n_in, one]), c.i64(0)])
    total = None
    for idx, w in weights:
        hit = c.op("Cast", [c.op("Equal", [c.op("Unsqueeze", [idx, c.i64(1)]), cols])],
                   to=TensorProto.FLOAT)
        part = hit if w is None else c.op("Mul", [hit, c.op("Unsqueeze", [w, c.i64(1)])])
        total = part if total is None else c.op("Add", [total, part])
    return total if dtype == TensorProto.FLOAT else c.op("Cast", [total], to=dtype)


TABLE_SIZE = 1024  # TF's kTableSize: the cubic kernel's samples between two pixels


def _cubic_table(a: float) -> np.ndarray:
    """TF's InitCoeffsTable(a): [TABLE_SIZE + 1, 2] float32, row i the kernel at distances
    i / TABLE_SIZE and 1 + i / TABLE_SIZE (computed in double from the float distance)."""
    x = (np.arange(TABLE_SIZE + 1) / TABLE_SIZE).astype(np.float32).astype(np.float64)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    x1 = (x.astype(np.float32) + np.float32(1)).astype(np.float64)
    far = ((a * x1 - 5 * a) * x1 + 8 * a) * x1 - 4 * a
    return np.stack([near, far], axis=1).astype(np.float32)


def _bicubic_taps(c, n, n_in, n_out):
    """TF's GetWeightsAndIndices for each of the n_out output positions of one axis: four
    (int64 source index, float32 weight) pairs, the sources floor(in) - 1 .. floor(in) + 2
    clamped to the image."""
    half = _flags(c, n)[1]
    zero, one = c.const(0, np.int64), c.const(1, np.int64)
    i = c.op("Cast", [c.op("Range", [zero, n_out, one])], to=TensorProto.FLOAT)
    if half:
        i = c.op("Add", [i, c.const(0.5, np.float32)])
    pos = c.op("Mul", [i, _scale(c, n, n_in, n_out)])
    if half:
        pos = c.op("Sub", [pos, c.const(0.5, np.float32)])
    lo = c.op("Floor", [pos])
    step = c.op("Cast", [c.op("Round", [c.op("Mul", [c.op("Sub", [pos, lo]), c.const(
        float(TABLE_SIZE), np.float32)])])], to=TensorProto.INT64)  # lrintf: half to even
    table = c.const(_cubic_table(-0.5 if half else -0.75))
    back = c.op("Sub", [c.const(TABLE_SIZE, np.int64), step])
    # distances 1 + f, f, 1 - f, 2 - f from taps floor - 1 .. floor + 2 (f the fraction)
    w = [c.op("Gather", [c.op("Gather", [table, s], axis=0), c.const(k, np.int64)], axis=1)
         for s, k in ((step, 1), (step, 0), (back, 0), (back, 1))]
    base = c.op("Cast", [lo], to=TensorProto.INT64)
    last = c.op("Sub", [n_in, one])
    raw = [c.op("Add", [base, c.const(k, np.int64)]) for k in (-1, 0, 1, 2)]
    idx = [c.op("Min", [c.op("Max", [r, zero]), last]) for r in raw]
    if half:  # Keys: taps outside the image weigh 0, the rest are renormalized
        zf = c.const(0.0, np.float32)
        w = [c.op("Where", [c.op("Equal", [k, r]), wk, zf]) for k, r, wk in zip(idx, raw, w)]
        total = c.op("Sum", w)
        ok = c.op("GreaterOrEqual", [c.op("Abs", [total]), c.const(
            1000 * np.finfo(np.float32).tiny, np.float32)])
        inv = c.op("Div", [c.const(1.0, np.float32), c.op("Where", [ok, total, c.const(
            1.0, np.float32)])])
        w = [c.op("Where", [ok, c.op("Mul", [wk, inv]), wk]) for wk in w]
    return list(zip(idx, w))


@handler("ResizeBicubic")
def _resize_bicubic(c, n):
    """(images [B, H, W, C], size [2]) -> float32 [B, size, C]: y = einsum(x, A_h, A_w) with
    TF's bicubic matrices (see the module docstring)."""
    x = c.x(n, 0)
    if np_type(n) != np.float32:
        x = c.op("Cast", [x], to=TensorProto.FLOAT)  # TF's bicubic output is float32
    a_h, a_w = _axis_matrices(c, n, c.op("Shape", [x], start=1, end=3),
                              as_i64(c, c.x(n, 1)), TensorProto.FLOAT)
    return [c.op("Einsum", [x, a_h, a_w], equation="bhwc,ih,jw->bijc")]


def _axis_matrices(c, n, in_hw, out_hw, dtype):
    """(A_h, A_w): :func:`_axis_matrix` of each axis, from [2] int64 vectors of the input's and
    the output's height and width."""
    dims = [[c.op("Squeeze", [c.op("Slice", [v, c.i64(k), c.i64(k + 1)]), c.i64(0)])
             for k in (0, 1)] for v in (in_hw, out_hw)]
    return tuple(_axis_matrix(c, n, dims[0][k], dims[1][k], dtype) for k in (0, 1))


@handler("ScaleAndTranslate", "ScaleAndTranslateGrad")
def _scale_and_translate(c, n):
    raise ConversionError(
        f"{n}: not supported: TF's ScaleAndTranslate (tf.image.resize with antialias=True, or "
        f"with the kernel {c.attr(n, 'kernel_type', '?')!r}) samples a kernel scaled to the "
        "resize factor with renormalized weights, which ONNX's Resize does not compute the "
        "same way; resize with antialias=False (bilinear, bicubic and nearest emit "
        "ResizeBilinear, ResizeBicubic and ResizeNearestNeighbor, which convert exactly)")


@handler("ResizeBilinearGrad", "ResizeNearestNeighborGrad", "ResizeBicubicGrad")
def _resize_grad(c, n):
    """ResizeBilinearGrad / ResizeBicubicGrad(grads, original_image),
    ResizeNearestNeighborGrad(grads, size):
    dx[b, h, w, ch] = sum over (i, j) of A_h[i, h] A_w[j, w] dy[b, i, j, ch]."""
    dy = c.x(n, 0)
    out_hw = c.op("Shape", [dy], start=1, end=3)
    if n.op in ("ResizeBilinearGrad", "ResizeBicubicGrad"):
        in_hw = c.op("Shape", [c.x(n, 1)], start=1, end=3)
    else:
        in_hw = as_i64(c, c.x(n, 1))
    t = c.onnx_type(n)
    grads_f32 = n.op != "ResizeNearestNeighborGrad"  # (TF's grads are float32, dx of type T)
    a_h, a_w = _axis_matrices(c, n, in_hw, out_hw, TensorProto.FLOAT if grads_f32 else t)
    dx = c.op("Einsum", [dy, a_h, a_w], equation="bijc,ih,jw->bhwc")
    return [c.op("Cast", [dx], to=t) if grads_f32 and t != TensorProto.FLOAT else dx]


# -- SpaceToBatchND / BatchToSpaceND ----------------------------------------------------------
def _block(c, n):
    b = c.const_input(n, 1, required="block_shape")
    return [int(v) for v in np.reshape(b, -1)]


def _rest_rank(c, n, m):
    r = rank_of(c, n, 0, required=n.op)
    if r < m + 1:
        raise ConversionError(f"{n}: input of rank {r} has no {m} spatial dims after the batch")
    return r - 1 - m


@handler("SpaceToBatchND")
def _space_to_batch(c, n):
    """(x [B, *spatial, *rest], block_shape [M], paddings [M, 2]) -> [B * prod(block),
    *(padded spatial / block), *rest]: pad, split each spatial dim into (dim / b, b), move the
    block factors in front of the batch."""
    block = _block(c, n)
    m = len(block)
    k = _rest_rank(c, n, m)
    pads = c.const_input(n, 2)
    if pads is not None:
        full = np.zeros((1 + m + k, 2), np.int64)
        full[1:1 + m] = np.reshape(pads, (m, 2))
        pads = c.const(full.T.reshape(-1))
    else:
        p = as_i64(c, c.x(n, 2))
        zeros = c.i64(*[0] * (2 * k))
        p = c.op("Concat", [c.i64(0, 0), c.op("Reshape", [p, c.i64(-1)]), zeros], axis=0)
        pads = c.op("Reshape", [c.op("Transpose", [c.op("Reshape", [p, c.i64(-1, 2)])],
                                     perm=[1, 0]), c.i64(-1)])
    x = c.op("Pad", [c.x(n, 0), pads])
    shape = c.op("Shape", [x])
    dims = [c.op("Slice", [shape, c.i64(d), c.i64(d + 1)]) for d in range(1 + m)]
    rest = c.op("Slice", [shape, c.i64(1 + m), c.i64(BIG)])
    split = [dims[0]]
    for d, b in zip(dims[1:], block):
        split += [c.op("Div", [d, c.i64(b)]), c.i64(b)]
    x = c.op("Reshape", [x, c.op("Concat", split + [rest], axis=0)])
    # [B, s1, b1, ..., sM, bM, *rest] -> [b1, ..., bM, B, s1, ..., sM, *rest]
    perm = [2 + 2 * i for i in range(m)] + [0] + [1 + 2 * i for i in range(m)] + [
        1 + 2 * m + i for i in range(k)]
    x = c.op("Transpose", [x], perm=perm)
    batch = c.op("Mul", [dims[0], c.i64(int(np.prod(block)))])
    return [c.op("Reshape", [x, c.op("Concat", [batch] + split[1::2] + [rest], axis=0)])]


@handler("BatchToSpaceND")
def _batch_to_space(c, n):
    """(x [B * prod(block), *spatial, *rest], block_shape [M], crops [M, 2]) -> [B,
    *(spatial * block - crops), *rest]: the inverse rearrangement, then the crops cut."""
    block = _block(c, n)
    m = len(block)
    k = _rest_rank(c, n, m)
    x = c.x(n, 0)
    shape = c.op("Shape", [x])
    dims = [c.op("Slice", [shape, c.i64(d), c.i64(d + 1)]) for d in range(1 + m)]
    rest = c.op("Slice", [shape, c.i64(1 + m), c.i64(BIG)])
    batch = c.op("Div", [dims[0], c.i64(int(np.prod(block)))])
    x = c.op("Reshape", [x, c.op("Concat", [c.i64(*block), batch] + dims[1:] + [rest], axis=0)])
    # [b1, ..., bM, B, s1, ..., sM, *rest] -> [B, s1, b1, ..., sM, bM, *rest]
    perm = [m] + [v for i in range(m) for v in (m + 1 + i, i)] + [2 * m + 1 + i for i in range(k)]
    x = c.op("Transpose", [x], perm=perm)
    spatial = [c.op("Mul", [d, c.i64(b)]) for d, b in zip(dims[1:], block)]
    x = c.op("Reshape", [x, c.op("Concat", [batch] + spatial + [rest], axis=0)])
    crops = c.const_input(n, 2)
    if crops is not None:
        crops = np.reshape(crops, (m, 2)).astype(np.int64)
        if not crops.any():
            return [x]
        begin = c.const(crops[:, 0])
        end = c.op("Sub", [c.op("Concat", spatial, axis=0), c.const(crops[:, 1])])
    else:
        cr = c.op("Reshape", [as_i64(c, c.x(n, 2)), c.i64(m, 2)])
        begin = c.op("Reshape", [c.op("Slice", [cr, c.i64(0), c.i64(1), c.i64(1)]), c.i64(-1)])
        end = c.op("Sub", [c.op("Concat", spatial, axis=0), c.op(
            "Reshape", [c.op("Slice", [cr, c.i64(1), c.i64(2), c.i64(1)]), c.i64(-1)])])
    return [c.op("Slice", [x, begin, end, c.i64(*range(1, 1 + m))])]


@handler("DepthToSpace", "SpaceToDepth")
def _depth_space(c, n):
    """ONNX's DepthToSpace in DCR mode (depth read as [block, block, channels], TF's order) and
    SpaceToDepth, channels-first: NHWC is transposed around them."""
    if c.attr(n, "data_format", "NHWC") not in ("NHWC", "NCHW"):
        raise ConversionError(f"{n}: data_format {c.attr(n, 'data_format')!r} is not supported")
    last = c.attr(n, "data_format", "NHWC") == "NHWC"
    x = c.x(n)
    if last:
        x = c.op("Transpose", [x], perm=[0, 3, 1, 2])
    attrs = {"blocksize": int(c.attr(n, "block_size"))}
    if n.op == "DepthToSpace":
        attrs["mode"] = "DCR"
    y = c.op(n.op, [x], **attrs)
    return [c.op("Transpose", [y], perm=[0, 2, 3, 1]) if last else y]
