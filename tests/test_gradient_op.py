"""The standard's ``ai.onnx.preview.training.Gradient`` op, lowered
(``onnxgrad.lower_gradient_ops``), against its definition: the names in ``xs`` and ``zs`` are
the independent variables of the graph that computes ``y``, and the node's i-th input is the
value at which the i-th of them is taken. Drawn graphs and Gradient nodes, checked in float64
against central finite differences of a NumPy evaluation of that definition."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import onnxgrad
from onnxgrad.errors import InvalidModelError, UnsupportedError
from onnxgrad.runtime import session

D = "ai.onnx.preview.training"
INPUTS = ("A", "B", "C")
SHAPE = [2, 3]
UNARY = {"Tanh": np.tanh, "Sin": np.sin, "Sigmoid": lambda v: 1 / (1 + np.exp(-v)),
         "Cos": np.cos}
BINARY = {"Mul": np.multiply, "Add": np.add, "Sub": np.subtract}


def _model(body, y, xs, zs, values, update):
    """body: (op, inputs) per node, node i writing v{i}; a Gradient node after it; ``update``
    adds a node reading the first gradient (as a training update would)."""
    nodes = [helper.make_node(op, ins, [f"v{i}"]) for i, (op, ins) in enumerate(body)]
    grads = [f"d{i}" for i in range(len(xs))]
    nodes.append(helper.make_node("Gradient", values, grads, domain=D, xs=xs, y=y,
                                  **({"zs": zs} if zs else {})))
    outs = [y, *grads]
    if update:
        nodes.append(helper.make_node("Sub", [xs[0], grads[0]], ["updated"]))
        outs.append("updated")
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.DOUBLE, SHAPE)  # noqa: E731
    g = helper.make_graph(nodes, "g", [vi(n) for n in INPUTS], [vi(n) for n in outs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                               helper.make_opsetid(D, 1)], ir_version=10)


def _evaluate(body, feeds, held=None):
    """Every value of the graph, the names in ``held`` read as the values given there."""
    held = held or {}
    env = {**feeds, **held}
    for i, (op, ins) in enumerate(body):
        args = [env[v] for v in ins]
        out = UNARY[op](*args) if op in UNARY else BINARY[op](*args)
        env[f"v{i}"] = held.get(f"v{i}", out)
    return env


@st.composite
def programs(draw):
    names, body = list(INPUTS), []
    for i in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(sorted(UNARY) + sorted(BINARY)))
        ins = [draw(st.sampled_from(names)) for _ in range(1 if op in UNARY else 2)]
        body.append((op, ins))
        names.append(f"v{i}")
    y = draw(st.sampled_from(names[len(INPUTS):]))
    symbols = draw(st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True))
    n_xs = draw(st.integers(1, len(symbols)))
    values = [s if draw(st.booleans()) else draw(st.sampled_from(names)) for s in symbols]
    return body, y, symbols[:n_xs], symbols[n_xs:], values, draw(st.booleans())


def _check(body, y, xs, zs, values, update, seed=0):
    model = _model(body, y, xs, zs, values, update)
    before = model.SerializeToString()
    lowered = onnxgrad.lower_gradient_ops(model)
    assert model.SerializeToString() == before
    onnx.checker.check_model(lowered, full_check=True)
    assert not any(n.domain == D for n in lowered.graph.node)
    rng = np.random.default_rng(seed)
    feeds = {n: rng.uniform(-1.5, 1.5, SHAPE) for n in INPUTS}
    names = [o.name for o in lowered.graph.output]
    got = dict(zip(names, session(lowered).run(names, feeds)))
    env = _evaluate(body, feeds)
    at = {s: env[v] for s, v in zip(xs + zs, values)}  # the definition: symbols := inputs
    np.testing.assert_allclose(got[y], env[y], rtol=1e-12)
    eps = 1e-6
    for i, x in enumerate(xs):
        want = np.zeros(SHAPE)
        for k in np.ndindex(*SHAPE):
            hi, lo = dict(at), dict(at)
            hi[x], lo[x] = at[x].copy(), at[x].copy()
            hi[x][k] += eps
            lo[x][k] -= eps
            # sum(y): the standard's y is differentiated with all-ones upstream
            want[k] = (_evaluate(body, feeds, hi)[y].sum()
                       - _evaluate(body, feeds, lo)[y].sum()) / (2 * eps)
        np.testing.assert_allclose(got[f"d{i}"], want, rtol=1e-6, atol=1e-6,
                                   err_msg=f"d y / d {x} ({xs=}, {zs=}, inputs {values})")
    if update:
        np.testing.assert_allclose(got["updated"], env[xs[0]] - got["d0"], rtol=1e-12)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(programs())
# a Gradient node taken at a value other than the tensor xs names (the standard's H_1 example):
# the lowering took it at the graph's own value (silently wrong)
@example(([("Tanh", ["A"]), ("Mul", ["v0", "v0"])], "v1", ["v0"], [], ["B"], False))
# a zs computed from an xs: the partial derivative, not the total one
@example(([("Mul", ["A", "A"]), ("Mul", ["v0", "A"])], "v1", ["A"], ["v0"], ["A", "v0"], True))
# two names taken at one value, and swapped values
@example(([("Mul", ["A", "A"]), ("Mul", ["v0", "B"])], "v1", ["A", "B"], [], ["A", "A"], False))
@example(([("Mul", ["A", "A"]), ("Mul", ["v0", "B"])], "v1", ["A", "B"], [], ["B", "A"], False))
def test_gradient_op_follows_the_standard(program):
    _check(*program)


def test_gradient_op_inputs_must_match_xs_and_zs():
    body = [("Mul", ["A", "B"])]
    with pytest.raises(InvalidModelError, match=r"inputs \['A'\] for xs \+ zs = \['A', 'B'\]"):
        onnxgrad.lower_gradient_ops(_model(body, "v0", ["A"], ["B"], ["A"], False))
    with pytest.raises(InvalidModelError, match=r"names \['Z'\], which the graph does not"):
        onnxgrad.lower_gradient_ops(_model(body, "v0", ["Z"], [], ["A"], False))
    with pytest.raises(InvalidModelError, match="names a tensor twice"):
        onnxgrad.lower_gradient_ops(_model(body, "v0", ["A"], ["A"], ["A", "A"], False))


def test_gradient_op_copy_through_control_flow_is_refused():
    then = helper.make_graph([helper.make_node("Tanh", ["A"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.DOUBLE, SHAPE)])
    els = helper.make_graph([helper.make_node("Sin", ["A"], ["e"])], "else", [],
                            [helper.make_tensor_value_info("e", TensorProto.DOUBLE, SHAPE)])
    m = _model([("Mul", ["A", "A"])], "v0", ["A"], [], ["B"], False)
    g = m.graph
    g.input.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    g.node.insert(1, helper.make_node("If", ["c"], ["f"], name="branch", then_branch=then,
                                      else_branch=els))
    g.node.insert(2, helper.make_node("Mul", ["f", "v0"], ["w"]))
    g.node[3].attribute[-1].s = b"w"  # the Gradient node's y
    assert g.node[3].attribute[-1].name == "y"
    # at the tensor A itself, the If is differentiated as it stands
    g.node[3].input[:] = ["A"]
    low = onnxgrad.lower_gradient_ops(m)
    a = np.full(SHAPE, 0.3)
    d = session(low).run(["d0"], {"A": a, "B": a, "C": a, "c": np.array(True)})[0]
    np.testing.assert_allclose(d, (1 - np.tanh(a) ** 2) * a * a + np.tanh(a) * 2 * a)
    g.node[3].input[:] = ["B"]
    with pytest.raises(UnsupportedError, match="through If node 'branch'"):
        onnxgrad.lower_gradient_ops(m)


def test_gradient_op_in_a_function_is_refused():
    """A Gradient node inside a model-local function was left there, unlowered, and the model
    returned (and written by ``onnxgrad lower``) as if lowered: no runtime runs it."""
    fn = helper.make_function(
        "local", "F", ["a"], ["da"],
        [helper.make_node("Tanh", ["a"], ["t"]),
         helper.make_node("Gradient", ["a"], ["da"], domain=D, xs=["a"], y="t", name="inner")],
        [helper.make_opsetid("", 18), helper.make_opsetid(D, 1)])
    vi = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("F", ["A"], ["y"], domain="local")], "g",
                          [vi("A", TensorProto.DOUBLE, SHAPE)],
                          [vi("y", TensorProto.DOUBLE, SHAPE)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                            helper.make_opsetid("local", 1),
                                            helper.make_opsetid(D, 1)],
                          functions=[fn], ir_version=10)
    with pytest.raises(UnsupportedError, match="'inner' is inside model-local function local.F"):
        onnxgrad.lower_gradient_ops(m)


def test_gradient_op_symbol_among_a_nodes_outputs():
    """xs names one output of a Split whose other output y reads, the node taken at other
    values: the copied Split's output must not replace the value given for that name."""
    vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.DOUBLE, s)  # noqa: E731
    g = helper.make_graph(
        [helper.make_node("Mul", ["X", "A"], ["m"]),
         helper.make_node("Split", ["m"], ["s1", "s2"], axis=0, num_outputs=2),
         helper.make_node("Mul", ["s1", "s2"], ["Y"]),
         helper.make_node("Gradient", ["B", "S"], ["dA", "ds1"], domain=D, xs=["A", "s1"],
                          y="Y")], "g",
        [vi("X", [4]), vi("A", [4]), vi("B", [4]), vi("S", [2])],
        [vi("Y", [2]), vi("dA", [4]), vi("ds1", [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                            helper.make_opsetid(D, 1)], ir_version=10)
    x, b, s = np.array([1.0, 2, 3, 4]), np.array([5.0, 6, 7, 8]), np.array([10.0, 20])
    da, ds1 = session(onnxgrad.lower_gradient_ops(m)).run(
        ["dA", "ds1"], {"X": x, "A": np.ones(4), "B": b, "S": s})
    # A := B and s1 := S, independent: Y = s1 * (X * A)[2:]
    np.testing.assert_allclose(da, [0, 0, s[0] * x[2], s[1] * x[3]])
    np.testing.assert_allclose(ds1, (x * b)[2:])
