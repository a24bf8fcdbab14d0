"""One tensor fed to several inputs of one node (FusedMatMul(h, h) in a contrastive loss,
Attention(x, x, x), a model function called F(x, x)). The rules built on a function body or an
expansion returned the sweep's whole gradient of that tensor once per position, so the engine
added it up k times (k-fold gradients, silently). Metamorphic check, for every op family: the
gradient of a node reading v at positions i and j equals the gradient of the same node reading
two Identity copies of v; plus finite differences in float64 where onnxruntime runs the op."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper

from onnxgrad.check import check_gradients
from onnxgrad.runtime import session

from util import grads_of

pytest.importorskip("onnxruntime")

MS = "com.microsoft"
# (domain, op, number of inputs, shape of every input, output shape, attributes, opset)
OPS = [
    ("", "Mul", 2, [3, 3], [3, 3], {}, 18),
    ("", "MatMul", 2, [3, 3], [3, 3], {}, 18),
    ("", "Gemm", 3, [3, 3], [3, 3], {"transB": 1, "alpha": 0.5, "beta": 2.0}, 18),
    ("", "Einsum", 2, [3, 3], [3, 3], {"equation": "ij,jk->ik"}, 18),
    ("", "Sum", 3, [2, 3], [2, 3], {}, 18),
    ("", "Concat", 3, [2, 3], [6, 3], {"axis": 0}, 18),
    ("", "Attention", 3, [1, 2, 3, 4], [1, 2, 3, 4], {}, 23),  # a function body in the schema
    ("my.fn", "F", 3, [2, 3], [2, 3], {}, 18),  # a model-local function
    (MS, "FusedMatMul", 2, [2, 3, 3], [2, 3, 3], {"alpha": 0.5, "transB": 1}, 18),  # an expansion rule
    (MS, "BiasGelu", 2, [3], [3], {}, 18),
]


def _local_function():
    nodes = [helper.make_node("Tanh", ["b"], ["t"]), helper.make_node("Mul", ["a", "t"], ["m"]),
             helper.make_node("Add", ["m", "c"], ["o"])]
    return helper.make_function("my.fn", "F", ["a", "b", "c"], ["o"], nodes,
                                [helper.make_opsetid("", 18)])


def _model(case, reads, copies: bool, dtype):
    """y = ReduceSum(op(v[reads[0]], v[reads[1]], ...) * w); with ``copies`` every position
    reads its own Identity of the variable instead of the variable itself."""
    domain, op, k, shape, _, attrs, opset = case
    names = sorted(set(reads))
    nodes, args = [], []
    for i, r in enumerate(reads):
        if copies:
            nodes.append(helper.make_node("Identity", [f"v{r}"], [f"c{i}"]))
        args.append(f"c{i}" if copies else f"v{r}")
    nodes += [helper.make_node(op, args, ["o"], domain=domain, **attrs),
              helper.make_node("Mul", ["o", "w"], ["p"]),
              helper.make_node("ReduceSum", ["p"], ["y"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(f"v{r}", dtype, shape) for r in names]
        + [helper.make_tensor_value_info("w", dtype, None)],
        [helper.make_tensor_value_info("y", dtype, [])])
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=11 if opset >= 23 else 10,
                             functions=[_local_function()] if domain == "my.fn" else [])


@st.composite
def cases(draw):
    case = draw(st.sampled_from(OPS))
    k = case[2]
    reads = draw(st.lists(st.integers(0, k - 1), min_size=k, max_size=k)
                 .filter(lambda r: len(set(r)) < k))  # at least one tensor read twice
    return case, reads, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_a_tensor_read_twice_gets_the_gradient_of_two_copies(drawn):
    case, reads, seed = drawn
    rng = np.random.default_rng(seed)
    names = [f"v{r}" for r in sorted(set(reads))]
    feeds = {n: rng.uniform(-1, 1, case[3]).astype(np.float32) for n in names}
    feeds["w"] = rng.uniform(-1, 1, case[4]).astype(np.float32)
    got, res = grads_of(_model(case, reads, False, TP.FLOAT), "y", names, feeds)
    want, _ = grads_of(_model(case, reads, True, TP.FLOAT), "y", names, feeds)
    # and at onnxruntime's default level (ORT_ENABLE_ALL), which fuses what the check does not
    full = session(res.model).run(res.grads, feeds)
    for n, a, b, f in zip(names, got, want, full):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"{case[1]} {reads}: d/d{n}")
        np.testing.assert_allclose(f, b, rtol=1e-4, atol=1e-5, err_msg=f"{case[1]} {reads}: d/d{n}")


@pytest.mark.parametrize("case", [c for c in OPS if c[0] != MS], ids=lambda c: c[1])
def test_a_tensor_read_at_every_position_matches_finite_differences(case):
    k = case[2]
    model = _model(case, [0] * k, False, TP.DOUBLE)
    rng = np.random.default_rng(0)
    feeds = {"v0": rng.uniform(-1, 1, case[3]), "w": rng.uniform(-1, 1, case[4])}
    report = check_gradients(model, "y", ["v0"], feeds, dtype="float64")
    assert report.ok, str(report)
