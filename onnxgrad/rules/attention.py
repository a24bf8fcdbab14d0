"""Gradient rule: Attention (opset 23+), through its ONNX function body with fully masked rows
made safe.

The body adds the mask as -inf and takes a Softmax; a row whose every score is -inf (a fully
masked query) gives NaN there, and its NaN would spread through the sums of the backward pass
into every gradient of K and V. onnxruntime's Attention kernel (and the ONNX test cases' expected
outputs) give 0 for such a row instead, so the expansion differentiated here computes
``P = Softmax(where(live, s, 0)) * live``, ``live`` meaning the row has a finite score: the same
values on every other row, 0 on fully masked ones, and zero gradients through them.
"""
from __future__ import annotations

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
    finite = e.Cast(e.Not(e.IsInf(s, detect_positive=0)), to=ir.DataType.FLOAT)
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


@register("Attention", since=23)
def _attention(n, g):
    v = n.input(2)
    if v is not None and v.shape is not None and len(v.shape) == 3 \
            and not isinstance(v.shape[-1], int):
        # onnx's inference then makes the output's last dim 0, and onnxruntime folds the
        # shapes of the gradient graph from that: a model it cannot run
        raise NotImplementedError(
            f"the gradient of Attention node {n.node.name!r} needs the hidden size of V "
            f"({v.name!r}, its last dim) to be static: onnx's shape inference gives the output "
            f"a last dim of 0 otherwise, and onnxruntime would size the gradients from that")
    return differentiate_body(n, _append_safe)
