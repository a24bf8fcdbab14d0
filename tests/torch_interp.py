"""A small ONNX interpreter in PyTorch: an independent, exact oracle for gradients.

Runs an ONNX graph node by node with torch ops, so torch autograd gives the gradient of any
output w.r.t. the inputs and initializers, in float64 on the CPU (onnxruntime has no float64
Conv; onnx.reference is far too slow at 224x224). It covers exactly the op types of the model-zoo
architectures in onnx/backend/test/data/light (opset 9 semantics; Softmax follows the model's
opset), and raises on anything else:

Conv, BatchNormalization (inference), Relu, MaxPool, AveragePool, GlobalAveragePool, Gemm,
Reshape, Softmax, LRN, Dropout (inference: identity), Concat, Sum, Add, Mul, Unsqueeze (``axes``
attribute), Transpose, Flatten.

Nothing here is derived from onnxgrad: every op is written from the ONNX operator specification.

    values = initializers(model, torch.float64)        # name -> tensor (ints stay int64)
    values[data] = torch.tensor(x, dtype=torch.float64)
    (y,) = run(model, values)
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

OPS = ("Conv", "BatchNormalization", "Relu", "MaxPool", "AveragePool", "GlobalAveragePool",
       "Gemm", "Reshape", "Softmax", "LRN", "Dropout", "Concat", "Sum", "Add", "Mul",
       "Unsqueeze", "Transpose", "Flatten")


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _opset(model):
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 9)


def initializers(model, dtype=torch.float64, requires_grad=False):
    """name -> torch tensor for every initializer: floats in ``dtype`` (leaves with
    ``requires_grad`` when asked), integer tensors (Reshape shapes) as int64."""
    out = {}
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t)
        if np.issubdtype(a.dtype, np.floating):
            v = torch.tensor(a.astype(np.float64), dtype=dtype)
            out[t.name] = v.requires_grad_(requires_grad)
        else:
            out[t.name] = torch.tensor(a.astype(np.int64))
    return out


# -- helpers ------------------------------------------------------------------------------------
def _spatial_pads(attrs, nd):
    pads = list(attrs.get("pads", [0] * (2 * nd)))
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto not in ("NOTSET", "VALID"):
        raise NotImplementedError(f"auto_pad={auto}")
    if auto == "VALID":
        pads = [0] * (2 * nd)
    return pads[:nd], pads[nd:]


def _torch_pad(begins, ends):
    """ONNX [b1..bn], [e1..en] for the spatial axes -> F.pad's (last axis first) list."""
    out = []
    for b, e in zip(reversed(begins), reversed(ends)):
        out += [int(b), int(e)]
    return out


def _pool_geometry(x, attrs):
    """Kernel, strides, and the padding that makes every ONNX output window lie inside the padded
    input: the explicit pads plus, under ceil_mode, the extra tail the last window reaches."""
    k = list(attrs["kernel_shape"])
    nd = len(k)
    s = list(attrs.get("strides", [1] * nd))
    d = list(attrs.get("dilations", [1] * nd))
    if any(v != 1 for v in d):
        raise NotImplementedError("pooling dilations")
    begins, ends = _spatial_pads(attrs, nd)
    ceil_mode = attrs.get("ceil_mode", 0)
    extra = []
    for i in range(nd):
        n = x.shape[2 + i]
        span = n + begins[i] + ends[i] - k[i]
        out = (math.ceil(span / s[i]) if ceil_mode else span // s[i]) + 1
        if ceil_mode and (out - 1) * s[i] >= n + begins[i]:
            out -= 1  # the last window would start in the end padding (ONNX, torch, ORT agree)
        extra.append(max(0, (out - 1) * s[i] + k[i] - (n + begins[i] + ends[i])))
    return k, s, begins, ends, extra


def _max_pool(x, attrs):
    k, s, b, e, extra = _pool_geometry(x, attrs)
    x = F.pad(x, _torch_pad(b, [ei + xi for ei, xi in zip(e, extra)]), value=-math.inf)
    fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[len(k)]
    return fn(x, k, s)


def _avg_pool(x, attrs):
    """Window sums divided by the window's count: all the cells inside the explicit pads when
    count_include_pad, else only the input's cells; the ceil_mode tail never counts."""
    k, s, b, e, extra = _pool_geometry(x, attrs)
    fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[len(k)]
    size = float(np.prod(k))
    xs = F.pad(x, _torch_pad(b, [ei + xi for ei, xi in zip(e, extra)]))
    sums = fn(xs, k, s) * size
    ones = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype)
    if attrs.get("count_include_pad", 0):
        ones = F.pad(ones, _torch_pad(b, e), value=1.0)
        mask = F.pad(ones, _torch_pad([0] * len(k), extra))
    else:
        mask = F.pad(ones, _torch_pad(b, [ei + xi for ei, xi in zip(e, extra)]))
    counts = fn(mask, k, s) * size
    return sums / counts


def _conv(x, w, b, attrs):
    nd = w.dim() - 2
    s = list(attrs.get("strides", [1] * nd))
    d = list(attrs.get("dilations", [1] * nd))
    group = attrs.get("group", 1)
    begins, ends = _spatial_pads(attrs, nd)
    if begins == ends:
        padding = [int(p) for p in begins]
    else:
        x = F.pad(x, _torch_pad(begins, ends))
        padding = [0] * nd
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    return fn(x, w, b, s, padding, d, group)


def _lrn(x, attrs):
    """ONNX LRN: square_sum[c] = sum of x[c']^2 for c' in [c - floor((size-1)/2),
    c + ceil((size-1)/2)]; y = x / (bias + alpha / size * square_sum) ** beta."""
    size = attrs["size"]
    alpha = attrs.get("alpha", 1e-4)
    beta = attrs.get("beta", 0.75)
    bias = attrs.get("bias", 1.0)
    lo, hi = (size - 1) // 2, (size - 1) - (size - 1) // 2
    sq = x * x
    pad = [0, 0] * (x.dim() - 2) + [lo, hi]
    sqp = F.pad(sq, pad)
    c = x.shape[1]
    ssum = sum(sqp[:, j:j + c] for j in range(size))
    return x / (bias + alpha / size * ssum) ** beta


def _reshape(x, shape):
    shape = [int(v) for v in shape.tolist()]
    shape = [x.shape[i] if v == 0 else v for i, v in enumerate(shape)]
    return x.reshape(shape)


def _softmax(x, attrs, opset):
    if opset >= 13:
        return torch.softmax(x, attrs.get("axis", -1))
    axis = attrs.get("axis", 1)
    axis = axis + x.dim() if axis < 0 else axis
    lead = int(np.prod(x.shape[:axis]))
    return torch.softmax(x.reshape(lead, -1), 1).reshape(x.shape)


def _gemm(a, b, c, attrs):
    if attrs.get("transA", 0):
        a = a.t()
    if attrs.get("transB", 0):
        b = b.t()
    y = attrs.get("alpha", 1.0) * (a @ b)
    if c is not None:
        y = y + attrs.get("beta", 1.0) * c
    return y


def _unsqueeze(x, axes):
    r = x.dim() + len(axes)
    for a in sorted(v + r if v < 0 else v for v in axes):
        x = x.unsqueeze(a)
    return x


def _flatten(x, attrs):
    axis = attrs.get("axis", 1)
    axis = axis + x.dim() if axis < 0 else axis
    return x.reshape(int(np.prod(x.shape[:axis])), -1)


def _node(node, ins, opset):
    op, at = node.op_type, _attrs(node)
    x = ins[0]
    if op == "Conv":
        return [_conv(x, ins[1], ins[2] if len(ins) > 2 else None, at)]
    if op == "BatchNormalization":
        if len(node.output) > 1 and any(node.output[1:]):
            raise NotImplementedError("BatchNormalization in training mode")
        # written out (F.batch_norm does not differentiate w.r.t. the running statistics)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        scale, bias, mean, var = (v.reshape(shape) for v in ins[1:5])
        return [(x - mean) / torch.sqrt(var + at.get("epsilon", 1e-5)) * scale + bias]
    if op == "Relu":
        return [torch.relu(x)]
    if op == "MaxPool":
        if len(node.output) > 1 and any(node.output[1:]):
            raise NotImplementedError("MaxPool Indices")
        return [_max_pool(x, at)]
    if op == "AveragePool":
        return [_avg_pool(x, at)]
    if op == "GlobalAveragePool":
        return [x.mean(dim=tuple(range(2, x.dim())), keepdim=True)]
    if op == "Gemm":
        return [_gemm(x, ins[1], ins[2] if len(ins) > 2 else None, at)]
    if op == "Reshape":
        return [_reshape(x, ins[1])]
    if op == "Softmax":
        return [_softmax(x, at, opset)]
    if op == "LRN":
        return [_lrn(x, at)]
    if op == "Dropout":  # inference: identity (and an all-true mask if asked for)
        return [x, torch.ones(x.shape, dtype=torch.bool)][:len(node.output)]
    if op == "Concat":
        return [torch.cat(ins, at["axis"])]
    if op == "Sum":
        y = ins[0]
        for v in ins[1:]:
            y = y + v
        return [y]
    if op == "Add":
        return [x + ins[1]]
    if op == "Mul":
        return [x * ins[1]]
    if op == "Unsqueeze":
        axes = at["axes"] if "axes" in at else ins[1].tolist()
        return [_unsqueeze(x, list(axes))]
    if op == "Transpose":
        perm = at.get("perm", list(reversed(range(x.dim()))))
        return [x.permute(*perm)]
    if op == "Flatten":
        return [_flatten(x, at)]
    raise NotImplementedError(f"torch_interp: op {op}")


def _kinked(node, x, ref, tie=None):
    """Relu / MaxPool of ``x`` on the piece that ``ref`` (the same tensor computed elsewhere,
    e.g. in float32) lies on: Relu's mask and MaxPool's argmax are taken from ``ref``, the values
    from ``x``. In float64 this is the gradient a correct float32 backward computes, free of the
    near-ties (|a - b| ~ 1e-7) that float32 rounding resolves the other way.

    With ``tie`` (a fraction of max |x|), only the near-ties are taken from ``ref``: a decision
    is x's own unless x itself puts it within tie * max |x| of the other side (a Relu input that
    close to 0, a window whose ref-chosen element is that close to its maximum), where
    rounding may resolve it either way and each choice is right."""
    ref = ref.to(x.dtype)
    tol = None if tie is None else tie * float(x.detach().abs().max())
    if node.op_type == "Relu":
        on = ref > 0
        if tol is not None:
            on = torch.where(x.detach().abs() <= tol, on, x.detach() > 0)
        return x * on.to(x.dtype)
    k, s, b, e, extra = _pool_geometry(x, _attrs(node))
    pad = _torch_pad(b, [ei + xi for ei, xi in zip(e, extra)])
    fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[len(k)]
    _, idx = fn(F.pad(ref, pad, value=-math.inf), k, s, return_indices=True)
    shape, idx = idx.shape, idx.flatten(2)
    xp = F.pad(x, pad, value=-math.inf).flatten(2)
    if tol is not None:
        best, own = fn(F.pad(x.detach(), pad, value=-math.inf), k, s, return_indices=True)
        near = best.flatten(2) - xp.detach().gather(2, idx) <= tol
        idx = torch.where(near, idx, own.flatten(2))
    return xp.gather(2, idx).reshape(shape)


def run(model: onnx.ModelProto, values: dict, outputs=None, kinks=None, tie=None):
    """Run ``model``'s graph on ``values`` (name -> torch tensor: the graph inputs and every
    initializer, e.g. from ``initializers``); returns the tensors named by ``outputs`` (default:
    the graph outputs), as a list. ``kinks``: name -> reference value of a Relu's or MaxPool's
    input, whose mask / argmax are used instead of the input's own (``_kinked``); with ``tie``,
    only where the input's own decision is a near-tie."""
    opset = _opset(model)
    env = dict(values)
    kinks = kinks or {}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            raise NotImplementedError(f"torch_interp: domain {node.domain}")
        ins = [env[n] if n else None for n in node.input]
        if node.op_type in ("Relu", "MaxPool") and node.input[0] in kinks:
            outs = [_kinked(node, ins[0], kinks[node.input[0]], tie)]
        else:
            outs = _node(node, ins, opset)
        for name, v in zip(node.output, outs):
            if name:
                env[name] = v
    names = outputs or [o.name for o in model.graph.output]
    return [env[n] for n in names]
