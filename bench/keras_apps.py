"""Gradients of the Keras applications (``keras.applications``), as a Keras user brings them,
against TensorFlow's tape in float64.

    python bench/keras_apps.py                    # every architecture below, a markdown table
    python bench/keras_apps.py MobileNetV2 EfficientNetB0 --size 48

Each architecture is built twice with ``weights=None`` (nothing is downloaded) and 10 classes,
in float32 and, with the same weights, in float64 (Keras's floatx and dtype policy); biases and
BatchNorm betas get 0.1 N(0, 1) so that no ReLU sits exactly at its kink behind a dead channel.
The float32 model is saved with ``model.export()``, converted by
``onnxgrad.converters.tensorflow.convert`` and differentiated by ``onnxgrad.gradients`` with
respect to the image and every trainable weight, run in a stock onnxruntime session (every
graph optimization on), and compared with ``tf.GradientTape`` of the float64 model: per tensor
max |ours - tf64| / max |tf64| within 1e-3 plus 10x TensorFlow's own float32 error
(``tests/keras_gen.check_built``, the Keras fuzzer's oracle). A model where TensorFlow's float32
gradient is more than 1 % off its float64 one sits at a kink: reported, not judged.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

# name -> smallest input side the architecture takes (its own checks or its strides)
APPS = {"MobileNet": 32, "MobileNetV2": 32, "MobileNetV3Small": 32, "MobileNetV3Large": 32,
        "EfficientNetB0": 32, "EfficientNetV2B0": 32, "ResNet50": 32, "ResNet50V2": 32,
        "DenseNet121": 32, "ConvNeXtTiny": 32, "VGG16": 32, "Xception": 71,
        "InceptionV3": 75, "InceptionResNetV2": 75, "NASNetMobile": 32}


class Kink(Exception):
    pass


def _kink(why):
    raise Kink(why)


def build(name, side, dtype, seed):
    import keras
    keras.backend.clear_session()  # layer names from 0 again: the twins' weights pair by path
    keras.utils.set_random_seed(seed)
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        return getattr(keras.applications, name)(weights=None, input_shape=(side, side, 3),
                                                 classes=10, classifier_activation=None)
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")


def check(name, side, seed=0, batch=2) -> dict:
    import numpy as np
    import tensorflow as tf

    import keras_gen
    m32 = build(name, side, "float32", seed)
    rng = np.random.default_rng(seed)
    for w in m32.trainable_weights:
        if w.path.endswith(("bias", "beta")):
            w.assign(0.1 * rng.standard_normal(tuple(w.shape)).astype(np.float32))
    m64 = build(name, side, "float64", seed)
    assert [w.path for w in m32.weights] == [w.path for w in m64.weights], "unpaired weights"
    for a, b in zip(m32.weights, m64.weights):
        b.assign(tf.cast(a, tf.float64))
    return keras_gen.check_built(m32, m64, (side, side, 3), seed=seed, batch=batch,
                                 reject=_kink)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", help=f"any of {', '.join(APPS)}")
    p.add_argument("--size", type=int, default=0, help="image side (default: each one's least)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    unknown = [m for m in args.models if m not in APPS]
    if unknown:
        p.error(f"unknown model(s) {unknown}")
    print("| model | image | nodes | gradient nodes | tensors | worst tensor: error | seconds "
          "| verdict |")
    print("|---|---:|---:|---:|---:|---|---:|---|")
    bad = 0
    for name in args.models or APPS:
        side = max(args.size, APPS[name])
        t0 = time.perf_counter()
        try:
            r = check(name, side, args.seed)
        except Kink as k:
            print(f"| {name} | {side} | | | | | | not judged: {k} |", flush=True)
            continue
        except Exception as err:  # a refusal, a crash or a mismatch is a finding: go on
            bad += 1
            print(f"| {name} | {side} | | | | | | {type(err).__name__}: "
                  f"{str(err)[:300]} |", flush=True)
            continue
        (e, tensor) = r["worst"]
        print(f"| {name} | {side} | {r['nodes']} | {r['grad_nodes']} | {r['tensors']} | "
              f"{tensor}: {e:.0e} | {time.perf_counter() - t0:.0f} | ok |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
