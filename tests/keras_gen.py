"""Random Keras models, saved with ``model.export()`` and converted, against TF in float64.

A generator of the Keras models users bring (``tests/test_keras_fuzz.py``; more examples with
``python bench/fuzz_keras.py``): a stack of 1 to 4 layers from a catalogue of image layers
(Conv2D with same / valid padding, strides and dilations; DepthwiseConv2D, SeparableConv2D,
Conv2DTranspose; max and average pools; BatchNormalization, LayerNormalization; UpSampling2D,
ZeroPadding2D, Cropping2D; activations) or sequence layers (Dense, LSTM / GRU / SimpleRNN
forward or backward, Bidirectional, Conv1D with causal padding, pools, MultiHeadAttention,
LayerNormalization), then a head. The model is built twice from the same layer list: in
float32, which is exported, converted (``onnxgrad.converters.tensorflow.convert``) and
differentiated by ``onnxgrad.gradients`` (run on onnxruntime), and in float64 with the same
weights, whose ``tf.GradientTape`` is the reference (:func:`check`).

Kinks: no margins are recorded here; where TF's own float32 gradient is more than 1 % of the
largest reference gradient off the float64 one, the float32 point sits at a kink or is
ill-conditioned, and the example is rejected (a decision on TF's numbers alone, the same on
every machine). Biases are drawn, not Keras's zeros, which put a dead ReLU's next layer
exactly on an activation's kink, where onnxgrad's subgradient may be another than TF's.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
from hypothesis import assume
from hypothesis import strategies as st

import onnxgrad
from onnxgrad.converters.tensorflow import convert
from onnxgrad.runtime import session
from util import within

TOL = 1e-3  # max |ours - tf64| / max |tf64| per tensor, ours in float32
REJECTED: dict = {}
CHECKED: list = []  # the layer classes of each example checked
_ACTS = ["relu", "gelu", "swish", "tanh", "sigmoid", "softplus", "elu", "selu", "leaky_relu",
         "hard_sigmoid", "softsign", "linear"]


def _reject(why):
    REJECTED[why] = REJECTED.get(why, 0) + 1
    assume(False)


def _conv_len(n, k, s, d, padding):
    if padding == "same":
        return -(-n // s)
    return (n - d * (k - 1) - 1) // s + 1 if n >= d * (k - 1) + 1 else 0


# each drawn layer is (class name, kwargs, new shape); kwargs get the dtype when built
@st.composite
def image_layer(draw, h, w, c):
    kind = draw(st.sampled_from(["conv", "conv", "depthwise", "separable", "convt", "maxpool",
                                 "avgpool", "bn", "ln", "act", "upsample", "pad", "crop"]))
    if kind in ("conv", "depthwise", "separable"):
        k, s = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 1, 2]))
        d = draw(st.sampled_from([1, 2])) if s == 1 else 1
        padding = draw(st.sampled_from(["same", "valid"]))
        ho, wo = _conv_len(h, k, s, d, padding), _conv_len(w, k, s, d, padding)
        assume(ho >= 1 and wo >= 1)
        kw = dict(kernel_size=k, strides=s, dilation_rate=d, padding=padding,
                  activation=draw(st.sampled_from(_ACTS)), use_bias=draw(st.booleans()))
        if kind == "depthwise":
            m = draw(st.integers(1, 2))
            return ("DepthwiseConv2D", dict(kw, depth_multiplier=m), (ho, wo, c * m))
        f = draw(st.integers(1, 6))
        return ("SeparableConv2D" if kind == "separable" else "Conv2D", dict(kw, filters=f),
                (ho, wo, f))
    if kind == "convt":
        k, s = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2]))
        padding = draw(st.sampled_from(["same", "valid"]))
        ho, wo = [n * s if padding == "same" else (n - 1) * s + max(k, s) for n in (h, w)]
        assume(ho <= 16 and wo <= 16)
        f = draw(st.integers(1, 4))
        return ("Conv2DTranspose", dict(filters=f, kernel_size=k, strides=s, padding=padding,
                                        use_bias=draw(st.booleans())), (ho, wo, f))
    if kind in ("maxpool", "avgpool"):
        p, s = draw(st.sampled_from([2, 3])), draw(st.sampled_from([1, 2]))
        padding = draw(st.sampled_from(["same", "valid"]))
        ho, wo = _conv_len(h, p, s, 1, padding), _conv_len(w, p, s, 1, padding)
        assume(ho >= 1 and wo >= 1)
        return ("MaxPooling2D" if kind == "maxpool" else "AveragePooling2D",
                dict(pool_size=p, strides=s, padding=padding), (ho, wo, c))
    if kind == "bn":
        return ("BatchNormalization", {}, (h, w, c))
    if kind == "ln":
        assume(c >= 2)
        return ("LayerNormalization", {}, (h, w, c))
    if kind == "act":
        return ("Activation", dict(activation=draw(st.sampled_from(_ACTS))), (h, w, c))
    if kind == "upsample":
        assume(h <= 8 and w <= 8)
        return ("UpSampling2D", dict(size=2, interpolation=draw(st.sampled_from(
            ["nearest", "bilinear"]))), (2 * h, 2 * w, c))
    if kind == "pad":
        return ("ZeroPadding2D", dict(padding=((1, 0), (0, 2))), (h + 1, w + 2, c))
    assume(h >= 3 and w >= 2)
    return ("Cropping2D", dict(cropping=((1, 1), (0, 1))), (h - 2, w - 1, c))


@st.composite
def seq_layer(draw, s, d):
    kind = draw(st.sampled_from(["dense", "rnn", "rnn", "bidi", "conv1d", "pool1d", "mha",
                                 "ln", "act"]))
    if kind == "dense":
        u = draw(st.integers(1, 8))
        return ("Dense", dict(units=u, activation=draw(st.sampled_from(_ACTS))), (s, u))
    if kind in ("rnn", "bidi"):
        cls = draw(st.sampled_from(["LSTM", "GRU", "SimpleRNN"]))
        u = draw(st.integers(1, 6))
        kw = dict(units=u, return_sequences=True, go_backwards=draw(st.booleans()))
        if kind == "bidi":
            return ("Bidirectional", dict(layer=(cls, kw)), (s, 2 * u))
        return (cls, kw, (s, u))
    if kind == "conv1d":
        k, d_ = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2]))
        padding = draw(st.sampled_from(["same", "valid", "causal"]))
        so = s if padding != "valid" else _conv_len(s, k, 1, d_, "valid")
        assume(so >= 1)
        f = draw(st.integers(1, 6))
        return ("Conv1D", dict(filters=f, kernel_size=k, dilation_rate=d_, padding=padding,
                               activation=draw(st.sampled_from(_ACTS))), (so, f))
    if kind == "pool1d":
        assume(s >= 2)
        cls = draw(st.sampled_from(["MaxPooling1D", "AveragePooling1D"]))
        return (cls, dict(pool_size=2, padding="same"), (-(-s // 2), d))
    if kind == "mha":
        return ("MHA", dict(num_heads=draw(st.integers(1, 2)), key_dim=draw(st.integers(2, 4)),
                            causal=draw(st.booleans())), (s, d))
    if kind == "ln":
        assume(d >= 2)
        return ("LayerNormalization", {}, (s, d))
    return ("Activation", dict(activation=draw(st.sampled_from(_ACTS))), (s, d))


@st.composite
def models(draw):
    """(layers, input shape without the batch, head): a list of layer specs to build."""
    if draw(st.booleans()):
        shape = (draw(st.integers(3, 8)), draw(st.integers(3, 8)), draw(st.integers(1, 3)))
        make = image_layer
    else:
        shape = (draw(st.integers(2, 6)), draw(st.sampled_from([2, 3, 4])))
        make = seq_layer
    layers, cur = [], shape
    for _ in range(draw(st.integers(1, 4))):
        cls, kw, cur = draw(make(*cur))
        assume(int(np.prod(cur)) <= 1024)
        layers.append((cls, kw))
    head = draw(st.sampled_from(["none", "dense", "pool"]))
    return layers, shape, head, draw(st.integers(1, 4))


# Keras's zero biases put a dead ReLU's next layer exactly on an activation's kink (selu at 0:
# onnxgrad takes the left derivative, as torch; TF's SeluGrad the right one: README,
# Guarantees); drawn biases keep every example off the kinks that no margin here records
_BIASED = {"Conv2D", "DepthwiseConv2D", "SeparableConv2D", "Conv2DTranspose", "Conv1D", "Dense"}


def build(layers, shape, head, units, dtype):
    """The Keras functional model of ``layers`` in ``dtype`` (weights as Keras draws them)."""
    import keras
    L = keras.layers
    x = keras.Input(shape, dtype=dtype)
    y = x
    for cls, kw in layers:
        if cls == "MHA":
            kw = dict(kw)
            causal = kw.pop("causal")
            y = L.MultiHeadAttention(dtype=dtype, **kw)(y, y, use_causal_mask=causal)
        elif cls == "Bidirectional":
            inner, ikw = kw["layer"]
            y = L.Bidirectional(getattr(L, inner)(dtype=dtype, **ikw), dtype=dtype)(y)
        else:
            if cls in _BIASED and kw.get("use_bias", True):
                kw = dict(kw, bias_initializer="random_normal")
            y = getattr(L, cls)(dtype=dtype, **kw)(y)
    if head == "dense":
        y = L.Dense(units, dtype=dtype)(L.Flatten(dtype=dtype)(y))
    elif head == "pool":
        pool = L.GlobalAveragePooling2D if len(shape) == 3 else L.GlobalAveragePooling1D
        y = L.Dense(units, dtype=dtype)(pool(dtype=dtype)(y))
    return keras.Model(x, y)


def _tape(model, x, gy):
    import tensorflow as tf
    weights = model.trainable_weights
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = model(xt, training=False)
    gs = tape.gradient(y, [xt, *weights], output_gradients=tf.constant(gy))
    return y.numpy(), [None if g is None else tf.convert_to_tensor(g).numpy() for g in gs]


def check(layers, shape, head, units, seed=0, batch=2):
    """Export and convert the float32 model, differentiate it, compare with the float64 one's
    tape: the converted forward, and the gradients wrt the input and every trainable weight."""
    import keras
    import tensorflow as tf
    keras.utils.set_random_seed(seed)
    try:
        m32 = build(layers, shape, head, units, "float32")
        m64 = build(layers, shape, head, units, "float64")
    except Exception as e:  # noqa: BLE001  (Keras refuses the combination)
        _reject(f"build: {type(e).__name__}")
    for a, b in zip(m32.weights, m64.weights):
        b.assign(tf.cast(a, tf.float64))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    gy = rng.standard_normal(tuple(m64(x.astype(np.float64), training=False).shape)
                             ).astype(np.float32)
    y64, g64 = _tape(m64, x.astype(np.float64), gy.astype(np.float64))
    y32, g32 = _tape(m32, x, gy)
    scale = max(float(np.abs(g).max()) for g in g64 if g is not None)
    for a, b in zip(g32, g64):
        if a is not None and float(np.abs(a - b).max()) > 1e-2 * max(scale, 1e-30):
            _reject("kink (TF's float32 gradient is off its float64 one)")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "saved")
        m32.export(path, verbose=False)
        model = convert(path)
    onnx.checker.check_model(model, full_check=True)
    (x_in,), (y_out,) = model.graph.input, model.graph.output
    names = [f"{w.path}:0" for w in m32.trainable_weights]
    inits = {t.name for t in model.graph.initializer}
    assert set(names) <= inits, f"weights not found by their variables' names: {names}"
    y_ort = session(model).run([y_out.name], {x_in.name: x})[0]
    noise_y = float(np.abs(y32 - y64).max())
    assert within(y_ort, y64, noise_y, 1e-6, TOL), "the converted forward differs from TF's"
    res = onnxgrad.gradients(model, y_out.name, [x_in.name, *names], grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    outs = session(res.model).run([g for g in res.grads if g], {x_in.name: x, "gy": gy})
    got = iter(outs)
    bad = {}
    for name, g, want, t32 in zip([x_in.name, *names], res.grads, g64, g32):
        if g is None:
            assert want is None or not np.any(want), f"{name}: no gradient, TF's is nonzero"
            continue
        ours = next(got)
        want = np.zeros(ours.shape) if want is None else want
        noise = 0.0 if t32 is None else float(np.abs(t32 - want).max())
        if not within(ours, want, noise, 1e-5 * scale, TOL):
            bad[name] = (float(np.abs(ours - want).max()), float(np.abs(want).max()))
    assert not bad, f"(max |ours - tf64|, max |tf64|) beyond the tolerance: {bad}"
    CHECKED.append([cls for cls, _ in layers])
