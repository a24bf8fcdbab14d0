"""Random PyTorch modules, exported by torch.onnx, against torch autograd in float64.

A generator of the models users bring (``tests/test_torch_export_fuzz.py``; more examples with
``python bench/fuzz_torch.py``): a stack of 1 to 5 layers drawn from a catalogue of image layers
(convolutions with every padding mode, strides, dilations, groups; transposed convolutions;
batch, group, instance and layer norms; max, average, LP and adaptive pools with padding and
ceil_mode; upsampling; pixel shuffles; 23 activations; residual, concatenating and
squeeze-excite blocks; pads, slices, permutes; tensor and math ops: products with exact
zeros, gathers and indexing with repeats and negative indices, sorts, top-k, norms, einsum,
elementwise functions), sequence layers (Linear, LayerNorm, attention,
TransformerEncoderLayer, LSTM / GRU / RNN, Conv1d, softmax, cumsum) or 1-D and 3-D layers
(Conv, ConvTranspose, max and average pools with ceil_mode, norms, upsampling), then a head:
a Linear, or a loss (cross-entropy with class weights, ignore_index and label smoothing, NLL,
MSE, L1, smooth L1, Huber, BCE with logits, KL, soft margin) per image, per pixel (as a
segmentation net's) or per step.
The module is exported (the TorchScript exporter at a drawn opset, training or eval mode, or
the dynamo exporter; symbolic batch), ``onnxgrad.gradients`` differentiates ``sum(y * cot)``
wrt the input and every parameter the export holds as it is, and the gradients, run on
onnxruntime in float32, are compared with torch autograd on the same module in float64
(:func:`check`; the tolerance is explained at :func:`util.within` and in the README).

``check(..., via="trainer")`` takes the training step's own path instead (the loss
sum(y * cot) attached, :func:`onnxgrad.training.step.build_gradient_model` with its forward
rewrites, a Trainer's session with its blocked convolutions) and checks the parameters'
gradients and the loss; the "wide" family (a 16-channel stem and a 16-channel dense or
depthwise convolution) gives it convolutions that those rewrites take.

Kinks: where a float32 forward and a float64 one may take different sides of a ReLU, a clamp,
a shrink or a max (a value within KINK_MARGIN of the kink, or two window values that close),
either gradient is right. Each such layer records, in the float64 run, how far its input came
from its kinks, and the example is rejected when closer than KINK_MARGIN x its scale: the
decision is made in float64, so it is the same on every machine.
"""
from __future__ import annotations

import io
import math

import numpy as np
import onnx
import torch
from hypothesis import assume
from hypothesis import strategies as st

import onnxgrad
from util import stock_session as session
from util import quiet, within

nn, F = torch.nn, torch.nn.functional

KINK_MARGIN = 1e-5
TOL = 1e-3  # max |ours - torch64| / max |torch64| per tensor, ours in float32
FLOOR = 1e-5  # and an absolute floor: this times the largest gradient of any backward step
_record: list | None = None  # margins of the float64 run, while it records


def _note(margin, scale):
    if _record is not None:
        _record.append(float(margin) / max(float(scale), 1.0))


class Kinked(nn.Module):
    """``inner`` (an activation) with kinks at ``points``: records the input's distance to them."""

    def __init__(self, inner, points):
        super().__init__()
        self.inner, self.points = inner, tuple(points)

    def forward(self, x):
        if _record is not None and x.numel():
            with torch.no_grad():
                _note(min(float((x - p).abs().min()) for p in self.points), x.abs().max())
        return self.inner(x)


def _window_gap(x, k, s, p, d, ceil):
    """The smallest gap between the two largest values of any 2-D max-pool window (-inf pads)."""
    ph, pw = p
    ex = [(kk - 1) * dd + 1 for kk, dd in zip(k, d)]
    extra = [(ss - 1 if ceil else 0) for ss in s]
    xp = F.pad(x, (pw, pw + extra[1], ph, ph + extra[0]), value=-float("inf"))
    if xp.shape[2] < ex[0] or xp.shape[3] < ex[1]:
        return None
    u = F.unfold(xp.reshape(-1, 1, *xp.shape[2:]), k, dilation=d, stride=s)  # [B, kh*kw, L]
    if u.shape[1] < 2:
        return None
    top = u.topk(2, dim=1).values
    gap = top[:, 0] - top[:, 1]
    gap = gap[torch.isfinite(gap)]
    return float(gap.min()) if gap.numel() else None


class Pool(nn.Module):
    """F.max_pool1d, 2d or 3d that records its windows' smallest top-2 gap."""

    def __init__(self, k, s, p, d, ceil):
        super().__init__()
        self.a = (k, s, p, d, ceil)

    def forward(self, x):
        k, s, p, d, ceil = self.a
        if _record is not None:
            with torch.no_grad():
                gap = (_window_gap if x.dim() == 4 else _window_gap_nd)(x, k, s, p, d, ceil)
                if gap is not None:
                    _note(gap, x.abs().max())
        f = {3: F.max_pool1d, 4: F.max_pool2d, 5: F.max_pool3d}[x.dim()]
        return f(x, k, s, p, d, ceil_mode=ceil)

    def extra_repr(self):
        return "kernel {}, stride {}, padding {}, dilation {}, ceil_mode {}".format(*self.a)


class Fn(nn.Module):
    """``f(self, x)`` with submodules: one catalogue layer or block, shown as ``desc``."""

    def __init__(self, desc, f, **mods):
        super().__init__()
        self.desc, self.f = desc, f
        for k, v in mods.items():
            setattr(self, k, v)

    def forward(self, x):
        return self.f(self, x)

    def extra_repr(self):
        return self.desc


# -- the catalogue: each draws a layer for an input shape and returns (module, new shape) -------
def _act(draw):
    """An activation layer (those with kinks wrapped in :class:`Kinked`)."""
    name = draw(st.sampled_from([
        "relu", "leaky", "elu", "selu", "celu", "gelu", "gelu_tanh", "silu", "mish",
        "hardswish", "hardsigmoid", "hardtanh", "relu6", "softplus", "sigmoid", "tanh",
        "softsign", "logsigmoid", "tanhshrink", "softshrink", "hardshrink", "prelu", "abs"]))
    if name == "relu":
        return Kinked(nn.ReLU(), [0])
    if name == "leaky":
        return Kinked(nn.LeakyReLU(draw(st.sampled_from([0.01, 0.2, 1.5]))), [0])
    if name == "elu":
        return Kinked(nn.ELU(draw(st.sampled_from([1.0, 0.5]))), [0])
    if name == "selu":
        return Kinked(nn.SELU(), [0])
    if name == "celu":
        return Kinked(nn.CELU(draw(st.sampled_from([1.0, 2.0]))), [0])
    if name == "hardswish":
        return Kinked(nn.Hardswish(), [-3, 3])
    if name == "hardsigmoid":
        return Kinked(nn.Hardsigmoid(), [-3, 3])
    if name == "hardtanh":
        lo = draw(st.sampled_from([-1.0, -0.5]))
        return Kinked(nn.Hardtanh(lo, 1.0), [lo, 1.0])
    if name == "relu6":
        return Kinked(nn.ReLU6(), [0, 6])
    if name == "softplus":
        return nn.Softplus(draw(st.sampled_from([1.0, 2.0])))
    if name in ("softshrink", "hardshrink"):
        lam = draw(st.sampled_from([0.1, 0.5]))
        return Kinked(nn.Softshrink(lam) if name == "softshrink" else nn.Hardshrink(lam),
                      [-lam, lam])
    if name == "prelu":
        return Kinked(nn.PReLU(), [0])
    if name == "abs":
        return Kinked(Fn("abs", lambda m, x: x.abs()), [0])
    return {"gelu": nn.GELU(), "gelu_tanh": nn.GELU("tanh"), "silu": nn.SiLU(),
            "mish": nn.Mish(), "sigmoid": nn.Sigmoid(), "tanh": nn.Tanh(),
            "softsign": nn.Softsign(), "logsigmoid": nn.LogSigmoid(),
            "tanhshrink": nn.Tanhshrink()}[name]


def _conv_out(n, k, s, p, d):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _pool_out(n, k, s, p, d, ceil):
    num = n + 2 * p - d * (k - 1) - 1
    o = (-(-num // s) if ceil else num // s) + 1
    if ceil and (o - 1) * s >= n + p:  # the last window may not start in the end padding
        o -= 1
    return o


@st.composite
def conv(draw, c, h, w):
    k = draw(st.sampled_from([1, 2, 3, 5]))
    s = draw(st.sampled_from([1, 1, 2]))
    d = draw(st.sampled_from([1, 1, 2]))
    p = draw(st.integers(0, (d * (k - 1)) // 2 + 1))
    mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
    if mode != "zeros":
        p = min(p, h - 1, w - 1)
    co = draw(st.sampled_from([*range(1, 9), 16]))
    groups = draw(st.sampled_from([g for g in (1, 1, 2, c) if c % g == 0 and co % g == 0]))
    ho, wo = _conv_out(h, k, s, p, d), _conv_out(w, k, s, p, d)
    assume(ho >= 1 and wo >= 1)
    m = nn.Conv2d(c, co, k, s, p, d, groups=groups, bias=draw(st.booleans()), padding_mode=mode)
    return m, (co, ho, wo)


@st.composite
def conv_transpose(draw, c, h, w):
    k = draw(st.sampled_from([1, 2, 3, 4]))
    s = draw(st.sampled_from([1, 2, 2]))
    d = draw(st.sampled_from([1, 1, 2]))
    p = draw(st.integers(0, (d * (k - 1)) // 2))
    op = draw(st.integers(0, s - 1))  # onnxruntime: output_padding < stride (torch: or dilation)
    co = draw(st.integers(1, 6))
    groups = draw(st.sampled_from([1, c])) if co % c == 0 else 1
    ho, wo = [(n - 1) * s - 2 * p + d * (k - 1) + op + 1 for n in (h, w)]
    assume(1 <= ho <= 24 and 1 <= wo <= 24)
    m = nn.ConvTranspose2d(c, co, k, s, p, op, groups=groups, bias=draw(st.booleans()),
                           dilation=d)
    return m, (co, ho, wo)


@st.composite
def norm(draw, c, h, w):
    kind = draw(st.sampled_from(["batch", "batch", "group", "instance", "layer"]))
    # each normalized set of at least 4 values: over 2 the outputs are +-1 whatever x is, and
    # every gradient through them is float32 noise, nothing to compare
    if kind == "batch":
        assume(h * w >= 2)  # the batch is 2
        m = nn.BatchNorm2d(c, momentum=draw(st.sampled_from([0.1, 0.5])))
    elif kind == "group":
        g = draw(st.sampled_from([d for d in range(1, c + 1) if c % d == 0]))
        assume(c // g * h * w >= 4)
        m = nn.GroupNorm(g, c, affine=draw(st.booleans()))
    elif kind == "instance":
        assume(h * w >= 4)
        m = nn.InstanceNorm2d(c, affine=draw(st.booleans()))
    else:
        whole = draw(st.booleans())
        assume(whole or w >= 4)
        m = nn.LayerNorm([c, h, w] if whole else [w], elementwise_affine=draw(st.booleans()))
    return m, (c, h, w)


@st.composite
def pool(draw, c, h, w):
    kind = draw(st.sampled_from(["max", "max", "avg", "adaptive_avg", "adaptive_max", "lp"]))
    if kind.startswith("adaptive"):
        oh, ow = draw(st.integers(1, h)), draw(st.integers(1, w))
        assume(h % oh == 0 and w % ow == 0)  # the exporter's pools need whole tiles
        if kind == "adaptive_avg":
            return nn.AdaptiveAvgPool2d((oh, ow)), (c, oh, ow)
        return Pool((h // oh, w // ow), (h // oh, w // ow), (0, 0), (1, 1), False), (c, oh, ow)
    k = draw(st.sampled_from([2, 2, 3]))
    s = draw(st.sampled_from([1, 2, k]))
    p = draw(st.integers(0, k // 2))
    ceil = draw(st.booleans())
    if kind == "max":
        d = draw(st.sampled_from([1, 1, 2]))
        ho, wo = _pool_out(h, k, s, p, d, ceil), _pool_out(w, k, s, p, d, ceil)
        assume(ho >= 1 and wo >= 1)
        # torch 2.13's max_pool2d backward corrupts its heap where a window lies wholly in the
        # padding (onnxruntime's forward gives -FLT_MAX there, torch's -inf)
        assume(all(any(0 <= i * s - p + j * d < n for j in range(k))
                   for n, o in ((h, ho), (w, wo)) for i in range(o)))
        return Pool((k, k), (s, s), (p, p), (d, d), ceil), (c, ho, wo)
    if kind == "lp":
        ho, wo = _pool_out(h, k, s, 0, 1, False), _pool_out(w, k, s, 0, 1, False)
        assume(ho >= 1 and wo >= 1)
        return nn.LPPool2d(2, k, s), (c, ho, wo)
    incl = draw(st.booleans())
    ho, wo = _pool_out(h, k, s, p, 1, ceil), _pool_out(w, k, s, p, 1, ceil)
    assume(ho >= 1 and wo >= 1)
    return nn.AvgPool2d(k, s, p, ceil_mode=ceil, count_include_pad=incl), (c, ho, wo)


@st.composite
def resample(draw, c, h, w):
    kind = draw(st.sampled_from(["nearest", "bilinear", "bilinear_ac", "bicubic", "shuffle",
                                 "unshuffle"]))
    if kind == "shuffle":
        assume(c % 4 == 0)
        return nn.PixelShuffle(2), (c // 4, 2 * h, 2 * w)
    if kind == "unshuffle":
        assume(h % 2 == 0 and w % 2 == 0)
        return nn.PixelUnshuffle(2), (4 * c, h // 2, w // 2)
    assume(h <= 12 and w <= 12)
    mode = {"nearest": "nearest", "bicubic": "bicubic"}.get(kind, "bilinear")
    ac = True if kind == "bilinear_ac" else None
    scale = draw(st.sampled_from([2.0, 2.0, 1.5, 0.5]))
    ho, wo = int(h * scale), int(w * scale)
    assume(ho >= 1 and wo >= 1)
    return Fn(f"interpolate x{scale} {mode} align_corners={ac}",
              lambda m, x: F.interpolate(x, scale_factor=scale, mode=mode, align_corners=ac)), \
        (c, ho, wo)


@st.composite
def reshape(draw, c, h, w):
    kind = draw(st.sampled_from(["slice", "pad", "permute", "softmax", "mean", "amax", "cumsum",
                                 "chunk_mul", "flip", "normalize", "std", "logsumexp", "maxdim",
                                 "gram", "clamp", "square", "roll"]))
    if kind == "normalize":
        return _noting("normalize dim 1", lambda m, x: F.normalize(x, dim=1),  # as std below
                       lambda x: float(torch.linalg.vector_norm(x, 2, dim=1).min())), (c, h, w)
    if kind == "std":
        assume(h * w >= 2)
        # sqrt at a zero variance (a plane of exact zeros, after a ReLU and a product) is a
        # kink: torch's std backward gives 0 there, the exported Sqrt's chain rule 0 * inf
        return _noting("x / std(x, (2, 3))",
                       lambda m, x: x / (x.std(dim=(2, 3), keepdim=True) + 1.0),
                       lambda x: float(x.std(dim=(2, 3)).min())), (c, h, w)
    if kind == "logsumexp":
        return Fn("x - logsumexp(x, 3)",
                  lambda m, x: x - torch.logsumexp(x, dim=3, keepdim=True)), (c, h, w)
    if kind == "maxdim":
        def f(m, x):
            if _record is not None and x.shape[3] > 1:
                with torch.no_grad():
                    top = x.topk(2, dim=3).values
                    _note((top[..., 0] - top[..., 1]).min(), x.abs().max())
            return x.max(dim=3, keepdim=True).values * x
        return Fn("max(x, 3) * x", f), (c, h, w)
    if kind == "gram":
        return Fn("x @ x^T / w", lambda m, x: x @ x.transpose(2, 3) / x.shape[3]), (c, h, h)
    if kind == "clamp":
        return Kinked(Fn("clamp(-0.5, 1)", lambda m, x: x.clamp(-0.5, 1.0)), [-0.5, 1.0]), \
            (c, h, w)
    if kind == "square":
        return Fn("x * x.abs() / 2", lambda m, x: x * x.abs() / 2), (c, h, w)
    if kind == "roll":
        return Fn("roll 1 dim 2", lambda m, x: torch.roll(x, 1, dims=2)), (c, h, w)
    if kind == "slice":
        assume(h >= 3 and w >= 2)
        return Fn("x[:, :, 1:, ::2]", lambda m, x: x[:, :, 1:, ::2]), (c, h - 1, (w + 1) // 2)
    if kind == "pad":
        mode = draw(st.sampled_from(["constant", "reflect", "replicate"]))
        assume(mode == "constant" or (h > 2 and w > 2))
        return Fn(f"pad (1, 2, 2, 0) {mode}",
                  lambda m, x: F.pad(x, (1, 2, 2, 0), mode=mode)), (c, h + 2, w + 3)
    if kind == "permute":
        return Fn("permute 0 1 3 2",
                  lambda m, x: x.permute(0, 1, 3, 2).contiguous()), (c, w, h)
    if kind == "softmax":
        dim = draw(st.sampled_from([1, 3]))
        f = F.log_softmax if draw(st.booleans()) else F.softmax
        return Fn(f"{f.__name__} dim {dim}", lambda m, x: f(x, dim=dim)), (c, h, w)
    if kind == "mean":
        return Fn("x - mean(x, (2, 3))",
                  lambda m, x: x - x.mean(dim=(2, 3), keepdim=True)), (c, h, w)
    if kind == "amax":
        def f(m, x):
            if _record is not None and x.shape[1] > 1:
                with torch.no_grad():
                    top = x.topk(2, dim=1).values
                    _note((top[:, 0] - top[:, 1]).min(), x.abs().max())
            return x * x.amax(dim=1, keepdim=True)
        return Fn("x * amax(x, 1)", f), (c, h, w)
    if kind == "cumsum":
        return Fn("cumsum dim 3", lambda m, x: torch.cumsum(x, dim=3)), (c, h, w)
    if kind == "flip":
        return Fn("flip dim 2", lambda m, x: torch.flip(x, dims=[2])), (c, h, w)
    assume(c % 2 == 0)
    return Fn("a * sigmoid(b), a, b = chunk(x, 2, 1)",
              lambda m, x: (lambda a, b: a * torch.sigmoid(b))(*x.chunk(2, dim=1))), \
        (c // 2, h, w)


def _gaps(v, dim):
    """The smallest gap between neighbours of ``v`` sorted along ``dim`` (ties: 0)."""
    if v.shape[dim] < 2:
        return None
    u = v.sort(dim=dim).values
    return float((u.narrow(dim, 1, v.shape[dim] - 1) - u.narrow(dim, 0, v.shape[dim] - 1)).min())


def _noting(desc, f, margin, **mods):
    """Fn ``f`` that records ``margin(x)`` (its input's distance to a kink, or None) first."""
    def g(m, x):
        if _record is not None:
            with torch.no_grad():
                d = margin(x)
                if d is not None:
                    _note(d, x.abs().max())
        return f(m, x)
    return Fn(desc, g, **mods)


@st.composite
def tensor_op(draw, c, h, w):
    """Tensor and math ops (products, gathers, sorts, norms, einsum, elementwise functions)."""
    kind = draw(st.sampled_from([
        "prod", "maximum", "minimum", "gather", "index", "where_const", "where_cmp", "topk",
        "sort", "tril", "repeat", "expand", "einsum", "math", "norm", "var", "cosine", "diff",
        "stack", "split_cat", "unfold", "bmm_param"]))
    if kind == "prod":
        return _noting("prod(relu(x), 3) (exact zeros)",
                       lambda m, x: torch.relu(x).prod(3, keepdim=True),
                       lambda x: float(x.abs().min())), (c, h, 1)
    if kind in ("maximum", "minimum"):
        f = torch.maximum if kind == "maximum" else torch.minimum
        other = lambda x: 0.5 * x.flip(3) + 0.1  # noqa: E731
        return _noting(f"{kind}(x, 0.5 flip(x, 3) + 0.1)", lambda m, x: f(x, other(x)),
                       lambda x: float((x - other(x)).abs().min())), (c, h, w)
    if kind == "gather":  # repeated indices: their gradients add up
        k = draw(st.integers(1, 2 * w))
        idx = torch.tensor(draw(st.lists(st.integers(0, w - 1), min_size=k, max_size=k)))
        return Fn(f"gather(x, 3, {idx.tolist()})", lambda m, x: x.gather(
            3, idx.view(1, 1, 1, k).expand(x.shape[0], c, h, k))), (c, h, k)
    if kind == "index":  # negative indices and repeats along a spatial dim
        k = draw(st.integers(1, 2 * h))
        idx = draw(st.lists(st.integers(-h, h - 1), min_size=k, max_size=k))
        t = torch.tensor(idx)
        return Fn(f"x[:, :, {idx}]", lambda m, x: x[:, :, t]), (c, k, w)
    if kind == "where_const":
        mask = torch.tensor(np.random.default_rng(draw(st.integers(0, 99))).random((h, w)) < 0.5)
        return Fn("where(fixed mask, x, -2x)", lambda m, x: torch.where(mask, x, -2 * x)), \
            (c, h, w)
    if kind == "where_cmp":  # a jump at 0.25
        return _noting("where(x > 0.25, x, x * x)",
                       lambda m, x: torch.where(x > 0.25, x, x * x),
                       lambda x: float((x - 0.25).abs().min())), (c, h, w)
    if kind == "topk":
        k = draw(st.integers(1, w))
        return _noting(f"topk(x, {k}, 3).values", lambda m, x: x.topk(k, dim=3).values,
                       lambda x: _gaps(x, 3)), (c, h, k)
    if kind == "sort":
        desc = draw(st.booleans())
        return _noting(f"sort(x, 2, descending={desc}).values",
                       lambda m, x: x.sort(dim=2, descending=desc).values,
                       lambda x: _gaps(x, 2)), (c, h, w)
    if kind == "tril":
        d = draw(st.integers(-1, 1))
        return Fn(f"tril(x, {d})", lambda m, x: torch.tril(x, d)), (c, h, w)
    if kind == "repeat":
        return Fn("x.repeat(1, 1, 2, 1)", lambda m, x: x.repeat(1, 1, 2, 1)), (c, 2 * h, w)
    if kind == "expand":
        return Fn("x * mean(x, 2).expand(h)", lambda m, x: x * x.mean(2, keepdim=True).expand(
            -1, -1, h, -1)), (c, h, w)
    if kind == "einsum":
        return Fn("einsum(nchw,nchv->ncwv)", lambda m, x: torch.einsum(
            "nchw,nchv->ncwv", x, x) / h), (c, w, w)
    if kind == "bmm_param":
        p = nn.Parameter(torch.randn(w, w))
        return Fn("x @ P", lambda m, x: torch.matmul(x, m.p), p=p), (c, h, w)
    if kind == "math":
        name = draw(st.sampled_from(["pow3", "sqrt", "rsqrt", "recip", "gauss", "log1p", "erf",
                                     "atan", "sin", "cos", "asinh", "exp_neg", "powt"]))
        f = {"pow3": lambda x: x.pow(3) / 4, "sqrt": lambda x: torch.sqrt(x * x + 1),
             "rsqrt": lambda x: torch.rsqrt(x * x + 1), "recip": lambda x: 1 / (1 + x * x),
             "gauss": lambda x: torch.exp(-x * x / 2), "log1p": lambda x: torch.log1p(x * x),
             "erf": torch.erf, "atan": torch.atan, "sin": torch.sin, "cos": torch.cos,
             "asinh": torch.asinh, "exp_neg": lambda x: torch.exp(-x.abs() - 1) * x,
             "powt": lambda x: torch.pow(x * x + 1, torch.sigmoid(x))}[name]
        if name == "exp_neg":
            return _noting("exp(-|x| - 1) * x", lambda m, x: f(x),
                           lambda x: float(x.abs().min())), (c, h, w)
        return Fn(name, lambda m, x: f(x)), (c, h, w)
    if kind == "norm":
        p = draw(st.sampled_from([1, 2, float("inf")]))

        def margin(x):
            if p == 2:  # sqrt at a zero row (as for std above)
                return float(torch.linalg.vector_norm(x, 2, dim=3).min())
            a = float(x.abs().min())  # |x|'s kink at 0 (p 1, inf), and ties of the max |x|
            return a if p != float("inf") else min(a, _gaps(x.abs(), 3) or a)
        return _noting(f"x / (1 + norm(x, {p}, 3))",
                       lambda m, x: x / (1 + torch.linalg.vector_norm(x, p, dim=3,
                                                                      keepdim=True)),
                       margin), (c, h, w)
    if kind == "var":
        assume(w >= 2)
        unbiased = draw(st.booleans())
        return Fn(f"var(x, 3, unbiased={unbiased})",
                  lambda m, x: x.var(3, unbiased=unbiased, keepdim=True)), (c, h, 1)
    if kind == "cosine":
        assume(c >= 2)
        return _noting("cosine_similarity(x, flip(x, 3), 1)", lambda m, x: F.cosine_similarity(
            x, x.flip(3) + 0.5, dim=1).unsqueeze(1),  # a zero vector (a conv's padding): as std
            lambda x: float(torch.linalg.vector_norm(x, 2, dim=1).min())), (1, h, w)
    if kind == "diff":
        assume(w >= 2)
        return Fn("x[..., 1:] - x[..., :-1]", lambda m, x: x[..., 1:] - x[..., :-1]), \
            (c, h, w - 1)
    if kind == "stack":
        return Fn("stack(x, x * x, 2).flatten(2, 3)",
                  lambda m, x: torch.stack([x, x * x], 2).flatten(2, 3)), (c, 2 * h, w)
    if kind == "split_cat":
        assume(w >= 2)
        return Fn("a, b = split(x, [1, w - 1], 3); cat(b, 2a)", lambda m, x: (
            lambda a, b: torch.cat([b, 2 * a], 3))(*x.split([1, w - 1], 3))), (c, h, w)
    assume(h >= 2 and w >= 2 and c * 4 * h * w <= 4096)
    return Fn("unfold(x, 2) as an image", lambda m, x: F.unfold(x, 2).unflatten(
        2, (h - 1, w - 1))), (4 * c, h - 1, w - 1)


@st.composite
def loss_head(draw, k, spatial=()):
    """A loss over logits [N, k, *spatial] with fixed labels or targets (for up to 8 images,
    cut to the batch): cross-entropy (class weights, ignore_index, label smoothing), NLL,
    MSE, L1, smooth L1, Huber, BCE with logits (pos_weight), KL divergence, soft margin;
    each reduction."""
    kind = draw(st.sampled_from(["ce", "ce", "nll", "mse", "l1", "smooth_l1", "huber", "bce",
                                 "kl", "soft_margin"]))
    rng = np.random.default_rng(draw(st.integers(0, 999)))
    red = draw(st.sampled_from(["mean", "sum", "none"]))
    if kind in ("ce", "nll"):
        assume(k >= 2)
        lab = torch.tensor(rng.integers(0, k, (8, *spatial)))
        weight = torch.tensor(rng.uniform(0.5, 2, k)) if draw(st.booleans()) else None
        ignore = draw(st.sampled_from([-100, 0]))  # 0: every label 0 is ignored
        lab.view(-1)[0] = 1  # one label counts, whatever is ignored
        smooth = draw(st.sampled_from([0.0, 0.0, 0.1])) if kind == "ce" else 0.0
        desc = (f"{kind} weight={weight is not None} ignore_index={ignore} "
                f"label_smoothing={smooth} reduction={red}")

        def f(m, z):
            w = None if weight is None else weight.to(z.dtype)
            lb = lab[: z.shape[0]]
            if kind == "ce":
                return F.cross_entropy(z, lb, weight=w, ignore_index=ignore,
                                       label_smoothing=smooth, reduction=red)
            return F.nll_loss(F.log_softmax(z, 1), lb, weight=w, ignore_index=ignore,
                              reduction=red)
        return Fn(desc, f)
    target = torch.tensor(rng.standard_normal((8, k, *spatial)))
    if kind in ("bce", "kl"):
        target = torch.tensor(rng.uniform(0, 1, (8, k, *spatial)))
    if kind == "soft_margin":
        target = torch.tensor(rng.choice([-1.0, 1.0], (8, k, *spatial)))
    pw = torch.tensor(rng.uniform(0.5, 2, (k, *[1] * len(spatial)))) \
        if kind == "bce" and draw(st.booleans()) else None
    beta = draw(st.sampled_from([0.5, 1.0]))
    if kind == "kl":
        red = draw(st.sampled_from(["batchmean", "sum"]))
    desc = f"{kind} reduction={red}" + (f" beta={beta}" if kind in ("smooth_l1", "huber")
                                         else "") + (" pos_weight" if pw is not None else "")

    def reduce(v):
        return v.mean() if red == "mean" else v.sum() if red == "sum" else v

    def f(m, z):
        t = target[: z.shape[0]].to(z.dtype)
        if kind == "mse":
            return F.mse_loss(z, t, reduction=red)
        # the TorchScript exporter has no l1, smooth_l1, huber or soft_margin loss: written
        # out, as a user exporting one writes it
        d = (z - t).abs()
        if kind == "l1":
            return reduce(d)
        if kind == "smooth_l1":
            return reduce(torch.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta))
        if kind == "huber":
            return reduce(torch.where(d < beta, 0.5 * d * d, beta * (d - 0.5 * beta)))
        if kind == "bce":
            return F.binary_cross_entropy_with_logits(
                z, t, reduction=red, pos_weight=None if pw is None else pw.to(z.dtype))
        if kind == "kl":
            return F.kl_div(F.log_softmax(z, 1), t / t.sum(1, keepdim=True), reduction=red)
        return reduce(F.softplus(-t * z))
    if kind == "l1":
        return _noting(desc, f, lambda z: float((z - target[: z.shape[0]]).abs().min()))
    return Fn(desc, f)


@st.composite
def block(draw, c, h, w, depth):
    kind = draw(st.sampled_from(["residual", "concat", "se"]))
    if kind == "se":
        r = max(1, c // 2)
        mods = dict(a=nn.Conv2d(c, r, 1), b=nn.Conv2d(r, c, 1), act=Kinked(nn.ReLU(), [0]))
        return Fn("squeeze-excite",
                  lambda m, x: x * torch.sigmoid(m.b(m.act(m.a(x.mean((2, 3), keepdim=True))))),
                  **mods), (c, h, w)
    inner, shape = draw(stack(c, h, w, depth + 1, min_layers=1, max_layers=2))
    if kind == "residual":
        assume(shape == (c, h, w))
        return Fn("x + inner(x)", lambda m, x: x + m.inner(x), inner=inner), (c, h, w)
    assume(shape[1:] == (h, w))
    return Fn("cat(x, inner(x))", lambda m, x: torch.cat([x, m.inner(x)], 1),
              inner=inner), (c + shape[0], h, w)


@st.composite
def layer(draw, c, h, w, depth):
    kinds = ["conv", "conv", "act", "act", "norm", "pool", "convt", "resample", "reshape", "op"]
    if depth < 1:
        kinds.append("block")
    kind = draw(st.sampled_from(kinds))
    if kind == "act":
        return _act(draw), (c, h, w)
    make = {"conv": conv, "convt": conv_transpose, "norm": norm, "pool": pool,
            "resample": resample, "reshape": reshape, "op": tensor_op}.get(kind)
    if make is not None:
        return draw(make(c, h, w))
    return draw(block(c, h, w, depth))


@st.composite
def stack(draw, c, h, w, depth=0, min_layers=1, max_layers=5):
    layers = []
    for _ in range(draw(st.integers(min_layers, max_layers))):
        m, (c, h, w) = draw(layer(c, h, w, depth))
        assume(c * h * w <= 4096 and h <= 32 and w <= 32)
        layers.append(m)
    return nn.Sequential(*layers), (c, h, w)


@st.composite
def image_model(draw, wide=False):
    """An image model; ``wide``: a 3x3 stem to 16 channels, then a convolution of 16 channels
    in and out, dense or depthwise (what a training step runs in onnxruntime's blocked layout,
    or as a Gemm on small images: training/nchwc.py, training/fast_forms.py)."""
    c, h, w = draw(st.integers(1, 4)), draw(st.integers(4, 10)), draw(st.integers(4, 10))
    shape, stem = (c, h, w), []
    if wide:
        k, s = draw(st.sampled_from([1, 2, 3, 5])), draw(st.sampled_from([1, 1, 2]))
        p = draw(st.integers(0, k // 2))
        h2, w2 = _conv_out(h, k, s, p, 1), _conv_out(w, k, s, p, 1)
        assume(min(h2, w2) >= 1)
        stem = [nn.Conv2d(c, 16, 3, padding=1),
                nn.Conv2d(16, 16, k, s, p, groups=draw(st.sampled_from([1, 16])),
                          bias=draw(st.booleans()))]
        c, h, w = 16, h2, w2
    body, (co, ho, wo) = draw(stack(c, h, w))
    if stem:
        body = nn.Sequential(*stem, body)
    head = draw(st.sampled_from(["none", "linear", "gap", "loss", "segmentation"]))
    if head in ("linear", "loss"):
        k = draw(st.integers(1, 5))
        body = nn.Sequential(body, nn.Flatten(), nn.Linear(co * ho * wo, k))
        if head == "loss":
            body.append(draw(loss_head(k)))
    elif head == "gap":
        body = nn.Sequential(body, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(co, draw(st.integers(1, 5))))
    elif head == "segmentation":  # per-pixel classes, as a segmentation net's loss
        k = draw(st.integers(2, 4))
        body = nn.Sequential(body, nn.Conv2d(co, k, 1), draw(loss_head(k, (ho, wo))))
    return body, shape


@st.composite
def seq_layer(draw, s, d):
    kind = draw(st.sampled_from(["linear", "norm", "act", "attn", "encoder", "rnn", "conv1d",
                                 "softmax", "cumsum", "embed", "rnn_h0"]))
    if kind == "embed":  # a learned position embedding: Gather rows of a parameter
        assume(s <= 8)
        emb = nn.Embedding(8, d)
        return Fn("x + embedding(arange(steps))", lambda m, x: x + m.emb(
            torch.arange(x.shape[1])), emb=emb), (s, d)
    if kind == "rnn_h0":  # a learned initial state, broadcast over the batch
        cls = draw(st.sampled_from([nn.GRU, nn.RNN, nn.LSTM]))
        hdim = draw(st.integers(1, 6))
        r = cls(d, hdim, batch_first=True)
        h0 = nn.Parameter(torch.randn(1, 1, hdim))

        def f(m, x):
            h = m.h0.expand(1, x.shape[0], hdim).contiguous()
            return m.r(x, (h, torch.zeros_like(h)) if cls is nn.LSTM else h)[0]
        return Fn(f"{cls.__name__} with a learned h0", f, r=r, h0=h0), (s, hdim)
    if kind == "linear":
        do = draw(st.integers(1, 12))
        return nn.Linear(d, do, bias=draw(st.booleans())), (s, do)
    if kind == "norm":
        assume(d >= 4)  # as in norm() above
        return nn.LayerNorm(d, elementwise_affine=draw(st.booleans())), (s, d)
    if kind == "act":
        return _act(draw), (s, d)
    if kind in ("attn", "encoder"):
        heads = draw(st.sampled_from([h for h in (1, 2, 4) if d % h == 0]))
        if kind == "attn":
            mha = nn.MultiheadAttention(d, heads, batch_first=True, bias=draw(st.booleans()))
            causal = draw(st.booleans())

            def f(m, x):
                mask = None
                if causal:
                    n = x.shape[1]
                    mask = torch.triu(torch.full((n, n), float("-inf"), dtype=x.dtype), 1)
                # need_weights: torch's fused inference path has no ONNX export
                return m.mha(x, x, x, need_weights=True, attn_mask=mask)[0]
            return Fn(f"self-attention causal={causal}", f, mha=mha), (s, d)
        assume(d >= 4)  # its LayerNorms, as in norm() above
        enc = nn.TransformerEncoderLayer(d, heads, draw(st.sampled_from([8, 16])), dropout=0.0,
                                         batch_first=True, norm_first=draw(st.booleans()),
                                         activation=draw(st.sampled_from(["relu", "gelu"])))
        if enc.activation_relu_or_gelu == 1:
            enc.activation = Kinked(nn.ReLU(), [0])
        return enc, (s, d)
    if kind == "rnn":
        cls = draw(st.sampled_from([nn.LSTM, nn.GRU, nn.RNN]))
        hdim, bi = draw(st.integers(1, 8)), draw(st.booleans())
        r = cls(d, hdim, num_layers=draw(st.sampled_from([1, 2])), batch_first=True,
                bidirectional=bi, bias=draw(st.booleans()))
        return Fn("r(x)[0]", lambda m, x: m.r(x)[0], r=r), (s, hdim * (2 if bi else 1))
    if kind == "conv1d":
        k = draw(st.sampled_from([1, 2, 3]))
        co = draw(st.integers(1, 8))
        c1 = nn.Conv1d(d, co, k, padding=k // 2)
        so = s + 2 * (k // 2) - k + 1
        return Fn("conv over the steps",
                  lambda m, x: m.c(x.transpose(1, 2)).transpose(1, 2), c=c1), (so, co)
    if kind == "softmax":
        dim = draw(st.sampled_from([1, 2]))
        return Fn(f"softmax dim {dim}", lambda m, x: F.softmax(x, dim=dim)), (s, d)
    return Fn("cumsum dim 1", lambda m, x: torch.cumsum(x, dim=1)), (s, d)


@st.composite
def seq_model(draw):
    s, d = draw(st.integers(1, 7)), draw(st.sampled_from([2, 4, 8]))
    layers, shape = [], (s, d)
    for _ in range(draw(st.integers(1, 4))):
        m, shape = draw(seq_layer(*shape))
        layers.append(m)
    if draw(st.integers(0, 3)) == 0:  # a per-step loss over k classes
        k = draw(st.integers(2, 4))
        layers += [nn.Linear(shape[1], k), Fn("transpose 1 2", lambda m, x: x.transpose(1, 2)),
                   draw(loss_head(k, (shape[0],)))]
    return nn.Sequential(*layers), (s, d)


def _window_gap_nd(x, k, s, p, d, ceil):
    """:func:`_window_gap` for 1-D and 3-D pools (brute force over the few windows)."""
    r = x.dim() - 2
    xp = F.pad(x, [q for i in reversed(range(r)) for q in (p[i], p[i] + (s[i] - 1 if ceil else 0))],
               value=-float("inf"))
    gaps = []
    for pos in np.ndindex(*[max(0, (xp.shape[2 + i] - (k[i] - 1) * d[i] - 1) // s[i] + 1)
                            for i in range(r)]):
        taps = xp[(..., *[slice(pos[i] * s[i], pos[i] * s[i] + (k[i] - 1) * d[i] + 1, d[i])
                          for i in range(r)])].reshape(*xp.shape[:2], -1)
        if taps.shape[-1] >= 2:
            top = taps.topk(2, dim=-1).values
            g = top[..., 0] - top[..., 1]
            gaps.append(g[torch.isfinite(g)])
    g = torch.cat(gaps) if gaps else torch.zeros(0)
    return float(g.min()) if g.numel() else None


@st.composite
def nd_layer(draw, c, dims):
    """A 1-D or 3-D layer (len(dims)): Conv, ConvTranspose, max / average pools, norms,
    linear / trilinear / nearest upsampling, activations."""
    r = len(dims)
    kind = draw(st.sampled_from(["conv", "conv", "convt", "maxpool", "avgpool", "norm",
                                 "upsample", "act", "act"]))
    conv, convt = (nn.Conv1d, nn.ConvTranspose1d) if r == 1 else (nn.Conv3d, nn.ConvTranspose3d)
    if kind == "act":
        return _act(draw), (c, dims)
    if kind == "conv":
        k, s, d = (draw(st.sampled_from(v)) for v in ([1, 2, 3], [1, 1, 2], [1, 1, 2]))
        p = draw(st.integers(0, (d * (k - 1)) // 2 + 1))
        mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
        if mode != "zeros":
            p = min([p, *[n - 1 for n in dims]])
        co = draw(st.integers(1, 6))
        groups = draw(st.sampled_from([1, c])) if co % c == 0 else 1
        out = tuple(_conv_out(n, k, s, p, d) for n in dims)
        assume(min(out) >= 1)
        return conv(c, co, k, s, p, d, groups=groups, bias=draw(st.booleans()),
                    padding_mode=mode), (co, out)
    if kind == "convt":
        k, s, d = (draw(st.sampled_from(v)) for v in ([1, 2, 3], [1, 2], [1, 1, 2]))
        p = draw(st.integers(0, (d * (k - 1)) // 2))
        op = draw(st.integers(0, s - 1))
        co = draw(st.integers(1, 4))
        out = tuple((n - 1) * s - 2 * p + d * (k - 1) + op + 1 for n in dims)
        assume(min(out) >= 1 and max(out) <= (24 if r == 1 else 8))
        return convt(c, co, k, s, p, op, bias=draw(st.booleans()), dilation=d), (co, out)
    if kind in ("maxpool", "avgpool"):
        k = draw(st.sampled_from([2, 2, 3]))
        s = draw(st.sampled_from([1, 2, k]))
        p = draw(st.integers(0, k // 2))
        ceil = draw(st.booleans())
        d = draw(st.sampled_from([1, 1, 2])) if kind == "maxpool" else 1
        out = tuple(_pool_out(n, k, s, p, d, ceil) for n in dims)
        assume(min(out) >= 1 and (r == 1 or min(dims) >= k))  # torch's 3-D pools: no smaller
        # as in pool(): no window wholly in the padding (torch's backward corrupts its heap)
        assume(all(any(0 <= i * s - p + j * d < n for j in range(k))
                   for n, o in zip(dims, out) for i in range(o)))
        if kind == "maxpool":
            return Pool((k,) * r, (s,) * r, (p,) * r, (d,) * r, ceil), (c, out)
        avg = nn.AvgPool1d if r == 1 else nn.AvgPool3d
        return avg(k, s, p, ceil_mode=ceil, count_include_pad=draw(st.booleans())), (c, out)
    if kind == "norm":
        assume(math.prod(dims) >= 4)
        if draw(st.booleans()):
            bn = nn.BatchNorm1d if r == 1 else nn.BatchNorm3d
            return bn(c, momentum=draw(st.sampled_from([0.1, 0.5]))), (c, dims)
        inst = nn.InstanceNorm1d if r == 1 else nn.InstanceNorm3d
        return inst(c, affine=draw(st.booleans())), (c, dims)
    assume(max(dims) <= (12 if r == 1 else 4))
    mode = draw(st.sampled_from(["nearest", "linear" if r == 1 else "trilinear"]))
    ac = draw(st.sampled_from([None, True])) if mode != "nearest" else None
    return Fn(f"interpolate x2 {mode} align_corners={ac}", lambda m, x: F.interpolate(
        x, scale_factor=2.0, mode=mode, align_corners=ac)), (c, tuple(2 * n for n in dims))


@st.composite
def nd_model(draw):
    """A stack of 1-D (signals) or 3-D (volumes) layers, then a head."""
    r = draw(st.sampled_from([1, 3]))
    c = draw(st.integers(1, 3))
    dims = tuple(draw(st.integers(4, 12)) if r == 1 else draw(st.integers(2, 5))
                 for _ in range(r))
    layers, (co, out) = [], (c, dims)
    for _ in range(draw(st.integers(1, 4))):
        m, (co, out) = draw(nd_layer(co, out))
        assume(co * math.prod(out) <= 2048)
        layers.append(m)
    if draw(st.booleans()):
        layers += [nn.Flatten(), nn.Linear(co * math.prod(out), draw(st.integers(1, 4)))]
    return nn.Sequential(*layers), (c, *dims)


@st.composite
def models(draw, exporters=("torchscript",), families=("image", "seq", "nd")):
    """(module, input shape without the batch, opset, training, exporter): exporter
    "torchscript" (dynamo=False; "torchscript-folded" with its constant folding) or "dynamo" /
    "dynamo-optimized" (dynamo=True, optimize off / on); families: image models, sequence
    models, 1-D and 3-D ("nd") ones, image models with a 16-channel stem ("wide")."""
    make = {"image": image_model, "seq": seq_model, "nd": nd_model,
            "wide": lambda: image_model(wide=True)}
    module, shape = draw(st.one_of(*[make[f]() for f in families]))
    exporter = draw(st.sampled_from(exporters))
    opset = draw(st.sampled_from([14, 16, 17, 18] if exporter.startswith("torchscript")
                                 else [18, 20]))
    return module, shape, opset, draw(st.booleans()), exporter


# -- the check ---------------------------------------------------------------------------------
def randomize(module, seed, keep_fresh=False):
    """Distinct random parameters (the exporter merges equal initializers), N(0, 1 / fan-in);
    ``keep_fresh``: a norm's fresh weights and biases (all ones, all zeros) stay, which the
    TorchScript exporter's folding merges as a fresh model's are."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in module.named_parameters():
            if keep_fresh and t.dim() == 1 and bool((t == t.flatten()[0]).all()):
                continue
            fan_in = t[0].numel() if t.dim() > 1 else 1
            t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype) / fan_in ** 0.5)
    return module


def export(module, x, opset, training, exporter="torchscript"):
    """The module exported with input "x" (symbolic batch) and output "y"."""
    with quiet():
        if not exporter.startswith("torchscript"):  # exports the module in its own mode
            prog = torch.onnx.export(module, (torch.tensor(x),), dynamo=True,
                                     opset_version=opset, input_names=["x"],
                                     output_names=["y"], optimize=exporter.endswith("optimized"),
                                     dynamic_shapes=({0: torch.export.Dim("N")},))
            return prog.model_proto
        f = io.BytesIO()
        mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
        torch.onnx.export(module, (torch.tensor(x),), f, dynamo=False, opset_version=opset,
                          training=mode, input_names=["x"],
                          # ("torchscript-folded": the exporter's default, which merges equal
                          # parameters into Identity nodes and folds weights' transposes)
                          do_constant_folding=exporter == "torchscript-folded",
                          output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return onnx.load_from_string(f.getvalue())


def _watch_backward(loss):
    """What torch's backward of ``loss`` makes on the way, filled in as it runs: "scale", the
    largest gradient any step makes (the terms that cancel into a small or zero result: the
    scale of float32's noise there), and "singular", whether a step made an infinite or NaN
    gradient: the point is singular (sqrt of 0 inside torch's LPPool2d after a ReLU), where
    frameworks differ by design: torch's ReLU backward selects 0 where x <= 0, TF's ReluGrad
    (and onnxgrad's, as documented) multiplies by 0 and gives NaN for an infinite g. Such an
    example counts as a kink."""
    seen_out = {"scale": 0.0, "singular": False}

    def hook(grads_in, _):
        for t in grads_in:
            if t is not None and t.numel():
                finite = torch.isfinite(t)
                seen_out["singular"] |= not bool(finite.all())
                seen_out["scale"] = max(seen_out["scale"], float(t[finite].abs().max(
                    ) if finite.any() else 0.0))
    seen, todo = set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        fn.register_hook(hook)
        todo.extend(f for f, _ in fn.next_functions)
    return seen_out


def _torch_grads(module, x, cot, dtype):
    """torch autograd of sum(module(x) * cot) in ``dtype``: (y, dx, {parameter: grad}, the
    smallest kink margin the forward saw (None: no kinks), the largest gradient of any step of
    the backward)."""
    global _record
    m = module.to(dtype)
    params = dict(m.named_parameters())
    xt = torch.tensor(x, dtype=dtype, requires_grad=True)
    _record = []
    try:
        y = m(xt)
    finally:
        margins, _record = _record, None
    loss = (y * torch.tensor(cot, dtype=dtype)).sum()
    watch = _watch_backward(loss)
    gs = torch.autograd.grad(loss, [xt, *params.values()], allow_unused=True)
    if watch["singular"]:  # see _watch_backward
        margins = [0.0]
    named = {k: (None if g is None else g.double().numpy()) for k, g in zip(params, gs[1:])}
    return (y.detach().double().numpy(), gs[0].double().numpy(), named,
            min(margins) if margins else None, watch["scale"])


#: why examples were rejected (the exporter or onnxruntime failed on the forward, a kink)
REJECTED: dict = {}
DIFFERS: list = []  # the modules whose exported forward differs from torch's
UNRUNNABLE: list = []  # the modules whose exported forward onnxruntime cannot run


def _reject(why):
    REJECTED[why] = REJECTED.get(why, 0) + 1
    assume(False)


def check(module, shape, opset, training, exporter="torchscript", seed=0, batch=2,
          via="gradients"):
    """Export, differentiate, compare with torch autograd in float64; returns the names checked.
    Rejects (hypothesis.assume) an example whose export fails or whose exported forward differs
    from torch's: those are the exporter's or onnxruntime's, not the gradient's. ``via``:
    "gradients" (onnxgrad.gradients, every gradient and y checked) or "trainer" (the training
    step's path, :func:`_via_trainer`: the parameters' gradients and the loss)."""
    rng = np.random.default_rng(seed)
    randomize(module, seed, keep_fresh=exporter == "torchscript-folded")
    module.train(training)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    try:  # with gradients on: torch's fused inference paths (attention) have no export
        model = export(module.float(), x, opset, training, exporter)
    except Exception as e:  # noqa: BLE001  the exporter's failure
        _reject(f"export: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    case = f"{module}\ninput {shape}, opset {opset}, training {training}, exporter {exporter}"
    try:
        y_ort = session(model).run(["y"], {"x": x})[0]
    except Exception as e:  # noqa: BLE001
        # onnxruntime cannot run the model as exported (the dims that onnx's inference gives
        # a ceil_mode pool, for one): the gradient model's y is then held to torch's alone
        y_ort = None
        UNRUNNABLE.append(f"{case}: {e}")
    with torch.no_grad():
        cot = np.asarray(rng.standard_normal(tuple(module(torch.tensor(x)).shape)), np.float32)
    y64, gx64, gw64, margin, terms = _torch_grads(module, x, cot, torch.float64)
    if margin is not None and margin <= KINK_MARGIN:
        _reject("kink")
    y32, gx32, gw32, _, _ = _torch_grads(module, x, cot, torch.float32)
    noise_y = float(np.abs(y32 - y64).max())
    if y_ort is not None and (y_ort.shape != y64.shape or not within(y_ort, y64, noise_y)):
        DIFFERS.append(case)
        _reject("exported forward differs from torch")
    declared = model.graph.output[0].type.tensor_type
    if declared.HasField("shape") and len(declared.shape.dim) != y64.ndim:
        # the exporter's own declaration is wrong (torch.onnx's dynamo exporter declares
        # cross_entropy(reduction="none") a scalar): onnxgrad refuses the contradiction, with
        # the remedy (tests/test_bad_input.py)
        _reject("the exporter declares y of another rank than it computes")
    # the parameters the export holds as they are (an exporter may fold, transpose or split
    # others into initializers of other values)
    params = dict(module.float().named_parameters())
    inits = {t.name: t for t in model.graph.initializer}
    if via == "trainer":  # the step trains the module's parameters (an exporter's merges undone)
        from onnxgrad.training.step import as_module_parameters
        held = onnx.ModelProto()
        held.CopyFrom(model)
        inits = {t.name: t for t in as_module_parameters(held).graph.initializer}
    wrt = ["x"] + [k for k in gw64 if k in inits and np.array_equal(
        onnx.numpy_helper.to_array(inits[k]), params[k].detach().numpy())]
    if via == "trainer":
        wrt = wrt[1:]
        if not wrt:
            _reject("no parameter held as it is")
        loss, got = _via_trainer(model, wrt, x, cot, y_ort)
        # the loss sum(y * cot) stands for y: the step's forward rewrites must not change it
        ref = y64 if y_ort is None else y_ort.astype(np.float64)
        assert abs(float(loss) - float((ref * cot).sum())) <= 1e-5 * float(
            np.abs(ref * cot).sum()) + 10 * noise_y * float(np.abs(cot).sum()) + 1e-30, \
            "the training step's loss differs from the model's"
        fwd = y_ort  # the runtime's forward, for the tolerance below
    else:
        fwd, got = _via_gradients(model, wrt, x, cot, y_ort)
        # the gradient model computes the model's own y (a rewrite of the forward must not
        # change it)
        if y_ort is not None:
            assert fwd.shape == y_ort.shape and within(fwd, y_ort, 0.0, tol=1e-5), \
                "the gradient model's y differs from the model's"
        else:
            assert fwd.shape == y64.shape and within(fwd, y64, noise_y), \
                "the gradient model's y differs from torch's (onnxruntime cannot run the model)"
    bad = {}
    # gradients as accurate as onnxruntime's forward allows: its Sigmoid, for one, is off by
    # 1e-4 relative at -11, where torch's float32 one is exact
    rel_y = 0.0 if fwd is None else float(np.abs(fwd - y64).max(initial=0)) / max(
        float(np.abs(y64).max(initial=0)), 1e-30)
    tol = max(TOL, 10 * rel_y)
    # the terms' scale: the largest gradient any step of torch's backward made
    floor = FLOOR * terms
    for name in wrt:
        want, t32 = (gx64, gx32) if name == "x" else (gw64[name], gw32[name])
        ours = got[name]
        if ours is None:
            assert want is None or not np.any(want), f"{name}: no gradient, torch's is nonzero"
            continue
        want = np.zeros(ours.shape) if want is None else want
        t32 = np.zeros(ours.shape) if t32 is None else t32
        assert ours.shape == want.shape, f"{name}: shape {ours.shape}, torch {want.shape}"
        if not within(ours, want, float(np.abs(t32 - want).max(initial=0)), floor, tol):
            bad[name] = (float(np.abs(ours - want).max()), float(np.abs(want).max()))
    if bad and _export_differs(model, {k: got[k] for k in bad}, x, cot):
        DIFFERS.append(case)
        _reject("exported function differs from torch where y cannot show it")
    assert not bad, f"(max |ours - torch64|, max |torch64|) beyond the tolerance: {bad}"
    return wrt


def _export_differs(model, got, x, cot) -> bool:
    """Whether the gradients ``got`` (name -> ours) are those of the exported model's own
    function, by float64 central differences of sum(y * cot) along a random direction per
    tensor: the export then is not torch's function. torch.onnx's dynamo exporter writes a
    training-mode BatchNorm1d as an inference-mode BatchNormalization, and an InstanceNorm
    after it undoes any per-channel scale, so y agrees with torch's while the BatchNorm weight's
    gradient (eps-sized) does not."""
    from onnxgrad.check import to_float64
    from onnxgrad.runtime import runner
    m = to_float64(model)
    feeds = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer
             if t.name in got}
    keep = [t for t in m.graph.initializer if t.name not in got]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    m.graph.input.extend(onnx.helper.make_tensor_value_info(k, onnx.TensorProto.DOUBLE, v.shape)
                         for k, v in feeds.items())
    run = runner(m)
    feeds["x"] = x.astype(np.float64)
    rng = np.random.default_rng(0)
    for name, ours in got.items():
        d = rng.standard_normal(ours.shape)
        h = 1e-6 * max(1.0, float(np.abs(feeds[name]).max()))
        f = [float(np.sum(run({**feeds, name: feeds[name] + t * d}, ["y"])[0] * cot))
             for t in (h, -h)]
        fd, ana = (f[0] - f[1]) / (2 * h), float(np.sum(ours.astype(np.float64) * d))
        if not abs(fd - ana) <= 1e-3 * max(abs(fd), abs(ana), 1e-30):
            return False
    return True


def _via_gradients(model, wrt, x, cot, y_ort):
    """(y, {name: gradient or None}) from onnxgrad.gradients of sum(y * cot), on onnxruntime."""
    before = model.SerializeToString()
    res = onnxgrad.gradients(model, ["y"], wrt, grad_ys=["cot"])
    assert model.SerializeToString() == before, "gradients() changed the model it was given"
    onnx.checker.check_model(res.model, full_check=True)
    names = [g for g in res.grads if g is not None]
    try:
        sess = session(res.model)
    except Exception:  # noqa: BLE001
        if y_ort is not None:
            raise
        # neither loads: onnxruntime folds constants that onnx's inference does not (the
        # TorchScript exporter's reflect-pad arithmetic before a ceil_mode pool), and its
        # static dims keep the window its kernel drops; onnx saw no dims to rewrite the pool by
        _reject("onnxruntime loads neither the model nor its gradient model")
    try:
        y_grad, *outs = sess.run(["y", *names], {"x": x, "cot": cot})
    except Exception:  # noqa: BLE001
        if y_ort is not None:
            raise
        # the forward it holds fails as the exported one did (the dynamo exporter's zero bias
        # of a bias-free Conv3d, Expand-ed to [Co, 2])
        _reject("onnxruntime runs neither the model nor its gradient model")
    got = dict(zip(names, outs))
    return y_grad, {w: None if g is None else got[g] for w, g in zip(wrt, res.grads)}


def _via_trainer(model, params, x, cot, y_ort):
    """(the loss, {parameter: gradient or None}) from the training step's path: the loss
    sum(y * cot) attached to the model, :func:`onnxgrad.training.step.build_gradient_model`
    (its forward rewrites: functions inlined, pools' Indices, small-image convolutions as
    Gemms, dropouts) and a Trainer's session (convolutions in onnxruntime's blocked layout)."""
    from onnx import TensorProto, helper
    from onnxgrad.training.step import build_gradient_model
    from onnxgrad.training.trainer import make_session
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.initializer.append(onnx.numpy_helper.from_array(cot, "cot"))
    m.graph.node.extend([helper.make_node("Mul", ["y", "cot"], ["y_cot"]),
                         helper.make_node("ReduceSum", ["y_cot"], ["loss"], keepdims=0)])
    m.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    try:
        session(m)
    except Exception:  # noqa: BLE001
        # onnxruntime's static dims of a ceil_mode pool whose input dims only its constant
        # folding sees keep the window its kernel drops: y * cot fails to load
        _reject("onnxruntime cannot load the model with its loss")
    before = m.SerializeToString()
    desc = build_gradient_model(m, "loss", params)
    assert m.SerializeToString() == before, "the training step changed the model it was given"
    try:
        sess = make_session(desc.model, "cpu", threads=1)
        feeds = {"x": x, **{p: desc.initial_params[p] for p in desc.params},
                 **desc.initial_stats}
        loss, *outs = sess.run([desc.loss, *desc.grads], feeds)
    except Exception:  # noqa: BLE001
        if y_ort is not None:
            raise
        _reject("onnxruntime runs neither the model nor its training step")
    got = dict(zip(desc.params, outs))
    return loss, {p: got.get(p) for p in params}
