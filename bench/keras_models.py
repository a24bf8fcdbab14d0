"""Keras models for bench/train_step.py's Keras rows: what a Keras user brings (a model saved with
``model.export()``, converted by ``onnxgrad.converters.tensorflow.convert``), trained against
TensorFlow training the Keras model itself.

    make(name, seed) -> (keras.Model, input shape without the batch axis, default batch size)
    inputs(name, batch, rng) -> a random batch of the model's input
    export(model, directory)  -> the SavedModel directory (``model.export``)
    parameter_names(model)    -> the converted model's initializer names of its trainable weights

The architectures are the ones of the PyTorch rows, in Keras's layouts:
    cnn   Conv2D 16 3x3 same, ReLU, MaxPooling2D 2, Conv2D 32, ReLU, MaxPooling2D 2, Flatten,
          Dense 10; 28x28x1 images (channels last), batch 64
    lstm  LSTM 128 over 32 steps of 64 features (the last hidden state), Dense 10; batch 64
          (the hand-built ``lstm`` row's sizes; Keras runs its own while loop on a CPU)
    textlstm  Embedding 1000 x 64 of 32 tokens (int32), LSTM 128, Dense 10; batch 64: a text
          classifier, whose loop reads rows of a tensor that needs a gradient (the embedding's)
"""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODELS = {"cnn": ((28, 28, 1), 64), "lstm": ((32, 64), 64), "textlstm": ((32,), 64)}
VOCABULARY = 1000


def make(name: str, seed: int = 0):
    import keras
    keras.utils.set_random_seed(seed)
    shape, batch = MODELS[name]
    L = keras.layers
    if name == "cnn":
        layers = [L.Conv2D(16, 3, padding="same", activation="relu"), L.MaxPooling2D(2),
                  L.Conv2D(32, 3, padding="same", activation="relu"), L.MaxPooling2D(2),
                  L.Flatten(), L.Dense(10)]
    elif name == "textlstm":
        layers = [L.Embedding(VOCABULARY, 64), L.LSTM(128), L.Dense(10)]
    else:
        layers = [L.LSTM(128), L.Dense(10)]
    dtype = "int32" if name == "textlstm" else "float32"
    return keras.Sequential([keras.Input(shape, dtype=dtype), *layers]), shape, batch


def inputs(name: str, batch: int, rng):
    shape = MODELS[name][0]
    if name == "textlstm":
        return rng.integers(0, VOCABULARY, (batch, *shape)).astype("int32")
    return rng.standard_normal((batch, *shape)).astype("float32")


def export(model, directory: str) -> str:
    model.export(directory, verbose=False)
    return directory


def parameter_names(model) -> list[str]:
    """The converted model's initializer names of the Keras model's trainable variables."""
    return [f"{v.path}:0" for v in model.trainable_variables]
