"""The gradient-rule registry: (domain, op_type) -> rules, each for an opset range.

A rule is ``rule(n, g)``: ``n`` is the :class:`Node` context below, ``g`` the gradient of the
node's first output (None when it has none; ``n.gs`` holds all of them). It returns the gradient
of each input: one value for a single-input op, or a tuple (None for an input with no gradient).
A rule that never reads ``n.gs`` handles its first output's gradient alone: where another output
has one too, the engine refuses the call instead of dropping it.

Nodes with subgraphs (If, Loop, Scan, SequenceMap) also read outer-scope values implicitly
(:func:`captured` lists them). Their rules return ``Grads(inputs, captured={value: grad})``: the
per-input tuple as above plus the gradients of captured outer values, keyed by the ir.Value.

What a rule may use beyond its node's values (the whole API between rules and the engine):

- ``n.e``: the :class:`~onnxgrad.emitter.Emitter` appending to the graph being differentiated;
  ``n.e.child(graph, prefix)`` is an emitter for a new subgraph (names stay unique per call).
- ``n.wants(value)``: whether the engine needs that input's (or captured value's) gradient; a
  rule may skip work for the others.
- ``n.differentiate(graph, seeds, xs, e)``: the engine's reverse sweep on another graph (a loop or
  branch body that the rule has cloned into ``e.graph``): ``seeds`` maps values to gradients,
  ``xs`` are values of that graph or outer-scope values it reads; returns one gradient or None
  per x. The sweep may meet further control flow and recurse again.
- ``n.reached(graph, x)``: the values of a body that depend on x (a body input, or an outer
  value it reads), past the model's stops: which of a loop's values reach ys at all
  (``rules.control.connected``), so that the others get None, not zeros.
- A rule may mutate its own forward node in place (``node.resize_outputs`` plus new body outputs,
  as the Loop rule does to save per-iteration state); the node's existing outputs must stay.

Gradients of values that are not tensors (sequences) are added with the function registered by
:func:`register_add` for their type, and the engine names them ``<name>@<scope>``.
"""
from __future__ import annotations

import bisect
import functools
from typing import Callable

import numpy as np
import onnx
import onnx.defs
import onnx_ir as ir

from .emitter import Emitter, V
from .inference import WITH_SUBGRAPHS


def constant_value(v: ir.Value | None) -> np.ndarray | None:
    """v's value when it is a constant: a Constant node's, or an initializer's that is not also
    a graph input (a caller may feed another value there); else None."""
    if v is None:
        return None
    tensor = v.const_value
    if tensor is None and v.producer() is not None and v.producer().op_type == "Constant":
        attr = v.producer().attributes.get("value")
        tensor = attr.value if attr is not None else None
    if tensor is None or v.is_graph_input():
        return None
    return tensor.numpy()

Rule = Callable[["Node", "V | None"], object]

# (domain, op_type) -> sorted list of (since_version, until_version_inclusive, rule)
_RULES: dict[tuple[str, str], list[tuple[int, int, Rule]]] = {}
_MAX = 10**6


def register(op_types: str | list[str], rule: Rule | None = None, *, domain: str = "",
             since: int = 1, until: int = _MAX):
    """Register ``rule`` for one or more op types (usable as a decorator)."""
    names = [op_types] if isinstance(op_types, str) else list(op_types)

    def add(fn):
        for op in names:
            entries = _RULES.setdefault((domain, op), [])
            bisect.insort(entries, (since, until, fn), key=lambda e: e[0])
        return fn

    return add if rule is None else add(rule)


def table(rules: dict[str, Rule], *, domain: str = "", since: int = 1, until: int = _MAX):
    """Register a whole table of one-line rules."""
    for op, fn in rules.items():
        register(op, fn, domain=domain, since=since, until=until)


# custom domain -> fn(ModelProto) -> ModelProto that adds the FunctionProtos of its ops
_FUNCTIONS: dict[str, Callable] = {}


def functions_for(domain: str, attach: Callable) -> None:
    """Register how to attach the function bodies of ``domain``'s ops to a model using them."""
    _FUNCTIONS[domain] = attach


def attach_functions(model):
    """Give a model the function bodies of every custom-domain op it uses, so any runtime runs it."""
    used = set()
    stack = [model.graph]
    while stack:
        for node in stack.pop().node:
            domain = node.domain
            used.add(domain)
            # only these ai.onnx ops have graph attributes: reading every node's attributes
            # costs 5x the walk on a large model
            if (domain and domain != "ai.onnx") or node.op_type in WITH_SUBGRAPHS:
                for a in node.attribute:
                    if a.type == onnx.AttributeProto.GRAPH:
                        stack.append(a.g)
                    elif a.type == onnx.AttributeProto.GRAPHS:
                        stack.extend(a.graphs)
    for domain in sorted(used & _FUNCTIONS.keys()):
        model = _FUNCTIONS[domain](model)
    return model


def own_domain(domain: str) -> bool:
    """Whether ``domain`` holds onnxgrad's own ops (whose bodies attach_functions supplies)."""
    return domain in _FUNCTIONS


_FALLBACK: list[Rule] = []  # the rule for ops with a function body and no rule of their own


def fallback(rule: Rule) -> Rule:
    """Register the rule used for an op that has a function body (an ai.onnx schema's, or the
    model's own) but no rule."""
    _FALLBACK[:] = [rule]
    return rule


@functools.lru_cache(maxsize=None)
def _has_function(op_type: str, opset: int) -> bool:
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    return schema.has_function or schema.has_context_dependent_function


@functools.cache
def _load_rules() -> None:
    """Import the rule modules (registering every rule), for a lookup that comes first."""
    from . import rules  # noqa: F401


def lookup(domain: str, op_type: str, opset: int, local: bool = False) -> Rule | None:
    """The rule for an op; ``local``: the model defines a function of that name (its body is
    differentiated when no rule is registered). Never the body of an op of onnxgrad's own
    domains (the functions attach_functions adds): their rules leave buffers such as the RNN's
    reserve_space without a gradient, so the body of an op that reads them (the RNN backward,
    in a second-order call) would be differentiated without those terms; they are refused."""
    _load_rules()
    for since, until, fn in reversed(_RULES.get((domain, op_type), ())):
        if since <= opset <= until:
            return fn
    if _FALLBACK and (local and not own_domain(domain) or
                      domain == "" and _has_function(op_type, opset)):
        return _FALLBACK[0]
    return None


# gradient graphs are written at ai.onnx opset 13 or newer; older models are upgraded first
MIN_OPSET = 13


def supported_ops() -> list[tuple[str, str, int, int | None]]:
    """(domain, op_type, since, until) rows, sorted; until is None when open-ended. For ai.onnx,
    since is at least MIN_OPSET: a model with an older opset is upgraded before any rule runs."""
    _load_rules()
    rows = [(d, op, max(s, MIN_OPSET) if d == "" else s, None if u == _MAX else u)
            for (d, op), entries in _RULES.items() for s, u, _ in entries
            if d != "" or u >= MIN_OPSET]
    if _FALLBACK:  # ops covered only through their function body
        newest = onnx.defs.onnx_opset_version()
        rows += [("", schema.name, max(schema.since_version, MIN_OPSET), None)
                 for schema in onnx.defs.get_all_schemas()
                 if schema.domain == "" and ("", schema.name) not in _RULES
                 and not schema.deprecated and _has_function(schema.name, newest)]
    return sorted(rows, key=lambda r: (r[0], r[1], r[2], _MAX if r[3] is None else r[3]))


class Grads:
    """A rule's result with gradients for captured outer-scope values (see the module docstring)."""

    __slots__ = ("inputs", "captured")

    def __init__(self, inputs=(), captured=None):
        self.inputs = tuple(inputs)
        self.captured = dict(captured or {})

    @classmethod
    def by_value(cls, e, inputs, grads) -> "Grads":
        """The gradients of a node that the rule replaced (``Emitter.replace``), keyed by its
        former ``inputs`` (aligned with ``grads``): a value that was several inputs gets the
        sum."""
        out: dict = {}
        for v, gv in zip(inputs, grads):
            if v is not None and gv is not None:
                out[v] = e.Add(out[v], gv) if v in out else gv
        return cls((), out)


# ir type class (ir.SequenceType, ...) -> add(e, a, b) -> V: how gradients of that type add up
_ADDERS: dict[type, Callable] = {}


def register_add(type_class: type, add: Callable) -> None:
    """Register how two gradients of a non-tensor type add (elementwise) up."""
    _ADDERS[type_class] = add


def add_for(t) -> Callable | None:
    """The add registered for a value's type (None for tensors and unknown types)."""
    return None if t is None or isinstance(t, ir.TensorType) else _ADDERS.get(type(t))


def subgraphs(node: ir.Node) -> list[ir.Graph]:
    out = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            out.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            out.extend(attr.value)
    return out


def captured(node: ir.Node) -> list[ir.Value]:
    """Outer-scope values a node's subgraphs read (they are inputs of the node, implicitly)."""
    inner, used = set(), []
    for g in subgraphs(node):
        inner.update(g.inputs)
        inner.update(g.initializers.values())
        for n in ir.traversal.RecursiveGraphIterator(g):
            inner.update(n.outputs)
            for sub in subgraphs(n):
                inner.update(sub.inputs)
                inner.update(sub.initializers.values())
            used.extend(v for v in n.inputs if v is not None)
    return [v for v in dict.fromkeys(used) if v not in inner]


class Node:
    """What a rule sees of the forward node: its inputs, outputs, attributes and gradients."""

    def __init__(self, node: ir.Node, e: Emitter, gs: list[V | None], opset: int, engine=None,
                 live=None):
        self.node, self.e, self._gs, self.opset = node, e, gs, opset
        self.read_gs = False
        # (dtype and shape read now: every rule reads most of them, and a V reads an unset
        # one slowly; frozen shapes' dims are cached)
        self.ins = [None if v is None else V(v, e, v.dtype, e.dims(v)) for v in node.inputs]
        self.outs = [None if v is None else V(v, e, v.dtype, e.dims(v)) for v in node.outputs]
        self._engine, self._live = engine, live

    @property
    def gs(self) -> list[V | None]:
        """The gradient of each output (None where it has none)."""
        self.read_gs = True
        return self._gs

    def local_function(self) -> onnx.FunctionProto | None:
        """The model-local function this node calls, if the model defines one (not to mutate)."""
        return self._engine.function_protos.get(self.node.op_identifier()) if self._engine \
            else None

    def model_functions(self) -> list[onnx.FunctionProto]:
        """The model's own functions (for shape inference of a body that calls them)."""
        return list(self._engine.function_protos.values()) if self._engine else []

    def wants(self, value) -> bool:
        """Whether the gradient of ``value`` (an input or captured ir.Value, or a V) is needed."""
        v = value.value if isinstance(value, V) else value
        return v is not None and (self._live is None or v in self._live)

    def reached(self, graph: ir.Graph, x) -> set:
        """The values of ``graph`` (a subgraph of this node) that depend on ``x``, one of its
        inputs or an outer value it reads, through float values."""
        return self._engine.reach(graph, x)

    def differentiate(self, graph: ir.Graph, seeds: dict, xs: list, e: Emitter, stop=()):
        """The engine's sweep on ``graph`` (see the module docstring)."""
        seeds = {k: (list(v) if isinstance(v, (list, tuple)) else [v])
                 for k, v in seeds.items() if v is not None}
        return self._engine.sweep(graph, e, seeds, list(xs), set(stop), owner=self)

    x = property(lambda self: self.ins[0])
    y = property(lambda self: self.outs[0])

    def attr(self, name: str, default=None):
        a = self.node.attributes.get(name)
        if a is None:
            return default
        v = a.value
        return list(v) if isinstance(v, tuple) else v

    def input(self, i: int) -> V | None:
        """Input i, or None when it is absent (past the end or given as an empty name)."""
        return self.ins[i] if i < len(self.ins) else None

    def const(self, i: int) -> np.ndarray | None:
        """Input i's value when it is a constant (initializer or Constant node), else None."""
        return constant_value(self.node.inputs[i]) if i < len(self.node.inputs) else None

    def sum_to(self, t: V, x: V) -> V:
        return self.e.sum_to(t, x)
