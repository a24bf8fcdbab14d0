"""The fused CPU optimizer (onnxgrad.training.fused) against the ONNX optimizer graph it
replaces, and its kernel against a numpy reference of the same arithmetic.

The Trainer runs Adam and AdamW fused by default on CPU (test_training.py's torch comparisons go
through it); here each configuration runs both ways from the same weights and batches, and the
kernel's generated cases (hypothesis) cover sizes, thread splits and hyper-parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from onnxgrad.errors import InvalidArgumentError
from onnxgrad.training import SGD, Adam, AdamW, NonFiniteLossError, Trainer, fused
from util import make_model


@pytest.fixture
def cc():
    """The kernel library; without a C compiler these tests fail and say so (the Trainer itself
    then runs the optimizer graph, test_without_a_compiler_the_graph_runs)."""
    why = fused.unavailable()
    if why is not None:
        pytest.fail(f"the fused optimizer's tests need a C compiler (cc; Debian: apt-get install "
                    f"gcc): {why}")
    return fused.library()


@dataclass
class Lion(SGD):
    """A user's own optimizer (here SGD's update under another name): no fused kernel."""


def _mlp(dtype=np.float32, hidden=16, seed=0):
    rng = np.random.default_rng(seed)
    w = {"W1": rng.standard_normal((8, hidden)) * 0.4, "b1": rng.standard_normal(hidden) * 0.1,
         "W2": rng.standard_normal((hidden, 3)) * 0.3, "b2": np.zeros(3)}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Tanh", ["hb"], ["a"]),
             helper.make_node("MatMul", ["a", "W2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["logits"])]
    return make_model(nodes, {"x": (dtype, ["N", 8])}, ["logits"],
                      inits={k: v.astype(dtype) for k, v in w.items()})


def _batches(dtype=np.float32, steps=8, n=12, seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((n, 8)).astype(dtype), "target": rng.integers(0, 3, n)}
            for _ in range(steps)]


def _run(model, optimizer, batches, **kw):
    tr = Trainer(model, "cross_entropy", optimizer=optimizer, device="cpu", progress=False,
                 lr_schedule=lambda s: 0.02 / (1 + 0.3 * s), **kw)
    losses = [tr.step(b) for b in batches]
    return tr, losses


OPTIMIZERS = {
    "adamw": lambda: AdamW(lr=1e-2, weight_decay=0.1),
    "adamw-no-decay": lambda: AdamW(lr=1e-2, weight_decay=0.0),
    "adam": lambda: Adam(lr=1e-2),
    "adam-l2": lambda: Adam(lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-2, eps=1e-6),
    "adam-amsgrad": lambda: Adam(lr=1e-2, amsgrad=True),
    "adamw-amsgrad": lambda: AdamW(lr=1e-2, betas=(0.5, 0.9), amsgrad=True),
    "sgd": lambda: SGD(lr=0.1),
    "sgd-momentum": lambda: SGD(lr=0.05, momentum=0.9),
    "sgd-nesterov-wd": lambda: SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd-dampening-wd": lambda: SGD(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.1),
}


def _against_graph(make_opt, batches, model, rtol=1e-6, **kw):
    """Run the fused and the graph step from the same weights and batches; their losses,
    parameters and state must agree to ``rtol``."""
    ours, ours_losses = _run(model, make_opt(), batches, fused_optimizer=True, **kw)
    graph, graph_losses = _run(model, make_opt(), batches, fused_optimizer=False, **kw)
    assert ours.fused_reason is None and graph.fused_reason == "fused_optimizer=False"
    assert ours._sess is None and graph._sess is not None  # each ran the path it names
    np.testing.assert_allclose(ours_losses, graph_losses, rtol=1e-6)
    for got, want in ((ours.parameters(), graph.parameters()),
                      (ours.optimizer_state(), graph.optimizer_state())):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype, k
            np.testing.assert_allclose(got[k], want[k], rtol=rtol,
                                       atol=rtol / 10 * np.abs(want[k]).max(), err_msg=k)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_fused_equals_the_optimizer_graph(cc, opt, dtype):
    """Same weights, batches and lr schedule: the fused step's losses, parameters and state are
    the one-graph step's (the same operations in the same order and type)."""
    _against_graph(OPTIMIZERS[opt], _batches(dtype), _mlp(dtype))


@pytest.mark.parametrize("opt", ["adamw-amsgrad", "sgd-nesterov-wd"])
def test_fused_after_accumulation_equals_the_optimizer_graph(cc, opt):
    """Split steps (gradient accumulation; data-parallel steps are the same code) apply the
    fused update to the accumulated gradients in place of their optimizer graph."""
    _against_graph(OPTIMIZERS[opt], _batches(steps=4, n=15), _mlp(), accumulation_steps=3)


@pytest.mark.parametrize("opt", ["adamw", "adam-l2", "sgd-nesterov-wd"])
@pytest.mark.parametrize("clip_norm", [0.05, 100.0])
def test_fused_with_clipping_equals_the_optimizer_graph(cc, opt, clip_norm):
    """clip_norm: the global norm (summed in float64 here, per gradient in float32 by the graph)
    scales every gradient first; 0.05 clips every step, 100 none."""
    _against_graph(OPTIMIZERS[opt], _batches(steps=6), _mlp(), rtol=1e-5, clip_norm=clip_norm)


def test_fused_threads_split_the_parameters(cc):
    """The kernel splits the parameters (laid end to end) into ranges of at least 65,536
    elements, one per thread: the results do not depend on the split."""
    model, batches = _mlp(hidden=20000), _batches(steps=3)  # 8*20000 + 20000 + 20000*3 + 3
    one, _ = _run(model, AdamW(lr=1e-2), batches, fused_optimizer=True, threads=1)
    three, _ = _run(model, AdamW(lr=1e-2), batches, fused_optimizer=True, threads=3)
    graph, _ = _run(model, AdamW(lr=1e-2), batches, fused_optimizer=False, threads=1)
    assert sum(v.size for v in one.parameters().values()) > 3 * 65536
    for k, v in one.parameters().items():
        assert np.array_equal(three.parameters()[k], v), k
        np.testing.assert_allclose(v, graph.parameters()[k], rtol=1e-6, atol=1e-9, err_msg=k)


def test_fused_step_with_a_non_finite_loss_changes_nothing(cc):
    tr = Trainer(_mlp(), "cross_entropy", optimizer=AdamW(amsgrad=True), device="cpu",
                 progress=False, fused_optimizer=True,
                 lr_schedule=lambda step: 1e38 if step == 2 else 1e-3)
    batches = _batches(steps=3, n=16)
    tr.step(batches[0])
    tr.step(batches[1])
    before, state = tr.parameters(), tr.optimizer_state()
    with pytest.raises(NonFiniteLossError, match="at step 3"):
        tr.step(batches[2])
    assert tr.step_count == 2
    for k, v in tr.parameters().items():
        assert np.array_equal(v, before[k]), k
    for k, v in tr.optimizer_state().items():
        assert np.array_equal(v, state[k]), k


def test_fused_optimizer_argument_and_refusals(cc):
    with pytest.raises(InvalidArgumentError, match="fused_optimizer='yes'"):
        Trainer(_mlp(), "cross_entropy", device="cpu", fused_optimizer="yes")
    with pytest.raises(InvalidArgumentError, match="fused_optimizer=1"):
        Trainer(_mlp(), "cross_entropy", device="cpu", fused_optimizer=1)
    with pytest.raises(InvalidArgumentError, match="Lion has no fused kernel"):
        Trainer(_mlp(), "cross_entropy", optimizer=Lion(), device="cpu", fused_optimizer=True)
    # "auto" takes the graph where the fused kernel does not apply, and says why
    tr = Trainer(_mlp(), "cross_entropy", optimizer=Lion(), device="cpu", progress=False)
    assert tr.fused_reason == "Lion has no fused kernel (SGD, Adam and AdamW have)"
    assert tr._sess is not None and np.isfinite(tr.step(_batches(steps=1)[0]))


def test_without_a_compiler_the_graph_runs(monkeypatch, tmp_path):
    """No C compiler: "auto" runs the one-graph step (same losses as fused=False), True is an
    error that names the compiler; nothing is left in the cache."""
    monkeypatch.setattr(fused, "_lib", None)
    monkeypatch.setattr(fused, "_why", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ONNXGRAD_CACHE", str(tmp_path / "cache"))
    assert "no C compiler" in fused.unavailable()
    batches = _batches(steps=3)
    auto, auto_losses = _run(_mlp(), AdamW(lr=1e-2), batches)
    assert "no-such-cc" in auto.fused_reason and auto._sess is not None
    _, graph_losses = _run(_mlp(), AdamW(lr=1e-2), batches, fused_optimizer=False)
    assert auto_losses == graph_losses
    with pytest.raises(InvalidArgumentError, match="no C compiler"):
        Trainer(_mlp(), "cross_entropy", device="cpu", fused_optimizer=True)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


# -- the kernel alone, generated cases ---------------------------------------------------------
def _reference(opt, k, p, g, m, v, mx):
    """The optimizer graph's arithmetic in numpy, one rounded operation at a time."""
    decay, wd, b1, b2, step, eps = k
    pd = p * decay if opt.decoupled and opt.weight_decay != 0 else p
    if not opt.decoupled and opt.weight_decay != 0:
        g = g + p * wd
    m = m * b1 + g
    v = v * b2 + g * g
    d = v
    if opt.amsgrad:
        d = np.maximum(mx, v)
        mx = d
    return pd - m / (np.sqrt(d) + eps) * step, m, v, mx


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.one_of(st.integers(0, 300), st.integers(60000, 140000)), min_size=1,
                      max_size=4),
       dtype=st.sampled_from([np.float32, np.float64]),
       decoupled=st.booleans(), amsgrad=st.booleans(),
       wd=st.sampled_from([0.0, 1e-2, 0.3]), b1=st.floats(0.0, 0.99), b2=st.floats(0.5, 0.9999),
       eps=st.sampled_from([1e-8, 1e-6, 1e-3]), lr=st.floats(1e-5, 1.0),
       step=st.integers(1, 5000), threads=st.integers(1, 4), seed=st.integers(0, 2**31),
       clip_norm=st.sampled_from([None, None, 0.5, 1e4]))
def test_fused_kernel_is_the_graph_arithmetic(cc, sizes, dtype, decoupled, amsgrad, wd, b1, b2,
                                              eps, lr, step, threads, seed, clip_norm):
    """Bit for bit without clipping; with it, the coefficient comes from a norm summed in
    another order (per thread), so to rounding."""
    opt = (AdamW if decoupled else Adam)(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                                          amsgrad=amsgrad)
    kern = fused.make(opt, dtype, threads, clip_norm)
    rng = np.random.default_rng(seed)
    arrays = []
    for n in sizes:
        p, g, m = (rng.standard_normal(n).astype(dtype) for _ in range(3))
        v, mx = (np.abs(rng.standard_normal(n)).astype(dtype) for _ in range(2))
        arrays.append([p, g, m, v, mx])
    k = kern.scalars(lr, step)
    scale = None
    if clip_norm is not None:
        norm = np.sqrt(sum(np.sum(a[1].astype(np.float64) ** 2) for a in arrays))
        scale = dtype(min(1.0, clip_norm / (norm + 1e-6)))
    want = [_reference(opt, k, a[0], a[1] if scale is None else a[1] * scale, *a[2:])
            for a in arrays]
    kern.apply([(p.ctypes.data, g.ctypes.data, m.ctypes.data, v.ctypes.data,
                 mx.ctypes.data if amsgrad else 0, p.size) for p, g, m, v, mx in arrays],
               lr, step)
    same = np.array_equal if scale is None else (
        lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max(initial=1.0)))
    for (p, _, m, v, mx), (wp, wm, wv, wmx) in zip(arrays, want):
        assert same(p, wp) and same(m, wm) and same(v, wv)
        if amsgrad:
            assert same(mx, wmx)


def test_cli_fused_optimizer_flag(cc, tmp_path, capsys, monkeypatch):
    """`onnxgrad train --fused-optimizer on|off|auto`: on without a compiler is an error that
    says why and writes nothing; off and on train the same weights."""
    from onnxgrad.cli import main
    model, data = str(tmp_path / "m.onnx"), str(tmp_path / "d.npz")
    onnx.save(_mlp(), model)
    b = _batches(steps=1, n=40)[0]
    np.savez(data, x=b["x"], y=b["target"])
    common = ["train", model, "--loss", "cross_entropy", "--data", data, "--epochs", "2",
              "--batch-size", "8", "--lr", "0.01", "--no-progress", "--device", "cpu"]
    bad = str(tmp_path / "bad.onnx")
    monkeypatch.setattr(fused, "_lib", None)
    monkeypatch.setattr(fused, "_why", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ONNXGRAD_CACHE", str(tmp_path / "cache"))
    assert main(common + ["--fused-optimizer", "on", "-o", bad]) == 2
    assert "fused_optimizer=True: no C compiler" in capsys.readouterr().err
    monkeypatch.undo()
    assert not (tmp_path / "bad.onnx").exists()
    outs = {}
    for flag in ("on", "off"):
        out = str(tmp_path / f"{flag}.onnx")
        assert main(common + ["--fused-optimizer", flag, "-o", out]) == 0
        outs[flag] = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    assert outs["on"].keys() == outs["off"].keys()
    for k in outs["on"]:
        np.testing.assert_allclose(outs["on"][k], outs["off"][k], rtol=1e-6, atol=1e-8,
                                   err_msg=k)


def _sgd_reference(opt, k, p, g, buf):
    lr, wd, mom_t, damp_t, momentum = k
    d = g + p * wd if opt.weight_decay != 0 else g
    if opt.momentum != 0:
        buf = buf * mom_t + (d * damp_t if opt.dampening != 0 else d)
        d = d + buf * momentum if opt.nesterov else buf
    return p - d * lr, buf


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.one_of(st.integers(0, 300), st.integers(60000, 140000)), min_size=1,
                      max_size=4),
       dtype=st.sampled_from([np.float32, np.float64]),
       momentum=st.sampled_from([0.0, 0.5, 0.9]), dampening=st.sampled_from([0.0, 0.3]),
       nesterov=st.booleans(), wd=st.sampled_from([0.0, 1e-2]), lr=st.floats(1e-5, 1.0),
       step=st.integers(1, 3), threads=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_fused_sgd_kernel_is_the_graph_arithmetic(cc, sizes, dtype, momentum, dampening,
                                                  nesterov, wd, lr, step, threads, seed):
    if nesterov and (momentum == 0 or dampening != 0):
        nesterov = False  # SGD refuses it (as torch does)
    opt = SGD(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
              weight_decay=wd)
    kern = fused.make(opt, dtype, threads)
    rng = np.random.default_rng(seed)
    arrays = [[rng.standard_normal(n).astype(dtype) for _ in range(3)] for n in sizes]
    k = kern.scalars(lr, step)
    want = [_sgd_reference(opt, k, *a) for a in arrays]
    kern.apply([(p.ctypes.data, g.ctypes.data, b.ctypes.data if momentum else 0, 0, 0, p.size)
                for p, g, b in arrays], lr, step)
    for (p, _, b), (wp, wb) in zip(arrays, want):
        assert np.array_equal(p, wp)
        if momentum:
            assert np.array_equal(b, wb)


@pytest.mark.parametrize("fused_optimizer", [True, False])
def test_parameters_and_state_are_copies(cc, fused_optimizer):
    """What parameters() and optimizer_state() return stays as it was after later steps (the
    buffers are updated in place, and OrtValue.numpy() of a CPU buffer is a view of it)."""
    tr = Trainer(_mlp(), "cross_entropy", optimizer=AdamW(lr=1e-2), device="cpu",
                 progress=False, fused_optimizer=fused_optimizer)
    batches = _batches(steps=3)
    tr.step(batches[0])
    p, s = tr.parameters(), tr.optimizer_state()
    kept = {k: v.copy() for k, v in {**p, **s}.items()}
    tr.step(batches[1])
    tr.step(batches[2])
    for k, v in {**p, **s}.items():
        assert np.array_equal(v, kept[k]), k
    assert not np.array_equal(tr.parameters()["W1"], kept["W1"])  # it did train



# -- gradients where the gradient graph leaves them (grad_layout) ------------------------------
def _reshaped(seed=0):
    """Parameters whose gradients end in nodes that only re-shape them: a 3x3 Conv (its dW a
    Gemm's [Co, C*K] or the taps' [Co, C, K], then a Reshape), a BatchNormalization's scale
    read through a Reshape to [1, C, 1, 1] as torch exports it, a Linear read through a
    Transpose (which stays: it moves elements), and a bias read through Flatten and Squeeze."""
    rng = np.random.default_rng(seed)
    w = {"W1": rng.standard_normal((16, 8, 3, 3)) * 0.2, "s": 1 + 0.1 * rng.standard_normal(16),
         "W2": rng.standard_normal((5, 1024)) * 0.05, "b": rng.standard_normal((1, 5, 1)) * 0.1}
    inits = {k: v.astype(np.float32) for k, v in w.items()}
    inits["to_c"] = np.array([1, 16, 1, 1], np.int64)
    inits["ax2"] = np.array([2], np.int64)
    nodes = [helper.make_node("Conv", ["x", "W1"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["s", "to_c"], ["s4"]),
             helper.make_node("Mul", ["c", "s4"], ["cs"]),
             helper.make_node("Relu", ["cs"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["mp"], ["h"]),
             helper.make_node("Transpose", ["W2"], ["W2t"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "W2t"], ["o"]),
             helper.make_node("Flatten", ["b"], ["bf"]),
             helper.make_node("Squeeze", ["bf"], ["bs"]),
             helper.make_node("Add", ["o", "bs"], ["logits"])]
    return make_model(nodes, {"x": (np.float32, ["N", 8, 16, 16])}, ["logits"], inits=inits)


@pytest.mark.parametrize("opt", ["adamw-amsgrad", "sgd-nesterov-wd"])
def test_fused_reads_gradients_where_the_graph_leaves_them(cc, opt):
    """The fused step binds each gradient before the Reshapes that end it (onnxruntime copies
    at a graph output's Reshape; the kernel reads flat memory): the same losses, parameters
    and state as the optimizer graph's step, which reads the gradients in the parameters'
    own shapes (float32: onnxruntime has no float64 Conv)."""
    rng = np.random.default_rng(3)
    batches = [{"x": rng.standard_normal((6, 8, 16, 16)).astype(np.float32),
                "target": rng.integers(0, 5, 6)} for _ in range(4)]
    _against_graph(OPTIMIZERS[opt], batches, _reshaped(), rtol=1e-5)
    tr = Trainer(_reshaped(), "cross_entropy", optimizer=AdamW(), device="cpu",
                 progress=False, fused_optimizer=True)
    stored = dict(zip(tr.params, tr._stored))
    for p in ("W1", "s", "b"):  # bound before their Reshapes, Flatten and Squeeze
        assert stored[p] is not None and stored[p][0] not in tr._acc.grads, p
        assert math.prod(stored[p][1]) == tr.parameters()[p].size, p
    assert stored["W2"] is None  # its gradient ends in a Transpose


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from([(4, 10), (2, 4, 5), (40,), (1, 8, 5, 1)]),
       chain=st.lists(st.sampled_from(["Identity", "Unsqueeze", "Flatten", "Reshape"]),
                      max_size=3),
       opt=st.sampled_from(["adamw", "sgd-momentum"]))
def test_fused_reads_gradients_past_any_reshaping_chain(cc, shape, chain, opt):
    """A parameter of any shape reaches its MatMul through a drawn chain of Identity,
    Unsqueeze, Flatten and Reshape nodes (the last one to [8, 5]): its gradient ends in the
    reverse chain, whose start the fused step binds in whatever shape it has (one dim solved
    from the parameter's size where inference leaves it open); the same training as the
    optimizer graph's step."""
    nodes, cur, inits = [], "P", {"P": np.random.default_rng(1).standard_normal(shape)
                                  .astype(np.float32) * 0.3, "to": np.array([8, 5])}
    for i, op in enumerate([*chain, "Reshape"]):
        out = f"c{i}"
        if op == "Unsqueeze":
            inits[f"ax{i}"] = np.array([0])
            nodes.append(helper.make_node(op, [cur, f"ax{i}"], [out]))
        elif op == "Reshape":
            inits[f"sh{i}"] = np.array([8, 5] if i == len(chain) else [-1])
            nodes.append(helper.make_node(op, [cur, f"sh{i}"], [out]))
        else:
            nodes.append(helper.make_node(op, [cur], [out]))
        cur = out
    nodes.append(helper.make_node("MatMul", ["x", cur], ["logits"]))
    m = make_model(nodes, {"x": (np.float32, ["N", 8])}, ["logits"], inits=inits)
    rng = np.random.default_rng(2)
    batches = [{"x": rng.standard_normal((6, 8)).astype(np.float32),
                "target": rng.integers(0, 5, 6)} for _ in range(3)]
    _against_graph(OPTIMIZERS[opt], batches, m, rtol=1e-5, params=["P"])
    tr = Trainer(m, "cross_entropy", device="cpu", progress=False, params=["P"],
                 fused_optimizer=True)
    assert tr._stored[0] is not None and math.prod(tr._stored[0][1]) == 40  # bound early
