"""Gradients of Resize, Upsample, Compress, GridSample, RoiAlign, DeformConv and of ops
differentiated through their ONNX function bodies (Attention, RotaryEmbedding, AffineGrid): finite
differences, torch autograd and the runtimes' own kernels."""
import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

import onnxgrad
from util import assert_gradients, central_differences, grads_of, make_model, op_model

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
    # (not 0.6: it puts nearest's half_pixel coordinates exactly on integers, where float32 and
    # float64 floor differently; the gradient follows the forward of each dtype)
    dict(mode="nearest", scales=[1, 1, 0.5, 0.7], nearest_mode="floor"),
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


@st.composite
def resize_cases(draw):
    mode = draw(st.sampled_from(["nearest", "linear", "cubic"]))
    attrs = {"mode": mode, "coordinate_transformation_mode": draw(st.sampled_from(
        ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
         "asymmetric", "tf_crop_and_resize"]))}
    if mode == "nearest":
        attrs["nearest_mode"] = draw(st.sampled_from(
            ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]))
    else:
        attrs["antialias"] = draw(st.integers(0, 1))
    if mode == "cubic":
        attrs["exclude_outside"] = draw(st.integers(0, 1))
    hw = draw(st.tuples(st.integers(1, 6), st.integers(1, 6)))
    if draw(st.booleans()):
        resize = {"scales": np.array(draw(st.lists(st.sampled_from(
            [0.5, 0.6, 0.7, 1.0, 1.5, 1.7, 2.0, 3.0]), min_size=2, max_size=2)), f)}
    else:
        resize = {"sizes": np.array(draw(st.lists(st.integers(1, 9), min_size=2, max_size=2)),
                                    np.int64)}
        attrs["keep_aspect_ratio_policy"] = draw(st.sampled_from(
            ["stretch", "not_larger", "not_smaller"]))
    if attrs["coordinate_transformation_mode"] == "tf_crop_and_resize":
        resize["roi"] = np.array([0.1, 0.0, 0.8, 0.9], f)
    return attrs, hw, resize, draw(st.integers(0, 2**16))


@settings(max_examples=120, deadline=None, derandomize=True)
@given(resize_cases())
def test_resize_gradient_is_the_adjoint_of_onnxruntimes_forward(case):
    """The gradient on onnxruntime is J^T g for J the Jacobian of onnxruntime's own float32
    Resize, keep_aspect_ratio_policy and empty outputs included. onnx's reference Resize, which
    built static matrices before, differs from it for align_corners, tf_crop_and_resize,
    pytorch_half_pixel and half_pixel_symmetric at most scales, and for nearest at float32
    rounding ties (align_corners by 1.4 in a gradient of magnitude 1.4, silently)."""
    attrs, (h, w), resize, seed = case
    names = ["x", "roi" if "roi" in resize else "", "scales" if "scales" in resize else "",
             "sizes" if "sizes" in resize else ""]
    while not names[-1]:
        names.pop()
    node = helper.make_node("Resize", names, ["y"], axes=[2, 3], **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, ["N", 1, h, w])],
                          [helper.make_tensor_value_info("y", 1, None)],
                          [onnx.numpy_helper.from_array(v, k) for k, v in resize.items()])
    m = onnx.shape_inference.infer_shapes(helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 19)], ir_version=10))
    _assert_adjoint_of_onnxruntime(m, (2, 1, h, w), seed)


def _assert_adjoint_of_onnxruntime(m, shape, seed=0):
    """dx of Resize model m (x -> y, x of ``shape``) on onnxruntime is J^T gy, J the Jacobian of
    onnxruntime's own float32 forward: Resize is linear, so J is its forward of the basis."""
    from onnxgrad.runtime import session
    size, forward = int(np.prod(shape[1:])), session(m)
    jac = np.stack([forward.run(["y"], {"x": e.reshape(1, *shape[1:])})[0].ravel()
                    for e in np.eye(size, dtype=f)]).astype(np.float64)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(f)
    y = forward.run(["y"], {"x": x})[0]
    gy = rng.standard_normal(y.shape).astype(f)
    (gx,), res = grads_of(m, "y", ["x"], {"x": x, "gy": gy}, grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    want = (gy.reshape(shape[0], -1).astype(np.float64) @ jac.T).reshape(x.shape)
    np.testing.assert_allclose(gx, want, rtol=1e-5, atol=1e-5)


def test_resize_scales_from_concat_of_constants():
    """Exporters write scales as a Concat of Constants: the rule folds them (and y's spatial
    size, which shape inference does not propagate here, follows floor(in * scale))."""
    from onnx import TensorProto
    c = [helper.make_node("Constant", [], [k], value=helper.make_tensor(k, TensorProto.FLOAT, [2], v))
         for k, v in (("s1", [1, 1]), ("s2", [2, 1.5]))]
    nodes = c + [helper.make_node("Concat", ["s1", "s2"], ["scales"], axis=0),
                 helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear")]
    m = make_model(nodes, {"x": (f, [1, 2, 4, 5])}, ["y"], opset=19)
    rng = np.random.default_rng(0)
    x, gy = rng.standard_normal((1, 2, 4, 5)), rng.standard_normal((1, 2, 8, 7))
    assert_gradients(m, "y", "x")
    _, want = _torch_grad(lambda t: F.interpolate(t, scale_factor=(2, 1.5), mode="bilinear",
                                                  align_corners=False,
                                                  recompute_scale_factor=False), x, gy)
    (got,), _ = grads_of(onnxgrad.check.to_float64(m), "y", ["x"], {"x": x, "gy": gy},
                         grad_ys=["gy"])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


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


def test_resize_symbolic_spatial_dims():
    """Constant scales, symbolic H and W: the interpolation matrices are built at run time
    (the same Resize on the identity), one graph for every image size."""
    m = op_model("Resize", {"x": (f, ["N", 3, "H", "W"])}, opset=19,
                 inits={"roi": np.array([], f), "scales": np.array([1, 1, 2, 1.5], f)},
                 mode="linear")
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
    from onnxgrad.runtime import run
    for shape in [(1, 3, 4, 5), (2, 3, 7, 3)]:
        x = np.random.default_rng(shape[2]).standard_normal(shape)
        out = (shape[2] * 2, int(shape[3] * 1.5))
        gy = np.random.default_rng(1).standard_normal((*shape[:2], *out))
        (gx,) = run(res.model, {"x": x.astype(f), "gy": gy.astype(f)}, outputs=res.grads)
        _, gt = _torch_grad(lambda t: F.interpolate(t, scale_factor=(2, 1.5), mode="bilinear",
                                                    recompute_scale_factor=False), x, gy)
        np.testing.assert_allclose(gx, gt, rtol=1e-5, atol=1e-5)
    assert_gradients(m, "y", "x", {"x": np.random.default_rng(2).standard_normal(
        (2, 3, 3, 4)).astype(f)})


# the same cases with roi, scales or sizes fed at run time (graph inputs), symbolic batch
@pytest.mark.parametrize("case", RESIZE_FD[:-1],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_resize_run_time_scales_and_sizes(case):
    case = dict(case)
    ins, names = {"x": (f, ["N", 2, 4, 5])}, ["x", "", "", ""]
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 2, 4, 5)).astype(f)}
    if case.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        names[1], ins["roi"] = "roi", (f, [8])
        feeds["roi"] = np.array([0, 0, 0.1, 0.2, 1, 1, 0.8, 0.9], f)
    if "scales" in case:
        names[2], feeds["scales"] = "scales", np.array(case.pop("scales"), f)
        ins["scales"] = (f, [len(feeds["scales"])])
    else:
        names[3], feeds["sizes"] = "sizes", np.array(case.pop("sizes"), np.int64)
        ins["sizes"] = (np.int64, [len(feeds["sizes"])])
        if "axes" not in case:
            feeds["sizes"][0] = 2  # the batch
    while not names[-1]:
        names.pop()
    m = make_model([helper.make_node("Resize", names, ["y"], **case)], ins, ["y"], opset=19)
    assert_gradients(m, "y", "x", feeds)


def test_resize_run_time_sizes_with_aspect_ratio_policy_refused():
    m = make_model([helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="linear",
                                     axes=[2, 3], keep_aspect_ratio_policy="not_larger")],
                   {"x": (f, [1, 2, 4, 5]), "sizes": (np.int64, [2])}, ["y"], opset=19)
    with pytest.raises(NotImplementedError, match="keep_aspect_ratio_policy"):
        onnxgrad.gradients(m, "y", "x")


def test_resize_run_time_second_order():
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["r"], mode="cubic"),
             helper.make_node("Mul", ["r", "r"], ["y"])]
    m = make_model(nodes, {"x": (f, ["N", 1, "H", 4]), "scales": (f, [4])}, ["y"], opset=19)
    res = onnxgrad.gradients(m, "y", "x")
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 1, 3, 4)).astype(f),
             "scales": np.array([1, 1, 2, 1.5], f)}
    assert_gradients(res.model, res.grads[0], "x", feeds)


class _SegHead(torch.nn.Module):
    """A tiny LRASPP / FCN-like segmentation head: a strided stem, a dilated branch gated by a
    global pool, a 1x1 classifier, upsampled back to the input's size with
    F.interpolate(size=x.shape[-2:]), which the TorchScript exporter writes as
    Resize(sizes=Concat(Slice(Shape(o), 0:2), Shape(x)[2:4])): sizes only the run time knows."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.aspp = nn.Conv2d(8, 8, 3, padding=2, dilation=2)
        self.gate = nn.Conv2d(8, 8, 1)
        self.cls = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        h = F.relu(self.bn(self.stem(x)))
        g = torch.sigmoid(self.gate(F.adaptive_avg_pool2d(h, 1)))
        o = self.cls(F.relu(self.aspp(h)) * g)
        return F.interpolate(o, size=x.shape[-2:], mode="bilinear", align_corners=False)


def test_torch_exported_segmentation_head():
    """The torch-exported head differentiated against torch autograd, at two image sizes (odd
    ones: the stem halves them with rounding) and batch sizes from one gradient graph."""
    import io
    import warnings
    from onnxgrad.runtime import session
    torch.manual_seed(0)
    net = _SegHead().eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, torch.randn(1, 3, 20, 18), buf, dynamo=False, input_names=["x"],
                          output_names=["y"], opset_version=17,
                          dynamic_axes={"x": {0: "N", 2: "H", 3: "W"},
                                        "y": {0: "N", 2: "H", 3: "W"}})
    m = onnx.load_from_string(buf.getvalue())
    assert [nd.op_type for nd in m.graph.node].count("Resize") == 1
    tp = dict(net.named_parameters())
    params = [t.name for t in m.graph.initializer if t.name in tp]
    assert len(params) >= 4
    res = onnxgrad.gradients(m, "y", ["x", *params], grad_ys=["gy"])
    sess = session(res.model)
    for shape in [(2, 3, 20, 18), (1, 3, 13, 16)]:
        x = np.random.default_rng(1).standard_normal(shape).astype(f)
        gy = np.random.default_rng(2).standard_normal((shape[0], 4, *shape[2:])).astype(f)
        got = sess.run(res.grads, {"x": x, "gy": gy})
        tx = torch.tensor(x, requires_grad=True)
        want = torch.autograd.grad(net(tx), [tx] + [tp[p] for p in params], torch.tensor(gy))
        for name, a, b in zip(["x", *params], got, want):
            b = b.numpy()
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(),
                                       err_msg=f"{shape} {name}")


def test_resize_second_order():
    # y = Resize(x)^2 summed: the gradient graph is differentiable again (MatMul rules)
    nodes = [helper.make_node("Resize", ["x", "roi", "scales"], ["r"], mode="linear"),
             helper.make_node("Mul", ["r", "r"], ["y"])]
    m = make_model(nodes, {"x": (f, [1, 1, 3, 4])}, ["y"], opset=19,
                   inits={"roi": np.array([], f), "scales": np.array([1, 1, 2, 2], f)})
    res = onnxgrad.gradients(m, "y", "x")
    assert_gradients(res.model, res.grads[0], "x")



# keep_aspect_ratio_policy: one scale for all resized axes (sizes[i] / in[i], min or max), output
# lengths round_half_up(scale * in), coordinates transformed with that scale (not out / in). The
# shapes include outputs rounded up (where floor(scale * in), a resize by scales, is one shorter)
RESIZE_POLICY = [
    ("not_smaller", (2, 4), (1, 3)),   # scale 0.75: 2 -> 2 (1.5 rounded up), 4 -> 3
    ("not_smaller", (5, 3), (2, 7)),   # scale 7/3: 5 -> 12 (11.67), 3 -> 7
    ("not_larger", (3, 7), (5, 9)),    # scale 9/7: 3 -> 4 (3.86), 7 -> 9
    ("not_larger", (4, 5), (8, 8)),    # scale 1.6: 4 -> 6 (6.4), 5 -> 8
]


def _policy_model(policy, hw, sizes, **attrs):
    inits = {"roi": np.array([], f), "scales": np.array([], f),
             "sizes": np.array(sizes, np.int64)}
    return op_model("Resize", {"x": (f, [1, 2, *hw])}, opset=19, inits=inits, axes=[2, 3],
                    keep_aspect_ratio_policy=policy, **attrs)


@pytest.mark.parametrize("mode,ctm", [("nearest", "half_pixel"), ("nearest", "asymmetric"),
                                      ("linear", "half_pixel"), ("linear", "align_corners"),
                                      ("cubic", "pytorch_half_pixel")])
@pytest.mark.parametrize("policy,hw,sizes", RESIZE_POLICY, ids=lambda v: str(v))
def test_resize_keep_aspect_ratio_policy(policy, hw, sizes, mode, ctm):
    m = _policy_model(policy, hw, sizes, mode=mode, coordinate_transformation_mode=ctm)
    r = [s / d for s, d in zip(sizes, hw)]
    sc = min(r) if policy == "not_larger" else max(r)
    out = [int(sc * d + 0.5) for d in hw]
    x = np.random.default_rng(0).standard_normal((1, 2, *hw))
    from onnxgrad.runtime import run
    assert run(onnxgrad.check.to_float64(m), {"x": x}, outputs=["y"])[0].shape == (1, 2, *out)
    _assert_adjoint_of_onnxruntime(m, (1, 2, *hw))


@pytest.mark.parametrize("policy,hw,sizes", [("not_larger", (4, 5), (8, 8)),
                                             ("not_smaller", (4, 6), (2, 2))])
@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_resize_keep_aspect_ratio_policy_matches_torch(policy, hw, sizes, mode):
    """torch's interpolate with the policy's scale_factor (recompute_scale_factor=False: its
    coordinates use that scale too) where floor(scale * in), its output length, is the rounded
    one: nearest = asymmetric + floor, bilinear = half_pixel."""
    r = [s / d for s, d in zip(sizes, hw)]
    sc = min(r) if policy == "not_larger" else max(r)
    attrs = dict(mode="linear") if mode == "bilinear" else dict(
        mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    m = _policy_model(policy, hw, sizes, **attrs)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, *hw))
    kw = {} if mode == "nearest" else {"align_corners": False}
    fn = lambda t: F.interpolate(t, scale_factor=sc, mode=mode, recompute_scale_factor=False, **kw)  # noqa: E731
    gy = rng.standard_normal(fn(torch.tensor(x)).shape)
    y_t, gx_t = _torch_grad(fn, x, gy)
    (gx,), res = grads_of(onnxgrad.check.to_float64(m), "y", ["x"], {"x": x, "gy": gy},
                          grad_ys=["gy"])
    from onnxgrad.runtime import run
    np.testing.assert_allclose(run(res.model, {"x": x, "gy": gy}, outputs=["y"])[0], y_t,
                               rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gx, gx_t, rtol=1e-6, atol=1e-8)


def test_resize_keep_aspect_ratio_policy_without_axes():
    """sizes for every axis: the batch and channel ratios (1) take part in the min / max, and
    the channel axis is resized too (2 -> round_half_up(1.5) = 2 at scale 0.75)."""
    inits = {"roi": np.array([], f), "scales": np.array([], f),
             "sizes": np.array([1, 2, 3, 9], np.int64)}
    for mode in ("nearest", "linear"):
        m = op_model("Resize", {"x": (f, [1, 2, 4, 5])}, opset=19, inits=inits, mode=mode,
                     keep_aspect_ratio_policy="not_larger")
        if mode == "nearest":
            _assert_adjoint_of_onnxruntime(m, (1, 2, 4, 5))
            continue
        # onnxruntime's linear kernel rejects a channel scale: its matrices cannot be read off
        with pytest.raises(onnxgrad.NotDifferentiableError, match="onnxruntime's Resize"):
            onnxgrad.gradients(m, "y", "x")


# an opset-9 model is upgraded to 13 first; the engine restores Upsample's asymmetric coordinates
# that onnx's Upsample -> Resize adapter drops
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample(mode):
    m = op_model("Upsample", {"x": (f, [1, 2, 3, 4])}, opset=9,
                 inits={"scales": np.array([1, 1, 2, 3], f)}, mode=mode)
    # onnxruntime has no float64 Upsample (and onnx.reference no linear one): check in float32
    assert_gradients(m, "y", "x", dtype="float32", f32=False)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample_run_time_scales(mode):
    m = op_model("Upsample", {"x": (f, ["N", 2, "H", 4]), "scales": (f, [4])}, opset=9,
                 mode=mode)
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 2, 3, 4)).astype(f),
             "scales": np.array([1, 1, 2, 3], f)}
    assert_gradients(m, "y", "x", feeds, dtype="float32", f32=False)


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


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attention_fully_masked_rows(dtype):
    """A query row whose every key is masked: onnxruntime's kernel outputs 0 there and the
    gradients through it are 0 (the function body alone would make every gradient NaN). Oracle:
    torch autograd of attention written with that convention, in float64."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 2, 3, 8)) for _ in range(3))
    mask = np.array([[False, False, False], [True, False, True], [True, True, True]])
    gy = rng.standard_normal((1, 2, 3, 8))
    m = op_model("Attention", {"q": (dtype, [1, 2, 3, 8]), "k": (dtype, [1, 2, 3, 8]),
                               "v": (dtype, [1, 2, 3, 8])}, opset=23, inits={"mask": mask})
    res = onnxgrad.gradients(m, "y", ["q", "k", "v"], grad_ys=["gy"])
    from onnxgrad.runtime import session
    feeds = {"q": q, "k": k, "v": v, "gy": gy}
    sess = session(res.model)
    y, *got = sess.run(["y", *res.grads], {n: a.astype(dtype) for n, a in feeds.items()})
    ts = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    s = ts[0] @ ts[1].transpose(-1, -2) / np.sqrt(8)
    live = torch.tensor(mask.any(-1, keepdims=True))
    s = torch.where(torch.tensor(mask), s, torch.tensor(-np.inf, dtype=s.dtype))
    p = torch.softmax(torch.where(live, s, torch.zeros_like(s)), -1) * live
    (p @ ts[2]).backward(torch.tensor(gy))
    tol = 2e-2 if dtype == np.float16 else 1e-4
    np.testing.assert_allclose(y[0, :, 0].astype(np.float64), 0)  # the fully masked row
    for a, t in zip(got, ts):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a.astype(np.float64), t.grad.numpy(), rtol=tol, atol=tol)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(rows=st.lists(st.sampled_from(["open", "some", "min", "inf", "mixed", "-1e4"]),
                     min_size=3, max_size=3), causal=st.booleans(), seed=st.integers(0, 20))
def test_attention_rows_masked_by_the_lowest_float_are_onnxruntimes(rows, causal, seed):
    """HuggingFace masks with finfo(float32).min, and a score plus it rounds to it:
    onnxruntime's kernel outputs 0 for a row of them, as for a row of -inf, where the function
    body gives a uniform softmax; the gradient took the body's (d/dv off by 0.5). y is linear in
    v, so differences of onnxruntime's forward with a step of 1 are exact."""
    from onnxgrad.runtime import session
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(f) for _ in range(3))
    low = np.finfo(f).min
    fill = {"open": [0, 0, 0], "some": [0, low, 0], "min": [low] * 3, "inf": [-np.inf] * 3,
            "mixed": [low, -np.inf, low], "-1e4": [-1e4] * 3}
    mask = np.array([fill[r] for r in rows], f)
    m = op_model("Attention", {"q": (f, [1, 2, 3, 4]), "k": (f, [1, 2, 3, 4]),
                               "v": (f, [1, 2, 3, 4]), "mask": (f, [3, 3])}, opset=23,
                 is_causal=int(causal))
    gy = rng.standard_normal((1, 2, 3, 4)).astype(f)
    res = onnxgrad.gradients(m, "y", ["q", "k", "v"], grad_ys=["gy"])
    feeds = {"q": q, "k": k, "v": v, "mask": mask, "gy": gy}
    got = session(res.model).run(res.grads, feeds)
    fwd = session(m)

    def dot(vv):
        y, = fwd.run(["y"], {"q": q, "k": k, "v": vv, "mask": mask})
        return float((y.astype(np.float64) * gy).sum())
    assert all(np.isfinite(a).all() for a in got)
    np.testing.assert_allclose(got[2], central_differences(dot, v), rtol=1e-4, atol=1e-5)


def test_attention_causal_3d_inputs():
    m = op_model("Attention", {"q": (f, [2, 4, 12]), "k": (f, [2, 4, 12]), "v": (f, [2, 4, 12])},
                 opset=23, is_causal=1, q_num_heads=3, kv_num_heads=3)
    assert_gradients(m, "y", ["q", "k", "v"])


def _torch_attention(q, k, v, mask=None, past=None, nonpad=None, causal=False, mode=0):
    """4-D Attention-24 in torch, as the spec (with onnx 1.23's errata) writes it: a causal mask
    aligned bottom-right (query i sees key j iff j <= i + offset, offset = the past length, or
    nonpad_kv_seqlen - q_len per batch), padded keys masked, fully masked rows 0. Returns
    (y, present_key, present_value, qk_matmul_output)."""
    if past is not None:
        k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
    pk, pv = k, v
    sq, skv, d = q.shape[2], k.shape[2], q.shape[3]
    ninf = torch.tensor(-np.inf, dtype=q.dtype)
    zero = torch.zeros((), dtype=q.dtype)
    bias = torch.zeros(sq, skv, dtype=q.dtype)
    if mask is not None:
        pad = skv - mask.shape[-1]
        if mask.dtype == torch.bool:
            mask = torch.where(F.pad(mask, (0, pad), value=False), zero, ninf)
        bias = bias + F.pad(mask, (0, pad), value=-np.inf)
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None]
    if causal:
        off = past[0].shape[2] if past is not None else 0
        if nonpad is not None:
            off = torch.as_tensor(nonpad).reshape(-1, 1, 1, 1) - sq
        bias = bias + torch.where(j <= i + off, zero, ninf)
    if nonpad is not None:
        bias = bias + torch.where(j < torch.as_tensor(nonpad).reshape(-1, 1, 1, 1), zero, ninf)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / np.sqrt(d)
    dead = torch.isneginf(bias.amax(-1, keepdim=True)).expand(*s.shape)
    p = torch.where(dead, zero, torch.softmax(torch.where(dead, zero, s + bias), -1))
    return p @ v, pk, pv, {0: s, 2: s + bias, 3: p}[mode]


def _attention_model(shapes, dtype=f, opset=24, n_out=1, **attrs):
    """One Attention node; ``shapes`` maps the inputs used (q, k, v, mask, past_key, past_value,
    nonpad) to (dtype, shape), the ones left out are empty optional inputs."""
    order = ["q", "k", "v", "mask", "past_key", "past_value", "nonpad"]
    used = max(order.index(n) for n in shapes) + 1
    outs = ["y", "present_key", "present_value", "qk"][:n_out]
    node = helper.make_node("Attention", [n if n in shapes else "" for n in order[:used]], outs,
                            **attrs)
    return make_model([node], {n: (t or dtype, s) for n, (t, s) in shapes.items()}, outs,
                      opset=opset)


# nonpad_kv_seqlen with is_causal: (batch, q heads, kv heads, q_len, kv_len, nonpad, bool mask)
NONPAD_CAUSAL = {
    "batch_prefill": (3, 2, 2, 2, 6, [4, 5, 6], False),
    "negative_offset": (1, 2, 2, 4, 4, [2], False),  # leading rows see no key: fully masked
    "gqa_decode": (2, 4, 2, 1, 8, [8, 5], False),
    "bool_mask": (2, 2, 2, 3, 6, [4, 5], True),
}


@pytest.mark.parametrize("case", list(NONPAD_CAUSAL))
def test_attention_causal_nonpad_bottom_right(case):
    """External KV cache (nonpad_kv_seqlen) with is_causal: the causal mask is aligned
    bottom-right (offset = nonpad_kv_seqlen - q_len; onnx 1.23's errata). onnxruntime's float32
    kernel does this, its float64 path (the function body it bundles) aligns top-left, so the
    finite differences run on onnx.reference; torch autograd is the second oracle."""
    b, hq, hk, sq, skv, nonpad, bool_mask = NONPAD_CAUSAL[case]
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal(s) for s in ((b, hq, sq, 8), (b, hk, skv, 8), (b, hk, skv, 8)))
    nonpad = np.array(nonpad, np.int64)
    shapes = {"q": (None, q.shape), "k": (None, k.shape), "v": (None, v.shape),
              "nonpad": (np.int64, [b])}
    feeds = {"q": q, "k": k, "v": v, "nonpad": nonpad}
    mask = None
    if bool_mask:
        mask = rng.random((b, 1, sq, skv)) < 0.7
        shapes["mask"], feeds["mask"] = (np.bool_, mask.shape), mask
    m = _attention_model(shapes, is_causal=1)
    assert_gradients(m, "y", ["q", "k", "v"], feeds, runtime="reference")
    gy = rng.standard_normal((b, hq, sq, 8))
    ts = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    y = _torch_attention(*ts, mask=None if mask is None else torch.tensor(mask), nonpad=nonpad,
                         causal=True)[0]
    y.backward(torch.tensor(gy))
    from onnxgrad.runtime import session
    f32 = {n: a.astype(f) if a.dtype == np.float64 else a for n, a in feeds.items()}
    np.testing.assert_allclose(session(m).run(["y"], f32)[0], y.detach().numpy(), atol=1e-5)
    got, _ = grads_of(onnxgrad.check.to_float64(m), "y", ["q", "k", "v"], {**feeds, "gy": gy},
                      grad_ys=["gy"])
    for a, t in zip(got, ts):
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_attention_causal_nonpad_float16():
    """The float16 GQA decode step with an external cache: finite gradients close to float64
    torch autograd (float16 finite differences are too coarse to judge)."""
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 1, 8), (2, 2, 8, 8), (2, 2, 8, 8)))
    nonpad = np.array([8, 5], np.int64)
    m = _attention_model({"q": (None, q.shape), "k": (None, k.shape), "v": (None, v.shape),
                          "nonpad": (np.int64, [2])}, dtype=np.float16, is_causal=1)
    gy = rng.standard_normal((2, 4, 1, 8))
    res = onnxgrad.gradients(m, "y", ["q", "k", "v"], grad_ys=["gy"])
    from onnxgrad.runtime import session
    got = session(res.model).run(res.grads, {"q": q.astype(np.float16), "k": k.astype(np.float16),
                                             "v": v.astype(np.float16), "nonpad": nonpad,
                                             "gy": gy.astype(np.float16)})
    ts = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    _torch_attention(*ts, nonpad=nonpad, causal=True)[0].backward(torch.tensor(gy))
    for a, t in zip(got, ts):
        assert a.dtype == np.float16 and np.isfinite(a).all()
        np.testing.assert_allclose(a.astype(np.float64), t.grad.numpy(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mask_shape", [(2, 1, 4, 18), (2, 3, 4, 18)])
def test_attention_past_causal_qk_output_with_bias(mask_shape):
    """KV cache in the op (past_key/past_value, present outputs), causal (offset = the past
    length), a float mask and qk_matmul_output_mode=2 (scores + mask, -inf where causally
    masked). Finite differences of an output holding -inf are NaN, so they check y and the
    presents; torch autograd checks all four outputs (a cotangent at a -inf score flows into the
    score as through any Add, as torch's does)."""
    rng = np.random.default_rng(13)
    shapes = {"q": (2, 3, 4, 8), "k": (2, 3, 6, 8), "v": (2, 3, 6, 8), "mask": mask_shape,
              "past_key": (2, 3, 12, 8), "past_value": (2, 3, 12, 8)}
    feeds = {n: rng.standard_normal(s) for n, s in shapes.items()}
    m = _attention_model({n: (None, s) for n, s in shapes.items()}, opset=23, n_out=4,
                         is_causal=1, qk_matmul_output_mode=2)
    xs = list(shapes)
    # onnx.reference: onnxruntime's float64 path (its bundled function body) rejects this model
    assert_gradients(m, ["y", "present_key", "present_value"], xs, feeds, runtime="reference")
    ts = {n: torch.tensor(a, requires_grad=True) for n, a in feeds.items()}
    outs = _torch_attention(ts["q"], ts["k"], ts["v"], mask=ts["mask"],
                            past=(ts["past_key"], ts["past_value"]), causal=True, mode=2)
    assert torch.isinf(outs[3]).any()
    gys = [rng.standard_normal(o.shape) for o in outs]
    sum((o * torch.tensor(g)).sum() for o, g in zip(outs, gys)).backward()
    got, _ = grads_of(onnxgrad.check.to_float64(m), ["y", "present_key", "present_value", "qk"],
                      xs, {**feeds, **{f"g{i}": g for i, g in enumerate(gys)}},
                      grad_ys=[f"g{i}" for i in range(4)])
    for a, n in zip(got, xs):
        np.testing.assert_allclose(a, ts[n].grad.numpy(), rtol=1e-6, atol=1e-7, err_msg=n)


def test_attention_causal_bool_mask_fully_masked_row():
    """is_causal with a boolean mask that leaves a query row no key: that row of y is 0 and the
    gradients through it are 0, against float64 finite differences on onnx.reference (which
    zeroes the row as the spec says; onnxruntime's float64 function body gives NaN there)."""
    rng = np.random.default_rng(14)
    feeds = {n: rng.standard_normal((1, 2, 3, 8)) for n in ("q", "k", "v")}
    feeds["mask"] = np.array([[True, False, True], [False, False, True], [True, True, True]])
    m = _attention_model({**{n: (None, (1, 2, 3, 8)) for n in "qkv"},
                          "mask": (np.bool_, (3, 3))}, is_causal=1)
    assert_gradients(m, "y", ["q", "k", "v"], feeds, runtime="reference")
    gy = rng.standard_normal((1, 2, 3, 8))
    (gq, gk, gv), res = grads_of(onnxgrad.check.to_float64(m), "y", ["q", "k", "v"],
                                 {**feeds, "gy": gy}, grad_ys=["gy"])
    np.testing.assert_array_equal(gq[:, :, 1], 0)  # the fully masked row
    ts = [torch.tensor(feeds[n], requires_grad=True) for n in "qkv"]
    _torch_attention(*ts, mask=torch.tensor(feeds["mask"]), causal=True)[0].backward(
        torch.tensor(gy))
    for a, t in zip((gq, gk, gv), ts):
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-6, atol=1e-7)


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


def test_no_rule_still_reports_not_differentiable():
    """An op with neither a rule nor a function body (a custom-domain op here) on the path from y
    to x raises NotDifferentiableError naming it, its domain and the path."""
    from onnx import TensorProto
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Blur", ["r"], ["y"], domain="onnxgrad.test")]
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19),
                                            helper.make_opsetid("onnxgrad.test", 1)], ir_version=10)
    onnx.checker.check_model(m, full_check=True)
    with pytest.raises(onnxgrad.NotDifferentiableError, match=r"'Blur'.*onnxgrad\.test.*-> r ->"):
        onnxgrad.gradients(m, "y", "x")


# -- GridSample ---------------------------------------------------------------------------------
def _grid_model(xshape, gshape, opset, **attrs):
    return op_model("GridSample", {"x": (f, xshape), "grid": (f, gshape)}, opset=opset, **attrs)


# the float64 finite differences run on GridSample-20 (onnx.reference, the fallback for float64
# kernels, knows only its mode names); GridSample-16 is checked against torch. For cubic with
# border padding the rule follows onnxruntime and PyTorch (each tap clamped), where
# onnx.reference clamps the coordinate first
@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("pad", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("ac", [0, 1])
def test_grid_sample_finite_differences(mode, pad, ac):
    m = _grid_model([2, 2, 4, 5], [2, 3, 2, 2], 20, mode=mode, padding_mode=pad,
                    align_corners=ac)
    rng = np.random.default_rng(3)
    # grid points inside and outside [-1, 1]; nearest and the taps' floors have kinks at pixel
    # borders, so the points keep away from them (finite differences would straddle one)
    x = rng.standard_normal((2, 2, 4, 5))
    grid = rng.uniform(-1.4, 1.4, (2, 3, 2, 2))
    for k, size in enumerate([5, 4]):
        c = (grid[..., k] + 1) * (size - 1) / 2 if ac else ((grid[..., k] + 1) * size - 1) / 2
        frac = c - np.floor(c)
        c = np.where(np.abs(frac - 0.5) > 0.4, np.floor(c) + 0.3, c)  # off integers and halves
        grid[..., k] = 2 * c / (size - 1) - 1 if ac else (2 * c + 1) / size - 1
    xs = ["x"] if mode == "nearest" else ["x", "grid"]
    assert_gradients(m, "y", xs, {"x": x.astype(f), "grid": grid.astype(f)})


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("pad", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("ac", [False, True])
@pytest.mark.parametrize("opset", [16, 20])
def test_grid_sample_matches_torch(mode, pad, ac, opset):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 5, 6))
    grid = rng.uniform(-1.3, 1.3, (2, 4, 3, 2))
    gy = rng.standard_normal((2, 3, 4, 3))
    onnx_mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode) if opset >= 20 else mode
    m = _grid_model([2, 3, 5, 6], [2, 4, 3, 2], opset, mode=onnx_mode, padding_mode=pad,
                    align_corners=int(ac))
    tx = torch.tensor(x, requires_grad=True)
    tg = torch.tensor(grid, requires_grad=True)
    F.grid_sample(tx, tg, mode=mode, padding_mode=pad, align_corners=ac).backward(
        torch.tensor(gy))
    res = onnxgrad.gradients(m, "y", ["x", "grid"], grad_ys=["gy"])
    from onnxgrad.runtime import session
    gx, gg = session(res.model).run(res.grads, {"x": x.astype(f), "grid": grid.astype(f),
                                                "gy": gy.astype(f)})
    np.testing.assert_allclose(gx, tx.grad.numpy(), rtol=1e-4, atol=1e-4)
    want = np.zeros_like(grid) if mode == "nearest" else tg.grad.numpy()
    np.testing.assert_allclose(gg, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("pad", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_grid_sample_3d_matches_torch(mode, pad):
    """GridSample-20 in 3-D (trilinear): torch's 5-D grid_sample."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 2, 3, 4, 5))
    grid = rng.uniform(-1.2, 1.2, (2, 2, 3, 2, 3))
    gy = rng.standard_normal((2, 2, 2, 3, 2))
    m = _grid_model([2, 2, 3, 4, 5], [2, 2, 3, 2, 3], 20, mode=mode, padding_mode=pad)
    tx = torch.tensor(x, requires_grad=True)
    tg = torch.tensor(grid, requires_grad=True)
    F.grid_sample(tx, tg, mode="bilinear" if mode == "linear" else mode, padding_mode=pad,
                  align_corners=False).backward(torch.tensor(gy))
    res = onnxgrad.gradients(m, "y", ["x", "grid"], grad_ys=["gy"])
    from onnxgrad.runtime import run
    gx, gg = run(res.model, {"x": x.astype(f), "grid": grid.astype(f), "gy": gy.astype(f)},
                 outputs=res.grads)
    np.testing.assert_allclose(gx, tx.grad.numpy(), rtol=1e-4, atol=1e-4)
    want = np.zeros_like(grid) if mode == "nearest" else tg.grad.numpy()
    np.testing.assert_allclose(gg, want, rtol=1e-3, atol=1e-3)


def test_grid_sample_symbolic_shapes_and_float16():
    """Batch and spatial dims symbolic; float16 X and grid (the scatter adds in float32)."""
    h = np.float16
    m = op_model("GridSample", {"x": (h, ["N", 2, "H", "W"]), "grid": (h, ["N", "h", "w", 2])},
                 opset=20, mode="linear")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 4, 3))
    grid = rng.uniform(-1, 1, (1, 3, 2, 2))
    gy = rng.standard_normal((1, 2, 3, 2))
    res = onnxgrad.gradients(m, "y", ["x", "grid"], grad_ys=["gy"])
    from onnxgrad.runtime import session
    gx, gg = session(res.model).run(res.grads, {"x": x.astype(h), "grid": grid.astype(h),
                                                "gy": gy.astype(h)})
    tx, tg = torch.tensor(x, requires_grad=True), torch.tensor(grid, requires_grad=True)
    F.grid_sample(tx, tg, align_corners=False).backward(torch.tensor(gy))
    assert gx.dtype == h and gg.dtype == h
    np.testing.assert_allclose(gx.astype(np.float64), tx.grad.numpy(), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(gg.astype(np.float64), tg.grad.numpy(), atol=5e-2, rtol=5e-2)


# -- RoiAlign -----------------------------------------------------------------------------------
ROIS = np.array([[0.3, 0.4, 3.6, 2.7], [1.2, 0.1, 4.4, 3.9], [-0.5, 2.0, 2.2, 5.5],
                 [4.0, 3.5, 4.2, 3.6], [2.1, 1.2, 2.7, 1.6]], f)
# the fourth roi is tiny (an empty grid in half_pixel); the fifth is narrower than one pixel
# after spatial_scale (output_half_pixel clamps its size to 1: its end gets no gradient there)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("sr", [0, 2])
def test_roi_align_finite_differences(mode, ctm, sr):
    """Every element of x and of rois probed (rois partly outside the image, sampling_ratio 0
    giving a different grid per roi): Y moves with the rois through the bilinear sample
    positions, as TF's crop_and_resize with its boxes."""
    m = op_model("RoiAlign", {"x": (f, [2, 3, 5, 6]), "rois": (f, ["R", 4])}, opset=16,
                 inits={"bi": np.array([0, 1, 1, 0, 1], np.int64)}, mode=mode,
                 coordinate_transformation_mode=ctm, sampling_ratio=sr, output_height=2,
                 output_width=3, spatial_scale=0.9)
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 6)).astype(f)
    rep = assert_gradients(m, "y", ["x", "rois"], {"x": x, "rois": ROIS}, max_elements=200)
    assert [r.checked for r in rep.results] == [180, 20]
    assert np.abs(rep.results[1].grad).min() > 0 or ctm == "output_half_pixel"


def test_roi_align_10_symbolic_batch():
    """RoiAlign-10 (output_half_pixel coordinates) with symbolic batch and roi counts."""
    m = op_model("RoiAlign", {"x": (f, ["N", 2, 4, 5]), "rois": (f, ["R", 4])}, opset=10,
                 inits={"bi": np.array([1, 0], np.int64)}, output_height=2, output_width=2)
    rng = np.random.default_rng(1)
    # (ROIS[1] puts samples exactly on the last column of this 5-wide image: a kink)
    rois = np.array([[0.3, 0.4, 3.6, 2.7], [1.15, 0.1, 4.35, 3.9]], f)
    feeds = {"x": rng.standard_normal((2, 2, 4, 5)).astype(f), "rois": rois}
    rep = assert_gradients(m, "y", ["x", "rois"], feeds, max_elements=100)
    assert [r.checked for r in rep.results] == [80, 8]


def test_roi_align_rois_only_skips_the_scatter():
    """Only the rois' gradient wanted: no ScatterElements for X's."""
    m = op_model("RoiAlign", {"x": (f, [1, 1, 6, 6]), "rois": (f, [1, 4])}, opset=16,
                 inits={"bi": np.array([0], np.int64)}, output_height=2, output_width=2)
    res = onnxgrad.gradients(m, "y", "rois")
    assert not [nd for nd in res.model.graph.node if nd.op_type == "ScatterElements"]
    x = np.random.default_rng(3).standard_normal((1, 1, 6, 6)).astype(f)
    assert_gradients(m, "y", "rois", {"x": x, "rois": np.array([[0.7, 1.3, 4.6, 5.2]], f)})


# -- DeformConv ---------------------------------------------------------------------------------
def _deform_case(n=2, c=4, h=5, w=6, oc=4, k=(2, 3), s=(1, 1), d=(1, 1), p=(0, 0, 0, 0),
                 group=1, og=1, mask=False, bias=False, seed=0, dtype=f, batch=None):
    """A DeformConv model, its differentiable inputs and feeds. Offsets reach past the image
    borders (zero padding) and keep their fractional parts away from 0: the bilinear weights
    have kinks at integer coordinates, which central differences must not straddle."""
    from util import rand
    oh = (h + p[0] + p[2] - ((k[0] - 1) * d[0] + 1)) // s[0] + 1
    ow = (w + p[1] + p[3] - ((k[1] - 1) * d[1] + 1)) // s[1] + 1
    nk = k[0] * k[1]
    nb = n if batch is None else batch
    shapes = {"x": [nb, c, h, w], "w": [oc, c // group, *k], "offset": [nb, og * nk * 2, oh, ow]}
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((n, c, h, w)), "w": rng.standard_normal((oc, c // group, *k)),
             "offset": rand((n, og * nk * 2, oh, ow), -1.8, 1.8, away=(-1, 0, 1), gap=0.08,
                            seed=seed, dtype=np.float64)}
    names = ["x", "w", "offset"]
    if bias or mask:
        names.append("b" if bias else "")
        if bias:
            shapes["b"] = [oc]
            feeds["b"] = rng.standard_normal(oc)
    if mask:
        names.append("mask")
        shapes["mask"] = [nb, og * nk, oh, ow]
        feeds["mask"] = rng.uniform(-1, 1, (n, og * nk, oh, ow))
    node = helper.make_node("DeformConv", names, ["y"], kernel_shape=list(k), strides=list(s),
                            dilations=list(d), pads=list(p), group=group, offset_group=og)
    m = make_model([node], {k_: (dtype, v) for k_, v in shapes.items()}, ["y"], opset=19)
    return m, list(shapes), {k_: v.astype(dtype) for k_, v in feeds.items()}


DEFORM = {
    "default": dict(),
    "strides-pads-dilations": dict(h=7, w=8, s=(2, 1), p=(1, 0, 1, 2), d=(1, 2)),
    "stride-2-pads": dict(h=6, w=6, k=(3, 3), s=(2, 2), p=(1, 1, 1, 1)),
    "group-2": dict(group=2, oc=6),
    "offset-group-2": dict(og=2),
    "mask": dict(mask=True),
    "bias": dict(bias=True),
    "group-2-offset-group-2-mask-bias": dict(group=2, og=2, mask=True, bias=True),
    "group-2-offset-group-4-mask": dict(c=4, group=2, og=4, mask=True, k=(2, 2)),
    "1x1-kernel": dict(k=(1, 1), bias=True),
}


@pytest.mark.parametrize("case", DEFORM.values(), ids=DEFORM.keys())
def test_deform_conv_finite_differences(case):
    """float64 finite differences of onnxruntime's DeformConv kernel, every input (x, w, offset,
    b, mask) probed; the same gradient graph in float32 on onnxruntime."""
    m, xs, feeds = _deform_case(**case)
    rep = assert_gradients(m, "y", xs, feeds, max_elements=64)
    assert {r.name for r in rep.results} == set(xs)


@pytest.mark.parametrize("case", DEFORM.values(), ids=DEFORM.keys())
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_deform_conv_sampling_matches_runtimes(case, dtype):
    """The sampling the rule rebuilds (taps, weights, zero padding, offset and mask layout,
    groups), contracted with W, reproduces onnxruntime's DeformConv kernel and onnx.reference's
    DeformConv (a GridSample per kernel tap and output pixel)."""
    import onnx_ir as ir
    from onnxgrad.emitter import Emitter
    from onnxgrad.rules.vision import deform_conv_2d
    from onnxgrad.runtime import session
    m, xs, feeds = _deform_case(**case, dtype=dtype)
    node = m.graph.node[0]
    attrs = {a.name: list(a.ints) if a.ints else a.i for a in node.attribute}
    model = ir.serde.deserialize_model(m)
    graph = model.graph
    for n_ in list(graph):
        graph.remove(n_)
    graph.outputs.clear()
    e = Emitter(graph, "rebuilt", 19)
    ins = {v.name: e.wrap(v) for v in graph.inputs}
    y = deform_conv_2d(e, ins["x"], ins["w"], ins["offset"], ins.get("b"), ins.get("mask"),
                       kernel=attrs["kernel_shape"], strides=attrs["strides"],
                       dilations=attrs["dilations"], pads=attrs["pads"], group=attrs["group"],
                       offset_group=attrs["offset_group"])
    graph.outputs.append(y.value)
    rebuilt = onnx.shape_inference.infer_shapes(ir.serde.serialize_model(model), strict_mode=True)
    onnx.checker.check_model(rebuilt, full_check=True)
    assert "DeformConv" not in {n_.op_type for n_ in rebuilt.graph.node}
    (got,) = session(rebuilt).run(None, feeds)
    (want,) = session(m).run(None, feeds)
    from onnx.reference import ReferenceEvaluator
    (ref,) = ReferenceEvaluator(m).run(None, feeds)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    # onnx.reference goes through normalized GridSample coordinates, float32-accurate only
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_deform_conv_zero_offsets_match_torch_conv2d():
    """With zero offsets and no mask DeformConv is Conv: dX, dW and dB equal torch autograd's
    conv2d gradients (strides, pads, dilations, groups)."""
    cfg = dict(n=2, c=4, h=7, w=6, oc=6, k=(3, 2), s=(2, 1), p=(1, 0, 2, 1), d=(1, 2), group=2,
               bias=True)
    m, xs, feeds = _deform_case(**cfg, dtype=np.float64)
    feeds["offset"] = np.zeros_like(feeds["offset"])
    rng = np.random.default_rng(4)
    tx, tw, tb = (torch.tensor(feeds[k], requires_grad=True) for k in ("x", "w", "b"))
    # torch pads symmetrically: pad x by hand for the asymmetric pads
    xp = F.pad(tx, (0, 1, 1, 2))
    y = F.conv2d(xp, tw, tb, stride=(2, 1), dilation=(1, 2), groups=2)
    gy = rng.standard_normal(tuple(y.shape))
    y.backward(torch.tensor(gy))
    got, _ = grads_of(m, "y", ["x", "w", "b"], {**feeds, "gy": gy}, grad_ys=["gy"])
    for a, t in zip(got, (tx, tw, tb)):
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-10, atol=1e-10)


def test_deform_conv_symbolic_batch_runs_for_two_batch_sizes():
    for n in (1, 3):
        m, xs, feeds = _deform_case(n=n, batch="N", group=2, og=2, mask=True, bias=True, seed=n)
        assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
        assert_gradients(m, "y", xs, feeds, max_elements=32)


def test_deform_conv_second_order():
    """The gradient graph (GatherElements, ScatterElements, MatMul, Floor ...) is differentiable
    again: d(<dW, V>)/d(x, offset, mask) by finite differences."""
    m, xs, feeds = _deform_case(n=1, c=2, h=4, w=4, oc=2, k=(2, 2), mask=True, bias=True)
    res = onnxgrad.gradients(m, "y", ["w", "x"])
    nodes = [helper.make_node("Mul", [res.grads[0], "v"], ["p0"]),
             helper.make_node("Mul", [res.grads[1], res.grads[1]], ["p1"]),
             helper.make_node("ReduceSum", ["p0"], ["s0"], keepdims=0),
             helper.make_node("ReduceSum", ["p1"], ["s1"], keepdims=0),
             helper.make_node("Add", ["s0", "s1"], ["z"])]
    g = res.model.graph
    g.node.extend(nodes)
    g.input.append(helper.make_tensor_value_info("v", onnx.TensorProto.FLOAT, [2, 2, 2, 2]))
    g.output.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, []))
    feeds["v"] = np.random.default_rng(9).standard_normal((2, 2, 2, 2)).astype(f)
    assert_gradients(res.model, "z", ["x", "offset", "mask", "w"], feeds, max_elements=32)


def test_deform_conv_float16():
    """float16 inputs: the gradient graph runs in float16 (the scatter adds in float32) and
    agrees with the float64 gradient of the same graph."""
    from onnxgrad.runtime import session
    got = {}
    for dtype in (np.float64, np.float16):
        m, xs, feeds = _deform_case(group=2, og=2, mask=True, bias=True, dtype=dtype)
        gy = np.random.default_rng(2).standard_normal((2, 4, 4, 4)).astype(dtype)
        res = onnxgrad.gradients(m, "y", xs, grad_ys=["gy"])
        try:
            outs = session(res.model).run(res.grads, {**feeds, "gy": gy})
        except Exception:  # noqa: BLE001  no float16 DeformConv kernel for the forward
            from onnxgrad.runtime import run
            outs = run(res.model, {**feeds, "gy": gy}, outputs=res.grads, prefer="reference")
        got[dtype] = outs
    for name, a, b in zip(xs, got[np.float16], got[np.float64]):
        assert a.dtype == np.float16, name
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a.astype(np.float64), b, rtol=2e-2, atol=2e-2 * scale,
                                   err_msg=name)


@pytest.mark.parametrize("pads", [[0, 0, 0, 0], [1, 1, 1, 1]])
def test_deform_conv_offset_gradient_on_kinks_is_right_sided(pads):
    """Offsets of 0 put every sample on integer coordinates, where bilinear sampling (and the
    zero padding at the border) has kinks: the inputs of the ONNX backend cases, which the
    conformance sweep checks with the offset held constant. There d offset is the right-sided
    derivative (floor(c) is the lower tap, as in torchvision's deform_conv2d), checked here with
    one-sided differences of onnxruntime's float64 DeformConv; the outputs match the cases'."""
    from onnxgrad.runtime import session
    d = np.float64
    x = np.arange(9, dtype=d).reshape(1, 1, 3, 3)
    o = 4 if pads[0] else 2
    offset = np.zeros((1, 8, o, o), d)
    offset[0, 0, 0, 0] = 0.5
    offset[0, 5, 0, 1] = -0.1
    mask = np.ones((1, 4, o, o), d)
    mask[0, 2, 1, 1] = 0.2
    ins = {"x": (d, [1, 1, 3, 3]), "w": (d, [1, 1, 2, 2]), "offset": (d, [1, 8, o, o]),
           "b": (d, [1]), "mask": (d, [1, 4, o, o])}
    m = op_model("DeformConv", ins, opset=19, kernel_shape=[2, 2], pads=pads)
    feeds = {"x": x, "w": np.ones((1, 1, 2, 2), d), "offset": offset, "b": np.ones(1, d),
             "mask": mask}
    fwd = session(m)
    y = fwd.run(None, feeds)[0]
    if not pads[0]:
        np.testing.assert_allclose(y[0, 0], [[10.5, 12.9], [21.0, 19.4]], rtol=1e-12)
    gy = np.random.default_rng(0).standard_normal(y.shape)
    res = onnxgrad.gradients(m, "y", ["offset"], grad_ys=["gy"])
    (got,) = session(res.model).run(res.grads, {**feeds, "gy": gy})
    eps = 1e-7
    want, left = np.zeros_like(offset), np.zeros_like(offset)
    for i in np.ndindex(offset.shape):
        for sign, out in ((1, want), (-1, left)):
            shifted = offset.copy()
            shifted[i] += sign * eps
            out[i] = sign * ((fwd.run(None, {**feeds, "offset": shifted})[0] - y) * gy).sum() / eps
    assert (np.abs(want - left) > 1e-3).sum() > 10  # the kinks are there
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# -- MaxRoiPool ---------------------------------------------------------------------------------
def _c_round(v):  # C's round(): halves away from zero (ONNX Round goes to even)
    return int(np.copysign(np.floor(abs(v) + 0.5), v))


def _roi_pool_bins(rois, pooled, scale, height, width):
    """Every bin as onnxruntime's roi_pool.cc computes it (float32 products, C's round, floor and
    ceil edges, clipping to the image): (roi, batch, i, j, h0, h1, w0, w1)."""
    s = np.float32(scale)
    for r, roi in enumerate(np.asarray(rois, np.float32)):
        x1, y1, x2, y2 = (_c_round(float(v * s)) for v in roi[1:])
        bh = np.float32(max(y2 - y1 + 1, 1)) / np.float32(pooled[0])
        bw = np.float32(max(x2 - x1 + 1, 1)) / np.float32(pooled[1])
        for i in range(pooled[0]):
            for j in range(pooled[1]):
                edges = [(np.floor(np.float32(i) * bh), y1, height),
                         (np.ceil(np.float32(i + 1) * bh), y1, height),
                         (np.floor(np.float32(j) * bw), x1, width),
                         (np.ceil(np.float32(j + 1) * bw), x1, width)]
                yield (r, int(roi[0]), i, j, *(min(max(int(v) + o, 0), d) for v, o, d in edges))


def _roi_pool(x, rois, pooled, scale):
    """MaxRoiPool in numpy (any float dtype): the max of each bin, 0 for an empty one."""
    y = np.zeros((len(rois), x.shape[1], *pooled), x.dtype)
    for r, b, i, j, h0, h1, w0, w1 in _roi_pool_bins(rois, pooled, scale, *x.shape[2:]):
        if h1 > h0 and w1 > w0:
            y[r, :, i, j] = x[b, :, h0:h1, w0:w1].max(axis=(1, 2))
    return y


def _roi_pool_backward(x, rois, pooled, scale, gy):
    """The routing backward (Caffe's): each bin's g to its argmax, added up."""
    gx = np.zeros(x.shape)
    for r, b, i, j, h0, h1, w0, w1 in _roi_pool_bins(rois, pooled, scale, *x.shape[2:]):
        if h1 > h0 and w1 > w0:
            for c in range(x.shape[1]):
                h, w = np.unravel_index(np.argmax(x[b, c, h0:h1, w0:w1]), (h1 - h0, w1 - w0))
                gx[b, c, h0 + h, w0 + w] += gy[r, c, i, j]
    return gx


@pytest.fixture
def roi_pool_f64(monkeypatch):
    """onnxruntime's MaxRoiPool is float32 only and onnx.reference has none: the float64 copy the
    finite differences run on gets the numpy one above (held to onnxruntime's, bit for bit, by
    test_max_roi_pool_matches_onnxruntime) as a kernel of the reference runtime."""
    from onnx.reference.op_run import OpRun

    import onnxgrad.runtime as rt

    class MaxRoiPool(OpRun):
        def _run(self, x, rois, pooled_shape=None, spatial_scale=None):
            scale = 1.0 if spatial_scale is None else spatial_scale
            return (_roi_pool(x, rois, list(pooled_shape), scale),)

    ops = rt._exact_ops()
    monkeypatch.setattr(rt, "_exact_ops", lambda: [*ops, MaxRoiPool])


RP_ROIS = np.array([  # (batch, x1, y1, x2, y2) on images of 6 x 7
    [0, 0.3, 0.4, 4.6, 3.7],
    [1, 1.2, 0.1, 5.4, 5.9],      # the other image
    [1, 2.0, 1.0, 6.0, 4.0],      # overlaps the one before
    [0, -2.5, 2.0, 2.2, 9.5],     # partly outside the image; -2.5 rounds to -3
    [1, 0.5, 1.5, 3.5, 4.5],      # halves at scale 1: 1, 2, 4, 5 (half to even: 0, 2, 4, 4)
    [0, 4.0, 3.0, 2.0, 2.0],      # malformed (x2 < x1, y2 < y1): made 1 x 1
    [1, 9.0, 8.0, 12.0, 11.0],    # outside the image at scale <= 0.8: empty bins, Y = 0
], f)
RP_CASES = [((2, 3), 1.0), ((3, 2), 0.8), ((1, 1), 0.5), ((4, 3), 1.0)]


def _roi_pool_model(pooled, scale, x_shape=(2, 3, 6, 7), opset=18):
    return op_model("MaxRoiPool", {"x": (f, list(x_shape))}, inits={"rois": RP_ROIS},
                    opset=opset, pooled_shape=list(pooled), spatial_scale=scale)


@pytest.mark.parametrize("pooled, scale", RP_CASES)
def test_max_roi_pool_matches_onnxruntime(pooled, scale):
    """The numpy MaxRoiPool is onnxruntime's, bit for bit (so the float64 finite differences
    below differentiate onnxruntime's op), and the gradient graph on onnxruntime routes g as the
    numpy argmax backward does (random x: no ties)."""
    x = np.random.default_rng(3).standard_normal((2, 3, 6, 7)).astype(f)
    gy = np.random.default_rng(4).standard_normal((len(RP_ROIS), 3, *pooled)).astype(f)
    m = _roi_pool_model(pooled, scale)
    (gx,), res = grads_of(m, "y", "x", {"x": x, "gy": gy}, grad_ys=["gy"])
    from onnxgrad.runtime import run
    y = run(res.model, {"x": x, "gy": gy}, outputs=["y"])[0]
    np.testing.assert_array_equal(y, _roi_pool(x, RP_ROIS, pooled, scale))
    np.testing.assert_allclose(gx, _roi_pool_backward(x, RP_ROIS, pooled, scale, gy), atol=1e-6)


@pytest.mark.parametrize("pooled, scale", RP_CASES)
def test_max_roi_pool_finite_differences(roi_pool_f64, pooled, scale):
    """Every element of x probed in float64 (rois frozen: proposals get no gradient); the same
    graph in float32 on onnxruntime gives the same gradient."""
    rep = assert_gradients(_roi_pool_model(pooled, scale), "y", "x", max_elements=300)
    assert rep.results[0].checked == 2 * 3 * 6 * 7


def test_max_roi_pool_tie_splits_evenly(roi_pool_f64):
    """Two equal maxima in a bin share its gradient (what central differences see there)."""
    x = np.array([[[[1.0, 3.0, 0.5], [3.0, -1.0, 2.0]]]], f)
    m = op_model("MaxRoiPool", {"x": (f, [1, 1, 2, 3])},
                 inits={"rois": np.array([[0, 0, 0, 1, 1], [0, 0, 0, 2, 1]], f)},
                 pooled_shape=[1, 1])
    (gx,), _ = grads_of(m, "y", "x", {"x": x})
    np.testing.assert_array_equal(gx, [[[[0, 1, 0], [1, 0, 0]]]])
    assert_gradients(m, "y", "x", {"x": x})


def test_max_roi_pool_runtime_rois_symbolic_shapes(roi_pool_f64):
    """rois computed at run time (a graph input held constant) and symbolic batch, image and
    roi counts: the bins are rebuilt from the fed rois, for two different sizes."""
    m = op_model("MaxRoiPool", {"x": (f, ["N", 2, "H", "W"]), "rois": (f, ["R", 5])},
                 pooled_shape=[2, 2], spatial_scale=0.8)
    rng = np.random.default_rng(5)
    one_image = RP_ROIS[[0, 3, 5]] * np.array([0, 1, 1, 1, 1], f)  # all on image 0
    for shape, rois in [((2, 2, 6, 7), RP_ROIS), ((1, 2, 9, 5), one_image)]:
        x = rng.standard_normal(shape).astype(f)
        rep = assert_gradients(m, "y", "x", {"x": x, "rois": rois}, max_elements=200)
        assert rep.results[0].checked == x.size


def test_max_roi_pool_second_order(roi_pool_f64):
    """The gradient graph differentiated again (x small: onnx.reference's GatherElements, which
    the float64 check runs here, is wrong past 32 elements along its axis)."""
    nodes = [helper.make_node("MaxRoiPool", ["x", "rois"], ["t"], pooled_shape=[2, 2]),
             helper.make_node("Mul", ["t", "t"], ["y"])]
    m = make_model(nodes, {"x": (f, [2, 2, 3, 5])}, ["y"], inits={"rois": RP_ROIS})
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
    from onnxgrad.check import check_gradients
    rep = check_gradients(res.model, res.grads, ["x", "gy"], max_elements=300)
    assert rep.ok, str(rep)
