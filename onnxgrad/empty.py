"""Gradient values with no elements, made from constants.

onnxruntime's graph optimizers treat a broadcast to a zero-size dim as no broadcast: its
ExpandElimination drops an Expand whose constant target has 0 where the input has 1, and its
NoopElimination drops an Add/Sub/Mul/Div whose constant operand has no elements. A gradient
that meets a statically empty tensor (a Slice that selects nothing: the sum it feeds is 0,
its gradient an empty Expand) then comes out with a 1 where the dim is 0 (found by
bench/fuzz.py: x of shape [20, 10, 5] got a gradient of shape [20, 11, 5]). An empty tensor is
known by its type alone, so each added node whose results onnx's inference proves empty
makes them as an empty constant times a scalar: nothing is left for the optimizers to
broadcast, and the scalar (the sum of the node's float inputs) keeps the paths through it."""
from __future__ import annotations

import onnx
import onnx_ir as ir

from .inference import FLOAT_TYPES, _dims, infer_shapes, unique_name
from .validation import node_reads


def has_empty(graph: ir.Graph, nodes) -> bool:
    """Whether an input, initializer or result of ``nodes`` in ``graph`` has a static 0 dim."""
    for values in (graph.inputs, graph.initializers.values(),
                   (v for node in nodes for v in node.outputs)):
        for v in values:
            s = v.shape
            if s is not None and any(d == 0 for d in s.dims if type(d) is int):
                return True
    return False


def _empty_type(t: onnx.TypeProto | None):
    """(elem_type, dims) of a tensor type with static dims, one of them 0; else None."""
    if t is None or not t.HasField("tensor_type"):
        return None
    elem, ds = _dims(t)
    if ds is None or not all(isinstance(d, int) for d in ds) or all(ds):
        return None
    return elem, ds


def empty_as_constants(model: onnx.ModelProto, added: set[str]) -> onnx.ModelProto:
    """``model`` with each added node (main graph; ``added``: the names of their results)
    whose results are all statically empty replaced by constants, and the added nodes this
    leaves unused removed."""
    typed = infer_shapes(model, data_prop=True)
    g = model.graph
    types = {v.name: v.type for v in (*typed.graph.value_info, *g.input, *typed.graph.output)}
    elems = {t.name: t.data_type for t in g.initializer}
    elems.update((k, t.tensor_type.elem_type) for k, t in types.items()
                 if t.HasField("tensor_type"))
    taken = {o for n in g.node for o in n.output} | {n.name for n in g.node} | set(types)
    taken |= {t.name for t in g.initializer}
    nodes = []
    for n in g.node:
        empty = [_empty_type(types.get(o)) for o in n.output] if n.output and \
            n.output[0] in added and n.op_type != "Constant" else [None]
        if None in empty:
            nodes.append(n)
            continue
        for o, (elem, shape) in zip(n.output, empty):
            nodes += _empty(n, o, elem, shape, elems, taken)
    read = {o.name for o in g.output}
    kept = []
    for n in reversed(nodes):  # consumers before producers: a chain goes at once
        if n.output and n.output[0] in added and not read.intersection(n.output):
            continue
        kept.append(n)
        read.update(node_reads(n))
    del g.node[:]
    g.node.extend(reversed(kept))
    return model


def _empty(n: onnx.NodeProto, o: str, elem: int, shape: list, elems: dict, taken: set) -> list:
    """Nodes that make ``o``, a result of ``n`` of type (elem, shape), empty. Where ``n`` reads
    float tensors, the constant is multiplied by the sum of their sums (a scalar: no broadcast
    for onnxruntime to drop), so that a later gradients() call on the result still finds the
    paths through it and gives zeros, as TF does, not None. New names avoid ``taken``."""
    def node(op, ins, out=None, **attrs):
        out = out or unique_name(f"{o}/{op}", taken)
        return onnx.helper.make_node(op, ins, [out], name=out, **attrs)

    srcs = [x for x in dict.fromkeys(n.input) if x and elems.get(x) in FLOAT_TYPES]
    value = onnx.helper.make_tensor(o, elem, shape, [])
    if not srcs or elem not in FLOAT_TYPES:
        return [node("Constant", [], o, value=value)]
    out, sums = [node("Constant", [], value=value)], []
    for x in srcs:
        out.append(node("ReduceSum", [x], keepdims=0))
        if elems[x] != elem:
            out.append(node("Cast", [out[-1].output[0]], to=elem))
        sums.append(out[-1].output[0])
    if len(sums) > 1:
        out.append(node("Sum", sums))
    return out + [node("Mul", [out[0].output[0], out[-1].output[0]], o)]
