"""The training step's Conv nodes in onnxruntime's blocked layout (onnxgrad.training.nchwc):
the same function as the Conv on generated convolutions, held to a rounding bound computed in
float64; a Trainer on a CNN whose convolutions take it, against torch; and the models onnxgrad
returns stay standard ONNX."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.runtime import session
from onnxgrad.training import SGD, Trainer
from onnxgrad.training.nchwc import DOMAIN, MIN_POSITIONS, block_size, blocked_convs

torch = pytest.importorskip("torch")
F = torch.nn.functional
F32 = TensorProto.FLOAT
B = block_size()
SEG_K = B or 8  # _segnet's channels: a multiple of the block, whichever this machine has


def blocked(m) -> int:
    return sum(n.domain == DOMAIN and n.op_type == "Conv" for n in m.graph.node)


def conv_model(n, c, co, hw, k, attrs, bias, symbolic):
    cg = c // attrs.get("group", 1)
    dims = {"": [n, c, *hw], "N": ["N", c, *hw], "NHW": ["N", c, "H", "W"]}.get(symbolic)
    ins = [helper.make_tensor_value_info("x", F32, dims),
           helper.make_tensor_value_info("w", F32, [co, cg, *k])]
    if bias:
        ins.append(helper.make_tensor_value_info("b", F32, [co]))
    node = helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y"], name="conv",
                            **attrs)
    g = helper.make_graph([node], "conv", ins, [helper.make_tensor_value_info("y", F32, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def torch_conv(x, w, b, attrs):
    """Conv in float64 by torch, with ONNX's explicit or SAME_* pads (SAME: ceil(in / stride)
    outputs)."""
    s, d = attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1])
    auto = attrs.get("auto_pad", "NOTSET")
    if auto.startswith("SAME"):
        pads = []
        for i in range(2):
            out = -(-x.shape[2 + i] // s[i])
            total = max((out - 1) * s[i] + d[i] * (w.shape[2 + i] - 1) + 1 - x.shape[2 + i], 0)
            small, big = total // 2, total - total // 2
            pads.append((big, small) if auto == "SAME_LOWER" else (small, big))
        p = [pads[0][0], pads[1][0], pads[0][1], pads[1][1]]
    else:
        p = attrs.get("pads", [0, 0, 0, 0])
    x = F.pad(x, [p[1], p[3], p[0], p[2]])
    return F.conv2d(x, w, b, stride=s, dilation=d, groups=attrs.get("group", 1))


@st.composite
def convs(draw):
    b = B or 8
    grouping = draw(st.sampled_from(["none", "none", "depthwise", "two"]))
    co = draw(st.sampled_from([b, b, 2 * b, 4, b + 4]))
    c = co if grouping == "depthwise" else draw(st.sampled_from([b, b, 2 * b, 3, 4, b + 4]))
    if grouping == "two":
        c, co = 2 * c, 2 * co
    k = [draw(st.integers(1, 3)), draw(st.integers(1, 3))]
    attrs = {"strides": [draw(st.sampled_from([1, 1, 2])), draw(st.sampled_from([1, 1, 2]))],
             "dilations": [draw(st.integers(1, 2)), draw(st.integers(1, 2))]}
    if grouping != "none":
        attrs["group"] = c if grouping == "depthwise" else 2
    auto = draw(st.sampled_from(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    if auto == "NOTSET":
        attrs["pads"] = [draw(st.integers(0, 2)) for _ in range(4)]
    else:  # onnxruntime's Conv (either layout) refuses SAME_* with dilations
        attrs["auto_pad"] = auto
        attrs["dilations"] = [1, 1] if auto.startswith("SAME") else attrs["dilations"]
    span = [attrs["dilations"][i] * (k[i] - 1) + 1 for i in range(2)]
    hw = [span[i] + draw(st.sampled_from([0, 2, 5, 9, 14])) for i in range(2)]
    return dict(n=draw(st.integers(1, 3)), c=c, co=co, hw=hw, k=k, attrs=attrs,
                bias=draw(st.booleans()),
                symbolic=draw(st.sampled_from(["", "N", "NHW", "unknown"])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(convs(), st.integers(0, 2**31 - 1))
def test_same_function_as_the_conv(spec, seed):
    """Every generated Conv: rewritten exactly when eligible (explicit pads, a kernel over 1x1,
    input and output channels multiples of the block; depthwise, or ungrouped with at least
    MIN_POSITIONS output positions or an image size not known), and the blocked form
    computes what the Conv computes, within float32 rounding of its sums (the bound below holds
    for any order of summation)."""
    m = conv_model(**spec)
    before = m.SerializeToString()
    got_model = blocked_convs(m)
    assert m.SerializeToString() == before  # the input model is never changed
    c, co, group = spec["c"], spec["co"], spec["attrs"].get("group", 1)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((spec["n"], c, *spec["hw"])).astype(np.float32)
    w = rng.standard_normal((co, c // group, *spec["k"])).astype(np.float32)
    feeds = {"x": x, "w": w}
    if spec["bias"]:
        feeds["b"] = rng.standard_normal(co).astype(np.float32)
    got = session(got_model).run(None, feeds)[0]
    positions = got.shape[2] * got.shape[3]
    eligible = bool(B) and co % B == 0 and c % B == 0 and spec["k"] != [1, 1] and \
        not spec["attrs"].get("auto_pad", "").startswith("SAME") and (
            group == c or group == 1 and (spec["symbolic"] in ("NHW", "unknown")
                                          or positions >= MIN_POSITIONS))
    assert blocked(got_model) == eligible
    if not eligible:
        assert got_model is m
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in feeds.items()}
    want = torch_conv(t["x"], t["w"], t.get("b"), spec["attrs"]).numpy()
    assert got.shape == want.shape
    a = {k: v.abs() for k, v in t.items()}
    scale = torch_conv(a["x"], a["w"], a.get("b"), spec["attrs"]).numpy()
    terms = w[0].size + 1
    assert np.all(np.abs(got - want) <= 2 * terms * 2.0**-24 * scale + 1e-30)


def _segnet(seed=0):
    """x [N, K, 20, 20] -> Conv 3x3 (2K) -> Relu -> Conv 3x3 stride 2 (K) -> Relu -> depthwise
    Conv 3x3 (K) -> Conv 1x1 (3 classes): per-pixel logits [N, 3, 10, 10]. K is this machine's
    block (8 with AVX2, 16 with AVX-512), so that Convs 1-3 can be blocked on either."""
    k = SEG_K
    rng = np.random.default_rng(seed)
    shapes = {"w1": (2 * k, k, 3, 3), "b1": (2 * k,), "w2": (k, 2 * k, 3, 3), "w3": (k, 1, 3, 3),
              "w4": (3, k, 1, 1)}
    init = {name: (rng.standard_normal(s) / np.sqrt(np.prod(s[1:]) if len(s) > 1 else 4))
            .astype(np.float32) for name, s in shapes.items()}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1] * 4, strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=[1] * 4, group=k),
             helper.make_node("Conv", ["c3", "w4"], ["logits"])]
    g = helper.make_graph(nodes, "segnet", [helper.make_tensor_value_info("x", F32,
                                                                          ["N", k, 20, 20])],
                          [helper.make_tensor_value_info("logits", F32, ["N", 3, 10, 10])],
                          [numpy_helper.from_array(v, name) for name, v in init.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)

    def forward(x, p):
        y = F.relu(F.conv2d(x, p["w1"], p["b1"], padding=1))
        y = F.relu(F.conv2d(y, p["w2"], padding=1, stride=2))
        return F.conv2d(F.conv2d(y, p["w3"], padding=1, groups=SEG_K), p["w4"])
    return m, init, forward


def test_trainer_with_blocked_convs_matches_torch():
    """A Trainer whose step runs its forward and input-gradient Convs blocked trains as torch
    does (SGD with momentum, 6 steps), and the step it would export is standard ONNX."""
    m, init, forward = _segnet()
    tr = Trainer(m, "cross_entropy", optimizer=SGD(lr=0.1, momentum=0.9), device="cpu",
                 fused_optimizer=False, progress=False)
    step_model = tr.train_step.model
    assert not any(n.domain == DOMAIN for n in step_model.graph.node)
    onnx.checker.check_model(step_model, full_check=True)
    # at least the forward Convs 1-3 (Conv 4 has 3 output channels)
    assert blocked(blocked_convs(step_model)) >= 3 if B else blocked_convs(step_model) is \
        step_model
    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((4, SEG_K, 20, 20)).astype(np.float32),
                rng.integers(0, 3, (4, 10, 10))) for _ in range(6)]
    losses = [tr.step({"x": x, "target": y}) for x, y in batches]
    p = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in init.items()}
    opt = torch.optim.SGD(list(p.values()), lr=0.1, momentum=0.9)
    want = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(forward(torch.tensor(x, dtype=torch.float64), p),
                               torch.tensor(y))
        loss.backward()
        opt.step()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=1e-4)
    for k, v in tr.parameters().items():
        ref = p[k].detach().numpy()
        np.testing.assert_allclose(v, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=k)


def test_switched_off_and_left_alone(monkeypatch):
    """ONNXGRAD_NCHWC=0 leaves every Conv standard; float64 and 3-D Convs are never blocked."""
    m = conv_model(2, 8, 8, [9, 9], [3, 3], {"pads": [1] * 4}, False, "N")
    monkeypatch.setenv("ONNXGRAD_NCHWC", "0")
    block_size.cache_clear()
    try:
        assert block_size() == 0 and blocked_convs(m) is m
    finally:
        monkeypatch.delenv("ONNXGRAD_NCHWC")
        block_size.cache_clear()
    m64 = onnx.ModelProto()
    m64.CopyFrom(m)
    for v in m64.graph.input:
        v.type.tensor_type.elem_type = TensorProto.DOUBLE
    m64.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    assert blocked_convs(m64) is m64
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1] * 6)
    g = helper.make_graph([node], "c3d", [helper.make_tensor_value_info("x", F32, [1, 8, 4, 4, 4]),
                                          helper.make_tensor_value_info("w", F32, [8, 8, 3, 3, 3])],
                          [helper.make_tensor_value_info("y", F32, None)])
    m3 = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    assert blocked_convs(m3) is m3
