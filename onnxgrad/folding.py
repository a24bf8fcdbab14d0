"""The types of small integer tensors that a graph computes from constants alone.

Exporters compute shapes by arithmetic on constants: torch's ``unflatten`` (TorchScript
exporter) slices the input's shape up to ``(dim + 2) % 3``, a Mod of two Constants. onnx's
shape inference, data propagation included, does not follow Mod, so that Slice's length, the
Concat of the new shape and the rank of the Reshape that reads it stayed unknown, and every
rule that needs a rank after it refused the model (``F.unfold(x, 2).unflatten(2, (h, w))``
then a BatchNorm or an upsampling, found by the torch fuzzer). :func:`shape_seeds` evaluates
such nodes on their constants (onnx.reference) and returns their outputs' exact types for
inference to start from; the model keeps its nodes.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .inference import constant_tensors

# shape arithmetic: cheap, exact on integers, deterministic
_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Min", "Max", "Reshape",
                  "Unsqueeze", "Squeeze", "Concat", "Gather", "Slice", "Cast", "Range", "Equal",
                  "Less", "Greater", "Where", "Not", "Expand", "Tile", "ReduceProd",
                  "ReduceSum", "Identity", "Shape", "Size", "ConstantOfShape"})
_INTS = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL})
_MAX = 1024  # elements: shape vectors and index lists, not data


def shape_seeds(model: onnx.ModelProto, types: dict, opset: int) -> list:
    """ValueInfoProtos for the main graph's node outputs that ``types`` (inference's) gives no
    shape, from inference on a copy of ``model`` whose integer shape arithmetic on constants
    (and on fully static shapes in ``types``) is folded into Constants; dims that inference
    made up there are left unknown."""
    graph = model.graph
    wanted = _feeding_unshaped(graph, types)
    known = _known_values(graph, types, opset, wanted) if wanted else None
    if not known:
        return []
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    nodes = []
    for n in folded.graph.node:
        if n.output and all(o in known for o in n.output if o) and n.op_type != "Constant":
            nodes += [helper.make_node("Constant", [], [o], value=numpy_helper.from_array(
                known[o], o)) for o in n.output if o]
        else:
            nodes.append(n)
    del folded.graph.node[:]
    folded.graph.node.extend(nodes)
    try:
        inferred = onnx.shape_inference.infer_shapes(folded, data_prop=True)
    except Exception:  # noqa: BLE001  (inference refuses the copy: no seeds)
        return []
    out = []
    for vi in inferred.graph.value_info:
        t = types.get(vi.name)
        if (t is None or not t.tensor_type.HasField("shape")) and \
                vi.type.tensor_type.HasField("shape"):
            for d in vi.type.tensor_type.shape.dim:
                if d.dim_param.startswith("unk__"):
                    d.Clear()
            out.append(vi)
    return out


def _feeding_unshaped(graph: onnx.GraphProto, types: dict) -> set:
    """The indices of the nodes upstream of a node whose output ``types`` gives no shape: the
    only ones whose values can help (a large graph with static shapes folds little)."""
    todo = [i for n in graph.node if any(
        o and (o not in types or not types[o].tensor_type.HasField("shape")) for o in n.output)
        for i in n.input if i]
    if not todo:  # (the usual case: every output shaped)
        return set()
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    seen: set = set()
    while todo:
        k = producer.get(todo.pop())
        if k is not None and k not in seen:
            seen.add(k)
            todo += [i for i in graph.node[k].input if i]
    return seen


def _known_values(graph: onnx.GraphProto, types: dict, opset: int, wanted: set) -> dict:
    """{name: array} of the integer values the ``wanted`` nodes of ``graph`` compute from its
    constants."""
    from onnx.reference import ReferenceEvaluator

    known = {}
    for name, t in constant_tensors(graph).items():
        if t.data_type in _INTS and np.prod(t.dims, dtype=np.int64) <= _MAX:
            known[name] = numpy_helper.to_array(t)
    found = {}
    for k, n in enumerate(graph.node):
        if k not in wanted or n.domain not in ("", "ai.onnx") or n.op_type not in _OPS \
                or not n.input:
            continue
        if n.op_type in ("Shape", "Size"):
            dims = _static_shape(types.get(n.input[0]))
            if dims is None:
                continue
        elif not all(i in known for i in n.input if i):
            continue
        try:
            if n.op_type == "Shape":
                vals = [_shape_slice(n, np.array(dims, np.int64))]
            elif n.op_type == "Size":
                vals = [np.array(np.prod(dims, dtype=np.int64))]
            else:
                vals = ReferenceEvaluator(n, opsets={"": opset}).run(
                    None, {i: known[i] for i in n.input if i})
        except Exception:  # noqa: BLE001  (an op the reference cannot run: not folded)
            continue
        for o, v in zip(n.output, vals):
            v = np.asarray(v)
            if o and v.dtype.kind in "iub" and v.size <= _MAX:
                known[o] = found[o] = v
    return found


def _static_shape(t):
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in t.tensor_type.shape.dim]
    return None if None in dims else dims


def _shape_slice(n: onnx.NodeProto, whole: np.ndarray) -> np.ndarray:
    """Shape-15's start and end attributes (clamped as the spec says)."""
    a = {x.name: x.i for x in n.attribute}
    r = len(whole)
    start, end = a.get("start", 0), a.get("end", r)
    start, end = [min(max(v + r if v < 0 else v, 0), r) for v in (start, end)]
    return whole[start:end]
