"""Gradient rules of the forward CudnnRNN ops (domain ``onnxgrad``), as TensorFlow registers them:
CudnnRNN -> CudnnRNNBackprop, CudnnRNNV2 -> CudnnRNNBackpropV2 (the V1 forward has no
host_reserved output to feed the V2 backward). The backward node reuses the forward's
reserve_space (and host_reserved), so nothing is recomputed; outputs without an incoming gradient
get zeros, as TF's gradients() gives them.

The emitted node carries the forward's overload (when set); ``onnxgrad.rnn.ops.attach_functions``
adds the function bodies to the model that gradients() returns.
"""
from __future__ import annotations

from ..registry import functions_for, register
from .ops import ATTR_DEFAULTS, DOMAIN, attach_functions

functions_for(DOMAIN, attach_functions)

_BACKWARD = {"CudnnRNN": "CudnnRNNBackprop", "CudnnRNNV2": "CudnnRNNBackpropV2"}


@register(["CudnnRNN", "CudnnRNNV2"], domain=DOMAIN)
def _cudnn_rnn(n, g):
    op = n.node.op_type
    if not n.attr("is_training", 1):
        raise ValueError(f"To use {op} in gradients, is_training must be set to True.")
    e = n.e
    outs = n.outs
    dt = n.ins[0].dtype  # outputs that are not graph outputs may carry no type
    gs = [n.gs[i] if n.gs[i] is not None else e.fill_like(outs[i], 0, dt) for i in range(3)]
    ins = list(n.ins[:4]) + [outs[0], outs[1], outs[2]] + gs + [outs[3]]
    if op == "CudnnRNNV2":
        ins.append(outs[4])
    attrs = {k: n.attr(k, d) for k, d in ATTR_DEFAULTS.items() if k != "num_proj"}
    if n.attr("num_proj", 0):
        attrs["num_proj"] = n.attr("num_proj")
    dtypes = [n.ins[0].dtype, n.ins[1].dtype, n.ins[2].dtype, n.ins[3].dtype]
    res = e.op(_BACKWARD[op], *ins, _outputs=4, _domain=DOMAIN, _dtype=dtypes, **attrs)
    res[0].value.producer().overload = n.node.overload
    return tuple(r.with_shape(x.shape) for r, x in zip(res, n.ins[:4]))

from . import onnx_rnn as _onnx_rnn  # noqa: E402,F401  (ai.onnx LSTM, GRU, RNN)
