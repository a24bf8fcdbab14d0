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

With ``--train`` each converted model is also trained: three SGD steps (``--lr``, 0.01) of
``onnxgrad.Trainer``
(its default parameters, MSE against random targets, float32) against the same steps of
TensorFlow on the float32 Keras model in inference mode (as exported): the Trainer's parameters
must be Keras's ``trainable_weights`` exactly, the losses equal to 1e-4, and each tensor's change
TensorFlow's to 1e-2 of that change (or of 1e-3 of the largest change of any tensor).
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


def _nudged(m, seed):
    """``m`` with its biases and BatchNorm betas drawn from 0.1 N(0, 1) (Keras's are zeros)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    for w in m.trainable_weights:
        if w.path.endswith(("bias", "beta")):
            w.assign(0.1 * rng.standard_normal(tuple(w.shape)).astype(np.float32))
    return m


def check(name, side, seed=0, batch=2) -> dict:
    import tensorflow as tf

    import keras_gen
    m32 = _nudged(build(name, side, "float32", seed), seed)
    m64 = build(name, side, "float64", seed)
    assert [w.path for w in m32.weights] == [w.path for w in m64.weights], "unpaired weights"
    for a, b in zip(m32.weights, m64.weights):
        b.assign(tf.cast(a, tf.float64))
    return keras_gen.check_built(m32, m64, (side, side, 3), seed=seed, batch=batch,
                                 reject=_kink)


def train(name, side, seed=0, batch=4, steps=3, lr=0.01) -> dict:
    """Three SGD steps of the Trainer on the converted model against TensorFlow's on the Keras
    model (inference mode), from the same weights and batch."""
    import numpy as np
    import tensorflow as tf

    import keras_gen
    import onnxgrad
    m = _nudged(build(name, side, "float32", seed), seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((batch, side, side, 3)).astype(np.float32)
    target = rng.standard_normal((batch, 10)).astype(np.float32)
    model = keras_gen.converted(m)
    trainer = onnxgrad.Trainer(model, "mse", optimizer=onnxgrad.training.SGD(lr=lr),
                               device="cpu", progress=False)
    names = sorted(f"{w.path}:0" for w in m.trainable_weights)
    assert sorted(trainer.parameters()) == names, "the Trainer trains other tensors than Keras"
    start = {w.path: w.numpy() for w in m.trainable_weights}
    theirs = keras_gen.keras_sgd(m, lambda t, y: tf.reduce_mean((y - t) ** 2), x, target, lr,
                                 steps)
    if not np.isfinite(theirs).all():
        raise Kink(f"TensorFlow's own steps diverge at lr {lr} (losses {theirs})")
    x_in = model.graph.input[0].name
    ours = [trainer.step({x_in: x, "target": target}) for _ in range(steps)]
    got = trainer.parameters()
    # each tensor's change against TensorFlow's, within 1e-2 of it (or of 1e-3 of the largest
    # change of any tensor, where a deep tensor hardly moves): float32 steps through a deep net
    moved = {w.path: np.abs(w.numpy() - start[w.path]).max() for w in m.trainable_weights}
    floor = 1e-3 * max(moved.values())
    weights = max(float(np.abs(got[f"{w.path}:0"] - w.numpy()).max() /
                        max(moved[w.path], floor, 1e-30)) for w in m.trainable_weights)
    losses = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    assert losses < 1e-4 and weights < 1e-2, f"losses {ours} vs {theirs}, changes {weights:.1e}"
    return dict(losses=losses, weights=weights, params=len(names))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", help=f"any of {', '.join(APPS)}")
    p.add_argument("--size", type=int, default=0, help="image side (default: each one's least)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", action="store_true",
                   help="also train: three Trainer SGD steps against TensorFlow's")
    p.add_argument("--lr", type=float, default=0.01, help="the SGD steps' learning rate")
    args = p.parse_args(argv)
    unknown = [m for m in args.models if m not in APPS]
    if unknown:
        p.error(f"unknown model(s) {unknown}")
    print("| model | image | nodes | gradient nodes | tensors | worst tensor: error | seconds "
          "| verdict |" + (" training: losses, weights |" if args.train else ""))
    print("|---|---:|---:|---:|---:|---|---:|---|" + ("---|" if args.train else ""))
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
        trained = ""
        if args.train:
            try:
                t = train(name, side, args.seed, lr=args.lr)
                trained = f" {t['losses']:.0e}, {t['weights']:.0e} ({t['params']} tensors) |"
            except Kink as k:
                trained = f" not judged: {k} |"
            except Exception as err:  # noqa: BLE001
                bad += 1
                trained = f" {type(err).__name__}: {str(err)[:300]} |"
        print(f"| {name} | {side} | {r['nodes']} | {r['grad_nodes']} | {r['tensors']} | "
              f"{tensor}: {e:.0e} | {time.perf_counter() - t0:.0f} | ok |{trained}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
