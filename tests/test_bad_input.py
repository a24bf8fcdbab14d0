"""A catalogue of bad inputs and faults (issue 12): files, names, graphs, training data,
checkpoints, disk full, a write killed midway, concurrent writers.

Every case asserts the error class (the one hierarchy in onnxgrad.errors, which also derives from
the builtin a caller expects), the message (it names the thing that is wrong), that nothing
partial was written (the output folder holds exactly what it held before: no new file, no
temporary, an existing output byte for byte the same) and that the input is unchanged (the bytes
of every input file, the serialized ModelProto passed in).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad import errors, storage
from onnxgrad.cli import main
from onnxgrad.check import check_gradients
from onnxgrad.converters.tensorflow import proto as tfproto
from onnxgrad.training import SGD, Adam, AdamW, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "models", "mlp.onnx")
E = errors


# -- the inputs ---------------------------------------------------------------------------------
def classifier(seed=0) -> onnx.ModelProto:
    """logits [N, 3] = x [N, 4] @ W^T + b: the smallest model a Trainer classifies with."""
    rng = np.random.default_rng(seed)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["logits"], transB=1)], "clf",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "W"),
         numpy_helper.from_array(np.zeros(3, np.float32), "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def gradient_op_model(**attrs) -> onnx.ModelProto:
    """t = Tanh(x) and an ai.onnx.preview.training.Gradient node with the given attributes."""
    g = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["t"]),
         helper.make_node("Gradient", ["x"], ["dx"], domain="ai.onnx.preview.training",
                          **attrs)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [3])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                               helper.make_opsetid("ai.onnx.preview.training",
                                                                   1)], ir_version=10)


def graph_def(unranked=False):
    """A frozen TF GraphDef, built without TensorFlow: y = reduce_max(x * c, axis 1) (x of
    unknown rank where ``unranked``)."""
    gd = tfproto.GraphDef()
    x = gd.node.add(name="x", op="Placeholder")
    x.attr["dtype"].type = tfproto.DT["DT_FLOAT"]
    if unranked:
        x.attr["shape"].shape.unknown_rank = True
    for d in () if unranked else (-1, 3):
        x.attr["shape"].shape.dim.add(size=d)
    c = gd.node.add(name="c", op="Const")
    c.attr["dtype"].type = x.attr["dtype"].type
    c.attr["value"].tensor.CopyFrom(_tf_tensor(np.array([[1.0, 2.0, 3.0]], np.float32)))
    axis = gd.node.add(name="axis", op="Const")
    axis.attr["dtype"].type = tfproto.DT["DT_INT32"]
    axis.attr["value"].tensor.CopyFrom(_tf_tensor(np.array([1], np.int32)))
    m = gd.node.add(name="m", op="Mul", input=["x", "c"])
    m.attr["T"].type = x.attr["dtype"].type
    y = gd.node.add(name="y", op="Max", input=["m", "axis"])
    y.attr["T"].type = x.attr["dtype"].type
    y.attr["Tidx"].type = tfproto.DT["DT_INT32"]
    return gd


def _tf_tensor(a: np.ndarray):
    t = tfproto.TensorProto()
    t.dtype = tfproto.DT["DT_FLOAT" if a.dtype == np.float32 else "DT_INT32"]
    for d in a.shape:
        t.tensor_shape.dim.add(size=d)
    t.tensor_content = a.tobytes()
    return t


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The input files every case reads (never written to: each test checks their hashes)."""
    d = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(12)
    mlp = open(MLP, "rb").read()
    files = {
        "mlp.onnx": mlp,
        "empty.onnx": b"",
        "random.onnx": rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "text.onnx": b"this is not a model\n",
        "truncated.onnx": mlp[:len(mlp) // 3],
        "graphless.onnx": onnx.ModelProto(ir_version=10).SerializeToString(),
        "clf.onnx": classifier().SerializeToString(),
        "noy.onnx": gradient_op_model(xs=["x"]).SerializeToString(),
        "noxs.onnx": gradient_op_model(y="t").SerializeToString(),
        "twoouts.onnx": gradient_op_model(xs=["x", "x", "x"], y="t").SerializeToString(),
        "g.pb": graph_def().SerializeToString(),
        "unranked.pb": graph_def(unranked=True).SerializeToString(),
        "empty.pb": b"",
        "empty.pbtxt": b"   \n",
        "broken.pbtxt": b"node { name: 'x' op: ",
        "random.pb": rng.integers(0, 256, 512, dtype=np.uint8).tobytes(),
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "folder.onnx").mkdir()
    (d / "not_a_saved_model").mkdir()
    x = rng.standard_normal((12, 4)).astype(np.float32)
    y = np.arange(12) % 3
    arrays = {
        "data.npz": {"x": x, "y": y},
        "neg.npz": {"x": x, "y": np.where(np.arange(12) == 7, -1, y)},
        "big.npz": {"x": x, "y": np.where(np.arange(12) == 4, 3, y)},
        "frac.npz": {"x": x, "y": np.where(np.arange(12) == 5, 1.5, y)},
        "nanx.npz": {"x": np.where(np.arange(12)[:, None] == 9, np.nan, x), "y": y},
        "rows.npz": {"x": x, "y": y[:10]},
        "noy.npz": {"x": x},
        "strings.npz": {"x": x, "y": np.array(["a"] * 12)},
        "feeds_nan.npz": {"x": np.full((2, 64), np.nan)},
        "feeds_inf.npz": {"x": np.full((2, 64), np.inf)},
        "feeds_dim.npz": {"x": np.ones((2, 63))},
        "feeds_rank.npz": {"x": np.ones((2, 64, 1))},
        "feeds_name.npz": {"bogus": np.ones(2)},
        "feeds_text.npz": {"x": np.array(["a", "b"])},
    }
    for name, arrs in arrays.items():
        np.savez(d / name, **arrs)
    np.save(d / "single.npy", np.ones(3))
    os.replace(d / "single.npy", d / "single.npz")
    (d / "trunc.npz").write_bytes((d / "data.npz").read_bytes()[:200])
    return d


def digest(folder) -> dict:
    """name -> sha256 of every file in ``folder`` (recursively)."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def out(tmp_path):
    """An output folder holding one earlier output, ``o.onnx``: a failed command must leave it
    and nothing else."""
    d = tmp_path / "out"
    d.mkdir()
    (d / "o.onnx").write_bytes(b"an earlier output")
    return d


def assert_untouched(out, inputs, before):
    assert os.listdir(out) == ["o.onnx"], os.listdir(out)  # no new file, no temporary
    assert (out / "o.onnx").read_bytes() == b"an earlier output"
    assert digest(inputs) == before


def run_cli(monkeypatch, capsys, argv, cls, needles):
    """The command raises ``cls`` (seen with ONNXGRAD_DEBUG=1), and without it prints one line
    'onnxgrad: error: ...' holding each needle, exit status 2."""
    monkeypatch.setenv("ONNXGRAD_DEBUG", "1")
    with pytest.raises(cls) as info:
        main(argv)
    assert isinstance(info.value, E.OnnxgradError), type(info.value)
    monkeypatch.delenv("ONNXGRAD_DEBUG")
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("onnxgrad: error: ") and len(err.strip().splitlines()) == 1, err
    assert "unexpected" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


# -- files given to each command ------------------------------------------------------------------
BAD_MODELS = [  # file, error class, what the message says
    ("missing.onnx", E.ModelFileNotFoundError, "no such file"),
    ("empty.onnx", E.ModelLoadError, "the file is empty"),
    ("random.onnx", E.ModelLoadError, "not an ONNX model"),
    ("text.onnx", E.ModelLoadError, "not an ONNX model"),
    ("truncated.onnx", E.ModelLoadError, "not an ONNX model"),
    ("graphless.onnx", E.ModelLoadError, "no graph"),
    ("folder.onnx", E.ModelLoadError, "is a directory"),
]
COMMANDS = {
    "grad": lambda m, o, i: ["grad", m, "-o", o, "--ys", "loss", "--xs", "W1"],
    "check": lambda m, o, i: ["check", m, "--ys", "loss", "--xs", "W1"],
    "lower": lambda m, o, i: ["lower", m, "-o", o],
    "train": lambda m, o, i: ["train", m, "--loss", "cross_entropy", "--data",
                              i / "data.npz", "-o", o, "--no-progress"],
    "export-train-step": lambda m, o, i: ["export-train-step", m, "--loss", "mse", "-o", o],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("name, cls, needle", BAD_MODELS, ids=[b[0] for b in BAD_MODELS])
def test_bad_model_file(monkeypatch, capsys, inputs, out, command, name, cls, needle):
    before = digest(inputs)
    argv = [str(a) for a in COMMANDS[command](inputs / name, out / "o.onnx", inputs)]
    run_cli(monkeypatch, capsys, argv, cls, [name, needle])
    assert_untouched(out, inputs, before)


# -- command lines whose values are wrong -------------------------------------------------------
def _cases():
    c = []

    def case(id_, argv, cls, *needles):
        c.append(pytest.param(argv, cls, needles, id=id_))
    mlp, o = "{i}/mlp.onnx", "{o}/o.onnx"
    check = ["check", mlp, "--ys", "loss", "--xs", "b2"]
    for f, cls, needle in [("feeds_nan", E.DataError, "holds nan at index [0, 0]"),
                           ("feeds_inf", E.DataError, "holds inf"),
                           ("feeds_dim", E.DataError, "shape [2, 63]"),
                           ("feeds_rank", E.DataError, "(rank 2)"),
                           ("feeds_name", E.InvalidArgumentError, "'bogus' is not an input"),
                           ("feeds_text", E.DataError, "<U1"),
                           ("trunc", E.DataError, "not a readable"),
                           ("single", E.DataError, "not a single array"),
                           ("missing", E.ModelFileNotFoundError, "no such file")]:
        case(f"check-{f}", check + ["--feeds", f"{{i}}/{f}.npz"], cls, needle)
    for flag, value, needle in [("--dim", "0", "at least 1"), ("--dim", "-2", "at least 1"),
                                ("--eps", "nan", "positive finite"),
                                ("--rtol", "inf", "positive finite"),
                                ("--seed", "-1", "is not a seed")]:
        case(f"check{flag}={value}", check + [flag, value], E.InvalidArgumentError, flag, needle)
    grad = ["grad", mlp, "-o", o, "--ys", "loss"]
    case("grad-unknown-x", grad + ["--xs", "W11"], E.InvalidArgumentError, "did you mean")
    case("grad-unknown-y", ["grad", mlp, "-o", o, "--ys", "los", "--xs", "W1"],
         E.InvalidArgumentError, "'los'")
    case("grad-grad-ys-count", grad + ["--xs", "W1", "--grad-ys", "a", "b"],
         E.InvalidArgumentError, "--grad-ys has 2 names")
    case("grad-unknown-stop", grad + ["--xs", "W1", "--stop", "nothing"],
         E.InvalidArgumentError, "stop_gradients", "'nothing'")
    for f, cls, needle in [("noy", E.InvalidModelError, "no attribute 'y'"),
                           ("noxs", E.InvalidModelError, "no attribute 'xs'"),
                           ("twoouts", E.InvalidModelError, "1 outputs but 3 xs")]:
        case(f"lower-{f}", ["lower", f"{{i}}/{f}.onnx", "-o", o], cls, needle)
    conv = ["convert", "{i}/g.pb", "-o", o]
    for id_, extra, needle in [
            ("opset-7", ["--outputs", "y:0", "--opset", "7"], "cannot bring this graph to opset 7"),
            ("opset-13", ["--outputs", "y:0", "--opset", "13"], "opset 13"),
            ("opset-99", ["--outputs", "y:0", "--opset", "99"], "knows opsets 1 to"),
            ("output-index", ["--outputs", "y:5"], "has no output 5"),
            ("output-syntax", ["--outputs", "y:zero"], "is not a tensor name"),
            ("output-node", ["--outputs", "nothing:0"], "no node 'nothing'"),
            ("input-index", ["--outputs", "y:0", "--inputs", "x:3"], "no node reads output 3"),
            ("input-node", ["--outputs", "y:0", "--inputs", "q:0"], "no node 'q'")]:
        case(f"convert-{id_}", conv + extra, E.OnnxgradError, needle)
    for f, needle in [("empty.pb", "is empty"), ("empty.pbtxt", "is empty"),
                      ("broken.pbtxt", "not a text-format GraphDef"),
                      ("random.pb", "not a binary GraphDef")]:
        case(f"convert-{f}", ["convert", f"{{i}}/{f}", "-o", o, "--outputs", "y:0"],
             E.OnnxgradError, f, needle)
    # an input whose rank TF does not know has no valid ONNX declaration: no file by default
    case("convert-unranked", ["convert", "{i}/unranked.pb", "-o", o, "--outputs", "y:0"],
         E.OnnxgradError, "'x:0'", "--allow-unranked")
    case("convert-missing", ["convert", "{i}/none.pb", "-o", o, "--outputs", "y:0"],
         E.InvalidArgumentError, "no such file")
    case("convert-dir", ["convert", "{i}/not_a_saved_model", "-o", o],
         E.InvalidArgumentError, "not a SavedModel")
    train = ["train", "{i}/clf.onnx", "--loss", "cross_entropy", "-o", o, "--no-progress"]
    data = ["--data", "{i}/data.npz"]
    for f, cls, needle in [("neg", E.DataError, "label -1 at row 7 is negative"),
                           ("big", E.DataError, "label 3 at row 4 is out of range"),
                           ("frac", E.DataError, "label 1.5 at row 5 is not a whole number"),
                           ("nanx", E.DataError, "'x': nan at row 9"),
                           ("rows", E.DataError, "same number of rows"),
                           ("noy", E.DataError, "needs arrays 'x' and 'y'"),
                           ("strings", E.DataError, "holds <U1 values"),
                           ("trunc", E.DataError, "not a readable"),
                           ("missing", E.ModelFileNotFoundError, "no such file")]:
        case(f"train-{f}", train + ["--data", f"{{i}}/{f}.npz"], cls, needle)
    for extra, needle in [(["--lr", "nan"], "--lr"), (["--lr", "inf"], "--lr"),
                          (["--lr", "-1"], "lr=-1.0"),
                          (["--weight-decay", "nan"], "--weight-decay"),
                          (["--momentum", "0.9"], "--optimizer sgd only"),
                          (["--optimizer", "sgd", "--momentum", "nan"], "--momentum"),
                          (["--clip-norm", "0"], "--clip-norm"),
                          (["--clip-norm", "nan"], "--clip-norm"),
                          (["--epochs", "0"], "--epochs"), (["--batch-size", "0"], "--batch-size"),
                          (["--accumulate", "0"], "--accumulate"),
                          (["--val-split", "1"], "--val-split"),
                          (["--checkpoint-every", "0"], "--checkpoint-every"),
                          (["--resume", "{i}/none.npz"], "no such checkpoint"),
                          (["--resume", "{i}/random.onnx"], "not a readable checkpoint"),
                          (["--frozen", "nothing"], "'nothing'")]:
        case("train" + "".join(extra).replace("{i}/", ""), train + data + extra,
             E.InvalidArgumentError if extra[0] != "--resume" or "none" in extra[1]
             else E.CheckpointError, needle)
    step = ["export-train-step", "{i}/clf.onnx", "--loss", "mse", "-o", o]
    case("step-lr-nan", step + ["--lr", "nan"], E.InvalidArgumentError, "--lr")
    case("step-clip-negative", step + ["--clip-norm", "-1"], E.InvalidArgumentError, "--clip")
    case("step-output-name", step + ["--output-name", "nope"], E.InvalidArgumentError, "'nope'")
    return c


@pytest.mark.parametrize("argv, cls, needles", _cases())
def test_bad_command_line(monkeypatch, capsys, inputs, out, argv, cls, needles):
    before = digest(inputs)
    argv = [a.format(i=inputs, o=out) for a in argv]
    run_cli(monkeypatch, capsys, argv, cls, needles)
    assert_untouched(out, inputs, before)


def test_convert_allow_unranked_writes_what_onnxruntime_runs(tmp_path, capsys):
    """--allow-unranked: the input of unknown rank declared by its element type alone, with a
    warning; onnxruntime runs the file (onnx.checker refuses it, as the error said)."""
    from onnxgrad.converters.tensorflow import ConversionWarning
    from onnxgrad.runtime import session
    src, dst = tmp_path / "g.pb", tmp_path / "m.onnx"
    src.write_bytes(graph_def(unranked=True).SerializeToString())
    with pytest.warns(ConversionWarning, match="'x:0'"):
        assert main(["convert", str(src), "-o", str(dst), "--outputs", "y:0",
                     "--allow-unranked"]) == 0
    m = onnx.load(dst)
    assert not m.graph.input[0].type.tensor_type.HasField("shape")
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    (y,) = session(m).run(["y:0"], {"x:0": x})
    np.testing.assert_allclose(y, (x * [1.0, 2.0, 3.0]).max(axis=1), rtol=1e-6)


# -- the Python API ---------------------------------------------------------------------------
def _api_cases():
    def grads(**kw):
        return lambda m: onnxgrad.gradients(m, **{"ys": "loss", "xs": "W1", **kw})
    return [
        pytest.param(grads(xs=3), E.ArgumentTypeError, "xs must be a tensor name", id="xs=3"),
        pytest.param(grads(xs=["W1", 3]), E.ArgumentTypeError, "got 3", id="xs=[W1,3]"),
        pytest.param(grads(ys=None), E.ArgumentTypeError, "ys must hold", id="ys=None"),
        pytest.param(grads(name=None), E.ArgumentTypeError, "name must be", id="name=None"),
        pytest.param(grads(name=b"g"), E.ArgumentTypeError, "name must be", id="name=bytes"),
        pytest.param(grads(stop_gradients=5), E.ArgumentTypeError, "stop_gradients",
                     id="stop=5"),
        pytest.param(grads(xs="nope"), E.InvalidArgumentError, "'nope'", id="unknown-x"),
        pytest.param(grads(grad_ys=["a", "b"]), ValueError, "grad_ys has 2", id="grad_ys"),
        pytest.param(grads(unconnected_gradients="maybe"), ValueError, "'maybe'",
                     id="unconnected"),
        pytest.param(lambda m: onnxgrad.gradients(3, "loss", "W1"), E.ArgumentTypeError,
                     "not int", id="model=3"),
        pytest.param(lambda m: onnxgrad.gradients(b"\x08\x01garbage", "loss", "W1"),
                     E.ModelLoadError, "not an ONNX model", id="model=bytes"),
        pytest.param(lambda m: check_gradients(m, "loss", "b2", dim=0),
                     E.InvalidArgumentError, "dim=0", id="check-dim=0"),
        pytest.param(lambda m: storage.save_model("model", "x.onnx"), E.ArgumentTypeError,
                     "onnx.ModelProto", id="save-not-a-model"),
        pytest.param(lambda m: onnxgrad.lower_gradient_ops(gradient_op_model(xs=["x"])),
                     E.InvalidModelError, "no attribute 'y'", id="lower-no-y"),
    ]


@pytest.mark.parametrize("call, cls, needle", _api_cases())
def test_bad_python_call(tmp_path, monkeypatch, call, cls, needle):
    monkeypatch.chdir(tmp_path)
    m = onnx.load(MLP)
    before = m.SerializeToString()
    with pytest.raises(cls, match=re.escape(needle)):
        call(m)
    assert m.SerializeToString() == before  # the ModelProto passed in is unchanged
    assert os.listdir(tmp_path) == []


# -- optimizers and trainer arguments -----------------------------------------------------------
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("make, needle", [
    (lambda: AdamW(lr=NAN), "AdamW: lr=nan"),
    (lambda: AdamW(lr=INF), "AdamW: lr=inf"),
    (lambda: Adam(lr=-1e-3), "Adam: lr=-0.001"),
    (lambda: Adam(betas=(1.0, 0.9)), "betas[0]=1.0"),
    (lambda: Adam(betas=(0.9, NAN)), "betas[1]=nan"),
    (lambda: Adam(betas=0.9), "betas=0.9"),
    (lambda: AdamW(eps=NAN), "eps=nan"),
    (lambda: AdamW(weight_decay=INF), "weight_decay=inf"),
    (lambda: AdamW(amsgrad="yes"), "amsgrad='yes'"),
    (lambda: SGD(momentum=NAN), "momentum=nan"),
    (lambda: SGD(dampening=INF), "dampening=inf"),
    (lambda: SGD(lr="0.1"), "lr='0.1'"),
    (lambda: SGD(nesterov=True), "nesterov"),
    (lambda: Trainer(classifier(), "cross_entropy", clip_norm=INF, device="cpu"),
     "clip_norm=inf"),
    (lambda: Trainer(classifier(), "cross_entropy", clip_norm=0.0, device="cpu"),
     "clip_norm=0"),
    (lambda: Trainer(classifier(), "cross_entropy", accumulation_steps=0, device="cpu"),
     "accumulation_steps=0"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_hyper_parameter(make, needle):
    with pytest.raises((E.InvalidArgumentError, E.ArgumentTypeError), match=re.escape(needle)):
        make()


def trainer(**kw):
    return Trainer(classifier(), "cross_entropy", device="cpu", progress=False, **kw)


def data(n=12, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 4)).astype(np.float32), "target": np.arange(n) % 3}


@pytest.mark.parametrize("change, kw, cls, needle", [
    (lambda d: d["target"].__setitem__(7, -1), {}, E.DataError, "label -1 at row 7"),
    (lambda d: d["target"].__setitem__(2, 3), {}, E.DataError, "label 3 at row 2 is out of "
     "range: the model has 3 classes"),
    (lambda d: d.__setitem__("target", d["target"] + 0.25), {}, E.DataError,
     "label 0.25 at row 0 is not a whole number"),
    (lambda d: d.__setitem__("target", np.where(np.arange(12) == 3, np.nan, d["target"])), {},
     E.DataError, "label nan at row 3"),
    (lambda d: d["target"].__setitem__(4, -100), {"loss_options": {"ignore_index": -5}},
     E.DataError, "not ignore_index (-5)"),
    (lambda d: d["x"].__setitem__((5, 2), np.inf), {}, E.DataError, "'x': inf at row 5"),
    (lambda d: d.__setitem__("target", d["target"][:11]), {}, E.DataError,
     "different numbers of rows"),
    (lambda d: d.pop("target"), {}, E.DataError, "data has no ['target']"),
    (lambda d: d.__setitem__("x", d["x"][:, :3]), {}, E.DataError, "shape [12, 3]"),
], ids=["negative", "out-of-range", "fraction", "nan-label", "ignore-index", "inf-x", "rows",
        "missing", "shape"])
def test_bad_training_data(change, kw, cls, needle):
    tr = trainer(**kw)
    d = data()
    change(d)
    before = {k: v.copy() for k, v in d.items()}
    params = tr.parameters()
    with pytest.raises(cls, match=re.escape(needle)):
        tr.fit(d, epochs=1, batch_size=4)
    assert tr.step_count == 0  # refused before the first step
    assert all(np.array_equal(v, tr.parameters()[k]) for k, v in params.items())
    assert all(np.array_equal(before[k], d[k], equal_nan=True) for k in d)


def test_ignore_index_is_respected():
    tr = trainer(loss_options={"ignore_index": -100})
    d = data()
    d["target"][[1, 4]] = -100
    tr.fit(d, epochs=1, batch_size=4)
    assert tr.step_count == 3


def test_batch_labels_in_step_and_a_bad_schedule():
    tr = trainer()
    d = data(4)
    d["target"][1] = 9
    with pytest.raises(E.DataError, match="label 9 at row 1"):
        tr.step(d)
    tr = trainer(lr_schedule=lambda step: NAN if step == 2 else 1e-3)
    tr.step(data(4))
    with pytest.raises(E.InvalidArgumentError, match="lr_schedule at step 2: lr=nan"):
        tr.step(data(4))
    assert tr.step_count == 1


# -- checkpoints ---------------------------------------------------------------------------------
def rewrite(path, edit, manifest=True):
    """Rewrite the checkpoint at ``path`` with ``edit`` applied to its arrays, as a valid zip
    whose manifest describes the new arrays (``manifest=False``: the old manifest stays)."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    edit(arrays)
    if manifest and "manifest" in arrays:
        arrays["manifest"] = np.array(json.dumps({k: {
            "dtype": a.dtype.str, "shape": list(a.shape),
            "sha256": hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()}
            for k, a in arrays.items() if k != "manifest"}))
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize("spoil, needle", [
    (lambda p: p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 2]),
     "not a readable checkpoint"),
    (lambda p: p.write_bytes(b""), "not a readable checkpoint"),
    (lambda p: p.write_bytes(os.urandom(300)), "not a readable checkpoint"),
    (lambda p: rewrite(p, lambda a: a.__setitem__("param_0", a["param_0"].astype(np.float64))),
     "'W' is float64 [3, 4] in the checkpoint but float32 [3, 4]"),
    (lambda p: rewrite(p, lambda a: a.__setitem__("param_0", a["param_0"].T.copy())),
     "'W' is float32 [4, 3] in the checkpoint"),
    (lambda p: rewrite(p, lambda a: a.__setitem__("param_0", a["param_0"] + 1), False),
     "'param_0' does not match its recorded dtype, shape and SHA-256"),
    (lambda p: rewrite(p, lambda a: a.pop("state_1"), False), "'state_1' is missing"),
    (lambda p: rewrite(p, lambda a: a.pop("manifest")), "no manifest"),
    (lambda p: rewrite(p, lambda a: a.__setitem__("format", np.array("other"))),
     "not an onnxgrad checkpoint"),
    (lambda p: rewrite(p, lambda a: (a.__setitem__("param_1", np.full(3, np.nan, np.float32)),
                                     a.pop("manifest"),
                                     a.__setitem__("format", np.array("onnxgrad-checkpoint-1")))),
     "'b' holds 3 NaN or infinite values"),
    (lambda p: rewrite(p, lambda a: (a.__setitem__("param_names", np.array(["V", "b"])),
                                     a.pop("manifest"),
                                     a.__setitem__("format", np.array("onnxgrad-checkpoint-1")))),
     "do not match this trainer's"),
    (lambda p: p.unlink(), "no such checkpoint"),
], ids=["truncated", "empty", "random", "float64", "transposed", "checksum", "incomplete",
        "no-manifest", "format", "nan-v1", "other-model", "missing"])
def test_bad_checkpoint(tmp_path, spoil, needle):
    tr = trainer()
    tr.fit(data(), epochs=1, batch_size=4)
    ckpt = tmp_path / "ckpt.npz"
    tr.save_checkpoint(ckpt)
    spoil(ckpt)
    spoiled = ckpt.read_bytes() if ckpt.exists() else None
    fresh = trainer()
    params, state = fresh.parameters(), fresh.optimizer_state()
    with pytest.raises(E.CheckpointError, match=re.escape(needle)):
        fresh.load_checkpoint(ckpt)
    # nothing was restored: not even the arrays that were read before the bad one
    assert fresh.step_count == 0
    assert all(np.array_equal(v, fresh.parameters()[k]) for k, v in params.items())
    assert all(np.array_equal(v, fresh.optimizer_state()[k]) for k, v in state.items())
    assert (ckpt.read_bytes() if ckpt.exists() else None) == spoiled


def test_checkpoint_round_trip_checks_out(tmp_path):
    tr = trainer()
    tr.fit(data(), epochs=1, batch_size=4)
    tr.save_checkpoint(tmp_path / "c.npz")
    other = trainer()
    other.load_checkpoint(tmp_path / "c.npz")
    assert other.step_count == tr.step_count
    for k, v in tr.parameters().items():
        assert np.array_equal(other.parameters()[k], v)


def _blow_up(tr):
    """Make the trainer's current parameters non-finite (as a diverged run has them)."""
    tr._sets[tr._cur][0].update_inplace(np.full((3, 4), np.nan, np.float32))


def test_never_checkpoint_or_export_nan(tmp_path):
    tr = trainer()
    tr.fit(data(), epochs=1, batch_size=4)
    ckpt, model = tmp_path / "c.npz", tmp_path / "m.onnx"
    tr.save_checkpoint(ckpt)
    tr.export(model)
    good = digest(tmp_path)
    _blow_up(tr)
    with pytest.raises(E.NonFiniteError, match="'W' holds 12 NaN or infinite values: not "
                                               "writing the checkpoint"):
        tr.save_checkpoint(ckpt)
    with pytest.raises(E.NonFiniteError, match="not exporting"):
        tr.export(model)
    assert digest(tmp_path) == good  # the good checkpoint and model are still there


def test_fit_stops_when_a_checkpoint_cannot_be_written(tmp_path, monkeypatch):
    tr = trainer()
    ckpt = tmp_path / "c.npz"
    tr.fit(data(), epochs=1, batch_size=4, checkpoint=str(ckpt))
    good = ckpt.read_bytes()
    disk_full(monkeypatch)
    with pytest.raises(E.WriteError, match="no space left on the device; training stopped at "
                                           f"step 6, {re.escape(str(ckpt))} still holds step 3"):
        tr.fit(data(), epochs=2, batch_size=4, checkpoint=str(ckpt))
    assert ckpt.read_bytes() == good and os.listdir(tmp_path) == ["c.npz"]
    assert tr.step_count == 6  # the trainer still holds the run's weights
    monkeypatch.undo()
    tr.save_checkpoint(ckpt)  # and writes them once the disk has room
    again = trainer()
    again.load_checkpoint(ckpt)
    assert again.step_count == 6


# -- faults while writing -------------------------------------------------------------------------
def disk_full(monkeypatch):
    """Every fsync reports ENOSPC, as a full disk does for data the kernel could not place."""
    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", fsync)


WRITERS = {
    "save_model": lambda p: storage.save_model(onnx.load(MLP), p),
    "save_model-external": lambda p: storage.save_model(onnx.load(MLP), p),
    "checkpoint": lambda p: trainer().save_checkpoint(p),
    "export": lambda p: trainer().export(p),
    "export-train-step": lambda p: onnxgrad.training.export_train_step(
        onnxgrad.training.attach_loss(classifier(), "mse"), "loss", p),
    "cli-grad": lambda p: main(["grad", MLP, "-o", str(p), "--ys", "loss", "--xs", "W1"]),
    "cli-lower": lambda p: main(["lower", MLP, "-o", str(p)]),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_disk_full(tmp_path, monkeypatch, capsys, writer):
    if writer == "save_model-external":  # the external-data path: a data file, then the model
        monkeypatch.setattr(storage, "EXTERNAL_DATA_ABOVE", 1000)
    target = tmp_path / "o.onnx"
    target.write_bytes(b"the last good file")
    mlp = digest(os.path.dirname(MLP))
    disk_full(monkeypatch)
    if writer.startswith("cli-"):
        assert WRITERS[writer](target) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no space left on the device" in err, err
    else:
        with pytest.raises(E.WriteError, match=r"no space left on the device\); nothing "
                                               "was written there") as info:
            WRITERS[writer](target)
        assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == ["o.onnx"]  # no temporary, no data file
    assert target.read_bytes() == b"the last good file"
    assert digest(os.path.dirname(MLP)) == mlp


def test_export_failure_says_what_is_kept(monkeypatch, capsys, inputs, out):
    disk_full(monkeypatch)
    argv = ["train", str(inputs / "clf.onnx"), "--loss", "cross_entropy", "--data",
            str(inputs / "data.npz"), "-o", str(out / "o.onnx"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no space left on the device; the trained weights were not saved" in err, err
    assert os.listdir(out) == ["o.onnx"]


def test_output_is_a_directory(tmp_path):
    (tmp_path / "d.onnx").mkdir()
    with pytest.raises(E.WriteError, match="it is a directory"):
        storage.save_model(onnx.load(MLP), tmp_path / "d.onnx")
    assert os.listdir(tmp_path / "d.onnx") == []


@pytest.mark.parametrize("name", ["", "newdir/"])
def test_output_that_names_no_file(tmp_path, monkeypatch, name):
    """-o '' was reported as "a directory"; -o newdir/ wrote a file named newdir."""
    monkeypatch.chdir(tmp_path)
    why = "it names no file" if not name else "it ends with a separator"
    with pytest.raises(E.WriteError, match=why):
        storage.save_model(onnx.load(MLP), name)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", ["grad", "lower"])
def test_output_over_the_inputs_external_data_is_refused(tmp_path, capsys, command):
    """`grad ext.onnx -o ext.data` replaced the input's weights with the output (exit 0; the
    input then loaded garbage weights)."""
    g = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [300])],
                          [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [300])],
                          [numpy_helper.from_array(np.arange(300.0), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(m, tmp_path / "ext.onnx", save_as_external_data=True, location="ext.data",
              size_threshold=0)
    before = (tmp_path / "ext.data").read_bytes()
    extra = ["--ys", "y", "--xs", "x"] if command == "grad" else []
    assert main([command, str(tmp_path / "ext.onnx"), "-o", str(tmp_path / "ext.data"),
                 *extra]) == 2
    assert "holds the external data" in capsys.readouterr().err
    assert (tmp_path / "ext.data").read_bytes() == before


@pytest.mark.parametrize("via", ["plain", "linked_model", "linked_output"])
@pytest.mark.parametrize("writer", ["export", "export_train_step", "export_gradient",
                                    "save_checkpoint", "export_train_step_fn", "export_web_step"])
def test_python_writers_never_write_over_the_models_external_data(tmp_path, writer, via):
    """Trainer.export("model.onnx.data") replaced the weights of the model it was built from
    (which then loaded with garbage weights, silently), where the CLI refuses that path; so
    could save_checkpoint, export_train_step and export_web_step."""
    from onnxgrad.training import SGD, Trainer, export_train_step
    from onnxgrad.training.webstep import export_web_step
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 30])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
                          [numpy_helper.from_array(np.ones((30, 10), np.float32), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    src, data = tmp_path / "m.onnx", tmp_path / "m.data"
    onnx.save(m, src, save_as_external_data=True, location="m.data", size_threshold=0)
    before = data.read_bytes()
    os.symlink(tmp_path, tmp_path / "link")  # (the same folder reached through a link)
    if via == "linked_model":
        src = tmp_path / "link" / "m.onnx"
    elif via == "linked_output":
        data = tmp_path / "link" / "m.data"
    tr = Trainer(str(src), "mse", optimizer=SGD(lr=0.1), device="cpu", progress=False)
    write = {"export": lambda: tr.export(data),
             "export_train_step": lambda: tr.export(tmp_path / "o.onnx", train_step=data),
             "export_gradient": lambda: tr.export(tmp_path / "o.onnx", gradient=data),
             "save_checkpoint": lambda: tr.save_checkpoint(data),
             "export_train_step_fn": lambda: export_train_step(str(src), "mse", data),
             "export_web_step": lambda: export_web_step(str(src), "mse", data)}[writer]
    with pytest.raises(E.WriteError, match="holds the external data"):
        write()
    assert data.read_bytes() == before


def test_failed_write_removes_the_folders_it_made(tmp_path):
    """The message says nothing was written there: the folders made for the file go too."""
    with pytest.raises(E.WriteError):
        storage.save_model(onnx.load(MLP), tmp_path / "made" / "sub" / ("b" * 300 + ".onnx"))
    assert os.listdir(tmp_path) == []


def test_symlink_is_written_through(tmp_path):
    target, link = tmp_path / "real.onnx", tmp_path / "link.onnx"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    link.symlink_to(target.name)
    storage.save_model(onnx.load(MLP), link)
    assert link.is_symlink() and os.readlink(link) == "real.onnx"  # the link stays a link
    assert os.stat(target).st_mode & 0o777 == 0o640  # the target keeps its mode
    assert onnx.load(link).SerializeToString() == onnx.load(MLP).SerializeToString()
    assert sorted(os.listdir(tmp_path)) == ["link.onnx", "real.onnx"]


def test_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.onnx"
    link.symlink_to("made.onnx")
    storage.save_model(onnx.load(MLP), link)
    assert link.is_symlink() and (tmp_path / "made.onnx").is_file()


def test_stale_temporaries_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".m.onnx.onnxgrad-{dead}-0123abcd.tmp"
    live = tmp_path / f".m.onnx.onnxgrad-{os.getppid()}-0123abcd.tmp"  # a running process
    other = tmp_path / f".n.onnx.onnxgrad-{dead}-0123abcd.tmp"  # another destination's
    mine = tmp_path / "notes.tmp"  # not ours at all
    for p in (stale, live, other, mine):
        p.write_bytes(b"x" * 1000)
    storage.save_model(onnx.load(MLP), tmp_path / "m.onnx")
    assert sorted(os.listdir(tmp_path)) == sorted(["m.onnx", live.name, other.name, mine.name])


KILLED_WRITER = r"""
import sys
from onnxgrad.storage import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    with open(tmp, "wb") as f:
        f.write(b"half of a model" * 100000)
        f.flush()
        print("writing", flush=True)
        sys.stdin.read()  # killed here, mid-write
"""


def test_kill_during_write(tmp_path):
    target = tmp_path / "m.onnx"
    storage.save_model(onnx.load(MLP), target)
    good = target.read_bytes()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "writing"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    left = [n for n in os.listdir(tmp_path) if n != "m.onnx"]
    assert len(left) == 1 and left[0].startswith(".m.onnx.onnxgrad-")  # the killed temporary
    assert target.read_bytes() == good  # readers still see the last complete model
    checker = onnx.load(target)  # a complete model
    trainer().save_checkpoint(tmp_path / "c.npz")  # another destination leaves it alone
    assert left[0] in os.listdir(tmp_path)
    storage.save_model(checker, target)  # the next write to the same path removes it
    assert sorted(os.listdir(tmp_path)) == ["c.npz", "m.onnx"]


def test_concurrent_writers(tmp_path, monkeypatch):
    """Eight threads write eight different models to one path, five times each: the file is
    always one of them, whole, and no temporary or data file is left over."""
    models = []
    for k in range(8):
        m = classifier(seed=k)
        m.doc_string = f"writer {k}"
        models.append(m)
    target = tmp_path / "m.onnx"
    failures = []

    def write(m):
        try:
            for _ in range(5):
                storage.save_model(m, target)
                onnx.load(target)  # every read sees a whole model
        except Exception as exc:  # noqa: BLE001
            failures.append(exc)
    threads = [threading.Thread(target=write, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert onnx.load(target).doc_string in {m.doc_string for m in models}
    assert os.listdir(tmp_path) == ["m.onnx"]


def test_concurrent_checkpoints(tmp_path):
    trainers = [trainer() for _ in range(3)]
    for k, tr in enumerate(trainers):
        tr.fit(data(seed=k), epochs=1, batch_size=4)
    ckpt = tmp_path / "c.npz"
    threads = [threading.Thread(target=tr.save_checkpoint, args=(ckpt,)) for tr in trainers
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    restored = trainer()
    restored.load_checkpoint(ckpt)  # whole and intact: one of the three
    assert any(all(np.array_equal(restored.parameters()[k], v)
                   for k, v in tr.parameters().items()) for tr in trainers)
    assert os.listdir(tmp_path) == ["c.npz"]


# -- generated cases (hypothesis): the classes above, beyond the examples -------------------------
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from onnxgrad.training.losses import check_labels  # noqa: E402

FEW = settings(max_examples=40, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture])


@FEW
@given(st.binary(max_size=300))
def test_any_bytes_load_or_refuse(data):
    """Whatever the bytes, loading gives a model with a graph and an IR version, or a
    ModelLoadError: never another exception."""
    try:
        m = storage.load_model(data)
    except E.ModelLoadError as exc:
        assert "not an ONNX model" in str(exc)
    else:
        assert m.ir_version > 0 and m.HasField("graph")


@FEW
@given(st.integers(1, 6), st.one_of(st.none(), st.sampled_from([-100, -1, 2])),
       st.lists(st.one_of(st.integers(-3, 8), st.sampled_from([0.5, 2.0, float("nan")])),
                min_size=1, max_size=12))
def test_labels_are_accepted_exactly_when_valid(classes, ignore, values):
    a = np.array(values, dtype=np.float64 if any(isinstance(v, float) for v in values)
                 else np.int64)

    def ok(v):
        return (v == ignore) or (v == int(v) and 0 <= v < classes) if v == v else False
    bad = [i for i, v in enumerate(a) if not ok(v)]
    if not bad:
        assert check_labels(a, classes, ignore).tolist() == [int(v) for v in a]
        return
    with pytest.raises(E.DataError) as info:
        check_labels(a, classes, ignore)
    assert f"at row {bad[0]} " in str(info.value)


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory):
    tr = trainer()
    tr.fit(data(), epochs=1, batch_size=4)
    path = tmp_path_factory.mktemp("ckpt") / "c.npz"
    tr.save_checkpoint(path)
    return path.read_bytes(), tr.parameters(), tr.optimizer_state()


@FEW
@given(st.data())
def test_a_flipped_byte_never_loads_garbage(tmp_path_factory, checkpoint_bytes, draw):
    """Any one byte of a checkpoint changed: it loads the very same values (a byte that held
    no data, a zip timestamp say) or it is a CheckpointError; it never loads other values."""
    good, params, state = checkpoint_bytes
    at = draw.draw(st.integers(0, len(good) - 1))
    flip = draw.draw(st.integers(1, 255))
    bad = bytearray(good)
    bad[at] ^= flip
    path = tmp_path_factory.mktemp("flip") / "c.npz"
    path.write_bytes(bytes(bad))
    tr = trainer()
    try:
        tr.load_checkpoint(path)
    except E.CheckpointError:
        assert tr.step_count == 0
        return
    for k, v in params.items():
        assert np.array_equal(tr.parameters()[k], v), (at, k)
    for k, v in state.items():
        assert np.array_equal(tr.optimizer_state()[k], v), (at, k)


def test_new_files_get_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        storage.save_model(onnx.load(MLP), tmp_path / "m.onnx")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "m.onnx").st_mode & 0o777 == 0o640


_OUTPUT_FLAGS = ["-o", "--checkpoint", "--plot"]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.sampled_from(_OUTPUT_FLAGS), st.sampled_from(["model", "data", "-o", "--checkpoint",
                                                        "--plot"]))
def test_an_output_naming_an_input_or_another_output_is_refused(tmp_path_factory, flag, victim):
    """`train --checkpoint model.onnx` (or data.npz, or -o's file) wrote over the input model,
    the data or the other output, exit 0. Every output of `train` against every file it reads
    and every other output: refused, and nothing is written."""
    assume(flag != victim)
    d = tmp_path_factory.mktemp("clash")
    (d / "clf.onnx").write_bytes(classifier().SerializeToString())
    rng = np.random.default_rng(0)
    np.savez(d / "data.npz", x=rng.standard_normal((8, 4)).astype(np.float32),
             y=rng.integers(0, 3, 8))
    paths = {"model": d / "clf.onnx", "data": d / "data.npz"}
    outs = {f: d / f"out{k}" for k, f in enumerate(_OUTPUT_FLAGS)}
    outs[flag] = paths.get(victim, outs.get(victim))
    before = digest(d)
    argv = ["train", str(paths["model"]), "--loss", "cross_entropy", "--data", str(paths["data"]),
            "--no-progress"] + [str(a) for f, p in outs.items() for a in (f, p)]
    assert main(argv) == 2
    assert digest(d) == before


def test_checkpoint_may_be_the_file_resumed_from(tmp_path, capsys):
    (tmp_path / "clf.onnx").write_bytes(classifier().SerializeToString())
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((8, 4)).astype(np.float32),
             y=rng.integers(0, 3, 8))
    base = ["train", str(tmp_path / "clf.onnx"), "--loss", "cross_entropy", "--data",
            str(tmp_path / "data.npz"), "--no-progress", "-o", str(tmp_path / "o.onnx"),
            "--checkpoint", str(tmp_path / "ck.npz")]
    assert main(base) == 0
    assert main(base + ["--resume", str(tmp_path / "ck.npz"), "--epochs", "2"]) == 0, \
        capsys.readouterr().err


def test_export_train_step_outputs_may_not_collide(tmp_path, capsys):
    """`export-train-step -o step.onnx --gradient step.onnx` left the gradient graph where the
    step was asked for, exit 0."""
    (tmp_path / "clf.onnx").write_bytes(classifier().SerializeToString())
    step = str(tmp_path / "step.onnx")
    assert main(["export-train-step", str(tmp_path / "clf.onnx"), "--loss", "cross_entropy",
                 "-o", step, "--gradient", step]) == 2
    assert "name the same file" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["clf.onnx"]


def test_web_export_beside_its_input_model_is_refused(tmp_path, capsys):
    """The web target writes STEP.model.onnx beside -o STEP.onnx: over the input model there."""
    model = tmp_path / "step.model.onnx"
    model.write_bytes(classifier().SerializeToString())
    before = model.read_bytes()
    assert main(["export-train-step", str(model), "--loss", "cross_entropy", "-o",
                 str(tmp_path / "step.onnx"), "--target", "web"]) == 2
    assert "it is the input model" in capsys.readouterr().err
    assert model.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["step.model.onnx"]


def test_an_exporters_wrong_output_declaration_is_refused_with_the_remedy():
    """torch.onnx's dynamo exporter declares cross_entropy(reduction="none") a scalar where the
    model computes [N] (found by bench/fuzz_torch.py): the contradiction is refused, naming the
    output and how to clear the declaration; so cleared, the gradient is torch's."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    import warnings
    F = torch.nn.functional
    lin = torch.nn.Linear(4, 3)
    labels = torch.tensor([1, 0, 2, 2, 1])

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            z = self.lin(x)
            return F.cross_entropy(z, labels[: z.shape[0]], reduction="none")
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = torch.onnx.export(Net(), (torch.tensor(x),), dynamo=True, input_names=["x"],
                              output_names=["y"], verbose=False,
                              dynamic_shapes=({0: torch.export.Dim("N")},)).model_proto
    if len(m.graph.output[0].type.tensor_type.shape.dim) == 1:
        pytest.skip("this torch declares the output as it computes it")
    with pytest.raises(errors.InvalidModelError, match="'y' as float.*ClearField"):
        onnxgrad.gradients(m, "y", "x")
    next(o for o in m.graph.output if o.name == "y").type.tensor_type.ClearField("shape")
    res = onnxgrad.gradients(m, "y", "x")
    got, = onnxgrad.runtime.session(res.model).run(res.grads, {"x": x})
    xt = torch.tensor(x, requires_grad=True)
    F.cross_entropy(lin(xt), labels, reduction="none").sum().backward()
    np.testing.assert_allclose(got, xt.grad.numpy(), rtol=1e-5, atol=1e-6)


def _files(folder) -> dict:
    """name -> sha256 of each regular file, or its kind (a pipe, a folder), under ``folder``."""
    out = {}
    for dirpath, dirs, names in os.walk(folder):
        for n in names + dirs:
            p = os.path.join(dirpath, n)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    out[os.path.relpath(p, folder)] = hashlib.sha256(f.read()).hexdigest()
            else:
                out[os.path.relpath(p, folder)] = "dir" if os.path.isdir(p) else "special"
    return out


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.sampled_from(["grad", "export", "web", "train"]),
       st.sampled_from(["dir", "pipe", "under a file"]), st.integers(0, 2))
def test_an_output_no_file_can_be_written_at_is_refused_before_the_run(
        tmp_path_factory, command, kind, which):
    """A run wrote some of its outputs and then failed on another (--gradient, --plot or the
    web manifest naming a folder) saying "nothing was written there"; an output naming a pipe
    or a device was replaced by a regular file, exit 0. Every output of every command, each
    kind of path no file can be written at: refused before the run, every file as it was."""
    from onnxgrad.training.webstep import paths
    d = tmp_path_factory.mktemp("unwritable")
    (d / "clf.onnx").write_bytes(classifier().SerializeToString())
    rng = np.random.default_rng(0)
    np.savez(d / "data.npz", x=rng.standard_normal((8, 4)).astype(np.float32),
             y=rng.integers(0, 3, 8))
    outs = {"grad": {"-o": "g.onnx"}, "export": {"-o": "s.onnx", "--gradient": "sg.onnx"},
            "web": dict(zip(["-o", "model", "manifest"],
                            [os.path.basename(p) for p in paths("w.onnx").values()])),
            "train": {"-o": "t.onnx", "--checkpoint": "c.npz", "--plot": "p.png"}}[command]
    for name in outs.values():
        (d / name).write_bytes(b"an earlier good file\n")
    bad = list(outs)[which % len(outs)]
    if command == "web" and kind == "under a file":  # (the model and manifest sit beside -o)
        bad = "-o"
    target = d / outs[bad]
    target.unlink()
    if kind == "dir":
        target.mkdir()
    elif kind == "pipe":
        os.mkfifo(target)
    else:
        (d / "afile").write_bytes(b"a file, not a folder\n")
        outs[bad] = target = d / "afile" / outs[bad]
    before = _files(d)
    model = str(d / "clf.onnx")
    argv = {"grad": ["grad", model, "--ys", "logits", "--xs", "W"],
            "export": ["export-train-step", model, "--loss", "cross_entropy"],
            "web": ["export-train-step", model, "--loss", "cross_entropy", "--target", "web"],
            "train": ["train", model, "--loss", "cross_entropy", "--data", str(d / "data.npz"),
                      "--no-progress"]}[command]
    argv += [a for f, n in outs.items() if f.startswith("-") for a in (f, str(d / n))]
    assert main(argv) == 2
    assert _files(d) == before


@pytest.mark.parametrize("inside", ["saved_model.pb", "variables/variables.index", "new.onnx"])
def test_convert_never_writes_into_the_savedmodel_it_reads(tmp_path, capsys, inside):
    """`convert sm -o sm/saved_model.pb` wrote the ONNX model over the SavedModel's own file,
    exit 0 (only `-o sm` itself was refused)."""
    sm = tmp_path / "sm"
    (sm / "variables").mkdir(parents=True)
    (sm / "saved_model.pb").write_bytes(b"the graph")
    (sm / "variables" / "variables.index").write_bytes(b"the index")
    before = _files(tmp_path)
    assert main(["convert", str(sm), "-o", str(sm / inside)]) == 2
    assert "inside the TensorFlow graph" in capsys.readouterr().err
    assert _files(tmp_path) == before


def test_a_set_of_files_is_replaced_as_one(tmp_path, monkeypatch):
    """A web export's step, model and manifest (whose hashes must agree) were renamed into
    place one after another: an interrupt between two renames left a mix, which the page
    refuses, the old set gone. The renames now run with SIGINT and SIGTERM held: a signal
    that comes between them lands after the last."""
    files = {tmp_path / f"f{k}.onnx": f"new {k}".encode() for k in range(3)}
    for p in files:
        p.write_bytes(b"old")

    class Term(Exception):
        pass

    def on_term(*_):
        raise Term

    real, done = os.replace, []

    def replace(a, b):
        real(a, b)
        done.append(b)
        if len(done) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
    old = signal.signal(signal.SIGTERM, on_term)
    try:
        monkeypatch.setattr(storage.os, "replace", replace)
        with pytest.raises(Term):
            storage.write_together(files)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert len(done) == 3
    assert all(p.read_bytes() == data for p, data in files.items())
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in files)


def test_a_model_at_onnx_s_default_ir_trains(tmp_path, capsys):
    """onnx 1.23 writes IR 14, which onnxruntime 1.31 does not read: `grad` and
    `export-train-step` pinned their outputs to IR 13, but `train` (and the Trainer) handed
    the model to onnxruntime as it was and failed with "unexpected Fail ... please report it"."""
    m = classifier()
    m.ir_version = 14
    onnx.save(m, tmp_path / "m14.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((8, 4)).astype(np.float32),
             y=rng.integers(0, 3, 8))
    assert main(["train", str(tmp_path / "m14.onnx"), "--loss", "cross_entropy", "--data",
                 str(tmp_path / "d.npz"), "--no-progress", "-o", str(tmp_path / "t.onnx")]) == 0, \
        capsys.readouterr().err
    assert onnx.load(tmp_path / "t.onnx").ir_version == 13


@pytest.mark.parametrize("dtype,eps", [("float64", 1e308), ("float32", 2e38)])
def test_a_step_whose_double_overflows_is_refused(dtype, eps):
    """`check --eps 1e308` divided by 2 * eps = inf: every slope came out 0 and the check said
    "all gradients match", exit 0."""
    with pytest.raises(errors.InvalidArgumentError, match="eps=.* too large"):
        check_gradients(MLP, "loss", ["W1"], dtype=dtype, eps=eps)


def test_lower_refuses_an_opset_onnx_does_not_know(tmp_path, capsys):
    """`lower` wrote a model importing opset 29 (which neither onnx 1.23 nor onnxruntime
    knows), exit 0, where `grad` and `check` refuse it."""
    m = classifier()
    m.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    onnx.save(m, tmp_path / "m.onnx")
    assert main(["lower", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx")]) == 2
    assert "newer than the installed onnx" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


def test_a_validation_split_of_every_row_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "clf.onnx").write_bytes(classifier().SerializeToString())
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((8, 4)).astype(np.float32),
             y=rng.integers(0, 3, 8))
    assert main(["train", str(tmp_path / "clf.onnx"), "--loss", "cross_entropy", "--data",
                 str(tmp_path / "d.npz"), "--val-split", "0.99", "--no-progress", "-o",
                 str(tmp_path / "t.onnx")]) == 2
    assert "--val-split 0.99 of 8 rows leaves none to train on" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["export-train-step", "web", "train"])
def test_a_step_onnxruntime_cannot_load_is_refused(tmp_path, capsys, command):
    """A model at an opset onnx knows but onnxruntime does not run (27 and 28 beside
    onnxruntime 1.31): `export-train-step` wrote a step onnxruntime refuses to load, exit 0, and
    `train` failed with "unexpected Fail ... please report it"."""
    from onnxgrad.runtime import newest_opset
    if newest_opset() >= onnx.defs.onnx_opset_version():
        pytest.skip("this onnxruntime runs every opset this onnx knows")
    m = classifier()
    m.opset_import[0].version = newest_opset() + 1
    m.ir_version = 13
    onnx.save(m, tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((8, 4)).astype(np.float32),
             y=rng.integers(0, 3, 8))
    model = str(tmp_path / "m.onnx")
    argv = ["train", model, "--data", str(tmp_path / "d.npz"), "--no-progress"] \
        if command == "train" else ["export-train-step", model]
    argv += ["--loss", "cross_entropy", "-o", str(tmp_path / "o.onnx")]
    argv += ["--target", "web"] if command == "web" else []
    assert main(argv) == 2
    assert f"runs up to opset {newest_opset()}" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["d.npz", "m.onnx"]


def test_an_output_naming_a_folder_by_its_separator_is_refused_before_the_run(tmp_path, capsys):
    """(Found reviewing the output checks.) `train ... -o newdir/` trained to the end and then
    refused to write, the trained weights lost."""
    (tmp_path / "clf.onnx").write_bytes(classifier().SerializeToString())
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((8, 4)).astype(np.float32),
             y=rng.integers(0, 3, 8))
    before = _files(tmp_path)
    assert main(["train", str(tmp_path / "clf.onnx"), "--loss", "cross_entropy", "--data",
                 str(tmp_path / "d.npz"), "--no-progress", "-o",
                 str(tmp_path / "newdir") + os.sep]) == 2
    err = capsys.readouterr()
    assert "ends with a separator" in err.err and "training" not in err.out
    assert _files(tmp_path) == before
