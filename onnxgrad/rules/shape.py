"""Gradient rules: shape and indexing ops (reshapes, concat/split, slicing, gathers and scatters,
padding, tiling, block rearrangements).

All of these are linear in their float input, so each gradient is the op's adjoint:
- ops that only reshape: g reshaped back to x's run-time shape;
- gathers: g scatter-added (ScatterND / ScatterElements, reduction "add") into zeros of x's shape
  at the forward's own indices; scatters: the matching gathers;
- ops that only move elements (strided Slice, Pad's reflect/edge/wrap modes, batched GatherND):
  the forward is replayed on x's flat element numbers ("iota"), which tells every element of y
  which element of x it came from; g is scatter-added there (see ``_replay``);
- crops and zero pads are each other's adjoints (Slice <-> Pad, CenterCropPad <-> itself).
Shapes come from Shape at run time; only ranks and axes are read statically.
"""
import numpy as np
import onnx_ir as ir

from ..emitter import V
from ..errors import NotDifferentiableError
from ..registry import register
from .spec import attr

INT64 = ir.DataType.INT64
HALF = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
END = np.iinfo(np.int64).max  # "to the end" for Slice


# -- helpers ---------------------------------------------------------------------------------------
def _i64(n, v):
    return v if v is None or v.dtype == INT64 else n.e.Cast(v, to=INT64)


def _rank(x):
    if x.rank is None:
        raise NotImplementedError(f"this gradient needs the rank of {x.name!r}, which is unknown; "
                                  "run onnx shape inference on the model first")
    return x.rank


def _axis(x, axis):
    """axis made non-negative (with x's static rank)."""
    return axis if axis >= 0 else axis + _rank(x)


def _inverse(perm):
    return None if perm is None else [int(i) for i in np.argsort(perm)]


def _dims(n, x, axes=None):
    """x's run-time dims as a 1-D int64 tensor, only at ``axes`` when given."""
    s = n.e.Shape(x)
    return s if axes is None else n.e.Gather(s, axes)


def _back(n, g):
    """g reshaped to x's shape: the gradient of every op that only changes the shape."""
    return n.e.Reshape(g, n.e.Shape(n.x), allowzero=1 if n.opset >= 14 else None)


def _scatter_add(n, op, x, indices, t, add=True, **attrs):
    """t scattered into zeros of x's shape at ``indices`` and added up there (unless ``add`` is
    False: no index repeats): the adjoint of the matching gather. Half-precision sums run in
    float32 (more exact, and onnxruntime's CPU kernels have no half-precision scatter-add)."""
    e = n.e
    if not add:
        return e.op(op, e.zeros_like(x), indices, t, **attrs)
    e.need(16)  # reduction="add"
    half = t.dtype in HALF
    zeros = e.fill_like(x, 0, ir.DataType.FLOAT if half else t.dtype)
    out = e.op(op, zeros, indices, e.Cast(t, to=ir.DataType.FLOAT) if half else t,
               reduction="add", **attrs)
    return e.Cast(out, to=t.dtype) if half else out


def _replay(n, g, forward, add=True):
    """The adjoint of an op that only moves (or copies) elements of x: ``forward`` applied to the
    flat element numbers of x says where each element of y came from; g is added there."""
    e, x = n.e, n.x
    source = forward(e.Reshape(e.Range(0, e.Size(x), 1), e.Shape(x)))
    flat = _scatter_add(n, "ScatterElements", e.Reshape(x, [-1]), e.Reshape(source, [-1]),
                        e.Reshape(g, [-1]), add, axis=0)
    return e.Reshape(flat, e.Shape(x))


def _halves(n, pads):
    """pads split into its begin and end halves."""
    return n.e.Split(pads, axis=0, num_outputs=2 if n.opset >= 18 else None, _outputs=2)


def _zero_pad(n, t, begin, end, axes):
    """t padded with zeros: begin/end (1-D, >= 0) elements before/after it on each of ``axes``.

    The pads are written for every axis (scattered into zeros), never as Pad's ``axes`` input:
    onnxruntime's transpose optimizer (1.31, from ORT_ENABLE_BASIC up) permutes run-time pads as
    if they covered every axis, ignoring ``axes``, which reads out of bounds downstream."""
    e = n.e
    rank = e.Size(e.Shape(t))
    axes = e.Where(e.Less(axes, 0), axes + rank, axes)
    zeros = e.ConstantOfShape(e.Reshape(rank * 2, [1]), value=ir.tensor(np.zeros(1, np.int64)))
    pads = e.ScatterElements(zeros, e.Concat(axes, axes + rank, axis=0),
                             e.Concat(begin, end, axis=0), axis=0)
    return e.Pad(t, pads)


def _unpad(n, t, pads, axes, crop_only=False):
    """Pad(t, -pads, axes): the adjoint of zero padding. Pads > 0 become crops (Slice) and pads < 0
    zero padding, so no runtime meets negative pads (onnx.reference rejects them)."""
    e, axes = n.e, _i64(n, axes)
    begin, end = _halves(n, e.Max(pads, 0))
    t = e.Slice(t, begin, _dims(n, t, axes) - end, axes)
    if crop_only:
        return t
    grow = e.Max(-pads, 0)
    return e.Pad(t, grow) if axes is None else _zero_pad(n, t, *_halves(n, grow), axes)


# -- ops that only reshape or permute -------------------------------------------------------------
@register(["Reshape", "Flatten", "Squeeze", "Unsqueeze"])
def _reshape(n, g):
    return _back(n, g)


@register("Transpose")
def _transpose(n, g):
    perm = _inverse(n.attr("perm"))  # no perm: reversing twice
    node = g.value.producer()
    if node is not None and node.op_type == "Transpose" and node.domain in ("", "ai.onnx") \
            and g.rank is not None:
        # g is a Transpose this one undoes (a weight gradient made transposed, for a weight
        # read through a Transpose): its input, not two copies in a row
        a = node.attributes.get("perm")
        first = list(a.as_ints()) if a is not None else list(range(g.rank))[::-1]
        last = perm if perm is not None else list(range(g.rank))[::-1]
        if [first[i] for i in last] == list(range(g.rank)):
            return V(node.inputs[0], n.e)
    return n.e.Transpose(g, perm=perm)


@register("DepthToSpace")
def _depth_to_space(n, g):
    b = n.attr("blocksize")
    if attr(n, "mode") == "DCR":
        return n.e.SpaceToDepth(g, blocksize=b)
    # CRD: y = [N, C, H*b, W*b] from x viewed as [N, C, b, b, H, W]; undo it
    e, s = n.e, n.e.Shape(n.x)
    t = e.Reshape(g, e.Concat(e.Slice(s, [0], [1]), [-1], e.Slice(s, [2], [3]),
                              [b], e.Slice(s, [3], [4]), [b], axis=0))
    return e.Reshape(e.Transpose(t, perm=[0, 1, 3, 5, 2, 4]), s)


@register("SpaceToDepth")
def _space_to_depth(n, g):  # DepthToSpace of the same mode (CRD from opset 28) undoes it
    mode = attr(n, "mode")
    return n.e.DepthToSpace(g, blocksize=n.attr("blocksize"),
                            mode=mode.decode() if isinstance(mode, bytes) else mode)


@register("ReverseSequence")
def _reverse_sequence(n, g):
    return n.e.ReverseSequence(g, n.ins[1], batch_axis=attr(n, "batch_axis"),
                               time_axis=attr(n, "time_axis")), None


@register("CumSum")
def _cumsum(n, g):
    return n.e.CumSum(g, n.ins[1], exclusive=attr(n, "exclusive"),
                      reverse=1 - attr(n, "reverse")), None


@register("CumProd", since=26)
def _cumprod(n, g):
    # dx_i = sum_{j after i} g_j prod_{k up to j, k != i} x_k. Before the first zero of the scan
    # that is the reverse cumsum of g y over x_i; at the first zero z it is the same sum with x_z
    # taken as 1 (the products of the others); past z every term holds x_z = 0 (as torch.cumprod)
    e, x, y, axis = n.e, n.x, n.y, n.ins[1]
    ex, rev = attr(n, "exclusive"), attr(n, "reverse")
    back = lambda t: e.CumSum(t, axis, exclusive=ex, reverse=1 - rev)  # noqa: E731
    zero, one = e.const(0, x.dtype), e.const(1, x.dtype)
    is_zero = e.Equal(x, zero)
    seen = e.CumSum(e.Cast(is_zero, to=x.dtype), axis, reverse=rev)  # zeros up to i (inclusive)
    before, first = e.Equal(seen, zero), e.And(is_zero, e.Equal(seen, one))
    y1 = e.CumProd(e.Where(first, one, x), axis, exclusive=ex, reverse=rev)
    at_first = e.Where(first, back(g * y1), zero)
    return e.Where(before, back(g * y) / e.Where(before, x, one), at_first), None


@register("Trilu")
def _trilu(n, g):
    return n.e.Trilu(g, n.input(1), upper=attr(n, "upper")), None


# -- concat / split, slice / pad ---------------------------------------------------------------
@register("Concat")
def _concat(n, g):
    if len(n.ins) == 1:
        return g
    axis = n.attr("axis")
    sizes = [[x.shape[axis]] if x.shape and isinstance(x.shape[axis], int)
             else _dims(n, x, [axis]) for x in n.ins]
    return n.e.Split(g, n.e.Concat(*sizes, axis=0), axis=axis, _outputs=len(n.ins))


@register("Split")
def _split(n, g):
    parts = [gi if gi is not None else n.e.zeros_like(y) for gi, y in zip(n.gs, n.outs)]
    return n.e.Concat(*parts, axis=attr(n, "axis")), None


@register("Slice")
def _slice(n, g):
    e = n.e
    steps = n.const(4)
    if n.input(4) is not None and (steps is None or (steps != 1).any()):
        return _replay(n, g, lambda i: e.Slice(i, *n.ins[1:]), add=False)
    # unit steps: g zero-padded by what was cut off before and after, on each sliced axis
    one = _one_static_slice(n)
    if one is not None:
        return e.place(g, n.x, *one)
    starts, ends, axes = (_i64(n, v) for v in (n.ins[1], n.ins[2], n.input(3)))
    if axes is None:
        axes = e.Range(0, e.Size(starts), 1)
    dim = _dims(n, n.x, axes)

    def clamp(i):
        return e.Min(e.Max(e.Where(e.Less(i, 0), i + dim, i), 0), dim)

    begin = clamp(starts)
    return _zero_pad(n, g, begin, dim - e.Max(clamp(ends), begin), axes)


def _one_static_slice(n):
    """(axis, start, stop) of a unit-step Slice of one axis with constant bounds, of static
    length, that takes something, else None."""
    starts, ends = n.const(1), n.const(2)
    axes = n.const(3) if n.input(3) is not None else np.zeros(1, np.int64)
    x = n.x
    if starts is None or ends is None or axes is None or starts.size != 1 or ends.size != 1 \
            or axes.size != 1 or x.shape is None:
        return None
    a = int(axes.ravel()[0]) % len(x.shape)
    d = x.shape[a]
    if not isinstance(d, int):
        return None
    clamp = lambda i: min(max(i + d if i < 0 else i, 0), d)  # noqa: E731  (ONNX's rule)
    start = clamp(int(starts.ravel()[0]))
    stop = max(clamp(int(ends.ravel()[0])), start)
    return (a, start, stop) if stop > start else None


@register("Pad")
def _pad(n, g):
    pads, value, axes = n.ins[1], n.input(2), n.input(3)
    mode = attr(n, "mode")
    if mode != "constant":  # reflect, edge, wrap: copies of x's elements
        return _replay(n, g, lambda i: n.e.Pad(i, pads, None, axes, mode=mode)), None, None, None
    known = n.const(1)
    dx = _unpad(n, g, pads, axes, crop_only=known is not None and bool((known >= 0).all()))
    # constant_value fills every element of y that does not come from x
    dv = None if value is None else n.e.Reshape(
        n.e.ReduceSum(g, keepdims=0) - n.e.ReduceSum(dx, keepdims=0), n.e.Shape(value))
    return dx, None, dv, None


@register("CenterCropPad")
def _center_crop_pad(n, g):
    """A centred crop and a centred zero pad are each other's adjoints: g is cropped where x
    was padded and zero-padded where x was cropped, floor(difference / 2) in front (as the
    forward). Written as Slice and a full-rank Pad, not as CenterCropPad, whose function body
    pads through Pad's axes input (see _zero_pad)."""
    e, axes = n.e, n.attr("axes")
    axes = e.const(np.arange(_rank(n.x)) if axes is None else np.array(axes))
    d, t = _dims(n, n.x, axes), _dims(n, g, axes)
    start = e.Div(e.Max(t - d, 0), 2)
    cut = e.Slice(g, start, start + e.Min(d, t), axes)
    grow = e.Max(d - t, 0)
    front = e.Div(grow, 2)
    return _zero_pad(n, cut, front, grow - front, axes), None


# -- broadcasting copies -----------------------------------------------------------------------
@register("Expand")
def _expand(n, g):
    return n.sum_to(g, n.x), None


@register("Tile")
def _tile(n, g):
    e, x, reps = n.e, n.x, n.ins[1]
    if x.rank == 0:
        return g, None
    # y viewed as [r0, d0, r1, d1, ...]: summing over the repeat axes leaves x
    view = e.Reshape(e.Concat(e.Unsqueeze(reps, [1]), e.Unsqueeze(e.Shape(x), [1]), axis=1), [-1])
    axes = (list(range(0, 2 * x.rank, 2)) if x.rank is not None
            else e.Range(0, e.Size(reps) * 2, 2))
    return e.reduce("ReduceSum", e.Reshape(g, view), axes, keepdims=0), None


# -- gathers -> scatter-adds -------------------------------------------------------------------
@register("Gather")
def _gather(n, g):
    e, x, idx = n.e, n.x, n.ins[1]
    a = _axis(x, attr(n, "axis"))
    k = n.const(1)
    if k is not None and np.ndim(k) == 0 and g.dtype not in HALF:
        # one constant slice (q, k, v = qkv[0], qkv[1], qkv[2]): g zero-padded back into place,
        # one pass, instead of zeros of x's shape and a ScatterND (2.5x the time on 6 MB)
        return _pad_back(n, x, a, int(k), g), None
    if a == 0:  # the embedding case: whole rows, no per-element indices
        return _scatter_add(n, "ScatterND", x, e.Unsqueeze(_i64(n, idx), [-1]), g), None
    # idx's dims (in the middle of g) made one, then each element of g scattered along axis a
    s = e.Shape(x)
    t = e.Reshape(g, e.Concat(e.Slice(s, [0], [a]), [-1], e.Slice(s, [a + 1], [END]), axis=0))
    trailing = list(range(1, _rank(x) - a))  # idx as [K, 1, ...]: it broadcasts over t
    i = e.Reshape(idx, [-1])
    i = e.Expand(e.Unsqueeze(i, trailing) if trailing else i, e.Shape(t))
    return _scatter_add(n, "ScatterElements", x, i, t, axis=a), None


def _pad_back(n, x, a, k, g):
    """The gradient of Gather(x, k, axis=a) for a constant scalar k: g put back at x[..., k, ...]
    with zeros on either side."""
    e = n.e
    d = x.shape[a] if x.shape is not None else None
    if isinstance(d, int) or k >= 0:
        k = k % d if isinstance(d, int) else k
        return e.place(e.Unsqueeze(g, [a]), x, a, k, k + 1)
    # k counts from the end of a dim known at run time only
    before = e.Add(e.Slice(e.Shape(x), [a], [a + 1]), [k])
    return e.Pad(e.Unsqueeze(g, [a]), e.axis_pads(x, a, before, -k - 1))


@register("GatherElements")
def _gather_elements(n, g):
    return _scatter_add(n, "ScatterElements", n.x, n.ins[1], g, axis=attr(n, "axis")), None


@register("GatherND")
def _gather_nd(n, g):
    b = attr(n, "batch_dims")
    if b:  # ScatterND has no batch_dims: replay the gather on element numbers instead
        return _replay(n, g, lambda i: n.e.GatherND(i, n.ins[1], batch_dims=b)), None
    return _scatter_add(n, "ScatterND", n.x, n.ins[1], g), None


@register("TopK")
def _topk(n, g):  # the values go back where the indices output says they came from
    return n.e.ScatterElements(n.e.zeros_like(n.x), n.outs[1], g, axis=attr(n, "axis")), None


# -- scatters -> gathers -----------------------------------------------------------------------
def _scatter_rule(gather):
    def scatter(n, g):
        e, (data, idx, upd) = n.e, n.ins
        kw = {"axis": attr(n, "axis")} if gather == "GatherElements" else {}
        take = lambda t: e.op(gather, t, idx, **kw)  # noqa: E731  (t at the scattered positions)
        reduction = attr(n, "reduction", "none")  # absent before opset 16
        if reduction == "none":  # the scattered positions of data were overwritten
            dupd = None
            if n.wants(n.node.inputs[2]):
                dupd = take(g)
                if not _distinct_targets(n, gather):  # only the update kept counts
                    dupd = dupd * kept_share(n, n.node.op_type, data, idx, upd, n.y, take, **kw)
            return e.op(n.node.op_type, g, idx, e.zeros_like(upd), **kw), None, dupd
        if reduction == "add":
            return g, None, take(g)
        if reduction in ("max", "min"):  # to whatever equals the result, split among ties
            hit_d = e.Cast(e.Equal(data, n.y), to=g.dtype)
            hit_u = e.Cast(e.Equal(upd, take(n.y)), to=g.dtype)
            share = g / (hit_d + _scatter_add(n, n.node.op_type, data, idx, hit_u, **kw))
            return share * hit_d, None, take(share) * hit_u
        if reduction == "mul":
            return _scatter_mul(n, g, take, kw)
        raise NotDifferentiableError(f"{n.node.op_type}(reduction={reduction!r})", "", n.opset,
                                     n.node.name, [])
    return scatter


def kept_share(n, op: str, data: V, idx: V, upd: V, y: V, take, **kw) -> V:
    """The share of g at its target each element of ``upd`` gets from a write without reduction
    (``op``: ScatterElements, ScatterND) whose indices may repeat: 1 for the update the output
    holds, 0 for those overwritten (the standard leaves the order of repeated writes open; the
    output's value tells which was kept, whatever order the runtime took), split evenly among
    repeated updates of that same value."""
    e = n.e
    held = e.Cast(e.Equal(upd, take(y)), to=upd.dtype)
    return held / take(_scatter_add(n, op, data, idx, held, **kw))


def _distinct_targets(n, gather: str) -> bool:
    """The scatter's indices are a constant that writes no element twice."""
    idx, shape = n.const(1), n.node.inputs[0].shape
    dims = [d if isinstance(d, int) else None for d in shape] if shape is not None else None
    if idx is None or dims is None:
        return False
    idx = idx.astype(np.int64)
    if gather == "GatherElements":  # element (.., idx[.., j, ..], ..) along axis, per line
        a = attr(n, "axis") % idx.ndim
        if dims[a] is None:
            return False
        lines = np.moveaxis(idx % dims[a], a, -1).reshape(-1, idx.shape[a])
        return all(len(set(line)) == len(line) for line in lines)
    k = idx.shape[-1]
    if None in dims[:k]:
        return False
    rows = (idx.reshape(-1, k) % np.array(dims[:k], np.int64)).tolist()
    return len(set(map(tuple, rows))) == len(rows)


def _scatter_mul(n, g, take, kw):
    """reduction="mul": y = data * P, P the product of the updates that hit each element (1 where
    none does). d data = g * P; d update_k = (g * data)[idx_k] * the product of the OTHER updates
    at idx_k. Exact with zeros among the updates and repeated indices, and no division by zero:
    with nz = the updates with zeros made ones, Pnz = the product of the non-zero updates and zc
    the number of zero updates per element (two scatters), P = Pnz where zc is 0 (else 0) and
    others_k = Pnz[idx_k] / nz_k where zc[idx_k] - [u_k == 0] is 0 (else 0: another zero hits
    that element). Half precision is computed in float32 (onnxruntime's CPU kernels have no
    half-precision scatter reductions)."""
    e, (data, idx, upd), op = n.e, n.ins, n.node.op_type
    e.need(16)  # reduction="mul"
    half = upd.dtype in HALF
    f = ir.DataType.FLOAT if half else upd.dtype
    u = e.Cast(upd, to=f) if half else upd
    is0 = e.Equal(u, 0)
    zero = e.Cast(is0, to=f)
    nz = e.Where(is0, 1, u)
    pnz = e.op(op, e.fill_like(data, 1, f), idx, nz, reduction="mul", **kw)
    zc = e.op(op, e.fill_like(data, 0, f), idx, zero, reduction="add", **kw)
    narrow = (lambda t: e.Cast(t, to=upd.dtype)) if half else (lambda t: t)  # noqa: E731
    ddata = dupd = None
    if n.wants(n.node.inputs[0]):
        ddata = g * narrow(e.Where(e.Greater(zc, 0), 0, pnz))
    if n.wants(n.node.inputs[2]):
        others = e.Where(e.Equal(take(zc), zero), take(pnz) / nz, 0)
        dupd = take(g * data) * narrow(others)
    return ddata, None, dupd


register("ScatterElements", _scatter_rule("GatherElements"))
register("ScatterND", _scatter_rule("GatherND"))


@register("TensorScatter", since=24)
def _tensor_scatter(n, g):
    """present = past_cache with update written along ``axis`` at positions w[b] + j of batch row
    b (w = write_indices, zeros when absent; modulo the axis size in circular mode). past_cache's
    gradient is g with those positions overwritten by zeros (the same write); update's is g read
    back at them. write_indices is integer: no gradient."""
    e, past, upd, w = n.e, n.x, n.ins[1], n.input(2)
    axis, mode = attr(n, "axis"), attr(n, "mode")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    dpast = dupd = None
    if n.wants(n.node.inputs[0]):
        dpast = e.TensorScatter(g, e.zeros_like(upd), w, axis=axis, mode=mode)
    if n.wants(n.node.inputs[1]):
        if w is None:  # written at 0 .. S-1: a crop of g (S <= the axis size: no wrap-around)
            dupd = e.Slice(g, [0], _dims(n, upd, [axis]), [axis])
        else:  # per row positions [B, S], made [B, 1, .., S, .., 1] and read with GatherElements
            a, rank = _axis(past, axis), _rank(past)
            at = lambda t: e.Gather(e.Shape(t), e.const(np.array(a, np.int64)))  # noqa: E731
            pos = e.Unsqueeze(_i64(n, w), [1]) + e.Unsqueeze(e.Range(0, at(upd), 1), [0])
            if mode == "circular":
                pos = e.Mod(pos, at(past))
            spread = [i for i in range(1, rank) if i != a]
            pos = e.Unsqueeze(pos, spread) if spread else pos
            dupd = e.GatherElements(g, e.Expand(pos, e.Shape(upd)), axis=a)
    return dpast, dupd, None
