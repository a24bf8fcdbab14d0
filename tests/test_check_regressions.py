"""check_gradients / ``onnxgrad check``: stop_gradients held constant in the finite differences,
ONNX RNN ops at float64 (onnxruntime's run-time refusals fall back), and argument checking."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper as H
from onnx import numpy_helper as NH

import onnxgrad
from onnxgrad.check import check_gradients, to_float64
from onnxgrad.cli import main
from onnxgrad.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError
from onnxgrad.runtime import runner

D = TP.DOUBLE


def _model(nodes, inputs, outputs, inits=(), opset=18):
    vi = H.make_tensor_value_info
    g = H.make_graph(nodes, "g", [vi(n, D, s) for n, s in inputs],
                     [vi(n, D, s) for n, s in outputs], list(inits))
    return H.make_model(g, opset_imports=[H.make_opsetid("", opset)], ir_version=10)


def _sin_times_x():  # y = s * x with s = sin(x): d/dx with s held constant is sin(x)
    return _model([H.make_node("Sin", ["x"], ["s"]), H.make_node("Mul", ["s", "x"], ["y"])],
                  [("x", [3])], [("y", [3])])


X = np.array([0.3, -1.2, 2.0])


# -- stop_gradients ---------------------------------------------------------------------------
def test_check_holds_a_stopped_intermediate_constant():
    """The finite differences of the total derivative (sin x + x cos x) made a correct partial
    derivative a FAIL (rel err 0.9)."""
    report = check_gradients(_sin_times_x(), "y", "x", {"x": X}, stop_gradients=["s"])
    assert report.ok, str(report)
    cot, = report.cotangents.values()  # (the gradient checked is that of sum(cot * y))
    np.testing.assert_allclose(report.results[0].grad, cot * np.sin(X), rtol=1e-12)
    assert check_gradients(_sin_times_x(), "y", "x", {"x": X}).ok  # (nothing held: the total)


def test_check_held_values_are_those_at_the_feeds():
    """A stop given as one string, on a tensor that is also a y: the y is the constant fed."""
    m = _sin_times_x()
    report = check_gradients(m, ["y", "s"], "x", {"x": X}, stop_gradients="s")
    assert report.ok, str(report)


def test_check_stopped_x_is_still_varied():
    """README: with b = 2a, y = a + b, stop=[a, b] gives dy/da = 1 (a varies, b does not)."""
    m = _model([H.make_node("Add", ["a", "a"], ["b"]), H.make_node("Add", ["a", "b"], ["y"])],
               [("a", [2])], [("y", [2])])
    report = check_gradients(m, "y", "a", {"a": np.array([1.0, 2.0])}, stop_gradients=["a", "b"])
    assert report.ok, str(report)
    cot, = report.cotangents.values()
    np.testing.assert_allclose(report.results[0].grad, cot)
    report = check_gradients(m, "y", "a", stop_gradients=["a"])  # (b follows a: 3)
    assert report.ok, str(report)
    np.testing.assert_allclose(report.results[0].grad, 3 * report.cotangents["__cotangent_0"])


def test_check_holds_the_metadata_stops_constant():
    """The model's onnxgrad.stop_gradients list (a converted StopGradient) is honoured by
    gradients(), so the finite differences hold those tensors constant too."""
    m = _sin_times_x()
    H.set_model_props(m, {onnxgrad.autodiff.STOP_GRADIENTS_KEY: '["s"]'})
    assert check_gradients(m, "y", "x", {"x": X}).ok


def test_check_cli_stop_exits_0(tmp_path, capsys):
    onnx.save(_sin_times_x(), tmp_path / "m.onnx")
    np.savez(tmp_path / "f.npz", x=X)
    rc = main(["check", str(tmp_path / "m.onnx"), "--ys", "y", "--xs", "x", "--stop", "s",
               "--feeds", str(tmp_path / "f.npz")])
    out = capsys.readouterr().out
    assert rc == 0 and "all gradients match" in out, out


def test_check_refuses_a_stop_inside_a_subgraph():
    """A tensor of an If branch has no single value to hold: refused, naming it."""
    vi = H.make_tensor_value_info
    then = H.make_graph([H.make_node("Sin", ["x"], ["t"]), H.make_node("Mul", ["t", "x"], ["o"])],
                        "then", [], [vi("o", D, [3])])
    other = H.make_graph([H.make_node("Identity", ["x"], ["o2"])], "else", [], [vi("o2", D, [3])])
    g = H.make_graph([H.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                     [vi("c", TP.BOOL, []), vi("x", D, [3])], [vi("y", D, [3])])
    m = H.make_model(g, opset_imports=[H.make_opsetid("", 18)], ir_version=10)
    with pytest.raises(UnsupportedError, match="stop_gradients names 't'.*inside an If"):
        check_gradients(m, "y", "x", {"c": np.array(True), "x": X}, stop_gradients=["t"])


# -- ONNX RNN ops at float64 --------------------------------------------------------------------
def _rnn(op):
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    rng = np.random.default_rng(0)
    F = TP.FLOAT

    def w(name, *shape):
        return NH.from_array((0.5 * rng.standard_normal(shape)).astype(np.float32), name)
    g = H.make_graph([H.make_node(op, ["X", "W", "R", "B"], ["Y"], hidden_size=3),
                      H.make_node("ReduceSum", ["Y"], ["y"], keepdims=0)], "g",
                     [H.make_tensor_value_info("X", F, [3, 2, 2])],
                     [H.make_tensor_value_info("y", F, [])],
                     [w("W", 1, gates * 3, 2), w("R", 1, gates * 3, 3), w("B", 1, gates * 6)])
    return H.make_model(g, opset_imports=[H.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_check_onnx_rnn_ops_at_float64(op):
    """onnxruntime loads a float64 LSTM/GRU but refuses it when run ("does not support double
    yet"), and has no float64 RNN, whose backward's reverse Scans onnx.reference cannot run."""
    report = check_gradients(_rnn(op), "y", ["X", "W", "R", "B"])
    assert report.ok, str(report)
    assert all(r.checked for r in report.results)


def test_runner_falls_back_when_a_kernel_refuses_at_run_time():
    m = to_float64(_rnn("LSTM"))
    x = np.random.default_rng(1).standard_normal((3, 2, 2))
    got = runner(m)({"X": x}, ["y"])[0]
    want = runner(m, "reference")({"X": x}, ["y"])[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12)


# -- arguments ---------------------------------------------------------------------------------
def _sin():
    return _model([H.make_node("Sin", ["x"], ["y"])], [("x", [3])], [("y", [3])])


@pytest.mark.parametrize("kw, err, needle", [
    ({"feeds": {"x": 1.0}}, InvalidArgumentError, r"feeds\['x'\] has shape \[\].*rank 1"),
    ({"feeds": {"x": np.ones((1, 3))}}, InvalidArgumentError, r"feeds\['x'\] has shape \[1, 3\]"),
    ({"feeds": {"x": np.ones(3), "nope": np.ones(3)}}, InvalidArgumentError,
     "feeds 'nope' is not an input"),
    ({"feeds": {"x": np.array([1.0, np.nan, 2.0])}}, InvalidArgumentError,
     r"feeds\['x'\] holds NaN at index \[1\]: an x must not be NaN"),
    ({"feeds": {"x": ["a", "b", "c"]}}, InvalidArgumentError, r"feeds\['x'\] holds <U1"),
    ({"feeds": [np.ones(3)]}, ArgumentTypeError, "feeds must be a dict"),
    ({"dtype": "float16"}, InvalidArgumentError, "dtype='float16'"),
    ({"dtype": "int8"}, InvalidArgumentError, "dtype='int8'"),
    ({"runtime": "torch"}, InvalidArgumentError, "runtime='torch'"),
    ({"seed": -1}, InvalidArgumentError, "seed=-1"),
    ({"directions": 0, "max_elements": 0}, InvalidArgumentError, "directions=0"),
    ({"max_elements": -1}, InvalidArgumentError, "max_elements=-1"),
    ({"eps": 0.0}, InvalidArgumentError, "eps=0.0"),
    ({"rtol": float("nan")}, InvalidArgumentError, "rtol=nan"),
])
def test_check_refuses_bad_arguments_naming_them(kw, err, needle):
    with pytest.raises(err, match=needle):
        check_gradients(_sin(), "y", "x", **kw)


def test_check_refuses_unknown_xs_as_an_onnxgrad_error():
    with pytest.raises(InvalidArgumentError, match=r"xs \['nope'\] are not graph inputs"):
        check_gradients(_sin(), "y", ["x", "nope"])


def test_check_takes_feeds_as_lists_and_numpy_dtype_names():
    """A list is an array of the input's dtype; np.float64 names the float64 check."""
    report = check_gradients(_sin(), "y", "x", {"x": [0.5, 1.0, -2.0]}, dtype=np.float64)
    assert report.ok and report.dtype == "float64"
    assert report.feeds["x"].dtype == np.float64
    report = check_gradients(_sin(), "y", "x", {"x": [0.5, 1.0, -2.0]}, dtype="float32")
    assert report.ok, str(report)


def test_check_reports_non_finite_values_as_such():
    """A NaN in an input that is not an x makes the ys NaN: a FAIL that says so, not one with
    'max abs err 0'. An infinity may be meant (a -inf mask, even as an x: its gradient is 0)."""
    m = _model([H.make_node("Add", ["x", "m"], ["t"]), H.make_node("Exp", ["t"], ["y"])],
               [("x", [3]), ("m", [3])], [("y", [3])])
    report = check_gradients(m, "y", "x", {"x": X, "m": np.array([0.0, np.nan, 0.0])})
    assert not report.ok and np.isnan(report.results[0].max_abs_err)
    assert "not finite" in str(report)
    report = check_gradients(m, "y", ["x", "m"], {"x": X, "m": np.array([0.0, -np.inf, 0.0])})
    assert report.ok, str(report)


# -- what the figures cannot say ----------------------------------------------------------------
def test_check_says_an_empty_x_checked_nothing_but_its_gradient_shape():
    """An x with no elements passed with '0 probes' and nothing else said."""
    m = _model([H.make_node("Mul", ["x", "x"], ["y"])], [("x", [0, 3])], [("y", [0, 3])])
    report = check_gradients(m, "y", "x", {"x": np.zeros((0, 3))})
    (r,) = report.results
    assert r.ok and r.checked == 0 and r.grad.shape == (0, 3)
    assert "x has no elements" in str(report)


def _tampered(real, op, operand):
    """``real`` (gradients()) with its first gradient passed through ``op`` with the constant
    ``operand``, as a faulty rule would give it."""
    def tampered(*a, **k):
        res = real(*a, **k)
        g = res.model.graph
        (out,) = [o for o in g.output if o.name == res.grads[0]]
        g.node.append(H.make_node(op, [out.name + "_", "__operand"], [out.name]))
        for n in g.node[:-1]:
            n.output[:] = [o + "_" if o == out.name else o for o in n.output]
        g.initializer.append(NH.from_array(operand, "__operand"))
        del out.type.tensor_type.shape.dim[:]
        return res
    return tampered


def test_check_fails_a_gradient_of_another_shape(monkeypatch):
    """A gradient of x's size but another shape ([3, 1] for x [1, 3]) broadcast against the probes
    and was compared with numbers it does not hold."""
    import onnxgrad.check as check
    monkeypatch.setattr(check, "gradients",
                        _tampered(check.gradients, "Reshape", np.array([3, 1], np.int64)))
    m = _model([H.make_node("Mul", ["x", "x"], ["y"])], [("x", [1, 3])], [("y", [1, 3])])
    report = check_gradients(m, "y", "x", {"x": np.array([[1.0, 2.0, 3.0]])})
    assert not report.ok
    assert "the gradient has shape [3, 1], x has [1, 3]" in str(report)


# -- the step on large values ----------------------------------------------------------------
@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(exponent=st.integers(-3, 15), sign=st.sampled_from([1.0, -1.0]),
       wrong=st.sampled_from([None, 0.9, 1.1]), seed=st.integers(0, 2**16))
def test_check_judges_the_step_x_actually_took(exponent, sign, wrong, seed):
    """x + eps rounds on large values (5.9e8 + 1e-6 is off by 6 %, the spacing there being
    1.2e-7): central differences over 2 eps then made the correct gradient of sin(x) a FAIL.
    The analytic slope is taken along the step x took; a gradient off by 10 % still fails; a
    step that vanishes against x fails with a note, having compared nothing."""
    import onnxgrad.check as check
    x = sign * np.random.default_rng(seed).uniform(1, 10, 3) * 10.0 ** exponent
    m = _model([H.make_node("Sin", ["x"], ["y"])], [("x", [3])], [("y", [3])])
    with pytest.MonkeyPatch.context() as mp:
        if wrong is not None:  # a faulty rule: the gradient times ``wrong``
            mp.setattr(check, "gradients", _tampered(check.gradients, "Mul", np.array(wrong)))
        report = check_gradients(m, "y", "x", {"x": x})
    vanishes = np.any(x + 1e-6 == x - 1e-6)
    assert report.ok == (wrong is None and not vanishes), str(report)
    assert ("vanishes" in str(report)) == bool(vanishes)


# -- a training-mode BatchNormalization's statistics -------------------------------------------
@pytest.mark.parametrize("opset", [13, 15])
def test_check_runs_a_training_batchnorm_with_statistics_of_its_own(opset):
    """onnxruntime writes a training-mode BatchNormalization's updated statistics over its
    inputs: the check's finite differences ran the model itself, whose running_var initializer
    moved on every run, so a loss through running_var drifted and correct gradients FAILed
    (max abs err 2.5e3). The statistics are inputs of their own in the check's copy: ok, and the
    model's initializers unchanged."""
    rng = np.random.default_rng(0)
    inits = [NH.from_array(rng.random(3) + 0.5, "s"), NH.from_array(np.zeros(3), "b"),
             NH.from_array(np.zeros(3), "rm"), NH.from_array(np.ones(3), "rv")]
    if opset >= 14:
        bn = H.make_node("BatchNormalization", ["x", "s", "b", "rm", "rv"], ["y", "rm2", "rv2"],
                         training_mode=1, momentum=0.9)
    else:  # BatchNormalization-9: its statistics outputs mean training
        bn = H.make_node("BatchNormalization", ["x", "s", "b", "rm", "rv"],
                         ["y", "rm2", "rv2", "sm", "sv"], momentum=0.9)
    m = _model([bn, H.make_node("Tanh", ["y"], ["t"]), H.make_node("Mul", ["t", "y"], ["p"]),
                H.make_node("ReduceSum", ["p"], ["a"], keepdims=0),
                H.make_node("ReduceSum", ["rv2"], ["v"], keepdims=0),
                H.make_node("Add", ["a", "v"], ["loss"])],
               [("x", [4, 3, 5])], [("loss", [])], inits, opset=opset)
    before = m.SerializeToString()
    report = check_gradients(m, "loss", ["x", "s"], {"x": rng.standard_normal((4, 3, 5))})
    assert report.ok, str(report)
    assert m.SerializeToString() == before


# -- the float64 oracle where onnxruntime has no float64 kernel -----------------------------------
@st.composite
def _reference_run_ops(draw):
    """(node, input shapes, opset, exact): one op onnxruntime has no float64 kernel for, so the
    float64 check runs it on onnx.reference, with drawn shapes and attributes. ``exact``: the
    reference is made exact for it (runtime._exact_ops); the rest may disagree with onnxruntime."""
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    hw = draw(st.lists(st.integers(3, 6), min_size=2, max_size=2))
    k = draw(st.lists(st.integers(1, 3), min_size=2, max_size=2))
    s = draw(st.lists(st.integers(1, 2), min_size=2, max_size=2))
    d = draw(st.lists(st.integers(1, 2), min_size=2, max_size=2))
    pads = [min(draw(st.integers(0, 1)), kk - 1) for kk in k + k]
    kind = draw(st.sampled_from(["LRN", "MVN", "ConvTranspose", "AveragePool", "LpPool"]))
    if kind == "LRN":
        node = H.make_node("LRN", ["x"], ["y"], size=draw(st.integers(1, 5)), alpha=0.3,
                           beta=draw(st.sampled_from([0.5, 0.75, 1.0])), bias=1.5)
        return node, [[n, c, *hw]], 13, True
    if kind == "MVN":
        axes = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True))
        node = H.make_node("MeanVarianceNormalization", ["x"], ["y"], axes=sorted(axes))
        return node, [[2, c, *hw]], 13, True  # (axes over size-1 dims only: std 0)
    if kind == "ConvTranspose":
        group = draw(st.sampled_from([1, 2]))
        attrs = dict(strides=s, dilations=d, group=group, pads=pads,
                     output_padding=[draw(st.integers(0, si - 1)) for si in s])
        if draw(st.booleans()):  # output_shape instead of pads: the spec's crop
            full = [si * (x - 1) + o + (kk - 1) * di + 1
                    for si, x, o, kk, di in zip(s, hw, attrs["output_padding"], k, d)]
            attrs = dict(strides=s, dilations=d, group=group,
                         output_shape=[f - draw(st.integers(0, 1)) for f in full])
        return H.make_node("ConvTranspose", ["x", "w"], ["y"], **attrs), \
            [[n, 2 * group, *hw], [2 * group, 2, *k]], 18, True
    common = dict(kernel_shape=k, strides=s, pads=pads, ceil_mode=draw(st.integers(0, 1)))
    if draw(st.booleans()):
        common["dilations"] = d
    if kind == "AveragePool":
        node = H.make_node("AveragePool", ["x"], ["y"], **common,
                           count_include_pad=draw(st.integers(0, 1)))
    else:
        node = H.make_node("LpPool", ["x"], ["y"], **common, p=draw(st.sampled_from([2, 3])))
    return node, [[n, c, *hw]], 19, False


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_reference_run_ops(), st.integers(0, 2**16))
def test_float64_check_never_blames_a_correct_gradient(case, seed):
    """onnx.reference computes LRN over the batch axis where N != C, fails on a grouped
    ConvTranspose and on MeanVarianceNormalization in float64, and computes LpPool with
    ceil_mode and dilations, and AveragePool with dilations, otherwise than onnxruntime: a
    correct gradient was reported FAIL, or the check raised the reference's own error. Now the
    float64 check is exact for the first three; otherwise its oracle is compared with
    onnxruntime's float32 run and, where they differ, the check refuses, naming float32; and
    the float32 check then passes."""
    node, shapes, opset, exact = case
    names = ["x", "w"][:len(shapes)]
    g = H.make_graph([node], "g", [H.make_tensor_value_info(k, TP.FLOAT, s)
                                   for k, s in zip(names, shapes)],
                     [H.make_tensor_value_info("y", TP.FLOAT, None)])
    m = H.make_model(g, opset_imports=[H.make_opsetid("", opset)], ir_version=9)
    rng = np.random.default_rng(seed)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in zip(names, shapes)}
    try:
        report = check_gradients(m, "y", names, feeds)
    except UnsupportedError as e:
        assert not exact and "dtype='float32'" in str(e), str(e)
        report = check_gradients(m, "y", names, feeds, dtype="float32")
    assert report.ok, str(report)


@pytest.mark.parametrize("stash", [None, 1])
@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_norm_with_its_stash_type_written_out_is_checked_in_float64(stash, axis):
    """torch.onnx's dynamo exporter writes LayerNormalization's stash_type=1 (the default):
    the float64 copy made it 11, a model no runtime runs (its Mean and InvStdDev are float or
    bfloat16 only), so check_gradients refused every such model ("neither onnxruntime nor
    onnx.reference can run")."""
    from onnx import TensorProto, helper, numpy_helper
    attrs = {"axis": axis} if stash is None else {"axis": axis, "stash_type": stash}
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], **attrs)], "ln",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 6])],
        [numpy_helper.from_array(rng.standard_normal([4, 6][axis:] if axis == 1 else [6])
                                 .astype(np.float32), n) for n in ("s", "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rep = check_gradients(m, ["y"], ["x", "s", "b"],
                          feeds={"x": rng.standard_normal((2, 4, 6)).astype(np.float32)})
    assert rep.ok, rep
