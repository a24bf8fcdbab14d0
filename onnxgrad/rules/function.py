"""The fallback rule: any op that has a function body and no rule of its own: an ai.onnx op the
schema defines as a function (Attention, RotaryEmbedding, SwiGLU, ...; context-dependent bodies
included), or a call of one of the model's own functions (``ModelProto.functions``: modules
exported as functions, onnxscript models). The body is expanded for this node, its nodes are
appended to the graph (they recompute the forward; the node itself stays as it is), and the
engine's sweep differentiates that expansion (calls of other functions in it the same way).
"""
from __future__ import annotations

import onnx
import onnx.defs
import onnx_ir as ir
from onnx import helper

from ..errors import NotDifferentiableError
from ..inference import forget_made_up, infer_shapes
from ..registry import fallback

def _function_proto(n) -> tuple[onnx.FunctionProto, dict] | None:
    """(the body the node calls, its attributes' defaults: name -> AttributeProto), or None."""
    fp = n.local_function()
    if fp is not None:
        return fp, {a.name: a for a in fp.attribute_proto}
    node = n.node
    try:
        schema = onnx.defs.get_schema(node.op_type, n.opset, node.domain or "")
    except onnx.defs.SchemaError:
        return None
    defaults = {name: a.default_value for name, a in schema.attributes.items()
                if a.default_value.type != onnx.AttributeProto.UNDEFINED}
    if schema.has_function:
        version = max((v for v in schema.function_opset_versions if v <= n.opset), default=None)
        fp = None if version is None else schema.get_function_with_opset_version(version)
        if fp:
            return (onnx.FunctionProto.FromString(fp) if isinstance(fp, bytes) else fp), defaults
    if schema.has_context_dependent_function:
        version = max((v for v in schema.context_dependent_function_opset_versions
                       if v <= n.opset), default=None)
        if version is None or any(v is not None and v.type is None for v in node.inputs):
            return None
        proto = ir.serde.serialize_node(node).SerializeToString()
        # the builders check the input types: a dtype outside the op's constraints (float64 in
        # a gradient check) gets the body built for float32, which is written dtype-generically
        for as_float in (False, True):
            types = []
            for v in node.inputs:
                t = onnx.TypeProto() if v is None else ir.serde.serialize_value(v).type
                if as_float and t.tensor_type.elem_type == onnx.TensorProto.DOUBLE:
                    t.tensor_type.elem_type = onnx.TensorProto.FLOAT
                types.append(t.SerializeToString())
            fp = schema.get_context_dependent_function_with_opset_version(version, proto, types)
            if fp:
                return onnx.FunctionProto.FromString(fp), defaults
    return None


def _attr_map(n, defaults: dict):
    attrs = dict(n.node.attributes)
    for name, a in defaults.items():
        if name not in attrs:
            attrs[name] = ir.serde.deserialize_attribute(a)
    return attrs


def _expand(n, fp: onnx.FunctionProto, defaults: dict):
    """Clone the body into the node's graph (named under the rule's prefix, typed by onnx shape
    inference); returns (nodes, outputs aligned with the node's outputs)."""
    from onnx_ir import _cloner

    e, node = n.e, n.node
    # a context-dependent body may name outputs (Attention's present_key ...) it does not make
    made = {o for c in fp.node for o in c.output} | set(fp.input)
    names = [o if o in made else None for o in fp.output[:len(node.outputs)]]
    fp = onnx.FunctionProto.FromString(fp.SerializeToString())
    del fp.output[:]
    fp.output.extend(o for o in names if o is not None)
    func = ir.serde.deserialize_function(fp)
    value_map = {}
    for i, formal in enumerate(func.inputs):
        value_map[formal] = node.inputs[i] if i < len(node.inputs) else None

    def rename(c):
        c.name = e.unique(f"{e.prefix}/{node.op_type}_body/{c.op_type}")
        for k, o in enumerate(c.outputs):
            # an output the body leaves unnamed (an optional one: autodiff._name_outputs named
            # the others) stays so, as in the forward call: onnxruntime inlines that call and its
            # CommonSubexpressionElimination merges the two copies, making consumers of a name
            # given here read the forward's absent output (the session cannot be created)
            if o.name:
                o.name = c.name if len(c.outputs) == 1 else f"{c.name}:{k}"

    cloner = _cloner.Cloner(attr_map=_attr_map(n, defaults), value_map=value_map, metadata_props={},
                            post_process=rename, resolve_ref_attrs=True)
    clones = [cloner.clone_node(c) for c in func]
    it = iter(func.outputs)
    outs = [None if o is None else value_map.get(next(it)) for o in names]
    _infer_types(n, clones, fp)
    return clones, outs


def _infer_types(n, clones, fp):
    """Types and shapes of the cloned values, from onnx shape inference on them alone."""
    produced = {o for c in clones for o in c.outputs}
    outer = list(dict.fromkeys(v for c in clones for v in c.inputs
                               if v is not None and v not in produced))
    inputs, inits = [], []
    consts = {v: n.const(i) for i, v in enumerate(n.node.inputs) if v is not None}
    for v in outer:
        inputs.append(ir.serde.serialize_value(v))
        value = consts.get(v)
        made = v.producer()
        if value is None and made is not None and made.op_type == "Constant" and \
                "value" in made.attributes and made.attributes["value"].value.size <= 64:
            value = made.attributes["value"].value.numpy()  # a shape the emitter made earlier
        if value is not None:  # lets data propagation see e.g. AffineGrid's size
            inits.append(onnx.numpy_helper.from_array(value, v.name))
    nodes = [ir.serde.serialize_node(c) for c in clones]
    last = [o for o in clones[-1].outputs] if clones else []
    graph = helper.make_graph(nodes, "body", inputs,
                              [helper.make_empty_tensor_value_info(o.name) for o in last], inits)
    # an expansion (fp None) is in ai.onnx at the model's opset, whatever the node's domain
    opsets = (fp and list(fp.opset_import)) or [helper.make_opsetid("", n.e.opset)]
    # a body may call the model's other functions
    model = helper.make_model(graph, opset_imports=opsets, functions=n.model_functions())
    model.ir_version = 10
    inferred = infer_shapes(model, data_prop=True)
    _copy_types(clones, inferred.graph)


def _copy_types(nodes, graph: onnx.GraphProto, inputs=()):
    """Types inferred in ``graph`` (the serialized ``nodes``) onto the ir values, recursing into
    the subgraphs (a Scan body in a function is untyped until inference types it). The dims
    this run of onnx's inference made up stay unknown: the rules would take them for the
    model's own dims of the same names."""
    forget_made_up([*graph.value_info, *graph.output, *graph.input])
    types = {vi.name: vi for vi in [*graph.value_info, *graph.output, *graph.input]}
    for v in [*inputs, *(o for c in nodes for o in c.outputs)]:
        vi = types.get(v.name)
        if vi is not None and vi.type.WhichOneof("value") is not None:  # sequences, optionals too
            t = ir.serde.deserialize_value_info_proto(vi, None)
            v.type, v.shape = t.type, t.shape
    for c, proto in zip(nodes, graph.node):
        subs = {a.name: a.g for a in proto.attribute if a.HasField("g")}
        for name, attr in c.attributes.items():
            if attr.type == ir.AttributeType.GRAPH and name in subs:
                _copy_types(list(attr.value), subs[name], attr.value.inputs)


def differentiate_body(n, append=None):
    """The gradients of the node's inputs through its expanded function body. ``append(e,
    clones)`` may put the clones into the graph rewritten; it returns every node it added and
    {clone output: the value that replaces it} (default: the clones as they are)."""
    found = _function_proto(n)
    if found is None:
        raise NotDifferentiableError(n.node.op_type, n.node.domain, n.opset, n.node.name, [])
    e = n.e
    clones, outs = _expand(n, *found)
    if append is None:
        for c in clones:
            e.graph.append(c)
        e.nodes.extend(clones)
        nodes, swap = clones, {}
    else:
        nodes, swap = append(e, clones)
    outs = [swap.get(o, o) if o is not None else None for o in outs]
    return _sweep(n, nodes, zip(outs, n.gs))


def _sweep(n, nodes, seeded):
    """The gradients of the node's inputs through ``nodes`` (already in the graph), seeded by
    the (value, gradient) pairs of ``seeded``."""
    seeds = {o: g for o, g in seeded if o is not None and g is not None}
    xs = [v for v in n.node.inputs if v is not None and n.wants(v)]
    view = ir.GraphView(inputs=[], outputs=[], nodes=nodes)
    got = dict(zip(xs, n.differentiate(view, seeds, xs, n.e)))
    # the sweep's gradient of a value fed at several positions is already the sum over them:
    # it goes to the first position only, as the engine adds up what each position returns
    return tuple(got.pop(v, None) if v is not None else None for v in n.node.inputs)


def differentiate_expansion(n, build, gs=None):
    """The gradients of the node's inputs through the standard ops that ``build(e)`` emits (a
    forward expansion of the node: an op outside the ONNX standard, written as ops with rules),
    typed by onnx shape inference and differentiated by the sweep. ``build`` returns the values
    that ``gs`` seed (default: the node's outputs and their gradients). The expansion's forward
    nodes that no gradient reads are dropped with the rest of the dead nodes."""
    start = len(n.e.nodes)
    outs = build(n.e)
    nodes = n.e.nodes[start:]
    _infer_types(n, nodes, None)
    return _sweep(n, nodes, ((None if o is None else o.value, g)
                             for o, g in zip(outs, n.gs if gs is None else gs)))


def _function_rule(n, g):
    return differentiate_body(n)


fallback(_function_rule)
