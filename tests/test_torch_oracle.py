"""Composite models against PyTorch autograd.

Each model is written twice, as an ONNX graph (onnx.helper) and as the same computation in
PyTorch; onnxgrad's gradient graph, run on onnxruntime, must give torch's gradients for the input
and every weight: to 1e-4 relative in float32 and far tighter in float64. Also a Hessian-vector
product (the gradient of gradient . v) against torch.autograd.functional.hvp.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnxgrad
from onnxgrad.runtime import run, session

torch = pytest.importorskip("torch")

TOL = {np.float32: 1e-4, np.float64: 1e-9}


def tensor_type(dtype):
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def build(nodes, inputs, outputs, inits, opset):
    """inputs: {name: (dtype, shape)}; inits: {name: array}; outputs: names."""
    g = helper.make_graph(
        nodes, "model",
        [helper.make_tensor_value_info(n, tensor_type(t), s) for n, (t, s) in inputs.items()],
        [helper.make_empty_tensor_value_info(n) for n in outputs],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    onnx.checker.check_model(m, full_check=True)
    return m


def run_grads(res, feeds, dtype):
    """Run the gradient graph on onnxruntime CPU.

    float64 runs with basic graph optimizations only: at the extended level onnxruntime fuses
    Mul-by-scalar + MatMul into com.microsoft FusedMatMul, whose float ``alpha`` attribute rounds
    the scale to float32 (1e-8 relative errors in a float64 model). onnx.reference stands in only
    where onnxruntime has no float64 kernel at all."""
    if dtype == np.float32:
        return session(res.model).run(res.grads, feeds)
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.log_severity_level = 3
    try:
        sess = ort.InferenceSession(res.model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001  (NOT_IMPLEMENTED float64 kernels)
        return run(res.model, feeds, outputs=res.grads, prefer="reference")
    return sess.run(res.grads, feeds)


def assert_close(got, want, dtype, name):
    want = want.detach().numpy() if hasattr(want, "detach") else np.asarray(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert got.dtype == dtype, (name, got.dtype)
    tol = TOL[dtype]
    scale = max(float(np.abs(want).max()), 1e-30)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=name)


def torch_grads(fn, values, wrt):
    """Gradients of the scalar fn(**tensors) wrt the named arrays, in their dtype."""
    ts = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in values.items()}
    out = fn(**ts)
    gs = torch.autograd.grad(out, [ts[k] for k in wrt])
    return [g.numpy() for g in gs]


# -- (a) MLP [B,20] -> 32 -> 32 -> 10, softmax cross-entropy ---------------------------------------
ACT_ONNX = {"Relu": "Relu", "Tanh": "Tanh", "Gelu": "Gelu"}
ACT_TORCH = {"Relu": torch.relu, "Tanh": torch.tanh,
             "Gelu": lambda t: torch.nn.functional.gelu(t)}


def mlp_weights(dtype, seed=0):
    rng = np.random.default_rng(seed)

    def w(*s):
        return (rng.standard_normal(s) / math.sqrt(s[0] if len(s) > 1 else 1)).astype(dtype)

    return {"W1": w(20, 32), "b1": (0.1 * rng.standard_normal(32)).astype(dtype),
            "W2": w(32, 32), "b2": (0.1 * rng.standard_normal(32)).astype(dtype),
            "W3": (rng.standard_normal((10, 32)) / math.sqrt(32)).astype(dtype),
            "b3": (0.1 * rng.standard_normal(10)).astype(dtype)}


def mlp_onnx(dtype, act1, act2):
    """h1 = act1(Gemm(x, W1, b1)); h2 = act2(x1 @ W2 + b2); logits = Gemm(h2, W3^T, b3);
    loss = -mean_b sum_k t * log(softmax(logits))."""
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["z1"]),
        helper.make_node(ACT_ONNX[act1], ["z1"], ["h1"]),
        helper.make_node("MatMul", ["h1", "W2"], ["m2"]),
        helper.make_node("Add", ["m2", "b2"], ["z2"]),
        helper.make_node(ACT_ONNX[act2], ["z2"], ["h2"]),
        helper.make_node("Gemm", ["h2", "W3", "b3"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["p"], axis=-1),
        helper.make_node("Log", ["p"], ["logp"]),
        helper.make_node("Mul", ["t", "logp"], ["tl"]),
        helper.make_node("ReduceSum", ["tl", "ax1"], ["per_row"], keepdims=0),
        helper.make_node("ReduceMean", ["per_row", "ax0"], ["mean"], keepdims=0),
        helper.make_node("Neg", ["mean"], ["loss"]),
    ]
    inits = {**mlp_weights(dtype), "ax1": np.array([1], np.int64), "ax0": np.array([0], np.int64)}
    return build(nodes, {"x": (dtype, ["B", 20]), "t": (dtype, ["B", 10])}, ["loss"], inits,
                 opset=20)


def mlp_torch(act1, act2):
    def f(x, t, W1, b1, W2, b2, W3, b3):
        h1 = ACT_TORCH[act1](x @ W1 + b1)
        h2 = ACT_TORCH[act2](h1 @ W2 + b2)
        logits = h2 @ W3.T + b3
        return -(t * torch.log(torch.softmax(logits, -1))).sum(1).mean()
    return f


def mlp_data(dtype, batch, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 20)).astype(dtype)
    t = np.eye(10, dtype=dtype)[rng.integers(0, 10, batch)]
    return x, t


MLP_WRT = ["x", "W1", "b1", "W2", "b2", "W3", "b3"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("acts", [("Relu", "Tanh"), ("Gelu", "Relu"), ("Tanh", "Gelu")],
                         ids="-".join)
def test_mlp_cross_entropy(acts, dtype):
    m = mlp_onnx(dtype, *acts)
    res = onnxgrad.gradients(m, "loss", MLP_WRT)
    onnx.checker.check_model(res.model, full_check=True)
    assert all(res.grads)
    for batch in (8, 3):  # one gradient graph, two batch sizes
        x, t = mlp_data(dtype, batch, seed=batch)
        got = run_grads(res, {"x": x, "t": t}, dtype)
        want = torch_grads(mlp_torch(*acts), {"x": x, "t": t, **mlp_weights(dtype)}, MLP_WRT)
        for name, g, w in zip(MLP_WRT, got, want):
            assert_close(g, w, dtype, f"{name} (batch {batch})")


# -- (b) single-head self-attention + residual + LayerNorm, symbolic batch -------------------------
T_LEN, D = 5, 8


def attn_weights(dtype, seed=2):
    rng = np.random.default_rng(seed)
    w = {k: (rng.standard_normal((D, D)) / math.sqrt(D)).astype(dtype)
         for k in ("Wq", "Wk", "Wv", "Wo")}
    w["gamma"] = (1 + 0.1 * rng.standard_normal(D)).astype(dtype)
    w["beta"] = (0.1 * rng.standard_normal(D)).astype(dtype)
    return w


ATTN_WRT = ["x", "Wq", "Wk", "Wv", "Wo", "gamma", "beta"]


def attention_onnx(dtype):
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"]),
        helper.make_node("MatMul", ["x", "Wk"], ["k"]),
        helper.make_node("MatMul", ["x", "Wv"], ["v"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Mul", ["s", "scale"], ["ss"]),
        helper.make_node("Softmax", ["ss"], ["a"], axis=-1),
        helper.make_node("MatMul", ["a", "v"], ["o"]),
        helper.make_node("Reshape", ["o", "flat"], ["o2"]),        # [N*T, D]
        helper.make_node("MatMul", ["o2", "Wo"], ["p2"]),
        helper.make_node("Reshape", ["p2", "unflat"], ["p"]),      # [N, T, D]
        helper.make_node("Add", ["x", "p"], ["r"]),
        helper.make_node("ReduceMean", ["r", "last"], ["mu"], keepdims=1),
        helper.make_node("Sub", ["r", "mu"], ["c"]),
        helper.make_node("Mul", ["c", "c"], ["c2"]),
        helper.make_node("ReduceMean", ["c2", "last"], ["var"], keepdims=1),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["c", "sd"], ["n"]),
        helper.make_node("Mul", ["n", "gamma"], ["ng"]),
        helper.make_node("Add", ["ng", "beta"], ["y"]),
    ]
    inits = {**attn_weights(dtype), "scale": np.array(1 / math.sqrt(D), dtype),
             "eps": np.array(1e-5, dtype), "flat": np.array([-1, D], np.int64),
             "unflat": np.array([-1, T_LEN, D], np.int64), "last": np.array([-1], np.int64)}
    return build(nodes, {"x": (dtype, ["N", T_LEN, D])}, ["y"], inits, opset=18)


def attention_torch(x, Wq, Wk, Wv, Wo, gamma, beta, cot):
    q, k, v = x @ Wq, x @ Wk, x @ Wv
    a = torch.softmax((q @ k.transpose(1, 2)) * (1 / math.sqrt(D)), -1)
    r = x + ((a @ v).reshape(-1, D) @ Wo).reshape(-1, T_LEN, D)
    mu = r.mean(-1, keepdim=True)
    c = r - mu
    y = c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-5) * gamma + beta
    return (y * cot).sum()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_block(dtype):
    m = attention_onnx(dtype)
    res = onnxgrad.gradients(m, "y", ATTN_WRT, grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    rng = np.random.default_rng(3)
    for n in (2, 3):  # the same gradient graph at two batch sizes
        x = rng.standard_normal((n, T_LEN, D)).astype(dtype)
        cot = rng.standard_normal((n, T_LEN, D)).astype(dtype)
        got = run_grads(res, {"x": x, "gy": cot}, dtype)
        want = torch_grads(attention_torch, {"x": x, "cot": cot, **attn_weights(dtype)}, ATTN_WRT)
        for name, g, w in zip(ATTN_WRT, got, want):
            assert_close(g, w, dtype, f"{name} (N={n})")


# -- Hessian-vector product of a small tanh/sigmoid MLP --------------------------------------------
def hvp_onnx(dtype):
    """loss = sum((sigmoid(tanh(x @ W1 + b1) @ W2) - t)^2)"""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["z1"]),
        helper.make_node("Tanh", ["z1"], ["h"]),
        helper.make_node("MatMul", ["h", "W2"], ["z2"]),
        helper.make_node("Sigmoid", ["z2"], ["s"]),
        helper.make_node("Sub", ["s", "t"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["d2"]),
        helper.make_node("ReduceSum", ["d2"], ["loss"], keepdims=0),
    ]
    ins = {"x": (dtype, ["B", 3]), "t": (dtype, ["B", 2]), "W1": (dtype, [3, 4]),
           "b1": (dtype, [4]), "W2": (dtype, [4, 2])}
    return build(nodes, ins, ["loss"], {}, opset=18)


def hvp_torch(x, t):
    def f(W1, b1, W2):
        s = torch.sigmoid(torch.tanh(x @ W1 + b1) @ W2)
        return ((s - t) ** 2).sum()
    return f


HVP_WRT = ["W1", "b1", "W2"]


def hvp_data(dtype, seed=4):
    rng = np.random.default_rng(seed)
    vals = {"x": rng.standard_normal((6, 3)), "t": rng.uniform(0, 1, (6, 2)),
            "W1": rng.standard_normal((3, 4)), "b1": 0.3 * rng.standard_normal(4),
            "W2": rng.standard_normal((4, 2))}
    vs = {f"v_{k}": rng.standard_normal(vals[k].shape) for k in HVP_WRT}
    return ({k: v.astype(dtype) for k, v in vals.items()},
            {k: v.astype(dtype) for k, v in vs.items()})


def torch_hvp(vals, vs):
    x, t = (torch.tensor(vals[k]) for k in "xt")
    ws = tuple(torch.tensor(vals[k]) for k in HVP_WRT)
    _, hv = torch.autograd.functional.hvp(hvp_torch(x, t), ws,
                                          tuple(torch.tensor(vs[f"v_{k}"]) for k in HVP_WRT))
    return hv


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_hvp_through_grad_ys(dtype):
    """H v = d/dW (dL/dW . v): the second call seeds the first call's gradients with v."""
    m = hvp_onnx(dtype)
    g1 = onnxgrad.gradients(m, "loss", HVP_WRT)
    g2 = onnxgrad.gradients(g1.model, g1.grads, HVP_WRT, grad_ys=[f"v_{k}" for k in HVP_WRT])
    onnx.checker.check_model(g2.model, full_check=True)
    assert all(n.startswith("gradients_1/") for n in g2.grads)
    vals, vs = hvp_data(dtype)
    got = run_grads(g2, {**vals, **vs}, dtype)
    for name, g, w in zip(HVP_WRT, got, torch_hvp(vals, vs)):
        assert_close(g, w, dtype, f"Hv[{name}]")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_hvp_of_explicit_dot(dtype):
    """Same product written out: s = sum_k ReduceSum(grad_k * v_k) in the graph, then d s / dW."""
    m = hvp_onnx(dtype)
    g1 = onnxgrad.gradients(m, "loss", HVP_WRT)
    m1 = g1.model
    for i, (k, g) in enumerate(zip(HVP_WRT, g1.grads)):
        m1.graph.input.append(helper.make_tensor_value_info(
            f"v_{k}", tensor_type(dtype), [d.dim_value for d in next(
                vi for vi in m.graph.input if vi.name == k).type.tensor_type.shape.dim]))
        m1.graph.node.extend([helper.make_node("Mul", [g, f"v_{k}"], [f"gv{i}"]),
                              helper.make_node("ReduceSum", [f"gv{i}"], [f"dot{i}"], keepdims=0)])
    m1.graph.node.append(helper.make_node("Sum", [f"dot{i}" for i in range(3)], ["gdotv"]))
    m1.graph.output.append(helper.make_empty_tensor_value_info("gdotv"))
    m1 = onnx.shape_inference.infer_shapes(m1, strict_mode=True)
    onnx.checker.check_model(m1, full_check=True)
    g2 = onnxgrad.gradients(m1, "gdotv", HVP_WRT)
    vals, vs = hvp_data(dtype, seed=5)
    got = run_grads(g2, {**vals, **vs}, dtype)
    for name, g, w in zip(HVP_WRT, got, torch_hvp(vals, vs)):
        assert_close(g, w, dtype, f"Hv[{name}]")


def test_hvp_double_backward_wrt_input():
    """Mixed second derivative d/dx (dL/dW1 . v) against torch double backward."""
    dtype = np.float64
    m = hvp_onnx(dtype)
    g1 = onnxgrad.gradients(m, "loss", ["W1"])
    g2 = onnxgrad.gradients(g1.model, g1.grads, ["x", "t"], grad_ys=["v_W1"])
    vals, vs = hvp_data(dtype, seed=6)
    got = run(g2.model, {**vals, "v_W1": vs["v_W1"]}, outputs=g2.grads)
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in vals.items()}
    loss = hvp_torch(ts["x"], ts["t"])(ts["W1"], ts["b1"], ts["W2"])
    (gw,) = torch.autograd.grad(loss, [ts["W1"]], create_graph=True)
    want = torch.autograd.grad((gw * torch.tensor(vs["v_W1"])).sum(), [ts["x"], ts["t"]])
    for name, g, w in zip(["x", "t"], got, want):
        assert_close(g, w, dtype, f"d/d{name}")
