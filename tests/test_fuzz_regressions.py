"""Focused regressions for what the gradient fuzzer (tests/test_fuzz.py, bench/fuzz.py) found,
one test per class, each fixed at its root."""
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnxgrad
from onnxgrad.runtime import ort_module, session, session_options
from onnxgrad.check import check_gradients
from util import assert_gradients, op_model


# a static element count of zero (an empty input) divided by: ReduceMean, GlobalAveragePool and
# the mean losses raised ZeroDivisionError while building; the gradient of an empty x is empty.
# onnxruntime runs the empty ReduceMean; it refuses the other two forwards themselves (zero
# spatial size; a Reshape with -1 over zero elements), so those are built and checked only
@pytest.mark.parametrize("shape,attrs,inits", [
    ([2, 0, 3], {"keepdims": 0}, {"axes": np.array([1])}),
    ([0, 3], {}, {}),
])
def test_empty_reduce_mean(shape, attrs, inits):
    m = op_model("ReduceMean", {"x": (np.float32, shape)}, inits=inits, **attrs)
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    (g,) = session(res.model).run(res.grads, {"x": np.zeros(shape, np.float32)})
    assert g.shape == tuple(shape)


@pytest.mark.parametrize("op,inputs", [
    ("GlobalAveragePool", {"x": (np.float32, [2, 3, 0])}),
    ("SoftmaxCrossEntropyLoss", {"x": (np.float32, [0, 3]), "labels": (np.int64, [0])}),
])
def test_empty_mean_builds(op, inputs):
    m = op_model(op, inputs)
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    grad = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(res.model).graph.output}
    dims = grad[res.grads[0]].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == inputs["x"][1]


# onnx 1.23 infers STFT's output without onesided as two-sided ([.., 16, ..] here: the runtime
# gives 9). onnxgrad writes the default onesided=1 out, so that the checker infers the result
# right; the dims a model declares downstream (inferred by onnx with the wrong default) failed
# the checker against it, and with them left undeclared, the shapes onnxgrad inferred did
def _stft_model(value_info, **attrs):
    nodes = [onnx.helper.make_node("STFT", ["x", "step", "", "length"], ["s"], **attrs),
             onnx.helper.make_node("Mul", ["s", "s"], ["y"])]
    g = onnx.helper.make_graph(
        nodes, "stft", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE,
                                                           [1, 32, 1])],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.DOUBLE, list("abcd"))
         for n in ("y", "s")],
        [onnx.numpy_helper.from_array(np.array(8), "step"),
         onnx.numpy_helper.from_array(np.array(16), "length")])
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 21)],
                               ir_version=10)
    return onnx.shape_inference.infer_shapes(m) if value_info else m


@pytest.mark.parametrize("value_info", [False, True])
@pytest.mark.parametrize("xs", [["x"], ["s"], ["x", "s"]])
def test_stft_without_onesided(value_info, xs):
    m = _stft_model(value_info)
    onnx.checker.check_model(m, full_check=True)
    if value_info:  # onnx's own (wrong) inference, declared
        assert [d.dim_value for d in m.graph.output[1].type.tensor_type.shape.dim][2] == 16
    res = onnxgrad.gradients(m, "y", xs)
    onnx.checker.check_model(res.model, full_check=True)
    explicit = _stft_model(False, onesided=1)  # the same op: onesided defaults to 1
    assert_gradients(explicit, "y", "x")
    want = onnxgrad.gradients(explicit, "y", xs)
    x = {"x": np.random.default_rng(0).standard_normal((1, 32, 1))}
    for got, ref in zip(session(res.model).run(res.grads, x),
                        session(want.model).run(want.grads, x)):
        np.testing.assert_allclose(got, ref, rtol=1e-12)


# AffineGrid's rule refused a theta of symbolic shape (it told 2-D from 3-D by theta's rows);
# size's length, or the grid's rank, tells as well
@pytest.mark.parametrize("size", [[2, 1, 3, 4], [1, 1, 2, 3, 2]])
def test_affine_grid_symbolic_theta(size):
    k = len(size) - 2
    node = onnx.helper.make_node("AffineGrid", ["theta", "size"], ["y"], align_corners=0)
    g = onnx.helper.make_graph(
        [node], "affine",
        [onnx.helper.make_tensor_value_info("theta", onnx.TensorProto.DOUBLE, ["n", "r", "c"])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)],
        [onnx.numpy_helper.from_array(np.array(size), "size")])
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 20)],
                               ir_version=10)
    theta = np.random.default_rng(k).standard_normal((size[0], k, k + 1))
    assert_gradients(m, "y", "theta", {"theta": theta})


# the second-order gradient of a Scan whose body reads an outer tensor of symbolic shape: the
# backward bodies' outputs had no shapes, and onnxruntime runs no Scan whose body outputs lack
# them ("Subgraph must have the shape set for all outputs"); they take the shapes of the
# values they are the gradients of
def test_second_order_scan_with_symbolic_capture():
    h = onnx.helper
    dbl = onnx.TensorProto.DOUBLE
    body = h.make_graph(
        [h.make_node("Mul", ["s_in", "x"], ["a"]), h.make_node("Mul", ["x", "w"], ["b"]),
         h.make_node("Tanh", ["b"], ["c"]), h.make_node("Add", ["a", "c"], ["s_out"]),
         h.make_node("Mul", ["s_out", "x"], ["y_t"])], "body",
        [h.make_tensor_value_info("s_in", dbl, [3]), h.make_tensor_value_info("x", dbl, [3])],
        [h.make_tensor_value_info("s_out", dbl, [3]), h.make_tensor_value_info("y_t", dbl, [3])])
    scan = h.make_node("Scan", ["s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1)
    g = h.make_graph([scan], "scan",
                     [h.make_tensor_value_info("s0", dbl, [3]),
                      h.make_tensor_value_info("xs", dbl, [4, 3]),
                      h.make_tensor_value_info("w", dbl, ["k"])],
                     [h.make_tensor_value_info(n, dbl, None) for n in ("s", "ys")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21)], ir_version=10)
    xs = ["s0", "xs", "w"]
    first = onnxgrad.gradients(m, ["s", "ys"], xs, grad_ys=["ds", "dys"])
    second = onnxgrad.gradients(first.model, first.grads, xs)
    onnx.checker.check_model(second.model, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {"s0": rng.standard_normal(3), "xs": rng.standard_normal((4, 3)),
             "w": rng.standard_normal(3), "ds": rng.standard_normal(3),
             "dys": rng.standard_normal((4, 3))}
    session(second.model).run(second.grads, feeds)
    assert check_gradients(first.model, first.grads, xs, feeds).ok


# onnx's inference drops the shape of every loop-carried output (it may change between
# iterations; onnxgrad refuses a Loop where it does), so a carried output taken as an x with
# "zero" had no rank to declare its gradient with; it takes its initial value's rank
def test_loop_carried_output_keeps_its_rank():
    h = onnx.helper
    dbl = onnx.TensorProto.DOUBLE
    body = h.make_graph(
        [h.make_node("Identity", ["c_in"], ["c_out"]), h.make_node("Mul", ["v_in", "w"], ["m"]),
         h.make_node("Tanh", ["m"], ["v_out"]), h.make_node("Mul", ["v_out", "w"], ["scan"])],
        "body", [h.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
                 h.make_tensor_value_info("c_in", onnx.TensorProto.BOOL, []),
                 h.make_tensor_value_info("v_in", dbl, [2, 3])],
        [h.make_tensor_value_info("c_out", onnx.TensorProto.BOOL, []),
         h.make_tensor_value_info("v_out", dbl, [2, 3]),
         h.make_tensor_value_info("scan", dbl, [2, 3])])
    loop = h.make_node("Loop", ["trips", "cond", "v0"], ["v", "scans"], body=body)
    g = h.make_graph([loop], "loop", [h.make_tensor_value_info("v0", dbl, [2, 3]),
                                      h.make_tensor_value_info("w", dbl, [2, 3])],
                     [h.make_tensor_value_info("scans", dbl, None)],
                     [onnx.numpy_helper.from_array(np.array(3), "trips"),
                      onnx.numpy_helper.from_array(np.array(True), "cond")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21)], ir_version=10)
    res = onnxgrad.gradients(m, "scans", ["v", "v0"], unconnected_gradients="zero")
    onnx.checker.check_model(res.model, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {"v0": rng.standard_normal((2, 3)), "w": rng.standard_normal((2, 3))}
    dv, _ = session(res.model).run(res.grads, feeds)
    np.testing.assert_array_equal(dv, np.zeros((2, 3)))  # the scans do not depend on v
    assert_gradients(m, "scans", ["v0", "w"], feeds)


def _attention_model(v_shape, outputs=("y",), q_shape=(2, 4, 24), k_shape=(2, 6, 24)):
    h = onnx.helper
    dbl = onnx.TensorProto.DOUBLE
    node = h.make_node("Attention", ["q", "k", "v"], list(outputs), q_num_heads=3,
                       kv_num_heads=3)
    g = h.make_graph([node], "attention",
                     [h.make_tensor_value_info(n, dbl, list(s))
                      for n, s in (("q", q_shape), ("k", k_shape), ("v", v_shape))],
                     [h.make_tensor_value_info(o, dbl, None) for o in outputs])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 24)], ir_version=10)


# onnx's inference makes up dims of 0 for Attention outputs when some input dims are symbolic
# (the output's last dim with a symbolic V hidden size; qk_matmul_output's total sequence length
# with a symbolic V sequence and a past), and onnxruntime sized the gradient graph from them (a
# Reshape that fails at run time): refused, naming the output; with static hidden sizes (the
# realistic case) the gradient is exact
def test_attention_made_up_zero_dims_refused():
    with pytest.raises(onnxgrad.NotDifferentiableError, match=r"Attention output 'y' the shape"):
        onnxgrad.gradients(_attention_model(("b", "s", "h")), "y", "q")
    m = _attention_model(("b", "s", 24), q_shape=("b", 4, 24), k_shape=("b", "s", 24))
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((2, 4, 24)), "k": rng.standard_normal((2, 6, 24)),
             "v": rng.standard_normal((2, 6, 24))}
    assert_gradients(m, "y", ["q", "k", "v"], feeds)


# onnx leaves Attention's present_key/present_value untyped when dims are symbolic: the rank
# of everything computed from them was unknown, and rules that need a rank refused
def test_attention_present_outputs_have_their_rank():
    h = onnx.helper
    m = _attention_model(("b", 3, "s", 8), ("y", "pk", "pv"), q_shape=("b", 3, 4, 8),
                         k_shape=("b", 3, "s", 8))
    m.graph.node.append(h.make_node("CenterCropPad", ["pv", "crop"], ["z"]))
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([2, 3, 4, 6]), "crop"))
    m.graph.output.append(h.make_tensor_value_info("z", onnx.TensorProto.DOUBLE, None))
    rng = np.random.default_rng(1)
    feeds = {"q": rng.standard_normal((2, 3, 4, 8)), "k": rng.standard_normal((2, 3, 5, 8)),
             "v": rng.standard_normal((2, 3, 5, 8))}
    assert_gradients(m, "z", ["v"], feeds)


# ReduceL2's gradient x * g / ||x||, 0 where the norm is 0, divided by the norm itself inside
# Where: the second order took 0 * inf = NaN from the branch left out; it divides by a safe norm
@pytest.mark.parametrize("x", [np.zeros((2, 3)), np.zeros((2, 0))])
def test_reduce_l2_second_order_at_zero_norm(x):
    m = op_model("ReduceL2", {"x": (np.float64, list(x.shape))},
                 inits={"axes": np.array([1])}, keepdims=1)
    first = onnxgrad.gradients(m, "y", "x", grad_ys=["dy"])
    second = onnxgrad.gradients(first.model, first.grads, "dy")
    dy = np.random.default_rng(2).standard_normal((2, 1))
    (g,) = session(second.model).run(second.grads, {"x": x, "dy": dy})
    np.testing.assert_array_equal(g, np.zeros((2, 1)))  # d/d dy of sum(x * dy / ||x||) = 0


# the LSTM rule puts its forward op in place of the node and moved only the outputs something
# read: an unused Y_h named in xs (its "zero" gradient reads its shape) was left without a
# producer (a model that fails the checker); every named output moves now
def test_rnn_output_in_xs_keeps_its_producer():
    h = onnx.helper
    dbl = onnx.TensorProto.DOUBLE
    lstm = h.make_node("LSTM", ["x", "w", "r"], ["", "y_h", "y_c"], hidden_size=3,
                       direction="bidirectional")
    rng = np.random.default_rng(3)
    g = h.make_graph([lstm], "lstm", [h.make_tensor_value_info("x", dbl, [4, 2, 2])],
                     [h.make_tensor_value_info("y_c", dbl, None)],
                     [onnx.numpy_helper.from_array(rng.standard_normal((2, 12, 2)) * 0.5, "w"),
                      onnx.numpy_helper.from_array(rng.standard_normal((2, 12, 3)) * 0.5, "r")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21)], ir_version=10)
    res = onnxgrad.gradients(m, "y_c", ["y_h", "w"], unconnected_gradients="zero")
    onnx.checker.check_model(res.model, full_check=True)
    x = rng.standard_normal((4, 2, 2))
    dyh, dw = session(res.model).run(res.grads, {"x": x})
    np.testing.assert_array_equal(dyh, np.zeros((2, 2, 3)))
    alone = onnxgrad.gradients(m, "y_c", "w")  # checked against finite differences elsewhere
    np.testing.assert_allclose(dw, session(alone.model).run(alone.grads, {"x": x})[0],
                               rtol=1e-12)


# onnx gives STFT's output no shape when the signal's dims are symbolic, so an STFT output named
# in xs had no rank to declare its gradient with; it is always [batch, frames, bins, 2]
def test_stft_output_of_symbolic_signal_has_its_rank():
    h = onnx.helper
    dbl = onnx.TensorProto.DOUBLE
    g = h.make_graph([h.make_node("STFT", ["x", "step", "", "length"], ["s"], onesided=1),
                      h.make_node("Mul", ["s", "s"], ["y"]), h.make_node("Neg", ["x"], ["t"])],
                     "stft", [h.make_tensor_value_info("x", dbl, ["b", "n", 1])],
                     [h.make_tensor_value_info(o, dbl, None) for o in ("y", "t")],
                     [onnx.numpy_helper.from_array(np.array(8), "step"),
                      onnx.numpy_helper.from_array(np.array(16), "length")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21)], ir_version=10)
    res = onnxgrad.gradients(m, "y", ["s", "x"])
    onnx.checker.check_model(res.model, full_check=True)
    x = np.random.default_rng(4).standard_normal((1, 32, 1))
    ds, _ = session(res.model).run(res.grads, {"x": x})
    assert ds.ndim == 4
    assert_gradients(m, "y", "x", {"x": x})
    zero = onnxgrad.gradients(m, "t", ["s"], unconnected_gradients="zero")  # no rank: refused
    onnx.checker.check_model(zero.model, full_check=True)
    (dz,) = session(zero.model).run(zero.grads, {"x": x})
    np.testing.assert_array_equal(dz, np.zeros_like(ds))


# a gradient that reshaped a flat tensor to Shape(x) read a 0 of an empty x as "copy input dim
# i", which the flat (rank-1) tensor does not have: onnxruntime refused the model ("Invalid
# position of 0"). A shape read off a tensor is now reshaped to with allowzero=1 (seed 36: a
# Slice with steps, whose gradient replays the slice on the element numbers)
@pytest.mark.parametrize("shape", [[3, 0, 2], [0, 4], [4, 3, 0]])
@pytest.mark.parametrize("op", ["Slice", "Pad"])
def test_empty_x_reshaped_to_its_shape(shape, op):
    if op == "Slice":  # every other row
        inits = {k: np.array(v, np.int64) for k, v in
                 {"s": [0], "e": [3], "a": [0], "st": [2]}.items()}
        attrs = {}
    else:  # reflect one row/column in front, along the longest axis (reflecting needs 2)
        pads = np.zeros(2 * len(shape), np.int64)
        pads[int(np.argmax(shape))] = 1
        inits, attrs = {"pads": pads}, {"mode": "reflect"}
    m = op_model(op, {"x": (np.float64, shape)}, inits=inits, **attrs)
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    (g,) = session(res.model).run(res.grads, {"x": np.zeros(shape)})
    assert g.shape == tuple(shape)


# onnx infers a ceil_mode pool's last window even where it would start past the input (2x2
# here; onnxruntime, onnx.reference and PyTorch give 1x1), so a model declared with onnx's own
# inference was refused ("declares graph output as [1, 1, 2, 2] but its producer makes it
# [1, 1, 1, 1]", seed 36). The dims declared from such a pool, and downstream, are forgotten
# as for STFT: the result declares the runtimes' shape, and the gradient is checked
@pytest.mark.parametrize("value_info", [False, True])
def test_ceil_pool_declared_with_onnx_dims(value_info):
    dt = onnx.TensorProto.DOUBLE
    nodes = [onnx.helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[1, 1], strides=[2, 2],
                                   ceil_mode=1),
             onnx.helper.make_node("Tanh", ["p"], ["y"])]
    g = onnx.helper.make_graph(
        nodes, "pool", [onnx.helper.make_tensor_value_info("x", dt, [1, 1, 2, 2])],
        [onnx.helper.make_tensor_value_info("y", dt, [1, 1, 2, 2])],
        value_info=[onnx.helper.make_tensor_value_info("p", dt, [1, 1, 2, 2])]
        if value_info else [])
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 21)],
                               ir_version=10)
    assert [d.dim_value for d in onnx.shape_inference.infer_shapes(m).graph.output[0].type
            .tensor_type.shape.dim] == [1, 1, 2, 2]  # onnx's own inference, as declared
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    assert [d.dim_value for d in res.model.graph.output[0].type.tensor_type.shape.dim] == \
        [1, 1, 1, 1]
    assert_gradients(res.model, "y", "x", f32=False)


# -- model-local functions (fuzz seed 2121) -----------------------------------------------------
# The function rule differentiates a call through a clone of its body. The clone named every
# output the body leaves unnamed; onnxruntime inlines the forward call and its
# CommonSubexpressionElimination (every optimization level) merges the two equal nodes, so the
# clone's consumers of RNN's Y or LayerNormalization's Mean read the forward's absent output:
# "Argument type mismatch when adding edge", no session (an invalid model written without an
# error). The clone now leaves unnamed what the body leaves unnamed, and the outputs a node
# computes anyway are named in function bodies too, as in the graph (autodiff._name_outputs)
_H = 3
_OPTIONAL_OUTPUTS = {  # op: (inputs, initializers, attributes, outputs, the float outputs, x)
    "LayerNormalization": (["x", "s", "b"], {"s": (4,), "b": (4,)}, {}, 3, (0, 1, 2), [2, 4]),
    "RNN": (["x", "W", "R"], {"W": (1, _H, 4), "R": (1, _H, _H)}, {"hidden_size": _H}, 2,
            (0, 1), [2, 1, 4]),
    "GRU": (["x", "W", "R"], {"W": (2, 3 * _H, 4), "R": (2, 3 * _H, _H)},
            {"hidden_size": _H, "direction": "bidirectional"}, 2, (0, 1), [2, 1, 4]),
    "LSTM": (["x", "W", "R"], {"W": (1, 4 * _H, 4), "R": (1, 4 * _H, _H)}, {"hidden_size": _H},
             3, (0, 1, 2), [2, 1, 4]),
    "MaxPool": (["x"], {}, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, 2, (0,), [1, 2, 4, 4]),
    "Split": (["x"], {}, {"axis": 1, "num_outputs": 2}, 2, (0, 1), [2, 4]),
}


def _optional_outputs_model(op, named, in_function):
    ins, inits, attrs, n_out, floats, x_shape = _OPTIONAL_OUTPUTS[op]
    h, rng = onnx.helper, np.random.default_rng(0)
    outs = [f"o{i}" if i in named else "" for i in range(n_out)]
    node = h.make_node(op, ins, outs, **attrs)
    used = [o for o in outs if o]
    nodes, functions = [node], []
    if in_function:
        functions = [h.make_function("fz", "Block", ins, used, [node], [h.make_opsetid("", 18)])]
        nodes = [h.make_node("Block", ins, used, domain="fz")]
    summed = [f"o{i}" for i in sorted(named) if i in floats]
    nodes += [h.make_node("ReduceSum", [o], [f"{o}_sum"], keepdims=0) for o in summed]
    nodes.append(h.make_node("Sum", [f"{o}_sum" for o in summed], ["loss"]))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape)],
                     [h.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])],
                     [onnx.numpy_helper.from_array(rng.uniform(-.5, .5, s).astype(np.float32), k)
                      for k, s in inits.items()])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("fz", 1)],
                        ir_version=10, functions=functions)


@st.composite
def _optional_outputs_cases(draw):
    op = draw(st.sampled_from(sorted(_OPTIONAL_OUTPUTS)))
    n_out, floats = _OPTIONAL_OUTPUTS[op][3], _OPTIONAL_OUTPUTS[op][4]
    named = draw(st.sets(st.integers(0, n_out - 1), min_size=1))
    if op in ("LayerNormalization", "MaxPool"):
        named.add(0)  # Y is not optional
    if not named & set(floats):
        named.add(floats[-1])
    return op, frozenset(named)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_optional_outputs_cases())
def test_function_bodies_with_unnamed_outputs(case):
    """A call's gradient equals the gradient of the same node outside a function (the rule
    tests check that one against finite differences and PyTorch), and onnxruntime makes a
    session of it at ORT_ENABLE_ALL, for every op with unnamed outputs and every naming."""
    op, named = case
    xs = ["x", *_OPTIONAL_OUTPUTS[op][1]]
    x = np.random.default_rng(1).standard_normal(_OPTIONAL_OUTPUTS[op][5]).astype(np.float32)
    so = session_options()
    so.graph_optimization_level = ort_module().GraphOptimizationLevel.ORT_ENABLE_ALL
    got = []
    for in_function in (True, False):
        res = onnxgrad.gradients(_optional_outputs_model(op, named, in_function), "loss", xs)
        onnx.checker.check_model(res.model, full_check=True)
        got.append(session(res.model, options=so).run(res.grads, {"x": x}))
    for name, a, b in zip(xs, *got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{op} {name}")


# onnx's STFT inference reads an absent onesided as 0 (test_stft_without_onesided): the dims
# a model declares downstream of such an STFT were forgotten when the STFT was in the graph,
# but not when it was in a function body or a Loop body (fuzz seed 2121: "the model declares
# graph output as [1, 15, 16, 2], but its producer makes it [1, 15, 9, 2]"). The outputs of a
# call or a node that holds one are forgotten too, and onesided is written in every body
@pytest.mark.parametrize("wrap", ["function", "nested function", "loop"])
def test_stft_without_onesided_in_a_body(wrap):
    h, dt = onnx.helper, onnx.TensorProto.DOUBLE
    stft = h.make_node("STFT", ["x", "step", "", "length"], ["s"])
    consts = [h.make_node("Constant", [], [n], value=onnx.numpy_helper.from_array(np.array(v), n))
              for n, v in (("step", 8), ("length", 16))]
    functions, opsets = [], [h.make_opsetid("", 21)]
    if wrap == "loop":
        body = h.make_graph(consts + [stft, h.make_node("Identity", ["c"], ["c_out"])], "body",
                            [h.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
                             h.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
                            [h.make_tensor_value_info("c_out", onnx.TensorProto.BOOL, []),
                             h.make_tensor_value_info("s", dt, None)])
        call = h.make_node("Loop", ["trips", ""], ["s_all"], body=body)
        head = [h.make_node("Constant", [], ["trips"], value=onnx.numpy_helper.from_array(
            np.array(1, np.int64), "trips"))]
        tail = [h.make_node("Squeeze", ["s_all", "zero"], ["s_out"]),
                h.make_node("Constant", [], ["zero"], value=onnx.numpy_helper.from_array(
                    np.array([0], np.int64), "zero"))]
        nodes = head + [tail[1], call, tail[0]]
    else:
        functions.append(h.make_function("fz", "Frames", ["x"], ["s"], consts + [stft], opsets))
        outer = "Frames"
        if wrap == "nested function":
            functions.append(h.make_function("fz", "Outer", ["x"], ["s"],
                                             [h.make_node("Frames", ["x"], ["s"], domain="fz")],
                                             opsets + [h.make_opsetid("fz", 1)]))
            outer = "Outer"
        nodes = [h.make_node(outer, ["x"], ["s_out"], domain="fz")]
    nodes.append(h.make_node("Mul", ["s_out", "s_out"], ["y"]))
    g = h.make_graph(nodes, "stft", [h.make_tensor_value_info("x", dt, [1, 32, 1])],
                     [h.make_tensor_value_info("y", dt, None)])
    m = h.make_model(g, opset_imports=opsets + [h.make_opsetid("fz", 1)], ir_version=10,
                     functions=functions)
    m = onnx.shape_inference.infer_shapes(m)  # declares onnx's own (wrong) dims, as exports do
    assert [d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim][2] == 16
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    assert [d.dim_value for d in res.model.graph.output[0].type.tensor_type.shape.dim][2] != 16
    assert_gradients(m, "y", "x", f32=False)


# a ceil_mode pool whose last window onnx keeps and the runtimes drop is rewritten with the
# equivalent pads in every graph, but not in a function body (its input's size is the call's):
# the refusal says so and names the pads, instead of count_include_pad (a MaxPool has none)
def test_ceil_pool_in_a_function_refused_with_its_pads():
    h, dt = onnx.helper, onnx.TensorProto.DOUBLE
    pool = h.make_node("MaxPool", ["x"], ["p"], kernel_shape=[1, 1], strides=[2, 2], ceil_mode=1)
    f = h.make_function("fz", "Block", ["x"], ["p"], [pool], [h.make_opsetid("", 21)])
    g = h.make_graph([h.make_node("Block", ["x"], ["p"], domain="fz"),
                      h.make_node("Tanh", ["p"], ["y"])], "pool",
                     [h.make_tensor_value_info("x", dt, [1, 1, 2, 2])],
                     [h.make_tensor_value_info("y", dt, None)])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("fz", 1)],
                     ir_version=10, functions=[f])
    with pytest.raises(onnxgrad.NotDifferentiableError,
                       match=r"model-local function.*\[0, 0, 0, 0\]"):
        onnxgrad.gradients(m, "y", "x")


def test_fuzzer_steps_an_intermediate_x_by_the_magnitude_of_its_value():
    """Fuzzer seed 4801 (session 30) reported a correct gradient as wrong: its x was an
    intermediate (a ReduceProd, 5.9e8), fed as the value plus a zero delta, and the step was
    sized by the delta (1e-6), which 5.9e8 + 1e-6 rounds 6 % off. The step is now sized by the
    value (the same graph: ok or, where sin's curvature over that step is too large, skipped;
    onnxgrad's -3.39502 is right: differences at 1e-2 give -3.39496)."""
    import sys
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import fuzz_check
    import fuzz_graphs
    spec = fuzz_graphs.Spec(
        opset=1, dtype=1, batch=False, symbolic=False, value_info=False,
        inputs=((3, (4, 1, 1)), (3, (4, 1, 1))),
        steps=((1, (8141, 215098, 3876, 600350, 32229, 130, 74761, 127)),
               (0, (1158, 1048575, 91, 17327, 258, 43014, 9793, 12456)),
               (0, (399875, 3018, 49658, 237267, 242, 4470, 2896, 865)),
               (0, (587, 13009, 226069, 8104, 34843, 8323, 4778, 63076)),
               (0, (399875, 3018, 49658, 237267, 242, 4470, 2896, 865))),
        ys=(295,), xs=(262,), stops=(), grad_ys=(), unconnected=False, scope=0, aggregation=0,
        second=(), seed=75, function=103932)
    p = fuzz_graphs.build(spec)
    assert [n.op_type for n in p.model(np.float64, functions=False).graph.node
            if n.output[0] == p.xs[0]] == ["ReduceProd"]  # (the same graph as found)
    assert fuzz_check.evaluate(p).verdict in ("ok", "skipped-tie")
