"""Random Keras models, exported, converted and differentiated, against TF's tape in float64
(the generator and the oracle: ``tests/keras_gen.py``; more examples, not derandomized:
``python bench/fuzz_keras.py``)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings

from tf_util import eager, tf  # noqa: F401  (tf: skips the module without TF)

keras = pytest.importorskip("keras")

import keras_gen  # noqa: E402


_CONV = dict(kernel_size=1, strides=1, dilation_rate=1, padding="same", activation="relu",
             use_bias=False, filters=1)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(keras_gen.models())
# what it found first (session 35): a Resize with axes [1, 2] between layout Transposes, which
# onnxruntime's layout optimizer left with empty sizes (the converted model failed to load)
@example(([("Conv2D", dict(_CONV, strides=2)),
           ("UpSampling2D", dict(size=2, interpolation="bilinear")), ("Conv2D", _CONV)],
          (3, 3, 1), "none", 1))
# and a ZeroPadding2D between pools, which onnxruntime's Pad_Fusion folded into the second pool
# (summed pads of 3 over a 2x2 kernel: the converted model failed to load; ort_fusions.py)
@example(([("MaxPooling2D", dict(pool_size=2, strides=1, padding="same")),
           ("ZeroPadding2D", dict(padding=((1, 0), (0, 2)))),
           ("MaxPooling2D", dict(pool_size=2, strides=1, padding="same"))], (3, 3, 1), "none", 1))
# a BatchNormalization, whose moving statistics the Trainer trained as weights (session 37:
# the converter now lists a SavedModel's non-trainable variables as not trained)
@example(([("BatchNormalization", {})], (3, 3, 2), "dense", 2))
# a Maximum merge of a ReLU's output and a BatchNormalization of it, equal (0) where the ReLU is
# off: TF gives such a tie to the first input, onnxgrad's Max split it (session 38: the
# converter writes TF's Maximum and Minimum as the selection TF's gradient makes)
@example(([("Conv2D", _CONV),
           ("Residual", dict(layer=("BatchNormalization", {}), merge="Maximum"))],
          (3, 3, 1), "none", 1))
# a TimeDistributed Dense after a dead ReLU, its bias Keras's zeros: a selu exactly at its kink
# (TF's subgradient there is another than onnxgrad's, a documented convention); inner layers'
# biases are drawn now, as the others' were (bench/fuzz_keras.py seed 19)
@example(([("Dense", {"units": 1, "activation": "relu"}),
           ("TimeDistributed", {"layer": ("Dense", {"units": 1, "activation": "selu"})})],
          (2, 2), "none", 1))
def test_converted_keras_models_match_tf(case):
    eager(keras_gen.check, *case)


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
    eager(keras_gen.check, *case)
    monkeypatch.setattr(keras_gen, "session", Off)
    with pytest.raises(AssertionError, match="beyond the tolerance"):
        eager(keras_gen.check, *case)
