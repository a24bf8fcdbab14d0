"""Models past protobuf's 2 GB limit (issue 12, item 16): saved with external data, loaded,
differentiated and exported without serialising the weights.

One test writes a real model with a single initializer of 2 GiB + 4 MiB (about 4.3 GB of disk
for its input and output, removed at the end); the others take the same code paths with the
external-data threshold lowered, so they run in milliseconds.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad import errors, storage
from onnxgrad.cli import main
from onnxgrad.runtime import session
from onnxgrad.training import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "models", "mlp.onnx")


def data_files(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".data"))


def same_model(a: onnx.ModelProto, b: onnx.ModelProto):
    assert a.graph.node == b.graph.node
    for s, t in zip(a.graph.initializer, b.graph.initializer):
        assert s.name == t.name
        np.testing.assert_array_equal(numpy_helper.to_array(s), numpy_helper.to_array(t))


@pytest.fixture
def small_limit(monkeypatch):
    """Treat every model as one past 2 GB."""
    monkeypatch.setattr(storage, "EXTERNAL_DATA_ABOVE", 1000)


def test_external_data_round_trip_and_rewrite(tmp_path, small_limit):
    m = onnx.load(MLP)
    before = m.SerializeToString()
    path = tmp_path / "m.onnx"
    storage.save_model(m, path)
    assert m.SerializeToString() == before  # the model given is not changed by saving it
    first = data_files(tmp_path)
    assert len(first) == 1 and first[0].startswith("m.onnx.")
    light = onnx.load(path, load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in light.graph.initializer
               if storage.tensor_nbytes(t) >= storage.EXTERNAL_MIN_BYTES)
    same_model(storage.load_model(path), m)
    onnx.checker.check_model(str(path), full_check=True)
    storage.save_model(m, path)  # a rewrite: a new data file, the old one removed
    second = data_files(tmp_path)
    assert len(second) == 1 and second != first
    same_model(onnx.load(path), m)
    x = np.ones((2, 64), np.float32)
    labels = np.eye(10, dtype=np.float32)[[1, 2]]
    ours = session(str(path)).run(None, {"x": x, "labels": labels})
    ref = session(m).run(None, {"x": x, "labels": labels})
    for a, b in zip(ours, ref):
        np.testing.assert_array_equal(a, b)


def test_unloaded_external_data_is_copied_or_refused(tmp_path, small_limit):
    src = tmp_path / "src"
    storage.save_model(onnx.load(MLP), src / "m.onnx")
    light = onnx.load(src / "m.onnx", load_external_data=False)
    elsewhere = tmp_path / "elsewhere" / "m.onnx"
    with pytest.raises(errors.InvalidArgumentError, match="keeps its data in an external file "
                                                          "that was not loaded: pass base_dir"):
        storage.save_model(light, elsewhere)
    assert not elsewhere.parent.exists() or os.listdir(elsewhere.parent) == []
    storage.save_model(light, elsewhere, base_dir=src)
    same_model(onnx.load(elsewhere), onnx.load(MLP))
    (src / data_files(src)[0]).unlink()  # the copy does not read the source's data any more
    same_model(onnx.load(elsewhere), onnx.load(MLP))
    with pytest.raises(errors.ModelLoadError, match="its external data cannot be read"):
        storage.load_model(src / "m.onnx")


def test_gradients_of_an_unloaded_model_keep_the_references(tmp_path, small_limit):
    src = tmp_path / "m.onnx"
    storage.save_model(onnx.load(MLP), src)
    light = onnx.load(src, load_external_data=False)
    res = onnxgrad.gradients(light, "loss", ["W1", "b2"])
    out = tmp_path / "g" / "grad.onnx"
    storage.save_model(res.model, out, base_dir=tmp_path)
    full = onnxgrad.gradients(MLP, "loss", ["W1", "b2"])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 64)).astype(np.float32),
             "labels": np.eye(10, dtype=np.float32)[[0, 4, 9]]}
    for a, b in zip(session(str(out)).run(res.grads, feeds),
                    session(full.model).run(full.grads, feeds)):
        np.testing.assert_array_equal(a, b)


def test_trainer_export_keeps_the_trained_weights(tmp_path, small_limit):
    data = np.load(os.path.join(ROOT, "models", "digits.npz"))
    tr = Trainer(os.path.join(ROOT, "models", "digits_mlp.onnx"), "cross_entropy",
                 device="cpu", progress=False)
    tr.fit({"x": data["x"][:64], "target": data["y"][:64]}, epochs=1, batch_size=32)
    out, step = tmp_path / "trained.onnx", tmp_path / "step.onnx"
    tr.export(out, train_step=step)
    assert len(data_files(tmp_path)) == 2
    trained = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    for k, v in tr.parameters().items():
        np.testing.assert_array_equal(trained[k], v)
    defaults = {t.name: numpy_helper.to_array(t) for t in onnx.load(step).graph.initializer}
    for k, v in tr.parameters().items():
        np.testing.assert_array_equal(defaults[k], v)


# -- a real model past 2 GB ---------------------------------------------------------------------
N_W = (2**31 + 2**22) // 4  # float32 elements: one initializer of 2 GiB + 4 MiB
CHUNK = 251 << 16  # a whole number of periods: every chunk of W is the same


def pattern(start: int, stop: int) -> np.ndarray:
    """The values of W[start:stop] (start a multiple of CHUNK): W[i] = (i mod 251 - 125) / 8,
    different per offset, and every partial sum exact in float32 (multiples of 1/8 that stay
    small), so onnxruntime's float32 sum of all of W is exact too."""
    assert start % CHUNK == 0 and stop - start <= CHUNK
    return _chunk()[:stop - start]


@functools.cache
def _chunk() -> np.ndarray:
    return ((np.arange(CHUNK) % 251 - 125) / 8).astype(np.float32)


def test_gradients_of_a_model_past_2gb(tmp_path, capsys):
    """`onnxgrad grad` on a model whose single initializer is 2 GiB + 4 MiB: the gradient model
    is written (external data), passes the checker, holds W's bytes unchanged and runs."""
    src = tmp_path / "big.onnx"
    with open(tmp_path / "big.onnx.w.data", "wb") as f:  # W written in chunks, never whole
        for i in range(0, N_W, CHUNK):
            f.write(pattern(i, min(i + CHUNK, N_W)).tobytes())
    init = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[N_W])
    for k, v in (("location", "big.onnx.w.data"), ("offset", "0"), ("length", str(N_W * 4))):
        init.external_data.add(key=k, value=v)
    init.data_location = TensorProto.EXTERNAL
    g = helper.make_graph(
        [helper.make_node("ReduceSum", ["W"], ["s"], keepdims=0),
         helper.make_node("Mul", ["x", "s"], ["y"]),
         helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [init])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    with open(src, "wb") as f:
        f.write(m.SerializeToString())
    out = tmp_path / "out" / "grad.onnx"
    try:
        rc = main(["grad", str(src), "-o", str(out), "--ys", "loss", "--xs", "x", "W"])
        assert rc == 0, capsys.readouterr().err
        assert capsys.readouterr().out.splitlines() == ["x -> gradients/x_grad",
                                                        "W -> gradients/W_grad"]
        light = onnx.load(out, load_external_data=False)
        assert light.ir_version <= storage.MAX_IR_VERSION
        (t,) = [t for t in light.graph.initializer if t.name == "W"]
        info = {e.key: e.value for e in t.external_data}
        assert int(info["length"]) == N_W * 4
        with open(out.parent / info["location"], "rb") as f:  # W's bytes, chunk by chunk
            f.seek(int(info.get("offset", 0)))
            for i in range(0, N_W, CHUNK):
                n = min(i + CHUNK, N_W)
                assert f.read((n - i) * 4) == pattern(i, n).tobytes(), f"W differs at {i}"
        onnx.checker.check_model(str(out), full_check=True)
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        (gx,) = session(str(out)).run(["gradients/x_grad"], {"x": x})
        r = N_W % 251  # whole periods sum to 0
        want = (r * (r - 1) // 2 - 125 * r) / 8
        np.testing.assert_array_equal(gx, np.full((2, 4), want, np.float32))
    finally:
        for folder in (tmp_path, out.parent):
            for n in os.listdir(folder) if folder.exists() else []:
                if os.path.isfile(folder / n):
                    os.unlink(folder / n)


@pytest.mark.parametrize("other", ["moved", "copied", "backup", "killed write"])
def test_a_rewrite_removes_only_the_data_its_old_model_read(tmp_path, small_limit, other):
    """A write past 2 GB removed every `<OUT>.<pid>-<hex>.data` of a process no longer running:
    a model written to OUT earlier and then moved (or copied) lost its weights, exit 0. Now the
    data file of the model replaced goes, unless a copy of that model reads it; one no model
    names (a killed write's) stays."""
    m = onnx.load(MLP)
    out = tmp_path / "out.onnx"
    storage.save_model(m, out)
    (first,) = data_files(tmp_path)
    if other == "moved":
        os.replace(out, tmp_path / "earlier.onnx")
    elif other == "copied":
        (tmp_path / "earlier.onnx").write_bytes(out.read_bytes())
    elif other == "backup":  # (a copy by any name: model.onnx.bak)
        (tmp_path / "out.onnx.bak").write_bytes(out.read_bytes())
    else:  # a data file by an earlier writer's name, its pid long gone, read by no model
        (tmp_path / "out.onnx.4000001-deadbeef.data").write_bytes(b"\0" * 64)
    storage.save_model(m, out)
    same_model(onnx.load(out), m)
    if other == "killed write":
        assert "out.onnx.4000001-deadbeef.data" in data_files(tmp_path)
        assert first not in data_files(tmp_path)  # (the replaced model's own: gone)
    else:
        same_model(onnx.load(tmp_path / ("out.onnx.bak" if other == "backup" else
                                         "earlier.onnx")), m)
