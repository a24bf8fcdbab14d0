"""Gradient rules for MatMul (numpy semantics), Gemm and Einsum."""
import numpy as np
import onnx
import pytest
from onnx import helper
from util import assert_gradients, grads_of, make_model, op_model

import onnxgrad
from onnxgrad.registry import lookup
from onnxgrad.rules.linalg import parse_einsum


def _feeds(shapes, seed=0, dim=2):
    rng = np.random.default_rng(seed)
    return {k: np.asarray(rng.standard_normal([dim if isinstance(d, str) else d for d in s]),
                          np.float32) for k, s in shapes.items()}


# -- MatMul ------------------------------------------------------------------------------------
MATMUL_SHAPES = [
    ([3], [3, 4]),               # 1-D @ 2-D
    ([3, 4], [4]),               # 2-D @ 1-D
    ([4], [4]),                  # dot product
    ([3, 4], [4, 5]),
    ([2, 1, 3, 4], [5, 4, 2]),   # batch broadcasting both ways
    ([2, 3, 4], [4, 5]),         # batched @ matrix (flattened GEMM for dB: a transposed)
    ([2, 3, 5], [5, 2]),         # the same with g narrower than a (g transposed)
    (["N", 3, 5], [5, 2]),
    ([2, 3, 4], [4]),            # batched @ vector
    ([4], [2, 4, 3]),            # vector @ batched
    ([3, 4], [2, 4, 5]),         # matrix @ batched
    ([1, 3, 4], [2, 4, 5]),      # size-1 batch on the left
    (["N", 3, 4], [4, 5]),       # symbolic batch
    (["N", 3, 4], ["N", 4, 2]),
    (["B", 1, 3, 4], ["T", 4, 2]),  # symbolic dims that broadcast only at run time
    ([2, 3, "K"], ["K", 2]),     # symbolic contraction dim
]


@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES, ids=str)
def test_matmul(sa, sb):
    m = op_model("MatMul", {"a": (np.float32, sa), "b": (np.float32, sb)}, opset=13)
    assert_gradients(m, "y", ["a", "b"], feeds=_feeds({"a": sa, "b": sb}))


def test_matmul_weight_grad_avoids_gemm_trans_a():
    """x[..., K] @ W: dW is a plain MatMul of an explicitly transposed operand (MLAS's transA
    is slow), never a Gemm with transA."""
    for sb in ([5, 2], [5, 8]):
        m = op_model("MatMul", {"a": (np.float32, ["N", 3, 5]), "b": (np.float32, sb)})
        res = onnxgrad.gradients(m, "y", ["b"])
        assert not [n for n in res.model.graph.node if n.op_type == "Gemm"]
        assert "Transpose" in {n.op_type for n in res.model.graph.node}


@pytest.mark.parametrize("k,n", [(5, 4), (3, 6)])
def test_matmul_weight_read_through_a_transpose(k, n):
    """x[..., K] @ Transpose(W) (torch's Linear as exported) with N < K: W's gradient is made
    transposed ((g^T x)^T, g the narrower), and the Transpose's own gradient undoes that, so
    W's gradient is the MatMul's output, no Transpose after it; values against finite
    differences either way."""
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "Wt"], ["y"])]
    m = make_model(nodes, {"x": (np.float32, ["N", 3, k]), "W": (np.float32, [n, k])}, ["y"])
    res = onnxgrad.gradients(m, "y", ["W"])
    made = {o: nd for nd in res.model.graph.node for o in nd.output}
    assert made[res.grads[0]].op_type == ("MatMul" if n < k else "Transpose")
    assert_gradients(m, "y", ["x", "W"], feeds=_feeds({"x": [2, 3, k], "W": [n, k]}))


def test_matmul_symbolic_broadcast_at_run_time():
    """A symbolic dim that is 1 at run time on one side and not on the other."""
    m = op_model("MatMul", {"a": (np.float32, ["B", 1, 3, 4]), "b": (np.float32, ["T", 4, 2])})
    rng = np.random.default_rng(1)
    feeds = {"a": rng.standard_normal((1, 1, 3, 4)).astype(np.float32),
             "b": rng.standard_normal((3, 4, 2)).astype(np.float32)}
    assert_gradients(m, "y", ["a", "b"], feeds=feeds)


def test_matmul_float64_and_float16():
    for dt in (np.float64, np.float16):
        m = op_model("MatMul", {"a": (dt, [2, 3, 4]), "b": (dt, [4, 5])})
        f = {k: v.astype(dt) for k, v in _feeds({"a": [2, 3, 4], "b": [4, 5]}).items()}
        assert_gradients(m, "y", ["a", "b"], feeds=f)


def test_matmul_emits_no_einsum():
    m = op_model("MatMul", {"a": (np.float32, [2, 1, 3, 4]), "b": (np.float32, [5, 4, 2])})
    res = onnxgrad.gradients(m, "y", ["a", "b"])
    ops = {n.op_type for n in res.model.graph.node}
    assert "MatMul" in ops and "Einsum" not in ops


def test_matmul_unknown_rank_raises():
    m = make_model([helper.make_node("MatMul", ["a", "b"], ["y"])],
                   {"a": (np.float32, [3, 4]), "b": (np.float32, [4, 5])}, ["y"])
    m.graph.input[1].type.tensor_type.ClearField("shape")
    with pytest.raises(NotImplementedError, match="rank"):
        onnxgrad.gradients(m, "y", ["a", "b"])


@pytest.mark.parametrize("sa,sb", [([2, 1, 3, 4], [5, 4, 2]), ([3], [2, 3, 4]), ([2, 3, 4], [4])],
                         ids=str)
def test_matmul_vs_torch(sa, sb):
    torch = pytest.importorskip("torch")
    f = _feeds({"a": sa, "b": sb}, seed=3)
    m = op_model("MatMul", {"a": (np.float32, sa), "b": (np.float32, sb)})
    rng = np.random.default_rng(4)
    gy = rng.standard_normal(np.matmul(f["a"], f["b"]).shape).astype(np.float32)
    (ga, gb), _ = grads_of(m, "y", ["a", "b"], {**f, "gy": gy}, grad_ys=["gy"])
    ta = torch.tensor(f["a"], dtype=torch.float64, requires_grad=True)
    tb = torch.tensor(f["b"], dtype=torch.float64, requires_grad=True)
    torch.matmul(ta, tb).backward(torch.tensor(gy, dtype=torch.float64))
    np.testing.assert_allclose(ga, ta.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gb, tb.grad.numpy(), rtol=1e-4, atol=1e-5)


# -- Gemm --------------------------------------------------------------------------------------
M, K, N = 3, 4, 5


@pytest.mark.parametrize("c_shape", [None, [], [N], [1, N], [M, 1], [M, N]], ids=str)
@pytest.mark.parametrize("ab", [(1.0, 1.0), (0.5, -2.0)], ids=str)
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("trans_a", [0, 1])
def test_gemm(trans_a, trans_b, ab, c_shape):
    alpha, beta = ab
    shapes = {"a": [K, M] if trans_a else [M, K], "b": [N, K] if trans_b else [K, N]}
    if c_shape is not None:
        shapes["c"] = c_shape
    m = op_model("Gemm", {k: (np.float32, s) for k, s in shapes.items()}, opset=13,
                 transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)
    assert_gradients(m, "y", list(shapes), feeds=_feeds(shapes))


def test_gemm_symbolic_m():
    shapes = {"a": ["M", K], "b": [K, N], "c": [N]}
    m = op_model("Gemm", {k: (np.float32, s) for k, s in shapes.items()}, opset=13, transB=0)
    assert_gradients(m, "y", list(shapes), feeds=_feeds(shapes, dim=3))


@pytest.mark.parametrize("trans_a,trans_b,c_shape", [(0, 1, [N]), (1, 0, [M, 1]), (1, 1, [])])
def test_gemm_vs_torch(trans_a, trans_b, c_shape):
    torch = pytest.importorskip("torch")
    shapes = {"a": [K, M] if trans_a else [M, K], "b": [N, K] if trans_b else [K, N],
              "c": c_shape}
    f = _feeds(shapes, seed=5)
    m = op_model("Gemm", {k: (np.float32, s) for k, s in shapes.items()},
                 transA=trans_a, transB=trans_b, alpha=0.7, beta=1.5)
    gy = np.random.default_rng(6).standard_normal((M, N)).astype(np.float32)
    got, _ = grads_of(m, "y", ["a", "b", "c"], {**f, "gy": gy}, grad_ys=["gy"])
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in f.items()}
    a = t["a"].T if trans_a else t["a"]
    b = t["b"].T if trans_b else t["b"]
    (0.7 * a @ b + 1.5 * t["c"]).backward(torch.tensor(gy, dtype=torch.float64))
    for g, k in zip(got, ["a", "b", "c"]):
        np.testing.assert_allclose(g, t[k].grad.numpy(), rtol=1e-4, atol=1e-5)


# -- Einsum ------------------------------------------------------------------------------------
EINSUMS = [
    ("ij,jk->ik", [[3, 4], [4, 5]]),
    ("bij,bjk->bik", [[2, 3, 4], [2, 4, 5]]),
    ("ij->ji", [[3, 4]]),
    ("ijk->kij", [[2, 3, 4]]),
    ("bi,bj,ij->b", [[2, 3], [2, 4], [3, 4]]),      # bilinear form
    ("bn,anm,bm->ba", [[2, 3], [5, 3, 4], [2, 4]]),  # torch.nn.Bilinear
    ("i,j->ij", [[3], [4]]),                         # outer product
    ("ij,jk", [[3, 4], [4, 5]]),                     # implicit output (ik)
    ("ba,ca", [[3, 4], [2, 4]]),                     # implicit output, reordered (bc)
    ("ij->", [[3, 4]]),                              # sum of everything
    ("ij->i", [[3, 4]]),                             # j broadcast back
    ("ij,ij->", [[3, 4], [3, 4]]),                   # Frobenius product
    ("ij,kj->ikj", [[3, 4], [2, 4]]),
    ("ii->", [[3, 3]]),                              # trace
    ("ii", [[4, 4]]),                                # implicit trace
    ("ii->i", [[3, 3]]),                             # diagonal
    ("iij->j", [[3, 3, 2]]),
    ("ii,i->i", [[3, 3], [3]]),
    ("iji->j", [[3, 2, 3]]),
    ("iii->i", [[2, 2, 2]]),
    ("Ab,bC->AC", [[3, 4], [4, 2]]),                 # upper-case subscripts
    ("...ij,...jk->...ik", [[2, 3, 4], [2, 4, 5]]),
    ("...ij,jk->...ik", [[2, 3, 3, 4], [4, 5]]),
    ("...ij,...jk->...ik", [[2, 1, 3, 4], [1, 5, 4, 2]]),  # ellipsis broadcasting
    ("i...j,jk->i...k", [[2, 3, 4], [4, 2]]),
    ("...ii->...i", [[2, 3, 3]]),
    ("...ij->...", [[2, 3, 4]]),
    ("...,...->...", [[3, 4], [3, 4]]),
    ("a b , b c -> a c", [[3, 4], [4, 2]]),          # spaces
]


@pytest.mark.parametrize("eq,shapes", EINSUMS, ids=[e for e, _ in EINSUMS])
def test_einsum(eq, shapes):
    names = [f"x{i}" for i in range(len(shapes))]
    m = op_model("Einsum", {n: (np.float32, s) for n, s in zip(names, shapes)}, opset=13,
                 equation=eq)
    f = _feeds(dict(zip(names, shapes)), seed=7)
    report = assert_gradients(m, "y", names, feeds=f)
    # an independent oracle: numpy's einsum and its exact linearity in each operand
    cot = next(iter(report.cotangents.values()))
    f64 = [f[n].astype(np.float64) for n in names]
    for i, r in enumerate(report.results):
        basis = np.eye(f64[i].size).reshape((f64[i].size,) + f64[i].shape)
        want = np.array([np.sum(np.einsum(eq, *(f64[:i] + [e] + f64[i + 1:])) * cot)
                         for e in basis]).reshape(f64[i].shape)
        np.testing.assert_allclose(r.grad, want, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("eq,shapes", [
    ("bij,bjk->bik", [["N", 3, 4], ["N", 4, 5]]),
    ("ii->", [["N", "N"]]),                          # run-time identity mask
    ("...ij,jk->...ik", [["N", 3, 4], [4, 2]]),
    ("ij->i", [["N", "M"]]),                         # run-time broadcast back
])
def test_einsum_symbolic(eq, shapes):
    names = [f"x{i}" for i in range(len(shapes))]
    m = op_model("Einsum", {n: (np.float32, s) for n, s in zip(names, shapes)}, opset=13,
                 equation=eq)
    assert_gradients(m, "y", names, feeds=_feeds(dict(zip(names, shapes)), dim=3))


def test_einsum_vs_torch():
    torch = pytest.importorskip("torch")
    shapes = {"x0": [2, 3], "x1": [5, 3, 4], "x2": [2, 4]}
    f = _feeds(shapes, seed=8)
    m = op_model("Einsum", {k: (np.float32, s) for k, s in shapes.items()},
                 equation="bn,anm,bm->ba")
    got, _ = grads_of(m, "y", list(shapes), f)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in f.items()}
    torch.einsum("bn,anm,bm->ba", t["x0"], t["x1"], t["x2"]).sum().backward()
    for g, k in zip(got, shapes):
        np.testing.assert_allclose(g, t[k].grad.numpy(), rtol=1e-4, atol=1e-5)


def test_einsum_parse():
    assert parse_einsum("ij,jk", 2) == ([["i", "j"], ["j", "k"]], ["i", "k"])
    assert parse_einsum("ii", 1) == ([["i", "i"]], [])
    assert parse_einsum("...ij,jk", 2)[1] == ["...", "i", "k"]
    with pytest.raises(ValueError, match="repeats"):
        parse_einsum("ij->ii", 1)
    with pytest.raises(ValueError, match="terms"):
        parse_einsum("ij,jk->ik", 1)


def test_einsum_ellipsis_unknown_rank_raises():
    m = make_model([helper.make_node("Einsum", ["a"], ["y"], equation="...ij->...ji")],
                   {"a": (np.float32, [2, 3, 4])}, ["y"], opset=13)
    m.graph.input[0].type.tensor_type.ClearField("shape")
    del m.graph.value_info[:]
    m.graph.output[0].type.tensor_type.shape.Clear()
    with pytest.raises(NotImplementedError, match=r"'\.\.\.'"):
        onnxgrad.gradients(m, "y", ["a"])


# -- second order ------------------------------------------------------------------------------
def _needs(*ops):
    missing = [op for op in ops if lookup("", op, 18) is None]
    assert not missing, f"second order needs gradient rules for {missing}"


@pytest.mark.parametrize("op,shapes,attrs", [
    ("MatMul", {"a": [2, 3, 4], "b": [4, 5]}, {}),
    ("MatMul", {"a": [4], "b": [2, 4, 3]}, {}),
    ("Gemm", {"a": [4, 3], "b": [5, 4], "c": [5]}, {"transA": 1, "transB": 1, "alpha": 0.5}),
    ("Einsum", {"a": [3, 3], "b": [3]}, {"equation": "ii,i->i"}),
    ("Einsum", {"a": [2, 3, 4], "b": [4, 2]}, {"equation": "...ij,jk->...ik"}),
])
def test_second_order(op, shapes, attrs):
    _needs("Unsqueeze", "Squeeze", "Transpose", "Reshape", "Expand")
    m = op_model(op, {k: (np.float32, s) for k, s in shapes.items()}, **attrs)
    first = onnxgrad.gradients(m, "y", list(shapes), grad_ys=["gy"])
    m2 = onnx.shape_inference.infer_shapes(first.model)
    assert_gradients(m2, first.grads, [*shapes, "gy"], feeds=_feeds(shapes, seed=9))


# -- Det -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [[1, 1], [2, 2], [3, 3], [2, 4, 4], ["N", 3, 3], [2, 1, 5, 5]],
                         ids=str)
def test_det(shape):
    m = op_model("Det", {"x": (np.float32, shape)}, opset=22)
    assert_gradients(m, "y", "x", feeds=_feeds({"x": shape}, seed=3))


def test_det_vs_torch_and_singular():
    """torch.linalg.det autograd, on a well-conditioned batch and on a rank-deficient matrix (the
    cofactors are the exact gradient there; torch gets it through an SVD)."""
    torch = pytest.importorskip("torch")
    x = _feeds({"x": [3, 4, 4]}, seed=5)["x"]
    x[2, 3] = x[2, 0] + 2 * x[2, 1]  # rank 3: det 0, gradient non-zero
    m = op_model("Det", {"x": (np.float32, [3, 4, 4])}, opset=22)
    (got,), _ = grads_of(m, "y", "x", {"x": x})
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    torch.linalg.det(t).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-4, atol=1e-4)
    assert np.abs(got[2]).max() > 0.1


def test_det_second_order():
    m = op_model("Det", {"x": (np.float32, [2, 3, 3])}, opset=22)
    first = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
    m2 = onnx.shape_inference.infer_shapes(first.model)
    assert_gradients(m2, first.grads, ["x", "gy"], feeds=_feeds({"x": [2, 3, 3], "gy": [2]}, 4))


def test_det_dynamic_size_raises():
    m = op_model("Det", {"x": (np.float32, [2, "K", "K"])}, opset=22)
    with pytest.raises(NotImplementedError, match="static"):
        onnxgrad.gradients(m, "y", "x")
