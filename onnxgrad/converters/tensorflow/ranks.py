"""Shape inference after conversion: ONNX's, helped where it stops short.

- TF's static shapes (``_output_shapes``, from the GraphDef or from TensorFlow, see
  :mod:`.tf_shapes`) for values ONNX finds no shape for.
- Loop-carried values. A Loop body's inputs are declared without shapes (TF lets a loop value's
  dims change between iterations), and ONNX's Loop inference gives the Loop's outputs no shape:
  each round gives a body input the rank of the value the Loop starts from, and a carried
  output the rank that its start value and the body's output agree on (a Loop may run no
  iteration); a scan output gets the body value's rank plus one. Dims stay unknown.

Rounds repeat while they add something (a rank found in a body can tell one outside).
"""
from __future__ import annotations

import onnx
from onnx import helper

from ...inference import forget_made_up, graphs_of

ROUNDS = 6


def infer(m: onnx.ModelProto, tf_shapes: dict) -> onnx.ModelProto:
    for _ in range(ROUNDS):
        m = onnx.shape_inference.infer_shapes(m)
        g = m.graph
        changed = _tf_shapes(g, tf_shapes)
        changed |= _loop_ranks(g, _types(g))
        if not changed:
            break
    # onnx's inference names dims it cannot tell (unk__N), and may give one name to dims that
    # differ at run time (two reads of a sequence of unequal elements): onnxruntime takes them
    # for one size and fails re-using a buffer. Such dims are left unknown.
    forget_made_up([vi for g in graphs_of(m.graph) for vi in [*g.value_info, *g.output]])
    return m


def rank(t: onnx.TypeProto | None) -> int | None:
    if t is None or t.WhichOneof("value") != "tensor_type" or not t.tensor_type.HasField("shape"):
        return None
    return len(t.tensor_type.shape.dim)


def _types(g: onnx.GraphProto, outer: dict | None = None) -> dict:
    types = dict(outer or {})
    types.update({vi.name: vi.type for vi in [*g.value_info, *g.input, *g.output]})
    types.update({t.name: helper.make_tensor_type_proto(t.data_type, t.dims)
                  for t in g.initializer})
    return types


def _set_rank(t: onnx.TypeProto, r: int) -> None:
    shape = t.tensor_type.shape
    shape.SetInParent()  # a scalar's shape has no dims but must be present
    del shape.dim[:]
    shape.dim.extend(onnx.TensorShapeProto.Dimension() for _ in range(r))


def _tf_shapes(g: onnx.GraphProto, tf_shapes: dict) -> bool:
    changed = False
    for vi in [*g.value_info, *g.output]:
        shape = tf_shapes.get(vi.name)
        tt = vi.type.tensor_type
        if shape is not None and vi.type.WhichOneof("value") == "tensor_type" and \
                not tt.HasField("shape"):
            tt.shape.SetInParent()
            for d in shape:
                dim = tt.shape.dim.add()
                if d is not None:
                    dim.dim_value = d
            changed = True
    return changed


def _loop_ranks(g: onnx.GraphProto, types: dict) -> bool:
    changed = False
    for node in g.node:
        for a in node.attribute:
            if a.type != onnx.AttributeProto.GRAPH:
                continue
            body = a.g
            changed |= _loop_ranks(body, _types(body, types))
            if node.op_type != "Loop":
                continue
            for vi, src in zip(body.input[2:], node.input[2:]):
                r = rank(types.get(src))
                if r is not None and rank(vi.type) is None and \
                        vi.type.WhichOneof("value") == "tensor_type":
                    _set_rank(vi.type, r)
                    changed = True
            changed |= _output_ranks(g, node.output, _loop_output_ranks(node, types), types)
        if node.op_type == "If":  # a backward loop made twice (control_flow._one_node)
            loops = [a.g.node[0] for a in node.attribute if a.type == onnx.AttributeProto.GRAPH
                     and len(a.g.node) == 1 and a.g.node[0].op_type == "Loop"]
            if len(loops) == 2:
                both = [_loop_output_ranks(lp, types) for lp in loops]
                changed |= _output_ranks(g, node.output, [a if a == b else None
                                                           for a, b in zip(*both)], types)
    return changed


def _loop_output_ranks(node: onnx.NodeProto, types: dict) -> list:
    """The rank of each output of a Loop, as far as known: a carried value's when its start
    value and the body's output agree on it (a Loop may run no iteration), a scan output's the
    body value's plus one."""
    body = next(a.g for a in node.attribute if a.name == "body")
    inner = _types(body)
    n_carried = len(node.input) - 2
    ranks = []
    for k in range(len(node.output)):
        r = rank(inner.get(body.output[1 + k].name))
        if r is not None and k < n_carried and rank(types.get(node.input[2 + k])) != r:
            r = None
        ranks.append(r if r is None or k < n_carried else r + 1)
    return ranks


def _output_ranks(g: onnx.GraphProto, outputs, ranks: list, types: dict) -> bool:
    """Give the node outputs of unknown rank the ranks found (value_info of graph ``g``)."""
    changed = False
    for out, r in zip(outputs, ranks):
        if not out or r is None or rank(types.get(out)) is not None:
            continue
        t = types.get(out)
        if t is None or t.WhichOneof("value") != "tensor_type":
            continue
        vi = next((v for v in [*g.value_info, *g.output] if v.name == out), None)
        if vi is None:
            vi = g.value_info.add()
            vi.CopyFrom(helper.make_tensor_value_info(out, t.tensor_type.elem_type, None))
        if vi.type.WhichOneof("value") != "tensor_type" or rank(vi.type) is not None:
            continue
        _set_rank(vi.type, r)
        types[out] = vi.type
        changed = True
    return changed
