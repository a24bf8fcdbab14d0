"""TF's CudnnRNN family -> onnxgrad's custom ops of the same names (domain ``onnxgrad``), one to
one: same inputs, outputs and attributes (:func:`onnxgrad.rnn.ops.op_signature`). The models
carry the ops' function bodies, so they run on any onnxruntime, where TF itself has no CPU kernel.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ...rnn.ops import DOMAIN, TF_OPS, op_signature
from .core import Converter, handler, onnx_dtype
from .errors import ConversionError
from .graph import TFNode

TYPE_ATTRS = ("T", "S")  # CudnnRNNParamsSize's dtypes: ONNX data types in the custom op


def _attrs(c: Converter, n: TFNode, sig: dict) -> dict:
    out = {}
    for k, default in sig["attributes"].items():
        if k not in n.attr:
            if default is None:
                raise ConversionError(f"{n} has no attribute {k!r}, which {n.op} needs")
            continue
        if k in TYPE_ATTRS:
            out[k] = onnx_dtype(n.attr[k].type, n)
        else:
            v = c.attr(n, k)
            out[k] = int(v) if isinstance(v, bool) else v
    if "num_proj" in n.attr and c.attr(n, "num_proj"):
        raise ConversionError(f"{n}: num_proj={c.attr(n, 'num_proj')} (projection LSTMs) is not "
                              "supported by onnxgrad's CudnnRNN ops")
    return out


@handler(*TF_OPS)
def _cudnn_rnn(c: Converter, n: TFNode):
    sig = op_signature(n.op)
    attrs = _attrs(c, n, sig)
    n_out = sum(attrs.get(sig["variadic"][o], 0) if o in sig["variadic"] else 1
                for o in sig["outputs"])
    outs = c.op(n.op, [c.x(n, i) for i in range(len(n.inputs))], n_out=n_out, domain=DOMAIN,
                **attrs)
    return [outs] if isinstance(outs, str) else outs


def _v3_attrs(c: Converter, n: TFNode) -> dict:
    """CudnnRNNV3's / CudnnRNNBackpropV3's attributes, with TF's defaults; projection LSTMs and
    dropout between layers in training refused."""
    a = {k: c.attr(n, k, d) for k, d in (("rnn_mode", "lstm"), ("input_mode", "linear_input"),
                                         ("direction", "unidirectional"), ("dropout", 0.0),
                                         ("num_proj", 0), ("is_training", True),
                                         ("time_major", True))}
    if a["num_proj"]:
        raise ConversionError(f"{n}: num_proj={a['num_proj']} (projection LSTMs) is not "
                              "supported by onnxgrad's CudnnRNN ops")
    if a["dropout"] and a["is_training"]:
        raise ConversionError(f"{n}: dropout={a['dropout']} between layers in training is not "
                              "supported with sequence_lengths (CudnnRNNV2 has it; a one-layer "
                              "or inference node has none: set is_training=False)")
    return a


def _time_major(c: Converter, vs):
    """[B, T, *] <-> [T, B, *] (a batch-major node's tensors and states)."""
    return [c.op("Transpose", [v], perm=[1, 0, 2]) for v in vs]


def _zeros_like(c: Converter, n: TFNode, v: str) -> str:
    dtype = helper.tensor_dtype_to_np_dtype(onnx_dtype(n.attr["T"].type, n))
    return c.zeros(c.op("Shape", [v]), dtype)


def _ex_attrs(a: dict) -> dict:
    return dict(rnn_mode=a["rnn_mode"], input_mode=a["input_mode"], direction=a["direction"],
                linear_before_reset=1)


@handler("CudnnRNNV3")
def _cudnn_rnn_v3(c: Converter, n: TFNode):
    """CudnnRNNV3 (what Keras's LSTM and GRU trace on a GPU): per-batch ``sequence_lengths`` and
    a batch-major layout. onnxgrad's OnnxRNN with sequence_lens has cuDNN's masked semantics (a
    padded step outputs 0 and carries the state; the backward direction starts at each entry's
    last step) on the same params buffer, so it is that op between Transposes; its gradient is
    OnnxRNNBackprop. Batch-major (``time_major=False``) states are [batch, layers * dirs,
    units], as cuDNN takes them."""
    a = _v3_attrs(c, n)
    x, h, cc, params, lens = (c.x(n, i) for i in range(5))
    batch_major = not a["time_major"]
    if batch_major:  # [B, T, I] -> [T, B, I]; states [B, L * D, H] -> [L * D, B, H]
        x, h = _time_major(c, (x, h))
        if a["rnn_mode"] == "lstm":
            (cc,) = _time_major(c, (cc,))
    if a["rnn_mode"] != "lstm":  # input_c is not read (Keras's GRU passes a scalar 0)
        cc = h
    lens64 = c.op("Cast", [lens], to=TensorProto.INT64)
    y, hn, cn, reserve = c.op("OnnxRNN", [x, h, cc, params, "", lens64], n_out=4, domain=DOMAIN,
                              **_ex_attrs(a))
    if batch_major:
        y, hn, cn = _time_major(c, (y, hn, cn))
    # host_reserved: read by CudnnRNNBackpropV3, which the reserve_space alone serves here
    return [y, hn, cn, reserve, c.const(np.zeros([0], np.int8))]


@handler("CudnnRNNBackpropV3")
def _cudnn_rnn_backprop_v3(c: Converter, n: TFNode):
    """TF's gradient op of CudnnRNNV3 (a tape or tf.gradients graph through a Keras LSTM / GRU
    traced on a GPU): OnnxRNNBackprop with the same sequence_lens, reading the reserve_space
    the converted CudnnRNNV3 (OnnxRNN) wrote, between the same Transposes. For other modes than
    LSTM the cell state is not read, and its gradient is zeros of input_c's shape."""
    a = _v3_attrs(c, n)
    lstm = a["rnn_mode"] == "lstm"
    (x, h, cc, params, lens, y, hn, cn, dy, dhn, dcn, reserve) = (c.x(n, i) for i in range(12))
    input_c = cc
    if not a["time_major"]:
        x, h, y, hn, dy, dhn = _time_major(c, (x, h, y, hn, dy, dhn))
        if lstm:
            cc, cn, dcn = _time_major(c, (cc, cn, dcn))
    if not lstm:  # as the forward: input_c is h; the cell state's values are not read
        cc = cn = h
        dcn = _zeros_like(c, n, h)
    lens64 = c.op("Cast", [lens], to=TensorProto.INT64)
    dx, dh, dc, dp = c.op("OnnxRNNBackprop", [x, h, cc, params, y, hn, cn, dy, dhn, dcn, reserve,
                                              "", lens64], n_out=4, domain=DOMAIN,
                          **_ex_attrs(a))
    if not a["time_major"]:
        dx, dh = _time_major(c, (dx, dh))
        if lstm:
            (dc,) = _time_major(c, (dc,))
    if not lstm:
        dc = _zeros_like(c, n, input_c)
    return [dx, dh, dc, dp]
