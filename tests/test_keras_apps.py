"""A Keras application as users bring it (``bench/keras_apps.py`` runs fifteen): MobileNetV3Small
(hard swish, squeeze-excite, Rescaling, BatchNormalization, depthwise convolutions) exported,
converted and differentiated against TF's float64 tape, then trained by the Trainer for three
SGD steps against TensorFlow's."""
from __future__ import annotations

import os
import sys

from tf_util import eager, tf  # noqa: F401  (tf: skips the module without TF)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import keras_apps  # noqa: E402


def test_mobilenet_v3_small_gradients_match_tf():
    r = eager(keras_apps.check, "MobileNetV3Small", 32)
    assert r["tensors"] == 143 and r["worst"][0] < 1e-3, r


def test_mobilenet_v3_small_trains_as_tensorflow_does():
    r = eager(keras_apps.train, "MobileNetV3Small", 32)
    assert r["params"] == 142 and r["losses"] < 1e-4 and r["weights"] < 1e-2, r
