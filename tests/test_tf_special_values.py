"""Converted TF elementwise ops at their special values (0, tiny, huge, where an exp or log
saturates): the converted output and ``onnxgrad.gradients`` of it equal TensorFlow's op and
tf.gradients, NaN and inf included. Decompositions that select a branch with Where must keep the
branch not taken finite ("double where"): Expm1, Log1p, Xlogy and Xdivy gave NaN gradients at
0 (a Keras model with celu had NaN input gradients at every positive input), and Expm1 gave 0
instead of -1 below -104 and NaN instead of inf above 89. A Max or Min that clamps halves the
gradient at its tie (Erfc at 0.5, ClipByValue at its bounds): selections there instead."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_util import ort_run, tf, tf1_graph, tf_run

import onnxgrad
from onnxgrad.converters.tensorflow import convert

v1 = tf.compat.v1
SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 1e-8, -1e-8, 1e-4, 0.25, 0.5, -0.5, 0.49999997, 1.0, -1.0,
           3.0, -0.9, -0.99999994, 20.0, -20.0, 88.0, 89.0, 100.0, -100.0, -104.0, -200.0,
           1e30, -1e30, np.inf, -np.inf]
UNARY = {"Expm1": tf.math.expm1, "Log1p": tf.math.log1p, "Softplus": tf.nn.softplus,
         "Elu": tf.nn.elu, "Selu": tf.nn.selu, "Erfc": tf.math.erfc, "Softsign": tf.nn.softsign,
         "Celu": lambda x: tf.maximum(x, 0.0) + tf.minimum(0.0, 0.7 * tf.math.expm1(x / 0.7)),
         "Lgamma": tf.math.lgamma, "Digamma": tf.math.digamma, "Erfinv": tf.math.erfinv,
         "Ndtri": tf.math.ndtri, "BesselI0e": tf.math.bessel_i0e, "BesselI1e": tf.math.bessel_i1e,
         "Trigamma": lambda x: tf.math.polygamma(tf.constant(1.0), x)}
BINARY = {"Xlogy": tf.math.xlogy, "Xdivy": tf.math.xdivy, "DivNoNan": tf.math.divide_no_nan,
          "MulNoNan": tf.math.multiply_no_nan}
# TF's ClipByValue op (tf.clip_by_value itself builds Minimum and Maximum, which the converter
# writes as TF's selections: test_maximum_and_minimum_ties_go_to_x_as_in_tf)
CLIPS = {"clip_by_value": lambda x: tf.raw_ops.ClipByValue(t=x, clip_value_min=-1.0,
                                                           clip_value_max=0.5),
         "clip_tensor_bounds": lambda x: tf.raw_ops.ClipByValue(
             t=x, clip_value_min=x * 0.0 - 1.0, clip_value_max=tf.abs(x) * 0.0 + 0.5)}
# where the comparison means something: outside its domain (log1p of x < -1 is NaN) TF's native
# gradient still gives a number (1 / (1 + x)) that no decomposition into ONNX ops reproduces;
# Selu's kink at 0 takes the left derivative here (as torch), TF's SeluGrad the right one, and
# TF reads the branch from the output, so x = -1e-30 (whose output rounds to 0) gets it too
DOMAIN = {"Log1p": lambda x: x > -1, "Selu": lambda x: np.abs(x) > 1e-6}


def _off_poles(x):
    return (x > 0) | (x != np.floor(x))


# lgamma and psi: off their poles (TF's gradient there is its formula's, NaN or inf);
# TF's float32 erfinv is inf at 1 - 2^-24 (it rounds (x + 1) / 2), its float32 polygamma wrong
# below about -7 (tests/test_tf_special_fns.py); TF's i1e gradient, i0e - y (1 + 1 / x), reads
# its output y = x / 2, flushed to 0 where that is subnormal (1 at 1e-38, not 1/2)
DOMAIN.update({"Lgamma": _off_poles, "Digamma": _off_poles,
               "Trigamma": lambda x: _off_poles(x) & (x > -7),
               "Erfinv": lambda x: (np.abs(x) < 0.9999) | (np.abs(x) == 1),
               "Ndtri": lambda x: (x >= 0) & (x <= 1),
               "BesselI1e": lambda x: (np.abs(x) > 1e-37) | (x == 0)})


def _both(fn, values):
    """(TF's output and gradients, the converted model's) at ``values`` (float32 arrays)."""
    def build():
        ps = [v1.placeholder(tf.float32, [None], name=f"in{i}") for i in range(len(values))]
        y = tf.identity(fn(*ps), name="y")
        gy = v1.placeholder(tf.float32, [None], name="gy")
        return ps, y, gy, tf.gradients(y, ps, grad_ys=gy)
    graph, (ps, y, gy, grads) = tf1_graph(build)
    gys = np.linspace(0.5, 1.5, len(values[0])).astype(np.float32)
    feeds = {p.name: v for p, v in zip(ps, values)}
    want = tf_run(graph, [y] + grads, {**feeds, gy.name: gys})
    model = convert(graph.as_graph_def(), inputs=[p.name for p in ps], outputs=["y:0"])
    res = onnxgrad.gradients(model, "y:0", [p.name for p in ps], grad_ys=["gy"])
    got = ort_run(res.model, {**feeds, "gy": gys}, ["y:0", *res.grads])
    return want, got


def _same(got, want, what):
    """The same NaNs and infinities; finite values to 2e-5 relative, or 1e-7 of the largest
    (onnxruntime's Sigmoid is 0 where TF's is 2e-9, at -20: an absolute error of its kernel)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)), (what, got, want)
    ok = np.isfinite(want)
    assert np.array_equal(got[~ok & ~np.isnan(want)], want[~ok & ~np.isnan(want)]), (what, got,
                                                                                    want)
    scale = np.abs(want[ok]).max(initial=0.0)
    np.testing.assert_allclose(got[ok], want[ok], rtol=2e-5, atol=1e-7 * max(scale, 1.0),
                               err_msg=what)


@pytest.mark.parametrize("op", UNARY)
def test_unary_ops_at_special_values(op):
    x = np.array(SPECIAL, np.float32)
    x = x[DOMAIN.get(op, np.isfinite)(x)]
    want, got = _both(UNARY[op], [x])
    for what, g, w in zip(["output", "gradient"], got, want):
        _same(g, w, f"{op} {what} at {x.tolist()}")


@pytest.mark.parametrize("op", CLIPS)
def test_clips_at_their_bounds(op):
    """An x exactly at a bound gets the whole gradient, as in TF (Max and Min split such a tie
    and gave it half)."""
    x = np.array([-1.0, 0.5, -2.0, 1.0, 0.0, 0.25, 6.0, -1.0], np.float32)
    want, got = _both(CLIPS[op], [x])
    for what, g, w in zip(["output", "gradient"], got, want):
        _same(g, w, f"{op} {what} at {x.tolist()}")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(op=st.sampled_from(["maximum", "minimum"]),
       pairs=st.lists(st.tuples(*[st.sampled_from([0.0, -0.0, 1.0, -2.0, np.inf, -np.inf,
                                                   np.nan])] * 2), min_size=1, max_size=8))
def test_maximum_and_minimum_ties_go_to_x_as_in_tf(op, pairs):
    """TF's gradient gives a tie of tf.maximum / tf.minimum to x (x >= y, x <= y); onnxgrad's
    Max and Min split it evenly (as PyTorch), so the converter writes the selection TF's
    gradient makes, with TF's forward (NaN from either side). Gradients are compared where
    neither input is NaN (there TF's gives all to y, the selection to the NaN x)."""
    x, y = (np.array(v, np.float32) for v in zip(*pairs))
    want, got = _both(getattr(tf, op), [x, y])
    _same(got[0], want[0], f"{op} output")
    finite = ~np.isnan(x) & ~np.isnan(y)
    for what, g, w in zip(["d/dx", "d/dy"], got[1:], want[1:]):
        _same(g[finite], w[finite], f"{op} {what} at {pairs}")


@pytest.mark.parametrize("op", BINARY)
def test_binary_ops_at_zeros(op):
    x = np.array([0.0, 0.0, 0.0, 2.0, -1.0, 0.0, 3.0, np.inf], np.float32)
    y = np.array([0.0, 1.0, -2.0, 0.0, 0.5, 1e-30, 4.0, 0.0], np.float32)
    want, got = _both(BINARY[op], [x, y])
    for what, g, w in zip(["output", "d/dx", "d/dy"], got, want):
        if op == "MulNoNan" and what == "d/dy":  # TF's is x there: inf for x = inf at y = 0,
            g, w = g[:-1], w[:-1]                # where the form takes 0 (its x made finite)
        _same(g, w, f"{op} {what}")


# (fixed draws; the drawn floats stay clear of exp's float32 overflow near 88.72, where TF's
# and onnxruntime's kernels may round a value to inf on one side only: the listed 88 and 89
# are on either side of it)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(op=st.sampled_from(sorted(UNARY)),
       xs=st.lists(st.one_of(st.sampled_from(SPECIAL),
                             st.floats(-80, 80, width=32, allow_subnormal=False)),
                   min_size=1, max_size=6))
def test_unary_ops_against_tf_generated(op, xs):
    x = np.array(xs, np.float32)
    x = x[DOMAIN.get(op, np.isfinite)(x)]
    if not x.size:
        return
    want, got = _both(UNARY[op], [x])
    for what, g, w in zip(["output", "gradient"], got, want):
        _same(g, w, f"{op} {what} at {x.tolist()}")
