"""The conversion driver: walks the TF graph context by context and calls one handler per op.

A handler gets the converter ``c`` and the node ``n`` and returns the ONNX values of the node's
outputs, in order (see :mod:`.ops` for the table). Values are ONNX tensor/sequence names, or
:class:`Resource` objects for TF resource handles (TensorArrays, stacks). Every top-level while
frame becomes an ONNX ``Loop`` and every v1 cond an ``If`` (:mod:`.control_flow`); TF's mutable
resources become sequence values threaded through the graph in TF's execution order.
"""
from __future__ import annotations

import json
import os
import re
from collections import ChainMap
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...inference import FLOAT_TYPES
from ...versions import convert_version
from . import proto
from .errors import ConversionError
from .graph import Graph, TFNode, group_key, split_ref, toposort

DEFAULT_OPSET = 18
HANDLERS: dict = {}


def handler(*ops):
    """Register ``fn(c, n) -> list of output values`` for the TF ops ``ops``."""
    def deco(fn):
        for op in ops:
            HANDLERS[op] = fn
        return fn
    return deco


@dataclass(eq=False)
class Resource:
    """A TF resource (TensorArray, stack): its state is an ONNX sequence threaded in TF order."""
    key: tuple
    kind: str  # "tensor_array" or "stack"
    dtype: int  # ONNX element type
    fixed_size: bool = True
    unwritten: tuple | None = None  # (empty state, size) of an array made without shapes
    elem_shape: list | None = None  # TF's static element shape (None dims unknown), if known
    reserved: str | None = None  # a lazy TF list's reserved length (ONNX int64 scalar value)
    made: tuple | None = None  # (state as made, size, dynamic_size) of a TensorArray

    def __repr__(self):
        return f"{self.kind} {self.key[-1]!r}"


class Scope:
    """The nodes of one ONNX graph being built (the main graph or a Loop/If body)."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []

    def graph(self, name: str) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, name, self.inputs, self.outputs)


class Converter:
    def __init__(self, graph: Graph, opset: int):
        self.g, self.opset = graph, opset
        self.main = graph  # (self.g is a function's graph while its body is converted)
        self.allow_unranked = False  # (convert's argument)
        self.env: ChainMap = ChainMap()  # "node:index" -> ONNX name or Resource
        self.fed: set[str] = set()  # tensors fed as inputs ("node:index"): no node overwrites them
        self.state: ChainMap = ChainMap()  # resource key -> ONNX name of its current sequence
        self.resources: dict[tuple, Resource] = {}
        self.seq_of: dict[str, Resource] = {}  # sequence value -> the resource it is a state of
        self.scope = Scope()
        self.root = self.scope  # the main graph's scope
        self.initializers: list[onnx.TensorProto] = []
        self.consts: dict[str, np.ndarray] = {}  # ONNX name -> value, for Const-fed inputs
        # the float Consts of the graph (frozen weights): gradients may be asked for them, so
        # what reads them must stay ops, never fold into new constants (see ops._fold)
        self.weight_values: set[str] = set()
        self.domains: set[str] = set()
        self._names: set[str] = set()
        self.stop_gradients: list[str] = []  # outputs of StopGradient (see ops._stop_gradient)
        self.prevent_gradients: dict[str, str] = {}  # PreventGradient output -> its message
        self.node: TFNode | None = None  # the node being converted (names what it emits)
        self.weights: dict[str, bool] | None = None  # a SavedModel's variables: trainable?
        self.statistics: dict[str, str] = {}  # value read as a FusedBatchNorm's mean/variance
        self.scan_stacks: dict = {}  # stack key -> its push node (resources.scan_stacks)
        self.scan_pushes: dict = {}  # stack key -> the value pushed in the Loop body being made
        self.scan_dtype: dict = {}  # stack key -> its pushes' ONNX type where not the stack's
        self.iteration: str | None = None  # the iteration number of the Loop body being made
        self.scan_writes: dict = {}  # array key -> (index, value) written in the Loop body
        self.stacked: dict[str, str] = {}  # sequence value -> the tensor of its elements stacked
        self.seq_len: dict[str, int] = {}  # sequence value -> its length, where known statically
        # TensorListElementShape / TensorListLength output -> the list it was read from
        self.list_shape_of: dict[str, str] = {}
        self.list_length_of: dict[str, str] = {}
        self.loop_scope: Scope | None = None  # the scope around the Loop body being made
        self.int64_of: dict[str, str] = {}  # int32 shape value -> the int64 value it is a cast of
        self.popped: dict[str, tuple] = {}  # value -> (stacked pushes, index) it was popped at
        self._memo: dict = {}  # per-scope reuse of values computed once (pop indices, masks)
        self.outputs: set[str] = set()  # the TF tensors asked for (their values must stay)
        # BroadcastGradientArgs of popped shapes: the masks of the backward loop being made,
        # and whether its body is being made again assuming none broadcasts (see control_flow)
        self.bga_masks: list[str] = []
        self.no_broadcast = False
        # TF optionals (cond_v2 hands a branch's intermediates to its gradient as optionals):
        # an OptionalNone's type waits for the If it leaves by (functions._type_optionals)
        self.optional_of: dict[str, tuple] = {}  # -> (element type, depth)
        self.optional_union: dict[str, dict] = {}  # -> {element type: the value of that type}
        self.bga_shapes: dict[str, str] = {}  # BGA axes / a gradient -> the shape it sums to
        self.list_scans: dict[str, str | None] = {}  # TF2 list -> the item a While body writes
        self.made_by: dict[str, TFNode] = {}  # ONNX node name -> the TF node it converts

    # -- names and emission ------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        """A new value or node name. Never a TF tensor name ("Reshape:0"), which only the
        tensor itself takes (:meth:`_rename`, :meth:`reserve`): a value made outside a node
        (named by its op alone) took TF's name from the tensor, whose static shape then
        declared the wrong value."""
        name, k = base, 0
        while name in self._names or self._is_tf_tensor(name):
            k += 1
            name = f"{base}__{k}"
        self._names.add(name)
        return name

    def reserve(self, ref: str) -> None:
        """Keep a TF tensor name for that tensor (a graph input or output)."""
        self._names.add(ref)

    def _is_tf_tensor(self, name: str, *graphs: Graph) -> bool:
        """Whether ``name`` is a tensor of the main graph or the function being converted."""
        node, _, i = name.rpartition(":")
        return i.isdigit() and any(node in g.nodes for g in graphs or (self.main, self.g))

    def op(self, op_type: str, inputs, n_out: int = 1, name: str | None = None,
           domain: str = "", **attrs):
        """Emit one node into the current scope; returns its output name(s)."""
        base = name or (f"{self.node.name}/{op_type}" if self.node else op_type)
        outs = [self.fresh(f"{base}:{i}") for i in range(n_out)]
        node_name = self.fresh(base)
        self.scope.nodes.append(helper.make_node(op_type, [i or "" for i in inputs], outs,
                                                 name=node_name, domain=domain, **attrs))
        if self.node is not None:
            self.made_by[node_name] = self.node
        if domain:
            self.domains.add(domain)
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=None, name: str | None = None) -> str:
        arr = np.asarray(value, dtype=dtype)
        nm = self.fresh(name or (f"{self.node.name}/const" if self.node else "const"))
        self.initializers.append(numpy_helper.from_array(arr, nm))
        self.consts[nm] = arr
        return nm

    def zeros(self, shape: str, dtype) -> str:
        """Zeros of numpy ``dtype`` and the int64 ``shape`` (a value): an Expand of a scalar."""
        return self.op("Expand", [self.const(0, dtype), shape])

    def i64(self, *vals) -> str:
        return self.const(np.array(vals, np.int64))

    def memo(self, key, make, scope: Scope | None = None) -> str:
        """``make()``'s value, emitted once per key into ``scope`` (default the current one)."""
        scope = scope or self.scope
        key = (id(scope), key)
        if key not in self._memo:
            saved, self.scope = self.scope, scope
            try:
                self._memo[key] = make()
            finally:
                self.scope = saved
        return self._memo[key]

    # -- reading a node's inputs and attributes ------------------------------------------------
    def value(self, ref: str):
        try:
            return self.env[ref]
        except KeyError:
            raise ConversionError(f"tensor {ref!r} is read before it is made (unsupported "
                                  "control-flow structure?)") from None

    def x(self, n: TFNode, i: int = 0):
        return self.value(n.inputs[i])

    def const_input(self, n: TFNode, i: int, required: str | None = None):
        """The value of input i when it is a constant of the graph, else None (or an error that
        says why it must be one, when ``required`` names what it is for)."""
        v = self.consts.get(self.x(n, i)) if isinstance(self.x(n, i), str) else None
        if v is None and required:
            raise ConversionError(f"{n}: input {i} ({n.inputs[i]}) must be a constant ({required})")
        return v

    def attr(self, n: TFNode, key: str, default=None):
        a = n.attr.get(key)
        return default if a is None else attr_value(a)

    def onnx_type(self, n: TFNode, key: str = "T") -> int:
        a = n.attr.get(key)
        if a is None:
            raise ConversionError(f"{n} has no attribute {key!r}")
        return onnx_dtype(a.type, n)

    # -- resources -------------------------------------------------------------------------
    def resource(self, n: TFNode, i: int = 0) -> Resource:
        r = self.x(n, i)
        if not isinstance(r, Resource):
            raise ConversionError(f"{n}: input {i} ({n.inputs[i]}) is not a TensorArray or stack "
                                  "handle the converter made")
        return r

    def get_state(self, r: Resource) -> str:
        return self.state[r.key]

    def set_state(self, r: Resource, seq: str) -> str:
        self.state[r.key] = seq
        self.seq_of[seq] = r
        return seq

    def _flow_arithmetic(self, n: TFNode):
        if n.op not in FLOW_OPS:
            return None
        rs = {self.seq_of[v] for v in (self.value(r) for r in n.inputs)
              if isinstance(v, str) and v in self.seq_of}
        if not rs:
            return None
        if any(r.kind == "tensor_list" for r in rs):  # TF2 TensorLists are values, not flows
            from .tensor_list import list_arithmetic
            return list_arithmetic(self, n)
        if len(rs) > 1:
            raise ConversionError(f"{n} combines the flows of different TensorArrays")
        return [self.get_state(rs.pop())]

    # -- walking the graph -----------------------------------------------------------------
    def convert_nodes(self, prefix: tuple, members: list[TFNode]) -> None:
        """Convert ``members`` (all nodes whose context starts with ``prefix``), one level at a
        time: nodes at this level by their handlers, each nested frame or cond as one unit."""
        from . import control_flow

        groups: dict[object, list[TFNode]] = {}
        for n in members:  # members come in the graph's topological order
            key = n if len(n.ctx) == len(prefix) else group_key(n.ctx[len(prefix)])
            groups.setdefault(key, []).append(n)
        items, item_of = {}, {}
        for key, ns in groups.items():
            parts = control_flow.split_cond(self.g, prefix, ns) if isinstance(
                key, tuple) and key[0] == "C" else [ns]
            for k, part in enumerate(parts):
                ikey = key if len(parts) == 1 else key + (k,)
                items[ikey] = part
                for n in part:
                    item_of.setdefault(n.name, ikey)
        for key in _item_order(self.g, items, item_of):
            if isinstance(key, TFNode):
                self.convert_node(key)
            elif key[0] == "F":
                control_flow.convert_loop(self, prefix + (key,), items[key])
            else:
                control_flow.convert_cond(self, prefix, key[1], items[key])

    def convert_node(self, n: TFNode) -> None:
        fn = HANDLERS.get(n.op)
        if fn is None and self.g.library is not None:  # a call of a library function
            from .functions import call_handler, is_function
            fn = call_handler if is_function(self, n.op) else None
        if fn is None:
            raise ConversionError(f"no converter for TensorFlow op {n.op!r} (node {n.name!r})")
        if "_gradient_op_type" in n.attr and not _swish(self.g, n):
            # (TF's mark of both ways to override a gradient)
            raise ConversionError(
                f"{n} has a custom gradient ({self.attr(n, '_gradient_op_type')!r}, from "
                "tf.custom_gradient or gradient_override_map), which ONNX cannot carry: "
                "onnxgrad would differentiate its forward ops instead, a different "
                "derivative. Export the model without the custom gradient")
        self.node = n
        first_node, first_init = len(self.scope.nodes), len(self.initializers)
        try:
            outs = self._flow_arithmetic(n) or fn(self, n)
        except ConversionError:
            raise
        except Exception as e:  # a handler bug or an input it cannot take: say where
            raise ConversionError(f"converting {n}: {type(e).__name__}: {e}") from e
        finally:
            self.node = None
        outs, named = list(outs or ()), set()
        for i, v in enumerate(outs):
            if v is None or f"{n.name}:{i}" in self.fed:
                continue
            if v not in named:  # (a value returned at two positions is renamed once)
                new = self._rename(v, f"{n.name}:{i}", first_node, first_init)
                outs = [new if o == v else o for o in outs]
                named.add(new)
                v = new
            self.env[f"{n.name}:{i}"] = v

    def _rename(self, v, name: str, first_node: int, first_init: int):
        """Give the value a node made its TF tensor name ("dense/MatMul:0", "w:0"), so that
        users find TF's tensors (and frozen weights) under the names they know."""
        if not isinstance(v, str) or v in self.seq_of or name in self._names or (
                self.g is not self.main and self._is_tf_tensor(name, self.main)):
            return v  # (a function's node named like one of the main graph's: not its name)
        made = [nd for nd in self.scope.nodes[first_node:] if v in nd.output]
        inits = [t for t in self.initializers[first_init:] if t.name == v]
        if not made and not inits:
            return v  # a value made earlier (an identity): it keeps its own name
        for nd in self.scope.nodes[first_node:]:
            for lst in (nd.output, nd.input):
                for k, x in enumerate(lst):
                    if x == v:
                        lst[k] = name
        for t in inits:
            t.name = name
        if v in self.consts:
            self.consts[name] = self.consts.pop(v)
        if v in self.weight_values:
            self.weight_values.discard(v)
            self.weight_values.add(name)
        for table in (self.int64_of, self.popped, self.optional_of, self.optional_union):
            if v in table:
                table[name] = table.pop(v)
        self.stop_gradients = [name if x == v else x for x in self.stop_gradients]
        self.prevent_gradients = {name if x == v else x: msg
                                  for x, msg in self.prevent_gradients.items()}
        self._names.add(name)
        return name


def attr_value(a):
    """An AttrValue as a Python value (str, int, float, bool, DataType int, shape list, ndarray,
    function name, or a list of those)."""
    kind = a.WhichOneof("value")
    if kind == "list":
        lst = a.list
        for f in ("s", "i", "f", "b", "type", "shape", "tensor", "func"):
            vals = getattr(lst, f)
            if len(vals):
                return [_scalar(f, v) for v in vals]
        return []
    return None if kind is None else _scalar(kind, getattr(a, kind))


def _scalar(kind, v):
    if kind == "s":
        return v.decode("utf-8", "replace")
    if kind == "shape":
        return proto.shape_of(v)
    if kind == "tensor":
        return proto.tensor_to_numpy(v)
    if kind == "func":
        return v.name
    return v


def onnx_dtype(dt: int, n: TFNode) -> int:
    info = proto.dtype_info(dt)
    if info.onnx is None:
        raise ConversionError(f"{n}: TensorFlow dtype {info.name} has no ONNX equivalent")
    return info.onnx


# tf.gradients treats TensorArray flows as float scalars: it sums flow gradients (AddN, and Add
# in a loop's accumulator) and starts accumulators with ZerosLike(flow). Here a flow is the
# array's state, which already holds every write, so each of these ops yields that state.
FLOW_OPS = frozenset({"Add", "AddV2", "AddN", "ZerosLike", "OnesLike"})


def _item_order(g: Graph, items: dict, item_of: dict) -> list:
    """Items (nodes and nested constructs) in an order where each comes after what it reads."""
    deps = {}
    for k, ns in items.items():
        inside = {n.name for n in ns}
        deps[k] = {item_of[p.name] for n in ns for p in g.deps(n)
                   if p.name in item_of and p.name not in inside}
    order = toposort(list(items), deps)
    if order is None:
        raise ConversionError("control-flow constructs depend on each other in a cycle")
    return order


def needed_nodes(g: Graph, outputs: list[str], fed=frozenset()) -> list[TFNode]:
    """The nodes the outputs depend on, in TF order: data and control edges, plus the ops that
    change a TensorArray or stack that a needed node reads (a push has no consumers, but the
    pop that returns its value does). So the forward part of a graph that also holds
    tf.gradients' machinery converts without the pushes that only the backward loop reads.
    A ``fed`` tensor ("name:i") is an input: nothing behind it is needed through it."""
    from .resources import GRAD_OPS, MUTATING, static_key

    # reads and updates of a variable TF left unfrozen (a Keras layer's seed state, advanced in
    # every call): TF orders them before the outputs by control edges alone, so those edges are
    # not followed; a value an output reads from one fails to convert (ONNX has no variables)
    resource_args: set[str] = set()
    unfrozen: set[str] = set()
    for n in g.order:
        if n.op in ("Placeholder", "_Arg"):
            a = n.attr.get("dtype" if n.op == "Placeholder" else "T")
            if a is not None and a.type == proto.DT["DT_RESOURCE"]:
                resource_args.add(n.name)
        elif n.op.endswith("VariableOp") and n.inputs and \
                split_ref(n.inputs[0])[0] in resource_args:
            unfrozen.add(n.name)
        elif n.op == "Identity" and n.inputs and split_ref(n.inputs[0])[0] in resource_args:
            resource_args.add(n.name)  # (a function call inlined: its inputs pass Identities)

    def reach(todo, seen):
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                n = g.nodes[name]
                todo.extend(split_ref(r)[0] for r in n.inputs if _full_ref(r) not in fed)
                todo.extend(c for c in n.controls if c not in unfrozen)

    def key(n):
        try:
            k = static_key(g, n.inputs[0]) if n.inputs else None
        except (KeyError, IndexError):
            return None
        return k + (n.attr["source"].s.decode(),) if n.op in GRAD_OPS else k

    seen: set[str] = set()
    reach([split_ref(o)[0] for o in outputs if _full_ref(o) not in fed], seen)
    mutators = [n for n in g.order if n.op in MUTATING]
    while True:
        used = {key(g.nodes[s]) for s in seen if g.nodes[s].op.startswith(("TensorArray", "Stack"))}
        more = [n.name for n in mutators if n.name not in seen and key(n) in used]
        if not more:
            return [n for n in g.order if n.name in seen]
        reach(more, seen)


def convert(graph_def, inputs=None, outputs=None, opset: int | None = None,
            name: str = "tf_graph", signature: str | None = None,
            tf_shapes: bool = True, allow_unranked: bool = False) -> onnx.ModelProto:
    """Convert a TensorFlow GraphDef (proto, bytes or path to a .pb/.pbtxt) or a SavedModel
    directory to an ONNX model.

    ``inputs``: tensor names ("x:0") that become graph inputs (default: every Placeholder the
    outputs need); ``outputs``: tensor names to compute (required for a GraphDef). Values keep
    their TF names ("y:0"); frozen variables (Const nodes) become initializers named after their
    nodes. A SavedModel (:mod:`.savedmodel`, needs TensorFlow) is frozen first; its
    ``signature`` (default "serving_default") gives the default inputs and outputs, which may
    also be named by the signature's keys. ``tf_shapes``: ask TensorFlow (when installed) for the
    static shapes of a GraphDef written without them (:mod:`.tf_shapes`).

    An input or output whose rank neither TF nor ONNX's inference can tell has no valid ONNX
    declaration (the IR wants shapes on a main graph's inputs and outputs; onnx.checker refuses
    the model): a ConversionError names them, unless ``allow_unranked``, which returns the
    model with them declared by element type alone (onnxruntime runs it) and a
    ConversionWarning.
    """
    from . import cudnn_rnn, functions, ops, tensor_list  # noqa: F401  (register the handlers)

    if not isinstance(graph_def, bytes) and isinstance(graph_def, (str, os.PathLike)) and \
            os.path.isdir(graph_def):
        from .savedmodel import load_saved_model
        graph_def, inputs, outputs, weights = load_saved_model(graph_def, inputs, outputs,
                                                               signature)
    elif signature is not None:
        raise ConversionError("signature: only a SavedModel directory has signatures")
    else:
        weights = None
    gd = proto.load_graph_def(graph_def) if isinstance(graph_def, (str, bytes)) or hasattr(
        graph_def, "__fspath__") else graph_def
    if tf_shapes:
        from .tf_shapes import with_tf_shapes
        gd = with_tf_shapes(gd)
    if not outputs:
        raise ConversionError("outputs: name the tensors to convert, e.g. outputs=['y:0']")
    opset = _check_opset(opset)
    outputs = list(dict.fromkeys(  # a tensor named twice is one output
        _ref(o, "output") for o in ([outputs] if isinstance(outputs, str) else outputs)))
    if not gd.node:
        raise ConversionError("the GraphDef has no nodes (an empty graph, or not a GraphDef)")
    g = Graph(gd)
    for o in outputs:
        nm, idx = split_ref(o)
        if nm not in g.nodes:
            raise ConversionError(f"output {o!r}: the graph has no node {nm!r}")
    c = Converter(g, DEFAULT_OPSET)
    c.weights = weights
    c.allow_unranked = allow_unranked
    from .resources import scan_stacks
    c.scan_stacks = scan_stacks(g)
    feeds = [_ref(i, "input") for i in ([inputs] if isinstance(inputs, str) else inputs or [])]
    read = {r for n in g.nodes.values() for r in n.inputs}
    for ref in feeds:
        nm, idx = split_ref(ref)
        if nm not in g.nodes:
            raise ConversionError(f"input {ref!r}: the graph has no node {nm!r}")
        n = g.nodes[nm]
        if idx > 0 and ref not in read:
            raise ConversionError(f"input {ref!r}: no node reads output {idx} of {n} (does it "
                                  "have one?)")
        dt = n.attr.get("dtype") or n.attr.get("T")
        if dt is None:
            raise ConversionError(f"input {ref!r}: cannot tell the dtype of {n}")
        shape = proto.shape_of(n.attr["shape"].shape) if "shape" in n.attr else None
        known = c.attr(n, "_output_shapes") or ()
        if shape is None and idx < len(known):  # an intermediate tensor: TF's static shape
            shape = known[idx]
        if n.op == "Const" and "value" in n.attr:  # a frozen value fed instead: its own shape
            shape = list(proto.tensor_to_numpy(n.attr["value"].tensor).shape)
        c.reserve(ref)
        c.scope.inputs.append(helper.make_tensor_value_info(
            ref, onnx_dtype(dt.type, n),
            None if shape is None else [d if d is not None else f"{nm}_{k}"
                                        for k, d in enumerate(shape)]))
        c.env[ref] = ref
    for o in outputs:  # output names are the TF names: keep them free for the outputs
        c.reserve(o)
    c.outputs = set(outputs)
    # (a fed output of a node some other output of which is needed keeps the feed)
    c.fed = set(c.env)
    needed = needed_nodes(g, outputs, c.fed)
    reads = {_full_ref(r) for m in needed for r in m.inputs} | {_full_ref(o) for o in outputs}

    def fed_only(n):  # (a node some output of which is fed, and no other one read: the feed)
        mine = f"{n.name}:"
        return any(r.startswith(mine) for r in c.fed) and not any(
            r.startswith(mine) for r in reads - c.fed)
    c.convert_nodes((), [n for n in needed if not fed_only(n)])

    for o in outputs:
        nm, idx = split_ref(o)
        if o not in c.env and f"{nm}:0" in c.env:
            raise ConversionError(f"output {o!r}: {g.nodes[nm]} has no output {idx}")
        v = c.value(o)
        if not isinstance(v, str) or v in c.seq_of:
            raise ConversionError(f"output {o!r} is a TensorArray/stack handle or flow, not a tensor")
        fed = next((vi for vi in c.scope.inputs if vi.name == o), None)
        if fed is not None:  # an input asked for as an output: listed as both, nothing makes it
            c.scope.outputs.append(fed)
            continue
        c.scope.nodes.append(helper.make_node("Identity", [v], [o], name=c.fresh(o + "/output")))
        c.scope.outputs.append(helper.make_empty_tensor_value_info(o))
    return _finish(c, name, opset)


# ONNX ops (that handlers emit) without a kernel for an input type in onnxruntime's CPU provider
# (1.31): a model with one converts, then fails to load. Elementwise functions are built from
# other ops for float64 (:mod:`.special`); these are refused.
MISSING_KERNELS = {
    TensorProto.DOUBLE: {"Conv", "ConvTranspose", "AveragePool", "Det", "LRN", "Tan", "Asin",
                         "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Erf",
                         "Hardmax", "GridSample", "MaxUnpool", "Col2Im", "InstanceNormalization"},
}


def _refuse_missing_kernels(c: Converter, m: onnx.ModelProto) -> None:
    """A clear error, naming the TF node, its op and the dtype, for a node whose ONNX op has no
    onnxruntime CPU kernel for its (first) input's element type (:data:`MISSING_KERNELS`),
    instead of a model that converts and then cannot be run. IsInf, which has no float16 or
    bfloat16 kernel either, reads its input cast to float32 instead (exactly: infinities stay
    infinite, finite values finite)."""
    from ...inference import graphs_of

    graphs = graphs_of(m.graph)
    types = {t.name: t.data_type for g in graphs for t in g.initializer}
    types.update({vi.name: vi.type.tensor_type.elem_type for g in graphs
                  for vi in [*g.input, *g.output, *g.value_info]
                  if vi.type.WhichOneof("value") == "tensor_type"})
    for g in graphs:
        for i in reversed(range(len(g.node))):
            nd = g.node[i]
            if nd.op_type == "IsInf" and nd.domain in ("", "ai.onnx") and \
                    types.get(nd.input[0]) in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
                wide = c.fresh(f"{nd.name}/float32")
                g.node.insert(i, helper.make_node("Cast", [nd.input[0]], [wide], name=wide,
                                                  to=TensorProto.FLOAT))
                nd.input[0] = wide
        for nd in g.node:
            if nd.domain not in ("", "ai.onnx") or not nd.input:
                continue
            t = types.get(nd.input[0])
            if nd.op_type in MISSING_KERNELS.get(t, ()):
                tf_node = c.made_by.get(nd.name)
                dtype = TensorProto.DataType.Name(t).lower()
                raise ConversionError(
                    f"{tf_node or nd.name}: not supported in {dtype}: it converts to ONNX "
                    f"{nd.op_type}, which onnxruntime's CPU has no {dtype} kernel for (the model "
                    "would not run); convert the graph in float32")


def _ref(name, what: str) -> str:
    if not isinstance(name, str):
        raise ConversionError(f"{what} {name!r}: tensor names are strings, such as 'y:0'")
    ref = name if ":" in name else f"{name}:0"
    if not re.fullmatch(r"[^:]+:\d+", ref):
        raise ConversionError(f"{what} {name!r} is not a tensor name (node:index, e.g. 'y:0')")
    return ref


def _check_opset(opset) -> int:
    """The converter writes opset-18 forms (Reduce* with axes inputs, ...); another opset is
    reached with onnx's version converter, and the result is checked, so an opset too old for
    the graph is an error, never an invalid model."""
    if opset is None:
        return DEFAULT_OPSET
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, int) or not 1 <= opset <= newest:
        raise ConversionError(f"opset {opset!r}: the installed onnx knows opsets 1 to {newest}")
    return opset


def _record_weights(c: Converter, m: onnx.ModelProto) -> None:
    """What training may change, in the model's metadata (onnxgrad.training.step reads it): a
    SavedModel's trainable variables as its weights; as not trained, its other variables, the
    frozen statistics a FusedBatchNorm reads (a GraphDef's moving mean and variance) and the
    float constants the converter made itself (an epsilon, gelu's 0.5), which no TF Const holds."""
    from ...training.step import NOT_TRAINED_KEY, WEIGHTS_KEY
    inits = {t.name for t in m.graph.initializer}
    not_trained = {t.name: "a constant the converter made (no TF Const holds it)"
                   for t in m.graph.initializer
                   if t.data_type in FLOAT_TYPES and t.name not in c.weight_values}
    if c.weights is not None:
        m.metadata_props.add(key=WEIGHTS_KEY, value=json.dumps(
            [f"{w}:0" for w, trainable in c.weights.items() if trainable and f"{w}:0" in inits]))
        not_trained.update({f"{w}:0": "a variable the SavedModel marks not trainable (a "
                            "layer's state, such as BatchNormalization's moving statistics)"
                            for w, trainable in c.weights.items()
                            if not trainable and f"{w}:0" in inits})
    source = {n.output[0]: n.input[0] for n in m.graph.node if n.op_type == "Identity"}
    for value, node in c.statistics.items():
        while value in source and value not in inits:
            value = source[value]
        if value in inits and value not in not_trained:
            not_trained[value] = f"a moving statistic that {node!r} (FusedBatchNorm) reads"
    if not_trained:
        m.metadata_props.add(key=NOT_TRAINED_KEY, value=json.dumps(not_trained))


def _finish(c: Converter, name: str, opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from ...runtime import MAX_IR_VERSION

    g = c.scope.graph(name)
    g.initializer.extend(c.initializers)

    imports = [helper.make_opsetid("", c.opset)]
    imports += [helper.make_opsetid(d, 1) for d in sorted(c.domains)]
    from ...training.losses import TF_PRODUCER  # (its losses read TF's layout from it)
    m = helper.make_model(g, opset_imports=imports, ir_version=min(10, MAX_IR_VERSION),
                          producer_name=TF_PRODUCER)
    model = ir.from_proto(m)
    RemoveUnusedNodesPass()(model)
    for init in list(model.graph.initializers.values()):
        if not init.uses():
            del model.graph.initializers[init.name]
    m = ir.to_proto(model)
    from ...rnn.ops import walk_nodes
    live = {o for nd in walk_nodes(m.graph) for o in nd.output}
    stops = [v for v in c.stop_gradients if v in live]
    if stops:
        from ...autodiff import STOP_GRADIENTS_KEY
        m.metadata_props.add(key=STOP_GRADIENTS_KEY, value=json.dumps(stops))
    prevents = {v: msg for v, msg in c.prevent_gradients.items() if v in live}
    if prevents:
        from ...autodiff import PREVENT_GRADIENTS_KEY
        m.metadata_props.add(key=PREVENT_GRADIENTS_KEY, value=json.dumps(prevents))
    _record_weights(c, m)
    if "onnxgrad" in c.domains:
        from ...rnn import attach_functions
        m = attach_functions(m)
    _guard_range_gathers(m)
    from .ranks import infer
    m = infer(m, _tf_shapes(c))
    _refuse_missing_kernels(c, m)
    m = _declare_outputs(c, m)
    from ...ort_fusions import guard_pad_fusion
    return guard_pad_fusion(m if opset == c.opset else _to_opset(m, opset))


def _guard_range_gathers(m: onnx.ModelProto) -> None:
    """A Range read only by a Gather's indices computes them in float64 and casts them back:
    onnxruntime's GatherToSliceFusion (every optimization level from extended) turns Range ->
    Gather into a Slice over Range's bounds, which reads a negative bound as counted from the
    end, so ``tf.gather(x, tf.range(n - 1, -1, -1))`` came out empty on stock onnxruntime.
    A Range of constant bounds that are all non-negative, with a positive step, slices alike
    and stays as it is. (The converter writes opset 18: CastLike keeps the index type.)"""
    from ...inference import constant_tensors, graphs_of, unique_name
    graphs = graphs_of(m.graph)
    taken = {o for g in graphs for nd in g.node for o in [*nd.output, nd.name]}
    for g in graphs:
        consts = constant_tensors(g)
        readers: dict[str, list] = {}
        for nd in g.node:
            for i, x in enumerate(nd.input):
                readers.setdefault(x, []).append((nd, i))
        outs = {o.name for o in g.output}
        fixed = []
        for nd in g.node:
            use = readers.get(nd.output[0], []) if nd.op_type == "Range" else []
            if len(use) != 1 or use[0][0].op_type != "Gather" or use[0][1] != 1 or \
                    nd.output[0] in outs:
                fixed.append(nd)
                continue
            bounds = [None if x not in consts else numpy_helper.to_array(consts[x])
                      for x in nd.input]
            if all(b is not None for b in bounds) and bounds[0] >= 0 and bounds[1] >= 0 and \
                    bounds[2] > 0:
                fixed.append(nd)
                continue
            base = nd.name or nd.output[0]
            wide = [unique_name(f"{base}/f64_{k}", taken) for k in range(4)]
            fixed += [helper.make_node("Cast", [x], [w], name=w, to=TensorProto.DOUBLE)
                      for x, w in zip(nd.input, wide)]
            fixed.append(helper.make_node("Range", wide[:3], [wide[3]], name=base))
            fixed.append(helper.make_node("CastLike", [wide[3], nd.input[0]], [nd.output[0]],
                                          name=unique_name(f"{base}/indices", taken)))
        if len(fixed) != len(g.node):
            del g.node[:]
            g.node.extend(fixed)


def _declare_outputs(c: Converter, m: onnx.ModelProto) -> onnx.ModelProto:
    """Graph outputs typed as inference found them. An output whose rank neither TF nor ONNX
    can tell (a value popped from a stack, read from a TensorArray without element shapes), like
    a placeholder of unknown rank, has no valid declaration: onnx.checker wants a shape on every
    main-graph input and output. Refused, naming them; with ``allow_unranked`` declared with
    its element type only (onnxruntime runs the model), the model checked with those declared
    as scalars, and a ConversionWarning names them."""
    import warnings

    from .errors import ConversionWarning
    from .ranks import rank
    known = {vi.name: vi for vi in [*m.graph.value_info, *m.graph.input, *m.graph.output]}
    unranked = []
    for out in m.graph.output:
        vi = known.get(out.name)
        if vi is not None and rank(vi.type) is not None:
            out.type.CopyFrom(vi.type)
            continue
        elem = vi.type.tensor_type.elem_type if vi is not None and vi.type.HasField(
            "tensor_type") else 0
        if not elem:
            elem = _tf_dtype(c, out.name)
        out.type.CopyFrom(helper.make_tensor_type_proto(elem, None))
        unranked.append(out.name)
    unranked += [i.name for i in m.graph.input if rank(i.type) is None]
    if not unranked:
        _check_valid(m)
        return m
    fixes = ("give the placeholders a shape, reshape such outputs in TF, or export with "
             "add_shapes=True where TF knows their shapes")
    if not c.allow_unranked:
        raise ConversionError(
            f"{unranked}: their rank is known only at run time (TensorFlow does not know it "
            "either), and ONNX has no declaration for a main-graph input or output without "
            f"one (onnx.checker refuses such a model): {fixes}; or pass allow_unranked=True "
            "(onnxgrad convert --allow-unranked) for a model that onnxruntime runs but "
            "onnx.checker refuses")
    probe = onnx.ModelProto()
    probe.CopyFrom(m)
    for vi in [*probe.graph.input, *probe.graph.output]:
        if vi.name in unranked:
            vi.type.tensor_type.shape.SetInParent()
    _check_valid(m, probe)
    warnings.warn(ConversionWarning(
        f"{unranked}: their rank is known only at run time (TensorFlow does not know it "
        "either), so they are declared without a shape (allow_unranked); onnxruntime runs the "
        f"model, onnx.checker refuses it: {fixes}"), stacklevel=4)
    return m


def _check_valid(m: onnx.ModelProto, probe: onnx.ModelProto | None = None) -> None:
    """onnx's checker (on ``probe``, the model with its unranked outputs declared as scalars,
    where there are such) and its strict shape inference: a model the converter made invalid
    is its defect, refused here rather than returned (or written by the command line)."""
    try:
        onnx.checker.check_model(probe or m)
        onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        why = " ".join(str(e).split())[:500]
        raise ConversionError(f"the converted model is not valid ONNX ({why}): a converter "
                              "defect; please report it with the graph") from None


def _to_opset(m: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    try:
        out = convert_version(m, opset)
        onnx.checker.check_model(out, full_check=True)
    except Exception as e:  # noqa: BLE001  (the converter and checker raise several kinds)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0].split("failed: ")[-1]
        raise ConversionError(f"opset {opset}: the converter writes opset {DEFAULT_OPSET} and "
                              f"onnx's version converter cannot bring this graph to opset "
                              f"{opset} ({why})") from None
    return out



def _tf_dtype(c: Converter, ref: str) -> int:
    """The ONNX element type of TF tensor ``ref``, from its node's attributes."""
    n = c.g.nodes[split_ref(ref)[0]]
    for key in ("T", "dtype", "elem_type", "element_dtype", "out_type", "DstT"):
        if key in n.attr and n.attr[key].WhichOneof("value") == "type":
            return onnx_dtype(n.attr[key].type, n)
    raise ConversionError(f"output {ref!r}: cannot tell its element type")


def _tf_shapes(c: Converter) -> dict:
    """ONNX name -> TF's static shape, for main-graph values of nodes that carry
    ``_output_shapes`` (GraphDefs written with add_shapes=True)."""
    out = {}
    for n in c.g.nodes.values():
        for i, shape in enumerate(c.attr(n, "_output_shapes") or ()):
            v = c.env.get(f"{n.name}:{i}")
            if isinstance(v, str) and shape is not None and v not in c.seq_of:
                out.setdefault(v, shape)
                out.setdefault(f"{n.name}:{i}", shape)  # graph outputs keep TF's names
    return out


def _full_ref(ref: str) -> str:
    """A tensor reference with its output index ("sp" is "sp:0")."""
    nm, idx = split_ref(ref)
    return f"{nm}:{idx}"


def _swish(g, n) -> bool:
    """Whether ``n`` is the IdentityN of TF's swish / silu (Keras's "swish" and "silu"):
    IdentityN(x * sigmoid(beta * x), x, beta). Its custom gradient is that product's own
    derivative, written out to save memory: differentiating the forward ops gives the same."""
    if n.op != "IdentityN" or len(n.inputs) != 3:
        return False
    y, x, beta = (split_ref(r) for r in n.inputs)

    def node(ref):
        return g.nodes.get(ref[0]) if ref[1] == 0 else None

    def operands(m, op):
        return ({split_ref(r) for r in m.inputs} if m is not None and m.op == op
                and len(m.inputs) == 2 else set())
    prod = node(y)
    ins = operands(prod, "Mul")
    if x not in ins or len(ins) != 2:
        return False
    sig = node(next(iter(ins - {x})))
    if sig is None or sig.op != "Sigmoid" or len(sig.inputs) != 1:
        return False
    return operands(node(split_ref(sig.inputs[0])), "Mul") == {x, beta}
