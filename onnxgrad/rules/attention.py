"""Gradient rule: Attention (opset 23+), through its ONNX function body with fully masked rows
made safe.

The body adds the mask as -inf and takes a Softmax; a row whose every score is -inf (a fully
masked query) gives NaN there, and its NaN would spread through the sums of the backward pass
into every gradient of K and V. onnxruntime's Attention kernel (and the ONNX test cases' expected
outputs) give 0 for such a row instead, so the expansion differentiated here computes
``P = Softmax(where(live, s, 0)) * live``, ``live`` meaning the row has a score above the
dtype's lowest: the same values on every other row, 0 on fully masked ones, and zero gradients
through them. The lowest finite value masks as -inf does (onnxruntime's kernel outputs 0 for a
row of them; the body a uniform softmax): HuggingFace's masks are ``finfo.min``, and a score
plus it rounds to it.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir

from ..registry import register
from .function import differentiate_body


def _safe_softmax(e, sm):
    """Rewire Softmax node ``sm`` (not yet in the graph) to read safe scores; returns the
    masked probabilities that replace its output."""
    s = e.wrap(sm.inputs[0])
    a = sm.attributes.get("axis")
    axis = -1 if a is None else int(a.value)
    lowest = e.const(float(ml_dtypes.finfo(s.dtype.numpy()).min), s.dtype)
    finite = e.Cast(e.Greater(s, lowest), to=ir.DataType.FLOAT)
    live = e.Greater(e.reduce("ReduceMax", finite, [axis], keepdims=1),
                     e.const(np.array(0, np.float32)))
    sm.replace_input_with(0, e.Where(live, s, e.zeros_like(s)).value)
    return live


def _append_safe(e, clones):
    """The clones into the graph, each Softmax made safe (see the module docstring)."""
    nodes, swap = [], {}
    for c in clones:
        for i, v in enumerate(c.inputs):
            if v in swap:
                c.replace_input_with(i, swap[v])
        start = len(e.nodes)
        live = _safe_softmax(e, c) if c.op_type == "Softmax" else None
        nodes.extend(e.nodes[start:])
        e.graph.append(c)
        e.nodes.append(c)
        nodes.append(c)
        if live is not None:
            start = len(e.nodes)
            p = e.wrap(c.outputs[0])
            swap[c.outputs[0]] = (p * e.Cast(live, to=p.dtype)).value
            nodes.extend(e.nodes[start:])
    return nodes, swap


def _zero_dims(v) -> bool:
    return v is not None and v.shape is not None and any(d == 0 for d in v.shape)


@register("Attention", since=23)
def _attention(n, g):
    # onnx's inference of Attention makes up dims of 0 for some symbolic input dims (the
    # output's last dim when V's hidden size is symbolic, qk_matmul_output's total sequence
    # length ...), and onnxruntime, which types the graph the same way, would size the gradient
    # from them: refuse rather than build a graph that fails at run time
    wrong = [v for v in n.node.outputs if _zero_dims(v)]
    if wrong and not any(_zero_dims(v) for v in n.node.inputs):
        v = wrong[0]
        raise NotImplementedError(
            f"onnx's shape inference gives Attention output {v.name!r} the shape "
            f"{list(v.shape)}, a dim of 0 that no input has (its inference is wrong for "
            f"symbolic dims), and onnxruntime would size the gradient from it; declare the "
            f"Attention inputs' dims (hidden sizes, sequence lengths) static")
    return differentiate_body(n, _append_safe)
