"""Gradient rules of onnxgrad/rules/norm.py.

Oracles: float64 central finite differences (assert_gradients), PyTorch autograd in float32 for the
ops PyTorch has, and small numpy / torch formulas written from the ONNX spec for the rest.

Runtime gaps worked around here:
- GroupNormalization (a function op) gets no output type from onnx shape inference, so the tests
  build its model with a typed output; GroupNormalization-18 is deprecated in onnx's checker, so
  its models are checked with finite differences only (onnxruntime still runs them).
- GroupNormalization-21 with the default stash_type computes in float32 even in the float64 copy
  the check makes (the attribute is not a dtype), so the float64 check uses stash_type=DOUBLE and
  the default stash_type is checked in float32.
- onnxruntime has no float64 LRN and only odd sizes; onnx.reference's LRN loops over the batch
  axis instead of the channels (right only when N == C), so LRN inputs have N == C.
- onnxruntime has no float64 MeanVarianceNormalization and onnx.reference expands its function
  with float32 constants, so MVN is checked in float32 (and against torch).
"""
import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import onnxgrad
from onnxgrad.check import check_gradients
from onnxgrad.runtime import run
from util import assert_gradients, grads_of, make_model, op_model

F, H, D = np.float32, np.float16, np.float64


def rng(seed=0):
    return np.random.default_rng(seed)


def positive(shape, seed=1):
    return (np.abs(rng(seed).standard_normal(shape)) + 0.5).astype(F)


def check(model, ys, xs, feeds=None, **kw):
    """assert_gradients, probing tensors of more than 8 elements along 3 random directions."""
    kw.setdefault("max_elements", 8)
    return assert_gradients(model, ys, xs, feeds, **kw)


def fd_only(model, ys, xs, feeds=None, **kw):
    """Finite differences without the checker / onnxruntime float32 pass of assert_gradients."""
    kw.setdefault("max_elements", 8)
    report = check_gradients(model, ys, xs, feeds, **kw)
    assert report.ok, str(report)
    return report


def typed_model(op, inputs, outputs, opset, strict=True, **attrs):
    """A one-node model whose outputs are declared {name: (np dtype, shape)} (for function ops
    that onnx shape inference gives no output type)."""
    vi = lambda n, t, s: helper.make_tensor_value_info(  # noqa: E731
        n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), s)
    g = helper.make_graph([helper.make_node(op, list(inputs), list(outputs), **attrs)], "test",
                          [vi(n, t, s) for n, (t, s) in inputs.items()],
                          [vi(n, t, s) for n, (t, s) in outputs.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return onnx.shape_inference.infer_shapes(m, strict_mode=True) if strict else m


def group_norm(opset, c=4, groups=2, dtype=F, batch="N", **attrs):
    p = c if opset >= 21 else groups
    return typed_model("GroupNormalization",
                       {"x": (dtype, [batch, c, 3, 2]), "s": (dtype, [p]), "b": (dtype, [p])},
                       {"y": (dtype, [batch, c, 3, 2])}, opset, num_groups=groups, **attrs)


def bn_inputs(dtype=F, shape=("N", 3, 4, 5)):
    c = shape[1]
    return {"x": (dtype, list(shape)), "s": (dtype, [c]), "b": (dtype, [c]), "m": (dtype, [c]),
            "v": (dtype, [c])}


# -- BatchNormalization ----------------------------------------------------------------------
@pytest.mark.parametrize("opset", [13, 15])
@pytest.mark.parametrize("shape", [("N", 3), ("N", 3, 4, 5)])
def test_batch_norm_inference_all_inputs(opset, shape):
    m = op_model("BatchNormalization", bn_inputs(shape=shape), opset=opset, epsilon=1e-3)
    check(m, "y", ["x", "s", "b", "m", "v"], feeds={"v": positive(3)})


@pytest.mark.parametrize("shape", [("N", 3), ("N", 3, 5), ("N", 3, 4, 5), (5, 3, 4, 5), (5, 3)])
@pytest.mark.parametrize("eps", [1e-5, 0.1])
def test_batch_norm_training(shape, eps):  # static shapes: the count is a number
    m = op_model("BatchNormalization", bn_inputs(shape=shape), n_out=3, opset=15,
                 training_mode=1, epsilon=eps, momentum=0.8)
    feeds = {"x": rng().standard_normal((5,) + shape[1:]).astype(F), "v": positive(3)}
    rep = check(m, "y0", ["x", "s", "b", "m", "v"], feeds=feeds)
    # the input statistics do not reach y in training mode
    assert not rep.results[3].grad.any() and not rep.results[4].grad.any()


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(rank=st.integers(2, 5), opset=st.sampled_from([13, 15]), double=st.booleans(),
       eps=st.sampled_from([1e-5, 0.1]), seed=st.integers(0, 2**16))
def test_batch_norm_training_versus_torch_generated(rank, opset, double, eps, seed):
    """Training-mode BatchNormalization (opset 15's training_mode, BatchNormalization-9's
    statistics outputs) against torch autograd in float64: dx, dscale, dB for a random
    cotangent, at every rank. dx's last step (a per-channel t * a + b) is one inference-mode
    BatchNormalization in float32 and float64 (mean 0, variance 1 - 2^-16, epsilon 2^-16).
    From opset 14 the node itself is replaced by its definition (batch statistics the backward
    reads): no training-mode node is left, and the forward's y and running statistics are
    torch's y and the spec's (biased variance)."""
    torch = pytest.importorskip("torch")
    r = np.random.default_rng(seed)
    shape = [int(d) for d in r.integers(1, 5, rank)]
    shape[0] = max(shape[0], 2)
    c, dt = shape[1], np.float64 if double else np.float32
    ins = bn_inputs(dt, tuple(["N"] + shape[1:]))
    if opset >= 14:
        m = op_model("BatchNormalization", ins, n_out=3, opset=opset, training_mode=1,
                     epsilon=eps, momentum=0.9)
        y, stats = "y0", ["y1", "y2"]
    else:
        outs = {"y": ins["x"], **{k: (dt, [c]) for k in ("rm", "rv", "sm", "sv")}}
        m = typed_model("BatchNormalization", ins, outs, opset, epsilon=eps, momentum=0.9)
        y, stats = "y", ["rm", "rv"]
    feeds = {"x": r.standard_normal(shape).astype(dt) * 2 + 1, "s": r.standard_normal(c).astype(dt),
             "b": r.standard_normal(c).astype(dt), "m": r.standard_normal(c).astype(dt),
             "v": r.uniform(0.5, 2, c).astype(dt)}
    cot = r.standard_normal(shape).astype(dt)
    res = onnxgrad.gradients(m, y, ["x", "s", "b"], grad_ys=["cot"])
    bns = [n for n in res.model.graph.node if n.op_type == "BatchNormalization"]
    training = [n for n in bns if any(a.name == "training_mode" and a.i for a in n.attribute)]
    assert len(bns) == 2 and not (opset >= 14 and training)  # (BN-9 has no training_mode)
    got = run(res.model, {**feeds, "cot": cot}, outputs=[y, *stats, *res.grads])
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in "xsb") for k, v in feeds.items()}
    out = torch.nn.functional.batch_norm(t["x"], t["m"].detach(), t["v"].detach(), t["s"], t["b"],
                                         training=True, momentum=0.1, eps=eps)
    want = torch.autograd.grad(out, [t["x"], t["s"], t["b"]], torch.tensor(cot, dtype=torch.float64))
    x64, axes = feeds["x"].astype(np.float64), tuple(i for i in range(rank) if i != 1)
    mom = float(np.float32(0.9))  # a float attribute
    want_stats = [feeds[k] * mom + f(x64, axis=axes) * (1 - mom)
                  for k, f in (("m", np.mean), ("v", np.var))]
    tol = 1e-9 if double else 2e-4
    for g, w in zip(got, [out.detach(), *want_stats, *want]):
        w = np.asarray(w)
        assert np.max(np.abs(g - w)) <= tol * (1 + np.max(np.abs(w))), (g, w)


def test_batch_norm_9_with_statistics_outputs_is_training():
    # before opset 14, a node with its optional outputs runs in training mode (onnxruntime)
    outs = {"y": (F, ["N", 3, 5]), **{k: (F, [3]) for k in ["rm", "rv", "sm", "sv"]}}
    m = typed_model("BatchNormalization", bn_inputs(shape=("N", 3, 5)), outs, 13)
    feeds = {"x": rng().standard_normal((4, 3, 5)).astype(F), "v": positive(3)}
    rep = check(m, "y", ["x", "s", "b", "m", "v"], feeds=feeds)
    assert not rep.results[3].grad.any() and not rep.results[4].grad.any()


@pytest.mark.parametrize("shape", [("N", 3), ("N", 3, 4, 5)])
def test_batch_norm_training_running_stats(shape):
    """running_mean = mean * momentum + mean_A(x) * (1 - momentum), and running_var likewise
    with the biased batch variance: their gradients reach x, mean and var."""
    m = op_model("BatchNormalization", bn_inputs(shape=shape), n_out=3, opset=15,
                 training_mode=1, momentum=0.7)
    feeds = {"x": rng().standard_normal((4,) + shape[1:]).astype(F), "v": positive(3)}
    check(m, ["y0", "y1", "y2"], ["x", "s", "b", "m", "v"], feeds=feeds)
    for y in ("y1", "y2"):  # each statistic on its own (the other's cotangent absent)
        check(m, y, ["x", "m", "v"], feeds=feeds)
    # numpy oracle: d/dmean, d/dvar are momentum; d running_var / dx = 0.3 * 2 (x - mu) / M
    x = feeds["x"].astype(np.float64)
    full = {**feeds, **{k: rng(i).standard_normal(3).astype(F) for i, k in enumerate("sbm")}}
    (gx, gm, gv), _ = grads_of(m, ["y1", "y2"], ["x", "m", "v"], full)
    axes = (0,) + tuple(range(2, x.ndim))
    cnt = x.size / 3
    mu = x.mean(axis=axes, keepdims=True)
    np.testing.assert_allclose(gm, np.full(3, 0.7), rtol=1e-6)
    np.testing.assert_allclose(gv, np.full(3, 0.7), rtol=1e-6)
    np.testing.assert_allclose(gx, 0.3 * (1 + 2 * (x - mu)) / cnt, rtol=1e-4, atol=1e-6)


def test_batch_norm_float16():
    m = op_model("BatchNormalization", bn_inputs(H), n_out=3, opset=15, training_mode=1)
    check(m, "y0", ["x", "s", "b"])
    m = op_model("BatchNormalization", bn_inputs(H), opset=15)
    check(m, "y", ["x", "s", "b", "m", "v"], feeds={"v": positive(3).astype(H)})


# -- InstanceNormalization, LayerNormalization, GroupNormalization, RMSNormalization ---------
@pytest.mark.parametrize("shape", [("N", 3, 7), ("N", 3, 4, 5)])
@pytest.mark.parametrize("dtype", [F, H])
def test_instance_norm(shape, dtype):
    c = shape[1]
    m = op_model("InstanceNormalization",
                 {"x": (dtype, list(shape)), "s": (dtype, [c]), "b": (dtype, [c])}, epsilon=1e-3)
    check(m, "y", ["x", "s", "b"])


LN_CASES = [(-1, [4]), (-2, [3, 4]), (1, [3, 4]), (2, [4]), (0, [2, 3, 4])]


@pytest.mark.parametrize("axis,pshape", LN_CASES)
@pytest.mark.parametrize("n_out", [1, 3])
def test_layer_norm(axis, pshape, n_out):
    x = [2, 3, 4] if axis == 0 else ["N", 3, 4]
    m = op_model("LayerNormalization", {"x": (F, x), "s": (F, pshape), "b": (F, pshape)},
                 n_out=n_out, axis=axis, epsilon=1e-3)
    check(m, "y" if n_out == 1 else "y0", ["x", "s", "b"])


def test_layer_norm_without_bias_and_through_its_statistics():
    # Mean and InvStdDev are outputs like any other: their gradients reach x too
    m = op_model("LayerNormalization", {"x": (F, ["N", 3, 4]), "s": (F, [4])}, n_out=3, axis=-1)
    check(m, ["y0", "y1", "y2"], ["x", "s"])
    check(m, ["y1"], ["x"])
    check(m, ["y2"], ["x"])


@pytest.mark.parametrize("outs", [["y", "", "inv"], ["y", "mean"], ["y", "", ""]])
def test_layer_norm_partial_outputs_reused(outs):
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], outs, axis=1)
    m = make_model([node], {"x": (F, ["N", 3, 4]), "s": (F, [3, 4]), "b": (F, [3, 4])},
                   [o for o in outs if o])
    check(m, "y", ["x", "s", "b"])
    res = onnxgrad.gradients(m, "y", ["x"])
    read = {i for n in res.model.graph.node if n.name.startswith("gradients/") for i in n.input}
    for o in outs[1:]:
        if o:  # the forward's statistics are reused, not recomputed
            assert o in read


def test_layer_norm_float16_computes_in_stash_type():
    m = op_model("LayerNormalization", {"x": (H, ["N", 3, 4]), "s": (H, [4]), "b": (H, [4])},
                 n_out=3)
    check(m, ["y0", "y2"], ["x", "s", "b"])
    res = onnxgrad.gradients(m, "y0", ["x"])
    casts = [a.i for n in res.model.graph.node if n.op_type == "Cast" for a in n.attribute]
    assert TensorProto.FLOAT in casts and TensorProto.FLOAT16 in casts


def test_layer_norm_float64_stays_float64():
    m = op_model("LayerNormalization", {"x": (D, ["N", 3, 4]), "s": (D, [4]), "b": (D, [4])},
                 n_out=3)
    check(m, ["y0"], ["x", "s", "b"])
    res = onnxgrad.gradients(m, "y0", ["x", "s", "b"])
    grad_nodes = [n for n in res.model.graph.node if n.name.startswith("gradients/")]
    # the float32 Mean/InvStdDev are not reused (recomputed in float64); nothing is narrowed
    assert all(a.i != TensorProto.FLOAT for n in grad_nodes if n.op_type == "Cast"
               for a in n.attribute)


@pytest.mark.parametrize("outs", [["y", "mean", "inv"], ["y", "", "inv"], ["y", "mean"]])
def test_layer_norm_float64_with_float32_statistics(outs):
    """A float64 node with the default stash_type outputs float32 Mean / InvStdDev; reusing
    them made the float64 gradient float32-accurate (here, x far from 0 against its spread:
    1e-4 relative off torch's float64 autograd). float64 in, float64 accuracy out: they are
    recomputed in float64. Oracles: torch float64 autograd to 1e-10, and float64 differences
    to 1e-6 (the forward itself, on onnxruntime and onnx.reference alike, keeps float32 bits
    with this stash_type: its y is off float64 by 1e-9, which differences magnify to 1.5e-7)."""
    torch = pytest.importorskip("torch")
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], outs, axis=-1)
    m = make_model([node], {"x": (D, ["N", 3, 5]), "s": (D, [5]), "b": (D, [5])},
                   [o for o in outs if o])
    assert m.graph.output[-1].type.tensor_type.elem_type == TensorProto.FLOAT  # the stash type
    rng = np.random.default_rng(4)
    feeds = {"x": 50.0 + 0.01 * rng.standard_normal((2, 3, 5)), "s": rng.standard_normal(5),
             "b": rng.standard_normal(5)}
    report = check_gradients(m, "y", ["x", "s", "b"], feeds, rtol=1e-6, atol=1e-9)
    assert report.ok, str(report)
    cot = rng.standard_normal((2, 3, 5))
    res = onnxgrad.gradients(m, "y", ["x", "s", "b"], grad_ys=["cot"])
    got = run(res.model, {**feeds, "cot": cot}, res.grads)
    t = [torch.tensor(feeds[k], requires_grad=True) for k in ("x", "s", "b")]
    y = torch.nn.functional.layer_norm(t[0], (5,), t[1], t[2], eps=float(np.float32(1e-5)))
    for a, w in zip(got, torch.autograd.grad(y, t, torch.tensor(cot))):
        np.testing.assert_allclose(a, w.numpy(), rtol=1e-10, atol=1e-10 * np.abs(w.numpy()).max())
    res = onnxgrad.gradients(m, "y", ["x"])
    read = {i for nd in res.model.graph.node if nd.name.startswith("gradients/") for i in nd.input}
    assert not read & {"mean", "inv"}


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(rank=st.integers(2, 4), axis_from_end=st.integers(1, 4),
       kind=st.sampled_from(["f32", "f16", "f64"]), stats=st.booleans(),
       seed=st.integers(0, 2**16))
def test_layer_norm_versus_torch_generated(rank, axis_from_end, kind, stats, seed):
    """LayerNormalization against torch autograd in float64: y, dx, dscale, dB for a random
    cotangent, over rank, axis and dtype, with and without the Mean / InvStdDev outputs. A node
    without them whose statistics (float32, the stash type) are as wide as the gradient's
    dtype (float32, float16) is replaced by the same node with them: the backward reads them
    and nothing recomputes the statistics; a float64 node keeps its form and recomputes them in
    float64."""
    torch = pytest.importorskip("torch")
    r = np.random.default_rng(seed)
    axis = rank - min(axis_from_end, rank)
    shape = [int(d) for d in r.integers(1, 5, rank)]
    dt = {"f32": np.float32, "f16": np.float16, "f64": np.float64}[kind]
    m = op_model("LayerNormalization", {"x": (dt, shape), "s": (dt, shape[axis:]),
                                        "b": (dt, shape[axis:])}, n_out=3 if stats else 1,
                 axis=axis, epsilon=1e-3)
    y = "y0" if stats else "y"
    feeds = {"x": (r.standard_normal(shape) * 2 + 1).astype(dt),
             "s": r.standard_normal(shape[axis:]).astype(dt),
             "b": r.standard_normal(shape[axis:]).astype(dt)}
    cot = r.standard_normal(shape).astype(dt)
    res = onnxgrad.gradients(m, y, ["x", "s", "b"], grad_ys=["cot"])
    lns = [n for n in res.model.graph.node if n.op_type == "LayerNormalization"]
    assert len(lns) == 1
    assert (len([o for o in lns[0].output if o]) == 3) == (kind != "f64" or stats)
    # the backward's two means of ĝ terms, and two more where it recomputes mean and variance
    means = [n for n in res.model.graph.node if n.op_type == "ReduceMean"]
    assert len(means) == (4 if kind == "f64" else 2)
    got = run(res.model, {**feeds, "cot": cot}, outputs=[y, *res.grads])
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in feeds.items()}
    out = torch.nn.functional.layer_norm(t["x"], shape[axis:], t["s"], t["b"], eps=1e-3)
    want = [out.detach()] + list(torch.autograd.grad(out, [t["x"], t["s"], t["b"]],
                                                      torch.tensor(cot, dtype=torch.float64)))
    tol = {"f32": 2e-4, "f16": 2e-2, "f64": 1e-6}[kind]  # (f64: float32 forward statistics)
    for g, w in zip(got, want):
        w = w.numpy()
        assert np.max(np.abs(g - w)) <= tol * (1 + np.max(np.abs(w))), (kind, g, w)


@pytest.mark.parametrize("second", [["z"], ["z", "", ""], ["z", "zm", "zi"]])
def test_layer_norms_on_one_x_load_at_every_level(second):
    """Two LayerNormalizations on the same x, the first off the loss's path, with one output,
    empty optional outputs or all three: onnxruntime's common subexpression elimination merges
    such nodes whatever outputs each has, and failed to load a gradient model in which the rule
    had given one of them Mean and InvStdDev while the other kept empty output slots (a model
    function's body recomputed beside its call: test_function_bodies_with_unnamed_outputs in
    test_fuzz_regressions.py). The rule gives them none where another LayerNormalization or a
    function call reads x; the gradient loads at ORT_ENABLE_ALL and matches finite
    differences."""
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("LayerNormalization", ["x", "s", "b"], second, axis=-1),
             helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1),
             helper.make_node("Tanh", ["y"], ["p"])]
    m = helper.make_model(helper.make_graph(
        nodes, "g", [vi("x", TensorProto.FLOAT, ["N", 3, 4]), vi("s", TensorProto.FLOAT, [4]),
                     vi("b", TensorProto.FLOAT, [4])],
        [vi("p", TensorProto.FLOAT, None), vi("z", TensorProto.FLOAT, None)]),
        opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    assert_gradients(m, "p", ["x", "s", "b"])


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_group_norm_21(groups):
    m = group_norm(21, groups=groups, stash_type=TensorProto.DOUBLE, epsilon=1e-3)
    check(m, "y", ["x", "s", "b"])
    # the default stash_type (float32) runs the forward in float32, even in float64 copies
    check(group_norm(21, groups=groups), "y", ["x", "s", "b"], dtype="float32")


def test_group_norm_21_float16():
    check(group_norm(21, dtype=H, stash_type=TensorProto.DOUBLE), "y", ["x", "s", "b"])


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_group_norm_18_per_group_scale(groups):
    fd_only(group_norm(18, groups=groups, epsilon=1e-3), "y", ["x", "s", "b"])


@pytest.mark.parametrize("axis,pshape", [(-1, [4]), (-2, [3, 4]), (1, [3, 4]), (0, [2, 3, 4])])
def test_rms_norm(axis, pshape):
    x = [2, 3, 4] if axis == 0 else ["N", 3, 4]
    m = op_model("RMSNormalization", {"x": (F, x), "s": (F, pshape)}, opset=23, axis=axis,
                 epsilon=1e-3)
    check(m, "y", ["x", "s"])


def test_rms_norm_float16():
    m = op_model("RMSNormalization", {"x": (H, ["N", 3, 4]), "s": (H, [4])}, opset=23)
    check(m, "y", ["x", "s"])


# -- LpNormalization, MeanVarianceNormalization, LRN -----------------------------------------
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_lp_norm(p, axis):
    m = op_model("LpNormalization", {"x": (F, ["N", 3, 4])}, p=p, axis=axis)
    check(m, "y", ["x"], feeds={"x": rng(3).standard_normal((2, 3, 4)).astype(F)})


@pytest.mark.parametrize("axes", [[0, 2, 3], [1], [2, 3], [-1]])
def test_mean_variance_norm(axes):
    m = op_model("MeanVarianceNormalization", {"x": (F, ["N", 3, 4, 5])}, axes=axes)
    check(m, "y", ["x"], dtype="float32")


def test_mean_variance_norm_default_axes():
    # onnx shape inference fails on MVN's function without an explicit axes: skip it
    m = typed_model("MeanVarianceNormalization", {"x": (F, ["N", 3, 4, 5])},
                    {"y": (F, ["N", 3, 4, 5])}, 13, strict=False)
    x = rng().standard_normal((2, 3, 4, 5)).astype(F)
    (g,), _ = grads_of(m, "y", ["x"], {"x": x, "gy": x[::-1].copy()}, grad_ys=["gy"])
    want = torch_grads(lambda t: mvn_torch(t, [0, 2, 3]), [x], x[::-1].copy())[0]
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


LRN_X = rng(5).standard_normal((5, 5, 3, 2)).astype(F)  # N == C (see the module docstring)


@pytest.mark.parametrize("size", [1, 3, 5, 7])
def test_lrn(size):
    m = op_model("LRN", {"x": (F, ["N", 5, 3, 2])}, size=size, alpha=0.5, beta=0.7, bias=1.5)
    check(m, "y", ["x"], feeds={"x": LRN_X})


@pytest.mark.parametrize("size", [2, 4])
def test_lrn_even_size(size):
    # the window is [c - floor((size-1)/2), c + ceil((size-1)/2)]: asymmetric for even sizes
    # (alpha, beta, bias exact in float32, as the attributes are stored)
    attrs = dict(size=size, alpha=0.5, beta=0.625, bias=1.5)
    fd_only(op_model("LRN", {"x": (F, ["N", 5, 3, 2])}, **attrs), "y", ["x"], feeds={"x": LRN_X})
    gy = rng(6).standard_normal(LRN_X.shape)
    res = onnxgrad.gradients(op_model("LRN", {"x": (D, ["N", 5, 3, 2])}, **attrs), "y", ["x"],
                             grad_ys=["gy"])
    g, = run(res.model, {"x": LRN_X.astype(D), "gy": gy}, [res.grads[0]], prefer="reference")
    want = torch_grads(lambda t: lrn_spec(t, size, 0.5, 0.625, 1.5), [LRN_X.astype(D)], gy)[0]
    np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-12)


# -- Dropout ---------------------------------------------------------------------------------
def dropout_model(ins, outs, inits=None):
    types = {"x": (F, ["N", 3, 20]), "ratio": (F, []), "t": (np.bool_, [])}
    node = helper.make_node("Dropout", ins, outs, seed=3)
    return make_model([node], {k: types[k] for k in ins if k and k not in (inits or {})},
                      [o for o in outs if o], inits=inits, opset=13)


X = rng(7).standard_normal((2, 3, 20)).astype(F)
GY = rng(8).standard_normal((2, 3, 20)).astype(F)


@pytest.mark.parametrize("ins,inits", [
    (["x"], None), (["x", "ratio"], {"ratio": np.array(0.3, F)}),
    (["x", "ratio", "t"], {"ratio": np.array(0.3, F), "t": np.array(False)})])
@pytest.mark.parametrize("mask", [False, True])
def test_dropout_inference_is_identity(ins, inits, mask):
    m = dropout_model(ins, ["y", "mask"] if mask else ["y"], inits)
    (g,), _ = grads_of(m, "y", ["x"], {"x": X, "gy": GY}, grad_ys=["gy"])
    np.testing.assert_array_equal(g, GY)


@pytest.mark.parametrize("ratio", [None, 0.0, 0.3])
def test_dropout_training_reuses_mask(ratio):
    inits = {"t": np.array(True)}
    if ratio is not None:
        inits["ratio"] = np.array(ratio, F)
    m = dropout_model(["x", "ratio" if ratio is not None else "", "t"], ["y", "mask"], inits)
    res = onnxgrad.gradients(m, "y", ["x"], grad_ys=["gy"])
    g, mask = run(res.model, {"x": X, "gy": GY}, [res.grads[0], "mask"])
    keep = 1 - (0.5 if ratio is None else ratio)
    assert mask.dtype == np.bool_ and (ratio == 0.0 or 0 < mask.mean() < 1)
    np.testing.assert_allclose(g, GY * mask / keep, rtol=1e-6)


@pytest.mark.parametrize("training", [False, True])
def test_dropout_training_mode_and_ratio_at_run_time(training):
    m = dropout_model(["x", "ratio", "t"], ["y", "mask"])
    res = onnxgrad.gradients(m, "y", ["x"], grad_ys=["gy"])
    feeds = {"x": X, "gy": GY, "ratio": np.array(0.25, F), "t": np.array(training)}
    g, mask = run(res.model, feeds, [res.grads[0], "mask"])
    want = GY * mask / 0.75 if training else GY
    np.testing.assert_allclose(g, want, rtol=1e-6)


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("as_node", [False, True])
def test_dropout_training_with_constant_zero_ratio_is_identity(mask, as_node):
    """A training-mode Dropout whose ratio is a constant 0 (an exported Dropout(p=0)) keeps every
    element: its gradient is g itself, with no mask pass, and it needs no mask output."""
    inits = {"t": np.array(True)}
    if not as_node:
        inits["ratio"] = np.array(0.0, F)
    m = dropout_model(["x", "ratio", "t"], ["y", "mask"] if mask else ["y"], inits)
    if as_node:  # the ratio from a Constant node instead of an initializer
        ins = [i for i in m.graph.input if i.name != "ratio"]
        del m.graph.input[:]
        m.graph.input.extend(ins)
        m.graph.node.insert(0, helper.make_node("Constant", [], ["ratio"],
                                                value=helper.make_tensor("r", TensorProto.FLOAT, [], [0.0])))
    res = onnxgrad.gradients(m, "y", ["x"], grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    added = [n.op_type for n in res.model.graph.node if n.name.startswith("gradients/")]
    assert "Mul" not in added and "Cast" not in added, added
    y, g = run(res.model, {"x": X, "gy": GY}, ["y", res.grads[0]])
    np.testing.assert_array_equal(y, X)  # the forward keeps every element too
    np.testing.assert_array_equal(g, GY)
    # float64 central differences, and the float32 graph at ORT_ENABLE_ALL
    assert_gradients(m, "y", "x", {"x": X})


@pytest.mark.parametrize("inits", [{"t": np.array(True)}, None])
def test_dropout_training_without_mask_raises(inits):
    m = dropout_model(["x", "", "t"], ["y"], inits)
    with pytest.raises(NotImplementedError, match="mask output"):
        onnxgrad.gradients(m, "y", ["x"])


# -- Hardmax, OneHot -------------------------------------------------------------------------
def test_hardmax_gradient_is_zero():
    m = op_model("Hardmax", {"x": (F, ["N", 3, 4])}, axis=1)
    (g,), _ = grads_of(m, "y", ["x"], {"x": X[:, :, :4]})
    assert g.shape == (2, 3, 4) and not g.any()


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot_values(axis):
    idx = np.array([[0, 2, 3], [1, -1, 4]])
    m = op_model("OneHot", {"i": (np.int64, [2, 3]), "d": (np.int64, []), "v": (F, [2])},
                 axis=axis)
    feeds = {"i": idx, "d": np.array(4), "v": np.array([-0.5, 2.0], F)}
    rep = check(m, "y", ["v"], feeds=feeds)
    wrapped = np.where(idx < 0, idx + 4, idx)  # -1 is depth - 1; 4 is out of range: all off
    hot = np.eye(4)[np.clip(wrapped, 0, 3)] * ((wrapped >= 0) & (wrapped < 4))[..., None]
    hot = np.moveaxis(hot, -1, axis if axis >= 0 else 2)
    cot = next(iter(rep.cotangents.values()))
    np.testing.assert_allclose(rep.results[0].grad, [np.sum(cot * (1 - hot)), np.sum(cot * hot)])


# -- PyTorch autograd ------------------------------------------------------------------------
def torch_grads(fn, arrays, gy):
    torch = pytest.importorskip("torch")
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    y = fn(*ts)
    y.backward(torch.tensor(np.asarray(gy, dtype=arrays[0].dtype)))
    return [t.grad.numpy() for t in ts]


def mvn_torch(x, axes):
    m = x.mean(dim=axes, keepdim=True)
    return (x - m) / (((x - m) ** 2).mean(dim=axes, keepdim=True).sqrt() + 1e-9)


def lrn_spec(x, size, alpha, beta, bias):
    """ONNX LRN from its spec: window [c - floor((size-1)/2), c + ceil((size-1)/2)]."""
    import torch.nn.functional as tf
    c, lo = x.shape[1], (size - 1) // 2
    sq = tf.pad(x * x, (0, 0, 0, 0, lo, size - 1 - lo))
    return x / (bias + alpha / size * sum(sq[:, k:k + c] for k in range(size))) ** beta


def group_norm_18(x, s, b, groups, eps):
    n = x.shape[0]
    x3 = x.reshape(n, groups, -1)
    m = x3.mean(-1, keepdim=True)
    xh = (x3 - m) / ((x3 - m).pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return (xh * s[:, None] + b[:, None]).reshape(x.shape)


def _torch_cases():
    torch = pytest.importorskip("torch")
    tf = torch.nn.functional
    x4 = rng(11).standard_normal((3, 4, 5, 6)).astype(F)
    x3 = rng(12).standard_normal((3, 4, 6)).astype(F)
    c4 = [rng(13 + i).standard_normal(4).astype(F) for i in range(2)]
    var = positive(4, 15)
    ln_s = [rng(16 + i).standard_normal((5, 6)).astype(F) for i in range(2)]
    return {
        "batch_norm_eval": (
            op_model("BatchNormalization", bn_inputs(shape=("N", 4, 5, 6)), epsilon=1e-3),
            ["x", "s", "b"], [x4, *c4], {"m": c4[0] * 0.3, "v": var},
            lambda x, s, b: tf.batch_norm(x, torch.tensor(c4[0] * 0.3), torch.tensor(var), s, b,
                                          training=False, eps=1e-3)),
        "batch_norm_train": (
            op_model("BatchNormalization", bn_inputs(shape=("N", 4, 5, 6)), n_out=3, opset=15,
                     training_mode=1, epsilon=1e-3),
            ["x", "s", "b"], [x4, *c4], {"m": c4[0], "v": var},
            lambda x, s, b: tf.batch_norm(x, None, None, s, b, training=True, eps=1e-3)),
        "instance_norm": (
            op_model("InstanceNormalization",
                     {"x": (F, ["N", 4, 5, 6]), "s": (F, [4]), "b": (F, [4])}, epsilon=1e-3),
            ["x", "s", "b"], [x4, *c4], {},
            lambda x, s, b: tf.instance_norm(x, weight=s, bias=b, eps=1e-3)),
        "layer_norm": (
            op_model("LayerNormalization",
                     {"x": (F, ["N", 4, 5, 6]), "s": (F, [5, 6]), "b": (F, [5, 6])}, n_out=3,
                     axis=-2, epsilon=1e-3),
            ["x", "s", "b"], [x4, *ln_s], {},
            lambda x, s, b: tf.layer_norm(x, (5, 6), s, b, eps=1e-3)),
        "group_norm": (
            group_norm(21, c=4, groups=2, epsilon=1e-3), ["x", "s", "b"],
            [x4[:, :, :3, :2].copy(), *c4], {},
            lambda x, s, b: tf.group_norm(x, 2, s, b, eps=1e-3)),
        "group_norm_18": (
            group_norm(18, c=4, groups=2, epsilon=1e-3), ["x", "s", "b"],
            [x4[:, :, :3, :2].copy(), c4[0][:2], c4[1][:2]], {},
            lambda x, s, b: group_norm_18(x, s, b, 2, 1e-3)),
        "rms_norm": (
            op_model("RMSNormalization", {"x": (F, ["N", 4, 6]), "s": (F, [6])}, opset=23,
                     epsilon=1e-3),
            ["x", "s"], [x3, ln_s[0][0]], {},
            lambda x, s: tf.rms_norm(x, (6,), s, eps=1e-3)),
        "normalize_p1": (
            op_model("LpNormalization", {"x": (F, ["N", 4, 6])}, p=1, axis=1), ["x"], [x3], {},
            lambda x: tf.normalize(x, p=1, dim=1, eps=0.0)),
        "normalize_p2": (
            op_model("LpNormalization", {"x": (F, ["N", 4, 6])}, p=2, axis=-1), ["x"], [x3], {},
            lambda x: tf.normalize(x, p=2, dim=-1, eps=0.0)),
        "local_response_norm": (
            op_model("LRN", {"x": (F, ["N", 4, 5, 6])}, size=3, alpha=0.3, beta=0.75, bias=2.0),
            ["x"], [x4], {},
            lambda x: tf.local_response_norm(x, 3, alpha=0.3, beta=0.75, k=2.0)),
        "mean_variance_norm": (
            op_model("MeanVarianceNormalization", {"x": (F, ["N", 4, 5, 6])}, axes=[0, 2]),
            ["x"], [x4], {}, lambda x: mvn_torch(x, [0, 2])),
    }


TORCH_CASES = ["batch_norm_eval", "batch_norm_train", "instance_norm", "layer_norm",
               "group_norm", "group_norm_18", "rms_norm", "normalize_p1", "normalize_p2",
               "local_response_norm", "mean_variance_norm"]


@pytest.mark.parametrize("case", TORCH_CASES)
def test_against_torch(case):
    model, xs, arrays, extra, fn = _torch_cases()[case]
    y = model.graph.output[0].name
    y_shape, = run(model, {**dict(zip(xs, arrays)), **extra}, [y])
    gy = rng(21).standard_normal(np.shape(y_shape)).astype(F)
    res = onnxgrad.gradients(model, y, xs, grad_ys=["gy"])
    ours = run(res.model, {**dict(zip(xs, arrays)), **extra, "gy": gy}, res.grads)
    want = torch_grads(fn, arrays, gy)
    for name, got, ref in zip(xs, ours, want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(),
                                   err_msg=f"{case}: gradient of {name}")


@pytest.mark.parametrize("batch", [1, 4])
def test_symbolic_batch_at_run_time(batch):
    # one gradient graph, run at two batch sizes: counts and shapes come from the run time
    torch = pytest.importorskip("torch")
    m = op_model("BatchNormalization", bn_inputs(shape=("N", 3, 5)), n_out=3, opset=15,
                 training_mode=1)
    ln = op_model("LayerNormalization", {"x": (F, ["N", 3, 5]), "s": (F, [3, 5])}, n_out=3,
                  axis=1)
    x = rng(batch).standard_normal((batch, 3, 5)).astype(F)
    gy = rng(batch + 1).standard_normal((batch, 3, 5)).astype(F)
    s, b = positive(3), rng(2).standard_normal(3).astype(F)
    feeds = {"x": x, "s": s, "b": b, "m": b, "v": s, "gy": gy}
    (gx,), _ = grads_of(m, "y0", ["x"], feeds, grad_ys=["gy"])
    want = torch_grads(lambda t: torch.nn.functional.batch_norm(
        t, None, None, torch.tensor(s), torch.tensor(b), training=True), [x], gy)[0]
    np.testing.assert_allclose(gx, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    s2 = positive((3, 5))
    (gx,), _ = grads_of(ln, "y0", ["x"], {"x": x, "s": s2, "gy": gy}, grad_ys=["gy"])
    want = torch_grads(lambda t: torch.nn.functional.layer_norm(
        t, (3, 5), torch.tensor(s2), eps=1e-5), [x], gy)[0]
    np.testing.assert_allclose(gx, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# -- second order: the gradient graphs are themselves differentiable --------------------------
def second_order(model, y, xs, feeds=None, **kw):
    """Differentiate the gradient graph (cotangent gy fed at run time) once more."""
    res = onnxgrad.gradients(model, y, xs, grad_ys=["gy"])
    return check(res.model, res.grads, xs + ["gy"], feeds=feeds, **kw)


SECOND_ORDER = {
    "batch_norm_eval": lambda: (op_model("BatchNormalization", bn_inputs(), opset=15),
                                "y", ["x", "s", "m", "v"], {"v": positive(3)}),
    "batch_norm_train": lambda: (op_model("BatchNormalization", bn_inputs(), n_out=3, opset=15,
                                          training_mode=1), "y0", ["x", "s", "b"], None),
    "instance_norm": lambda: (op_model("InstanceNormalization", {
        "x": (F, ["N", 3, 5]), "s": (F, [3]), "b": (F, [3])}), "y", ["x", "s"], None),
    "layer_norm_stats_reused": lambda: (op_model("LayerNormalization", {
        "x": (F, ["N", 3, 4]), "s": (F, [3, 4]), "b": (F, [3, 4])}, n_out=3, axis=1),
        "y0", ["x", "s", "b"], None),
    "layer_norm": lambda: (op_model("LayerNormalization", {
        "x": (F, ["N", 3, 4]), "s": (F, [4])}, axis=-1), "y", ["x", "s"], None),
    "group_norm": lambda: (group_norm(21, stash_type=TensorProto.DOUBLE), "y", ["x", "s"], None),
    "rms_norm": lambda: (op_model("RMSNormalization", {"x": (F, ["N", 3, 4]), "s": (F, [4])},
                                  opset=23), "y", ["x", "s"], None),
    "lp_norm_p1": lambda: (op_model("LpNormalization", {"x": (F, ["N", 3, 4])}, p=1), "y", ["x"],
                           None),
    "lp_norm_p2": lambda: (op_model("LpNormalization", {"x": (F, ["N", 3, 4])}, p=2, axis=1), "y",
                           ["x"], None),
    "lrn": lambda: (op_model("LRN", {"x": (F, ["N", 5, 3, 2])}, size=3, alpha=0.5, beta=0.7,
                             bias=1.5), "y", ["x"], {"x": LRN_X, "gy": LRN_X[::-1].copy()}),
    # float32 only (see the module docstring)
    "mean_variance_norm": lambda: (op_model("MeanVarianceNormalization", {
        "x": (F, ["N", 3, 4, 5])}, axes=[0, 2]), "y", ["x"], None, {"dtype": "float32"}),
}


@pytest.mark.parametrize("case", list(SECOND_ORDER))
def test_second_order(case):
    model, y, xs, feeds, *kw = SECOND_ORDER[case]()
    second_order(model, y, xs, feeds, **(kw[0] if kw else {}))
