"""Random Keras models, saved with ``model.export()`` and converted, against TF in float64.

A generator of the Keras models users bring (``tests/test_keras_fuzz.py``; more examples with
``python bench/fuzz_keras.py``): a stack of 1 to 4 layers from a catalogue of image layers
(Conv2D with same / valid padding, strides, dilations and groups; DepthwiseConv2D,
SeparableConv2D, Conv2DTranspose; max and average pools; BatchNormalization,
LayerNormalization; UpSampling2D, Resizing, ZeroPadding2D, Cropping2D; activations, PReLU,
ReLU6, Softmax, Dropout) or sequence layers (Dense, TimeDistributed, LSTM / GRU (both reset
forms) / SimpleRNN forward or backward, their last state, Bidirectional, Conv1D with causal
padding, pools, MultiHeadAttention, Attention, LayerNormalization), over float inputs or
int32 token ids through an Embedding; any layer may sit in a residual branch merged with its
input (Add, Subtract, Multiply, Maximum, Average, Concatenate); then a head. The model is
built twice from the same layer list: in float32, which is exported, converted
(``onnxgrad.converters.tensorflow.convert``) and differentiated by ``onnxgrad.gradients``
(run in a stock onnxruntime session), and in float64 with the same weights, whose
``tf.GradientTape`` is the reference (:func:`check`).

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
from onnxgrad.converters.tensorflow import ConversionError, convert
from onnxgrad.training.step import default_params
from util import stock_session as session
from util import within

VOCABULARY = 7  # token ids of the ``tokens`` family
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
def image_layer(draw, h, w, c, inner=False):
    kind = draw(st.sampled_from(["conv", "conv", "depthwise", "separable", "convt", "maxpool",
                                 "avgpool", "bn", "ln", "act", "upsample", "pad", "crop",
                                 "gconv", "prelu", "relu6", "softmax", "dropout", "resize",
                                 *([] if inner else ["residual", "residual"])]))
    if kind == "residual":
        return draw(_residual(image_layer, (h, w, c)))
    if kind == "gconv":  # grouped: channels in and out divisible by the groups
        assume(c % 2 == 0)
        k = draw(st.sampled_from([1, 3]))
        f = 2 * draw(st.integers(1, 3))
        return ("Conv2D", dict(filters=f, kernel_size=k, groups=2, padding="same",
                               activation=draw(st.sampled_from(_ACTS))), (h, w, f))
    if kind in ("prelu", "relu6", "softmax", "dropout"):
        cls, kw = {"prelu": ("PReLU", dict(alpha_initializer="random_normal")),
                   "relu6": ("ReLU", dict(max_value=6.0, negative_slope=0.1)),
                   "softmax": ("Softmax", {}), "dropout": ("Dropout", dict(rate=0.5))}[kind]
        return (cls, kw, (h, w, c))
    if kind == "resize":
        ho, wo = draw(st.integers(2, 9)), draw(st.integers(2, 9))
        return ("Resizing", dict(height=ho, width=wo, interpolation=draw(st.sampled_from(
            ["nearest", "bilinear"]))), (ho, wo, c))
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
def seq_layer(draw, s, d, inner=False):
    kind = draw(st.sampled_from(["dense", "rnn", "rnn", "bidi", "conv1d", "pool1d", "mha",
                                 "ln", "act", "gru1", "timedist", "attention", "last",
                                 *([] if inner else ["residual", "residual"])]))
    if kind == "residual":
        return draw(_residual(seq_layer, (s, d)))
    if kind == "gru1":  # the reset gate before the recurrent product (Keras 2's GRU)
        u = draw(st.integers(1, 6))
        return ("GRU", dict(units=u, return_sequences=True, reset_after=False), (s, u))
    if kind == "timedist":
        u = draw(st.integers(1, 6))
        return ("TimeDistributed", dict(layer=("Dense", dict(units=u, activation=draw(
            st.sampled_from(_ACTS))))), (s, u))
    if kind == "attention":  # dot-product self-attention, optionally scaled and causal
        return ("Attention", dict(use_scale=draw(st.booleans()),
                                  score_mode=draw(st.sampled_from(["dot", "concat"])),
                                  causal=draw(st.booleans())), (s, d))
    if kind == "last":  # an RNN's last state: the stack's last layer
        assume(not inner)
        cls = draw(st.sampled_from(["LSTM", "GRU", "SimpleRNN"]))
        u = draw(st.integers(1, 6))
        return (cls, dict(units=u, go_backwards=draw(st.booleans())), (u,))
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


_MERGES = ["Add", "Subtract", "Multiply", "Maximum", "Average", "Concatenate"]


@st.composite
def _residual(draw, make, shape):
    """A branch beside the identity, merged: y = merge(x, layer(x)) (a ResNet block, a
    U-Net's skip); Concatenate where only the channels differ."""
    cls, kw, out = draw(make(*shape, inner=True))
    if tuple(out) == tuple(shape):
        merge = draw(st.sampled_from(_MERGES))
    else:
        assume(len(out) == len(shape) and tuple(out[:-1]) == tuple(shape[:-1]))
        merge = "Concatenate"
    new = (*shape[:-1], shape[-1] + out[-1]) if merge == "Concatenate" else tuple(shape)
    return ("Residual", dict(layer=(cls, kw), merge=merge), new)


@st.composite
def models(draw):
    """(layers, input shape without the batch, head): a list of layer specs to build."""
    family = draw(st.sampled_from(["image", "seq", "tokens"]))
    if family == "image":
        shape = (draw(st.integers(3, 8)), draw(st.integers(3, 8)), draw(st.integers(1, 3)))
        make = image_layer
    else:
        shape = (draw(st.integers(2, 6)), draw(st.sampled_from([2, 3, 4])))
        make = seq_layer
    layers, cur = [], shape
    if family == "tokens":  # int32 token ids through an Embedding (no gradient wrt them)
        layers.append(("Embedding", dict(input_dim=VOCABULARY, output_dim=shape[1])))
        shape = shape[:1]
    for _ in range(draw(st.integers(1, 4))):
        cls, kw, cur = draw(make(*cur))
        assume(int(np.prod(cur)) <= 1024)
        layers.append((cls, kw))
        if len(cur) == 1:
            break
    head = draw(st.sampled_from(["none", "dense"] if len(cur) == 1 else
                                ["none", "dense", "pool", "maxpool"]))
    return layers, shape, head, draw(st.integers(1, 4))


# Keras's zero biases put a dead ReLU's next layer exactly on an activation's kink (selu at 0:
# onnxgrad takes the left derivative, as torch; TF's SeluGrad the right one: README,
# Guarantees); drawn biases keep every example off the kinks that no margin here records
_BIASED = {"Conv2D", "DepthwiseConv2D", "SeparableConv2D", "Conv2DTranspose", "Conv1D", "Dense"}


def build(layers, shape, head, units, dtype):
    """The Keras functional model of ``layers`` in ``dtype`` (weights as Keras draws them)."""
    import keras
    L = keras.layers
    tokens = layers[0][0] == "Embedding"
    x = keras.Input(shape, dtype="int32" if tokens else dtype)
    y = x
    for cls, kw in layers:
        y = _apply(L, cls, kw, y, dtype)
    if head == "dense":
        y = L.Dense(units, dtype=dtype)(L.Flatten(dtype=dtype)(y))
    elif head in ("pool", "maxpool"):
        rank = len(y.shape) - 2
        pool = getattr(L, f"Global{'Max' if head == 'maxpool' else 'Average'}Pooling{rank}D")
        y = L.Dense(units, dtype=dtype)(pool(dtype=dtype)(y))
    return keras.Model(x, y)


def _apply(L, cls, kw, y, dtype):
    """Layer ``cls`` built with ``kw`` in ``dtype``, applied to the Keras tensor ``y``."""
    kw = dict(kw)
    if cls == "MHA":
        causal = kw.pop("causal")
        return L.MultiHeadAttention(dtype=dtype, **kw)(y, y, use_causal_mask=causal)
    if cls == "Attention":
        causal = kw.pop("causal")
        return L.Attention(dtype=dtype, **kw)([y, y], use_causal_mask=causal)
    if cls in ("Bidirectional", "TimeDistributed"):
        inner, ikw = kw["layer"]
        return getattr(L, cls)(getattr(L, inner)(dtype=dtype, **_drawn_bias(inner, ikw)),
                               dtype=dtype)(y)
    if cls == "Residual":
        branch = _apply(L, *kw["layer"], y, dtype)
        return getattr(L, kw["merge"])(dtype=dtype)([y, branch])
    return getattr(L, cls)(dtype=dtype, **_drawn_bias(cls, kw))(y)


def _drawn_bias(cls, kw):
    """``kw`` with a drawn bias for a layer that has one (Keras's zeros put a dead ReLU's next
    layer exactly on its activation's kink: inner layers of TimeDistributed too, seed 19 of
    bench/fuzz_keras.py, a selu at 0 where TF's subgradient is another than onnxgrad's)."""
    if cls in _BIASED and kw.get("use_bias", True):
        return {**kw, "bias_initializer": "random_normal"}
    return kw


def _tape(model, x, gy):
    import tensorflow as tf
    weights = model.trainable_weights
    xt = tf.constant(x)
    floating = xt.dtype.is_floating
    with tf.GradientTape() as tape:
        if floating:
            tape.watch(xt)
        y = model(xt, training=False)
    gs = tape.gradient(y, [xt, *weights] if floating else weights,
                       output_gradients=tf.constant(gy))
    gs = [None if g is None else tf.convert_to_tensor(g).numpy() for g in gs]
    return y.numpy(), gs if floating else [None, *gs]


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
    check_built(m32, m64, shape, layers[0][0] == "Embedding", seed, batch)
    CHECKED.append([f"{kw['merge']}({kw['layer'][0]})" if cls == "Residual" else cls
                    for cls, kw in layers])


#: "onnxgrad" (its TF converter) or "tf2onnx" (bench/fuzz_keras.py --converter tf2onnx: the
#: converter most Keras users take; its graphs fold and rename weights, so the input's gradient
#: alone is compared)
CONVERTER = "onnxgrad"


def converted(m):
    """The Keras model ``m`` saved with ``model.export()`` and converted."""
    if CONVERTER == "tf2onnx":
        import tensorflow as tf
        import tf2onnx  # (not a test extra: pip install tf2onnx)
        spec = [tf.TensorSpec(t.shape, t.dtype, name="x") for t in m.inputs]
        fn = tf.function(lambda t: m(t, training=False))
        try:
            model = tf2onnx.convert.from_function(fn, input_signature=spec, opset=17)[0]
            onnx.checker.check_model(model, full_check=True)
        except Exception as e:  # noqa: BLE001  (tf2onnx's: Gelu's Erfc has no ONNX op)
            _reject(f"tf2onnx: {type(e).__name__}")
        return model
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "saved")
        m.export(path, verbose=False)
        return convert(path)


def keras_sgd(m, loss_fn, x, y, lr, steps=3) -> list[float]:
    """TensorFlow's SGD steps on the Keras model ``m`` in inference mode (as exported), in
    place: the losses, ``loss_fn(y, m(x))`` before each step."""
    import keras
    import tensorflow as tf
    opt, losses = keras.optimizers.SGD(lr), []
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, m(x, training=False))
        opt.apply_gradients(zip(tape.gradient(loss, m.trainable_weights), m.trainable_weights))
        losses.append(float(loss))
    return losses


def check_built(m32, m64, shape, tokens=False, seed=0, batch=2, reject=_reject):
    """:func:`check` of a built pair: ``m32`` is exported, converted and differentiated, ``m64``
    (the same weights in float64) is the reference; ``reject(why)`` is called at a kink.
    Returns the node counts and the worst tensor's max |ours - tf64| / max |tf64|."""
    rng = np.random.default_rng(seed)
    if tokens:
        x = x64 = rng.integers(0, VOCABULARY, (batch, *shape)).astype(np.int32)
    else:
        x = rng.standard_normal((batch, *shape)).astype(np.float32)
        x64 = x.astype(np.float64)
    gy = rng.standard_normal(tuple(m64(x64, training=False).shape)).astype(np.float32)
    y64, g64 = _tape(m64, x64, gy.astype(np.float64))
    y32, g32 = _tape(m32, x, gy)
    scale = max(float(np.abs(g).max()) for g in g64 if g is not None)
    for a, b in zip(g32, g64):
        if a is not None and float(np.abs(a - b).max()) > 1e-2 * max(scale, 1e-30):
            reject("kink (TF's float32 gradient is off its float64 one)")
    try:
        model = converted(m32)
    except ConversionError as e:
        if "training mode" not in str(e):
            raise
        # Keras's export traced a BatchNormalization after a Resizing layer in training mode:
        # the SavedModel's serving function updates its statistics (refused, clearly)
        reject("Keras exported a layer in training mode")
    onnx.checker.check_model(model, full_check=True)
    (x_in,), (y_out,) = model.graph.input, model.graph.output
    names = [f"{w.path}:0" for w in m32.trainable_weights]
    if CONVERTER == "tf2onnx":
        if tokens:
            reject("tf2onnx: no float input to compare")
        names, g64, g32 = [], g64[:1], g32[:1]
    inits = {t.name for t in model.graph.initializer}
    assert set(names) <= inits, f"weights not found by their variables' names: {names}"
    trained = default_params(model)[0]  # what the Trainer trains: exactly Keras's trainables
    assert CONVERTER == "tf2onnx" or sorted(trained) == sorted(names), \
        f"the Trainer would train {trained}, not {names}"
    y_ort = session(model).run([y_out.name], {x_in.name: x})[0]
    noise_y = float(np.abs(y32 - y64).max())
    assert within(y_ort, y64, noise_y, 1e-6, TOL), "the converted forward differs from TF's"
    wrt = names if tokens else [x_in.name, *names]
    before = model.SerializeToString()
    res = onnxgrad.gradients(model, y_out.name, wrt, grad_ys=["gy"])
    assert model.SerializeToString() == before, "gradients() changed the model it was given"
    onnx.checker.check_model(res.model, full_check=True)
    outs = session(res.model).run([g for g in res.grads if g], {x_in.name: x, "gy": gy})
    got = iter(outs)
    bad, worst = {}, (0.0, "-")
    for name, g, want, t32 in zip(wrt, res.grads, g64[1:] if tokens else g64,
                                  g32[1:] if tokens else g32):
        if g is None:
            assert want is None or not np.any(want), f"{name}: no gradient, TF's is nonzero"
            continue
        ours = next(got)
        want = np.zeros(ours.shape) if want is None else want
        noise = 0.0 if t32 is None else float(np.abs(t32 - want).max())
        if not within(ours, want, noise, 1e-5 * scale, TOL):
            bad[name] = (float(np.abs(ours - want).max()), float(np.abs(want).max()))
        worst = max(worst, (float(np.abs(ours - want).max() / max(np.abs(want).max(), 1e-30)),
                            name))
    assert not bad, f"(max |ours - tf64|, max |tf64|) beyond the tolerance: {bad}"
    return dict(nodes=len(model.graph.node), grad_nodes=len(res.model.graph.node),
                tensors=len(wrt), worst=worst)
