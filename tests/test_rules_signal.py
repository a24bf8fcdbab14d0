"""Gradient rules of onnxgrad/rules/signal.py (DFT, opsets 17 and 20): the adjoint transform,
against float64 finite differences and torch.fft autograd."""
import numpy as np
import pytest
from onnx import helper
from util import assert_gradients, make_model

import onnxgrad
from onnxgrad.runtime import run

F32 = np.float32


def dft_model(opset, c, n=6, length=None, axis=None, **attrs):
    """DFT of x [2, n, 3, c] (c = 1 real, 2 complex); axis an attribute (17) or input (20)."""
    ins, inits = ["x", ""], {}
    if length is not None:
        ins[1], inits["L"] = "L", np.array(length, np.int64)
    if axis is not None and opset >= 20:
        ins.append("ax")
        inits["ax"] = np.array(axis, np.int64)
    elif axis is not None:
        attrs["axis"] = axis
    while ins[-1] == "":
        ins.pop()
    node = helper.make_node("DFT", ins, ["y"], **attrs)
    return make_model([node], {"x": (F32, [2, n, 3, c])}, ["y"], inits=inits, opset=opset)


def x_of(c, n=6, seed=0):
    return np.random.default_rng(seed).standard_normal((2, n, 3, c)).astype(F32)


@pytest.mark.parametrize("c,attrs", [
    (2, {}), (2, {"inverse": 1}), (1, {}), (1, {"inverse": 1}), (1, {"onesided": 1}),
    (2, {"length": 4}), (2, {"length": 9, "inverse": 1}), (1, {"length": 9, "onesided": 1}),
    (2, {"axis": 2})], ids=str)
@pytest.mark.parametrize("opset", [17, 20])
def test_dft(opset, c, attrs):
    attrs = dict(attrs)
    axis = attrs.pop("axis", 1 if opset == 17 else -3)
    m = dft_model(opset, c, axis=axis, **attrs)
    assert_gradients(m, "y", "x", feeds={"x": x_of(c)})


def test_dft_default_axis_opset20():
    assert_gradients(dft_model(20, 2, n=3), "y", "x", feeds={"x": x_of(2, 3)})


def test_dft_inverse_onesided_not_differentiable():
    m = dft_model(20, 2, length=10, axis=1, inverse=1, onesided=1)
    with pytest.raises(onnxgrad.NotDifferentiableError, match="onesided"):
        onnxgrad.gradients(m, "y", "x")


@pytest.mark.parametrize("onesided", [0, 1])
def test_dft_torch(onesided):
    """Real input, along axis 1: torch.fft.fft / rfft autograd."""
    torch = pytest.importorskip("torch")
    x = x_of(1)
    m = dft_model(20, 1, axis=1, onesided=onesided)
    w = np.random.default_rng(1).standard_normal((2, 4 if onesided else 6, 3, 2))
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["w"])  # w: the cotangent, fed
    got = run(res.model, {"x": x, "w": w.astype(F32)}, outputs=res.grads)[0]
    t = torch.tensor(x[..., 0], dtype=torch.float64, requires_grad=True)
    y = (torch.fft.rfft if onesided else torch.fft.fft)(t, dim=1)
    wt = torch.tensor(w)
    (y.real * wt[..., 0] + y.imag * wt[..., 1]).sum().backward()
    np.testing.assert_allclose(got[..., 0], t.grad.numpy(), rtol=1e-4, atol=1e-4)
