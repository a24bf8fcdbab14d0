"""ONNX function bodies of the params ops of the CudnnRNN family (domain ``onnxgrad``, version 1),
with TensorFlow's inputs, outputs, attribute names and defaults:

* ``CudnnRNNParamsSize(num_layers, num_units, input_size) -> params_size``
* ``CudnnRNNParamsToCanonical(num_layers, num_units, input_size, params)
  -> weights[num_params], biases[num_params]``
* ``CudnnRNNParamsToCanonicalV2(...same...) -> weights[num_params_weights],
  biases[num_params_biases]``
* ``CudnnRNNCanonicalToParams(num_layers, num_units, input_size, weights[num_params],
  biases[num_params]) -> params``
* ``CudnnRNNCanonicalToParamsV2(..., weights[num_params_weights], biases[num_params_biases])
  -> params``

num_layers, num_units and input_size are int32 scalars (shape [] or [1]), read **at run time**:
the bodies compute sizes and slice offsets with Shape-free integer arithmetic on them, so they
need not be constants. What fixes a body's structure is static and comes from attributes:
rnn_mode, direction, and for the list ops the list lengths (``num_params`` or
``num_params_weights`` / ``num_params_biases``, else the node's input/output counts), which give
num_layers L (biases = 2 * G * num_dirs * L) and the input mode (weights = 2 * G * num_dirs * L
for linear_input, (2 * L - 1) * G * num_dirs for skip_input, whose first-layer input matrices are
absent; auto_select is resolved by that count; V1 has equal counts, so linear_input only). The
run-time num_layers must equal that L, and params (resp. the concatenated weights and biases)
must have CudnnRNNParamsSize elements: otherwise the body's Reshape named
``params_must_have_CudnnRNNParamsSize_elements_and_num_layers_must_match_the_list_lengths``
(resp. ``weights_and_biases_must_have_...``) fails. CanonicalToParams checks the total only,
not each tensor's size (TF checks each); any shapes are accepted, as TF does.

ParamsSize's output is ``[1]`` (TF's shape), the number of **elements** (TF divides its byte
count by sizeof(T)), of ONNX type ``S``. TF's type attributes become int attributes holding
ONNX ``TensorProto`` data types: ``S`` (default INT32 = 6, TF's own choice in
cudnn_rnn_ops.py) and ``T`` (accepted and ignored: the count in elements does not depend on it;
default FLOAT = 1). The list ops have no ``T``: their tensors carry it. ``auto_select`` is
resolved at run time by ParamsSize (skip_input when input_size == num_units).
dropout, seed, seed2 are accepted and unused (as in TF); num_proj must be 0.

Overloads: ParamsSize ``"<rnn_mode>.<direction>.<input_mode>"`` (input_mode as given), the list
ops ``"<rnn_mode>.<direction>.<resolved input_mode>.L<num_layers>"``.

Gradients (:mod:`onnxgrad.rnn.grad`): CanonicalToParams and ParamsToCanonical are each other's
(linear rearrangements, as TF registers them); ParamsSize is integer-valued and has none.
"""
from __future__ import annotations

import itertools

import onnx
from onnx import helper

from .params import GATES, layout_coefficients, num_dirs, num_gates

PARAMS_OPS = ("CudnnRNNParamsSize", "CudnnRNNParamsToCanonical", "CudnnRNNParamsToCanonicalV2",
              "CudnnRNNCanonicalToParams", "CudnnRNNCanonicalToParamsV2")
#: an attribute without a default (TF requires it; here it may be inferred from list lengths)
REQUIRED = None
_COMMON = {"rnn_mode": "lstm", "input_mode": "linear_input", "direction": "unidirectional",
           "dropout": 0.0, "seed": 0, "seed2": 0}
ATTRS = {
    "CudnnRNNParamsSize": {"T": onnx.TensorProto.FLOAT, "S": onnx.TensorProto.INT32,
                           **_COMMON, "num_proj": 0},
    "CudnnRNNParamsToCanonical": {"num_params": REQUIRED, **_COMMON},
    "CudnnRNNParamsToCanonicalV2": {"num_params_weights": REQUIRED,
                                    "num_params_biases": REQUIRED, **_COMMON, "num_proj": 0},
    "CudnnRNNCanonicalToParams": {"num_params": REQUIRED, **_COMMON},
    "CudnnRNNCanonicalToParamsV2": {"num_params_weights": REQUIRED,
                                    "num_params_biases": REQUIRED, **_COMMON, "num_proj": 0},
}
SIZES = ["num_layers", "num_units", "input_size"]


def list_names(nw: int, nb: int) -> list[str]:
    return [f"weights_{i}" for i in range(nw)] + [f"biases_{i}" for i in range(nb)]


def op_io(op_type: str, nw: int = 0, nb: int = 0) -> tuple[list[str], list[str]]:
    """Formal (inputs, outputs) of one params op for list lengths nw, nb."""
    if op_type == "CudnnRNNParamsSize":
        return list(SIZES), ["params_size"]
    if op_type.startswith("CudnnRNNParamsToCanonical"):
        return SIZES + ["params"], list_names(nw, nb)
    return SIZES + list_names(nw, nb), ["params"]


def list_config(rnn_mode: str, direction: str, input_mode: str, nw: int, nb: int,
                what: str = "") -> tuple[str, int]:
    """(resolved input_mode, num_layers) from the list lengths."""
    per = num_gates(rnn_mode) * num_dirs(direction)
    if nb < 2 * per or nb % (2 * per):
        raise ValueError(f"{what}{nb} biases: a {rnn_mode} {direction} model has "
                         f"2 * {per} per layer")
    L = nb // (2 * per)
    modes = {2 * per * L: "linear_input", (2 * L - 1) * per: "skip_input"}
    if nw not in modes or input_mode not in ("auto_select", modes[nw]):
        raise ValueError(f"{what}{nw} weights with {nb} biases: a {L}-layer {rnn_mode} "
                         f"{direction} model with input_mode={input_mode!r} has "
                         + (f"{2 * per * L} (linear_input)" if input_mode != "skip_input"
                            else "") + (" or " if input_mode == "auto_select" else "")
                         + (f"{(2 * L - 1) * per} (skip_input)" if input_mode != "linear_input"
                            else ""))
    return modes[nw], L


def node_counts(op_type: str, attrs: dict, n_inputs: int, n_outputs: int,
                what: str = "") -> tuple[int, int]:
    """(num weights, num biases) of a list op node: its count attributes, or its list lengths."""
    total = n_outputs if op_type.startswith("CudnnRNNParamsToCanonical") else n_inputs - 3
    if op_type.endswith("V2"):
        nw, nb = attrs.get("num_params_weights"), attrs.get("num_params_biases")
        if nw is None and nb is None:
            raise ValueError(f"{what}set num_params_weights and num_params_biases")
        nw = total - nb if nw is None else nw
        nb = total - nw if nb is None else nb
    else:
        nw = nb = attrs.get("num_params") if attrs.get("num_params") is not None else total // 2
    if nw + nb != total:
        kind = "outputs" if op_type.startswith("CudnnRNNParamsToCanonical") else "list inputs"
        raise ValueError(f"{what}{nw} weights and {nb} biases but {total} {kind}")
    return nw, nb


def overload(op_type, rnn_mode, direction, input_mode, L=None) -> str:
    if op_type == "CudnnRNNParamsSize":
        return f"{rnn_mode}.{direction}.{input_mode}"
    return f"{rnn_mode}.{direction}.{input_mode}.L{L}"


def _scalar(b, name):
    return b.Reshape(b.Cast(name, to=onnx.TensorProto.INT64), b.ints(1))


def _size_expr(b, rnn_mode, direction, input_mode, L, H, I):
    """CudnnRNNParamsSize in elements, [1] int64: G * nd * (lin * H * I + H * H
    + (L - 1) * (nd + 1) * H * H + 2 * L * H), lin = 0 for skip_input."""
    G, nd = num_gates(rnn_mode), num_dirs(direction)
    HH = b.Mul(H, H)
    if input_mode == "linear_input":
        lin = b.ints(1)
    elif input_mode == "skip_input":
        lin = b.ints(0)
    else:  # auto_select: TF picks skip_input when input_size == num_units
        lin = b.Cast(b.Not(b.Equal(I, H)), to=onnx.TensorProto.INT64)
    per_layer = b.Mul(b.ints(nd + 1), HH)
    inner = b.Add(b.Add(b.Mul(lin, b.Mul(H, I)), HH),
                  b.Add(b.Mul(b.Sub(L, b.ints(1)), per_layer), b.Mul(b.Mul(b.ints(2), L), H)))
    return b.Mul(b.ints(G * nd), inner)


class _SizeDims:
    """_Dims of ops.py for sizes given as values: H, I as [1] int64."""

    def __init__(self, b, H, I):  # noqa: E741
        from .ops import _Dims
        self.b, self.H, self.I = b, H, I
        self.HI, self.HH = b.Mul(H, I), b.Mul(H, H)
        self._muls = {}
        self.mul = _Dims.mul.__get__(self)
        self.poly = _Dims.poly.__get__(self)


def _check(b, n, L, rnn_mode, direction, input_mode, H, I, flat, what):
    bad = b.Abs(b.Sub(_scalar(b, "num_layers"), b.ints(L)))
    total = _size_expr(b, rnn_mode, direction, input_mode, b.ints(L), H, I)
    return b.op("Reshape", flat, b.Add(total, bad),
                name=f"{what}_must_have_CudnnRNNParamsSize_elements_and_num_layers_must_match_"
                     "the_list_lengths", **n)


def _to_canonical(b, rnn_mode, direction, input_mode, L, nw, nb):
    H, I = _scalar(b, "num_units"), _scalar(b, "input_size")  # noqa: E741
    params = _check(b, {}, L, rnn_mode, direction, input_mode, H, I, "params", "params")
    dm = _SizeDims(b, H, I)
    G, nd = num_gates(rnn_mode), num_dirs(direction)
    blocks, _ = layout_coefficients(rnn_mode, L, direction, input_mode)
    outs = iter(list_names(nw, nb))

    def cut(start, size, k, shape):
        s = tuple(a + k * c for a, c in zip(start, size))
        e = tuple(a + c for a, c in zip(s, size))
        flat = b.Slice(params, dm.poly(s), dm.poly(e), b.ints(0))
        name = next(outs)
        if shape is None:
            return b.Identity(flat, out=name)
        return b.Reshape(flat, shape, out=name)

    nd_h = dm.mul(nd, H)
    for layer in range(L):
        for d in range(nd):
            wx, rh, _, _ = blocks[(layer, d)]
            if wx is not None:
                size, width = ((1, 0, 0), I) if layer == 0 else ((0, nd, 0), nd_h)
                shape = b.Concat(H, width, axis=0)
                for k in range(G):
                    cut(wx, size, k, shape)
            shape = b.Concat(H, H, axis=0)
            for k in range(G):
                cut(rh, (0, 1, 0), k, shape)
    for layer in range(L):
        for d in range(nd):
            _, _, bx, bh = blocks[(layer, d)]
            for start in (bx, bh):
                for k in range(G):
                    cut(start, (0, 0, 1), k, None)


def _to_params(b, rnn_mode, direction, input_mode, L, nw, nb):
    H, I = _scalar(b, "num_units"), _scalar(b, "input_size")  # noqa: E741
    flat = b.Concat(*[b.Reshape(v, b.ints(-1)) for v in list_names(nw, nb)], axis=0)
    _check(b, {"out": "params"}, L, rnn_mode, direction, input_mode, H, I, flat,
           "weights_and_biases")


def make_params_function(op_type: str, rnn_mode: str = "lstm",
                         direction: str = "unidirectional", input_mode: str = "linear_input",
                         num_layers: int | None = None, opset: int = 18, nw: int = 0,
                         nb: int = 0) -> onnx.FunctionProto:
    """The FunctionProto of one params op for one configuration (see the module doc)."""
    from .ops import _B
    if op_type not in PARAMS_OPS:
        raise ValueError(f"{op_type!r} is not one of {', '.join(PARAMS_OPS)}")
    if rnn_mode not in GATES:
        raise ValueError(f"rnn_mode={rnn_mode!r} is not one of {', '.join(GATES)}")
    num_dirs(direction)
    b = _B(itertools.count(), opset)
    if op_type == "CudnnRNNParamsSize":
        size = _size_expr(b, rnn_mode, direction, input_mode, _scalar(b, "num_layers"),
                          _scalar(b, "num_units"), _scalar(b, "input_size"))
        cast = helper.make_node("Cast", [size], ["params_size"])
        cast.attribute.append(onnx.AttributeProto(name="to", ref_attr_name="S",
                                                  type=onnx.AttributeProto.INT))
        b.nodes.append(cast)
    else:
        got = list_config(rnn_mode, direction, input_mode, nw, nb)
        if got != (input_mode, num_layers):
            raise ValueError(f"{op_type}: {nw} weights and {nb} biases mean {got}, not "
                             f"{(input_mode, num_layers)}")
        body = _to_canonical if op_type.startswith("CudnnRNNParamsToCanonical") else _to_params
        body(b, rnn_mode, direction, input_mode, num_layers, nw, nb)
    ins, outs = op_io(op_type, nw, nb)
    attrs = ATTRS[op_type]
    f = helper.make_function(
        "onnxgrad", op_type, ins, outs, b.nodes, [helper.make_opsetid("", opset)],
        attributes=[k for k, v in attrs.items() if v is REQUIRED],
        attribute_protos=[helper.make_attribute(k, v) for k, v in attrs.items()
                          if v is not REQUIRED],
        doc_string=f"onnxgrad {op_type} ({rnn_mode}, {direction}, {input_mode}"
                   + ("" if num_layers is None else f", {num_layers} layers")
                   + "); see onnxgrad.rnn.params_ops")
    f.overload = overload(op_type, rnn_mode, direction, input_mode, num_layers)
    return f


def node_config(node: onnx.NodeProto, attrs: dict):
    """(overload key, make_params_function kwargs) of one params op node; validates it."""
    op = node.op_type
    what = f"{op} {node.name!r}: "
    rnn_mode, direction, input_mode = attrs["rnn_mode"], attrs["direction"], attrs["input_mode"]
    num_gates(rnn_mode)
    num_dirs(direction)
    if input_mode not in ("linear_input", "skip_input", "auto_select"):
        raise ValueError(f"{what}input_mode={input_mode!r}")
    if attrs.get("num_proj"):
        raise NotImplementedError(f"{what}num_proj={attrs['num_proj']} is not supported (only 0)")
    if op == "CudnnRNNParamsSize":
        kw = dict(rnn_mode=rnn_mode, direction=direction, input_mode=input_mode)
        return overload(op, rnn_mode, direction, input_mode), kw
    nw, nb = node_counts(op, attrs, len(node.input), len(node.output), what)
    input_mode, L = list_config(rnn_mode, direction, input_mode, nw, nb, what)
    kw = dict(rnn_mode=rnn_mode, direction=direction, input_mode=input_mode, num_layers=L,
              nw=nw, nb=nb)
    key = overload(op, rnn_mode, direction, input_mode, L)
    if node.overload and node.overload != key:
        raise ValueError(f"{what}overload {node.overload!r} does not match {key!r}")
    return key, kw
