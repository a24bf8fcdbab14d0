"""Gradient rules for ONNX optionals: Optional, OptionalGetElement (OptionalHasElement's output
is a bool: no gradient flows through it).

The gradient of an optional value is an optional holding the gradient of its element, so it
has the value's own type (the engine names it ``<name>@<scope>`` as it does sequences);
gradients of one optional add up element-wise. OptionalGetElement of a plain tensor or
sequence (allowed from opset 18) is the identity.
"""
from __future__ import annotations

import onnx_ir as ir

from ..emitter import V
from ..registry import register, register_add
from .sequence import is_seq, seq_add


def _is_optional(v) -> bool:
    return isinstance((v.value if isinstance(v, V) else v).type, ir.OptionalType)


def _wrap(e, g: V) -> V:
    """An optional holding g."""
    elem = g.value.type or ir.TensorType(g.dtype)
    out = e.op("Optional", g, _dtype=g.dtype)
    out.value.type = ir.OptionalType(elem)
    return V(out.value, e, g.dtype, None)


def _unwrap(e, o: V) -> V:
    """The element of optional o."""
    elem = o.value.type.elem_type
    out = e.op("OptionalGetElement", o, _dtype=o.dtype)
    out.value.type = elem
    return V(out.value, e, o.dtype, o.shape if isinstance(elem, ir.TensorType) else None)


def _add(e, a: V, b: V) -> V:
    x, y = _unwrap(e, a), _unwrap(e, b)
    return _wrap(e, seq_add(e, x, y) if is_seq(x) else x + y)


register_add(ir.OptionalType, _add)


@register("OptionalGetElement", since=15)
def _get_element(n, g):
    return _wrap(n.e, g) if _is_optional(n.x) else g


@register("Optional", since=15)
def _optional(n, g):
    if not n.ins or n.x is None:  # an empty optional reads nothing
        return ()
    return _unwrap(n.e, g)
