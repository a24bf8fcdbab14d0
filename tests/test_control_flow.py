"""If / Loop / Scan gradients against float64 finite differences (and onnxruntime in float32)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper

import onnxgrad
from onnxgrad.runtime import run
from util import assert_gradients, central_differences, vi_model

F = np.float32
N = h.make_node


def vi(name, t=TP.FLOAT, shape=None):
    return h.make_tensor_value_info(name, t, shape)


def seq_vi(name, t=TP.FLOAT):
    return h.make_tensor_sequence_value_info(name, t, None)


def model(nodes, inputs, outputs, inits=None, opset=18):
    """inputs / outputs: ValueInfoProtos (explicit, since Loop/Scan outputs infer poorly)."""
    return vi_model(nodes, inputs, outputs, inits, opset, infer=False)


def body(nodes, inputs, outputs):
    return h.make_graph(nodes, "body", inputs, outputs)


# -- If ---------------------------------------------------------------------------------------
def if_model(cond_const=None):
    then = body([N("Sin", ["x"], ["s"]), N("Mul", ["s", "w"], ["o1"])], [], [vi("o1")])
    els = body([N("Mul", ["x", "x"], ["o2"])], [], [vi("o2")])
    nodes = [N("If", ["c"], ["y"], then_branch=then, else_branch=els)]
    inputs = [vi("x", shape=[3]), vi("w", shape=[3])]
    if cond_const is None:
        inputs.insert(0, vi("c", TP.BOOL, []))
    else:
        nodes.insert(0, N("Constant", [], ["c"], value=h.make_tensor("cv", TP.BOOL, [],
                                                                     [cond_const])))
    return model(nodes, inputs, [vi("y", shape=[3])])


@pytest.mark.parametrize("c", [True, False])
def test_if_both_branches(c):
    r = assert_gradients(if_model(), "y", ["x", "w"], feeds={"c": np.array(c)})
    x = r.feeds["x"]
    if not c:  # the else branch does not read w: its gradient is zero, not missing
        np.testing.assert_array_equal(r.results[1].grad, 0)
        np.testing.assert_allclose(r.results[0].grad, 2 * x * r.cotangents["__cotangent_0"])


@pytest.mark.parametrize("c", [True, False])
def test_if_constant_condition(c):
    assert_gradients(if_model(cond_const=c), "y", ["x", "w"])


def test_if_branch_outputs_of_different_shapes():
    then = body([N("Mul", ["x", "w"], ["o1"])], [], [vi("o1", shape=[3])])
    els = body([N("ReduceSum", ["x"], ["o2"], keepdims=1), N("Mul", ["o2", "o2"], ["o3"])],
               [], [vi("o3", shape=[1])])
    m = model([N("If", ["c"], ["y"], then_branch=then, else_branch=els),
               N("ReduceSum", ["y"], ["z"], keepdims=0)],
              [vi("c", TP.BOOL, []), vi("x", shape=[3]), vi("w", shape=[3])], [vi("z", shape=[])])
    for c in (True, False):
        assert_gradients(m, "z", ["x", "w"], feeds={"c": np.array(c)})


def test_nested_if():
    inner_t = body([N("Mul", ["x", "w"], ["a"])], [], [vi("a")])
    inner_e = body([N("Exp", ["x"], ["b"])], [], [vi("b")])
    then = body([N("If", ["c2"], ["i"], then_branch=inner_t, else_branch=inner_e),
                 N("Tanh", ["i"], ["o1"])], [], [vi("o1")])
    els = body([N("Sin", ["w"], ["o2"])], [], [vi("o2")])
    m = model([N("If", ["c1"], ["y"], then_branch=then, else_branch=els)],
              [vi("c1", TP.BOOL, []), vi("c2", TP.BOOL, []), vi("x", shape=[3]),
               vi("w", shape=[3])], [vi("y", shape=[3])])
    for c1 in (True, False):
        for c2 in (True, False):
            assert_gradients(m, "y", ["x", "w"], feeds={"c1": np.array(c1), "c2": np.array(c2)})


# -- Loop -------------------------------------------------------------------------------------
def rnn_loop_body(d=3):
    return body([N("Gather", ["x", "i"], ["xi"], axis=0), N("MatMul", ["h_in", "w"], ["hw"]),
                 N("Add", ["hw", "xi"], ["pre"]), N("Tanh", ["pre"], ["h_out"]),
                 N("Identity", ["cond_in"], ["cond_out"]), N("Mul", ["h_out", "h_out"], ["sq"])],
                [vi("i", TP.INT64, []), vi("cond_in", TP.BOOL, []), vi("h_in", shape=[2, d])],
                [vi("cond_out", TP.BOOL, []), vi("h_out", shape=[2, d]), vi("sq", shape=[2, d])])


def test_loop_state_scan_outputs_and_outer_tensors():
    # h <- tanh(h @ w + x[i]); x and w are outer-scope tensors read in every iteration
    m = model([N("Loop", ["M", "", "h0"], ["hT", "hs"], body=rnn_loop_body())],
              [vi("M", TP.INT64, []), vi("h0", shape=[2, 3]), vi("x", shape=[4, 2, 3]),
               vi("w", shape=[3, 3])], [vi("hT", shape=[2, 3]), vi("hs", shape=["T", 2, 3])])
    assert_gradients(m, ["hT", "hs"], ["h0", "x", "w"], feeds={"M": np.array(4)})


def test_loop_dynamic_trip_count_one_graph():
    m = model([N("Loop", ["M", "", "h0"], ["hT", "hs"], body=rnn_loop_body())],
              [vi("M", TP.INT64, []), vi("h0", shape=[2, 3]), vi("x", shape=["T", 2, 3]),
               vi("w", shape=[3, 3])], [vi("hT", shape=[2, 3]), vi("hs", shape=["T", 2, 3])])
    res = onnxgrad.gradients(m, ["hT"], ["h0", "x", "w"])
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 3)).astype(F) * 0.5
    h0 = rng.standard_normal((2, 3)).astype(F)
    for t in (0, 1, 5):  # zero iterations too: gradients pass straight through
        x = rng.standard_normal((max(t, 1), 2, 3)).astype(F)
        gh0, gx, gw = run(res.model, {"M": np.array(t), "h0": h0, "x": x, "w": w}, res.grads)
        # an independent oracle: the same recurrence differentiated by hand in numpy
        hs = [h0.astype(np.float64)]
        for i in range(t):
            hs.append(np.tanh(hs[-1] @ w + x[i]))
        g, dx, dw = np.ones((2, 3)), np.zeros(x.shape), np.zeros((3, 3))
        for i in reversed(range(t)):
            dpre = g * (1 - hs[i + 1] ** 2)
            dx[i] += dpre
            dw += hs[i].T @ dpre
            g = dpre @ w.T
        np.testing.assert_allclose(gh0, g, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(gx, dx, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(gw, dw, rtol=1e-4, atol=1e-5)


def while_model():
    # while i < M and sum(h) < limit: h <- h * a + b; i counts (an integer carried state)
    b_ = body([N("Mul", ["h_in", "a"], ["ha"]), N("Add", ["ha", "b"], ["h_out"]),
               N("ReduceSum", ["h_out"], ["s"], keepdims=0), N("Less", ["s", "limit"], ["c"]),
               N("Add", ["k_in", "one"], ["k_out"]), N("Identity", ["c"], ["cond_out"])],
              [vi("i", TP.INT64, []), vi("cond_in", TP.BOOL, []), vi("h_in", shape=[3]),
               vi("k_in", TP.INT64, [])],
              [vi("cond_out", TP.BOOL, []), vi("h_out", shape=[3]), vi("k_out", TP.INT64, [])])
    return model([N("Loop", ["M", "c0", "h0", "k0"], ["hT", "kT"], body=b_),
                  N("Cast", ["kT"], ["kf"], to=TP.FLOAT), N("Mul", ["hT", "kf"], ["y"])],
                 [vi("M", TP.INT64, []), vi("c0", TP.BOOL, []), vi("h0", shape=[3]),
                  vi("a", shape=[3]), vi("b", shape=[3]), vi("k0", TP.INT64, [])],
                 [vi("y", shape=[3])],
                 inits={"limit": np.array(20, F), "one": np.array(1, np.int64)})


def loop_with_body_initializer(dtype):
    """h <- sin(h * k), k an initializer of the body (of the model's dtype)."""
    t = h.np_dtype_to_tensor_dtype(np.dtype(dtype))
    b_ = h.make_graph([N("Mul", ["h_in", "k"], ["m"]), N("Sin", ["m"], ["h_out"]),
                       N("Identity", ["c_in"], ["c_out"])], "body",
                      [vi("i", TP.INT64, []), vi("c_in", TP.BOOL, []), vi("h_in", t, [3])],
                      [vi("c_out", TP.BOOL, []), vi("h_out", t, [3])],
                      [numpy_helper.from_array(np.array([0.5, 1.5, -2.0], dtype), "k")])
    return model([N("Loop", ["M", "", "h0"], ["hT"], body=b_)],
                 [vi("M", TP.INT64, []), vi("h0", t, [3])], [vi("hT", t, [3])])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_loop_body_initializer_keeps_its_dtype(dtype):
    """A float64 Loop whose body holds an initializer (refused before: "a float constant needs
    an explicit dtype"; the float32 one too, inside the checker's float64 copy)."""
    m = loop_with_body_initializer(dtype)
    feeds = {"M": np.array(3), "h0": np.array([0.3, -0.7, 1.1], dtype)}
    r = assert_gradients(m, "hT", "h0", feeds=feeds)
    hh, g = feeds["h0"].astype(np.float64), np.ones(3)
    k = np.array([0.5, 1.5, -2.0])
    for _ in range(3):  # numpy: d sin(h k) / dh = cos(h k) k
        g, hh = g * np.cos(hh * k) * k, np.sin(hh * k)
    res = onnxgrad.gradients(m, "hT", "h0")
    (got,) = run(res.model, feeds, res.grads)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, g, rtol=1e-5 if dtype == np.float32 else 1e-12)
    assert r.results[0].ok


def test_loop_data_dependent_condition():
    feeds = {"M": np.array(50), "c0": np.array(True), "k0": np.array(0),
             "h0": np.array([0.5, 1.0, 0.2], F), "a": np.array([1.3, 1.1, 1.2], F),
             "b": np.array([0.1, 0.2, 0.3], F)}
    r = assert_gradients(while_model(), "y", ["h0", "a", "b"], feeds=feeds)
    # the loop ran a data-dependent number of times (not M): check against a numpy loop
    h_, k = feeds["h0"].astype(np.float64), 0
    while k < 50:
        h_ = h_ * feeds["a"] + feeds["b"]
        k += 1
        if h_.sum() >= 20:
            break
    assert 1 < k < 50
    cot = r.cotangents["__cotangent_0"]
    np.testing.assert_allclose(r.results[0].grad, cot * k * feeds["a"].astype(np.float64) ** k,
                               rtol=1e-6)


def test_nested_loops():
    # outer: for i < 3: h <- inner(h) * x[i];  inner: for j < 2: h <- sin(h + w)
    inner = body([N("Add", ["g_in", "w"], ["gw"]), N("Sin", ["gw"], ["g_out"]),
                  N("Identity", ["ci"], ["co"])],
                 [vi("j", TP.INT64, []), vi("ci", TP.BOOL, []), vi("g_in", shape=[3])],
                 [vi("co", TP.BOOL, []), vi("g_out", shape=[3])])
    outer = body([N("Loop", ["two", "", "h_in"], ["hi"], body=inner),
                  N("Gather", ["x", "i"], ["xi"], axis=0), N("Mul", ["hi", "xi"], ["h_out"]),
                  N("Identity", ["cond_in"], ["cond_out"]), N("Identity", ["hi"], ["scan"])],
                 [vi("i", TP.INT64, []), vi("cond_in", TP.BOOL, []), vi("h_in", shape=[3])],
                 [vi("cond_out", TP.BOOL, []), vi("h_out", shape=[3]), vi("scan", shape=[3])])
    m = model([N("Loop", ["three", "", "h0"], ["hT", "his"], body=outer)],
              [vi("h0", shape=[3]), vi("x", shape=[3, 3]), vi("w", shape=[3])],
              [vi("hT", shape=[3]), vi("his", shape=[3, 3])],
              inits={"two": np.array(2, np.int64), "three": np.array(3, np.int64)})
    assert_gradients(m, ["hT", "his"], ["h0", "x", "w"])


def test_loop_gradient_is_differentiable_again():
    m = model([N("Loop", ["M", "", "h0"], ["hT", "hs"], body=rnn_loop_body())],
              [vi("M", TP.INT64, []), vi("h0", shape=[2, 3]), vi("x", shape=[3, 2, 3]),
               vi("w", shape=[3, 3])], [vi("hT", shape=[2, 3]), vi("hs", shape=["T", 2, 3])])
    first = onnxgrad.gradients(m, "hT", "w")
    assert_gradients(first.model, first.grads[0], ["h0"], feeds={"M": np.array(3)}, f32=False)


# -- Scan -------------------------------------------------------------------------------------
@pytest.mark.parametrize("in_dir,in_axis,out_dir,out_axis", [(0, 0, 0, 0), (1, 1, 1, 1),
                                                           (0, -1, 1, 0)])
def test_scan_states_inputs_outputs(in_dir, in_axis, out_dir, out_axis):
    # s <- tanh(s * w + x_t) ; y_t = s * s ; two scan inputs (one in the other direction)
    b_ = body([N("Mul", ["s_in", "w"], ["sw"]), N("Add", ["sw", "xt"], ["p"]),
               N("Mul", ["p", "zt"], ["pz"]), N("Tanh", ["pz"], ["s_out"]),
               N("Mul", ["s_out", "s_out"], ["yt"])],
              [vi("s_in", shape=[2]), vi("xt", shape=[2]), vi("zt", shape=[2])],
              [vi("s_out", shape=[2]), vi("yt", shape=[2])])
    xshape = [4, 2] if in_axis == 0 else [2, 4]
    m = model([N("Scan", ["s0", "x", "z"], ["sT", "ys"], body=b_, num_scan_inputs=2,
                 scan_input_axes=[in_axis, 0], scan_input_directions=[in_dir, 1 - in_dir],
                 scan_output_axes=[out_axis], scan_output_directions=[out_dir])],
              [vi("s0", shape=[2]), vi("x", shape=xshape), vi("z", shape=[4, 2]),
               vi("w", shape=[2])],
              [vi("sT", shape=[2]), vi("ys", shape=[4, 2] if out_axis == 0 else [2, 4])])
    assert_gradients(m, ["sT", "ys"], ["s0", "x", "z", "w"])


def test_scan_cumulative_sum_against_numpy():
    b_ = body([N("Add", ["s_in", "xt"], ["s_out"]), N("Identity", ["s_out"], ["yt"])],
              [vi("s_in", shape=[2]), vi("xt", shape=[2])],
              [vi("s_out", shape=[2]), vi("yt", shape=[2])])
    m = model([N("Scan", ["s0", "x"], ["sT", "ys"], body=b_, num_scan_inputs=1)],
              [vi("s0", shape=[2]), vi("x", shape=[5, 2])],
              [vi("sT", shape=[2]), vi("ys", shape=[5, 2])])
    res = onnxgrad.gradients(m, "ys", ["x", "s0"])
    x = np.arange(10, dtype=F).reshape(5, 2)
    gx, gs0 = run(res.model, {"x": x, "s0": np.zeros(2, F)}, res.grads)
    # d sum(cumsum(x)) / dx[t] = T - t
    np.testing.assert_allclose(gx, np.repeat(np.arange(5, 0, -1)[:, None], 2, 1).astype(F))
    np.testing.assert_allclose(gs0, [5, 5])


def test_scan_body_reading_outer_constants():
    """A body whose Unsqueeze axes come from an outer Constant: onnx's shape inference alone
    leaves every rank after it unknown (MatMul's rule needs them); onnxgrad's inference sees the
    Constant, and the result model keeps the body as it was."""
    b_ = body([N("Unsqueeze", ["xt", "ax"], ["col"]), N("MatMul", ["col", "w"], ["p"]),
               N("Add", ["s_in", "p"], ["s_out"]), N("Identity", ["s_out"], ["yt"])],
              [vi("s_in"), vi("xt")], [vi("s_out"), vi("yt")])
    m = model([N("Constant", [], ["ax"], value=h.make_tensor("ax", TP.INT64, [1], [1])),
               N("Scan", ["s0", "x"], ["sT", "ys"], body=b_, num_scan_inputs=1)],
              [vi("s0", shape=[3, 4]), vi("x", shape=[5, 3]), vi("w", shape=[1, 4])],
              [vi("sT", shape=[3, 4]), vi("ys", shape=[5, 3, 4])])
    assert_gradients(m, ["sT", "ys"], ["s0", "x", "w"])
    res = onnxgrad.gradients(m, "sT", "x")
    body_ops = [n.op_type for n in res.model.graph.node[1].attribute[0].g.node]
    assert body_ops[:2] == ["Unsqueeze", "MatMul"]


def test_scan8_refused_with_a_clear_error():
    """Scan-8 (opset 8) has a batch axis that onnx's version converter strips from the declared
    shapes (the upgraded model would not accept the original inputs): refused, not mangled."""
    b_ = body([N("Add", ["s_in", "xt"], ["s_out"]), N("Identity", ["s_out"], ["yt"])],
              [vi("s_in", shape=[2]), vi("xt", shape=[2])],
              [vi("s_out", shape=[2]), vi("yt", shape=[2])])
    m = model([N("Scan", ["", "s0", "x"], ["sT", "ys"], body=b_, num_scan_inputs=1)],
              [vi("s0", shape=[1, 2]), vi("x", shape=[1, 5, 2])],
              [vi("sT", shape=[1, 2]), vi("ys", shape=[1, 5, 2])], opset=8)
    with pytest.raises(NotImplementedError, match="Scan-8.*opset 9"):
        onnxgrad.gradients(m, "ys", "x")


# -- sequences carried through loops (the TensorArray-in-while-loop case) ---------------------
def ta_rnn_model():
    """The dynamic RNN of tf.nn.dynamic_rnn: xs = unstack(x) outside; inside the loop
    h = tanh(read(xs, i) @ u + h @ w); outs = outs.write(i, h); afterwards stack(outs)."""
    b_ = body([N("SequenceAt", ["xs", "i"], ["xi"]), N("MatMul", ["xi", "u"], ["xu"]),
               N("MatMul", ["h_in", "w"], ["hw"]), N("Add", ["xu", "hw"], ["p"]),
               N("Tanh", ["p"], ["h_out"]), N("SequenceInsert", ["ta_in", "h_out", "i"], ["ta_out"]),
               N("Identity", ["cond_in"], ["cond_out"])],
              [vi("i", TP.INT64, []), vi("cond_in", TP.BOOL, []), vi("h_in", shape=[2, 3]),
               seq_vi("ta_in")],
              [vi("cond_out", TP.BOOL, []), vi("h_out", shape=[2, 3]), seq_vi("ta_out")])
    return model([N("SplitToSequence", ["x"], ["xs"], axis=0, keepdims=0),
                  N("SequenceLength", ["xs"], ["T"]),
                  N("SequenceEmpty", [], ["ta0"], dtype=TP.FLOAT),
                  N("Loop", ["T", "", "h0", "ta0"], ["hT", "ta"], body=b_),
                  N("ConcatFromSequence", ["ta"], ["outs"], axis=0, new_axis=1)],
                 [vi("x", shape=[4, 2, 2]), vi("h0", shape=[2, 3]), vi("u", shape=[2, 3]),
                  vi("w", shape=[3, 3])], [vi("outs", shape=[4, 2, 3]), vi("hT", shape=[2, 3])])


def test_sequence_written_in_loop_and_outer_sequence_read():
    m = ta_rnn_model()
    assert_gradients(m, ["outs", "hT"], ["x", "h0", "u", "w"])
    res = onnxgrad.gradients(m, "outs", ["x", "w"])
    nodes = {n.op_type for n in res.model.graph.node}
    assert "Loop" in nodes
    # the forward loop saved h (a tensor) per iteration, and what its gradient reads of the
    # iteration (its tanh), but not the sequence it writes
    fwd = next(n for n in res.model.graph.node if n.op_type == "Loop")
    added = [o.rsplit("/", 1)[-1] for o in fwd.output[2:]]
    assert sorted(added) == ["Loop_iters", "Loop_kept", "Loop_saved"], added


# -- the model's stop and prevent marks inside bodies -----------------------------------------
def _marked(model, key, names):
    import json
    model.metadata_props.add(key=key, value=json.dumps(names))
    return model


@settings(max_examples=30, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["Loop", "Scan"]), at=st.sampled_from(["in", "row", "p", None]),
       opset=st.sampled_from([13, 16, 18]), seed=st.integers(0, 20))
def test_stops_inside_bodies_are_torchs_detach(kind, at, opset, seed):
    """h <- sin(h w + x[t]) + h over the rows of x, with the model's metadata stopping the
    body's carried input, its row read (a Loop's Gather, opset 16 on a scan output of its
    gradient; a Scan's element) or an inner value. Stops on body inputs were accepted and
    ignored, a stopped row read still took its gradient (ScatterND path): against torch with
    .detach() there in every iteration."""
    import onnx
    torch = pytest.importorskip("torch")
    D = TP.DOUBLE
    rng = np.random.default_rng(seed)
    T = 4
    x, h0, w = rng.standard_normal((T, 3)), rng.standard_normal(3), rng.standard_normal(3)
    step = [h.make_node("Mul", ["h_in", "w"], ["hw"]), h.make_node("Add", ["hw", "xi"], ["p"]),
            h.make_node("Sin", ["p"], ["s"]), h.make_node("Add", ["s", "h_in"], ["h_out"])]
    if kind == "Loop":
        body = h.make_graph(
            [h.make_node("Gather", ["x", "i"], ["xi"], axis=0), *step,
             h.make_node("Identity", ["c"], ["c_out"])], "body",
            [h.make_tensor_value_info("i", TP.INT64, []),
             h.make_tensor_value_info("c", TP.BOOL, []), h.make_tensor_value_info("h_in", D, [3])],
            [h.make_tensor_value_info("c_out", TP.BOOL, []),
             h.make_tensor_value_info("h_out", D, [3])])
        node = h.make_node("Loop", ["T", "", "h0"], ["hT"], body=body)
        inits = [numpy_helper.from_array(np.array(T, np.int64), "T")]
    else:
        body = h.make_graph(step + [h.make_node("Identity", ["h_out"], ["o"])], "body",
                            [h.make_tensor_value_info("h_in", D, [3]),
                             h.make_tensor_value_info("xi", D, [3])],
                            [h.make_tensor_value_info("h_out", D, [3]),
                             h.make_tensor_value_info("o", D, [3])])
        node = h.make_node("Scan", ["h0", "x"], ["hT", "os"], body=body, num_scan_inputs=1)
        inits = []
    g = h.make_graph([node], "g", [h.make_tensor_value_info(n, D, s) for n, s in
                                   (("x", [T, 3]), ("h0", [3]), ("w", [3]))],
                     [h.make_tensor_value_info("hT", D, [3])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)], ir_version=8)
    name = {"in": "h_in", "row": "xi", "p": "p", None: None}[at]
    if name:
        _marked(m, "onnxgrad.stop_gradients", [name])
    onnx.checker.check_model(m, full_check=True)
    res = onnxgrad.gradients(m, "hT", ["x", "h0", "w"])
    xt, ht, wt = (torch.tensor(a, requires_grad=True) for a in (x, h0, w))
    hh = ht
    for t in range(T):
        hin = hh.detach() if at == "in" else hh
        xi = xt[t].detach() if at == "row" else xt[t]
        p = hin * wt + xi
        hh = torch.sin(p.detach() if at == "p" else p) + hin
    want = torch.autograd.grad(hh.sum(), [xt, ht, wt], allow_unused=True)
    # x only through its stopped rows: None, as torch's (unused) gradient
    assert [g is None for g in res.grads] == [b is None for b in want]
    got = run(res.model, {"x": x, "h0": h0, "w": w}, [g for g in res.grads if g is not None])
    for a, b in zip(got, [b for b in want if b is not None]):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-10, atol=1e-12)
    if name:  # the same name prevented: a gradient through it is refused, by name
        del m.metadata_props[:]
        _marked(m, "onnxgrad.prevent_gradients", {name: "not here"})
        with pytest.raises(onnxgrad.NotDifferentiableError, match=f"'{name}'.*not here"):
            onnxgrad.gradients(m, "hT", ["x", "h0", "w"])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["Loop", "Scan"]),
       deps=st.lists(st.sets(st.sampled_from(["c0", "c1", "c2", "w"]), max_size=3),
                     min_size=3, max_size=3),
       trips=st.integers(0, 3), seed=st.integers(0, 20))
def test_values_no_iteration_connects_to_ys_get_none(kind, deps, trips, seed):
    """Three carried values, c_k <- sin(sum of those deps[k] names) (a constant when none), and
    an outer w; ys = the final c0. Which initial values and w the gradient reaches at all is a
    fixpoint over deps: the others get None, as outside a loop (a Loop gave every carried value
    and capture zeros, which the Trainer's weight decay then moved). The rest: float64 central
    differences."""
    import onnx
    D = TP.DOUBLE
    rng = np.random.default_rng(seed)
    ins = ["c0_in", "c1_in", "c2_in"]
    nodes, outs = [], []
    for k, dep in enumerate(deps):
        names = [("w" if d == "w" else f"{d}_in") for d in sorted(dep)]
        if not names:
            nodes.append(h.make_node("Constant", [], [f"s{k}"],
                                     value=numpy_helper.from_array(np.full(2, 0.5))))
        elif len(names) == 1:
            nodes.append(h.make_node("Identity", names, [f"s{k}"]))
        else:
            nodes.append(h.make_node("Sum", names, [f"s{k}"]))
        nodes.append(h.make_node("Sin", [f"s{k}"], [f"c{k}_out"]))
        outs.append(f"c{k}_out")
    vi = [h.make_tensor_value_info(n, D, [2]) for n in ins]
    vo = [h.make_tensor_value_info(n, D, [2]) for n in outs]
    feeds = {"c0": rng.standard_normal(2), "c1": rng.standard_normal(2),
             "c2": rng.standard_normal(2), "w": rng.standard_normal(2)}
    if kind == "Loop":
        body = h.make_graph(nodes + [h.make_node("Identity", ["c"], ["c_out"])], "body",
                            [h.make_tensor_value_info("i", TP.INT64, []),
                             h.make_tensor_value_info("c", TP.BOOL, []), *vi],
                            [h.make_tensor_value_info("c_out", TP.BOOL, []), *vo])
        node = h.make_node("Loop", ["M", "", "c0", "c1", "c2"], ["f0", "f1", "f2"], body=body)
        extra = [h.make_tensor_value_info("M", TP.INT64, [])]
        feeds["M"] = np.array(trips, np.int64)
    else:  # the rows of r count the iterations (the body reads none of them; onnxruntime
        trips = max(trips, 1)  # runs no Scan over 0 rows)
        body = h.make_graph(nodes + [h.make_node("Identity", ["r"], ["ro"])], "body",
                            [*vi, h.make_tensor_value_info("r", D, [])],
                            [*vo, h.make_tensor_value_info("ro", D, [])])
        node = h.make_node("Scan", ["c0", "c1", "c2", "r"], ["f0", "f1", "f2", "rs"],
                           body=body, num_scan_inputs=1)
        extra = [h.make_tensor_value_info("r", D, [trips])]
        feeds["r"] = np.zeros(trips)
    g = h.make_graph([node], "g", [*(h.make_tensor_value_info(n, D, [2]) for n in
                                     ("c0", "c1", "c2", "w")), *extra],
                     [h.make_tensor_value_info("f0", D, [2])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    xs = ["c0", "c1", "c2", "w"]
    res = onnxgrad.gradients(m, "f0", xs)
    needed, reached, grew = {"c0"}, set(), True
    while grew:  # the expected connectivity, from deps alone
        grew = False
        for k in list(needed):
            for d in deps[int(k[1])]:
                if d not in reached:
                    reached.add(d)
                    grew = True
                    if d != "w":
                        needed.add(d)
    # the initial c0 is the output when the loop may run no iteration (M is fed; the Scan's
    # length is a static 1 or more)
    want = reached | ({"c0"} if kind == "Loop" else set())
    assert [x for x, gr in zip(xs, res.grads) if gr is not None] == [x for x in xs if x in want]
    got = dict(zip([x for x in xs if x in want],
                   run(res.model, feeds, [gr for gr in res.grads if gr is not None])))
    for x in got:
        fd = central_differences(lambda v: run(m, {**feeds, x: v}, ["f0"])[0].sum(),
                                 feeds[x], 1e-6)
        np.testing.assert_allclose(got[x], fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("cond", [True, False])
def test_if_values_that_reach_no_output_with_a_gradient_get_none(cond):
    """Each branch outputs (a from w1, b from w2); ys read a alone: w2 gets None, as without
    the If (both branches gave it zeros)."""
    D = TP.DOUBLE
    outs = [h.make_tensor_value_info(n, D, [2]) for n in ("a", "b")]
    then = h.make_graph([h.make_node("Sin", ["w1"], ["a"]), h.make_node("Cos", ["w2"], ["b"])],
                        "then", [], outs)
    other = h.make_graph([h.make_node("Neg", ["w1"], ["a"]), h.make_node("Exp", ["w2"], ["b"])],
                         "else", [], outs)
    g = h.make_graph([h.make_node("If", ["c"], ["ya", "yb"], then_branch=then,
                                  else_branch=other)], "g",
                     [h.make_tensor_value_info("c", TP.BOOL, []),
                      *(h.make_tensor_value_info(n, D, [2]) for n in ("w1", "w2"))],
                     [h.make_tensor_value_info(n, D, [2]) for n in ("ya", "yb")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18)], ir_version=8)
    res = onnxgrad.gradients(m, "ya", ["w1", "w2"])
    assert res.grads[0] is not None and res.grads[1] is None
    w1 = np.array([0.3, -1.2])
    got, = run(res.model, {"c": np.array(cond), "w1": w1, "w2": w1}, [res.grads[0]])
    np.testing.assert_allclose(got, np.cos(w1) if cond else -np.ones(2), rtol=1e-12)
    both = onnxgrad.gradients(m, ["ya", "yb"], ["w1", "w2"])
    assert None not in both.grads


@settings(max_examples=12, deadline=None, derandomize=True)
@given(cuts=st.lists(st.integers(1, 6), min_size=1, max_size=3, unique=True),
       opset=st.sampled_from([13, 17]), seed=st.integers(0, 5))
def test_torchscript_loops_with_a_one_element_iteration_number(cuts, opset, seed):
    """torch.tensor_split exports as a Loop whose body declares its iteration number int64[1]
    and its trip count is [1]: the backward body computed from a scalar what the clones declare
    [1] (an invalid model, exit 0), and a constant trip count of shape [1] broke the rule.
    Against torch autograd; the result passes full_check."""
    import io
    import warnings

    import onnx
    torch = pytest.importorskip("torch")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(7, 7)

        def forward(self, x):
            parts = torch.tensor_split(self.l(x), sorted(cuts), 1)
            return torch.cat([t * (i + 1) for i, t in enumerate(parts)], 1)

    torch.manual_seed(seed)
    mod, x = M().double(), torch.randn(3, 7, dtype=torch.float64)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(mod, (x,), f, dynamo=False, opset_version=opset, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    m = onnx.load_from_string(f.getvalue())
    res = onnxgrad.gradients(m, "y", ["x", "l.weight"])
    onnx.checker.check_model(res.model, full_check=True)
    got = run(res.model, {"x": x.numpy()}, res.grads)
    xt = x.clone().requires_grad_(True)
    want = torch.autograd.grad(mod(xt).sum(), [xt, mod.l.weight])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-10, atol=1e-12)
