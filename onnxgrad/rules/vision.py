"""Gradient rules: resampling and vision ops (Resize, Upsample, AffineGrid, Compress, GridSample,
RoiAlign, MaxRoiPool, DeformConv).

- Resize / Upsample: linear in X and separable: each resized axis k applies an (out_k x in_k)
  interpolation matrix M_k (nearest, linear and cubic alike, every coordinate transformation
  mode, antialias, exclude_outside), and the gradient applies M_k^T along each axis with MatMul
  (its rule gives the higher orders). M_k^T is the same Resize (the node's attributes, that
  axis' scale or size and roi) applied to the identity in the gradient graph
  (``_probe_matrix``), so it is the interpolation of the runtime that runs the forward, whose
  scales and sizes may be computed at run time (every torch export of F.interpolate(size=...))
  and whose spatial dims may be symbolic. (onnx's reference Resize, which built these matrices
  as constants before, disagrees with onnxruntime's and torch's for align_corners,
  tf_crop_and_resize, pytorch_half_pixel and half_pixel_symmetric at most scales, and for
  nearest wherever a coordinate lands on a rounding tie in float32.) An axis whose scale is 1 or
  whose size is the input's own dim (the batch and channels of those exports) is skipped.
  Static sizes with keep_aspect_ratio_policy not_larger / not_smaller give every resized axis
  one scale and round_half_up(scale * in) elements: their matrices come from onnxruntime's
  Resize of probes at build time (``_policy_matrices``); run-time sizes with a policy are
  refused.
- Compress: the selected elements go back where they came from (replay of element numbers).
- MaxRoiPool: g goes to the elements of each bin that equal its maximum (bins rebuilt from rois).
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import onnx_ir as ir
from onnx import helper

from ..registry import register
from .shape import END, HALF, _replay
from .spec import attr, no_gradient


def _s(v):
    return v.decode() if isinstance(v, bytes) else v


# -- Resize / Upsample ---------------------------------------------------------------------------
def _resize_grad(n, g, attrs, roi, scales, sizes, axes):
    """Shared by Resize and Upsample: the adjoint of the separable interpolation, one matrix
    M_k (out_k x in_k) per resized axis, applied as M_k^T along it. roi, scales, sizes: the
    node's inputs (V), or numpy constants (Upsample's attribute), or None when absent."""
    e, x = n.e, n.x
    xs = x.shape
    if xs is None:
        raise NotImplementedError(f"Resize gradient at node {n.node.name!r}: the rank of its "
                                  "input is unknown; run onnx shape inference first")
    rank = len(xs)
    if n.y.shape is not None and 0 in list(n.y.shape):
        # nothing reads x; and onnxruntime's MatMul over an empty inner dim may leave its
        # output unwritten (uninitialised memory, seen as 1e34s) instead of zeros
        return e.zeros_like(x)
    axes = list(range(rank)) if axes is None else [a % rank for a in axes]
    sc_el, sz_el = _elements(scales), _elements(sizes)
    by_sizes = sizes is not None and (scales is None or sc_el == [])
    if not by_sizes and (scales is None or sc_el == []):
        raise NotImplementedError(f"Resize node {n.node.name!r} has neither scales nor sizes")
    el = sz_el if by_sizes else sc_el
    if el is None:
        raise NotImplementedError(
            f"Resize gradient at node {n.node.name!r}: cannot tell how many entries its run-time "
            f"{'sizes' if by_sizes else 'scales'} hold (declare its shape or run shape inference)")
    crop = _s(attrs.get("coordinate_transformation_mode")) == "tf_crop_and_resize"
    roi_el = _elements(roi) if crop else None
    numbers = lambda t: t is not None and all(isinstance(v, (int, float)) for v in t)  # noqa: E731
    if by_sizes and _s(attr(n, "keep_aspect_ratio_policy", "stretch")) != "stretch":
        if not (numbers(el) and (roi_el is None or numbers(roi_el))
                and all(isinstance(xs[a], int) for a in axes)):
            raise NotImplementedError(
                f"Resize gradient at node {n.node.name!r}: keep_aspect_ratio_policy with sizes "
                "known only at run time (one scale chosen across the axes) is not supported")
        return _policy_resize(n, g, attrs, None if roi_el is None else np.array(roi_el),
                              np.array(el, np.int64), axes)
    dx = g
    for a in reversed(range(rank)):
        if a not in axes:
            continue
        k = axes.index(a)
        r = None if roi_el is None else (roi_el[k], roi_el[len(axes) + k])
        if r in (None, (0.0, 1.0)) and (el[k] in (("dim", x.value, a), xs[a]) if by_sizes
                                         else el[k] == 1.0):
            continue  # untouched: the batch and channels of an exported F.interpolate
        dx = _along(e, dx, a, rank, _probe_matrix(n, g.dtype, a, attrs, crop, roi, scales, sizes,
                                                  by_sizes, k, len(axes)))
    return dx


def _along(e, t, a, rank, mt):
    """t contracted along axis a with M (its out x in matrix), given as M^T [in, out]."""
    if a == rank - 2:
        return e.MatMul(mt, t)
    m = e.Transpose(mt, perm=[1, 0])
    if a == rank - 1:
        return e.MatMul(t, m)
    perm = list(range(rank))
    perm[a], perm[-1] = perm[-1], perm[a]
    return e.Transpose(e.MatMul(e.Transpose(t, perm=perm), m), perm=perm)


def _probe_matrix(n, dtype, a, attrs, crop, roi, scales, sizes, by_sizes, k, count):
    """M^T [in, out] of axis a, at run time: the identity of the axis' length, each row a
    probe image [in, 1, 1, in] (the probes along the batch), resized by the node's own op and
    attributes along its last axis alone with entry k of the node's scales or sizes (and of
    roi's starts and ends): the interpolation is separable, and an axis' weights depend only
    on its own lengths, scale and roi. (4-D with unit outer scales: every mode onnxruntime's
    Resize runs, cubic and antialias included.)"""
    e, x = n.e, n.x
    calc = ir.DataType.FLOAT if dtype in HALF else dtype  # onnxruntime's Resize and EyeLike
    i64, f32 = ir.DataType.INT64, ir.DataType.FLOAT
    d = e.Slice(e.Shape(x), [a], [a + 1])

    def cat(dt, *parts):  # lists of numbers as constants of dt, values cast to dt
        return e.Concat(*[e.const(np.array(q), dt) if isinstance(q, list) else _cast(e, q, dt)
                          for q in parts], axis=0)

    def entry(v, i):
        return e.const(v.reshape(-1)[i:i + 1]) if isinstance(v, np.ndarray) else \
            e.Slice(v, [i], [i + 1])

    zero = ir.tensor(np.zeros(1, calc.numpy()))
    eye = e.EyeLike(e.ConstantOfShape(cat(i64, d, d), value=zero), _dtype=calc)
    probe = e.Reshape(eye, cat(i64, d, [1, 1], d))
    roi_in = scales_in = sizes_in = None
    if crop and roi is not None:
        rdt = f32 if isinstance(roi, np.ndarray) else roi.dtype
        roi_in = cat(rdt, [0.0] * 3, entry(roi, k), [1.0] * 3, entry(roi, count + k))
    if by_sizes:
        sizes_in = cat(i64, d, [1, 1], entry(sizes, k))
    else:
        scales_in = cat(f32, [1.0] * 3, entry(scales, k))
    kept = {key: v for key, v in attrs.items() if v is not None and key in _PROBE_ATTRS}
    if e.opset < 18:
        kept.pop("antialias", None)
    y = e.op("Resize", probe, roi_in, scales_in, sizes_in, _dtype=calc, **kept)
    mt = e.Reshape(y, cat(i64, d, [-1]))
    return mt if calc == dtype else e.Cast(mt, to=dtype)


_PROBE_ATTRS = ("mode", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside",
                "nearest_mode", "antialias")


def _policy_resize(n, g, attrs, roi, sizes, axes):
    """The adjoint of a Resize by static sizes with keep_aspect_ratio_policy not_larger /
    not_smaller, from constant matrices (:func:`_policy_matrices`). sizes/roi: numpy constants
    (roi None unless tf_crop_and_resize), in the order of ``axes``."""
    xs = n.x.shape
    dims = tuple(xs[a] if a in axes else 1 for a in range(len(xs)))
    key = tuple(sorted((k, v) for k, v in attrs.items() if v is not None))
    mats = _policy_matrices(dims, tuple(axes), tuple(int(s) for s in sizes.ravel()),
                            None if roi is None else tuple(roi.astype(float).ravel().tolist()),
                            key, _s(attr(n, "keep_aspect_ratio_policy")), n.node.name)
    if any(m.shape[0] == 0 for m in mats.values()):
        return n.e.zeros_like(n.x)  # an empty output (see _resize_grad)
    dx = g
    for a in sorted(axes, reverse=True):
        dx = _along(n.e, dx, a, len(xs), n.e.const(np.ascontiguousarray(mats[a].T), g.dtype))
    return dx


@functools.lru_cache(maxsize=64)
def _policy_matrices(dims: tuple, axes: tuple, sizes: tuple, roi: tuple | None, attrs: tuple,
                     policy: str, name: str) -> dict:
    """{axis: M (out x in)} of a Resize by static sizes with a keep_aspect_ratio_policy, from
    onnxruntime's own kernel at build time (dims: x's shape, 1 on the axes not resized). The
    policy picks one scale across the axes, which no resize of one axis alone reproduces, so
    the node's Resize runs on probes of all its axes: along axis a one element of the identity,
    along the others ones. Every row of an interpolation's weights sums to 1 (0 where
    tf_crop_and_resize extrapolates: the probes extrapolate 0), so the output read where the
    resize of ones is largest is a column of M_a. The matrices are checked against
    onnxruntime's Resize of a random image, or the gradient is refused."""
    from ..runtime import session
    k = len(axes)
    kw = dict(attrs, axes=list(axes), keep_aspect_ratio_policy=policy, extrapolation_value=0.0)
    inits = [helper.make_tensor("roi", 1, [2 * k], list(roi or [0.0] * k + [1.0] * k)),
             helper.make_tensor("sizes", 7, [k], list(sizes))]
    node = helper.make_node("Resize", ["x", "roi", "", "sizes"], ["y"], **kw)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", 1, dims)],
                              [helper.make_tensor_value_info("y", 1, None)], inits)
    run = session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)],
                                    ir_version=10))

    def resize(x):
        return run.run(["y"], {"x": np.asarray(x, np.float32)})[0].astype(np.float64)

    try:
        ones = resize(np.ones(dims))
    except Exception as err:  # noqa: BLE001  (onnxruntime's own refusal of the attributes)
        raise NotImplementedError(
            f"Resize gradient at node {name!r}: onnxruntime's Resize does not run it "
            f"(keep_aspect_ratio_policy={policy!r}, {dict(attrs)}): {err}") from None
    if not ones.size:  # an empty output: nothing reads x (see _policy_resize)
        return {a: np.zeros((ones.shape[a], dims[a])) for a in axes}
    at = np.unravel_index(int(np.argmax(ones)), ones.shape)
    mats = {}
    for a in axes:
        cols = []
        for i in range(dims[a]):
            probe = np.ones(dims)
            probe[(slice(None),) * a + (slice(0, i),)] = 0
            probe[(slice(None),) * a + (slice(i + 1, None),)] = 0
            cols.append(resize(probe)[at[:a] + (slice(None),) + at[a + 1:]])
        mats[a] = np.stack(cols, axis=1)
    x = np.random.default_rng(0).standard_normal(dims)
    got = x
    for a in axes:
        got = np.moveaxis(np.tensordot(mats[a], np.moveaxis(got, a, 0), axes=1), 0, a)
    want = resize(x)
    if got.shape != want.shape or (want.size and np.abs(got - want).max() > 1e-4 * max(
            1.0, np.abs(want).max())):
        raise NotImplementedError(
            f"Resize gradient at node {name!r}: onnxruntime's Resize with "
            f"keep_aspect_ratio_policy={policy!r} and {dict(attrs)} does not factor into one "
            "interpolation matrix per axis here")
    return mats


def _elements(v):
    """What is known statically of a 1-D input's entries: a list of numbers, ("dim", value,
    axis) for an entry that is Shape(value)[axis], or None for an entry only the run time
    knows; None when even the number of entries is unknown. ``v`` a V, a numpy constant
    (given as is) or None (absent: None)."""
    if v is None:
        return None
    if isinstance(v, np.ndarray):
        return v.reshape(-1).tolist()
    got = _entries(v.value, 8)
    if got is None and v.shape is not None and len(v.shape) == 1 and isinstance(v.shape[0], int):
        got = [None] * v.shape[0]
    return got


def _entries(v, depth):
    const = _fold(v, depth)
    if const is not None:
        return np.asarray(const).reshape(-1).tolist()
    p = v.producer()
    if p is None or depth <= 0 or p.domain not in ("", "ai.onnx"):
        return None
    op, ins = p.op_type, list(p.inputs)
    if op == "Shape" and ins[0].shape is not None:
        rank = len(ins[0].shape)
        start, end = p.attributes.get("start"), p.attributes.get("end")
        lo = 0 if start is None else start.value
        hi = rank if end is None else end.value
        return [("dim", ins[0], i) for i in range(rank)][slice(lo, hi)]
    if op in ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape"):
        return _entries(ins[0], depth - 1)
    if op == "Concat":
        parts = [_entries(i, depth - 1) for i in ins]
        if any(q is None for q in parts):
            parts = [q if q is not None else _length_unknown(i) for q, i in zip(parts, ins)]
            if any(q is None for q in parts):
                return None
        return [item for q in parts for item in q]
    if op in ("Slice", "Gather"):
        data = _entries(ins[0], depth - 1)
        consts = [None if i is None else _fold(i, depth - 1) for i in ins[1:]]
        if data is None or any(c is None for i, c in zip(ins[1:], consts) if i is not None):
            return None
        if op == "Gather":
            return [data[int(i)] for i in np.asarray(consts[0]).reshape(-1)]
        first = [None if c is None else int(np.asarray(c).reshape(-1)[0]) for c in consts]
        step = first[3] if len(first) > 3 and first[3] is not None else 1
        return data[slice(first[0], first[1], step)]
    return None


def _length_unknown(v):
    """[None] * length for a 1-D value of static length, else None."""
    s = v.shape
    return [None] * s[0] if s is not None and len(s) == 1 and isinstance(s[0], int) else None


_RESIZE_ATTRS = ("mode", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside",
                 "nearest_mode", "antialias", "extrapolation_value")


def _fold(v, depth):
    if v is None or v.is_graph_input():
        return None
    if v.const_value is not None:
        return v.const_value.numpy()
    p = v.producer()
    if p is None or depth <= 0 or p.domain not in ("", "ai.onnx") or any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
            for a in p.attributes.values()) or p.op_type.startswith("Random"):
        return None
    feeds = {}
    for x in p.inputs:
        if x is not None:
            val = _fold(x, depth - 1)
            if val is None:
                return None
            feeds[x.name] = val
    from onnx.reference import ReferenceEvaluator
    node = ir.serde.serialize_node(p)
    try:
        outs = ReferenceEvaluator(node).run(None, feeds)
    except Exception:  # noqa: BLE001  (not foldable: the rule reports what it lacks)
        return None
    return np.asarray(outs[list(p.outputs).index(v)])


@register("Resize", since=11)
def _resize(n, g):
    attrs = {k: _s(n.attr(k)) for k in _RESIZE_ATTRS}
    attrs["extrapolation_value"] = None  # the adjoint of the linear part
    dx = _resize_grad(n, g, attrs, n.input(1), n.input(2), n.input(3), n.attr("axes"))
    return (dx,) + (None,) * (len(n.ins) - 1)


def _asymmetric(mode):
    """Resize's attributes of Resize-10 and Upsample (as version_converter maps them)."""
    mode = "linear" if mode in ("linear", "bilinear") else mode
    return {"mode": mode, "coordinate_transformation_mode": "asymmetric",
            "nearest_mode": "floor" if mode == "nearest" else None}


@register("Resize", since=10, until=10)
def _resize10(n, g):
    return _resize_grad(n, g, _asymmetric(_s(attr(n, "mode"))), None, n.input(1), None,
                        None), None


@register("Upsample")
def _upsample(n, g):
    scales = n.attr("scales")  # Upsample-7 holds them in an attribute, Upsample-9 in an input
    scales = np.array(scales, np.float32) if scales is not None else n.input(1)
    dx = _resize_grad(n, g, _asymmetric(_s(attr(n, "mode"))), None, scales, None, None)
    return (dx,) + (None,) * (len(n.ins) - 1)


no_gradient("Resize", roi="non-differentiable in the ONNX schema",
            scales="non-differentiable in the ONNX schema")
no_gradient("Upsample", scales="as Resize's (Upsample is upgraded to Resize)")


# -- AffineGrid ---------------------------------------------------------------------------------
@register("AffineGrid", since=20)
def _affine_grid(n, g):
    """grid[n, ..., :] = theta[n] @ [base(...), 1]: linear in theta, so dtheta is an Einsum of g
    with the base grid, which AffineGrid itself makes from the identity (size may be dynamic)."""
    e, theta, size = n.e, n.x, n.ins[1]
    # 2 (2-D) or 3 (3-D): theta's rows, or the length of size (N, C and the spatial dims), or
    # the grid's rank (N, the spatial dims and the coordinates)
    ks = [theta.shape[1] if theta.rank == 3 else None,
          size.shape[0] - 2 if size.rank == 1 and isinstance(size.shape[0], int) else None,
          n.y.rank - 2 if n.y.rank is not None else None]
    k = next((k for k in ks if isinstance(k, int)), None)
    if k is None:
        raise NotImplementedError(f"AffineGrid gradient at node {n.node.name!r}: neither theta's "
                                  "shape, size's length nor the grid's rank is known, so 2-D "
                                  "cannot be told from 3-D")
    eye = e.const(np.eye(k, k + 1)[None], theta.dtype)
    one_size = e.Concat([1], e.Slice(size, [1], [END]), axis=0)
    base = e.AffineGrid(eye, one_size, align_corners=attr(n, "align_corners"))
    base = e.Squeeze(base, [0])
    base = e.Concat(base, e.fill_like(e.Slice(base, [0], [1], [-1]), 1), axis=-1)
    sp = "hw" if k == 2 else "dhw"
    return e.Einsum(g, base, equation=f"n{sp}i,{sp}j->nij"), None


# -- Compress ------------------------------------------------------------------------------------
@register("Compress")
def _compress(n, g):
    axis = n.attr("axis")
    return _replay(n, g, lambda i: n.e.Compress(i, n.ins[1], axis=axis), add=False), None


# -- sampling at fractional coordinates: GridSample, RoiAlign, DeformConv -------------------------
_I64, _F32 = ir.DataType.INT64, ir.DataType.FLOAT
_A = -0.75  # GridSample's cubic coefficient (Keys)


def _cubic(t):
    """Keys' cubic weights of the taps at floor-1 .. floor+2 (t = c - floor(c)) and their
    derivatives in t, as polynomials: [(w, dw)] * 4."""
    s, u, v = t + 1.0, 1.0 - t, 2.0 - t

    def far(z):  # |z| in [1, 2]
        return ((z * _A - 5 * _A) * z + 8 * _A) * z - 4 * _A, (z * (3 * _A) - 10 * _A) * z + 8 * _A

    def near(z):  # |z| in [0, 1]
        return (z * (_A + 2) - (_A + 3)) * z * z + 1.0, (z * (3 * (_A + 2)) - 2 * (_A + 3)) * z

    (w0, d0), (w1, d1), (w2, d2), (w3, d3) = far(s), near(t), near(u), far(v)
    return [(w0, d0), (w1, d1), (w2, -d2), (w3, -d3)]


def _reflect(e, c, lo, hi):
    """c reflected at lo and hi until it lies in [lo, hi] (GridSample's reflection), and the
    derivative of that map (+1 or -1)."""
    rng = hi - lo
    period = rng * 2.0
    t = c - lo
    m = t - e.Floor(t / period) * period
    back = e.Greater(m, rng)
    r = e.Where(back, period - m, m)
    r = e.Where(e.Greater(rng, 0.0), r, e.zeros_like(r))  # an axis of one pixel
    return lo + r, e.Where(back, e.const(-1.0, c.dtype), e.const(1.0, c.dtype))


def _axis_taps(e, c, size, sizef, mode, padding, lo, hi):
    """One axis of GridSample: the taps (int64 index, weight, d weight / dc) at pixel
    coordinates c, after the spec's coordinate padding and with each tap's own padding (zeros:
    a tap outside the axis weighs 0; border: clamped; reflection: reflected); and dc'/dc, the
    derivative of the coordinate padding."""
    one = e.const(1.0, c.dtype)
    dfac = None
    if mode == "nearest":
        c = e.Round(c)  # half to even, as the spec and PyTorch
    # border: each tap is clamped; for linear and nearest that equals the spec's clamping of
    # the coordinate, for cubic it is what onnxruntime and PyTorch compute (onnx.reference
    # clamps the coordinate first, so its cubic border values differ from theirs)
    if padding == "reflection":
        c, dfac = _reflect(e, c, lo, hi)
    last = sizef - 1.0

    def pad(i):  # float tap index -> (int64 index inside the axis, weight factor or None)
        if padding == "zeros":
            ok = e.Cast(e.And(e.GreaterOrEqual(i, 0.0), e.LessOrEqual(i, last)), to=c.dtype)
            return e.Cast(e.Min(e.Max(i, 0.0), last), to=_I64), ok
        if padding == "reflection":
            i = _reflect(e, i, lo, hi)[0]
        return e.Cast(e.Round(e.Min(e.Max(i, 0.0), last)), to=_I64), None

    if mode == "nearest":
        idx, ok = pad(c)
        return [(idx, e.fill_like(c, 1) if ok is None else ok, None, None)], None
    f = e.Floor(c)
    t = c - f
    if mode in ("linear", "bilinear"):
        polys = [(f, one - t, -one), (f + 1.0, t, one)]
    else:
        polys = [(f + float(k - 1), w, dw) for k, (w, dw) in enumerate(_cubic(t))]
    taps = []
    for i, w, dw in polys:
        idx, ok = pad(i)
        taps.append((idx, w, dw, ok))
    return taps, dfac


def _combine(e, axis_taps, strides):
    """Taps of all axes combined: [(flat index, weight, [d weight / dc_axis])] per combination."""
    out = []
    for combo in itertools.product(*axis_taps):
        flat, ws = None, []
        for (idx, w, _, ok), st in zip(combo, strides):
            term = idx if st is None else idx * st
            flat = term if flat is None else flat + term
            ws.append(w if ok is None else w * ok)
        weight = functools.reduce(lambda a, b: a * b, ws)
        partial = []
        for j, (_, _, dw, ok) in enumerate(combo):
            if dw is None:  # nearest: piecewise constant
                continue
            p = dw if ok is None else dw * ok
            for k, w in enumerate(ws):
                if k != j:
                    p = p * w
            partial.append(p)
        out.append((flat, weight, partial))
    return out


def _scatter_add(e, zeros, idx, upd, axis):
    """ScatterElements(reduction="add") (opset 16); float16/bfloat16 add in float32, which
    onnxruntime's CPU kernel requires."""
    e.need(16)
    dt = upd.dtype
    if dt in HALF:
        r = e.ScatterElements(e.Cast(zeros, to=_F32), idx, e.Cast(upd, to=_F32), axis=axis,
                              reduction="add")
        return e.Cast(r, to=dt)
    return e.ScatterElements(zeros, idx, upd, axis=axis, reduction="add")


def _cast(e, v, dtype):
    return v if v.dtype == dtype else e.Cast(v, to=dtype)


@register("GridSample", since=16)
def _grid_sample(n, g):
    """Y[n, c, p] = sum over taps t of w_t(grid[n, p]) X[n, c, i_t(grid[n, p])]: each tap's
    indices and weights are rebuilt from the grid (the spec's coordinate and tap padding, any
    number of spatial axes). dX scatters g * w_t back to i_t (ScatterElements, reduction add);
    dgrid = sum_c g * sum_t X[i_t] dw_t/dgrid (a GatherElements), zero for nearest."""
    e, x, grid = n.e, n.x, n.ins[1]
    mode = _s(attr(n, "mode"))
    padding = _s(attr(n, "padding_mode"))
    align = bool(attr(n, "align_corners"))
    rank = x.rank if x.rank is not None else grid.rank
    if rank is None:
        raise NotImplementedError(f"GridSample gradient at node {n.node.name!r}: the rank of "
                                  "its inputs is unknown; run onnx shape inference first")
    nd = rank - 2
    dt = grid.dtype
    shape = e.Shape(x)
    sizes = [e.Gather(shape, e.const(np.array(2 + i, np.int64))) for i in range(nd)]
    sizef = [e.Cast(s, to=dt) for s in sizes]
    gf = e.Reshape(grid, [0, 1, -1, nd])                     # (N, 1, P, nd)
    axis_taps, dfacs, scales = [], [], []
    for i in range(nd):  # spatial axis i is grid component nd-1-i
        gc = e.Squeeze(e.Slice(gf, [nd - 1 - i], [nd - i], [3]), [3])   # (N, 1, P)
        if align:
            c, scale, lo, hi = (gc + 1.0) * (sizef[i] - 1.0) * 0.5, (sizef[i] - 1.0) * 0.5, \
                e.const(0.0, dt), sizef[i] - 1.0
        else:
            c, scale = ((gc + 1.0) * sizef[i] - 1.0) * 0.5, sizef[i] * 0.5
            lo, hi = e.const(-0.5, dt), sizef[i] - 0.5
        taps, dfac = _axis_taps(e, c, sizes[i], sizef[i], mode, padding, lo, hi)
        axis_taps.append(taps)
        dfacs.append(dfac)
        scales.append(scale)
    strides, acc = [None] * nd, None
    for i in reversed(range(nd)):
        strides[i] = acc
        acc = sizes[i] if acc is None else acc * sizes[i]
    combos = _combine(e, axis_taps, strides)
    count = len(combos)
    idx = e.Concat(*[c[0] for c in combos], axis=2)          # (N, 1, T*P)
    w = e.Concat(*[c[1] for c in combos], axis=2)
    xf = e.Reshape(x, [0, 0, -1])                            # (N, C, M)
    idx = e.Expand(idx, e.Concat(e.Shape(x, end=2), e.Shape(idx, start=2), axis=0))
    g3 = e.Tile(e.Reshape(g, [0, 0, -1]), [1, 1, count])     # (N, C, T*P)
    dx = None
    if n.wants(n.node.inputs[0]):
        dx = _scatter_add(e, e.zeros_like(xf), idx, g3 * _cast(e, w, g.dtype), 2)
        dx = e.Reshape(dx, shape)
    dgrid = None
    if n.wants(n.node.inputs[1]):
        if mode == "nearest":
            dgrid = e.zeros_like(grid)
        else:
            h = _cast(e, e.reduce("ReduceSum", g3 * e.GatherElements(xf, idx, axis=2), [1]), dt)
            parts = []
            for i in reversed(range(nd)):  # grid component k is spatial axis nd-1-k
                p = e.Concat(*[c[2][i] for c in combos], axis=2)          # (N, 1, T*P)
                d = e.reduce("ReduceSum", e.Reshape(h * p, [0, count, -1]), [1])  # (N, 1, P)
                d = d * scales[i]
                if dfacs[i] is not None:
                    d = d * dfacs[i]
                parts.append(e.Unsqueeze(d, [3]))
            dgrid = e.Reshape(e.Concat(*parts, axis=3), e.Shape(grid))
    return dx, dgrid


# -- RoiAlign ------------------------------------------------------------------------------------
def _roi_axis(e, c, size):
    """RoiAlign's bilinear taps along one axis at sample coordinates c (the spec's clamping):
    (in range, [(int64 index, weight)] * 2, d frac / d c). frac, the high tap's weight, moves
    with c except where c is clamped (c <= 0) or sits on the last row (both taps there)."""
    ok = e.And(e.GreaterOrEqual(c, -1.0), e.LessOrEqual(c, size))
    c0 = e.Max(c, 0.0)
    f = e.Floor(c0)
    top = e.GreaterOrEqual(f, size - 1.0)
    lo = e.Where(top, e.Expand(size - 1.0, e.Shape(f)), f)
    hi = e.Where(top, lo, f + 1.0)
    frac = e.Where(top, e.zeros_like(f), c0 - f)
    moves = e.Cast(e.And(e.Greater(c, 0.0), e.Not(top)), to=c.dtype)
    return ok, [(e.Cast(lo, to=_I64), 1.0 - frac), (e.Cast(hi, to=_I64), frac)], moves


def _roi_samples(e, start, size, bins, grid, dt):
    """Sample coordinates [R, bins, G] of one axis (G the largest per-roi grid), the mask of
    the samples that exist for each roi (i < grid[r]), and u = (p + (i + 0.5) / grid) / bins,
    the share of the roi's size in front of each sample (c = start + size * u)."""
    b = size / float(bins)                                   # bin size [R]
    gmax = e.Cast(e.reduce("ReduceMax", grid, [0], keepdims=0), to=_I64)
    i = e.Cast(e.Range(e.const(np.array(0, np.int64)), gmax, e.const(np.array(1, np.int64))),
               to=dt)                                        # [G]
    r3 = lambda t: e.Unsqueeze(t, [1, 2])                    # noqa: E731  [R] -> [R, 1, 1]
    p = e.const(np.arange(bins, dtype=np.float64).reshape(1, -1, 1), dt)
    safe = e.Max(grid, 1.0)
    i3 = e.Unsqueeze(i, [0, 1]) + 0.5
    c = r3(start) + p * r3(b) + i3 * r3(b / safe)            # the forward's own arithmetic
    u = (p + i3 / r3(safe)) * (1.0 / bins)
    return c, e.Less(e.Unsqueeze(i, [0, 1]), r3(grid)), u


@register("RoiAlign", since=10)
def _roi_align(n, g):
    """Y[r, c, ph, pw] averages (or takes the max of) bilinear samples of X[batch[r], c] on a
    grid in each bin. The samples' taps and weights are rebuilt from rois (the spec's clamping,
    sampling_ratio 0 meaning ceil(roi size / bins) per roi: samples up to the largest grid, the
    others masked). Each bin's cotangent per tap K (g / count for avg; for max, g at the tap
    w * X of the bin's largest product) gives dX = K * w scattered with ScatterElements add,
    and the rois' gradient through the sample positions c = start + size * u (as
    crop_and_resize's boxes): dY/dc = K * X * dw/dc, dc/dstart = 1 - u, dc/dend = u (the size
    clamped to >= 1 in output_half_pixel mode moves neither), times spatial_scale. The grid
    count and the in-range test are piecewise constant in rois: no gradient through them.
    batch_indices are integers."""
    e, x = n.e, n.x
    rois, batch = n.ins[1], n.ins[2]
    dt = x.dtype
    mode = _s(attr(n, "mode"))
    half = _s(attr(n, "coordinate_transformation_mode")) == "half_pixel" \
        if n.opset >= 16 else False
    oh, ow = int(attr(n, "output_height")), int(attr(n, "output_width"))
    sr = int(attr(n, "sampling_ratio"))
    scale = float(attr(n, "spatial_scale"))
    want_x, want_rois = n.wants(n.node.inputs[0]), n.wants(n.node.inputs[1])
    shape = e.Shape(x)
    hw = [e.Cast(e.Gather(shape, e.const(np.array(i, np.int64))), to=dt) for i in (2, 3)]
    hw_i = [e.Gather(shape, e.const(np.array(i, np.int64))) for i in (2, 3)]
    r = _cast(e, rois, dt)
    col = lambda k: e.Squeeze(e.Slice(r, [k], [k + 1], [1]), [1]) * scale - (0.5 if half else 0.0)  # noqa: E731,E501
    x1, y1, x2, y2 = (col(k) for k in range(4))
    rw, rh = x2 - x1, y2 - y1
    grow_w = grow_h = None  # where the size follows the roi (not clamped to 1)
    if not half:
        grow_w, grow_h = (e.Cast(e.Greater(t, 1.0), to=dt) for t in (rw, rh))
        rw, rh = e.Max(rw, 1.0), e.Max(rh, 1.0)
    if sr > 0:
        gh = gw = e.Expand(e.const(float(sr), dt), e.Shape(rw))
    else:
        gh, gw = e.Ceil(rh / float(oh)), e.Ceil(rw / float(ow))
    cy, my, uy = _roi_samples(e, y1, rh, oh, gh, dt)         # [R, oh, Gh]
    cx, mx, ux = _roi_samples(e, x1, rw, ow, gw, dt)         # [R, ow, Gw]
    oky, ty, dfy = _roi_axis(e, cy, hw[0])
    okx, tx, dfx = _roi_axis(e, cx, hw[1])
    y5 = lambda t: e.Unsqueeze(t, [3, 4])                    # noqa: E731  -> [R, oh, Gh, 1, 1]
    x5 = lambda t: e.Unsqueeze(t, [1, 2])                    # noqa: E731  -> [R, 1, 1, ow, Gw]
    exists = e.And(y5(my), x5(mx))                           # the samples of each roi's grid
    inside = e.Cast(e.And(y5(oky), x5(okx)), to=dt)
    base = e.Unsqueeze(e.Cast(batch, to=_I64) * (hw_i[0] * hw_i[1]), [1, 2, 3, 4])
    taps = [(base + y5(iy) * hw_i[1] + x5(ix), y5(wy) * x5(wx) * inside)
            for iy, wy in ty for ix, wx in tx]               # 4 x ([R, oh, Gh, ow, Gw])
    tap7 = lambda ts: e.Concat(*[e.Unsqueeze(t, [5]) for t in ts], axis=5)  # noqa: E731
    idx7, w7 = tap7([i for i, _ in taps]), tap7([w for _, w in taps])      # [R,oh,Gh,ow,Gw,4]
    xt = e.Reshape(e.Transpose(x, perm=[1, 0, 2, 3]), [0, -1])    # [C, N*H*W]
    c_dim = e.Slice(e.Shape(xt), [0], [1])
    ex7 = e.Unsqueeze(e.Cast(exists, to=dt), [0, 6])          # [1, R, oh, Gh, ow, Gw, 1]
    vals = None                                               # X at every tap [C, R, ..., 4]
    if mode == "max" or want_rois:
        vals = e.Gather(xt, e.Reshape(idx7, [-1]), axis=1)
        vals = e.Reshape(vals, e.Concat(c_dim, e.Shape(idx7), axis=0))
    if mode == "avg":  # K: g / count on every tap of every existing sample
        count = e.Unsqueeze(e.Max(gh * gw, 1.0), [1, 2, 3, 4, 5])
        k7 = e.Unsqueeze(e.Transpose(e.Unsqueeze(g, [3, 5]), perm=[1, 0, 2, 3, 4, 5]), [6])
        k7 = k7 * (ex7 / e.Unsqueeze(count, [0]))            # [C, R, oh, Gh, ow, Gw, 1]
    else:  # max: the tap w * X of each bin's largest product, first in (iy, ix, tap) order
        prod = e.Where(e.Cast(ex7, to=ir.DataType.BOOL), vals * e.Unsqueeze(w7, [0]),
                       e.const(-np.inf, dt))                  # [C,R,oh,Gh,ow,Gw,4]
        flat = e.Reshape(e.Transpose(prod, perm=[1, 0, 2, 4, 3, 5, 6]), [0, 0, oh, ow, -1])
        am = e.ArgMax(flat, axis=-1, keepdims=1)
        hit = e.Equal(e.Range(e.const(np.array(0, np.int64)),
                              e.Squeeze(e.Shape(flat, start=-1), [0]),
                              e.const(np.array(1, np.int64))), am)
        k7 = e.Cast(hit, to=dt) * e.Unsqueeze(g, [4])                       # [R,C,oh,ow,S]
        k7 = e.Reshape(k7, e.Concat(e.Shape(g), e.Shape(idx7, start=2, end=3),
                                    e.Shape(idx7, start=4), axis=0))       # [R,C,oh,ow,Gh,Gw,4]
        k7 = e.Transpose(k7, perm=[1, 0, 2, 4, 3, 5, 6]) * ex7             # [C,R,oh,Gh,ow,Gw,4]
    dx = drois = None
    if want_x:
        upd = e.Reshape(e.Expand(k7 * e.Unsqueeze(w7, [0]),
                                 e.Concat(c_dim, e.Shape(idx7), axis=0)),
                        e.Concat(c_dim, [-1], axis=0))
        idx = e.Expand(e.Reshape(idx7, [1, -1]), e.Shape(upd))
        dxt = _scatter_add(e, e.zeros_like(xt), idx, upd, 1)
        dx = e.Transpose(e.Reshape(dxt, e.Concat(e.Shape(x, start=1, end=2), e.Shape(x, end=1),
                                                 e.Shape(x, start=2), axis=0)),
                         perm=[1, 0, 2, 3])
    if want_rois:
        d7 = e.reduce("ReduceSum", k7 * vals, [0], keepdims=0)  # dY/dw per tap [R,oh,Gh,ow,Gw,4]
        sign = (-1.0, 1.0)   # d w / d frac of the low and high tap
        dwy = tap7([y5(dfy * sy) * x5(wx) * inside for sy in sign for _, wx in tx])
        dwx = tap7([y5(wy) * x5(dfx * sx) * inside for _, wy in ty for sx in sign])
        dcy = e.reduce("ReduceSum", d7 * dwy, [3, 4, 5], keepdims=0)       # [R, oh, Gh]
        dcx = e.reduce("ReduceSum", d7 * dwx, [1, 2, 5], keepdims=0)       # [R, ow, Gw]

        def ends(dc, u, grow):  # d/d(start, end) of c = start + size * u
            du = dc * u if grow is None else dc * u * e.Unsqueeze(grow, [1, 2])
            total, moved = (e.reduce("ReduceSum", t, [1, 2], keepdims=0) for t in (dc, du))
            return total - moved, moved
        (dx1, dx2), (dy1, dy2) = ends(dcx, ux, grow_w), ends(dcy, uy, grow_h)
        drois = e.Concat(*[e.Unsqueeze(t, [1]) for t in (dx1, dy1, dx2, dy2)], axis=1) * scale
        drois = _cast(e, drois, rois.dtype)
    return dx, drois, None


# -- MaxRoiPool ----------------------------------------------------------------------------------
def _roi_bins(e, start, end, pooled, dim):
    """One axis of MaxRoiPool's bins as onnxruntime (like Caffe and torchvision) computes them,
    in float32 and integers: bin p of a roi covers [start + floor(p * b), start + ceil((p+1) * b))
    clipped to [0, dim), b = max(end - start + 1, 1) / pooled. Returns the element indices
    [R, pooled, K] (K the largest bin of all rois; indices past a bin's end stay inside the
    axis) and whether each is in its bin."""
    b = e.Unsqueeze(e.Cast(e.Max(end - start + 1, 1), to=_F32) / float(pooled), [1])  # [R, 1]
    s = e.Unsqueeze(start, [1])
    clip = lambda t: e.Min(e.Max(e.Cast(t, to=_I64) + s, 0), dim)  # noqa: E731
    lo = clip(e.Floor(e.const(np.arange(pooled, dtype=np.float32)) * b))         # [R, P]
    hi = clip(e.Ceil(e.const(np.arange(1, pooled + 1, dtype=np.float32)) * b))
    size = hi - lo
    k = e.Range(0, e.reduce("ReduceMax", e.Concat(e.Reshape(size, [-1]), [0], axis=0), [0],
                            keepdims=0), 1)                                       # [K]
    return e.Min(e.Unsqueeze(lo, [2]) + k, dim - 1), e.Less(k, e.Unsqueeze(size, [2]))


@register("MaxRoiPool")
def _max_roi_pool(n, g):
    """Y[r, c, i, j] is the max of X[batch[r], c] over bin (i, j) of roi r (0 for an empty bin).
    The bins are rebuilt from rois at run time with onnxruntime's arithmetic (float32 products,
    C's round half away from zero, floor/ceil bin edges, clipping) and every bin's elements
    gathered from X ([C, R, ph, Kh, pw, Kw], the forward's own cost); g goes to the elements equal
    to Y (the forward's max, reused), split evenly among ties, and is added up into X's shape
    (bins of overlapping rois share elements). rois get none (see NO_GRADIENT below)."""
    e, x, y = n.e, n.x, n.y
    ph, pw = (int(v) for v in n.attr("pooled_shape"))
    r = e.Cast(n.ins[1], to=_F32)
    batch = e.Cast(e.Squeeze(e.Slice(r, [0], [1], [1]), [1]), to=_I64)      # truncated, as C
    c = e.Slice(r, [1], [5], [1]) * float(attr(n, "spatial_scale"))   # x1, y1, x2, y2
    a = e.Abs(c)
    f = e.Floor(a)
    c = e.Cast(e.Sign(c) * e.Where(e.GreaterOrEqual(a - f, 0.5), f + 1.0, f), to=_I64)
    col = lambda k: e.Squeeze(e.Slice(c, [k], [k + 1], [1]), [1])          # noqa: E731
    shape = e.Shape(x)
    height, width = (e.Gather(shape, e.const(np.array(i, np.int64))) for i in (2, 3))
    rows, in_h = _roi_bins(e, col(1), col(3), ph, height)                  # [R, ph, Kh]
    cols, in_w = _roi_bins(e, col(0), col(2), pw, width)                   # [R, pw, Kw]
    flat = (e.Unsqueeze(batch * height * width, [1, 2, 3, 4]) + e.Unsqueeze(rows * width, [3, 4])
            + e.Unsqueeze(cols, [1, 2]))                                   # [R, ph, Kh, pw, Kw]
    inside = e.And(e.Unsqueeze(in_h, [3, 4]), e.Unsqueeze(in_w, [1, 2]))
    xt = e.Reshape(e.Transpose(x, perm=[1, 0, 2, 3]), [0, -1])             # [C, N*H*W]
    vals = e.Gather(xt, flat, axis=1)                                      # [C, R, ph, Kh, pw, Kw]
    per_bin = lambda t: e.Unsqueeze(e.Transpose(t, perm=[1, 0, 2, 3]), [3, 5])  # noqa: E731
    hit = e.Cast(e.And(e.Equal(vals, per_bin(y)), inside), to=g.dtype)
    ties = e.reduce("ReduceSum", hit, [3, 5])
    upd = e.Reshape(hit * (per_bin(g) / e.Max(ties, 1.0)), e.Concat(e.Shape(xt, end=1), [-1],
                                                                      axis=0))
    idx = e.Expand(e.Reshape(flat, [1, -1]), e.Shape(upd))
    dxt = _scatter_add(e, e.zeros_like(xt), idx, upd, 1)
    dx = e.Reshape(dxt, e.Concat(e.Shape(x, start=1, end=2), e.Shape(x, end=1),
                                 e.Shape(x, start=2), axis=0))
    return e.Transpose(dx, perm=[1, 0, 2, 3]), None


no_gradient("MaxRoiPool", rois="non-differentiable in the ONNX schema (Y is piecewise constant "
                             "in them: they are rounded to whole bins)")


# -- DeformConv ----------------------------------------------------------------------------------
def _deform_attrs(n, w):
    """(kh, kw), strides, dilations, pads, group, offset_group of a 2-D DeformConv."""
    k = n.attr("kernel_shape")
    if k is None and w.shape is not None and len(w.shape) == 4 and all(
            isinstance(i, int) for i in w.shape[2:]):
        k = list(w.shape[2:])
    ranks = {v.rank for v in (n.x, w) if v is not None and v.rank is not None}
    if k is None or len(k) != 2 or ranks - {4}:
        raise NotImplementedError(f"DeformConv gradient at node {n.node.name!r}: only 2-D "
                                  "DeformConv with a known kernel shape (kernel_shape or a static "
                                  "W) is supported")
    ints = lambda name, d: [int(i) for i in (n.attr(name) or d)]  # noqa: E731
    return ([int(i) for i in k], ints("strides", [1, 1]), ints("dilations", [1, 1]),
            ints("pads", [0, 0, 0, 0]), int(attr(n, "group")), int(attr(n, "offset_group")))


def _deform_sample(e, x, offset, kernel, strides, dilations, pads, og):
    """The bilinear samples of a 2-D DeformConv, rebuilt from offset like GridSample's taps
    (pixel coordinates, zero padding per tap): x [N, C, H, W] regrouped as xf [N, OG, C/OG, H*W];
    the taps' flat indices idx [N, OG, C/OG, T*K*P] (T = 4 taps, K = kh*kw, P = oh*ow), weights
    wt and d wt / d(h, w) [N, OG, 1, T*K*P]; the samples S [N, OG, C/OG, K*P] (without mask)."""
    dt = x.dtype
    (kh, kw), (sh, sw), (dh, dw), (pt, pl) = kernel, strides, dilations, pads[:2]
    sx, so = e.Shape(x), e.Shape(offset)
    one = e.const(np.array(1, np.int64))
    zero = e.const(np.array(0, np.int64))
    at = lambda s, i: e.Gather(s, e.const(np.array(i, np.int64)))  # noqa: E731
    height, width, oh, ow = at(sx, 2), at(sx, 3), at(so, 2), at(so, 3)
    grid = e.Concat(e.Reshape(oh, [1]), e.Reshape(ow, [1]), axis=0)
    rows = e.Cast(e.Range(zero, oh, one), to=dt) * float(sh) - float(pt)      # [oh]
    cols = e.Cast(e.Range(zero, ow, one), to=dt) * float(sw) - float(pl)      # [ow]
    rows = e.Reshape(e.Expand(e.Unsqueeze(rows, [1]), grid), [1, 1, -1])      # [1, 1, P]
    cols = e.Reshape(e.Expand(e.Unsqueeze(cols, [0]), grid), [1, 1, -1])
    base_h = rows + e.const((np.arange(kh) * dh).reshape(kh, 1, 1), dt)     # [kh, 1, P]
    base_w = cols + e.const((np.arange(kw) * dw).reshape(1, kw, 1), dt)     # [1, kw, P]
    off = e.Reshape(offset, [0, og, kh, kw, 2, -1])                         # [N, OG, kh, kw, 2, P]
    comp = lambda i: e.Squeeze(e.Slice(off, [i], [i + 1], [4]), [4])       # noqa: E731
    to5 = lambda c: e.Reshape(c, [0, 0, 1, kh * kw, -1])                    # noqa: E731
    ch, cw = to5(comp(0) + base_h), to5(comp(1) + base_w)                   # [N, OG, 1, K, P]
    taps = [_axis_taps(e, c, size, e.Cast(size, to=dt), "linear", "zeros", None, None)[0]
            for c, size in ((ch, height), (cw, width))]
    combos = _combine(e, taps, [width, None])
    flat = lambda k: e.Reshape(e.Concat(*k, axis=2), [0, 0, 1, -1])         # noqa: E731
    idx = flat([c[0] for c in combos])                                       # [N, OG, 1, T*K*P]
    wt = flat([c[1] for c in combos])
    dwt = [flat([c[2][i] for c in combos]) for i in range(2)]
    hw = e.Reshape(height * width, [1])
    xf = e.Reshape(x, e.Concat([0, og, -1], hw, axis=0))                    # [N, OG, C/OG, H*W]
    idx = e.Expand(idx, e.Concat(e.Shape(xf, end=3), e.Shape(idx, start=3), axis=0))
    return xf, idx, wt, dwt, len(combos)


def _deform_columns(e, xf, idx, wt, count):
    """The taps' values X[idx] and the samples S = sum over taps of wt * X[idx]."""
    taken = e.GatherElements(xf, idx, axis=3)                                # [N, OG, Cg, T*K*P]
    s = e.reduce("ReduceSum", e.Reshape(taken * wt, [0, 0, 0, count, -1]), [3], keepdims=0)
    return taken, s


def deform_conv_2d(e, x, w, offset, b=None, mask=None, *, kernel, strides=(1, 1),
                   dilations=(1, 1), pads=(0, 0, 0, 0), group=1, offset_group=1):
    """DeformConv's forward written with the same sampling as its gradient (standard ops): the
    columns mask * S contracted with W. Used by the tests to hold the rebuilt sampling against
    the runtimes' DeformConv."""
    xf, idx, wt, _, count = _deform_sample(e, x, offset, kernel, strides, dilations, pads,
                                           offset_group)
    _, s = _deform_columns(e, xf, idx, wt, count)
    cols = s if mask is None else s * e.Reshape(mask, [0, offset_group, 1, -1])
    p = e.Reshape(e.Mul(e.Shape(offset, start=2, end=3), e.Shape(offset, start=3, end=4)), [1])
    cols = e.Reshape(cols, e.Concat([0, group, -1], p, axis=0))             # [N, G, Cgg*K, P]
    wg = e.Reshape(w, [0, -1])
    wg = e.Reshape(wg, e.Concat([group, -1], e.Shape(wg, start=1), axis=0))  # [G, OCg, Cgg*K]
    y = e.MatMul(wg, cols)                                                   # [N, G, OCg, P]
    y = e.Reshape(y, e.Concat(e.Shape(offset, end=1), e.Shape(w, end=1),
                              e.Shape(offset, start=2), axis=0))
    return y if b is None else y + e.Reshape(b, [1, -1, 1, 1])


@register("DeformConv", since=19)
def _deform_conv(n, g):
    """Y[n, o, p] = B[o] + sum over the input channels c of o's group and the kernel taps k of
    W[o, c, k] * mask[n, k, p] * S[n, c, k, p], S the bilinear sample of X[n, c] at the kernel
    position moved by offset[n, k, p] (offset and mask per offset group). The samples are rebuilt
    from offset as GridSample's taps (pixel coordinates, zero padding per tap); then, with the
    columns mask * S: dW = g . columns^T (one MatMul over batch and positions), d columns =
    W^T . g, d mask = sum over c of d columns * S, dX a ScatterElements(add) of d S times each
    tap's weight, d offset = sum over c and taps of d S * X[tap] * d weight / d position,
    dB = sum of g."""
    e, x, w, offset = n.e, n.x, n.ins[1], n.ins[2]
    b, mask = n.input(3), n.input(4)
    kernel, strides, dilations, pads, group, og = _deform_attrs(n, w)
    nk = kernel[0] * kernel[1]
    want = [n.wants(v) for v in n.node.inputs] + [False] * (5 - len(n.node.inputs))
    xf, idx, wt, dwt, count = _deform_sample(e, x, offset, kernel, strides, dilations, pads, og)
    gwt = _cast(e, wt, g.dtype)
    need_taken = want[1] or want[2] or want[4]
    taken, s = _deform_columns(e, xf, idx, wt, count) if need_taken else (None, None)
    m = None if mask is None else e.Reshape(mask, [0, og, 1, -1])           # [N, OG, 1, K*P]
    p = e.Reshape(e.Mul(e.Shape(offset, start=2, end=3), e.Shape(offset, start=3, end=4)), [1])
    grouped = lambda t: e.Reshape(t, e.Concat([0, group, -1], p, axis=0))   # noqa: E731
    gg = grouped(g)                                                          # [N, G, OCg, P]
    wg = e.Reshape(w, [0, -1])
    wg = e.Reshape(wg, e.Concat([group, -1], e.Shape(wg, start=1), axis=0))  # [G, OCg, Cgg*K]
    dw = None
    if want[1]:
        cols = grouped(s if m is None else s * m)                           # [N, G, Cgg*K, P]
        lhs = e.Reshape(e.Transpose(gg, perm=[1, 2, 0, 3]), [0, 0, -1])     # [G, OCg, N*P]
        rhs = e.Reshape(e.Transpose(cols, perm=[1, 0, 3, 2]),
                        e.Concat([group, -1], e.Shape(cols, start=2, end=3), axis=0))
        dw = e.Reshape(e.MatMul(lhs, rhs), e.Shape(w))                      # [G, OCg, Cgg*K]
    dx = doff = dmask = None
    if want[0] or want[2] or want[4]:
        dcols = e.MatMul(e.Transpose(wg, perm=[0, 2, 1]), gg)               # [N, G, Cgg*K, P]
        dcols = e.Reshape(dcols, e.Concat(e.Shape(xf, end=3), [-1], axis=0))  # [N, OG, Cg, K*P]
        if want[4] and mask is not None:
            dmask = e.Reshape(e.reduce("ReduceSum", dcols * s, [2]), e.Shape(mask))
        ds = dcols if m is None else dcols * m
        dst = e.Tile(ds, [1, 1, 1, count])                                  # [N, OG, Cg, T*K*P]
        if want[0]:
            dx = _scatter_add(e, e.zeros_like(xf), idx, dst * gwt, 3)
            dx = e.Reshape(dx, e.Shape(x))
        if want[2]:
            h = _cast(e, e.reduce("ReduceSum", dst * taken, [2]), offset.dtype)  # [N,OG,1,TKP]
            parts = []
            for d in dwt:  # the h and w components
                t = e.reduce("ReduceSum", e.Reshape(h * d, [0, 0, count, -1]), [2])
                parts.append(e.Reshape(t, e.Concat([0, og, nk, 1], p, axis=0)))
            doff = e.Reshape(e.Concat(*parts, axis=3), e.Shape(offset))
    db = None
    if b is not None and want[3]:
        db = e.reduce("ReduceSum", g, [0, 2, 3], keepdims=0)
    return dx, dw, doff, db, dmask
