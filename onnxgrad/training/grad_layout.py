"""The fused optimizer's gradients as the gradient graph's last computing nodes write them.

A weight gradient often ends in nodes that only re-shape it: the Reshape from a Gemm's [Co, C*K]
to the kernel's [Co, C, kh, kw], a BatchNormalization's [1, C, 1, 1] to [C]. onnxruntime copies
at each of them when its output is a graph output (the output has its own buffer): ResNet-18's
step at 2 threads spent 6 ms of its 240 ms of kernels in such Reshapes (profiled). The fused
optimizer reads a gradient as flat memory, where a Reshape moves no element, so the gradient
graph hands it the tensor before them (ResNet-18's step 1.04x; its peak RSS about 46 MB higher,
onnxruntime's arena planning the step's buffers otherwise, measured)."""
from __future__ import annotations

import math

import onnx
from onnx import helper

from ..inference import infer_shapes
from .step import _prune

_RESHAPING = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"}


def _static(types: dict, name: str, size: int) -> list[int] | None:
    """The shape of ``name``, which holds ``size`` elements: one dim inference does not know
    (a Reshape to a Shape() computed at run time) follows from the others."""
    t = types.get(name)
    if t is None or not t.type.tensor_type.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None
            for d in t.type.tensor_type.shape.dim]
    known = math.prod(d for d in dims if d is not None)
    if dims.count(None) == 1 and known > 0 and size % known == 0:
        dims[dims.index(None)] = size // known
    return dims if None not in dims and math.prod(dims) == size else None


def stored_gradients(model: onnx.ModelProto, loss: str, grads: list[str], sizes: list[int]
                     ) -> tuple[onnx.ModelProto, list[tuple[str, list[int]] | None]]:
    """``model`` (outputs loss, grads, and any others, kept) with each gradient output moved back across the
    re-shaping nodes that end it, and where each is now: (output, shape), or None where it
    stays. The input model is not changed. A gradient stays where what is before those nodes is
    a graph input or initializer, is an output already, or has no static shape of ``sizes``'
    number of elements (the parameters')."""
    g = model.graph
    made = {o: n for n in g.node for o in n.output}
    taken = {o.name for o in g.output}
    before = {}
    for grad in grads:
        cur = grad
        while cur in made and made[cur].op_type in _RESHAPING and \
                made[cur].domain in ("", "ai.onnx"):
            cur = made[cur].input[0]
        if cur != grad and cur in made and cur not in taken:
            before[grad] = cur
            taken.add(cur)
    if not before:
        return model, [None] * len(grads)
    try:
        types = {v.name: v for v in infer_shapes(model).graph.value_info}
    except Exception:  # noqa: BLE001  (an optimisation: without shapes the outputs stay)
        return model, [None] * len(grads)
    where, outputs, infos = [], [], []
    for grad, size in zip(grads, sizes):
        cur = before.get(grad)
        shape = None if cur is None else _static(types, cur, size)
        if shape is None:
            where.append(None)
            outputs.append(grad)
            continue
        where.append((cur, shape))
        outputs.append(cur)
        infos.append(helper.make_tensor_value_info(
            cur, types[cur].type.tensor_type.elem_type, shape))
    if not infos:
        return model, where
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.value_info.extend(infos)
    kept = [o.name for o in g.output if o.name != loss and o.name not in set(grads)]
    _prune(m, [loss, *outputs, *kept], [i.name for i in model.graph.input])
    return m, where
