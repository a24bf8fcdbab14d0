"""TF ops the converter used to refuse: GatherV2 with batch_dims, Atan2, the sorted segment
reductions (SegmentSum/Mean/Max/Min/Prod), CumulativeLogsumexp, ResizeBicubic and
MaxPoolWithArgmax. Each against TensorFlow as the oracle: the converted forward on onnxruntime,
``onnxgrad.gradients`` of it against ``tf.gradients`` (with a non-uniform upstream gradient),
TF's own gradient graph of the op converted, and a derandomized hypothesis test drawing
shapes, axes and values."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_util import check, ort_run, same as _same, tf, tf1_graph, tf_run, upstream

import onnxgrad
from onnxgrad.converters.tensorflow import ConversionError, convert

v1 = tf.compat.v1
R = np.random.RandomState(7)
inf = np.inf


def rnd(*shape, dtype=np.float32, scale=1.0):
    return (R.randn(*shape) * scale).astype(dtype)


def ops_of(model) -> set:
    return {nd.op_type for nd in model.graph.node}


# -- GatherV2 with batch_dims -----------------------------------------------------------------
GATHER = {  # name: (params shape, indices shape, axis, batch_dims)
    "axis_is_batch": ([2, 3, 4], [2, 5], 1, 1),
    "two_batch_dims": ([2, 3, 4, 5], [2, 3, 6], 2, 2),
    "axis_after_batch": ([2, 3, 4, 5], [2, 6], 2, 1),
    "two_axes_between_two_index_axes": ([2, 3, 4, 5, 2], [2, 3, 2], 3, 1),
    "scalar_index_per_batch": ([3, 4], [3], 1, 1),
    "all_index_axes_batch": ([2, 3, 5], [2, 3], 2, 2),
    "negative_batch_dims": ([2, 3, 4], [2, 5], None, -1),
    "negative_axis": ([2, 3, 4, 5], [2, 6], -2, 1),
    "last_axis": ([2, 3, 4], [2, 3, 2], 2, 2),
}


def _gather_case(pshape, ishape, axis, bd, dtype=np.float32, itype=np.int32):
    ri = len(ishape)
    b = bd + ri if bd < 0 else bd
    a = b if axis is None else axis % len(pshape)
    params = rnd(*pshape, dtype=dtype)
    idx = R.randint(0, pshape[a], ishape).astype(itype)
    return params, idx


@pytest.mark.parametrize("name", GATHER)
def test_gather_batch_dims(name):
    pshape, ishape, axis, bd = GATHER[name]
    params, idx = _gather_case(pshape, ishape, axis, bd)
    model = check(lambda p, i: tf.gather(p, i, axis=axis, batch_dims=bd), {"p": params, "i": idx},
                  diff=["p"])
    assert "GatherND" in ops_of(model)


@pytest.mark.parametrize("dtype, itype", [(np.float64, np.int64), (np.int32, np.int64)])
def test_gather_batch_dims_dtypes(dtype, itype):
    params, idx = _gather_case([2, 3, 4], [2, 5], 2, 1, dtype, itype)
    check(lambda p, i: tf.gather(p, i, axis=2, batch_dims=1), {"p": params, "i": idx},
          diff=["p"] if dtype == np.float64 else [])


def test_gather_batch_dims_static_shapes_and_repeats():
    """Fully static shapes, repeated indices (their gradients add up)."""
    params = rnd(3, 4, 2)
    idx = np.array([[0, 0, 3], [1, 1, 1], [2, 3, 2]], np.int32)
    check(lambda p, i: tf.gather(p, i, axis=1, batch_dims=1), {"p": params, "i": idx},
          diff=["p"], shapes={"p": [3, 4, 2], "i": [3, 3]})


def test_gather_batch_dims_bad_axis_is_an_error():
    """axis < batch_dims: TF refuses it when it runs; the converter when it converts."""
    g, _ = tf1_graph(lambda: tf.raw_ops.GatherV2(
        params=v1.placeholder(tf.float32, [2, 3, 4], name="p"),
        indices=v1.placeholder(tf.int32, [2, 3, 4], name="i"), axis=1, batch_dims=2, name="y"))
    with pytest.raises(ConversionError, match=r"y.*batch_dims 2 and axis 1"):
        convert(g.as_graph_def(add_shapes=True), inputs=["p:0", "i:0"], outputs=["y:0"])


def test_gather_batch_dims_unknown_rank_is_an_error():
    g, _ = tf1_graph(lambda: tf.raw_ops.GatherV2(
        params=v1.placeholder(tf.float32, None, name="p"),
        indices=v1.placeholder(tf.int32, [2, 3], name="i"), axis=2, batch_dims=1, name="y"))
    with pytest.raises(ConversionError, match=r"y.*rank of input 0.*statically"):
        convert(g.as_graph_def(add_shapes=True), inputs=["p:0", "i:0"], outputs=["y:0"])


def test_gather_batch_dims_of_a_saved_model_variable(tmp_path):
    """A SavedModel: tf.gather on a variable with batch_dims (ReadVariableOp + GatherV2);
    forward and the gradient with respect to the frozen weight against TF's tape."""
    w = tf.Variable(rnd(2, 3, 4), name="w")

    class M(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([2, 5], tf.int32)])
        def f(self, i):
            return tf.gather(w, i, axis=2, batch_dims=1)
    m = M()
    m.w = w
    tf.saved_model.save(m, str(tmp_path), signatures=m.f)
    i = np.array([[0, 1, 2, 0, 1], [2, 2, 1, 0, 0]], np.int32)
    want = m.f(tf.constant(i))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(w, i, axis=2, batch_dims=1) *
                             upstream(want.shape, np.float32))
    want_dw = tf.convert_to_tensor(tape.gradient(loss, w)).numpy()
    model = convert(str(tmp_path))
    weight = next(t.name for t in model.graph.initializer if t.name.startswith("w"))
    out = model.graph.output[0].name
    got = ort_run(model, {model.graph.input[0].name: i}, [out])[0]
    _same(got, want.numpy(), "gather")
    res = onnxgrad.gradients(model, out, weight, grad_ys=["gy"])
    dw = ort_run(res.model, {model.graph.input[0].name: i,
                             "gy": upstream(got.shape, np.float32)}, res.grads)[0]
    _same(dw, want_dw, "dgather/dw")


@st.composite
def gather_cases(draw):
    rp = draw(st.integers(1, 4))
    pshape = draw(st.lists(st.integers(1, 3), min_size=rp, max_size=rp))
    bd = draw(st.integers(0, rp - 1))
    axis = draw(st.integers(bd, rp - 1))
    extra = draw(st.lists(st.integers(0, 3), min_size=0, max_size=2))
    ishape = pshape[:bd] + extra
    neg_bd = draw(st.booleans()) and bd > 0
    neg_axis = draw(st.booleans())
    seed = draw(st.integers(0, 2 ** 16))
    return pshape, ishape, axis - rp if neg_axis else axis, bd - len(ishape) if neg_bd else bd, \
        seed


@settings(derandomize=True, max_examples=25, deadline=None)
@given(gather_cases())
def test_gather_batch_dims_hypothesis(case):
    pshape, ishape, axis, bd, seed = case
    rs = np.random.RandomState(seed)
    a = axis % len(pshape)
    params = rs.randn(*pshape).astype(np.float32)
    idx = rs.randint(0, pshape[a], ishape).astype(np.int32)
    check(lambda p, i: tf.gather(p, i, axis=axis, batch_dims=bd), {"p": params, "i": idx},
          diff=["p"], tf_grad_graph=False)


# -- Atan2 ------------------------------------------------------------------------------------
AXES = [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 1e-30, -1e-30, 1e30, -1e30, 0.3, -0.7, inf, -inf]


def test_atan2_all_quadrants_axes_and_infinities():
    """Every pair of special values (signed zeros, tiny, huge, infinite): the output equals
    TF's (+-pi by the sign of a zero y or x), NaN-free; the gradients equal TF's wherever TF's
    are finite, and are NaN at the origin, as TF's. (TF's are also inf or NaN where x^2 + y^2 overflows or
    underflows, at 1e30 and 1e-30; onnxgrad's, through atan(y / x), are finite there.)"""
    y, x = (a.reshape(-1) for a in np.meshgrid(np.array(AXES, np.float32),
                                                np.array(AXES, np.float32)))
    want_y, got_y, want_g, got_g = _atan2_both(y, x)
    _same(got_y, want_y, "atan2")
    assert not np.isnan(got_y).any()
    # (the sign of a zero result, atan2(-0, x >= +0) = -0, is lost: onnxruntime's CPU Where
    # returns +0 when it selects a -0)
    np.testing.assert_array_equal(np.signbit(got_y)[want_y != 0], np.signbit(want_y)[want_y != 0])
    origin = (y == 0) & (x == 0)
    for name, g, w in zip("yx", got_g, want_g):
        ok = np.isfinite(w)
        _same(g[ok], w[ok], f"d/d{name}")
        assert np.isfinite(g[~np.isinf(x) & ~np.isinf(y) & ~origin]).all()
        assert np.isnan(g[origin]).all()


def _atan2_both(y, x, dtype=np.float32):
    def build():
        py, px = (v1.placeholder(tf.as_dtype(dtype), [None], name=k) for k in "yx")
        out = tf.identity(tf.math.atan2(py, px), name="out")
        gy = v1.placeholder(tf.as_dtype(dtype), [None], name="gy")
        return out, gy, tf.gradients(out, [py, px], grad_ys=gy)
    graph, (out, gy, gs) = tf1_graph(build)
    ups = upstream(y.shape, dtype)
    feeds = {"y:0": y.astype(dtype), "x:0": x.astype(dtype)}
    want = tf_run(graph, [out] + gs, {**feeds, "gy:0": ups})
    model = convert(graph.as_graph_def(add_shapes=True), inputs=list(feeds), outputs=["out:0"])
    res = onnxgrad.gradients(model, "out:0", list(feeds), grad_ys=["gy"])
    got = ort_run(res.model, {**feeds, "gy": ups}, ["out:0", *res.grads])
    return want[0], got[0], want[1:], got[1:]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_atan2_random(dtype):
    y, x = rnd(3, 5, dtype=dtype, scale=3), rnd(3, 5, dtype=dtype, scale=3)
    check(lambda y, x: tf.math.atan2(y, x), {"y": y, "x": x}, diff=["y", "x"],
          rtol=1e-12 if dtype == np.float64 else 2e-6)


def test_atan2_broadcasts():
    check(lambda y, x: tf.math.atan2(y, x), {"y": rnd(4, 1), "x": rnd(1, 3)}, diff=["y", "x"])


@settings(derandomize=True, max_examples=40, deadline=None)
@given(st.lists(st.tuples(*[st.one_of(
    st.floats(-1e6, 1e6, width=32).filter(lambda v: v == 0 or abs(v) > 1e-30),
    st.sampled_from([0.0, -0.0, 1.0, -1.0])) for _ in range(2)]), min_size=1, max_size=8))
def test_atan2_hypothesis(pairs):
    y, x = (np.array(v, np.float32) for v in zip(*pairs))
    want_y, got_y, want_g, got_g = _atan2_both(y, x)
    _same(got_y, want_y, "atan2", rtol=3e-6)
    for name, g, w in zip("yx", got_g, want_g):
        ok = np.isfinite(w)
        _same(g[ok], w[ok], f"d/d{name}", rtol=1e-5, atol=1e-30)


# -- sorted segment reductions ------------------------------------------------------------------
SEGMENTS = {"SegmentSum": tf.math.segment_sum, "SegmentMean": tf.math.segment_mean,
            "SegmentMax": tf.math.segment_max, "SegmentMin": tf.math.segment_min,
            "SegmentProd": tf.math.segment_prod}
SEG_IDS = np.array([1, 1, 1, 3, 3, 4, 6], np.int32)  # segments 0, 2, 5 empty


@pytest.mark.parametrize("op", SEGMENTS)
def test_segment_ops(op):
    """Empty segments (leading, inner) are 0 (1 for prod); an all-negative segment's max is
    negative, not the 0 of an empty one; data of rank 3; TF's gradient graph converts too."""
    data = rnd(7, 2, 3)
    data[3:5] = -np.abs(data[3:5]) - 0.5  # segment 3: all negative
    model = check(lambda d, i: SEGMENTS[op](d, i), {"d": data, "i": SEG_IDS}, diff=["d"])
    assert "ScatterND" in ops_of(model)


def test_segment_max_min_ties_split_like_tf():
    """Exact ties (integer-valued floats): TF's gradient splits evenly among the tied rows,
    as onnxgrad's ScatterND max/min rule does."""
    data = np.array([[1, 2], [1, 2], [0, 2], [3, 3], [3, -1]], np.float32)
    ids = np.array([0, 0, 0, 2, 2], np.int32)
    for fn in (tf.math.segment_max, tf.math.segment_min):
        check(lambda d, i: fn(d, i), {"d": data, "i": ids}, diff=["d"])


def test_segment_prod_zeros():
    """One zero in a segment (its gradient is the product of the others), two zeros (all 0)."""
    data = np.array([[2, 0, 3], [0, 4, 0], [5, 6, 0], [0.5, 2, 3]], np.float32)
    ids = np.array([0, 0, 0, 1], np.int32)
    check(lambda d, i: tf.math.segment_prod(d, i), {"d": data, "i": ids}, diff=["d"])


@pytest.mark.parametrize("op", SEGMENTS)
def test_segment_ops_ints_and_empty(op):
    """Integer data (SegmentMean truncates, as TF's), int64 ids, and no rows at all."""
    data = R.randint(-9, 10, (6, 2)).astype(np.int32)
    ids = np.array([0, 0, 2, 2, 2, 3], np.int64)
    check(lambda d, i: SEGMENTS[op](d, i), {"d": data, "i": ids})
    check(lambda d, i: SEGMENTS[op](d, i), {"d": np.zeros((0, 3), np.float32),
                                            "i": np.zeros(0, np.int32)})


@pytest.mark.parametrize("op", ["SegmentMean", "SegmentMax"])
def test_segment_ops_float64_vector(op):
    data = rnd(6, dtype=np.float64)
    check(lambda d, i: SEGMENTS[op](d, i), {"d": data, "i": np.array([0, 2, 2, 2, 3, 3],
                                                                     np.int32)}, diff=["d"])


@settings(derandomize=True, max_examples=25, deadline=None)
@given(st.sampled_from(sorted(SEGMENTS)), st.lists(st.integers(0, 3), min_size=1, max_size=6),
       st.lists(st.integers(1, 3), min_size=0, max_size=2), st.integers(0, 2 ** 16))
def test_segment_ops_hypothesis(op, gaps, tail, seed):
    """Sorted ids drawn as gaps (a gap > 1 leaves empty segments); distinct data values (no
    ties for max and min)."""
    ids = np.cumsum(gaps).astype(np.int32)
    rs = np.random.RandomState(seed)
    size = len(ids) * int(np.prod(tail))
    data = (rs.permutation(size) - size / 2 + rs.uniform(0.1, 0.9, size)).astype(np.float32)
    data = (data / max(size / 4, 1)).reshape([len(ids), *tail])
    check(lambda d, i: SEGMENTS[op](d, i), {"d": data, "i": ids}, diff=["d"], rtol=1e-5,
          tf_grad_graph=False)


# -- CumulativeLogsumexp ----------------------------------------------------------------------
FLAGS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("exclusive, reverse", FLAGS)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cumulative_logsumexp(axis, exclusive, reverse):
    x = rnd(4, 5, 3, scale=3)
    check(lambda x: tf.math.cumulative_logsumexp(x, axis=axis, exclusive=exclusive,
                                                 reverse=reverse), {"x": x}, diff=["x"],
          rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-5)


@pytest.mark.parametrize("exclusive, reverse", FLAGS)
def test_cumulative_logsumexp_large_and_infinite(exclusive, reverse):
    """1000 neither overflows nor does -1000 underflow next to 0; -inf terms add nothing; a
    prefix of -inf only (and an exclusive first element) is -inf; +inf makes +inf. Gradients
    where TF's are finite (TF's own loses ~1e-4 relative next to 1000: its gradient formula
    exponentiates differences of ~1000)."""
    x = np.array([[1000, 1000, -inf, 1, -1000],
                  [-1000, 0, 1000, 5, -5],
                  [-inf, -inf, 2, -inf, 3],
                  [3, -2, inf, 1, 0]], np.float32)
    fn = lambda x: tf.math.cumulative_logsumexp(x, axis=1, exclusive=exclusive,  # noqa: E731
                                                reverse=reverse)
    model = check(fn, {"x": x[:2]}, diff=["x"], rtol=1e-6, grad_rtol=3e-4, grad_atol=1e-4)
    assert model is not None
    # with infinities the forward matches exactly; gradients where TF's is finite
    g, (y, gy, gs) = tf1_graph(lambda: _cum_graph(fn))
    ups = upstream(x.shape, np.float32)
    want = tf_run(g, [y, *gs], {"x:0": x, "gy:0": ups})
    m = convert(g.as_graph_def(add_shapes=True), inputs=["x:0"], outputs=["y:0"])
    res = onnxgrad.gradients(m, "y:0", "x:0", grad_ys=["gy"])
    got = ort_run(res.model, {"x:0": x, "gy": ups}, ["y:0", res.grads[0]])
    _same(got[0], want[0], "forward", rtol=1e-6)
    ok = np.isfinite(want[1])
    _same(got[1][ok], want[1][ok], "gradient", rtol=3e-4, atol=1e-4)


def _cum_graph(fn):
    x = v1.placeholder(tf.float32, [None, None], name="x")
    y = tf.identity(fn(x), name="y")
    gy = v1.placeholder(tf.float32, [None, None], name="gy")
    return y, gy, tf.gradients(y, x, grad_ys=gy)


def test_cumulative_logsumexp_float64():
    check(lambda x: tf.math.cumulative_logsumexp(x, axis=0, reverse=True),
          {"x": rnd(6, 2, dtype=np.float64, scale=10)}, diff=["x"], rtol=1e-12,
          grad_rtol=1e-9, grad_atol=1e-12)


@settings(derandomize=True, max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(0, 2),
       st.booleans(), st.booleans(), st.integers(0, 2 ** 16), st.sampled_from([1.0, 30.0]))
def test_cumulative_logsumexp_hypothesis(shape, axis, exclusive, reverse, seed, scale):
    axis %= len(shape)
    x = (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)
    check(lambda x: tf.math.cumulative_logsumexp(x, axis=axis, exclusive=exclusive,
                                                 reverse=reverse), {"x": x}, diff=["x"],
          rtol=1e-5, atol=1e-5, grad_rtol=3e-4, grad_atol=1e-4, tf_grad_graph=False)


# -- ResizeBicubic ----------------------------------------------------------------------------
RESIZE_FLAGS = {"half_pixel": (False, True), "align_corners": (True, False),
                "legacy": (False, False)}


@pytest.mark.parametrize("size", [(11, 9), (3, 2), (5, 5), (1, 1)])
@pytest.mark.parametrize("flags", RESIZE_FLAGS)
def test_resize_bicubic(flags, size):
    """Up, down, same size and to one pixel, with each coordinate convention: TF's tabulated
    weights exactly (ONNX's Resize(cubic) would differ by ~1e-3); the gradient and TF's
    ResizeBicubicGrad."""
    align, half = RESIZE_FLAGS[flags]
    fn = lambda x: tf.raw_ops.ResizeBicubic(images=x, size=size, align_corners=align,  # noqa
                                            half_pixel_centers=half)
    check(fn, {"x": rnd(2, 5, 4, 3)}, diff=["x"], rtol=1e-5, atol=2e-6)


def test_resize_bicubic_tf2_keras_and_uint8():
    """tf.image.resize(bicubic) and Keras's Resizing emit ResizeBicubic with half pixel
    centers; uint8 images give float32."""
    check(lambda x: tf.image.resize(x, [7, 9], method="bicubic"), {"x": rnd(1, 4, 5, 2)},
          diff=["x"], atol=2e-6)
    check(lambda x: tf.keras.layers.Resizing(3, 7, interpolation="bicubic")(x),
          {"x": rnd(2, 6, 5, 1)}, diff=["x"], atol=2e-6)
    img = R.randint(0, 256, (1, 5, 6, 3)).astype(np.uint8)
    check(lambda x: v1.image.resize_bicubic(x, [8, 4], align_corners=True), {"x": img},
          rtol=1e-5, atol=5e-4)


@pytest.mark.parametrize("op", ["ResizeBicubic", "ResizeBilinear"])
def test_resize_float64_and_its_grad_op(op):
    """float64 images: the output is float32 and TF's *Grad op (float32 grads, float64 dx)
    converts (ResizeBilinearGrad mixed float32 and float64 in one Einsum before)."""
    fn = lambda x: getattr(tf.raw_ops, op)(images=x, size=[7, 3],  # noqa: E731
                                           half_pixel_centers=True)
    check(fn, {"x": rnd(1, 4, 5, 2, dtype=np.float64)}, diff=["x"], atol=2e-6)


def test_resize_antialias_is_a_clear_error():
    """tf.image.resize(antialias=True) emits ScaleAndTranslate: refused, naming the node."""
    g, _ = tf1_graph(lambda: tf.image.resize(v1.placeholder(tf.float32, [1, 8, 8, 1], name="x"),
                                             [3, 3], method="bicubic", antialias=True))
    with pytest.raises(ConversionError, match="ScaleAndTranslate.*antialias"):
        convert(g.as_graph_def(add_shapes=True), inputs=["x:0"],
                outputs=[next(n.name for n in g.as_graph_def().node
                              if n.op == "ScaleAndTranslate") + ":0"])


def test_resize_bicubic_computed_size():
    check(lambda x: tf.image.resize(x, tf.shape(x)[1:3] * 2 - 1, method="bicubic"),
          {"x": rnd(1, 4, 3, 2)}, diff=["x"], atol=2e-6)


@settings(derandomize=True, max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 9), st.integers(1, 9),
       st.sampled_from(sorted(RESIZE_FLAGS)), st.integers(0, 2 ** 16))
def test_resize_bicubic_hypothesis(h, w, oh, ow, flags, seed):
    align, half = RESIZE_FLAGS[flags]
    x = np.random.RandomState(seed).randn(1, h, w, 2).astype(np.float32)
    check(lambda x: tf.raw_ops.ResizeBicubic(images=x, size=[oh, ow], align_corners=align,
                                             half_pixel_centers=half),
          {"x": x}, diff=["x"], rtol=1e-5, atol=3e-6, tf_grad_graph=False)


# -- MaxPoolWithArgmax ------------------------------------------------------------------------
POOLS = {  # name: (ksize, strides, padding)
    "2x2_s2_valid": (2, 2, "VALID"), "3x3_s2_same": (3, 2, "SAME"),
    "3x2_s1_same": ([1, 3, 2, 1], [1, 1, 1, 1], "SAME"), "2x3_s3_valid": ([1, 2, 3, 1], 3, "VALID"),
}


def _argmax_pool(ksize, strides, padding, include_batch, targmax=tf.int64):
    def fn(x):
        y, arg = tf.nn.max_pool_with_argmax(x, ksize, strides, padding, output_dtype=targmax,
                                            include_batch_in_index=include_batch)
        return y, arg
    return fn


@pytest.mark.parametrize("include_batch", [False, True])
@pytest.mark.parametrize("name", POOLS)
def test_max_pool_with_argmax(name, include_batch):
    """The pooled values and TF's NHWC flat argmax (with and without the batch in it); the
    gradient of the values (TF's MaxPoolGradWithArgmax converted too)."""
    pool = _argmax_pool(*POOLS[name], include_batch)
    x = rnd(2, 7, 6, 3)
    check(lambda x: pool(x)[0], {"x": x}, diff=["x"])
    model = check(lambda x: pool(x)[1], {"x": x})
    assert "MaxPool" in ops_of(model)


def test_max_pool_with_argmax_ties_and_int32():
    """Exact ties (integer-valued inputs): TF and onnxruntime both take a window's first
    maximum in row-major order; int32 argmax; float64. (TF has no MaxPoolGradWithArgmax
    kernel for an int32 argmax.)"""
    x = R.randint(0, 3, (2, 5, 6, 2)).astype(np.float64)
    for include_batch in (False, True):
        check(lambda x: _argmax_pool(3, 2, "SAME", include_batch, tf.int32)(x)[1], {"x": x})
        check(lambda x: _argmax_pool(3, 2, "SAME", include_batch)(x)[0], {"x": x}, diff=["x"])


@settings(derandomize=True, max_examples=15, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 3), st.integers(1, 3),
       st.integers(1, 3), st.sampled_from(["SAME", "VALID"]), st.booleans(),
       st.integers(0, 2 ** 16))
def test_max_pool_with_argmax_hypothesis(h, w, kh, kw, s, padding, include_batch, seed):
    if padding == "VALID" and (kh > h or kw > w):
        return
    rs = np.random.RandomState(seed)
    x = rs.permutation(2 * h * w * 2).reshape(2, h, w, 2).astype(np.float32)  # no ties
    pool = _argmax_pool([1, kh, kw, 1], s, padding, include_batch)
    shapes = {"x": list(x.shape)} if s > min(kh, kw) else None  # (see the next test)
    check(lambda x: pool(x)[1], {"x": x}, shapes=shapes)
    check(lambda x: pool(x)[0], {"x": x}, diff=["x"], shapes=shapes, tf_grad_graph=False)


def test_max_pool_with_argmax_same_stride_past_window():
    """SAME with a stride past the window: TF pads max(total, 0) (onnxruntime refuses the
    negative pads of auto_pad): explicit pads from the static spatial sizes, else a Pad at run
    time, whose indices move back to the unpadded plane."""
    x = rnd(2, 5, 7, 2)
    for shapes in ({"x": [None, 5, 7, 2]}, {"x": [None, None, None, 2]}):
        for batch in (False, True):
            check(lambda x: _argmax_pool([1, 2], [3, 4], "SAME", batch)(x)[1], {"x": x},
                  shapes=shapes)
            check(lambda x: _argmax_pool([1, 2], [3, 4], "SAME", batch)(x)[0], {"x": x},
                  diff=["x"], shapes=shapes)


def test_is_inf_in_float16_runs():
    """onnxruntime's CPU has no float16 IsInf: the converted IsInf, IsFinite, MulNoNan and
    Atan2 (whose forms test for infinities) read their float16 input cast to float32, exactly,
    and give TF's results."""
    def build():
        x = v1.placeholder(tf.float16, [None], name="x")
        y = v1.placeholder(tf.float16, [None], name="y")
        return x, y, [tf.identity(tf.math.is_inf(x), name="a"),
                      tf.identity(tf.math.is_finite(x), name="b"),
                      tf.identity(tf.math.multiply_no_nan(x, y), name="c"),
                      tf.identity(tf.math.atan2(y, x), name="d")]
    graph, (x, y, outs) = tf1_graph(build)
    xs = np.array([0, -0.0, 1, -2.5, inf, -inf, np.nan, 6e4, 1e-4], np.float16)
    ys = np.array([1, 0, inf, np.nan, 0, 2, 1, -3, 0.5], np.float16)
    want = tf_run(graph, outs, {"x:0": xs, "y:0": ys})
    model = convert(graph.as_graph_def(), inputs=["x:0", "y:0"],
                    outputs=["a:0", "b:0", "c:0", "d:0"])
    onnx.checker.check_model(model, full_check=True)
    got = ort_run(model, {"x:0": xs, "y:0": ys}, ["a:0", "b:0", "c:0", "d:0"])
    for g, w, k in zip(got, want, "abcd"):
        _same(g, w, k, rtol=2e-3, atol=1e-3)


# -- Roll (session 36: refused before, found by bench/fuzz_tf.py) -----------------------------
@settings(derandomize=True, max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_roll_hypothesis(shape, data):
    """tf.roll with shifts of either sign and beyond the length, negative and repeated axes
    (their shifts add up), float32 or float64, a constant or a fed shift: the forward and the
    gradient equal TF's."""
    r = len(shape)
    k = data.draw(st.integers(1, 3))
    axes = data.draw(st.lists(st.integers(-r, r - 1), min_size=k, max_size=k))
    shifts = data.draw(st.lists(st.integers(-9, 9), min_size=k, max_size=k))
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    x = rnd(*shape, dtype=dtype)
    if data.draw(st.booleans()):
        check(lambda x: tf.roll(x, shifts, axes) * tf.sin(x), {"x": x}, diff=("x",))
    else:
        check(lambda x, s: tf.roll(x, s, axes), {"x": x, "s": np.array(shifts, np.int32)},
              diff=("x",))


def test_roll_of_an_empty_axis():
    check(lambda x: tf.roll(x, 2, 0), {"x": np.zeros((0, 3), np.float32)})


# -- MirrorPadGrad (session 36: TF's gradient graph of a reflect pad was refused) -----------
@settings(derandomize=True, max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.sampled_from(["REFLECT",
                                                                             "SYMMETRIC"]),
       st.data())
def test_mirror_pad_grad_hypothesis(shape, mode, data):
    """TF's gradient graph of tf.pad REFLECT / SYMMETRIC (MirrorPadGrad), converted, equals
    TF's gradient; so do onnxgrad's and the forward (tf_util.check)."""
    top = (lambda d: d - 1) if mode == "REFLECT" else (lambda d: d)
    pads = [[data.draw(st.integers(0, top(d))), data.draw(st.integers(0, top(d)))]
            for d in shape]
    x = rnd(*shape, dtype=data.draw(st.sampled_from([np.float32, np.float64])))
    check(lambda x: tf.sin(tf.pad(x, pads, mode)), {"x": x}, diff=("x",))


# -- MatrixSetDiag (session 36: TF's gradient graph of diag_part was refused) --------------
@settings(derandomize=True, max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=2, max_size=4), st.data())
def test_matrix_set_diag_hypothesis(shape, data):
    """tf.linalg.set_diag with the main diagonal of [..., M, N] (M < N, M > N, square), and
    TF's gradient graph of tf.linalg.diag_part (MatrixSetDiagV3), converted, equal TF's."""
    x = rnd(*shape, dtype=data.draw(st.sampled_from([np.float32, np.float64])))
    d = rnd(*shape[:-2], min(shape[-2:]), dtype=x.dtype)
    check(lambda x, d: tf.linalg.set_diag(x, tf.sin(d)) * x, {"x": x, "d": d}, diff=("x", "d"))
    check(lambda x: tf.linalg.diag_part(x) * 2.0, {"x": x}, diff=("x",))
    # trace's and diag_part's gradient graphs on [M, N]: MatrixDiagV3 with num_rows M and
    # num_cols N (refused where M != N before session 36)
    check(lambda x: tf.linalg.trace(x) * 2.0, {"x": x}, diff=("x",))


@pytest.mark.parametrize("rows, cols", [(3, -1), (-1, 3), (4, 3), (3, 5), (-1, -1)])
def test_matrix_diag_v3_sizes(rows, cols):
    """MatrixDiagV3 (k = 0) with num_rows / num_cols given or inferred (m where not given),
    square or not, and its gradient."""
    d = rnd(2, 3, dtype=np.float64)
    check(lambda d: tf.raw_ops.MatrixDiagV3(diagonal=tf.sin(d), k=0, num_rows=rows,
                                            num_cols=cols, padding_value=0.5,
                                            align="RIGHT_LEFT"),
          {"d": d}, diff=("d",), shapes={"d": [2, 3]})
