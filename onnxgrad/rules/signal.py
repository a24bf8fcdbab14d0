"""Gradient rules: signal processing (DFT, STFT).

DFT is linear, so its gradient is its adjoint. With F the forward DFT matrix of length L, the
inverse transform is conj(F) / L, so the adjoint of the forward is L * inverse and that of the
inverse is forward / L. A real input (last dim 1) takes the real part of the adjoint; a onesided
output (the first L // 2 + 1 bins) is the full one with the other bins dropped, so its gradient
is zero-padded back to L bins first; a dft_length that pads or truncates x is undone by
truncating or zero-padding the gradient back to x's length.

The complex-to-real inverse (inverse=1, onesided=1: irfft) reads the first m = L // 2 + 1 bins
of x (x cropped or zero-padded to m) as a Hermitian spectrum: bin k in 1 .. (L - 1) // 2 also
stands for bin L - k (its conjugate), bin 0 and (even L) bin L / 2 only for themselves, and
their imaginary parts are not used. So y[t] = sum_k c_k / L * (Re x_k cos - Im x_k sin)(2 pi k
t / L) with c_k = 2 for the mirrored bins, else 1: the adjoint is the rfft of g times c_k / L.
Its imaginary parts at bins 0 and L / 2 are sums of g times sin(0) and sin(pi t): zero, as
they should be. This is the ONNX spec (and onnx.reference, numpy.fft.irfft); onnxruntime 1.31
agrees where x has exactly m bins (the default dft_length 2 * (n - 1), and L = 2n - 2 or 2n - 1),
but builds another spectrum when x has more or fewer bins than m.

STFT is the DFT (along axis 2, length frame_length) of the windowed frames
z[b, f, k] = x[b, f * step + k] * w[k], so z's gradient gz is the same adjoint as above; then
w's gradient sums gz * frames over batch, frames and the real/imaginary channel, and x's
gradient overlap-adds gz * w back onto the signal positions f * step + k (a scatter-add, since
frames overlap when step < frame_length; positions no frame reads get zero). A complex signal
with onesided=1 (which the spec rules out) gets onnxruntime's meaning: the first
frame_length // 2 + 1 bins of the full DFT, whose adjoint is the same zero-padding.
"""
import numpy as np
import onnx_ir as ir

from ..registry import register
from .shape import _i64, _scatter_add
from .spec import attr

END = np.iinfo(np.int64).max  # "to the end" for Slice


def _vec(e, axis):
    """The axis (an int, or a [1] int64 tensor) as a [1] int64 tensor."""
    return e.const(np.array([axis], np.int64)) if isinstance(axis, int) else axis


def _size(e, t, axis):
    """t's length along axis, as a [1] int64 tensor."""
    return e.Gather(e.Shape(t), _vec(e, axis))


def _dft(e, t, length, axis, **attrs):
    """DFT of t along axis with dft_length ``length`` ([1]), in the form the opset wants (the
    axis an attribute before opset 20, an input since)."""
    if e.opset < 20:
        return e.DFT(t, e.Reshape(length, []), axis=axis, **attrs)
    axis = e.const(np.array(axis, np.int64)) if isinstance(axis, int) else e.Reshape(axis, [])
    return e.DFT(t, e.Reshape(length, []), axis, **attrs)


def _fit(e, t, k, axis):
    """t cropped or zero-padded at the end of axis to length k (Pad without axes: opset 13)."""
    axis = _vec(e, axis)
    t = e.Slice(t, [0], k, axis)
    rank = e.Shape(e.Shape(t))
    zeros = e.ConstantOfShape(rank * 2, value=ir.tensor(np.array([0], np.int64)))
    at = rank + e.Mod(axis, rank)  # the end pad of axis
    return e.Pad(t, e.ScatterElements(zeros, at, k - _size(e, t, axis)), e.const(0, t.dtype))


def _along(e, v, axis, like):
    """1-D v reshaped to [len(v), 1, ..., 1]: it broadcasts along ``axis`` of ``like``."""
    rank = e.Shape(e.Shape(like))
    ones = e.ConstantOfShape(rank - 1 - e.Mod(_vec(e, axis), rank),
                             value=ir.tensor(np.array([1], np.int64)))
    return e.Reshape(v, e.Concat([-1], ones, axis=0))


def _adjoint(e, g, L, axis, inverse, onesided, channels):
    """The gradient of x for y = DFT(x) of length L (complex-to-complex or real-to-complex) when
    x has L elements along axis and ``channels`` ([1]: 1 real, 2 complex) in its last dim."""
    if onesided:  # the dropped bins get zero gradient
        g = _fit(e, g, L, axis)
    adj = _dft(e, g, L, axis, inverse=1 - inverse)
    n = e.Cast(L, to=g.dtype)
    adj = adj / n if inverse else adj * n
    return e.Slice(adj, [0], channels, [-1])  # real input: the real part


def _irfft_adjoint(e, g, L, axis):
    """The gradient of the half spectrum x (cropped to L // 2 + 1 bins) for y = irfft(x, L)."""
    r = _dft(e, g, L, axis, onesided=1)  # rfft(g): [.., L // 2 + 1, .., 2]
    k = e.Range(0, e.Reshape(e.Div(L, [2]) + 1, []), 1)
    f = lambda b: e.Cast(b, to=g.dtype)  # noqa: E731
    mirrored = 2 - f(e.Equal(k, [0])) - f(e.Equal(k * 2, L))  # c_k: 1 at bins 0 and L / 2
    return r * _along(e, mirrored / e.Cast(L, to=g.dtype), axis, r)


@register("DFT", since=17)
def _dft_rule(n, g):
    e, x, length = n.e, n.x, n.input(1)
    inverse, onesided = attr(n, "inverse"), attr(n, "onesided")
    if n.opset < 20:
        axis = attr(n, "axis")
    elif n.input(2) is None:
        axis = -2
    else:
        axis = n.const(2)
        axis = e.Reshape(_i64(n, n.input(2)), [1]) if axis is None else int(axis)
    n_x = _size(e, x, axis)
    if inverse and onesided:  # irfft: y has the L samples
        adj = _irfft_adjoint(e, g, _size(e, n.y, axis), axis)
    else:
        L = n_x if length is None else e.Reshape(_i64(n, length), [1])
        adj = _adjoint(e, g, L, axis, inverse, onesided, e.Slice(e.Shape(x), [-1], [END]))
    if length is not None:  # undo the padding / truncation to dft_length (irfft: to L // 2 + 1)
        adj = _fit(e, adj, n_x, axis)
    return (adj,) + (None,) * (len(n.ins) - 1)


@register("STFT", since=17)
def _stft(n, g):
    e, x = n.e, n.x
    step, w, length = n.input(1), n.input(2), n.input(3)
    if length is not None:
        L = e.Reshape(_i64(n, length), [1])
    else:  # frame_length from the window, else the whole signal (the spec's defaults)
        L = e.Shape(w) if w is not None else _size(e, x, 1)
    frames = _size(e, n.y, 1)
    # frame f reads the signal at f * step + [0, L): idx [frames, L]
    starts = e.Range(0, e.Reshape(frames, []), 1) * e.Reshape(_i64(n, step), [])
    idx = e.Unsqueeze(starts, [1]) + e.Range(0, e.Reshape(L, []), 1)
    # gz: the gradient of the windowed frames [batch, frames, L, channels]
    channels = _size(e, x, -1)
    gz = _adjoint(e, g, L, 2, 0, attr(n, "onesided"), channels)
    gx = gw = None
    if n.wants(x):  # overlap-add gz * w back onto the signal
        t = gz * e.Unsqueeze(w, [1]) if w is not None else gz
        t = e.Reshape(t, e.Concat([0, -1], channels, axis=0))  # [batch, frames * L, channels]
        at = e.Expand(e.Reshape(idx, [1, -1, 1]), e.Shape(t))
        gx = _scatter_add(n, "ScatterElements", x, at, t, axis=1)
    if w is not None and n.wants(w):  # sum over batch, frames and re/im of gz * frames
        gw = e.reduce("ReduceSum", gz * e.Gather(x, idx, axis=1), [0, 1, 3], keepdims=0)
    return (gx, None, gw, None)[:len(n.ins)]
