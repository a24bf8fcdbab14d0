"""Random TensorFlow programs of raw ops, converted and differentiated, against TensorFlow
(the generator and the oracle: ``tests/tf_gen.py``; more examples, not derandomized:
``python bench/fuzz_tf.py``)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings

from tf_util import tf  # noqa: F401  (skips the module without TF)

import tf_gen  # noqa: E402


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(tf_gen.programs())
def test_converted_tf_programs_match_tf(case):
    tf_gen.check(*case)


def _array(write, read, order, idx=(0,), size="static", known=False, extra=0):
    return ("tensor_array", [0, 0], (write, read, order, (len(order),), idx, size, known, extra))


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(tf_gen.programs(tf_gen.ARRAY_OPS))
# found by this test's generator (session 39), each failed before its fix:
# TF's own gradient graph of a gather of fewer indices than the array holds: its gradient
# array scattered at [0] was taken for an unstack (Range-like indices) and cut to one element
@example(([(2,)], [_array("unstack", "gather", (0, 1))], False, False, 0, "float64", False))
# writes out of index order into an array without a static element shape (onnxruntime:
# "Invalid sequence index"), unrolled and in a loop into a dynamic array
@example(([(3,)], [_array("write_unrolled", "stack", (0, 2, 1))], False, False, 0, "float64",
          False))
@example(([(2,)], [_array("write_loop", "stack", (1, 0), size="grow")], False, False, 0,
          "float64", False))
# TF's v2 gradient of a gather with a repeated index keeps one upstream row (TensorList
# scatter); onnxgrad's adds them, as TF1's TensorArray does: the reference is the TF1 form
@example(([(2,)], [_array("unstack", "gather", (0, 1), idx=(0, 0))], False, True, 0, "float64",
          False))
# a SavedModel whose output rank TF does not know (a concat of an array without element
# shapes): converted with its output declared without a shape and a ConversionWarning; the
# oracle checks it as the converter does (seed 24 of bench/fuzz_tf.py stopped at its checker)
@example(([(4,), (1,)], [("broadcast_to", [0], [1, 4]), _array("split", "concat", (0, 1, 2, 3)),
                         ("segments", [3], ("sum", [0, 0, 0, 0]))], False, False, 0, "float64",
          True))
def test_tensor_array_programs_match_tf(case):
    """TensorArrays written and read every way (tf_gen._tensor_array), among other ops."""
    tf_gen.check(*case)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_oracle_sees_a_wrong_gradient(monkeypatch, dtype):
    """The comparison is not vacuous: gradients off by 1e-6 (float64) or 0.5 % (float32) fail
    it; the forward alone passes."""
    case = ([(2, 3), (3,)], [("binary", [0, 1], "mul"), ("unary", [2], "tanh"),
                             ("reduce", [3], ("sum", [1], False))], False, False, 7, dtype)
    tf_gen.check(*case)
    real = tf_gen.ort_run
    off = 1 + (1e-6 if dtype == "float64" else 5e-3)

    def ort_run(model, feeds, outputs):
        out = real(model, feeds, outputs)
        return [o * np.asarray(off, o.dtype) if "gy" in feeds else o for o in out]

    monkeypatch.setattr(tf_gen, "ort_run", ort_run)
    with pytest.raises(AssertionError, match="max error"):
        tf_gen.check(*case)
