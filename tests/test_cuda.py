"""onnxruntime's CUDA provider: the forms onnxgrad rewrites for it (checked here on the CPU,
against onnxruntime's own kernels) and, where a GPU is present, training on it against the CPU.

Found on an H200 (onnxruntime-gpu 1.31): training-mode BatchNormalization does not load on
CUDA from opset 14; a host scalar bound to a CUDA session is copied when bound, so every step
after the first read lr 0 and went NaN; float32 ran in TF32 (a CudnnRNN gradient 4 % off)."""
from __future__ import annotations

import functools
import os

import numpy as np
import onnx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import onnxgrad
from onnxgrad import runtime
from onnxgrad.cuda_forms import for_cuda, has_forms
from onnxgrad.errors import UnsupportedError


def cpu(model, feeds, outputs=None):
    return runtime.session(model, "cpu").run(outputs, feeds)


@functools.cache
def _cuda() -> bool:
    return runtime.cuda_available()


def form_runs(form, feeds, outputs=None):
    """The form's outputs on onnxruntime CPU and, where a CUDA session can be created, on CUDA
    too: what a CUDA session runs is the form, so a GPU machine checks it there as well."""
    devices = ["cpu", "cuda"] if _cuda() else ["cpu"]
    return [runtime.session(form, d).run(outputs, feeds) for d in devices]


def bn_model(shape, opset, dtype, momentum, eps, symbolic=True):
    C = shape[1]
    n = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"],
                         ["y", "rm", "rv"], training_mode=1, momentum=momentum,
                         epsilon=eps)
    xdims = (["N"] if symbolic else [shape[0]]) + list(shape[1:])
    g = helper.make_graph(
        [n], "bn", [helper.make_tensor_value_info("x", dtype, xdims)] +
        [helper.make_tensor_value_info(k, dtype, [C]) for k in "sbmv"],
        [helper.make_tensor_value_info(k, dtype, d)
         for k, d in [("y", xdims), ("rm", [C]), ("rv", [C])]])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rank=st.integers(2, 5), opset=st.sampled_from([14, 15, 17, 18, 21]),
       dtype=st.sampled_from([TP.FLOAT, TP.DOUBLE]), momentum=st.floats(0.0, 1.0),
       eps=st.sampled_from([1e-5, 1e-3, 0.1]),
       symbolic=st.booleans(), seed=st.integers(0, 2**16))
def test_batchnorm_training_form_matches_onnxruntime(rank, opset, dtype, momentum, eps, symbolic,
                                                      seed):
    """The written-out training BatchNormalization gives onnxruntime CPU's own outputs (Y and
    both running statistics), at every rank, opset, dtype and momentum."""
    rng = np.random.default_rng(seed)
    shape = [int(d) for d in rng.integers(1, 5, rank)]
    shape[0] = max(shape[0], 2)
    m = bn_model(shape, opset, dtype, momentum, eps, symbolic=symbolic)
    before = m.SerializeToString()
    f = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    feeds = {"x": rng.standard_normal(shape).astype(f) * 3 + 1,
             **{k: rng.uniform(0.5, 2, shape[1]).astype(f) for k in "sbmv"}}
    form = for_cuda(m)
    assert m.SerializeToString() == before  # the input model is not changed
    assert not any(n.op_type == "BatchNormalization" for n in form.graph.node)
    onnx.checker.check_model(form, full_check=True)
    tol = 1e-5 if dtype == TP.FLOAT else 1e-12
    want = cpu(m, feeds)
    for got in form_runs(form, feeds):
        for a, b in zip(want, got):
            np.testing.assert_allclose(b, a, rtol=tol, atol=tol)


def bn_net(opset=17, conv=False):
    """[Conv ->] BatchNormalization (training) -> Relu -> Flatten -> Gemm, float64."""
    rng = np.random.default_rng(0)
    inits = {"s": rng.uniform(0.5, 1.5, 4), "b": rng.standard_normal(4) * 0.1,
             "m": np.zeros(4), "v": np.ones(4), "D": rng.standard_normal((3, 100)) * 0.1}
    nodes, cin = [], 4
    if conv:  # onnxruntime CPU has no float64 Conv: the float32 training test only
        inits["W"], cin = rng.standard_normal((4, 2, 3, 3)) * 0.3, 2
        nodes.append(helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]))
    nodes += [helper.make_node("BatchNormalization", ["c" if conv else "x", "s", "b", "m", "v"],
                               ["n", "rm", "rv"], training_mode=1, momentum=0.9),
              helper.make_node("Relu", ["n"], ["r"]),
              helper.make_node("Flatten", ["r"], ["f"]),
              helper.make_node("Gemm", ["f", "D"], ["logits"], transB=1)]
    g = helper.make_graph(
        nodes, "net", [helper.make_tensor_value_info("x", TP.DOUBLE, ["N", cin, 5, 5])],
        [helper.make_tensor_value_info("logits", TP.DOUBLE, ["N", 3]),
         helper.make_tensor_value_info("rm", TP.DOUBLE, [4]),
         helper.make_tensor_value_info("rv", TP.DOUBLE, [4])],
        [numpy_helper.from_array(v.astype(np.float64), k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("opset", [14, 17, 18])
def test_gradient_graph_with_cuda_forms(opset):
    """A gradient graph through training BatchNormalization, with its nodes written out as the
    CUDA session gets them, gives the same gradients and running statistics (float64)."""
    res = onnxgrad.gradients(bn_net(opset), "logits", ["x", "s", "b", "D"])
    x = np.random.default_rng(1).standard_normal((3, 4, 5, 5))
    outs = [*res.grads, "rm", "rv"]
    want = cpu(res.model, {"x": x}, outs)
    for got in form_runs(for_cuda(res.model), {"x": x}, outs):
        for a, b in zip(want, got):
            np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)


def test_batchnorm_form_needs_rank():
    """X of unknown rank: a clear refusal naming the node, not a session that fails on CUDA."""
    m = bn_model([2, 3, 4], 15, TP.FLOAT, 0.9, 1e-5)
    m.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(UnsupportedError, match="BatchNormalization.*rank"):
        for_cuda(m)


def test_models_without_training_batchnorm_pass_through():
    m = bn_model([2, 3], 15, TP.FLOAT, 0.9, 1e-5)
    m.graph.node[0].attribute[-1].i = 0  # training_mode (the last attribute made) off
    del m.graph.node[0].output[1:], m.graph.output[1:]
    assert not has_forms(m) and for_cuda(m) is m
    assert has_forms(bn_model([2, 3], 15, TP.FLOAT, 0.9, 1e-5))


def test_cuda_sessions_run_float32_as_float32():
    """The CUDA provider's options turn TF32 off (its default is on)."""
    assert runtime.CUDA_OPTIONS == {"use_tf32": "0"}
    if runtime.cuda_available():
        assert runtime.providers("cuda")[0] == ("CUDAExecutionProvider", {"use_tf32": "0"})


# -- on a GPU ----------------------------------------------------------------------------------
@pytest.mark.parametrize("net", ["mlp", "conv_bn"])
def test_cuda_training_matches_cpu(net, tmp_path):
    """Five AdamW steps on CUDA give the CPU's losses (skipped without a GPU)."""
    if not runtime.cuda_available():
        pytest.skip("no CUDA session can be created here")
    from onnxgrad.training import AdamW, Trainer
    rng = np.random.default_rng(3)
    if net == "mlp":
        W1, W2 = rng.standard_normal((8, 6)) * 0.4, rng.standard_normal((3, 8)) * 0.4
        g = helper.make_graph(
            [helper.make_node("Gemm", ["x", "W1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("Gemm", ["a", "W2"], ["logits"], transB=1)], "mlp",
            [helper.make_tensor_value_info("x", TP.FLOAT, ["N", 6])],
            [helper.make_tensor_value_info("logits", TP.FLOAT, ["N", 3])],
            [numpy_helper.from_array(W1.astype(np.float32), "W1"),
             numpy_helper.from_array(W2.astype(np.float32), "W2")])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        xs = rng.standard_normal((5, 16, 6)).astype(np.float32)
    else:
        model = bn_net(conv=True)
        for t in model.graph.initializer:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32),
                                               t.name))
        for v in [*model.graph.input, *model.graph.output]:
            v.type.tensor_type.elem_type = TP.FLOAT
        del model.graph.output[1:]
        xs = rng.standard_normal((5, 8, 2, 5, 5)).astype(np.float32)
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    ys = rng.integers(0, 3, (5, len(xs[0])))
    runs = {}
    for device in ("cpu", "cuda"):
        tr = Trainer(path, "cross_entropy", optimizer=AdamW(lr=1e-2), device=device,
                     progress=False)
        losses = [tr.step({tr.data_inputs[0]: x, "target": y}) for x, y in zip(xs, ys)]
        runs[device] = losses
    # steps 2..5 read the weights and state the earlier steps wrote on the device
    np.testing.assert_allclose(runs["cuda"], runs["cpu"], rtol=1e-4)


def col2im_model(cols_shape, image, block, attrs, c_static=True, const_geometry=True):
    dims = list(cols_shape) if c_static else [cols_shape[0], "CK", cols_shape[2]]
    ins = [helper.make_tensor_value_info("cols", TP.FLOAT, dims)]
    nodes, inits = [], []
    for name, v in (("image", image), ("block", block)):
        if const_geometry:
            inits.append(numpy_helper.from_array(np.array(v, np.int64), name))
        else:
            ins.append(helper.make_tensor_value_info(name, TP.INT64, [len(v)]))
    nodes.append(helper.make_node("Col2Im", ["cols", "image", "block"], ["y"], **attrs))
    g = helper.make_graph(nodes, "c2i", ins, [helper.make_tensor_value_info("y", TP.FLOAT, None)],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_col2im_forms_match_onnxruntime(data):
    """Col2Im written as Reshape/Transpose (blocks that tile the image) or a grouped one-hot
    ConvTranspose (any strides, dilations, pads, an image end no block reaches: output_padding)
    gives onnxruntime CPU's Col2Im, every element."""
    tile = data.draw(st.booleans(), "tile")
    c, n = data.draw(st.integers(1, 3), "C"), data.draw(st.integers(1, 3), "N")
    k = [data.draw(st.integers(1, 3), f"k{i}") for i in range(2)]
    if tile:
        s, d, pads = list(k), [1, 1], [0, 0, 0, 0]
        size = [k[i] * data.draw(st.integers(1, 3), f"o{i}") for i in range(2)]
    else:
        s = [data.draw(st.integers(1, 3), f"s{i}") for i in range(2)]
        d = [data.draw(st.integers(1, 2), f"d{i}") for i in range(2)]
        pads = [data.draw(st.integers(0, 2), f"p{i}") for i in range(4)]
        size = [data.draw(st.integers(1, 8), f"h{i}") for i in range(2)]
    o = [(size[i] + pads[i] + pads[2 + i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(2)]
    if min(o) < 1:
        return
    shape = [n, c * k[0] * k[1], o[0] * o[1]]
    m = col2im_model(shape, size, k, dict(strides=s, dilations=d, pads=pads),
                     c_static=not tile or data.draw(st.booleans(), "c_static"))
    form = for_cuda(m)
    assert not any(x.op_type == "Col2Im" for x in form.graph.node)
    onnx.checker.check_model(form, full_check=True)
    cols = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    want = cpu(m, {"cols": cols})[0]
    for got, in form_runs(form, {"cols": cols}):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_col2im_with_run_time_geometry_stays():
    """An image or block shape known only at run time: the node stays (on the host, right)."""
    m = col2im_model([1, 4, 4], [3, 3], [2, 2], {}, const_geometry=False)
    assert [x.op_type for x in for_cuda(m).graph.node] == ["Col2Im"]


def nll_model(kind, shape, reduction, ignore, weighted, log_prob, opset, labels=TP.INT64):
    C = shape[1]
    ins = ["x", "t"] + (["w"] if weighted else [])
    attrs = {"reduction": reduction}
    if ignore is not None:
        attrs["ignore_index"] = ignore
    outs = ["loss"] + (["lp"] if log_prob else [])
    n = helper.make_node(kind, ins, outs, **attrs)
    lab = [shape[0], *shape[2:]]
    g = helper.make_graph(
        [n], "nll", [helper.make_tensor_value_info("x", TP.FLOAT, shape),
                     helper.make_tensor_value_info("t", labels, lab)]
        + ([helper.make_tensor_value_info("w", TP.FLOAT, [C])] if weighted else []),
        [helper.make_tensor_value_info("loss", TP.FLOAT, None)]
        + ([helper.make_tensor_value_info("lp", TP.FLOAT, shape)] if log_prob else []))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"]),
       extra=st.lists(st.integers(1, 3), max_size=2), n=st.integers(1, 4), c=st.integers(1, 5),
       reduction=st.sampled_from(["mean", "sum", "none"]), ignore=st.sampled_from([None, 0, 2, -1]),
       weighted=st.booleans(), log_prob=st.booleans(), opset=st.sampled_from([12, 13, 17, 21]),
       seed=st.integers(0, 99), int32=st.booleans())
@example(kind="SoftmaxCrossEntropyLoss", extra=[3, 2], n=2, c=1, reduction="mean", ignore=None,
         weighted=False, log_prob=True, opset=12, seed=0, int32=False)  # LogSoftmax-11
@example(kind="SoftmaxCrossEntropyLoss", extra=[2], n=3, c=3, reduction="none", ignore=None,
         weighted=False, log_prob=True, opset=12, seed=1, int32=True)
def test_nll_losses_match_onnxruntime(kind, extra, n, c, reduction, ignore, weighted, log_prob,
                                      opset, seed, int32):
    """SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (no CUDA kernel: every step's
    logits went to the host) written as standard ops give onnxruntime CPU's own losses and log
    probabilities, every reduction, ignore_index and class weights included."""
    if kind == "NegativeLogLikelihoodLoss":
        log_prob = False
    shape = [n, c, *extra]
    rng = np.random.default_rng(seed)
    t = rng.integers(0, c, [n, *extra])
    if ignore is not None:
        t[rng.random(t.shape) < 0.3] = ignore
        if reduction == "mean" and (t == ignore).all():
            t.flat[0] = 0 if ignore != 0 else min(1, c - 1)
            if (t == ignore).all():
                return  # every label ignored: 0 / 0
    feeds = {"x": rng.standard_normal(shape).astype(np.float32),
             "t": t.astype(np.int32 if int32 else np.int64)}
    if weighted:
        feeds["w"] = rng.uniform(0.5, 2, c).astype(np.float32)
    m = nll_model(kind, shape, reduction, ignore, weighted, log_prob, opset,
                  TP.INT32 if int32 else TP.INT64)
    form = for_cuda(m)
    assert not any(x.op_type == kind for x in form.graph.node)
    for run in form_runs(form, feeds):
        for want, got in zip(cpu(m, feeds), run):
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def one_node_model(op, shape, dtype, opset, inits=(), **attrs):
    names = ["x"] + [t.name for t in inits]
    g = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], "one",
                          [helper.make_tensor_value_info("x", dtype, shape)],
                          [helper.make_tensor_value_info("y", dtype, None)], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(case=st.sampled_from(["Mish", "Celu", "Lp1", "Lp2", "Group18", "Group21"]),
       dims=st.lists(st.integers(1, 4), min_size=2, max_size=4),
       dtype=st.sampled_from([TP.FLOAT, TP.DOUBLE, TP.FLOAT16]), seed=st.integers(0, 99),
       groups=st.integers(1, 3))
def test_forms_of_ops_without_cuda_kernels_match_onnxruntime(case, dims, dtype, seed, groups):
    """GroupNormalization (18: per-group scale, 21: per channel, float32 stash), Mish, Celu and
    LpNormalization have no kernel in onnxruntime's CUDA provider (each step would run them on
    the host): their CUDA forms give onnxruntime CPU's values."""
    rng = np.random.default_rng(seed)
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    inits, attrs = [], {}
    if case.startswith("Group"):
        dims = [dims[0], groups * dims[1], *dims[2:]]
        opset = 18 if case == "Group18" else 21
        per = groups if opset == 18 else dims[1]
        inits = [numpy_helper.from_array(rng.uniform(0.5, 1.5, per).astype(npdt), "s"),
                 numpy_helper.from_array(rng.standard_normal(per).astype(npdt), "b")]
        op, attrs = "GroupNormalization", {"num_groups": groups, "epsilon": 1e-3}
    elif case.startswith("Lp"):
        op, opset, attrs = "LpNormalization", 17, {"p": int(case[2]),
                                                   "axis": int(seed % len(dims)) - len(dims)}
    else:
        op, opset = case, 18
        if case == "Celu":
            attrs = {"alpha": 0.7}
            if dtype != TP.FLOAT:  # Celu is float32 only
                return
    if dtype == TP.FLOAT16 and case in ("Mish", "Lp1", "Lp2", "Group18"):
        return  # (onnxruntime CPU has no float16 kernel for these)
    m = one_node_model(op, dims, dtype, opset, inits, **attrs)
    x = rng.standard_normal(dims).astype(npdt)
    form = for_cuda(m)
    assert [n.op_type for n in form.graph.node] != [op]
    want, = cpu(m, {"x": x})
    tol = 2e-3 if dtype == TP.FLOAT16 else 1e-5 if dtype == TP.FLOAT else 1e-12
    if case == "Group21" and dtype == TP.DOUBLE:
        tol = 1e-5  # onnxruntime's expansion computes in the float32 stash; the form in float64
    for got, in form_runs(form, {"x": x}):
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                                   atol=tol)


def test_cuda_asked_for_where_none_can_be_created(capsys):
    """device="cuda" without a usable CUDA provider: an onnxgrad error that says what it needs
    (the CLI printed "unexpected RuntimeError ... please report it")."""
    if _cuda():
        pytest.skip("a CUDA session can be created here")
    from onnxgrad.cli import main
    from onnxgrad.errors import DeviceUnavailableError
    with pytest.raises(DeviceUnavailableError, match="onnxruntime-gpu.*device='auto'"):
        runtime.resolve("cuda")
    models = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
    assert main(["train", os.path.join(models, "digits_mlp.onnx"), "--loss", "cross_entropy",
                 "--data", os.path.join(models, "digits.npz"), "--epochs", "1", "--device",
                 "cuda", "-o", "/nonexistent/never-written.onnx", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "CUDA session" in err and "unexpected" not in err
