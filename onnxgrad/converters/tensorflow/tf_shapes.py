"""TF's static shapes for a GraphDef written without them (``as_graph_def()`` without
``add_shapes=True``, ``convert_variables_to_constants`` of such a graph), asked of TensorFlow
itself when it is installed, as tf2onnx does: the graph is imported into a ``tf.Graph`` (TF's
shape inference runs on import) and written back with ``_output_shapes``. Without TensorFlow, or
when TF cannot import the graph, the GraphDef converts as it is: no handler refuses a graph for
want of these shapes alone where the run-time shapes serve, and what ONNX shape inference finds
after conversion is kept (see :func:`.core._finish`).
"""
from __future__ import annotations

import importlib.util
import os
import sys

from . import proto


def with_tf_shapes(gd):
    """``gd`` with ``_output_shapes`` on every main-graph node, from TensorFlow; ``gd`` itself
    when its nodes (Consts aside: their values tell) already carry them, when TensorFlow is not
    installed, or when it cannot import the graph."""
    if all("_output_shapes" in n.attr for n in gd.node if n.op != "Const") or not _have_tf():
        return gd
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import tensorflow as tf

        tf_gd = tf.compat.v1.GraphDef.FromString(gd.SerializeToString())
        g = tf.Graph()
        with g.as_default():
            tf.graph_util.import_graph_def(tf_gd, name="")
        shaped = g.as_graph_def(add_shapes=True)
    except Exception:  # noqa: BLE001  (ops TF cannot import here: convert without its shapes)
        return gd
    out = proto.load_graph_def(shaped.SerializeToString())
    # functions as they were (TF may rewrite them)
    out.library.ParseFromString(gd.library.SerializeToString())
    return out


def _have_tf() -> bool:
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"] is not None
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):
        return False
