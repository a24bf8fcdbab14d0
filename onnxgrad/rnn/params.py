"""cuDNN's opaque RNN params buffer, laid out exactly as TensorFlow's CudnnRNN ops use it.

The buffer is one flat 1-D tensor: **all weight matrices first, then all bias vectors**.

Weights, in this order::

    for layer in range(num_layers):
        for d in range(num_dirs):            # 0 = forward, 1 = backward (bidirectional only)
            G matrices applied on the layer input,      each [num_units, in_size(layer)]
            G matrices applied on the recurrent state,  each [num_units, num_units]

Biases, in the same (layer, direction) order::

            G input biases,      each [num_units]
            G recurrent biases,  each [num_units]

with G gates per cell and this gate order (the same as PyTorch's ``weight_ih_l*`` rows):

=========== === ==========================================================================
rnn_mode     G  gates
=========== === ==========================================================================
rnn_relu     1  h' = relu(W x + b_W + R h + b_R)
rnn_tanh     1  h' = tanh(W x + b_W + R h + b_R)
lstm         4  i, f, c (the candidate, "g" in PyTorch), o
gru          3  r, z, h (the candidate); cuDNN's form: h~ = tanh(W_h x + b_Wh + r*(R_h h + b_Rh))
=========== === ==========================================================================

Each matrix is stored row-major, so the G input matrices of one (layer, direction) are also one
row-major ``[G * num_units, in_size]`` matrix (PyTorch's ``weight_ih_l{k}[_reverse]``), and the G
recurrent ones are ``weight_hh_l{k}[_reverse]``; the G input biases are ``bias_ih`` and the G
recurrent biases ``bias_hh``.

``in_size(0) = input_size``; ``in_size(layer > 0) = num_units * num_dirs`` (the concatenated
forward and backward outputs of the layer below).

``input_mode="skip_input"`` (cuDNN's CUDNN_SKIP_INPUT, allowed only when input_size == num_units):
the first layer has no input matrices (each gate sees the input itself, as through an identity
matrix); its input *biases* are kept. Layers above the first are unchanged. In the canonical lists
(:func:`params_to_canonical`, :func:`canonical_to_params`) the missing matrices are simply absent.
``input_mode="auto_select"`` means skip_input when input_size == num_units, else linear_input
(TensorFlow's rule); see :func:`resolve_input_mode`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RNN_MODES = ("rnn_relu", "rnn_tanh", "lstm", "gru")
DIRECTIONS = ("unidirectional", "bidirectional")
INPUT_MODES = ("linear_input", "skip_input", "auto_select")
GATES = {"rnn_relu": 1, "rnn_tanh": 1, "lstm": 4, "gru": 3}


def num_gates(rnn_mode: str) -> int:
    if rnn_mode not in GATES:
        raise ValueError(f"rnn_mode={rnn_mode!r} is not one of {', '.join(RNN_MODES)}")
    return GATES[rnn_mode]


def num_dirs(direction: str) -> int:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} is not one of {', '.join(DIRECTIONS)}")
    return 1 if direction == "unidirectional" else 2


def resolve_input_mode(input_mode: str, input_size: int | None, num_units: int | None) -> str:
    """linear_input or skip_input; auto_select picks skip_input when input_size == num_units."""
    if input_mode not in INPUT_MODES:
        raise ValueError(f"input_mode={input_mode!r} is not one of {', '.join(INPUT_MODES)}")
    if input_mode == "linear_input":
        return input_mode
    known = input_size is not None and num_units is not None
    if input_mode == "auto_select":
        if not known:
            raise ValueError("input_mode='auto_select' needs input_size and num_units known "
                             "statically to choose between skip_input and linear_input")
        return "skip_input" if input_size == num_units else "linear_input"
    if known and input_size != num_units:
        raise ValueError(f"input_mode='skip_input' needs input_size == num_units, got "
                         f"input_size={input_size} and num_units={num_units}")
    return input_mode


@dataclass(frozen=True)
class Region:
    """One matrix or bias vector in the flat params buffer."""
    kind: str        # "weight" or "bias"
    layer: int
    direction: int   # 0 forward, 1 backward
    recurrent: bool  # applied on the recurrent state (False: on the layer input)
    gate: int        # 0..G-1 in the gate order above
    offset: int
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


def layout(rnn_mode: str, num_layers: int, num_units: int, input_size: int,
           direction: str = "unidirectional", input_mode: str = "linear_input") -> list[Region]:
    """Every region of the params buffer, in buffer order."""
    g, nd = num_gates(rnn_mode), num_dirs(direction)
    input_mode = resolve_input_mode(input_mode, input_size, num_units)
    if num_layers < 1 or num_units < 1 or input_size < 1:
        raise ValueError(f"num_layers, num_units and input_size must be >= 1, got "
                         f"{num_layers}, {num_units}, {input_size}")
    regions, off = [], 0
    for layer in range(num_layers):
        in_size = input_size if layer == 0 else num_units * nd
        for d in range(nd):
            for recurrent in (False, True):
                if not recurrent and layer == 0 and input_mode == "skip_input":
                    continue
                for k in range(g):
                    shape = (num_units, num_units if recurrent else in_size)
                    regions.append(Region("weight", layer, d, recurrent, k, off, shape))
                    off += shape[0] * shape[1]
    for layer in range(num_layers):
        for d in range(nd):
            for recurrent in (False, True):
                for k in range(g):
                    regions.append(Region("bias", layer, d, recurrent, k, off, (num_units,)))
                    off += num_units
    return regions


def params_size(rnn_mode: str, num_layers: int, num_units: int, input_size: int,
                direction: str = "unidirectional", input_mode: str = "linear_input") -> int:
    """Number of elements of the params buffer (TF's CudnnRNNParamsSize, in elements)."""
    regions = layout(rnn_mode, num_layers, num_units, input_size, direction, input_mode)
    return regions[-1].offset + regions[-1].size


def params_to_canonical(params, rnn_mode: str, num_layers: int, num_units: int, input_size: int,
                        direction: str = "unidirectional", input_mode: str = "linear_input"):
    """Split the flat buffer into (weights, biases): lists of arrays in buffer order, weights
    shaped [num_units, in], biases [num_units] (TF's CudnnRNNParamsToCanonical)."""
    params = np.asarray(params)
    regions = layout(rnn_mode, num_layers, num_units, input_size, direction, input_mode)
    total = regions[-1].offset + regions[-1].size
    if params.ndim != 1 or params.size != total:
        raise ValueError(f"params must be a 1-D buffer of {total} elements for this "
                         f"configuration, got shape {params.shape}")
    cut = lambda r: params[r.offset:r.offset + r.size].reshape(r.shape)  # noqa: E731
    ws = [cut(r) for r in regions if r.kind == "weight"]
    bs = [cut(r) for r in regions if r.kind == "bias"]
    return ws, bs


def canonical_to_params(weights, biases, rnn_mode: str, num_layers: int, num_units: int,
                        input_size: int, direction: str = "unidirectional",
                        input_mode: str = "linear_input") -> np.ndarray:
    """Pack canonical weights and biases (lists in buffer order, any shapes with the right number
    of elements, as TF's CudnnRNNCanonicalToParams) into the flat buffer."""
    regions = layout(rnn_mode, num_layers, num_units, input_size, direction, input_mode)
    wr = [r for r in regions if r.kind == "weight"]
    br = [r for r in regions if r.kind == "bias"]
    if len(weights) != len(wr) or len(biases) != len(br):
        raise ValueError(f"expected {len(wr)} weights and {len(br)} biases for this "
                         f"configuration, got {len(weights)} and {len(biases)}")
    parts = []
    for r, a in zip(wr + br, list(weights) + list(biases)):
        a = np.asarray(a)
        if a.size != r.size:
            raise ValueError(f"{r.kind} of layer {r.layer}, direction {r.direction}, "
                             f"{'recurrent' if r.recurrent else 'input'} gate {r.gate}: expected "
                             f"{r.size} elements {r.shape}, got shape {a.shape}")
        parts.append(a.reshape(-1))
    dtype = np.result_type(*parts)
    return np.concatenate(parts).astype(dtype, copy=False)


def per_layer(params, rnn_mode: str, num_layers: int, num_units: int, input_size: int,
              direction: str = "unidirectional", input_mode: str = "linear_input"):
    """{(layer, dir): (Wx [G*H, in] or None for skip_input, Rh [G*H, H], bx [G*H], bh [G*H])},
    views into params; the same blocks as PyTorch's weight_ih/weight_hh/bias_ih/bias_hh."""
    params = np.asarray(params)
    regions = layout(rnn_mode, num_layers, num_units, input_size, direction, input_mode)
    out = {}
    for r in regions:
        if r.gate != 0:
            continue
        g = num_gates(rnn_mode)
        n = r.size * g
        block = params[r.offset:r.offset + n]
        key = (r.layer, r.direction)
        entry = out.setdefault(key, [None, None, None, None])
        if r.kind == "weight":
            entry[1 if r.recurrent else 0] = block.reshape(g * r.shape[0], r.shape[1])
        else:
            entry[3 if r.recurrent else 2] = block
    return {k: tuple(v) for k, v in out.items()}


def layout_coefficients(rnn_mode: str, num_layers: int, direction: str = "unidirectional",
                        input_mode: str = "linear_input"):
    """The same layout with num_units (H) and input_size (I) left symbolic: for each
    (layer, dir), the offsets of its [Wx, Rh, bx, bh] blocks as (a, b, c) meaning
    a*H*I + b*H*H + c*H, and the end of the buffer. Used to slice params at run time."""
    g, nd = num_gates(rnn_mode), num_dirs(direction)
    if input_mode not in ("linear_input", "skip_input"):
        raise ValueError(f"input_mode={input_mode!r} must be resolved to linear_input or "
                         "skip_input first")
    off = [0, 0, 0]
    blocks = {}
    for layer in range(num_layers):
        for d in range(nd):
            wx = None
            if not (layer == 0 and input_mode == "skip_input"):
                wx = tuple(off)
                if layer == 0:
                    off[0] += g
                else:
                    off[1] += g * nd
            rh = tuple(off)
            off[1] += g
            blocks[(layer, d)] = [wx, rh, None, None]
    for layer in range(num_layers):
        for d in range(nd):
            blocks[(layer, d)][2] = tuple(off)
            off[2] += g
            blocks[(layer, d)][3] = tuple(off)
            off[2] += g
    return {k: tuple(v) for k, v in blocks.items()}, tuple(off)
