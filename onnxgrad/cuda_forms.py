"""Forms of ops that onnxruntime's CUDA provider refuses or runs on the host, rewritten into
standard ops it runs on the GPU.

onnxruntime 1.31's CUDA BatchNormalization refuses training_mode=1 from opset 14 on ("Training
mode does not support BN opset 14 (or higher) yet"): every model exported by torch.onnx in
training mode, and so every train step of a network with BatchNorm, failed to load on a GPU.
Such a node is written out here as the spec defines it (population variance of the batch,
running statistics moved by ``momentum``), with the same inputs and outputs.

Col2Im (the Conv and MaxPool gradients' form for small images on the CPU) has no CUDA kernel:
onnxruntime ran it on the host, with two copies per node inside every step. Blocks that tile
the image become a Reshape/Transpose; others a ConvTranspose, grouped by channel, whose
one-hot kernels put each block element back in place (Col2Im is im2col's adjoint; a transposed
convolution with such kernels is exactly that). Where the geometry is not static, the node
stays as it is (on the host, still right).

SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss have no CUDA kernel either (onnxruntime's
training build has them): every step's logits went to the host and its loss came back. They
are written as the spec defines them (LogSoftmax, the labels' entries, weights, ignore_index,
the reduction).

Only sessions on CUDA get these forms; a model written to a file keeps its nodes."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import UnsupportedError
from .inference import constant_tensors, graphs_of, infer_shapes, model_opset, value_types
from .training.fast_forms import _Nodes


def _training_bn(n: onnx.NodeProto) -> bool:
    return n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx") and any(
        a.name == "training_mode" and a.i for a in n.attribute)


def _col2im(n: onnx.NodeProto) -> bool:
    return n.op_type == "Col2Im" and n.domain in ("", "ai.onnx")


def _nll(n: onnx.NodeProto) -> bool:
    return n.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") and \
        n.domain in ("", "ai.onnx")


def has_forms(model: onnx.ModelProto) -> bool:
    """Whether :func:`for_cuda` rewrites any node of ``model``."""
    return any(_training_bn(n) or _col2im(n) or _nll(n)
               for g in graphs_of(model.graph) for n in g.node)


def for_cuda(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy with its training-mode BatchNormalization and Col2Im nodes (in every
    graph) in the forms above; ``model`` itself is not changed."""
    if not has_forms(model):
        return model
    m = infer_shapes(model)  # a copy, typed: the rewrite needs X's rank and element types
    graphs = graphs_of(m.graph)
    types, opset = value_types(graphs), model_opset(m)
    taken = {o for g in graphs for n in g.node for o in [*n.input, *n.output]}
    taken |= set(types)
    for g in graphs:
        nodes = []
        consts = constant_tensors(g)
        for n in g.node:
            nodes += (_batch_norm(n, types, opset, taken) if _training_bn(n) else
                      _col2im_form(n, types, consts, taken) if _col2im(n) else
                      _nll_form(n, types, opset, taken) if _nll(n) else [n])
        del g.node[:]
        g.node.extend(nodes)
    return m


def _batch_norm(n: onnx.NodeProto, types: dict, opset: int, taken: set) -> list:
    x, scale, bias, mean_in, var_in = n.input[:5]
    outs = list(n.output) + [""] * (3 - len(n.output))
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    eps, momentum = attrs.get("epsilon", 1e-5), attrs.get("momentum", 0.9)

    def elem(name):
        t = types.get(name)
        return t.tensor_type.elem_type if t is not None and t.HasField("tensor_type") else 0
    tx = elem(x) or elem(scale)
    t = types.get(x)
    rank = (len(t.tensor_type.shape.dim) if t is not None and t.HasField("tensor_type")
            and t.tensor_type.HasField("shape") else None)
    if not tx or rank is None or rank < 2:
        raise UnsupportedError(
            f"BatchNormalization {n.name or outs[0]!r} (training_mode=1): onnxruntime's CUDA "
            "provider has no kernel for it and onnxgrad writes it out only where the rank "
            f"(>= 2) and element type of X ({x!r}) are known: give the model's input shapes, "
            "or run it on the CPU")
    dt = helper.tensor_dtype_to_np_dtype(tx)
    b = _Nodes(f"{n.name or outs[0]}/cuda_form", taken)
    op = b.op

    def const(value, dtype=dt):
        return b.const(value, dtype)

    def as_x(name):  # scale and bias (T1) and the running statistics (T2) may differ from X's T
        return name if elem(name) in (0, tx) else op("Cast", name, to=tx)

    axes = [0, *range(2, rank)]

    def mean(v):
        if opset >= 18:
            return op("ReduceMean", v, const(axes, np.int64), keepdims=1)
        return op("ReduceMean", v, axes=axes, keepdims=1)
    per_channel = const([-1] + [1] * (rank - 2), np.int64)
    mu = mean(x)
    d = op("Sub", x, mu)
    var = mean(op("Mul", d, d))
    inv = op("Reciprocal", op("Sqrt", op("Add", var, const(eps))))
    gain = op("Mul", inv, op("Reshape", as_x(scale), per_channel))
    op("Add", op("Mul", d, gain), op("Reshape", as_x(bias), per_channel), out=outs[0])
    flat = const([-1], np.int64)
    for stat, running, out in ((mu, mean_in, outs[1]), (var, var_in, outs[2])):
        if out:
            moved = op("Add", op("Mul", as_x(running), const(momentum)),
                       op("Mul", op("Reshape", stat, flat), const(1 - momentum)))
            if elem(running) in (0, tx):
                op("Identity", moved, out=out)
            else:
                op("Cast", moved, to=elem(running), out=out)
    return b.nodes


def _col2im_form(n: onnx.NodeProto, types: dict, consts: dict, taken: set) -> list:
    cols, image, block = n.input[:3]
    if image not in consts or block not in consts:
        return [n]
    size = [int(v) for v in numpy_helper.to_array(consts[image])]
    k = [int(v) for v in numpy_helper.to_array(consts[block])]
    r = len(k)
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    d = list(attrs.get("dilations", [1] * r))
    s = list(attrs.get("strides", [1] * r))
    pads = list(attrs.get("pads", [0] * 2 * r))
    padded = [size[i] + pads[i] + pads[r + i] for i in range(r)]
    o = [(padded[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(r)]
    if min(o) < 1:
        return [n]
    b = _Nodes(f"{n.name or n.output[0]}/cuda_form", taken)
    op, ints = b.op, b.const
    kk = int(np.prod(k))
    if s == k and d == [1] * r and not any(pads) and padded == [a * b for a, b in zip(o, k)]:
        # blocks that tile the image: [N, C*K, L] -> [N, C, *k, *o] -> [N, C, o1, k1, ...]
        blocks = op("Reshape", cols, ints([0, -1, *k, *o]))
        perm = [0, 1] + [j for i in range(r) for j in (2 + r + i, 2 + i)]
        op("Reshape", op("Transpose", blocks, perm=perm), ints([0, -1, *size]), out=n.output[0])
        return b.nodes
    t = types.get(cols)
    dims = t.tensor_type.shape.dim if t is not None and t.HasField("tensor_type") else []
    if len(dims) != 3 or not dims[1].HasField("dim_value") or dims[1].dim_value % kk:
        return [n]
    c = dims[1].dim_value // kk
    dt = helper.tensor_dtype_to_np_dtype(t.tensor_type.elem_type)
    w = np.zeros((c * kk, 1, kk), dt)
    w[:, 0, :] = np.tile(np.eye(kk, dtype=dt), (c, 1))  # channel (c, j) puts its value at tap j
    weight = b.const(w.reshape(c * kk, 1, *k), dt)
    # (padded - d (k - 1) - 1) mod s: the image's end that no block reaches, zeros, < stride
    extra = [padded[i] - (s[i] * (o[i] - 1) + d[i] * (k[i] - 1) + 1) for i in range(r)]
    op("ConvTranspose", op("Reshape", cols, ints([0, 0, *o])), weight, out=n.output[0], group=c,
       strides=s, dilations=d, pads=pads, output_padding=extra)
    return b.nodes


def _nll_form(n: onnx.NodeProto, types: dict, opset: int, taken: set) -> list:
    """SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss as the spec defines them: picked
    (log-)probabilities, weighted, masked where the label is ignore_index, reduced. onnxruntime's
    CUDA provider has no kernel for either (its training build has), so every step's logits
    went to the host and back (seen in onnxruntime's log on an H200)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    reduction = attrs.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    ignore = attrs.get("ignore_index")
    x, labels = n.input[0], n.input[1]
    weight = n.input[2] if len(n.input) > 2 and n.input[2] else None
    t = types.get(x)
    tx = t.tensor_type.elem_type if t is not None and t.HasField("tensor_type") else 0
    if not tx:
        return [n]  # (the mask's type is x's)
    b = _Nodes(f"{n.name or n.output[0]}/cuda_form", taken)
    op, ints = b.op, b.const

    def axes(v):
        return {"axes": v} if opset < 13 else {}

    def ax(v):
        return [ints(v)] if opset >= 13 else []
    lp = x
    if n.op_type == "SoftmaxCrossEntropyLoss":
        rank = len(t.tensor_type.shape.dim) if t.tensor_type.HasField("shape") else None
        if opset >= 13 or rank == 2:
            lp = op("LogSoftmax", x, axis=1)
        elif rank is None:
            return [n]
        else:  # LogSoftmax-11 flattens from its axis: the classes go last, alone
            last = [0, *range(2, rank), 1]
            back = [0, rank - 1, *range(1, rank - 1)]
            lp = op("Transpose", op("LogSoftmax", op("Transpose", x, perm=last), axis=rank - 1),
                    perm=back)
        if len(n.output) > 1 and n.output[1]:
            op("Identity", lp, out=n.output[1])
    safe, valid = labels, None
    if ignore is not None:
        valid = op("Not", op("Equal", labels, ints(ignore)))
        safe = op("Where", valid, labels, ints(0))
    picked = op("Squeeze", op("GatherElements", lp, op("Unsqueeze", safe, *ax([1]), **axes([1])),
                              axis=1), *ax([1]), **axes([1]))
    w = op("Gather", weight, safe) if weight else None
    if valid is not None:
        mask = op("Cast", valid, to=tx)
        w = mask if w is None else op("Mul", w, mask)
    loss = op("Neg", picked) if w is None else op("Mul", op("Neg", picked), w)
    out = n.output[0]
    if reduction == "none":
        op("Identity", loss, out=out)
    elif reduction == "sum":
        op("ReduceSum", loss, keepdims=0, out=out)
    elif w is None:
        op("ReduceMean", loss, keepdims=0, out=out)
    else:  # the weights of the picked labels sum to the mean's denominator
        op("Div", op("ReduceSum", loss, keepdims=0), op("ReduceSum", w, keepdims=0), out=out)
    return b.nodes
