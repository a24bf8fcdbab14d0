"""ONNX function bodies for the CudnnRNN op family (domain ``onnxgrad``, version 1).

Ops, with TensorFlow's inputs, outputs, attribute names and defaults:

* ``CudnnRNN(input, input_h, input_c, params) -> output, output_h, output_c, reserve_space``
* ``CudnnRNNV2(...same...) -> output, output_h, output_c, reserve_space, host_reserved``
* ``CudnnRNNBackprop(input, input_h, input_c, params, output, output_h, output_c,
  output_backprop, output_h_backprop, output_c_backprop, reserve_space)
  -> input_backprop, input_h_backprop, input_c_backprop, params_backprop``
* ``CudnnRNNBackpropV2(...same..., host_reserved) -> ...same...``

Attributes: rnn_mode ("lstm"), input_mode ("linear_input"), direction ("unidirectional"),
dropout (0.0), seed (0), seed2 (0), is_training (1; forward ops only), num_proj (0; only 0 is
supported). Shapes are time-major: input [seq_length, batch, input_size], input_h/input_c
[num_layers * num_dirs, batch, num_units]; params is the flat cuDNN buffer of
:mod:`onnxgrad.rnn.params`. For modes other than lstm, input_c is ignored, output_c is a zero
scalar (TF's shape) and input_c_backprop is zeros of input_c's shape.

**One function per configuration, chosen by FunctionProto overload.** An ONNX function body cannot
change its structure with an attribute, and num_layers, direction, rnn_mode and input_mode all
change it. So each node carries ``overload = "<rnn_mode>.<direction>.<input_mode>.L<num_layers>"``
(input_mode resolved: auto_select becomes linear_input or skip_input) and the model carries one
FunctionProto per (op_type, overload) in use (IR >= 10; onnxruntime resolves overloads). The node
users see is always op_type "CudnnRNN"/... in domain "onnxgrad". :func:`attach_functions` sets the
overloads (num_layers from input_h's static first dim) and adds the functions and the opset import.
Everything else is read from shapes at run time (seq_length, batch, input_size, num_units may be
symbolic). The bodies use standard ai.onnx ops only (Scan over time, Slice/Reshape of params,
MatMul, Sigmoid, Tanh, Relu, Split, Concat), at the model's ai.onnx opset (13 or newer).

**reserve_space layout** (1-D, dtype of input): the flattening of a tensor
``[num_layers * num_dirs, seq_length, batch, K * num_units]`` (index layer * num_dirs + dir; time
index t is the real time step for both directions) whose rows are, per step, what backward needs:

=========== === ===============================================================================
rnn_mode     K  row at step t (each block num_units wide)
=========== === ===============================================================================
lstm         6  i, f, c~ (activated gates), o, c_t, h_t
gru          5  r, z, h~ (activated), R_h h_{t-1} + b_Rh, h_t
rnn_*        1  h_t
=========== === ===============================================================================

The backward op reads gate activations, states and each layer's outputs (the next layer's inputs)
from it and recomputes nothing of the forward. host_reserved (V2) is an int8 vector
``[111, rnn_mode index, direction index, input_mode index, num_layers]`` (111 = 'o'); this slice
does not yet check it at run time.

Dropout is not implemented yet: a forward op with dropout > 0, is_training and num_layers > 1
(or a backward op with dropout > 0 and num_layers > 1) is rejected by :func:`attach_functions`
with NotImplementedError. (cuDNN applies no dropout to a single-layer model.)
"""
from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .params import INPUT_MODES, RNN_MODES, layout_coefficients, num_dirs, num_gates, \
    resolve_input_mode
from .reference import RESERVE_WIDTH

DOMAIN = "onnxgrad"
VERSION = 1
FORWARD_OPS = ("CudnnRNN", "CudnnRNNV2")
BACKWARD_OPS = ("CudnnRNNBackprop", "CudnnRNNBackpropV2")
OPS = FORWARD_OPS + BACKWARD_OPS
MIN_OPSET = 13
_INT_MAX = np.iinfo(np.int64).max

ATTR_DEFAULTS = {"rnn_mode": "lstm", "input_mode": "linear_input", "direction": "unidirectional",
                 "dropout": 0.0, "seed": 0, "seed2": 0, "num_proj": 0}
FORWARD_ATTR_DEFAULTS = {**ATTR_DEFAULTS, "is_training": 1}

FORWARD_INPUTS = ["input", "input_h", "input_c", "params"]
FORWARD_OUTPUTS = ["output", "output_h", "output_c", "reserve_space"]
BACKWARD_INPUTS = FORWARD_INPUTS + ["output", "output_h", "output_c", "output_backprop",
                                    "output_h_backprop", "output_c_backprop", "reserve_space"]
BACKWARD_OUTPUTS = ["input_backprop", "input_h_backprop", "input_c_backprop", "params_backprop"]


def op_inputs(op_type: str) -> list[str]:
    if op_type in FORWARD_OPS:
        return list(FORWARD_INPUTS)
    return BACKWARD_INPUTS + (["host_reserved"] if op_type.endswith("V2") else [])


def op_outputs(op_type: str) -> list[str]:
    if op_type in FORWARD_OPS:
        return FORWARD_OUTPUTS + (["host_reserved"] if op_type.endswith("V2") else [])
    return list(BACKWARD_OUTPUTS)


def overload_key(rnn_mode: str, direction: str, input_mode: str, num_layers: int) -> str:
    return f"{rnn_mode}.{direction}.{input_mode}.L{num_layers}"


def parse_overload(key: str) -> tuple[str, str, str, int]:
    try:
        mode, direction, input_mode, layers = key.split(".")
        assert layers[0] == "L"
        return mode, direction, input_mode, int(layers[1:])
    except (ValueError, AssertionError, IndexError):
        raise ValueError(f"{key!r} is not an onnxgrad CudnnRNN overload "
                         "('<rnn_mode>.<direction>.<input_mode>.L<num_layers>')") from None


# -- a small NodeProto builder -----------------------------------------------------------------
class _B:
    """Appends NodeProtos; every name is unique across the function and its subgraphs."""

    def __init__(self, counter, opset, tag=""):
        self.nodes: list[onnx.NodeProto] = []
        self.counter, self.opset, self.tag = counter, opset, tag
        self._ints: dict = {}

    def fresh(self, base: str) -> str:
        return f"{self.tag}{base}_{next(self.counter)}"

    def op(self, op_type, *inputs, n_out=1, out=None, **attrs):
        outs = out if out is not None else [self.fresh(op_type) for _ in range(n_out)]
        outs = [outs] if isinstance(outs, str) else list(outs)
        self.nodes.append(helper.make_node(op_type, [i or "" for i in inputs], outs, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def sub(self, tag):
        return _B(self.counter, self.opset, tag)

    def ints(self, *vals):
        """A 1-D int64 constant (one per distinct value in this builder)."""
        if vals not in self._ints:
            self._ints[vals] = self.op("Constant", value=numpy_helper.from_array(
                np.array(vals, np.int64)))
        return self._ints[vals]

    def scalar_int(self, v):
        return self.op("Constant", value=numpy_helper.from_array(np.array(v, np.int64)))

    def like(self, v: int, x: str) -> str:
        """The scalar 0 or 1 in x's dtype (the bodies are polymorphic in T). Opset 15+ has
        CastLike; before it, 0 is the exact sum of an empty slice of x and 1 is exp(0)."""
        if self.opset >= 15:
            c = self.op("Constant", value=numpy_helper.from_array(np.array(v, np.float32)))
            return self.op("CastLike", c, x)
        if v not in (0, 1):
            raise ValueError("only 0 and 1 can be made without CastLike")
        empty = self.op("Slice", self.op("Reshape", x, self.ints(-1)), self.ints(0), self.ints(0))
        zero = self.op("ReduceSum", empty, self.ints(0), keepdims=0)
        return zero if v == 0 else self.op("Exp", zero)

    def __getattr__(self, op_type):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)


def _graph(b: _B, name, inputs, outputs):
    # element types are left open: the function is polymorphic in T, and Scan gives its body
    # inputs the types of its own inputs
    vi = lambda n: onnx.ValueInfoProto(name=n)  # noqa: E731
    return helper.make_graph(b.nodes, name, [vi(i) for i in inputs], [vi(o) for o in outputs])


class _Dims:
    """Run-time dims of one op call, as 1-D int64 tensors."""

    def __init__(self, b: _B, x: str, h: str, nd: int):
        sx, sh = b.Shape(x), b.Shape(h)
        self.T = b.Slice(sx, b.ints(0), b.ints(1))
        self.B = b.Slice(sx, b.ints(1), b.ints(2))
        self.I = b.Slice(sx, b.ints(2), b.ints(3))
        self.H = b.Slice(sh, b.ints(2), b.ints(3))
        self.HI, self.HH = b.Mul(self.H, self.I), b.Mul(self.H, self.H)
        self.b = b
        self._muls: dict = {}

    def mul(self, k: int, v: str):
        key = (k, v)
        if key not in self._muls:
            self._muls[key] = v if k == 1 else self.b.Mul(v, self.b.ints(k))
        return self._muls[key]

    def poly(self, coef):
        """a*H*I + b*H*H + c*H for coef = (a, b, c)."""
        terms = [self.mul(k, v) for k, v in zip(coef, (self.HI, self.HH, self.H)) if k]
        if not terms:
            return self.b.ints(0)
        out = terms[0]
        for t in terms[1:]:
            out = self.b.Add(out, t)
        return out


def _add(a, b):
    return tuple(x + y for x, y in zip(a, b))


class _Weights:
    """Slices of the flat params buffer for each (layer, dir), in the layout of params.py."""

    def __init__(self, b: _B, dm: _Dims, params: str, rnn_mode, L, direction, input_mode):
        self.b, self.dm, self.params = b, dm, params
        self.G, self.nd = num_gates(rnn_mode), num_dirs(direction)
        self.blocks, self.end = layout_coefficients(rnn_mode, L, direction, input_mode)
        self.ndH = dm.mul(self.nd, dm.H)
        self.GH = dm.mul(self.G, dm.H)

    def in_dim(self, layer):
        return self.dm.I if layer == 0 else self.ndH

    def _slice(self, start, size, shape):
        b = self.b
        s, e = self.dm.poly(start), self.dm.poly(_add(start, size))
        flat = b.Slice(self.params, s, e, b.ints(0))
        return flat if shape is None else b.Reshape(flat, shape)

    def get(self, layer, d):
        """(Wx [GH, in] or None, Rh [GH, H], bx [GH], bh [GH])."""
        b, G = self.b, self.G
        wx, rh, bx, bh = self.blocks[(layer, d)]
        Wx = None
        if wx is not None:
            size = (G, 0, 0) if layer == 0 else (0, G * self.nd, 0)
            Wx = self._slice(wx, size, b.Concat(b.ints(-1), self.in_dim(layer), axis=0))
        Rh = self._slice(rh, (0, G, 0), b.Concat(b.ints(-1), self.dm.H, axis=0))
        return Wx, Rh, self._slice(bx, (0, 0, G), None), self._slice(bh, (0, 0, G), None)


def _split(b, x, sizes, n):
    return b.op("Split", x, sizes, axis=1, n_out=n)


def _host_reserved(rnn_mode, direction, input_mode, L):
    return np.array([111, RNN_MODES.index(rnn_mode), ("unidirectional", "bidirectional").index(
        direction), INPUT_MODES.index(input_mode), min(L, 127)], np.int8)


# -- forward ---------------------------------------------------------------------------------
def _fwd_cell(b: _B, rnn_mode, RhT, bh, splits, one):
    """Scan body: (h[, c], xp_t) -> (h'[, c'], row, h')."""
    lstm = rnn_mode == "lstm"
    h, xp = b.fresh("h"), b.fresh("xp")
    c = b.fresh("c") if lstm else None
    hh = b.Add(b.MatMul(h, RhT), bh)
    if lstm:
        g = b.Add(xp, hh)
        i, f, cc, o = _split(b, g, splits, 4)
        i, f, cc, o = b.Sigmoid(i), b.Sigmoid(f), b.Tanh(cc), b.Sigmoid(o)
        c2 = b.Add(b.Mul(f, c), b.Mul(i, cc))
        h2 = b.Mul(o, b.Tanh(c2))
        row = b.Concat(i, f, cc, o, c2, h2, axis=1)
    elif rnn_mode == "gru":
        xr, xz, xn = _split(b, xp, splits, 3)
        hr, hz, hn = _split(b, hh, splits, 3)
        r, z = b.Sigmoid(b.Add(xr, hr)), b.Sigmoid(b.Add(xz, hz))
        n = b.Tanh(b.Add(xn, b.Mul(r, hn)))
        h2 = b.Add(n, b.Mul(z, b.Sub(h, n)))
        row = b.Concat(r, z, n, hn, h2, axis=1)
    else:
        p = b.Add(xp, hh)
        h2 = b.Relu(p) if rnn_mode == "rnn_relu" else b.Tanh(p)
        row = b.Identity(h2)
    ins = [h] + ([c] if lstm else []) + [xp]
    outs = [h2] + ([c2] if lstm else []) + [row, b.Identity(h2)]
    return _graph(b, "cell", ins, outs)


def _forward_body(b: _B, v2, rnn_mode, direction, input_mode, L):
    x, h0, c0, params = FORWARD_INPUTS
    lstm = rnn_mode == "lstm"
    nd, G = num_dirs(direction), num_gates(rnn_mode)
    dm = _Dims(b, x, h0, nd)
    w = _Weights(b, dm, params, rnn_mode, L, direction, input_mode)
    one = b.like(1, x)
    splits = b.Concat(*[dm.H] * G, axis=0)
    layer_in = x
    hn, cn, rows = [], [], []
    for layer in range(L):
        outs = []
        for d in range(nd):
            idx = b.scalar_int(layer * nd + d)
            Wx, Rh, bx, bh = w.get(layer, d)
            if Wx is None:
                xp = b.Add(b.Concat(*[layer_in] * G, axis=2), bx)
            else:
                xp = b.Add(b.MatMul(layer_in, b.Transpose(Wx)), bx)
            body = _fwd_cell(b.sub(f"l{layer}d{d}/"), rnn_mode, b.Transpose(Rh), bh, splits, one)
            states = [b.Gather(h0, idx, axis=0)] + ([b.Gather(c0, idx, axis=0)] if lstm else [])
            res = b.op("Scan", *states, xp, n_out=len(states) + 2, body=body, num_scan_inputs=1,
                       scan_input_directions=[d], scan_output_directions=[d, d])
            hn.append(res[0])
            if lstm:
                cn.append(res[1])
            rows.append(res[-2])
            outs.append(res[-1])
        layer_in = outs[0] if nd == 1 else b.Concat(*outs, axis=2)
    b.Identity(layer_in, out="output")
    stack = lambda vs: b.Concat(*[b.Unsqueeze(v, b.ints(0)) for v in vs], axis=0)  # noqa: E731
    b.Identity(stack(hn), out="output_h")
    if lstm:
        b.Identity(stack(cn), out="output_c")
    else:
        b.Mul(b.like(0, x), one, out="output_c")
    b.Reshape(stack(rows), b.ints(-1), out="reserve_space")
    if v2:
        b.op("Constant", out="host_reserved", value=numpy_helper.from_array(
            _host_reserved(rnn_mode, direction, input_mode, L)))


# -- backward --------------------------------------------------------------------------------
def _bwd_cell(b: _B, rnn_mode, Rh, splits_row, one):
    """Scan body (backwards in time): (dh[, dc], dy_t, row_t, hprev_t[, cprev_t]) ->
    (dh_prev[, dc_prev], dgx_t[, dgh_t])."""
    lstm, gru = rnn_mode == "lstm", rnn_mode == "gru"
    dh_c, dy, row, hp = b.fresh("dh"), b.fresh("dy"), b.fresh("row"), b.fresh("hp")
    dc_c = b.fresh("dc") if lstm else None
    cp = b.fresh("cp") if lstm else None
    dh = b.Add(dy, dh_c)
    sig_d = lambda s: b.Mul(s, b.Sub(one, s))  # noqa: E731  sigmoid' from its output
    tanh_d = lambda t: b.Sub(one, b.Mul(t, t))  # noqa: E731
    if lstm:
        i, f, cc, o, c, _ = _split(b, row, splits_row, 6)
        tc = b.Tanh(c)
        do = b.Mul(dh, tc)
        dc = b.Add(dc_c, b.Mul(b.Mul(dh, o), tanh_d(tc)))
        dg = b.Concat(b.Mul(b.Mul(dc, cc), sig_d(i)), b.Mul(b.Mul(dc, cp), sig_d(f)),
                      b.Mul(b.Mul(dc, i), tanh_d(cc)), b.Mul(do, sig_d(o)), axis=1)
        dhp, states, outs = b.MatMul(dg, Rh), [b.Mul(dc, f)], [dg]
    elif gru:
        r, z, n, hr, _ = _split(b, row, splits_row, 5)
        dnp = b.Mul(b.Mul(dh, b.Sub(one, z)), tanh_d(n))
        drp = b.Mul(b.Mul(dnp, hr), sig_d(r))
        dzp = b.Mul(b.Mul(dh, b.Sub(hp, n)), sig_d(z))
        dgx = b.Concat(drp, dzp, dnp, axis=1)
        dgh = b.Concat(drp, dzp, b.Mul(dnp, r), axis=1)
        dhp, states, outs = b.Add(b.Mul(dh, z), b.MatMul(dgh, Rh)), [], [dgx, dgh]
    else:
        if rnn_mode == "rnn_relu":
            zero = b.Sub(one, one)
            dp = b.Where(b.Greater(row, zero), dh, zero)
        else:
            dp = b.Mul(dh, tanh_d(row))
        dhp, states, outs = b.MatMul(dp, Rh), [], [dp]
    ins = [dh_c] + ([dc_c] if lstm else []) + [dy, row, hp] + ([cp] if lstm else [])
    return _graph(b, "cell_grad", ins, [dhp] + states + outs)


def _backward_body(b: _B, v2, rnn_mode, direction, input_mode, L):
    x, h0, c0, params = FORWARD_INPUTS
    lstm, gru = rnn_mode == "lstm", rnn_mode == "gru"
    nd, G = num_dirs(direction), num_gates(rnn_mode)
    dm = _Dims(b, x, h0, nd)
    w = _Weights(b, dm, params, rnn_mode, L, direction, input_mode)
    H = dm.H
    one = b.like(1, x)
    k = RESERVE_WIDTH[rnn_mode]
    splits_row = b.Concat(*[H] * k, axis=0)
    R = b.Reshape("reserve_space", b.Concat(b.ints(L * nd), dm.T, dm.B, dm.mul(k, H), axis=0))
    negH = b.Neg(H)
    rows = [b.Gather(R, b.scalar_int(i), axis=0) for i in range(L * nd)]
    hseq = [b.Slice(r, negH, b.ints(_INT_MAX), b.ints(2)) for r in rows]
    minus1 = b.ints(-1)
    dY = "output_backprop"
    dh0s, dc0s, grads = [None] * (L * nd), [None] * (L * nd), {}
    for layer in reversed(range(L)):
        if layer == 0:
            layer_in = x
        else:
            below = hseq[(layer - 1) * nd:layer * nd]
            layer_in = below[0] if nd == 1 else b.Concat(*below, axis=2)
        dxs = []
        for d in range(nd):
            idx = layer * nd + d
            sidx = b.scalar_int(idx)
            Wx, Rh, bx, bh = w.get(layer, d)

            def shifted(seq, first):
                first = b.Unsqueeze(first, b.ints(0))
                if d == 0:  # prev of t is t-1
                    return b.Concat(first, b.Slice(seq, b.ints(0), minus1, b.ints(0)), axis=0)
                return b.Concat(b.Slice(seq, b.ints(1), b.ints(_INT_MAX), b.ints(0)), first,
                                axis=0)

            hprev = shifted(hseq[idx], b.Gather(h0, sidx, axis=0))
            scan_in = [dY if nd == 1 else
                       b.Slice(dY, dm.mul(d, H), dm.mul(d + 1, H), b.ints(2)), rows[idx], hprev]
            states = [b.Gather("output_h_backprop", sidx, axis=0)]
            if lstm:
                cs = b.Slice(rows[idx], dm.mul(4, H), dm.mul(5, H), b.ints(2))
                scan_in.append(shifted(cs, b.Gather(c0, sidx, axis=0)))
                states.append(b.Gather("output_c_backprop", sidx, axis=0))
            n_scan_out = 2 if gru else 1
            body = _bwd_cell(b.sub(f"gl{layer}d{d}/"), rnn_mode, Rh, splits_row, one)
            res = b.op("Scan", *states, *scan_in, n_out=len(states) + n_scan_out, body=body,
                       num_scan_inputs=len(scan_in),
                       scan_input_directions=[1 - d] * len(scan_in),
                       scan_output_directions=[1 - d] * n_scan_out)
            dh0s[idx] = res[0]
            if lstm:
                dc0s[idx] = res[1]
            dgx = res[len(states)]
            dgh = res[-1]
            flat = lambda v, width: b.Reshape(v, b.Concat(minus1, width, axis=0))  # noqa: E731
            dgx2, dgh2 = flat(dgx, w.GH), flat(dgh, w.GH)
            dWx = None if Wx is None else b.MatMul(b.Transpose(dgx2), flat(layer_in,
                                                                             w.in_dim(layer)))
            dRh = b.MatMul(b.Transpose(dgh2), flat(hprev, H))
            grads[(layer, d)] = (dWx, dRh, b.ReduceSum(dgx2, b.ints(0), keepdims=0),
                                 b.ReduceSum(dgh2, b.ints(0), keepdims=0))
            if Wx is None:
                dxs.append(b.ReduceSum(b.Reshape(dgx, b.Concat(dm.T, dm.B, b.ints(G), H, axis=0)),
                                       b.ints(2), keepdims=0))
            else:
                dxs.append(b.MatMul(dgx, Wx))
        dY = dxs[0] if nd == 1 else b.Add(*dxs)
    b.Identity(dY, out="input_backprop")
    stack = lambda vs: b.Concat(*[b.Unsqueeze(v, b.ints(0)) for v in vs], axis=0)  # noqa: E731
    b.Identity(stack(dh0s), out="input_h_backprop")
    if lstm:
        b.Identity(stack(dc0s), out="input_c_backprop")
    else:
        b.Expand(b.like(0, x), b.Shape(c0), out="input_c_backprop")
    weights, biases = [], []
    for layer in range(L):
        for d in range(nd):
            dWx, dRh, dbx, dbh = grads[(layer, d)]
            weights += ([] if dWx is None else [b.Reshape(dWx, minus1)]) + [b.Reshape(dRh, minus1)]
            biases += [dbx, dbh]
    b.Concat(*weights, *biases, axis=0, out="params_backprop")


def make_function(op_type: str, rnn_mode: str = "lstm", direction: str = "unidirectional",
                  input_mode: str = "linear_input", num_layers: int = 1,
                  opset: int = 18) -> onnx.FunctionProto:
    """The FunctionProto of one op for one configuration (its overload is the config key)."""
    if op_type not in OPS:
        raise ValueError(f"{op_type!r} is not one of {', '.join(OPS)}")
    num_gates(rnn_mode)
    num_dirs(direction)
    if input_mode not in ("linear_input", "skip_input"):
        raise ValueError(f"input_mode={input_mode!r}: resolve auto_select before building")
    if opset < MIN_OPSET:
        raise ValueError(f"the CudnnRNN function bodies need ai.onnx opset >= {MIN_OPSET}, "
                         f"got {opset}")
    b = _B(itertools.count(), opset)
    v2 = op_type.endswith("V2")
    if op_type in FORWARD_OPS:
        _forward_body(b, v2, rnn_mode, direction, input_mode, num_layers)
        defaults = FORWARD_ATTR_DEFAULTS
    else:
        _backward_body(b, v2, rnn_mode, direction, input_mode, num_layers)
        defaults = ATTR_DEFAULTS
    f = helper.make_function(
        DOMAIN, op_type, op_inputs(op_type), op_outputs(op_type), b.nodes,
        [helper.make_opsetid("", opset)],
        attribute_protos=[helper.make_attribute(k, v) for k, v in defaults.items()],
        doc_string=f"onnxgrad {op_type} ({rnn_mode}, {direction}, {input_mode}, "
                   f"{num_layers} layers); see onnxgrad.rnn.ops")
    f.overload = overload_key(rnn_mode, direction, input_mode, num_layers)
    return f


# -- attaching functions to a model ----------------------------------------------------------
def _attrs(node: onnx.NodeProto, defaults) -> dict:
    out = dict(defaults)
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _static_dims(model: onnx.ModelProto) -> dict[str, list]:
    """name -> list of dims (int or None) for every value whose shape onnx can tell."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001  custom ops without inference: use what is declared
        inferred = model
    out = {}
    g = inferred.graph
    for vi in itertools.chain(g.input, g.value_info, g.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    for init in g.initializer:
        out[init.name] = list(init.dims)
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            for a in n.attribute:
                if a.name == "value":
                    out[n.output[0]] = list(a.t.dims)
    return out


def _walk(graph: onnx.GraphProto):
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _walk(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sg in a.graphs:
                    yield from _walk(sg)


def node_config(node: onnx.NodeProto, dims: dict | None = None) -> tuple[str, str, str, int]:
    """(rnn_mode, direction, resolved input_mode, num_layers) of one node; validates what this
    slice supports."""
    fwd = node.op_type in FORWARD_OPS
    a = _attrs(node, FORWARD_ATTR_DEFAULTS if fwd else ATTR_DEFAULTS)
    rnn_mode, direction = a["rnn_mode"], a["direction"]
    num_gates(rnn_mode)
    nd = num_dirs(direction)
    if a["num_proj"]:
        raise NotImplementedError(f"{node.op_type} {node.name!r}: num_proj={a['num_proj']} is not "
                                  "supported (only 0)")
    dims = dims or {}
    xs = dims.get(node.input[0]) if node.input else None
    hs = dims.get(node.input[1]) if len(node.input) > 1 else None
    if node.overload:
        key_mode, key_dir, key_in, layers = parse_overload(node.overload)
        if (key_mode, key_dir) != (rnn_mode, direction):
            raise ValueError(f"{node.op_type} {node.name!r}: overload {node.overload!r} does not "
                             f"match rnn_mode={rnn_mode!r}, direction={direction!r}")
        input_mode = key_in
    else:
        if not hs or hs[0] is None:
            raise ValueError(
                f"{node.op_type} {node.name!r}: num_layers comes from input_h's first dim "
                f"(num_layers * num_dirs), which is not known statically for "
                f"{node.input[1]!r}; give input_h a static first dim or set the node's overload "
                f"to '<rnn_mode>.<direction>.<input_mode>.L<num_layers>'")
        if hs[0] % nd:
            raise ValueError(f"{node.op_type} {node.name!r}: input_h's first dim {hs[0]} is not "
                             f"a multiple of {nd} ({direction})")
        layers = hs[0] // nd
        input_size = xs[2] if xs and len(xs) == 3 else None
        num_units = hs[2] if len(hs) == 3 else None
        input_mode = resolve_input_mode(a["input_mode"], input_size, num_units)
    if a["dropout"] > 0 and layers > 1 and (not fwd or a["is_training"]):
        raise NotImplementedError(f"{node.op_type} {node.name!r}: dropout={a['dropout']} between "
                                  "layers is not implemented yet in onnxgrad's CudnnRNN functions")
    return rnn_mode, direction, input_mode, layers


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` where every onnxgrad CudnnRNN-family node has its overload set and the
    model carries the matching FunctionProtos and imports the ``onnxgrad`` opset (version 1)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    nodes = [n for n in _walk(m.graph) if n.domain == DOMAIN and n.op_type in OPS]
    if not nodes:
        return m
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < MIN_OPSET:
        raise ValueError(f"the CudnnRNN function bodies need ai.onnx opset >= {MIN_OPSET}, "
                         f"the model imports {opset}")
    dims = None if all(n.overload for n in nodes) else _static_dims(m)
    have = {(f.domain, f.name, f.overload) for f in m.functions}
    for n in nodes:
        cfg = node_config(n, dims)
        n.overload = overload_key(*cfg)
        if (DOMAIN, n.op_type, n.overload) not in have:
            m.functions.append(make_function(n.op_type, *cfg, opset=opset))
            have.add((DOMAIN, n.op_type, n.overload))
    if not any(o.domain == DOMAIN for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid(DOMAIN, VERSION))
    m.ir_version = max(m.ir_version, 10)  # FunctionProto.overload / NodeProto.overload
    return m


def make_node(op_type: str, inputs, outputs, **attrs) -> onnx.NodeProto:
    """A NodeProto of one of the ops in the onnxgrad domain (attributes as TF names them)."""
    if op_type not in OPS:
        raise ValueError(f"{op_type!r} is not one of {', '.join(OPS)}")
    return helper.make_node(op_type, inputs, outputs, domain=DOMAIN, **attrs)


__all__ = ["attach_functions", "make_function", "make_node", "node_config", "overload_key",
           "DOMAIN", "OPS", "FORWARD_OPS", "BACKWARD_OPS"]
