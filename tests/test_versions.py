"""Models whose opset gradients() converts (older than 13, or older than a rule's op needs):
model-local functions, Clip and Upsample in subgraphs, and the RNN bodies (which need opset 14:
at 13 onnxruntime refused their Scans whenever the batch dim was symbolic) all come out whole,
with gradients that match finite differences."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper, numpy_helper
from util import assert_gradients, central_differences

import onnxgrad
from onnxgrad.check import check_gradients
from onnxgrad.rnn import attach_functions, make_node

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _rnn_model(op, opset, direction, batch, with_h0, seed):
    rng = np.random.default_rng(seed)
    nd, H, I, S = (2 if direction == "bidirectional" else 1), 3, 2, 3
    g = GATES[op]
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n)
             for n, s in (("W", (nd, g * H, I)), ("R", (nd, g * H, H)),
                          ("Bias", (nd, 2 * g * H)))]
    ins = ["X", "W", "R", "Bias"] + (["", "h0"] if with_h0 else [])
    inputs = [helper.make_tensor_value_info("X", TP.FLOAT, [S, batch, I])]
    if with_h0:
        inputs.append(helper.make_tensor_value_info("h0", TP.FLOAT, [nd, batch, H]))
    node = helper.make_node(op, ins, ["Y", "Y_h"], hidden_size=H, direction=direction)
    graph = helper.make_graph([node], "rnn", inputs,
                              [helper.make_tensor_value_info("Y", TP.FLOAT, None),
                               helper.make_tensor_value_info("Y_h", TP.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(sorted(GATES)), opset=st.integers(7, 14),
       direction=st.sampled_from(["forward", "reverse", "bidirectional"]),
       batch=st.sampled_from([2, "batch"]), with_h0=st.booleans(), seed=st.integers(0, 99))
def test_onnx_rnn_ops_at_any_opset_and_batch(op, opset, direction, batch, with_h0, seed):
    """The gradient of an ONNX RNN/GRU/LSTM exported at opset 7 to 14 with a static or symbolic
    batch (torch.onnx's TorchScript exporter at opset 11 or 13 with dynamic_axes makes the
    latter) runs on onnxruntime and matches finite differences. At opset 13 with a symbolic
    batch it failed at run time: "Subgraph must have the shape set for all outputs"."""
    m = _rnn_model(op, opset, direction, batch, with_h0, seed)
    xs = ["X", "W", "R", "Bias"] + (["h0"] if with_h0 else [])
    assert_gradients(m, ["Y", "Y_h"], xs)


def test_cudnn_rnn_bodies_need_opset_14():
    node = make_node("CudnnRNNV2", ["x", "h", "c", "p"], ["y", "hy", "cy", "rs", "hr"],
                     rnn_mode="gru")
    vi = lambda n, s: helper.make_tensor_value_info(n, TP.FLOAT, s)  # noqa: E731
    g = helper.make_graph([node], "g", [vi("x", [2, "b", 3]), vi("h", [1, "b", 4]),
                                        vi("c", [1, "b", 4]), vi("p", [None])],
                          [vi("y", None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13),
                                            helper.make_opsetid("onnxgrad", 1)])
    with pytest.raises(ValueError, match="need ai.onnx opset >= 14, the model imports 13"):
        attach_functions(m)


# -- model-local functions through an upgrade -------------------------------------------------
_BODY_OPS = ["Tanh", "Sigmoid", "Softplus", "Square", "Exp"]


def _body(op, a, b):
    if op == "Square":
        return [helper.make_node("Mul", [a, a], [b])]
    if op == "Exp":  # (bounded, so the finite differences stay well scaled)
        return [helper.make_node("Tanh", [a], [b + "_t"]), helper.make_node("Exp", [b + "_t"], [b])]
    return [helper.make_node(op, [a], [b])]


@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(opset=st.sampled_from([11, 12, 13, 14, 15]), outer=st.sampled_from(_BODY_OPS),
       inner=st.sampled_from(_BODY_OPS), nested=st.booleans(),
       needs=st.sampled_from(["GatherElements", "ScatterElements", "none"]))
def test_local_functions_survive_an_upgrade(opset, outer, inner, nested, needs):
    """A model with model-local functions whose opset gradients() raises (older than 13, or a
    rule that needs ScatterElements' add reduction, opset 16): onnx's version converter drops
    every function body, which left the calls without one ("no gradient rule for op 'F'").
    The functions are inlined before the conversion; the gradient matches finite
    differences. Functions may call functions."""
    fo = [helper.make_opsetid("", opset), helper.make_opsetid("local", 1)]
    fns = [helper.make_function("local", "Inner", ["a"], ["b"], _body(inner, "a", "b"), fo)]
    outer_nodes = _body(outer, "a", "t") + (
        [helper.make_node("Inner", ["t"], ["b"], domain="local")] if nested else
        [helper.make_node("Identity", ["t"], ["b"])])
    fns.append(helper.make_function("local", "Outer", ["a"], ["b"], outer_nodes, fo))
    nodes = [helper.make_node("Outer", ["x"], ["f"], domain="local")]
    ins = [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3]),
           helper.make_tensor_value_info("i", TP.INT64, [2, 2])]
    if needs == "GatherElements":
        nodes.append(helper.make_node("GatherElements", ["f", "i"], ["y"], axis=1))
    elif needs == "ScatterElements":
        ins.append(helper.make_tensor_value_info("u", TP.FLOAT, [2, 2]))
        nodes.append(helper.make_node("ScatterElements", ["f", "i", "u"], ["y"], axis=1))
    else:
        nodes.append(helper.make_node("Mul", ["f", "f"], ["y"]))
    y_shape = [2, 2] if needs == "GatherElements" else [2, 3]
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", TP.FLOAT, y_shape)])
    m = helper.make_model(g, opset_imports=fo, functions=fns, ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    before = m.SerializeToString()
    index = np.array([[0, 2], [1, 0]])  # (no repeats: ScatterElements' result is then defined)
    xs = ["x"] + (["u"] if needs == "ScatterElements" else [])
    assert_gradients(m, "y", xs, {"i": index})
    assert m.SerializeToString() == before


# -- the converter's repairs, in subgraphs too ------------------------------------------------
def _if_model(branch_nodes, opset, dtype=TP.DOUBLE, shape=(3,), out_shape=(3,)):
    def branch(name, k):
        nodes = [helper.make_node(n.op_type, list(n.input), [f"{o}{k}" for o in n.output],
                                  **{a.name: helper.get_attribute_value(a) for a in n.attribute})
                 for n in branch_nodes]
        # (names in a branch are its own: rename every output, reads of them follow)
        made = {o for n in branch_nodes for o in n.output}
        for n in nodes:
            n.input[:] = [f"{i}{k}" if i in made else i for i in n.input]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(
            f"{branch_nodes[-1].output[0]}{k}", dtype, list(out_shape))])
    g = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=branch("t", 1),
                                            else_branch=branch("e", 2))], "g",
                          [helper.make_tensor_value_info("x", dtype, list(shape)),
                           helper.make_tensor_value_info("cond", TP.BOOL, [])],
                          [helper.make_tensor_value_info("y", dtype, list(out_shape))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=6)
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("cond", [True, False])
def test_clip_6_in_a_subgraph_keeps_its_dtype(cond):
    """Clip-6's bounds are attributes; the converter writes float32 Constants for them, which a
    double Clip refuses. They were retyped in the main graph only: an If branch's Clip made the
    gradient graph fail onnx's inference ("min has inconsistent type tensor(float)")."""
    m = _if_model([helper.make_node("Clip", ["x"], ["c"], min=-0.5, max=0.4),
                   helper.make_node("Mul", ["c", "x"], ["o"])], opset=10)
    x = np.array([0.3, -0.9, 0.45])  # (each side of each bound, away from the kinks)
    assert_gradients(m, "y", ["x"], {"x": x, "cond": np.array(cond)}, f32=False)


def test_upsample_in_a_subgraph_keeps_its_coordinates():
    """Upsample (opset 9) becomes Resize with Resize's default half_pixel coordinates; Upsample's
    are asymmetric. The repair was made in the main graph only: in an If branch the forward
    changed. The finite differences run the original Upsample model."""
    scales = numpy_helper.from_array(np.array([1, 1, 2, 3], np.float32), "s")
    m = _if_model([helper.make_node("Constant", [], ["s"], value=scales),
                   helper.make_node("Upsample", ["x", "s"], ["u"], mode="linear")],
                  opset=9, dtype=TP.FLOAT, shape=(1, 1, 2, 3), out_shape=(1, 1, 4, 9))
    res = onnxgrad.gradients(m, "y", "x")
    from onnxgrad.runtime import session
    x = np.arange(6, dtype=np.float32).reshape(1, 1, 2, 3)
    want = session(m).run(["y"], {"x": x, "cond": np.array(True)})[0]
    got = session(res.model).run(["y"], {"x": x, "cond": np.array(True)})[0]
    np.testing.assert_array_equal(got, want)
    # (no float64 oracle: onnx.reference has no 4-D linear Upsample, onnxruntime no float64 one;
    # the op is linear in x, so float32 differences are exact up to rounding)
    report = check_gradients(m, "y", ["x"], {"x": x, "cond": np.array(True)}, dtype="float32")
    assert report.ok, str(report)


@pytest.mark.parametrize("opset", [13, 14])
@pytest.mark.parametrize("batch", [2, "batch"])
def test_resize_after_a_run_time_reshape(opset, batch):
    """Reshape-13 to a shape computed at run time has no rank in onnx's inference (data
    propagation finds one, Reshape-14's inference too): the result's inference then sized the
    Resize gradient's sizes, read from such a Shape, as empty, and onnx.checker and onnxruntime
    refused the model. TorchScript writes GroupNorm that way (Reshape(.., Shape(x))) at opset
    13 and below; the result now states those Reshapes' ranks."""
    nodes = [helper.make_node("Shape", ["x"], ["xs"]),
             helper.make_node("Reshape", ["x", "xs"], ["h"]),
             helper.make_node("Shape", ["h"], ["hs"]),
             helper.make_node("Slice", ["hs", "c0", "c2"], ["nc"]),
             helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
             helper.make_node("Resize", ["h", "", "", "sizes"], ["y"], mode="linear",
                              coordinate_transformation_mode="align_corners")]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n)
             for n, v in (("c0", [0]), ("c2", [2]), ("hw", [5, 4]))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT,
                                                                     [batch, 2, 3, 2])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [batch, 2, 5, 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    assert_gradients(m, "y", ["x"])


# -- an upgrade keeps the forward: ops whose meaning changed across opsets ------------------------
@st.composite
def old_ops(draw):
    """(nodes, initializers, input shape, opset) of one op whose semantics the version converter
    does not carry over by itself: Resize-10 (asymmetric; nearest ceil on a shrunk axis, floor
    elsewhere), Upsample-9, Hardmax / Softmax / LogSoftmax before 13 (2-D coercion at axis); and
    ops whose attributes became inputs (Slice-1, Pad-2, ReduceSum-11, Clip-6, Squeeze-11)."""
    kind = draw(st.sampled_from(["Resize", "Upsample", "Hardmax", "Softmax", "LogSoftmax",
                                 "Slice", "Pad", "ReduceSum", "Clip", "Squeeze"]))
    if kind in ("Resize", "Upsample"):
        pick = [0.5, 0.6, 0.7, 1.0, 1.5, 1.7, 2.0] if kind == "Resize" else [1.0, 1.5, 2.0, 3.0]
        scales = np.array([1, 1] + draw(st.lists(st.sampled_from(pick), min_size=2, max_size=2)),
                          np.float32)
        mode = draw(st.sampled_from(["nearest", "linear"]))
        node = helper.make_node(kind, ["x", "scales"], ["y"], mode=mode)
        inits = [numpy_helper.from_array(scales, "scales")]
        return [node], inits, [1, 2, 5, 7], 10 if kind == "Resize" else 9
    rank = draw(st.integers(2, 4))
    axis = draw(st.integers(-rank, rank - 1))
    shape = [2, 3, 4, 3][:rank]
    if kind == "Slice":
        node = helper.make_node(kind, ["x"], ["y"], starts=[1], ends=[draw(st.integers(-1, 3))],
                                axes=[axis])
    elif kind == "Pad":
        node = helper.make_node(kind, ["x"], ["y"], pads=[0, 1] * rank,
                                mode=draw(st.sampled_from(["constant", "reflect", "edge"])))
    elif kind == "ReduceSum":
        node = helper.make_node(kind, ["x"], ["y"], axes=[axis], keepdims=draw(st.integers(0, 1)))
    elif kind == "Clip":
        node = helper.make_node(kind, ["x"], ["y"], min=3.0, max=9.0)
    elif kind == "Squeeze":
        shape[axis] = 1
        node = helper.make_node(kind, ["x"], ["y"], axes=[axis])
    else:
        node = helper.make_node(kind, ["x"], ["y"], axis=axis)
    return [node], [], shape, 9 if kind in ("Slice", "Pad", "Clip") else draw(
        st.sampled_from([11, 12]))


def _old_model(case, ir_version):
    nodes, inits, shape, opset = case
    inputs = [helper.make_tensor_value_info("x", TP.FLOAT, shape)]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in inits]
    g = helper.make_graph(nodes, "g", inputs if ir_version < 4 else inputs[:1],
                          [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=ir_version)  # (IR 3: initializers are inputs too)


def _pad2(mode):
    return [helper.make_node("Pad", ["x"], ["y"], pads=[0, 1, 0, 1], mode=mode)], [], [2, 3], 9


def _resize10():
    scales = numpy_helper.from_array(np.array([1, 1, 2, 1.5], np.float32), "scales")
    return [helper.make_node("Resize", ["x", "scales"], ["y"], mode="linear")], [scales], \
        [1, 2, 5, 7], 10


@settings(max_examples=100, deadline=None, derandomize=True)
@given(old_ops(), st.sampled_from([3, 6]), st.integers(0, 2**16))
@example(_pad2("constant"), 3, 0)  # an invalid model
@example(_pad2("reflect"), 3, 0)  # upgraded again to 16 for the rule: ConvertError
def test_an_upgrade_keeps_the_forward(case, ir_version, seed):
    """gradients() upgrades models below opset 13 with onnx's version converter; the returned
    model must compute what the input model computes on onnxruntime. Resize-10 came out with
    half_pixel coordinates and Hardmax-11/12 one-hot along axis alone: other functions, and
    their gradients, silently. At IR 3 (the model zoo's opset 3 to 9 models) the converter's
    Pad adapter added its pads as an initializer that is no graph input: an invalid model
    (or, upgraded again for a rule, onnx's raw ConvertError)."""
    from onnxgrad.runtime import session
    shape, m = case[2], _old_model(case, ir_version)
    # distinct values: no ties for Hardmax
    x = np.random.default_rng(seed).permutation(np.prod(shape)).reshape(shape).astype(np.float32)
    want = session(m).run(["y"], {"x": x})[0]
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    y, dx = session(res.model).run(["y", res.grads[0]], {"x": x})
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    assert dx.shape == x.shape


def test_resize_10_nearest_with_run_time_scales_is_refused():
    g = helper.make_graph([helper.make_node("Resize", ["x", "s"], ["y"], mode="nearest")], "g",
                          [helper.make_tensor_value_info("x", TP.FLOAT, [1, 1, 4, 4]),
                           helper.make_tensor_value_info("s", TP.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 10)], ir_version=6)
    with pytest.raises(onnxgrad.UnsupportedError, match="Resize-10 .* run time"):
        onnxgrad.gradients(m, "y", "x")


def test_hardmax_11_in_a_subgraph_and_its_parent_keep_their_forward():
    """A graph rewritten (its Hardmax made 2-D) copies its nodes: the subgraphs are fixed first."""
    from onnxgrad.runtime import session

    def branch(name):
        return helper.make_graph([helper.make_node("Hardmax", ["h"], [f"{name}_o"], axis=1)],
                                 name, [], [helper.make_tensor_value_info(f"{name}_o", TP.FLOAT,
                                                                          [2, 3, 4])])
    nodes = [helper.make_node("Hardmax", ["x"], ["h"], axis=1),
             helper.make_node("If", ["c"], ["o"], then_branch=branch("t"), else_branch=branch("e")),
             helper.make_node("Mul", ["o", "x"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3, 4]),
                                       helper.make_tensor_value_info("c", TP.BOOL, [])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [2, 3, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)
    feeds = {"x": np.random.default_rng(1).permutation(24).reshape(2, 3, 4).astype(np.float32),
             "c": np.array(True)}
    res = onnxgrad.gradients(m, "y", "x")
    np.testing.assert_array_equal(session(res.model).run(["y"], feeds)[0],
                                  session(m).run(["y"], feeds)[0])


def test_an_upgrade_the_converter_cannot_make_is_a_clear_refusal():
    """BatchNormalization-7 with spatial=0 tripped an assertion inside onnx's converter: a raw
    RuntimeError reached the user."""
    g = helper.make_graph([helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"],
                                            ["y"], spatial=0)], "g",
                          [helper.make_tensor_value_info(k, TP.FLOAT, [3, 2, 4] if k == "x"
                                                         else [2, 4]) for k in "xsbmv"],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [3, 2, 4])],
                          [numpy_helper.from_array(np.ones((2, 4), np.float32), k)
                           for k in "sbmv"])  # (IR 3: initializers are graph inputs too)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 7)], ir_version=3)
    with pytest.raises(onnxgrad.UnsupportedError, match="version converter cannot upgrade .* "
                       "spatial"):
        onnxgrad.gradients(m, "y", "x")


@st.composite
def legacy_broadcast(draw):
    """(op, opset, A's shape, B's shape, axis, B given): a broadcast of opsets 1 to 6, B aligned
    with A's dims from ``axis`` (ones among B's dims allowed); A's batch dim symbolic."""
    op = draw(st.sampled_from(["Add", "Sub", "Mul", "Div", "Pow"]))
    opset = 1 if op == "Pow" else draw(st.sampled_from([1, 5, 6]))
    a = [2, 3, 4, 5][:draw(st.integers(1, 4))]
    rb = draw(st.integers(1, len(a)))
    axis = draw(st.integers(0, len(a) - rb))
    b = [d if draw(st.booleans()) else 1 for d in a[axis:axis + rb]]
    return op, opset, a, b, axis, draw(st.booleans())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(legacy_broadcast(), st.sampled_from([3, 6]), st.integers(0, 2**16))
@example(("Add", 6, [2, 3, 4, 5], [3], 1, True), 3, 0)  # Caffe2's per-channel bias
@example(("Mul", 5, [2, 3, 4, 5], [3, 4], 1, False), 3, 0)
def test_legacy_axis_broadcasts_upgrade(case, ir_version, seed):
    """onnx's converter asserted on ``Op(A, B, broadcast=1, axis=k)`` with B aligned inside A
    (a per-channel bias): the model was refused. Now its forward is the legacy one and its
    gradients are checked against float64 central differences."""
    from onnxgrad.runtime import session
    op, opset, a_shape, b_shape, axis, given_b = case
    rng = np.random.default_rng(seed)
    b = rng.uniform(0.5, 1.5, b_shape)
    inputs = [helper.make_tensor_value_info("a", TP.FLOAT, ["N", *a_shape[1:]]),
              helper.make_tensor_value_info("b", TP.FLOAT, b_shape)]
    inits = [] if given_b else [numpy_helper.from_array(b.astype(np.float32), "b")]
    if ir_version > 3 and not given_b:
        del inputs[1:]
    g = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"], broadcast=1, axis=axis)],
                          "g", inputs, [helper.make_tensor_value_info("y", TP.FLOAT, None)],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                          ir_version=ir_version)
    xs = ["a", "b"] if given_b else ["a"]
    res = onnxgrad.gradients(m, "y", xs)
    onnx.checker.check_model(res.model, full_check=True)
    a = rng.uniform(0.5, 1.5, a_shape)
    legacy = getattr(np, {"Sub": "subtract", "Mul": "multiply", "Div": "divide",
                          "Pow": "power"}.get(op, "add"))(
        a, b.reshape(b_shape + [1] * (len(a_shape) - axis - len(b_shape))))
    feeds = {"a": a.astype(np.float32), **({"b": b.astype(np.float32)} if given_b else {})}
    y = session(res.model).run(["y"], feeds)[0]
    np.testing.assert_allclose(y, legacy, rtol=1e-5)
    report = check_gradients(m, "y", xs, {k: v.astype(np.float64) for k, v in feeds.items()})
    assert report.ok, str(report)


def _caffe2_era(opset, rng):
    """Conv -> Add(bias, broadcast=1, axis=1) -> Relu -> MaxPool -> Flatten -> Gemm(broadcast=1)
    -> Mul(scalar, broadcast=1) = y, and Greater(gemm, scalar, broadcast=1) = flag; batch N."""
    arrays = {"W": rng.standard_normal((4, 3, 3, 3)) * 0.3, "B": rng.standard_normal(4),
              "G": rng.standard_normal((16, 5)) * 0.3, "C": rng.standard_normal(5),
              "S": np.array([1.5])}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()]
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Add", ["c", "B"], ["cb"], broadcast=1, axis=1),
             helper.make_node("Relu", ["cb"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["p"], ["f"], axis=1),
             helper.make_node("Gemm", ["f", "G", "C"], ["gm"], broadcast=1),
             helper.make_node("Mul", ["gm", "S"], ["y"], broadcast=1),
             helper.make_node("Greater", ["gm", "S"], ["flag"], broadcast=1)]
    inputs = [helper.make_tensor_value_info("x", TP.FLOAT, ["N", 3, 4, 4])]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in inits]
    g = helper.make_graph(nodes, "caffe2_era", inputs,
                          [helper.make_tensor_value_info("y", TP.FLOAT, ["N", 5]),
                           helper.make_tensor_value_info("flag", TP.BOOL, ["N", 5])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=3), arrays


@pytest.mark.parametrize("opset", [1, 3, 5, 6])
def test_a_caffe2_era_network_upgrades(opset):
    """Caffe2-era models (the model zoo's opsets 1 to 6) with a symbolic batch: every broadcast
    (the per-channel bias at axis 1, Gemm's, the comparison's, which onnx's converter has no
    adapter for) was refused. Now y, flag and every gradient are torch's."""
    import torch
    from onnxgrad.runtime import session
    rng = np.random.default_rng(opset)
    m, arrays = _caffe2_era(opset, rng)
    before = m.SerializeToString()
    res = onnxgrad.gradients(m, "y", ["x", *arrays])
    assert m.SerializeToString() == before
    onnx.checker.check_model(res.model, full_check=True)
    x = rng.standard_normal((3, 3, 4, 4))
    t = {k: torch.tensor(v.astype(np.float32), requires_grad=True)
         for k, v in {"x": x, **arrays}.items()}
    f = torch.nn.functional
    gm = f.max_pool2d(f.conv2d(t["x"], t["W"], t["B"], padding=1).relu(), 2).flatten(1) \
        @ t["G"] + t["C"]
    (gm * t["S"]).sum().backward()
    got = session(res.model).run(None, {"x": x.astype(np.float32)})
    outs = [o.name for o in res.model.graph.output]
    np.testing.assert_allclose(got[0], (gm * t["S"]).detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[1], (gm > t["S"]).numpy())
    for k, v in zip(outs[2:], got[2:]):
        name = k.split("/")[-1].removesuffix("_grad")
        np.testing.assert_allclose(v, t[name].grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)
    report = check_gradients(m, "y", ["x", *arrays], {"x": x})
    assert report.ok, str(report)


@pytest.mark.parametrize("opset", [1, 3, 5, 6])
@pytest.mark.parametrize("first", ["Relu", "Mul", "Sub"])
def test_legacy_broadcasts_after_ops_inference_leaves_unranked(opset, first):
    """(Found reviewing the upgrade.) Before opset 6 onnx's inference gives a legacy broadcast's
    or a consumed_inputs op's output no rank, so an Add at axis 1 after one was refused ("ranks
    ... onnx's shape inference does not tell") though every input was declared: such outputs
    take input 0's rank now. Checked against the legacy forward and float64 differences."""
    from onnxgrad.runtime import session
    rng = np.random.default_rng(opset)
    b = rng.uniform(0.5, 1.5, 3)
    one = [helper.make_node("Relu", ["a"], ["h"], **({"consumed_inputs": [0]} if opset < 6
                                                     else {}))] if first == "Relu" else \
        [helper.make_node(first, ["a", "b"], ["h"], broadcast=1, axis=1)]
    nodes = one + [helper.make_node("Add", ["h", "b"], ["y"], broadcast=1, axis=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TP.FLOAT, [2, 3, 4]),
                                       helper.make_tensor_value_info("b", TP.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, None)],
                          [numpy_helper.from_array(b.astype(np.float32), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=3)
    res = onnxgrad.gradients(m, "y", "a")
    onnx.checker.check_model(res.model, full_check=True)
    a = rng.uniform(-1, 1, (2, 3, 4))
    bb = b.reshape(3, 1)
    h = {"Relu": np.maximum(a, 0), "Mul": a * bb, "Sub": a - bb}[first]
    y = session(res.model).run(["y"], {"a": a.astype(np.float32)})[0]
    np.testing.assert_allclose(y, h + bb, rtol=1e-5, atol=1e-6)
    report = check_gradients(m, "y", ["a"], {"a": a})
    assert report.ok, str(report)


def test_check_gradients_of_ir3_initializers():
    """(Found reviewing the IR rules.) An IR-3 model's initializers are graph inputs onnxruntime
    takes no value for: check_gradients with one of them in xs failed with onnxruntime's
    "Invalid input name: W". The check runs the model as IR 4, where they are defaults."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 2)), "W"),
             numpy_helper.from_array(rng.standard_normal(2), "b")]
    g = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["P"]),
                           helper.make_node("Add", ["P", "b"], ["Q"]),
                           helper.make_node("Tanh", ["Q"], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TP.DOUBLE, [3, 4]),
                           helper.make_tensor_value_info("W", TP.DOUBLE, [4, 2]),
                           helper.make_tensor_value_info("b", TP.DOUBLE, [2])],
                          [helper.make_tensor_value_info("Y", TP.DOUBLE, [3, 2])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 8)], ir_version=3)
    for xs, feeds in ((["W"], None), (["W", "b"], {"X": rng.standard_normal((3, 4))})):
        report = check_gradients(m, "Y", xs, feeds)
        assert report.ok, str(report)


# -- check_gradients' float64 oracle at old opsets ------------------------------------------------
@st.composite
def old_softmax(draw):
    """(nodes, initializers, input shape, opset): Softmax, LogSoftmax or Hardmax at an opset
    before 13 (2-D coercion at axis; negative axes from 11)."""
    op = draw(st.sampled_from(["Softmax", "LogSoftmax", "Hardmax"]))
    opset = draw(st.sampled_from([1, 6, 7, 9, 11, 12]))
    rank = draw(st.integers(2, 4))
    axis = draw(st.integers(-rank if opset >= 11 else 0, rank - 1))
    return [helper.make_node(op, ["x"], ["y"], axis=axis)], [], [2, 3, 4, 3][:rank], opset


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.one_of(old_ops(), old_softmax()), st.sampled_from(["ort", "reference"]),
       st.integers(0, 2**16))
@example(([helper.make_node("Softmax", ["x"], ["y"], axis=1)], [], [2, 3, 4], 11), "reference", 0)
@example(_resize10(), "ort", 0)  # (no float64 Resize in onnxruntime: onnx.reference ran it)
def test_check_gradients_at_old_opsets(case, runtime, seed):
    """check_gradients' finite differences run the model as it is, in float64: on onnxruntime,
    which lacks float64 kernels for some ops (Resize), and on onnx.reference where it does not
    run them, which computes Softmax-11 along ``axis`` alone and Resize-10 with half-pixel
    coordinates (the newest definitions) and fails on Upsample: a correct gradient was
    reported FAIL, or the check raised onnx.reference's own error."""
    shape, m = case[2], _old_model(case, 3)
    rng = np.random.default_rng(seed)  # distinct values off the integers: no ties, no Clip kink
    x = rng.permutation(np.prod(shape)).reshape(shape) + rng.uniform(0.2, 0.8)
    report = check_gradients(m, "y", ["x"], {"x": x}, runtime=runtime)
    assert report.ok, str(report)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.sampled_from([1, 2]), st.integers(-2, 1), st.sampled_from(["ort", "reference"]),
       st.integers(0, 2**16))
@example(1, -1, "reference", 0)
def test_check_gradients_of_lp_normalization(p, axis, runtime, seed):
    """onnx.reference's LpNormalization p=1 divides by sum(x), not sum(|x|): mixed signs made
    the reference path report a correct gradient FAIL."""
    g = helper.make_graph([helper.make_node("LpNormalization", ["x"], ["y"], p=p, axis=axis)],
                          "g", [helper.make_tensor_value_info("x", TP.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    x = np.random.default_rng(seed).uniform(0.5, 2, (3, 4)) * np.array([1, -1, 1, -1])
    report = check_gradients(m, "y", ["x"], {"x": x}, runtime=runtime)
    assert report.ok, str(report)


# -- training steps of models at old opsets -------------------------------------------------------
def _mlp(opset, ir_version, seed):
    """x [N, 4] -> Pad (zero pads, Pad-2 below 11) -> Gemm -> Relu -> Gemm -> y [N, 3]."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("W1", (4, 5)), ("B1", (5,)), ("W2", (5, 3)), ("B2", (3,)))]
    pad = helper.make_node("Pad", ["x"], ["xp"], pads=[0, 0, 0, 0]) if opset < 11 else \
        helper.make_node("Pad", ["x", "pads"], ["xp"])
    if opset >= 11:
        inits.append(numpy_helper.from_array(np.zeros(4, np.int64), "pads"))
    legacy = {"broadcast": 1} if opset < 7 else {}  # (C of another shape than Y)
    nodes = [pad, helper.make_node("Gemm", ["xp", "W1", "B1"], ["h"], **legacy),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "W2", "B2"], ["y"], **legacy)]
    inputs = [helper.make_tensor_value_info("x", TP.FLOAT, ["N", 4])]
    if ir_version < 4:
        inputs += [helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in inits]
    g = helper.make_graph(nodes, "mlp", inputs, [helper.make_tensor_value_info("y", TP.FLOAT,
                                                                               ["N", 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=ir_version)


@settings(max_examples=28, deadline=None, derandomize=True)
@given(st.sampled_from([6, 7, 8, 9, 10, 11, 12]), st.sampled_from([3, 7]),
       st.sampled_from(["mse", "l1", "bce", "cross_entropy"]), st.booleans(),
       st.integers(0, 2**16))
@example(7, 3, "mse", False, 0)  # the loss's target check (a Where) in an opset-7 model
@example(6, 3, "cross_entropy", False, 0)  # Gemm-6's broadcast with a batch N
def test_old_opsets_train_as_their_opset_13_twin(opset, ir_version, loss, sgd, seed):
    """A training step of a model at an old opset (and the IR the model zoo's have) is the step
    of the same network written at opset 13: the mse, l1 and bce losses wrote their target
    check's Where (opset 9) into opset 7 and 8 models, refused as "not valid ONNX"."""
    from onnxgrad.runtime import session
    from onnxgrad.training import SGD, AdamW, attach_loss, build_train_step
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    target = rng.integers(0, 3, 6) if loss == "cross_entropy" else \
        rng.uniform(0, 1, (6, 3)).astype(np.float32)
    outs = []
    for m in (_mlp(opset, ir_version, seed), _mlp(13, 8, seed)):
        step = build_train_step(attach_loss(m, loss), "loss",
                                optimizer=SGD(lr=0.1) if sgd else AdamW(lr=0.1))
        onnx.checker.check_model(step.model, full_check=True)
        feeds = {"x": x, "target": target, "lr": np.array(0.1), "step": np.array(1),
                 **step.initial_params, **step.initial_state()}
        outs.append(session(step.model).run(None, feeds))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# -- rules that need newer opsets than the model's, several in one model -------------------------
def _needy(kind, i, x):
    """Nodes taking ``x`` [N, 5, 5] to a tensor of that shape whose gradient rule needs a newer
    opset than 13: (nodes, initializers, output, the opset the rule needs)."""
    rng = np.random.default_rng(i)
    if kind == "pad_reflect":  # the gradient's ScatterElements(reduction="add"): 16
        pads = numpy_helper.from_array(np.array([0, 0, 1, 0, 0, 2], np.int64), f"pads{i}")
        lo, hi = (numpy_helper.from_array(np.array(v, np.int64), f"{k}{i}")
                  for k, v in (("lo", [1]), ("hi", [6])))
        nodes = [helper.make_node("Pad", [x, pads.name], [f"p{i}"], mode="reflect"),
                 helper.make_node("Slice", [f"p{i}", lo.name, hi.name, f"ax{i}"], [f"o{i}"])]
        return nodes, [pads, lo, hi, numpy_helper.from_array(np.array([2], np.int64),
                                                             f"ax{i}")], f"o{i}", 16
    if kind in ("gru", "gru_clip", "lstm"):  # the RNN function bodies: 14; with a clip: 16
        gates = 4 if kind == "lstm" else 3
        w, r = (numpy_helper.from_array((rng.standard_normal(s) * 0.4).astype(np.float32),
                                        f"{k}{i}") for k, s in (("W", (1, 5 * gates, 5)),
                                                                ("R", (1, 5 * gates, 5))))
        attrs = dict(clip=5.0) if kind == "gru_clip" else {}
        one = numpy_helper.from_array(np.array([1], np.int64), f"one{i}")
        if kind == "lstm":  # over axis 0 of x itself (a rank onnx may not know): [N, 1, 5, 5]
            nodes = [helper.make_node("LSTM", [x, w.name, r.name], [f"y{i}"], hidden_size=5),
                     helper.make_node("Squeeze", [f"y{i}", one.name], [f"o{i}"])]
            return nodes, [w, r, one], f"o{i}", 14
        nodes = [helper.make_node("Transpose", [x], [f"t{i}"], perm=[1, 0, 2]),
                 helper.make_node("GRU", [f"t{i}", w.name, r.name], [f"y{i}"], hidden_size=5,
                                  **attrs),
                 helper.make_node("Squeeze", [f"y{i}", f"one{i}"], [f"s{i}"]),
                 helper.make_node("Transpose", [f"s{i}"], [f"o{i}"], perm=[1, 0, 2])]
        return nodes, [w, r, one], f"o{i}", 16 if attrs else 14
    # sequences: the rules' SequenceMap, 17
    nodes = [helper.make_node("SplitToSequence", [x], [f"q{i}"], axis=1),
             helper.make_node("ConcatFromSequence", [f"q{i}"], [f"c{i}"], axis=1),
             helper.make_node("Tanh", [f"c{i}"], [f"o{i}"])]
    return nodes, [], f"o{i}", 17


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.sampled_from([13, 14, 15]),
       st.lists(st.sampled_from(["pad_reflect", "gru", "gru_clip", "lstm", "sequence"]),
                min_size=1, max_size=3), st.integers(0, 2**16))
@example(13, ["pad_reflect", "gru"], 0)  # the GRU's rule (after the Pad) raised first
@example(15, ["gru_clip"], 0)
@example(15, ["sequence", "gru"], 0)  # a GRU's input of a rank onnx cannot infer
@example(14, ["sequence", "lstm"], 0)
def test_rules_needing_several_newer_opsets(opset, kinds, seed):
    """A model below the opsets its gradient rules need is upgraded until every rule has its
    own: a GRU's rule (14) after a reflect Pad's (16) upgraded the model once, to 14, and the
    Pad's need then reached the user as onnxgrad's internal NeedOpset exception. A clipped
    GRU's rule asked for 15 (CastLike), where onnxruntime refused the gradient's Scan ("must
    have the shape set for all outputs"), as it did for any RNN whose input's rank onnx's
    inference cannot tell (a ConcatFromSequence's output), at every opset."""
    x, nodes, inits, need = "x", [], [], opset
    for i, kind in enumerate(kinds):
        more, values, x, version = _needy(kind, i, x)
        nodes += more
        inits += values
        need = max(need, version)
    if kinds[-1] == "lstm":  # its Y itself the output: the backward's cotangent of a rank the
        x = nodes.pop().input[0]  # caller's inference may not know
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["N", 5, 5])],
                          [helper.make_tensor_value_info(x, TP.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    res = onnxgrad.gradients(m, x, "x")
    assert res.model.opset_import[0].version == need
    x0 = np.random.default_rng(seed).standard_normal((2, 5, 5))
    report = check_gradients(m, x, ["x"], {"x": x0})
    assert report.ok, str(report)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(opset=st.sampled_from([7, 8, 9]), mode=st.sampled_from(["nearest", "linear"]),
       scales=st.sampled_from([[1, 1, 2, 2], [1, 1, 1, 3], [1, 1, 2, 1]]),
       consumed=st.booleans(), seed=st.integers(0, 20))
def test_upsample_read_by_another_node_keeps_its_coordinates(opset, mode, scales, consumed,
                                                             seed):
    """onnx's adapter makes Upsample a Resize and renames its output unless it is a graph
    output; the asymmetric fix-up was keyed by the old name, so an Upsample read by another
    node (every decoder's) became a half_pixel Resize: another forward and gradient, silently,
    and its name was gone from the model. y = Upsample(x) * w is linear in x and w: the
    gradients are exact differences of onnxruntime's forward of the input model."""
    from onnxgrad.runtime import run
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 1, 2, 3)).astype(np.float32)
    out = [int(d * s) for d, s in zip(x.shape, scales)]
    w = rng.standard_normal(out).astype(np.float32)
    f = np.array(scales, np.float32)
    up = (helper.make_node("Upsample", ["x", "sc"], ["up"], mode=mode) if opset == 9 else
          helper.make_node("Upsample", ["x"], ["up"], mode=mode, scales=f.tolist()))
    nodes = [up, helper.make_node("Mul", ["up", "w"], ["y"])] if consumed else [up]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, x.shape),
                                       helper.make_tensor_value_info("w", TP.FLOAT, out)],
                          [helper.make_tensor_value_info("y" if consumed else "up", TP.FLOAT,
                                                         out)],
                          [numpy_helper.from_array(f, "sc")] if opset == 9 else [])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=4)
    y = "y" if consumed else "up"
    feeds = {"x": x, "w": w}
    res = onnxgrad.gradients(m, y, ["x", "up"], grad_ys=["gy"])
    gy = w if not consumed else np.ones_like(w)
    got = run(res.model, {**feeds, "gy": gy}, [y, *res.grads])
    want_y = run(m, feeds, [y])[0]
    np.testing.assert_array_equal(got[0], want_y)

    def total(xx):
        return float((run(m, {**feeds, "x": xx}, [y])[0].astype(np.float64) * gy).sum())
    np.testing.assert_allclose(got[1], central_differences(total, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2], gy * (w if consumed else 1), rtol=1e-6)


@pytest.mark.parametrize("opset", [11, 13])
def test_training_batchnorm_with_an_overlapping_pool_upgrades(opset):
    """A ResNet stem exported in training mode below opset 14 (BatchNormalization with its
    saved mean and variance, unread) and an overlapping MaxPool, whose rule upgrades the model
    to 16: onnx's adapter asserted on outputs 4 and 5 (refused), and kept the statistics
    outputs without training_mode (onnxruntime refused the node). Trains as torch does."""
    import io
    import warnings
    torch = pytest.importorskip("torch")
    from onnxgrad.training import SGD, Trainer
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                              torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 4 * 4, 3))
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net.train(), (torch.randn(2, 3, 8, 8),), f,
                          dynamo=False, opset_version=opset, do_constant_folding=False,
                          training=torch.onnx.TrainingMode.TRAINING, input_names=["x"],
                          dynamic_axes={"x": {0: "N"}})
    m = onnx.load_from_string(f.getvalue())
    init = {t.name: numpy_helper.to_array(t).copy() for t in m.graph.initializer}
    net.load_state_dict({k: torch.tensor(init[k]) if k in init else v
                         for k, v in net.state_dict().items()})
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 3, 4))
               for _ in range(3)]
    tr = Trainer(m, "cross_entropy", optimizer=SGD(lr=0.1), device="cpu", progress=False,
                 threads=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, t in batches:
        tr.step({"x": x, "target": t})
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(t)).backward()
        opt.step()
    got = tr.parameters()
    for k, v in net.named_parameters():
        np.testing.assert_allclose(got[k], v.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(tr.statistics()["1.running_mean"], net[1].running_mean.numpy(),
                               rtol=1e-4, atol=1e-6)


def test_an_opset_10_upsample_leaves_the_models_own_resize_alone():
    """At opset 10 onnx's adapter keeps an Upsample as it is: the Upsample fix-up, matching the
    graph's Resizes with its Upsamples in order, took the model's own Resize for one, renamed
    its output after the Upsample's (two producers of one name, the Resize's readers left
    reading nothing). Only Resizes the adapter made are the Upsamples'."""
    from onnxgrad.versions import convert_version
    g = helper.make_graph(
        [helper.make_node("Upsample", ["x", "sc"], ["u"], mode="linear"),
         helper.make_node("Resize", ["u", "sc"], ["r"], mode="linear"),
         helper.make_node("Neg", ["r"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [1, 1, 2, 3])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)],
        [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "sc")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 10)], ir_version=6)
    out = convert_version(m, 13)
    made = [o for n in out.graph.node for o in n.output]
    assert len(made) == len(set(made))
    resize = next(n for n in out.graph.node if n.op_type == "Resize")
    assert list(resize.output) == ["r"] and resize.input[0] == "u"
