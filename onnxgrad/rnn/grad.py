"""Gradient rules of the forward CudnnRNN ops (domain ``onnxgrad``), as TensorFlow registers them:
CudnnRNN -> CudnnRNNBackprop, CudnnRNNV2 -> CudnnRNNBackpropV2 (the V1 forward has no
host_reserved output to feed the V2 backward). The backward node reuses the forward's
reserve_space (and host_reserved), so nothing is recomputed; outputs without an incoming gradient
get zeros, as TF's gradients() gives them. When the input's (the params') gradient is not
needed, the node leaves input_backprop (params_backprop) unnamed and gets the ``.nodx``
(``.nodp``) body, which does not compute it.

The emitted node carries the forward's overload (when set); ``onnxgrad.rnn.ops.attach_functions``
adds the function bodies to the model that gradients() returns.
"""
from __future__ import annotations

from ..registry import functions_for, register
from .ops import ATTR_DEFAULTS, DOMAIN, EX_ATTR_DEFAULTS, MIN_OPSET, attach_functions

functions_for(DOMAIN, attach_functions)

_BACKWARD = {"CudnnRNN": "CudnnRNNBackprop", "CudnnRNNV2": "CudnnRNNBackpropV2",
             "OnnxRNN": "OnnxRNNBackprop"}


@register(["CudnnRNN", "CudnnRNNV2", "OnnxRNN"], domain=DOMAIN)
def _cudnn_rnn(n, g):
    op = n.node.op_type
    ex = op == "OnnxRNN"  # (in a model: TF's CudnnRNNV3, sequence_lengths, converted to it)
    if not ex and not n.attr("is_training", 1):
        raise ValueError(f"To use {op} in gradients, is_training must be set to True.")
    if n.gs[3] is not None:  # (host_reserved is int8: it never has one)
        # the backward's workspace: as TF, the rule reads no gradient of it, so where one
        # arrives (a graph that computes with it) the call is refused, never dropped silently
        raise NotImplementedError(
            "reserve_space is the workspace the backward op reads, not a value with a gradient "
            "(TensorFlow ignores one); pass it in stop_gradients if nothing should flow there")
    e = n.e
    e.need(MIN_OPSET)  # the opset of the backward op's body
    outs = n.outs
    dt = n.ins[0].dtype  # outputs that are not graph outputs may carry no type
    gs = [n.gs[i] if n.gs[i] is not None else e.fill_like(outs[i], 0, dt) for i in range(3)]
    ins = list(n.ins[:4]) + [outs[0], outs[1], outs[2]] + gs + [outs[3]]
    if op == "CudnnRNNV2":
        ins.append(outs[4])
    peep = ex and n.input(4) is not None
    if ex:  # peepholes, sequence_lens
        ins += [n.input(4), n.input(5)]
        attrs = {k: n.attr(k, d) for k, d in EX_ATTR_DEFAULTS.items()}
    else:
        attrs = {k: n.attr(k, d) for k, d in ATTR_DEFAULTS.items() if k != "num_proj"}
        if n.attr("num_proj", 0):
            attrs["num_proj"] = n.attr("num_proj")
    n_out = 5 if peep else 4
    dtypes = [n.ins[0].dtype, n.ins[1].dtype, n.ins[2].dtype, n.ins[3].dtype] + [dt] * peep
    res = e.op(_BACKWARD[op], *ins, _outputs=n_out, _domain=DOMAIN, _dtype=dtypes, **attrs)
    res[0].value.producer().overload = n.node.overload
    grads = [r.with_shape(x.shape) for r, x in zip(res, n.ins[:4])]
    for k in (0, 3):  # an unnamed input_backprop / params_backprop: the body skips it
        if not n.wants(n.node.inputs[k]):
            res[k].value.name, grads[k] = "", None
    if peep:
        grads.append(res[4].with_shape(n.input(4).shape))
    return tuple(grads)

from . import onnx_rnn as _onnx_rnn  # noqa: E402,F401  (ai.onnx LSTM, GRU, RNN)


# -- the params ops: CanonicalToParams and ParamsToCanonical are each other's gradient ----------
from .params_ops import ATTRS as _PARAMS_ATTRS  # noqa: E402
from .params_ops import node_counts as _node_counts  # noqa: E402

_TRANSPOSE = {"CudnnRNNCanonicalToParams": "CudnnRNNParamsToCanonical",
              "CudnnRNNCanonicalToParamsV2": "CudnnRNNParamsToCanonicalV2",
              "CudnnRNNParamsToCanonical": "CudnnRNNCanonicalToParams",
              "CudnnRNNParamsToCanonicalV2": "CudnnRNNCanonicalToParamsV2"}


def _params_attrs(n):
    op = n.node.op_type
    attrs = {k: n.attr(k, d) for k, d in _PARAMS_ATTRS[op].items()}
    nw, nb = _node_counts(op, attrs, len(n.node.inputs), len(n.node.outputs),
                          f"{op} {n.node.name!r}: ")
    if op.endswith("V2"):
        attrs.update(num_params_weights=nw, num_params_biases=nb)
    else:
        attrs["num_params"] = nw
    return attrs, nw, nb


@register(["CudnnRNNCanonicalToParams", "CudnnRNNCanonicalToParamsV2"], domain=DOMAIN)
def _canonical_to_params(n, g):
    """d weights/biases: ParamsToCanonical of d params, reshaped to each input's shape."""
    e = n.e
    e.need(MIN_OPSET)
    attrs, nw, nb = _params_attrs(n)
    lists = n.ins[3:]
    dt = lists[0].dtype
    outs = e.op(_TRANSPOSE[n.node.op_type], *n.ins[:3], g, _outputs=nw + nb, _domain=DOMAIN,
                _dtype=[dt] * (nw + nb), **attrs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs[0].value.producer().overload = n.node.overload
    return (None, None, None) + tuple(e.Reshape(o, e.Shape(x)).with_shape(x.shape)
                                      for o, x in zip(outs, lists))


@register(["CudnnRNNParamsToCanonical", "CudnnRNNParamsToCanonicalV2"], domain=DOMAIN)
def _params_to_canonical(n, g):
    """d params: CanonicalToParams of the cotangents (zeros for outputs without one)."""
    e = n.e
    e.need(MIN_OPSET)
    attrs, nw, nb = _params_attrs(n)
    dt = n.ins[3].dtype
    gs = [n.gs[i] if n.gs[i] is not None else e.fill_like(n.outs[i], 0, dt)
          for i in range(nw + nb)]
    res = e.op(_TRANSPOSE[n.node.op_type], *n.ins[:3], *gs, _domain=DOMAIN, _dtype=dt, **attrs)
    res.value.producer().overload = n.node.overload
    return None, None, None, res.with_shape(n.ins[3].shape)
