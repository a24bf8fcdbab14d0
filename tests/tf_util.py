"""Helpers for the TensorFlow converter tests: build a TF1 graph, run it in TF (the oracle),
convert it, run the ONNX model on onnxruntime and compare."""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow", reason="TensorFlow (the test extra) is the oracle here")

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
