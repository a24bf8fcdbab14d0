"""``onnxgrad.TensorArray`` (the builder of TensorArray programs on ONNX sequence ops) against
TensorFlow's graph TensorArrays: the programs of tests/tf_gen.py's TensorArray family (written
by unstack, scatter, split or writes in a drawn order, at static or run-time indices; read by
stack, gather with repeats, concat or single reads; sizes larger than what is written), built
with the builder, their forward and ``onnxgrad.gradients`` against TF1's and ``tf.gradients``
in float64."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tf_util import tf  # noqa: F401  (skips the module without TF)

import onnxgrad
import tf_gen
from onnxgrad.runtime import run
from onnxgrad.sequences import Builder

D = np.float64


@st.composite
def programs(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    _, p = tf_gen._tensor_array(draw, [shape])
    return shape, p, draw(st.booleans()), draw(st.integers(0, 2**16))


def _build(shape, p, dynamic):
    """The program of tf_gen._apply_tensor_array (reading its one input twice), built with the
    builder: (model, output, the run-time write indices fed)."""
    write, read, order, lengths, idx, size, known, extra = p
    b = Builder()
    a = b.input("a", D, list(shape))
    rows = b.node("Mul", [b.node("Sin", [a]), b.node("ReduceMean", [a], keepdims=0)])
    count = len(lengths) if write == "split" else len(order)
    ta = onnxgrad.TensorArray(
        b, D, size=None if size == "grow" else count + extra, dynamic_size=size == "grow",
        clear_after_read=False,
        element_shape=list(shape[1:]) if known and write != "split" else None)
    feeds = {}
    bulk = tf_gen.array_bulk_write(ta, write, order, lengths, rows)
    if bulk is not None:
        ta = bulk
    else:
        for m, t in enumerate(order):
            row = b.node("Gather", [rows, b.const(np.array(m, np.int64))], axis=0)
            if dynamic:
                feeds[f"i{m}"] = np.array(t, np.int64)
                t = b.input(f"i{m}", np.int64, [])
            ta = ta.write(t, row)
    scale = b.node("Cast", [ta.size()], to=11)

    def part(x):
        return b.node("ReduceSum", [x, b.const(np.array([0], np.int64))], keepdims=1) \
            if write == "split" else x
    out = tf_gen.array_bulk_read(ta, read, idx)
    if out is None and read == "read_unrolled":
        out = b.node("Sum", [b.node("Mul", [b.const(np.array(m + 1.0)), b.node(
            "Cos", [part(ta.read(t))])]) for m, t in enumerate(idx)])
    elif out is None:  # every index read twice (TF: in a loop bounded by the array's size)
        out = b.node("Sum", [b.node("Mul", [part(ta.read(t)), b.node("Cos", [part(ta.read(
            count - 1 - t))])]) for t in range(count)])
    out = b.node("Mul", [out, scale])
    rank = len(shape) - (write != "split") + (read in ("stack", "gather"))
    if rank == 0:
        out, rank = b.node("Reshape", [out, b.const(np.array([1], np.int64))]), 1
    b.output(out, D, [None] * rank)
    return b.model(), out, feeds


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(programs())
# found by this test (session 39), each failed before its fix: a write at a run-time index
# into a pre-sized array inserted (the array grew, its elements shifted); unstack and split
# of fewer elements than a pre-sized array holds replaced the whole array (TF's graph arrays
# keep their size)
@example(((3,), ("write_loop", "stack", (1, 0, 2), (3,), (0,), "static", True, 0), True, 0))
@example(((2, 2), ("unstack", "gather", (0, 1), (2,), (1, 0), "static", True, 2), False, 0))
def test_builder_arrays_match_tf(case):
    shape, p, dynamic, seed = case
    x = np.random.default_rng(seed).standard_normal(shape)
    _, y_tf, (g_tf,), gys, _ = tf_gen._run_tf([shape], [("tensor_array", [0, 0], p)], True,
                                                 False, {"x0:0": x}, "float64")
    model, out, feeds = _build(shape, p, dynamic)
    y = run(model, {"a": x, **feeds}, outputs=[out])[0]
    np.testing.assert_allclose(y, y_tf, rtol=1e-12, atol=1e-12)
    res = onnxgrad.gradients(model, out, "a", grad_ys=["gy"])
    g = run(res.model, {"a": x, "gy": gys, **feeds}, outputs=[res.grads[0]])[0]
    np.testing.assert_allclose(g, g_tf, rtol=1e-9, atol=1e-12 * np.abs(g_tf).max())
