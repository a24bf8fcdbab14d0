"""The training step's 2-D convolutions in onnxruntime's blocked (NCHWc) layout, at session time.

onnxruntime's CPU provider runs a Conv fastest in its NCHWc layout (channels in blocks of 8
with AVX2, 16 with AVX-512), but its optimizer moves a Conv there only when the kernel is a
constant: it reorders the kernel once, when the session is made. In a training step the
kernel is a graph input (a forward Conv) or computed (the Conv of an input gradient), so every
Conv runs the generic im2col path. This pass rewrites each eligible Conv into what the
optimizer would have written, with the kernel reordered by standard ops at run time:

    Reshape-Transpose-Reshape (W) ---------------------.
    x -> nchwc.ReorderInput -> nchwc.Conv(x', W', B) -> nchwc.ReorderOutput -> y

The blocked ops are onnxruntime's own (domain ``com.microsoft.nchwc``, registered by its CPU
provider where MLAS has the layout). They compute the same sums in another order, so results
agree to float32 rounding. The pass touches only the model handed to an onnxruntime CPU
session: models that onnxgrad returns or writes stay standard ONNX.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..inference import graphs_of, taken_names
from ..rules.conv import BLOCKED_MIN
from .fast_forms import _attrs, _Nodes, _static_shapes, conv_out_dims, explicit_pads

DOMAIN = "com.microsoft.nchwc"
# an ungrouped Conv gains from 64 output positions per image on (3x3, onnxruntime 1.31, AVX2,
# one and two threads: 0.6x-0.75x the time on 32x32 to 64x64 images, 0.91x-1.0x on 8x8 to 16x16,
# 1.4x-1.7x on 2x2); a depthwise one at every size (0.1x-0.5x). The Conv rule's input gradient
# takes the flipped Conv from there on, below it one Gemm of the image columns
MIN_POSITIONS = BLOCKED_MIN


@functools.lru_cache(maxsize=None)
def block_size() -> int:
    """onnxruntime's NCHWc block size on this CPU, or 0 where it has no NCHWc kernels (the
    layout is off with ``ONNXGRAD_NCHWC=0``)."""
    if os.environ.get("ONNXGRAD_NCHWC", "1") == "0":
        return 0
    from .. import runtime
    ort = runtime.ort_module()
    node = helper.make_node("ReorderInput", ["x"], ["y"], domain=DOMAIN)
    g = helper.make_graph([node], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 1, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, ir_version=8, opset_imports=[helper.make_opsetid("", 13),
                                                         helper.make_opsetid(DOMAIN, 1)])
    so = runtime.session_options(1)
    so.log_severity_level = 4  # a missing kernel is an answer here, not an error
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        b = int(s.run(None, {"x": np.zeros((1, 8, 1, 1), np.float32)})[0].shape[1])
    except Exception:  # noqa: BLE001  (no such kernels in this build or on this CPU)
        return 0
    return b if b > 1 else 0


def blocked_convs(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy whose eligible Conv nodes (main graph) run in the NCHWc layout."""
    b = block_size()
    if not b or not any(n.op_type == "Conv" and n.domain in ("", "ai.onnx")
                        for n in model.graph.node):
        return model
    try:
        shapes = _static_shapes(model)
    except ValueError:  # over protobuf's 2 GB: left as it is
        return model
    taken = set().union(*map(taken_names, graphs_of(model.graph)))
    out, done = [], 0
    for node in model.graph.node:
        new = _rewrite(node, shapes, b, taken)
        out.extend(new if new is not None else [node])
        done += new is not None
    if not done:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.node[:]
    m.graph.node.extend(out)
    if not any(o.domain == DOMAIN for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return m


def _positions(hw, k, a) -> float:
    """Output positions per image, or infinity when the image size is not static."""
    if None in hw:
        return float("inf")
    ho, wo = conv_out_dims(hw, k, a)
    return ho * wo


def _rewrite(node, shapes, b, taken):
    """The blocked form of one Conv, or None to keep it. Eligible: float32, 2-D, a static
    kernel larger than 1x1, explicit pads, output channels a multiple of the block,
    and input channels a multiple of it too; depthwise, or ungrouped on images with at least
    ``MIN_POSITIONS`` output positions."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    x, w = node.input[0], node.input[1]
    if w not in shapes:
        return None
    wt, ws = shapes[w]
    if wt != TensorProto.FLOAT or len(ws) != 4 or None in ws:
        return None
    co, cg, kh, kw = ws
    a = _attrs(node)
    group = int(a.get("group", 1))
    c = cg * group  # x's channels, as a valid Conv has them: its shape may be unknown
    if co % b or not explicit_pads(a):
        return None  # SAME_*: the blocked Conv refuses it with dilations
    if kh * kw == 1:
        return None  # a 1x1 Conv is one GEMM already: blocked, it ran 1.0x-2.3x slower
    nb = _Nodes(node.name or node.output[0], taken)  # (names are taken as nodes are made)
    if group == 1 and c % b == 0:
        hw = shapes[x][1][2:] if x in shapes and len(shapes[x][1]) == 4 else (None, None)
        if _positions(hw, (kh, kw), a) < MIN_POSITIONS:
            return None
        # OIHWBiBo [Co/B, C/B, kh, kw, Bi, Bo]: ReorderInput blocks W's input channels,
        # [Co/B, Bo, C/B*kh*kw*Bi], and one axis moves to the end, which onnxruntime
        # transposes as 2-D tiles; its general 6-D Transpose (one permutation of
        # [Co/B, Bo, C/B, Bi, kh, kw]) copies element by element, single-threaded: a
        # [128, 128, 3, 3] kernel 0.58 -> 0.11 ms, [512, 512, 3, 3] 10.4 -> 2.5 (measured)
        blocked = nb.op("Reshape", nb.op("ReorderInput", w, domain=DOMAIN),
                        nb.const([co // b, b, cg * kh * kw]))
    elif group == c == co and cg == 1:
        # depthwise: [Co/B, Bo, 1, kh, kw] -> OIHWBo [Co/B, 1, kh, kw, Bo]
        blocked = nb.op("Reshape", w, nb.const([co // b, b, kh * kw]))
    else:
        return None  # grouped, or input channels off the block (fewer than a block, read as
        # NCHW by the blocked Conv, measured 0.8x to 1.6x the time: not taken)
    wr = nb.op("Reshape", nb.op("Transpose", blocked, perm=[0, 2, 1]), nb.const([co, cg, kh, kw]))
    xr = nb.op("ReorderInput", x, domain=DOMAIN)
    yr = nb.op("Conv", xr, wr, *node.input[2:3], domain=DOMAIN)
    attrs = {a.name: a for a in node.attribute}
    attrs.setdefault("kernel_shape", helper.make_attribute("kernel_shape", [kh, kw]))
    nb.nodes[-1].attribute.extend(attrs.values())
    nb.op("ReorderOutput", yr, out=node.output[0], channels=co, domain=DOMAIN)
    return nb.nodes
