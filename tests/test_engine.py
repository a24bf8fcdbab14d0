"""The public contract of onnxgrad.gradients (DESIGN.md), one behaviour per test."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxgrad
from onnxgrad.check import check_gradients
from onnxgrad.runtime import run
from util import grads_of, make_model

F = np.float32


def node(op, ins, outs, **kw):
    return helper.make_node(op, ins, outs, **kw)


def seed_model():
    """a = 0; b = 2a; y = a + b (TF's stop_gradients example)."""
    return make_model([node("Mul", ["a", "two"], ["b"]), node("Add", ["a", "b"], ["y"])],
                      {"a": (F, [])}, ["y"], inits={"two": np.array(2, F)})


def test_stop_gradients_seed_example():
    feeds = {"a": np.array(0, F)}
    (ga, gb), _ = grads_of(seed_model(), "y", ["a", "b"], feeds, stop_gradients=["a", "b"])
    assert (ga, gb) == (1, 1)
    (ga, gb), _ = grads_of(seed_model(), "y", ["a", "b"], feeds)
    assert (ga, gb) == (3, 1)


def unconnected_model(batch=1):
    # a = ones([1, 2]), b = ones([3, 1]): b does not depend on a
    return make_model([node("Identity", ["a"], ["ya"]), node("Identity", ["b"], ["yb"])],
                      {"a": (F, [batch, 2]), "b": (F, [3, 1])}, ["ya", "yb"])


def test_unconnected_none_and_zero():
    feeds = {"a": np.ones((1, 2), F), "b": np.ones((3, 1), F)}
    (g,), res = grads_of(unconnected_model(), ["yb"], ["a"], feeds)
    assert g is None and res.grads == [None]
    (g,), _ = grads_of(unconnected_model(), ["yb"], ["a"], feeds, unconnected_gradients="zero")
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g, [[0.0, 0.0]])
    (g,), _ = grads_of(unconnected_model(), ["yb"], ["a"], feeds,
                       unconnected_gradients=onnxgrad.UnconnectedGradients.ZERO)
    np.testing.assert_array_equal(g, [[0.0, 0.0]])


def test_unconnected_zero_symbolic_shape():
    m = unconnected_model(batch="N")
    res = onnxgrad.gradients(m, ["yb"], ["a"], unconnected_gradients="zero")
    for n in (1, 4):
        g, = run(res.model, {"a": np.ones((n, 2), F), "b": np.ones((3, 1), F)}, [res.grads[0]])
        np.testing.assert_array_equal(g, np.zeros((n, 2), F))


def test_bad_unconnected_value_is_named():
    with pytest.raises(ValueError, match="'zeros'"):
        onnxgrad.gradients(unconnected_model(), ["yb"], ["a"], unconnected_gradients="zeros")


def test_bad_aggregation_value_is_named():
    with pytest.raises(ValueError, match="'fast'"):
        onnxgrad.gradients(seed_model(), "y", "a", aggregation_method="fast")


def test_integer_tensors_are_constants():
    # y = x * float(int(x)): the path through the integer Cast carries no gradient
    m = make_model([node("Cast", ["x"], ["xi"], to=TensorProto.INT64),
                    node("Cast", ["xi"], ["xf"], to=TensorProto.FLOAT),
                    node("Mul", ["x", "xf"], ["y"])], {"x": (F, [4])}, ["y"])
    x = np.array([1.5, 2.5, -3.2, 4.9], F)
    (g,), _ = grads_of(m, "y", ["x"], {"x": x})
    np.testing.assert_allclose(g, np.trunc(x))
    # an integer x gets no gradient at all
    (gi,), _ = grads_of(m, "y", ["xi"], {"x": x})
    assert gi is None


def multi_use_model():
    # y = x*x + sin(x) + x: x gets three contributions
    return make_model([node("Mul", ["x", "x"], ["sq"]), node("Sin", ["x"], ["s"]),
                       node("Sum", ["sq", "s", "x"], ["y"])], {"x": (F, [3])}, ["y"])


@pytest.mark.parametrize("method", [None, "add_n", "tree", "accumulate_n",
                                    onnxgrad.AggregationMethod.TREE])
def test_aggregation_methods_agree(method):
    x = np.array([0.3, -1.0, 2.0], F)
    (g,), res = grads_of(multi_use_model(), "y", ["x"], {"x": x}, aggregation_method=method)
    np.testing.assert_allclose(g, 2 * x + np.cos(x) + 1, rtol=1e-6)
    added = [n.op_type for n in res.model.graph.node if n.name.startswith("gradients/")]
    if method in (None, "add_n"):
        assert added.count("Sum") == 1
    else:
        assert "Sum" not in added and added.count("Add") >= 2


def test_unique_scopes():
    res = onnxgrad.gradients(multi_use_model(), "y", "x")
    added = [n.name for n in res.model.graph.node[3:]]
    assert added and all(n.startswith("gradients/") for n in added)
    res2 = onnxgrad.gradients(res.model, res.grads[0], "x")
    added2 = [n.name for n in res2.model.graph.node[len(res.model.graph.node):]]
    assert added2 and all(n.startswith("gradients_1/") for n in added2)
    res3 = onnxgrad.gradients(res2.model, "y", "x")
    assert res3.grads[0].startswith("gradients_2/")
    custom = onnxgrad.gradients(multi_use_model(), "y", "x", name="grads")
    assert custom.grads[0].startswith("grads/")


def test_scope_avoids_model_names():
    m = make_model([node("Relu", ["x"], ["gradients/x"], name="gradients/relu")],
                   {"x": (F, [3])}, ["gradients/x"])
    res = onnxgrad.gradients(m, "gradients/x", "x")
    assert res.grads[0].startswith("gradients_1/")
    names = [n.name for n in res.model.graph.node]
    assert len(names) == len(set(names))


def test_hessian_vector_product():
    # f = sum(tanh(x) * x): the gradient graph is itself differentiable
    m = make_model([node("Tanh", ["x"], ["t"]), node("Mul", ["t", "x"], ["p"]),
                    node("ReduceSum", ["p"], ["f"], keepdims=0)], {"x": (F, [5])}, ["f"])
    res = onnxgrad.gradients(m, "f", "x")
    hvp = onnxgrad.gradients(res.model, res.grads[0], "x", grad_ys=["v"])
    x = np.linspace(-1, 1, 5).astype(F)
    v = np.arange(5).astype(F)
    got, = run(hvp.model, {"x": x, "v": v}, [hvp.grads[0]])
    t = np.tanh(x)
    diag = 2 * (1 - t * t) - 2 * x * t * (1 - t * t)  # d2/dx2 of tanh(x) * x
    np.testing.assert_allclose(got, diag * v, rtol=1e-5, atol=1e-6)
    # and the second-order graph agrees with finite differences of the first-order one
    report = check_gradients(res.model, res.grads[0], "x")
    assert report.ok, str(report)


def test_input_model_not_mutated_and_output_deterministic():
    m = multi_use_model()
    before = m.SerializeToString()
    a = onnxgrad.gradients(m, "y", "x", unconnected_gradients="zero").model.SerializeToString()
    b = onnxgrad.gradients(m, "y", "x", unconnected_gradients="zero").model.SerializeToString()
    assert m.SerializeToString() == before
    assert a == b


def test_checker_opset_ir_and_outputs_kept():
    m = make_model([node("Sigmoid", ["x"], ["y"]), node("Relu", ["x"], ["z"])],
                   {"x": (F, ["N", 3])}, ["y", "z"], opset=17, ir_version=8)
    res = onnxgrad.gradients(m, ["y", "z"], "x")
    onnx.checker.check_model(res.model, full_check=True)
    assert res.model.ir_version == 8
    assert [(o.domain, o.version) for o in res.model.opset_import] == [("", 17)]
    assert [o.name for o in res.model.graph.output][:2] == ["y", "z"]
    assert res.model.graph.output[2].name == res.grads[0]


def test_old_opset_is_upgraded():
    m = make_model([node("Sigmoid", ["x"], ["y"])], {"x": (F, [3])}, ["y"], opset=11, ir_version=6)
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    assert res.model.opset_import[0].version == 13
    g, = run(res.model, {"x": np.zeros(3, F)}, [res.grads[0]])
    np.testing.assert_allclose(g, 0.25)


def test_symbolic_batch_one_graph_any_size():
    # broadcasting between different symbolic dims: the reduction axes are found at run time
    m = make_model([node("Mul", ["a", "b"], ["y"])], {"a": (F, ["N", 3]), "b": (F, ["M", 3])},
                   ["y"])
    res = onnxgrad.gradients(m, "y", ["a", "b"])
    onnx.checker.check_model(res.model, full_check=True)
    rng = np.random.default_rng(0)
    for n, mm in [(4, 1), (1, 5), (6, 6)]:
        a, b = rng.standard_normal((n, 3)).astype(F), rng.standard_normal((mm, 3)).astype(F)
        ga, gb = run(res.model, {"a": a, "b": b}, res.grads)
        ones = np.ones(np.broadcast_shapes(a.shape, b.shape), F)
        np.testing.assert_allclose(ga, (ones * b).sum(0, keepdims=True) if n == 1 else ones * b,
                                   rtol=1e-5)
        np.testing.assert_allclose(gb, (ones * a).sum(0, keepdims=True) if mm == 1 else ones * a,
                                   rtol=1e-5)


def test_grad_ys_existing_and_new_names():
    m = make_model([node("Sin", ["x"], ["y"]), node("Identity", ["w"], ["w_id"])],
                   {"x": (F, ["N"]), "w": (F, ["N"])}, ["y", "w_id"])
    x = np.array([0.1, 0.7, -2.0], F)
    w = np.array([1.0, -2.0, 3.0], F)
    (g,), _ = grads_of(m, "y", ["x"], {"x": x, "w": w}, grad_ys=["w"])
    np.testing.assert_allclose(g, w * np.cos(x), rtol=1e-6)
    # a new name becomes a graph input with y's type: a VJP that can be fed at run time
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["dy"])
    dy = [i for i in res.model.graph.input if i.name == "dy"][0]
    assert dy.type.tensor_type.elem_type == TensorProto.FLOAT
    assert dy.type.tensor_type.shape.dim[0].dim_param == "N"
    g, = run(res.model, {"x": x, "w": w, "dy": w}, [res.grads[0]])
    np.testing.assert_allclose(g, w * np.cos(x), rtol=1e-6)


def test_grad_ys_errors():
    m = multi_use_model()
    with pytest.raises(ValueError, match="grad_ys has 2 entries but ys has 1"):
        onnxgrad.gradients(m, "y", "x", grad_ys=[None, None])
    m2 = make_model([node("Sin", ["x"], ["y"])], {"x": (F, [3]), "d": (np.float64, [3])}, ["y"])
    with pytest.raises(TypeError, match="'d'"):
        onnxgrad.gradients(m2, "y", "x", grad_ys=["d"])


def test_unknown_names_suggest_close_ones():
    with pytest.raises(ValueError, match=r"xs: no tensor named 'xx'.*did you mean 'x'"):
        onnxgrad.gradients(multi_use_model(), "y", "xx")
    with pytest.raises(ValueError, match=r"ys: no tensor named 'yy'"):
        onnxgrad.gradients(multi_use_model(), "yy", "x")


def test_not_a_tensor():
    m = make_model([node("SequenceConstruct", ["x"], ["seq"]), node("Sin", ["x"], ["y"])],
                   {"x": (F, [3])}, ["seq", "y"])
    with pytest.raises(TypeError, match="'seq' is a"):
        onnxgrad.gradients(m, "seq", "x")


def custom_op_model():
    g = helper.make_graph(
        [node("Sin", ["x"], ["s"], name="sin"), node("Foo", ["s"], ["f"], domain="my.ops",
                                                      name="foo"),
         node("Mul", ["f", "x"], ["y"], name="mul")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        value_info=[helper.make_tensor_value_info("f", TensorProto.FLOAT, [3])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                               helper.make_opsetid("my.ops", 1)], ir_version=10)


def test_not_differentiable_error_names_op_and_path():
    with pytest.raises(onnxgrad.NotDifferentiableError) as err:
        onnxgrad.gradients(custom_op_model(), "y", "x")
    e = err.value
    assert isinstance(e, NotImplementedError)
    assert (e.op_type, e.domain, e.opset, e.node_name) == ("Foo", "my.ops", 1, "foo")
    assert e.path == ["y", "f", "[Foo]", "s", "x"]
    assert "stop_gradients" in str(e) and "'my.ops'" in str(e)
    # holding the op's input constant is the documented way around it
    res = onnxgrad.gradients(custom_op_model(), "y", "x", stop_gradients=["s"])
    assert res.grads[0] is not None


def test_op_without_rule_off_the_path_is_fine():
    res = onnxgrad.gradients(custom_op_model(), "s", "x")
    assert res.grads[0] is not None


def test_intermediate_and_repeated_xs():
    m = make_model([node("Sin", ["x"], ["s"]), node("Mul", ["s", "s"], ["y"])],
                   {"x": (F, [3])}, ["y"])
    x = np.array([0.2, 1.0, -0.5], F)
    (gs, gx, gx2, gy), res = grads_of(m, "y", ["s", "x", "x", "y"], {"x": x})
    np.testing.assert_allclose(gs, 2 * np.sin(x), rtol=1e-6)
    np.testing.assert_allclose(gx, 2 * np.sin(x) * np.cos(x), rtol=1e-6)
    np.testing.assert_array_equal(gx, gx2)
    np.testing.assert_array_equal(gy, np.ones(3))
    assert len(set(res.grads)) == 4


def test_initializer_xs_and_model_path(tmp_path):
    m = make_model([node("Mul", ["x", "w"], ["y"])], {"x": (F, [2, 3])}, ["y"],
                   inits={"w": np.full(3, 2.0, F)})
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    x = np.arange(6, dtype=F).reshape(2, 3)
    (gw,), _ = grads_of(str(path), "y", ["w"], {"x": x})
    np.testing.assert_allclose(gw, x.sum(0))


def test_bad_model_argument():
    with pytest.raises(TypeError, match="ModelProto or a path"):
        onnxgrad.gradients(42, "y", "x")


def test_large_weights_round_trip_exactly():
    # weights over 1 MiB skip version conversion and shape inference and are put back as given
    w = np.random.default_rng(0).standard_normal((600, 600)).astype(F)
    m = make_model([node("MatMul", ["x", "w"], ["y"])], {"x": (F, ["N", 600])}, ["y"],
                   inits={"w": w}, opset=11, ir_version=6)
    before = m.SerializeToString()
    res = onnxgrad.gradients(m, "y", ["x", "w"])
    assert m.SerializeToString() == before
    out = {t.name: t for t in res.model.graph.initializer}
    assert out["w"].SerializeToString() == m.graph.initializer[0].SerializeToString()
    x = np.ones((2, 600), F)
    gx, gw = run(res.model, {"x": x}, res.grads)
    np.testing.assert_allclose(gx, np.ones((2, 600), F) @ w.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gw, x.T @ np.ones((2, 600), F), rtol=1e-6)
