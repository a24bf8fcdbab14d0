"""Opset conversion: onnx's version converter, and what it leaves out or gets wrong.

- It drops model-local functions (the calls stay, the bodies go). The user's functions are
  inlined first (onnx's inliner), so their nodes are converted with the graph; the bodies of
  onnxgrad's own ops (the RNN family) are rebuilt at the new opset.
- Its Clip 6 -> 11 adapter writes float32 bound Constants whatever x's dtype.
- Its Upsample -> Resize adapter keeps Resize's default half_pixel coordinates, but Upsample maps
  output i to input i / scale: asymmetric coordinates (and floor for nearest).
"""
from __future__ import annotations

import onnx

from .inference import graphs_of, value_types
from .registry import attach_functions, own_domain


def convert_version(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """``model`` (not modified) converted to ai.onnx opset ``version``, functions kept working."""
    user = [(f.domain, f.name) for f in model.functions if not own_domain(f.domain)]
    if user:
        model = onnx.inliner.inline_selected_functions(model, user)
    upsample = {n.output[0] for g in graphs_of(model.graph) for n in g.node
                if n.op_type == "Upsample"}
    out = onnx.version_converter.convert_version(model, version)
    del out.functions[:]  # (the converter keeps none; the rebuilt ones follow)
    graphs = graphs_of(out.graph)
    for g in graphs:
        _fix_upsample(g, upsample)
    if any(n.op_type == "Clip" for g in graphs for n in g.node):
        _fix_clip_bounds(out, graphs)
    return attach_functions(out)


def _fix_upsample(graph: onnx.GraphProto, upsample: set):
    for n in graph.node:
        if n.op_type == "Resize" and n.output[0] in upsample:
            keep = [a for a in n.attribute
                    if a.name not in ("coordinate_transformation_mode", "nearest_mode")]
            del n.attribute[:]
            n.attribute.extend(keep)
            n.attribute.append(onnx.helper.make_attribute("coordinate_transformation_mode",
                                                          "asymmetric"))
            n.attribute.append(onnx.helper.make_attribute("nearest_mode", "floor"))


def _fix_clip_bounds(model: onnx.ModelProto, graphs: list):
    """Clip bounds made by the converter (Constants) in x's element type, which onnx's inference
    of a copy tells (names are unique across a model's graphs)."""
    try:
        typed = onnx.shape_inference.infer_shapes(model)
    except onnx.shape_inference.InferenceError:
        typed = model
    types = {k: t.tensor_type.elem_type for k, t in value_types(graphs_of(typed.graph)).items()}
    for g in graphs:
        consts = {n.output[0]: n for n in g.node if n.op_type == "Constant"}
        fixed = set()
        for n in g.node:
            want = types.get(n.input[0]) if n.op_type == "Clip" else None
            for bound in list(n.input[1:]) if want else []:
                t = consts[bound].attribute[0].t if bound in consts else None
                if t is not None and t.data_type != want:
                    arr = onnx.numpy_helper.to_array(t).astype(
                        onnx.helper.tensor_dtype_to_np_dtype(want))
                    t.CopyFrom(onnx.numpy_helper.from_array(arr, t.name))
                    fixed.add(bound)
        kept = [v for v in g.value_info if v.name not in fixed]
        del g.value_info[:]
        g.value_info.extend(kept)
