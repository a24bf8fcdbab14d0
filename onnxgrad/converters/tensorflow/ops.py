"""One small handler per TensorFlow op (the table): structure, elementwise, reduction and shape
ops here, neural-network ops (conv, pool, batch norm, losses and their gradients) in
:mod:`.nn_ops`. ``c`` is the :class:`~.core.Converter`, ``n`` the node; a handler returns the ONNX
values of the node's outputs in TF's output order. An op without a handler is an error naming the
op and its node (:meth:`~.core.Converter.convert_node`), never a custom op.

TF keeps int32 shapes and indices; ONNX wants int64 for shapes, axes and repeats, so handlers
cast where ONNX needs it and otherwise keep TF's dtypes unchanged. Shape arithmetic on constants
(the shapes of frozen weights, fully known static shapes) is folded, so that ONNX shape
inference can read it.
"""
from __future__ import annotations

import re

import numpy as np
from onnx import TensorProto, helper

from . import control_flow, resources  # noqa: F401  (they register handlers)
from . import special, special_gamma
from .core import Converter, handler, onnx_dtype
from .errors import ConversionError
from .graph import TFNode, split_ref
from .proto import DT, dtype_info

I64 = TensorProto.INT64
BIG = np.iinfo(np.int64).max


# -- helpers -----------------------------------------------------------------------------------
def as_i64(c: Converter, v: str) -> str:
    """v as int64 (ONNX's type for shapes, axes, repeats); folded when v is a constant, so that
    ONNX shape inference can read it, and the int64 value an int32 shape was cast from (TF's
    shapes are int32, ONNX's int64: no round trip)."""
    k = c.consts.get(v)
    if k is not None:
        return c.const(k.astype(np.int64))
    return c.int64_of.get(v) or c.op("Cast", [v], to=I64)


def _vec64(c: Converter, n: TFNode, i: int) -> str:
    """Input i as a 1-D int64 tensor (axes given as a scalar or a vector)."""
    k = c.const_input(n, i)
    if k is not None:
        return c.const(np.asarray(k, np.int64).reshape(-1))
    s = static_shape(c, n.inputs[i])
    v = as_i64(c, c.x(n, i))
    return v if s is not None and len(s) == 1 else c.op("Reshape", [v, c.i64(-1)])


def _shape_arg(c: Converter, n: TFNode, i: int) -> str:
    """Input i, a shape vector, as int64; reshaped to its static length when computed, so that
    ONNX infers the rank of what it shapes (Reshape, Expand)."""
    v = as_i64(c, c.x(n, i))
    s = static_shape(c, n.inputs[i])
    if v in c.consts or v in c.popped or s is None or len(s) != 1 or s[0] is None:
        return v  # (a popped row of stacked shapes has its length already, see control_flow)
    return c.op("Reshape", [v, c.i64(s[0])])


def _const_axis(c: Converter, n: TFNode, i: int, what="axis") -> int:
    return int(c.const_input(n, i, required=what))


def np_type(n: TFNode, key: str = "T"):
    return dtype_info(n.attr[key].type).np


def is_float(n: TFNode, key: str = "T") -> bool:
    return np.issubdtype(np.dtype(np_type(n, key)), np.floating) or \
        dtype_info(n.attr[key].type).name in ("DT_HALF", "DT_BFLOAT16")


def scalar(c: Converter, n: TFNode, value, key: str = "T") -> str:
    """A scalar constant of the node's dtype ``key``."""
    return c.const(value, np_type(n, key))


def static_shape(c: Converter, ref: str):
    """TF's static shape of tensor ``ref`` (a list, None for unknown dims) or None: from the
    producer's ``_output_shapes`` (add_shapes=True) or from a constant's value."""
    v = c.value(ref)
    if isinstance(v, str) and v in c.consts:
        return list(c.consts[v].shape)
    name, k = split_ref(ref)
    shapes = c.attr(c.g.nodes[name], "_output_shapes")
    return shapes[k] if shapes and k < len(shapes) else None


def rank_of(c: Converter, n: TFNode, i: int, required: str | None = None):
    s = static_shape(c, n.inputs[i])
    if s is None and required:
        raise ConversionError(f"{n}: the rank of input {i} ({n.inputs[i]}) must be known "
                              f"statically ({required}; export with add_shapes=True)")
    return None if s is None else len(s)


def _fold(c: Converter, n: TFNode, fn, *idx):
    """fn(*numpy values of inputs idx) as a constant when all those inputs are constants (and
    none a weight: see reads_weight)."""
    vals = [c.const_input(n, i) for i in idx]
    if any(v is None for v in vals) or reads_weight(c, n, *idx):
        return None
    return c.const(np.asarray(fn(*vals)))


def reads_weight(c: Converter, n: TFNode, *idx) -> bool:
    """Whether one of inputs idx is a float Const of the graph (a frozen weight): a value made
    from it by folding would be a new constant, so its gradient would miss that use."""
    return any(c.x(n, i) in c.weight_values for i in idx if isinstance(c.x(n, i), str))


def _where(c: Converter, mask: np.ndarray, a, b):
    """Elementwise ``mask ? a : b`` over vectors that are numpy arrays or ONNX values."""
    if not mask.any():
        return b
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return np.where(mask, a, b)
    a, b = (c.const(v) if isinstance(v, np.ndarray) else v for v in (a, b))
    return c.op("Where", [c.const(mask), a, b])


# -- structure ---------------------------------------------------------------------------------
@handler("Const")
def _const(c, n):
    y = c.const(c.attr(n, "value"), name=n.name)
    if c.consts[y].dtype.kind not in "iubOSU":  # float: a weight (see reads_weight)
        c.weight_values.add(y)
    return [y]


class UnfrozenVariable:
    """The value of a resource placeholder: a variable TF could not freeze."""


UNFROZEN_VARIABLE = UnfrozenVariable()


@handler("Placeholder", "PlaceholderV2")
def _placeholder(c, n):
    if n.attr["dtype"].type == DT["DT_RESOURCE"]:
        # a variable TF could not freeze (a Keras layer's seed state): no ONNX value; a function
        # that reads it is refused where it is called (functions.call)
        return [UNFROZEN_VARIABLE]
    ref = f"{n.name}:0"
    shape = c.attr(n, "shape")
    c.reserve(ref)
    c.scope.inputs.append(helper.make_tensor_value_info(
        ref, onnx_dtype(n.attr["dtype"].type, n),
        None if shape is None else [d if d is not None else f"{n.name}_{k}"
                                    for k, d in enumerate(shape)]))
    return [ref]


@handler("ReadVariableOp")
def _read_variable(c, n):
    raise ConversionError(
        f"{n} reads a variable that TensorFlow could not freeze into a constant (the graph "
        "assigns it) and that an output depends on: ONNX has no variables; export a signature "
        "that does not update state")


@handler("StopGradient")
def _stop_gradient(c, n):
    """Identity, listed in the model's metadata (STOP_GRADIENTS_KEY) so that onnxgrad.gradients
    holds it constant, as tf.gradients does."""
    y = c.op("Identity", [c.x(n)])
    c.stop_gradients.append(y)
    return [y]


@handler("PreventGradient")
def _prevent_gradient(c, n):
    """Identity, listed with its message in the model's metadata (PREVENT_GRADIENTS_KEY): TF
    refuses to differentiate through it, so onnxgrad.gradients must too (not hold it constant,
    which would be a silently partial derivative)."""
    y = c.op("Identity", [c.x(n)])
    c.prevent_gradients[y] = c.attr(n, "message", "")
    return [y]


# the names TF gives identities of its own: tf.identity() unnamed, variable reads, functions'
# return values, Keras's internal copies
_OWN_IDENTITY = re.compile(r"(^|/)(Identity(_\d+)?|read|[^/]*_identity(_\d+)?)$")


@handler("PlaceholderWithDefault", "Identity", "Snapshot",
         "CheckNumerics", "EnsureShape", "RefIdentity", "DebugGradientIdentity")
def _identity(c, n):
    v = c.x(n)
    # a tensor named with tf.identity(name="feat") keeps that name (an ONNX Identity, which
    # onnxruntime removes), so that "feat:0" is an x, a y or a stop of gradients()
    if n.op == "Identity" and not n.ctx and c.scope is c.root and isinstance(v, str) and \
            v not in c.seq_of and v not in c.consts and not _OWN_IDENTITY.search(n.name) and \
            f"{n.name}:0" not in c.outputs:  # (an output gets its name anyway)
        return [c.op("Identity", [v])]
    return [v]


@handler("IdentityN")
def _identity_n(c, n):
    return [c.x(n, i) for i in range(len(n.inputs))]


@handler("Switch", "RefSwitch")  # a cond's Switch: both outputs are the data (the If picks)
def _switch(c, n):
    return [c.x(n), c.x(n)]


# (StringFormat: tf.print's message, which only PrintV2 reads; a string is no ONNX tensor here)
@handler("NoOp", "ControlTrigger", "Assert", "Print", "PrintV2", "StringFormat")
def _nothing(c, n):
    return []


# -- elementwise -------------------------------------------------------------------------------
SAME = {  # TF op -> ONNX op with the same inputs and numpy broadcasting
    "Add": "Add", "AddV2": "Add", "Sub": "Sub", "Mul": "Mul", "RealDiv": "Div",
    "Pow": "Pow", "Greater": "Greater", "Less": "Less",
    "GreaterEqual": "GreaterOrEqual", "LessEqual": "LessOrEqual", "Equal": "Equal",
    "LogicalAnd": "And", "LogicalOr": "Or", "LogicalNot": "Not",
    "Tanh": "Tanh", "Sigmoid": "Sigmoid", "Relu": "Relu", "Exp": "Exp", "Log": "Log",
    "Neg": "Neg", "Abs": "Abs", "Sqrt": "Sqrt", "Sin": "Sin", "Cos": "Cos",
    "Floor": "Floor", "Ceil": "Ceil", "Reciprocal": "Reciprocal", "Inv": "Reciprocal",
    "Sign": "Sign", "Softplus": "Softplus", "Softsign": "Softsign", "Elu": "Elu",
    "Rint": "Round", "Round": "Round", "IsNan": "IsNaN",
    "SelectV2": "Where", "MatrixDeterminant": "Det", "Einsum": "Einsum",
    "BitwiseAnd": "BitwiseAnd", "BitwiseOr": "BitwiseOr", "BitwiseXor": "BitwiseXor",
}


NP_FOLD = {"Add": np.add, "AddV2": np.add, "Sub": np.subtract, "Mul": np.multiply,
           "Maximum": np.maximum, "Minimum": np.minimum, "FloorMod": np.mod,
           "FloorDiv": np.floor_divide, "Neg": np.negative, "SelectV2": np.where}


def _fold_int(c, n):
    """Integer arithmetic on constants (shape and axis arithmetic) folds."""
    fn = NP_FOLD.get(n.op)
    if fn is None or "T" not in n.attr or is_float(n):
        return None
    return _fold(c, n, lambda *v: fn(*v).astype(v[-1].dtype), *range(len(n.inputs)))


def gemm_plus(c: Converter, n: TFNode, i: int, other: str):
    """``MatMul + other`` (input i of n the MatMul's result) as the Gemm's C, when ONNX's
    Gemm takes it: the product read by n alone, ``other`` of a static shape that broadcasts to
    the product's without growing it (a bias, a loop's gradient accumulator). One pass over the
    data instead of two (TF's per-step weight gradient sums: [in, out] every step). Else None."""
    ref = n.inputs[i]
    p = c.g.producer(ref)
    y = c.value(ref)
    if p.op != "MatMul" or c.g.uses(ref) != 1 or ref in c.outputs:
        return None
    gemm = next((nd for nd in reversed(c.scope.nodes) if y in nd.output), None)
    out, extra = static_shape(c, ref), static_shape(c, n.inputs[1 - i])
    if (gemm is None or gemm.op_type != "Gemm" or len(gemm.input) != 2 or out is None
            or extra is None or len(extra) > 2 or None in extra or None in out[-len(extra):]
            or any(e not in (1, o) for e, o in zip(extra[::-1], out[::-1]))):
        return None
    # the Gemm moves to here, after ``other``, which may be made after the product (x@W + x@V)
    c.scope.nodes.remove(gemm)
    gemm.input.append(other)
    c.scope.nodes.append(gemm)
    return y


def _same(c, n, onnx_op):
    y = _fold_int(c, n)
    if y is not None:
        return [y]
    if onnx_op == "Add" and len(n.inputs) == 2:
        for i in (0, 1):
            y = gemm_plus(c, n, i, c.x(n, 1 - i))
            if y is not None:
                return [y]
    ins = [c.x(n, i) for i in range(len(n.inputs))]
    attrs = {}
    if n.op == "Einsum":
        attrs["equation"] = c.attr(n, "equation")
        ins = _einsum_ellipses(c, n, attrs["equation"], ins)
    return [c.op(onnx_op, ins, **attrs)]


def _einsum_ellipses(c, n, equation, ins: list) -> list:
    """The operands with as many ellipsis dims each: numpy and TF broadcast a shorter one's
    from the right ("...ij,...jk" over [2, 7, 5, 3] and [1, 3, 4]), ONNX's Einsum wants them
    equal (onnx's inference refuses the model); a shorter operand gets leading size-1 dims
    where its ellipsis starts. Ranks must be known for that; else as written."""
    terms = equation.replace(" ", "").split("->")[0].split(",")
    ranks = [rank_of(c, n, i) for i in range(len(ins))]
    if "..." not in equation or len(terms) != len(ins) or None in ranks:
        return ins
    extra = [r - len(t.replace("...", "")) if "..." in t else None
             for t, r in zip(terms, ranks)]
    k = max((e for e in extra if e is not None), default=0)
    out = []
    for x, t, e in zip(ins, terms, extra):
        if e is not None and e < k:
            at = t.index("...")
            x = c.op("Unsqueeze", [x, c.i64(*range(at, at + k - e))])
        out.append(x)
    return out


for _tf, _onnx in SAME.items():
    handler(_tf)(lambda c, n, _o=_onnx: _same(c, n, _o))


@handler("Maximum", "Minimum")
def _max_min(c, n):
    """TF's gradient gives a tie to x (x >= y for Maximum, x <= y for Minimum), onnxgrad's Max
    and Min split it evenly (as PyTorch): a float one is the selection Where(x >= y or x is
    NaN, x, y), TF's forward (NaN from either side) and TF's gradient. A converted Keras
    ``Maximum`` merge of a ReLU's output and a BatchNormalization of it (0 and 0 where the
    ReLU is off) gave beta half of those positions' gradient, TF none (bench/fuzz_keras.py)."""
    if not is_float(n) or dtype_info(n.attr["T"].type).name == "DT_BFLOAT16":
        return _same(c, n, "Max" if n.op == "Maximum" else "Min")  # (IsNaN: no bfloat16 < 20)
    x, y = c.x(n, 0), c.x(n, 1)
    keep = c.op("GreaterOrEqual" if n.op == "Maximum" else "LessOrEqual", [x, y])
    return [c.op("Where", [c.op("Or", [keep, c.op("IsNaN", [x])]), x, y])]


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


@handler("LogicalXor")
def _xor(c, n):
    return [c.op("Xor", [c.x(n, 0), c.x(n, 1)])]


@handler("IsInf")
def _is_inf(c, n):
    return [c.op("IsInf", [c.x(n)])]


@handler("IsFinite")
def _is_finite(c, n):
    x = c.x(n)
    return [c.op("Not", [c.op("Or", [c.op("IsNaN", [x]), c.op("IsInf", [x])])])]


@handler("Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Erf")
def _special(c, n):
    """The ONNX op of the same name; float64, which onnxruntime's CPU has no kernel of these
    for, from ops it has (:mod:`.special`)."""
    if c.onnx_type(n) == TensorProto.DOUBLE:
        return [special.FLOAT64[n.op](c, n, c.x(n))]
    return [c.op(n.op, [c.x(n)])]


ERFC_TAIL = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
             -1.13520398, 1.48851587, -0.82215223, 0.17087277)


@handler("Erfc")
def _erfc(c, n):
    """1 - erf(x) below 0.5; above, where that difference loses its digits (erfc(5) = 1.5e-12),
    the Chebyshev fit t * exp(-x^2 + P(t)), t = 1 / (1 + x / 2) (Numerical Recipes' erfcc:
    relative error under 1.2e-7, its derivative's under 4e-7), on x moved to 0.5 where the head is
    taken, so that the branch not taken stays finite (a Max would split its tie at 0.5: half the
    gradient there). float64: fdlibm's erfc (:mod:`.special`), exact to ~1e-15."""
    if c.onnx_type(n) == TensorProto.DOUBLE:
        return [special.erfc(c, n, c.x(n))]
    x = c.x(n)
    head_taken = c.op("Less", [x, scalar(c, n, 0.5)])
    z = c.op("Where", [head_taken, scalar(c, n, 0.5), x])
    t = c.op("Reciprocal", [c.op("Add", [scalar(c, n, 1), c.op("Mul", [z, scalar(c, n, 0.5)])])])
    p = scalar(c, n, ERFC_TAIL[-1])
    for coef in reversed(ERFC_TAIL[:-1]):
        p = c.op("Add", [c.op("Mul", [p, t]), scalar(c, n, coef)])
    tail = c.op("Mul", [t, c.op("Exp", [c.op("Sub", [p, c.op("Mul", [z, z])])])])
    head = c.op("Sub", [scalar(c, n, 1), c.op("Erf", [x])])
    return [c.op("Where", [head_taken, head, tail])]


# A Where picks one branch, but the gradient flows into both (zero into the one not taken): a
# branch that is singular where it is not taken (a division by 0, a log of 0) turns that zero
# into NaN (0 * inf). So each branch is computed on inputs where it is finite ("double where"):
# the gradient is TF's, NaN-free, where TF's native op has one.
@handler("Log1p")
def _log1p(c, n):
    return [special.log1p(c, n, c.x(n))]


@handler("Expm1")
def _expm1(c, n):
    return [special.expm1(c, n, c.x(n))]


def _x_is_zero(c, n, f):
    """0 where x == 0, else f(x, y) on a y made 1 there (Xlogy, Xdivy: TF's gradient is 0 there,
    where log(y) or 1 / y may be infinite)."""
    x, y = c.x(n, 0), c.x(n, 1)
    zero = scalar(c, n, 0)
    at0 = c.op("Equal", [x, zero])
    return c.op("Where", [at0, zero, f(x, c.op("Where", [at0, scalar(c, n, 1), y]))])


def _y_is_zero(c, n, f):
    """0 where y == 0, else f(x, y) on an x made 0 and a y made 1 there (DivNoNan: TF's
    gradients are 0 there, where x / 0 would make them NaN)."""
    x, y = c.x(n, 0), c.x(n, 1)
    zero = scalar(c, n, 0)
    at0 = c.op("Equal", [y, zero])
    xs = c.op("Where", [at0, zero, x])
    return c.op("Where", [at0, zero, f(xs, c.op("Where", [at0, scalar(c, n, 1), y]))])


@handler("DivNoNan")
def _div_no_nan(c, n):  # (Keras's losses and metrics divide so)
    return [_y_is_zero(c, n, lambda x, y: c.op("Div", [x, y]))]


@handler("MulNoNan")
def _mul_no_nan(c, n):
    """x * y, 0 where y == 0 even for an infinite or NaN x: such an x is made 0 there, so that
    d/dy stays x (TF's gradient) wherever x is finite."""
    x, y = c.x(n, 0), c.x(n, 1)
    zero = scalar(c, n, 0)
    bad = c.op("And", [c.op("Equal", [y, zero]),
                       c.op("Or", [c.op("IsInf", [x]), c.op("IsNaN", [x])])])
    return [c.op("Mul", [c.op("Where", [bad, zero, x]), y])]


@handler("Xlogy")
def _xlogy(c, n):
    return [_x_is_zero(c, n, lambda x, y: c.op("Mul", [x, c.op("Log", [y])]))]


@handler("Xdivy")
def _xdivy(c, n):
    return [_x_is_zero(c, n, lambda x, y: c.op("Div", [x, y]))]


@handler("Atan2")
def _atan2(c, n):
    """C's atan2(y, x) (:func:`.special.atan2`)."""
    return [special.atan2(c, n, c.x(n, 0), c.x(n, 1))]


@handler(*special_gamma.UNARY)
def _gamma_family(c, n):
    """Lgamma, Digamma, Erfinv, Ndtri, BesselI0e, BesselI1e: computed in float64 from ops that
    onnxruntime's CPU has (:mod:`.special_gamma`)."""
    return [special_gamma.in_float64(c, n, special_gamma.UNARY[n.op], c.x(n))]


def _folded(c: Converter, ref: str):
    """The value of tensor ref when it is a constant, or arithmetic (NP_FOLD's ops) on constants
    (TF's gradient of Polygamma asks for polygamma(a + 1, x): a float Add, which the converter
    does not fold), else None."""
    k = c.consts.get(c.value(ref)) if isinstance(c.value(ref), str) else None
    p = c.g.nodes.get(split_ref(ref)[0])
    if k is not None or p is None or p.op not in (*NP_FOLD, "Identity"):
        return k
    args = [_folded(c, r) for r in p.inputs]
    if any(v is None for v in args):
        return None
    return args[0] if p.op == "Identity" else NP_FOLD[p.op](*args)


@handler("Polygamma")
def _polygamma(c, n):
    """polygamma(a, x) for an order a known at conversion time (one value, broadcast with x):
    digamma for a = 0, psi^(a) (:func:`.special_gamma.polygamma`) for an integer a >= 1, NaN
    (TF's) for any other a."""
    a = _folded(c, n.inputs[0])
    if a is None:
        raise ConversionError(f"{n}: the order a (input 0, {n.inputs[0]}) must be a constant, "
                              "or arithmetic on constants")
    values = np.unique(np.asarray(a, np.float64))
    if values.size != 1:
        raise ConversionError(f"{n}: the order a (input 0) must be one value, not {values}")
    x = c.x(n, 1)
    if np.ndim(a):  # (the output has a's shape too)
        x = c.op("Add", [x, c.const(np.zeros(np.shape(a)), np_type(n))])
    m = values[0]
    if not (m >= 0 and m == np.floor(m)):
        return [c.op("Mul", [x, scalar(c, n, np.nan)])]
    return [special_gamma.in_float64(
        c, n, lambda c, n, v: special_gamma.polygamma(c, n, v, int(m)), x)]


@handler("FloorDiv")
def _floordiv(c, n):
    y = _fold_int(c, n)
    if y is not None:
        return [y]
    q = c.op("Div", [c.x(n, 0), c.x(n, 1)])
    return [c.op("Floor", [q]) if is_float(n) else _floor_int(c, n, q)]


def _floor_int(c, n, q):
    # ONNX integer Div truncates; TF's FloorDiv rounds down: subtract 1 where signs differ and
    # the division is inexact
    a, b = c.x(n, 0), c.x(n, 1)
    inexact = c.op("Not", [c.op("Equal", [c.op("Mul", [q, b]), a])])
    zero = scalar(c, n, 0)
    neg = c.op("Xor", [c.op("Less", [a, zero]), c.op("Less", [b, zero])])
    fix = c.op("Cast", [c.op("And", [inexact, neg])], to=c.onnx_type(n))
    return c.op("Sub", [q, fix])


@handler("TruncateDiv")
def _truncate_div(c, n):
    q = c.op("Div", [c.x(n, 0), c.x(n, 1)])  # integer Div truncates already
    if not is_float(n):
        return [q]
    return [c.op("Mul", [c.op("Sign", [q]), c.op("Floor", [c.op("Abs", [q])])])]


@handler("Mod", "TruncateMod")
def _mod(c, n):  # C's fmod / %: the result takes the dividend's sign
    return [c.op("Mod", [c.x(n, 0), c.x(n, 1)], fmod=1)]


@handler("FloorMod")
def _floormod(c, n):
    y = _fold_int(c, n)
    if y is not None:
        return [y]
    a, b = c.x(n, 0), c.x(n, 1)
    if not is_float(n):
        return [c.op("Mod", [a, b], fmod=0)]  # integer Mod takes the divisor's sign, like TF
    m = c.op("Mod", [a, b], fmod=1)  # TF: fmod, plus b where it is nonzero and signs differ
    zero = scalar(c, n, 0)
    fix = c.op("And", [c.op("Not", [c.op("Equal", [m, zero])]),
                       c.op("Xor", [c.op("Less", [m, zero]), c.op("Less", [b, zero])])])
    return [c.op("Where", [fix, c.op("Add", [m, b]), m])]


@handler("ClipByValue")
def _clip(c, n):
    """x between its bounds, which may be tensors that broadcast; as selections, whose gradient
    is TF's (x's where lo <= x <= hi, the bounds' beyond them) where Max and Min would split a
    tie: half of the gradient for an x exactly at a bound (a ReLU's zeros clipped at 0)."""
    x, lo, hi = c.x(n, 0), c.x(n, 1), c.x(n, 2)
    inside = c.op("Where", [c.op("Greater", [x, hi]), hi, x])
    return [c.op("Where", [c.op("Less", [x, lo]), lo, inside])]


@handler("AddN")
def _add_n(c, n):
    xs = [c.x(n, i) for i in range(len(n.inputs))]
    return [xs[0] if len(xs) == 1 else c.op("Sum", xs)]


@handler("Cast")
def _cast(c, n):
    k = c.const_input(n, 0)
    if k is not None and k.dtype.kind in "iub" and k.size <= 64:
        return [c.const(k.astype(dtype_info(n.attr["DstT"].type).np))]
    return [c.op("Cast", [c.x(n)], to=onnx_dtype(n.attr["DstT"].type, n))]


@handler("Select")
def _select(c, n):
    cond, a = c.x(n, 0), c.x(n, 1)
    if c.g.producer(n.inputs[1]).op != "ZerosLike" and _is_zeros_like(c, n, 2):
        # (Select's gradient: where(c, g, zeros_like(x)); the zeros a broadcast scalar)
        return [c.op("Where", [_rows(c, n, cond), a, scalar(c, n, 0)])]
    if _is_zeros_like(c, n, 1) and c.g.producer(n.inputs[2]).op != "ZerosLike":
        return [c.op("Where", [_rows(c, n, cond), scalar(c, n, 0), c.x(n, 2)])]
    # TF1 Select with a vector condition picks whole rows: make it broadcast over the rest
    rc, ra = rank_of(c, n, 0), rank_of(c, n, 1)
    if rc is not None and ra is not None:
        return [c.op("Where", [_rows(c, n, cond), a, c.x(n, 2)])]
    a_shape = c.op("Shape", [a])
    pad = c.op("Sub", [c.op("Size", [a_shape]), c.op("Size", [c.op("Shape", [cond])])])
    ones = c.op("Expand", [c.i64(1), c.op("Reshape", [pad, c.i64(1)])])
    shape = c.op("Concat", [c.op("Shape", [cond]), ones], axis=0)
    y = c.op("Where", [c.op("Reshape", [cond, shape]), a, c.x(n, 2)])
    # the result has a's shape: a Reshape to it tells ONNX shape inference the rank
    return [c.op("Reshape", [y, a_shape])]


def _is_zeros_like(c, n, i) -> bool:
    """Input i is TF's ZerosLike of a tensor of the other branch's shape (then a broadcast
    scalar zero is the same Where)."""
    return (c.g.producer(n.inputs[i]).op == "ZerosLike" and rank_of(c, n, 0) is not None
            and rank_of(c, n, 3 - i) is not None)


def _rows(c, n, cond):
    """Select's condition made to broadcast over the rest when it picks rows (TF1: a vector
    condition), once per condition (a loop's gradient selects twice on each)."""
    rc, ra = rank_of(c, n, 0), rank_of(c, n, 1) or rank_of(c, n, 2)
    if rc is None or ra is None or rc == ra:
        return cond
    return c.memo(("rows", cond, rc, ra), lambda: c.op("Unsqueeze", [cond, c.i64(*range(rc, ra))]))


# -- linear algebra ----------------------------------------------------------------------------
@handler("MatrixDiag", "MatrixDiagV2", "MatrixDiagV3")
def _matrix_diag(c, n):
    """Matrices [..., R, C] with the vectors ``diagonal`` [..., m] on their main diagonal and
    padding_value elsewhere (tf.eye, tf.linalg.diag; R and C num_rows and num_cols, m where
    not given, as TF's kernel: a non-square one is diag_part's gradient in TF's graphs):
    Where(i == j) over Range(R) x Range(C), the diagonal padded to R. Other diagonals (k != 0)
    are refused."""
    x = c.x(n, 0)
    pad = scalar(c, n, 0)
    zero, one = c.const(0, np.int64), c.const(1, np.int64)
    m = c.op("Squeeze", [c.op("Shape", [x], start=-1)])
    size = {"rows": m, "cols": m}
    if n.op != "MatrixDiag":
        k = c.const_input(n, 1, required="the diagonal's offset k")
        if np.any(np.asarray(k) != 0):
            raise ConversionError(f"{n}: only the main diagonal (k = 0) is supported, not "
                                  f"k={np.asarray(k).tolist()}")
        for i, what in ((2, "rows"), (3, "cols")):
            v = int(c.const_input(n, i, required=f"num_{what}"))
            if v != -1:
                size[what] = c.const(v, np.int64)
        pad = c.x(n, 4)
    i = c.op("Range", [zero, size["rows"], one])
    j = c.op("Range", [zero, size["cols"], one])
    eye = c.op("Equal", [c.op("Unsqueeze", [i, c.i64(1)]), c.op("Unsqueeze", [j, c.i64(0)])])
    if size["rows"] is not m:
        x = _pad_last(c, x, c.op("Reshape", [c.op("Sub", [size["rows"], m]), c.i64(1)]))
    return [c.op("Where", [eye, c.op("Unsqueeze", [x, c.i64(-1)]), pad])]


def _pad_last(c, x, more):
    """x padded with ``more`` (int64 [1]) zeros at the end of its last axis (its rank read at
    run time: TF's graphs may not say it). Full-rank pads, never Pad's axes input, which
    onnxruntime's transpose optimizer misreads (see rules/shape.py _zero_pad)."""
    rank = c.op("Shape", [c.op("Shape", [x])])
    zeros = lambda k: c.op("ConstantOfShape", [k], value=helper.make_tensor(  # noqa: E731
        "zero", TensorProto.INT64, [1], [0]))
    return c.op("Pad", [x, c.op("Concat", [zeros(rank), zeros(c.op("Sub", [rank, c.i64(1)])),
                                           more], axis=0)])


def _row_col(c, x):
    """The row index [M, 1] and column index [1, N] of matrices x [..., M, N] (int64)."""
    zero, one = c.const(0, np.int64), c.const(1, np.int64)
    rows = c.op("Range", [zero, c.op("Squeeze", [c.op("Shape", [x], start=-2, end=-1)]), one])
    cols = c.op("Range", [zero, c.op("Squeeze", [c.op("Shape", [x], start=-1)]), one])
    return c.op("Unsqueeze", [rows, c.i64(1)]), c.op("Unsqueeze", [cols, c.i64(0)])


@handler("MatrixDiagPart", "MatrixDiagPartV2", "MatrixDiagPartV3")
def _matrix_diag_part(c, n):
    """The main diagonal x[..., i, i] (i < min(M, N)) of matrices x [..., M, N]: the sum of each
    row masked by i == j (MatrixDiag's gradient); other diagonals are refused."""
    x = c.x(n, 0)
    if n.op != "MatrixDiagPart":
        k = c.const_input(n, 1, required="the diagonal's offset k")
        if np.any(np.asarray(k) != 0):
            raise ConversionError(f"{n}: only the main diagonal (k = 0) is supported, not "
                                  f"k={np.asarray(k).tolist()}")
    rows, cols = _row_col(c, x)
    eye = c.op("Equal", [rows, cols])
    d = c.op("ReduceSum", [c.op("Where", [eye, x, scalar(c, n, 0)]), c.i64(-1)], keepdims=0)
    length = c.op("Min", [c.op("Shape", [x], start=-2, end=-1), c.op("Shape", [x], start=-1)])
    return [c.op("Slice", [d, c.i64(0), length, c.i64(-1)])]


@handler("MatrixSetDiag", "MatrixSetDiagV2", "MatrixSetDiagV3")
def _matrix_set_diag(c, n):
    """(x [..., M, N], diagonal [..., min(M, N)]) -> x with its main diagonal replaced
    (MatrixDiagPart's gradient in TF's graphs): Where(i == j) picks column j of the diagonal,
    padded with zeros to N. Other diagonals (k != 0) are refused."""
    if n.op != "MatrixSetDiag":
        k = c.const_input(n, 2, required="the diagonal's offset k")
        if np.any(np.asarray(k) != 0):
            raise ConversionError(f"{n}: only the main diagonal (k = 0) is supported, not "
                                  f"k={np.asarray(k).tolist()}")
    x, d = c.x(n, 0), c.x(n, 1)
    rows, cols = _row_col(c, x)
    missing = c.op("Sub", [c.op("Shape", [x], start=-1), c.op("Shape", [d], start=-1)])
    row = c.op("Unsqueeze", [_pad_last(c, d, missing), c.i64(-2)])   # [..., 1, N]
    return [c.op("Where", [c.op("Equal", [rows, cols]), row, x])]


@handler("MatrixBandPart")
def _matrix_band_part(c, n):
    """(x, num_lower, num_upper): x[..., i, j] where (num_lower < 0 or i - j <= num_lower) and
    (num_upper < 0 or j - i <= num_upper), else 0 (a causal attention mask: (ones, -1, 0))."""
    y = _fold(c, n, _band_np, 0, 1, 2)
    if y is not None:
        return [y]
    x = c.x(n, 0)
    zero = c.const(0, np.int64)
    rows, cols = _row_col(c, x)
    d = c.op("Sub", [cols, rows])
    keep = None
    for i, dist in ((1, c.op("Neg", [d])), (2, d)):  # i - j against num_lower, j - i num_upper
        bound = c.const_input(n, i)
        if bound is not None and int(bound) < 0:
            continue
        b = as_i64(c, c.x(n, i))
        ok = c.op("LessOrEqual", [dist, b])
        if bound is None:
            ok = c.op("Or", [c.op("Less", [b, zero]), ok])
        keep = ok if keep is None else c.op("And", [keep, ok])
    if keep is None:
        return [x]
    if np_type(n) == np.bool_:
        return [c.op("And", [keep, x])]
    return [c.op("Where", [keep, x, scalar(c, n, 0)])]


def _band_np(x, lower, upper):
    i, j = np.indices(x.shape[-2:])
    keep = ((lower < 0) | (i - j <= lower)) & ((upper < 0) | (j - i <= upper))
    return np.where(keep, x, np.zeros((), x.dtype))


@handler("MatMul")
def _matmul(c, n):
    a, b = c.x(n, 0), c.x(n, 1)
    ta, tb = c.attr(n, "transpose_a", False), c.attr(n, "transpose_b", False)
    if np_type(n) in (np.float32, np.float64):  # Gemm: 2-D, float (what ORT's CPU Gemm takes)
        return [c.op("Gemm", [a, b], transA=int(ta), transB=int(tb))]
    a = c.op("Transpose", [a], perm=[1, 0]) if ta else a
    b = c.op("Transpose", [b], perm=[1, 0]) if tb else b
    return [c.op("MatMul", [a, b])]


def _swap_last(c, n, i):
    r = rank_of(c, n, i)
    if r is None:
        return c.op("Einsum", [c.x(n, i)], equation="...ij->...ji")
    return c.op("Transpose", [c.x(n, i)], perm=[*range(r - 2), r - 1, r - 2])


@handler("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
def _batch_matmul(c, n):
    a = _swap_last(c, n, 0) if c.attr(n, "adj_x", False) else c.x(n, 0)
    b = _swap_last(c, n, 1) if c.attr(n, "adj_y", False) else c.x(n, 1)
    y = c.op("MatMul", [a, b])
    if n.op == "BatchMatMulV3" and n.attr["Tout"].type != n.attr["Ta"].type:
        y = c.op("Cast", [y], to=c.onnx_type(n, "Tout"))
    return [y]


# -- reductions --------------------------------------------------------------------------------
REDUCE = {"Sum": "ReduceSum", "Mean": "ReduceMean", "Max": "ReduceMax", "Min": "ReduceMin",
          "Prod": "ReduceProd", "All": "ReduceMin", "Any": "ReduceMax",
          "EuclideanNorm": "ReduceL2"}
NP_REDUCE = {"Sum": np.sum, "Prod": np.prod, "Max": np.max, "Min": np.min}


def _reduce(c, n, onnx_op):
    keep = int(c.attr(n, "keep_dims", False))
    shape = c.bga_shapes.get(c.x(n, 1)) if n.op == "Sum" else None
    if shape is not None and c.no_broadcast:  # summed over no axis: the gradient itself,
        c.bga_shapes[c.x(n, 0)] = shape  # which has the shape it is reshaped to (_reshape)
        return [c.x(n, 0)]
    if n.op in NP_REDUCE and not is_float(n):  # shape arithmetic (Prod of a shape) folds
        y = _fold(c, n, lambda x, a: NP_REDUCE[n.op](x, axis=tuple(np.reshape(a, -1)),
                                                     keepdims=bool(keep)).astype(x.dtype), 0, 1)
        if y is not None:
            return [y]
    x = c.x(n, 0)
    boolean = n.op in ("All", "Any")
    if boolean:
        x = c.op("Cast", [x], to=TensorProto.INT32)
    if _reduces_all(c, n):  # no axes: ONNX then knows the result's rank
        y = c.op(onnx_op, [x], keepdims=keep)
    else:
        # TF reduces nothing over an empty axes vector (tf.gradients' BroadcastGradientArgs);
        # constant axes counted from the front where the rank is known: onnxruntime 1.31
        # ignores a negative axis of an empty input (a batch of 0 kept the reduced axis)
        axes, k, r = _vec64(c, n, 1), c.const_input(n, 1), rank_of(c, n, 0)
        if k is not None and r is not None and (np.asarray(k) < 0).any():
            axes = c.const(np.asarray(k, np.int64).reshape(-1) % r)
        y = c.op(onnx_op, [x, axes], keepdims=keep, noop_with_empty_axes=1)
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
    y = c.op(n.op, [c.x(n, 0)], axis=axis, keepdims=0, select_last_index=0)
    out = onnx_dtype(n.attr["output_type"].type, n) if "output_type" in n.attr else I64
    return [y if out == I64 else c.op("Cast", [y], to=out)]


@handler("Cumsum")
def _cumsum(c, n):
    return [c.op("CumSum", [c.x(n, 0), c.x(n, 1)], exclusive=int(c.attr(n, "exclusive", False)),
                 reverse=int(c.attr(n, "reverse", False)))]


@handler("Cumprod")
def _cumprod(c, n):
    """No ONNX op: y[i] = prod over j of (x[j] where j <= i (or <, >=, >) else 1), with i and j
    on two axes (O(L^2) for an axis of length L)."""
    r = rank_of(c, n, 0, required="Cumprod")
    a = _const_axis(c, n, 1) % r
    x = c.x(n, 0)
    length = c.op("Gather", [c.op("Shape", [x]), c.const(a, np.int64)])  # (Range: a scalar)
    iota = c.op("Range", [c.const(0, np.int64), length, c.const(1, np.int64)])
    i, j = c.op("Unsqueeze", [iota, c.i64(1)]), c.op("Unsqueeze", [iota, c.i64(0)])
    rev, excl = c.attr(n, "reverse", False), c.attr(n, "exclusive", False)
    cmp = {(0, 0): "LessOrEqual", (0, 1): "Less", (1, 0): "GreaterOrEqual", (1, 1): "Greater"}
    mask = c.op(cmp[int(rev), int(excl)], [j, i])
    if r - a - 1:
        mask = c.op("Unsqueeze", [mask, c.i64(*range(2, r - a + 1))])
    pairs = c.op("Where", [mask, c.op("Unsqueeze", [x, c.i64(a)]), scalar(c, n, 1)])
    return [c.op("ReduceProd", [pairs, c.i64(a + 1)], keepdims=0)]


@handler("CumulativeLogsumexp")
def _cumulative_logsumexp(c, n):
    """y[i] = log(sum over j of exp(x[j]) for j <= i (or <, >=, >)), with i and j on two axes
    (O(L^2) for an axis of length L, as Cumprod): m[i], the largest x[j] taken (a constant to
    the gradient: y does not depend on it), is subtracted before the exps and added back, so that
    neither 1000 overflows nor -1000 underflows; an infinite m is taken as 0 (a sum of no terms
    or of -inf ones is -inf, one with +inf is +inf, as TF's)."""
    r = rank_of(c, n, 0, required="CumulativeLogsumexp")
    a = _const_axis(c, n, 1) % r
    x = c.x(n, 0)
    length = c.op("Gather", [c.op("Shape", [x]), c.const(a, np.int64)])
    iota = c.op("Range", [c.const(0, np.int64), length, c.const(1, np.int64)])
    i, j = c.op("Unsqueeze", [iota, c.i64(1)]), c.op("Unsqueeze", [iota, c.i64(0)])
    rev, excl = c.attr(n, "reverse", False), c.attr(n, "exclusive", False)
    cmp = {(0, 0): "LessOrEqual", (0, 1): "Less", (1, 0): "GreaterOrEqual", (1, 1): "Greater"}
    mask = c.op(cmp[int(rev), int(excl)], [j, i])  # [i, j]: x[j] is in y[i]
    if r - a - 1:
        mask = c.op("Unsqueeze", [mask, c.i64(*range(2, r - a + 1))])
    xj = c.op("Unsqueeze", [x, c.i64(a)])  # [..., 1, L, ...]: j on axis a + 1
    neg_inf = scalar(c, n, -np.inf)
    m = c.op("ReduceMax", [c.op("Where", [mask, xj, neg_inf]), c.i64(a + 1)], keepdims=1)
    m = c.op("Identity", [m])
    c.stop_gradients.append(m)
    m = c.op("Where", [c.op("IsInf", [m]), scalar(c, n, 0), m])
    terms = c.op("Exp", [c.op("Where", [mask, c.op("Sub", [xj, m]), neg_inf])])
    total = c.op("ReduceSum", [terms, c.i64(a + 1)], keepdims=0)
    return [c.op("Add", [c.op("Log", [total]), c.op("Squeeze", [m, c.i64(a + 1)])])]


@handler("TopKV2")
def _top_k(c, n):
    k = c.op("Reshape", [as_i64(c, c.x(n, 1)), c.i64(1)])
    v, i = c.op("TopK", [c.x(n, 0), k], n_out=2, axis=-1, largest=1, sorted=1)
    return [v, c.op("Cast", [i], to=c.onnx_type(n, "index_type") if "index_type" in n.attr
                    else TensorProto.INT32)]


# -- shapes ------------------------------------------------------------------------------------
def _out_type(c, n, v, key="out_type"):
    """An int64 shape value v in the node's output type (TF's default int32)."""
    t = onnx_dtype(n.attr[key].type, n) if key in n.attr else TensorProto.INT32
    if t == I64:
        return v
    out = c.op("Cast", [v], to=t)
    c.int64_of[out] = v
    return out


def _shape_of(c, n, i):
    """Shape of input i; a constant when TF knows it fully (a frozen weight's, a placeholder's
    without None dims): TF checks fed and computed tensors against their static shapes."""
    s = static_shape(c, n.inputs[i])
    if s is not None and None not in s:
        t = np_type(n, "out_type") if "out_type" in n.attr else np.int32
        return c.const(np.array(s, t))
    return _out_type(c, n, c.op("Shape", [c.x(n, i)]))


@handler("Shape")
def _shape(c, n):
    return [_shape_of(c, n, 0)]


@handler("ShapeN")
def _shape_n(c, n):
    return [_shape_of(c, n, i) for i in range(len(n.inputs))]


@handler("Size")
def _size(c, n):
    return [_out_type(c, n, c.op("Size", [c.x(n)]))]


@handler("Rank")
def _rank_op(c, n):
    r = rank_of(c, n, 0)
    if r is not None:
        return [c.const(r, np.int32)]
    return [c.op("Cast", [c.op("Size", [c.op("Shape", [c.x(n)])])], to=TensorProto.INT32)]


@handler("Reshape")
def _reshape(c, n):
    shape = _shape_arg(c, n, 1)
    if c.no_broadcast and c.bga_shapes.get(c.x(n, 0)) == shape:  # (see _reduce)
        return [c.x(n, 0)]
    return [c.op("Reshape", [c.x(n, 0), shape])]


@handler("Squeeze")
def _squeeze(c, n):
    dims = c.attr(n, "squeeze_dims", [])
    return [c.op("Squeeze", [c.x(n)] + ([c.i64(*dims)] if dims else []))]


@handler("ExpandDims")
def _expand_dims(c, n):
    return [c.op("Unsqueeze", [c.x(n, 0), _vec64(c, n, 1)])]


@handler("Transpose", "ConjugateTranspose")
def _transpose(c, n):
    perm = c.const_input(n, 1)
    if perm is not None:
        return [c.op("Transpose", [c.x(n, 0)], perm=[int(p) for p in perm])]
    return [_transpose_dynamic(c, n)]


def _transpose_dynamic(c, n):
    """y[i] = x[i[inv(perm)]]: GatherND over the grid of output indices (rank must be known)."""
    r = rank_of(c, n, 0, required="Transpose with a computed permutation")
    x, perm = c.x(n, 0), as_i64(c, c.x(n, 1))
    out_shape = c.op("Gather", [c.op("Shape", [x]), perm])
    zero, one = c.const(0, np.int64), c.const(1, np.int64)
    grids = []
    for k in range(r):  # index along output axis k, broadcast to the output shape
        idx = c.op("Range", [zero, c.op("Gather", [out_shape, c.const(k, np.int64)]), one])
        shape = [1] * r
        shape[k] = -1
        grids.append(c.op("Expand", [c.op("Reshape", [idx, c.i64(*shape)]), out_shape]))
    grid = c.op("Concat", [c.op("Unsqueeze", [g, c.i64(-1)]) for g in grids], axis=-1)
    inv = c.op("ScatterElements", [c.i64(*[0] * r), perm, c.i64(*range(r))])
    return c.op("GatherND", [x, c.op("Gather", [grid, inv], axis=-1)])


@handler("InvertPermutation")
def _invert_permutation(c, n):
    y = _fold(c, n, lambda p: np.argsort(p).astype(p.dtype), 0)
    if y is not None:
        return [y]
    p = c.x(n)
    r = c.op("Range", [c.const(0, np_type(n)), c.op("Cast", [c.op("Size", [p])], to=c.onnx_type(n)),
                       c.const(1, np_type(n))])
    return [c.op("ScatterElements", [r, as_i64(c, p), r])]


@handler("ConcatV2")
def _concat(c, n):
    k = len(n.inputs) - 1
    y = _fold(c, n, lambda *v: np.concatenate(v[:-1], axis=int(v[-1])), *range(k + 1))
    return [y or c.op("Concat", [c.x(n, i) for i in range(k)], axis=_const_axis(c, n, k))]


@handler("Concat")
def _concat_v1(c, n):
    return [c.op("Concat", [c.x(n, i) for i in range(1, len(n.inputs))],
                 axis=_const_axis(c, n, 0))]


@handler("ConcatOffset")
def _concat_offset(c, n):
    """(axis, shape_0..shape_k-1) -> the offset of each input in the concatenation: zeros but
    the sum of the earlier inputs' sizes along the axis. Constant when the axis and the inputs'
    sizes along it are known statically (the other dims do not matter)."""
    k = len(n.inputs) - 1
    axis = c.const_input(n, 0)
    known = [shape_value(c, ref) for ref in n.inputs[1:]]
    if axis is not None and all(v is not None for v in known):
        a = int(axis) % len(known[0])
        if all(len(v) == len(known[0]) and v[a] is not None for v in known):
            offs = np.cumsum([0] + [v[a] for v in known[:-1]])
            dt = np_type(n, "shape_type") if "shape_type" in n.attr else np.int32
            return [c.const(np.where(np.arange(len(v)) == a, o, 0).astype(dt))
                    for v, o in zip(known, offs)]
    axis, shapes = c.x(n, 0), [c.x(n, i) for i in range(1, k + 1)]
    t = c.onnx_type(n, "shape_type") if "shape_type" in n.attr else TensorProto.INT32
    iota = c.op("Range", [c.const(0, np.int32), c.op("Cast", [c.op("Size", [shapes[0]])],
                                                     to=TensorProto.INT32), c.const(1, np.int32)])
    at_axis = c.op("Cast", [c.op("Equal", [iota, axis])], to=t)  # one-hot of the axis
    outs, total = [], None
    for s in shapes:
        outs.append(c.op("Mul", [at_axis, total]) if total else c.op("Sub", [at_axis, at_axis]))
        size = c.op("Cast", [c.op("Gather", [s, axis])], to=t)
        total = size if total is None else c.op("Add", [total, size])
    return outs


@handler("Pack")
def _pack(c, n):
    axis = c.attr(n, "axis", 0)
    k = len(n.inputs)
    y = _fold(c, n, lambda *v: np.stack(v, axis=axis), *range(k))
    if y is not None:
        return [y]
    ax = c.i64(axis)
    return [c.op("Concat", [c.op("Unsqueeze", [c.x(n, i), ax]) for i in range(k)], axis=axis)]


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
    if num == 1:
        return [c.x(n, 0)]
    sizes = c.const_input(n, 1)
    if sizes is not None and (sizes < 0).any():  # one -1: the rest of the axis
        s = static_shape(c, n.inputs[0])
        if s is None or s[axis] is None:
            sizes = None
        else:
            sizes = np.where(sizes < 0, s[axis] - sizes[sizes >= 0].sum(), sizes)
    if sizes is None and c.const_input(n, 1) is not None:
        raise ConversionError(f"{n}: size_splits with -1 needs the axis' size known statically")
    split = c.const(sizes.astype(np.int64)) if sizes is not None else as_i64(c, c.x(n, 1))
    return c.op("Split", [c.x(n, 0), split], n_out=num, axis=axis)


@handler("ListDiff")
def _list_diff(c, n):
    """(x, y) -> (the values of x not in y, in order; their positions in x)."""
    k = c.const_input(n, 0), c.const_input(n, 1)
    if k[0] is not None and k[1] is not None:
        keep = ~np.isin(k[0], k[1])
        return [c.const(k[0][keep]), c.const(np.flatnonzero(keep).astype(np_type(n, "out_idx")))]
    x, y = c.x(n, 0), c.x(n, 1)
    hit = c.op("Cast", [c.op("Equal", [c.op("Unsqueeze", [x, c.i64(1)]),
                                       c.op("Unsqueeze", [y, c.i64(0)])])], to=TensorProto.INT32)
    keep = c.op("Not", [c.op("Cast", [c.op("ReduceMax", [hit, c.i64(1)], keepdims=0)],
                             to=TensorProto.BOOL)])
    pos = c.op("Range", [c.const(0, np_type(n, "out_idx")), c.op("Cast", [c.op("Size", [x])],
                         to=c.onnx_type(n, "out_idx")), c.const(1, np_type(n, "out_idx"))])
    return [c.op("Compress", [x, keep], axis=0), c.op("Compress", [pos, keep], axis=0)]


@handler("Fill")
def _fill(c, n):
    # a small fill of constants is one (tf.signal.frame's strides: ones_like of a constant,
    # which StridedSlice needs as a constant)
    shape = c.const_input(n, 0)
    if shape is not None and np.prod(np.reshape(shape, -1)) <= 4096:
        y = _fold(c, n, lambda s, v: np.full(np.reshape(s, -1).astype(np.int64), v, v.dtype),
                  0, 1)
        if y is not None:
            return [y]
    return [c.op("Expand", [c.x(n, 1), _shape_arg(c, n, 0)])]


@handler("BroadcastArgs")
def _broadcast_args(c, n):
    """The broadcast of two constant shapes (tf.linspace makes one of its arguments')."""
    a, b = (c.const_input(n, i, required="the shapes BroadcastArgs broadcasts") for i in (0, 1))
    return [c.const(np.asarray(np.broadcast_shapes(tuple(np.reshape(a, -1)),
                                                   tuple(np.reshape(b, -1))), a.dtype))]


@handler("BroadcastTo")
def _broadcast_to(c, n):
    return [c.op("Expand", [c.x(n, 0), _shape_arg(c, n, 1)])]


@handler("ZerosLike", "OnesLike")
def _zeros_like(c, n):
    v = c.const(0 if n.op == "ZerosLike" else 1, np_type(n))
    return [c.op("Expand", [v, c.op("Shape", [c.x(n)])])]


@handler("Range")
def _range(c, n):
    y = None if is_float(n, "Tidx") else _fold(
        c, n, lambda a, b, d: np.arange(a, b, d).astype(np.result_type(a, b, d)), 0, 1, 2)
    return [y or c.op("Range", [c.x(n, 0), c.x(n, 1), c.x(n, 2)])]


@handler("Tile")
def _tile(c, n):
    return [c.op("Tile", [c.x(n, 0), as_i64(c, c.x(n, 1))])]


@handler("Pad", "PadV2", "MirrorPad")
def _pad(c, n):
    mode = c.attr(n, "mode", "CONSTANT").lower()
    if mode == "symmetric":
        return [_pad_symmetric(c, n)]
    p = c.const_input(n, 1)
    pads = c.const(p.T.reshape(-1).astype(np.int64)) if p is not None else c.op(
        "Reshape", [c.op("Transpose", [as_i64(c, c.x(n, 1))], perm=[1, 0]), c.i64(-1)])
    value = [c.x(n, 2)] if n.op == "PadV2" else []
    return [c.op("Pad", [c.x(n, 0), pads] + value, mode=mode)]


def _pad_symmetric(c, n):
    """MirrorPad SYMMETRIC (the edge repeated): concatenate reversed slices per axis."""
    y = c.x(n, 0)
    for axis, (lo, hi) in enumerate(c.const_input(n, 1, required="SYMMETRIC paddings")):
        lo, hi = int(lo), int(hi)
        parts = [_flip_slice(c, y, axis, lo - 1, -BIG)] if lo else []
        parts.append(y)
        parts += [_flip_slice(c, y, axis, -1, -hi - 1)] if hi else []
        y = c.op("Concat", parts, axis=axis) if len(parts) > 1 else y
    return y


@handler("MirrorPadGrad")
def _mirror_pad_grad(c, n):
    """(dy, paddings) -> dx of MirrorPad: per axis with pads (lo, hi) around x's L elements,
    the middle of dy plus its borders reversed and added where they were read: REFLECT's left
    border onto x[1 : lo + 1], its right onto x[L - 1 - hi : L - 1]; SYMMETRIC's onto
    x[0 : lo] and x[L - hi : L]. L is known at run time only (full-rank pads: see
    rules/shape.py _zero_pad on Pad's axes input)."""
    reflect = c.attr(n, "mode", "REFLECT").upper() == "REFLECT"
    pads = c.const_input(n, 1, required="MirrorPadGrad's paddings")
    r = len(pads)
    t = c.x(n, 0)
    for a, (lo, hi) in enumerate(pads):
        lo, hi = int(lo), int(hi)
        if not lo and not hi:
            continue
        size = c.op("Sub", [c.op("Gather", [c.op("Shape", [t]), c.i64(a)]), c.i64(lo + hi)])
        parts = [c.op("Slice", [t, c.i64(lo), c.i64(-hi if hi else BIG), c.i64(a)])]
        shift = 1 if reflect else 0
        if lo:  # reversed, onto x[shift : shift + lo]
            after = c.op("Sub", [size, c.i64(lo + shift)])
            parts.append(_pad_axis(c, _flip_slice(c, t, a, lo - 1, -BIG), a, r,
                                   c.i64(shift), after))
        if hi:  # reversed, onto x[L - shift - hi : L - shift]
            before = c.op("Sub", [size, c.i64(hi + shift)])
            parts.append(_pad_axis(c, _flip_slice(c, t, a, -1, -hi - 1), a, r, before,
                                   c.i64(shift)))
        t = parts[0]
        for p in parts[1:]:
            t = c.op("Add", [t, p])
    return [t]


def _pad_axis(c, x, axis, rank, before, after):
    """x padded with zeros by ``before`` / ``after`` (int64 [1]) on ``axis`` of ``rank``."""
    zeros = lambda k: [c.i64(*[0] * k)] if k else []  # noqa: E731
    pads = c.op("Concat", [*zeros(axis), before, *zeros(rank - 1),
                           after, *zeros(rank - 1 - axis)], axis=0)
    return c.op("Pad", [x, pads])


def _flip_slice(c, x, axis, start, end):
    return c.op("Slice", [x, c.i64(start), c.i64(end), c.i64(axis), c.i64(-1)])


@handler("ReverseV2")
def _reverse_v2(c, n):
    axes = c.const_input(n, 1, required="the axes to reverse")
    return [_reverse(c, c.x(n), [int(a) for a in np.reshape(axes, -1)])]


@handler("Reverse")
def _reverse_v1(c, n):
    dims = c.const_input(n, 1, required="the dims to reverse")
    return [_reverse(c, c.x(n), [i for i, d in enumerate(dims) if d])]


@handler("ReverseSequence")
def _reverse_sequence(c, n):
    """ONNX's ReverseSequence takes batch and time axes 0 and 1 only: others are transposed
    there and back (TF1's bidirectional_dynamic_rnn with sequence_length writes seq_dim 1,
    batch_dim 0)."""
    seq, batch = int(c.attr(n, "seq_dim")), int(c.attr(n, "batch_dim", 0))
    x, lens = c.x(n), c.op("Cast", [c.x(n, 1)], to=TensorProto.INT64)
    if {seq, batch} != {0, 1}:
        r = rank_of(c, n, 0, required="ReverseSequence on axes other than 0 and 1")
        seq, batch = seq % r, batch % r
        perm = [batch, seq] + [a for a in range(r) if a not in (batch, seq)]
        back = [perm.index(a) for a in range(r)]
        moved = c.op("Transpose", [x], perm=perm)
        rev = c.op("ReverseSequence", [moved, lens], batch_axis=0, time_axis=1)
        return [c.op("Transpose", [rev], perm=back)]
    return [c.op("ReverseSequence", [x, lens], batch_axis=batch, time_axis=seq)]


def _reverse(c, x, axes):
    if not axes:
        return x
    k = len(axes)
    return c.op("Slice", [x, c.i64(*[-1] * k), c.i64(*[-BIG] * k), c.i64(*axes), c.i64(*[-1] * k)])


@handler("Roll")
def _roll(c, n):
    """tf.roll along constant axes (an axis named twice rolls by the sum of its shifts): the
    last s = shift mod n elements moved in front, Concat(x[n - s:], x[:n - s]), s computed at
    run time (the shift may be a tensor; integer Mod takes the divisor's sign, so s lies in
    [0, n); an empty axis divides by 1 instead)."""
    axes = [int(a) for a in np.reshape(c.const_input(n, 2, required="the axes to roll"), -1)]
    x = c.x(n)
    shifts = c.op("Reshape", [c.op("Cast", [c.x(n, 1)], to=TensorProto.INT64), c.i64(-1)])
    shape = c.op("Shape", [x])
    for a in dict.fromkeys(axes):
        picks = [i for i, b in enumerate(axes) if b == a]
        total = c.op("ReduceSum", [c.op("Gather", [shifts, c.i64(*picks)]), c.i64(0)],
                     keepdims=1)
        size = c.op("Gather", [shape, c.i64(a)])
        cut = c.op("Sub", [size, c.op("Mod", [total, c.op("Max", [size, c.i64(1)])])])
        tail = c.op("Slice", [x, cut, c.i64(BIG), c.i64(a)])
        head = c.op("Slice", [x, c.i64(0), cut, c.i64(a)])
        x = c.op("Concat", [tail, head], axis=a)
    return [x]


# -- gathers and scatters ----------------------------------------------------------------------
@handler("GatherV2")
def _gather(c, n):
    axis = _const_axis(c, n, 2)
    if c.attr(n, "batch_dims", 0):
        return [_batch_gather(c, n, c.x(n, 0), axis, c.attr(n, "batch_dims"))]
    y = _fold(c, n, lambda p, i, a: np.take(p, i, axis=int(a)), 0, 1, 2)
    return [y or c.op("Gather", [c.x(n, 0), c.x(n, 1)], axis=axis)]


def _batch_gather(c, n, params, axis: int, batch_dims: int):
    """tf.gather(params, indices, axis, batch_dims): y[b.., p.., i.., r..] =
    params[b.., p.., indices[b.., i..], r..], the b the first batch_dims axes of both, p the axes
    of params between them and ``axis``. GatherND with batch_dims on params with ``axis`` moved
    right after the batch axes, and the p axes moved back in front of the i axes. A negative
    batch_dims counts from the end of indices' axes, a negative axis from params' (TF's kernel);
    indices must lie in [0, params.shape[axis]) (TF's CPU kernel raises otherwise)."""
    ri = rank_of(c, n, 1)
    if batch_dims < 0:
        ri = rank_of(c, n, 1, required=f"a negative batch_dims ({batch_dims})")
        batch_dims += ri
    rp = rank_of(c, n, 0)
    if axis < 0 or axis > batch_dims:
        rp = rank_of(c, n, 0, required=f"gather axis {axis} with batch_dims {batch_dims}")
        axis += rp if axis < 0 else 0
    if ri is not None and not 0 <= batch_dims <= ri or rp is not None and not (
            batch_dims <= axis < rp) or axis < batch_dims:
        raise ConversionError(f"{n}: batch_dims {c.attr(n, 'batch_dims')} and axis "
                              f"{_const_axis(c, n, 2)} do not fit params of rank {rp} and "
                              f"indices of rank {ri} (TF needs 0 <= batch_dims <= rank(indices) "
                              "and batch_dims <= axis < rank(params))")
    if batch_dims == 0:
        return c.op("Gather", [params, c.x(n, 1)], axis=axis)
    between = axis - batch_dims  # the p axes
    if between:
        perm = [*range(batch_dims), axis, *range(batch_dims, axis), *range(axis + 1, rp)]
        params = c.op("Transpose", [params], perm=perm)
    idx = c.op("Unsqueeze", [as_i64(c, c.x(n, 1)), c.i64(-1)])
    y = c.op("GatherND", [params, idx], batch_dims=batch_dims)
    if not between:
        return y
    ri = rank_of(c, n, 1, required=f"gather axis {axis} after batch_dims {batch_dims}")
    k = ri - batch_dims  # the i axes, now right after the batch axes, then the p axes
    b = list(range(batch_dims))
    perm = [*b, *range(batch_dims + k, axis + k), *range(batch_dims, batch_dims + k),
            *range(axis + k, rp - 1 + k)]
    return c.op("Transpose", [y], perm=perm)


@handler("Gather")
def _gather_v1(c, n):
    return [c.op("Gather", [c.x(n, 0), c.x(n, 1)], axis=0)]


@handler("GatherNd")
def _gather_nd(c, n):
    return [c.op("GatherND", [c.x(n, 0), as_i64(c, c.x(n, 1))])]


@handler("ScatterNd")
def _scatter_nd(c, n):  # (indices, updates, shape): duplicates add up
    zeros = c.zeros(_shape_arg(c, n, 2), np_type(n))
    return [c.op("ScatterND", [zeros, as_i64(c, c.x(n, 0)), c.x(n, 1)], reduction="add")]


TENSOR_SCATTER = {"TensorScatterUpdate": "none", "TensorScatterAdd": "add",
                  "TensorScatterSub": "add", "TensorScatterMax": "max", "TensorScatterMin": "min"}


@handler(*TENSOR_SCATTER)
def _tensor_scatter(c, n):
    upd = c.op("Neg", [c.x(n, 2)]) if n.op == "TensorScatterSub" else c.x(n, 2)
    return [c.op("ScatterND", [c.x(n, 0), as_i64(c, c.x(n, 1)), upd],
                 reduction=TENSOR_SCATTER[n.op])]


SEGMENT = {"UnsortedSegmentSum": "add", "UnsortedSegmentProd": "mul",
           "UnsortedSegmentMax": "max", "UnsortedSegmentMin": "min"}


def _identity(red: str, dt: np.dtype):
    """The identity of ScatterND's reduction ``red`` in dtype dt (0, 1, its lowest, highest)."""
    if red in ("add", "mul"):
        return int(red == "mul")
    info = np.finfo(dt) if dt.kind == "f" else np.iinfo(dt)
    return info.min if red == "max" else info.max


@handler(*SEGMENT)
def _unsorted_segment(c, n):
    """(data, ids, num): out[ids[i], ...] (+)= data[i, ...], out's other rows TF's identity
    for the reduction (0, 1, the dtype's lowest/highest)."""
    red = SEGMENT[n.op]
    dt = np.dtype(np_type(n))
    init = _identity(red, dt)
    data, ids = c.x(n, 0), as_i64(c, c.x(n, 1))
    tail = _shape_after(c, data, ids)
    shape = c.op("Concat", [c.op("Reshape", [as_i64(c, c.x(n, 2)), c.i64(1)]), tail], axis=0)
    flat_ids = c.op("Reshape", [ids, c.i64(-1, 1)])
    flat = c.op("Reshape", [data, c.op("Concat", [c.i64(-1), tail], axis=0)])
    return [c.op("ScatterND", [c.op("Expand", [c.const(init, dt), shape]), flat_ids, flat],
                 reduction=red)]


SORTED_SEGMENT = {"SegmentSum": "add", "SegmentMean": "add", "SegmentProd": "mul",
                  "SegmentMax": "max", "SegmentMin": "min"}


@handler(*SORTED_SEGMENT)
def _sorted_segment(c, n):
    """(data, ids): out[ids[i], ...] (+)= data[i, ...] over segment_ids[-1] + 1 segments (ids
    sorted, 1-D, as TF requires; none when empty). An empty segment is 0 (1 for SegmentProd), as
    TF's sorted kernels give: Max and Min start from the dtype's lowest / highest and their empty
    segments are set to 0 by a count of the rows in each segment, which also divides the sum for
    SegmentMean (TF's integer mean truncates, as ONNX's integer Div)."""
    red = SORTED_SEGMENT[n.op]
    dt = np.dtype(np_type(n))
    init = _identity(red, dt)
    data, ids = c.x(n, 0), c.op("Reshape", [as_i64(c, c.x(n, 1)), c.i64(-1)])
    last = c.op("Slice", [c.op("Concat", [c.i64(-1), ids], axis=0), c.i64(-1), c.i64(BIG)])
    tail = c.op("Shape", [data], start=1)
    shape = c.op("Concat", [c.op("Add", [last, c.i64(1)]), tail], axis=0)
    where = c.op("Unsqueeze", [ids, c.i64(-1)])
    y = c.op("ScatterND", [c.op("Expand", [c.const(init, dt), shape]), where, data],
             reduction=red)
    if n.op in ("SegmentSum", "SegmentProd"):
        return [y]
    zero = c.const(0, np.int64)
    count = c.op("ScatterND", [c.op("Expand", [zero, shape]), where, c.op(
        "Expand", [c.const(1, np.int64), c.op("Shape", [data])])], reduction="add")
    if n.op == "SegmentMean":
        return [c.op("Div", [y, c.op("Cast", [c.op("Max", [count, c.const(1, np.int64)])],
                                     to=c.onnx_type(n))])]
    return [c.op("Where", [c.op("Equal", [count, zero]), c.const(0, dt), y])]


def _shape_after(c, data, ids):
    """data's shape after the leading dims that ``ids`` covers (int64 vector)."""
    rank_ids = c.op("Shape", [c.op("Shape", [ids])])
    return c.op("Slice", [c.op("Shape", [data]), rank_ids, c.i64(BIG)])


@handler("DynamicStitch", "ParallelDynamicStitch")
def _dynamic_stitch(c, n):
    """(indices_0..k-1, data_0..k-1): merged[indices_m[i]] = data_m[i] (later m win)."""
    k = len(n.inputs) // 2
    if all(c.const_input(n, i) is not None for i in range(2 * k)) and not reads_weight(
            c, n, *range(k, 2 * k)):
        vals = [c.const_input(n, i) for i in range(2 * k)]
        tail = vals[k].shape[vals[0].ndim:]
        out = np.zeros((max(int(v.max(initial=-1)) for v in vals[:k]) + 1,) + tail, vals[k].dtype)
        for idx, d in zip(vals[:k], vals[k:]):
            out[idx.reshape(-1)] = d.reshape((-1,) + tail)
        return [c.const(out)]
    ids = [as_i64(c, c.x(n, i)) for i in range(k)]
    tail = _shape_after(c, c.x(n, k), ids[0])
    flat_ids = c.op("Concat", [c.op("Reshape", [i, c.i64(-1)]) for i in ids], axis=0)
    rows = c.op("Concat", [c.i64(-1), tail], axis=0)
    flat = c.op("Concat", [c.op("Reshape", [c.x(n, k + m), rows]) for m in range(k)], axis=0)
    size = c.op("Add", [c.op("ReduceMax", [flat_ids], keepdims=1), c.i64(1)])
    zeros = c.zeros(c.op("Concat", [size, tail], axis=0), np_type(n))
    return [c.op("ScatterND", [zeros, c.op("Unsqueeze", [flat_ids, c.i64(-1)]), flat])]


@handler("OneHot")
def _one_hot(c, n):
    """(indices, depth, on, off): compare with Range(depth) (out-of-range indices: all off)."""
    idx, axis = c.x(n, 0), c.attr(n, "axis", -1)
    depth = c.op("Range", [c.const(0, np_type(n, "TI")), c.op("Cast", [c.x(n, 1)],
                                                          to=c.onnx_type(n, "TI")),
                           c.const(1, np_type(n, "TI"))])
    y = c.op("Where", [c.op("Equal", [c.op("Unsqueeze", [idx, c.i64(-1)]), depth]),
                       c.x(n, 2), c.x(n, 3)])
    if axis == -1:
        return [y]
    r = rank_of(c, n, 0, required="OneHot with an axis") + 1
    perm = list(range(r - 1))
    perm.insert(axis, r - 1)
    return [c.op("Transpose", [y], perm=perm)]


@handler("Where")
def _where_op(c, n):  # the coordinates of the true (nonzero) elements, one row each
    return [c.op("Transpose", [c.op("NonZero", [c.x(n)])], perm=[1, 0])]


# -- slices ------------------------------------------------------------------------------------
def shape_value(c: Converter, ref: str):
    """The value of shape vector ``ref`` as far as it is known statically (a list of ints and
    None), or None: a constant, the Shape of a tensor of known rank, through identities and a
    loop's stack (what a backward loop pops, the forward loop pushed)."""
    v = c.value(ref)
    if isinstance(v, str) and v in c.consts:
        return [int(d) for d in np.reshape(c.consts[v], -1)]
    p, k = c.g.producer(ref), split_ref(ref)[1]
    if p.op in ("Shape", "ShapeN"):
        return static_shape(c, p.inputs[k if p.op == "ShapeN" else 0])
    if p.op in ("Identity", "Enter", "RefEnter", "Switch", "RefSwitch"):
        return shape_value(c, p.inputs[0])
    if p.op == "StackPopV2":
        from .resources import static_key
        push = c.scan_stacks.get(static_key(c.g, p.inputs[0]))
        return None if push is None else shape_value(c, push.inputs[1])
    return None


def _concat_slice(c, n):
    """TF's gradient of a concat, Slice(dy, ConcatOffset, Shape(x_k)): the slice along the axis
    when the offsets are constant (see ConcatOffset) and x_k's size along it is known (the
    other dims are dy's whole extent)."""
    p = c.g.producer(n.inputs[1])
    while p.op in ("Identity", "Enter", "RefEnter", "Switch", "RefSwitch"):
        p = c.g.producer(p.inputs[0])
    begin, size = c.const_input(n, 1), shape_value(c, n.inputs[2])
    if p.op != "ConcatOffset" or begin is None or size is None or len(size) != len(begin):
        return None
    axis = int(c.const_input(p, 0)) % len(begin)
    if size[axis] is None or any(b for i, b in enumerate(begin) if i != axis):
        return None
    return c.op("Slice", [c.x(n, 0), c.i64(int(begin[axis])),
                          c.i64(int(begin[axis]) + size[axis]), c.i64(axis)])


@handler("Slice")
def _slice(c, n):
    y = _concat_slice(c, n)
    if y is not None:
        return [y]
    begin, size = as_i64(c, c.x(n, 1)), as_i64(c, c.x(n, 2))
    b, s = c.consts.get(begin), c.consts.get(size)
    if b is not None and s is not None:
        end = c.const(np.where(s < 0, BIG, b + s))
    else:  # size -1 means "to the end"
        end = c.op("Where", [c.op("Less", [size, c.i64(0)]), c.i64(BIG),
                             c.op("Add", [begin, size])])
    return [c.op("Slice", [c.x(n, 0), begin, end])]


@handler("StridedSlice")
def _strided_slice(c, n):
    y = _fold(c, n, lambda *v: _strided_slice_np(c, n, *v), 0, 1, 2, 3)
    return [y or _slice_like(c, n, c.x(n, 0), 1)]


def _strided_slice_np(c, n, x, b, e, s):
    spec = _SliceSpec(c, n, s)
    idx: list = [np.newaxis if k in spec.new else slice(None) for k in range(len(s))]
    for k, _, sk in spec.sliced:
        bk = None if spec.mask("begin", k) else int(b[k])
        ek = None if spec.mask("end", k) else int(e[k])
        idx[k] = int(b[k]) if spec.mask("shrink_axis", k) else slice(bk, ek, int(sk))
    if spec.ellipsis is not None:
        idx[spec.ellipsis] = Ellipsis
    return np.asarray(x[tuple(idx)])


class _SliceSpec:
    """StridedSlice's sparse spec resolved without knowing the input's rank: an entry before
    the ellipsis (or with none) slices input axis 0, 1, ..., one after it axis ..., -2, -1;
    a new axis lands at output position p (from the front) or p < 0 (from the back)."""

    def __init__(self, c, n, strides):
        self.masks = {m: c.attr(n, m, 0) for m in ("begin_mask", "end_mask", "ellipsis_mask",
                                                   "new_axis_mask", "shrink_axis_mask")}
        ell, k = self.masks["ellipsis_mask"], len(strides)
        self.ellipsis = (ell & -ell).bit_length() - 1 if ell else None
        e = k if self.ellipsis is None else self.ellipsis
        self.sliced, self.new = [], {}  # sliced: (spec index, input axis, stride)
        ax = pos = 0
        for i in range(e):  # before the ellipsis: counted from the front
            if self.mask("new_axis", i):
                self.new[i] = pos
                pos += 1
            else:
                self.sliced.append((i, ax, int(strides[i])))
                ax += 1
                pos += not self.mask("shrink_axis", i)
        ax = pos = 0
        for i in reversed(range(e + 1, k)):  # after it: from the back
            if self.mask("new_axis", i):
                pos -= 1
                self.new[i] = pos
            else:
                ax -= 1
                self.sliced.append((i, ax, int(strides[i])))
                pos -= not self.mask("shrink_axis", i)
        self.sliced.sort()

    def mask(self, kind: str, i: int) -> bool:
        return bool(self.masks[kind + "_mask"] >> i & 1)


def _slice_like(c, n, x, first: int) -> str:
    """x sliced like node n's StridedSlice with (begin, end, strides) at inputs first..first+2;
    begin and end may be computed at run time, strides must be constants."""
    spec = _SliceSpec(c, n, c.const_input(n, first + 2, required="StridedSlice strides"))
    if spec.sliced:
        pos = np.array([i for i, _, _ in spec.sliced])
        shrink = np.array([spec.mask("shrink_axis", i) for i in pos])
        steps = np.where(shrink, 1, [s for _, _, s in spec.sliced])
        fwd = steps > 0
        begin, end = (_gathered(c, n, first + j, pos) for j in (0, 1))
        if shrink.any():  # one element: [b, b + 1), or [-1, end)
            if isinstance(begin, np.ndarray):
                after = np.where(begin == -1, BIG, begin + 1)
            else:
                after = c.op("Where", [c.op("Equal", [begin, c.i64(-1)]), c.i64(BIG),
                                       c.op("Add", [begin, c.i64(1)])])
            end = _where(c, shrink, after, end)
        bm = np.array([spec.mask("begin", i) for i in pos]) & ~shrink
        em = np.array([spec.mask("end", i) for i in pos]) & ~shrink
        begin = _where(c, bm, np.where(fwd, 0, BIG), begin)
        end = _where(c, em, np.where(fwd, BIG, -BIG), end)
        begin, end = (c.const(v) if isinstance(v, np.ndarray) else v for v in (begin, end))
        x = c.op("Slice", [x, begin, end, c.i64(*[a for _, a, _ in spec.sliced]),
                           c.const(steps.astype(np.int64))])
        squeeze = [a for i, a, _ in spec.sliced if spec.mask("shrink_axis", i)]
        x = c.op("Squeeze", [x, c.i64(*squeeze)]) if squeeze else x
    if spec.new:
        x = c.op("Unsqueeze", [x, c.i64(*spec.new.values())])
    return x


def _gathered(c, n, i, pos):
    """Entries ``pos`` of the int vector input i: numpy when constant, else an ONNX value."""
    k = c.const_input(n, i)
    if k is not None:
        return np.asarray(k, np.int64)[pos]
    return c.op("Gather", [as_i64(c, c.x(n, i)), c.const(pos.astype(np.int64))])


@handler("StridedSliceGrad")
def _strided_slice_grad(c, n):  # (shape, begin, end, strides, dy): dy scattered into zeros
    shape = as_i64(c, c.x(n, 0))
    count = c.op("ReduceProd", [shape], keepdims=1)
    zero, one = c.const(0, np.int64), c.const(1, np.int64)
    index = c.op("Reshape", [c.op("Range", [zero, c.op("Squeeze", [count]), one]), shape])
    where = c.op("Unsqueeze", [c.op("Reshape", [_slice_like(c, n, index, 1), c.i64(-1)]),
                               c.i64(-1)])
    zeros = c.zeros(count, np_type(n))
    flat = c.op("ScatterND", [zeros, where, c.op("Reshape", [c.x(n, 4), c.i64(-1)])])
    return [c.op("Reshape", [flat, shape])]


@handler("BroadcastGradientArgs")
def _broadcast_gradient_args(c, n):
    """(s0, s1) -> the axes each input's gradient is summed over: none when the shapes are equal,
    else every axis where the input's (left-padded with 1s) shape is 1."""
    y = [_fold(c, n, lambda a, b, j=j: _bga_np(a, b)[j], 0, 1) for j in (0, 1)]
    if y[0] is not None:
        return y
    popped = [c.popped.get(c.x(n, i)) for i in (0, 1)]
    if all(popped) and popped[0][1] == popped[1][1] and c.loop_scope is not None:
        outs = _bga_of_pops(c, n, popped[0][0], popped[1][0], popped[0][1])
        for i, o in enumerate(outs):  # (Sum then Reshape to input i: see _reduce, _reshape)
            c.bga_shapes[c.int64_of.get(o, o)] = c.bga_shapes[o] = as_i64(c, c.x(n, i))
        return outs
    s = [as_i64(c, c.x(n, i)) for i in (0, 1)]
    lens = [c.op("Shape", [v]) for v in s]
    r = c.op("Max", lens)
    padded = [c.op("Concat", [c.op("Expand", [c.i64(1), c.op("Sub", [r, ln])]), v], axis=0)
              for v, ln in zip(s, lens)]
    same = c.op("And", [c.op("Equal", [lens[0], lens[1]]), c.op("Cast", [c.op("ReduceMin", [
        c.op("Cast", [c.op("Equal", padded)], to=TensorProto.INT32)], keepdims=1)],
        to=TensorProto.BOOL)])
    axes = c.op("Range", [c.const(0, np_type(n)), c.op("Cast", [c.op("Squeeze", [r])],
                                                       to=c.onnx_type(n)), c.const(1, np_type(n))])
    return [c.op("Compress", [axes, c.op("And", [c.op("Equal", [p, c.i64(1)]),
                                                  c.op("Not", [same])])], axis=0)
            for p in padded]


def _bga_of_pops(c, n, s0, s1, idx):
    """BroadcastGradientArgs of two shapes a backward loop pops (tf.gradients' pattern in a
    while loop): the forward loop's shapes are all stacked (s0, s1: [iterations, rank]), so
    which axes each iteration reduces is worked out once for all iterations before the loop
    (an [iterations, rank] mask per side), and each iteration only picks its row."""
    def masks():
        w = [c.op("Shape", [v], start=1, end=2) for v in (s0, s1)]
        r = c.op("Max", w)
        zero = c.i64(0)
        padded = [c.op("Pad", [v, c.op("Concat", [zero, c.op("Sub", [r, wi]), zero, zero],
                                        axis=0), c.const(1, np.int64)])
                  for v, wi in zip((s0, s1), w)]
        rows_equal = c.op("Cast", [c.op("ReduceMin", [c.op("Cast", [c.op("Equal", padded)],
                                                           to=TensorProto.INT32), c.i64(1)],
                                        keepdims=1)], to=TensorProto.BOOL)
        differ = c.op("Not", [c.op("And", [rows_equal, c.op("Equal", w)])])
        axes = c.op("Range", [c.const(0, np.int64), c.op("Squeeze", [r]),
                              c.const(1, np.int64)])
        return [c.op("And", [c.op("Equal", [p, c.const(1, np.int64)]), differ])
                for p in padded] + [axes]
    if c.no_broadcast:  # the body made assuming no iteration broadcasts: no axes
        return [c.const(np.zeros(0, np_type(n))) for _ in (0, 1)]
    m0, m1, axes = c.memo(("bga", s0, s1), masks, scope=c.loop_scope)
    c.bga_masks += [m0, m1]
    outs = []
    for m in (m0, m1):
        wide = c.op("Compress", [axes, c.op("Gather", [m, idx], axis=0)], axis=0)
        outs.append(_out_type(c, n, wide, "T"))  # (the int64 axes for the Sum that reads them)
    return outs


def _bga_np(a, b):
    if a.shape == b.shape and (a == b).all():
        return [np.zeros(0, a.dtype)] * 2
    r = max(len(a), len(b))
    pad = [np.concatenate([np.ones(r - len(v), v.dtype), v]) for v in (a, b)]
    return [np.flatnonzero(p == 1).astype(a.dtype) for p in pad]


from . import image_ops, nn_ops  # noqa: E402,F401  (their handlers register on import)
