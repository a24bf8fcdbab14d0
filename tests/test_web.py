"""The browser trainer: the web export, the server, and the page itself in headless Chromium.

The browser test needs Debian's chromium (/usr/bin/chromium, or $CHROMIUM) and `npm ci` in web/;
.ci/run installs both. Without them it fails and says so: it is not skipped.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request

import numpy as np
import onnx
import pytest
from hypothesis import given, settings, strategies as st
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import web
from onnxgrad.runtime import save_model
from onnxgrad.training import AdamW, SGD, Trainer, attach_loss, build_train_step
from onnxgrad.training.trainer import make_session
from onnxgrad.training.webstep import export_web_step, paths, raw_data_ranges

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEB = os.path.join(ROOT, "web")
DIGITS = os.path.join(ROOT, "models", "digits_mlp.onnx")
sys.path.insert(0, WEB)
import make_assets  # noqa: E402  (web/make_assets.py)
from util import bn_train_export  # noqa: E402


def digits_split():
    """(x_train, y_train, x_val, y_val) in the order the page holds them (web/make_assets.py)."""
    with np.load(os.path.join(ROOT, "models", "digits.npz")) as z:
        x, y = z["x"], z["y"]
    tr, va = make_assets.split(len(x))
    return x[tr], y[tr], x[va], y[va]


def run_steps(step_path, manifest, model_path, batches, lr):
    """The web step on onnxruntime Python (ORT_ENABLE_ALL), the page's way: params from the model
    file, zero state, outputs fed back as inputs. Returns (losses, params)."""
    sess = make_session(onnx.load(step_path), threads=1)
    init = {t.name: numpy_helper.to_array(t) for t in onnx.load(model_path).graph.initializer}
    values = {p["name"]: init[p["name"]] for p in manifest["params"]}
    values.update({s["name"]: np.zeros(s["shape"], np.float32) for s in manifest["state"]})
    roles = manifest["params"] + manifest["state"]
    outs = [manifest["loss"]["name"]] + [t["output"] for t in roles]
    losses = []
    for k, (x, y) in enumerate(batches):
        feeds = {"x": x, "target": y, **values, manifest["lr"]["name"]: np.array(lr, np.float32),
                 manifest["step"]["name"]: np.array(k + 1, np.int64)}
        res = sess.run(outs, feeds)
        losses.append(float(res[0]))
        values = {t["name"]: v for t, v in zip(roles, res[1:])}
    return losses, {p["name"]: values[p["name"]] for p in manifest["params"]}


def rel_diff(a, b) -> float:
    """max |a - b| / max |b| over one tensor."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


# -- the export --------------------------------------------------------------------------------
def _double_tensors(model: onnx.ModelProto) -> list[str]:
    m = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = m.graph
    typed = [*g.input, *g.output, *g.value_info]
    bad = [v.name for v in typed if v.type.tensor_type.elem_type == TensorProto.DOUBLE]
    for n in g.node:
        for a in n.attribute:
            if a.name == "to" and a.i == TensorProto.DOUBLE or a.t.data_type == TensorProto.DOUBLE:
                bad.append(n.name)
    return bad


@pytest.mark.parametrize("optimizer", [AdamW(lr=1e-2), SGD(lr=0.05, momentum=0.9, nesterov=True)],
                         ids=["adamw", "sgd"])
def test_web_export_files_and_float32_scalars(tmp_path, optimizer):
    m = export_web_step(DIGITS, "cross_entropy", tmp_path / "s.onnx", optimizer=optimizer)
    files = paths(tmp_path / "s.onnx")
    assert json.loads(open(files["manifest"]).read()) == json.loads(json.dumps(m))
    step, model = onnx.load(files["step"]), onnx.load(files["model"])
    onnx.checker.check_model(step, full_check=True)
    onnx.checker.check_model(model, full_check=True)
    assert step.ir_version <= 13 and model.ir_version <= 13
    for role in ("step", "model"):
        data = open(files[role], "rb").read()
        assert m["files"][role] == {"name": os.path.basename(files[role]), "bytes": len(data),
                                    "sha256": hashlib.sha256(data).hexdigest()}
    # no float64 anywhere (onnxruntime-web's WebGPU builds have no float64 kernels), no defaults
    assert _double_tensors(step) == []
    assert not {t.name for t in step.graph.initializer} & {v.name for v in step.graph.input}
    # the model file is the original graph; each parameter's bytes lie where the manifest says
    original = onnx.load(DIGITS)
    assert [n.SerializeToString() for n in model.graph.node] == \
        [n.SerializeToString() for n in original.graph.node]
    data = open(files["model"], "rb").read()
    init = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}
    for p in m["params"]:
        got = np.frombuffer(data[p["offset"]:p["offset"] + p["length"]], "<f4").reshape(p["shape"])
        np.testing.assert_array_equal(got, init[p["name"]])
    assert m["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["N", 64]}]
    assert m["targets"] == [{"name": "target", "dtype": "int64", "shape": ["N"]}]
    assert m["lr"] == {"name": "lr", "dtype": "float32", "default": optimizer.lr}
    assert m["optimizer"]["type"] == type(optimizer).__name__


def test_web_step_trains_as_the_float64_step():
    """float32 scalars change the step by rounding only: 20 steps of the web step and of the default
    (float64 scalars) step from the same start agree to 3e-6 (symbolic batch: sizes 32 and 7)."""
    x, y, _, _ = digits_split()
    lm = attach_loss(onnx.load(DIGITS), "cross_entropy")
    sizes = [32] * 10 + [7] * 10
    batches, start = [], 0
    for b in sizes:
        batches.append((x[start:start + b], y[start:start + b]))
        start += b
    params = {}
    for scalars in ("float64", "float32"):
        st_ = build_train_step(lm, "loss", optimizer=AdamW(lr=1e-2), scalars=scalars)
        sess = make_session(st_.model, threads=1)
        vals = {**st_.initial_params, **st_.initial_state()}
        outs = [st_.loss, *st_.param_outputs, *st_.state_outputs]
        for k, (bx, by) in enumerate(batches):
            res = sess.run(outs, {"x": bx, "target": by, **vals, st_.lr: np.array(1e-2, scalars),
                                  st_.step: np.array(k + 1, np.int64)})
            vals = dict(zip(st_.params + st_.state, res[1:]))
        params[scalars] = {p: vals[p] for p in st_.params}
    for p, v in params["float64"].items():
        assert rel_diff(params["float32"][p], v) < 3e-6, p  # 3e-7 seen; 3e-5 with 1 - beta^t


def test_web_export_errors(tmp_path):
    w = helper.make_tensor("W", TensorProto.BFLOAT16, [2, 2], np.zeros(4, np.uint16).tobytes(),
                           raw=True)
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Cast", ["W"], ["Wf"], to=TensorProto.FLOAT),
         helper.make_node("MatMul", ["x", "Wf"], ["y"])], "bf16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], [w]),
        opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    with pytest.raises(ValueError, match="'W' is BFLOAT16: onnxruntime-web has no tensors"):
        export_web_step(m, "mse", tmp_path / "s.onnx")
    assert not os.listdir(tmp_path)  # nothing written
    with pytest.raises(ValueError, match="output_name applies to loss kinds only"):
        export_web_step(DIGITS, "logits", tmp_path / "s.onnx", output_name="logits")


def test_cli_export_train_step_target_web(tmp_path, capsys):
    from onnxgrad.cli import main
    out = tmp_path / "d.onnx"
    assert main(["export-train-step", DIGITS, "--loss", "cross_entropy", "--target", "web",
                 "--optimizer", "sgd", "--momentum", "0.9", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "d.model.onnx (the model)" in text and "lr (float32)" in text
    assert sorted(os.listdir(tmp_path)) == ["d.json", "d.model.onnx", "d.onnx"]
    man = json.load(open(tmp_path / "d.json"))
    assert [s["slot"] for s in man["state"]] == ["momentum_buffer"] * 4
    assert main(["export-train-step", DIGITS, "--loss", "cross_entropy", "--target", "web",
                 "--gradient", str(tmp_path / "g.onnx"), "-o", str(out)]) == 2
    assert "--gradient applies to --target python only" in capsys.readouterr().err


_names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1,
                 max_size=12)
_dtypes = st.sampled_from([np.float32, np.float64, np.float16, np.int64, np.uint8])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(_names, _dtypes, st.lists(st.integers(0, 40), max_size=3)),
                min_size=1, max_size=6, unique_by=lambda t: t[0]),
       st.text(max_size=300), st.booleans())
def test_raw_data_ranges_finds_every_initializer(specs, doc, as_float_data):
    """The wire-format reader finds each initializer's raw bytes, whatever its name, size,
    position or neighbours (doc strings, metadata, tensors stored as float_data)."""
    rng = np.random.default_rng(0)
    inits, expect = [], {}
    for name, dt, shape in specs:
        a = (rng.standard_normal(shape) * 100).astype(dt)
        t = numpy_helper.from_array(a, name)
        if as_float_data and dt == np.float32:  # not raw: must not be reported
            t = helper.make_tensor(name, TensorProto.FLOAT, a.shape, a.ravel().tolist())
        else:
            expect[name] = a.tobytes()
        inits.append(t)
    g = helper.make_graph([], "g", [], [], inits, doc_string=doc)
    m = helper.make_model(g, doc_string=doc)
    helper.set_model_props(m, {"k": doc})
    data = m.SerializeToString()
    ranges = raw_data_ranges(data)
    assert {k: data[o:o + n] for k, (o, n) in ranges.items()} == expect


def test_assets_are_current(tmp_path):
    """web/assets/ is what web/make_assets.py writes now (same bytes)."""
    make_assets.main(str(tmp_path))
    for name in sorted(os.listdir(tmp_path)):
        with open(tmp_path / name, "rb") as f, open(os.path.join(WEB, "assets", name), "rb") as g:
            assert f.read() == g.read(), f"web/assets/{name} is stale: python web/make_assets.py"


# -- the server --------------------------------------------------------------------------------
def test_server_headers_and_types():
    srv = web.start(WEB, port=0)
    try:
        with urllib.request.urlopen(srv.url) as r:
            assert r.headers["Cross-Origin-Opener-Policy"] == "same-origin"
            assert r.headers["Cross-Origin-Embedder-Policy"] == "require-corp"
            assert b"onnxgrad" in r.read()
        for path, mime in [("worker.js", "text/javascript"),
                           ("node_modules/onnxruntime-web/dist/ort-wasm-simd-threaded.wasm",
                            "application/wasm"),
                           ("node_modules/onnxruntime-web/dist/ort.wasm.min.mjs",
                            "text/javascript")]:
            with urllib.request.urlopen(srv.url + path) as r:
                assert r.headers["Content-Type"] == mime, path
    finally:
        srv.shutdown()
        srv.server_close()


def test_python_m_onnxgrad_web_prints_its_url():
    proc = subprocess.Popen([sys.executable, "-m", "onnxgrad.web", "--port", "0"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving the onnxgrad browser trainer at http://localhost:"), line
        url = line.split(" at ")[1].split()[0]
        with urllib.request.urlopen(url + "assets/digits_step.json") as r:
            assert json.load(r)["format"] == "onnxgrad-web-step"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_server_refuses_a_folder_without_the_page(tmp_path, capsys):
    from onnxgrad.cli import main
    assert main(["web", "--root", str(tmp_path)]) == 2
    assert "no index.html" in capsys.readouterr().err
    (tmp_path / "index.html").write_text("<p>")
    assert main(["web", "--root", str(tmp_path)]) == 2
    assert "run `npm ci` in" in capsys.readouterr().err


# -- the page in Chromium ----------------------------------------------------------------------
def _browser_ready() -> str | None:
    chromium = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    if not os.path.exists(chromium):
        return f"no Chromium at {chromium} (apt-get install chromium)"
    if shutil.which("node") is None:
        return "no node (apt-get install nodejs npm)"
    if not os.path.isdir(os.path.join(WEB, "node_modules", "playwright-core")):
        return "web/node_modules is missing (npm ci in web/)"
    return None


@pytest.mark.parametrize("n", [1, 2, 5])
def test_page_sessions_keep_a_range_gather_reversal(tmp_path, n):
    """Gather(x, Range(len - 1, -1, -1)) on onnxruntime-web with the page's session options
    (trainer.js sessionOptions, through web/tools/run_model.mjs in Node): x reversed. With
    onnxruntime's GatherToSliceFusion on (onnxruntime-web's default) it came out empty."""
    missing = _browser_ready()
    if missing:
        pytest.fail(f"this test needs {missing}; .ci/run installs it")
    one = lambda name, v: helper.make_tensor(name, TensorProto.INT64, [], [v])  # noqa: E731
    g = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Gather", ["s", "zero"], ["len"], axis=0),
         helper.make_node("Sub", ["len", "one"], ["start"]),
         helper.make_node("Range", ["start", "minus1", "minus1"], ["idx"]),
         helper.make_node("Gather", ["x", "idx"], ["y"], axis=0)], "reverse",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
        [one("zero", 0), one("one", 1), one("minus1", -1)])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              tmp_path / "reverse.onnx")
    x = np.arange(n, dtype=np.float32) + 1
    (tmp_path / "feeds.json").write_text(json.dumps(
        {"x": {"dtype": "float32", "dims": [n], "data": x.tolist()}}))
    proc = subprocess.run(["node", os.path.join(WEB, "tools", "run_model.mjs"),
                           str(tmp_path / "reverse.onnx"), str(tmp_path / "feeds.json")],
                          capture_output=True, text=True, timeout=120, cwd=WEB)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["y"] == x[::-1].tolist()


def test_page_sessions_keep_a_zero_pad_before_a_max_pool(tmp_path):
    """Pad (zeros) then MaxPool on onnxruntime-web with the page's session options: windows
    over the zeros and negative values give 0. With onnxruntime's Pad_Fusion on (its default)
    the zeros were folded into the pool's -inf pads (ort_fusions.py; models onnxgrad writes
    are guarded too, this model is not)."""
    missing = _browser_ready()
    if missing:
        pytest.fail(f"this test needs {missing}; .ci/run installs it")
    g = helper.make_graph(
        [helper.make_node("Pad", ["x", "pads"], ["p"], mode="constant"),
         helper.make_node("MaxPool", ["p"], ["y"], kernel_shape=[3, 3])], "pad_pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 3, 3])],
        [helper.make_tensor("pads", TensorProto.INT64, [8], [0, 0, 1, 1, 0, 0, 1, 1])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              tmp_path / "pad_pool.onnx")
    x = -np.arange(1, 10, dtype=np.float32)
    (tmp_path / "feeds.json").write_text(json.dumps(
        {"x": {"dtype": "float32", "dims": [1, 1, 3, 3], "data": x.tolist()}}))
    proc = subprocess.run(["node", os.path.join(WEB, "tools", "run_model.mjs"),
                           str(tmp_path / "pad_pool.onnx"), str(tmp_path / "feeds.json")],
                          capture_output=True, text=True, timeout=120, cwd=WEB)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want = [0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0]  # only the centre window misses the pads
    assert json.loads(proc.stdout.strip().splitlines()[-1])["y"] == want


def test_web_step_carries_batchnorm_statistics(tmp_path):
    """A training-mode BatchNormalization's running statistics are part of the web export: its
    manifest lists them with their bytes in the model file, and the page's Trainer (trainer.js on
    onnxruntime-web in Node) carries them from step to step and writes them into the download, as
    the Python Trainer does (the download then predicts in eval mode with the trained
    statistics, not the initial ones). Before, the download kept the initial statistics."""
    missing = _browser_ready()
    if missing:
        pytest.fail(f"this test needs {missing}; .ci/run installs it")
    src = str(tmp_path / "bn.onnx")
    bn_train_export(src, running=(0.3, 2.0))
    original = onnx.load(src)
    man = export_web_step(src, "mse", tmp_path / "s.onnx", optimizer=SGD(lr=0.1))
    assert [t["name"] for t in man["stats"]] == ["1.running_mean", "1.running_var"]
    assert "1.running_mean" not in [p["name"] for p in man["params"]]
    data = (tmp_path / "s.model.onnx").read_bytes()
    init = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}
    for t in man["stats"]:
        got = np.frombuffer(data[t["offset"]:t["offset"] + t["length"]], "<f4")
        np.testing.assert_array_equal(got, init[t["name"]])
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((8, 3, 8, 8)).astype(np.float32),
                rng.standard_normal((8, 2)).astype(np.float32)) for _ in range(4)]
    (tmp_path / "batches.json").write_text(json.dumps(
        [{"x": {"dtype": "float32", "dims": list(x.shape), "data": x.ravel().tolist()},
          "target": {"dtype": "float32", "dims": list(y.shape), "data": y.ravel().tolist()}}
         for x, y in batches]))
    proc = subprocess.run(["node", os.path.join(WEB, "tools", "train_steps.mjs"),
                           str(tmp_path / "s.json"), str(tmp_path / "batches.json"), "0.1",
                           str(tmp_path / "trained.onnx")],
                          capture_output=True, text=True, timeout=120, cwd=WEB)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = json.loads(proc.stdout.strip().splitlines()[-1])["losses"]
    tr = Trainer(src, "mse", optimizer=SGD(lr=0.1), device="cpu", progress=False, threads=1)
    want = [tr.step({"x": x, "target": y}) for x, y in batches]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    got = {t.name: numpy_helper.to_array(t)
           for t in onnx.load(tmp_path / "trained.onnx").graph.initializer}
    for name, v in {**tr.parameters(), **tr.statistics()}.items():
        assert rel_diff(got[name], v) <= 1e-5, name
    for name in ("1.running_mean", "1.running_var"):
        assert rel_diff(init[name], got[name]) > 1e-2, name  # the steps moved them
    # the download is what Trainer.export writes for these values
    expected = tr.trained_model()
    for t in expected.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(got[t.name], t.name))
    save_model(expected, tmp_path / "expected.onnx")
    assert (tmp_path / "expected.onnx").read_bytes() == (tmp_path / "trained.onnx").read_bytes()


def test_a_float16_loss_is_read_as_its_value(tmp_path):
    """Where the JS engine has no Float16Array (Node 20, Firefox before 129), onnxruntime-web
    gives float16 data as its bits: the page's Trainer read a loss of 4988 as 27871 and an
    infinite one as 31744, and took that step. Now the losses are the Python Trainer's, and an
    infinite loss stops the run before its updates, as in Python."""
    missing = _browser_ready()
    if missing:
        pytest.fail(f"this test needs {missing}; .ci/run installs it")
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"], transB=1)], "lin16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 3])],
        [numpy_helper.from_array((rng.standard_normal((3, 5)) * 0.3).astype(np.float16), "W"),
         numpy_helper.from_array(np.zeros(3, np.float16), "b")])
    src = tmp_path / "lin16.onnx"
    save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), src)
    export_web_step(str(src), "mse", tmp_path / "s.onnx", optimizer=SGD(lr=1e-4))

    def run(scales):
        batches = [(rng.standard_normal((4, 5)).astype(np.float16),
                    (rng.standard_normal((4, 3)) * s).astype(np.float16)) for s in scales]
        (tmp_path / "b.json").write_text(json.dumps(
            [{"x": {"dtype": "float16", "dims": [4, 5], "data": x.view(np.uint16).ravel().tolist()},
              "target": {"dtype": "float16", "dims": [4, 3],
                         "data": y.view(np.uint16).ravel().tolist()}} for x, y in batches]))
        proc = subprocess.run(["node", os.path.join(WEB, "tools", "train_steps.mjs"),
                               str(tmp_path / "s.json"), str(tmp_path / "b.json"), "1e-4",
                               str(tmp_path / "out.onnx")],
                              capture_output=True, text=True, timeout=120, cwd=WEB)
        return batches, proc

    batches, proc = run([1.0, 70.0, 3.0])  # losses near 1, near 5000, near 9
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = json.loads(proc.stdout.strip().splitlines()[-1])["losses"]
    tr = Trainer(str(src), "mse", optimizer=SGD(lr=1e-4), device="cpu", progress=False,
                 threads=1)
    want = [tr.step({"x": x, "target": y}) for x, y in batches]
    assert want[1] > 1000
    np.testing.assert_allclose(losses, want, rtol=2e-3)
    _, proc = run([1.0, 1000.0])  # squares past float16's 65504: an infinite loss
    assert proc.returncode != 0
    assert "the loss is Infinity at step 2" in proc.stderr, proc.stderr


def test_manifest_without_stats_still_trains(tmp_path):
    """A web export written before manifests had "stats" (a step without statistics) trains on
    the page's Trainer as before, to the same losses as its current export."""
    missing = _browser_ready()
    if missing:
        pytest.fail(f"this test needs {missing}; .ci/run installs it")
    man = export_web_step(DIGITS, "cross_entropy", tmp_path / "s.onnx", optimizer=SGD(lr=0.05))
    assert man["stats"] == []
    del man["stats"]
    (tmp_path / "old.json").write_text(json.dumps(man))
    x, y, _, _ = digits_split()
    (tmp_path / "batches.json").write_text(json.dumps(
        [{"x": {"dtype": "float32", "dims": [16, 64], "data": x[k:k + 16].ravel().tolist()},
          "target": {"dtype": "int64", "dims": [16], "data": y[k:k + 16].tolist()}}
         for k in (0, 16)]))
    losses = []
    for manifest in ("s.json", "old.json"):
        proc = subprocess.run(["node", os.path.join(WEB, "tools", "train_steps.mjs"),
                               str(tmp_path / manifest), str(tmp_path / "batches.json"), "0.05",
                               str(tmp_path / f"{manifest}.onnx")],
                              capture_output=True, text=True, timeout=120, cwd=WEB)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        losses.append(json.loads(proc.stdout.strip().splitlines()[-1])["losses"])
    assert losses[0] == losses[1] and len(losses[0]) == 2
    assert (tmp_path / "s.json.onnx").read_bytes() == (tmp_path / "old.json.onnx").read_bytes()


def test_page_in_chromium(tmp_path):
    """One browser session (web/tools/e2e.mjs; one test, so that pytest-xdist runs it once),
    then the checks below on what it saw."""
    res, out = _run_page(tmp_path)
    for check in (_trains_the_digits, _matches_onnxruntime_python,
                  _download_is_the_trained_original, _predicts_the_drawing,
                  _bad_input_messages_custom_export_and_stop,
                  _webgpu):
        check(res, out)


def _run_page(out):
    missing = _browser_ready()
    if missing:
        pytest.fail(f"the browser test needs {missing}; .ci/run installs it")
    custom = out / "custom"
    os.makedirs(custom)
    export_web_step(DIGITS, "cross_entropy", custom / "sgd_step.onnx",
                    optimizer=SGD(lr=0.05, momentum=0.9))
    notonnx = out / "notonnx" / "sgd_step.onnx"
    os.makedirs(notonnx.parent)
    notonnx.write_bytes(b"this is not an ONNX model\n" * 40)
    shutil.copy(custom / "sgd_step.json", notonnx.parent)
    shutil.copy(custom / "sgd_step.model.onnx", notonnx.parent)
    cases = {
        "epochs": 10,
        "fixed": {"steps": 10, "batchSize": 32, "lr": 0.01},
        "bad": {"no_manifest": [DIGITS],
                "not_onnx_alone": [str(out / "notonnx" / "sgd_step.onnx")],
                "not_onnx_with_manifest": [str(p) for p in sorted(notonnx.parent.iterdir())]},
        "custom": [str(p) for p in sorted(custom.iterdir())],
        "webgpu": True,
    }
    (out / "cases.json").write_text(json.dumps(cases))
    srv = web.start(WEB, port=0)
    try:
        proc = subprocess.run(["node", os.path.join(WEB, "tools", "e2e.mjs"), srv.url, str(out),
                               str(out / "cases.json")], capture_output=True, text=True,
                              timeout=240)
    finally:
        srv.shutdown()
        srv.server_close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((out / "result.json").read_text())
    assert "error" not in res, res["error"] + "\n" + "\n".join(res["log"][-20:])
    shot = os.path.join(ROOT, "out", "web")
    os.makedirs(shot, exist_ok=True)
    shutil.copy(out / "trainer.png", os.path.join(shot, "trainer.png"))  # out/ is git-ignored
    return res, out


def _trains_the_digits(res, out):
    assert res["loaded"]["state"] == "ready", res["loaded"]
    assert res["loaded"]["info"]["backend"] == "wasm"
    assert res["trained"]["state"] == "done", res["trained"]["text"]
    epochs = res["trained"]["epochs"]
    assert len(epochs) == 10
    losses = [v for _, v in res["trained"]["history"]]
    per = len(losses) // 10
    assert np.mean(losses[-per:]) < 0.3 * np.mean(losses[:10])  # the training loss falls
    assert epochs[-1]["valLoss"] < 0.5 * epochs[0]["valLoss"]    # and the validation loss
    assert epochs[-1]["valAccuracy"] >= 0.90
    with open(out / "trainer.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _matches_onnxruntime_python(res, out):
    """10 steps on fixed batches in the browser (onnxruntime-web WASM) and in onnxruntime Python,
    on the same step graph from the same start, land on the same parameters."""
    man = json.load(open(os.path.join(WEB, "assets", "digits_step.json")))
    x, y, _, _ = digits_split()
    f = res["fixed"]
    assert f["type"] == "fixed-steps"
    b = 32
    batches = [(x[k * b:(k + 1) * b], y[k * b:(k + 1) * b]) for k in range(10)]
    losses, params = run_steps(os.path.join(WEB, "assets", "digits_step.onnx"), man,
                               os.path.join(WEB, "assets", "digits_step.model.onnx"), batches,
                               0.01)
    np.testing.assert_allclose(f["losses"], losses, rtol=1e-5)
    init = {t.name: numpy_helper.to_array(t) for t in onnx.load(DIGITS).graph.initializer}
    for p in man["params"]:
        got = np.asarray(f["params"][p["name"]], np.float32).reshape(p["shape"])
        assert rel_diff(got, params[p["name"]]) <= 1e-5, p["name"]
        assert rel_diff(init[p["name"]], params[p["name"]]) > 1e-2  # the steps moved it


def _download_is_the_trained_original(res, out):
    """The download is the original graph with the trained weights: the bytes Trainer.export
    writes for those weights; its validation accuracy is what the page showed."""
    assert res["downloadName"] == "digits_step_trained.onnx"
    data = (out / "trained.onnx").read_bytes()
    got = onnx.load_from_string(data)
    onnx.checker.check_model(got, full_check=True)
    weights = {t.name: numpy_helper.to_array(t) for t in got.graph.initializer}
    original = onnx.load(DIGITS)
    for t in original.graph.initializer:  # Trainer.trained_model's form, written by save_model
        t.CopyFrom(numpy_helper.from_array(weights[t.name], t.name))
    save_model(original, out / "expected.onnx")
    assert (out / "expected.onnx").read_bytes() == data
    _, _, xv, yv = digits_split()
    logits = make_session(got, threads=1).run(["logits"], {"x": xv})[0]
    acc = float(np.mean(logits.argmax(1) == yv))
    assert abs(acc - res["trained"]["epochs"][-1]["valAccuracy"]) <= 1.5 / len(yv)


def _predicts_the_drawing(res, out):
    d = res["drawn"]
    feats = np.asarray(d["features"], np.float32).reshape(1, 64)
    assert 0.1 < feats.mean() < 0.6 and feats.min() >= 0 and feats.max() <= 1
    model = onnx.load_from_string((out / "trained.onnx").read_bytes())
    z = make_session(model, threads=1).run(["logits"], {"x": feats})[0][0]
    p = np.exp(z - z.max())
    np.testing.assert_allclose(d["probs"], p / p.sum(), atol=1e-5)
    assert d["shown"] == str(d["digit"]) == "0"  # a drawn ring reads as a zero


def _bad_input_messages_custom_export_and_stop(res, out):
    bad = res["bad"]
    assert bad["no_manifest"]["state"] == "error"
    assert "digits_mlp.onnx: no manifest" in bad["no_manifest"]["text"]
    assert "--target web" in bad["no_manifest"]["text"]
    for k in ("not_onnx_alone", "not_onnx_with_manifest"):
        assert bad[k]["state"] == "error"
        assert "sgd_step.onnx is not an ONNX model" in bad[k]["text"], bad[k]["text"]
    assert res["custom"]["state"] == "ready", res["custom"]["text"]
    assert res["custom"]["info"]["optimizer"]["type"] == "SGD"
    # while the worker trained, the page drew a frame; Stop ended 1000 epochs early
    stopped = res["stopped"]
    assert stopped["state"] == "done", stopped
    assert stopped["text"].startswith(f"Stopped after {stopped['steps']} steps"), stopped
    assert 100 <= stopped["steps"] < 1000 * 45 and stopped["frameMs"] < 5000


def _webgpu(res, out):
    """With WebGPU offered (SwiftShader here), the page trains there only after a first step that
    agrees with WASM; either way it says which it uses."""
    gpu = res["webgpu"]
    assert gpu["state"] in ("ready", "warn"), gpu["text"]
    if gpu["info"]["backend"] == "webgpu":  # parameters swapped as GPU buffers: the same losses
        assert "WebGPU agrees with WASM" in gpu["text"]
        np.testing.assert_allclose(gpu["fixed"]["losses"], res["fixed"]["losses"], rtol=1e-3)
    else:
        assert "WebGPU was not used" in gpu["text"]
