"""TF's CudnnRNN family -> onnxgrad's custom ops of the same names (domain ``onnxgrad``), one to
one: same inputs, outputs and attributes (:func:`onnxgrad.rnn.ops.op_signature`). The models
carry the ops' function bodies, so they run on any onnxruntime, where TF itself has no CPU kernel.
"""
from __future__ import annotations

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


@handler("CudnnRNNV3", "CudnnRNNBackpropV3")
def _cudnn_rnn_v3(c: Converter, n: TFNode):
    raise ConversionError(f"{n}: {n.op} (sequence_lengths, batch-major layout, projections) has "
                          "no onnxgrad op yet; CudnnRNN and CudnnRNNV2 (time-major, full "
                          "lengths) are supported")
