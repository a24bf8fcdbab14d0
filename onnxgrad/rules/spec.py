"""What the ONNX schemas say about a rule's node (attribute defaults), and which float inputs
get no gradient and why (``NO_GRADIENT``, printed by ``onnxgrad ops``).

A rule reads its attributes through :func:`attr`, so an absent attribute takes the default the
schema of the node's opset gives, the constant the forward itself uses: Selu's alpha is the
float32 1.67326319217681884765625, not the more exact 1.6732632423543772, and a derivative built
from the more exact one is off by 3e-8 relative in float64.
"""
from __future__ import annotations

import functools

import onnx
import onnx.defs
from onnx import helper

_UNDEFINED = onnx.AttributeProto.UNDEFINED


@functools.lru_cache(maxsize=None)
def _schema(domain: str, op_type: str, opset: int):
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None


@functools.lru_cache(maxsize=None)
def _ort_defaults(domain: str, op_type: str) -> dict:
    """{attribute: AttributeProto} defaults of an op onnxruntime defines (com.microsoft), from
    its own schema registry (onnx has no schema for them)."""
    from ..runtime import ort_module
    state = ort_module().capi.onnxruntime_pybind11_state
    schema = max((s for s in state.get_all_operator_schema()
                  if s.domain == domain and s.name == op_type),
                 key=lambda s: s.since_version, default=None)
    if schema is None:
        return {}
    out = {k: onnx.AttributeProto.FromString(a._default_value)
           for k, a in schema.attributes.items() if a._default_value}
    return {k: a for k, a in out.items() if a.type != _UNDEFINED}


@functools.lru_cache(maxsize=None)
def default(domain: str, op_type: str, opset: int, name: str):
    """The schema's default of attribute ``name`` (None when it has none); strings as str,
    lists as tuples. Ops of onnxruntime's com.microsoft domain: onnxruntime's schema."""
    if domain == "com.microsoft":
        proto = _ort_defaults(domain, op_type).get(name)
    else:
        schema = _schema(domain, op_type, opset)
        a = None if schema is None else schema.attributes.get(name)
        proto = None if a is None or a.default_value.type == _UNDEFINED else a.default_value
    if proto is None:
        return None
    v = helper.get_attribute_value(proto)
    if isinstance(v, bytes):
        return v.decode()
    return tuple(v) if isinstance(v, list) else v


def attr(n, name: str, otherwise=None):
    """Attribute ``name`` of the rule's node, else its schema default, else ``otherwise`` (for
    an attribute the node's opset does not have: ReduceMean-13's noop_with_empty_axes)."""
    v = n.attr(name)
    if v is not None:
        return v.decode() if isinstance(v, bytes) else v
    d = default(n.node.domain or "", n.node.op_type, n.opset, name)
    if d is None:
        return otherwise
    return list(d) if isinstance(d, tuple) else d


# op type -> {float input (the schema's name): why it gets no gradient}. A rule returns None
# for a float input only when its op is listed here; `onnxgrad ops` prints the reasons.
NO_GRADIENT: dict[str, dict[str, str]] = {}


def no_gradient(op_type: str, **why: str) -> None:
    """Declare float inputs of ``op_type`` that get no gradient, with the reason."""
    NO_GRADIENT.setdefault(op_type, {}).update(why)
