"""What a converted TensorFlow model trains by default: its trainable variables, never its
state. Keras's BatchNormalization moving mean and variance and a Normalization layer's
statistics are SavedModel variables marked not trainable; a frozen GraphDef's FusedBatchNorm
reads its moving statistics as Consts; the converter's own constants (an epsilon) hold no TF
Const. Before session 37 the Trainer trained all of those by gradient descent (a moving
variance can go negative: NaN), where Keras's fit never changes them by gradients."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from tf_util import tf  # (skips the module without TF)

import onnxgrad  # noqa: E402
from onnxgrad.converters.tensorflow import convert  # noqa: E402
from onnxgrad.training.step import default_params  # noqa: E402

keras = pytest.importorskip("keras")
L = keras.layers

from keras_gen import converted, keras_sgd  # noqa: E402


def _bn_model(rng):
    """Normalization (adapted: its statistics are constants of the exported graph), Conv2D,
    BatchNormalization with moving statistics away from 0 and 1, ReLU, Dense."""
    keras.utils.set_random_seed(3)
    norm = L.Normalization()
    norm.adapt(rng.standard_normal((16, 6, 6, 2)).astype(np.float32) * 2 + 1)
    bn = L.BatchNormalization()
    m = keras.Sequential([keras.Input((6, 6, 2)), norm, L.Conv2D(3, 3), bn, L.ReLU(),
                          L.Flatten(), L.Dense(2)])
    bn.moving_mean.assign(rng.standard_normal(3).astype(np.float32))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, 3).astype(np.float32))
    return m


def test_keras_state_is_not_trained_and_steps_match_tensorflow():
    """The Trainer's default parameters are Keras's trainable weights exactly; three SGD steps
    equal TensorFlow's (the model in inference mode, as exported), and the statistics stay."""
    rng = np.random.default_rng(0)
    m = _bn_model(rng)
    model = converted(m)
    trainable = sorted(f"{w.path}:0" for w in m.trainable_weights)
    inits = {t.name for t in model.graph.initializer}
    state = sorted(f"{w.path}:0" for w in m.non_trainable_weights if f"{w.path}:0" in inits)
    params, left_out = default_params(model)
    assert sorted(params) == trainable
    assert len(state) == 2 and all("not trainable" in left_out[s] for s in state), left_out

    x = rng.standard_normal((8, 6, 6, 2)).astype(np.float32)
    target = rng.standard_normal((8, 2)).astype(np.float32)
    x_in = model.graph.input[0].name
    trainer = onnxgrad.Trainer(model, "mse", optimizer=onnxgrad.training.SGD(lr=0.05),
                               device="cpu", threads=1, progress=False)
    before = {s: v.copy() for s, v in trainer.parameters().items()}
    ours = [trainer.step({x_in: x, "target": target}) for _ in range(3)]

    theirs = keras_sgd(m, lambda t, y: tf.reduce_mean((y - t) ** 2), x, target, 0.05)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    got = trainer.parameters()
    for w in m.trainable_weights:
        np.testing.assert_allclose(got[f"{w.path}:0"], w.numpy(), rtol=1e-4, atol=1e-6)
    trained = trainer.trained_model()  # trained again later: the same parameters
    assert sorted(default_params(trained)[0]) == trainable
    final = {t.name: t for t in trained.graph.initializer}
    for s in state:
        assert s not in got and s not in before
        np.testing.assert_array_equal(numpy_helper.to_array(final[s]),
                                      next(w for w in m.non_trainable_weights
                                           if f"{w.path}:0" == s).numpy())


def test_graph_def_batch_norm_statistics_and_converter_constants_are_not_trained():
    """A frozen GraphDef lists no variables: every float TF Const trains by default, except
    what a FusedBatchNorm reads as its moving mean and variance (also through an Identity);
    the constants the converter makes (FusedBatchNorm's epsilon) never."""
    rng = np.random.default_rng(1)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4, 4, 3], name="x")
        w = tf.constant(rng.standard_normal((3, 3, 3, 5)).astype(np.float32), name="w")
        y = tf.nn.conv2d(x, w, 1, "SAME")
        mean = tf.constant(rng.standard_normal(5).astype(np.float32), name="bn/moving_mean")
        var = tf.identity(tf.constant(rng.uniform(1, 2, 5).astype(np.float32),
                                      name="bn/moving_variance"))
        gamma = tf.constant(np.ones(5, np.float32), name="bn/gamma")
        beta = tf.constant(np.zeros(5, np.float32), name="bn/beta")
        z, _, _ = tf.compat.v1.nn.fused_batch_norm(y, gamma, beta, mean, var, is_training=False)
        tf.identity(tf.reduce_sum(z), name="out")
    model = convert(g.as_graph_def(), outputs=["out:0"])
    params, left_out = default_params(model)
    assert sorted(params) == ["bn/beta:0", "bn/gamma:0", "w:0"]
    assert "FusedBatchNorm" in left_out["bn/moving_mean:0"]
    assert "FusedBatchNorm" in left_out["bn/moving_variance:0"]
    assert any("converter made" in why for why in left_out.values()), left_out


def test_the_command_line_says_what_it_trains(tmp_path, capsys):
    """``onnxgrad train`` prints how many tensors it trains and what it leaves, and why."""
    import onnx

    from onnxgrad.cli import main
    m = _bn_model(np.random.default_rng(2))
    model = converted(m)
    onnx.save(model, tmp_path / "m.onnx")
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((16, 6, 6, 2)).astype(np.float32),
             y=rng.integers(0, 2, 16))
    rc = main(["train", str(tmp_path / "m.onnx"), "--loss", "cross_entropy", "--data",
               str(tmp_path / "data.npz"), "-o", str(tmp_path / "out.onnx"), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"parameters: {len(m.trainable_weights)} tensors" in out, out
    assert "2 a variable the SavedModel marks not trainable" in out, out


@pytest.mark.parametrize("side, classes", [(4, 3), (3, 3)])
def test_keras_segmentation_logits_take_their_classes_on_the_last_axis(side, classes):
    """A converted Keras segmentation net's logits are [N, H, W, C]: the Trainer's
    cross_entropy reads the classes on the last axis (as Keras's SparseCategoricalCrossentropy),
    so three SGD steps equal Keras's. With H = W = C (3x3 images, 3 classes) the old axis-1
    reading took the targets' shape all the same and trained a wrong loss, silently."""
    keras.utils.set_random_seed(5)
    m = keras.Sequential([keras.Input((side, side, 2)),
                          L.Conv2D(4, 3, padding="same", activation="tanh"),
                          L.Conv2D(classes, 1)])
    model = converted(m)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, side, side, 2)).astype(np.float32)
    y = rng.integers(0, classes, (5, side, side))
    trainer = onnxgrad.Trainer(model, "cross_entropy", optimizer=onnxgrad.training.SGD(lr=0.5),
                               device="cpu", threads=1, progress=False)
    assert trainer.class_axis == -1
    ours = [trainer.step({model.graph.input[0].name: x, "target": y}) for _ in range(3)]
    theirs = keras_sgd(m, keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y,
                        0.5)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    # the PyTorch layout still on request: the classes on axis 1 (here H), as before
    assert onnxgrad.Trainer(model, "cross_entropy", loss_options={"class_axis": 1},
                            device="cpu", progress=False).class_axis == 1


def test_a_loss_on_probabilities_warns_and_names_the_logits(caplog):
    """A Keras classifier ending in Dense(activation="softmax") outputs probabilities; the
    cross_entropy loss takes logits: the Trainer warns, naming the Softmax's input, and trained
    on that input its steps equal Keras's SparseCategoricalCrossentropy on the probabilities."""
    import logging

    keras.utils.set_random_seed(6)
    m = keras.Sequential([keras.Input((5,)), L.Dense(8, activation="tanh"),
                          L.Dense(3, activation="softmax")])
    model = converted(m)
    with caplog.at_level(logging.WARNING, logger="onnxgrad.training"):
        onnxgrad.Trainer(model, "cross_entropy", device="cpu", progress=False)
    (record,) = [r for r in caplog.records if "probabilities" in r.getMessage()]
    logits = record.args[-1]
    caplog.clear()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    y = rng.integers(0, 3, 6)
    with caplog.at_level(logging.WARNING, logger="onnxgrad.training"):
        trainer = onnxgrad.Trainer(model, "cross_entropy", output_name=logits,
                                   optimizer=onnxgrad.training.SGD(lr=0.5), device="cpu",
                                   threads=1, progress=False)
    assert not [r for r in caplog.records if "probabilities" in r.getMessage()]
    ours = [trainer.step({model.graph.input[0].name: x, "target": y}) for _ in range(3)]
    theirs = keras_sgd(m, keras.losses.SparseCategoricalCrossentropy(), x, y, 0.5)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
