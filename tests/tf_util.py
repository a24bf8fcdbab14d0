"""Helpers for the TensorFlow converter tests: build a TF1 graph, run it in TF (the oracle),
convert it, run the ONNX model on onnxruntime and compare."""
from __future__ import annotations

import contextlib
import os

import numpy as np
import onnx
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow", reason="TensorFlow (the test extra) is the oracle here")

import onnxgrad  # noqa: E402
from onnxgrad.converters.tensorflow import convert  # noqa: E402
from onnxgrad.runtime import ort_module, session_options  # noqa: E402


def ort_run(model, feeds: dict, outputs: list[str]) -> list:
    """Run on stock onnxruntime (CPU), no fallback: the converted model must run there."""
    s = ort_module().InferenceSession(model.SerializeToString(), session_options(),
                                      providers=["CPUExecutionProvider"])
    return s.run(outputs, {k: np.asarray(v) for k, v in feeds.items()})


@contextlib.contextmanager
def control_flow(v2: bool = False):
    """TF's control-flow version for graphs built (and differentiated) inside the block; TF's
    global setting is restored after, so eager/TF2 tests in the same process are unaffected."""
    from tensorflow.python.ops import control_flow_util

    was = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = v2
    try:
        yield
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = was


def tf1_graph(build, control_flow_v2: bool = False):
    """Call ``build()`` inside a fresh graph (TF1 graph mode, v1 control flow unless asked
    otherwise); returns (graph, whatever build returned)."""
    g = tf.Graph()
    with control_flow(control_flow_v2), g.as_default():
        out = build()
    return g, out


def eager(f, *a):
    """f(*a) in eager mode: Keras and tf.saved_model.save need it, and other test modules
    switch it off for the whole process."""
    from tensorflow.python.eager import context
    with context.eager_mode():
        return f(*a)


def tf_run(graph, fetches, feeds):
    with tf.compat.v1.Session(graph=graph) as s:
        return s.run(fetches, feeds)


def names(tensors) -> list[str]:
    return [t if isinstance(t, str) else t.name for t in tensors]


def check_conversion(graph, outputs, feeds: dict, rtol=1e-5, atol=1e-6, inputs=None,
                     graph_def=None):
    """Convert ``graph`` (or ``graph_def``), run it on onnxruntime with ``feeds`` ({tensor name:
    array}) and assert every output equals TF's. Returns (model, onnx results)."""
    outputs = names(outputs)
    expected = tf_run(graph, outputs, feeds)
    gd = graph_def if graph_def is not None else graph.as_graph_def(add_shapes=True)
    model = convert(gd, inputs=inputs or list(feeds), outputs=outputs)
    got = ort_run(model, feeds, outputs)
    for name, e, g in zip(outputs, expected, got):
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=name)
    return model, got


def upstream(shape, dtype):
    """A non-uniform upstream gradient with both signs."""
    k = np.arange(int(np.prod(shape)), dtype=np.float64)
    return (np.cos(k * 0.7) * 1.5 + 0.25).reshape(shape).astype(dtype)


def same(got, want, what, rtol=2e-5, atol=1e-6):
    """Equal dtype and shape, the same NaNs and infinities, finite values close."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype,
                                                                 want.shape, want.dtype)
    if want.dtype.kind != "f":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    assert np.array_equal(np.isnan(got), np.isnan(want)), (what, got, want)
    ok = np.isfinite(want)
    odd = ~ok & ~np.isnan(want)
    assert np.array_equal(got[odd], want[odd]), (what, got, want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=rtol, atol=atol, err_msg=what)


def check(fn, feeds: dict, diff=(), rtol=2e-5, atol=1e-6, grad_rtol=None, grad_atol=None,
          shapes=None, tf_grad_graph=True):
    """fn(**placeholders) in a TF1 graph (placeholders of known rank, unknown dims unless
    ``shapes`` says otherwise): the converted output equals TF's; onnxgrad.gradients of it with
    respect to the inputs named in ``diff`` equals tf.gradients (same upstream gradient); and
    TF's own gradient graph, converted, gives TF's gradients. Returns the converted model."""
    grad_rtol = rtol if grad_rtol is None else grad_rtol
    grad_atol = atol if grad_atol is None else grad_atol
    shapes = shapes or {}

    def build():
        ps = {k: tf.compat.v1.placeholder(tf.as_dtype(v.dtype), shapes.get(k, [None] * np.ndim(v)),
                                name=k) for k, v in feeds.items()}
        y = tf.identity(fn(**ps), name="result")
        gy = tf.compat.v1.placeholder(y.dtype, [None] * y.shape.rank, name="gy")
        gs = tf.gradients(y, [ps[k] for k in diff], grad_ys=gy) if diff else []
        return y, gy, [tf.convert_to_tensor(g) for g in gs]
    graph, (y, gy, tf_grads) = tf1_graph(build)
    tf_feeds = {f"{k}:0": v for k, v in feeds.items()}
    want_y = tf_run(graph, y, tf_feeds)
    gys = upstream(want_y.shape, want_y.dtype)
    want = tf_run(graph, [y] + tf_grads, {**tf_feeds, gy.name: gys})
    gd = graph.as_graph_def(add_shapes=True)
    model = convert(gd, inputs=list(tf_feeds), outputs=["result:0"])
    onnx.checker.check_model(model, full_check=True)
    same(ort_run(model, tf_feeds, ["result:0"])[0], want[0], "forward", rtol, atol)
    if not diff:
        return model
    res = onnxgrad.gradients(model, "result:0", [f"{k}:0" for k in diff], grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    got = ort_run(res.model, {**tf_feeds, "gy": gys}, res.grads)
    for k, g, w in zip(diff, got, want[1:]):
        same(g, w, f"d/d{k} (onnxgrad)", grad_rtol, grad_atol)
    if tf_grad_graph:  # TF's gradient graph of the op, converted
        outs = [t.name for t in tf_grads]
        m2 = convert(gd, inputs=[*tf_feeds, gy.name], outputs=outs)
        got2 = ort_run(m2, {**tf_feeds, gy.name: gys}, outs)
        for k, g, w in zip(diff, got2, want[1:]):
            same(g, w, f"d/d{k} (TF's gradient graph)", grad_rtol, grad_atol)
    return model
