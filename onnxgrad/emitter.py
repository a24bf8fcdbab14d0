"""A small builder that appends standard ONNX nodes to an onnx-ir graph.

Rules use it through ``V``, a thin wrapper over ``onnx_ir.Value`` with arithmetic operators, so a
rule reads like its math: ``g * y * (1 - y)``. Python numbers become constants of the dtype of the
tensor they meet (never a hard-wired float32), lists of ints become int64 constants.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from .inference import AXES_RANK, FLOAT_TYPES, SAME_RANK, out_rank


# ops whose output dtype is fixed, whatever their inputs
_INT64_OUT = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})
_BOOL_OUT = frozenset({"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And",
                       "Or", "Xor", "IsNaN", "IsInf"})
# ops whose output dtype is that of one input, not the first typed one
_DTYPE_FROM_INPUT = {"CastLike": 1, "Where": 1, "OneHot": 2}
_SPECIAL_DTYPE = _INT64_OUT | _BOOL_OUT | {"Cast", "Constant", "ConstantOfShape",
                                          *_DTYPE_FROM_INPUT}
# ops that broadcast their inputs, whose scalar constants take the rank of the widest input
# (Pow: onnxruntime special-cases a rank-0 exponent)
_WIDENED = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Equal", "Less", "Greater",
                      "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Min", "Max", "Sum",
                      "Mean", "PRelu", "BitShift", "Mod"})
# elementwise ops: the output shape is the broadcast of the input shapes
_ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Reciprocal", "Sqrt", "Exp", "Log", "Erf",
    "Sin", "Cos", "Tan", "Tanh", "Sigmoid", "Sign", "Relu", "Where", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Cast", "Identity", "Min", "Max", "Sum",
    "Mean", "Floor", "Ceil", "IsNaN", "IsInf", "Cosh", "Sinh", "Softplus", "Atan", "Asin", "Acos"})


def dims(value) -> tuple | None:
    """A value's static shape as a tuple of int | str | None (None: unknown dim), or None."""
    shape = value.shape
    if shape is None:
        return None
    return tuple(d if isinstance(d, int) else d.value for d in shape.dims)


def compatible_dims(a, b) -> bool:
    """Whether static shapes ``a`` and ``b`` may be one shape: one rank, no two ints differ."""
    return len(a) == len(b) and all(not isinstance(x, int) or not isinstance(y, int) or x == y
                                    for x, y in zip(a, b))


def broadcast_dims(shapes):
    """Static numpy-style broadcast of several shapes (None where a dim cannot be decided)."""
    if len(shapes) == 2 and shapes[0] == shapes[1]:  # the common case: a binary op, one shape
        return shapes[0]
    if any(s is None for s in shapes):
        return None
    try:
        return _broadcast(tuple(shapes))
    except TypeError:  # a shape a rule gave as a list
        return _broadcast.__wrapped__(shapes)


@functools.lru_cache(maxsize=4096)  # a model has few distinct shape pairs, met again and again
def _broadcast(shapes):
    full = [s for s in shapes if s]  # rank-0 shapes broadcast away
    if not full:
        return ()
    if all(s == full[0] for s in full):  # the common case: equal shapes, scalar constants
        return full[0]
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        ds = {s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0} - {1}
        if not ds:
            out.append(1)
        elif len(ds) == 1:
            out.append(ds.pop())
        else:
            ints = {d for d in ds if isinstance(d, int)}
            out.append(ints.pop() if len(ints) == 1 else None)
    return tuple(out)


class Piece(NamedTuple):
    """A slice's gradient as :meth:`Emitter.place` made it: ``t`` at [start, stop) along
    ``axis`` of x's shape, zeros elsewhere."""
    axis: int
    start: int
    stop: int
    t: "V"
    x: "V"


_HALF = {ir.DataType.FLOAT16: "tensor(float16)", ir.DataType.BFLOAT16: "tensor(bfloat16)"}
_HALF_TYPES = frozenset(_HALF)
# constants a rule passes as they are (never an ir.Value)
_PLAIN = frozenset({int, float, bool, list, tuple, np.ndarray})


@functools.lru_cache(maxsize=None)
def _half_opset(op_type: str, opset: int, ins: tuple, outs: tuple) -> int | None:
    """The first ai.onnx opset from ``opset`` on whose ``op_type`` takes ``ins`` and makes
    ``outs`` (type strings of the half-precision ones, None for the others), or None."""
    import onnx

    for v in range(opset, onnx.defs.onnx_opset_version() + 1):
        try:
            schema = onnx.defs.get_schema(op_type, v, "")
        except onnx.defs.SchemaError:
            return None
        allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}

        def takes(formal, types):  # (a variadic last parameter takes the rest)
            return all(t is None or t in allowed.get(formal[min(i, len(formal) - 1)].type_str, ())
                       for i, t in enumerate(types))
        if takes(schema.inputs, ins) and takes(schema.outputs, outs):
            return v
    return None


class NeedOpset(Exception):
    """Raised by a rule that needs a newer ai.onnx opset than the model has; the engine upgrades
    the model (onnx.version_converter) and starts again."""

    def __init__(self, version: int):
        super().__init__(version)
        self.version = version


class V:
    """An ONNX value inside a rule: arithmetic emits nodes through its emitter.

    dtype and static shape are cached: the emitter knows them for what it emits (kept only here,
    not written into the model), and reads them once from the IR for forward values."""

    # dtype and shape are plain slots (rules read them hundreds of thousands of times), left
    # unset until known: __getattr__ reads an unset one from the IR, once
    __slots__ = ("value", "e", "dtype", "shape")
    _UNSET = object()

    def __init__(self, value: ir.Value, e: Emitter, dtype=_UNSET, shape=_UNSET):
        self.value, self.e = value, e
        if dtype is not V._UNSET:
            self.dtype = dtype
        if shape is not V._UNSET:
            self.shape = shape

    def __getattr__(self, name: str):  # (only called for a slot not set yet)
        if name == "dtype":
            self.dtype = self.value.dtype
            return self.dtype
        if name == "shape":
            self.shape = self.e.dims(self.value)
            return self.shape
        raise AttributeError(name)

    name = property(lambda self: self.value.name)
    rank = property(lambda self: None if self.shape is None else len(self.shape))

    def with_shape(self, shape) -> V:
        """The same value, known to have ``shape`` (a gradient has its primal's shape)."""
        return V(self.value, self.e, self.dtype, shape)

    def __add__(self, o): return self.e.op("Add", self, o)
    def __radd__(self, o): return self.e.op("Add", o, self)
    def __sub__(self, o): return self.e.op("Sub", self, o)
    def __rsub__(self, o): return self.e.op("Sub", o, self)
    def __mul__(self, o): return self.e.op("Mul", self, o)
    def __rmul__(self, o): return self.e.op("Mul", o, self)
    def __truediv__(self, o): return self.e.op("Div", self, o)
    def __rtruediv__(self, o): return self.e.op("Div", o, self)
    def __pow__(self, o): return self.e.op("Pow", self, o)
    def __matmul__(self, o): return self.e.op("MatMul", self, o)
    def __neg__(self): return self.e.op("Neg", self)
    def __repr__(self): return f"V({self.name!r}, {self.dtype}, {self.shape})"


class Emitter:
    """Appends nodes named ``<scope>/<prefix>/<OpType>[_k]`` to ``graph``; records what it added."""

    def __init__(self, graph: ir.Graph, scope: str, opset: int):
        self.graph, self.scope, self.opset = graph, scope, opset
        self.prefix = scope
        self.nodes: list[ir.Node] = []
        self._counts: dict[str, int] = {}
        self._issued: set[str] = set()  # every name handed out in this gradients call
        self.unranked: list[ir.Node] = []  # nodes whose output rank only onnx inference finds
        self._consts: dict[tuple, V] = {}
        self._scalars: dict[ir.Value, np.ndarray] = {}  # the rank-0 constants made here
        self.pieces: dict[ir.Value, Piece] = {}  # what :meth:`place` made
        self._frozen_dims: dict[int, tuple] = {}  # id(shape) -> (shape, its dims)

    def need(self, version: int) -> None:
        """Declare that the rule being run emits an op of ai.onnx opset ``version``."""
        if self.opset < version:
            raise NeedOpset(version)

    def reserve(self, names) -> None:
        """Names that :meth:`unique` must not hand out (new graph inputs named by the caller)."""
        self._issued.update(names)

    def dims(self, value) -> tuple | None:
        """:func:`dims` of ``value``, read once per frozen shape: onnx-ir's reader shares
        frozen (immutable) shapes between values, and the sweep asks again and again."""
        shape = value.shape
        if shape is None:
            return None
        hit = self._frozen_dims.get(id(shape))
        if hit is not None and hit[0] is shape:  # (the shape is held: its id is not reused)
            return hit[1]
        out = dims(value)
        if shape.frozen:
            self._frozen_dims[id(shape)] = (shape, out)
        return out

    def wrap(self, value: ir.Value | None) -> V | None:
        return None if value is None else V(value, self)

    def unique(self, base: str) -> str:
        """``base``, or ``base_k`` with the first k that no earlier name of this call took."""
        k = self._counts.get(base, 0)
        name = base if k == 0 else f"{base}_{k}"
        while name in self._issued:
            k += 1
            name = f"{base}_{k}"
        self._counts[base] = k + 1
        self._issued.add(name)
        return name

    # -- constants -------------------------------------------------------------------------
    def const(self, value, dtype: ir.DataType | None = None) -> V:
        """A Constant node (one per distinct value and dtype in a gradients call)."""
        memo = _memo_key(value, dtype)  # Python numbers and int lists: found without numpy
        hit = None if memo is None else self._consts.get(memo)
        if hit is not None:
            return hit
        arr = np.asarray(value, dtype=None if dtype is None else dtype.numpy())
        if arr.dtype == np.float64 and dtype is None:
            raise TypeError("a float constant needs an explicit dtype")
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        hit = self._consts.get(key)
        if hit is None:
            tensor = ir.tensor(arr)
            saved, self.prefix = self.prefix, self.scope
            hit = self.op("Constant", value=tensor, _shape=arr.shape)
            self.prefix = saved
            self._consts[key] = hit
            if arr.ndim == 0:
                self._scalars[hit.value] = arr
        if memo is not None:
            self._consts[memo] = hit
        return hit

    def _widen_scalars(self, ins: list) -> list:
        """Scalar constants of a broadcasting op as [1] * rank, the rank of its widest input:
        onnxruntime's CPU kernels broadcast a rank-0 operand against a tensor whose trailing
        dims are 1 (an SE block's [N, C, 1, 1]) element by element, 10x to 40x slower
        (measured); [1] * rank takes the fast path, and no shape changes."""
        rank = max((len(x.shape) for x in ins if x is not None and x.shape is not None),
                   default=0)
        if not rank:
            return ins
        out = []
        for x in ins:
            arr = None if x is None or x.shape != () else self._scalars.get(x.value)
            if arr is not None:
                key = ("widened", x.value, rank)
                wide = self._consts.get(key)
                if wide is None:
                    wide = self._consts[key] = self.const(arr.reshape((1,) * rank), x.dtype)
                x = wide
            out.append(x)
        return out

    def _as_input(self, x, dtype):
        if x is None or isinstance(x, V):
            return x
        if type(x) not in _PLAIN and isinstance(x, ir.Value):  # (a Protocol: slow isinstance)
            return V(x, self)
        if isinstance(x, (list, tuple)) and all(isinstance(i, (int, np.integer)) for i in x):
            return self.const(x, ir.DataType.INT64)
        if isinstance(x, np.ndarray):
            return self.const(x)
        if dtype is None:
            raise TypeError(f"cannot tell the dtype of constant {x!r}: pass a tensor beside it")
        return self.const(x, dtype)

    # -- nodes -----------------------------------------------------------------------------
    def op(self, op_type: str, *inputs, _outputs: int = 1, _domain: str = "", _dtype=None,
           _shape=None, **attrs):
        """Emit one node; returns a V, or a tuple of V when ``_outputs`` > 1.

        ``_dtype`` (one dtype, or one per output) and ``_shape`` (output 0's static shape)
        override what the emitter infers."""
        ins = list(inputs)
        for x in ins:
            if x is not None and type(x) is not V:  # constants, ir.Values: convert
                ins = self._convert(ins)
                break
        if op_type in _WIDENED and self._scalars and len(ins) > 1:
            scalars = self._scalars
            for x in ins:
                if x is not None and x.value in scalars:
                    ins = self._widen_scalars(ins)
                    break
        # trailing absent optional inputs are dropped, inner ones stay as empty names
        while ins and ins[-1] is None:
            ins.pop()
        if op_type == "Reshape" and "allowzero" not in attrs and self.opset >= 14 and \
                _from_shape(ins[1]):
            # a shape read off a tensor with a 0 dim means 0 there, not "copy input dim i"
            # (which a lower-rank input cannot even do: onnxruntime refuses the model); Shape
            # never yields -1, the one value allowzero forbids beside a 0
            attrs["allowzero"] = 1
        base = f"{self.prefix}/{op_type}"
        if base in self._counts or base in self._issued:
            name = self.unique(base)
        else:  # (unique's first try, inline: most names are new)
            name = base
            self._counts[base] = 1
            self._issued.add(base)
        if _outputs > 1:  # output names are name:i; none may be taken either
            while any(f"{name}:{i}" in self._issued for i in range(_outputs)):
                name = self.unique(f"{self.prefix}/{op_type}")
            self._issued.update(f"{name}:{i}" for i in range(_outputs))
        attributes = [_attr(k, v) for k, v in attrs.items() if v is not None] if attrs else ()
        in_dtypes = [x.dtype for x in ins if x is not None]
        dtype = _dtype or _out_dtype(op_type, ins, attrs, in_dtypes)
        shape = _shape
        if shape is None and op_type in _ELEMENTWISE:
            if len(ins) == 2 and ins[0] is not None and ins[1] is not None:
                a, b = ins[0].shape, ins[1].shape
                shape = a if a == b and a is not None else broadcast_dims([a, b])
            else:
                shape = broadcast_dims([x.shape for x in ins if x is not None])
        elif shape is None and op_type == "Shape":  # 1-D, as long as x's rank
            shape = (None if attrs or ins[0].shape is None else len(ins[0].shape),)
        elif shape is None and op_type in _RANKS:
            rank = _RANKS[op_type](ins, attrs)
            shape = None if rank is None else (None,) * rank
        dtypes = dtype if isinstance(dtype, (list, tuple)) else [dtype] * _outputs
        if not _domain and not (_HALF_TYPES.isdisjoint(dtypes) and
                                _HALF_TYPES.isdisjoint(in_dtypes)):
            self._need_half(op_type, ins, dtypes)
        # an op whose rank onnx's inference will not find (computed split sizes, axes, kernel
        # ...): the rank is written into the model, for gradients of this gradient graph
        record = (op_type in SAME_RANK or op_type in AXES_RANK) and _computed_args(ins)
        unranked = record and shape is None  # left to onnx shape inference on the result
        if unranked:
            record = False
        values = [None if x is None else x.value for x in ins]
        # outputs made whole before the node: setting their names and types afterwards costs
        # onnx-ir a fifth more per node (measured alone, 9.8 against 11.9 us)
        if _outputs == 1:
            d = dtypes[0]
            out = ir.Value(name=name, type=None if d is None else _tensor_type(d),
                           shape=ir.Shape(shape) if record and d is not None else None)
            node = ir.Node(_domain, op_type, values, attributes, outputs=(out,), name=name)
            if unranked:
                self.unranked.append(node)
            self.graph.append(node)
            self.nodes.append(node)
            return V(out, self, d, shape)
        shapes = [shape] + [None] * (_outputs - 1)
        if record:
            shapes = [shape] + [(None,) * len(shape)] * (_outputs - 1)
        outs = [ir.Value(name=f"{name}:{i}",
                         type=None if dtypes[i] is None else _tensor_type(dtypes[i]),
                         shape=ir.Shape(shapes[i]) if record and dtypes[i] is not None else None)
                for i in range(_outputs)]
        node = ir.Node(_domain, op_type, values, attributes, outputs=outs, name=name)
        if unranked:
            self.unranked.append(node)
        self.graph.append(node)
        self.nodes.append(node)
        return tuple(V(o, self, dtypes[i], shapes[i]) for i, o in enumerate(node.outputs))

    def _convert(self, ins: list) -> list:
        """``ins`` with ir.Values wrapped and constants (numbers, int lists, arrays) made
        Constant nodes: a constant takes the dtype of the first float input, else the first."""
        # (plain Python constants first: isinstance against ir.Value, a typing Protocol, is slow)
        ins = [x if type(x) is V or type(x) in _PLAIN or not isinstance(x, ir.Value)
               else V(x, self) for x in ins]
        ctx = None
        for x in ins:
            if type(x) is V and x.dtype is not None:
                if x.dtype in FLOAT_TYPES:
                    ctx = x.dtype
                    break
                ctx = ctx or x.dtype
        return [self._as_input(x, ctx) for x in ins]

    def _need_half(self, op_type: str, ins: list, dtypes: list) -> None:
        """Half-precision types came to ai.onnx ops at various opsets (bfloat16: most at 13,
        Where at 16, ConstantOfShape at 20): an op whose schema at the model's opset refuses
        them upgrades the model to the first opset that takes them."""
        v = _half_opset(op_type, self.opset,
                        tuple(None if x is None else _HALF.get(x.dtype) for x in ins),
                        tuple(_HALF.get(d) for d in dtypes))
        if v is None:
            raise NotImplementedError(f"the gradient needs {op_type} in half precision, which "
                                      "no ai.onnx opset defines")
        self.need(v)

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)

    # -- helpers shared by many rules ------------------------------------------------------
    def fill_like(self, x: V, value, dtype=None) -> V:
        """A tensor of x's run-time shape filled with ``value`` (x's dtype unless given)."""
        dtype = dtype or x.dtype
        if dtype == ir.DataType.BFLOAT16 and self.opset < 20:  # (ConstantOfShape takes it at 20)
            return self.Cast(self.fill_like(x, value, ir.DataType.FLOAT), to=dtype)
        return self.op("ConstantOfShape", self.op("Shape", x),
                       value=ir.tensor(np.array([value], dtype=dtype.numpy())),
                       _dtype=dtype, _shape=x.shape)

    def zeros_like(self, x: V) -> V:
        return self.fill_like(x, 0)

    def broadcast_to(self, t: V, x: V) -> V:
        """``t`` (x's rank, size 1 on the axes it broadcasts along) broadcast to x's shape. An
        Expand; but where those axes are x's last ones with static sizes (a pooled [N, C, 1, 1]
        back to [N, C, H, W]) and t is float or double, a product with a row of ones, which
        onnxruntime runs 5x to 10x faster on small trailing dims (its Expand writes such a
        broadcast element by element; measured): exact, x * 1 with nothing summed."""
        ts, xs = t.shape, x.shape
        if ts is not None and xs is not None and len(ts) == len(xs) and \
                t.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
            k = len(xs)
            while k and ts[k - 1] == 1 and isinstance(xs[k - 1], int):
                k -= 1
            width = int(np.prod(xs[k:], dtype=np.int64))
            if all(a is not None and a == b for a, b in zip(ts[:k], xs[:k])) and width > 1:
                ones = self.const(np.ones((1, width)), t.dtype)
                # [lead..., 1] (0 copies a dim: an empty batch stays empty, where -1 fails)
                row = self.op("MatMul", self.op("Reshape", t, [0] * k + [1]), ones)
                return self.op("Reshape", row, self.op("Shape", x), _shape=xs)
        return self.op("Expand", t, self.op("Shape", x), _shape=xs)

    def place(self, t: V, x: V, axis: int, start: int, stop: int) -> V:
        """t, the slice [start, stop) of x along ``axis`` (>= 0), zero-padded back to x's shape:
        the adjoint of taking the slice (x's dim there and its rank may be known only at run
        time; stop <= that dim). Recorded, so that the gradients of slices that meet (q, k, v =
        qkv[0], qkv[1], qkv[2]) are joined by one Concat instead of padded and summed
        (autodiff's _aggregate)."""
        d = x.shape[axis] if x.shape is not None else None
        after = d - stop if isinstance(d, int) else \
            self.op("Sub", self.op("Slice", self.op("Shape", x), [axis], [axis + 1]), [stop])
        out = self.op("Pad", t, self.axis_pads(x, axis, start, after), _shape=x.shape)
        self.pieces[out.value] = Piece(axis, start, stop, t, x)
        return out

    def axis_pads(self, x: V, axis: int, before, after):
        """Pad's pads for x's rank: ``before`` and ``after`` (ints, or int64 [1] tensors) on
        ``axis`` (>= 0), zeros on the other axes, whose number may be known at run time only."""
        if x.rank is not None and isinstance(before, int) and isinstance(after, int):
            pads = [0] * (2 * x.rank)
            pads[axis], pads[x.rank + axis] = before, after
            return pads
        if x.rank is not None:
            mid, tail = [0] * (x.rank - 1), [0] * (x.rank - axis - 1)
        else:  # zeros for the other axes, from the rank at run time: shape arithmetic alone,
            # which onnxruntime's CUDA provider keeps on the host (see _sum_dynamic)
            zeros = self.op("Mul", self.op("Shape", x), [0])
            mid = self.op("Slice", zeros, [1], [np.iinfo(np.int64).max])
            tail = self.op("Slice", zeros, [axis + 1], [np.iinfo(np.int64).max])
        parts = [[0] * axis, [before] if isinstance(before, int) else before, mid,
                 [after] if isinstance(after, int) else after, tail]
        return self.op("Concat", *[p for p in parts if not isinstance(p, list) or p], axis=0)

    def reduce(self, op_type: str, x: V, axes, keepdims: int = 1) -> V:
        """ReduceXxx over ``axes`` (ints or an int64 tensor), in the form this opset wants."""
        leading = _leading(x, axes, self.opset) if op_type == "ReduceSum" else None
        if leading:
            return self._sum_leading(x, leading, keepdims)
        axes_as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if axes_as_input:
            return self.op(op_type, x, axes, keepdims=keepdims)
        return self.op(op_type, x, axes=list(axes), keepdims=keepdims)

    def _sum_leading(self, x: V, axes: set, keepdims: int) -> V:
        """The sum over ``axes``, x's first k axes but for some of size 1, as ones[R] @ x[R, C]
        (R: the product of the first k dims, C: of the rest). onnxruntime's ReduceSum over
        leading axes (a bias gradient) runs 1.3x to 1.7x slower than this product at one
        thread and 2x to 8x at two, where it is slower than at one (measured on [2048, 256] to
        [16, 64, 64, 64]); its reductions over inner axes (0, 2, 3 of NCHW) are 2x faster than
        products, and keep the ReduceSum."""
        shape, k = x.shape, max(axes) + 1
        lead, trail = shape[:k], shape[k:]
        c = math.prod(trail)
        rows = x if len(shape) == 2 else self.op("Reshape", x, [-1, c], _shape=(None, c))
        vec = not keepdims and len(trail) == 1  # [R] @ [R, C] is [C]: no Reshape after
        if all(isinstance(d, int) for d in lead):
            r = math.prod(lead)
            count = [r] if vec else [1, r]
        else:  # the rows counted at run time (a symbolic batch)
            r = self.op("Slice", self.op("Shape", rows), [0], [1])
            count = r if vec else self.op("Concat", [1], r, axis=0)
        ones = self.op("ConstantOfShape", count, value=ir.tensor(np.ones(1, x.dtype.numpy())),
                       _shape=(None,) if vec else (1, None))
        total = self.op("MatMul", ones, rows, _shape=(c,) if vec else (1, c))
        out = tuple(1 for i in range(k) if keepdims or i not in axes) + tuple(trail)
        return total if total.shape == out else self.op("Reshape", total, list(out), _shape=out)

    def over_count(self, g: V, k) -> V:
        """g / k for a count k (an int, or an integer or float32 tensor), in float32 where g is
        float16 or bfloat16 and rounded once: there a count past 65504 is inf (g / inf = 0),
        and 1 / k is a subnormal a few per cent off. g is a reduced gradient (small)."""
        half = g.dtype in _HALF_TYPES
        w = self.op("Cast", g, to=ir.DataType.FLOAT) if half else g
        if isinstance(k, int):
            w = w * (1.0 / max(k, 1))  # 0: an empty tensor, whose (empty) gradient any scale gives
        else:
            w = w / (k if k.dtype == w.dtype else self.op("Cast", k, to=w.dtype))
        return self.op("Cast", w, to=g.dtype) if half else w

    def sum_to(self, t: V, x: V) -> V:
        """Sum ``t`` (broadcast from x) down to x's shape: the adjoint of numpy broadcasting.

        Static shapes decide the axes when they can; otherwise the axes are computed at run time
        from Shape(t) and Shape(x), so symbolic batch dims work.
        """
        src, dst = t.shape, x.shape
        if src == dst and src is not None and None not in src:  # (what the loop below finds)
            return t
        if src is not None and dst is not None:
            lead = len(src) - len(dst)
            if lead >= 0:
                axes, ambiguous = [], False
                for i, d in enumerate(dst):
                    s = src[lead + i]
                    if d == 1 and s != 1:
                        axes.append(lead + i)
                    elif not isinstance(d, int) and (d is None or d != s):
                        ambiguous = True  # a symbolic or unknown dim may be 1 at run time
                if not ambiguous:
                    return self._sum_static(t, lead, axes)
        return self._sum_dynamic(t, x)

    def _sum_static(self, t: V, lead: int, axes: list[int]) -> V:
        if not axes and not lead:
            return t
        if not axes:
            return self.reduce("ReduceSum", t, list(range(lead)), keepdims=0)
        r = self.reduce("ReduceSum", t, list(range(lead)) + axes, keepdims=1)
        return self.op("Squeeze", r, list(range(lead))) if lead else r

    def _sum_dynamic(self, t: V, x: V) -> V:
        st, sx = self.op("Shape", t), self.op("Shape", x)
        # x's shape left-padded with ones to t's rank; reduce where it differs from t's
        if t.rank is not None and x.rank is not None and t.rank >= x.rank:
            # ranks known: shape arithmetic alone, which onnxruntime's CUDA provider keeps on
            # the host (a ConstantOfShape runs on the device, and its ones came back by copy)
            lead = t.rank - x.rank
            padded = self.op("Concat", [1] * lead, sx, axis=0) if lead else sx
        else:
            rank_t = self.op("Shape", st)
            ones = self.op("ConstantOfShape", rank_t,
                           value=ir.tensor(np.array([1], dtype=np.int64)))
            padded = self.op("Slice", self.op("Concat", ones, sx, axis=0),
                             self.op("Neg", rank_t), [np.iinfo(np.int64).max])
        axes = self.op("Reshape", self.op("NonZero", self.op("Not", self.op("Equal", padded, st))),
                       [-1])
        r = self.op("ReduceSum", t, axes, keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", r, sx, _shape=x.shape)

    # -- appended for control flow (issue 4) ---------------------------------------------------
    def child(self, graph: ir.Graph, prefix: str, outer_consts: bool = True) -> Emitter:
        """An emitter for a subgraph: its own graph and node list, names unique across the call
        (shared counters), and the constants made so far reused (outer-scope values), unless
        ``outer_consts`` is False: a forward node's own body runs before them."""
        c = Emitter(graph, self.scope, self.opset)
        c.prefix = prefix
        c._counts, c._issued, c.unranked = self._counts, self._issued, self.unranked
        c._consts = dict(self._consts) if outer_consts else {}
        c._scalars = dict(self._scalars) if outer_consts else {}
        c.pieces, c._frozen_dims = self.pieces, self._frozen_dims
        return c

    # -- a forward node replaced in place (the RNN and normalization rules) ----------------------
    def scratch(self, tag: str = "_fwd") -> Emitter:
        """An emitter into a new, empty graph whose nodes :meth:`replace` moves in front of a
        forward node; its constants are its own (those made so far may sit after the node)."""
        prefix = self.prefix[:-5] if self.prefix.endswith("_grad") else self.prefix
        return self.child(ir.Graph([], [], nodes=[], name="scratch"), prefix + tag,
                          outer_consts=False)

    def replace(self, node: ir.Node, f: Emitter, new) -> None:
        """Put ``node`` out of the graph in favour of what :meth:`scratch` emitter ``f`` built:
        those nodes go in front of it, and ``new`` (V or None, aligned with its outputs) takes
        over each named output's uses, graph outputs, name and type."""
        for old, v in zip(node.outputs, new):
            if not old.name:  # an output the node does not have
                continue
            name = old.name
            old.name = self.unique(f"{name}__replaced")
            old.replace_all_uses_with(v.value, replace_graph_outputs=True)
            v.value.name, v.value.type, v.value.shape = name, old.type, old.shape
        self.put_before(node, f)
        node.graph.remove(node, safe=True)

    @staticmethod
    def put_before(node: ir.Node, f: Emitter) -> None:
        """Move what :meth:`scratch` emitter ``f`` built in front of ``node``."""
        nodes = list(f.graph)
        f.graph.remove(nodes)
        node.graph.insert_before(node, nodes)

    def made(self, node: ir.Node) -> bool:
        """Whether this gradients call made ``node`` (an emitted node, or a clone such as a
        model function's body recomputed beside its call)."""
        return node.name in self._issued

    def adopt(self, v: V) -> V:
        """``v`` (made by another emitter, e.g. a :meth:`scratch` one) with arithmetic here."""
        return V(v.value, self, v.dtype, v.shape)


def _rank(x) -> int | None:
    return None if x is None or x.shape is None else len(x.shape)


def _length(x) -> int | None:
    """The number of elements of a 1-D input (a shape or axes), from its static shape or its
    constant value, or None."""
    if x is None:
        return None
    if x.shape is not None and len(x.shape) == 1 and isinstance(x.shape[0], int):
        return x.shape[0]
    p, t = x.value.producer(), x.value.const_value
    if t is None and p is not None and p.op_type == "Constant" and "value" in p.attributes:
        t = p.attributes["value"].value
    return None if t is None or len(t.shape) != 1 else int(t.shape[0])


def _first(ins, attrs):
    """Input 0's rank (ReduceXxx: only with keepdims=1)."""
    return _rank(ins[0]) if attrs.get("keepdims", 1) else None


def _kernel_or_first(ins, attrs):
    """A convolution's: input 0's rank, which its kernel has too."""
    r = _rank(ins[0])
    return r if r is not None or len(ins) < 2 else _rank(ins[1])


def _any(ins, attrs):
    return next((_rank(x) for x in ins if _rank(x) is not None), None)


def _matmul(ins, attrs):
    ra, rb = _rank(ins[0]), _rank(ins[1])
    if ra is None or rb is None:
        return None
    return max(ra, rb) if min(ra, rb) >= 2 else ra + rb - 2


def _by_length(op_type):
    return lambda ins, attrs: out_rank(op_type, 1, _rank(ins[0]),
                                       _length(ins[1]) if len(ins) > 1 else None)


# the output rank of ops from their inputs' ranks (dims unknown): rules know more ranks, and the
# outputs of SAME_RANK / AXES_RANK ops with computed arguments get it written into the model
_RANKS = {
    **{op: _first for op in SAME_RANK},
    **{op: _first for op in ("Transpose", "Softmax", "LogSoftmax", "CumSum", "Trilu", "Slice",
                             "Pad", "Tile", "ScatterElements", "ScatterND", "GatherElements")},
    **{op: _by_length(op) for op in AXES_RANK},
    "Conv": _kernel_or_first, "ConvTranspose": _kernel_or_first, "Concat": _any,
    "MatMul": _matmul, "Gemm": lambda ins, attrs: 2, "Flatten": lambda ins, attrs: 2,
    "Size": lambda ins, attrs: 0, "ConstantOfShape": lambda ins, attrs: _length(ins[0]),
    "Gather": lambda ins, attrs: (None if _rank(ins[0]) is None or _rank(ins[1]) is None
                                  else _rank(ins[0]) + _rank(ins[1]) - 1),
}


def _leading(x, axes, opset: int) -> set | None:
    """``axes`` made non-negative when a ReduceSum of x over them sums its first k axes (but
    for some of static size 1, which sum nothing) into static trailing ones, on a float tensor
    large enough for :meth:`Emitter._sum_leading` to matter (32768 elements or more by its
    static dims); else None."""
    if opset < 10 or x.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE) or \
            x.shape is None or len(x.shape) < 2 or not isinstance(axes, (list, tuple)) or \
            not axes or not all(isinstance(a, int) for a in axes):
        return None
    shape, rank = x.shape, len(x.shape)
    if math.prod(d for d in shape if isinstance(d, int)) < 1 << 15 or \
            any(not -rank <= a < rank for a in axes):
        return None
    ks = {a % rank for a in axes}
    k = max(ks) + 1
    if len(ks) < len(axes) or k >= rank or \
            any(shape[i] != 1 for i in range(k) if i not in ks):
        return None
    if all(isinstance(d, int) and d > 0 for d in shape[k:]):
        return ks
    return None


def _memo_key(value, dtype) -> tuple | None:
    """:meth:`Emitter.const`'s key for a Python number of a given dtype, or an int64 list or tuple
    of Python ints; None for anything else. A float's sign is part of it: -0.0 == 0.0."""
    kind = type(value)
    if dtype is None:
        return None
    if kind is int or kind is bool:
        return ("number", dtype, int(value))
    if kind is float:
        return ("number", dtype, value, math.copysign(1.0, value))
    if dtype == ir.DataType.INT64 and (kind is list or kind is tuple) and \
            all(type(i) is int for i in value):
        return ("ints", tuple(value))
    return None


def _computed_args(ins) -> bool:
    """Whether an input after the first is computed (not a Constant node or initializer)."""
    for x in ins[1:]:
        p = None if x is None else x.value.producer()
        if x is not None and (p is None or p.op_type != "Constant") and x.value.const_value is None:
            return True
    return False


@functools.lru_cache(maxsize=None)
def _tensor_type(dtype):
    return ir.TensorType(dtype)


def _attr(name, value):
    # direct constructors for the common kinds: convert_attribute's protocol checks cost ~50x more
    kind = type(value)
    if kind is int or kind is bool or isinstance(value, ir.DataType):
        return ir.AttrInt64(name, int(value))
    if kind is float:
        return ir.AttrFloat32(name, value)
    if kind is str:
        return ir.AttrString(name, value)
    if (kind is list or kind is tuple) and all(type(v) is int for v in value):
        return ir.AttrInt64s(name, value)
    if isinstance(value, ir.Tensor):
        return ir.AttrTensor(name, value)
    if isinstance(value, ir.Attr):
        return value
    return ir.convenience.convert_attribute(name, value)


def _from_shape(v) -> bool:
    """Whether v is the output of a Shape node."""
    p = v.value.producer() if v is not None else None
    return p is not None and p.op_type == "Shape" and p.domain in ("", "ai.onnx")


def _out_dtype(op_type, ins, attrs, in_dtypes):
    """The output dtype of ``op_type`` from its inputs (``in_dtypes``: those of the present
    ones, in order)."""
    if op_type not in _SPECIAL_DTYPE:  # the dtype of the first typed input
        for d in in_dtypes:
            if d is not None:
                return d
        return None
    if op_type in _INT64_OUT:
        return ir.DataType.INT64
    if op_type in _BOOL_OUT:
        return ir.DataType.BOOL
    if op_type == "Cast":
        return ir.DataType(int(attrs["to"]))
    if op_type == "Constant":
        return attrs["value"].dtype
    if op_type == "ConstantOfShape":
        return attrs["value"].dtype if "value" in attrs else ir.DataType.FLOAT
    return ins[_DTYPE_FROM_INPUT[op_type]].dtype

