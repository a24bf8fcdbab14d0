"""SAME padding of TF's window ops with a stride larger than the window.

TF pads each spatial axis by max(total, 0), total = (ceil(n / s) - 1) * s + (k - 1) * d + 1 - n;
with a stride past the window total can be negative. The converter wrote ONNX's
``auto_pad=SAME_UPPER``, whose pads are that total unclamped: ``tf.nn.max_pool2d(x, 1, 3,
"SAME")`` on a 5x5 image converted, and onnxruntime refused to run it ("padding values must be
non-negative"). Now explicit pads from the static sizes, or a Pad computed at run time where
they are not static (MaxPoolWithArgmax's and MaxPoolGrad's indices move back to the unpadded
input). Each case: the converted forward against TF, ``onnxgrad.gradients`` against
``tf.gradients`` (a non-uniform upstream gradient), and TF's own gradient graph converted, with
static and with unknown spatial sizes, in 1-D, 2-D and 3-D where TF has the op.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_util import ort_run, tf, tf1_graph, tf_run

import onnxgrad
from onnxgrad.converters.tensorflow import convert

v1 = tf.compat.v1


def distinct(shape, seed=0):
    """Values all different (no ties in a window's maximum) and well apart: a permutation of
    0 .. size-1, scaled."""
    rng = np.random.RandomState(seed)
    return (rng.permutation(int(np.prod(shape))).reshape(shape) * 0.25 - 1).astype(np.float32)


def upstream(shape):
    k = np.arange(int(np.prod(shape)), dtype=np.float64)
    return (np.cos(k * 0.7) * 1.5 + 0.25).reshape(shape).astype(np.float32)


def _close(got, want, what):
    """float32 sums of products of values up to ~35 (:func:`distinct`): absolute error relative
    to the largest value (cancellation leaves small results with large ones' rounding)."""
    scale = max(1.0, float(np.abs(want).max())) if np.size(want) else 1.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


def check(fn, x, static=True, grad=True):
    """fn(x) in a TF1 graph with x's spatial sizes static or not: forward, onnxgrad's gradient
    and TF's gradient graph converted, all against TF."""
    def build():
        shape = list(x.shape) if static else [x.shape[0], *[None] * (x.ndim - 2), x.shape[-1]]
        xp = v1.placeholder(tf.float32, shape, name="x")
        y = tf.identity(fn(xp), name="y")
        if not grad:
            return xp, y, None, None
        gy = v1.placeholder(tf.float32, [None] * y.shape.rank, name="gy")
        return xp, y, gy, tf.gradients(y, xp, grad_ys=gy)[0]
    graph, (xp, y, gy, gx) = tf1_graph(build)
    want_y = tf_run(graph, y, {xp: x})
    gd = graph.as_graph_def(add_shapes=True)
    model = convert(gd, inputs=["x:0"], outputs=["y:0"])
    onnx.checker.check_model(model, full_check=True)
    got = ort_run(model, {"x:0": x}, ["y:0"])[0]
    assert got.dtype == want_y.dtype and got.shape == want_y.shape, (got.shape, want_y.shape)
    _close(got, want_y, "forward")
    if not grad:
        return model
    gys = upstream(want_y.shape)
    want_g = tf_run(graph, gx, {xp: x, gy: gys})
    res = onnxgrad.gradients(model, "y:0", ["x:0"], grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    _close(ort_run(res.model, {"x:0": x, "gy": gys}, res.grads)[0], want_g, "onnxgrad gradient")
    m2 = convert(gd, inputs=["x:0", "gy:0"], outputs=[gx.name])
    _close(ort_run(m2, {"x:0": x, "gy:0": gys}, [gx.name])[0], want_g, "TF's gradient graph")
    return model


R = np.random.RandomState(3)
W1, W2, W3 = (R.randn(*s).astype(np.float32) for s in ([2, 3, 2], [1, 2, 3, 2],
                                                        [1, 2, 1, 3, 2]))
WD = R.randn(2, 1, 3, 2).astype(np.float32)
CASES = {  # name: (fn, input shape); every one has a stride larger than its window somewhere
    "max_pool1d": (lambda x: tf.nn.max_pool1d(x, 2, 3, "SAME"), [2, 7, 3]),
    "avg_pool1d": (lambda x: tf.nn.avg_pool1d(x, 1, 4, "SAME"), [2, 6, 3]),
    "conv1d": (lambda x: tf.nn.conv1d(x, W1, 3, "SAME"), [2, 8, 3]),
    "max_pool2d": (lambda x: tf.nn.max_pool2d(x, 1, 3, "SAME"), [1, 5, 5, 2]),
    "max_pool2d_even": (lambda x: tf.nn.max_pool2d(x, [2, 1], [3, 4], "SAME"), [2, 8, 6, 3]),
    "avg_pool2d": (lambda x: tf.nn.avg_pool2d(x, [2, 1], [3, 4], "SAME"), [2, 7, 6, 3]),
    "max_pool_v2": (lambda x: tf.raw_ops.MaxPoolV2(input=x, ksize=[1, 1, 2, 1],
                                                   strides=[1, 3, 3, 1], padding="SAME"),
                    [1, 7, 5, 2]),
    "conv2d": (lambda x: tf.nn.conv2d(x, W2, [3, 4], "SAME"), [2, 7, 8, 3]),
    "depthwise": (lambda x: tf.nn.depthwise_conv2d(x, WD, [1, 3, 3, 1], "SAME"), [1, 7, 6, 3]),
    "argmax_values": (lambda x: tf.nn.max_pool_with_argmax(x, [2, 1], [3, 4], "SAME")[0],
                      [2, 5, 7, 3]),
    "max_pool3d": (lambda x: tf.nn.max_pool3d(x, [1, 2, 1], [3, 3, 2], "SAME"), [1, 5, 6, 4, 2]),
    "avg_pool3d": (lambda x: tf.nn.avg_pool3d(x, [1, 2, 1], [3, 3, 2], "SAME"), [1, 5, 6, 4, 2]),
    "conv3d": (lambda x: tf.nn.conv3d(x, W3, [1, 3, 3, 2, 1], "SAME"), [1, 5, 6, 4, 3]),
}


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_same_padding_stride_past_the_window(name, static):
    fn, shape = CASES[name]
    model = check(fn, distinct(shape), static=static)
    if static:  # explicit pads, never an auto_pad that onnxruntime may take negative
        assert not any(a.name == "auto_pad" for nd in model.graph.node for a in nd.attribute)


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("include_batch", [False, True])
def test_max_pool_with_argmax_indices_stride_past_the_window(static, include_batch):
    """The flat indices in TF's layout, also where the pads are the run time's (the indices
    of the padded plane moved back to the input's)."""
    x = distinct([2, 5, 7, 3], seed=1)
    for ksize, strides in (([2, 1], [3, 4]), (1, 3), ([1, 3], [4, 2])):
        check(lambda x: tf.nn.max_pool_with_argmax(
            x, ksize, strides, "SAME", include_batch_in_index=include_batch)[1],
            x, static=static, grad=False)


def test_conv2d_transpose_stride_past_the_window():
    """Conv2DBackpropInput as a forward op (conv2d_transpose): its pads are TF's SAME of the
    forward conv, clamped at 0."""
    w = R.randn(1, 2, 3, 2).astype(np.float32)  # [k_h, k_w, out, in]
    x = distinct([2, 3, 2, 2], seed=2)
    check(lambda x: tf.nn.conv2d_transpose(x, w, [2, 8, 7, 3], [3, 4], "SAME"), x)


FILTERS = {  # name: (fn(x, w), x shape, w shape)
    "conv2d": (lambda x, w: tf.nn.conv2d(x, w, [3, 4], "SAME"), [2, 7, 8, 3], [1, 2, 3, 2]),
    "depthwise": (lambda x, w: tf.nn.depthwise_conv2d(x, w, [1, 3, 3, 1], "SAME"), [1, 7, 6, 3],
                  [2, 1, 3, 2]),
    "conv3d": (lambda x, w: tf.nn.conv3d(x, w, [1, 3, 3, 2, 1], "SAME"), [1, 5, 6, 4, 3],
               [1, 2, 1, 3, 2]),
}


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_filter_gradients_stride_past_the_window(name):
    """The filter's gradient (TF's Conv*BackpropFilter, converted, and onnxgrad's)."""
    fn, xs, ws = FILTERS[name]
    x, w = distinct(xs), np.random.RandomState(4).randn(*ws).astype(np.float32)

    def build():
        xp = v1.placeholder(tf.float32, xs, name="x")
        wp = v1.placeholder(tf.float32, ws, name="w")
        y = tf.identity(fn(xp, wp), name="y")
        gy = v1.placeholder(tf.float32, y.shape, name="gy")
        return y, gy, tf.gradients(y, wp, grad_ys=gy)[0]
    graph, (y, gy, gw) = tf1_graph(build)
    feeds = {"x:0": x, "w:0": w}
    gys = upstream(y.shape.as_list())
    want = tf_run(graph, gw, {**feeds, gy: gys})
    gd = graph.as_graph_def(add_shapes=True)
    m = convert(gd, inputs=["x:0", "w:0", "gy:0"], outputs=[gw.name])
    _close(ort_run(m, {**feeds, "gy:0": gys}, [gw.name])[0], want, "TF's filter gradient")
    model = convert(gd, inputs=["x:0", "w:0"], outputs=["y:0"])
    res = onnxgrad.gradients(model, "y:0", ["w:0"], grad_ys=["gy"])
    _close(ort_run(res.model, {**feeds, "gy": gys}, res.grads)[0], want, "onnxgrad's")


# (fixed draws) every window op that pads SAME, over drawn sizes, windows, strides (often past
# the window) and dilations (Conv, where TF takes them with unit strides)
@st.composite
def windows(draw):
    op = draw(st.sampled_from(["max", "avg", "conv"]))
    rank = draw(st.integers(1, 3))
    size = [draw(st.integers(1, 8)) for _ in range(rank)]
    kernel = [draw(st.integers(1, 3)) for _ in range(rank)]
    strides = [draw(st.integers(1, 4)) for _ in range(rank)]
    dilations = [1] * rank
    if op == "conv" and draw(st.booleans()):
        strides = [1] * rank
        dilations = [draw(st.integers(1, 3)) for _ in range(rank)]
    return op, size, kernel, strides, dilations, draw(st.booleans())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(windows())
def test_same_padding_generated(case):
    op, size, kernel, strides, dilations, static = case
    rank = len(size)
    x = distinct([2, *size, 2], seed=sum(size))
    if op == "conv":
        w = np.random.RandomState(rank).randn(*kernel, 2, 3).astype(np.float32)
        fn = lambda x: tf.nn.convolution(x, w, strides, "SAME", dilations=dilations)  # noqa: E731
    else:
        pool = tf.nn.max_pool if op == "max" else tf.nn.avg_pool
        fn = lambda x: pool(x, kernel, strides, "SAME")  # noqa: E731
    check(fn, x, static=static)
