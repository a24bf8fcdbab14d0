"""Models that onnxruntime's graph optimizer used to break, run as written
(onnxgrad/ort_fusions.py).

onnxruntime 1.31 folds a Pad of zeros into the MaxPool or AveragePool that reads it (its
Pad_Fusion): a MaxPool's pads are -inf, so windows of negative values over the zeros came out
negative, and pads summed to the kernel failed to load. Found by the Keras fuzzer
(``ZeroPadding2D`` between pools); torch's ``ZeroPad2d`` before ``MaxPool2d`` exports the same.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.ort_fusions import guard_pad_fusion
from onnxgrad.runtime import ort_module, session
from util import quiet, stock_session

ort = ort_module()


@st.composite
def pad_pool_models(draw):
    """Pad (zeros) then a pool, NCHW or NHWC between layout Transposes, maybe through a
    Cast or an Identity, at opset 13 to 20; (model, x)."""
    opset = draw(st.sampled_from([13, 17, 18, 20]))
    nhwc = draw(st.booleans())
    h, w = draw(st.integers(2, 6)), draw(st.integers(2, 6))
    pads = [draw(st.integers(0, 3)) for _ in range(4)]  # h begin, w begin, h end, w end
    k = [draw(st.integers(1, 3)), draw(st.integers(1, 3))]
    pool = draw(st.sampled_from(["MaxPool", "AveragePool"]))
    attrs = dict(kernel_shape=k, strides=[draw(st.integers(1, 2)) for _ in k],
                 pads=[draw(st.integers(0, ki - 1)) for ki in k + k])
    if pool == "AveragePool":
        attrs["count_include_pad"] = draw(st.integers(0, 1))
    hp, wp = h + pads[0] + pads[2], w + pads[1] + pads[3]
    if hp + attrs["pads"][0] + attrs["pads"][2] < k[0] or \
            wp + attrs["pads"][1] + attrs["pads"][3] < k[1]:
        k[:] = [1, 1]
        attrs.update(kernel_shape=k, pads=[0, 0, 0, 0])
    if nhwc:
        full = [0, pads[0], pads[1], 0, 0, pads[2], pads[3], 0]
    else:
        full = [0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]]
    inits = [numpy_helper.from_array(np.array(full, np.int64), "pads"),
             numpy_helper.from_array(np.zeros((), np.int64), "izero"),
             numpy_helper.from_array(np.ones((), np.float32), "one")]
    nodes, ins = [], ["x", "pads"]
    # pads as given, folded by onnxruntime from constants, or computed at run time (from the
    # symbolic batch dim); the value absent, given, or folded
    how = draw(st.sampled_from(["given", "folded", "run time"]))
    if how != "given":
        src = "x" if how == "run time" else "pads"
        nodes += [helper.make_node("Shape", [src], ["s"]),
                  helper.make_node("Mul", ["s", "izero"], ["z"]),
                  helper.make_node("Concat", ["z", "z"] if how == "run time" else ["z"], ["zz"],
                                   axis=0),
                  helper.make_node("Add", ["zz", "pads"], ["pads_c"])]
        ins[1] = "pads_c"
    # (a computed value below opset 18 is not guarded: ort_fusions.py)
    value = draw(st.sampled_from(["absent", "given", *(["folded"] if opset >= 18 else [])]))
    if value == "given":
        inits.append(numpy_helper.from_array(np.zeros((), np.float32), "zero"))
        ins.append("zero")
    elif value == "folded":
        nodes.append(helper.make_node("Sub", ["one", "one"], ["zero_c"]))
        ins.append("zero_c")
    nodes.append(helper.make_node("Pad", ins, ["p"], mode="constant"))
    t = "p"
    between = draw(st.sampled_from(["none", "cast", "identity"]))
    if between != "none":
        nodes.append(helper.make_node("Cast", [t], ["c"], to=TensorProto.FLOAT) if between
                     == "cast" else helper.make_node("Identity", [t], ["c"]))
        t = "c"
    if nhwc:
        nodes.append(helper.make_node("Transpose", [t], ["t"], perm=[0, 3, 1, 2]))
        t = "t"
    nodes.append(helper.make_node(pool, [t], ["q" if nhwc else "y"], **attrs))
    if nhwc:
        nodes.append(helper.make_node("Transpose", ["q"], ["y"], perm=[0, 2, 3, 1]))
    shape = [2, h, w, 3] if nhwc else [2, 3, h, w]
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *shape[1:]])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * 4)
    g = helper.make_graph(nodes, "pad_pool", [x_info], [y_info], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    x = np.random.default_rng(draw(st.integers(0, 99))).standard_normal(shape)
    return m, (x - 1.5).astype(np.float32)  # mostly negative: zeros win the padded windows


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(pad_pool_models())
def test_guarded_pad_then_pool_runs_as_written(case):
    model, x = case
    want = stock_session(model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {"x": x})[0]
    guarded = guard_pad_fusion(onnx.ModelProto.FromString(model.SerializeToString()))
    onnx.checker.check_model(guarded, full_check=True)
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        np.testing.assert_array_equal(stock_session(guarded, level).run(None, {"x": x})[0], want)
    # the unguarded model in a session onnxgrad makes (Pad_Fusion off)
    np.testing.assert_array_equal(session(model).run(None, {"x": x})[0], want)


def test_the_guard_leaves_other_pads_alone():
    """Reflect pads, non-zero values and Pads read by no pool are not fused: the guard changes
    nothing in them."""
    inits = [numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads"),
             numpy_helper.from_array(np.ones((), np.float32), "one")]
    nodes = [helper.make_node("Pad", ["x", "pads"], ["a"], mode="reflect"),
             helper.make_node("MaxPool", ["a"], ["y1"], kernel_shape=[2, 2]),
             helper.make_node("Pad", ["x", "pads", "one"], ["b"]),
             helper.make_node("MaxPool", ["b"], ["y2"], kernel_shape=[2, 2]),
             helper.make_node("Pad", ["x", "pads"], ["c"], mode="edge"),
             helper.make_node("AveragePool", ["c"], ["y3"], kernel_shape=[2, 2]),
             helper.make_node("Pad", ["x", "pads"], ["d"]),
             helper.make_node("Relu", ["d"], ["y4"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, 1, 4, 4])],
                          [helper.make_tensor_value_info(f"y{i}", 1, None) for i in range(1, 5)],
                          inits)
    for opset in (17, 18):
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
        before = m.SerializeToString()
        assert guard_pad_fusion(m).SerializeToString() == before


@pytest.mark.parametrize("dynamo", [False, True])
def test_torch_zero_pad_then_max_pool_gradients_on_stock_onnxruntime(tmp_path, dynamo):
    """torch's ZeroPad2d, MaxPool2d and a 1x1 Conv from either exporter, differentiated wrt the
    Conv's weight (the pool's own gradient not needed, so the Pad has one reader): gradients()'s
    model, run in a plain onnxruntime session, gives torch's forward and weight gradient (on
    the old code the first pads made the session fail to load, the second gave negative
    maxima)."""
    torch = pytest.importorskip("torch")
    for pads, pool in (((1, 2, 0, 1), 2), ((1, 1, 1, 1), 3)):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.ZeroPad2d(pads), torch.nn.MaxPool2d(pool, 2),
                                  torch.nn.Conv2d(3, 2, 1))
        x = torch.randn(2, 3, 7, 7) - 1.5
        y = net(x)
        gy = torch.randn(y.shape)
        (gw,) = torch.autograd.grad(y, net[2].weight, gy)
        path = tmp_path / f"pool{pool}.onnx"
        with quiet():
            torch.onnx.export(net, (x,), str(path), input_names=["x"], output_names=["y"],
                              dynamo=dynamo)
        model = onnx.load(path)
        (w,) = [t.name for t in model.graph.initializer if tuple(t.dims) == (2, 3, 1, 1)]
        res = onnxgrad.gradients(model, "y", w, grad_ys="gy")
        got_y, got_gw = stock_session(res.model).run(["y", res.grads[0]],
                                              {"x": x.numpy(), "gy": gy.numpy()})
        np.testing.assert_allclose(got_y, y.detach().numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_gw, gw.numpy(), rtol=1e-5, atol=1e-5)
