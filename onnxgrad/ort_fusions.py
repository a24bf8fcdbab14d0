"""Forms of a model that onnxruntime's graph optimizer runs as written.

onnxruntime (1.31, its ``Pad_Fusion`` rule at every optimization level above none, in Python
and in onnxruntime-web alike) folds a Pad of constant zeros into the MaxPool or AveragePool that
reads it, also through a Cast and after its transpose optimizer has moved layout Transposes
out from between them (a converted Keras ``ZeroPadding2D`` then ``MaxPooling2D``; torch's
``ZeroPad2d`` then ``MaxPool2d`` from either exporter). MaxPool's own pads stand for -inf, so
the fused pool drops the zeros: every window that reached them and holds only negative values
comes out negative instead of 0, silently; and where the summed pads reach the kernel the model
fails to load ("Pad should be smaller than kernel"). The rule leaves alone a Pad with an
``axes`` input (opset 18 on) and one whose value has a nonzero byte: :func:`guard_pad_fusion`
gives every such Pad its axes, or below opset 18 the value -0.0 (a floating x: the maxima and
sums over it are those over +0.0 but for the sign of a zero maximum). Not guarded: a Pad below
opset 18 whose value is computed (onnxruntime's Where, which could select -0.0 where it
computes 0, returns +0.0), or of an integer type. Sessions onnxgrad makes run without the
rule (runtime.UNSAFE_OPTIMIZERS), those models and models that come to them unguarded too.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .inference import FLOAT_TYPES, constant_tensors, graphs_of, model_opset, taken_names, \
    unique_name, value_types

_POOLS = {"MaxPool", "AveragePool"}
# what onnxruntime removes or moves from between a Pad and a pool before the fusion looks
_THROUGH = {"Transpose", "Cast", "Identity", "Dropout"}


def guard_pad_fusion(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` itself, each constant-mode Pad that reaches a pool made one that onnxruntime
    does not fold into it (module docstring). Pads and values computed from constants count:
    onnxruntime folds them first (the TorchScript exporter computes ZeroPad2d's pads)."""
    opset = model_opset(model)
    graphs = graphs_of(model.graph)
    types, inferred = None, False  # (read only for a guarded Pad below opset 18)
    for g in graphs:
        pads = [n for n in g.node if n.op_type == "Pad" and n.domain in ("", "ai.onnx")
                and len(n.input) in (2, 3) and _constant_mode(n)]
        if pads:
            readers = _readers(g)
            pads = [n for n in pads if _reaches_pool(readers, n)]
        if not pads:
            continue
        consts, taken = constant_tensors(g), taken_names(g)
        for n in pads:
            value = n.input[2] if len(n.input) == 3 and n.input[2] else None
            if value in consts and numpy_helper.to_array(consts[value]).any():
                continue  # a value other than zero: not fused
            if opset < 18 and value is not None and value not in consts:
                continue  # a computed value (rare): no -0.0 in its place (module docstring)
            if opset >= 18:
                _give_axes(g, n, consts, taken, value)
                continue
            types = value_types(graphs) if types is None else types
            dtype = _dtype(types, n.input[0]) or _dtype(types, value)
            if dtype is None and not inferred:  # (rare: a pool below opset 18)
                inferred = True
                types.update(value_types(graphs_of(
                    onnx.shape_inference.infer_shapes(model).graph)))
                dtype = _dtype(types, n.input[0]) or _dtype(types, value)
            if dtype not in FLOAT_TYPES:
                continue  # an integer pool (rare); onnxgrad's sessions are safe
            neg = unique_name(f"{n.output[0]}_value", taken)
            g.initializer.append(numpy_helper.from_array(
                np.array(-0.0, helper.tensor_dtype_to_np_dtype(dtype)), neg))
            n.input[2:] = [neg]
    return model


def _give_axes(g: onnx.GraphProto, n: onnx.NodeProto, consts: dict, taken: set, value):
    """Pad ``n`` given an axes input naming every axis: constant where its pads are, else
    computed before it (half the pads' length)."""
    axes = unique_name(f"{n.output[0]}_axes", taken)
    if n.input[1] in consts:
        size = int(np.prod(consts[n.input[1]].dims))
        g.initializer.append(numpy_helper.from_array(np.arange(size // 2, dtype=np.int64), axes))
    else:
        half = unique_name(f"{n.output[0]}_rank", taken)
        at = list(g.node).index(n)
        for k, node in enumerate([
                helper.make_node("Size", [n.input[1]], [half + "_2"]),
                helper.make_node("Div", [half + "_2", _const(g, taken, 2)], [half]),
                helper.make_node("Range", [_const(g, taken, 0), half, _const(g, taken, 1)],
                                 [axes])]):
            g.node.insert(at + k, node)
    n.input[2:] = [value or "", axes]


def _dtype(types: dict, name: str | None) -> int | None:
    t = types.get(name)
    return t.tensor_type.elem_type or None if t is not None and t.HasField("tensor_type") \
        else None


def _const(g: onnx.GraphProto, taken: set, v: int) -> str:
    name = unique_name(f"onnxgrad_pad_axes_{v}", taken)
    g.initializer.append(numpy_helper.from_array(np.array(v, np.int64), name))
    return name


def _constant_mode(n: onnx.NodeProto) -> bool:
    mode = next((a.s for a in n.attribute if a.name == "mode"), b"constant")
    return mode == b"constant"


def _readers(g: onnx.GraphProto) -> dict[str, list]:
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    return readers


def _reaches_pool(readers: dict, pad: onnx.NodeProto) -> bool:
    todo, seen = [pad.output[0]], set()
    while todo:
        for n in readers.get(todo.pop(), []):
            if n.op_type in _POOLS:
                return True
            if n.op_type in _THROUGH and n.output[0] not in seen:
                seen.add(n.output[0])
                todo.append(n.output[0])
    return False
