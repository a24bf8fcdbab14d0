"""Random Keras models, exported, converted and differentiated, against TF's tape in float64
(the generator and the oracle: ``tests/keras_gen.py``; more examples, not derandomized:
``python bench/fuzz_keras.py``)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from tf_util import tf  # noqa: F401  (skips the module without TF)

keras = pytest.importorskip("keras")

import keras_gen  # noqa: E402


def _eager(f, *a):
    """Keras builds and exports in eager mode, which other test modules switch off for the
    whole process."""
    from tensorflow.python.eager import context
    with context.eager_mode():
        return f(*a)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(keras_gen.models())
def test_converted_keras_models_match_tf(case):
    _eager(keras_gen.check, *case)


def test_the_oracle_sees_a_wrong_gradient(monkeypatch):
    """The comparison is not vacuous: gradients 0.5 % off fail it."""
    real = keras_gen.session

    class Off:
        def __init__(self, model):
            self.s = real(model)

        def run(self, names, feeds):
            out = self.s.run(names, feeds)
            scale = np.float32(1.005) if "gy" in feeds else np.float32(1)
            return [o * scale for o in out]

    case = ([("Conv2D", dict(filters=3, kernel_size=3, padding="same", activation="tanh"))],
            (5, 5, 2), "dense", 2)
    _eager(keras_gen.check, *case)
    monkeypatch.setattr(keras_gen, "session", Off)
    with pytest.raises(AssertionError, match="beyond the tolerance"):
        _eager(keras_gen.check, *case)
