"""Gradient rules: resampling and vision ops (Resize, Upsample, AffineGrid, Compress).

- Resize / Upsample: linear in X. With static sizes on the resized axes the op is separable: each
  resized axis k applies a constant (out_k x in_k) interpolation matrix M_k (nearest, linear and
  cubic alike, every coordinate transformation mode, antialias, exclude_outside). M_k is built once
  with numpy by resizing the identity with onnx's reference implementation (the spec's own
  semantics), and the gradient applies M_k^T along each axis with MatMul (its rule gives the
  higher orders). Batch and channel dims may be symbolic; a resized axis whose size only the run
  time knows raises NotImplementedError.
- Compress: the selected elements go back where they came from (replay of element numbers).
"""
from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import helper

from ..registry import register
from .shape import END, _replay


def _s(v):
    return v.decode() if isinstance(v, bytes) else v


# -- Resize / Upsample ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _interp_matrix(n_in: int, n_out: int, scale: float | None, roi: tuple | None, attrs: tuple):
    """(n_out x n_in) matrix of a 1-D Resize, from onnx's reference Resize on the identity."""
    from onnx.reference import ReferenceEvaluator
    kw = dict(attrs)
    ins = ["X", "roi" if roi is not None else "", "scales" if scale is not None else ""]
    feeds = {"X": np.eye(n_in, dtype=np.float64)}
    if roi is not None:
        feeds["roi"] = np.array([0.0, roi[0], 1.0, roi[1]], np.float32)
    if scale is not None:
        feeds["scales"] = np.array([1.0, scale], np.float32)
    else:
        ins.append("sizes")
        feeds["sizes"] = np.array([n_in, n_out], np.int64)
    while ins and not ins[-1]:
        ins.pop()
    node = helper.make_node("Resize", ins, ["Y"], **kw)
    vi = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
          for k, v in feeds.items()]
    graph = helper.make_graph([node], "m", vi, [helper.make_empty_tensor_value_info("Y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    y = ReferenceEvaluator(model).run(None, feeds)[0]
    if y.shape != (n_in, n_out):
        raise NotImplementedError(f"Resize gradient: 1-D resize of {n_in} gave {y.shape[1]} "
                                  f"elements, the node's output has {n_out}")
    return np.ascontiguousarray(y.T)


def _resize_grad(n, g, mode, attrs, scales, sizes, roi, axes):
    """Shared by Resize and Upsample. scales/sizes/roi: numpy constants (or None)."""
    e, x = n.e, n.x
    xs, ys = x.shape, n.y.shape
    if xs is None:
        raise NotImplementedError(f"Resize gradient at node {n.node.name!r}: the rank of its "
                                  "input is unknown; run onnx shape inference first")
    rank = len(xs)
    axes = list(range(rank)) if axes is None else [a % rank for a in axes]
    full_s = [1.0] * rank
    out = list(xs)
    use_scales = scales is not None and scales.size > 0
    if use_scales:
        for a, s in zip(axes, scales.tolist()):
            full_s[a] = float(s)
    elif sizes is not None and sizes.size > 0:
        policy = _s(n.attr("keep_aspect_ratio_policy", "stretch"))
        static = [xs[a] for a in axes]
        if not all(isinstance(d, int) for d in static):
            raise NotImplementedError(f"Resize gradient at node {n.node.name!r}: the resized "
                                      "axes need static sizes")
        if policy != "stretch":
            r = [s / d for s, d in zip(sizes.tolist(), static)]
            sc = min(r) if policy == "not_larger" else max(r)
            for a in axes:
                full_s[a] = sc
                out[a] = int(np.round(sc * xs[a]))
            use_scales = True  # the transformation uses this scale, not out/in
        else:
            for a, s in zip(axes, sizes.tolist()):
                out[a] = int(s)
    else:
        raise NotImplementedError(f"Resize gradient at node {n.node.name!r}: its scales or sizes "
                                  "are computed at run time; only constant ones are supported")
    if use_scales and ys is not None:
        for a in axes:
            if isinstance(ys[a], int):
                out[a] = ys[a]
    roi_full = None
    if _s(attrs.get("coordinate_transformation_mode")) == "tf_crop_and_resize" and roi is not None:
        r = roi.astype(np.float64).ravel().tolist()
        k = len(r) // 2
        roi_full = {a: (r[i], r[k + i]) for i, a in enumerate(axes if k == len(axes) else range(rank))}
    key_attrs = tuple(sorted((k, v) for k, v in attrs.items() if v is not None))
    dx = g
    for a in reversed(range(rank)):
        d_in, d_out = xs[a], out[a]
        r = None if roi_full is None else roi_full.get(a, (0.0, 1.0))
        if full_s[a] == 1.0 and d_in == d_out and r in (None, (0.0, 1.0)):
            continue  # an untouched axis (batch and channels, symbolic or not)
        if not (isinstance(d_in, int) and isinstance(d_out, int)):
            raise NotImplementedError(
                f"Resize gradient at node {n.node.name!r}: axis {a} is resized but its size is "
                f"not static ({d_in!r} -> {d_out!r}); run shape inference with fixed spatial dims")
        m = _interp_matrix(d_in, d_out, full_s[a] if use_scales else None, r, key_attrs)
        if a == rank - 1:
            dx = e.MatMul(dx, e.const(m, g.dtype))
        elif a == rank - 2:
            dx = e.MatMul(e.const(np.ascontiguousarray(m.T), g.dtype), dx)
        else:
            perm = list(range(rank))
            perm[a], perm[-1] = perm[-1], perm[a]
            dx = e.Transpose(e.MatMul(e.Transpose(dx, perm=perm), e.const(m, g.dtype)), perm=perm)
    return dx


_RESIZE_ATTRS = ("mode", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside",
                 "nearest_mode", "antialias", "extrapolation_value")


@register("Resize", since=11)
def _resize(n, g):
    attrs = {k: _s(n.attr(k)) for k in _RESIZE_ATTRS}
    attrs["extrapolation_value"] = None  # the adjoint of the linear part
    dx = _resize_grad(n, g, attrs.get("mode"), attrs, n.const(2), n.const(3), n.const(1),
                      n.attr("axes"))
    return (dx,) + (None,) * (len(n.ins) - 1)


@register("Resize", since=10, until=10)
def _resize10(n, g):  # Resize-10: asymmetric coordinates (as version_converter maps it to 11)
    mode = _s(n.attr("mode", "nearest"))
    attrs = {"mode": mode, "coordinate_transformation_mode": "asymmetric",
             "nearest_mode": "floor" if mode == "nearest" else None}
    return _resize_grad(n, g, mode, attrs, n.const(1), None, None, None), None


@register("Upsample")
def _upsample(n, g):
    mode = _s(n.attr("mode", "nearest"))
    mode = "linear" if mode in ("linear", "bilinear") else mode
    attrs = {"mode": mode, "coordinate_transformation_mode": "asymmetric",
             "nearest_mode": "floor" if mode == "nearest" else None}
    scales = n.attr("scales")
    scales = np.array(scales, np.float32) if scales is not None else n.const(1)
    dx = _resize_grad(n, g, mode, attrs, scales, None, None, None)
    return (dx,) + (None,) * (len(n.ins) - 1)


# -- AffineGrid ---------------------------------------------------------------------------------
@register("AffineGrid", since=20)
def _affine_grid(n, g):
    """grid[n, ..., :] = theta[n] @ [base(...), 1]: linear in theta, so dtheta is an Einsum of g
    with the base grid, which AffineGrid itself makes from the identity (size may be dynamic)."""
    e, theta, size = n.e, n.x, n.ins[1]
    if theta.shape is None or not isinstance(theta.shape[1], int):
        raise NotImplementedError(f"AffineGrid gradient at node {n.node.name!r}: theta's shape "
                                  "must be known to tell 2-D from 3-D")
    k = theta.shape[1]  # 2 (2-D) or 3 (3-D)
    eye = e.const(np.eye(k, k + 1)[None], theta.dtype)
    one_size = e.Concat([1], e.Slice(size, [1], [END]), axis=0)
    base = e.AffineGrid(eye, one_size, align_corners=n.attr("align_corners", 0))
    base = e.Squeeze(base, [0])
    base = e.Concat(base, e.fill_like(e.Slice(base, [0], [1], [-1]), 1), axis=-1)
    sp = "hw" if k == 2 else "dhw"
    return e.Einsum(g, base, equation=f"n{sp}i,{sp}j->nij"), None


# -- Compress ------------------------------------------------------------------------------------
@register("Compress")
def _compress(n, g):
    axis = n.attr("axis")
    return _replay(n, g, lambda i: n.e.Compress(i, n.ins[1], axis=axis), add=False), None
