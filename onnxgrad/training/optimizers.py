"""Optimizers as ONNX subgraphs, matching PyTorch's definitions (torch.optim, single-tensor path).

Each optimizer emits, for one parameter p with gradient g and its state tensors, the nodes that
compute the updated parameter and state. The learning rate is a float64 scalar graph input (so a
schedule can feed it per step) and the step count an int64 scalar input: the number of the step
being taken, 1 for the first (PyTorch's ``state["step"]`` after its increment). Scalar
hyper-parameter arithmetic (bias corrections, lr * weight_decay) is done in float64 and cast to
the parameter's dtype once, as PyTorch does with its Python-float scalars (or all in float32, lr
a float32 input, for runtimes without float64 kernels: see :class:`Scalars`).

    SGD    d = g + wd p;  b = d (first step) | momentum b + (1 - dampening) d  (one expression,
           b mom_t + d damp_t with (mom_t, damp_t) = (0, 1) on the first step: no Where);
           d = d + momentum b (nesterov) | b;  p = p - lr d
    Adam   g = g + wd p;  m = lerp(m, g, 1 - beta1);  v = beta2 v + (1 - beta2) g g;
           p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
           (amsgrad: v_max = max(v_max, v) in the denominator). The state kept is the plain
           exponentially weighted sums s1 = beta1 s1 + g = m / (1 - beta1) and
           s2 = beta2 s2 + g g = v / (1 - beta2) (slots ``exp_sum``, ``exp_sum_sq``), and every
           constant factor is moved into two scalars: p - step * s1 / (sqrt(s2) + eps') with
           step = lr (1 - beta1) / bc1 * sqrt(bc2 / (1 - beta2)), eps' = eps sqrt(bc2 / (1 -
           beta2)). 11 full passes per parameter for AdamW instead of 13 (each pass is memory
           bound; equal to torch's up to float rounding).
    AdamW  as Adam, with p = p (1 - lr wd) first instead of g + wd p

:func:`clip_grad_norm` scales all gradients as ``torch.nn.utils.clip_grad_norm_`` (2-norm):
g = g * min(1, max_norm / (total_norm + 1e-6)).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import ArgumentTypeError, InvalidArgumentError


def check_number(owner: str, name: str, value, low: float = 0.0, high: float = math.inf,
                 high_open: bool = False) -> float:
    """``value`` as a float, or an error naming ``owner.name``: it must be a finite real number
    in [low, high] ([low, high) with ``high_open``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{owner}: {name}={value!r} must be a number")
    v = float(value)
    if not math.isfinite(v) or v < low or v > high or (high_open and v == high):
        span = (f"in [{low:g}, {high:g}{')' if high_open else ']'}" if math.isfinite(high)
                else f">= {low:g}")
        raise InvalidArgumentError(f"{owner}: {name}={value!r} must be a finite number {span}")
    return v


def check_flag(owner: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{owner}: {name}={value!r} must be True or False")
    return bool(value)


class Builder:
    """Appends NodeProtos with unique names under a prefix; constants are Constant nodes."""

    def __init__(self, taken: set[str], prefix: str = "optimizer"):
        self.taken, self.prefix = taken, prefix
        self.nodes: list[onnx.NodeProto] = []
        self._consts: dict[tuple, str] = {}

    def name(self, base: str) -> str:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def rename(self, renames: dict[str, str]) -> None:
        """Rename tensors produced by this builder's nodes (and their uses), in one pass."""
        for n in self.nodes:
            for i, x in enumerate(n.input):
                if x in renames:
                    n.input[i] = renames[x]
            for i, x in enumerate(n.output):
                if x in renames:
                    n.output[i] = renames[x]

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        out = out or self.name(f"{self.prefix}/{op_type}")
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def const(self, value, dtype, rank: int = 0) -> str:
        """A Constant; a scalar meant for a tensor of rank ``rank`` gets that rank ([1] * rank):
        onnxruntime's CPU Mul/Add/Div of a tensor whose trailing dims are 1 (a 1x1 Conv kernel
        [Co, C, 1, 1]) by a rank-0 scalar runs element by element, about 50x slower."""
        arr = np.asarray(value, dtype).reshape([1] * rank if rank else np.shape(value))
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            out = self.name(f"{self.prefix}/const")
            self.nodes.append(helper.make_node("Constant", [], [out], name=out,
                                               value=numpy_helper.from_array(arr)))
            self._consts[key] = out
        return self._consts[key]


@dataclass
class Slot:
    """What the update of one parameter reads: names of p, g, its state tensors (by slot) and
    the shared scalars; ``dtype`` is p's ONNX elem type, ``rank`` its rank."""
    param: str
    grad: str
    state: dict[str, str]
    dtype: int
    scalars: "Scalars"
    rank: int = 0  # p's rank: scalars are made this rank (see Builder.const)


class Scalars:
    """The step's shared scalars: lr, step (int64), and casts made once per dtype. Scalar
    arithmetic runs in ``dtype``, lr's type: float64 (PyTorch's Python floats), or float32 for
    runtimes without float64 kernels (onnxruntime-web's WebGPU builds)."""

    def __init__(self, b: Builder, lr: str, step: str, dtype: int = TensorProto.DOUBLE,
                 ok: str | None = None):
        self.b, self.lr, self.step, self.dtype, self.ok = b, lr, step, dtype, ok
        self._cast: dict = {}
        self._step_float = None

    # A step whose loss is not finite is not taken. Its parameters go to the other buffer set
    # and are dropped; the optimizer state is updated in place (one copy of it, not two), so
    # ``ok`` (the loss is finite) gates the state's update: the gradient term becomes 0 and
    # each decay factor 1, which leaves a finite state exactly as it was.
    def gate(self, g: str, dtype: int, rank: int) -> str:
        """``g``, or 0 when the step is not ok (a full pass: only for what enters the state)."""
        if self.ok is None:
            return g
        if dtype == TensorProto.BFLOAT16:  # Where takes bfloat16 from opset 16 only; exact
            wide = self.b.op("Cast", g, to=TensorProto.FLOAT)
            return self.b.op("Cast", self.gate(wide, TensorProto.FLOAT, rank), to=dtype)
        return self.b.op("Where", self.ok, g, self.b.const(0, _np(dtype), rank))

    def keep(self, factor: str, dtype: int, rank: int) -> str:
        """The scalar ``factor`` (of the scalar dtype) as ``dtype``, or 1 when the step is not
        ok."""
        if self.ok is not None:
            factor = self.memo(("keep", factor), lambda: self.b.op(
                "Where", self.ok, factor, self.num(1.0)))
        return self.cast(factor, dtype, rank)

    def cast(self, name: str, dtype: int, rank: int = 0) -> str:
        """The scalar ``name`` as ``dtype``, shaped [1] * rank (see Builder.const)."""
        key = ("cast", name, dtype, rank)
        if key not in self._cast:
            if rank:
                shape = self.b.const([1] * rank, np.int64)
                out = self.b.op("Reshape", self.cast(name, dtype), shape)
            else:
                out = name if dtype == self.dtype else self.b.op("Cast", name, to=dtype)
            self._cast[key] = out
        return self._cast[key]

    def num(self, value) -> str:
        """A constant scalar of the scalar dtype."""
        return self.b.const(value, _np(self.dtype))

    @property
    def step_float(self) -> str:
        if self._step_float is None:
            self._step_float = self.b.op("Cast", self.step, to=self.dtype)
        return self._step_float

    def memo(self, key, make):
        if key not in self._cast:
            self._cast[key] = make()
        return self._cast[key]


@dataclass
class Optimizer:
    """Base class: ``lr`` is the default learning rate (what a Trainer feeds without a
    schedule); ``slots`` are the state tensors each parameter gets (zeros at the start)."""
    lr: float = 1e-3

    slots: tuple[str, ...] = field(default=(), init=False, repr=False)

    def update(self, b: Builder, s: Slot) -> tuple[str, dict[str, str]]:
        raise NotImplementedError

    def config(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "slots"}

    def legacy_slots(self) -> dict[str, tuple[str, float]]:
        """State slots of older checkpoint formats: {old slot: (slot, factor)}, the state now
        being the old one times factor."""
        return {}


@dataclass
class SGD(Optimizer):
    """torch.optim.SGD (maximize=False): momentum buffer = d on the first step."""
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        for name in ("lr", "momentum", "weight_decay"):
            setattr(self, name, check_number("SGD", name, getattr(self, name)))
        self.dampening = check_number("SGD", "dampening", self.dampening, 0.0, 1.0)
        self.nesterov = check_flag("SGD", "nesterov", self.nesterov)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidArgumentError("SGD: nesterov momentum requires a momentum and zero "
                                       "dampening")
        self.slots = ("momentum_buffer",) if self.momentum != 0 else ()

    def _scalars(self, b, sc, T, rank):
        """The momentum and (1 - dampening) as T scalars, (0, 1) on the first step; made once
        per step, dtype and rank, in the scalar dtype and cast once."""
        def make():
            first = sc.memo("first", lambda: b.op("Equal", sc.step, b.const(1, np.int64)))
            mom = b.op("Where", first, sc.num(0.0), sc.num(self.momentum))
            damp = b.op("Where", first, sc.num(1.0), sc.num(1.0 - self.dampening))
            return sc.keep(mom, T, rank), sc.cast(damp, T, rank)
        return sc.memo(("sgd", T, rank), make)

    def update(self, b, s):
        T, sc, r = s.dtype, s.scalars, s.rank
        d = s.grad
        if self.weight_decay != 0:
            d = b.op("Add", d, b.op("Mul", s.param, b.const(self.weight_decay, _np(T), r)))
        new_state = {}
        if self.momentum != 0:
            # buf = d on the first step, momentum buf + (1 - dampening) d later: one expression
            # buf * mom_t + d * damp_t with scalars that are (0, 1) on the first step, so no
            # full-size select (Where) runs; buf * 0 + d * 1 is d exactly for a finite buf
            mom_t, damp_t = self._scalars(b, sc, T, r)
            d = sc.gate(d, T, r)
            scaled = d if self.dampening == 0 else b.op("Mul", d, damp_t)
            buf = b.op("Add", b.op("Mul", s.state["momentum_buffer"], mom_t), scaled)
            new_state["momentum_buffer"] = buf
            d = b.op("Add", d, b.op("Mul", buf, b.const(self.momentum, _np(T), r))) \
                if self.nesterov else buf
        lr = sc.cast(sc.lr, T, r)
        return b.op("Sub", s.param, b.op("Mul", d, lr)), new_state


@dataclass
class Adam(Optimizer):
    """torch.optim.Adam (maximize=False, capturable=False); weight decay is L2 on the gradient."""
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    decoupled = False

    def __post_init__(self):
        kind = type(self).__name__
        try:
            b1, b2 = self.betas
        except (TypeError, ValueError):
            raise ArgumentTypeError(f"{kind}: betas={self.betas!r} must be a pair of numbers") \
                from None
        self.betas = (check_number(kind, "betas[0]", b1, 0.0, 1.0, high_open=True),
                      check_number(kind, "betas[1]", b2, 0.0, 1.0, high_open=True))
        for name in ("lr", "eps", "weight_decay"):
            setattr(self, name, check_number(kind, name, getattr(self, name)))
        self.amsgrad = check_flag(kind, "amsgrad", self.amsgrad)
        self.slots = ("exp_sum", "exp_sum_sq") + (("max_exp_sum_sq",) if self.amsgrad else ())

    def legacy_slots(self):
        b1, b2 = self.betas  # checkpoint formats 1 and 2 kept torch's m and v
        return {"exp_avg": ("exp_sum", 1 / (1 - b1)), "exp_avg_sq": ("exp_sum_sq", 1 / (1 - b2)),
                "max_exp_avg_sq": ("max_exp_sum_sq", 1 / (1 - b2))}

    def _scalars(self, b, sc):
        """Scalars shared by all parameters: the step size and eps of the sums' form (see the
        module doc), and the decoupled decay factor 1 - lr wd."""
        b1, b2 = self.betas

        def one_minus_pow(beta, t):  # the bias correction 1 - beta^t
            if sc.dtype == TensorProto.DOUBLE:
                return b.op("Sub", sc.num(1.0), b.op("Pow", sc.num(beta), t))
            # in float32, 1 - beta^t cancels (1.3e-5 off for beta 0.999 at t = 1); with
            # u = tanh(t ln(beta) / 2) it is -2u / (1 - u) exactly, and tanh keeps its relative
            # precision near 0 (1e-7 at every t)
            with np.errstate(divide="ignore"):  # beta = 0: ln 0 = -inf, u = -1, 1 - 0^t = 1
                half_log = np.log(beta) / 2
            u = b.op("Tanh", b.op("Mul", t, sc.num(half_log)))
            return b.op("Div", b.op("Mul", u, sc.num(-2.0)), b.op("Sub", sc.num(1.0), u))

        def make():
            t = sc.step_float
            bc1, bc2 = one_minus_pow(b1, t), one_minus_pow(b2, t)
            # sqrt(bc2 / (1 - beta2)): s2 = v / (1 - beta2), and v / bc2 is torch's v-hat
            root = b.op("Sqrt", b.op("Div", bc2, sc.num(1.0 - b2)))
            step_size = b.op("Mul", b.op("Div", sc.lr, bc1), b.op("Mul", root, sc.num(1.0 - b1)))
            eps = b.op("Mul", sc.num(self.eps), root)
            decay = b.op("Sub", sc.num(1.0), b.op("Mul", sc.lr, sc.num(self.weight_decay)))
            return step_size, eps, decay
        return sc.memo("adam", make)

    def update(self, b, s):
        T, sc, npT, r = s.dtype, s.scalars, _np(s.dtype), s.rank
        b1, b2 = self.betas
        step_size, eps, decay = self._scalars(b, sc)
        p, g = s.param, s.grad
        if self.weight_decay != 0:
            if self.decoupled:
                p = b.op("Mul", p, sc.cast(decay, T, r))
            else:
                g = b.op("Add", g, b.op("Mul", p, b.const(self.weight_decay, npT, r)))
        g = sc.gate(g, T, r)
        s1 = b.op("Add", b.op("Mul", s.state["exp_sum"], sc.keep(sc.num(b1), T, r)), g)
        s2 = b.op("Add", b.op("Mul", s.state["exp_sum_sq"], sc.keep(sc.num(b2), T, r)),
                  b.op("Mul", g, g))
        new_state = {"exp_sum": s1, "exp_sum_sq": s2}
        sd = s2
        if self.amsgrad:  # max over s2 is max over v: 1 - beta2 > 0
            sd = b.op("Max", s.state["max_exp_sum_sq"], s2)
            new_state["max_exp_sum_sq"] = sd
        denom = b.op("Add", b.op("Sqrt", sd), sc.cast(eps, T, r))
        p_new = b.op("Sub", p, b.op("Mul", b.op("Div", s1, denom), sc.cast(step_size, T, r)))
        return p_new, new_state


@dataclass
class AdamW(Adam):
    """torch.optim.AdamW: decoupled weight decay p = p (1 - lr wd), default wd 1e-2."""
    weight_decay: float = 1e-2
    decoupled = True


OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def make_optimizer(name: str, **kw) -> Optimizer:
    """An optimizer by name ("sgd", "adam", "adamw") with its keyword hyper-parameters."""
    try:
        return OPTIMIZERS[name.lower()](**kw)
    except KeyError:
        raise InvalidArgumentError(f"optimizer={name!r} is not one of "
                                   f"{', '.join(OPTIMIZERS)}") from None


def clip_grad_norm(b: Builder, grads: list[str], dtypes: list[int], max_norm: float,
                   ranks: list[int] | None = None) -> list[str]:
    """The gradients scaled as torch.nn.utils.clip_grad_norm_(max_norm, norm_type=2) does
    (``ranks``: the gradients' ranks, for the scale's shape; see Builder.const)."""
    if not grads:
        return grads
    # summed in float32 at least, float64 where a gradient is: in float16 the sum of squares
    # is inf past a norm of 256, and the scale clip / inf would zero every gradient
    T = TensorProto.DOUBLE if TensorProto.DOUBLE in dtypes else TensorProto.FLOAT
    sq = []
    for g, dt in zip(grads, dtypes):
        if dt in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
            g, dt = b.op("Cast", g, to=TensorProto.FLOAT), TensorProto.FLOAT
        s = b.op("ReduceSumSquare", g, keepdims=0)
        sq.append(s if dt == T else b.op("Cast", s, to=T))
    total = b.op("Sqrt", sq[0] if len(sq) == 1 else b.op("Sum", *sq))
    coef = b.op("Div", b.const(max_norm, _np(T)), b.op("Add", total, b.const(1e-6, _np(T))))
    coef = b.op("Min", coef, b.const(1.0, _np(T)))
    out, scales = [], {}
    for g, dt, r in zip(grads, dtypes, ranks or [0] * len(grads)):
        if (dt, r) not in scales:
            c = coef if dt == T else b.op("Cast", coef, to=dt)
            scales[(dt, r)] = b.op("Reshape", c, b.const([1] * r, np.int64)) if r else c
        out.append(b.op("Mul", g, scales[(dt, r)]))
    return out


def _np(dtype: int):
    return helper.tensor_dtype_to_np_dtype(dtype)
