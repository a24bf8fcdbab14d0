"""Gradient rules for ONNX sequence ops (TensorArray semantics, see DESIGN.md).

The gradient of a sequence value is a sequence of the same length whose element i is the gradient
of element i (zeros where nothing flowed). Contributions add elementwise (``seq_add``, registered
with the engine for ``ir.SequenceType``); the engine names the summed gradient ``S@<scope>``.
A rule never needs the forward sequence when a gradient sequence already carries its length
(SequenceInsert), so loops that write a sequence need not save it per iteration.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..emitter import V
from ..inference import FLOAT_TYPES
from ..registry import Grads, captured, register, register_add
from .spec import attr

SEQ_OPSET = 17  # SequenceMap


def is_seq(v) -> bool:
    t = (v.value if isinstance(v, V) else v).type
    return isinstance(t, ir.SequenceType)


def seq_type(dtype) -> ir.SequenceType:
    return ir.SequenceType(ir.TensorType(dtype))


def sop(e, op_type, *inputs, _dtype=None, **attrs) -> V:
    """Emit a sequence-valued op (the output typed as a sequence of ``_dtype`` tensors)."""
    out = e.op(op_type, *inputs, **attrs)
    dtype = _dtype or out.dtype
    out.value.type = seq_type(dtype)
    return V(out.value, e, dtype, None)


def _map(e, fn, seqs, dtypes, n_out=1):
    """SequenceMap(seqs) whose body is ``fn(body_emitter, *elements) -> V or tuple``; the
    element dtypes of the outputs are ``dtypes``."""
    e.need(SEQ_OPSET)
    ins = [ir.Value(name=e.unique(f"{e.prefix}/map_in"), type=ir.TensorType(s.dtype))
           for s in seqs]
    body = ir.Graph(ins, [], nodes=[], name=e.unique(f"{e.prefix}/map_body"))
    be = e.child(body, f"{e.prefix}/map")
    outs = fn(be, *[V(v, be) for v in ins])
    outs = outs if isinstance(outs, tuple) else (outs,)
    for o in outs:
        body.outputs.append(be.op("Identity", o).value)
    res = e.op("SequenceMap", *seqs, body=body, _outputs=n_out)
    res = res if isinstance(res, tuple) else (res,)
    for r, d in zip(res, dtypes):
        r.value.type = seq_type(d)
    return tuple(V(r.value, e, d, None) for r, d in zip(res, dtypes))


def seq_zeros_like(e, s: V) -> V:
    """A sequence of zeros shaped like each element of ``s``."""
    return _map(e, lambda be, x: be.zeros_like(x), [s], [s.dtype])[0]


def seq_add(e, a: V, b: V) -> V:
    """Elementwise sum of two sequences of the same length."""
    return _map(e, lambda be, x, y: x + y, [a, b], [a.dtype])[0]


register_add(ir.SequenceType, seq_add)


def zeros_for(e, v: V) -> V:
    """Zeros like a tensor or a sequence."""
    return seq_zeros_like(e, v) if is_seq(v) else e.zeros_like(v)


def position(e, p: V | None) -> V | None:
    """A sequence position as int64 (ONNX takes int32 too)."""
    if p is None:
        return None
    return p if p.dtype == ir.DataType.INT64 else e.Cast(p, to=ir.DataType.INT64)


def norm_position(e, p: V, length: V) -> V:
    """A position made non-negative against ``length``."""
    zero = e.const(np.array(0, np.int64))
    return e.Where(e.Less(p, zero), p + length, p)


def one_hot(e, s: V, pos: V, g: V) -> V:
    """zeros like ``s`` with ``g`` at ``pos``."""
    z = seq_zeros_like(e, s)
    p = norm_position(e, position(e, pos), e.SequenceLength(s, _dtype=ir.DataType.INT64))
    return sop(e, "SequenceInsert", sop(e, "SequenceErase", z, p), g, p)


@register("SequenceEmpty")
def _empty(n, g):
    return ()


@register("SequenceLength")
def _length(n, g):
    return None


@register("SequenceConstruct")
def _construct(n, g):
    e = n.e
    return tuple(None if not n.wants(x) else e.SequenceAt(g, e.const(np.array(i, np.int64)))
                 for i, x in enumerate(n.ins))


@register("SequenceAt")
def _at(n, g):
    return one_hot(n.e, n.x, n.ins[1], g), None


@register("SequenceInsert")
def _insert(n, g):
    e = n.e
    p = position(e, n.input(2))
    if p is None:  # appended: the last element of g
        gt = e.SequenceAt(g, e.const(np.array(-1, np.int64))) if n.wants(n.ins[1]) else None
        return sop(e, "SequenceErase", g), gt, None
    # normalized against len(S) = len(g) - 1, so the forward sequence is not needed
    p = norm_position(e, p, e.SequenceLength(g, _dtype=ir.DataType.INT64) - _one(e))
    gt = e.SequenceAt(g, p) if n.wants(n.ins[1]) else None
    return sop(e, "SequenceErase", g, p), gt, None


@register("SequenceErase")
def _erase(n, g):
    e, s = n.e, n.x
    p = position(e, n.input(1))
    if p is None:
        last = e.SequenceAt(s, e.const(np.array(-1, np.int64)))
        return sop(e, "SequenceInsert", g, e.zeros_like(last)), None
    p = norm_position(e, p, e.SequenceLength(s, _dtype=ir.DataType.INT64))
    return sop(e, "SequenceInsert", g, e.zeros_like(e.SequenceAt(s, p)), p), None


@register("ConcatFromSequence")
def _concat(n, g):
    e, s = n.e, n.x
    axis, new_axis = n.attr("axis"), attr(n, "new_axis")
    if new_axis:
        return sop(e, "SplitToSequence", g, axis=axis, keepdims=0, _dtype=g.dtype)
    idx = e.const(np.array([axis], np.int64))
    lens = _map(e, lambda be, x: be.Gather(be.Shape(x), idx), [s], [ir.DataType.INT64])[0]
    split = e.ConcatFromSequence(lens, axis=0, _dtype=ir.DataType.INT64)
    return sop(e, "SplitToSequence", g, split, axis=axis, _dtype=g.dtype)


@register("SplitToSequence")
def _split(n, g):
    axis = attr(n, "axis")
    squeezed = n.input(1) is None and attr(n, "keepdims") == 0
    out = n.e.ConcatFromSequence(g, axis=axis, new_axis=1 if squeezed else 0, _dtype=g.dtype)
    return out, None


def _stack_sum(e, s: V) -> V:
    """The sum of a sequence's (same-shaped) elements."""
    st = e.ConcatFromSequence(s, axis=0, new_axis=1, _dtype=s.dtype)
    return e.ReduceSum(st, e.const(np.array([0], np.int64)), keepdims=0)


def float_value(v) -> bool:
    return v is not None and v.dtype in FLOAT_TYPES and isinstance(
        v.type, (ir.TensorType, ir.SequenceType))


def captures(n, sequences: bool = True) -> list:
    """The float tensors and sequences that n's subgraphs read from outside whose gradients are
    needed. An optional among n's inputs, outputs or those values, with a gradient to pass, is
    refused: a body's gradient would have to be made in every branch and step, also where it is
    empty (the rules left it out: a silent zero). So is a sequence, unless ``sequences``: a
    Scan's states and a SequenceMap's elements are tensors, where its gradient would go."""
    caps = captured(n.node)
    gets = [o for o, g in zip(n.node.outputs, n.gs) if g is not None]
    optional = next((v for v in [*caps, *n.node.inputs, *gets] if v is not None
                     and isinstance(v.type, ir.OptionalType) and v.dtype in FLOAT_TYPES
                     and (v in gets or n.wants(v))), None)
    if optional is not None:
        raise NotImplementedError(
            f"the optional {optional.name!r} passes through this node's subgraphs; gradients "
            "of optionals through If, Loop, Scan and SequenceMap are not supported: pass the "
            "element (OptionalGetElement outside the subgraph) instead")
    seq = None if sequences else next((c for c in caps if isinstance(c.type, ir.SequenceType)
                                       and c.dtype in FLOAT_TYPES and n.wants(c)), None)
    if seq is not None:
        raise NotImplementedError(
            f"the sequence {seq.name!r} is read inside the body from outside; its gradient "
            f"would be a state of the backward {n.node.op_type}, which holds tensors only "
            "(a Loop body may read it)")
    return [c for c in caps if float_value(c) and n.wants(c)]


@register("SequenceMap")
def _sequence_map(n, g):
    """A SequenceMap of the body's gradient: per-element gradients of sequence inputs come out as
    sequences; tensor inputs and captured values get the sum over the elements."""
    from .control import clone_into, finish_body  # one module for the subgraph machinery
    e, node = n.e, n.node
    body = node.attributes["body"].value
    caps = captures(n, sequences=False)
    gs = [gi if gi is not None else seq_zeros_like(e, o) for gi, o in zip(n.gs, n.outs)]
    e.need(SEQ_OPSET)
    # body inputs: the forward inputs' elements, then the output gradients' elements
    b_in = [ir.Value(name=e.unique(f"{e.prefix}/in"), type=v.type) for v in body.inputs]
    b_g = [ir.Value(name=e.unique(f"{e.prefix}/g"), type=o.type) for o in body.outputs]
    bb = ir.Graph([*b_in, *b_g], [], nodes=[], name=e.unique(f"{e.prefix}/body"))
    be = e.child(bb, f"{e.prefix}/body")
    vmap = clone_into(be, body, dict(zip(body.inputs, b_in)))
    seeds = {vmap[o]: V(gv, be) for o, gv in zip(body.outputs, b_g) if float_value(o)}
    wanted = [i for i, x in enumerate(node.inputs) if float_value(x) and n.wants(x)]
    xs = [b_in[i] for i in wanted] + caps
    res = n.differentiate(bb, seeds, xs, be)
    outs = [r if r is not None else be.zeros_like(V(x, be)) for r, x in zip(res, xs)]
    finish_body(be, bb, outs, xs)
    out_types = [x.dtype for x in xs]
    mapped = e.op("SequenceMap", *n.ins, *gs, body=bb, _outputs=len(xs)) if xs else ()
    mapped = mapped if isinstance(mapped, tuple) else (mapped,)
    grads = []
    for m, d in zip(mapped, out_types):
        m.value.type = seq_type(d)
        grads.append(V(m.value, e, d, None))
    per_input = [None] * len(node.inputs)
    for k, i in enumerate(wanted):
        per_input[i] = grads[k] if is_seq(node.inputs[i]) else _stack_sum(e, grads[k])
    cap_grads = {c: _stack_sum(e, grads[len(wanted) + k]) for k, c in enumerate(caps)}
    return Grads(per_input, cap_grads)


def _one(e):
    return e.const(np.array(1, np.int64))
