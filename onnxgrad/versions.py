"""Opset conversion: onnx's version converter, and what it leaves out or gets wrong.

- It drops model-local functions (the calls stay, the bodies go). The user's functions are
  inlined first (onnx's inliner), so their nodes are converted with the graph; the bodies of
  onnxgrad's own ops (the RNN family) are rebuilt at the new opset.
- Its Clip 6 -> 11 adapter writes float32 bound Constants whatever x's dtype.
- Its Upsample -> Resize adapter keeps Resize's default half_pixel coordinates, but Upsample maps
  output i to input i / scale: asymmetric coordinates (and floor for nearest). Resize-10 is
  carried over as is, with the same default: it too is asymmetric, and its nearest pixel is
  onnxruntime's (and the spec's examples') ceil on a shrunk axis, floor on the others.
- Hardmax before 13 coerces x to 2-D at ``axis`` (one-hot over the flattened trailing dims), and
  the converter carries it over as Hardmax-13 (one-hot along ``axis`` alone); Softmax and
  LogSoftmax get their Flatten / Reshape, Hardmax gets the same here.
- Its adapters for the broadcasts of opsets before 7 assert on a B aligned at an ``axis`` inside
  A (Caffe2's per-channel ``Add(broadcast=1, axis=1)``) and on symbolic dims, and it has none
  for the legacy comparisons: those nodes are upgraded here.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx.inliner  # (a submodule `import onnx` does not load)

from .errors import UnsupportedError
from .inference import (constant_tensors, graphs_of, model_opset, names_read, unique_name,
                        value_types)
from .registry import attach_functions, own_domain
from .storage import MAX_IR_VERSION


def without_ir3_inputs(model: onnx.ModelProto, xs) -> onnx.ModelProto:
    """``model``, or for an IR below 4 a copy at IR 4 whose initializers not in ``xs`` are no
    longer graph inputs. IR 3 makes every initializer an input, which onnxruntime takes no
    value for: they are constants (as their exporters meant, and read as such); from IR 4 an
    initializer that is an input is a default a feed overrides, which the xs among them are."""
    if model.ir_version >= 4:
        return model
    xs = {xs} if isinstance(xs, str) else set(xs)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.ir_version = 4
    consts = {t.name for t in out.graph.initializer} - xs
    kept = [v for v in out.graph.input if v.name not in consts]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    return out


def convert_version(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """``model`` (not modified) converted to ai.onnx opset ``version``, functions kept working."""
    user = [(f.domain, f.name) for f in model.functions if not own_domain(f.domain)]
    if user:
        model = onnx.inliner.inline_selected_functions(model, user)
    old = model_opset(model)
    nodes = [n for g in graphs_of(model.graph) for n in g.node]
    # (each graph's Upsamples, in order: onnx's adapter renames their outputs to "_v_N"; and
    # its Resizes, whose outputs it keeps)
    upsample = [([n.output[0] for n in g.node if n.op_type == "Upsample"],
                 {n.output[0] for n in g.node if n.op_type == "Resize"})
                for g in graphs_of(model.graph)]
    resize10 = {n.output[0] for n in nodes if n.op_type == "Resize" and old == 10}
    hardmax = {n.output[0] for n in nodes if n.op_type == "Hardmax" and old < 13 <= version}
    # onnx's converter keeps the IR version, and an IR below 4 wants every initializer to be a
    # graph input: the pads its Pad 10 -> 11 adapter adds as one made an invalid model (and
    # failed a second upgrade). The IR the new opset was released with has no such rule.
    ir = max(model.ir_version, min(onnx.helper.find_min_ir_version_for(
        [onnx.helper.make_opsetid("", version)]), MAX_IR_VERSION))
    # BatchNormalization's saved mean and variance (outputs 3 and 4, training mode before
    # opset 14; a torch.onnx TRAINING export writes them, unread): the 13 -> 14 adapter asserts
    # on them, so they go (nothing reads them)
    read = names_read(model.graph) | {o.name for o in model.graph.output}
    saved = old < 14 <= version and any(n.op_type == "BatchNormalization" and len(n.output) > 3
                                        and not read.intersection(n.output[3:]) for n in nodes)
    if ir != model.ir_version or old < 7 or saved:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.ir_version = ir
    if saved:
        for g in graphs_of(model.graph):
            for n in g.node:
                if n.op_type == "BatchNormalization" and not read.intersection(n.output[3:]):
                    del n.output[3:]
    if old < 7:
        _hide_legacy_broadcasts(model, old)
    try:
        out = onnx.version_converter.convert_version(model, version)
    except (RuntimeError, onnx.checker.ValidationError,
            onnx.version_converter.ConvertError) as err:  # an adapter's own assertion
        why = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise UnsupportedError(f"onnx's version converter cannot upgrade the model from opset "
                               f"{old} to {version}: {why}; export it at opset {version} or "
                               "newer") from None
    del out.functions[:]  # (the converter keeps none; the rebuilt ones follow)
    if old < 7:
        _unhide_legacy_broadcasts(out)
    graphs = graphs_of(out.graph)
    taken = {o for g in graphs for n in g.node for o in [*n.output, n.name]}
    for g, (names, native) in zip(graphs, upsample):
        _fix_upsample(g, names, native)
    for g in reversed(graphs):  # subgraphs first: a graph rewritten copies its nodes' subgraphs
        _fix_resize10(g, resize10, taken)
        _fix_hardmax(g, hardmax, taken)
    graphs = graphs_of(out.graph)
    if old < 14 <= version:  # (the adapter keeps a training node's statistics outputs, and
        for g in graphs:     # drops the mode they meant: onnxruntime refuses the node)
            for n in g.node:
                if n.op_type == "BatchNormalization" and len(n.output) > 1 and not any(
                        a.name == "training_mode" for a in n.attribute):
                    n.attribute.append(onnx.helper.make_attribute("training_mode", 1))
    if any(n.op_type == "Clip" for g in graphs for n in g.node):
        _fix_clip_bounds(out, graphs)
    return attach_functions(out)


_LEGACY = "onnxgrad.legacy_broadcast"  # (a domain the converter passes by)
_BROADCASTS = {"Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Greater", "Less",
               "Gemm"}
# ops whose output 0 has input 0's rank, where onnx infers none before opset 6 (consumed_inputs)
_SAME_RANK = {"Relu", "Sigmoid", "Tanh", "Abs", "Neg", "Exp", "Log", "Sqrt", "Reciprocal",
              "Floor", "Ceil", "LeakyRelu", "Elu", "Selu", "HardSigmoid", "Clip", "Dropout",
              "BatchNormalization", "Identity", "Softmax", "LogSoftmax", "Cast", "PRelu",
              "ThresholdedRelu", "Softsign", "Softplus", "InstanceNormalization", "LRN", "Sum",
              "Max", "Min", "Mean"} | (_BROADCASTS - {"Gemm"})


def _hide_legacy_broadcasts(model: onnx.ModelProto, old: int):
    """The broadcasting ops of opsets before 7 made numpy-style and moved out of the converter's
    way: ``Op(A, B, broadcast=1, axis=k)`` becomes ``Op(A, Unsqueeze(B))``, B given A's
    trailing dims, in a domain the converter leaves alone (:func:`_unhide_legacy_broadcasts`
    moves them back). The converter's adapters assert on a B aligned inside A, on any symbolic
    dim (a batch), and have none for the comparisons and logical ops."""
    try:
        typed = onnx.shape_inference.infer_shapes(model)
    except onnx.shape_inference.InferenceError:
        typed = model
    ranks = {k: len(t.tensor_type.shape.dim) for k, t in value_types(graphs_of(typed.graph)).items()
             if t.HasField("tensor_type") and t.tensor_type.HasField("shape")}
    graphs = graphs_of(model.graph)
    taken = {o for g in graphs for n in g.node for o in [*n.output, n.name]}
    for g in graphs:
        fixed = []
        for n in g.node:
            if n.domain in ("", "ai.onnx") and n.output and n.output[0] not in ranks:
                if n.op_type in _SAME_RANK and n.input and n.input[0] in ranks:
                    ranks[n.output[0]] = ranks[n.input[0]]
                elif n.op_type == "Gemm":
                    ranks[n.output[0]] = 2
            if n.op_type not in _BROADCASTS or n.domain not in ("", "ai.onnx"):
                fixed.append(n)
                continue
            attrs = {a.name: a.i for a in n.attribute}
            if attrs.get("broadcast") == 1 and "axis" in attrs and n.op_type != "Gemm":
                ra, rb = (ranks.get(i) for i in n.input)
                if None in (ra, rb):
                    raise UnsupportedError(
                        f"{n.op_type}-{old} node {n.name or n.output[0]!r} broadcasts its "
                        f"second input from axis {attrs['axis']} of its first, whose ranks "
                        "onnx's shape inference does not tell; declare the inputs' shapes or "
                        "export the model at opset 7 or newer")
                axis = attrs["axis"] + (ra if attrs["axis"] < 0 else 0)
                if ra - axis > rb:
                    b = unique_name(f"{n.input[1]}/aligned", taken)
                    fixed.append(onnx.helper.make_node("Unsqueeze", [n.input[1]], [b], name=b,
                                                       axes=list(range(rb, ra - axis))))
                    n.input[1] = b
            keep = [a for a in n.attribute if a.name not in ("broadcast", "axis",
                                                             "consumed_inputs")]
            del n.attribute[:]
            n.attribute.extend(keep)
            n.domain = _LEGACY
            fixed.append(n)
        if len(fixed) != len(g.node):
            del g.node[:]
            g.node.extend(fixed)
    model.opset_import.append(onnx.helper.make_opsetid(_LEGACY, 1))


def _unhide_legacy_broadcasts(model: onnx.ModelProto):
    for g in graphs_of(model.graph):
        for n in g.node:
            if n.domain == _LEGACY:
                n.domain = ""
    kept = [o for o in model.opset_import if o.domain != _LEGACY]
    del model.opset_import[:]
    model.opset_import.extend(kept)


def _fix_upsample(graph: onnx.GraphProto, names: list, native: set):
    """The Resizes onnx's adapter made of the graph's Upsamples (``names``: their outputs, in
    order; ``native``: the outputs of the graph's own Resizes, which it keeps), asymmetric as
    Upsample is, and their outputs named as the Upsamples' were (the adapter renames all but a
    graph output's, so xs, ys and the nodes reading them by the old name found none, and a
    fix-up keyed by it missed them: half_pixel interpolation, silently). An opset-10 Upsample
    stays one: then no Resize is made, and none is touched."""
    resizes = [n for n in graph.node if n.op_type == "Resize" and n.output[0] not in native]
    if not names or len(resizes) != len(names):
        return
    renamed = {}
    for n, name in zip(resizes, names):
        _asymmetric(n, "floor")
        if n.output[0] != name:
            renamed[n.output[0]] = name
            n.output[0] = name
    for g in graphs_of(graph):
        for n in g.node:
            n.input[:] = [renamed.get(i, i) for i in n.input]
        for v in [*g.value_info, *g.output]:
            v.name = renamed.get(v.name, v.name)


def _asymmetric(n: onnx.NodeProto, nearest: str):
    keep = [a for a in n.attribute
            if a.name not in ("coordinate_transformation_mode", "nearest_mode")]
    del n.attribute[:]
    n.attribute.extend(keep)
    n.attribute.append(onnx.helper.make_attribute("coordinate_transformation_mode", "asymmetric"))
    n.attribute.append(onnx.helper.make_attribute("nearest_mode", nearest))


def _fix_resize10(graph: onnx.GraphProto, resize10: set, taken: set):
    """Resize-10 as Resize-13: asymmetric; nearest takes ceil on the axes it shrinks and floor
    on the others (onnxruntime's Resize-10), so scales that shrink some axes and enlarge others
    become two Resizes (the interpolation is separable)."""
    consts = constant_tensors(graph)
    fixed = []
    for n in graph.node:
        if n.op_type != "Resize" or n.output[0] not in resize10:
            fixed.append(n)
            continue
        mode = next((a.s.decode() for a in n.attribute if a.name == "mode"), "nearest")
        if mode != "nearest":
            _asymmetric(n, "floor")
            fixed.append(n)
            continue
        scales = consts.get(n.input[2]) if len(n.input) > 2 else None
        if scales is None:
            raise UnsupportedError(
                f"Resize-10 node {n.name or n.output[0]!r} (mode nearest) has scales known only "
                "at run time: its nearest pixel (ceil on the axes it shrinks, floor on the "
                "others) has no opset-13 form then; export the model at opset 11 or newer")
        s = onnx.numpy_helper.to_array(scales).astype(float).ravel()
        if (s >= 1).all() or (s <= 1).all():
            _asymmetric(n, "floor" if (s >= 1).all() else "ceil")
            fixed.append(n)
            continue
        shrink = unique_name(f"{n.output[0]}/shrink", taken)
        names = [unique_name(f"{n.output[0]}/scales_{k}", taken) for k in ("shrink", "grow")]
        for name, part in zip(names, (np.minimum(s, 1), np.maximum(s, 1))):
            graph.initializer.append(onnx.numpy_helper.from_array(part.astype(np.float32), name))
        first = onnx.NodeProto()
        first.CopyFrom(n)
        first.name, first.output[0] = shrink, shrink
        first.input[2] = names[0]
        _asymmetric(first, "ceil")
        n.input[0], n.input[2] = shrink, names[1]
        _asymmetric(n, "floor")
        fixed += [first, n]
    if len(fixed) != len(graph.node):
        del graph.node[:]
        graph.node.extend(fixed)


def _fix_hardmax(graph: onnx.GraphProto, hardmax: set, taken: set):
    """Hardmax before 13 as Flatten(axis) -> Hardmax(-1) -> Reshape to x's shape."""
    helper = onnx.helper
    fixed = []
    for n in graph.node:
        axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
        if n.op_type != "Hardmax" or n.output[0] not in hardmax or axis == -1:
            fixed.append(n)
            continue
        base = n.name or n.output[0]
        shape, flat, hard = (unique_name(f"{base}/{k}", taken) for k in ("shape", "flat", "2d"))
        fixed += [helper.make_node("Shape", [n.input[0]], [shape], name=shape),
                  helper.make_node("Flatten", [n.input[0]], [flat], name=flat, axis=axis),
                  helper.make_node("Hardmax", [flat], [hard], name=hard, axis=-1),
                  helper.make_node("Reshape", [hard, shape], [n.output[0]], name=base)]
    if len(fixed) != len(graph.node):
        del graph.node[:]
        graph.node.extend(fixed)


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
