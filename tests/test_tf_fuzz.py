"""Random TensorFlow programs of raw ops, converted and differentiated, against TensorFlow
(the generator and the oracle: ``tests/tf_gen.py``; more examples, not derandomized:
``python bench/fuzz_tf.py``)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from tf_util import tf  # noqa: F401  (skips the module without TF)

import tf_gen  # noqa: E402


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(tf_gen.programs())
def test_converted_tf_programs_match_tf(case):
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
