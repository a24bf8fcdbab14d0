"""Gradients of Resize, Upsample, Compress and of ops differentiated through their ONNX function
bodies (Attention, RotaryEmbedding, AffineGrid): finite differences and torch autograd."""
import numpy as np
import onnx
import pytest
from onnx import helper

import onnxgrad
from util import assert_gradients, grads_of, make_model, op_model

f = np.float32
torch = pytest.importorskip("torch")
F = torch.nn.functional


def _resize_model(shape, scales=None, sizes=None, opset=19, **attrs):
    inits = {"roi": np.array([], f)}
    if scales is not None:
        inits["scales"] = np.array(scales, f)
    else:
        inits["scales"] = np.array([], f)
        inits["sizes"] = np.array(sizes, np.int64)
    return op_model("Resize", {"x": (f, shape)}, opset=opset, inits=inits, **attrs)


RESIZE_FD = [
    dict(mode="nearest", scales=[1, 1, 2, 3]),
    dict(mode="nearest", scales=[1, 1, 0.5, 0.6], nearest_mode="floor"),
    dict(mode="nearest", sizes=[1, 2, 7, 3], coordinate_transformation_mode="asymmetric",
         nearest_mode="ceil"),
    dict(mode="linear", scales=[1, 1, 2, 1.5]),
    dict(mode="linear", scales=[1, 1, 0.5, 0.8], antialias=1),
    dict(mode="linear", sizes=[1, 2, 7, 3], coordinate_transformation_mode="align_corners"),
    dict(mode="linear", sizes=[1, 2, 7, 9], coordinate_transformation_mode="pytorch_half_pixel"),
    dict(mode="linear", sizes=[1, 2, 7, 9], coordinate_transformation_mode="tf_crop_and_resize"),
    dict(mode="cubic", scales=[1, 1, 2, 1.5], cubic_coeff_a=-0.5, exclude_outside=1),
    dict(mode="cubic", sizes=[1, 2, 3, 9], coordinate_transformation_mode="asymmetric"),
    dict(mode="linear", sizes=[5, 7], axes=[2, 3]),
    dict(mode="linear", sizes=[8, 8], axes=[2, 3], keep_aspect_ratio_policy="not_larger"),
]


@pytest.mark.parametrize("case", RESIZE_FD, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_resize_finite_differences(case):
    case = dict(case)
    shape = [1, 2, 4, 5]
    if case.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        inits = {"roi": np.array([0, 0, 0.1, 0.2, 1, 1, 0.8, 0.9], f), "scales": np.array([], f),
                 "sizes": np.array(case.pop("sizes"), np.int64)}
        m = op_model("Resize", {"x": (f, shape)}, opset=19, inits=inits, **case)
    else:
        m = _resize_model(shape, case.pop("scales", None), case.pop("sizes", None), **case)
    assert_gradients(m, "y", "x")


def _torch_grad(fn, x, gy):
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = fn(t)
    y.backward(torch.tensor(gy, dtype=torch.float64))
    return y.detach().numpy(), t.grad.numpy()


@pytest.mark.parametrize("mode,ctm,align", [
    ("nearest", "asymmetric", None),      # torch's "nearest" is asymmetric + floor
    ("bilinear", "half_pixel", False),
    ("bilinear", "align_corners", True),
    ("bicubic", "half_pixel", False),
    ("bicubic", "align_corners", True),
])
@pytest.mark.parametrize("out", [(7, 9), (3, 2)])
def test_resize_matches_torch_interpolate(mode, ctm, align, out):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 5, 4))
    onnx_mode = {"nearest": "nearest", "bilinear": "linear", "bicubic": "cubic"}[mode]
    attrs = dict(mode=onnx_mode, coordinate_transformation_mode=ctm)
    if mode == "nearest":
        attrs["nearest_mode"] = "floor"
    if mode == "bicubic":
        attrs["cubic_coeff_a"] = -0.75
    m = _resize_model([2, 3, 5, 4], sizes=[2, 3, *out], **attrs)
    m64 = onnxgrad.check.to_float64(m)
    gy = rng.standard_normal((2, 3, *out))
    kw = {} if align is None else {"align_corners": align}
    y_t, gx_t = _torch_grad(lambda t: F.interpolate(t, size=out, mode=mode, **kw), x, gy)
    (gx,), res = grads_of(m64, "y", "x", {"x": x, "gy": gy}, grad_ys=["gy"])
    from onnxgrad.runtime import run
    y = run(res.model, {"x": x, "gy": gy}, outputs=["y"])[0]
    np.testing.assert_allclose(y, y_t, rtol=1e-5, atol=1e-5)  # same forward (ORT: f32 scales)
    np.testing.assert_allclose(gx, gx_t, rtol=1e-5, atol=1e-5)


def test_resize_symbolic_batch_runs_for_two_batch_sizes():
    m = op_model("Resize", {"x": (f, ["N", 3, 4, 5])}, opset=19,
                 inits={"roi": np.array([], f), "scales": np.array([1, 1, 2, 2], f)}, mode="linear")
    res = onnxgrad.gradients(m, "y", "x")
    from onnxgrad.runtime import run
    for b in (1, 3):
        x = np.random.default_rng(b).standard_normal((b, 3, 4, 5)).astype(f)
        (gx,) = run(res.model, {"x": x}, outputs=[res.grads[0]])
        _, gt = _torch_grad(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), x,
                            np.ones((b, 3, 8, 10)))
        np.testing.assert_allclose(gx, gt, rtol=1e-5, atol=1e-5)


def test_resize_symbolic_spatial_dims_raise_clearly():
    m = op_model("Resize", {"x": (f, [1, 3, "H", "W"])}, opset=19,
                 inits={"roi": np.array([], f), "scales": np.array([1, 1, 2, 2], f)}, mode="linear")
    with pytest.raises(NotImplementedError, match="not static"):
        onnxgrad.gradients(m, "y", "x")


def test_resize_second_order():
    # y = Resize(x)^2 summed: the gradient graph is differentiable again (MatMul rules)
    nodes = [helper.make_node("Resize", ["x", "roi", "scales"], ["r"], mode="linear"),
             helper.make_node("Mul", ["r", "r"], ["y"])]
    m = make_model(nodes, {"x": (f, [1, 1, 3, 4])}, ["y"], opset=19,
                   inits={"roi": np.array([], f), "scales": np.array([1, 1, 2, 2], f)})
    res = onnxgrad.gradients(m, "y", "x")
    assert_gradients(res.model, res.grads[0], "x")


# an opset-9 model is upgraded to 13 first; the engine restores Upsample's asymmetric coordinates
# that onnx's Upsample -> Resize adapter drops
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample(mode):
    m = op_model("Upsample", {"x": (f, [1, 2, 3, 4])}, opset=9,
                 inits={"scales": np.array([1, 1, 2, 3], f)}, mode=mode)
    # onnxruntime has no float64 Upsample (and onnx.reference no linear one): check in float32
    assert_gradients(m, "y", "x", dtype="float32", f32=False)


def test_upsample_nearest_matches_repeat_adjoint():
    m = op_model("Upsample", {"x": (f, [1, 2, 3, 4])}, opset=9,
                 inits={"scales": np.array([1, 1, 2, 3], f)}, mode="nearest")
    gy = np.random.default_rng(0).standard_normal((1, 2, 6, 12)).astype(f)
    (gx,), _ = grads_of(m, "y", "x", {"x": np.zeros((1, 2, 3, 4), f), "gy": gy}, grad_ys=["gy"])
    want = gy.reshape(1, 2, 3, 2, 4, 3).sum(axis=(3, 5))  # each x copied to a 2x3 block
    np.testing.assert_allclose(gx, want, rtol=1e-5)


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_compress(axis):
    cond = np.array([1, 0, 1], bool)
    kw = {} if axis is None else {"axis": axis}
    m = op_model("Compress", {"x": (f, [3, 3])}, opset=13, inits={"c": cond}, **kw)
    assert_gradients(m, "y", "x")
    gy_shape = {None: (2,), 0: (2, 3), 1: (3, 2), -1: (3, 2)}[axis]
    gy = np.arange(1, 1 + np.prod(gy_shape), dtype=f).reshape(gy_shape)
    (gx,), _ = grads_of(m, "y", "x", {"x": np.zeros((3, 3), f), "gy": gy}, grad_ys=["gy"])
    want = np.zeros((3, 3), f)
    if axis is None:
        want.reshape(-1)[[0, 2]] = gy
    elif axis == 0:
        want[[0, 2]] = gy
    else:
        want[:, [0, 2]] = gy
    np.testing.assert_array_equal(gx, want)


# -- ops with function bodies ---------------------------------------------------------------
def test_attention_matches_torch_sdpa():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 8)))
    mask = rng.standard_normal((4, 6))
    m = op_model("Attention", {"q": (f, [2, 3, 4, 8]), "k": (f, [2, 3, 6, 8]),
                               "v": (f, [2, 3, 6, 8]), "mask": (f, [4, 6])}, opset=23)
    assert_gradients(m, "y", ["q", "k", "v", "mask"])
    gy = rng.standard_normal((2, 3, 4, 8))
    ts = [torch.tensor(a, requires_grad=True) for a in (q, k, v, mask)]
    y = F.scaled_dot_product_attention(ts[0], ts[1], ts[2], attn_mask=ts[3])
    y.backward(torch.tensor(gy))
    m64 = onnxgrad.check.to_float64(m)
    got, _ = grads_of(m64, "y", ["q", "k", "v", "mask"],
                      {"q": q, "k": k, "v": v, "mask": mask, "gy": gy}, grad_ys=["gy"])
    for a, t in zip(got, ts):
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_attention_causal_3d_inputs():
    m = op_model("Attention", {"q": (f, [2, 4, 12]), "k": (f, [2, 4, 12]), "v": (f, [2, 4, 12])},
                 opset=23, is_causal=1, q_num_heads=3, kv_num_heads=3)
    assert_gradients(m, "y", ["q", "k", "v"])


def test_rotary_embedding():
    pos = np.array([[0, 1, 2, 3], [2, 3, 4, 5]], np.int64)
    m = op_model("RotaryEmbedding", {"x": (f, [2, 3, 4, 8]), "cos": (f, [6, 4]),
                                     "sin": (f, [6, 4])}, opset=23, inits={"pos": pos})
    assert_gradients(m, "y", ["x", "cos", "sin"])


@pytest.mark.parametrize("align", [0, 1])
def test_affine_grid_matches_torch(align):
    rng = np.random.default_rng(4)
    theta = rng.standard_normal((2, 2, 3))
    m = op_model("AffineGrid", {"theta": (f, [2, 2, 3])}, opset=20,
                 inits={"size": np.array([2, 3, 4, 5], np.int64)}, align_corners=align)
    gy = rng.standard_normal((2, 4, 5, 2))
    _, gt = _torch_grad(lambda t: F.affine_grid(t, [2, 3, 4, 5], align_corners=bool(align)),
                        theta, gy)
    (g,), _ = grads_of(onnxgrad.check.to_float64(m), "y", "theta", {"theta": theta, "gy": gy},
                       grad_ys=["gy"])
    np.testing.assert_allclose(g, gt, rtol=1e-6, atol=1e-9)
    assert_gradients(m, "y", "theta")


def test_affine_grid_3d():
    m = op_model("AffineGrid", {"theta": (f, [2, 3, 4])}, opset=20,
                 inits={"size": np.array([2, 1, 3, 4, 5], np.int64)})
    assert_gradients(m, "y", "theta")


def test_no_function_body_still_reports_not_differentiable():
    m = op_model("GridSample", {"x": (f, [1, 1, 3, 3]), "grid": (f, [1, 2, 2, 2])}, opset=20)
    with pytest.raises(onnxgrad.NotDifferentiableError, match="GridSample"):
        onnxgrad.gradients(m, "y", "x")
