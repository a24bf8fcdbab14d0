"""Gradient rules: signal processing (DFT).

The DFT is linear, so its gradient is its adjoint. With F the forward DFT matrix of length L,
the inverse transform is conj(F) / L, so the adjoint of the forward is L * inverse and that of
the inverse is forward / L. A real input (last dim 1) takes the real part of the adjoint; a
onesided output (the first L // 2 + 1 bins) is the full one with the other bins dropped, so its
gradient is zero-padded back to L bins first; a dft_length that pads or truncates x is undone
by truncating or zero-padding the gradient back to x's length.
"""
import numpy as np
import onnx_ir as ir

from ..errors import NotDifferentiableError
from ..registry import register


@register("DFT", since=17)
def _dft(n, g):
    e, x, length = n.e, n.x, n.input(1)
    inverse, onesided = n.attr("inverse", 0), n.attr("onesided", 0)
    if inverse and onesided:  # complex-to-real inverse (opset 20): Hermitian weights not done
        raise NotDifferentiableError("DFT(inverse=1, onesided=1)", "", n.opset, n.node.name, [])
    if n.opset >= 20:
        axis = n.input(2)
        axis = e.const(np.array([-2], np.int64)) if axis is None else e.Reshape(axis, [1])
    else:
        axis = e.const(np.array([n.attr("axis", 1)], np.int64))
    size = lambda t: e.Gather(e.Shape(t), axis)  # noqa: E731  ([1]: the length along axis)

    def fit(t, k):  # t zero-padded at the end of axis to length k (Pad without axes: opset 13)
        rank = e.Shape(e.Shape(t))
        zeros = e.ConstantOfShape(rank * 2, value=ir.tensor(np.array([0], np.int64)))
        at = rank + e.Mod(axis, rank)  # the end pad of axis
        return e.Pad(t, e.ScatterElements(zeros, at, k - size(t)), e.const(0, t.dtype))

    n_x = size(x)
    L = n_x if length is None else e.Reshape(length, [1])
    if onesided:  # the dropped bins get zero gradient
        g = fit(g, L)
    scalar_L = e.Reshape(L, [])
    kw = {"axis": n.attr("axis", 1)} if n.opset < 20 else {}
    args = (g, scalar_L) + ((e.Reshape(axis, []),) if n.opset >= 20 else ())
    adj = e.DFT(*args, inverse=1 - inverse, **kw)
    Lf = e.Cast(scalar_L, to=g.dtype)
    adj = adj / Lf if inverse else adj * Lf
    adj = e.Slice(adj, [0], e.Slice(e.Shape(x), [-1], [2**62]), [-1])  # real input: real part
    if length is not None:  # undo the padding / truncation to dft_length
        adj = fit(e.Slice(adj, [0], n_x, axis), n_x)
    return (adj,) + (None,) * (len(n.ins) - 1)
