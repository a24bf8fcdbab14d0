"""TF's gradient ops of convolutions, pools and LRN that the converter refused: LRNGrad (no
converter), the grouped Conv2DBackpropFilter (an error), and Conv2DBackpropInput,
Conv3DBackpropInputV2, DepthwiseConv2dNativeBackpropInput and AvgPoolGrad/AvgPool3DGrad
(and the filter gradients) where the input's spatial sizes are known only at run time (an
error: ConvTranspose's pads are attributes; now the full transposed op is cut to the run-time
sizes). TF is the oracle: TF's gradient graph (tf.gradients, TF1 graph mode) converted, and
``onnxgrad.gradients`` of the converted forward, against TF's values, over drawn shapes,
windows, strides (often past the window), dilations where TF's CPU kernels take them, VALID and
SAME; with unknown spatial sizes one onnxruntime session runs two different sizes. Every model
passes the full ONNX check.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_util import tf, tf1_graph

import onnxgrad
from onnxgrad.converters.tensorflow import convert
from onnxgrad.runtime import ort_module, session_options

v1 = tf.compat.v1


def values(shape, seed):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def upstream(shape):
    """A non-uniform upstream gradient with both signs."""
    k = np.arange(int(np.prod(shape)), dtype=np.float64)
    return (np.cos(k * 0.7) * 1.5 + 0.25).reshape(shape).astype(np.float32)


def session(model):
    onnx.checker.check_model(model, full_check=True)
    return ort_module().InferenceSession(model.SerializeToString(), session_options(),
                                         providers=["CPUExecutionProvider"])


def _close(got, want, what, tol):
    """float32 sums of products: the absolute error scales with the largest value."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


def check(fn, xshapes, w=None, ops=(), static=False, channels_first=False, tol=2e-5):
    """fn(x) (fn(x, w) with a filter w) in a TF1 graph whose x has x's first shape, or unknown
    spatial sizes (static=False): TF's gradient graph (dx, and dw; it holds the TF ``ops``)
    converted and onnxgrad's gradients of the converted forward, run in one session each on
    every shape in ``xshapes`` (only the first where static), against TF."""
    xshapes = xshapes[:1] if static else xshapes
    first = list(xshapes[0])

    def build():
        shape = first if static else (
            [first[0], first[1], *[None] * (len(first) - 2)] if channels_first
            else [first[0], *[None] * (len(first) - 2), first[-1]])
        xp = v1.placeholder(tf.float32, shape, name="x")
        wp = None if w is None else v1.placeholder(tf.float32, w.shape, name="w")
        y = tf.identity(fn(xp) if w is None else fn(xp, wp), name="y")
        gy = v1.placeholder(tf.float32, [None] * y.shape.rank, name="gy")
        wrt = [xp] if w is None else [xp, wp]
        return y, gy, tf.gradients(y, wrt, grad_ys=gy)
    graph, (y, gy, grads) = tf1_graph(build)
    gd = graph.as_graph_def(add_shapes=True)
    assert set(ops) <= {nd.op for nd in gd.node}, ops
    ins = ["x:0"] if w is None else ["x:0", "w:0"]
    tf_grad = session(convert(gd, inputs=[*ins, "gy:0"], outputs=[g.name for g in grads]))
    res = onnxgrad.gradients(convert(gd, inputs=ins, outputs=["y:0"]), "y:0", ins,
                             grad_ys=["gy"])
    ours = session(res.model)
    with v1.Session(graph=graph) as s:
        for k, xs in enumerate(xshapes):
            feeds = {"x:0": values(xs, k)} if w is None else {"x:0": values(xs, k), "w:0": w}
            gys = upstream(s.run(y, feeds).shape)
            want = s.run(grads, {**feeds, "gy:0": gys})
            got = tf_grad.run(None, {**feeds, "gy:0": gys})
            got2 = ours.run(res.grads, {**feeds, "gy": gys})
            for name, g, g2, wv in zip(ins, got, got2, want):
                _close(g, wv, f"{name} {xs}: TF's gradient graph", tol)
                _close(g2, wv, f"{name} {xs}: onnxgrad's gradient", tol)


def _window(draw, rank, kmax=3, smax=4, dmax=3, dilate=True):
    """(kernel, strides, dilations): strides often past the window; dilations (unit strides,
    as TF takes them) in some draws."""
    kernel = [draw(st.integers(1, kmax)) for _ in range(rank)]
    strides, dilations = [draw(st.integers(1, smax)) for _ in range(rank)], [1] * rank
    if dilate and draw(st.booleans()):
        strides, dilations = [1] * rank, [draw(st.integers(1, dmax)) for _ in range(rank)]
    return kernel, strides, dilations


def _sizes(draw, kernel, dilations, padding, lo=1, extra=5):
    """Two spatial sizes (each at least the dilated window for VALID)."""
    low = [max(lo, (k - 1) * d + 1) if padding == "VALID" else lo
           for k, d in zip(kernel, dilations)]
    return [[draw(st.integers(b, b + extra)) for b in low] for _ in range(2)]


SETTINGS = settings(derandomize=True, deadline=None, max_examples=50)


# -- LRNGrad -------------------------------------------------------------------------------------
@SETTINGS
@given(st.data())
def test_lrn_grad(data):
    """TF's LRNGrad: channel windows of every radius (past the channels too), bias, alpha,
    beta; NHWC, its spatial sizes static or unknown."""
    d = data.draw
    ch, rad = d(st.integers(1, 9)), d(st.integers(0, 6))
    bias, alpha, beta = (d(st.floats(lo, hi)) for lo, hi in ((0.5, 2.0), (0.01, 1.0),
                                                               (0.2, 1.0)))
    shapes = [[d(st.integers(1, 3)), d(st.integers(1, 4)), d(st.integers(1, 4)), ch]
              for _ in range(2)]
    shapes[1][0] = shapes[0][0]
    check(lambda x: tf.nn.local_response_normalization(x, rad, bias, alpha, beta), shapes,
          ops=["LRNGrad"], static=d(st.booleans()), tol=1e-4)


# -- Conv2D, grouped and not, and its input and filter gradients ----------------------------------
@SETTINGS
@given(st.data())
def test_conv2d_grads(data):
    """Conv2DBackpropInput and Conv2DBackpropFilter, grouped (G * per input channels, G * m
    outputs) or not, NHWC and NCHW."""
    d = data.draw
    groups, per, m = d(st.integers(1, 3)), d(st.integers(1, 2)), d(st.integers(1, 2))
    kernel, strides, dilations = _window(d, 2)
    padding = d(st.sampled_from(["VALID", "SAME"]))
    nchw = d(st.booleans())
    w = values([*kernel, per, groups * m], 1)
    shapes = [[2, *s, groups * per] for s in _sizes(d, kernel, dilations, padding)]
    if nchw:
        shapes = [[s[0], s[-1], *s[1:-1]] for s in shapes]
    fmt = "NCHW" if nchw else "NHWC"
    check(lambda x, w: tf.nn.conv2d(x, w, strides, padding, data_format=fmt,
                                    dilations=dilations), shapes, w,
          ["Conv2DBackpropInput", "Conv2DBackpropFilter"], d(st.booleans()), nchw)


@SETTINGS
@given(st.data())
def test_conv3d_grads(data):
    """Conv3DBackpropInputV2 and Conv3DBackpropFilterV2 (TF's CPU Conv3D is not grouped)."""
    d = data.draw
    kernel, strides, dilations = _window(d, 3, kmax=2, smax=3, dmax=2)
    padding = d(st.sampled_from(["VALID", "SAME"]))
    w = values([*kernel, 2, 3], 2)
    shapes = [[1, *s, 2] for s in _sizes(d, kernel, dilations, padding, extra=3)]
    check(lambda x, w: tf.nn.conv3d(x, w, [1, *strides, 1], padding,
                                    dilations=[1, *dilations, 1]),
          shapes, w, ["Conv3DBackpropInputV2", "Conv3DBackpropFilterV2"], d(st.booleans()))


@SETTINGS
@given(st.data())
def test_depthwise_grads(data):
    """DepthwiseConv2dNativeBackpropInput and ...BackpropFilter (TF's depthwise strides are
    equal over rows and columns; no dilations: TF's own CPU kernels refuse them, and oneDNN's
    that take them give a wrong input gradient, [1, 3, 3] for conv2d's [1, 3, 2] on a row of
    3 with the taps [1, 2] two apart, SAME)."""
    d = data.draw
    ch, mult = d(st.integers(1, 3)), d(st.integers(1, 2))
    kernel, strides, dilations = _window(d, 2, dilate=False)
    strides = [strides[0]] * 2
    padding = d(st.sampled_from(["VALID", "SAME"]))
    w = values([*kernel, ch, mult], 3)
    shapes = [[2, *s, ch] for s in _sizes(d, kernel, dilations, padding)]
    check(lambda x, w: v1.nn.depthwise_conv2d_native(x, w, [1, *strides, 1], padding,
                                                     dilations=[1, *dilations, 1]),
          shapes, w, ["DepthwiseConv2dNativeBackpropInput",
                      "DepthwiseConv2dNativeBackpropFilter"], d(st.booleans()))


# -- AvgPoolGrad, AvgPool3DGrad -------------------------------------------------------------------
@SETTINGS
@given(st.data())
def test_avg_pool_grads(data):
    """AvgPoolGrad (2-D) and AvgPool3DGrad: the counts of real pixels per window and the cut to
    the input, from the run-time sizes where they are not static."""
    d = data.draw
    rank = d(st.sampled_from([2, 3]))
    kernel, strides, _ = _window(d, rank, smax=4, dilate=False)
    padding = d(st.sampled_from(["VALID", "SAME"]))
    shapes = [[2, *s, 3] for s in _sizes(d, kernel, [1] * rank, padding,
                                         extra=5 if rank == 2 else 3)]
    check(lambda x: tf.nn.avg_pool(x, kernel, strides, padding), shapes,
          ops=["AvgPoolGrad" if rank == 2 else "AvgPool3DGrad"], static=d(st.booleans()))


# -- Conv2DBackpropInput as a forward op, its sizes the run time's ---------------------------------
@SETTINGS
@given(st.data())
def test_conv2d_transpose_run_time_output_shape(data):
    """tf.nn.conv2d_transpose with an output shape computed from x's run-time shape (any size
    the forward conv maps back onto x's): converted, differentiated by onnxgrad (through the
    cut of the full transposed convolution), and TF's gradient graph of it (Conv2D and
    Conv2DBackpropFilter over run-time sizes)."""
    d = data.draw
    kernel, strides, _ = _window(d, 2, dilate=False)
    padding = d(st.sampled_from(["VALID", "SAME"]))
    offs = [d(st.integers(0, s - 1)) for s in strides]  # any output size within one stride
    w = values([*kernel, 2, 3], 4)  # [k, k, out, in]

    def fn(x, w):
        size = tf.shape(x)[1:3]
        last = (size - 1) * strides + [k if padding == "VALID" else 1 for k in kernel]
        return tf.nn.conv2d_transpose(x, w, tf.concat([tf.shape(x)[:1], last + offs, [2]], 0),
                                      strides, padding)
    shapes = [[2, *s, 3] for s in _sizes(d, [1, 1], [1, 1], padding)]
    check(fn, shapes, w, ["Conv2DBackpropInput", "Conv2DBackpropFilter"], d(st.booleans()))


@pytest.mark.parametrize("wrt", ["x", "w"])
@pytest.mark.parametrize("channels", [2, 6])
def test_conv2d_grads_of_unknown_channels(channels, wrt):
    """x's channels unknown: the gradient ops are taken as ungrouped (ONNX's group is an
    attribute), right for an ungrouped conv; a grouped one (6 = 3 * 2 channels) fails when it
    runs, never a gradient of the wrong shape."""
    w = values([3, 2, 2, 6], 5)

    def build():
        x, wc = v1.placeholder(tf.float32, [2, None, None, None], name="x"), tf.constant(w)
        y = tf.nn.conv2d(x, wc, [1, 2], "SAME")
        gy = v1.placeholder(tf.float32, [2, None, None, 6], name="gy")
        return y, gy, tf.gradients(y, x if wrt == "x" else wc, grad_ys=gy)[0]
    graph, (y, gy, grad) = tf1_graph(build)
    gd = graph.as_graph_def(add_shapes=True)
    model = session(convert(gd, inputs=["x:0", "gy:0"], outputs=[grad.name]))
    x = values([2, 7, 5, channels], 6)
    with v1.Session(graph=graph) as s:
        feeds = {"x:0": x, "gy:0": upstream(s.run(y, {"x:0": x}).shape)}
        if channels == 6:
            s.run(grad, feeds)  # (TF's runs)
            with pytest.raises(Exception, match="Conv2DBackprop"):
                model.run(None, feeds)
        else:
            _close(model.run(None, feeds)[0], s.run(grad, feeds), wrt, 2e-5)
