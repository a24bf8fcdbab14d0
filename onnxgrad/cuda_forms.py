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
the reduction). So are GroupNormalization, Mish, Celu and LpNormalization, the other ai.onnx ops
a network may train through that the CUDA provider has no kernel for (its OperatorKernels.md).

Only sessions on CUDA get these forms; a model written to a file keeps its nodes."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import UnsupportedError
from .inference import constant_tensors, graphs_of, infer_shapes, model_opset, value_types
from .training.fast_forms import _Nodes


def _onnx(n: onnx.NodeProto) -> bool:
    return n.domain in ("", "ai.onnx")


def _training_bn(n: onnx.NodeProto) -> bool:
    return any(a.name == "training_mode" and a.i for a in n.attribute)


def _attrs(n: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in n.attribute}


def _elem(types: dict, name: str) -> int:
    t = types.get(name)
    return t.tensor_type.elem_type if t is not None and t.HasField("tensor_type") else 0


def _rank(types: dict, name: str) -> int | None:
    t = types.get(name)
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    return len(t.tensor_type.shape.dim)


def _reduce(b: _Nodes, op_type: str, v: str, axes: list, opset: int) -> str:
    """A keepdims Reduce over ``axes``: an input from opset 13 (ReduceSum) or 18 (the others),
    an attribute before."""
    if opset >= (13 if op_type == "ReduceSum" else 18):
        return b.op(op_type, v, b.const(axes), keepdims=1)
    return b.op(op_type, v, axes=axes, keepdims=1)


def has_forms(model: onnx.ModelProto) -> bool:
    """Whether :func:`for_cuda` rewrites any node of ``model``."""
    return any(_form_of(n) is not None for g in graphs_of(model.graph) for n in g.node)


def _form_of(n: onnx.NodeProto):
    """The function that writes ``n`` in standard ops the CUDA provider runs, or None."""
    if not _onnx(n) or n.op_type not in _FORMS:
        return None
    if n.op_type == "BatchNormalization" and not _training_bn(n):
        return None
    return _FORMS[n.op_type]


def for_cuda(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy with the nodes of :data:`_FORMS` (in every graph) in the forms
    above; ``model`` itself is not changed."""
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
            form = _form_of(n)
            nodes += [n] if form is None else form(n, types, consts, opset, taken)
        del g.node[:]
        g.node.extend(nodes)
    return m


def _batch_norm(n: onnx.NodeProto, types: dict, consts: dict, opset: int, taken: set) -> list:
    x, scale, bias, mean_in, var_in = n.input[:5]
    outs = list(n.output) + [""] * (3 - len(n.output))
    attrs = _attrs(n)
    eps, momentum = attrs.get("epsilon", 1e-5), attrs.get("momentum", 0.9)
    tx = _elem(types, x) or _elem(types, scale)
    rank = _rank(types, x)
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
        return name if _elem(types, name) in (0, tx) else op("Cast", name, to=tx)

    axes = [0, *range(2, rank)]

    def mean(v):
        return _reduce(b, "ReduceMean", v, axes, opset)
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
            if _elem(types, running) in (0, tx):
                op("Identity", moved, out=out)
            else:
                op("Cast", moved, to=_elem(types, running), out=out)
    return b.nodes


def _col2im_form(n: onnx.NodeProto, types: dict, consts: dict, opset: int,
                 taken: set) -> list:
    cols, image, block = n.input[:3]
    if image not in consts or block not in consts:
        return [n]
    size = [int(v) for v in numpy_helper.to_array(consts[image])]
    k = [int(v) for v in numpy_helper.to_array(consts[block])]
    r = len(k)
    attrs = _attrs(n)
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


def _nll_form(n: onnx.NodeProto, types: dict, consts: dict, opset: int, taken: set) -> list:
    """SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss as the spec defines them: picked
    (log-)probabilities, weighted, masked where the label is ignore_index, reduced. onnxruntime's
    CUDA provider has no kernel for either (its training build has), so every step's logits
    went to the host and back (seen in onnxruntime's log on an H200)."""
    attrs = _attrs(n)
    reduction = attrs.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    ignore = attrs.get("ignore_index")
    x, labels = n.input[0], n.input[1]
    weight = n.input[2] if len(n.input) > 2 and n.input[2] else None
    tx, tl = _elem(types, x), _elem(types, labels)
    if not tx or not tl:
        return [n]  # (the mask's type is x's, ignore_index's the labels')
    lt = helper.tensor_dtype_to_np_dtype(tl)
    b = _Nodes(f"{n.name or n.output[0]}/cuda_form", taken)
    op, ints = b.op, b.const

    def axes(v):
        return {"axes": v} if opset < 13 else {}

    def ax(v):
        return [ints(v)] if opset >= 13 else []
    lp = x
    if n.op_type == "SoftmaxCrossEntropyLoss":
        rank = _rank(types, x)
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
        valid = op("Not", op("Equal", labels, b.const(ignore, lt)))
        safe = op("Where", valid, labels, b.const(0, lt))
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


# -- activations and normalizations with no CUDA kernel ----------------------------------------
def _mish(n, types, consts, opset, taken) -> list:
    """Mish(x) = x tanh(softplus(x))."""
    b = _Nodes(f"{n.name or n.output[0]}/cuda_form", taken)
    b.op("Mul", n.input[0], b.op("Tanh", b.op("Softplus", n.input[0])), out=n.output[0])
    return b.nodes


def _celu(n, types, consts, opset, taken) -> list:
    """Celu(x) = max(0, x) + min(0, alpha (exp(x / alpha) - 1))."""
    tx = _elem(types, n.input[0])
    if not tx:
        return [n]
    dt = helper.tensor_dtype_to_np_dtype(tx)
    alpha = float(_attrs(n).get("alpha", 1.0))
    b = _Nodes(f"{n.name or n.output[0]}/cuda_form", taken)
    op, x = b.op, n.input[0]
    zero = b.const(0.0, dt)
    em1 = op("Sub", op("Exp", op("Div", x, b.const(alpha, dt))), b.const(1.0, dt))
    op("Add", op("Max", x, zero), op("Min", op("Mul", em1, b.const(alpha, dt)), zero),
       out=n.output[0])
    return b.nodes


def _lp_normalization(n, types, consts, opset, taken) -> list:
    """x / ||x||_p along the axis (p 1 or 2)."""
    a = _attrs(n)
    p, axis = a.get("p", 2), a.get("axis", -1)
    rank = _rank(types, n.input[0])
    if p not in (1, 2) or rank is None:
        return [n]
    b = _Nodes(f"{n.name or n.output[0]}/cuda_form", taken)
    op, x = b.op, n.input[0]
    t = op("Abs", x) if p == 1 else op("Mul", x, x)
    total = _reduce(b, "ReduceSum", t, [axis % rank], opset)
    op("Div", x, total if p == 1 else op("Sqrt", total), out=n.output[0])
    return b.nodes


def _group_norm(n, types, consts, opset, taken) -> list:
    """GroupNormalization: x as [N, G, rest], standardized over rest (in the wider of x's type
    and the stash type from opset 21), then scale and bias per group (opset 18) or per channel
    (21)."""
    a = _attrs(n)
    x, scale, bias = n.input[:3]
    tx, rank = _elem(types, x), _rank(types, x)
    if not tx or rank is None or rank < 2:
        return [n]
    groups, eps = int(a["num_groups"]), float(a.get("epsilon", 1e-5))
    per_channel = opset >= 21
    # the wider of x's type and the stash type (as onnxruntime's CPU kernel computes)
    bits = {TensorProto.FLOAT16: 16, TensorProto.BFLOAT16: 16, TensorProto.FLOAT: 32,
            TensorProto.DOUBLE: 64}
    stash = int(a.get("stash_type", TensorProto.FLOAT)) if per_channel else tx
    stash = stash if bits.get(stash, 0) > bits.get(tx, 0) else tx
    b = _Nodes(f"{n.name or n.output[0]}/cuda_form", taken)
    op, ints = b.op, b.const
    sdt = helper.tensor_dtype_to_np_dtype(stash)

    def mean(v):
        return _reduce(b, "ReduceMean", v, [2], opset)
    g = op("Reshape", x if stash == tx else op("Cast", x, to=stash), ints([0, groups, -1]))
    d = op("Sub", g, mean(g))
    normed = op("Mul", d, op("Reciprocal", op("Sqrt", op("Add", mean(op("Mul", d, d)),
                                                       b.const(eps, sdt)))))
    if not per_channel:  # scale and bias [G]
        per = ints([groups, 1])
        y = op("Add", op("Mul", normed, op("Reshape", scale, per)), op("Reshape", bias, per))
        op("Reshape", y, op("Shape", x), out=n.output[0])
        return b.nodes
    y = op("Reshape", normed, op("Shape", x))
    if stash != tx:
        y = op("Cast", y, to=tx)
    per = ints([-1] + [1] * (rank - 2))
    op("Add", op("Mul", y, op("Reshape", scale, per)), op("Reshape", bias, per),
       out=n.output[0])
    return b.nodes


#: what :func:`for_cuda` writes out (onnxruntime 1.31's CUDA provider has no kernel for them:
#: its docs/OperatorKernels.md; BatchNormalization only in training mode)
_FORMS = {"BatchNormalization": _batch_norm, "Col2Im": _col2im_form,
          "SoftmaxCrossEntropyLoss": _nll_form, "NegativeLogLikelihoodLoss": _nll_form,
          "GroupNormalization": _group_norm, "Mish": _mish, "Celu": _celu,
          "LpNormalization": _lp_normalization}
