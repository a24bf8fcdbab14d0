"""The training API's results are the full-batch, torch-equal ones, or a clear refusal.

Gradient accumulation and evaluate() over parts equal the loss over the whole batch for every
built-in loss configuration; the parameters trained by default are a torch module's parameters
(not its buffers, constants nor BatchNorm statistics); a checkpoint resumes only the run it was
written by; a step checks its batch as fit checks its data. torch is the oracle throughout.
"""
from __future__ import annotations

import logging
import re

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

import onnxgrad
from onnxgrad.errors import CheckpointError, DataError, InvalidArgumentError
from onnxgrad.training import SGD, Adam, AdamW, Trainer, build_train_step
from util import (bn_train_export, central_differences, make_model, quiet, quiet_export,
                  stock_session)

torch = pytest.importorskip("torch")
F = torch.nn.functional


def linear_model(dtype=np.float64, seed=0, inputs=4, classes=3):
    rng = np.random.default_rng(seed)
    w = {"W": rng.standard_normal((classes, inputs)).astype(dtype),
         "b": (rng.standard_normal(classes) * 0.1).astype(dtype)}
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["y"], transB=1)]
    return make_model(nodes, {"x": (dtype, ["N", inputs])}, ["y"], inits=w), w


def _trainer(model, kind, opts, **kw):
    return Trainer(model, kind, loss_options=opts, optimizer=SGD(lr=0.1), device="cpu",
                   progress=False, threads=1, **kw)


def _torch_loss(kind, opts, out, target):
    red = opts.get("reduction", "mean")
    if kind == "mse":
        return F.mse_loss(out, target, reduction=red)
    if kind == "l1":
        return F.l1_loss(out, target, reduction=red)
    if kind == "bce":
        return F.binary_cross_entropy_with_logits(out, target, reduction=red)
    w = opts.get("weight")
    return F.cross_entropy(out, target, reduction=red,
                           weight=None if w is None else torch.tensor(w, dtype=out.dtype),
                           ignore_index=opts.get("ignore_index", -100))


# -- 1. gradient accumulation == the full-batch step, for every loss configuration ------------
@st.composite
def loss_cases(draw):
    kind = draw(st.sampled_from(["mse", "l1", "bce", "cross_entropy"]))
    opts = {"reduction": draw(st.sampled_from(["mean", "sum"]))}
    if kind == "cross_entropy":
        if draw(st.booleans()):
            opts["weight"] = draw(st.lists(st.sampled_from([0.0, 0.2, 1.0, 5.0]), min_size=3,
                                           max_size=3))
        ignore = draw(st.sampled_from([None, 0, 1, -100]))
        if ignore is not None:
            opts["ignore_index"] = ignore
    k = draw(st.integers(1, 4))
    rows = draw(st.integers(k, 8))
    seed = draw(st.integers(0, 2 ** 16))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 4))
    if kind == "cross_entropy":
        labels = draw(st.lists(st.integers(0, 2), min_size=rows, max_size=rows))
        target = np.array(labels, np.int64)
        if opts.get("ignore_index") == -100:
            target[rng.random(rows) < 0.4] = -100
    elif kind == "bce":
        target = rng.random((rows, 3))
    else:
        target = rng.standard_normal((rows, 3))
    return kind, opts, k, x, target


@settings(derandomize=True, deadline=None, max_examples=60)
@given(loss_cases())
def test_accumulation_equals_the_full_batch_step_and_torch(case):
    kind, opts, k, x, target = case
    model, w = linear_model()
    W = torch.tensor(w["W"], requires_grad=True)
    b = torch.tensor(w["b"], requires_grad=True)
    want = _torch_loss(kind, opts, torch.tensor(x) @ W.T + b, torch.tensor(target))
    batch = {"x": x, "target": target}
    full, acc = _trainer(model, kind, opts), _trainer(model, kind, opts, accumulation_steps=k)
    if not np.isfinite(want.item()):  # every target ignored or of weight 0: torch's 0 / 0
        for tr in (full, acc):
            with pytest.raises(DataError, match="0 / 0"):
                tr.step(batch)
            assert tr.step_count == 0
        return
    want.backward()
    lf, la = full.step(batch), acc.step(batch)
    assert la == pytest.approx(lf, rel=1e-12, abs=1e-14)
    assert la == pytest.approx(want.item(), rel=1e-12, abs=1e-14)
    pf, pa = full.parameters(), acc.parameters()
    for name, t in (("W", W), ("b", b)):
        np.testing.assert_allclose(pa[name], pf[name], rtol=0, atol=1e-13)
        np.testing.assert_allclose(pa[name], w[name] - 0.1 * t.grad.numpy(), rtol=0, atol=1e-12)


def test_a_micro_batch_of_ignored_targets_adds_nothing():
    """The red team's case: rows 0-1 (the first micro-batch) all ignore_index; float32."""
    model, w = linear_model(np.float32)
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    y = np.array([1, 1, 0, 2])
    opts = {"ignore_index": 1}
    want = F.cross_entropy(torch.tensor(x) @ torch.tensor(w["W"]).T + torch.tensor(w["b"]),
                           torch.tensor(y), ignore_index=1).item()
    losses = [_trainer(model, "cross_entropy", opts, accumulation_steps=k).step(
        {"x": x, "target": y}) for k in (1, 2, 4)]
    np.testing.assert_allclose(losses, want, rtol=1e-6)


def test_shards_of_a_weighted_cross_entropy_are_refused():
    model, _ = linear_model()
    x, y = np.zeros((4, 4)), np.array([0, 1, 2, 0])
    tr = _trainer(model, "cross_entropy", {"weight": [1.0, 2.0, 3.0]}, accumulation_steps=2)
    with pytest.raises(InvalidArgumentError, match="total_rows"):
        tr.step({"x": x, "target": y}, total_rows=8)
    with pytest.raises(InvalidArgumentError, match="negative class weights"):
        _trainer(model, "cross_entropy", {"weight": [1.0, -2.0, 3.0]}, accumulation_steps=2)
    # a sum needs no normalizer: a shard's gradient is its own
    tr = _trainer(model, "mse", {"reduction": "sum"}, accumulation_steps=2)
    assert np.isfinite(tr.step({"x": x, "target": np.zeros((4, 3))}, total_rows=8))


# -- 2. the parameters trained by default -----------------------------------------------------
def _train_both(model_path, net, steps=3, lr=0.05, **kw):
    tr = Trainer(model_path, "mse", optimizer=SGD(lr=lr), device="cpu", progress=False,
                 threads=1, **kw)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x = rng.standard_normal((8, 4)).astype(np.float32)
        y = rng.standard_normal((8, 2)).astype(np.float32)
        lo = tr.step({"x": x, "target": y})
        opt.zero_grad()
        loss = F.mse_loss(net(torch.tensor(x)), torch.tensor(y))
        loss.backward()
        opt.step()
        assert lo == pytest.approx(loss.item(), rel=1e-5)
    return tr


def test_batchnorm_statistics_are_not_trained(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                              torch.nn.Linear(3, 2)).eval()
    with torch.no_grad():
        net[1].running_var.fill_(0.05)
        net[1].running_mean.fill_(0.3)
    path = str(tmp_path / "bn.onnx")
    quiet_export(net, path, dynamo=False, dynamic_axes={"x": {0: "N"}})
    tr = _train_both(path, net, steps=5)
    assert tr.params == [n for n, _ in net.named_parameters()]
    assert set(tr.left_out) == {"1.running_mean", "1.running_var"}
    assert "BatchNormalization" in tr.left_out["1.running_var"]
    p = tr.parameters()
    for name, t in net.named_parameters():
        np.testing.assert_allclose(p[name], t.detach().numpy(), rtol=1e-5, atol=1e-6)
    out = tr.trained_model()
    stats = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    np.testing.assert_array_equal(stats["1.running_var"], np.full(3, 0.05, np.float32))
    # asked for by name, they are trained
    tr = Trainer(path, "mse", params=["1.running_mean"], optimizer=SGD(lr=0.1), device="cpu",
                 progress=False)
    assert tr.params == ["1.running_mean"] and tr.left_out == {}


@pytest.mark.parametrize("kw", [{}, {"fused_optimizer": False}, {"accumulation_steps": 2}],
                         ids=["fused", "one-graph", "accumulated"])
def test_training_mode_batchnorm_statistics_are_updated(tmp_path, kw):
    """A training-mode export's BatchNormalization running statistics are updated by every
    forward the step runs (each micro-batch's), as PyTorch's are, as the ONNX op defines them:
    running = momentum * running + (1 - momentum) * the batch's mean and biased variance
    (PyTorch's running_var takes the unbiased one). The oracle: that formula in numpy over the
    BatchNorm inputs of a PyTorch run of the same steps; its running_mean equals PyTorch's.
    trained_model() holds them; a checkpoint carries them; statistics() returns copies (it
    returned views of the buffers the next step overwrote)."""
    import copy
    path = str(tmp_path / "bn_train.onnx")
    net = bn_train_export(path)
    ref = copy.deepcopy(net)  # (the export ran a forward: its statistics are the model's)
    seen = []
    ref[1].register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().double().numpy()))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tr = Trainer(path, "mse", optimizer=SGD(lr=0.1), device="cpu", progress=False, **kw)
    assert tr.stat_names == ["1.running_mean", "1.running_var"] and tr.left_out
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((8, 3, 8, 8)).astype(np.float32),
                rng.standard_normal((8, 2)).astype(np.float32)) for _ in range(3)]
    parts = [slice(0, 4), slice(4, 8)] if kw.get("accumulation_steps") else [slice(0, 8)]
    for k, (x, y) in enumerate(batches):
        if k == 2:  # resume from a checkpoint: the statistics come back with it
            tr.save_checkpoint(tmp_path / "c.npz")
            tr = Trainer(path, "mse", optimizer=SGD(lr=0.1), device="cpu", progress=False,
                         **kw)
            tr.load_checkpoint(tmp_path / "c.npz")
        before = tr.statistics()
        tr.step({"x": x, "target": y})
        assert not np.array_equal(before["1.running_mean"], tr.statistics()["1.running_mean"])
        opt.zero_grad()
        for sl in parts:
            (F.mse_loss(ref(torch.tensor(x[sl])), torch.tensor(y[sl])) / len(parts)).backward()
        opt.step()
    rm = numpy_helper.to_array(next(t for t in onnx.load(path).graph.initializer
                                    if t.name == "1.running_mean")).astype(np.float64)
    rv = numpy_helper.to_array(next(t for t in onnx.load(path).graph.initializer
                                    if t.name == "1.running_var")).astype(np.float64)
    for a in seen:
        rm = 0.7 * rm + 0.3 * a.mean(axis=(0, 2, 3))
        rv = 0.7 * rv + 0.3 * a.var(axis=(0, 2, 3))
    got = tr.statistics()
    np.testing.assert_allclose(got["1.running_mean"], rm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["1.running_var"], rv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["1.running_mean"], ref[1].running_mean.numpy(), atol=1e-6)
    out = {t.name: numpy_helper.to_array(t) for t in tr.trained_model().graph.initializer}
    for k in got:
        np.testing.assert_array_equal(out[k], got[k])


def test_web_step_carries_batchnorm_statistics(tmp_path):
    """The browser step updates running statistics as the Trainer's does: they are step inputs
    (no initializers), their updates step outputs, the manifest lists both, and the step runs on
    onnxruntime (tests/test_web.py trains with it in onnxruntime-web against the Trainer)."""
    from onnxgrad.training.webstep import export_web_step
    from onnxgrad.runtime import ort_module
    path = str(tmp_path / "bn_train.onnx")
    bn_train_export(path)
    man = export_web_step(path, "mse", str(tmp_path / "step.onnx"))
    step = onnx.load(str(tmp_path / "step.onnx"))
    stats = ["1.running_mean", "1.running_var"]
    assert [t["name"] for t in man["stats"]] == stats
    assert set(stats) <= {i.name for i in step.graph.input}
    assert not set(stats) & {t.name for t in step.graph.initializer}
    assert len(step.graph.output) == 1 + len(man["params"]) + len(man["state"]) + 2
    sess = ort_module().InferenceSession(step.SerializeToString(),
                                         providers=["CPUExecutionProvider"])
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else 8 for d in i.shape]
        feeds[i.name] = (np.ones(shape, np.int64) if i.type == "tensor(int64)"
                         else np.full(shape, 0.1, np.float32))
    assert np.isfinite(sess.run(None, feeds)[0])


def test_shared_batchnorm_statistics_are_said_to_stay(caplog):
    """Statistics read by two training-mode BatchNormalizations have no one update: the Trainer
    leaves them as given and says so at WARNING level, naming them."""
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], [f"y{k}",
                              f"rm{k}", f"rv{k}"], training_mode=1) for k in (0, 1)]
    nodes += [helper.make_node("Add", ["y0", "y1"], ["y"])]
    inits = {"s": np.ones(3, np.float32), "b": np.zeros(3, np.float32),
             "m": np.zeros(3, np.float32), "v": np.ones(3, np.float32)}
    m = make_model(nodes, {"x": (np.float32, ["N", 3, 4])}, ["y"], inits=inits, opset=15)
    with caplog.at_level(logging.WARNING, logger="onnxgrad.training"):
        tr = Trainer(m, "mse", optimizer=SGD(lr=0.1), device="cpu", progress=False)
    said = [r.getMessage() for r in caplog.records if "running statistics" in r.getMessage()]
    assert len(said) == 1 and "m, v" in said[0], said
    assert tr.stat_names == []
    x = np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)
    tr.step({"x": x, "target": np.zeros((5, 3, 4), np.float32)})
    out = {t.name: numpy_helper.to_array(t) for t in tr.trained_model().graph.initializer}
    np.testing.assert_array_equal(out["v"], inits["v"])


def test_function_batchnorm_statistics_are_said_to_stay(caplog):
    """A training-mode BatchNormalization inside a model function updates a private copy of the
    statistics it is passed (onnxgrad.aliasing): the Trainer cannot carry them, leaves them as
    given and says so at WARNING level, naming them (it said nothing before)."""
    body = [helper.make_node("BatchNormalization", ["t", "s", "b", "m", "v"], ["u", "um", "uv"],
                             training_mode=1)]
    fn = helper.make_function("lib", "BN", ["t", "s", "b", "m", "v"], ["u"], body,
                              [helper.make_opsetid("", 15)])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("BN", ["h", "s", "b", "m", "v"], ["y"], domain="lib")]
    inits = {"w": np.eye(3, dtype=np.float32), "s": np.ones(3, np.float32),
             "b": np.zeros(3, np.float32), "m": np.full(3, 0.5, np.float32),
             "v": np.full(3, 2.0, np.float32)}
    g = helper.make_graph(nodes, "fn", [helper.make_tensor_value_info("x", 1, ["N", 3])],
                          [helper.make_tensor_value_info("y", 1, ["N", 3])],
                          [numpy_helper.from_array(a, n) for n, a in inits.items()])
    m = helper.make_model(g, functions=[fn], ir_version=10,
                          opset_imports=[helper.make_opsetid("", 15), helper.make_opsetid("lib", 1)])
    with caplog.at_level(logging.WARNING, logger="onnxgrad.training"):
        tr = Trainer(m, "mse", optimizer=SGD(lr=0.1), device="cpu", progress=False)
    said = [r.getMessage() for r in caplog.records if "running statistics" in r.getMessage()]
    assert len(said) == 1 and "m, v keep" in said[0] and "model function" in said[0], said
    assert tr.stat_names == [] and tr.params == ["w", "s", "b"]
    x = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    for _ in range(2):
        assert np.isfinite(tr.step({"x": x, "target": np.zeros((6, 3), np.float32)}))
    out = {t.name: numpy_helper.to_array(t) for t in tr.trained_model().graph.initializer}
    np.testing.assert_array_equal(out["m"], inits["m"])
    np.testing.assert_array_equal(out["v"], inits["v"])
    assert not np.array_equal(out["w"], inits["w"])


def test_torch_export_constants_and_buffers_are_not_trained(tmp_path, caplog):
    pytest.importorskip("onnxscript")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W = torch.nn.Parameter(torch.randn(2, 4) * 0.5)
            self.temp = torch.nn.Parameter(torch.tensor(1.5))
            self.register_buffer("scale", torch.tensor([1.0, 2.0]))

        def forward(self, x):  # W.t() is folded into a new initializer, from a parameter
            return (x @ self.W.t()) * self.temp * 0.5 + self.scale * 2.0 + 1.0

    torch.manual_seed(0)
    net = Net()
    path = str(tmp_path / "dyn.onnx")
    quiet_export(net, path, dynamo=True, dynamic_shapes=({0: torch.export.Dim("N")},))
    with caplog.at_level(logging.DEBUG, logger="onnxgrad.training"):
        tr = _train_both(path, net)
    assert "not trained by default" in caplog.text
    assert len(tr.params) == 2 and "temp" in tr.params  # temp, and W's transpose
    (wt,) = [n for n in tr.params if n != "temp"]
    assert tr.left_out and all(n not in tr.params for n in tr.left_out)
    p = tr.parameters()
    np.testing.assert_allclose(p[wt], net.W.detach().numpy().T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p["temp"], net.temp.detach().numpy(), rtol=1e-5)


def test_non_finite_buffers_are_not_trained(tmp_path):
    rng = np.random.default_rng(0)
    mask = np.array([0, 0, -np.inf], np.float32)  # class 2 never predicted
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Add", ["h", "mask"], ["y"])]
    model = make_model(nodes, {"x": (np.float32, ["N", 3])}, ["y"],
                       inits={"W": rng.standard_normal((3, 3)).astype(np.float32),
                              "mask": mask})
    tr = Trainer(model, "cross_entropy", optimizer=AdamW(lr=0.01), device="cpu",
                 progress=False)
    assert tr.params == ["W"] and list(tr.left_out) == ["mask"]
    data = {"x": rng.standard_normal((8, 3)).astype(np.float32),
            "target": np.zeros(8, np.int64)}
    tr.fit(data, epochs=1, batch_size=4, checkpoint=str(tmp_path / "ck.npz"))
    tr.export(str(tmp_path / "out.onnx"))  # the old default trained mask: neither would run


def test_frozen_initializers_that_are_inputs_stay_constants():
    """keep_initializers_as_inputs models: a frozen (or not chosen) weight is not data."""
    model, w = linear_model(np.float32)
    model.graph.input.extend([helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT,
                                                            list(v.shape))
                              for n, v in w.items()])
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((8, 4)).astype(np.float32),
            "target": rng.standard_normal((8, 3)).astype(np.float32)}
    for kw in ({"frozen": ["W"]}, {"params": ["b"]}):
        tr = Trainer(model, "mse", optimizer=SGD(lr=0.1), device="cpu", progress=False, **kw)
        assert tr.data_inputs == ["x", "target"] and tr.params == ["b"]
        tr.fit(data, epochs=1, batch_size=4)
        assert np.isfinite(tr.evaluate(data))
        assert "W" not in tr.parameters()
        got = {t.name: numpy_helper.to_array(t) for t in tr.trained_model().graph.initializer}
        np.testing.assert_array_equal(got["W"], w["W"])


# -- 3. resuming ------------------------------------------------------------------------------
def _checkpoint(tmp_path, optimizer, model=None):
    model = model or linear_model()[0]
    rng = np.random.default_rng(1)
    data = {"x": rng.standard_normal((50, 4)), "target": rng.standard_normal((50, 3))}
    tr = Trainer(model, "mse", optimizer=optimizer, device="cpu", progress=False)
    ck = str(tmp_path / "ck.npz")
    tr.fit(data, epochs=2, batch_size=8, checkpoint=ck, checkpoint_every=1, max_steps=2)
    return model, data, ck


@pytest.mark.parametrize("old, new, field", [
    (Adam(lr=0.01), Adam(lr=0.01, betas=(0.5, 0.9)), "betas"),
    (Adam(lr=0.01), Adam(lr=0.01, eps=1e-6), "eps"),
    (AdamW(lr=0.01), AdamW(lr=0.01, weight_decay=0.1), "weight_decay"),
    (Adam(lr=0.01), Adam(lr=0.01, amsgrad=True), "amsgrad"),
    (Adam(lr=0.01), AdamW(lr=0.01), "Adam"),
    (SGD(lr=0.1, momentum=0.9), SGD(lr=0.1, momentum=0.5), "momentum"),
    (SGD(lr=0.1, momentum=0.9), SGD(lr=0.1, momentum=0.9, nesterov=True), "nesterov"),
])
def test_resume_refuses_other_optimizer_settings(tmp_path, old, new, field):
    model, data, ck = _checkpoint(tmp_path, old)
    tr = Trainer(model, "mse", optimizer=new, device="cpu", progress=False)
    before = tr.parameters()
    with pytest.raises(CheckpointError, match=field):
        tr.load_checkpoint(ck)
    with pytest.raises(CheckpointError, match=field):
        tr.fit(data, epochs=2, batch_size=8, resume=ck)
    assert tr.step_count == 0
    for k, v in tr.parameters().items():
        np.testing.assert_array_equal(v, before[k])


def test_resume_with_another_lr_is_torch_with_that_lr(tmp_path):
    model, data, ck = _checkpoint(tmp_path, Adam(lr=0.01))
    tr = Trainer(model, "mse", optimizer=Adam(lr=0.05), device="cpu", progress=False)
    tr.load_checkpoint(ck)
    assert tr.step_count == 2


def test_resume_refuses_other_rows_or_batch_size(tmp_path):
    model, data, ck = _checkpoint(tmp_path, Adam(lr=0.01))
    fewer = {k: v[:20] for k, v in data.items()}
    for d, bs, what in ((fewer, 8, "50 rows"), (data, 25, "batches of 8")):
        tr = Trainer(model, "mse", optimizer=Adam(lr=0.01), device="cpu", progress=False)
        with pytest.raises(CheckpointError, match=what):
            tr.fit(d, epochs=2, batch_size=bs, resume=ck)
        assert tr.step_count == 0
        tr.load_checkpoint(ck)  # the position, restored, is checked by a fit as well
        with pytest.raises(InvalidArgumentError, match=what):
            tr.fit(d, epochs=2, batch_size=bs)
    # the same rows and batch size: 2 + 12 steps, as uninterrupted
    tr = Trainer(model, "mse", optimizer=Adam(lr=0.01), device="cpu", progress=False)
    assert len(tr.fit(data, epochs=2, batch_size=8, resume=ck)) == 12


@settings(max_examples=25, deadline=None, derandomize=True)
@given(rows=st.integers(3, 20), batch=st.integers(1, 8), epochs=st.integers(1, 3),
       cut=st.integers(0, 30), drop_last=st.booleans(), via_checkpoint=st.booleans())
def test_fit_stopped_by_max_steps_then_continued_is_the_uninterrupted_run(
        tmp_path_factory, rows, batch, epochs, cut, drop_last, via_checkpoint):
    # a stop at an epoch's end drew the next epoch's order from the RNG before it returned:
    # the continued run (the same trainer, or a checkpoint) shuffled that epoch another way
    if drop_last and rows < batch:
        return
    model = linear_model()[0]
    rng = np.random.default_rng(rows)
    data = {"x": rng.standard_normal((rows, 4)), "target": rng.standard_normal((rows, 3))}
    opts = dict(optimizer=SGD(lr=0.05, momentum=0.9), device="cpu", progress=False, seed=3,
                threads=1)
    fit = dict(epochs=epochs, batch_size=batch, drop_last=drop_last)
    full = Trainer(model, "mse", **opts)
    full.fit(data, **fit)
    part = Trainer(model, "mse", **opts)
    first = part.fit(data, max_steps=cut, **fit)
    assert len(first) == min(cut, full.step_count)
    if via_checkpoint:
        ck = str(tmp_path_factory.mktemp("ck") / "ck.npz")
        part.save_checkpoint(ck)
        part = Trainer(model, "mse", **{**opts, "seed": 99})
        part.fit(data, resume=ck, **fit)
    else:
        part.fit(data, **fit)
    assert part.step_count == full.step_count
    assert part.history == full.history
    for k, v in full.parameters().items():
        assert np.array_equal(part.parameters()[k], v), k


def test_fit_that_has_nothing_left_to_train_says_so(caplog):
    model = linear_model()[0]
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((16, 4)), "target": rng.standard_normal((16, 3))}
    tr = Trainer(model, "mse", optimizer=SGD(lr=0.05), device="cpu", progress=False)
    assert len(tr.fit(data, epochs=1, batch_size=8)) == 2
    with caplog.at_level(logging.WARNING, logger="onnxgrad.training"):
        assert tr.fit(data, epochs=1, batch_size=8) == []
    assert "fit(epochs=1) trained nothing" in caplog.text and "epochs=2" in caplog.text
    assert len(tr.fit(data, epochs=2, batch_size=8)) == 2  # epochs counts from the first


@pytest.mark.parametrize("kw, name", [
    (dict(epochs=2.0), "epochs"), (dict(epochs=-1), "epochs"), (dict(epochs="2"), "epochs"),
    (dict(max_steps=2.5), "max_steps"), (dict(max_steps=-1), "max_steps"),
    (dict(checkpoint_every=0), "checkpoint_every"), (dict(batch_size=True), "batch_size")])
def test_fit_refuses_loop_arguments_by_name(kw, name):
    model = linear_model()[0]
    data = {"x": np.zeros((8, 4)), "target": np.zeros((8, 3))}
    tr = Trainer(model, "mse", optimizer=SGD(lr=0.05), device="cpu", progress=False)
    with pytest.raises(InvalidArgumentError, match=rf"^{name}=.* must be an integer"):
        tr.fit(data, **kw)
    assert tr.step_count == 0


# -- 4. evaluate ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, opts", [
    ("cross_entropy", {"ignore_index": 0}), ("cross_entropy", {"weight": [1.0, 10.0, 0.1]}),
    ("cross_entropy", {"weight": [0.0, 2.0, 1.0], "ignore_index": 2}),
    ("cross_entropy", {"reduction": "sum"}), ("mse", {"reduction": "sum"}), ("mse", {}),
    ("bce", {}), ("l1", {"reduction": "sum"})])
def test_evaluate_is_the_loss_over_all_the_data(kind, opts):
    model, w = linear_model()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 4))
    if kind == "cross_entropy":  # sorted: whole parts of one class (all ignored, weight 0)
        target = np.sort(rng.integers(0, 3, 100))
    else:
        target = rng.random((100, 3)) if kind == "bce" else rng.standard_normal((100, 3))
    out = torch.tensor(x @ w["W"].T + w["b"])
    want = _torch_loss(kind, opts, out, torch.tensor(target)).item()
    tr = _trainer(model, kind, opts)
    got = tr.evaluate({"x": x, "target": target}, batch_size=16)
    assert got == pytest.approx(want, rel=1e-12)


def test_evaluate_checks_the_data_as_fit_does():
    model, _ = linear_model()
    tr = _trainer(model, "cross_entropy", {"ignore_index": 0})
    x = np.zeros((3, 4))
    for labels, why in (([0.0, 1.7, 2.0], "not a whole number"), ([0, 1, -3], "negative"),
                        ([0, 1, 3], "out of range")):
        with pytest.raises(DataError, match=why):
            tr.evaluate({"x": x, "target": np.array(labels)})
    with pytest.raises(DataError, match="0 / 0"):
        tr.evaluate({"x": x, "target": np.zeros(3, np.int64)})
    with pytest.raises(DataError, match="shape"):
        tr.evaluate({"x": np.zeros((3, 5)), "target": np.ones(3, np.int64)})
    with pytest.raises(DataError, match="finite"):
        tr.evaluate({"x": np.full((3, 4), np.nan), "target": np.ones(3, np.int64)})


# -- 5. the loss is a scalar; step checks its batch --------------------------------------------
def test_a_non_scalar_loss_is_refused():
    model, _ = linear_model(np.float32)
    with pytest.raises(InvalidArgumentError, match="not a scalar"):
        Trainer(model, "y", optimizer=SGD(lr=0.1), device="cpu", progress=False)
    with pytest.raises(InvalidArgumentError, match="not a scalar"):
        build_train_step(model, "y", optimizer=SGD(lr=0.1))


@pytest.mark.parametrize("kind, batch, why", [
    ("mse", {"x": np.zeros((4, 4)), "target": np.zeros((4, 3))}, "shape"),
    ("mse", {"x": np.zeros((4, 5)), "target": np.zeros((3, 3))}, "numbers of rows|disagree"),
    ("mse", {"x": np.zeros((4, 5)), "target": np.zeros((4, 4))}, "shape"),
    ("mse", {"x": np.zeros((4, 5)), "target": np.zeros((4, 1))}, "shape"),  # would broadcast
    ("mse", {"x": np.zeros((0, 5)), "target": np.zeros((0, 3))}, "no rows"),
    ("cross_entropy", {"x": np.zeros((0, 5)), "target": np.zeros(0, np.int64)}, "no rows"),
    ("mse", {"x": np.zeros((4, 5))}, "no \\['target'\\]"),
])
def test_step_checks_its_batch_as_fit_does(kind, batch, why):
    model, _ = linear_model(np.float32, inputs=5)
    tr = Trainer(model, kind, optimizer=SGD(lr=0.1), device="cpu", progress=False)
    with pytest.raises(DataError, match=why):
        tr.step({k: v.astype(np.float32) if k == "x" or kind == "mse" else v
                 for k, v in batch.items()})
    assert tr.step_count == 0


def test_data_parallel_shards_weigh_by_the_whole_batch():
    """A data-parallel step (its shards get total_rows) takes the whole batch's normalizer
    from step() before sharding: here one rank, three micro-batches, ignore_index."""
    dist = pytest.importorskip("torch.distributed")
    from onnxgrad.training.distributed import DistributedTrainer
    model, _ = linear_model()
    rng = np.random.default_rng(3)
    batch = {"x": rng.standard_normal((9, 4)), "target": np.array([1, 1, 1, 0, 2, 1, 0, 0, 2])}
    opts = {"ignore_index": 1, "weight": [1.0, 2.0, 0.5]}
    full = _trainer(model, "cross_entropy", opts)
    want = full.step(batch)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tr = DistributedTrainer(model, "cross_entropy", loss_options=opts, optimizer=SGD(lr=0.1),
                                accumulation_steps=3, device="cpu", progress=False)
        assert tr.step(batch) == pytest.approx(want, rel=1e-12)
        for k, v in tr.parameters().items():
            np.testing.assert_allclose(v, full.parameters()[k], rtol=0, atol=1e-13)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("array", ["x", "target"])
@pytest.mark.parametrize("kind", ["complex", "bool", "str", "object"])
def test_data_of_a_type_the_step_cannot_read_is_refused(array, kind):
    """A complex x lost its imaginary part (a numpy warning, exit 0), a bool x trained as 0/1,
    a string y failed without naming the array: each is a DataError naming it."""
    model, _ = linear_model(np.float32)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((4, 4)).astype(np.float32),
             "target": rng.standard_normal((4, 3)).astype(np.float32)}
    v = batch[array]
    batch[array] = {"complex": v.astype(np.complex64), "bool": v > 0,
                    "str": v.astype(str), "object": v.astype(object)}[kind]
    tr = _trainer(model, "mse", {})
    for run in (lambda: tr.step(batch), lambda: tr.fit(batch, batch_size=2),
                lambda: tr.evaluate(batch)):
        with pytest.raises(DataError, match=f"'{array}' holds"):
            run()
    assert tr.step_count == 0


class _MergedAndTied(torch.nn.Module):
    """Two fresh LayerNorms (equal weights, equal biases: the exporters merge equal tensors) and
    a weight read twice, as itself and transposed (as a tied embedding and output layer: the
    exporters fold the transpose into a copy)."""

    def __init__(self, fresh=True):
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(4, 6) * 0.5)
        self.ln1, self.ln2 = torch.nn.LayerNorm(6), torch.nn.LayerNorm(6)
        if not fresh:
            with torch.no_grad():
                self.ln2.weight.mul_(1.5)
                self.ln2.bias.add_(0.1)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.ln2(torch.tanh(self.ln1(x @ self.proj)))
        return self.head(F.linear(h, self.proj))


@pytest.mark.parametrize("exporter", ["torchscript", "torchscript-inputs", "dynamo",
                                      "dynamo-optimized"])
def test_parameters_the_exporters_merge_or_tie_train_as_torch(tmp_path, exporter, caplog,
                                                              monkeypatch):
    """The TorchScript exporter wrote a parameter equal to another (a fresh LayerNorm's) as
    Identity(other), trained as one tensor with the sum of both gradients; both exporters fold
    the transpose of a weight read twice into a copy, trained apart (TorchScript) or not at all
    (dynamo). Now each trains as torch's, step for step. torch.onnx's optimizer merges equal
    parameters where nothing in the file tells them from tied ones: a warning names them."""
    pytest.importorskip("onnxscript")
    from onnxgrad.training import step
    monkeypatch.setattr(step, "_WARNED", set())  # (said once a process: this test's own)
    torch.manual_seed(0)
    fresh = exporter != "dynamo-optimized"
    net = _MergedAndTied(fresh)
    path = str(tmp_path / "m.onnx")
    if exporter.startswith("torchscript"):  # (-inputs: initializers listed as inputs too)
        quiet_export(net, path, dynamo=False, dynamic_axes={"x": {0: "N"}},
                     keep_initializers_as_inputs=exporter.endswith("inputs"))
    else:
        quiet_export(net, path, dynamo=True, dynamic_shapes=({0: torch.export.Dim("N")},),
                     optimize=exporter == "dynamo-optimized")
    with caplog.at_level(logging.WARNING, logger="onnxgrad.training"):
        tr = _train_both(path, net, steps=4)
    assert sorted(tr.params) == sorted(n for n, _ in net.named_parameters())
    p = tr.parameters()
    for n, v in net.named_parameters():
        np.testing.assert_allclose(p[n], v.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=n)
    assert "does not hold" not in caplog.text
    if exporter == "dynamo-optimized":  # (fresh LayerNorms: merged, and said to be)
        torch.manual_seed(0)
        quiet_export(_MergedAndTied(), path, dynamo=True, optimize=True,
                     dynamic_shapes=({0: torch.export.Dim("N")},))
        with caplog.at_level(logging.WARNING, logger="onnxgrad.training"):
            Trainer(path, "mse", optimizer=SGD(lr=0.1), device="cpu", progress=False)
        assert re.search(r"does not hold as tensors: .*ln2\.weight", caplog.text)
        assert caplog.text.count("does not hold") == 1  # (said once, not per step builder)


class _NoMerge(torch.nn.Module):
    """A weight read as itself and through a no-op reshape, and returned as an output: the
    TorchScript exporter writes Identity(w) for both, which are not parameters of their own."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4) * 0.5)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(x @ self.w.reshape(4, 4)) + x @ self.w), self.w


def test_an_identity_of_a_parameter_that_is_none_stays_a_read_of_it(tmp_path):
    """(Found reviewing as_module_parameters.) An Identity of a parameter named by the exporter
    ("onnx::MatMul_8", a no-op reshape) or returned as a graph output is a read of that
    parameter, not a merged one: made its own initializer, it trained apart or not at all."""
    torch.manual_seed(0)
    net = _NoMerge()
    path = str(tmp_path / "m.onnx")
    with quiet():
        torch.onnx.export(net, (torch.randn(3, 4),), path, input_names=["x"], dynamo=False,
                          output_names=["y", "w_out"], dynamic_axes={"x": {0: "N"}})
    tr = Trainer(path, "mse", optimizer=SGD(lr=0.05), device="cpu", progress=False, threads=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((8, 4)).astype(np.float32)
        y = rng.standard_normal((8, 2)).astype(np.float32)
        lo = tr.step({"x": x, "target": y})
        opt.zero_grad()
        loss = F.mse_loss(net(torch.tensor(x))[0], torch.tensor(y))
        loss.backward()
        opt.step()
        assert lo == pytest.approx(loss.item(), rel=1e-5)
    assert sorted(tr.params) == sorted(n for n, _ in net.named_parameters())
    out = stock_session(tr.trained_model()).run(["w_out"], {"x": np.zeros((1, 4), np.float32)})
    np.testing.assert_allclose(out[0], net.w.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_weights_folded_into_their_transposes_are_not_warned(caplog, monkeypatch):
    """The dynamo optimizer folds a weight read once into its transpose (a TransformerEncoder's
    in_proj and linear weights): that constant trains to the same effect, and is not named in
    the warning that names the parameters it merged (a fresh layer's second LayerNorm)."""
    pytest.importorskip("onnxscript")
    from onnxgrad.training import step
    monkeypatch.setattr(step, "_WARNED", set())
    torch.manual_seed(0)
    net = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    with quiet():
        m = torch.onnx.export(net, (torch.zeros(2, 5, 8),), dynamo=True, input_names=["x"],
                              verbose=False).model_proto
    with caplog.at_level(logging.WARNING, logger="onnxgrad.training"):
        step.as_module_parameters(m)
    said = caplog.text
    assert "norm2.weight" in said and "linear1.weight" not in said, said


def test_a_web_export_holds_the_parameters_its_step_trains(tmp_path):
    """(Found by the CI run of the review fixes.) The web target saves the inference model the
    page fills with the trained values: it held Identity(ln1.weight) where its step trains
    ln2.weight of its own, which then had no bytes in the file to write to."""
    from onnxgrad.training.webstep import export_web_step, paths
    torch.manual_seed(0)
    net = _MergedAndTied()
    path = str(tmp_path / "m.onnx")
    quiet_export(net, path, dynamo=False, dynamic_axes={"x": {0: "N"}})
    man = export_web_step(path, "mse", tmp_path / "w.onnx", optimizer=SGD(lr=0.1))
    held = {t.name for t in onnx.load(paths(tmp_path / "w.onnx")["model"]).graph.initializer}
    trained = [p["name"] for p in man["params"]]
    assert sorted(trained) == sorted(n for n, _ in net.named_parameters())
    assert set(trained) <= held


@pytest.mark.parametrize("clash", [False, True])
def test_weights_inside_loop_bodies_train(clash):
    """A weight only a Loop's body reads, stored in the body (h <- tanh(h Wb + x_t)): the
    Trainer left it out silently (params=None), and params=["Wb"] was refused. It moves to the
    main graph and trains, to torch's values. Two bodies defining one name (an If's branches'
    own constant c) cannot both move: left out, by name and why."""
    from onnx import TensorProto as TP
    rng = np.random.default_rng(3)
    wb, wo = rng.standard_normal((3, 3)) * 0.5, rng.standard_normal((3, 2))
    V = helper.make_tensor_value_info
    branch = [numpy_helper.from_array(np.array(1.5 if k else 0.5), "c") for k in (0, 1)]
    ifs = [helper.make_graph([helper.make_node("Mul", ["p", "c"], [f"q{k}"])], f"b{k}", [],
                             [V(f"q{k}", TP.DOUBLE, ["N", 3])], [branch[k]]) for k in (0, 1)]
    step = [helper.make_node("Gather", ["x", "i"], ["xi"], axis=1),
            helper.make_node("MatMul", ["h_in", "Wb"], ["hw"]),
            helper.make_node("Add", ["hw", "xi"], ["p"])]
    step += ([helper.make_node("If", ["flag"], ["pq"], then_branch=ifs[0], else_branch=ifs[1]),
              helper.make_node("Tanh", ["pq"], ["h_out"])] if clash else
             [helper.make_node("Tanh", ["p"], ["h_out"])])
    body = helper.make_graph(
        step + [helper.make_node("Identity", ["cond"], ["c_out"])], "body",
        [V("i", TP.INT64, []), V("cond", TP.BOOL, []), V("h_in", TP.DOUBLE, ["N", 3])],
        [V("c_out", TP.BOOL, []), V("h_out", TP.DOUBLE, ["N", 3])],
        [numpy_helper.from_array(wb, "Wb")])
    g = helper.make_graph(
        [helper.make_node("Loop", ["T", "", "h0"], ["hT"], body=body),
         helper.make_node("MatMul", ["hT", "Wo"], ["y"])], "g",
        [V("x", TP.DOUBLE, ["N", 4, 3]), V("h0", TP.DOUBLE, ["N", 3])],
        [V("y", TP.DOUBLE, ["N", 2])],
        [numpy_helper.from_array(np.array(4, np.int64), "T"), numpy_helper.from_array(wo, "Wo"),
         numpy_helper.from_array(np.array(True), "flag")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    before = m.SerializeToString()
    x, h0, t = (rng.standard_normal(s) for s in ((8, 4, 3), (8, 3), (8, 2)))
    tr = Trainer(m, "mse", optimizer=SGD(lr=0.1), device="cpu", progress=False, threads=1)
    assert m.SerializeToString() == before
    assert sorted(tr.params) == ["Wb", "Wo"]
    if clash:
        assert "c" in tr.left_out and "defined elsewhere" in tr.left_out["c"]
    for _ in range(3):
        tr.step({"x": x, "h0": h0, "target": t})
    W, O = (torch.tensor(a, requires_grad=True) for a in (wb, wo))
    opt = torch.optim.SGD([W, O], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        h = torch.tensor(h0)
        for k in range(4):
            h = torch.tanh((h @ W + torch.tensor(x[:, k])) * (0.5 if clash else 1.0))
        F.mse_loss(h @ O, torch.tensor(t)).backward()
        opt.step()
    got = tr.parameters()
    np.testing.assert_allclose(got["Wb"], W.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["Wo"], O.detach().numpy(), rtol=1e-10, atol=1e-12)
    onnx.checker.check_model(tr.trained_model(), full_check=True)


@pytest.mark.parametrize("cond", [True, False])
@pytest.mark.parametrize("case", ["output", "shadows", "node_output", "sibling_matmul"])
def test_body_weights_that_cannot_move_stay(case, cond):
    """Names may repeat across sibling scopes: a body initializer that a branch returns as its
    output, one named as a main-graph initializer or node output, stay where they are (moving
    them made an invalid model: onnx's ValidationError from the Trainer); and a branch's own
    initializer read by a MatMul had no rank in the gradient (refused). Each trains what the
    main graph and the movable bodies hold, to float64 central differences of the loss."""
    from onnx import TensorProto as TP
    D = TP.DOUBLE
    V = helper.make_tensor_value_info
    rng = np.random.default_rng(0)
    a0, w0 = rng.standard_normal((2, 2)), rng.standard_normal((2, 2))
    arr = numpy_helper.from_array
    mm = helper.make_node

    def branch(nodes, out, inits, shape=("N", 2)):
        return helper.make_graph(nodes, f"b_{out}", [], [V(out, D, list(shape))], inits)
    neg = branch([mm("Neg", ["x"], ["t2"])], "t2", [])
    if case == "output":
        then = branch([], "A", [arr(a0, "A")], (2, 2))
        other = branch([mm("Identity", ["B"], ["t3"])], "t3", [], (2, 2))
        nodes = [mm("If", ["c"], ["h"], then_branch=then, else_branch=other),
                 mm("MatMul", ["x", "h"], ["out"])]
        inits, want = [arr(a0 * 0, "B")], ["B"]
    elif case in ("shadows", "node_output"):
        k = "W" if case == "shadows" else "K"
        then = branch([mm("MatMul", ["x", k], ["tt"])], "tt", [arr(a0, k)])
        nodes = [mm("If", ["c"], ["h"], then_branch=then, else_branch=neg)]
        if case == "node_output":
            nodes += [mm("Relu", ["h"], ["K"]), mm("MatMul", ["K", "W"], ["out"])]
        else:
            nodes += [mm("MatMul", ["h", "W"], ["out"])]
        inits, want = [arr(w0, "W")], ["W"]
    else:  # two Ifs whose then-branches both define K; their else-branches' own E1, E2 move
        def two(inp, out, e):
            return mm("If", ["c"], [out], then_branch=branch(
                [mm("MatMul", [inp, "K"], [f"t_{out}"])], f"t_{out}", [arr(a0, "K")]),
                else_branch=branch([mm("MatMul", [inp, e], [f"e_{out}"])], f"e_{out}",
                                   [arr(a0 + 0.5, e)]))
        nodes = [two("x", "h1", "E1"), two("h1", "h2", "E2"), mm("MatMul", ["h2", "W"], ["out"])]
        inits, want = [arr(w0, "W")], ["E1", "E2", "W"]
    g = helper.make_graph(nodes, "g", [V("x", D, ["N", 2])], [V("out", D, ["N", 2])],
                          inits + [arr(np.array(cond), "c")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    tr = Trainer(m, "mse", optimizer=SGD(lr=0.1), device="cpu", progress=False, threads=1)
    assert sorted(tr.params) == want
    feeds = {"x": rng.standard_normal((4, 2)), "target": rng.standard_normal((4, 2))}
    res = onnxgrad.gradients(tr.loss_model, tr.loss_name, tr.params)
    got = dict(zip(tr.params, stock_session(res.model).run(res.grads, feeds)))
    for p in tr.params:
        def loss(v, p=p):
            mdl = onnx.ModelProto()
            mdl.CopyFrom(tr.loss_model)
            for ti in mdl.graph.initializer:
                if ti.name == p:
                    ti.CopyFrom(numpy_helper.from_array(v, p))
            return float(stock_session(mdl).run([tr.loss_name], feeds)[0])
        start = numpy_helper.to_array(next(ti for ti in tr.loss_model.graph.initializer
                                           if ti.name == p))
        np.testing.assert_allclose(got[p], central_differences(loss, start, 1e-6),
                                   rtol=1e-5, atol=1e-8)
    tr.step(feeds)
    onnx.checker.check_model(tr.trained_model(), full_check=True)


def test_accumulation_over_a_static_batch_is_checked_by_name():
    """A model exported without a symbolic batch reads x as [6, 4]: split into micro-batches of
    3 rows, the step failed inside onnxruntime ("Got invalid dimensions for input"); now a
    DataError that says what to do. Micro-batches of the static size train, as one step on
    the whole batch of the model's symbolic twin does."""
    static, w = linear_model(inputs=4)
    for d in static.graph.input[0].type.tensor_type.shape.dim[:1]:
        d.Clear()
        d.dim_value = 6
    rng = np.random.default_rng(0)
    opts = dict(optimizer=SGD(lr=0.1), device="cpu", progress=False, threads=1)
    tr = Trainer(static, "mse", accumulation_steps=2, **opts)
    with pytest.raises(DataError, match=r"micro-batches of \[3\] rows.*static batch of 6.*12 rows"):
        tr.step({"x": rng.standard_normal((6, 4)), "target": rng.standard_normal((6, 3))})
    assert tr.step_count == 0
    batch = {"x": rng.standard_normal((12, 4)), "target": rng.standard_normal((12, 3))}
    tr.step(batch)
    whole = Trainer(linear_model(inputs=4)[0], "mse", **opts)
    whole.step(batch)
    for k, v in whole.parameters().items():
        np.testing.assert_allclose(tr.parameters()[k], v, rtol=1e-12, atol=1e-14)
