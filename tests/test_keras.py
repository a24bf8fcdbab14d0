"""Keras 3 models (TensorFlow 2.21) saved with ``model.export()``: converted, run and
differentiated. For every model of the layer list (Dense, Conv1D/Conv2D dilated and not,
BatchNormalization, Dropout, gelu, celu, selu, hard_swish, mish, swish, silu, Embedding (with mask_zero into a GRU too), LSTM, GRU (with dropout too), Bidirectional, a hand-written
tf.while_loop RNN over a TensorArray, MultiHeadAttention with a causal mask, LayerNormalization,
Resizing and UpSampling2D): the converted output equals TF's, and ``onnxgrad.gradients`` of the
output (under a random upstream gradient) with respect to the input and every weight equals
``tf.GradientTape``'s, the weights found under their variables' names. The tape's own gradient
function, frozen, converts and equals TF too; and ``onnxgrad.Trainer`` fine-tunes a converted
model. TF's references run as tf.functions (graph mode, what the SavedModel runs)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from tf_util import ort_run, tf  # (skips the module without TF)

import onnxgrad  # noqa: E402
from onnxgrad.converters.tensorflow import convert  # noqa: E402

keras = pytest.importorskip("keras")
L = keras.layers


class WhileRNN(L.Layer):
    """h_t = tanh(x_t W + h_{t-1} U), h_{t-1} read back from the TensorArray the loop writes:
    a loop-carried list read and written in the loop."""

    def __init__(self, units, **kw):
        super().__init__(**kw)
        self.units = units

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], self.units), name="w")
        self.u = self.add_weight(shape=(self.units, self.units), name="u")

    def call(self, x):
        steps = tf.shape(x)[1]
        ta = tf.TensorArray(tf.float32, size=steps + 1).write(
            0, tf.zeros([tf.shape(x)[0], self.units]))

        def body(t, ta):
            h = tf.tanh(tf.matmul(x[:, t], self.w) + tf.matmul(ta.read(t), self.u))
            return t + 1, ta.write(t + 1, h)
        _, ta = tf.while_loop(lambda t, ta: t < steps, body, [0, ta])
        return tf.transpose(ta.stack()[1:], [1, 0, 2])


def _gelu(x):
    return keras.activations.gelu(x, approximate=False)  # TF: 0.5 x erfc(-x / sqrt(2))


def _seq():
    return keras.Input((5, 3))


def _conv():
    inp = keras.Input((9, 9, 3))
    h = L.Conv2D(4, 3, dilation_rate=2, padding="same")(L.Conv2D(3, 2, padding="same")(inp))
    h = L.BatchNormalization()(h)
    return inp, L.Conv1D(2, 3, dilation_rate=2)(L.Conv1D(3, 2)(L.Reshape((81, 4))(h)))


def _attention():
    inp = keras.Input((5, 8))
    h = L.MultiHeadAttention(2, 4)(inp, inp, use_causal_mask=True)
    return inp, L.LayerNormalization()(h + inp)


def _resize():
    inp = keras.Input((6, 6, 2))
    parts = [L.Resizing(9, 9, interpolation="bilinear")(inp), L.Resizing(4, 4,
             interpolation="nearest")(inp), L.UpSampling2D(2, interpolation="bilinear")(inp),
             L.UpSampling2D(2)(inp)]
    return inp, L.Concatenate()([L.Flatten()(p) for p in parts])


def _embedding():
    inp = keras.Input((5,), dtype="int32")
    return inp, L.Dense(2)(L.Embedding(10, 4)(inp))


MODELS = {  # name: (builder -> (input, output), input shape)
    "dense_dropout_gelu": (lambda: (lambda i: (i, L.Dense(3, activation=_gelu)(L.Dropout(0.5)(
        L.Dense(5, activation="relu")(i)))))(keras.Input((6,))), (4, 6)),
    "conv_dilated_batchnorm": (_conv, (2, 9, 9, 3)),
    "embedding": (_embedding, (3, 5)),
    "embedding_mask_zero_gru": (lambda: (lambda i: (i, L.GRU(3)(L.Embedding(10, 4, mask_zero=True)(
        i))))(keras.Input((6,), dtype="int32")), (3, 6)),
    "lstm": (lambda: (lambda i: (i, L.LSTM(4, return_sequences=True)(i)))(_seq()), (2, 5, 3)),
    "gru": (lambda: (lambda i: (i, L.GRU(4, return_sequences=True)(i)))(_seq()), (2, 5, 3)),
    "bidirectional_lstm": (lambda: (lambda i: (i, L.Bidirectional(L.LSTM(
        3, return_sequences=True))(i)))(_seq()), (2, 5, 3)),
    # dropout: every call (inference too) advances the layer's SeedGenerator, an integer
    # variable TF cannot freeze; were refused
    "lstm_dropout": (lambda: (lambda i: (i, L.LSTM(4, dropout=0.2, recurrent_dropout=0.1,
                                                   return_sequences=True)(i)))(_seq()), (2, 5, 3)),
    "gru_dropout": (lambda: (lambda i: (i, L.Dense(2)(L.GRU(3, dropout=0.3)(i))))(_seq()),
                    (2, 5, 3)),
    "while_loop_rnn": (lambda: (lambda i: (i, WhileRNN(4)(i)))(_seq()), (2, 5, 3)),
    "attention_causal_layernorm": (_attention, (2, 5, 8)),
    # Keras's celu: max(x, 0) + min(0, a expm1(x / a)); the converted Expm1's branch not taken
    # divided 0 by 0 at every x >= 0 (NaN input gradients)
    "celu_selu_hard_swish": (lambda: (lambda i: (i, L.Concatenate()([
        L.Activation(a)(i) for a in ("celu", "selu", "hard_swish", "mish")])))(
        keras.Input((6,))), (4, 6)),
    # swish / silu: TF's custom gradient (an IdentityN) is the product's own derivative; were
    # refused as a custom gradient
    "swish_silu": (lambda: (lambda i: (i, L.Dense(3, activation="silu")(L.Conv1D(
        4, 2, activation="swish")(i))))(_seq()), (2, 5, 3)),
    "resizing_upsampling": (_resize, (2, 6, 6, 2)),
}


class Case:
    """One exported model: its SavedModel, an input, TF's output and gradients (input first,
    then the trainable weights under their variable names), and the frozen tape function."""


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Every model built, exported and run in TF once (Keras needs eager mode, which other
    test modules switch off for the whole process: all of it runs in an eager context)."""
    from tensorflow.python.eager import context

    out = {}
    root = tmp_path_factory.mktemp("keras")
    with context.eager_mode():
        for name, (build, shape) in MODELS.items():
            keras.utils.set_random_seed(0)
            model = keras.Model(*build())
            case = Case()
            case.path = root / name
            model.export(str(case.path), verbose=False)
            rng = np.random.default_rng(0)
            case.int_input = name.startswith("embedding")
            case.x = rng.integers(0, 10, shape).astype(np.int32) if case.int_input else \
                rng.standard_normal(shape).astype(np.float32)
            weights = model.trainable_weights
            case.weights = [f"{w.path}:0" for w in weights]

            step = _tape_step(model, weights)
            y_shape = tf.function(lambda v, m=model: m(v, training=False))(case.x).shape
            case.gy = rng.standard_normal(y_shape).astype(np.float32)
            cf = step.get_concrete_function(tf.TensorSpec(case.x.shape, case.x.dtype),
                                            tf.TensorSpec(case.gy.shape, tf.float32))
            res = [v.numpy() for v in cf(tf.constant(case.x), tf.constant(case.gy))]
            case.y, case.grads = res[0], res[1:]  # (no input gradient for int input)
            case.tape_graph = cf.graph.as_graph_def()  # the weights are Consts in it
            case.tape_inputs = [t.name for t in cf.inputs]
            case.tape_outputs = [t.name for t in cf.outputs]
            out[name] = case
    return out


def _tape_step(model, weights):
    """TF's reference: the output and the tape's gradients of (input, trainable weights) under
    the upstream gradient gy, as a tf.function whose weights are constants of its graph
    (Keras's stateless_call), so that its GraphDef is the frozen gradient function (TF's own
    freezing cannot rewrite the VariableShape ops of a while loop's gradient)."""
    values = [w.numpy() for w in weights]
    rest = [w.numpy() for w in model.non_trainable_variables]

    @tf.function
    def step(x, gy):
        ws = [tf.constant(v) for v in values]
        with tf.GradientTape() as tape:
            tape.watch([x] + ws)
            y, _ = model.stateless_call(ws, [tf.constant(v) for v in rest], x, training=False)
        gs = tape.gradient(y, [x] + ws, output_gradients=gy)
        return [y] + [tf.convert_to_tensor(g) for g in gs if g is not None]
    return step


def assert_close(got, want, scale, what):
    """1e-5 relative, and absolute 1e-6 of the largest reference value of its kind (a gradient
    that is zero by the math, attention's key bias, is float noise on both sides)."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale, err_msg=what)


@pytest.mark.parametrize("name", MODELS)
def test_keras_model_converts_and_differentiates(cases, name):
    case = cases[name]
    model = convert(case.path)
    onnx.checker.check_model(model, full_check=True)
    (x_in,), (y_out,) = model.graph.input, model.graph.output
    inits = {t.name for t in model.graph.initializer}
    assert set(case.weights) <= inits, "weights are named after their variables"
    (y,) = ort_run(model, {x_in.name: case.x}, [y_out.name])
    assert_close(y, case.y, np.abs(case.y).max(), "output")
    xs = ([] if case.int_input else [x_in.name]) + case.weights
    res = onnxgrad.gradients(model, y_out.name, xs, grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    got = ort_run(res.model, {x_in.name: case.x, "gy": case.gy}, res.grads)
    scale = max(np.abs(g).max() for g in case.grads)
    for x, g, want in zip(xs, got, case.grads):
        assert_close(g, want, scale, f"gradient of {x}")


@pytest.mark.parametrize("name", MODELS)
def test_frozen_tape_gradient_function(cases, name):
    """The tape's gradient function (TF's own gradient graph: while-gradient bodies, TensorList
    accumulators, BiasAddGrad of unknown rank, ResizeBilinearGrad, ...), frozen, converts and
    equals TF."""
    case = cases[name]
    model = convert(case.tape_graph, inputs=case.tape_inputs, outputs=case.tape_outputs)
    got = ort_run(model, dict(zip(case.tape_inputs, [case.x, case.gy])), case.tape_outputs)
    assert_close(got[0], case.y, np.abs(case.y).max(), "output")
    scale = max(np.abs(g).max() for g in case.grads)
    for out, g, want in zip(case.tape_outputs[1:], got[1:], case.grads):
        assert_close(g, want, scale, out)


def test_trainer_fine_tunes_a_converted_keras_model(cases):
    """onnxgrad.Trainer on the converted LSTM: the loss falls, and only the variables train
    (the converted graph's constants are left alone: the model lists its weights)."""
    case = cases["lstm"]
    model = convert(case.path)
    x_in, y_out = model.graph.input[0].name, model.graph.output[0].name
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 5, 3)).astype(np.float32)
    target = np.tanh(np.cumsum(x[..., :1], axis=1)) * np.ones((1, 1, 4), np.float32)
    trainer = onnxgrad.Trainer(model, "mse", optimizer=onnxgrad.training.Adam(lr=0.02),
                               device="cpu", threads=1, progress=False)
    assert sorted(trainer.parameters()) == sorted(case.weights)
    first = trainer.evaluate({x_in: x, "target": target})
    trainer.fit({x_in: x, "target": target}, epochs=30, batch_size=16)
    last = trainer.evaluate({x_in: x, "target": target})
    assert last < 0.5 * first, (first, last)
    trained = trainer.trained_model()
    (y,) = ort_run(trained, {x_in: x}, [y_out])
    assert np.mean((y - target) ** 2) == pytest.approx(last, rel=1e-4)


@pytest.mark.parametrize("how", ["layer", "base_model", "embedding", "lora"])
def test_weights_keras_freezes_are_not_trained(tmp_path, how):
    """layer.trainable = False (a frozen base model, a pretrained Embedding, the kernel
    enable_lora freezes) leaves the variables' own trainable flag True; the SavedModel lists
    them as not trainable, and so does the converted model: the Trainer trains exactly Keras's
    trainable_weights, to Keras's values (they were all trained)."""
    keras.utils.set_random_seed(0)
    if how == "embedding":
        i = keras.Input((5,), dtype="int32")
        h = L.Flatten()(L.Embedding(10, 4, trainable=False, name="emb")(i))
        x = np.random.default_rng(0).integers(0, 10, (3, 5)).astype(np.int32)
    elif how == "base_model":
        bi = keras.Input((4,))
        base = keras.Model(bi, L.Dense(5, activation="tanh", name="b_dense")(bi), name="base")
        base.trainable = False
        i = keras.Input((4,))
        h = base(i, training=False)
        x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    else:
        i = keras.Input((4,))
        layer = L.Dense(5, activation="tanh", name="frozen")
        h = layer(i)
        if how == "layer":
            layer.trainable = False
        else:
            layer.enable_lora(2)
        x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    model = keras.Model(i, L.Dense(2, name="head")(h))
    model.export(str(tmp_path / "sm"), verbose=False)
    m = convert(str(tmp_path / "sm"))
    t = np.random.default_rng(1).standard_normal((3, 2)).astype(np.float32)
    tr = onnxgrad.Trainer(m, "mse", optimizer=onnxgrad.training.SGD(lr=0.1), device="cpu",
                          threads=1, progress=False)
    assert sorted(tr.params) == sorted(w.path + ":0" for w in model.trainable_weights)
    for _ in range(2):
        tr.step({m.graph.input[0].name: x, "target": t})
    opt = keras.optimizers.SGD(0.1)
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(t, model(x, training=False))
        grads = tape.gradient(loss, model.trainable_weights)
        opt.apply_gradients(zip(grads, model.trainable_weights))
    ours = {q.name: onnx.numpy_helper.to_array(q) for q in tr.trained_model().graph.initializer}
    for w in model.weights:
        np.testing.assert_allclose(ours[w.path + ":0"], w.numpy(), rtol=1e-5, atol=1e-6)


def test_an_output_that_reads_an_assigned_variable_is_refused(tmp_path):
    """A SavedModel whose output reads an integer variable it also assigns: the variable
    cannot be a constant; a clear refusal, not a model that ignores the update."""
    from tensorflow.python.eager import context

    from onnxgrad.converters.tensorflow import ConversionError

    class Counter(tf.Module):
        def __init__(self):
            super().__init__()
            self.n = tf.Variable(1, dtype=tf.int64)

        @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)])
        def __call__(self, x):
            self.n.assign_add(1)
            return {"y": x * tf.cast(self.n, tf.float32)}

    with context.eager_mode():
        m = Counter()
        tf.saved_model.save(m, str(tmp_path / "c"), signatures=m.__call__)
    with pytest.raises(ConversionError, match="variable"):
        convert(str(tmp_path / "c"))


def test_grouped_conv2d_inside_keras_jit_function(tmp_path):
    """Keras's Conv2D(groups=2) runs TF's grouped conv inside a jit-compiled function, whose
    body did not know its argument's shapes: it converted as ungrouped, a model onnxruntime
    refused. The function's traced argument shapes are read now: forward and gradients equal
    TF's; so does the tape's gradient graph, converted (its grouped filter gradient, grouped
    Conv2DBackpropFilter, was refused)."""
    from tensorflow.python.eager import context

    with context.eager_mode():
        keras.utils.set_random_seed(0)
        inp = keras.Input((5, 5, 4))
        model = keras.Model(inp, L.Conv2D(4, 3, groups=2, padding="same")(inp))
        model.export(str(tmp_path / "m"), verbose=False)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2, 5, 5, 4)).astype(np.float32)
        weights = model.trainable_weights
        step = _tape_step(model, weights)
        gy = rng.standard_normal((2, 5, 5, 4)).astype(np.float32)
        cf = step.get_concrete_function(tf.TensorSpec(x.shape, tf.float32),
                                        tf.TensorSpec(gy.shape, tf.float32))
        want = [v.numpy() for v in cf(tf.constant(x), tf.constant(gy))]
        tape = (cf.graph.as_graph_def(), [t.name for t in cf.inputs],
                [t.name for t in cf.outputs])
    m = convert(tmp_path / "m")
    (x_in,), (y_out,) = m.graph.input, m.graph.output
    xs = [x_in.name] + [f"{w.path}:0" for w in weights]
    res = onnxgrad.gradients(m, y_out.name, xs, grad_ys=["gy"])
    got = ort_run(res.model, {x_in.name: x, "gy": gy}, [y_out.name, *res.grads])
    for g, w, what in zip(got, want, ["output", *xs]):
        assert_close(g, w, np.abs(w).max(), what)
    tm = convert(tape[0], inputs=tape[1], outputs=tape[2])
    got = ort_run(tm, dict(zip(tape[1], [x, gy])), tape[2])
    for g, w, what in zip(got, want, ["output", *xs]):
        assert_close(g, w, np.abs(w).max(), f"{what} (the tape's graph)")


def test_batch_norm_exported_in_training_mode_is_refused_with_the_remedy(tmp_path):
    """Keras's model.export() traces a BatchNormalization after a Resizing layer in training
    mode (its serving function normalizes with the batch's statistics and updates the moving
    ones): refused, saying so and how to export instead; the remedy converts, in inference
    mode, with the moving statistics not trained."""
    from onnxgrad.converters.tensorflow import ConversionError
    from onnxgrad.training.step import default_params

    x = keras.Input((3, 3, 1))
    m = keras.Model(x, L.BatchNormalization()(L.Resizing(2, 2)(x)))
    m.export(str(tmp_path / "export"), verbose=False)
    with pytest.raises(ConversionError, match="training mode .*training=False"):
        convert(str(tmp_path / "export"))
    archive = keras.export.ExportArchive()
    archive.track(m)
    archive.add_endpoint("serve", lambda t: m(t, training=False),
                         input_signature=[tf.TensorSpec([None, 3, 3, 1], tf.float32)])
    archive.write_out(str(tmp_path / "archive"), verbose=False)
    model = convert(str(tmp_path / "archive"), signature="serve")
    a = np.random.default_rng(0).standard_normal((2, 3, 3, 1)).astype(np.float32)
    (y,) = ort_run(model, {model.graph.input[0].name: a}, [model.graph.output[0].name])
    np.testing.assert_allclose(y, m(a, training=False).numpy(), rtol=1e-5, atol=1e-6)
    assert sorted(default_params(model)[0]) == sorted(f"{w.path}:0" for w in m.trainable_weights)
