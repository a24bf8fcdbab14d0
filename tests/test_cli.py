"""The ``onnxgrad`` command: grad, check, ops, --version and its error handling."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper
from util import make_model

from onnxgrad import registry
from onnxgrad.cli import main
from onnxgrad.runtime import MAX_IR_VERSION, session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "models", "mlp.onnx")
ATTENTION = os.path.join(ROOT, "models", "attention.onnx")
PARAMS = ["W1", "b1", "W2", "b2"]
TEST_DOMAIN = "onnxgrad.test"


def cli(capsys, *argv):
    """Run ``onnxgrad argv`` in-process: (exit status, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_module(*argv, cwd=ROOT):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ONNXGRAD_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "onnxgrad", *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(rc, err, *needles):
    assert rc == 2
    assert err.startswith("onnxgrad: error: "), err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


def small_model():
    """y = Tanh(x * w) + x, z = Sigmoid(u): elementwise only, so it needs no other rule family."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]),
             helper.make_node("Tanh", ["xw"], ["t"]),
             helper.make_node("Add", ["t", "x"], ["y"]),
             helper.make_node("Sigmoid", ["u"], ["z"])]
    return make_model(nodes, {"x": (np.float32, ["N", 3]), "u": (np.float32, [3])}, ["y", "z"],
                      inits={"w": np.array([0.5, -1.0, 2.0], np.float32)})


def twice_model():
    """y = Twice(x) with Twice(X) = X + X, an op of a test domain with a function body."""
    fn = helper.make_function(TEST_DOMAIN, "Twice", ["X"], ["Y"],
                              [helper.make_node("Add", ["X", "X"], ["Y"])],
                              opset_imports=[helper.make_opsetid("", 18)])
    g = helper.make_graph([helper.make_node("Twice", ["x"], ["y"], domain=TEST_DOMAIN)], "twice",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                            helper.make_opsetid(TEST_DOMAIN, 1)],
                          functions=[fn], ir_version=10)
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.fixture
def saved(tmp_path):
    def save(model, name="model.onnx"):
        path = tmp_path / name
        onnx.save_model(model, path)
        return path
    return save


# -- grad --------------------------------------------------------------------------------------
def test_grad_bundled_mlp(capsys, tmp_path):
    out = tmp_path / "mlp_grad.onnx"
    rc, stdout, err = cli(capsys, "grad", MLP, "-o", out, "--ys", "loss", "--xs", *PARAMS)
    assert rc == 0, err
    assert stdout.splitlines() == [f"{p} -> gradients/{p}_grad" for p in PARAMS]
    m = onnx.load(out)
    onnx.checker.check_model(m, full_check=True)
    assert m.ir_version <= MAX_IR_VERSION
    names = [o.name for o in m.graph.output]
    assert names[:2] == ["logits", "loss"]
    assert names[2:] == [f"gradients/{p}_grad" for p in PARAMS]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((5, 64)).astype(np.float32),
             "labels": np.eye(10, dtype=np.float32)[rng.integers(0, 10, 5)]}
    grads = session(m).run(names[2:], feeds)
    ref = {t.name: t for t in onnx.load(MLP).graph.initializer}
    for p, g in zip(PARAMS, grads):
        assert g.shape == tuple(ref[p].dims) and np.isfinite(g).all()


def test_grad_options(capsys, saved, tmp_path):
    path, out = saved(small_model()), tmp_path / "out.onnx"
    rc, stdout, err = cli(capsys, "grad", path, "-o", out, "--ys", "y", "--xs", "x", "w", "u",
                          "--unconnected", "zero", "--aggregation", "tree", "--name", "bwd",
                          "--grad-ys", "dy")
    assert rc == 0, err
    assert stdout.splitlines() == ["x -> bwd/x_grad", "w -> bwd/w_grad", "u -> bwd/u_grad"]
    m = onnx.load(out)
    onnx.checker.check_model(m, full_check=True)
    assert "dy" in [i.name for i in m.graph.input]  # a new grad_ys name becomes an input
    x = np.array([[0.1, 0.2, -0.3], [1.0, -2.0, 0.5]], np.float32)
    dy = np.full_like(x, 2.0)
    gx, gw, gu = session(m).run(["bwd/x_grad", "bwd/w_grad", "bwd/u_grad"],
                                {"x": x, "u": np.zeros(3, np.float32), "dy": dy})
    w = np.array([0.5, -1.0, 2.0], np.float32)
    sech2 = 1 - np.tanh(x * w) ** 2
    np.testing.assert_allclose(gx, dy * (sech2 * w + 1), rtol=1e-5)
    np.testing.assert_allclose(gw, (dy * sech2 * x).sum(0), rtol=1e-5)
    np.testing.assert_array_equal(gu, np.zeros(3, np.float32))  # unconnected -> zeros


def test_grad_unconnected_none_and_stop(capsys, saved, tmp_path):
    path, out = saved(small_model()), tmp_path / "out.onnx"
    rc, stdout, err = cli(capsys, "grad", path, "-o", out, "--ys", "y", "--xs", "x", "u",
                          "--stop", "t")
    assert rc == 0, err
    assert stdout.splitlines() == ["x -> gradients/x_grad", "u -> None"]
    m = onnx.load(out)
    (gx,) = session(m).run(["gradients/x_grad"], {"x": np.ones((2, 3), np.float32),
                                                  "u": np.zeros(3, np.float32)})
    np.testing.assert_array_equal(gx, np.ones((2, 3), np.float32))  # only the residual path


def test_grad_twice_gets_a_new_scope(capsys, saved, tmp_path):
    first, second = tmp_path / "g1.onnx", tmp_path / "g2.onnx"
    assert cli(capsys, "grad", saved(small_model()), "-o", first, "--ys", "y", "--xs", "x")[0] == 0
    rc, stdout, _ = cli(capsys, "grad", first, "-o", second, "--ys", "gradients/x_grad",
                        "--xs", "x")
    assert rc == 0
    assert stdout.strip() == "x -> gradients_1/x_grad"


# -- check -------------------------------------------------------------------------------------
def test_check_bundled_mlp(capsys):
    rc, stdout, err = cli(capsys, "check", MLP, "--ys", "loss", "--xs", *PARAMS)
    assert rc == 0, stdout + err
    assert stdout.startswith("gradient check (float64")
    for p in PARAMS:
        assert f"ok   {p}:" in stdout


def test_check_bundled_attention(capsys):
    rc, stdout, err = cli(capsys, "check", ATTENTION, "--ys", "loss", "--xs",
                          "Wq", "Wk", "Wv", "Wo", "x")
    assert rc == 0, stdout + err


def test_check_with_feeds_and_intermediate_y(capsys, saved, tmp_path):
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, x=np.linspace(-1, 1, 6).reshape(2, 3))  # float64 and no "u": both fine
    rc, stdout, err = cli(capsys, "check", saved(small_model()), "--ys", "t", "--xs", "x", "w",
                          "--feeds", feeds, "--dtype", "float32")
    assert rc == 0, stdout + err
    assert "gradient check (float32" in stdout


def test_check_fails_on_a_wrong_rule(capsys, saved, monkeypatch):
    path = saved(twice_model())
    key = (TEST_DOMAIN, "Twice")
    monkeypatch.setitem(registry._RULES, key, [(1, registry._MAX, lambda n, g: g * 2)])
    rc, stdout, err = cli(capsys, "check", path, "--ys", "y", "--xs", "x")
    assert rc == 0, stdout + err  # the right rule passes: the fixture itself is sound
    monkeypatch.setitem(registry._RULES, key, [(1, registry._MAX, lambda n, g: g)])  # d(2x) != 1
    rc, stdout, err = cli(capsys, "check", path, "--ys", "y", "--xs", "x")
    assert rc == 1, stdout + err
    assert "FAIL x:" in stdout and "MISMATCH: x" in stdout


# -- ops, version --------------------------------------------------------------------------------
def test_ops_plain_and_markdown(capsys):
    rc, stdout, _ = cli(capsys, "ops")
    assert rc == 0
    lines = stdout.splitlines()
    assert lines[0].split()[:4] == ["domain", "op", "since", "until"]
    assert any(line.split()[:2] == ["ai.onnx", "Relu"] for line in lines)
    rc, stdout, _ = cli(capsys, "ops", "--markdown")
    assert rc == 0
    lines = stdout.splitlines()
    assert lines[0] == "| domain | op | since | until | float inputs without a gradient |"
    assert lines[1].startswith("|---")
    assert "| ai.onnx | Relu | 13 | - |  |" in lines
    assert ("| ai.onnx | Resize | 13 | - | roi, scales: non-differentiable in the ONNX schema |"
            in lines)
    assert len(lines) == 2 + len(registry.supported_ops())


def test_version_via_python_m():
    import onnxgrad
    p = run_module("--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"onnxgrad {onnxgrad.__version__}"


def test_python_m_grad_end_to_end(saved, tmp_path):
    out = tmp_path / "out.onnx"
    p = run_module("grad", saved(small_model()), "-o", out, "--ys", "y", "--xs", "w")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["w -> gradients/w_grad"]
    onnx.checker.check_model(onnx.load(out), full_check=True)



def test_the_command_loads_its_libraries_inside_its_interrupt_handler():
    # An interrupt while onnx and onnxruntime load (about a second) is the command's own
    # ("interrupted", exit 130) only if they load inside main(): importing the command's module
    # (what the console script and `python -m onnxgrad` do before main()) loads neither.
    probe = ("import sys, onnxgrad.cli, onnxgrad.__main__; print(sorted({m.split('.')[0] "
             "for m in sys.modules} & {'onnx', 'onnxruntime', 'onnx_ir', 'numpy'}))")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
    # a module imported first still has what it needs: the rules register on the first lookup
    first = ("from onnxgrad.registry import lookup, supported_ops; "
             "print(lookup('', 'Relu', 13) is not None, len(supported_ops()) > 100)")
    p = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.split() == ["True", "True"], p.stderr
    # the lazy package still offers every documented name and submodule
    import onnxgrad
    for name in onnxgrad.__all__ + ["check", "runtime", "training", "rnn", "converters"]:
        assert getattr(onnxgrad, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        onnxgrad.nope


def test_each_module_imports_the_onnx_submodules_it_uses():
    # with the package imported lazily, a module that used onnx.inliner without importing it
    # worked only after another module had (versions.convert_version failed on its own)
    import pathlib
    import re
    probe = "import onnx, sys; print(' '.join(sorted(sys.modules)))"
    loaded = set(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                timeout=120, check=True).stdout.split())
    root = pathlib.Path(__file__).resolve().parents[1] / "onnxgrad"
    missing = []
    for path in root.rglob("*.py"):
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines()
                         if not line.lstrip().startswith(('"', "'")))
        for sub in set(re.findall(r"(?<![\w.\"'])onnx\.([a-z_]+)\.[a-zA-Z_]", code)):
            if f"onnx.{sub}" not in loaded and not re.search(
                    rf"^\s*(import onnx\.{sub}\b|from onnx\.{sub}\b|from onnx import .*\b{sub}\b)",
                    code, re.M):
                missing.append(f"{path.relative_to(root)}: onnx.{sub}")
    assert not missing, missing

# -- errors ------------------------------------------------------------------------------------
def test_unknown_xs_name_suggests(capsys, tmp_path):
    rc, _, err = cli(capsys, "grad", MLP, "-o", tmp_path / "o.onnx", "--ys", "loss",
                     "--xs", "W11")
    assert_one_line_error(rc, err, "'W11'", "did you mean", "'W1'")
    assert not (tmp_path / "o.onnx").exists()


def test_unknown_xs_name_via_python_m(tmp_path):
    p = run_module("grad", MLP, "-o", tmp_path / "o.onnx", "--ys", "loss", "--xs", "W11")
    assert_one_line_error(p.returncode, p.stderr, "did you mean")


def test_missing_model_file(capsys, tmp_path):
    rc, _, err = cli(capsys, "grad", tmp_path / "nope.onnx", "-o", tmp_path / "o.onnx",
                     "--ys", "y", "--xs", "x")
    assert_one_line_error(rc, err, "nope.onnx", "no such file")
    rc, _, err = cli(capsys, "check", tmp_path / "nope.onnx", "--ys", "y", "--xs", "x")
    assert_one_line_error(rc, err, "no such file")


def test_not_an_onnx_file(capsys, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_text("not a model")
    rc, _, err = cli(capsys, "grad", bad, "-o", tmp_path / "o.onnx", "--ys", "y", "--xs", "x")
    assert_one_line_error(rc, err, "bad.onnx")


def test_not_differentiable(capsys, saved, tmp_path):
    """A custom op with neither a rule nor a function body in the model."""
    m = twice_model()
    del m.functions[:]
    rc, _, err = cli(capsys, "grad", saved(m), "-o", tmp_path / "o.onnx",
                     "--ys", "y", "--xs", "x")
    assert_one_line_error(rc, err, "no gradient rule for op 'Twice'", TEST_DOMAIN,
                          "stop_gradients")
    assert not (tmp_path / "o.onnx").exists()


def test_grad_through_a_model_function(capsys, saved, tmp_path):
    """The same op with its body among the model's functions: differentiated through it."""
    out = tmp_path / "o.onnx"
    rc, stdout, err = cli(capsys, "grad", saved(twice_model()), "-o", out, "--ys", "y",
                          "--xs", "x")
    assert rc == 0, stdout + err
    m = onnx.load(out)
    onnx.checker.check_model(m, full_check=True)
    import onnxruntime as ort
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(sess.run(["gradients/x_grad"], {"x": x})[0], np.full(4, 2.0))


@pytest.mark.parametrize("argv, needle", [
    (["grad", MLP, "-o", "o.onnx", "--ys", "loss", "--xs", "W1", "--unconnected", "maybe"],
     "--unconnected"),
    (["grad", MLP, "-o", "o.onnx", "--ys", "loss", "--xs", "W1", "--aggregation", "mean"],
     "--aggregation"),
    (["grad", MLP, "--ys", "loss", "--xs", "W1"], "-o/--output"),
    (["grad", MLP, "-o", "o.onnx", "--ys", "loss", "logits", "--xs", "W1", "--grad-ys", "g"],
     "--grad-ys"),
    (["check", MLP, "--ys", "loss", "--xs", "W1", "--rtol", "abc"], "--rtol"),
    (["check", MLP, "--ys", "loss", "--xs", "W1", "--eps", "0"], "--eps"),
    (["check", MLP, "--ys", "loss", "--xs", "h1"], "h1"),
    (["frobnicate"], "frobnicate"),
    ([], "give a command"),
])
def test_bad_values(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    rc, _, err = cli(capsys, *argv)
    assert_one_line_error(rc, err, needle)
    assert not (tmp_path / "o.onnx").exists()


def test_bad_feeds(capsys, tmp_path):
    extra = tmp_path / "extra.npz"
    np.savez(extra, bogus=np.ones(2))
    rc, _, err = cli(capsys, "check", MLP, "--ys", "loss", "--xs", "b2", "--feeds", extra)
    assert_one_line_error(rc, err, "'bogus'", "not an input")
    rc, _, err = cli(capsys, "check", MLP, "--ys", "loss", "--xs", "b2",
                     "--feeds", tmp_path / "missing.npz")
    assert_one_line_error(rc, err, "missing.npz", "no such file")


def test_check_needs_feeds_for_integer_inputs(capsys, saved):
    """A Loop's trip count cannot be drawn at random: a one-line error naming it (the message
    itself crashed before)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_control_flow import loop_with_body_initializer
    path = saved(loop_with_body_initializer(np.float32))
    rc, _, err = cli(capsys, "check", path, "--ys", "hT", "--xs", "h0")
    assert_one_line_error(rc, err, "'M'", "int64", "--feeds")


# -- the bundled models --------------------------------------------------------------------------
def test_bundled_models_are_what_the_script_makes(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "models"))
    try:
        import make_models
    finally:
        sys.path.pop(0)
    make_models.main(["--out", str(tmp_path)])
    for name in make_models.MODELS:
        made = (tmp_path / name).read_bytes()
        with open(os.path.join(ROOT, "models", name), "rb") as f:
            assert f.read() == made, f"models/{name} is stale: run python models/make_models.py"
        m = onnx.load(tmp_path / name)
        onnx.checker.check_model(m, full_check=True)
        assert m.ir_version == 10
        assert [(o.domain, o.version) for o in m.opset_import] == [("", 18)]


def test_all_commands_are_wired_in(capsys):
    rc, stdout, _ = cli(capsys, "--help")
    assert rc == 0
    for command in ("grad", "check", "ops", "lower", "train", "export-train-step"):
        assert f"\n    {command}" in stdout, command
