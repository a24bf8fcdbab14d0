"""The TensorFlow converter's table of ordinary ops: each op (and each *Grad op tf.gradients
emits, via tf.gradients of its forward op) in a TF1 graph with placeholders, converted and run on
onnxruntime, against TensorFlow as the oracle; then whole frozen models (an MLP, a small CNN)
with their gradients."""
from __future__ import annotations

import numpy as np
import pytest

from tf_util import ort_run, tf, tf1_graph, tf_run

from onnxgrad.converters.tensorflow import ConversionError, ConversionWarning, convert

v1 = tf.compat.v1
R = np.random.RandomState(0)


def rnd(*shape, lo=None, hi=None, dtype=np.float32):
    x = R.randn(*shape) if lo is None else R.uniform(lo, hi, shape)
    return np.asarray(x, dtype)


def ints(*shape, lo=-5, hi=6, dtype=np.int32):
    return R.randint(lo, hi, shape).astype(dtype)


class Static(np.ndarray):
    """A feed whose placeholder gets its full static shape (a shape vector of known length)."""


def static(a):
    return np.asarray(a).view(Static)


class Feeds:
    """Makes placeholders (first dim dynamic, unless ``shape`` is given or "static") and
    records their feeds."""

    def __init__(self):
        self.feeds = {}

    def __call__(self, value, shape="batch"):
        if isinstance(value, Static):
            value, shape = np.asarray(value), "static"
        value = np.asarray(value)
        if shape == "batch":
            shape = [None, *value.shape[1:]] if value.ndim else []
        elif shape == "static":
            shape = value.shape
        p = v1.placeholder(tf.as_dtype(value.dtype), shape, name=f"in{len(self.feeds)}")
        self.feeds[p.name] = value
        return p


def compare(expected, got, names, rtol, atol):
    for name, e, g in zip(names, expected, got):
        e, g = np.asarray(e), np.asarray(g)
        assert g.dtype == e.dtype and g.shape == e.shape, (name, g.dtype, g.shape, e.dtype, e.shape)
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=name)


def run_case(build, rtol=1e-5, atol=1e-6, **kw):
    """Build the graph with ``build(P)`` (P makes placeholders), run it in TF and converted on
    onnxruntime (``kw`` to convert), and compare every output (dtype, shape, values)."""
    f = Feeds()
    g, outs = tf1_graph(lambda: build(f))
    outs = [o.name for o in (outs if isinstance(outs, (list, tuple)) else [outs])]
    expected = tf_run(g, outs, f.feeds)
    model = convert(g.as_graph_def(add_shapes=True), inputs=list(f.feeds), outputs=outs, **kw)
    compare(expected, ort_run(model, f.feeds, outs), outs, rtol, atol)
    return g, model


def grads(fn, *xs, upstream=None):
    """fn(*xs) and its gradients w.r.t. xs, under a loss that weights each output element
    differently (sum of y * cos(k)), so that the *Grad ops see a nonuniform dy."""
    y = fn(*xs)
    w = tf.cos(tf.cast(tf.reshape(tf.range(tf.size(y)), tf.shape(y)), y.dtype))
    gs = tf.gradients(tf.reduce_sum(y * tf.stop_gradient(w)), list(xs))
    # Gather's gradient is IndexedSlices: made dense (UnsortedSegmentSum)
    return [y, *(tf.convert_to_tensor(g) for g in gs if g is not None)]


def ops_of(g) -> set:
    return {n.op for n in g.as_graph_def().node}


# -- one op at a time -------------------------------------------------------------------------
X = rnd(4, 3)
POS = rnd(4, 3, lo=0.1, hi=3.0)
IMG_S2B = rnd(2, 5, 4, 3)
UNARY = {
    "Tanh": (tf.tanh, X), "Sigmoid": (tf.sigmoid, X), "Relu": (tf.nn.relu, X),
    "Exp": (tf.exp, X), "Log": (tf.math.log, POS), "Neg": (tf.negative, X), "Abs": (tf.abs, X),
    "Sqrt": (tf.sqrt, POS), "Rsqrt": (tf.math.rsqrt, POS), "Square": (tf.square, X),
    "Sign": (tf.sign, X), "Floor": (tf.floor, X * 3), "Ceil": (tf.math.ceil, X * 3),
    "Round": (tf.round, np.array([[0.5, 1.5, -0.5, 2.5, -1.7]], np.float32)),
    "Reciprocal": (tf.math.reciprocal, POS), "Softplus": (tf.nn.softplus, X * 10),
    "Softplus_extremes": (tf.nn.softplus, np.array([[100, -100, 20, -20, 0.5]], np.float32)),
    "Softsign": (tf.nn.softsign, X), "Elu": (tf.nn.elu, X), "Selu": (tf.nn.selu, X),
    "Relu6": (tf.nn.relu6, X * 5), "LeakyRelu": (lambda x: tf.nn.leaky_relu(x, 0.3), X),
    "Log1p": (tf.math.log1p, np.array([[1e-8, -1e-6, 0.5, 3.0, -0.9]], np.float32)),
    "Expm1": (tf.math.expm1, np.array([[1e-8, -1e-6, 0.5, 3.0, -20.0]], np.float32)),
    "Erf": (tf.math.erf, X), "Sin": (tf.sin, X), "Cos": (tf.cos, X),
    "Erfc": (tf.math.erfc, np.array([[-4, -1.5, -0.1, 0, 0.3, 0.49, 0.5, 0.51, 1, 2.5]],
                                    np.float32)),
    "MatrixBandPart_causal": (lambda x: tf.linalg.band_part(x, -1, 0), rnd(2, 4, 5)),
    "MatrixBandPart_bool": (lambda x: tf.linalg.band_part(x, 1, -1), rnd(3, 5) > 0),
    "SpaceToBatchND": (lambda x: tf.space_to_batch_nd(x, [2, 3], [[1, 0], [2, 0]]), IMG_S2B),
    "BatchToSpaceND": (lambda x: tf.compat.v1.batch_to_space_nd(x, [2, 1], [[1, 2], [0, 0]]),
                       rnd(4, 3, 2, 3)),
    "IsFinite": (tf.math.is_finite, np.array([[1, np.inf, -np.inf, np.nan]], np.float32)),
    "IsNan": (tf.math.is_nan, np.array([[1, np.inf, -np.inf, np.nan]], np.float32)),
    "IsInf": (tf.math.is_inf, np.array([[1, np.inf, -np.inf, np.nan]], np.float32)),
    "LogicalNot": (tf.logical_not, X > 0), "Softmax": (tf.nn.softmax, X),
    "LogSoftmax": (tf.nn.log_softmax, X), "L2Loss": (tf.nn.l2_loss, X),
    "Cast": (lambda x: tf.cast(x, tf.int32), X * 5), "Identity": (tf.identity, X),
    "StopGradient": (tf.stop_gradient, X), "ZerosLike": (tf.zeros_like, X),
    "OnesLike": (tf.ones_like, ints(2, 3)), "Shape": (tf.shape, X), "Size": (tf.size, X),
    "Rank": (tf.rank, X), "Where": (tf.where, X > 0),
    "Cumsum": (lambda x: tf.cumsum(x, axis=1), X),
    "Cumsum_exclusive_reverse": (lambda x: tf.cumsum(x, 0, exclusive=True, reverse=True), X),
    "ArgMax": (lambda x: tf.argmax(x, 1), X),
    "ArgMin_int32": (lambda x: tf.argmin(x, 0, output_type=tf.int32), X),
    "Einsum": (lambda x: tf.einsum("ij,kj->ik", x, x), X),
    "Transpose": (lambda x: tf.transpose(x), X),
    "InvertPermutation": (tf.math.invert_permutation, np.array([2, 0, 3, 1], np.int32)),
}


@pytest.mark.parametrize("name", UNARY)
def test_unary(name):
    fn, x = UNARY[name]
    run_case(lambda P: fn(P(x)))


A, B = rnd(4, 3), rnd(3)
IA, IB = ints(4, 3), np.array([3, -2, 4], np.int32)
BINARY = {
    "Add": (tf.add, A, B), "Sub": (tf.subtract, A, B), "Mul": (tf.multiply, A, B),
    "RealDiv": (tf.divide, A, B + 3), "Maximum": (tf.maximum, A, B),
    "Minimum": (tf.minimum, A, B), "Pow": (tf.pow, np.abs(A) + 0.5, B),
    "SquaredDifference": (tf.math.squared_difference, A, B),
    "FloorDiv": (tf.math.floordiv, A * 4, B), "FloorDiv_int": (tf.math.floordiv, IA, IB),
    "FloorMod": (tf.math.floormod, A * 4, B), "FloorMod_int": (tf.math.floormod, IA, IB),
    "TruncateMod": (tf.truncatemod, A * 4, B),
    "TruncateMod_int": (tf.truncatemod, IA, IB),
    "TruncateDiv_int": (tf.truncatediv, IA, IB),
    "Mod": (lambda a, b: tf.raw_ops.Mod(x=a, y=b), A * 4, B),
    "Mod_int": (lambda a, b: tf.raw_ops.Mod(x=a, y=b), IA, IB),
    "Reverse_v1": (lambda a, b: tf.raw_ops.Reverse(tensor=a + b, dims=[True, True]), A, B),
    "ListDiff": (lambda a, b: list(tf.raw_ops.ListDiff(x=a, y=b)), np.array([4, 1, 3, 1, 7]),
                 np.array([1, 7, 9])),
    "Xlogy": (tf.math.xlogy, np.where(A > 0, A, 0), np.abs(B)),
    "Xdivy": (tf.math.xdivy, np.where(A > 0, A, 0), B),
    "Greater": (tf.greater, A, B), "Less": (tf.less, A, B), "Equal": (tf.equal, IA, IB[:1]),
    "NotEqual": (tf.not_equal, IA, IB[:1]), "GreaterEqual": (tf.greater_equal, IA, IB),
    "LogicalAnd": (tf.logical_and, A > 0, B > 0), "LogicalOr": (tf.logical_or, A > 0, B > 0),
    "MatMul": (tf.matmul, A, rnd(3, 5)),
    "MatMul_transposes": (lambda a, b: tf.matmul(a, b, transpose_a=True, transpose_b=True),
                          A, rnd(5, 4)),
    "MatMul_int": (lambda a, b: tf.matmul(a, b, transpose_b=True), IA, ints(2, 3)),
    "BatchMatMulV2": (tf.matmul, rnd(2, 4, 3), rnd(3, 5)),
    "BatchMatMulV2_adjoint": (lambda a, b: tf.matmul(a, b, adjoint_a=True, adjoint_b=True),
                              rnd(2, 3, 4), rnd(2, 5, 3)),
    "BiasAdd": (tf.nn.bias_add, rnd(2, 3, 3), B),
    "SelectV2": (lambda c, a: tf.where(c, a, -a), B > 0, A),
    "Select_rows": (lambda c, a: v1.where(c, a, -a), A[:, 0] > 0, A),
    "AddN": (lambda a, b: tf.add_n([a, b, a]), A, A),
    "Einsum_batch": (lambda a, b: tf.einsum("bij,bjk->bik", a, b), rnd(2, 3, 4), rnd(2, 4, 2)),
    "GatherV2": (lambda p, i: tf.gather(p, i, axis=1), A, np.array([[2, 0], [1, 1]], np.int32)),
    "GatherNd": (tf.gather_nd, A, np.array([[0, 2], [3, 1]], np.int64)),
    "Reshape": (lambda x, s: tf.reshape(x, tf.concat([s[:1], [-1]], 0)), A,
                static(np.array([2, 6], np.int32))),
    "Transpose_dynamic_perm": (tf.transpose, rnd(2, 3, 4), np.array([2, 0, 1], np.int32)),
    "Tile": (tf.tile, A, np.array([2, 1], np.int32)),
    "BroadcastTo": (lambda x, s: tf.broadcast_to(x, tf.concat([[2], s], 0)), A,
                    static(np.array([4, 3], np.int32))),
    "Fill": (lambda s, v: tf.fill(s, v), static(np.array([2, 3], np.int32)), np.float32(1.5)),
    "Cumprod": (lambda x, y: [tf.math.cumprod(x, 1), tf.math.cumprod(y, 0, True, True)], A, B),
    "SoftplusGrad": (lambda a, b: tf.raw_ops.SoftplusGrad(gradients=a, features=b), A, A * 5),
    "Range": (lambda a, b: tf.range(a, b, 2), np.int32(1), np.int32(9)),
    "ClipByValue": (lambda x, lo: tf.clip_by_value(x, lo, lo + 1.0), A, B),
    "TopKV2": (lambda x, k: tf.math.top_k(x, k), A, np.int32(2)),
    "Slice": (lambda x, b: tf.slice(x, b, [-1, 2]), A, np.array([1, 1], np.int32)),
    "ExpandDims": (lambda x, y: tf.expand_dims(x, 1) + tf.expand_dims(y, -1), A, B[:1]),
    "ScatterNd": (lambda i, u: tf.scatter_nd(i, u, [5, 3]), np.array([[1], [3], [1]], np.int32),
                  rnd(3, 3)),
    "TensorScatterUpdate": (lambda t, u: tf.tensor_scatter_nd_update(t, [[0], [2]], u), A,
                            rnd(2, 3)),
    "TensorScatterAdd": (lambda t, u: tf.tensor_scatter_nd_add(t, [[0], [0]], u), A, rnd(2, 3)),
    "UnsortedSegmentSum": (lambda d, i: tf.math.unsorted_segment_sum(d, i, 4), A,
                           np.array([3, 0, 3, 1], np.int32)),
    "UnsortedSegmentMax": (lambda d, i: tf.math.unsorted_segment_max(d, i, 4), A,
                           np.array([3, 0, 3, 1], np.int32)),
    "DynamicStitch": (lambda d, i: tf.dynamic_stitch([i, [1, 4]], [d, -d[:2]]), A,
                      np.array([0, 2, 4, 3], np.int32)),
    "BroadcastGradientArgs": (lambda a, b: list(tf.raw_ops.BroadcastGradientArgs(
        s0=tf.shape(a), s1=tf.shape(b))), rnd(4, 1, 3), rnd(5, 1)),
    "BroadcastGradientArgs_same": (lambda a, b: list(tf.raw_ops.BroadcastGradientArgs(
        s0=tf.shape(a), s1=tf.shape(b))), rnd(4, 1), rnd(4, 1)),
    "ConcatOffset": (lambda a, b: list(tf.raw_ops.ConcatOffset(
        concat_dim=1, shape=[tf.shape(a), tf.shape(b), tf.shape(a)])), rnd(2, 3), rnd(2, 5)),
    "ConcatV2": (lambda a, b: tf.concat([a, b, a], -1), A, rnd(4, 2)),
    "Pack": (lambda a, b: tf.stack([a, b], 1), A, A + 1),
    "Unpack": (lambda a, b: tf.unstack(a + b, axis=1), A, B),
    "Split": (lambda a, b: tf.split(a * b, 3, axis=1), A, B),
    "SplitV": (lambda a, b: tf.split(a, [1, -1], axis=1) + tf.split(b, [2, 1]), A, B),
    "OneHot": (lambda i, d: tf.one_hot(i, d, 2.0, -1.0), np.array([0, 2, -1, 5], np.int32),
               np.int32(4)),
    "OneHot_axis0": (lambda i, d: tf.one_hot(i, d, axis=0), np.array([[0, 3], [1, 9]], np.int64),
                     np.int32(4)),
    "Pad": (lambda x, p: tf.pad(x, p), A, np.array([[1, 0], [2, 1]], np.int32)),
    "PadV2": (lambda x, p: tf.pad(x, p, constant_values=2.5), A, np.array([[0, 1], [1, 1]],
                                                                         np.int32)),
    "MirrorPad_reflect": (lambda x, p: tf.pad(x, p, "REFLECT"), A,
                          np.array([[1, 2], [2, 1]], np.int32)),
    "MatrixBandPart": (lambda x, k: tf.linalg.band_part(x, k, k - 1), rnd(2, 4, 5),
                       np.int64(1)),
    "SpaceToBatchND_computed": (lambda x, p: tf.space_to_batch_nd(x, [2], p), rnd(3, 5, 2),
                                static(np.array([[2, 1]], np.int32))),
}


@pytest.mark.parametrize("name", BINARY)
def test_binary(name):
    fn, a, b = BINARY[name]
    run_case(lambda P: fn(P(a), P(b)))


T = rnd(2, 5, 4, 3)
REDUCE = {
    "Sum": lambda x: tf.reduce_sum(x, [1, 3]), "Sum_all": tf.reduce_sum,
    "Mean": lambda x: tf.reduce_mean(x, -1, keepdims=True), "Max": lambda x: tf.reduce_max(x, 2),
    "Min": lambda x: tf.reduce_min(x, [0]), "Prod": lambda x: tf.reduce_prod(x, 1),
    "All": lambda x: tf.reduce_all(x > -1, 1), "Any": lambda x: tf.reduce_any(x > 1.5, [1, 2]),
    "EuclideanNorm": lambda x: tf.norm(x, axis=1),
    "Squeeze": lambda x: tf.squeeze(x[:, :1], 1), "Reverse": lambda x: tf.reverse(x, [1, -1]),
    "MirrorPad_symmetric": lambda x: tf.pad(x, [[0, 0], [2, 1], [0, 3], [1, 0]], "SYMMETRIC"),
    # StridedSlice: every mask, negative strides, ellipsis and new axes, computed bounds
    "StridedSlice_basic": lambda x: x[:, 1:4, ::2, -1],
    "StridedSlice_negative": lambda x: x[::-1, 3:0:-2, :, ::-1],
    "StridedSlice_ellipsis": lambda x: x[..., 1:, None, 0],
    "StridedSlice_ellipsis_front": lambda x: x[1, ..., tf.newaxis, ::-1],
    "StridedSlice_newaxis": lambda x: x[None, :, tf.newaxis, 2],
    "StridedSlice_shrink_last": lambda x: x[-1, :, -1],
    "StridedSlice_dynamic": lambda x: x[:, tf.shape(x)[1] - 3:tf.shape(x)[2], 1],
    "StridedSlice_dynamic_shrink": lambda x: x[tf.shape(x)[0] - 1, ..., tf.size(x) // 1000 - 1],
    "StridedSlice_dynamic_negative": lambda x: x[:, tf.shape(x)[1] - 1:0:-1],
}


@pytest.mark.parametrize("name", REDUCE)
def test_reduce_and_slice(name):
    run_case(lambda P: REDUCE[name](P(T)))


# -- the *Grad ops, through tf.gradients --------------------------------------------------------
GRAD = {  # name: (forward, inputs, *Grad ops tf.gradients must emit)
    "ReluGrad": (tf.nn.relu, [X], {"ReluGrad"}),
    "Relu6Grad": (tf.nn.relu6, [X * 5], {"Relu6Grad"}),
    "EluGrad": (tf.nn.elu, [X], {"EluGrad"}),
    "SeluGrad": (tf.nn.selu, [X], {"SeluGrad"}),
    "Softplus": (tf.nn.softplus, [X], set()),
    "SoftsignGrad": (tf.nn.softsign, [X], {"SoftsignGrad"}),
    "LeakyReluGrad": (lambda x: tf.nn.leaky_relu(x, 0.1), [X], {"LeakyReluGrad"}),
    "TanhGrad": (tf.tanh, [X], {"TanhGrad"}), "SigmoidGrad": (tf.sigmoid, [X], {"SigmoidGrad"}),
    "RsqrtGrad": (tf.math.rsqrt, [POS], {"RsqrtGrad"}),
    "SqrtGrad": (tf.sqrt, [POS], {"SqrtGrad"}),
    "ReciprocalGrad": (tf.math.reciprocal, [POS], {"ReciprocalGrad"}),
    "BroadcastGradientArgs": (lambda a, b: a * b + a / (b + 3), [rnd(4, 1, 3), rnd(5, 1)],
                              {"BroadcastGradientArgs"}),
    "BiasAddGrad": (tf.nn.bias_add, [rnd(2, 3, 4), rnd(4)], {"BiasAddGrad"}),
    "Mean": (lambda x: tf.reduce_mean(x, 1), [T], {"DynamicStitch", "BroadcastTo"}),
    "Sum_keepdims": (lambda x: tf.reduce_sum(x, [0, 2], keepdims=True), [T], set()),
    "Max": (lambda x: tf.reduce_max(x, 1), [T], {"DynamicStitch"}),
    "Prod": (lambda x: tf.reduce_prod(x, 1), [rnd(3, 4, lo=0.5, hi=1.5)],
             {"Cumprod", "ListDiff", "InvertPermutation"}),
    "ConcatOffset": (lambda a, b: tf.concat([a, b, a], 1), [rnd(2, 3), rnd(2, 2)],
                     {"ConcatOffset"}),
    "StridedSliceGrad": (lambda x: x[:, 1::2, ..., None, 0], [T], {"StridedSliceGrad"}),
    "Slice": (lambda x: tf.slice(x, [0, 1, 0, 0], [-1, 2, 3, -1]), [T], set()),
    "GatherV2": (lambda p, i: tf.gather(p, i), [A, np.array([0, 2, 0], np.int32)],
                 {"UnsortedSegmentSum"}),
    "Split": (lambda x: tf.split(x, [1, 2], 1)[1], [A], set()),
    "Pack_Unpack": (lambda a, b: tf.unstack(tf.stack([a, b]), axis=2)[1], [A, A], set()),
    "Transpose": (lambda x: tf.transpose(x, [2, 0, 3, 1]), [T], {"InvertPermutation"}),
    "Tile": (lambda x: tf.tile(x, [2, 3]), [A], set()),
    "Pad": (lambda x: tf.pad(x, [[1, 0], [0, 2]]), [A], set()),
    "SquaredDifference": (tf.math.squared_difference, [A, B], set()),
    "Pow": (tf.pow, [POS, B], set()),
    "MatMul": (lambda a, b: tf.matmul(a, b, transpose_b=True), [A, rnd(5, 3)], set()),
    "BatchMatMulV2": (tf.matmul, [rnd(2, 4, 3), rnd(3, 5)], set()),
    "Select": (lambda a, b: tf.where(a > b, a, b), [A, B], set()),
    "Softmax": (tf.nn.softmax, [X], set()),
    "Cumsum": (lambda x: tf.cumsum(x, 1), [X], set()),
    "Maximum": (tf.maximum, [A, B], set()),
    "Erfc": (tf.math.erfc, [X], set()),
    "MatrixBandPart": (lambda x: tf.linalg.band_part(x, 1, 0), [rnd(2, 3, 4)],
                       {"MatrixBandPart"}),
    "SpaceToBatchND": (lambda x: tf.space_to_batch_nd(x, [2, 2], [[1, 0], [0, 2]]), [IMG_S2B],
                       {"BatchToSpaceND"}),
    "BatchToSpaceND": (lambda x: tf.compat.v1.batch_to_space_nd(x, [2], [[1, 2]]),
                       [rnd(4, 3, 2)], {"SpaceToBatchND"}),
}


@pytest.mark.parametrize("name", GRAD)
def test_grad(name):
    fn, xs, emitted = GRAD[name]
    g, _ = run_case(lambda P: grads(fn, *[P(x) for x in xs]))
    assert emitted <= ops_of(g)


# -- neural-network ops -------------------------------------------------------------------------
IMG = rnd(2, 7, 6, 3)
CONV = {  # name: (fn of (x, filter), filter shape)
    "Conv2D_same": (lambda x, w: tf.nn.conv2d(x, w, 1, "SAME"), (3, 3, 3, 4)),
    "Conv2D_valid_stride": (lambda x, w: tf.nn.conv2d(x, w, [1, 2, 2, 1], "VALID"), (3, 2, 3, 4)),
    "Conv2D_same_stride": (lambda x, w: tf.nn.conv2d(x, w, 2, "SAME"), (4, 3, 3, 2)),
    "Conv2D_explicit": (lambda x, w: tf.nn.conv2d(x, w, [1, 2, 1, 1], [[0, 0], [1, 2], [0, 1],
                                                                       [0, 0]]), (3, 3, 3, 2)),
    "Depthwise": (lambda x, w: tf.nn.depthwise_conv2d(x, w, [1, 1, 1, 1], "SAME"), (3, 3, 3, 2)),
    "Depthwise_stride": (lambda x, w: tf.nn.depthwise_conv2d(x, w, [1, 2, 2, 1], "VALID"),
                         (2, 2, 3, 1)),
}


@pytest.mark.parametrize("name", CONV)
def test_conv(name):
    fn, wshape = CONV[name]
    w = rnd(*wshape)
    run_case(lambda P: grads(fn, P(IMG), P(w, "static")), rtol=1e-4, atol=1e-5)


def test_conv3d():
    x, w = rnd(1, 5, 4, 6, 2), rnd(2, 3, 2, 2, 3)
    g, _ = run_case(lambda P: grads(lambda x, w: tf.nn.conv3d(x, w, [1, 2, 1, 1, 1], "SAME"),
                                    P(x), P(w, "static")), rtol=1e-4, atol=1e-5)
    assert {"Conv3DBackpropInputV2", "Conv3DBackpropFilterV2"} <= ops_of(g)


POOL = {
    "MaxPool_valid": lambda x: tf.nn.max_pool2d(x, 2, 2, "VALID"),
    "MaxPool_same_overlap": lambda x: tf.nn.max_pool2d(x, 3, [1, 2, 1, 1], "SAME"),
    "AvgPool_valid": lambda x: tf.nn.avg_pool2d(x, 2, 2, "VALID"),
    "AvgPool_same": lambda x: tf.nn.avg_pool2d(x, [3, 2], [2, 1], "SAME"),
    "MaxPool3D": lambda x: tf.nn.max_pool3d(tf.expand_dims(x, 1), [1, 2, 2], 2, "SAME"),
    "AvgPool3D": lambda x: tf.nn.avg_pool3d(tf.expand_dims(x, 1), [1, 2, 3], 2, "SAME"),
}


@pytest.mark.parametrize("name", POOL)
def test_pool(name):
    g, _ = run_case(lambda P: grads(POOL[name], P(IMG)))
    assert any(op.endswith("Grad") for op in ops_of(g))


def test_dilated_conv_through_space_to_batch():
    """tf.nn.atrous_conv2d: SpaceToBatchND -> Conv2D -> BatchToSpaceND, and its gradients."""
    w = rnd(3, 2, 3, 4)
    g, _ = run_case(lambda P: grads(lambda x, k: tf.nn.atrous_conv2d(x, k, 2, "SAME"),
                                    P(IMG), P(w, "static")), rtol=1e-4, atol=1e-5)
    assert {"SpaceToBatchND", "BatchToSpaceND"} <= ops_of(g)


def test_erfc_keeps_its_digits_in_the_tail():
    """erfc(x) for large x is far below 1 - erf(x)'s resolution: relative error only (float32's
    exp of -x^2 alone costs x^2 * 6e-8 near x = 9)."""
    x = np.linspace(-3, 9, 97).astype(np.float32)
    run_case(lambda P: tf.math.erfc(P(x)), rtol=1e-5, atol=0)


RESIZE = {  # name: (resize, size)
    f"{kind}_{flags}_{size[0]}x{size[1]}": (kind, flags, size)
    for kind in ("bilinear", "nearest")
    for flags in ("half_pixel", "align_corners", "asymmetric")
    for size in ((11, 9), (4, 3))}


@pytest.mark.parametrize("name", RESIZE)
def test_resize(name):
    """ResizeBilinear / ResizeNearestNeighbor with each coordinate convention, up and down,
    and their gradients (ResizeBilinearGrad, ResizeNearestNeighborGrad)."""
    kind, flags, size = RESIZE[name]
    op = tf.raw_ops.ResizeBilinear if kind == "bilinear" else tf.raw_ops.ResizeNearestNeighbor
    fn = lambda x: op(images=x, size=size, align_corners=flags == "align_corners",  # noqa: E731
                      half_pixel_centers=flags == "half_pixel")
    g, _ = run_case(lambda P: grads(fn, P(rnd(2, 6, 5, 3), [None, 6, 5, 3])))
    assert {"ResizeBilinearGrad" if kind == "bilinear" else "ResizeNearestNeighborGrad"} <= ops_of(g)


def test_resize_computed_size():
    """A size computed at run time (the gradients need no static sizes either)."""
    def build(P):
        x = P(rnd(2, 6, 5, 3), [None, None, None, 3])
        size = tf.shape(x)[1:3] * 2 - 1
        return grads(lambda v: tf.compat.v1.image.resize_bilinear(v, size) +
                     tf.compat.v1.image.resize_nearest_neighbor(v, size), x)
    run_case(build)


UNKNOWN_RANK = {  # name: (fn, input): the placeholder has no static shape at all
    "BiasAdd": (lambda x: tf.nn.bias_add(x, [1.0, -2.0, 0.5]), rnd(2, 4, 3)),
    "BiasAdd_NCHW": (lambda x: tf.nn.bias_add(x, [1.0, -2.0], data_format="NCHW"),
                     rnd(2, 2, 3, 2)),
    "BiasAddGrad": (lambda x: grads(lambda v: tf.nn.bias_add(v, [1.0, -2.0, 0.5]), x),
                    rnd(2, 2, 4, 3)),
    "BiasAddGrad_NCHW": (lambda x: tf.raw_ops.BiasAddGrad(out_backprop=x, data_format="NCHW"),
                         rnd(2, 3, 4, 2)),
    "FusedBatchNorm_training": (lambda x: list(v1.nn.fused_batch_norm(
        x, [1.0, 2.0, 0.5], [0.1, 0.0, -0.3], epsilon=1e-3, is_training=True))[:3],
        rnd(2, 4, 3, 3)),
    "FusedBatchNorm_inference": (lambda x: v1.nn.fused_batch_norm(
        x, [1.0, 2.0], [0.1, 0.0], [0.5, -0.5], [1.0, 2.0], is_training=False)[0],
        rnd(2, 4, 3, 2)),
    "Select_rows": (lambda x: v1.where(x[:, 0, 0] > 0, x, -x), rnd(4, 3, 2)),
}


@pytest.mark.parametrize("name", UNKNOWN_RANK)
def test_unknown_rank(name):
    """Inputs whose rank TF does not know statically: the run-time shapes serve. ONNX has no
    declaration for such an input: refused by default, naming it; with allow_unranked it is
    declared without a shape, which a ConversionWarning says."""
    fn, x = UNKNOWN_RANK[name]
    with pytest.raises(ConversionError, match=r"in0:0.*allow_unranked=True"):
        run_case(lambda P: fn(P(x, None)))
    with pytest.warns(ConversionWarning, match="in0:0"):
        run_case(lambda P: fn(P(x, None)), rtol=1e-4, atol=1e-5, allow_unranked=True)


def convert_vs_oracle(converted, oracle, to_oracle, rtol=1e-4, atol=1e-5):
    """Convert the graph ``converted(P)`` builds, TF-run the equivalent ``oracle(P)`` (for what
    TF's CPU kernels cannot run), compare after ``to_oracle(i, onnx result i)``."""
    fo, fc = Feeds(), Feeds()
    go, yo = tf1_graph(lambda: oracle(fo))
    gc, yc = tf1_graph(lambda: converted(fc))
    expected = tf_run(go, [y.name for y in yo], fo.feeds)
    names = [y.name for y in yc]
    model = convert(gc.as_graph_def(add_shapes=True), inputs=list(fc.feeds), outputs=names)
    got = ort_run(model, fc.feeds, names)
    for i, (e, g) in enumerate(zip(expected, got)):
        np.testing.assert_allclose(to_oracle(i, g), e, rtol=rtol, atol=atol, err_msg=names[i])
    return gc


def test_conv_pool_nchw():
    """TF's CPU kernels take NHWC only: the NCHW graph (with its gradients) is converted and
    checked against the same ops run NHWC in TF."""
    w = rnd(3, 3, 3, 4)

    def build(fmt):
        def fn(P):
            x = P(IMG if fmt == "NHWC" else IMG.transpose(0, 3, 1, 2))
            k = P(w, "static")

            def f(x, k):
                y = tf.nn.conv2d(x, k, [1, 1, 2, 2] if fmt == "NCHW" else [1, 2, 2, 1], "SAME",
                                 data_format=fmt)
                y = tf.nn.bias_add(y, [1.0, 2.0, -1.0, 0.5], data_format=fmt)
                y = tf.nn.max_pool2d(y, 2, 1, "VALID", data_format=fmt)
                return tf.nn.avg_pool2d(y, 2, 1, "SAME", data_format=fmt)
            y = f(x, k)
            return [y, *tf.gradients(tf.reduce_sum(y * y), [x, k])]
        return fn

    g = convert_vs_oracle(build("NCHW"), build("NHWC"),
                          lambda i, v: v.transpose(0, 2, 3, 1) if i < 2 else v)
    assert {"Conv2DBackpropInput", "Conv2DBackpropFilter", "MaxPoolGrad", "AvgPoolGrad",
            "BiasAddGrad"} <= ops_of(g)


def test_conv2d_dilated_filter_grad():
    """TF's CPU has no dilated Conv2DBackpropFilter: the oracle convolves with the kernel spread
    out with zeros (the same convolution, undilated) and keeps every 2nd row/column of its
    filter gradient."""
    x, w = IMG, rnd(2, 3, 3, 2)

    def converted(P):
        xs, k = P(x), P(w, "static")
        y = tf.nn.conv2d(xs, k, 1, "SAME", dilations=2)
        return [y, *tf.gradients(tf.reduce_sum(y * y), [xs, k])]

    def oracle(P):
        xs, k = P(x), P(w, "static")
        spread = tf.reshape(tf.pad(k[:, None, :, None], [[0, 0], [0, 1], [0, 0], [0, 1],
                                                         [0, 0], [0, 0]]), [4, 6, 3, 2])
        y = tf.nn.conv2d(xs, spread[:3, :5], 1, "SAME")
        return [y, *tf.gradients(tf.reduce_sum(y * y), [xs, k])]

    g = convert_vs_oracle(converted, oracle, lambda i, v: v)
    assert "Conv2DBackpropFilter" in ops_of(g)


@pytest.mark.parametrize("training", [False, True])
def test_fused_batch_norm(training):
    x, s, o, m, v = rnd(2, 4, 3, 5), rnd(5), rnd(5), rnd(5), rnd(5, lo=0.5, hi=2)
    run_case(lambda P: list(v1.nn.fused_batch_norm(
        P(x), P(s), P(o), None if training else P(m), None if training else P(v),
        epsilon=1e-3, is_training=training))[:3], rtol=1e-4, atol=1e-5)


def test_losses_and_grads():
    logits, ids = rnd(5, 4), np.array([0, 3, 1, 1, 2], np.int32)
    labels = np.abs(rnd(5, 4))
    labels /= labels.sum(1, keepdims=True)

    def build(P):
        lg, i, lb = P(logits), P(ids), P(labels)
        a = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=i, logits=lg)
        b = tf.nn.softmax_cross_entropy_with_logits(labels=lb, logits=lg)
        return [a, b, *tf.gradients(tf.reduce_sum(a * 2.0) + tf.reduce_mean(b), [lg])]

    g, _ = run_case(build)
    assert {"SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"} <= ops_of(g)


def test_xent_backprop_output():
    """The second output (backprop) of both losses, read directly."""
    logits, ids = rnd(3, 4), np.array([2, 0, 3], np.int64)
    onehot = np.eye(4, dtype=np.float32)[[1, 1, 0]]
    run_case(lambda P: [*tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(
        features=P(logits), labels=P(ids)), *tf.raw_ops.SoftmaxCrossEntropyWithLogits(
        features=P(logits), labels=P(onehot))])


# -- whole models ---------------------------------------------------------------------------------
def frozen_check(build, weights: list[str], rtol=1e-4, atol=1e-5):
    """build(P) -> (outputs, tf.Variables); freeze the variables, run the frozen graph in TF and
    converted, compare; the frozen variables must be initializers named by their TF tensors
    ("w1:0")."""
    f = Feeds()
    g, (outs, vars_) = tf1_graph(lambda: build(f))
    with v1.Session(graph=g) as s:
        s.run(v1.global_variables_initializer())
        frozen = v1.graph_util.convert_variables_to_constants(
            s, g.as_graph_def(add_shapes=True), [o.op.name for o in outs])
    g2 = tf.Graph()
    with g2.as_default():
        tf.import_graph_def(frozen, name="")
    names = [o.name for o in outs]
    expected = tf_run(g2, names, f.feeds)
    model = convert(frozen, inputs=list(f.feeds), outputs=names)
    assert {f"{w}:0" for w in weights} <= {i.name for i in model.graph.initializer}
    compare(expected, ort_run(model, f.feeds, names), names, rtol, atol)
    return g


def _var(name, *shape):
    return tf.Variable(rnd(*shape) * 0.5, name=name)


def test_mlp_frozen():
    x, y = rnd(6, 5), np.array([0, 2, 1, 2, 0, 1], np.int32)

    def build(P):
        xs, ys = P(x), P(y)
        w1, b1, w2, b2 = _var("w1", 5, 8), _var("b1", 8), _var("w2", 8, 3), _var("b2", 3)
        h = tf.tanh(tf.matmul(xs, w1) + b1)
        logits = tf.matmul(tf.nn.relu(h), w2) + b2
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=ys, logits=logits))
        probs = tf.nn.softmax(logits)
        return [loss, probs, *tf.gradients(loss, [w1, b1, w2, b2])], [w1, b1, w2, b2]

    frozen_check(build, ["w1", "b1", "w2", "b2"])


def test_cnn_frozen():
    x, y = rnd(3, 8, 8, 2), np.array([1, 0, 2], np.int32)

    def build(P):
        xs, ys = P(x), P(y)
        k, b = _var("kernel", 3, 3, 2, 4), _var("bias", 4)
        w, wb = _var("dense", 4 * 4 * 4, 3), _var("dense_bias", 3)
        h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(xs, k, 1, "SAME"), b))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        logits = tf.matmul(tf.reshape(h, [-1, 4 * 4 * 4]), w) + wb
        labels = tf.one_hot(ys, 3)
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels,
                                                                      logits=logits))
        return [loss, *tf.gradients(loss, [k, b, w, wb])], [k, b, w, wb]

    g = frozen_check(build, ["kernel", "bias", "dense", "dense_bias"])
    assert {"Conv2DBackpropFilter", "MaxPoolGrad", "BiasAddGrad", "ReluGrad"} <= ops_of(g)


def test_lstm_grads():
    """An LSTM written with tf ops, unrolled: tf.gradients brings ConcatOffset, Split's grads,
    StridedSliceGrad, BroadcastGradientArgs, SigmoidGrad and TanhGrad."""
    x = rnd(2, 3, 4)
    W, bias = rnd(4 + 5, 20) * 0.3, rnd(20) * 0.1

    def build(P):
        xs, w, b = P(x), P(W, "static"), P(bias, "static")
        h = tf.zeros_like(xs[:, 0, :1]) * tf.zeros([1, 5])
        cell = h
        for t in range(3):
            z = tf.matmul(tf.concat([xs[:, t], h], 1), w) + b
            i, f, o, u = tf.split(z, 4, axis=1)
            cell = tf.sigmoid(f) * cell + tf.sigmoid(i) * tf.tanh(u)
            h = tf.sigmoid(o) * tf.tanh(cell)
        loss = tf.reduce_sum(tf.square(h))
        return [loss, *tf.gradients(loss, [w, b, xs])]

    g, _ = run_case(build, rtol=1e-4, atol=1e-5)
    assert {"ConcatOffset", "StridedSliceGrad", "BroadcastGradientArgs"} <= ops_of(g)


# -- errors -----------------------------------------------------------------------------------
def test_unknown_op_names_op_and_node():
    g, y = tf1_graph(lambda: tf.raw_ops.BesselJ0(x=v1.placeholder(tf.float32, [2], name="x"),
                                                 name="my_j0"))
    with pytest.raises(ConversionError, match=r"'BesselJ0'.*'my_j0'"):
        convert(g.as_graph_def(), inputs=["x:0"], outputs=[y.name])


def test_computed_strided_slice_strides_are_an_error():
    def build():
        x = v1.placeholder(tf.float32, [4], name="x")
        s = v1.placeholder(tf.int32, [], name="s")
        return x[::s]
    g, y = tf1_graph(build)
    with pytest.raises(ConversionError, match="strides"):
        convert(g.as_graph_def(), inputs=["x:0", "s:0"], outputs=[y.name])
