"""Trust in the engine (issue 12): no dependency hidden by an untyped op, no declared or inferred
shape that contradicts the run time steering a rule, unique names whatever the scope, models
validated up front, ranks on everything a gradient graph adds (so second-order calls work), and
gradient outputs that pass the full checker. Each class has a generator where one makes sense."""
from __future__ import annotations

import os
import re
import sys

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.check import check_gradients
from onnxgrad.cli import main
from onnxgrad.errors import InvalidModelError, NotDifferentiableError
from onnxgrad.runtime import session
from util import assert_gradients, make_model

F = np.float32
T = TensorProto.FLOAT
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def graph_model(nodes, inputs, outputs, inits=(), value_info=(), opset=17, extra_opsets=()):
    """A model as written, without shape inference (the tests here are about what it declares)."""
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits), value_info=list(value_info))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), *extra_opsets],
                             ir_version=10)


def vi(name, shape, dtype=T):
    return helper.make_tensor_value_info(name, dtype, shape)


def ort_all(model):
    """An onnxruntime CPU session at ORT_ENABLE_ALL, what users get."""
    ort = pytest.importorskip("onnxruntime")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def cli_error(capsys, argv, *needles):
    rc = main([str(a) for a in argv])
    _, err = capsys.readouterr()
    assert rc == 2, err
    assert err.startswith("onnxgrad: error: ") and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def assert_refused(capsys, tmp_path, model, error, pattern, needle, xs=("x",)):
    """gradients() raises ``error`` matching ``pattern``; ``onnxgrad grad`` exits 2 with one
    line holding ``needle`` and writes nothing."""
    with pytest.raises(error, match=pattern):
        onnxgrad.gradients(model, "y", list(xs))
    path, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    cli_error(capsys, ["grad", path, "-o", out, "--ys", "y", "--xs", *xs], needle)
    assert not out.exists()


# -- 1. ops that shape inference cannot type ---------------------------------------------------
MSFT = helper.make_opsetid("com.microsoft", 1)
CUSTOM = helper.make_opsetid("example.custom", 1)


def untyped_model(op="CDist", domain="com.microsoft"):
    """x -> Tanh -> t; z = <untyped op>(t, W); y = z * W2 (y has no type either)."""
    return graph_model(
        [helper.make_node("Tanh", ["x"], ["t"]),
         helper.make_node(op, ["t", "W"], ["z"], domain=domain),
         helper.make_node("Mul", ["z", "W2"], ["y"])],
        [vi("x", [2, 3])], [helper.make_tensor_value_info("y", T, None)],
        [numpy_helper.from_array(np.eye(3, dtype=F), "W"),
         numpy_helper.from_array(np.ones(3, F), "W2")],
        extra_opsets=[MSFT, CUSTOM])


@pytest.mark.parametrize("op,domain", [("CDist", "com.microsoft"), ("Mix", "example.custom")])
@pytest.mark.parametrize("xs", [["x"], ["W"], ["t"], ["x", "W2"]])
@pytest.mark.parametrize("unconnected", ["none", "zero"])
def test_untyped_op_on_the_path_is_refused(op, domain, xs, unconnected):
    with pytest.raises(NotDifferentiableError, match=f"'{op}'.*'{domain}'") as info:
        onnxgrad.gradients(untyped_model(op, domain), "y", xs, unconnected_gradients=unconnected)
    assert info.value.op_type == op and info.value.path[0] == "y"


def test_untyped_op_held_constant_by_stop_gradients():
    """Past the op, with its output declared (evidence inference does not contradict), the
    downstream gradient is exact."""
    m = untyped_model()
    m.graph.value_info.append(vi("z", [2, 3]))
    res = onnxgrad.gradients(m, "y", ["W2", "x"], stop_gradients=["z"])
    assert res.grads[1] is None
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(F)
    (g,) = session(res.model).run(res.grads[:1], {"x": x})  # onnxruntime has CDist
    # z[i, j] = |tanh(x)[i] - I[j]|^2 (CDist's default metric, sqeuclidean)
    z = ((np.tanh(x)[:, None, :] - np.eye(3)[None]) ** 2).sum(-1)
    np.testing.assert_allclose(g, z.sum(0), rtol=1e-5)
    # y = Mul(z, W2) with z untyped: Mul's schema ties y's type to W2's (float), which is
    # certain, so dy/dW2 = sum of z's rows is built; z's own type still matters to nothing else
    m2 = untyped_model()
    m2.graph.output[0].CopyFrom(helper.make_empty_tensor_value_info("y"))
    res2 = onnxgrad.gradients(m2, "y", ["W2"])
    (g2,) = session(res2.model).run(res2.grads, {"x": x})
    np.testing.assert_allclose(g2, z.sum(0), rtol=1e-5)


def test_untyped_indices_are_refused_not_dropped():
    """An untyped value may be float whatever the consumer: the dependency is refused."""
    m = graph_model(
        [helper.make_node("Mix", ["x"], ["i"], domain="example.custom"),
         helper.make_node("Gather", ["W", "i"], ["y"])],
        [vi("x", [2])], [helper.make_tensor_value_info("y", T, None)],
        [numpy_helper.from_array(np.ones((3, 2), F), "W")], extra_opsets=[CUSTOM])
    with pytest.raises(NotDifferentiableError, match="'Mix'"):
        onnxgrad.gradients(m, "y", ["x", "W"])


def test_untyped_value_read_by_a_subgraph_is_refused():
    then = helper.make_graph([helper.make_node("Identity", ["z"], ["o"])], "then", [],
                             [helper.make_tensor_value_info("o", T, None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["o2"])], "else", [],
                              [helper.make_tensor_value_info("o2", T, None)])
    m = graph_model(
        [helper.make_node("Mix", ["x"], ["z"], domain="example.custom"),
         helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        [vi("x", [2]), vi("c", [], TensorProto.BOOL)], [vi("y", [2])], extra_opsets=[CUSTOM])
    with pytest.raises(NotDifferentiableError, match="'Mix'"):
        onnxgrad.gradients(m, "y", ["x"])


def test_untyped_op_refused_by_cli_and_trainer(capsys, tmp_path):
    assert_refused(capsys, tmp_path, untyped_model(), NotDifferentiableError, "'CDist'",
                   "no gradient rule for op 'CDist' (domain 'com.microsoft'")
    cli_error(capsys, ["check", tmp_path / "m.onnx", "--ys", "y", "--xs", "x"], "'CDist'")
    from onnxgrad.training.step import build_train_step
    loss = untyped_model()
    loss.graph.node.append(helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0))
    loss.graph.output.append(vi("loss", []))
    with pytest.raises(NotDifferentiableError, match="'CDist'"):
        build_train_step(loss, "loss")  # (Trainer builds its step graph with it)
    with pytest.raises(NotDifferentiableError, match="'CDist'"):
        onnxgrad.Trainer(loss, "loss", device="cpu", progress=False)


# -- 2. declared shapes that contradict the run time -------------------------------------------
def chain(declared):
    """x [3] -> Tanh -> t -> Mul(b) -> u -> Sin -> y; ``declared``: value_info to add."""
    return graph_model(
        [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Mul", ["t", "b"], ["u"]),
         helper.make_node("Sin", ["u"], ["y"])],
        [vi("x", [3])], [helper.make_tensor_value_info("y", T, None)],
        [numpy_helper.from_array(np.array([0.5], F), "b")], value_info=declared)


def test_contradicting_value_info_does_not_steer_the_rules():
    m = chain([vi("t", [7, 5]), vi("u", [3, 1])])
    x = np.array([0.3, -1.2, 2.0], F)
    res = onnxgrad.gradients(m, "y", ["x", "b"])
    onnx.checker.check_model(res.model, full_check=True)
    gx, gb = ort_all(res.model).run(res.grads, {"x": x})
    u = np.tanh(x.astype(np.float64)) * 0.5
    np.testing.assert_allclose(gx, np.cos(u) * 0.5 * (1 - np.tanh(x) ** 2), rtol=1e-5)
    np.testing.assert_allclose(gb, [np.sum(np.cos(u) * np.tanh(x))], rtol=1e-5)
    assert gx.shape == (3,) and gb.shape == (1,)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["t", "u"]),
                          st.lists(st.integers(1, 7), min_size=0, max_size=3)),
                min_size=1, max_size=2, unique_by=lambda p: p[0]))
def test_any_declared_shape_gives_the_same_gradient(declared):
    x = np.array([0.3, -1.2, 2.0], F)
    want = ort_all(onnxgrad.gradients(chain([]), "y", ["x", "b"]).model).run(
        None, {"x": x})
    res = onnxgrad.gradients(chain([vi(n, s) for n, s in declared]), "y", ["x", "b"])
    got = ort_all(res.model).run(None, {"x": x})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_declared_static_dim_does_not_bake_in_a_symbolic_batch():
    """x is [N, 3]; the model declares t and y as [2, 3]: the gradient still holds for N=5."""
    m = graph_model([helper.make_node("Tanh", ["x"], ["t"]),
                     helper.make_node("Add", ["t", "b"], ["y"])],
                    [vi("x", ["N", 3])], [vi("y", [2, 3])],
                    [numpy_helper.from_array(np.zeros(3, F), "b")], value_info=[vi("t", [2, 3])])
    res = onnxgrad.gradients(m, "y", ["x", "b"])
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(F)
    gx, gb = ort_all(res.model).run(res.grads, {"x": x})
    np.testing.assert_allclose(gx, 1 - np.tanh(x) ** 2, rtol=1e-5)
    np.testing.assert_allclose(gb, np.full(3, 5.0), rtol=1e-6)


def test_deprecated_op_is_not_an_invalid_model():
    m = graph_model([helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"],
                                      num_groups=2)],
                    [vi("x", [1, 4, 3]), vi("s", [2]), vi("b", [2])], [vi("y", [1, 4, 3])],
                    opset=18)
    assert onnxgrad.gradients(m, "y", ["x", "s"]).grads[0] is not None


def test_contradicted_graph_output_is_refused(capsys, tmp_path):
    m = chain([])
    m.graph.output[0].CopyFrom(vi("y", [4]))
    assert_refused(capsys, tmp_path, m, InvalidModelError,
                   "output 'y'.*float\\[4\\].*float\\[3\\]", "output 'y'")


def test_declared_type_after_an_untyped_op_is_used():
    """Where inference says nothing, what the model declares (and nothing contradicts) stands."""
    m = untyped_model()
    m.graph.value_info.append(vi("z", [2, 3]))
    res = onnxgrad.gradients(m, "y", ["W2"])
    out = {o.name: o for o in res.model.graph.output}[res.grads[0]]
    assert [d.dim_value for d in out.type.tensor_type.shape.dim] == [3]


# -- 3. pools whose inferred output length the runtimes do not produce --------------------------
def pool_model(op, shape, symbolic=False, **attrs):
    ins = [vi("x", ["N", shape[1], *(f"s{i}" for i in range(len(shape) - 2))] if symbolic
              else list(shape))]
    return graph_model([helper.make_node(op, ["x"], ["y"], **attrs)], ins,
                       [helper.make_tensor_value_info("y", T, None)], opset=19)


def torch_pool(op, x, k, s, p, count_include_pad=0, p_norm=2):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as tf
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    nd = x.ndim - 2
    if op == "AveragePool":
        fn = (tf.avg_pool1d, tf.avg_pool2d)[nd - 1]
        y = fn(t, k, s, p, ceil_mode=True, count_include_pad=bool(count_include_pad))
    elif op == "MaxPool":
        y = (tf.max_pool1d, tf.max_pool2d)[nd - 1](t, k, s, p, ceil_mode=True)
    else:
        y = (tf.lp_pool1d, tf.lp_pool2d)[nd - 1](t, p_norm, k[0] if nd == 1 else tuple(k),
                                                   s[0] if nd == 1 else tuple(s), ceil_mode=True)
    cot = np.random.default_rng(1).standard_normal(tuple(y.shape))
    (y * torch.tensor(cot)).sum().backward()
    return y.detach().numpy(), cot, t.grad.numpy()


POOL_CASES = [  # (x shape, kernel, stride, pad): each drops a last window that starts in padding
    ((1, 1, 2), [1], [2], [0]),
    ((1, 2, 7), [2], [2], [1]),
    ((2, 1, 5), [2], [3], [1]),
    ((1, 2, 7, 5), [2, 3], [2, 2], [1, 1]),  # one axis drops a window, the other does not
    ((1, 2, 4, 4), [1, 1], [2, 2], [0, 0]),
]


@pytest.mark.parametrize("op,case", [(op, i) for op in ("AveragePool", "MaxPool", "LpPool")
                                     for i, c in enumerate(POOL_CASES)
                                     if op != "LpPool" or not any(c[3])])  # torch: no lp pads
@pytest.mark.parametrize("symbolic", [False, True])
def test_ceil_mode_pool_against_torch(op, case, symbolic):
    shape, k, s, p = POOL_CASES[case]
    x = np.random.default_rng(case).standard_normal(shape).astype(F)
    attrs = dict(kernel_shape=k, strides=s, ceil_mode=1, pads=p * 2)
    if op == "LpPool":
        attrs["p"] = 2
    m = pool_model(op, shape, symbolic, **attrs)
    y, cot, want = torch_pool(op, x.astype(np.float64), k, s, p)
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["cot"])
    onnx.checker.check_model(res.model, full_check=True)
    got_y, got = ort_all(res.model).run(["y", res.grads[0]], {"x": x, "cot": cot.astype(F)})
    np.testing.assert_allclose(got_y, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@SETTINGS
@given(st.integers(1, 9), st.integers(1, 4), st.integers(1, 4), st.integers(0, 2),
       st.sampled_from(["AveragePool", "MaxPool"]), st.integers(0, 1))
def test_any_ceil_mode_pool_matches_torch(n, k, s, p, op, incl):
    assume(p <= k // 2 and n + 2 * p >= k)  # torch's limits (and at least one window)
    x = np.random.default_rng(n * 100 + k * 10 + s).standard_normal((1, 2, n))
    attrs = dict(kernel_shape=[k], strides=[s], ceil_mode=1, pads=[p, p])
    if op == "AveragePool":
        attrs["count_include_pad"] = incl
    y, cot, want = torch_pool(op, x, [k], [s], [p], incl)
    res = onnxgrad.gradients(pool_model(op, x.shape, **attrs), "y", "x", grad_ys=["cot"])
    got_y, got = ort_all(res.model).run(["y", res.grads[0]], {"x": x.astype(F),
                                                                "cot": cot.astype(F)})
    np.testing.assert_allclose(got_y, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# (op, kernel, stride, pad, count_include_pad): strides and pads with which ceil_mode drops
# a last window often
_POOL = st.tuples(st.sampled_from(["AveragePool", "MaxPool"]), st.integers(1, 3),
                  st.integers(2, 3), st.sampled_from([1, 1, 0]), st.integers(0, 1))


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.integers(3, 12), st.lists(_POOL, min_size=2, max_size=3), st.booleans())
@example(7, [("MaxPool", 2, 2, 1, 0)] * 2, False)
def test_chained_ceil_mode_pools_match_torch(n, pools, symbolic):
    """Pools in a chain, each with ceil_mode: where one drops a last window that onnx's
    inference keeps, the dims onnx gives the next pool's input are wrong too, and sizing that
    pool's rewrite from them computed other windows: the model's forward itself changed
    (bench/fuzz_torch.py, two 2x2 / 2 MaxPools with pads 1 on 4x7: [2, 2] instead of [2, 3])."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as tf
    t = torch.tensor(np.random.default_rng(n).standard_normal((1, 2, n)), requires_grad=True)
    y, nodes, name = t, [], "x"
    for i, (op, k, s, p, incl) in enumerate(pools):
        p = min(p, k // 2)
        assume(y.shape[-1] + 2 * p >= k)  # torch's limits, and a window
        if op == "MaxPool":
            y = tf.max_pool1d(y, k, s, p, ceil_mode=True)
            attrs = {}
        else:
            y = tf.avg_pool1d(y, k, s, p, ceil_mode=True, count_include_pad=bool(incl))
            attrs = {"count_include_pad": incl}
        out = "y" if i == len(pools) - 1 else f"p{i}"
        nodes.append(helper.make_node(op, [name], [out], kernel_shape=[k], strides=[s],
                                      pads=[p, p], ceil_mode=1, **attrs))
        name = out
    _pools_match_torch(t, y, nodes, [1, 2, "n" if symbolic else n])


def _pools_match_torch(t, y, nodes, x_dims):
    """The pools ``nodes`` (x -> y, x declared ``x_dims``) against torch's y computed from the
    leaf t beside them: the returned model's y and its gradient of sum(y * cot)."""
    torch = pytest.importorskip("torch")
    cot = np.random.default_rng(1).standard_normal(tuple(y.shape))
    (y * torch.tensor(cot)).sum().backward()
    ins = [helper.make_tensor_value_info("x", T, x_dims)]
    m = graph_model(nodes, ins, [helper.make_tensor_value_info("y", T, None)], opset=19)
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["cot"])
    onnx.checker.check_model(res.model, full_check=True)
    x = t.detach().numpy().astype(F)
    got_y, got = ort_all(res.model).run(["y", res.grads[0]], {"x": x, "cot": cot.astype(F)})
    np.testing.assert_allclose(got_y, y.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["AveragePool", "MaxPool", "LpPool"])
def test_ceil_mode_pool_finite_differences(op):
    shape, k, s, p = POOL_CASES[3]
    x = np.random.default_rng(3).standard_normal(shape)
    m = pool_model(op, shape, kernel_shape=k, strides=s, ceil_mode=1, pads=p * 2)
    # onnx.reference, which runs float64 LpPool, keeps the window that onnxruntime drops
    dtype = "float32" if op == "LpPool" else "float64"
    report = check_gradients(m, "y", "x", {"x": x.astype(dtype)}, dtype=dtype)
    assert report.ok, str(report)


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.lists(st.integers(2, 8), min_size=1, max_size=3), st.data())
@example([3, 5], None)
def test_ceil_mode_average_pools_counting_pads_match_torch(dims, data):
    """AveragePool with ceil_mode and count_include_pad=1, 1-D to 3-D, one or two in a chain,
    static or symbolic dims. Where one axis drops a last window (onnx's inference keeps it)
    and another has a partial last window, no explicit pads give the same divisors: such a
    pool was refused (bench/fuzz_torch.py: torch's AvgPool3d(3, 3, 1, ceil_mode=True) on
    3x3x5); it now averages over x alone and is rescaled by the divisors the runtimes use."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as tf
    nd = len(dims)
    draw = (lambda s_: s_.example()) if data is None else data.draw
    # (kernel, stride, pad, count_include_pad), drawn where windows are dropped often
    pools = [(3, 3, 1, 1)] if data is None else draw(st.lists(st.tuples(
        st.integers(1, 3), st.sampled_from([2, 3, 1]), st.sampled_from([1, 1, 0]),
        st.sampled_from([1, 1, 0])), min_size=1, max_size=2))
    symbolic = False if data is None else draw(st.booleans())
    fn = (tf.avg_pool1d, tf.avg_pool2d, tf.avg_pool3d)[nd - 1]
    t = torch.tensor(np.random.default_rng(sum(dims)).standard_normal((2, 2, *dims)),
                     requires_grad=True)
    y, nodes, name = t, [], "x"
    for i, (k, s, p, incl) in enumerate(pools):
        p = min(p, k // 2)
        # torch's limits (its 3-D pools want the image as large as the kernel), and a window
        assume(min(y.shape[2:]) + (2 * p if nd < 3 else 0) >= k)
        y = fn(y, k, s, p, ceil_mode=True, count_include_pad=bool(incl))
        out = "y" if i == len(pools) - 1 else f"p{i}"
        nodes.append(helper.make_node("AveragePool", [name], [out], kernel_shape=[k] * nd,
                                      strides=[s] * nd, pads=[p] * 2 * nd, ceil_mode=1,
                                      count_include_pad=incl))
        name = out
    _pools_match_torch(t, y, nodes,
                       ["N", 2, *(f"d{i}" if symbolic else n for i, n in enumerate(dims))])


def test_rescaled_ceil_mode_average_pool_finite_differences():
    """The rescaled form (count_include_pad=1, no equivalent pads) in float64 against central
    differences, 2-D and 3-D."""
    for shape, k in (((1, 2, 3, 5), [3, 3]), ((1, 1, 3, 3, 5), [3, 3, 3])):
        m = pool_model("AveragePool", shape, kernel_shape=k, strides=k, pads=[1] * 2 * len(k),
                       ceil_mode=1, count_include_pad=1)
        x = np.random.default_rng(0).standard_normal(shape)
        report = check_gradients(m, "y", "x", {"x": x}, dtype="float64")
        assert report.ok, str(report)


def test_rescaled_ceil_mode_average_pool_inside_an_if_branch():
    """The rescaled form of the test above in a subgraph: its Constant and Mul go into the
    branch, after the pool."""
    torch = pytest.importorskip("torch")
    attrs = dict(kernel_shape=[3, 3], strides=[3, 3], pads=[1] * 4, ceil_mode=1,
                 count_include_pad=1)
    then = helper.make_graph([helper.make_node("AveragePool", ["x"], ["p"], **attrs),
                              helper.make_node("Tanh", ["p"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", T, None)])
    other = helper.make_graph([helper.make_node("AveragePool", ["x"], ["q"], **attrs)], "else",
                              [], [helper.make_tensor_value_info("q", T, None)])
    m = graph_model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                    [helper.make_tensor_value_info("x", T, [2, 1, 3, 5]),
                     helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                    [helper.make_tensor_value_info("y", T, None)], opset=19)
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["cot"])
    onnx.checker.check_model(res.model, full_check=True)
    rng = np.random.default_rng(0)
    x, cot = rng.standard_normal((2, 1, 3, 5)), rng.standard_normal((2, 1, 2, 2))
    t = torch.tensor(x, requires_grad=True)
    y = torch.tanh(torch.nn.functional.avg_pool2d(t, 3, 3, 1, ceil_mode=True))
    (y * torch.tensor(cot)).sum().backward()
    got_y, got = ort_all(res.model).run(["y", res.grads[0]], {
        "x": x.astype(F), "c": np.array(True), "cot": cot.astype(F)})
    np.testing.assert_allclose(got_y, y.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_ceil_mode_pool_without_equivalent_pads_is_refused(capsys, tmp_path):
    """count_include_pad=1 with dilations: one axis drops a window, the other has a partial
    last one, whose divisor no explicit pad would keep (without dilations such a pool is
    rescaled, above)."""
    m = pool_model("AveragePool", (1, 1, 3, 5), kernel_shape=[2, 2], strides=[3, 3],
                   pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1, dilations=[2, 2])
    assert_refused(capsys, tmp_path, m, NotDifferentiableError, "no equivalent pads",
                   "ceil_mode drops")


@pytest.mark.parametrize("op", ["AveragePool", "MaxPool", "LpPool"])
def test_pool_same_with_dilations_is_refused(op, capsys, tmp_path):
    m = pool_model(op, (1, 1, 6), kernel_shape=[2], strides=[3], dilations=[2],
                   auto_pad="SAME_UPPER")
    assert_refused(capsys, tmp_path, m, NotDifferentiableError, "SAME with dilations",
                   "SAME with dilations")


# -- 7. scope names ------------------------------------------------------------------------------
def names_of(model):
    g = model.graph
    values = [*(v.name for v in g.input), *(t.name for t in g.initializer)]
    nodes = []
    for n in g.node:
        values += [o for o in n.output if o]
        nodes += [n.name] if n.name else []
    return values, nodes


def assert_unique_and_runs(res, feeds):
    values, nodes = names_of(res.model)
    assert len(values) == len(set(values)), "duplicate tensor names"
    assert len(nodes) == len(set(nodes)), "duplicate node names"
    onnx.checker.check_model(res.model, full_check=True)
    sess = ort_all(res.model)
    extra = {i.name: np.ones([d if isinstance(d, int) else 2 for d in i.shape], F)
             for i in sess.get_inputs() if i.name not in feeds}
    return sess.run(None, {**feeds, **extra})


def small():
    return make_model([helper.make_node("Tanh", ["x"], ["t"]),
                       helper.make_node("Mul", ["t", "x"], ["y"])], {"x": (F, [3])}, ["y"])


def test_second_call_with_the_same_scope_gets_a_new_one():
    feeds = {"x": np.array([0.1, 0.2, 0.3], F)}
    r1 = onnxgrad.gradients(small(), "y", "x", name="train/grads")
    r2 = onnxgrad.gradients(r1.model, "y", "x", name="train/grads")
    r3 = onnxgrad.gradients(r2.model, r1.grads[0], "x", name="train/grads")
    assert (r1.grads, r2.grads, r3.grads) == (["train/grads/x_grad"], ["train/grads_1/x_grad"],
                                              ["train/grads_2/x_grad"])
    outs = dict(zip([o.name for o in r3.model.graph.output], assert_unique_and_runs(r3, feeds)))
    np.testing.assert_array_equal(outs["train/grads/x_grad"], outs["train/grads_1/x_grad"])


def test_grad_ys_naming_a_future_gradient_output():
    res = onnxgrad.gradients(small(), "y", "x", grad_ys=["gradients/x_grad"])
    assert res.grads == ["gradients_1/x_grad"]
    assert_unique_and_runs(res, {"x": np.ones(3, F)})


SCOPES = st.text(alphabet="ab/_@1", max_size=6) | st.sampled_from(
    ["gradients", "x", "t", "y", "gradients/x_grad", "a//b/", "/", ""])


@SETTINGS
@given(st.lists(SCOPES, min_size=1, max_size=3), st.booleans())
def test_any_scopes_give_unique_names(scopes, second_order):
    """Successive calls with any scope strings (slashes, empty pieces, names of existing
    tensors or of earlier calls' outputs) and grad_ys named like gradient outputs."""
    model, y = small(), "y"
    for i, scope in enumerate(scopes):
        gy = [f"{scope}/x_grad"] if i == 1 else None
        res = onnxgrad.gradients(model, y, ["x", "t"], name=scope, grad_ys=gy)
        model = res.model
        if second_order:
            y = res.grads[0]
    assert_unique_and_runs(res, {"x": np.array([0.1, 0.2, 0.3], F)})


def test_name_must_be_a_str():
    with pytest.raises(TypeError, match="name must be a str"):
        onnxgrad.gradients(small(), "y", "x", name=None)


# -- 8. models validated up front -----------------------------------------------------------------
def bad_models():
    x = [vi("x", [3])]
    y = [helper.make_tensor_value_info("y", T, None)]
    yield "dangling", graph_model([helper.make_node("Add", ["x", "zz"], ["y"], name="add1")], x,
                                  y), "'zz' of node 'add1'"
    yield "twice", graph_model([helper.make_node("Relu", ["x"], ["y"]),
                                helper.make_node("Tanh", ["x"], ["y"])], x, y), "'y'"
    yield "opset", graph_model([helper.make_node("Relu", ["x"], ["y"])], x, y, opset=99), \
        "opset 99"
    m = graph_model([helper.make_node("Relu", ["x"], ["y"])], x, y)
    m.ir_version = onnx.IR_VERSION + 1
    yield "ir", m, f"IR version {onnx.IR_VERSION + 1}"
    yield "attribute", graph_model([helper.make_node("Softmax", ["x"], ["y"], axis="a")], x, y), \
        "axis"
    yield "no op", graph_model([helper.make_node("Frob", ["x"], ["y"])], x, y), "Frob"


@pytest.mark.parametrize("case", [c[0] for c in bad_models()])
def test_invalid_model_is_refused_up_front(case, capsys, tmp_path):
    _, m, needle = next(c for c in bad_models() if c[0] == case)
    before = m.SerializeToString()
    assert_refused(capsys, tmp_path, m, InvalidModelError, re.escape(needle), needle)
    assert m.SerializeToString() == before
    cli_error(capsys, ["check", tmp_path / "m.onnx", "--ys", "y", "--xs", "x"], needle)


def test_out_of_order_nodes_and_big_weights_are_valid():
    m = graph_model([helper.make_node("Relu", ["t"], ["y"]),
                     helper.make_node("MatMul", ["x", "W"], ["t"])],
                    [vi("x", [1, 3])], [helper.make_tensor_value_info("y", T, None)],
                    [numpy_helper.from_array(np.ones((3, 100_000), F), "W")])  # over 1 MiB
    res = onnxgrad.gradients(m, "y", ["x", "W"])
    onnx.checker.check_model(res.model, full_check=True)
    gx, _ = session(res.model).run(res.grads, {"x": np.ones((1, 3), F)})
    np.testing.assert_array_equal(gx, np.full((1, 3), 100_000, F))


def growing_loop(body_shape):
    body = helper.make_graph(
        [helper.make_node("Concat", ["s_in", "w"], ["s_out"], axis=0),
         helper.make_node("Identity", ["c_in"], ["c_out"])], "body",
        [vi("i", [], TensorProto.INT64), vi("c_in", [], TensorProto.BOOL),
         vi("s_in", body_shape)], [vi("c_out", [], TensorProto.BOOL), vi("s_out", None)])
    return graph_model(
        [helper.make_node("Loop", ["n", "", "s0"], ["s"], body=body),
         helper.make_node("ReduceSum", ["s"], ["y"], keepdims=0)],
        [vi("s0", [2]), vi("w", [1])], [vi("y", [])],
        [numpy_helper.from_array(np.array(3, np.int64), "n")])


def test_loop_carried_tensor_changing_shape_is_refused(capsys, tmp_path):
    assert_refused(capsys, tmp_path, growing_loop([2]), NotDifferentiableError,
                   "'s_in' changes shape", "changes shape", xs=("s0", "w"))


# -- 10 and 12. ranks on everything added; second-order calls -------------------------------------
def lost_ranks(model, first_new):
    """Tensor values the gradient call added whose rank onnx shape inference cannot tell."""
    inf = onnx.shape_inference.infer_shapes(model)
    ranked = {v.name for v in [*inf.graph.value_info, *inf.graph.output, *inf.graph.input]
              if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}
    ranked |= {t.name for t in inf.graph.initializer}
    return [(n.op_type, o) for n in inf.graph.node[first_new:] for o in n.output
            if o and o not in ranked]


def test_concat_then_batched_matmul_second_order():
    m = make_model([helper.make_node("Concat", ["a", "b"], ["c"], axis=1),
                    helper.make_node("MatMul", ["c", "w"], ["y"])],
                   {"a": (F, ["N", "A", 4]), "b": (F, ["N", "B", 4]), "w": (F, ["N", 4, 3])},
                   ["y"])
    r1 = onnxgrad.gradients(m, "y", ["w"])
    assert lost_ranks(r1.model, len(m.graph.node)) == []
    r2 = onnxgrad.gradients(r1.model, r1.grads, ["a", "b"])
    onnx.checker.check_model(r2.model, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((2, 2, 4)), "b": rng.standard_normal((2, 3, 4)),
             "w": rng.standard_normal((2, 4, 3))}
    report = check_gradients(r1.model, r1.grads, ["a", "b"], feeds)
    assert report.ok, str(report)


@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_conv_with_symbolic_kernel_second_order(op):
    m = graph_model([helper.make_node(op, ["x", "w"], ["y"])],
                    [vi("x", ["N", 2, "H", "W"]), vi("w", [2, 2, "K", "K"])],
                    [vi("y", ["N", 2, "Ho", "Wo"])])
    r1 = onnxgrad.gradients(m, "y", ["x", "w"])
    assert lost_ranks(r1.model, len(m.graph.node)) == []
    r2 = onnxgrad.gradients(r1.model, r1.grads, ["x", "w"])
    onnx.checker.check_model(r2.model, full_check=True)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((1, 2, 5, 4)), "w": rng.standard_normal((2, 2, 2, 2))}
    report = check_gradients(r1.model, r1.grads, ["x", "w"], feeds)
    assert report.ok, str(report)


def test_gradient_outputs_carry_rank_and_pass_the_full_checker():
    """p and q come from a Split with computed sizes, which onnx's inference leaves unranked:
    their rank is their input's, so their gradients (and the MatMul's rule) have one."""
    m = graph_model([helper.make_node("Split", ["a", "s"], ["p", "q"], axis=0),
                     helper.make_node("Mul", ["p", "q"], ["r"]),
                     helper.make_node("MatMul", ["r", "w"], ["y"])],
                    [vi("a", ["N", 3]), vi("s", [2], TensorProto.INT64), vi("w", [3, 2])],
                    [helper.make_tensor_value_info("y", T, None)])
    res = onnxgrad.gradients(m, "y", ["a", "p", "w"], unconnected_gradients="zero")
    onnx.checker.check_model(res.model, full_check=True)
    ranks = {o.name: len(o.type.tensor_type.shape.dim) for o in res.model.graph.output}
    assert [ranks[g] for g in res.grads] == [2, 2, 2]
    rng = np.random.default_rng(2)
    report = check_gradients(m, "y", ["a", "w"], {"a": rng.standard_normal((4, 3)),
                                                  "s": np.array([2, 2], np.int64)})
    assert report.ok, str(report)


def test_gradient_output_of_unknown_rank_is_refused():
    m = graph_model([helper.make_node("Tanh", ["x"], ["y"])],
                    [helper.make_tensor_value_info("x", T, None)],
                    [helper.make_tensor_value_info("y", T, None)])
    with pytest.raises(InvalidModelError, match="rank of 'x' is unknown"):
        onnxgrad.gradients(m, "y", "x")


def conformance_cases():
    """One passing backend case per op (the first in name order)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from test_conformance import PASSING
    import conformance
    seen, out = set(), []
    for name in PASSING:
        if name in conformance.EXCLUDED_CASES:
            continue
        op = name.split("_")[1]
        if op not in seen:
            seen.add(op)
            out.append(name)
    return out


# ops whose first-order graph uses an op without a gradient rule of its own: the second call
# refuses them by name (NotDifferentiableError), never for want of a rank
NO_SECOND_ORDER = {"CudnnRNNBackpropV2", "OnnxRNNBackprop"}


@pytest.mark.parametrize("name", conformance_cases())
def test_second_order_over_the_rule_table(name):
    import conformance
    _, model, xs, ys, _ = conformance.build(conformance.all_cases()[name])
    r1 = onnxgrad.gradients(model, ys, xs, unconnected_gradients="zero")
    if name != "test_mvn":  # onnx's full check fails on the case's own model (its function body)
        onnx.checker.check_model(r1.model, full_check=True)
    assert lost_ranks(r1.model, len(model.graph.node)) == []
    try:
        r2 = onnxgrad.gradients(r1.model, r1.grads, xs, unconnected_gradients="zero")
    except NotDifferentiableError as e:
        assert e.op_type in NO_SECOND_ORDER, str(e)
        return
    if name != "test_mvn":
        onnx.checker.check_model(r2.model, full_check=True)


@pytest.mark.parametrize("name", ["test_softmax_example", "test_matmul_3d", "test_tanh",
                                  "test_averagepool_2d_pads", "test_reduce_log_sum_exp_"
                                  "do_not_keepdims_example", "test_instancenorm_example"])
def test_second_order_finite_differences(name):
    import conformance
    _, model, xs, ys, feeds = conformance.build(conformance.all_cases()[name])
    r1 = onnxgrad.gradients(model, ys, xs)
    report = check_gradients(r1.model, r1.grads, xs, feeds, max_elements=16, directions=2)
    assert report.ok, str(report)


def test_assert_gradients_helper_still_applies():
    """The usual first-order check on a model with a contradicting value_info entry."""
    m = chain([vi("t", [7, 5])])
    assert_gradients(m, "y", ["x", "b"], {"x": np.array([0.3, -1.2, 2.0], F)})


def test_schema_fixes_output_types_that_inference_missed():
    """A node whose shape inference fails still has an output type its schema fixes."""
    from onnxgrad.inference import schema_output_dtypes
    f, d, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT64
    assert schema_output_dtypes("Reshape", 18, [d, i64]) == [d]
    assert schema_output_dtypes("Shape", 18, [None]) == [i64]
    assert schema_output_dtypes("Cast", 18, [f]) == [None]  # any type: the attribute says
    assert schema_output_dtypes("Where", 18, [onnx.TensorProto.BOOL, None, f]) == [f]
    assert schema_output_dtypes("NoSuchOp", 18, [f]) == []


def test_rule_reading_only_the_first_gradient_is_refused_not_dropped(monkeypatch):
    """A rule that never reads ``n.gs`` handles output 0's gradient alone: where another output
    has a gradient too, the call is refused (a planted Split rule that ignores part 1); a rule
    that reads ``n.gs`` (the real one) is trusted with every output."""
    from onnxgrad import registry
    m = graph_model([helper.make_node("Split", ["x"], ["a", "b"], axis=0, num_outputs=2),
                     helper.make_node("Mul", ["a", "b"], ["y"])],
                    [vi("x", [4, 3])], [vi("y", [2, 3])], opset=18)
    real = onnxgrad.gradients(m, "y", "x")  # the registered rule: both parts
    assert real.grads == ["gradients/x_grad"]
    monkeypatch.setitem(registry._RULES, ("", "Split"),
                        [(1, registry._MAX, lambda n, g: n.e.Concat(g, n.e.zeros_like(g),
                                                                   axis=0))])
    with pytest.raises(NotDifferentiableError, match=r"output 1 \('b'\) has one too"):
        onnxgrad.gradients(m, "y", "x")
    onnxgrad.gradients(m, "a", "x")  # output 0 alone: the rule is enough
