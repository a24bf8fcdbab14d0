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
MatMul, Gemm, Sigmoid, Tanh, Relu, Split, Concat), at the model's ai.onnx opset (13 or newer).
Per step they do the recurrent matmul (one Gemm, the input projection of all steps with both
biases (LSTM, RNN) made before the Scan by one MatMul) and the elementwise gates; the backward
accumulates the weight gradients after its Scan with one MatMul each over all steps.

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

With the ONNX cell options (``OnnxRNN``, below): for GRU with linear_before_reset=0 the fourth
block is r * h_{t-1} (what R_h multiplies); with clip, G more blocks before h_t hold the 0/1
masks of the gate pre-activations that were not clipped (i, f, c~, o / r, z, h~ / the one gate).

The backward op reads gate activations, states and each layer's outputs (the next layer's inputs)
from it and recomputes nothing of the forward. host_reserved (V2) is an int8 vector
``[111, rnn_mode index, direction index, input_mode index, num_layers]`` (111 = 'o'); the
backward body checks it at run time: another value makes the node named
``reserve_space_does_not_match_this_configuration_or_the_forward_op_host_reserved`` fail (a
host_reserved of another length fails at ``host_reserved_must_have_5_entries...``), and so does a
reserve_space of the wrong size. :func:`attach_functions` checks at build time that a backward
node reading a forward node's reserve_space/host_reserved has the same attributes and
configuration.

**OnnxRNN / OnnxRNNBackprop** (domain onnxgrad): the same params layout, bodies and reserve_space
with the ONNX cell options cuDNN lacks, used by the gradients of ai.onnx LSTM/GRU/RNN
(:mod:`onnxgrad.rnn.onnx_rnn`). Inputs: CudnnRNN's (resp. CudnnRNNBackprop's) plus an optional
trailing ``peepholes`` [num_layers * num_dirs, 3 * num_units] (ONNX's P: i, o, f); outputs:
CudnnRNN's without host_reserved (resp. CudnnRNNBackprop's plus ``peepholes_backprop``).
Attributes: rnn_mode, input_mode, direction, ``linear_before_reset`` (1: cuDNN's GRU; 0: ONNX's
default, h~ = tanh(W_h x + b_Wh + R_h (r * h) + b_Rh)), ``clip`` (0: none; else ONNX's clip,
bounding every gate pre-activation to [-clip, clip], as onnxruntime does; needs opset 15).
With ``sequence_lens`` (int32 [batch], ONNX's per-batch lengths; the inputs are then
``..., peepholes (may be ""), sequence_lens``), step t of batch entry b is computed only when
t < sequence_lens[b]: a padded step carries h and c unchanged (so the reserve_space rows' c_t and
h_t are the carried states) and outputs 0; the backward passes dh, dc through padded steps.
The overload key gets ``.lbr0``, ``.clip``, ``.peep``, ``.seq`` suffixes.

**Dropout** (forward ops with dropout > 0, is_training and num_layers >= 2, and backward ops
with dropout > 0 and num_layers >= 2; overload suffix ``.drop``, ai.onnx opset >= 15): as cuDNN,
the input of layers 2..L (the output of the layer below, both directions together) is
multiplied by a mask of 0 (dropped) and 1 / (1 - dropout) (kept); nothing else is dropped, and a
one-layer model or inference is unchanged (dropout = 0 builds exactly the function without it).
The masks ``[num_layers - 1, seq_length, batch, num_dirs * num_units]`` are **appended to
reserve_space** after the rows above (flattened, in input's dtype); the backward op reads them
from there and never recomputes them. Generator (deterministic; see
:func:`onnxgrad.rnn.reference.dropout_mask`): element k of the masks (row-major flat index) is
kept when ``dropout_hash(k, seed, seed2) >= int64(float32(dropout) * float32(2**31 - 1))``, a
counter-based hash in int64 Mod/Mul/Add modulo the prime 2**31 - 1 (onnxruntime's RandomUniform
is not used: its generator advances on every run, so two runs of one model would differ). The
same seeds give the same masks on every run (unlike TF, where the dropout state advances per
step and seed = seed2 = 0 means a random seed): feed different seeds per step for fresh masks.
Counters wrap modulo 2**31 - 1 (masks longer than that repeat).

**Outputs nobody reads** (a backward node whose input_backprop or params_backprop is "", as
gradients() emits it when the input's, or every weight's, gradient is not asked for; overload
suffixes ``.nodx``, ``.nodp``): the body skips layer 0's input gradient (one MatMul over all
steps per direction, seq_length * batch * G * num_units * input_size multiply-adds), or every
weight and bias gradient (two or three MatMuls and the bias sums per layer and direction), and
that output is an empty tensor. Such an overload on a node that names the output is a
ValueError at :func:`attach_functions`.

**Params ops** (CudnnRNNParamsSize, CudnnRNNParamsToCanonical[V2], CudnnRNNCanonicalToParams[V2]):
see :mod:`onnxgrad.rnn.params_ops`. :func:`op_signature` gives any op's TF signature (input and
output names in order, attributes with defaults, list lengths) for converters.
"""
from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .params_ops import ATTRS as PARAMS_ATTRS
from .params_ops import PARAMS_OPS
from .params import INPUT_MODES, RNN_MODES, layout_coefficients, num_dirs, num_gates, \
    resolve_input_mode
from .reference import RESERVE_WIDTH

DOMAIN = "onnxgrad"
VERSION = 1
FORWARD_OPS = ("CudnnRNN", "CudnnRNNV2")
BACKWARD_OPS = ("CudnnRNNBackprop", "CudnnRNNBackpropV2")
#: the same cell and params layout with the ONNX cell options cuDNN lacks (see module doc)
EX_OPS = ("OnnxRNN", "OnnxRNNBackprop")
OPS = FORWARD_OPS + BACKWARD_OPS + EX_OPS
# Reshape-13's shape inference gives no rank for a shape computed at run time (Reshape-14's
# does), and onnxruntime's Scan refuses a body output without one: at opset 13, every body
# with a symbolic batch dim failed to run
MIN_OPSET = 14
_INT_MAX = np.iinfo(np.int64).max

ATTR_DEFAULTS = {"rnn_mode": "lstm", "input_mode": "linear_input", "direction": "unidirectional",
                 "dropout": 0.0, "seed": 0, "seed2": 0, "num_proj": 0}
FORWARD_ATTR_DEFAULTS = {**ATTR_DEFAULTS, "is_training": 1}
EX_ATTR_DEFAULTS = {"rnn_mode": "lstm", "input_mode": "linear_input",
                    "direction": "unidirectional", "linear_before_reset": 1, "clip": 0.0}

FORWARD_INPUTS = ["input", "input_h", "input_c", "params"]
FORWARD_OUTPUTS = ["output", "output_h", "output_c", "reserve_space"]
BACKWARD_INPUTS = FORWARD_INPUTS + ["output", "output_h", "output_c", "output_backprop",
                                    "output_h_backprop", "output_c_backprop", "reserve_space"]
BACKWARD_OUTPUTS = ["input_backprop", "input_h_backprop", "input_c_backprop", "params_backprop"]


class Variant(tuple):
    """What changes a body's structure beyond (rnn_mode, direction, input_mode, num_layers):
    the ONNX cell options cuDNN lacks (GRU linear_before_reset=0, clip on the gate
    pre-activations, LSTM peepholes, per-batch ``sequence_lens``; OnnxRNN* only), dropout
    between layers (CudnnRNN* only) and, for backward ops, an input_backprop (``nodx``) or a
    params_backprop (``nodp``) nobody reads. ``Variant()`` is cuDNN's cell without dropout."""

    def __new__(cls, lbr: int = 1, clip: bool = False, peep: bool = False, drop: bool = False,
                seq: bool = False, nodx: bool = False, nodp: bool = False):
        return super().__new__(cls, (int(lbr), bool(clip), bool(peep), bool(drop), bool(seq),
                                     bool(nodx), bool(nodp)))

    lbr = property(lambda self: self[0])
    clip = property(lambda self: self[1])
    peep = property(lambda self: self[2])
    drop = property(lambda self: self[3])
    seq = property(lambda self: self[4])
    nodx = property(lambda self: self[5])
    nodp = property(lambda self: self[6])

    def skipping(self, nodx: bool = False, nodp: bool = False) -> "Variant":
        return Variant(*self[:5], nodx=nodx, nodp=nodp)

    def cell(self) -> "Variant":
        """The variant without what a node's attributes and outputs decide (dropout, nodx,
        nodp)."""
        return Variant(self.lbr, self.clip, self.peep, seq=self.seq)

    @property
    def onnx_options(self) -> bool:
        """Whether it uses an ONNX cell option (only OnnxRNN / OnnxRNNBackprop have them)."""
        return not self.lbr or self.clip or self.peep or self.seq

    def suffix(self) -> str:
        return ("" if self.lbr else ".lbr0") + (".clip" if self.clip else "") + \
            (".peep" if self.peep else "") + (".drop" if self.drop else "") + \
            (".seq" if self.seq else "") + (".nodx" if self.nodx else "") + \
            (".nodp" if self.nodp else "")

    @classmethod
    def parse(cls, parts) -> "Variant":
        bad = set(parts) - {"lbr0", "clip", "peep", "drop", "seq", "nodx", "nodp"}
        if bad:
            raise ValueError(f"unknown variant flags {sorted(bad)}")
        return cls(0 if "lbr0" in parts else 1, "clip" in parts, "peep" in parts,
                   "drop" in parts, "seq" in parts, "nodx" in parts, "nodp" in parts)


CUDNN_CELL = Variant()


def reserve_width(rnn_mode: str, variant: Variant = CUDNN_CELL) -> int:
    """Width of one reserve_space row, in units of num_units (see the layout above)."""
    return RESERVE_WIDTH[rnn_mode] + (num_gates(rnn_mode) if variant.clip else 0)


def _ex_inputs(variant: Variant) -> list[str]:
    if variant.seq:  # positional: peepholes is "" when absent
        return ["peepholes", "sequence_lens"]
    return ["peepholes"] if variant.peep else []


def op_inputs(op_type: str, variant: Variant = CUDNN_CELL) -> list[str]:
    if op_type in FORWARD_OPS:
        return list(FORWARD_INPUTS)
    if op_type == "OnnxRNN":
        return FORWARD_INPUTS + _ex_inputs(variant)
    if op_type == "OnnxRNNBackprop":
        return BACKWARD_INPUTS + _ex_inputs(variant)
    return BACKWARD_INPUTS + (["host_reserved"] if op_type.endswith("V2") else [])


def op_outputs(op_type: str, variant: Variant = CUDNN_CELL) -> list[str]:
    if op_type == "OnnxRNN":
        return list(FORWARD_OUTPUTS)
    if op_type == "OnnxRNNBackprop":
        return BACKWARD_OUTPUTS + (["peepholes_backprop"] if variant.peep else [])
    if op_type in FORWARD_OPS:
        return FORWARD_OUTPUTS + (["host_reserved"] if op_type.endswith("V2") else [])
    return list(BACKWARD_OUTPUTS)


def overload_key(rnn_mode: str, direction: str, input_mode: str, num_layers: int,
                 variant: Variant = CUDNN_CELL) -> str:
    return f"{rnn_mode}.{direction}.{input_mode}.L{num_layers}{variant.suffix()}"


def parse_overload(key: str, with_variant: bool = False):
    """(rnn_mode, direction, input_mode, num_layers[, Variant]) from an overload key."""
    try:
        mode, direction, input_mode, layers, *extra = key.split(".")
        assert layers[0] == "L"
        variant = Variant.parse(extra)
        out = (mode, direction, input_mode, int(layers[1:]))
    except (ValueError, AssertionError, IndexError):
        raise ValueError(f"{key!r} is not an onnxgrad CudnnRNN overload "
                         "('<rnn_mode>.<direction>.<input_mode>.L<num_layers>"
                         "[.lbr0][.clip][.peep][.drop][.seq][.nodx][.nodp]')") from None
    return out + (variant,) if with_variant else out


# -- a small NodeProto builder -----------------------------------------------------------------
class _B:
    """Appends NodeProtos; every name is unique across the function and its subgraphs."""

    def __init__(self, counter, opset, tag=""):
        self.nodes: list[onnx.NodeProto] = []
        self.counter, self.opset, self.tag = counter, opset, tag
        self._ints: dict = {}

    def fresh(self, base: str) -> str:
        return f"{self.tag}{base}_{next(self.counter)}"

    def op(self, op_type, *inputs, n_out=1, out=None, name=None, **attrs):
        outs = out if out is not None else [self.fresh(op_type) for _ in range(n_out)]
        outs = [outs] if isinstance(outs, str) else list(outs)
        self.nodes.append(helper.make_node(op_type, [i or "" for i in inputs], outs, name=name,
                                           **attrs))
        return outs[0] if len(outs) == 1 else outs

    def attr_const(self, attr: str, like: str) -> str:
        """The float attribute ``attr`` of the function (a reference), cast to like's dtype."""
        node = helper.make_node("Constant", [], [self.fresh("attr_" + attr)])
        ref = onnx.AttributeProto(name="value_float", ref_attr_name=attr,
                                  type=onnx.AttributeProto.FLOAT)
        node.attribute.append(ref)
        self.nodes.append(node)
        return self.op("CastLike", node.output[0], like)

    def attr_int(self, attr: str) -> str:
        """The int attribute ``attr`` of the function (a reference), as an int64 scalar."""
        node = helper.make_node("Constant", [], [self.fresh("attr_" + attr)])
        node.attribute.append(onnx.AttributeProto(name="value_int", ref_attr_name=attr,
                                                  type=onnx.AttributeProto.INT))
        self.nodes.append(node)
        return node.output[0]

    def attr_float(self, attr: str) -> str:
        """The float attribute ``attr`` of the function (a reference), as a float32 scalar."""
        node = helper.make_node("Constant", [], [self.fresh("attr_" + attr)])
        node.attribute.append(onnx.AttributeProto(name="value_float", ref_attr_name=attr,
                                                  type=onnx.AttributeProto.FLOAT))
        self.nodes.append(node)
        return node.output[0]

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

    def ranked(self, x: str, rank: int) -> str:
        """x reshaped to its own dims, gathered one by one: a tensor whose rank inference
        knows where x's it may not (after a ConcatFromSequence), for onnxruntime's Scan refuses
        a body output without a shape, and the bodies' shapes follow their inputs'."""
        return self.Reshape(x, self.Gather(self.Shape(x), self.ints(*range(rank)), axis=0))

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
class _Cell:
    """What the cell bodies share: the variant, 1 and 0 in T, the clip bound, the splits."""

    def __init__(self, b: _B, x: str, H: str, rnn_mode: str, variant: Variant):
        self.mode, self.v = rnn_mode, variant
        self.one = b.like(1, x)
        self.zero = b.Sub(self.one, self.one)
        self.c = b.attr_const("clip", x) if variant.clip else None
        self.negc = b.Neg(self.c) if variant.clip else None
        G = num_gates(rnn_mode)
        self.splits = b.Concat(*[H] * G, axis=0)
        self.splits_row = b.Concat(*[H] * reserve_width(rnn_mode, variant), axis=0)

    def clip(self, b, pre, masks):
        """clip(pre) (ONNX: bounds the input of every gate activation); records the 0/1 mask
        of where the derivative passes."""
        if not self.v.clip:
            return pre
        masks.append(b.Where(b.LessOrEqual(b.Abs(pre), self.c), self.one, self.zero))
        return b.Clip(pre, self.negc, self.c)


def _fwd_cell(b: _B, cl: _Cell, Rh, bh, peep):
    """Scan body: (h[, c], xp_t) -> (h'[, c'], row, h'). ``Rh`` [GH, H] (multiplied transposed,
    by Gemm's transB); for GRU with linear_before_reset=0, (Rh_rz, Rh_n, bh_rz, bh_n). For LSTM
    and RNN, xp_t holds both biases: the gates are one Gemm, xp_t + h Rh^T; ``peep`` (Pi, Po,
    Pf) or None."""
    rnn_mode, v = cl.mode, cl.v
    lstm = rnn_mode == "lstm"
    h, xp = b.fresh("h"), b.fresh("xp")
    c = b.fresh("c") if lstm else None
    valid = b.fresh("valid") if v.seq else None  # bool [B, 1]: t < sequence_lens[b]
    keep = (lambda new, old: b.Where(valid, new, old)) if v.seq else \
        (lambda new, old: new)  # noqa: E731  padded steps carry the state unchanged
    masks = []
    if lstm:
        g = b.Gemm(h, Rh, xp, transB=1)
        gi, gf, gc, go = _split(b, g, cl.splits, 4)
        if peep:
            gi, gf = b.Add(gi, b.Mul(peep[0], c)), b.Add(gf, b.Mul(peep[2], c))
        i = b.Sigmoid(cl.clip(b, gi, masks))
        f = b.Sigmoid(cl.clip(b, gf, masks))
        cc = b.Tanh(cl.clip(b, gc, masks))
        c2 = b.Add(b.Mul(f, c), b.Mul(i, cc))
        if peep:
            go = b.Add(go, b.Mul(peep[1], c2))
        o = b.Sigmoid(cl.clip(b, go, masks))
        h2 = b.Mul(o, b.Tanh(c2))
        y = h2
        h2, c2 = keep(h2, h), keep(c2, c)
        row = b.Concat(i, f, cc, o, c2, *masks, h2, axis=1)
    elif rnn_mode == "gru":
        xr, xz, xn = _split(b, xp, cl.splits, 3)
        if v.lbr:
            hr, hz, hn = _split(b, b.Gemm(h, Rh, bh, transB=1), cl.splits, 3)
        else:
            Rh_rz, Rh_n, bh_rz, bh_n = Rh
            hr, hz = _split(b, b.Gemm(h, Rh_rz, bh_rz, transB=1), b.Slice(
                cl.splits, b.ints(0), b.ints(2)), 2)
        r = b.Sigmoid(cl.clip(b, b.Add(xr, hr), masks))
        z = b.Sigmoid(cl.clip(b, b.Add(xz, hz), masks))
        if v.lbr:
            saved = hn
            pn = b.Add(xn, b.Mul(r, hn))
        else:
            saved = b.Mul(r, h)  # r * h_{t-1}: what R_h multiplies
            pn = b.Add(xn, b.Gemm(saved, Rh_n, bh_n, transB=1))
        n = b.Tanh(cl.clip(b, pn, masks))
        h2 = b.Add(n, b.Mul(z, b.Sub(h, n)))
        y = h2
        h2 = keep(h2, h)
        row = b.Concat(r, z, n, saved, *masks, h2, axis=1)
    else:
        p = cl.clip(b, b.Gemm(h, Rh, xp, transB=1), masks)
        h2 = b.Relu(p) if rnn_mode == "rnn_relu" else b.Tanh(p)
        y = h2
        h2 = keep(h2, h)
        row = b.Concat(*masks, h2, axis=1) if masks else b.Identity(h2)
    ins = [h] + ([c] if lstm else []) + [xp] + ([valid] if v.seq else [])
    y = b.Where(valid, y, cl.zero) if v.seq else b.Identity(h2)  # ONNX: Y is 0 past the end
    outs = [h2] + ([c2] if lstm else []) + [row, y]
    return _graph(b, "cell", ins, outs)


def _gru_split_rh(b, dm, Rh, bh, transpose):
    """(Rh_rz, Rh_n, bh_rz, bh_n): GRU's recurrent weights split into the r, z gates and h."""
    H2 = dm.mul(2, dm.H)
    GH = dm.mul(3, dm.H)
    Rrz, Rn = b.Slice(Rh, b.ints(0), H2, b.ints(0)), b.Slice(Rh, H2, GH, b.ints(0))
    if transpose:
        Rrz, Rn = b.Transpose(Rrz), b.Transpose(Rn)
    return Rrz, Rn, b.Slice(bh, b.ints(0), H2, b.ints(0)), b.Slice(bh, H2, GH, b.ints(0))


def _peepholes(b, dm, idx):
    """(Pi, Po, Pf) of one (layer, dir): rows of peepholes [L * nd, 3 * H] (ONNX's i, o, f)."""
    P = b.Gather("peepholes", idx, axis=0)
    return tuple(b.Slice(P, dm.mul(k, dm.H), dm.mul(k + 1, dm.H), b.ints(0)) for k in range(3))


#: the modulus of the dropout hash (a prime; every product below stays under 2**63)
DROPOUT_MODULUS = 2**31 - 1


def _valid_steps(b: _B, dm: _Dims) -> str:
    """bool [T, B, 1]: t < sequence_lens[b] (ONNX's per-batch lengths)."""
    steps = b.Range(b.scalar_int(0), b.Squeeze(dm.T, b.ints(0)), b.scalar_int(1))
    lens = b.Cast("sequence_lens", to=onnx.TensorProto.INT64)
    return b.Unsqueeze(b.Less(b.Unsqueeze(steps, b.ints(1)), b.Unsqueeze(lens, b.ints(0))),
                       b.ints(2))


def _dropout_masks(b: _B, dm: _Dims, cl, L: int, nd: int, x: str) -> str:
    """[L - 1, T, B, nd * H] in x's dtype: 0 (dropped) or 1 / (1 - dropout) (kept), for the
    inputs of layers 2..L. The generator is :func:`onnxgrad.rnn.reference.dropout_mask`: a
    counter-based hash of (flat index, seed, seed2) in int64 arithmetic modulo 2**31 - 1."""
    shape = b.Concat(b.ints(L - 1), dm.T, dm.B, dm.mul(nd, dm.H), axis=0)
    idx = b.Range(b.scalar_int(0), b.ReduceProd(shape, keepdims=0), b.scalar_int(1))
    m = b.scalar_int(DROPOUT_MODULUS)
    a, s2 = b.Mod(b.attr_int("seed"), m), b.Mod(b.attr_int("seed2"), m)
    one_i = b.scalar_int(1)
    mix = lambda v, k, c: b.Mod(b.Add(b.Mul(v, b.scalar_int(k)), c), m)  # noqa: E731
    sq = lambda v, c: b.Mod(b.Add(b.Mul(v, v), c), m)  # noqa: E731
    h = b.Add(b.Mod(idx, m), one_i)
    h = sq(mix(h, 48271, a), s2)
    h = sq(mix(h, 16807, b.Add(a, one_i)), b.Add(s2, one_i))
    h = mix(h, 48271, a)
    p32 = b.attr_float("dropout")
    thr = b.Cast(b.Mul(p32, b.op("Constant", value=numpy_helper.from_array(
        np.array(DROPOUT_MODULUS, np.float32)))), to=onnx.TensorProto.INT64)
    p = b.CastLike(p32, x)
    scale = b.Div(cl.one, b.Sub(cl.one, p))
    return b.Reshape(b.Where(b.GreaterOrEqual(h, thr), scale, cl.zero), shape)


def _forward_body(b: _B, v2, rnn_mode, direction, input_mode, L, variant=CUDNN_CELL):
    x, h0, c0, params = FORWARD_INPUTS
    lstm = rnn_mode == "lstm"
    x, h0, c0 = b.ranked(x, 3), b.ranked(h0, 3), b.ranked(c0, 3) if lstm else c0
    nd, G = num_dirs(direction), num_gates(rnn_mode)
    dm = _Dims(b, x, h0, nd)
    w = _Weights(b, dm, params, rnn_mode, L, direction, input_mode)
    cl = _Cell(b, x, dm.H, rnn_mode, variant)
    valid = _valid_steps(b, dm) if variant.seq else None
    drop = _dropout_masks(b, dm, cl, L, nd, x) if variant.drop else None
    layer_in = x
    hn, cn, rows = [], [], []
    for layer in range(L):
        if drop is not None and layer > 0:  # cuDNN: dropout on the input of layers 2..L
            layer_in = b.Mul(layer_in, b.Gather(drop, b.scalar_int(layer - 1), axis=0))
        outs = []
        for d in range(nd):
            idx = b.scalar_int(layer * nd + d)
            Wx, Rh, bx, bh = w.get(layer, d)
            if rnn_mode != "gru":  # both biases go in with the input projection
                bx = b.Add(bx, bh)
            if Wx is None:
                xp = b.Add(b.Concat(*[layer_in] * G, axis=2), bx)
            else:
                xp = b.Add(b.MatMul(layer_in, b.Transpose(Wx)), bx)
            if rnn_mode == "gru" and not variant.lbr:
                Rh = _gru_split_rh(b, dm, Rh, bh, transpose=False)
            peep = _peepholes(b, dm, idx) if variant.peep else None
            body = _fwd_cell(b.sub(f"l{layer}d{d}/"), cl, Rh, bh, peep)
            states = [b.Gather(h0, idx, axis=0)] + ([b.Gather(c0, idx, axis=0)] if lstm else [])
            seqs = [xp] + ([valid] if variant.seq else [])
            res = b.op("Scan", *states, *seqs, n_out=len(states) + 2, body=body,
                       num_scan_inputs=len(seqs), scan_input_directions=[d] * len(seqs),
                       scan_output_directions=[d, d])
            hn.append(res[0])
            if lstm:
                cn.append(res[1])
            rows.append(res[-2])
            outs.append(res[-1])
        layer_in = outs[0] if nd == 1 else b.Concat(*outs, axis=2)
    b.Identity(layer_in, out="output")
    stack = lambda vs: b.Unsqueeze(vs[0], b.ints(0)) if len(vs) == 1 else \
        b.Concat(*[b.Unsqueeze(v, b.ints(0)) for v in vs], axis=0)  # noqa: E731
    b.Identity(stack(hn), out="output_h")
    if lstm:
        b.Identity(stack(cn), out="output_c")
    else:
        b.Mul(cl.zero, cl.one, out="output_c")
    if drop is None:
        b.Reshape(stack(rows), b.ints(-1), out="reserve_space")
    else:  # the masks follow the rows (see the layout above)
        b.Concat(b.Reshape(stack(rows), b.ints(-1)), b.Reshape(drop, b.ints(-1)), axis=0,
                 out="reserve_space")
    if v2:
        b.op("Constant", out="host_reserved", value=numpy_helper.from_array(
            _host_reserved(rnn_mode, direction, input_mode, L)))


# -- backward --------------------------------------------------------------------------------
def _bwd_cell(b: _B, cl: _Cell, Rh, peep):
    """Scan body (backwards in time): (dh[, dc], dy_t, row_t, hprev_t[, cprev_t]) ->
    (dh_prev[, dc_prev], dgx_t[, dgh_t]). ``Rh`` is (Rh_rz, Rh_n) for GRU with
    linear_before_reset=0."""
    rnn_mode, v, one = cl.mode, cl.v, cl.one
    lstm, gru = rnn_mode == "lstm", rnn_mode == "gru"
    dh_c, dy, row, hp = b.fresh("dh"), b.fresh("dy"), b.fresh("row"), b.fresh("hp")
    dc_c = b.fresh("dc") if lstm else None
    cp = b.fresh("cp") if lstm else None
    dh_in, dc_in = dh_c, dc_c
    valid = b.fresh("valid") if v.seq else None
    if v.seq:  # a padded step passes dh, dc through unchanged and has no output
        dh_tot = b.Add(b.Where(valid, dy, cl.zero), dh_c)
        dh = b.Where(valid, dh_tot, cl.zero)
        dc_c = b.Where(valid, dc_c, cl.zero) if lstm else None
    else:
        dh = b.Add(dy, dh_c)
    sig_d = lambda s: b.Mul(s, b.Sub(one, s))  # noqa: E731  sigmoid' from its output
    tanh_d = lambda t: b.Sub(one, b.Mul(t, t))  # noqa: E731
    k = reserve_width(rnn_mode, v)
    parts = _split(b, row, cl.splits_row, k) if k > 1 else [row]
    G = num_gates(rnn_mode)
    base = RESERVE_WIDTH[rnn_mode] - 1
    masks = parts[base:base + G] if v.clip else [None] * G
    m = lambda t, k: t if masks[k] is None else b.Mul(t, masks[k])  # noqa: E731
    if lstm:
        i, f, cc, o, c = parts[:5]
        tc = b.Tanh(c)
        dgo = m(b.Mul(b.Mul(dh, tc), sig_d(o)), 3)
        dc = b.Add(dc_c, b.Mul(b.Mul(dh, o), tanh_d(tc)))
        if peep:
            dc = b.Add(dc, b.Mul(dgo, peep[1]))
        dgi = m(b.Mul(b.Mul(dc, cc), sig_d(i)), 0)
        dgf = m(b.Mul(b.Mul(dc, cp), sig_d(f)), 1)
        dg = b.Concat(dgi, dgf, m(b.Mul(b.Mul(dc, i), tanh_d(cc)), 2), dgo, axis=1)
        dcp = b.Mul(dc, f)
        if peep:
            dcp = b.Add(dcp, b.Add(b.Mul(dgi, peep[0]), b.Mul(dgf, peep[2])))
        dhp, states, outs = b.MatMul(dg, Rh), [dcp], [dg]
    elif gru:
        r, z, n, saved = parts[:4]
        dnp = m(b.Mul(b.Mul(dh, b.Sub(one, z)), tanh_d(n)), 2)
        dzp = m(b.Mul(b.Mul(dh, b.Sub(hp, n)), sig_d(z)), 1)
        if v.lbr:
            drp = m(b.Mul(b.Mul(dnp, saved), sig_d(r)), 0)
            dgx = b.Concat(drp, dzp, dnp, axis=1)
            dgh = b.Concat(drp, dzp, b.Mul(dnp, r), axis=1)
            dhp, outs = b.Add(b.Mul(dh, z), b.MatMul(dgh, Rh)), [dgx, dgh]
        else:
            Rrz, Rn = Rh
            drh = b.MatMul(dnp, Rn)  # d(r * h_{t-1})
            drp = m(b.Mul(b.Mul(drh, hp), sig_d(r)), 0)
            drz = b.Concat(drp, dzp, axis=1)
            dgx = b.Concat(drz, dnp, axis=1)
            dhp = b.Add(b.Add(b.Mul(dh, z), b.MatMul(drz, Rrz)), b.Mul(drh, r))
            outs = [dgx, b.Identity(dgx)]
        states = []
    else:
        h = parts[-1]
        if rnn_mode == "rnn_relu":
            dp = b.Where(b.Greater(h, cl.zero), dh, cl.zero)
        else:
            dp = b.Mul(dh, tanh_d(h))
        dp = m(dp, 0)
        dhp, states, outs = b.MatMul(dp, Rh), [], [dp]
    if v.seq:
        dhp = b.Where(valid, dhp, dh_tot)
        states = [b.Where(valid, st, dc_in) for st in states]
    ins = [dh_in] + ([dc_in] if lstm else []) + [dy, row, hp] + ([cp] if lstm else []) + \
        ([valid] if v.seq else [])
    return _graph(b, "cell_grad", ins, [dhp] + states + outs)


def _check_host_reserved(b: _B, rnn_mode, direction, input_mode, L):
    """0 (shape [1]) when host_reserved matches this configuration; a positive number otherwise,
    which makes the reserve_space Reshape below fail with a node name that says why."""
    want = b.op("Constant", value=numpy_helper.from_array(
        _host_reserved(rnn_mode, direction, input_mode, L).astype(np.int64)))
    got = b.Cast("host_reserved", to=onnx.TensorProto.INT64)
    diff = b.op("Sub", got, want,
                name="host_reserved_must_have_5_entries_as_written_by_the_forward_CudnnRNNV2")
    return b.ReduceSum(b.Abs(diff), b.ints(0), keepdims=1)


def _weight_grads(b, w, dm, layer, layer_in, row, hprev, dgx, dgh, Wx, lbr0):
    """(dWx, dRh, dbx, dbh) of one layer and direction from its gate gradients over all steps
    (dgx; dgh for GRU, whose recurrent gates differ), each one MatMul or ReduceSum."""
    H, minus1 = dm.H, b.ints(-1)
    flat = lambda v, width: b.Reshape(v, b.Concat(minus1, width, axis=0))  # noqa: E731
    dgx2 = flat(dgx, w.GH)
    dgh2 = dgx2 if dgh == dgx else flat(dgh, w.GH)

    def wgrad(dg2, v, width):
        """dg2^T @ v, v [T, B, width] flattened: v^T is made explicitly (3-D Transpose
        and Reshape: onnxruntime's MatMul with a transposed A, which it would fuse a 2-D
        Transpose into, is much slower) and is the smaller operand to transpose."""
        vT = b.Reshape(b.Transpose(v, perm=[2, 0, 1]), b.Concat(width, minus1, axis=0))
        return b.Transpose(b.MatMul(vT, dg2))

    dWx = None if Wx is None else wgrad(dgx2, layer_in, w.in_dim(layer))
    if lbr0:  # rows r, z multiply h_{t-1}; rows h multiply r * h_{t-1} (saved)
        H2 = dm.mul(2, H)
        rh = b.Slice(row, dm.mul(3, H), dm.mul(4, H), b.ints(2))
        dRh = b.Concat(wgrad(b.Slice(dgh2, b.ints(0), H2, b.ints(1)), hprev, H),
                       wgrad(b.Slice(dgh2, H2, w.GH, b.ints(1)), rh, H), axis=0)
    else:
        dRh = wgrad(dgh2, hprev, H)
    dbx = b.ReduceSum(dgx2, b.ints(0), keepdims=0)
    dbh = dbx if dgh2 == dgx2 else b.ReduceSum(dgh2, b.ints(0), keepdims=0)
    return dWx, dRh, dbx, dbh


def _backward_body(b: _B, v2, rnn_mode, direction, input_mode, L, variant=CUDNN_CELL):
    x, h0, c0, params = FORWARD_INPUTS
    lstm, gru = rnn_mode == "lstm", rnn_mode == "gru"
    x, h0, c0 = b.ranked(x, 3), b.ranked(h0, 3), b.ranked(c0, 3) if lstm else c0
    lbr0 = gru and not variant.lbr
    nd, G = num_dirs(direction), num_gates(rnn_mode)
    dm = _Dims(b, x, h0, nd)
    w = _Weights(b, dm, params, rnn_mode, L, direction, input_mode)
    H = dm.H
    cl = _Cell(b, x, H, rnn_mode, variant)
    k = reserve_width(rnn_mode, variant)
    width, first = dm.mul(k, H), b.ints(L * nd)
    reserve, drop = "reserve_space", None
    if variant.drop:  # [rows | dropout masks [L - 1, T, B, nd * H]]; both reshapes check sizes
        n_rows = b.ReduceProd(b.Concat(first, dm.T, dm.B, width, axis=0), keepdims=1)
        reserve = b.Slice("reserve_space", b.ints(0), n_rows, b.ints(0))
        drop = b.op("Reshape", b.Slice("reserve_space", n_rows, b.ints(_INT_MAX), b.ints(0)),
                    b.Concat(b.ints(L - 1), dm.T, dm.B, dm.mul(nd, H), axis=0),
                    name="reserve_space_has_no_dropout_masks_of_this_configuration_"
                         "is_the_forward_op_is_training_with_the_same_dropout")
    if v2:  # a host_reserved of another configuration makes the Reshape below fail, by name;
        # in two dims, so that onnxruntime's ReshapeFusion cannot turn the check into a -1
        bad = _check_host_reserved(b, rnn_mode, direction, input_mode, L)
        width, first = b.Add(width, bad), b.Add(first, bad)
    R = b.op("Reshape", reserve, b.Concat(first, dm.T, dm.B, width, axis=0),
             name="reserve_space_does_not_match_this_configuration_or_the_forward_op_"
                  "host_reserved")
    valid = _valid_steps(b, dm) if variant.seq else None
    layer_mask = lambda layer: b.Gather(drop, b.scalar_int(layer - 1), axis=0)  # noqa: E731
    negH = b.Neg(H)
    # one layer and direction: a Squeeze shares R's buffer (a Gather would copy all of it)
    rows = [b.Squeeze(R, b.ints(0))] if L * nd == 1 else \
        [b.Gather(R, b.scalar_int(i), axis=0) for i in range(L * nd)]
    hseq = [b.Slice(r, negH, b.ints(_INT_MAX), b.ints(2)) for r in rows]
    minus1 = b.ints(-1)
    dY = b.ranked("output_backprop", 3)
    dh_n = b.ranked("output_h_backprop", 3)
    dc_n = b.ranked("output_c_backprop", 3) if lstm else None
    dh0s, dc0s, dps, grads = [None] * (L * nd), [None] * (L * nd), [None] * (L * nd), {}
    for layer in reversed(range(L)):
        if layer == 0:
            layer_in = x
        else:
            below = hseq[(layer - 1) * nd:layer * nd]
            layer_in = below[0] if nd == 1 else b.Concat(*below, axis=2)
            if drop is not None:
                layer_in = b.Mul(layer_in, layer_mask(layer))
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
            states = [b.Gather(dh_n, sidx, axis=0)]
            cs = cprev = None
            if lstm:
                cs = b.Slice(rows[idx], dm.mul(4, H), dm.mul(5, H), b.ints(2))
                cprev = shifted(cs, b.Gather(c0, sidx, axis=0))
                scan_in.append(cprev)
                states.append(b.Gather(dc_n, sidx, axis=0))
            if variant.seq:
                scan_in.append(valid)
            n_scan_out = 2 if gru else 1
            peep = _peepholes(b, dm, sidx) if variant.peep else None
            cell_R = _gru_split_rh(b, dm, Rh, bh, False)[:2] if lbr0 else Rh
            body = _bwd_cell(b.sub(f"gl{layer}d{d}/"), cl, cell_R, peep)
            res = b.op("Scan", *states, *scan_in, n_out=len(states) + n_scan_out, body=body,
                       num_scan_inputs=len(scan_in),
                       scan_input_directions=[1 - d] * len(scan_in),
                       scan_output_directions=[1 - d] * n_scan_out)
            dh0s[idx] = res[0]
            if lstm:
                dc0s[idx] = res[1]
            dgx = res[len(states)]
            dgh = res[-1]
            if not variant.nodp:
                grads[(layer, d)] = _weight_grads(b, w, dm, layer, layer_in, rows[idx], hprev,
                                                  dgx, dgh, Wx, lbr0)
            if peep:  # ONNX order i, o, f
                sl = lambda v, j: b.Slice(v, dm.mul(j, H), dm.mul(j + 1, H), b.ints(2))  # noqa
                red = lambda v: b.ReduceSum(v, b.ints(0, 1), keepdims=0)  # noqa: E731
                dps[idx] = b.Concat(red(b.Mul(sl(dgx, 0), cprev)), red(b.Mul(sl(dgx, 3), cs)),
                                    red(b.Mul(sl(dgx, 1), cprev)), axis=0)
            if layer == 0 and variant.nodx:
                continue
            if Wx is None:
                dxs.append(b.ReduceSum(b.Reshape(dgx, b.Concat(dm.T, dm.B, b.ints(G), H, axis=0)),
                                       b.ints(2), keepdims=0))
            else:
                dxs.append(b.MatMul(dgx, Wx))
        if dxs:
            dY = dxs[0] if nd == 1 else b.Add(*dxs)
        if drop is not None and layer > 0:
            dY = b.Mul(dY, layer_mask(layer))
    if variant.nodx:  # an empty tensor: nothing reads it (the node leaves the output unnamed)
        b.Expand(cl.zero, b.ints(0), out="input_backprop")
    else:
        b.Identity(dY, out="input_backprop")
    stack = lambda vs: b.Unsqueeze(vs[0], b.ints(0)) if len(vs) == 1 else \
        b.Concat(*[b.Unsqueeze(v, b.ints(0)) for v in vs], axis=0)  # noqa: E731
    b.Identity(stack(dh0s), out="input_h_backprop")
    if lstm:
        b.Identity(stack(dc0s), out="input_c_backprop")
    else:
        b.Expand(cl.zero, b.Shape(c0), out="input_c_backprop")
    if variant.peep:
        b.Identity(stack(dps), out="peepholes_backprop")
    if variant.nodp:  # as input_backprop above
        b.Expand(cl.zero, b.ints(0), out="params_backprop")
        return
    weights, biases = [], []
    for layer in range(L):
        for d in range(nd):
            dWx, dRh, dbx, dbh = grads[(layer, d)]
            weights += ([] if dWx is None else [b.Reshape(dWx, minus1)]) + [b.Reshape(dRh, minus1)]
            biases += [dbx, dbh]
    b.Concat(*weights, *biases, axis=0, out="params_backprop")


def make_function(op_type: str, rnn_mode: str = "lstm", direction: str = "unidirectional",
                  input_mode: str = "linear_input", num_layers: int = 1,
                  opset: int = 18, variant: Variant = CUDNN_CELL) -> onnx.FunctionProto:
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
    if variant.onnx_options and op_type not in EX_OPS:
        raise ValueError(f"{op_type} has cuDNN's cell only; {variant.suffix()!r} needs "
                         f"{' / '.join(EX_OPS)}")
    if variant.drop and (op_type in EX_OPS or num_layers < 2):
        raise ValueError(f"dropout applies between layers of {' / '.join(FORWARD_OPS)} and "
                         f"their backward ops only (num_layers >= 2), not to {op_type} with "
                         f"{num_layers} layer(s)")
    if variant.drop and opset < 15:
        raise ValueError(f"dropout in {op_type} needs ai.onnx opset >= 15 (CastLike), got "
                         f"{opset}")
    if (variant.nodx or variant.nodp) and op_type not in BACKWARD_OPS + ("OnnxRNNBackprop",):
        raise ValueError(f"nodx / nodp (no input_backprop / params_backprop) are a backward "
                         f"op's variants, not {op_type}'s")
    if variant.clip and opset < 15:
        raise ValueError(f"clip in {op_type} needs ai.onnx opset >= 15 (CastLike), got {opset}")
    if not variant.lbr and rnn_mode != "gru":
        raise ValueError("linear_before_reset=0 is a GRU option")
    if variant.peep and rnn_mode != "lstm":
        raise ValueError("peepholes are an LSTM option")
    b = _B(itertools.count(), opset)
    v2 = op_type.endswith("V2")
    if op_type in FORWARD_OPS or op_type == "OnnxRNN":
        _forward_body(b, v2, rnn_mode, direction, input_mode, num_layers, variant)
        defaults = FORWARD_ATTR_DEFAULTS
    else:
        _backward_body(b, v2, rnn_mode, direction, input_mode, num_layers, variant)
        defaults = ATTR_DEFAULTS
    if op_type in EX_OPS:
        defaults = EX_ATTR_DEFAULTS
    f = helper.make_function(
        DOMAIN, op_type, op_inputs(op_type, variant), op_outputs(op_type, variant), b.nodes,
        [helper.make_opsetid("", opset)],
        attribute_protos=[helper.make_attribute(k, v) for k, v in defaults.items()],
        doc_string=f"onnxgrad {op_type} ({rnn_mode}, {direction}, {input_mode}, "
                   f"{num_layers} layers{variant.suffix()}); see onnxgrad.rnn.ops")
    f.overload = overload_key(rnn_mode, direction, input_mode, num_layers, variant)
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


def walk_nodes(graph: onnx.GraphProto):
    """Every node of ``graph`` and of its subgraphs, depth first."""
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from walk_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sg in a.graphs:
                    yield from walk_nodes(sg)


def _variant_of(node: onnx.NodeProto, a: dict) -> Variant:
    if node.op_type not in EX_OPS:
        return CUDNN_CELL
    pos = 4 if node.op_type == "OnnxRNN" else len(BACKWARD_INPUTS)
    peep = len(node.input) > pos and bool(node.input[pos])
    seq = len(node.input) > pos + 1 and bool(node.input[pos + 1])
    return Variant(a["linear_before_reset"], a["clip"] > 0, peep, seq=seq)


def node_config(node: onnx.NodeProto, dims: dict | None = None, with_variant: bool = False):
    """(rnn_mode, direction, resolved input_mode, num_layers[, Variant]) of one node; validates
    what the functions support."""
    fwd = node.op_type in FORWARD_OPS or node.op_type == "OnnxRNN"
    ex = node.op_type in EX_OPS
    a = _attrs(node, EX_ATTR_DEFAULTS if ex else FORWARD_ATTR_DEFAULTS if fwd else ATTR_DEFAULTS)
    rnn_mode, direction = a["rnn_mode"], a["direction"]
    num_gates(rnn_mode)
    nd = num_dirs(direction)
    variant = _variant_of(node, a)
    if a.get("num_proj"):
        raise NotImplementedError(f"{node.op_type} {node.name!r}: num_proj={a['num_proj']} is not "
                                  "supported (only 0)")
    dims = dims or {}
    xs = dims.get(node.input[0]) if node.input else None
    hs = dims.get(node.input[1]) if len(node.input) > 1 else None
    if node.overload:
        key_mode, key_dir, key_in, layers, key_variant = parse_overload(node.overload, True)
        if (key_mode, key_dir, key_variant.cell()) != (rnn_mode, direction, variant):
            raise ValueError(f"{node.op_type} {node.name!r}: overload {node.overload!r} does not "
                             f"match rnn_mode={rnn_mode!r}, direction={direction!r}"
                             + (f", cell options {variant.suffix()!r}" if ex else ""))
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
    drop = a.get("dropout", 0) > 0 and layers > 1 and (not fwd or bool(a["is_training"]))
    if node.overload and key_variant.drop != drop:
        raise ValueError(f"{node.op_type} {node.name!r}: overload {node.overload!r} does not "
                         f"match dropout={a.get('dropout', 0)}"
                         + ("" if not fwd else f", is_training={a['is_training']}")
                         + f" with {layers} layer(s)")
    if drop and not 0 < a["dropout"] < 1:
        raise ValueError(f"{node.op_type} {node.name!r}: dropout={a['dropout']} must be in "
                         "[0, 1)")
    # a backward node that does not ask for ("") input_backprop or params_backprop skips it
    unnamed = [not fwd and not (len(node.output) > k and node.output[k]) for k in (0, 3)]
    keyed = (key_variant.nodx, key_variant.nodp) if node.overload else (False, False)
    for k, out, flag, key_says in zip((0, 3), ("input_backprop", "params_backprop"), unnamed,
                                      keyed):
        if key_says and not flag:
            raise ValueError(f"{node.op_type} {node.name!r}: overload {node.overload!r} leaves "
                             f"{out} empty, but the node names it {node.output[k]!r}")
    variant = Variant(*variant[:3], drop=drop, seq=variant.seq).skipping(*unnamed)
    cfg = (rnn_mode, direction, input_mode, layers)
    return cfg + (variant,) if with_variant else cfg


#: the attributes a backward op must share with the forward op whose reserve_space it reads
_MUST_MATCH = ("rnn_mode", "direction", "dropout", "seed", "seed2", "num_proj")


def _check_pairs(m: onnx.ModelProto, nodes, cfgs) -> None:
    """A backward node fed by a forward node's reserve_space (or host_reserved) must have the
    same configuration; say so at build time rather than compute garbage."""
    producer = {}
    for n in nodes:
        if n.op_type in FORWARD_OPS or n.op_type == "OnnxRNN":
            for i, o in enumerate(n.output):
                if o and i >= 3:  # reserve_space, host_reserved
                    producer[o] = n
    for n in nodes:
        if n.op_type not in BACKWARD_OPS and n.op_type != "OnnxRNNBackprop":
            continue
        ins = [n.input[10]] if len(n.input) > 10 else []
        if n.op_type == "CudnnRNNBackpropV2" and len(n.input) > 11:
            ins.append(n.input[11])
        for name in ins:
            f = producer.get(name)
            if f is None:
                continue
            fa = _attrs(f, EX_ATTR_DEFAULTS if f.op_type in EX_OPS else FORWARD_ATTR_DEFAULTS)
            ba = _attrs(n, EX_ATTR_DEFAULTS if n.op_type in EX_OPS else ATTR_DEFAULTS)
            diff = [f"{k}: {fa.get(k)!r} vs {ba.get(k)!r}" for k in _MUST_MATCH + tuple(
                EX_ATTR_DEFAULTS) if fa.get(k) != ba.get(k)]
            if cfgs[id(f)] != cfgs[id(n)][:4] + (cfgs[id(n)][4].skipping(),):
                diff.append(f"configuration (rnn_mode.direction.input_mode.layers): "
                            f"{overload_key(*cfgs[id(f)])!r} vs {overload_key(*cfgs[id(n)])!r}")
            if diff:
                raise ValueError(f"{n.op_type} {n.name!r} reads {name!r} of {f.op_type} "
                                 f"{f.name!r}, but their attributes or shapes differ: "
                                 + "; ".join(diff))


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` where every onnxgrad CudnnRNN-family node has its overload set and the
    model carries the matching FunctionProtos and imports the ``onnxgrad`` opset (version 1).
    A backward node reading the reserve_space of a forward node with other attributes or
    another configuration is a ValueError."""
    from . import params_ops
    m = onnx.ModelProto()
    m.CopyFrom(model)
    nodes = [n for n in walk_nodes(m.graph) if n.domain == DOMAIN and n.op_type in OPS]
    pnodes = [n for n in walk_nodes(m.graph) if n.domain == DOMAIN and n.op_type in PARAMS_OPS]
    if not nodes and not pnodes:
        return m
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < MIN_OPSET:
        raise ValueError(f"the CudnnRNN function bodies need ai.onnx opset >= {MIN_OPSET}, "
                         f"the model imports {opset}")
    dims = None if all(n.overload for n in nodes) else _static_dims(m)
    have = {(f.domain, f.name, f.overload) for f in m.functions}
    cfgs = {}
    for n in nodes:
        cfg = node_config(n, dims, with_variant=True)
        cfgs[id(n)] = cfg
        n.overload = overload_key(*cfg)
        if (DOMAIN, n.op_type, n.overload) not in have:
            m.functions.append(make_function(n.op_type, *cfg[:4], opset=opset, variant=cfg[4]))
            have.add((DOMAIN, n.op_type, n.overload))
    for n in pnodes:
        key, kw = params_ops.node_config(n, _attrs(n, {k: v for k, v in params_ops.ATTRS[
            n.op_type].items() if v is not None}))
        n.overload = key
        if (DOMAIN, n.op_type, key) not in have:
            m.functions.append(params_ops.make_params_function(n.op_type, opset=opset, **kw))
            have.add((DOMAIN, n.op_type, key))
    _check_pairs(m, nodes, cfgs)
    # a node may leave out trailing outputs, but onnx's inference of a function call needs
    # every output the function has: omitted ones come back as ""
    n_outs = {(f.domain, f.name, f.overload): len(f.output) for f in m.functions}
    for n in nodes + pnodes:
        n.output.extend([""] * (n_outs[(DOMAIN, n.op_type, n.overload)] - len(n.output)))
    if not any(o.domain == DOMAIN for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid(DOMAIN, VERSION))
    m.ir_version = max(m.ir_version, 10)  # FunctionProto.overload / NodeProto.overload
    return m


def make_node(op_type: str, inputs, outputs, **attrs) -> onnx.NodeProto:
    """A NodeProto of one of the ops in the onnxgrad domain (attributes as TF names them)."""
    if op_type not in OPS + PARAMS_OPS:
        raise ValueError(f"{op_type!r} is not one of {', '.join(OPS + PARAMS_OPS)}")
    return helper.make_node(op_type, inputs, outputs, domain=DOMAIN, **attrs)


#: TensorFlow's CudnnRNN ops that map one to one onto this domain's ops (same names)
TF_OPS = FORWARD_OPS + BACKWARD_OPS + PARAMS_OPS


def op_signature(op_type: str) -> dict:
    """TensorFlow's signature of one op of the family, as this domain implements it, for
    converters: ``{"inputs": [...], "outputs": [...], "attributes": {name: default or None
    (required)}, "variadic": {list name: count attribute(s)}}``. Names and order are TF's; a list
    (variadic) input or output appears once by name (``weights``, ``biases``) and is passed as
    that many consecutive node inputs/outputs. TF's type attributes are not ONNX attributes
    (tensor types carry them), except CudnnRNNParamsSize's ``T`` and ``S``, which hold ONNX
    TensorProto data types. ``is_training`` is an int (0/1)."""
    if op_type in PARAMS_OPS:
        ins = ["num_layers", "num_units", "input_size"]
        if op_type == "CudnnRNNParamsSize":
            io = (ins, ["params_size"])
        elif op_type.startswith("CudnnRNNParamsToCanonical"):
            io = (ins + ["params"], ["weights", "biases"])
        else:
            io = (ins + ["weights", "biases"], ["params"])
        var = {}
        if op_type != "CudnnRNNParamsSize":
            var = ({"weights": "num_params_weights", "biases": "num_params_biases"}
                   if op_type.endswith("V2") else {"weights": "num_params",
                                                   "biases": "num_params"})
        return {"inputs": io[0], "outputs": io[1], "attributes": dict(PARAMS_ATTRS[op_type]),
                "variadic": var}
    if op_type not in TF_OPS:
        raise ValueError(f"{op_type!r} is not one of {', '.join(TF_OPS)}")
    attrs = dict(FORWARD_ATTR_DEFAULTS if op_type in FORWARD_OPS else ATTR_DEFAULTS)
    attrs.pop("num_proj")  # TF has it on CudnnRNNV3 only (the functions accept 0)
    return {"inputs": op_inputs(op_type), "outputs": op_outputs(op_type), "attributes": attrs,
            "variadic": {}}


__all__ = ["attach_functions", "op_signature", "TF_OPS", "PARAMS_OPS", "make_function",
           "make_node", "node_config", "overload_key",
           "DOMAIN", "OPS", "FORWARD_OPS", "BACKWARD_OPS", "EX_OPS", "Variant"]
