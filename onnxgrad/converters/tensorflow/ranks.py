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

ROUNDS = 6


def infer(m: onnx.ModelProto, tf_shapes: dict) -> onnx.ModelProto:
    for _ in range(ROUNDS):
        m = onnx.shape_inference.infer_shapes(m)
        g = m.graph
        changed = _tf_shapes(g, tf_shapes)
        changed |= _loop_ranks(g, _types(g))
        if not changed:
            break
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
            changed |= _loop_output_ranks(g, node, body, types)
    return changed


def _loop_output_ranks(g: onnx.GraphProto, node: onnx.NodeProto, body: onnx.GraphProto,
                       types: dict) -> bool:
    inner = _types(body)
    n_carried = len(node.input) - 2
    changed = False
    for k, out in enumerate(node.output):
        if not out or rank(types.get(out)) is not None:
            continue
        r = rank(inner.get(body.output[1 + k].name))
        if r is None:
            continue
        if k < n_carried:
            if rank(types.get(node.input[2 + k])) != r:
                continue
        else:
            r += 1  # a scan output stacks the body's values
        vi = next((v for v in [*g.value_info, *g.output] if v.name == out), None)
        if vi is None:
            t = types.get(out)
            elem = t.tensor_type.elem_type if t is not None and t.HasField("tensor_type") else \
                inner[body.output[1 + k].name].tensor_type.elem_type
            vi = g.value_info.add()
            vi.CopyFrom(helper.make_tensor_value_info(out, elem, None))
        if vi.type.WhichOneof("value") != "tensor_type":
            continue
        _set_rank(vi.type, r)
        types[out] = vi.type
        changed = True
    return changed
