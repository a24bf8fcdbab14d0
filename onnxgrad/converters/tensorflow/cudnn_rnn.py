"""TF's CudnnRNN family -> onnxgrad's custom ops of the same names (domain ``onnxgrad``), one to
one: same inputs, outputs and attributes (:func:`onnxgrad.rnn.ops.op_signature`). The models
carry the ops' function bodies, so they run on any onnxruntime, where TF itself has no CPU kernel.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

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


@handler("CudnnRNNV3")
def _cudnn_rnn_v3(c: Converter, n: TFNode):
    """CudnnRNNV3 (what Keras's LSTM and GRU trace on a GPU): per-batch ``sequence_lengths`` and
    a batch-major layout. onnxgrad's OnnxRNN with sequence_lens has cuDNN's masked semantics (a
    padded step outputs 0 and carries the state; the backward direction starts at each entry's
    last step) on the same params buffer, so it is that op between Transposes; its gradient is
    OnnxRNNBackprop. Batch-major (``time_major=False``) states are [batch, layers * dirs,
    units], as cuDNN takes them."""
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
    x, h, cc, params, lens = (c.x(n, i) for i in range(5))
    batch_major = not a["time_major"]
    if batch_major:  # [B, T, I] -> [T, B, I]; states [B, L * D, H] -> [L * D, B, H]
        x, h = (c.op("Transpose", [v], perm=[1, 0, 2]) for v in (x, h))
        if a["rnn_mode"] == "lstm":
            cc = c.op("Transpose", [cc], perm=[1, 0, 2])
    if a["rnn_mode"] != "lstm":  # input_c is not read (Keras's GRU passes a scalar 0)
        cc = h
    lens64 = c.op("Cast", [lens], to=TensorProto.INT64)
    y, hn, cn, reserve = c.op("OnnxRNN", [x, h, cc, params, "", lens64], n_out=4, domain=DOMAIN,
                              rnn_mode=a["rnn_mode"], input_mode=a["input_mode"],
                              direction=a["direction"], linear_before_reset=1)
    if batch_major:
        y, hn, cn = (c.op("Transpose", [v], perm=[1, 0, 2]) for v in (y, hn, cn))
    # host_reserved: read only by CudnnRNNBackpropV3 (refused below)
    return [y, hn, cn, reserve, c.const(np.zeros([0], np.int8))]


@handler("CudnnRNNBackpropV3")
def _cudnn_rnn_backprop_v3(c: Converter, n: TFNode):
    raise ConversionError(f"{n}: {n.op} (the gradient op of a TF tape graph through "
                          "CudnnRNNV3) has no onnxgrad op; convert the forward model and take "
                          "its gradients with onnxgrad.gradients, which differentiates the "
                          "converted CudnnRNNV3")
