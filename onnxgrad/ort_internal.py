"""onnxruntime's own ops in the ai.onnx domain, rewritten as the standard ops they compute.

onnxruntime's graph optimizer writes SimplifiedLayerNormalization (RMSNorm: Llama, T5, Mistral,
Qwen2, Gemma exported by torch.onnx's TorchScript exporter) and, in models below opset 17,
LayerNormalization into the ai.onnx domain when it saves an optimized model; no ONNX opset of the
model defines them, so onnx's checker refuses such a model. :func:`standard_forms` replaces each
with its computation in standard ops (onnxruntime's schema defaults; ``stash_type=1``, the default,
computes a float16 or bfloat16 input in float32, as the kernel does), so the model gradients()
works on, and the one it returns, is standard ONNX with the same forward values.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .errors import InvalidModelError
from .inference import _onnx_infer, graphs_of, model_opset, ort_internal, value_types
from .rules.spec import _ort_defaults

_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def standard_forms(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy in which every :func:`~onnxgrad.inference.ort_internal` node is
    replaced by standard ops."""
    opset = model_opset(model)
    if not any(ort_internal(n, opset) for g in graphs_of(model.graph) for n in g.node):
        return model
    m = onnx.ModelProto.FromString(model.SerializeToString())
    types = {k: t.tensor_type for k, t in value_types(graphs_of(_onnx_infer(m).graph)).items()}
    for g in graphs_of(m.graph):
        nodes = []
        for n in g.node:
            nodes += _expand(n, opset, types) if ort_internal(n, opset) else [n]
        del g.node[:]
        g.node.extend(nodes)
    return m


def _attrs(n: onnx.NodeProto) -> dict:
    out = {k: helper.get_attribute_value(a) for k, a in _ort_defaults("", n.op_type).items()}
    out.update((a.name, helper.get_attribute_value(a)) for a in n.attribute)
    return out


def _expand(n: onnx.NodeProto, opset: int, types: dict) -> list:
    """y = (x - mean) / sqrt(var + eps) * scale (+ B) over the axes from ``axis`` on; without
    the mean for SimplifiedLayerNormalization (mean(x^2) in place of var)."""
    a = _attrs(n)
    label = f"{n.op_type} node {n.name or n.output[0]!r}"
    x = types.get(n.input[0])
    if x is None or not x.elem_type:
        raise InvalidModelError(f"{label}: the type of its input {n.input[0]!r} is unknown")
    axis = a["axis"]
    if axis < 0:
        axes = list(range(axis, 0))
    elif x.HasField("shape"):
        axes = list(range(axis, len(x.shape.dim)))
    else:
        raise InvalidModelError(f"{label}: axis {axis} needs the rank of its input")
    dtype = TensorProto.FLOAT if a["stash_type"] == 1 and x.elem_type in _HALF else x.elem_type
    made, base = [], f"{n.name or n.output[0]}/"

    def op(op_type, *inputs, out=None, **kw):
        out = out or f"{base}{op_type}_{len(made)}"
        made.append(helper.make_node(op_type, list(inputs), [out], name=out, **kw))
        return out

    def mean(t):
        if opset < 18:
            return op("ReduceMean", t, axes=axes)
        return op("ReduceMean", t, op("Constant", value=helper.make_tensor(
            "axes", TensorProto.INT64, [len(axes)], axes)))

    t = n.input[0] if dtype == x.elem_type else op("Cast", n.input[0], to=dtype)
    simplified = n.op_type == "SimplifiedLayerNormalization"
    mu = None if simplified else mean(t)
    d = t if simplified else op("Sub", t, mu)
    eps = op("Constant", value=helper.make_tensor("eps", dtype, [], [a["epsilon"]]))
    inv = op("Reciprocal", op("Sqrt", op("Add", mean(op("Mul", d, d)), eps)))
    y = op("Mul", d, inv)
    if dtype != x.elem_type:
        y = op("Cast", y, to=x.elem_type)
    outs = list(n.output) + [""] * 3
    bias = n.input[2] if not simplified and len(n.input) > 2 and n.input[2] else None
    y = op("Mul", y, n.input[1], out=None if bias else outs[0])
    if bias:
        op("Add", y, bias, out=outs[0])
    stats = [inv] if simplified else [mu, inv]
    for out, s in zip(outs[1:], stats):
        if out:  # the statistics are float32 when the input is (onnxruntime's U)
            op("Cast", s, out=out, to=TensorProto.FLOAT)
    return made
