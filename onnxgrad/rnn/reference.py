"""A NumPy reference of the CudnnRNN forward pass and its backward pass (BPTT).

Time-major: input [seq_length, batch, input_size]; input_h / input_c / output_h / output_c
[num_layers * num_dirs, batch, num_units] (index layer * num_dirs + dir); output
[seq_length, batch, num_dirs * num_units] (forward then backward halves). The params buffer is
described in :mod:`onnxgrad.rnn.params`; reserve_space in :mod:`onnxgrad.rnn.ops` (the reference
writes and reads the same layout as the ONNX functions, so either can check the other).
"""
from __future__ import annotations

import numpy as np

from .params import num_dirs, num_gates, per_layer, resolve_input_mode

#: values saved per time step, per layer and direction, in units of num_units
RESERVE_WIDTH = {"lstm": 6, "gru": 5, "rnn_relu": 1, "rnn_tanh": 1}


#: the modulus of the dropout hash (a prime; every intermediate product stays under 2**63)
DROPOUT_MODULUS = 2**31 - 1


def dropout_hash(idx, seed: int = 0, seed2: int = 0) -> np.ndarray:
    """The counter-based generator of the dropout masks: int64 values in [0, 2**31 - 1) from
    int64 counters ``idx``, in int64 arithmetic modulo m = 2**31 - 1 (Python's sign convention:
    results are >= 0), exactly as the ONNX bodies compute it with Mod/Mul/Add::

        a, b = seed mod m, seed2 mod m
        x = idx mod m + 1
        x = ((x * 48271 + a) mod m)^2 + b  mod m
        x = ((x * 16807 + a + 1) mod m)^2 + b + 1  mod m
        x = (x * 48271 + a) mod m
    """
    m = np.int64(DROPOUT_MODULUS)
    a, b = np.int64(seed % DROPOUT_MODULUS), np.int64(seed2 % DROPOUT_MODULUS)
    x = np.asarray(idx, np.int64) % m + 1
    x = (x * 48271 + a) % m
    x = (x * x + b) % m
    x = (x * 16807 + a + 1) % m
    x = (x * x + b + 1) % m
    return (x * 48271 + a) % m


def dropout_mask(shape, dropout: float, seed: int = 0, seed2: int = 0, dtype=np.float32):
    """The dropout masks of CudnnRNN/V2 (is_training, num_layers L >= 2), shape
    ``[L - 1, seq_length, batch, num_dirs * num_units]``: element k (row-major flat index) is
    kept, as 1 / (1 - dropout) in dtype, when dropout_hash(k, seed, seed2) >=
    int64(float32(dropout) * float32(2**31 - 1)), else 0."""
    p32 = np.float32(dropout)
    thr = np.int64(p32 * np.float32(DROPOUT_MODULUS))
    keep = dropout_hash(np.arange(int(np.prod(shape)), dtype=np.int64), seed, seed2) >= thr
    one = np.asarray(1, dtype)
    scale = one / (one - np.asarray(p32, dtype))
    return np.where(keep, scale, np.asarray(0, dtype)).astype(dtype).reshape(shape)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _config(x, h0, rnn_mode, direction, input_mode):
    nd = num_dirs(direction)
    num_gates(rnn_mode)
    if x.ndim != 3 or h0.ndim != 3:
        raise ValueError("input must be [seq_length, batch, input_size] and input_h "
                         "[num_layers * num_dirs, batch, num_units]")
    if h0.shape[0] % nd:
        raise ValueError(f"input_h's first dim {h0.shape[0]} is not a multiple of {nd}")
    num_layers, num_units, input_size = h0.shape[0] // nd, h0.shape[2], x.shape[2]
    input_mode = resolve_input_mode(input_mode, input_size, num_units)
    return nd, num_layers, num_units, input_size, input_mode


def _cell_forward(rnn_mode, xp, h, c, Rh, bh):
    """One step: xp = W x + b_W already added. Returns h', c', the saved row [B, K*H]."""
    H = h.shape[1]
    hh = h @ Rh.T + bh
    if rnn_mode == "lstm":
        g = xp + hh
        i, f, cc, o = (_sigmoid(g[:, :H]), _sigmoid(g[:, H:2 * H]), np.tanh(g[:, 2 * H:3 * H]),
                       _sigmoid(g[:, 3 * H:]))
        c = f * c + i * cc
        h = o * np.tanh(c)
        return h, c, np.concatenate([i, f, cc, o, c, h], axis=1)
    if rnn_mode == "gru":
        r = _sigmoid(xp[:, :H] + hh[:, :H])
        z = _sigmoid(xp[:, H:2 * H] + hh[:, H:2 * H])
        hr = hh[:, 2 * H:]
        n = np.tanh(xp[:, 2 * H:] + r * hr)
        h = (1 - z) * n + z * h
        return h, c, np.concatenate([r, z, n, hr, h], axis=1)
    p = xp + hh
    h = np.maximum(p, 0) if rnn_mode == "rnn_relu" else np.tanh(p)
    return h, c, h


def rnn_forward(x, h0, c0, params, rnn_mode="lstm", direction="unidirectional",
                input_mode="linear_input", dropout_mask=None):
    """(output, output_h, output_c, reserve_space), computed in x's dtype. c0 may be None for
    modes other than lstm; output_c is then a zero scalar (TF's shape for non-LSTM).
    ``dropout_mask`` [L - 1, T, B, nd * H] multiplies the input of layers 2..L (cuDNN's
    dropout) and is appended to reserve_space (the layout of :mod:`onnxgrad.rnn.ops`)."""
    x, h0, params = np.asarray(x), np.asarray(h0), np.asarray(params)
    nd, L, H, I, input_mode = _config(x, h0, rnn_mode, direction, input_mode)
    c0 = np.zeros_like(h0) if c0 is None or rnn_mode != "lstm" else np.asarray(c0)
    blocks = per_layer(params, rnn_mode, L, H, I, direction, input_mode)
    T, G = x.shape[0], num_gates(rnn_mode)
    layer_in = x
    hn, cn, reserve = [], [], []
    for layer in range(L):
        if dropout_mask is not None and layer > 0:
            layer_in = layer_in * dropout_mask[layer - 1]
        outs = []
        for d in range(nd):
            Wx, Rh, bx, bh = blocks[(layer, d)]
            xp = (np.concatenate([layer_in] * G, axis=2) if Wx is None else layer_in @ Wx.T) + bx
            h, c = h0[layer * nd + d], c0[layer * nd + d]
            hs, rows = [None] * T, [None] * T
            for t in (range(T) if d == 0 else reversed(range(T))):
                h, c, rows[t] = _cell_forward(rnn_mode, xp[t], h, c, Rh, bh)
                hs[t] = h
            outs.append(np.stack(hs) if T else np.zeros((0,) + h.shape, x.dtype))
            hn.append(h)
            cn.append(c)
            reserve.append(np.stack(rows) if T else
                           np.zeros((0, h.shape[0], RESERVE_WIDTH[rnn_mode] * H), x.dtype))
        layer_in = np.concatenate(outs, axis=2)
    output_c = np.stack(cn) if rnn_mode == "lstm" else np.zeros((), x.dtype)
    reserve = np.stack(reserve).astype(x.dtype).reshape(-1)
    if dropout_mask is not None:
        reserve = np.concatenate([reserve, np.asarray(dropout_mask, x.dtype).reshape(-1)])
    return (layer_in.astype(x.dtype), np.stack(hn).astype(x.dtype), output_c.astype(x.dtype),
            reserve)


def _cell_backward(rnn_mode, dh, dc, row, hp, cp, Rh):
    """One step backwards. Returns (dh_prev, dc_prev, d pre-activations on the input side,
    d pre-activations on the recurrent side)."""
    H = hp.shape[1]
    if rnn_mode == "lstm":
        i, f, cc, o, c = (row[:, k * H:(k + 1) * H] for k in range(5))
        tc = np.tanh(c)
        do = dh * tc
        dc = dc + dh * o * (1 - tc * tc)
        dg = np.concatenate([dc * cc * i * (1 - i), dc * cp * f * (1 - f),
                             dc * i * (1 - cc * cc), do * o * (1 - o)], axis=1)
        return dg @ Rh, dc * f, dg, dg
    if rnn_mode == "gru":
        r, z, n, hr = (row[:, k * H:(k + 1) * H] for k in range(4))
        dnp = dh * (1 - z) * (1 - n * n)
        drp = dnp * hr * r * (1 - r)
        dzp = dh * (hp - n) * z * (1 - z)
        dgx = np.concatenate([drp, dzp, dnp], axis=1)
        dgh = np.concatenate([drp, dzp, dnp * r], axis=1)
        return dh * z + dgh @ Rh, dc, dgx, dgh
    h = row
    dp = dh * (h > 0) if rnn_mode == "rnn_relu" else dh * (1 - h * h)
    return dp @ Rh, dc, dp, dp


def rnn_backward(x, h0, c0, params, output_backprop, output_h_backprop, output_c_backprop,
                 reserve_space, rnn_mode="lstm", direction="unidirectional",
                 input_mode="linear_input", dropout_mask=None):
    """(input_backprop, input_h_backprop, input_c_backprop, params_backprop) from the
    forward's reserve_space; nothing of the forward is recomputed. None cotangents are zeros.
    ``dropout_mask``: the forward's (given explicitly; reserve_space's trailing copy is not
    read)."""
    x, h0, params = np.asarray(x), np.asarray(h0), np.asarray(params)
    nd, L, H, I, input_mode = _config(x, h0, rnn_mode, direction, input_mode)
    lstm = rnn_mode == "lstm"
    c0 = np.zeros_like(h0) if c0 is None or not lstm else np.asarray(c0)
    T, B, G = x.shape[0], x.shape[1], num_gates(rnn_mode)
    K = RESERVE_WIDTH[rnn_mode] * H
    n_rows = L * nd * T * B * K
    R = np.asarray(reserve_space)[:n_rows].reshape(L * nd, T, B, K)
    dy = np.zeros((T, B, nd * H), x.dtype) if output_backprop is None else output_backprop
    dhn = np.zeros_like(h0) if output_h_backprop is None else output_h_backprop
    dcn = np.zeros_like(h0) if output_c_backprop is None or not lstm else output_c_backprop
    blocks = per_layer(params, rnn_mode, L, H, I, direction, input_mode)
    grads = {}
    dh0, dc0 = np.zeros_like(h0), np.zeros_like(h0)
    for layer in reversed(range(L)):
        if layer == 0:
            layer_in = x
        else:
            layer_in = np.concatenate([R[(layer - 1) * nd + d][..., -H:] for d in range(nd)], 2)
            if dropout_mask is not None:
                layer_in = layer_in * dropout_mask[layer - 1]
        dx = np.zeros(layer_in.shape, np.result_type(layer_in, dy))
        for d in range(nd):
            idx = layer * nd + d
            Wx, Rh, bx, bh = blocks[(layer, d)]
            rows = R[idx]
            hs = rows[..., -H:]
            cs = rows[..., 4 * H:5 * H] if lstm else None
            dh, dc = dhn[idx], dcn[idx]
            dgx, dgh = np.zeros((T, B, G * H), dx.dtype), np.zeros((T, B, G * H), dx.dtype)
            hprev = np.zeros((T, B, H), dx.dtype)
            for t in (reversed(range(T)) if d == 0 else range(T)):
                tp = t - 1 if d == 0 else t + 1
                first = tp < 0 or tp >= T
                hp = h0[idx] if first else hs[tp]
                cp = (c0[idx] if first else cs[tp]) if lstm else None
                hprev[t] = hp
                dh, dc, dgx[t], dgh[t] = _cell_backward(
                    rnn_mode, dh + dy[t, :, d * H:(d + 1) * H], dc, rows[t], hp, cp, Rh)
            dh0[idx], dc0[idx] = dh, (dc if lstm else 0)
            dWx = None if Wx is None else np.einsum("tbg,tbi->gi", dgx, layer_in)
            grads[(layer, d)] = (dWx, np.einsum("tbg,tbh->gh", dgh, hprev),
                                 dgx.sum((0, 1)), dgh.sum((0, 1)))
            dx += dgx.reshape(T, B, G, H).sum(2) if Wx is None else dgx @ Wx
        dy = dx if dropout_mask is None or layer == 0 else dx * dropout_mask[layer - 1]
    weights, biases = [], []
    for layer in range(L):
        for d in range(nd):
            dWx, dRh, dbx, dbh = grads[(layer, d)]
            weights += ([] if dWx is None else [dWx.reshape(-1)]) + [dRh.reshape(-1)]
            biases += [dbx, dbh]
    dparams = np.concatenate(weights + biases).astype(params.dtype)
    dc0 = dc0 if lstm else np.zeros_like(h0 if c0 is None else c0)
    return dy.astype(x.dtype), dh0.astype(x.dtype), dc0.astype(x.dtype), dparams
