"""The autodiff engine: tf.gradients for ONNX graphs.

One forward pass marks what depends on xs, one reverse sweep over the nodes in topological order
calls each node's rule with the summed gradients of its outputs. The engine knows nothing about
particular ops: rules live in ``onnxgrad.rules`` and are found through the registry.
"""
from __future__ import annotations

import difflib
import enum
import functools
import gc
import json
from collections import deque
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from . import rules as _rules  # noqa: F401  (registers every rule)
from .aliasing import private_statistics
from .empty import empty_as_constants, has_empty
from .emitter import Emitter, NeedOpset, V, compatible_dims, dims
from .errors import (ArgumentTypeError, InvalidArgumentError, InvalidModelError,
                     NotDifferentiableError, UnsupportedError)
from .inference import (FLOAT_TYPES, bodies_of, forget_made_up, graphs_of, infer_ranks,
                        infer_shapes, names_read, node_subgraphs, schema_output_dtypes,
                        unique_name)
from .ort_fusions import guard_pad_fusion
from .ort_internal import standard_forms
from .storage import dense_copy, load_model, strip_weights
from .validation import check_model
from .versions import convert_version, without_ir3_inputs
from .registry import (Grads, Node, add_for, attach_functions, captured as _captured, lookup,
                       subgraphs, MIN_OPSET)


class UnconnectedGradients(str, enum.Enum):
    NONE = "none"
    ZERO = "zero"


class AggregationMethod(str, enum.Enum):
    ADD_N = "add_n"
    TREE = "tree"
    ACCUMULATE_N = "accumulate_n"


# tensors a model marks as held constant (TensorFlow's StopGradient, kept by the converter): a
# JSON list of names under this metadata_props key, honoured like stop_gradients, in subgraphs too
STOP_GRADIENTS_KEY = "onnxgrad.stop_gradients"
# tensors no gradient may pass (TensorFlow's PreventGradient): a JSON object {name: message}
PREVENT_GRADIENTS_KEY = "onnxgrad.prevent_gradients"
# the marks on ir.Values (ir's Cloner copies a value's meta, so a body's clone keeps them)
_STOP, _PREVENT = "onnxgrad.stop", "onnxgrad.prevent"


@dataclass
class GradientsResult:
    model: onnx.ModelProto
    grads: list[str | None]

    def __iter__(self):  # allows ``model, grads = gradients(...)``
        return iter((self.model, self.grads))


def gradients(model, ys, xs, grad_ys=None, name: str = "gradients", stop_gradients=None,
              unconnected_gradients="none", aggregation_method=None) -> GradientsResult:
    """Append the gradient of sum(ys) with respect to each of xs to ``model``.

    Follows ``tf.gradients``: see DESIGN.md for the contract. Returns a :class:`GradientsResult`
    whose ``model`` is a new ModelProto (the input is never mutated) and whose ``grads`` are the
    names of the new graph outputs, aligned with xs (None for an unconnected x under "none").
    """
    if not isinstance(name, str):
        raise ArgumentTypeError(f"name must be a str (the scope of the added nodes), not {name!r}")
    unconnected = _enum(UnconnectedGradients, unconnected_gradients, "unconnected_gradients")
    aggregation = _enum(AggregationMethod, aggregation_method or "add_n", "aggregation_method")
    ys, xs = _names(ys, "ys"), _names(xs, "xs")
    if not ys:
        raise InvalidArgumentError("ys is empty: give at least one tensor to differentiate")
    grad_ys = [None] * len(ys) if grad_ys is None else _names(grad_ys, "grad_ys", allow_none=True)
    if len(grad_ys) != len(ys):
        raise InvalidArgumentError(f"grad_ys has {len(grad_ys)} entries but ys has {len(ys)}")

    model, restore_sparse = dense_copy(_load(model))
    model, weights = _without_weights(without_ir3_inputs(model, xs))
    model = check_model(standard_forms(model), weights)  # (sorted, if only its order was wrong)
    model, defaults = _without_defaults(_name_outputs(model))
    args = (ys, xs, grad_ys, name, stop_gradients, unconnected, aggregation,
            {vi.name for vi in model.graph.value_info}, weights, defaults)
    # the sweep allocates millions of small objects and frees none: the cyclic collector would
    # rescan the whole IR again and again (a third of the build time at 10k nodes)
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        proto, opset = _prepare(model)
        while True:
            try:
                res = _gradients(proto, opset, *args)
                break
            except NeedOpset as need:  # a rule needs a newer op: upgrade the whole model, retry
                # (until every rule has its opset: an RNN's needs 14, a reflect Pad's 16 after
                # it; _gradients took its proto apart: the same preparation again, rather than
                # a copy of every model kept for this rare case)
                if need.version <= opset:  # (cannot happen: a rule needs what it has)
                    raise
                proto = convert_version(_prepare(model)[0], need.version)
                proto, opset = _prepare(proto)
        if restore_sparse is not None:
            restore_sparse(res.model)
        return res
    finally:
        if gc_was_on:
            gc.enable()


def _gradients(proto, opset, ys, xs, grad_ys, name, stop_gradients, unconnected, aggregation,
               declared, weights, defaults):
    reshaped = _computed_reshapes(proto, opset) - declared
    declared = declared | reshaped
    irm, kept = _deserialize(proto, declared)
    graph = irm.graph
    forward = list(graph)
    values, names = _values_and_names(graph)
    y_vals = [_resolve(values, n, "ys") for n in ys]
    x_vals = [_resolve(values, n, "xs") for n in xs]
    stop = {_resolve(values, n, "stop_gradients")
            for n in _names([] if stop_gradients is None else stop_gradients, "stop_gradients")}
    new_inputs = [gy for gy in grad_ys if gy is not None and gy not in values]
    inner = set(new_inputs).intersection(_inner_values(graph)) if new_inputs else set()
    if "" in new_inputs or inner:
        bad = "" if "" in new_inputs else min(inner)
        raise InvalidArgumentError(
            f"grad_ys: {bad!r} cannot become a new graph input: " + (
                "that name is taken inside a subgraph" if bad else "it is no name"))
    scope = _unique_scope(names + new_inputs, name)
    e = Emitter(graph, scope, opset)
    e.reserve(new_inputs)

    engine = Engine(irm, opset, aggregation)
    stop |= _mark_from_metadata(irm, values, engine)
    plan = engine.plan(graph, y_vals, x_vals, stop)  # refuses before anything is emitted
    seeds: dict[ir.Value, list[V]] = {}
    for y, gy in zip(y_vals, grad_ys):
        seed = _seed(e, graph, values, y, gy, y in plan.live)
        if seed is not None:
            seeds.setdefault(y, []).append(seed)
    results = engine.run(plan, e, seeds)
    names = _outputs(e, graph, xs, x_vals, results, unconnected)
    _drop_dead(graph, e.nodes)
    # (the names of the added results, where the forward has a tensor of no elements)
    empties = {v.name for node in e.nodes if node.graph is graph for v in node.outputs} \
        if has_empty(graph, forward) else None
    out = attach_functions(_to_proto(proto, irm, forward, declared, kept))
    if _may_hold_batch_norm(irm, forward):
        private_statistics(out)
    for vi in out.graph.value_info:  # their rank alone (see _computed_reshapes)
        if vi.name in reshaped:
            for d in vi.type.tensor_type.shape.dim:
                d.Clear()
    _add_ranks(out, {v.name for node in e.unranked if node.graph is not None
                     for v in node.outputs if v.shape is None and v.name})
    if empties:
        out = empty_as_constants(out, empties)
    guard_pad_fusion(out)
    out.graph.initializer.extend(defaults)
    for t in out.graph.initializer:
        if t.name in weights:
            t.CopyFrom(weights[t.name])
    return GradientsResult(out, names)


def _computed_reshapes(proto: onnx.ModelProto, opset: int) -> set:
    """Main-graph Reshape outputs of a shape computed at run time, below opset 14: Reshape-13's
    shape inference gives them no rank (data propagation found one for the rules), so onnx's
    inference of the result lost every rank after them, and there sized a Resize's sizes read
    from such a Shape as empty (a model that onnx.checker and onnxruntime refused)."""
    if opset >= 14:
        return set()
    g = proto.graph
    consts = {t.name for t in g.initializer}
    consts.update(n.output[0] for n in g.node if n.op_type == "Constant")
    return {n.output[0] for n in g.node
            if n.op_type == "Reshape" and len(n.input) > 1 and n.input[1] not in consts}


def _deserialize(proto: onnx.ModelProto, declared: set) -> tuple[ir.Model, list]:
    """onnx-ir's model of ``proto`` (ours to change), and the main graph's value_info entries
    the input model declared (see :func:`_to_proto`).

    The main graph's value_info, one entry per tensor after shape inference, is taken out and
    applied here with onnx-ir's own readers, once per distinct type: its shapes are frozen, so
    values may share them, and reading every entry anew was a third of the deserialisation
    (6 us an entry). The values typed are those onnx-ir types from value_info: node outputs and
    initializers that are not graph inputs; graph outputs keep their declared type."""
    g = proto.graph
    entries = list(g.value_info)
    del g.value_info[:]  # protobuf keeps the detached entries
    irm = ir.serde.deserialize_model(proto)
    graph, seen = irm.graph, {}
    for v in graph.inputs:  # a declared elem_type 0 is no type: a path through it is refused
        if v.dtype == ir.DataType.UNDEFINED:
            v.type = None
    values = {v.name: v for v in graph.initializers.values() if not v.is_graph_input()}
    values.update((v.name, v) for node in graph for v in node.outputs)
    for vi in entries:
        v = values.get(vi.name)
        if v is None or v.is_graph_output():
            continue
        if vi.doc_string or len(vi.metadata_props):
            ir.serde.deserialize_value_info_proto(vi, v)
            continue
        key = vi.type.SerializeToString()
        typed = seen.get(key)
        if typed is None:
            typed = seen[key] = (ir.serde.deserialize_type_proto_for_shape(vi.type),
                                 ir.serde.deserialize_type_proto_for_type(vi.type))
        v.shape, v.type = typed
    return irm, [vi for vi in entries if vi.name in declared]


def _to_proto(proto: onnx.ModelProto, irm: ir.Model, forward: list, declared: set,
              kept: list):
    """The result: ``proto`` (the prepared copy, ours to change) plus what the call added.

    Only the new nodes, and forward nodes a control-flow rule rewrote in place, are serialised;
    re-encoding the unchanged forward graph would cost a third of the build. When the graph
    changed in any other way, the whole model is serialised instead. value_info is kept where
    the input model had it (with what inference makes of it) and written for the new values
    whose shape the emitter recorded (ranks that onnx shape inference cannot find again); the
    other types from shape inference were for the rules. What the call writes names no dim
    that onnx's inference made up (:func:`~onnxgrad.inference.forget_made_up`)."""
    graph, g = irm.graph, proto.graph
    nodes = list(graph)
    outputs = len(g.output)
    if nodes[:len(forward)] != forward or len(graph.initializers) != len(g.initializer):
        new = set(nodes) - set(forward)
        for node in graph:
            for v in node.outputs:
                if (v.name not in declared and not v.is_graph_output()
                        and not (node in new and v.shape is not None)):
                    v.type, v.shape = None, None
        out = ir.serde.serialize_model(irm)
        forget_made_up([*(vi for vi in out.graph.value_info if vi.name not in declared),
                        *out.graph.output[outputs:]])
        return out
    for node, n in zip(forward, g.node):
        if len(node.outputs) != len(n.output) or (node.attributes and subgraphs(node)):
            n.CopyFrom(ir.serde.serialize_node(node))
    added = nodes[len(forward):]
    for node in added:  # straight into the repeated field (extend would copy each proto again)
        ir.serde.serialize_node_into(g.node.add(), node)
    g.input.extend(ir.serde.serialize_value(v) for v in list(graph.inputs)[len(g.input):])
    # _deserialize emptied g.value_info: past the kept (declared) entries is only what this
    # call writes, as past the model's own outputs
    _write_values(g.output, list(graph.outputs)[outputs:])
    g.value_info.extend(kept)
    _write_values(g.value_info, [v for node in added for v in node.outputs
                                 if v.shape is not None and v.type is not None
                                 and not v.is_graph_output()])
    for domain, version in irm.opset_imports.items():
        entry = next((o for o in proto.opset_import if o.domain == domain), None)
        if entry is None:
            proto.opset_import.add(domain=domain, version=version)
        else:
            entry.version = version
    return proto


def _write_values(field, values: list) -> None:
    """ValueInfoProtos of ``values`` appended to ``field``, naming no dim that onnx's inference
    made up (:func:`~onnxgrad.inference.forget_made_up`). onnx-ir writes one per distinct
    tensor type and frozen shape, copied under each value's name: writing every value anew
    cost 5 us each (the gradient outputs of a model with thousands of weights)."""
    by_id: dict[tuple, onnx.ValueInfoProto] = {}  # (type, id(shape)) -> written
    by_dims: dict[tuple, onnx.ValueInfoProto] = {}  # (type, dims, denotations) -> written
    held = []  # the shapes keyed by id (so no id is reused)
    for v in values:
        shape, t = v.shape, v.type
        if type(t) is not ir.TensorType or t.denotation or v.doc_string or v.metadata_props \
                or (shape is not None and not shape.frozen):
            vi = field.add()
            ir.serde.serialize_value_into(vi, v)
            forget_made_up([vi])
            continue
        key = (t.dtype.value, id(shape))
        written = by_id.get(key)
        if written is None:
            dims_key = (key[0], None) if shape is None else (
                key[0], shape.dims, tuple(shape.get_denotation(i) for i in range(len(shape))))
            written = by_dims.get(dims_key)
            if written is None:
                written = by_dims[dims_key] = onnx.ValueInfoProto()
                ir.serde.serialize_value_into(written, v)
                forget_made_up([written])
            by_id[key] = written
            held.append(shape)
        vi = field.add()
        vi.CopyFrom(written)
        vi.name = v.name


def _add_ranks(model: onnx.ModelProto, names: set) -> None:
    """value_info for ``names`` (outputs of added nodes whose rank the emitter could not tell
    and onnx's inference does not find alone, such as a Conv with a computed kernel), from shape
    inference on the result with ranks seeded as :func:`~onnxgrad.inference.rank_seeds` does;
    run only when there are any."""
    if not names:
        return
    try:
        typed = infer_ranks(model)
    except onnx.shape_inference.InferenceError:  # a rank is missing then, as it was before
        return
    for g, t in zip(graphs_of(model.graph), graphs_of(typed.graph)):
        added = [vi for vi in t.value_info if vi.name in names]
        forget_made_up(added)
        g.value_info.extend(added)


class Engine:
    """The reverse sweep, for the top-level graph or any subgraph (control-flow rules call it
    recursively through ``Node.differentiate``). Holds what is fixed for one gradients call."""

    def __init__(self, irm: ir.Model, opset: int, aggregation):
        self.irm, self.opset, self.aggregation = irm, opset, aggregation
        self.marked = False  # whether some values carry _STOP or _PREVENT marks
        self._rules: dict[tuple, object] = {}  # (op_identifier, opset) -> rule or None

    def opset_of(self, domain: str) -> int:
        if domain in ("", "ai.onnx"):
            return self.opset
        return self.irm.opset_imports.get(domain, 1)

    @functools.cached_property
    def function_protos(self) -> dict[tuple, onnx.FunctionProto]:
        """The model's own functions, by (domain, name, overload): serialized once a call."""
        return {k: ir.serde.serialize_function(f) for k, f in self.irm.functions.items()}

    def rule_of(self, node: ir.Node):
        """(the node's gradient rule or None, the opset it is read at), looked up once per
        (domain, op_type, overload) and opset in a call."""
        ident, opset = node.op_identifier(), self.opset_of(node.domain)
        rule = self._rules.get((ident, opset), _NO_RULE)
        if rule is _NO_RULE:
            rule = self._rules[ident, opset] = lookup(
                "" if node.domain == "ai.onnx" else node.domain, node.op_type, opset,
                ident in self.irm.functions)
        return rule, opset

    def sweep(self, graph: ir.Graph, e: Emitter, seeds: dict, xs: list, stop,
              owner) -> list[V | None]:
        """Gradients of the seeded values with respect to each of ``xs``, appended to ``e``'s graph.

        ``graph`` is the graph whose nodes are swept (a subgraph that the rule of ``owner``, a
        registry.Node, built, whose nodes may read outer-scope values); ``seeds`` maps values to
        lists of incoming gradients (V); ``xs`` may be values of ``graph``, its inputs, or
        outer-scope values it reads. Returns one summed gradient (or None) per x. Cost: linear
        in the nodes. An x that the model's metadata stops (a body input's placeholder, which
        :func:`~onnxgrad.rules.control.clone_into` marks, or a row a Loop reads) gets None: the
        rule passes nothing through it; one it prevents, with a gradient to pass, is refused.
        """
        out = self.run(self.plan(graph, list(seeds), xs, stop), e, seeds)
        if self.marked:
            for i, x in enumerate(xs):
                if out[i] is not None and x.meta.get(_STOP):
                    out[i] = None
                elif out[i] is not None and _PREVENT in x.meta:
                    node = owner.node
                    name, message = x.meta[_PREVENT]
                    raise NotDifferentiableError(
                        node.op_type, node.domain, owner.opset, node.name, [],
                        reason=f"its body's value {name!r} is marked by the model's "
                               f"{PREVENT_GRADIENTS_KEY!r} (TensorFlow's PreventGradient): "
                               "gradient explicitly disabled"
                               + (f". Reason: {message}" if message else ""))
        return out

    def reach(self, graph: ir.Graph, x: ir.Value) -> set:
        """The values of ``graph`` that depend on ``x`` (one of its inputs, or an outer value it
        reads) through float values, past the model's stops (none when x is stopped)."""
        if self.marked and x.meta.get(_STOP):
            return set()
        stop = {v for node in graph for v in node.outputs if v.meta.get(_STOP)} \
            if self.marked else ()
        return _forward_reach(graph, [x], stop, self.opset)[1]

    def plan(self, graph: ir.Graph, ys: list, xs: list, stop=frozenset()) -> _Plan:
        """What depends on xs, and the refusals due before any rule runs, when values on the
        path have no known type (shape inference could not type them, as after custom and
        com.microsoft ops; they may be float, so the path is there whatever the types say):
        an op without a rule that makes one of them, else the first of them (no rule can be
        run on it)."""
        if self.marked:
            stop = set(stop) | {v for node in graph for v in node.outputs if v.meta.get(_STOP)}
        on_path, live, untyped = _forward_reach(graph, xs, stop, self.opset)
        if untyped:
            self._refuse_untyped(on_path, live, ys, xs, stop)
        return _Plan(xs, stop, on_path, live)

    def _refuse_untyped(self, on_path, live, ys, xs, stop):
        needed = {y for y in ys if y in live and y not in stop}
        first = None
        for node in reversed(on_path):
            outs = [v for v in node.outputs if v in needed]
            if not outs:
                continue
            rule, opset_of = self.rule_of(node)
            if any(v.dtype is None for v in outs) and rule is None:
                raise NotDifferentiableError(node.op_type, node.domain, opset_of, node.name,
                                             _path(node, outs, ys, xs, live))
            ins = [v for v in _reads(node) if v in live and v not in stop]
            if first is None:
                first = next(((v, node) for v in [*outs, *ins] if v.dtype is None), None)
            needed.update(ins)
        if first is not None:
            v, node = first
            raise InvalidModelError(
                f"the type of tensor {v.name!r} (at node {node.name!r}, op {node.op_type!r}) is "
                "unknown: onnx shape inference cannot tell it, so no gradient rule can be run "
                "on it; declare its type in the model's value_info")

    def run(self, plan: _Plan, e: Emitter, seeds: dict) -> list[V | None]:
        """The reverse sweep of :meth:`plan` from ``seeds`` (see :meth:`sweep`)."""
        scope, stop, xs, live = e.scope, plan.stop, plan.xs, plan.live
        grads: dict[ir.Value, list[V]] = {}
        for y, parts in seeds.items():
            if y in live:
                grads.setdefault(y, []).extend(parts)
        y_vals = list(seeds)
        summed: dict[ir.Value, V | None] = {}
        aggregation = self.aggregation

        def total(v: ir.Value) -> V | None:
            if v in summed:
                return summed[v]
            parts = grads.pop(v, None)
            e.prefix = f"{scope}/{_label(v)}_grad"
            g = summed[v] = None if not parts else _name_grad(
                e, v, _aggregate(e, parts, aggregation, v).with_shape(e.dims(v)))
            return g

        def path(node):
            outs = [v for v in node.outputs if v in grads or v in summed]
            return _path(node, outs, y_vals, xs, live)

        for node in reversed(plan.on_path):
            gs = [total(v) if v in grads and v not in stop else None for v in node.outputs]
            if not any(gs):  # (a V is always true)
                continue
            rule, opset_of = self.rule_of(node)
            if self.marked:
                _refuse_prevented(node, gs, opset_of, path)
            if rule is None:
                raise NotDifferentiableError(node.op_type, node.domain, opset_of, node.name,
                                             path(node))
            e.prefix = f"{scope}/{node.name or node.op_type}_grad"
            ctx = Node(node, e, gs, opset_of, engine=self, live=live)
            try:
                out = rule(ctx, gs[0])
            except NotDifferentiableError as err:  # a rule refusing one attribute value
                if err.path:
                    raise
                raise NotDifferentiableError(err.op_type, err.domain, err.opset, err.node_name,
                                             path(node), reason=err.reason) from None
            except NotImplementedError as err:  # a rule refusing a configuration (its message)
                raise NotDifferentiableError(node.op_type, node.domain, opset_of, node.name,
                                             path(node), reason=str(err)) from None
            extra = None if len(gs) == 1 else next(
                (k for k, gk in enumerate(gs) if k and gk is not None), None)
            if extra is not None and not ctx.read_gs:
                raise NotDifferentiableError(
                    node.op_type, node.domain, opset_of, node.name, path(node),
                    reason=f"its rule takes the gradient of output 0 alone, and output {extra} "
                           f"({node.outputs[extra].name!r}) has one too")
            for v, gv in _pairs(node, out):
                if gv is not None and v is not None and v in live:
                    grads.setdefault(v, []).append(gv)

        return [total(x) if x in live and _maybe_float(x) else None for x in xs]


_NO_RULE = object()  # (rule_of: not looked up yet)


@dataclass
class _Plan:
    xs: list
    stop: set
    on_path: list
    live: set


def _maybe_float(v: ir.Value) -> bool:
    """A float value, or one whose type nobody knows (it may be float)."""
    return v.dtype is None or v.dtype in FLOAT_TYPES


def _has_subgraphs(node: ir.Node) -> bool:
    return bool(node.attributes) and any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for a in node.attributes.values())


def _may_hold_batch_norm(irm: ir.Model, forward: list) -> bool:
    """Whether the forward can hold a BatchNormalization: in the graph, a subgraph (any node with
    one) or a model function. Checked on the IR: walking the written result costs 24 ms at
    10,000 forward nodes, this 2 ms."""
    return any(n.op_type == "BatchNormalization" or _has_subgraphs(n) for n in forward) or \
        any(n.op_type == "BatchNormalization" for f in irm.functions.values() for n in f)


def _reads(node: ir.Node) -> list[ir.Value]:
    """The node's inputs and the outer-scope values its subgraphs read."""
    ins = [v for v in node.inputs if v is not None]
    return ins + _captured(node) if _has_subgraphs(node) else ins


def _pairs(node: ir.Node, out):
    """(value, gradient) pairs from what a rule returned (see registry's docstring)."""
    if isinstance(out, Grads):
        return [*zip(node.inputs, out.inputs), *out.captured.items()]
    return zip(node.inputs, out if isinstance(out, (tuple, list)) else (out,))


def _name_grad(e: Emitter, v: ir.Value, g: V) -> V:
    """A non-tensor gradient (a sequence) is named ``<name>@<scope>``, as TF names a TensorArray's
    gradient ``<name>@<source>``; tensors keep the emitter's names."""
    if v.type is None or isinstance(v.type, ir.TensorType) or not v.name:
        return g
    mine = (g.value.producer() is not None and g.value.producer().graph is e.graph
            and not g.value.is_graph_output() and (g.value.name or "").startswith(e.scope + "/"))
    if not mine:
        g = e.op("Identity", g, _dtype=g.dtype)
    g.value.type = v.type
    g.value.name = e.unique(f"{v.name}@{e.scope}")
    return g


# -- preparation -------------------------------------------------------------------------------


def _without_weights(model: onnx.ModelProto):
    """A copy of ``model`` whose float initializers of 1 MiB and more carry no data, and those
    initializers. Version conversion and shape inference serialise the whole model, which costs
    seconds with hundreds of MB of weights (and fails past 2 GB); no rule reads a weight's
    values, so they are put back at the end."""
    return strip_weights(model, 1 << 20, only=FLOAT_TYPES)


def _without_defaults(model: onnx.ModelProto):
    """``model``, or a copy whose initializers that are also graph inputs are inputs alone, and
    those initializers (put back at the end). Such an initializer (IR 4 on; IR 3's are made
    constants first, :func:`~onnxgrad.versions.without_ir3_inputs`) is a default the caller may
    override: no rule, and no shape inference, may read it as a constant (a Slice's starts read
    so gave a gradient of another length when fed)."""
    inputs = {v.name for v in model.graph.input}
    defaults = [t for t in model.graph.initializer if t.name in inputs]
    if not defaults:
        return model, []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    split = {t.name for t in defaults}
    kept = [t for t in out.graph.initializer if t.name not in split]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    _forget_shapes_after(out.graph, split)
    return out, defaults


def _forget_shapes_after(graph: onnx.GraphProto, names: set):
    """Drops the value_info of every tensor computed from ``names`` (in subgraphs too) and the
    dims (not the rank) of such graph outputs: onnx's inference wrote them from a default's
    value, which a fed value changes (a claimed [3, 1] reduced the gradient of a [3, 4])."""
    tainted = set(names)
    for n in graph.node:
        subs = list(node_subgraphs(n))
        if tainted.intersection(n.input) or any(tainted & names_read(s) for s in subs):
            tainted.update(n.output)
            tainted.update(o for s in subs for g in graphs_of(s) for k in g.node for o in k.output)
    for g in graphs_of(graph):
        kept = [v for v in g.value_info if v.name not in tainted]
        if len(kept) != len(g.value_info):
            del g.value_info[:]
            g.value_info.extend(kept)
    for v in graph.output:
        if v.name in tainted and v.type.tensor_type.HasField("shape"):
            for d in v.type.tensor_type.shape.dim:
                d.Clear()


def _load(model) -> onnx.ModelProto:
    return load_model(model)


def _always_computed(n: onnx.NodeProto, opset: int) -> list[int] | None:
    """The output positions ``n`` computes whether or not they are named (the node's own count
    for a variadic output); None for a node whose optional outputs change what it computes."""
    from .rnn.ops import DOMAIN, FORWARD_OPS, PARAMS_OPS, op_outputs
    if n.domain == DOMAIN:  # function bodies compute every output; a backward op skips some
        if n.op_type in FORWARD_OPS + ("OnnxRNN",):
            return list(range(max(len(n.output), len(op_outputs(n.op_type)))))
        return list(range(len(n.output))) if n.op_type in PARAMS_OPS else None
    if n.domain not in ("", "ai.onnx") or not onnx.defs.has(n.op_type):
        return None
    formal = onnx.defs.get_schema(n.op_type, opset).outputs
    opt = onnx.defs.OpSchema.FormalParameterOption.Optional
    return [i for i in range(len(n.output))
            if formal and formal[min(i, len(formal) - 1)].option != opt]


def _name_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy in which every output a node computes anyway but leaves unnamed
    (a Scan's or Loop's final state, a Split part, a forward RNN op's reserve_space) has a
    name, in the graphs and in the model's own function bodies: rules read them (the shape of
    a zero cotangent, the saved activations), and a gradient node reading "" would make an
    invalid model. Optional outputs whose presence changes the op (BatchNormalization's
    statistics, MaxPool's Indices) stay as they are, in a function's clone too
    (rules/function.py), so that a clone names what its forward node names."""
    todo = []  # (body's place in bodies_of, which is the same for a copy; node's; outputs)
    for bi, (nodes, opset) in enumerate(bodies_of(model)):
        for k, n in enumerate(nodes):
            if "" in n.output or n.domain:
                idx = _always_computed(n, opset)
                if idx and any(i >= len(n.output) or not n.output[i] for i in idx):
                    todo.append((bi, k, idx))
    if not todo:
        return model
    m = onnx.ModelProto.FromString(model.SerializeToString())
    bodies = bodies_of(m)
    taken = {v for g in graphs_of(m.graph) for v in [*(i.name for i in g.input),
                                                      *(t.name for t in g.initializer)]}
    taken.update(v for f in m.functions for v in f.input)
    taken.update(o for nodes, _ in bodies for n in nodes for o in n.output)
    for bi, k, idx in todo:
        n = bodies[bi][0][k]
        n.output.extend([""] * (max(idx) + 1 - len(n.output)))
        for i in idx:
            n.output[i] = n.output[i] or unique_name(f"{n.name or n.op_type}:out{i}", taken)
    return m


def _prepare(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise InvalidModelError("the model imports no ai.onnx opset")
    if opset < MIN_OPSET:  # gradient graphs need opset 13; upgrade rather than write two forms
        if opset < 9 and any(n.op_type == "Scan" for g in graphs_of(model.graph) for n in g.node):
            raise UnsupportedError(
                f"the model's Scan is Scan-8 (opset {opset}), with a batch axis that onnx's "
                "version converter drops; export the model at opset 9 or newer")
        model, opset = convert_version(model, MIN_OPSET), MIN_OPSET
    try:  # returns a copy, so the caller's model is never touched
        model = infer_shapes(model, data_prop=True)
    except onnx.shape_inference.InferenceError:  # onnx cannot type it: go on with what is declared
        model = onnx.ModelProto.FromString(model.SerializeToString())
    return model, opset


def _enum(kind, value, what):
    try:
        return kind(value.value if isinstance(value, enum.Enum) else value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise InvalidArgumentError(f"{what}={value!r} is not one of {allowed}") from None


def _names(x, what, allow_none=False) -> list:
    if isinstance(x, str) or x is None:
        items = [x]
    elif hasattr(x, "__iter__") and not isinstance(x, (bytes, dict)):
        items = list(x)
    else:
        raise ArgumentTypeError(f"{what} must be a tensor name (str) or a list of them, not "
                                f"{type(x).__name__} {x!r}")
    for n in items:
        if not (isinstance(n, str) or (allow_none and n is None)):
            raise ArgumentTypeError(f"{what} must hold tensor names (str), got {n!r}")
    return items


def _mark_from_metadata(irm: ir.Model, values: dict, engine: Engine) -> set:
    """The main-graph values the model's STOP_GRADIENTS_KEY lists; those in subgraphs, and every
    value PREVENT_GRADIENTS_KEY lists, are marked for the sweeps (a name no value has is an
    error: the model was changed after it was written, and dropping the entry would let a
    gradient through that the model holds back)."""
    stops = _metadata_json(irm, STOP_GRADIENTS_KEY, list)
    prevents = _metadata_json(irm, PREVENT_GRADIENTS_KEY, dict)
    if not stops and not prevents:
        return set()
    everywhere = {**_inner_values(irm.graph), **values}
    for key, names in ((STOP_GRADIENTS_KEY, stops), (PREVENT_GRADIENTS_KEY, prevents)):
        missing = [n for n in names if n not in everywhere]
        if missing:
            raise InvalidModelError(
                f"the model's metadata {key!r} names {missing[0]!r}, which is no tensor of the "
                "model (renamed or removed after the model was written?): correct or remove "
                "that entry")
    main = set()
    for n in stops:
        if n in values:
            main.add(values[n])
        else:
            everywhere[n].meta[_STOP] = True
            engine.marked = True
    for n, message in prevents.items():
        everywhere[n].meta[_PREVENT] = (n, message)  # (a body's clone has another name)
        engine.marked = True
    return main


def _inner_values(graph: ir.Graph) -> dict[str, ir.Value]:
    """The named values made or taken as inputs inside ``graph``'s subgraphs, by name."""
    out = {}
    for node in graph.all_nodes():
        if node.graph is not graph:
            out.update((v.name, v) for v in node.outputs if v.name)
        for g in subgraphs(node):
            out.update((v.name, v) for v in g.inputs if v.name)
    return out


def _metadata_json(irm: ir.Model, key: str, kind: type):
    raw = irm.metadata_props.get(key)
    if raw is None:
        return kind()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    ok = isinstance(parsed, kind) and all(isinstance(n, str) for n in parsed) and (
        kind is list or all(isinstance(m, str) for m in parsed.values()))
    if not ok:
        want = "a list of tensor names" if kind is list else "an object {tensor name: message}"
        raise InvalidModelError(f"the model's metadata {key!r} must be JSON, {want}; it is "
                                f"{raw[:80]!r}")
    return parsed


def _refuse_prevented(node: ir.Node, gs: list, opset: int, path) -> None:
    for v, g in zip(node.outputs, gs):
        if g is not None and _PREVENT in v.meta:
            name, message = v.meta[_PREVENT]
            raise NotDifferentiableError(
                node.op_type, node.domain, opset, node.name, path(node),
                reason=f"its output {name!r} is marked by the model's "
                       f"{PREVENT_GRADIENTS_KEY!r} (TensorFlow's PreventGradient): gradient "
                       "explicitly disabled" + (f". Reason: {message}" if message else ""))


def _values_and_names(graph: ir.Graph) -> tuple[dict[str, ir.Value], list[str]]:
    """The graph's values by name, and every name in the model (as :func:`_names_in` lists
    them, but for unnamed values), from one walk."""
    values = {v.name: v for v in graph.inputs}
    values.update(graph.initializers)
    names = []
    for node in graph:
        names.append(node.name)
        for v in node.outputs:
            if v.name:
                values[v.name] = v
        if node.attributes:
            for sub in subgraphs(node):
                names.append(sub.name)
                names += _names_in(sub)
    names += values
    return values, names


def _resolve(values, name, what) -> ir.Value:
    v = values.get(name)
    if v is None:
        close = difflib.get_close_matches(name, list(values), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise InvalidArgumentError(f"{what}: no tensor named {name!r} in the graph{hint}")
    if v.type is not None and not isinstance(v.type, ir.TensorType):
        raise ArgumentTypeError(f"{what}: {name!r} is a {v.type}, not a tensor")
    return v


def _names_in(graph: ir.Graph) -> list[str]:
    """Every name in the model: nodes, values, graph inputs, initializers, subgraphs."""
    names = [v.name for v in graph.inputs]
    names += graph.initializers
    for node in graph:  # (onnx-ir's recursive iterator costs 8x a plain one)
        names.append(node.name)
        for v in node.outputs:
            names.append(v.name)
        if node.attributes:
            for sub in subgraphs(node):
                names.append(sub.name)
                names += _names_in(sub)
    return names


def _unique_scope(names: list, name: str) -> str:
    """``name``, or ``name_k`` with the first k such that none of ``names`` lies under it: none
    equal to the scope, starting with ``scope/`` or naming a sequence gradient ``...@scope``."""
    # one string, each name between NULs: a scope is taken when "\0scope\0", "\0scope/" or
    # "@scope\0" occurs in it (a search in C; a NUL inside a name can only make it cautious)
    every = "\0" + "\0".join(n for n in names if n) + "\0"

    def taken(scope):
        return (f"\0{scope}\0" in every or f"\0{scope}/" in every
                or f"@{scope}\0" in every)

    scope, k = name, 0
    while taken(scope):
        k += 1
        scope = f"{name}_{k}"
    return scope


def _label(v: ir.Value) -> str:
    return v.name or "value"


# -- the sweep ---------------------------------------------------------------------------------
def _forward_reach(graph: ir.Graph, xs, stop, opset: int):
    """Nodes that read something depending on xs (in topological order), the values that
    depend on xs (float ones, and those of unknown type: a custom op's output may be float; a
    stopped value is a constant unless it is itself an x), and whether any of those has an
    unknown type."""
    live = {x for x in xs if _maybe_float(x)}
    untyped = any(x.dtype is None for x in live)
    on_path = []
    produced = set(graph.inputs) | set(graph.initializers.values())
    for node in list(graph):
        ins = node.inputs
        if None in ins:
            ins = [v for v in ins if v is not None]
        if not produced.issuperset(ins) and any(
                v not in produced and v.producer() is not None and v.producer().graph is graph
                for v in ins):  # values of outer scopes are always there
            graph.sort()  # not topologically ordered: let onnx-ir fix the order once
            return _forward_reach(graph, xs, stop, opset)
        if _has_subgraphs(node):
            ins = [*ins, *_captured(node)]
        outs = node.outputs
        produced.update(outs)
        if not live.isdisjoint(ins):
            on_path.append(node)
            if node.domain in ("", "ai.onnx"):
                for v in outs:
                    if v.dtype is None:
                        _type_by_schema(node, opset)
                        break
            for v in outs:
                dtype = v.dtype
                if (dtype is None or dtype in FLOAT_TYPES) and (v not in stop or v in xs):
                    live.add(v)
                    untyped = untyped or dtype is None
    return on_path, live, untyped


def _type_by_schema(node: ir.Node, opset: int) -> None:
    """Give outputs of unknown type the type their op's schema fixes (inference.
    schema_output_dtypes), so that a failed shape inference does not hide a certain dtype."""
    ins = [None if v is None or v.dtype is None else int(v.dtype) for v in node.inputs]
    for v, dt in zip(node.outputs, schema_output_dtypes(node.op_type, opset, ins)):
        if v.type is None and dt is not None:
            v.type = ir.TensorType(ir.DataType(dt))


def _seed(e: Emitter, graph, values, y: ir.Value, gy, live: bool) -> V:
    e.prefix = f"{e.scope}/{_label(y)}_seed"
    yv = e.wrap(y)
    if gy is None:
        if not live or y.dtype not in FLOAT_TYPES:  # (plan refused an untyped live y)
            return None
        static = yv.shape is not None and all(isinstance(d, int) for d in yv.shape)
        if static and np.prod(yv.shape, dtype=np.int64) <= 64:  # a scalar loss: a small Constant
            return e.const(np.ones(yv.shape), y.dtype)
        return e.fill_like(yv, 1)
    if gy in values:
        g = values[gy]
        if y.dtype is not None and g.dtype is not None and g.dtype != y.dtype:
            raise ArgumentTypeError(f"grad_ys: {gy!r} has dtype {g.dtype} but y {y.name!r} has "
                                    f"{y.dtype}")
        ys_, gs_ = dims(y), dims(g)  # (as tf.gradients, which refuses other shapes)
        if ys_ is not None and gs_ is not None and not compatible_dims(ys_, gs_):
            raise InvalidArgumentError(f"grad_ys: {gy!r} has shape {list(gs_)} but y "
                                       f"{y.name!r} has {list(ys_)}: they must be equal")
        return _same_shape(e, e.wrap(g), yv, gy)
    if y.type is None or y.shape is None:
        raise InvalidArgumentError(
            f"grad_ys: {gy!r} would become a graph input like y {y.name!r}, whose "
            "type or rank is unknown; pass the name of an existing tensor instead")
    new = ir.Value(name=gy, type=y.type, shape=y.shape)
    graph.inputs.append(new)
    values[gy] = new
    return _same_shape(e, e.wrap(new), yv, gy)


def _same_shape(e: Emitter, g: V, y: V, gy: str) -> V:
    """``g``, checked at run time to have y's shape where static dims cannot show it:
    onnxruntime binds a symbolic dim per input, so a cotangent of batch 1 for a y of batch 4
    would broadcast through the rules silently. A dim that differs is -2 in the Reshape
    target, which then fails, naming the check."""
    yd, gd = dims(y.value), dims(g.value)
    if yd is None or gd is None or len(yd) != len(gd) or (
            all(isinstance(d, int) for d in yd) and all(isinstance(d, int) for d in gd)):
        return g  # (static: checked above or by the runtime; an unknown rank: nothing to read)
    prefix, e.prefix = e.prefix, f"{e.scope}/grad_ys_{gy}_must_have_the_shape_of_y"
    want = e.Shape(y)
    target = e.Where(e.Equal(e.Shape(g), want), want, e.const(np.array(-2, np.int64)))
    out = e.op("Reshape", g, target, _shape=y.value.shape)
    e.prefix = prefix
    return out


def _aggregate(e: Emitter, parts: list[V], method, v: ir.Value) -> V:
    if len(parts) == 1:
        return parts[0]
    add = add_for(v.type)  # values that are not tensors (sequences) add as their type says
    if add is not None:
        while len(parts) > 1:
            parts = [add(e, parts[i], parts[i + 1]) if i + 1 < len(parts) else parts[i]
                     for i in range(0, len(parts), 2)]
        return parts[0]
    parts = _join_pieces(e, parts, v)
    if len(parts) == 1:
        return parts[0]
    if method is AggregationMethod.ADD_N:
        return e.op("Sum", *parts, _shape=dims(v))
    while len(parts) > 1:  # a balanced tree of pairwise Adds
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    return parts[0]


def _join_pieces(e: Emitter, parts: list[V], v: ir.Value) -> list[V]:
    """``parts`` with the slices' gradients that :meth:`Emitter.place` padded along one axis
    and that do not overlap joined: each run of adjacent ones by one Concat, padded once unless
    it covers the axis, in the place of its first, where summing them added zeros to all but
    one term at every element (exact either way, but for the sign of a zero): q, k, v = qkv[0],
    qkv[1], qkv[2] cost three full-size Pads and a three-way Sum (about 4 % of a
    TorchScript-exported TransformerEncoder's step)."""
    placed = sorted(((e.pieces[p.value], i) for i, p in enumerate(parts) if p.value in e.pieces),
                    key=lambda pi: (pi[0].start, pi[0].stop))
    if len(placed) < 2 or len({pc.axis for pc, _ in placed}) > 1 or any(
            a.stop > b.start for (a, _), (b, _) in zip(placed, placed[1:])):
        return parts
    axis, x = placed[0][0].axis, placed[0][0].x
    runs = [[placed[0]]]
    for pc, i in placed[1:]:
        if pc.start == runs[-1][-1][0].stop:
            runs[-1].append((pc, i))
        else:
            runs.append([(pc, i)])
    shape = dims(v)
    size = shape[axis] if shape is not None else None
    out = list(parts)
    for run in (r for r in runs if len(r) > 1):
        start, stop = run[0][0].start, run[-1][0].stop
        t = e.op("Concat", *[pc.t for pc, _ in run], axis=axis, _shape=None if shape is None
                 else tuple(stop - start if k == axis else d for k, d in enumerate(shape)))
        first = min(i for _, i in run)
        out[first] = t if (start, stop) == (0, size) else e.place(t, x, axis, start, stop)
        for _, i in run:
            if i != first:
                out[i] = None
    return [p for p in out if p is not None]


def _outputs(e: Emitter, graph, xs, x_vals, results, unconnected) -> list[str | None]:
    """The gradients as graph outputs, each with its x's type and shape (the checker wants a
    rank on every graph output)."""
    names, used, added = [], set(), set(e.nodes)
    for xname, x, g in zip(xs, x_vals, results):
        if g is None and (unconnected is UnconnectedGradients.NONE or not _maybe_float(x)):
            names.append(None)
            continue
        dtype = x.dtype or (g.dtype if g is not None else None)
        shape = x.shape
        if shape is None and g is not None and g.shape is not None:
            shape = ir.Shape(g.shape)
        if dtype is None or shape is None:
            raise InvalidModelError(
                f"xs: the {'type' if dtype is None else 'rank'} of {xname!r} is unknown (onnx "
                "shape inference cannot tell it), so its gradient cannot be declared as a graph "
                "output; declare its shape in the model's value_info")
        label = _label(x)
        if g is None:
            if x.producer() is not None and x.producer().graph is None:  # a rule replaced its
                x = next(v for n in graph for v in n.outputs if v.name == xname)  # producer
            e.prefix = f"{e.scope}/{label}_grad"
            g = e.zeros_like(e.wrap(x))
        out = g.value
        if (out.producer() not in added or out.is_graph_output()
                or out in used):
            e.prefix = f"{e.scope}/{label}_grad"
            out = e.op("Identity", g).value
        out.name = e.unique(f"{e.scope}/{xname}_grad")
        out.type, out.shape = ir.TensorType(dtype), shape
        used.add(out)
        graph.outputs.append(out)
        names.append(out.name)
    return names


def _drop_dead(graph: ir.Graph, added: list[ir.Node]):
    """Remove added nodes whose results nothing uses (rules compute every input's gradient);
    in reverse order, so a node's consumers are gone before it is looked at. A node a rule took
    out already (the ONNX RNN rules replace their forward node, an expanded body's too) is left."""
    for node in reversed(added):
        if node.graph is not graph:
            continue
        for v in node.outputs:
            if v.uses() or v.is_graph_output():
                break
        else:
            graph.remove(node, safe=True)


def _path(node, outs, ys, xs, live) -> list[str]:
    """A path y -> ... -> node -> ... -> x through tensor names, for error messages; ``outs``:
    the node's outputs on the way to ys."""
    def bfs(starts, step, goal):
        prev = {s: None for s in starts}
        queue = deque(starts)
        while queue:
            v = queue.popleft()
            if v in goal:
                chain = []
                while v is not None:
                    chain.append(v)
                    v = prev[v]
                return chain
            for w in step(v):
                if w not in prev:
                    prev[w] = v
                    queue.append(w)
        return list(starts[:1])

    def down(v):  # toward ys, through consumers
        return [o for c in v.consumers() for o in c.outputs if o in live]

    def up(v):  # toward xs, through producers
        p = v.producer()
        return [] if p is None else [i for i in p.inputs if i is not None and i in live]

    ins = [v for v in node.inputs if v is not None and v in live]
    to_y = bfs(outs, down, set(ys))  # out ... y
    to_x = bfs(ins, up, set(xs))     # in ... x
    return [v.name for v in to_y] + [f"[{node.op_type}]"] + [v.name for v in reversed(to_x)]
