"""Forward forms for the training step: Conv nodes that onnxruntime runs slowly once their
weights are graph inputs, rewritten into equivalent standard ops before differentiation (and
Dropouts of constant ratio 0, which keep every element, as Identity: :func:`zero_dropouts`).

With a constant kernel onnxruntime's CPU provider repacks a Conv into its blocked (NCHWc)
layout; a training step feeds the kernel as an input, so its Conv runs the generic path: one
small GEMM per image (per image and group for a grouped one), which re-reads the whole kernel
for each image. On the small images at the end of a CNN that path is several times slower than
the same arithmetic as one matrix product (ResNet-18's 512-channel 2x2 layers at 64x64 input:
13 ms per Conv, batch 32; MobileNetV3's 5x5 depthwise 2x2 layers: 6 ms, batch 64; measured one
thread). So a float32 2-D Conv whose kernel is a trained parameter, with static channel and
spatial dims (the batch may be symbolic), explicit pads and a small image (``MAX_POSITIONS``,
``MAX_DENSE``) becomes:

- ungrouped: im2col as a product with a constant 0/1 matrix P [H*W, O*K] (O output positions,
  K taps; padding taps select nothing), then one Gemm of the columns [N*O, C*K] with W
  reshaped [Co, C*K] (its own memory order), plus the bias;
- depthwise (group = C = Co): per channel, a dense [O, H*W] map M_c = W_c [K] times a constant
  0/1 matrix Q [K, O*H*W], applied as one batched MatMul [C, O, H*W] x [C, H*W, N] (6x faster
  forward and backward than a broadcast product and ReduceSum, measured).

Both compute each output from exactly the products the Conv forms (a padding tap contributes an
exact zero), so results agree to float rounding; only a non-finite input differs (an infinite x
meets the zeros of P or M: NaN where the Conv gives +-inf, in a step whose loss is not finite
either way). Their gradients come from the ordinary rules of MatMul, Gemm, Mul and ReduceSum,
which onnxruntime runs as a few large kernels too.
"""
from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# limits, from fwd+bwd timings on onnxruntime, one thread (batch 32 or 64, ResNet-18 and
# MobileNetV3 layer shapes): an ungrouped Conv gains 1.9x-2.3x at 2x2 outputs and nothing at
# 4x4; a depthwise one 15x-20x at O*H*W <= 256, 3.4x at an 8x8 image (4096), 1.3x at 16384
MAX_POSITIONS = 4         # ungrouped: output positions per image
MAX_DENSE = 4096          # depthwise: output positions x input positions per image


def small_image_convs(m: onnx.ModelProto, params: set[str], taken: set[str]) -> int:
    """Rewrite, in place, the Conv nodes of ``m``'s main graph that qualify (see the module
    doc) and whose kernel is one of ``params`` (graph inputs); returns how many. ``taken``:
    names in use, extended with the new ones."""
    shapes = _static_shapes(m)
    out, done = [], 0
    for node in m.graph.node:
        new = _rewrite(node, shapes, params, taken)
        out.extend(new if new is not None else [node])
        done += new is not None
    if done:
        del m.graph.node[:]
        m.graph.node.extend(out)
    return done


def zero_dropouts(m: onnx.ModelProto) -> int:
    """Rewrite, in place, each Dropout of ``m``'s main graph whose ratio is a constant 0 and
    whose mask output nothing reads into an Identity; returns how many. Such a node keeps every
    element in either mode (exporters write a training-mode Dropout(p=0), as for
    TransformerEncoderLayer(dropout=0)); onnxruntime still draws and writes its mask (1.7 ms on
    a [32, 64, 1024] tensor, one thread, measured), and Identity passes x through."""
    consts = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer if not t.dims}
    consts.update((n.output[0], numpy_helper.to_array(n.attribute[0].t)) for n in m.graph.node
                  if n.op_type == "Constant" and n.domain in ("", "ai.onnx")
                  and len(n.attribute) == 1 and n.attribute[0].name == "value")
    read = {i for n in m.graph.node for i in n.input} | {o.name for o in m.graph.output}
    inputs = {i.name for i in m.graph.input}  # an initializer that is also an input may be fed
    done = 0
    for n in m.graph.node:
        if n.op_type != "Dropout" or n.domain not in ("", "ai.onnx") or len(n.input) < 2:
            continue
        ratio = consts.get(n.input[1]) if n.input[1] not in inputs else None
        if ratio is None or ratio.size != 1 or float(ratio) != 0.0:
            continue
        if len(n.output) > 1 and n.output[1] and n.output[1] in read:
            continue
        n.op_type = "Identity"
        del n.input[1:], n.output[1:], n.attribute[:]
        done += 1
    return done


def _static_shapes(m: onnx.ModelProto) -> dict[str, tuple]:
    """name -> (elem_type, dims with None for non-static ones), from onnx shape inference."""
    try:
        g = onnx.shape_inference.infer_shapes(m).graph
    except onnx.shape_inference.InferenceError:
        g = m.graph
    out = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = (t.elem_type, tuple(d.dim_value if d.HasField("dim_value") else None
                                               for d in t.shape.dim))
    return out


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def explicit_pads(a: dict) -> bool:
    """Whether a Conv's attributes ``a`` (from :func:`_attrs`) give its pads (auto_pad NOTSET or
    VALID), not SAME_*."""
    auto = a.get("auto_pad", b"NOTSET")
    return (auto.decode() if isinstance(auto, bytes) else auto) in ("NOTSET", "VALID")


def conv_out_dims(hw, k, a: dict) -> tuple[int, int]:
    """A 2-D Conv's output height and width, for explicit pads (attributes ``a``)."""
    p, s, d = a.get("pads", [0] * 4), a.get("strides", [1, 1]), a.get("dilations", [1, 1])
    return tuple((hw[i] + p[i] + p[i + 2] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(2))


def _rewrite(node, shapes, params, taken):
    """The replacement nodes of one Conv, or None to keep it."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    x, w = node.input[0], node.input[1]
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if w not in params or x not in shapes or w not in shapes:
        return None
    (xt, xs), (wt, ws) = shapes[x], shapes[w]
    if xt != TensorProto.FLOAT or wt != TensorProto.FLOAT or len(xs) != 4 or len(ws) != 4 or \
            None in xs[1:] or None in ws:
        return None
    a = _attrs(node)
    if not explicit_pads(a):
        return None
    _, c, h, wd = xs
    co, cg, kh, kw = ws
    group = int(a.get("group", 1))
    k = list(a.get("kernel_shape", [kh, kw]))
    s = list(a.get("strides", [1, 1]))
    d = list(a.get("dilations", [1, 1]))
    p = list(a.get("pads", [0, 0, 0, 0]))
    ho, wo = conv_out_dims((h, wd), k, a)
    if k != [kh, kw] or ho < 1 or wo < 1:
        return None
    if group == 1 and cg == c:
        kind = "ungrouped" if ho * wo <= MAX_POSITIONS else None
    else:
        kind = "depthwise" if group == c == co and cg == 1 and ho * wo * h * wd <= MAX_DENSE \
            else None
    if kind is None:
        return None
    # where[o, t]: the flat input position tap t of output position o reads, or -1 (padding)
    where = np.full((ho * wo, kh * kw), -1, np.int64)
    for (i, j), (ky, kx) in itertools.product(itertools.product(range(ho), range(wo)),
                                              itertools.product(range(kh), range(kw))):
        r, q = i * s[0] - p[0] + ky * d[0], j * s[1] - p[1] + kx * d[1]
        if 0 <= r < h and 0 <= q < wd:
            where[i * wo + j, ky * kw + kx] = r * wd + q
    b = _Nodes(node.name or node.output[0], taken)
    if kind == "ungrouped":
        y = b.ungrouped(x, w, bias, where, c, co, h * wd)
    else:
        y = b.depthwise(x, w, bias, where, c, h * wd)
    b.op("Reshape", y, b.const([-1, co, ho, wo]), out=node.output[0])
    return b.nodes


class _Nodes:
    """NodeProtos named under the rewritten node's name."""

    def __init__(self, base: str, taken: set[str]):
        self.base, self.taken, self.nodes = base, taken, []

    def _name(self, kind: str) -> str:
        name, k = f"{self.base}/{kind}", 0
        while name in self.taken:
            k += 1
            name = f"{self.base}/{kind}_{k}"
        self.taken.add(name)
        return name

    def op(self, op_type, *inputs, out=None, **attrs):
        name = self._name(op_type)
        out = out or name
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=name, **attrs))
        return out

    def const(self, value, dtype=np.int64):
        name = self._name("const")
        self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                           value=numpy_helper.from_array(np.asarray(value, dtype))))
        return name

    def ungrouped(self, x, w, bias, where, c, co, hw):
        o, k = where.shape
        pick = np.zeros((hw, o * k), np.float32)                      # P [H*W, O*K]
        rows = where.reshape(-1)
        pick[rows[rows >= 0], np.flatnonzero(rows >= 0)] = 1
        cols = self.op("MatMul", self.op("Reshape", x, self.const([-1, hw])),
                       self.const(pick, np.float32))                  # [N*C, O*K]
        cols = self.op("Transpose", self.op("Reshape", cols, self.const([-1, c, o, k])),
                       perm=[0, 2, 1, 3])                             # [N, O, C, K]
        y = self.op("Gemm", self.op("Reshape", cols, self.const([-1, c * k])),
                    self.op("Reshape", w, self.const([co, c * k])),
                    *([bias] if bias else []), transB=1)              # [N*O, Co]
        return self.op("Transpose", self.op("Reshape", y, self.const([-1, o, co])),
                       perm=[0, 2, 1])                                # [N, Co, O]

    def depthwise(self, x, w, bias, where, c, hw):
        o, k = where.shape
        spread = np.zeros((k, o, hw), np.float32)                     # Q [K, O*H*W]
        oo, tt = np.nonzero(where >= 0)
        spread[tt, oo, where[oo, tt]] = 1
        dense = self.op("MatMul", self.op("Reshape", w, self.const([c, k])),
                        self.const(spread.reshape(k, o * hw), np.float32))  # [C, O*H*W]
        dense = self.op("Reshape", dense, self.const([c, o, hw]))
        xt = self.op("Transpose", self.op("Reshape", x, self.const([-1, c, hw])),
                     perm=[1, 2, 0])                                  # [C, H*W, N]
        y = self.op("Transpose", self.op("MatMul", dense, xt), perm=[2, 0, 1])  # [N, C, O]
        if bias:
            y = self.op("Add", y, self.op("Reshape", bias, self.const([1, c, 1])))
        return y
