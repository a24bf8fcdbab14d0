"""The training step's forms for convolutions on small images (onnxgrad.training.fast_forms):
the same function as the Conv (forward on onnxruntime), gradients by finite differences
(float64) and against torch autograd, symbolic batch, and the cases left alone."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import assert_gradients

import onnxgrad
from onnxgrad.runtime import session
from onnxgrad.training import build_gradient_model
from onnxgrad.training.fast_forms import small_image_convs

F32 = TensorProto.FLOAT

# x shape, w shape, Conv attributes, bias: small enough to be rewritten
CASES = {
    "3x3-pad-2x2": ((2, 4, 2, 2), (5, 4, 3, 3), dict(pads=[1, 1, 1, 1]), True),
    "stride2-4x4": ((2, 3, 4, 4), (5, 3, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2]), False),
    "1x1-stride2": ((2, 3, 3, 4), (4, 3, 1, 1), dict(strides=[2, 2]), True),
    "dilated-asym": ((1, 2, 3, 3), (3, 2, 2, 2),
                     dict(pads=[1, 0, 2, 1], dilations=[2, 2], strides=[2, 2]), False),
    "depthwise-5x5": ((2, 6, 2, 2), (6, 1, 5, 5), dict(pads=[2, 2, 2, 2], group=6), True),
    "depthwise-stride2": ((2, 4, 4, 3), (4, 1, 3, 3),
                          dict(pads=[1, 1, 1, 1], strides=[2, 2], group=4), False),
    "depthwise-4x4-asym": ((2, 3, 4, 4), (3, 1, 3, 2), dict(pads=[1, 0, 1, 1], group=3), True),
}


def conv_model(xs, ws, attrs, bias, batch=None, w_const=None, dtype=F32):
    ins = [helper.make_tensor_value_info("x", dtype, [batch or xs[0], *xs[1:]])]
    inits = []
    if w_const is None:
        ins.append(helper.make_tensor_value_info("w", dtype, list(ws)))
    else:
        inits.append(numpy_helper.from_array(w_const, "w"))
    if bias:
        ins.append(helper.make_tensor_value_info("b", dtype, [ws[0]]))
    node = helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y"], name="conv",
                            **attrs)
    g = helper.make_graph([node], "conv", ins, [helper.make_tensor_value_info("y", dtype, None)],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return onnx.shape_inference.infer_shapes(m)


def rewritten(m, params=("w", "b")):
    m2 = onnx.ModelProto()
    m2.CopyFrom(m)
    names = {n.name for n in m2.graph.node} | {o for n in m2.graph.node for o in n.output}
    count = small_image_convs(m2, set(params), names | {v.name for v in m2.graph.input})
    return m2, count


def feeds_for(xs, ws, bias, seed=0):
    rng = np.random.default_rng(seed)
    f = {"x": rng.standard_normal(xs).astype(np.float32),
         "w": rng.standard_normal(ws).astype(np.float32)}
    if bias:
        f["b"] = rng.standard_normal(ws[0]).astype(np.float32)
    return f


def torch_conv(attrs):
    import torch.nn.functional as F
    p = attrs.get("pads", [0, 0, 0, 0])

    def fn(x, w, b=None):
        return F.conv2d(F.pad(x, [p[1], p[3], p[0], p[2]]), w, b,
                        stride=attrs.get("strides", 1), dilation=attrs.get("dilations", 1),
                        groups=attrs.get("group", 1))
    return fn


@pytest.mark.parametrize("batch", [None, "N"])
@pytest.mark.parametrize("case", list(CASES))
def test_same_function_as_the_conv(case, batch):
    xs, ws, attrs, bias = CASES[case]
    m = conv_model(xs, ws, attrs, bias, batch)
    m2, count = rewritten(m)
    assert count == 1 and not any(n.op_type == "Conv" for n in m2.graph.node)
    onnx.checker.check_model(m2, full_check=True)
    f = feeds_for(xs, ws, bias)
    want = session(m).run(None, f)[0]
    got = session(m2).run(None, f)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_by_finite_differences_and_torch(case):
    torch = pytest.importorskip("torch")
    xs, ws, attrs, bias = CASES[case]
    m2, _ = rewritten(conv_model(xs, ws, attrs, bias, "N"))
    names = ["x", "w"] + (["b"] if bias else [])
    f = feeds_for(xs, ws, bias, seed=1)
    assert_gradients(m2, "y", names, feeds=f)  # float64 finite differences
    y = session(m2).run(None, f)[0]
    cot = np.random.default_rng(2).standard_normal(y.shape).astype(np.float32)
    res = onnxgrad.gradients(m2, "y", names, grad_ys=["cot"])
    got = session(res.model).run(res.grads, {**f, "cot": cot})
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in f.items()}
    want = torch.autograd.grad(torch_conv(attrs)(**t), [t[k] for k in names],
                               torch.tensor(cot, dtype=torch.float64))
    for k, a, b in zip(names, got, want):
        b = b.numpy()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(), err_msg=k)


def test_left_alone():
    xs, ws, attrs, bias = CASES["3x3-pad-2x2"]
    w = np.ones(ws, np.float32)
    assert rewritten(conv_model(xs, ws, attrs, bias, w_const=w))[1] == 0  # a constant kernel
    assert rewritten(conv_model(xs, ws, attrs, bias), params=("b",))[1] == 0  # w not trained
    assert rewritten(conv_model((2, 4, 3, 2), ws, attrs, bias))[1] == 0  # 6 output positions
    dw = conv_model((2, 3, 9, 8), (3, 1, 3, 3), dict(pads=[1] * 4, group=3), False)
    assert rewritten(dw)[1] == 0  # a depthwise one over 72 x 72 positions
    assert rewritten(conv_model(xs, (4, 2, 3, 3), dict(attrs, group=2), bias))[1] == 0
    assert rewritten(conv_model(xs, ws, attrs, bias, dtype=TensorProto.DOUBLE))[1] == 0
    assert rewritten(conv_model(xs, ws, dict(auto_pad="SAME_UPPER"), bias))[1] == 0


def test_gradient_model_uses_them():
    """build_gradient_model (every training step) rewrites the Conv of a trained kernel, and
    its gradients equal those of the plain Conv."""
    xs, ws, attrs, _ = CASES["depthwise-5x5"]
    rng = np.random.default_rng(3)
    w = rng.standard_normal(ws).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", **attrs),
             helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", F32, ["N", *xs[1:]])],
                          [helper.make_tensor_value_info("loss", F32, [])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    step = build_gradient_model(m, "loss", ["w"])
    assert not any(n.op_type == "Conv" for n in step.model.graph.node)
    x = rng.standard_normal(xs).astype(np.float32)
    got = session(step.model).run(step.grads, {"x": x, "w": w})[0]
    plain = onnxgrad.gradients(m, "loss", ["w"])
    want = session(plain.model).run(plain.grads, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _dropout_model(ratio, mask_read=False, ratio_as_input=False):
    """x -> Dropout(ratio, training) -> MatMul(w) -> ReduceSumSquare; the mask read by a second
    output when ``mask_read``."""
    nodes = [helper.make_node("Dropout", ["x", "r", "t"], ["d", "mask"], seed=1),
             helper.make_node("MatMul", ["d", "w"], ["y"]),
             helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0)]
    outs = [helper.make_tensor_value_info("loss", F32, [])]
    if mask_read:
        nodes.append(helper.make_node("Cast", ["mask"], ["kept"], to=F32))
        outs.append(helper.make_tensor_value_info("kept", F32, None))
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 4)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array(ratio, np.float32), "r"),
             numpy_helper.from_array(np.array(True), "t")]
    ins = [helper.make_tensor_value_info("x", F32, ["N", 6])]
    if ratio_as_input:
        ins.append(helper.make_tensor_value_info("r", F32, []))
    g = helper.make_graph(nodes, "m", ins, outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_zero_ratio_dropout_becomes_identity():
    """build_gradient_model turns a training-mode Dropout of constant ratio 0 into an Identity
    (the loss and gradient are those of the model without it, exactly); a nonzero ratio, a ratio
    that may be fed, or a mask that something reads keeps the Dropout. The input model is not
    changed."""
    m = _dropout_model(0.0)
    before = m.SerializeToString()
    step = build_gradient_model(m, "loss", ["w"])
    assert m.SerializeToString() == before
    ops = [n.op_type for n in step.model.graph.node]
    assert "Dropout" not in ops and "Identity" in ops
    x = np.random.default_rng(6).standard_normal((3, 6)).astype(np.float32)
    w = numpy_helper.to_array(m.graph.initializer[0])
    loss, gw = session(step.model).run(["loss", step.grads[0]], {"x": x, "w": w})
    y = x.astype(np.float64) @ w
    np.testing.assert_allclose(loss, (y * y).sum(), rtol=1e-5)
    np.testing.assert_allclose(gw, 2 * x.T.astype(np.float64) @ y, rtol=1e-5, atol=1e-5)
    for kept in (_dropout_model(0.1), _dropout_model(0.0, mask_read=True),
                 _dropout_model(0.0, ratio_as_input=True)):
        step = build_gradient_model(kept, "loss", ["w"])
        assert "Dropout" in [n.op_type for n in step.model.graph.node]
