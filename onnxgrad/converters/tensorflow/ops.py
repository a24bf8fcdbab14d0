"""One small handler per TensorFlow op (the table). ``c`` is the :class:`~.convert.Converter`,
``n`` the node; a handler returns the ONNX values of the node's outputs in order.

TF keeps int32 shapes and indices; ONNX wants int64 for shapes, axes and repeats, so handlers
cast where ONNX needs it and otherwise keep TF's dtypes unchanged.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from . import control_flow, resources  # noqa: F401  (their handlers register on import)
from .core import Converter, handler, onnx_dtype
from .errors import ConversionError
from .graph import TFNode

I64 = TensorProto.INT64


def _i64(c: Converter, v: str) -> str:
    """v as int64 (ONNX's type for shapes, axes, repeats); folded when v is a constant, so that
    ONNX shape inference can read it."""
    k = c.consts.get(v)
    return c.op("Cast", [v], to=I64) if k is None else c.const(k.astype(np.int64))


def _axes(c: Converter, n: TFNode, i: int) -> str:
    return _i64(c, c.x(n, i))


def _vec64(c: Converter, n: TFNode, i: int) -> str:
    """Input i as a 1-D int64 tensor (axes given as a scalar or a vector)."""
    k = c.const_input(n, i)
    if k is not None:
        return c.const(np.asarray(k, np.int64).reshape(-1))
    return c.op("Reshape", [_i64(c, c.x(n, i)), c.i64(-1)])


def _const_axis(c: Converter, n: TFNode, i: int, what="axis") -> int:
    return int(c.const_input(n, i, required=what))


# -- structure ---------------------------------------------------------------------------------
@handler("Const")
def _const(c, n):
    return [c.const(c.attr(n, "value"), name=n.name)]


@handler("Placeholder", "PlaceholderV2")
def _placeholder(c, n):
    ref = f"{n.name}:0"
    shape = c.attr(n, "shape")
    c.fresh(ref)
    c.scope.inputs.append(helper.make_tensor_value_info(
        ref, onnx_dtype(n.attr["dtype"].type, n),
        None if shape is None else [d if d is not None else f"{n.name}_{k}"
                                    for k, d in enumerate(shape)]))
    return [ref]


@handler("PlaceholderWithDefault", "Identity", "StopGradient", "Snapshot", "PreventGradient",
         "CheckNumerics", "EnsureShape", "RefIdentity")
def _identity(c, n):
    return [c.x(n)]


@handler("IdentityN")
def _identity_n(c, n):
    return [c.x(n, i) for i in range(len(n.inputs))]


@handler("Switch", "RefSwitch")  # a cond's Switch: both outputs are the data (the If picks)
def _switch(c, n):
    return [c.x(n), c.x(n)]


@handler("NoOp", "ControlTrigger", "Assert", "Print", "PrintV2")
def _nothing(c, n):
    return []


# -- elementwise -------------------------------------------------------------------------------
SAME = {  # TF op -> ONNX op with the same inputs and numpy broadcasting
    "Add": "Add", "AddV2": "Add", "Sub": "Sub", "Mul": "Mul", "RealDiv": "Div",
    "Maximum": "Max", "Minimum": "Min", "Pow": "Pow", "Greater": "Greater", "Less": "Less",
    "GreaterEqual": "GreaterOrEqual", "LessEqual": "LessOrEqual", "Equal": "Equal",
    "LogicalAnd": "And", "LogicalOr": "Or", "LogicalNot": "Not",
    "Tanh": "Tanh", "Sigmoid": "Sigmoid", "Relu": "Relu", "Exp": "Exp", "Log": "Log",
    "Neg": "Neg", "Abs": "Abs", "Sqrt": "Sqrt", "Sin": "Sin", "Cos": "Cos", "Tan": "Tan",
    "Floor": "Floor", "Ceil": "Ceil", "Erf": "Erf", "Reciprocal": "Reciprocal", "Inv": "Reciprocal",
    "Sign": "Sign", "Softplus": "Softplus", "Softsign": "Softsign", "Elu": "Elu", "Selu": "Selu",
    "Round": "Round", "IsNan": "IsNaN", "Asin": "Asin", "Acos": "Acos", "Atan": "Atan",
    "Sinh": "Sinh", "Cosh": "Cosh", "Asinh": "Asinh", "Acosh": "Acosh", "Atanh": "Atanh",
    "SelectV2": "Where", "MatrixDeterminant": "Det",
}
for _tf, _onnx in SAME.items():
    handler(_tf)(lambda c, n, _o=_onnx: [c.op(_o, [c.x(n, i) for i in range(len(n.inputs))])])


@handler("Rsqrt")
def _rsqrt(c, n):
    return [c.op("Reciprocal", [c.op("Sqrt", [c.x(n)])])]


@handler("Square")
def _square(c, n):
    return [c.op("Mul", [c.x(n), c.x(n)])]


@handler("SquaredDifference")
def _sq_diff(c, n):
    d = c.op("Sub", [c.x(n, 0), c.x(n, 1)])
    return [c.op("Mul", [d, d])]


@handler("NotEqual")
def _not_equal(c, n):
    return [c.op("Not", [c.op("Equal", [c.x(n, 0), c.x(n, 1)])])]


@handler("Relu6")
def _relu6(c, n):
    return [c.op("Clip", [c.x(n), c.const(0, _np(n)), c.const(6, _np(n))])]


@handler("LeakyRelu")
def _leaky(c, n):
    return [c.op("LeakyRelu", [c.x(n)], alpha=float(c.attr(n, "alpha", 0.2)))]


@handler("FloorDiv")
def _floordiv(c, n):
    q = c.op("Div", [c.x(n, 0), c.x(n, 1)])
    return [c.op("Floor", [q]) if _is_float(n) else _floor_int(c, n, q)]


@handler("FloorMod")
def _floormod(c, n):
    a, b = c.x(n, 0), c.x(n, 1)
    if not _is_float(n):
        return [c.op("Mod", [a, b], fmod=0)]  # integer Mod takes the divisor's sign, like TF
    return [c.op("Sub", [a, c.op("Mul", [c.op("Floor", [c.op("Div", [a, b])]), b])])]


def _floor_int(c, n, q):
    # ONNX integer Div truncates; TF's FloorDiv rounds down: subtract 1 where signs differ and
    # the division is inexact
    a, b = c.x(n, 0), c.x(n, 1)
    inexact = c.op("Not", [c.op("Equal", [c.op("Mul", [q, b]), a])])
    neg = c.op("Xor", [c.op("Less", [a, c.const(0, _np(n))]), c.op("Less", [b, c.const(0, _np(n))])])
    fix = c.op("Cast", [c.op("And", [inexact, neg])], to=onnx_dtype(n.attr["T"].type, n))
    return c.op("Sub", [q, fix])


def _np(n: TFNode, key: str = "T"):
    from .proto import dtype_info
    return dtype_info(n.attr[key].type).np


def _is_float(n: TFNode) -> bool:
    return np.issubdtype(_np(n), np.floating) or _np(n) in (np.float16,)


@handler("AddN")
def _add_n(c, n):
    xs = [c.x(n, i) for i in range(len(n.inputs))]
    return [xs[0] if len(xs) == 1 else c.op("Sum", xs)]


@handler("Cast")
def _cast(c, n):
    return [c.op("Cast", [c.x(n)], to=onnx_dtype(n.attr["DstT"].type, n))]


@handler("Select")
def _select(c, n):
    cond = c.x(n, 0)
    # TF1 Select with a vector condition picks whole rows: make it broadcast over the rest
    rank_t = c.op("Size", [c.op("Shape", [c.x(n, 1)])])
    pad = c.op("Sub", [rank_t, c.op("Size", [c.op("Shape", [cond])])])
    ones = c.op("ConstantOfShape", [c.op("Reshape", [pad, c.i64(1)])],
                value=helper.make_tensor("one", I64, [1], [1]))
    shape = c.op("Concat", [c.op("Shape", [cond]), ones], axis=0)
    return [c.op("Where", [c.op("Reshape", [cond, shape]), c.x(n, 1), c.x(n, 2)])]


@handler("BiasAdd", "BiasAddV1")
def _bias_add(c, n):
    if c.attr(n, "data_format", "NHWC") == "NCHW":
        rank = c.op("Size", [c.op("Shape", [c.x(n, 0)])])
        ones = c.op("ConstantOfShape", [c.op("Reshape", [c.op("Sub", [rank, c.i64(2)]),
                                                         c.i64(1)])],
                    value=helper.make_tensor("one", I64, [1], [1]))
        b = c.op("Reshape", [c.x(n, 1), c.op("Concat", [c.i64(-1), ones], axis=0)])
        return [c.op("Add", [c.x(n, 0), b])]
    return [c.op("Add", [c.x(n, 0), c.x(n, 1)])]


# -- linear algebra ----------------------------------------------------------------------------
@handler("MatMul")
def _matmul(c, n):
    a, b = c.x(n, 0), c.x(n, 1)
    ta, tb = c.attr(n, "transpose_a", False), c.attr(n, "transpose_b", False)
    if _is_float(n):
        return [c.op("Gemm", [a, b], transA=int(ta), transB=int(tb))]
    a = c.op("Transpose", [a], perm=[1, 0]) if ta else a
    b = c.op("Transpose", [b], perm=[1, 0]) if tb else b
    return [c.op("MatMul", [a, b])]


@handler("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
def _batch_matmul(c, n):
    a, b = c.x(n, 0), c.x(n, 1)
    a = c.op("Einsum", [a], equation="...ij->...ji") if c.attr(n, "adj_x", False) else a
    b = c.op("Einsum", [b], equation="...ij->...ji") if c.attr(n, "adj_y", False) else b
    return [c.op("MatMul", [a, b])]


# -- reductions --------------------------------------------------------------------------------
REDUCE = {"Sum": "ReduceSum", "Mean": "ReduceMean", "Max": "ReduceMax", "Min": "ReduceMin",
          "Prod": "ReduceProd", "All": "ReduceMin", "Any": "ReduceMax"}


def _reduce(c, n, onnx_op):
    x = c.x(n, 0)
    boolean = n.op in ("All", "Any")
    if boolean:
        x = c.op("Cast", [x], to=TensorProto.INT32)
    keep = int(c.attr(n, "keep_dims", False))
    if _reduces_all(c, n):  # no axes: ONNX then knows the result's rank
        y = c.op(onnx_op, [x], keepdims=keep)
    else:
        y = c.op(onnx_op, [x, _vec64(c, n, 1)], keepdims=keep, noop_with_empty_axes=0)
    return [c.op("Cast", [y], to=TensorProto.BOOL) if boolean else y]


def _reduces_all(c, n) -> bool:
    """TF reduces over every axis with axes = Range(0, Rank(x), 1) when x's rank is unknown."""
    p = c.g.producer(n.inputs[1])
    if p.op != "Range" or c.g.producer(p.inputs[1]).op != "Rank":
        return False
    start, delta = (c.consts.get(c.value(p.inputs[j])) for j in (0, 2))
    return start is not None and delta is not None and int(start) == 0 and int(delta) == 1


for _tf, _onnx in REDUCE.items():
    handler(_tf)(lambda c, n, _o=_onnx: _reduce(c, n, _o))


@handler("ArgMax", "ArgMin")
def _arg(c, n):
    axis = _const_axis(c, n, 1)
    y = c.op(n.op, [c.x(n, 0)], axis=axis, keepdims=0)
    out = onnx_dtype(n.attr["output_type"].type, n) if "output_type" in n.attr else I64
    return [y if out == I64 else c.op("Cast", [y], to=out)]


# -- shapes ------------------------------------------------------------------------------------
def _out_type(c, n, v, key="out_type"):
    t = onnx_dtype(n.attr[key].type, n) if key in n.attr else TensorProto.INT32
    return v if t == I64 else c.op("Cast", [v], to=t)


@handler("Shape")
def _shape(c, n):
    return [_out_type(c, n, c.op("Shape", [c.x(n)]))]


@handler("ShapeN")
def _shape_n(c, n):
    return [_out_type(c, n, c.op("Shape", [c.x(n, i)])) for i in range(len(n.inputs))]


@handler("Size")
def _size(c, n):
    return [_out_type(c, n, c.op("Size", [c.x(n)]))]


@handler("Rank")
def _rank(c, n):
    return [c.op("Cast", [c.op("Size", [c.op("Shape", [c.x(n)])])], to=TensorProto.INT32)]


@handler("Reshape")
def _reshape(c, n):
    return [c.op("Reshape", [c.x(n, 0), _i64(c, c.x(n, 1))])]


@handler("Squeeze")
def _squeeze(c, n):
    dims = c.attr(n, "squeeze_dims", [])
    return [c.op("Squeeze", [c.x(n)] + ([c.i64(*dims)] if dims else []))]


@handler("ExpandDims")
def _expand_dims(c, n):
    return [c.op("Unsqueeze", [c.x(n, 0), _vec64(c, n, 1)])]


@handler("Transpose")
def _transpose(c, n):
    perm = c.const_input(n, 1, required="the permutation")
    return [c.op("Transpose", [c.x(n, 0)], perm=[int(p) for p in perm])]


@handler("ConcatV2")
def _concat(c, n):
    k = len(n.inputs) - 1
    return [c.op("Concat", [c.x(n, i) for i in range(k)], axis=_const_axis(c, n, k))]


@handler("Concat")
def _concat_v1(c, n):
    return [c.op("Concat", [c.x(n, i) for i in range(1, len(n.inputs))],
                 axis=_const_axis(c, n, 0))]


@handler("Pack")
def _pack(c, n):
    axis = c.attr(n, "axis", 0)
    ax = c.i64(axis)
    return [c.op("Concat", [c.op("Unsqueeze", [c.x(n, i), ax]) for i in range(len(n.inputs))],
                 axis=axis)]


@handler("Unpack")
def _unpack(c, n):
    num, axis = c.attr(n, "num"), c.attr(n, "axis", 0)
    parts = c.op("Split", [c.x(n)], n_out=num, axis=axis, num_outputs=num) if num > 1 else [c.x(n)]
    parts = [parts] if isinstance(parts, str) else parts
    return [c.op("Squeeze", [p, c.i64(axis)]) for p in parts]


@handler("Split")
def _split(c, n):
    num, axis = c.attr(n, "num_split"), _const_axis(c, n, 0)
    if num == 1:
        return [c.x(n, 1)]
    return c.op("Split", [c.x(n, 1)], n_out=num, axis=axis, num_outputs=num)


@handler("SplitV")
def _split_v(c, n):
    num, axis = c.attr(n, "num_split"), _const_axis(c, n, 2)
    sizes = c.const_input(n, 1)
    if sizes is not None and (sizes < 0).any():
        raise ConversionError(f"{n}: size_splits with -1 is not supported")
    if num == 1:
        return [c.x(n, 0)]
    out = c.op("Split", [c.x(n, 0), _i64(c, c.x(n, 1))], n_out=num, axis=axis)
    return out


@handler("Fill")
def _fill(c, n):
    return [c.op("Expand", [c.x(n, 1), _i64(c, c.x(n, 0))])]


@handler("ZerosLike", "OnesLike")
def _zeros_like(c, n):
    v = c.const(0 if n.op == "ZerosLike" else 1, _np(n))
    return [c.op("Expand", [v, c.op("Shape", [c.x(n)])])]


@handler("Range")
def _range(c, n):
    return [c.op("Range", [c.x(n, 0), c.x(n, 1), c.x(n, 2)])]


@handler("Tile")
def _tile(c, n):
    return [c.op("Tile", [c.x(n, 0), _i64(c, c.x(n, 1))])]


@handler("GatherV2")
def _gather(c, n):
    if c.attr(n, "batch_dims", 0):
        raise ConversionError(f"{n}: batch_dims != 0 is not supported")
    return [c.op("Gather", [c.x(n, 0), c.x(n, 1)], axis=_const_axis(c, n, 2))]


@handler("Gather")
def _gather_v1(c, n):
    return [c.op("Gather", [c.x(n, 0), c.x(n, 1)], axis=0)]


@handler("Slice")
def _slice(c, n):
    begin, size = _i64(c, c.x(n, 1)), _i64(c, c.x(n, 2))
    big = c.i64(np.iinfo(np.int64).max)
    # size -1 means "to the end"
    end = c.op("Where", [c.op("Less", [size, c.i64(0)]), big, c.op("Add", [begin, size])])
    return [c.op("Slice", [c.x(n, 0), begin, end])]


@handler("StridedSlice")
def _strided_slice(c, n):
    return [_slice_like(c, n, c.x(n, 0), 1)]


@handler("StridedSliceGrad")
def _strided_slice_grad(c, n):  # (shape, begin, end, strides, dy): dy scattered into zeros
    shape = _i64(c, c.x(n, 0))
    count = c.op("ReduceProd", [shape], keepdims=1)
    zero, one = c.const(0, np.int64), c.const(1, np.int64)
    index = c.op("Reshape", [c.op("Range", [zero, c.op("Squeeze", [count]), one]), shape])
    where = c.op("Unsqueeze", [c.op("Reshape", [_slice_like(c, n, index, 1), c.i64(-1)]),
                               c.i64(-1)])
    dy = c.x(n, 4)
    zeros = c.op("Expand", [c.const(0, _np(n, "T") if "T" in n.attr else np.float32), count])
    flat = c.op("ScatterND", [zeros, where, c.op("Reshape", [dy, c.i64(-1)])])
    return [c.op("Reshape", [flat, shape])]


def _slice_like(c, n, x, first: int) -> str:
    """x sliced like node n's StridedSlice with bounds at inputs first..first+2."""
    begin, end, strides = (c.const_input(n, i, required="StridedSlice bounds")
                           for i in (first, first + 1, first + 2))
    m = {k: c.attr(n, k, 0) for k in ("begin_mask", "end_mask", "ellipsis_mask",
                                      "new_axis_mask", "shrink_axis_mask")}
    if m["ellipsis_mask"] or m["new_axis_mask"]:
        raise ConversionError(f"{n}: ellipsis_mask/new_axis_mask are not supported")
    big = np.iinfo(np.int64).max
    starts, ends, axes, steps, squeeze = [], [], [], [], []
    for i, (b, e, s) in enumerate(zip(begin, end, strides)):
        b, e, s = int(b), int(e), int(s)
        if m["shrink_axis_mask"] >> i & 1:
            e, squeeze = (b + 1 if b != -1 else big), squeeze + [i]
        else:
            if m["begin_mask"] >> i & 1:
                b = 0 if s > 0 else big
            if m["end_mask"] >> i & 1:
                e = big if s > 0 else -big
        starts.append(b), ends.append(e), axes.append(i), steps.append(s)
    y = c.op("Slice", [x, c.i64(*starts), c.i64(*ends), c.i64(*axes), c.i64(*steps)])
    return c.op("Squeeze", [y, c.i64(*squeeze)]) if squeeze else y


# -- neural-network ops ------------------------------------------------------------------------
@handler("Softmax", "LogSoftmax")
def _softmax(c, n):
    return [c.op(n.op, [c.x(n)], axis=-1)]


# -- gradient ops tf.gradients emits -------------------------------------------------------------
@handler("TanhGrad")
def _tanh_grad(c, n):  # (y, dy) -> dy * (1 - y^2)
    y, dy = c.x(n, 0), c.x(n, 1)
    return [c.op("Mul", [dy, c.op("Sub", [c.const(1, _np(n)), c.op("Mul", [y, y])])])]


@handler("SigmoidGrad")
def _sigmoid_grad(c, n):  # (y, dy) -> dy * y * (1 - y)
    y, dy = c.x(n, 0), c.x(n, 1)
    return [c.op("Mul", [dy, c.op("Mul", [y, c.op("Sub", [c.const(1, _np(n)), y])])])]


@handler("ReluGrad")
def _relu_grad(c, n):  # (dy, x) -> dy where x > 0
    dy, x = c.x(n, 0), c.x(n, 1)
    return [c.op("Where", [c.op("Greater", [x, c.const(0, _np(n))]), dy, c.const(0, _np(n))])]


@handler("BiasAddGrad")
def _bias_add_grad(c, n):
    dy = c.x(n)
    if c.attr(n, "data_format", "NHWC") == "NCHW":
        flat = c.op("Reshape", [c.op("Einsum", [dy], equation="ij...->ji..."), c.i64(0, -1)])
        return [c.op("ReduceSum", [flat, c.i64(1)], keepdims=0)]
    flat = c.op("Reshape", [dy, c.op("Concat", [c.i64(-1), c.op("Shape", [dy], start=-1)],
                                     axis=0)])
    return [c.op("ReduceSum", [flat, c.i64(0)], keepdims=0)]
