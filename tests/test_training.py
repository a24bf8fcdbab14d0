"""Training: loss helpers, optimizers, train-step graphs and the Trainer against PyTorch.

20 steps of each optimizer on an MLP and a small CNN (same initial weights, hyper-parameters and
batches as a torch.optim loop) must match to 1e-5 relative in float32 on CPU; each loss helper
matches torch's loss and its gradient; a resumed run is bit-for-bit the uninterrupted one.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxgrad
from onnxgrad.runtime import session
from onnxgrad.training import (SGD, Adam, AdamW, NonFiniteLossError, Trainer, attach_loss,
                               build_gradient_model, build_train_step)
from util import grads_of, make_model, torch_train

torch = pytest.importorskip("torch")
F = torch.nn.functional
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# -- the two models, in ONNX and in torch -----------------------------------------------------
def mlp_model(seed=0):
    rng = np.random.default_rng(seed)
    w = {"W1": rng.standard_normal((16, 8)) * 0.4, "b1": rng.standard_normal(16) * 0.1,
         "W2": rng.standard_normal((12, 16)) * 0.3, "b2": rng.standard_normal(12) * 0.1,
         "W3": rng.standard_normal((3, 12)) * 0.3, "b3": np.zeros(3)}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h1"], transB=1),
             helper.make_node("Tanh", ["h1"], ["a1"]),
             helper.make_node("MatMul", ["a1", "W2T"], ["h2m"]),
             helper.make_node("Add", ["h2m", "b2"], ["h2"]),
             helper.make_node("Relu", ["h2"], ["a2"]),
             helper.make_node("Gemm", ["a2", "W3", "b3"], ["logits"], transB=1)]
    w["W2T"] = w.pop("W2").T.copy()  # the MatMul weight is stored [in, out]
    order = ["W1", "b1", "W2T", "b2", "W3", "b3"]
    m = make_model(nodes, {"x": (np.float32, ["N", 8])}, ["logits"],
                   inits={k: w[k] for k in order})

    def forward(x, p):
        h = torch.tanh(x @ p["W1"].T + p["b1"])
        h = torch.relu(h @ p["W2T"] + p["b2"])
        return h @ p["W3"].T + p["b3"]
    return m, forward, (8,)


def cnn_model(seed=0):
    rng = np.random.default_rng(seed)
    w = {"C1": rng.standard_normal((4, 1, 3, 3)) * 0.4, "c1": rng.standard_normal(4) * 0.1,
         "C2": rng.standard_normal((6, 4, 3, 3)) * 0.2, "c2": rng.standard_normal(6) * 0.1,
         "D": rng.standard_normal((3, 24)) * 0.2, "d": np.zeros(3)}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    nodes = [helper.make_node("Conv", ["x", "C1", "c1"], ["y1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "C2", "c2"], ["y2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y2"], ["r2"]),
             helper.make_node("AveragePool", ["r2"], ["p2"], kernel_shape=[2, 2],
                              strides=[2, 2]),
             helper.make_node("Flatten", ["p2"], ["f"], axis=1),
             helper.make_node("Gemm", ["f", "D", "d"], ["logits"], transB=1)]
    m = make_model(nodes, {"x": (np.float32, ["N", 1, 8, 8])}, ["logits"], inits=w)

    def forward(x, p):
        y = F.max_pool2d(F.relu(F.conv2d(x, p["C1"], p["c1"], padding=1)), 2)
        y = F.avg_pool2d(F.relu(F.conv2d(y, p["C2"], p["c2"], padding=1)), 2)
        return y.flatten(1) @ p["D"].T + p["d"]
    return m, forward, (1, 8, 8)


def segnet_model(seed=0):
    """A small segmentation net: Conv, MaxPool 2 down, ConvTranspose 2x2 stride 2 up, and a
    1x1 Conv to 3 classes per pixel, trained with cross-entropy against labels [N, 8, 8]."""
    rng = np.random.default_rng(seed)
    w = {"C1": rng.standard_normal((4, 1, 3, 3)) * 0.4, "c1": rng.standard_normal(4) * 0.1,
         "T": rng.standard_normal((4, 4, 2, 2)) * 0.3, "t": rng.standard_normal(4) * 0.1,
         "K": rng.standard_normal((3, 4, 1, 1)) * 0.4, "k": np.zeros(3)}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    nodes = [helper.make_node("Conv", ["x", "C1", "c1"], ["y1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("ConvTranspose", ["p1", "T", "t"], ["u"], strides=[2, 2]),
             helper.make_node("Relu", ["u"], ["r2"]),
             helper.make_node("Conv", ["r2", "K", "k"], ["logits"])]
    m = make_model(nodes, {"x": (np.float32, ["N", 1, 8, 8])}, ["logits"], inits=w)

    def forward(x, p):
        y = F.max_pool2d(F.relu(F.conv2d(x, p["C1"], p["c1"], padding=1)), 2)
        y = F.relu(F.conv_transpose2d(y, p["T"], p["t"], stride=2))
        return F.conv2d(y, p["K"], p["k"])
    return m, forward, (1, 8, 8)


OPTIMIZERS = {
    "sgd": (lambda: SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2), None,
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                       weight_decay=1e-2)),
    "sgd_plain": (lambda: SGD(lr=0.1), None, lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd_dampening": (lambda: SGD(lr=0.05, momentum=0.8, dampening=0.3), None,
                      lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3)),
    "adam": (lambda: Adam(lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-2), None,
             lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-2)),
    "adam_amsgrad": (lambda: Adam(lr=1e-2, amsgrad=True), None,
                     lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True)),
    "adamw": (lambda: AdamW(lr=1e-2, weight_decay=0.1), None,
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "adamw_clip": (lambda: AdamW(lr=1e-2), 0.3,
                   lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    "sgd_clip": (lambda: SGD(lr=0.1, momentum=0.5), 0.2,
                 lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5)),
}
MODELS = {"mlp": mlp_model, "cnn": cnn_model, "segnet": segnet_model}
LABELS = {"segnet": (8, 8)}  # a label per pixel; the others one per row


def _batches(shape, steps=20, batch=6, classes=3, seed=1, labels=()):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, *shape)).astype(np.float32),
             rng.integers(0, classes, (batch, *labels))) for _ in range(steps)]


def _close(ours: dict, ref: dict, rtol=1e-5):
    for k, r in ref.items():
        scale = np.max(np.abs(r))
        np.testing.assert_allclose(ours[k], r, rtol=rtol, atol=rtol * scale, err_msg=k)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_optimizer_matches_torch(model, opt):
    m, forward, shape = MODELS[model]()
    ours_opt, clip, make_torch = OPTIMIZERS[opt]
    init = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    batches = _batches(shape, labels=LABELS.get(model, ()))
    sched = (lambda s: 0.05 / (1 + 0.1 * s)) if opt == "sgd" else None
    tr = Trainer(m, "cross_entropy", optimizer=ours_opt(), clip_norm=clip, device="cpu",
                 lr_schedule=sched, progress=False)
    losses = [tr.step({"x": x, "target": y}) for x, y in batches]
    ref, ref_losses = torch_train(forward, init, make_torch, clip, batches, sched)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _close(tr.parameters(), ref)
    assert tr.step_count == 20


# -- loss helpers ------------------------------------------------------------------------------
def _identity(shape, dtype=np.float32):
    return make_model([helper.make_node("Identity", ["x"], ["y"])], {"x": (dtype, shape)}, ["y"])


LOSS_CASES = {
    "mse": (["N", 5], {}, lambda x, t: F.mse_loss(x, t)),
    "l1": (["N", 5], {}, lambda x, t: F.l1_loss(x, t)),
    "mse_sum": (["N", 5], {"reduction": "sum"}, lambda x, t: F.mse_loss(x, t, reduction="sum")),
    "cross_entropy": (["N", 5], {}, lambda x, t: F.cross_entropy(x, t)),
    "cross_entropy_weighted": (
        ["N", 5, 3], {"weight": [0.5, 1.0, 2.0, 0.1, 1.5], "ignore_index": 2},
        lambda x, t: F.cross_entropy(x, t, weight=torch.tensor([0.5, 1.0, 2.0, 0.1, 1.5],
                                                               dtype=x.dtype), ignore_index=2)),
    # per pixel, as a segmentation model's logits [N, C, H, W] against labels [N, H, W]
    "cross_entropy_pixels": (["N", 4, 3, 5], {}, lambda x, t: F.cross_entropy(x, t)),
    "bce": (["N", 5], {}, lambda x, t: F.binary_cross_entropy_with_logits(x, t)),
    "bce_pos_weight": (["N", 5], {"pos_weight": [1.0, 2.0, 0.5, 3.0, 1.0]},
                       lambda x, t: F.binary_cross_entropy_with_logits(
                           x, t, pos_weight=torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0],
                                                         dtype=x.dtype))),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_loss_matches_torch(case, dtype):
    shape, kw, ref = LOSS_CASES[case]
    kind = case.split("_")[0] if not case.startswith("cross") else "cross_entropy"
    m = attach_loss(_identity(shape, dtype), kind, **kw)
    onnx.checker.check_model(m, full_check=True)
    assert [o.name for o in m.graph.output] == ["y", "loss"]
    target = m.graph.input[-1]
    assert target.name == "target"
    assert target.type.tensor_type.shape.dim[0].dim_param == "N"  # symbolic batch
    rng = np.random.default_rng(3)
    x = (rng.standard_normal([7] + shape[1:]) * 3).astype(dtype)
    if kind == "cross_entropy":
        t = rng.integers(0, shape[1], [7] + shape[2:])
    elif kind == "bce":
        t = rng.random(x.shape).astype(dtype)
    else:
        t = rng.standard_normal(x.shape).astype(dtype)
    (gx,), res = grads_of(m, "loss", "x", {"x": x, "target": t})
    loss = session(m).run(["loss"], {"x": x, "target": t})[0]
    xt = torch.tensor(x, requires_grad=True)
    lt = ref(xt, torch.tensor(t))
    lt.backward()
    tol = 1e-5 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(loss, lt.item(), rtol=tol)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=tol, atol=tol * 1e-1)


def test_loss_errors():
    m = _identity(["N", 4])
    with pytest.raises(ValueError, match="not one of"):
        attach_loss(m, "hinge")
    with pytest.raises(ValueError, match="no output named 'z'"):
        attach_loss(m, "mse", "z")
    with pytest.raises(ValueError, match="cross_entropy loss only"):
        attach_loss(m, "mse", weight=[1.0] * 4)


# -- step graphs -------------------------------------------------------------------------------
def test_build_train_step_description():
    m, _, _ = mlp_model()
    lm = attach_loss(m, "cross_entropy")
    step = build_train_step(lm, "loss", optimizer=Adam(), frozen=["b3"], clip_norm=1.0)
    onnx.checker.check_model(step.model, full_check=True)
    assert step.params == ["W1", "b1", "W2T", "b2", "W3"]
    assert step.data_inputs == ["x", "target"]
    assert len(step.state) == 2 * len(step.params)
    names = [i.name for i in step.model.graph.input]
    assert names == step.data_inputs + step.params + step.state + ["lr", "step"]
    assert [o.name for o in step.model.graph.output] == \
        ["loss"] + step.param_outputs + step.state_outputs
    inits = {t.name for t in step.model.graph.initializer}
    assert "b3" in inits and not inits & set(step.params)  # params are inputs, frozen stay
    g = build_gradient_model(lm, "loss", params=["W1", "b1"])
    assert [o.name for o in g.model.graph.output] == ["loss", *g.grads]
    with pytest.raises(ValueError, match="not an initializer"):
        build_train_step(lm, "loss", params=["x"])
    with pytest.raises(ValueError, match="no tensor named 'lss'"):
        build_train_step(lm, "lss")


def test_step_pools_once():
    """A MaxPool over 2x2 tiles stays one-output in the step graph (its gradient needs no
    argmax); an overlapping one gets its Indices output, which its gradient reuses."""
    m, _, _ = cnn_model()
    step = build_train_step(attach_loss(m, "cross_entropy"), "loss")
    pools = [n for n in step.model.graph.node if n.op_type == "MaxPool"]
    assert [len(n.output) for n in pools] == [1]
    assert not any(n.op_type == "ScatterElements" for n in step.model.graph.node)
    for n in m.graph.node:
        if n.op_type == "MaxPool":
            del n.attribute[:]
            n.attribute.extend([helper.make_attribute("kernel_shape", [3, 3]),
                                helper.make_attribute("strides", [2, 2]),
                                helper.make_attribute("pads", [1, 1, 1, 1])])  # 8 -> 4 still
    step = build_train_step(attach_loss(m, "cross_entropy"), "loss")
    pools = [n for n in step.model.graph.node if n.op_type == "MaxPool"]
    assert [len(n.output) for n in pools] == [2]


@pytest.mark.parametrize("opt", ["adamw", "adam_amsgrad", "sgd", "sgd_dampening"])
def test_optimizer_scalars_take_the_parameter_rank(opt):
    """Every elementwise op of the optimizer and the clipping sees operands of one rank: a
    rank-0 scalar beside a [Co, C, 1, 1] tensor makes onnxruntime's CPU kernels run element by
    element (about 50x slower)."""
    rng = np.random.default_rng(0)
    w = {"W": rng.standard_normal((3, 2, 1, 1)).astype(np.float32),
         "b": np.zeros(3, np.float32)}
    m = make_model([helper.make_node("Conv", ["x", "W", "b"], ["y"]),
                    helper.make_node("Flatten", ["y"], ["logits"])],
                   {"x": (np.float32, ["N", 2, 1, 1])}, ["logits"], inits=w)
    step = build_train_step(attach_loss(m, "cross_entropy"), "loss",
                            optimizer=OPTIMIZERS[opt][0](), clip_norm=0.5)
    inferred = onnx.shape_inference.infer_shapes(step.model, strict_mode=True).graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim)
             for v in [*inferred.value_info, *inferred.input, *inferred.output]}
    checked = 0
    for n in step.model.graph.node:
        if n.op_type in ("Mul", "Add", "Sub", "Div") and n.name.startswith("optimizer/") and \
                any(ranks.get(i) == 4 for i in n.input):
            assert {ranks.get(i) for i in n.input} == {4}, n.name
            checked += 1
    assert checked >= 3


def test_gradient_accumulation_equals_big_batch():
    m, _, shape = mlp_model()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((10, *shape)).astype(np.float32)
    y = rng.integers(0, 3, 10)
    results = []
    for k in (1, 3):
        tr = Trainer(m, "cross_entropy", optimizer=SGD(lr=0.1, momentum=0.9),
                     accumulation_steps=k, device="cpu", progress=False)
        losses = [tr.step({"x": x, "target": y}) for _ in range(3)]
        results.append((losses, tr.parameters()))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6)
    _close(results[1][1], results[0][1], rtol=1e-6)


# -- the Trainer's loop: resume, NaN, checkpoints, export --------------------------------------
def _data(n=50, seed=2):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 8)).astype(np.float32),
            "target": rng.integers(0, 3, n)}


def test_resume_is_bit_for_bit(tmp_path):
    m, _, _ = mlp_model()
    data = _data()
    opts = dict(optimizer=AdamW(lr=1e-2), device="cpu", progress=False, seed=7)
    full = Trainer(m, "cross_entropy", **opts)
    full.fit(data, epochs=3, batch_size=8)

    ckpt = str(tmp_path / "ckpt.npz")

    class Stop(Exception):
        pass

    def interrupt(tr, loss):
        if tr.step_count == 11:  # mid-epoch, after the checkpoint at step 10
            raise Stop

    first = Trainer(m, "cross_entropy", **opts)
    with pytest.raises(Stop):
        first.fit(data, epochs=3, batch_size=8, checkpoint=ckpt, checkpoint_every=5,
                  callback=interrupt)
    resumed = Trainer(m, "cross_entropy", **{**opts, "seed": 123})  # the RNG comes from ckpt
    resumed.fit(data, epochs=3, batch_size=8, resume=ckpt)
    assert resumed.step_count == full.step_count == 21
    assert resumed.history == full.history
    for k, v in full.parameters().items():
        assert np.array_equal(resumed.parameters()[k], v), k
    for k, v in full.optimizer_state().items():
        assert np.array_equal(resumed.optimizer_state()[k], v), k


@pytest.mark.parametrize("amsgrad", [False, True])
def test_format2_checkpoint_resumes(tmp_path, amsgrad):
    """Formats 1 and 2 kept Adam's state as torch's m and v (exp_avg, exp_avg_sq); format 3
    keeps the sums m / (1 - beta1), v / (1 - beta2). An old checkpoint resumes to the same
    trajectory as the trainer it came from."""
    m, _, _ = mlp_model()
    data = _data()
    b1, b2 = 0.8, 0.95
    opts = dict(optimizer=Adam(lr=1e-2, betas=(b1, b2), amsgrad=amsgrad), device="cpu",
                progress=False, seed=7)
    full = Trainer(m, "cross_entropy", **opts)
    full.fit(data, epochs=2, batch_size=8)
    half = Trainer(m, "cross_entropy", **opts)
    half.fit(data, epochs=1, batch_size=8)
    ckpt = tmp_path / "old.npz"
    half.save_checkpoint(ckpt)
    with np.load(ckpt) as z:
        arrays = {k: z[k] for k in z.files if k != "manifest"}
    names = [str(n) for n in arrays["state_names"]]
    for j, n in enumerate(names):  # back to format 2: torch's m and v under their names
        factor = (1 - b1) if n.endswith(".exp_sum") else (1 - b2)
        arrays[f"state_{j}"] = (arrays[f"state_{j}"] * factor).astype(np.float32)
        names[j] = n.replace("exp_sum", "exp_avg")
    assert any(n.endswith(".exp_avg_sq") for n in names)
    arrays["state_names"] = np.array(names)
    arrays["format"] = np.array("onnxgrad-checkpoint-2")
    arrays["manifest"] = np.array(json.dumps({k: {
        "dtype": a.dtype.str, "shape": list(a.shape),
        "sha256": hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()}
        for k, a in arrays.items()}))
    with open(ckpt, "wb") as f:
        np.savez(f, **arrays)
    resumed = Trainer(m, "cross_entropy", **opts)
    resumed.fit(data, epochs=2, batch_size=8, resume=str(ckpt))
    assert resumed.step_count == full.step_count
    for k, v in full.parameters().items():
        np.testing.assert_allclose(resumed.parameters()[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
    for k, v in full.optimizer_state().items():
        np.testing.assert_allclose(resumed.optimizer_state()[k], v, rtol=1e-5,
                                   atol=1e-6 * np.abs(v).max(), err_msg=k)


@pytest.mark.parametrize("optimizer, accumulation, fused", [
    (SGD, 1, "auto"), (lambda: SGD(momentum=0.9, dampening=0.1), 1, "auto"),
    (lambda: SGD(momentum=0.9, dampening=0.1), 1, False),
    (lambda: AdamW(amsgrad=True), 1, False), (lambda: AdamW(amsgrad=True), 1, "auto"),
    (AdamW, 2, "auto")],
    ids=["sgd", "sgd-momentum", "sgd-momentum-graph", "adamw-amsgrad-graph", "adamw-amsgrad",
         "adamw-split"])
def test_nan_loss_names_the_step(optimizer, accumulation, fused):
    m, _, _ = mlp_model()
    # a learning rate that blows the weights up at step 2: the loss of step 3 is not finite
    tr = Trainer(m, "cross_entropy", optimizer=optimizer(), device="cpu", progress=False,
                 lr_schedule=lambda step: 1e38 if step == 2 else 1e-3,
                 accumulation_steps=accumulation, fused_optimizer=fused)
    data = _data(48)
    before = state = None

    def keep(t, loss):
        nonlocal before, state
        before, state = t.parameters(), t.optimizer_state()
    with pytest.raises(NonFiniteLossError, match="at step 3") as err:
        tr.fit(data, epochs=1, batch_size=16, shuffle=False, callback=keep)
    assert err.value.step == 3 and tr.step_count == 2
    for k, v in tr.parameters().items():  # the bad step's updates were not applied
        assert np.array_equal(v, before[k])
    for k, v in tr.optimizer_state().items():  # nor its state's (kept in place)
        assert np.array_equal(v, state[k]), k


def test_checkpoint_is_atomic(tmp_path, monkeypatch):
    m, _, _ = mlp_model()
    tr = Trainer(m, "cross_entropy", device="cpu", progress=False)
    ckpt = tmp_path / "ckpt.npz"
    tr.save_checkpoint(ckpt)
    good = ckpt.read_bytes()
    tr.step(_data(8))

    def broken(f, **arrays):
        f.write(b"PK partial")
        raise OSError("disk full")
    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError, match="disk full"):
        tr.save_checkpoint(ckpt)
    assert ckpt.read_bytes() == good  # the old checkpoint is untouched
    assert os.listdir(tmp_path) == ["ckpt.npz"]  # no temporary left behind
    with pytest.raises(OSError):
        tr.save_checkpoint(tmp_path / "new.npz")
    assert not (tmp_path / "new.npz").exists()


def test_export_round_trip(tmp_path):
    m, _, _ = mlp_model()
    tr = Trainer(m, "cross_entropy", optimizer=AdamW(lr=1e-2), device="cpu", progress=False)
    data = _data()
    tr.fit(data, epochs=2, batch_size=10)
    out, step_path, grad_path = (str(tmp_path / n) for n in ("m.onnx", "step.onnx", "g.onnx"))
    tr.export(out, train_step=step_path, gradient=grad_path)
    exported = onnx.load(out)
    onnx.checker.check_model(exported, full_check=True)
    assert exported.ir_version <= 13
    assert [i.name for i in exported.graph.input] == ["x"]
    ours = session(exported).run(None, {"x": data["x"]})[0]
    np.testing.assert_array_equal(ours, tr.predict({"x": data["x"]})[0])
    assert not np.allclose(ours, session(m).run(None, {"x": data["x"]})[0])  # it did train
    # the train step runs as it is (parameters and state are input defaults) and continues
    step = session(onnx.load(step_path))
    batch = {"x": data["x"][:10], "target": data["target"][:10],
             "lr": np.array(1e-2), "step": np.array(tr.step_count + 1)}
    loss, *new = step.run(None, batch)
    assert np.isfinite(loss)
    g = session(onnx.load(grad_path)).run(None, {"x": data["x"], "target": data["target"]})
    assert len(g) == 1 + len(tr.params)
    assert tr.evaluate(data) == pytest.approx(float(g[0]), rel=1e-5)


def test_fit_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    m, _, _ = mlp_model()
    tr = Trainer(m, "cross_entropy", device="cpu", progress=True)
    losses = tr.fit(_data(20), epochs=1, batch_size=8)
    assert len(losses) == 3 and tr.history == losses


# -- CLI and the bundled demo ------------------------------------------------------------------
def _cli(argv):
    from onnxgrad.training.cli import add_export_train_step_parser, add_train_parser
    p = argparse.ArgumentParser(prog="onnxgrad")
    sub = p.add_subparsers(dest="command")
    add_train_parser(sub)
    add_export_train_step_parser(sub)
    args = p.parse_args(argv)
    out = io.StringIO()
    rc = args.func(args, out)
    return rc, out.getvalue()


def test_cli_train_and_export_train_step(tmp_path):
    m, _, _ = mlp_model()
    model = str(tmp_path / "mlp.onnx")
    onnx.save(m, model)
    d = _data(60)
    np.savez(tmp_path / "data.npz", x=d["x"], y=d["target"])
    out, ckpt = str(tmp_path / "trained.onnx"), str(tmp_path / "ck.npz")
    rc, text = _cli(["train", model, "--loss", "cross_entropy", "--data",
                     str(tmp_path / "data.npz"), "--epochs", "2", "--batch-size", "16",
                     "--optimizer", "adamw", "--lr", "0.01", "-o", out, "--checkpoint", ckpt,
                     "--val-split", "0.2", "--plot", str(tmp_path / "loss.png"), "--no-progress"])
    assert rc == 0, text
    assert "final loss" in text and "accuracy" in text
    assert os.path.exists(out) and os.path.exists(ckpt)
    rc, text = _cli(["export-train-step", model, "--loss", "cross_entropy", "--optimizer", "sgd",
                     "--lr", "0.1", "-o", str(tmp_path / "step.onnx")])
    assert rc == 0 and os.path.exists(tmp_path / "step.onnx")


def test_digits_demo_learns():
    path = os.path.join(ROOT, "models", "digits_mlp.onnx")
    data = np.load(os.path.join(ROOT, "models", "digits.npz"))
    x, y = data["x"], data["y"]
    assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == (1797, 64)
    tr = Trainer(path, "cross_entropy", optimizer=AdamW(lr=1e-2), device="cpu", progress=False,
                 seed=0)
    tr.fit({"x": x[:1500], "target": y[:1500]}, epochs=3, batch_size=32)
    acc = np.mean(np.argmax(tr.predict({"x": x[1500:]})[0], axis=1) == y[1500:])
    assert acc > 0.85  # 0.90 measured (these last rows are the hardest writers)


def test_trainer_exported_from_package():
    assert onnxgrad.training.Trainer is Trainer


def test_trainer_on_a_model_that_computes_its_loss():
    path = os.path.join(ROOT, "models", "mlp.onnx")  # x, one-hot labels -> logits, loss
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 64)).astype(np.float32)
    labels = np.eye(10, dtype=np.float32)[rng.integers(0, 10, 40)]
    tr = Trainer(path, "loss", optimizer=SGD(lr=0.5), device="cpu", progress=False)
    assert tr.data_inputs == ["x", "labels"] and tr.params == ["W1", "b1", "W2", "b2"]
    before = tr.evaluate({"x": x, "labels": labels})
    tr.fit({"x": x, "labels": labels}, epochs=5, batch_size=10)
    assert tr.evaluate({"x": x, "labels": labels}) < before


def test_state_in_place_check_refuses_unsafe_writers():
    """The state is read and written in one buffer: a reader after the writer, or a writer that
    is not elementwise over the old value (onnxruntime's Gemm copies C into its output before
    it reads A and B: bound in place it returns a g + g, not a s + g), must be refused when the
    step is built, not found as wrong state later."""
    from onnxgrad.training.step import _check_state_in_place
    node = helper.make_node
    ok = [node("Mul", ["s", "b"], ["t"], name="decay"),
          node("Add", ["t", "g"], ["s.new"], name="sum"),
          node("Max", ["m", "s.new"], ["m.new"], name="amsgrad")]
    _check_state_in_place(ok, ["s", "m"], ["s.new", "m.new"])
    late = ok + [node("Neg", ["s"], ["late"], name="late_reader")]
    with pytest.raises(AssertionError, match="late_reader"):
        _check_state_in_place(late, ["s", "m"], ["s.new", "m.new"])
    gemm = [node("Gemm", ["a", "s", "g"], ["s.new"], name="axpy")]
    with pytest.raises(AssertionError, match="axpy.*Gemm"):
        _check_state_in_place(gemm, ["s"], ["s.new"])


def _lstm_classifier(seed=0, T=5, I=3, H=4):
    """x [T, N, I] -> ONNX LSTM -> last h [N, H] -> logits [N, 3]."""
    rng = np.random.default_rng(seed)
    w = {"W": rng.standard_normal((1, 4 * H, I)) * 0.5,
         "R": rng.standard_normal((1, 4 * H, H)) * 0.5,
         "B": rng.standard_normal((1, 8 * H)) * 0.1,
         "D": rng.standard_normal((H, 3)) * 0.5}
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B"], ["", "h"], hidden_size=H),
             helper.make_node("Squeeze", ["h", "axis0"], ["hs"]),
             helper.make_node("MatMul", ["hs", "D"], ["logits"])]
    inits = {k: v.astype(np.float32) for k, v in w.items()}
    inits["axis0"] = np.array([0], np.int64)
    return make_model(nodes, {"x": (np.float32, [T, "N", I])}, ["logits"], inits=inits)


def test_step_sessions_stop_spinning_after_a_run():
    """The step's thread pool spins between kernels but is parked when a run returns, so that
    its threads do not compete with the fused optimizer's and the next step's Python (the MLP
    step at 2 threads: 1.03x to 1.06x, alternated processes); the losses are those of a step
    whose pool keeps spinning."""
    from onnxgrad.training.trainer import session_options
    m, _, _ = mlp_model()
    rng = np.random.default_rng(2)
    batches = [{"x": rng.standard_normal((8, 8)).astype(np.float32),
                "target": rng.integers(0, 3, 8)} for _ in range(3)]
    losses = {}
    spinning = session_options(2)
    spinning.add_session_config_entry("session.force_spinning_stop", "0")
    for stop, so in (("1", None), ("0", spinning)):
        tr = Trainer(m, "cross_entropy", optimizer=AdamW(lr=0.05), device="cpu", threads=2,
                     progress=False, session_options=so)
        opts = tr._loss_sess.get_session_options()
        assert opts.get_session_config_entry("session.force_spinning_stop") == stop
        losses[stop] = [tr.step(b) for b in batches * 2]
    assert losses["1"] == losses["0"] and losses["1"][-1] < losses["1"][0]


def test_looping_steps_plan_memory_once():
    """A step whose graph loops (the LSTM's Scans) runs with onnxruntime's memory pattern, and
    its losses and weights are exactly those of the same step without it; a step without loops
    keeps the pattern off (peak RSS)."""
    from onnxgrad.training.trainer import session_options
    rng = np.random.default_rng(1)
    batches = [{"x": rng.standard_normal((5, 6, 3)).astype(np.float32),
                "target": rng.integers(0, 3, 6)} for _ in range(4)]
    params = ["W", "R", "B", "D"]
    runs = {}
    for pattern in (True, False):
        so = None if pattern else session_options(1)
        tr = Trainer(_lstm_classifier(), "cross_entropy", optimizer=AdamW(lr=0.05), params=params,
                     device="cpu", threads=1, progress=False, session_options=so)
        assert tr._loss_sess.get_session_options().enable_mem_pattern is pattern
        runs[pattern] = [tr.step(b) for b in batches * 3], tr.parameters()
    (losses, weights), (losses_off, weights_off) = runs[True], runs[False]
    assert losses == losses_off and losses[-1] < losses[0]
    for p in params:
        np.testing.assert_array_equal(weights[p], weights_off[p])
    m, _, _ = mlp_model()
    tr = Trainer(m, "cross_entropy", optimizer=AdamW(lr=0.05), device="cpu", progress=False)
    assert tr._loss_sess.get_session_options().enable_mem_pattern is False
