"""Data-parallel training (onnxgrad.training.distributed) on 2 processes that torchrun starts from
here (gloo over 127.0.0.1, each run bounded in time), against single-process training on the same
global batches; faults (a killed rank, a hung rank, a NaN on one rank); resume; the zero-copy
exchange between onnxruntime and torch (in this process, a 1-rank group)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import numpy_helper

from dist_cases import CASES, MLP, digits, fit, trainer
from util import bn_train_export
from onnxgrad.errors import DistributedError, MissingExtraError
from onnxgrad.runtime import session
from onnxgrad.training import AdamW, Trainer, attach_loss, build_gradient_model
from onnxgrad.training.distributed import DistributedTrainer, plan_layout

torch = pytest.importorskip("torch")
dist = torch.distributed
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "dist_worker.py")


def torchrun(args, cwd, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # 127.0.0.1 only
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-process job: every case, the NaN run, and the runs the resume test continues."""
    out = tmp_path_factory.mktemp("dist")
    bn_train_export(out / "bn.onnx")
    res = torchrun([WORKER, str(out), "cases", "nan", "interrupt", "batchnorm"], out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    (out / "stderr.txt").write_text(res.stderr)
    return out


def close(ours: dict, ref: dict, rtol=1e-5):
    for k, r in ref.items():
        np.testing.assert_allclose(ours[k], r, rtol=rtol, atol=rtol * np.max(np.abs(r)),
                                   err_msg=k)


def saved(path):
    with np.load(path) as z:
        return ({k[2:]: z[k] for k in z.files if k.startswith("p:")},
                {k[2:]: z[k] for k in z.files if k.startswith("s:")},
                z["history"], int(z["step"]), json.loads(str(z["memory"])))


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_equal_one(runs, case):
    """20 AdamW steps of the digits MLP and of a CNN (plain, ZeRO-1, buckets + accumulation),
    SGD with clipping under ZeRO, uneven and 1-row last batches, drop_last: the parameters and
    optimizer state of 2 ranks equal one process on the same global batches."""
    params, state, history, steps, _ = saved(runs / f"{case}.npz")
    ref = trainer(case)
    fit(case, ref)
    assert steps == ref.step_count == {"uneven": 6, "short_last": 6, "drop_last": 4,
                                       "resume_ref": 15, "resume_ref_zero": 15}.get(case, 20)
    np.testing.assert_allclose(history, ref.history, rtol=1e-5)
    close(params, ref.parameters())
    close(state, ref.optimizer_state())


@pytest.mark.parametrize("plain, zero", [("mlp", "mlp_zero"), ("cnn", "cnn_zero"),
                                         ("resume_ref", "resume_ref_zero")])
def test_zero_equals_unsharded_and_saves_memory(runs, plain, zero):
    a, b = saved(runs / f"{plain}.npz"), saved(runs / f"{zero}.npz")
    for x, y in [(a[0], b[0]), (a[1], b[1])]:  # the same update of the same sums: bit for bit
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
    mem = b[4]
    param = sum(v.nbytes for v in b[0].values())
    # AdamW: 2 slots, one buffer set (updated in place); each rank keeps the state of half the
    # (padded) elements
    assert mem["optimizer_state"] == 2 * 4 * -(-param // 4 // 2)
    assert mem["total"] < mem["unsharded_total"] == a[4]["total"]


def test_nonfinite_loss_stops_every_rank_at_the_same_step(runs):
    got = [json.loads((runs / f"nan.{r}.json").read_text()) for r in (0, 1)]
    for r, g in enumerate(got):
        assert g["rank"] == r and g["step"] == 3 and g["steps_taken"] == 2, g
        assert g["ranks"] == [1] and "non-finite loss on rank 1" in g["msg"], g
        assert g["unchanged"], g  # no update of step 3 on either rank


def test_resume_reproduces_the_uninterrupted_run(runs):
    res = torchrun([WORKER, str(runs), "resume"], runs)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    for case in ("resume_ref", "resume_ref_zero"):
        full, resumed = saved(runs / f"{case}.npz"), saved(runs / f"resumed_{case}.npz")
        for x, y in zip(full[:4], resumed[:4]):
            if isinstance(x, dict):
                assert all(np.array_equal(x[k], y[k]) for k in x), case
            else:
                assert np.array_equal(x, y), case
    # a ZeRO checkpoint is a plain one: it loads into one process, equal to the unsharded run's
    plain, zero = trainer("resume_ref"), trainer("resume_ref")
    plain.load_checkpoint(runs / "resume_ref.ckpt.npz")
    zero.load_checkpoint(runs / "resume_ref_zero.ckpt.npz")
    assert plain.step_count == zero.step_count == 6
    for a, b in [(plain.parameters(), zero.parameters()),
                 (plain.optimizer_state(), zero.optimizer_state())]:
        assert all(np.array_equal(a[k], b[k]) for k in a)
    # and it continues in one process as the 2-process run went on (positions are global)
    fit("resume_ref_zero", zero)
    params, state, history, steps, _ = saved(runs / "resume_ref_zero.npz")
    assert zero.step_count == steps == 15
    np.testing.assert_allclose(zero.history, history, rtol=1e-5)
    close(zero.parameters(), params)
    close(zero.optimizer_state(), state)


def test_batchnorm_trains_as_torch_ddp_and_says_so(runs):
    """A training-mode BatchNormalization normalizes each rank's rows with their own statistics
    and updates each rank's running statistics, as torch DDP without SyncBatchNorm: the same
    parameters and rank 0's statistics as DDP's, not one process's, and a warning says so."""
    from dist_worker import BN_TRAINER, bn_data
    with np.load(runs / "batchnorm.npz") as z:
        ours = {k[2:]: z[k] for k in z.files if k.startswith("o:")}
        ddp = {k[2:]: z[k] for k in z.files if k.startswith("t:")}
    assert {"0.weight", "1.running_mean", "1.running_var"} <= ours.keys()
    # (running_var: the ONNX op's is the batch's biased variance, torch's the unbiased one)
    close(ours, {k: ddp[k] for k in ours if k != "1.running_var"})
    one = Trainer(str(runs / "bn.onnx"), "mse", **BN_TRAINER)
    one.fit(bn_data(), batch_size=16, shuffle=False)
    single = {**one.parameters(), **one.statistics()}
    assert max(np.abs(ours[k] - v).max() / np.abs(v).max() for k, v in single.items()) > 1e-3
    assert "training-mode BatchNormalization (running statistics 1.running_mean, " \
        "1.running_var)" in (runs / "stderr.txt").read_text()


def test_killed_rank_ends_the_job(tmp_path):
    res = torchrun([WORKER, str(tmp_path), "kill"], tmp_path)
    ended = time.time()
    assert res.returncode != 0
    killed_at = json.loads((tmp_path / "kill.1.json").read_text())["t"]  # just before
    assert ended - killed_at < 60  # the rank's timeout: torchrun ends the job well before
    root = res.stderr[res.stderr.index("Root Cause"):]
    assert "rank      : 1" in root and "SIGKILL" in root, res.stderr[-3000:]


def test_hung_rank_is_named_within_the_timeout(tmp_path):
    res = torchrun([WORKER, str(tmp_path), "hang"], tmp_path)
    assert res.returncode != 0
    hung_at = json.loads((tmp_path / "hang.0.json").read_text())["t"]
    err = json.loads((tmp_path / "hang.error.0.json").read_text())
    assert err["msg"].startswith("rank 1 stopped responding during the gradient exchange of "
                                 "step 4"), err
    assert 4.0 <= err["t"] - hung_at < 4.0 + 2.0 + 15  # the timeout, 2 s to name the rank
    assert "rank 1 stopped responding" in res.stderr


def test_cli_on_two_processes_equals_one(tmp_path):
    args = ["train", MLP, "--loss", "cross_entropy", "--data",
            os.path.join(ROOT, "models", "digits.npz"), "--epochs", "2", "--batch-size", "100",
            "--lr", "1e-2", "--val-split", "0.2", "--no-progress", "--drop-last"]
    res = torchrun(["-m", "onnxgrad", *args, "-o", "dist.onnx", "--distributed", "--zero",
                    "--timeout", "120"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert res.stdout.count("wrote dist.onnx") == 1  # rank 0 reports
    assert "2 processes" in res.stdout and "28 steps" in res.stdout, res.stdout
    from onnxgrad.cli import main
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main([*args, "-o", "one.onnx"]) == 0
    finally:
        os.chdir(cwd)

    def weights(name):
        return {t.name: numpy_helper.to_array(t)
                for t in onnx.load(str(tmp_path / name)).graph.initializer}
    close(weights("dist.onnx"), weights("one.onnx"))


# -- in this process: a 1-rank group ------------------------------------------------------------
@pytest.fixture
def one_rank():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("zero", [False, True])
def test_gradients_are_exchanged_zero_copy(one_rank, zero):
    """The gradient graph writes into the memory the collectives send (DLPack views of the flat
    buffers); the parameters onnxruntime reads are the tensors torch broadcasts."""
    tr = DistributedTrainer(MLP, "cross_entropy", zero=zero, bucket_mb=0.01, device="cpu",
                            progress=False)
    assert tr.fused_reason is None  # the fused optimizer, on the parameters or their segments
    views = tr.exchange_views()
    ptrs = [ov.data_ptr() for _, ov, _ in views]
    assert [p for p, _, _ in views] == tr.params
    assert ptrs == [t.data_ptr() for _, _, t in views]
    assert len({t.untyped_storage().data_ptr() for _, _, t in views}) == (1 if zero else 2)
    data = digits(64)
    before = tr.parameters()
    tr.step(data)
    # what the gradient graph computes on its own, for the parameters before the step
    lm = attach_loss(onnx.load(MLP), "cross_entropy")
    g = build_gradient_model(lm, lm.graph.output[-1].name)
    assert g.params == tr.params
    want = session(g.model).run(g.grads, {**data, **before})
    for (_, ov, t), w in zip(views, want):
        np.testing.assert_allclose(t.numpy(), w, rtol=1e-5, atol=1e-7)
        assert torch.from_dlpack(ov).data_ptr() == ov.data_ptr() == t.data_ptr()
    assert [ov.data_ptr() for _, ov, _ in tr.exchange_views()] == ptrs  # no new buffers


@pytest.mark.parametrize("zero", [False, True])
def test_fused_update_equals_the_optimizer_graph(one_rank, zero):
    """The fused optimizer on the exchanged gradients (on this rank's segments with ZeRO) gives
    the optimizer graph's parameters and state."""
    data = digits(96)
    runs = []
    for fused in (True, False):
        tr = DistributedTrainer(MLP, "cross_entropy", zero=zero, device="cpu", progress=False,
                                optimizer=AdamW(lr=1e-2, amsgrad=True), fused_optimizer=fused)
        assert (tr.fused_reason is None) == fused
        for i in range(3):
            tr.step({k: v[32 * i:32 * (i + 1)] for k, v in data.items()})
        runs.append((tr.parameters(), tr.optimizer_state()))
    for got, want in zip(runs[0], runs[1]):
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6,
                                       atol=1e-7 * np.abs(want[k]).max(), err_msg=k)


def test_argument_errors():
    with pytest.raises(ValueError, match="timeout=0 must be a positive"):
        DistributedTrainer(MLP, "cross_entropy", timeout=0)
    with pytest.raises(ValueError, match="elementwise optimizer"):
        class Lamb(AdamW):
            pass
        DistributedTrainer(MLP, "cross_entropy", zero=True, optimizer=Lamb())


def test_without_torchrun_the_error_says_how(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(DistributedError, match="start the processes with torchrun"):
        DistributedTrainer(MLP, "cross_entropy", device="cpu")


def test_torch_is_optional_and_named():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import onnxgrad.training.distributed as d\n"
            "from onnxgrad.errors import MissingExtraError\n"
            "try:\n"
            "    d.DistributedTrainer('models/digits_mlp.onnx', 'cross_entropy')\n"
            "except MissingExtraError as e:\n"
            "    print(e)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert "pip install 'onnxgrad[distributed]'" in res.stdout, res.stderr[-2000:]
    assert issubclass(MissingExtraError, ImportError)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from(["float32", "float64",
                                                               "float16"])),
                min_size=1, max_size=8),
       st.integers(1, 4), st.booleans(), st.integers(1, 200))
def test_layout_views_never_overlap(tensors, world, zero, bucket_bytes):
    lay = plan_layout([n for n, _ in tensors], [d for _, d in tensors], world, zero,
                      bucket_bytes)
    used = {f: np.zeros(s, int) for f, s in enumerate(lay.sizes)}
    for (n, d), (f, off) in zip(tensors, lay.slots):
        assert lay.dtypes[f] == np.dtype(d)
        used[f][off:off + n] += 1
    if lay.ctrl is not None:
        f, off = lay.ctrl
        assert lay.dtypes[f] in (np.float32, np.float64)
        used[f][off:off + world + 1] += 1
    else:
        assert zero or not {"float32", "float64"} & {d for _, d in tensors}
    assert all(u.max() <= 1 for u in used.values())  # no two views share an element
    assert sum(int(u.sum()) for u in used.values()) == sum(n for n, _ in tensors) + (
        world + 1 if lay.ctrl else 0)
    if zero:  # one buffer per dtype, N equal segments
        assert len(lay.sizes) == len({d for _, d in tensors})
        assert all(s % world == 0 and s - sum(n for n, d in tensors if np.dtype(d) == dt) < world
                   for s, dt in zip(lay.sizes, lay.dtypes))
    else:  # buckets fill up to the limit unless one tensor alone is larger
        for f, s in enumerate(lay.sizes):
            members = [n for n, (g, _) in zip([n for n, _ in tensors], lay.slots) if g == f]
            assert len(members) == 1 or sum(members) * lay.dtypes[f].itemsize <= bucket_bytes
