"""Regressions of the TensorFlow converter found by red-team testing: each test names what broke
and why. TF (the test extra) is the oracle; converted models run on stock onnxruntime (CPU)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tf_v1 import both_routes
from tf_util import check, check_conversion, ort_run, tf, tf1_graph, tf_run

import onnxgrad
from onnxgrad.converters.tensorflow import ConversionError, convert

R = np.random.RandomState(0)


def rand(*shape):
    return R.randn(*shape).astype(np.float32)


# -- 1. constant folding must not swallow a weight ------------------------------------------
FOLDED = {  # ops the converter folds when every input is a constant; W is [3, 2]
    "strided_slice": lambda W: W[:2],
    "gather": lambda W: tf.gather(W, [0, 2, 2]),
    "pack": lambda W: tf.stack([W, W]),
    "concat": lambda W: tf.concat([W, W], 0),
    "band_part": lambda W: tf.linalg.band_part(W, 0, -1),
    "dynamic_stitch": lambda W: tf.dynamic_stitch([[2, 0, 1]], [W]),
}


@pytest.mark.parametrize("kind", sorted(FOLDED))
def test_folding_keeps_weight_gradients(kind):
    """y = sum(x @ W) + sum(f(W)**2): f (a slice, gather, stack, concat, band part, stitch) of
    a frozen weight was folded into a new constant, so dy/dW lost the second term."""
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        W = tf.constant(np.arange(6, dtype=np.float32).reshape(3, 2) / 10, name="W")
        y = tf.add(tf.reduce_sum(tf.matmul(x, W)), tf.reduce_sum(tf.square(FOLDED[kind](W))),
                   name="y")
        return W, y
    g, (W, y) = tf1_graph(build)
    both_routes(g, y, [W], {"x:0": rand(2, 3)})


def test_keras_gru_without_reset_after_keeps_its_recurrent_kernel(tmp_path):
    """Keras GRU(reset_after=False) slices recurrent_kernel; the slices were folded, so the
    variable vanished from the model and from its onnxgrad.weights (never trained)."""
    keras = pytest.importorskip("keras")
    from tensorflow.python.eager import context

    x = R.randn(2, 3, 2).astype(np.float32)
    with context.eager_mode():
        keras.utils.set_random_seed(0)
        inp = keras.Input((3, 2))
        model = keras.Model(inp, keras.layers.GRU(2, reset_after=False)(inp))
        model.export(str(tmp_path / "gru"), verbose=False)
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(model(xt))
        want = [g.numpy() for g in tape.gradient(y, model.trainable_weights)]
        names = [f"{w.path}:0" for w in model.trainable_weights]
    m = convert(str(tmp_path / "gru"))
    meta = {p.key: p.value for p in m.metadata_props}
    assert sorted(json.loads(meta["onnxgrad.weights"])) == sorted(names)
    res = onnxgrad.gradients(m, m.graph.output[0].name, names)
    got = ort_run(res.model, {m.graph.input[0].name: x}, res.grads)
    for name, g, w in zip(names, got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)


# -- 2. MatMul + Add -> Gemm must stay in topological order -----------------------------------
def test_gemm_merge_of_two_products_keeps_topological_order():
    """x@W + x@V: the Add was merged into the first MatMul's Gemm as its C, which read the
    second product before it was computed (onnx: 'must be topologically sorted')."""
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        W, V = tf.constant(rand(3, 2), name="W"), tf.constant(rand(3, 2), name="V")
        return x, W, V, tf.identity(tf.matmul(x, W) + tf.matmul(x, V), name="y")
    g, (x, W, V, y) = tf1_graph(build)
    model, _ = check_conversion(g, [y], {"x:0": rand(2, 3)})
    onnx.checker.check_model(model, full_check=True)
    both_routes(g, y, [x, W, V], {"x:0": rand(2, 3)})


def test_keras_masking_gru_converts(tmp_path):
    """Keras Masking -> GRU: the same merge (the step's two products added) broke the order."""
    keras = pytest.importorskip("keras")
    from tensorflow.python.eager import context

    x = R.randn(2, 4, 3).astype(np.float32)
    x[0, 2:] = 0.0  # masked steps
    with context.eager_mode():
        keras.utils.set_random_seed(0)
        inp = keras.Input((4, 3))
        model = keras.Model(inp, keras.layers.GRU(3)(keras.layers.Masking(0.0)(inp)))
        model.export(str(tmp_path / "gru"), verbose=False)
        want = model.predict(x, verbose=0)
    m = convert(str(tmp_path / "gru"))
    onnx.checker.check_model(m, full_check=True)
    (got,) = ort_run(m, {m.graph.input[0].name: x}, [m.graph.output[0].name])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -- 3. TF1 cond branches holding constants ---------------------------------------------------
BRANCHES = {  # the true branch reads a constant (hung off the cond's switch_t by a control edge)
    "add_const": lambda x: x + 1.0,
    "index": lambda x: x[0] * x,
    "reshape": lambda x: tf.reshape(tf.reshape(x, [3, 1]) * 2.0, [3]),
}


@pytest.mark.parametrize("branch", sorted(BRANCHES))
def test_tf1_cond_branch_with_constants(branch):
    """A v1 cond switches data on Identity(pred) ('cond/pred_id') but hangs constants off
    Switch(pred, pred): the two were taken for two conds ('mixes tensors of two different
    control-flow contexts')."""
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
        y = tf.compat.v1.cond(tf.reduce_sum(x) > 0, lambda: BRANCHES[branch](x), lambda: x * x)
        return x, tf.reduce_sum(y * y, name="y")
    g, (x, y) = tf1_graph(build)
    for xv in (np.array([1, 2, 3], np.float32), np.array([-1, -2, 0.5], np.float32)):
        both_routes(g, y, [x], {"x:0": xv})


def test_tf1_cond_with_constants_inside_while():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")

        def body(i, a):
            a = tf.compat.v1.cond(tf.equal(i % 2, 0), lambda: a * 2.0 + x[0],
                                  lambda: tf.reshape(a, [2, 1])[:, 0] - 1.0)
            return i + 1, a
        _, a = tf.compat.v1.while_loop(lambda i, a: i < 3, body, [0, x])
        return x, tf.reduce_sum(a * a, name="y")
    g, (x, y) = tf1_graph(build)
    both_routes(g, y, [x], {"x:0": rand(2)})


# -- 4. TF1 nested loops writing one TensorArray ----------------------------------------------
@pytest.mark.parametrize("order, cols", [("in_order", 3), ("reversed", 3), ("in_order", None)])
def test_tf1_nested_loops_write_one_tensor_array(order, cols):
    """The inner loop's writes became scan outputs scattered into the stacked array, but an
    array whose rows' shape TF gives only at the first write has no rows yet inside the outer
    loop (ConcatFromSequence of nothing at run time). Rows of a static shape (cols=3) start as
    zeros (writes in any order); else (cols=None) the writes insert, in order."""

    def build():
        x = tf.compat.v1.placeholder(tf.float32, [2, cols], name="x")
        ta = tf.TensorArray(tf.float32, size=4)

        def outer(i, ta):
            def inner(j, ta):
                at = i * 2 + (j if order == "in_order" else 1 - j)
                return j + 1, ta.write(at, x[i] * tf.cast(j + 1, tf.float32))
            _, ta = tf.compat.v1.while_loop(lambda j, ta: j < 2, inner, [0, ta])
            return i + 1, ta
        _, ta = tf.compat.v1.while_loop(lambda i, ta: i < 2, outer, [0, ta])
        s = ta.stack()
        y = tf.reduce_sum(tf.sin(s) * s, name="y")
        return y, tf.gradients(y, x)[0]  # (TF's gradient graph converts too)
    g, (y, gx) = tf1_graph(build)
    check_conversion(g, [y, gx], {"x:0": rand(2, 3)})


# -- 5. value_info must not claim equal dims it cannot know -----------------------------------
def test_tensor_array_split_uneven_pieces_runs():
    """Pieces of lengths 2 and 3 read back: ONNX's inference named both reads' dim 'unk__0',
    the converter wrote that into value_info and onnxruntime took them for one size."""
    def f(x):
        ta = tf.TensorArray(tf.float32, size=2, infer_shape=False).split(x, [2, 3])
        return tf.concat([ta.read(1) * 2.0, ta.read(0) * ta.read(0)], 0)
    cf = tf.function(f).get_concrete_function(tf.TensorSpec([5], tf.float32))
    xin, yout = cf.inputs[0].name, cf.outputs[0].name
    x = np.arange(5, dtype=np.float32)
    m = convert(cf.graph.as_graph_def(), inputs=[xin], outputs=[yout])
    (got,) = ort_run(m, {xin: x}, [yout])
    np.testing.assert_allclose(got, [4, 6, 8, 0, 1])
    made_up = [d.dim_param for vi in m.graph.value_info
               for d in vi.type.tensor_type.shape.dim if d.dim_param.startswith("unk__")]
    assert not made_up


@settings(max_examples=12, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(0, 3), min_size=2, max_size=4),
       reads=st.lists(st.tuples(st.integers(0, 3), st.floats(-2, 2, width=32)), min_size=1,
                      max_size=4), square=st.booleans())
def test_tensor_array_split_tape_gradient(lengths, reads, square):
    """The GradientTape graph of reads from a split TensorArray whose pieces differ in length:
    TF's gradient lists are reserved "like" the split list, each read's list has one element set
    and AddN sums them; the converter's stand-ins for the unset elements were shaped like the
    first piece, so the sum failed on onnxruntime (an invalid model, written with exit 0), and a
    piece no read touched came out with the first piece's length."""
    reads = [(i % len(lengths), w) for i, w in reads]
    n = sum(lengths)

    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            ta = tf.TensorArray(tf.float32, size=len(lengths), infer_shape=False).split(
                x, lengths)
            y = tf.add_n([tf.reduce_sum(ta.read(i) * (ta.read(i) if square else w))
                          for i, w in reads])
        return tape.gradient(y, x)
    cf = tf.function(f).get_concrete_function(tf.TensorSpec([n], tf.float32))
    xin, gout = cf.inputs[0].name, cf.outputs[0].name
    x = np.linspace(-1, 1, n).astype(np.float32)
    want = cf(tf.constant(x)).numpy()
    m = convert(cf.graph.as_graph_def(), inputs=[xin], outputs=[gout])
    (got,) = ort_run(m, {xin: x}, [gout])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# -- 6. an input that is also an output -------------------------------------------------------
def test_input_that_is_also_an_output():
    """outputs=['y:0', 'x:0'] with x:0 an input: an Identity wrote x:0 again (onnx_ir
    SerdeError). The input is now listed as an output too, and gradients still work."""
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        return x, tf.identity(tf.sin(x), name="y")
    g, (x, y) = tf1_graph(build)
    xv = rand(2, 3)
    model, (yv, xo) = check_conversion(g, ["y:0", "x:0"], {"x:0": xv})
    np.testing.assert_array_equal(xo, xv)
    assert [o.name for o in model.graph.output] == ["y:0", "x:0"]
    res = onnxgrad.gradients(model, "y:0", ["x:0"])
    (gx,) = ort_run(res.model, {"x:0": xv}, res.grads)
    np.testing.assert_allclose(gx, np.cos(xv), rtol=1e-6)


# -- 7. scalars where ONNX wants scalars ------------------------------------------------------
@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(axis=st.integers(-2, 1), exclusive=st.booleans(), reverse=st.booleans())
def test_cumprod_runs(axis, exclusive, reverse):
    """Cumprod fed Range a 1-D length (Gather(Shape(x), [axis])) and 1-D bounds; onnxruntime
    refuses Range of non-scalars (the checker does not)."""
    def build():
        a = tf.compat.v1.placeholder(tf.float32, [2, 3], name="a")
        return a, tf.reduce_sum(tf.math.cumprod(a, axis=axis, exclusive=exclusive,
                                                reverse=reverse) ** 2, name="y")
    g, (a, y) = tf1_graph(build)
    feeds = {"a:0": rand(2, 3)}
    model, _ = check_conversion(g, [y], feeds, rtol=1e-5)
    with g.as_default():
        want = tf_run(g, tf.compat.v1.gradients(y, a)[0], feeds)
    res = onnxgrad.gradients(model, "y:0", ["a:0"])
    (got,) = ort_run(res.model, feeds, res.grads)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# -- 8. custom gradients cannot be carried over -----------------------------------------------
def test_custom_gradient_is_refused():
    """tf.custom_gradient (an IdentityN marked '_gradient_op_type') converted as its forward
    ops: onnxgrad then gave the plain derivative (6) where TF gives the custom one (0.3)."""
    @tf.custom_gradient
    def clip_grad(v):
        return tf.identity(v), lambda dy: tf.clip_by_value(dy, -0.1, 0.1)

    cf = tf.function(lambda x: clip_grad(x * 3.0) * 2.0).get_concrete_function(
        tf.TensorSpec([3], tf.float64))
    with pytest.raises(ConversionError, match="IdentityN node .* custom gradient"):
        convert(cf.graph.as_graph_def(), inputs=[cf.inputs[0].name],
                outputs=[cf.outputs[0].name])


@pytest.mark.parametrize("beta", [1.0, 1.5])
def test_swish_custom_gradient_is_its_own_derivative(beta):
    """tf.nn.silu / swish (Keras's "swish" and "silu") is a tf.custom_gradient of
    x * sigmoid(beta * x) whose gradient is that product's derivative: it converts (it was
    refused as a custom gradient), and onnxgrad's gradient equals TF's."""
    import onnxgrad
    cf = tf.function(lambda x: tf.nn.silu(x, beta=beta) * 2.0).get_concrete_function(
        tf.TensorSpec([None], tf.float32))
    model = convert(cf.graph.as_graph_def(), inputs=[cf.inputs[0].name],
                    outputs=[cf.outputs[0].name])
    x = np.array([-30.0, -2.0, -0.5, 0.0, 0.3, 4.0, 50.0], np.float32)
    with tf.GradientTape() as tape:
        xt = tf.constant(x)
        tape.watch(xt)
        y = tf.nn.silu(xt, beta=beta) * 2.0
    want = tape.gradient(y, xt).numpy()
    res = onnxgrad.gradients(model, cf.outputs[0].name, [cf.inputs[0].name])
    got, = ort_run(res.model, {cf.inputs[0].name: x}, res.grads)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_gradient_override_map_is_refused():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
        with tf.compat.v1.get_default_graph().gradient_override_map({"Identity": "MyGrad"}):
            return tf.identity(x * 2.0, name="y")
    g, y = tf1_graph(build)
    with pytest.raises(ConversionError, match="Identity node 'y' has a custom gradient"):
        convert(g.as_graph_def(add_shapes=True), inputs=["x:0"], outputs=["y:0"])


# -- 9. PreventGradient -----------------------------------------------------------------------
def test_prevent_gradient_is_listed_with_its_message():
    """PreventGradient was converted as a StopGradient (a silently partial derivative, where TF
    refuses): an Identity now, listed with its message under onnxgrad.prevent_gradients (in a
    loop body too), not under onnxgrad.stop_gradients."""
    def f(x):
        y = tf.raw_ops.PreventGradient(input=x * 2.0, message="no grads here") * x

        def body(i, a):
            return i + 1, tf.raw_ops.PreventGradient(input=a) + 1.0
        _, z = tf.while_loop(lambda i, a: i < 2, body, [0, x])
        return tf.stop_gradient(y) + z
    cf = tf.function(f).get_concrete_function(tf.TensorSpec([3], tf.float64))
    xin, yout = cf.inputs[0].name, cf.outputs[0].name
    m = convert(cf.graph.as_graph_def(), inputs=[xin], outputs=[yout])
    meta = {p.key: json.loads(p.value) for p in m.metadata_props}
    prevents = meta["onnxgrad.prevent_gradients"]
    assert sorted(prevents.values()) == ["", "no grads here"]
    made = {o for nd in onnxgrad.rnn.ops.walk_nodes(m.graph) for o in nd.output}
    assert set(prevents) <= made
    assert not set(prevents) & set(meta.get("onnxgrad.stop_gradients", []))
    x = np.array([1.0, 2.0, 3.0])
    (got,) = ort_run(m, {xin: x}, [yout])
    np.testing.assert_allclose(got, 2 * x * x + x + 2)


# -- 7. Range -> Gather on stock onnxruntime ------------------------------------------------------
@st.composite
def ranges(draw):
    n = 6
    start = draw(st.integers(0, n - 1))
    delta = draw(st.sampled_from([-2, -1, 1, 2]))
    limit = draw(st.integers(-1, start) if delta < 0 else st.integers(start, n))
    return n, start, limit, delta, draw(st.booleans())


@settings(max_examples=40, deadline=None, derandomize=True)
@given(ranges())
def test_gather_of_a_range_runs_right_on_stock_onnxruntime(case):
    """tf.gather(x, tf.range(n - 1, -1, -1)) came out empty on stock onnxruntime: its
    GatherToSliceFusion reads Range's bounds as Slice's, where -1 counts from the end. Bounds
    computed from x's shape or given as constants, every step: TF's values, and the gradient."""
    n, start, limit, delta, dynamic = case

    def f(x):
        size = tf.shape(x)[0]
        s, lim = (size - (n - start), size - (n - limit)) if dynamic else (start, limit)
        return tf.gather(x, tf.range(s, lim, delta)) * 2.0
    cf = tf.function(f).get_concrete_function(tf.TensorSpec([None], tf.float64))
    xin, yout = cf.inputs[0].name, cf.outputs[0].name
    x = np.arange(float(n))
    m = convert(cf.graph.as_graph_def(), inputs=[xin], outputs=[yout])
    (got,) = ort_run(m, {xin: x}, [yout])
    np.testing.assert_array_equal(got, cf(tf.constant(x)).numpy())
    res = onnxgrad.gradients(m, yout, xin)
    (dx,) = ort_run(res.model, {xin: x}, res.grads)
    want = np.zeros(n)
    np.add.at(want, np.arange(start, limit, delta), 2.0)
    np.testing.assert_array_equal(dx, want)


def test_onnxgrad_sessions_run_without_gather_to_slice_fusion():
    """A user's own Range -> Gather (not converted by onnxgrad) in onnxgrad's sessions."""
    from onnx import TensorProto as TP
    from onnx import helper

    from onnxgrad.runtime import session
    g = helper.make_graph(
        [helper.make_node("Range", ["s", "l", "d"], ["i"]),
         helper.make_node("Gather", ["x", "i"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [4]),
         helper.make_tensor_value_info("s", TP.INT64, []),
         helper.make_tensor_value_info("l", TP.INT64, []),
         helper.make_tensor_value_info("d", TP.INT64, [])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)])
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 18)],
                               ir_version=10)
    feeds = {"x": np.arange(4, dtype=np.float32), "s": np.array(3), "l": np.array(-1),
             "d": np.array(-1)}
    np.testing.assert_array_equal(session(m).run(["y"], feeds)[0], [3, 2, 1, 0])


# -- 8. ReverseSequence ---------------------------------------------------------------------------
@st.composite
def reverse_sequences(draw):
    rank = draw(st.integers(2, 4))
    seq = draw(st.integers(0, rank - 1))
    batch = draw(st.integers(0, rank - 1).filter(lambda b: b != seq))
    shape = draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
    lens = draw(st.lists(st.integers(0, shape[seq]), min_size=shape[batch],
                         max_size=shape[batch]))
    return seq, batch, shape, lens, draw(st.sampled_from([np.int32, np.int64]))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(reverse_sequences())
def test_reverse_sequence_matches_tf(case):
    """tf.reverse_sequence (TF1's bidirectional_dynamic_rnn with sequence_length) had no
    converter. Any seq and batch axes (ONNX's op takes 0 and 1 only), forward and gradient."""
    seq, batch, shape, lens, ltype = case
    w = np.random.default_rng(0).standard_normal(shape)

    def f(x, n):
        return tf.reduce_sum(tf.reverse_sequence(x, n, seq_axis=seq, batch_axis=batch) * w)
    cf = tf.function(f).get_concrete_function(tf.TensorSpec(shape, tf.float64),
                                              tf.TensorSpec([shape[batch]], tf.as_dtype(ltype)))
    (xin, nin), yout = [t.name for t in cf.inputs], cf.outputs[0].name
    x, n = np.random.default_rng(1).standard_normal(shape), np.array(lens, ltype)
    m = convert(cf.graph.as_graph_def(add_shapes=True), inputs=[xin, nin], outputs=[yout])
    (got,) = ort_run(m, {xin: x, nin: n}, [yout])
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        want = f(xt, tf.constant(n))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12)
    res = onnxgrad.gradients(m, yout, xin)
    (dx,) = ort_run(res.model, {xin: x, nin: n}, res.grads)
    np.testing.assert_allclose(dx, tape.gradient(want, xt).numpy(), rtol=1e-12)


# -- 9. tensors named with tf.identity ------------------------------------------------------------
def test_a_tensor_named_with_tf_identity_keeps_its_name():
    """tf.identity(t, name="feat"), TF's way to name a tensor, vanished in conversion: "no
    tensor named 'feat:0'" from gradients(). It is an x now, with TF's gradient."""
    def build():
        x = tf.compat.v1.placeholder(tf.float64, [2, 3], name="x")
        feat = tf.identity(tf.tanh(x) * 2.0, name="feat")
        loss = tf.identity(tf.reduce_sum(feat * feat), name="loss")
        return x, feat, loss, tf.gradients(loss, feat)[0]
    g, (x, feat, loss, gfeat) = tf1_graph(build)
    xv = np.arange(6.0).reshape(2, 3) / 6
    (want,) = tf_run(g, [gfeat.name], {"x:0": xv})
    m = convert(g.as_graph_def(), inputs=["x:0"], outputs=["loss:0"])
    res = onnxgrad.gradients(m, "loss:0", "feat:0")
    (got,) = ort_run(res.model, {"x:0": xv}, res.grads)
    np.testing.assert_allclose(got, want, rtol=1e-12)


# -- 10. TF's own training-step graphs through tf.cond (optionals) -----------------------------
TAPE_CONDS = {
    "cond": lambda x: tf.cond(tf.reduce_sum(x) > 0, lambda: tf.sin(x) * x,
                              lambda: tf.cos(x) * tf.exp(x)),
    "switch_case": lambda x: tf.switch_case(
        tf.cast(tf.reduce_sum(x) > 0, tf.int32) + tf.cast(tf.reduce_sum(x) > 1, tf.int32),
        [lambda: tf.sin(x) * x, lambda: tf.cos(x) * x * x, lambda: tf.tanh(x) * x]),
    "nested": lambda x: tf.cond(x[0] > 0, lambda: tf.cond(x[1] > 0, lambda: tf.sin(x) * x,
                                                          lambda: tf.exp(x) * x),
                                lambda: tf.cos(x) * x),
}


@settings(max_examples=24, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(TAPE_CONDS)),
       st.lists(st.floats(-2, 2, allow_subnormal=False), min_size=3, max_size=3))
def test_gradient_tape_graphs_through_conds_convert(name, xs):
    """cond_v2 hands each branch's intermediates to the gradient as optionals (OptionalFromValue,
    OptionalNone, OptionalGetValue), sharing a position between a then and an else value of
    different types: "no converter for TensorFlow op 'OptionalFromValue'" for the tape graph
    of any tf.cond. They are ONNX optionals now; every branch of each cond, TF's values."""
    f = TAPE_CONDS[name]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = f(x)
        return y, tape.gradient(y, x)
    cf = step.get_concrete_function(tf.TensorSpec([3], tf.float64))
    xin, outs = cf.inputs[0].name, [t.name for t in cf.outputs]
    x = np.array(xs)
    m = convert(cf.graph.as_graph_def(), inputs=[xin], outputs=outs)
    for got, want in zip(ort_run(m, {xin: x}, outs), cf(tf.constant(x))):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-15)


# -- grouped convolutions ---------------------------------------------------------------------
def test_grouped_conv2d_converts_and_differentiates():
    """TF's Conv2D convolves in groups when the input has a multiple of the filter's input
    channels: it converted with group 1, a model onnxruntime refused when it ran. Forward and
    onnxgrad's gradients (input and filter) equal TF's; so does TF's own gradient graph, its
    grouped Conv2DBackpropInput and Conv2DBackpropFilter converted."""
    import onnxgrad
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 6, 6, 4)).astype(np.float32)
    w = rng.standard_normal((3, 3, 2, 6)).astype(np.float32)  # 2 groups of 2 -> 3 channels

    def f(x, w):
        return tf.nn.conv2d(x, w, [1, 2, 1, 1], "SAME")
    cf = tf.function(f).get_concrete_function(tf.TensorSpec([None, 6, 6, 4], tf.float32),
                                              tf.TensorSpec(w.shape, tf.float32))
    names = [t.name for t in cf.inputs]
    model = convert(cf.graph.as_graph_def(), inputs=names, outputs=[cf.outputs[0].name])
    gy = rng.standard_normal(f(x, w).shape).astype(np.float32)
    with tf.GradientTape() as tape:
        xt, wt = tf.constant(x), tf.constant(w)
        tape.watch([xt, wt])
        y = f(xt, wt)
    want = [y.numpy()] + [g.numpy() for g in tape.gradient(y, [xt, wt], output_gradients=gy)]
    res = onnxgrad.gradients(model, cf.outputs[0].name, names, grad_ys=["gy"])
    got = ort_run(res.model, {names[0]: x, names[1]: w, "gy": gy},
                  [cf.outputs[0].name, *res.grads])
    for g, v, what in zip(got, want, ["output", "d/dx", "d/dw"]):
        np.testing.assert_allclose(g, v, rtol=1e-4, atol=1e-4, err_msg=what)

    @tf.function
    def tape_fn(x, w, gy):
        with tf.GradientTape() as t:
            t.watch([x, w])
            y = f(x, w)
        return t.gradient(y, [x, w], output_gradients=gy)
    tf_graph = tape_fn.get_concrete_function(
        tf.TensorSpec(x.shape, tf.float32), tf.TensorSpec(w.shape, tf.float32),
        tf.TensorSpec(gy.shape, tf.float32))
    tins = [t.name for t in tf_graph.inputs]
    outs = [t.name for t in tf_graph.outputs]
    grads = convert(tf_graph.graph.as_graph_def(), inputs=tins, outputs=outs)
    for g, v, what in zip(ort_run(grads, dict(zip(tins, [x, w, gy])), outs), want[1:],
                          ["d/dx", "d/dw"]):
        np.testing.assert_allclose(g, v, rtol=1e-4, atol=1e-4, err_msg=f"{what} (TF's graph)")


# -- ops a model may hold that had no converter -------------------------------------------------
NEW_OPS = {
    "depth_to_space": (lambda x: tf.nn.depth_to_space(x, 2), (2, 3, 3, 8)),
    "space_to_depth": (lambda x: tf.nn.space_to_depth(x, 3), (2, 6, 3, 2)),
    "eye_and_diag": (lambda x: tf.matmul(x[:, :3, :3], tf.eye(3) * 2.0) +
                     tf.linalg.diag(x[:, 0, :3] * 3.0), (2, 4, 5)),
    "diag_part": (lambda x: tf.linalg.diag_part(x) * 2.0, (2, 4, 4)),
    "lrn": (lambda x: tf.nn.local_response_normalization(x, depth_radius=2, bias=1.5,
                                                         alpha=0.3, beta=0.75), (2, 3, 3, 7)),
}


@pytest.mark.parametrize("name", NEW_OPS)
def test_new_ops_convert_and_differentiate(name):
    """DepthToSpace, SpaceToDepth (NHWC), MatrixDiagV3 (tf.eye, tf.linalg.diag),
    MatrixDiagPartV3 (tf.linalg.diag_part, MatrixDiag's gradient), LRN and LRNGrad had no
    converter: forward and onnxgrad's gradient equal TF's, and TF's own gradient graph (which
    holds the other of the pair, or LRNGrad) converts and equals it too."""
    import onnxgrad
    fn, shape = NEW_OPS[name]
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32)
    cf = tf.function(fn).get_concrete_function(tf.TensorSpec([None, *shape[1:]], tf.float32))
    model = convert(cf.graph.as_graph_def(), inputs=[cf.inputs[0].name],
                    outputs=[cf.outputs[0].name])
    with tf.GradientTape() as tape:
        xt = tf.constant(x)
        tape.watch(xt)
        y = fn(xt)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    want = tape.gradient(y, xt, output_gradients=gy).numpy()
    res = onnxgrad.gradients(model, cf.outputs[0].name, [cf.inputs[0].name], grad_ys=["gy"])
    out, got = ort_run(res.model, {cf.inputs[0].name: x, "gy": gy},
                       [cf.outputs[0].name, res.grads[0]])
    np.testing.assert_allclose(out, y.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    @tf.function
    def tape_fn(x, gy):
        with tf.GradientTape() as t:
            t.watch(x)
            y = fn(x)
        return t.gradient(y, x, output_gradients=gy)
    tg = tape_fn.get_concrete_function(tf.TensorSpec(x.shape, tf.float32),
                                       tf.TensorSpec(gy.shape, tf.float32))
    tins = [t.name for t in tg.inputs]
    grad_model = convert(tg.graph.as_graph_def(), inputs=tins, outputs=[tg.outputs[0].name])
    (dx,) = ort_run(grad_model, dict(zip(tins, [x, gy])), [tg.outputs[0].name])
    np.testing.assert_allclose(dx, want, rtol=1e-5, atol=1e-5)


def test_matrix_diag_off_the_main_diagonal_is_refused():
    cf = tf.function(lambda v: tf.linalg.diag(v, k=1)).get_concrete_function(
        tf.TensorSpec([3], tf.float32))
    with pytest.raises(ConversionError, match="only the main diagonal"):
        convert(cf.graph.as_graph_def(), inputs=[cf.inputs[0].name],
                outputs=[cf.outputs[0].name])


def test_freezing_failure_says_what_failed(tmp_path):
    """Any failure of TF's freezer (convert_variables_to_constants_v2) ended with "a graph that
    assigns float variables ... cannot be frozen", also where nothing is assigned: TF refuses
    to freeze a raw ResourceGather with batch_dims=1 on a variable. The message gives TF's own
    error, and the assignment only where the graph assigns a float variable."""
    from tensorflow.python.eager import context

    class Gather(tf.Module):
        def __init__(self):
            super().__init__()
            self.v = tf.Variable(np.arange(24, dtype=np.float32).reshape(2, 3, 4))

        @tf.function(input_signature=[tf.TensorSpec([2, 2], tf.int32)])
        def __call__(self, idx):
            return tf.raw_ops.ResourceGather(resource=self.v.handle, indices=idx,
                                             dtype=tf.float32, batch_dims=1)

    class Assign(tf.Module):
        def __init__(self):
            super().__init__()
            self.v = tf.Variable(np.ones(3, np.float32))

        @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)])
        def __call__(self, x):
            self.v.assign_add(x)
            return self.v * 2.0

    with context.eager_mode():
        for name, cls in (("gather", Gather), ("assign", Assign)):
            m = cls()
            tf.saved_model.save(m, str(tmp_path / name), signatures=m.__call__)
    with pytest.raises(ConversionError, match="TensorFlow cannot freeze") as e:
        convert(str(tmp_path / "gather"))
    assert "batch_dims must be 0" in str(e.value), str(e.value)
    assert "assigns" not in str(e.value), str(e.value)
    with pytest.raises(ConversionError, match="a graph that assigns float variables cannot "
                                              "be frozen, and this one does .*AssignAddVariableOp"
                                              ".*stateful=False.*training=False"):
        convert(str(tmp_path / "assign"))


_ACT_GRADS = {"selu": tf.nn.selu, "elu": tf.nn.elu, "relu": tf.nn.relu, "relu6": tf.nn.relu6,
              "leaky_relu": lambda x: tf.nn.leaky_relu(x, 0.3), "softplus": tf.nn.softplus,
              "softsign": tf.nn.softsign}
_EDGES = [0.0, -0.0, 1e-30, -1e-30, 1e-8, -1e-8, 6.0, 5.9999995, 6.0000005, 1.0, -1.0, 20.0,
          -20.0, 100.0, -100.0]


@pytest.mark.parametrize("act", sorted(_ACT_GRADS))
@settings(max_examples=6, deadline=None, derandomize=True)
# no subnormals: TF runs with denormals flushed to zero (1e-45 is 0 to its LeakyReluGrad)
@given(more=st.lists(st.floats(-30, 30, width=32, allow_subnormal=False), max_size=8))
def test_tf_activation_grad_graphs_at_their_edges(act, more):
    """TF's own gradient graphs of the activations (ReluGrad, Relu6Grad, EluGrad, SeluGrad,
    LeakyReluGrad, SoftplusGrad, SoftsignGrad), converted, equal TF at the points where their
    branches meet (0, -0, outputs that round to 0, Relu6's 6), far out, and at drawn points."""
    xs = _EDGES + more
    fn = _ACT_GRADS[act]

    def build():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        gy = tf.compat.v1.placeholder(tf.float32, [None], name="gy")
        return x, gy, tf.identity(tf.gradients(fn(x), x, grad_ys=gy)[0], name="gx")
    graph, (x, gy, gx) = tf1_graph(build)
    xv = np.array(xs, np.float32)
    gys = np.linspace(0.5, 1.5, xv.size).astype(np.float32)
    want = tf_run(graph, [gx], {x: xv, gy: gys})[0]
    model = convert(graph.as_graph_def(), inputs=["x:0", "gy:0"], outputs=["gx:0"])
    got = ort_run(model, {"x:0": xv, "gy:0": gys}, ["gx:0"])[0]
    # atol: TF's gradient graph of softplus is dy * Sigmoid(x) (TF's Sigmoid op), and
    # onnxruntime's float32 Sigmoid is exact to ~1e-7 absolute, not relative (sigmoid(-7.9)
    # 2e-4 off, sigmoid(-20) = 2e-9 comes out 0); the SoftplusGrad op is relatively exact (below)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-7, err_msg=act)


def test_tf_softplus_grad_op_is_relatively_exact_in_its_tail():
    """TF's SoftplusGrad kernel (Keras's graphs hold it) converted: dy * sigmoid(x) to a few ulp
    relative, sigmoid below 0 as exp(x - softplus(x)), not onnxruntime's Sigmoid (0 from -20)."""
    xv = np.array([-80, -30, -20, -7.9, -1, 0, 1, 7.9, 20, 88], np.float32)  # normal results
    gys = np.linspace(0.5, 1.5, xv.size).astype(np.float32)

    def build():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        gy = tf.compat.v1.placeholder(tf.float32, [None], name="gy")
        return x, gy, tf.identity(tf.raw_ops.SoftplusGrad(gradients=gy, features=x), name="gx")
    graph, (x, gy, gx) = tf1_graph(build)
    want = tf_run(graph, [gx], {x: xv, gy: gys})[0]
    model = convert(graph.as_graph_def(), inputs=["x:0", "gy:0"], outputs=["gx:0"])
    got = ort_run(model, {"x:0": xv, "gy:0": gys}, ["gx:0"])[0]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)


@pytest.mark.parametrize("act", ["selu", "elu"])
def test_tf_selu_and_elu_grad_at_zero_outputs(act):
    """TF's SeluGrad and EluGrad take the negative branch only where the output is < 0: at an
    output of 0 (x = 0, or a tiny negative x whose output rounds to 0) SeluGrad's gradient is
    scale. The converted gradient graph took scale * alpha there (it tested y > 0)."""
    fn = getattr(tf.nn, act)

    def build():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        gy = tf.compat.v1.placeholder(tf.float32, [None], name="gy")
        return x, gy, tf.identity(tf.gradients(fn(x), x, grad_ys=gy)[0], name="gx")
    graph, (x, gy, gx) = tf1_graph(build)
    xs = np.array([0.0, -0.0, -1e-30, 1e-30, -1e-8, -1.0, 1.0, -20.0], np.float32)
    gys = np.linspace(0.5, 1.5, xs.size).astype(np.float32)
    want = tf_run(graph, [gx], {x: xs, gy: gys})[0]
    model = convert(graph.as_graph_def(), inputs=["x:0", "gy:0"], outputs=["gx:0"])
    got = ort_run(model, {"x:0": xs, "gy:0": gys}, ["gx:0"])[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_scan_gradient_graph_over_one_element(rows):
    """tf.scan without an initializer scans elems[1:]: over one element, the loop of TF's
    gradient graph runs no iteration, onnxruntime gives its scan outputs zero dims past the
    first, and the converted TensorArray writes (a ScatterND of [0, 0] updates into [1, 5])
    failed at run time (found by bench/fuzz_tf.py, session 36). The forward, onnxgrad's
    gradient and TF's gradient graph converted equal TF's (v1 control flow)."""
    x = np.random.default_rng(rows).standard_normal((rows, 5)).astype(np.float32)
    check(lambda x: tf.scan(lambda a, e: tf.tanh(a) * 0.5 + e, x), {"x": x},
                  diff=("x",), shapes={"x": [rows, 5]})


def test_values_made_outside_a_node_never_take_a_tf_tensor_name():
    """The converter names a value it makes outside any TF node by its op ("Add:0"), the form
    of TF's tensor names. The writes of a dynamic TensorArray in a while loop, scattered after
    the loop, made "Add:0", "Max:0", "Concat:0": TF's own nodes of those names lost their
    names, and TF's static shape of "Add:0" ([1, n]) declared the converter's value ([1]), an
    invalid model returned without error (found by `bench/fuzz_tf.py --arrays`, session 39).
    TF's tensors keep their names, and the model is valid and right."""
    def fn(x, z):
        ta = tf.TensorArray(tf.float32, size=0, dynamic_size=True)
        ta = tf.while_loop(lambda t, _: t < tf.shape(x)[0],
                           lambda t, ta: (t + 1, ta.write(t, tf.sin(x[t]))), (0, ta))[1]
        add = tf.raw_ops.AddV2(x=ta.stack(), y=z, name="Add")  # [1, n]
        big = tf.reduce_max(add, axis=0, keepdims=True, name="Max")
        cat = tf.concat([add, big * add], 0, name="Concat")
        return tf.reshape(cat, tf.shape(cat, name="Shape"), name="Reshape")
    m = check(fn, {"x": rand(3), "z": rand(1, 1)}, diff=("x", "z"))
    made = {o: n.op_type for n in m.graph.node for o in n.output}
    assert made["Add:0"] == "Add" and made["Concat:0"] == "Concat"


@pytest.mark.parametrize("feeds", [["sp:0"], ["sp:1"], ["sp:0", "sp:1"], ["t:0"], ["t:0", "sp:1"]])
def test_intermediate_tensors_fed_as_inputs_are_tfs_feeds(feeds):
    """Cutting a graph at intermediate tensors (inputs=[...]): a fed output of a multi-output
    node (tf.split's sp:1) was overwritten by the node's own conversion, so the model ignored
    its input (silently, with allow_unranked) and its gradient was None; feeding sp:0 failed;
    the fed tensor had no shape though TF's _output_shapes has it. Oracle: TF's Session.run
    with the same feed_dict; y is linear in each fed tensor (gradient: 10 and 1)."""
    def f(x):
        t = tf.tanh(x, name="t")
        a, b = tf.split(t, 2, axis=1, name="sp")
        return tf.identity(a * 10.0 + b, name="y")
    cf = tf.function(f).get_concrete_function(tf.TensorSpec([2, 4], name="x"))
    gd = cf.graph.as_graph_def(add_shapes=True)
    rng = np.random.default_rng(0)
    shapes = {"sp:0": (2, 2), "sp:1": (2, 2), "t:0": (2, 4)}
    vals = {k: rng.standard_normal(shapes[k]).astype(np.float32) for k in feeds}
    x = rng.standard_normal((2, 4)).astype(np.float32)
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with tf.compat.v1.Session(graph=g) as s:
        want = s.run("y:0", {"x:0": x, **vals})
    m = convert(gd, inputs=feeds, outputs=["y:0"])
    names = [i.name for i in m.graph.input]
    assert set(feeds) <= set(names)
    ins = {"x:0": x, **vals}
    got, = ort_run(m, {k: ins[k] for k in names}, ["y:0"])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    res = onnxgrad.gradients(m, "y:0", feeds)
    grads = ort_run(res.model, {k: ins[k] for k in names}, res.grads)
    for k, gr in zip(feeds, grads):
        if k == "t:0":  # (t feeds both halves unless sp:1 is fed too)
            want_g = np.concatenate([np.full((2, 2), 10.0), np.full((2, 2), 0.0 if
                                     "sp:1" in feeds else 1.0)], axis=1)
        else:
            want_g = np.full((2, 2), 10.0 if k == "sp:0" else 1.0)
        if "sp:0" in feeds and k == "t:0":
            want_g[:, :2] = 0.0
        np.testing.assert_allclose(gr, want_g, rtol=1e-6)


def test_tf_print_is_left_out():
    """tf.print makes a StringFormat for its PrintV2 (which the converter leaves out): the
    whole model was refused ("no converter for TensorFlow op 'StringFormat'")."""
    def fn(x):
        tf.print("batch", tf.shape(x)[0], "mean", tf.reduce_mean(x))
        return tf.tanh(x) * 2.0
    cf = tf.function(fn).get_concrete_function(tf.TensorSpec([None, 3], name="x"))
    m = convert(cf.graph.as_graph_def(), inputs=["x:0"], outputs=[cf.outputs[0].name])
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    got, = ort_run(m, {"x:0": x}, [cf.outputs[0].name])
    np.testing.assert_allclose(got, np.tanh(x) * 2.0, rtol=1e-6)


@pytest.mark.parametrize("op", ["reduce_mean", "reduce_sum", "reduce_max", "reduce_prod"])
@pytest.mark.parametrize("axis", [-1, -2, [-1, -3], [0, -1]])
def test_negative_reduction_axes_of_an_empty_batch(op, axis):
    """onnxruntime 1.31 ignores a negative axis of a reduction over an empty input: a batch of
    0 kept the reduced axis (TF (0, 4), converted (0, 4, 3)), and a converted Keras GRU after
    Masking failed inside onnxruntime. Constant axes are counted from the front where the rank
    is known; against TF at batch 0 and 2."""
    fn = getattr(tf, op)
    cf = tf.function(lambda x: fn(x, axis=axis)).get_concrete_function(
        tf.TensorSpec([None, 4, 3], name="x"))
    m = convert(cf.graph.as_graph_def(add_shapes=True), inputs=["x:0"],
                outputs=[cf.outputs[0].name])
    for batch in (0, 2):
        x = np.random.default_rng(batch).standard_normal((batch, 4, 3)).astype(np.float32)
        got, = ort_run(m, {"x:0": x}, [cf.outputs[0].name])
        want = cf(tf.constant(x)).numpy()
        assert got.shape == want.shape
        if batch or 0 not in np.atleast_1d(axis) % 3:  # (over no value: TF NaN, ORT 0)
            np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("case", ["linspace", "linspace_2d", "frame"])
def test_shape_arithmetic_on_constants_folds(case):
    """tf.linspace (BroadcastArgs of constant shapes, a SelectV2 of constants as ConcatV2's
    axis) and tf.signal.frame (StridedSlice strides made by Fill) were refused; against TF."""
    fns = {"linspace": lambda x: x * tf.linspace(0.0, 1.0, 4),
           "linspace_2d": lambda x: x + tf.reduce_sum(tf.linspace([0.0, 1.0], [2.0, 5.0], 4), 1),
           "frame": lambda x: tf.signal.frame(x, 2, 1)}
    cf = tf.function(fns[case]).get_concrete_function(tf.TensorSpec([3, 4], name="x"))
    m = convert(cf.graph.as_graph_def(add_shapes=True), inputs=["x:0"],
                outputs=[cf.outputs[0].name])
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    got, = ort_run(m, {"x:0": x}, [cf.outputs[0].name])
    np.testing.assert_allclose(got, cf(tf.constant(x)).numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("eq, shapes", [
    ("...ij,...jk->...ik", [(2, 3, 5, 3), (1, 3, 4)]),
    ("...ij,...jk->...ik", [(5, 3), (2, 3, 4)]),
    ("i...,i...->...", [(3, 2, 4), (3, 4)]),
    ("...i,...i->...", [(2, 3, 4), (4,)]),
])
def test_einsum_ellipses_of_different_ranks(eq, shapes):
    """numpy and TF broadcast an operand's shorter ellipsis from the right; ONNX's Einsum wants
    the same number of dims under each (onnx's inference refused the model). Forward and
    gradient of both operands against TF's GradientTape."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    cf = tf.function(lambda x, w: tf.einsum(eq, x, w)).get_concrete_function(
        tf.TensorSpec(shapes[0], name="x"), tf.TensorSpec(shapes[1], name="w"))
    out = cf.outputs[0].name
    m = convert(cf.graph.as_graph_def(add_shapes=True), inputs=["x:0", "w:0"], outputs=[out])
    feeds = {"x:0": a, "w:0": b}
    res = onnxgrad.gradients(m, out, ["x:0", "w:0"])
    y, ga, gb = ort_run(res.model, feeds, [out, *res.grads])
    ta, tb = tf.constant(a), tf.constant(b)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([ta, tb])
        want = tf.einsum(eq, ta, tb)
        total = tf.reduce_sum(want)
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ga, tape.gradient(total, ta).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gb, tape.gradient(total, tb).numpy(), rtol=1e-5, atol=1e-6)
