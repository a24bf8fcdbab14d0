"""The gradient-rule registry: (domain, op_type) -> rules, each for an opset range.

A rule is ``rule(n, g)``: ``n`` is the :class:`Node` context below, ``g`` the gradient of the
node's first output (None when it has none; ``n.gs`` holds all of them). It returns the gradient
of each input: one value for a single-input op, or a tuple (None for an input with no gradient).
"""
from __future__ import annotations

import bisect
from typing import Callable

import numpy as np
import onnx_ir as ir

from .emitter import Emitter, V

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
            used.add(node.domain)
            stack.extend(a.g for a in node.attribute if a.HasField("g"))
            stack.extend(g for a in node.attribute for g in a.graphs)
    for domain in sorted(used & _FUNCTIONS.keys()):
        model = _FUNCTIONS[domain](model)
    return model


def lookup(domain: str, op_type: str, opset: int) -> Rule | None:
    for since, until, fn in reversed(_RULES.get((domain, op_type), ())):
        if since <= opset <= until:
            return fn
    return None


def supported_ops() -> list[tuple[str, str, int, int | None]]:
    """(domain, op_type, since, until) rows, sorted; until is None when open-ended."""
    rows = [(d, op, s, None if u == _MAX else u)
            for (d, op), entries in _RULES.items() for s, u, _ in entries]
    return sorted(rows)


class Node:
    """What a rule sees of the forward node: its inputs, outputs, attributes and gradients."""

    def __init__(self, node: ir.Node, e: Emitter, gs: list[V | None], opset: int):
        self.node, self.e, self.gs, self.opset = node, e, gs, opset
        self.ins = [e.wrap(v) for v in node.inputs]
        self.outs = [e.wrap(v) for v in node.outputs]

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
        if i >= len(self.node.inputs) or self.node.inputs[i] is None:
            return None
        v = self.node.inputs[i]
        tensor = v.const_value
        if tensor is None and v.producer() is not None and v.producer().op_type == "Constant":
            attr = v.producer().attributes.get("value")
            tensor = attr.value if attr is not None else None
        if tensor is None or v.is_graph_input():
            return None
        return tensor.numpy()

    def sum_to(self, t: V, x: V) -> V:
        return self.e.sum_to(t, x)
