"""TF1 control flow, TensorArrays and stacks through the converter, with tf.gradients: the
converted forward and gradient outputs equal TensorFlow's, and onnxgrad's gradients of the
converted forward graph agree with TensorFlow's gradients (two routes, one answer)."""
from __future__ import annotations

import numpy as np
import pytest
from tf_util import check_conversion, control_flow, names, ort_run, tf, tf1_graph, tf_run

import onnxgrad
from onnxgrad.converters.tensorflow import ConversionError, convert

R = np.random.RandomState(0)


def rand(*shape):
    return R.randn(*shape).astype(np.float32)


def both_routes(graph, y, xs, feeds, stop_gradients=None, unconnected="none", **tol):
    """Route 1: TF's tf.gradients graph, converted. Route 2: the forward graph converted, then
    differentiated by onnxgrad. Both must equal TF's numbers."""
    forward = graph.as_graph_def(add_shapes=True)
    with control_flow(v2=False), graph.as_default():
        gs = tf.gradients(y, xs, stop_gradients=stop_gradients,
                          unconnected_gradients=unconnected)
    fetch = [y] + [g for g in gs if g is not None]
    check_conversion(graph, fetch, feeds, **tol)
    expected = tf_run(graph, fetch, feeds)[1:]
    fwd = convert(forward, inputs=list(feeds), outputs=[y.name])
    res = onnxgrad.gradients(fwd, y.name, names(xs), stop_gradients=stop_gradients and names(
        stop_gradients), unconnected_gradients=unconnected)
    got = ort_run(res.model, feeds, [g for g in res.grads if g is not None])
    assert [g is None for g in res.grads] == [g is None for g in gs]
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, **{"rtol": 1e-5, "atol": 1e-6, **tol})


def test_unstack_read_loop():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [6, None], name="x")
        ta = tf.TensorArray(tf.float32, size=6, clear_after_read=False).unstack(x)

        def body(i, acc):
            return i + 1, acc + tf.sin(ta.read(i)) * ta.read(i)
        _, acc = tf.compat.v1.while_loop(lambda i, a: i < 6, body,
                                         [0, tf.zeros_like(x[0])])
        return x, tf.reduce_sum(acc * acc, name="y")
    g, (x, y) = tf1_graph(build)
    both_routes(g, y, [x], {"x:0": rand(6, 4)})


def test_write_stack_rnn_loop():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [5, None, 3], name="x")
        w = tf.constant(rand(3, 4), name="w")
        u = tf.constant(rand(4, 4) * 0.5, name="u")
        xs = tf.TensorArray(tf.float32, size=5).unstack(x)
        hs = tf.TensorArray(tf.float32, size=5)

        def body(t, h, hs):
            h = tf.tanh(tf.matmul(xs.read(t), w) + tf.matmul(h, u))
            return t + 1, h, hs.write(t, h)
        h0 = tf.zeros(tf.stack([tf.shape(x)[1], 4]))
        _, h, hs = tf.compat.v1.while_loop(lambda t, *_: t < 5, body, [0, h0, hs])
        y = tf.reduce_sum(hs.stack() ** 2, name="y") + tf.reduce_sum(h)
        return x, w, u, y
    g, (x, w, u, y) = tf1_graph(build)
    for batch in (2, 7):  # one converted graph, two batch sizes
        both_routes(g, y, [x, w, u], {"x:0": rand(5, batch, 3)})


def dynamic_rnn_lstm(x, lens, units):
    """An LSTM the way tf.compat.v1.nn.dynamic_rnn runs an LSTMCell (Keras 3 removed the cell):
    time-major TensorArrays in a while loop, and past each sequence's length the state is
    copied through and the output is zero (Select on a vector condition)."""
    steps, inputs = x.shape[1], int(x.shape[2])
    kernel = tf.compat.v1.get_variable("lstm/kernel", [inputs + units, 4 * units],
                                       initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
    bias = tf.compat.v1.get_variable("lstm/bias", [4 * units],
                                     initializer=tf.compat.v1.random_normal_initializer(seed=2))
    xt = tf.transpose(x, [1, 0, 2])
    batch = tf.shape(x)[0]
    in_ta = tf.TensorArray(tf.float32, size=steps, element_shape=[None, inputs]).unstack(xt)
    out_ta = tf.TensorArray(tf.float32, size=steps, element_shape=[None, units])
    zeros = tf.zeros(tf.stack([batch, units]))

    def body(t, c, h, out_ta):
        gates = tf.nn.bias_add(tf.matmul(tf.concat([in_ta.read(t), h], 1), kernel), bias)
        i, j, f, o = tf.split(gates, 4, axis=1)
        c_new = tf.sigmoid(f + 1.0) * c + tf.sigmoid(i) * tf.tanh(j)
        h_new = tf.sigmoid(o) * tf.tanh(c_new)
        done = t >= lens
        c_new = tf.compat.v1.where(done, c, c_new)
        h_out = tf.compat.v1.where(done, zeros, h_new)
        h_new = tf.compat.v1.where(done, h, h_new)
        return t + 1, c_new, h_new, out_ta.write(t, h_out)
    _, c, h, out_ta = tf.compat.v1.while_loop(lambda t, *_: t < steps, body,
                                              [0, zeros, zeros, out_ta])
    return tf.transpose(out_ta.stack(), [1, 0, 2]), c, h


def test_dynamic_rnn_lstm():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4, 3], name="x")
        lens = tf.compat.v1.placeholder(tf.int32, [None], name="lens")
        out, c, h = dynamic_rnn_lstm(x, lens, 5)
        y = tf.add(tf.reduce_sum(out * out), tf.reduce_sum(h * c), name="y")
        kernel = tf.compat.v1.trainable_variables()[0]
        # tf.gradients needs the while contexts, which a GraphDef does not keep: differentiate
        # before freezing
        return y, tf.gradients(y, [x, kernel])
    g, (y, grads) = tf1_graph(build)
    with g.as_default(), tf.compat.v1.Session() as s:
        s.run(tf.compat.v1.global_variables_initializer())
        frozen = tf.compat.v1.graph_util.convert_variables_to_constants(
            s, g.as_graph_def(add_shapes=True), [y.op.name] + [t.op.name for t in grads])
    gf = tf.Graph()
    with gf.as_default():
        tf.import_graph_def(frozen, name="")
    fetch = ["y:0"] + [t.name for t in grads]
    for batch, lens in ((3, [4, 2, 3]), (2, [1, 4])):
        feeds = {"x:0": rand(batch, 4, 3), "lens:0": np.array(lens, np.int32)}
        check_conversion(gf, fetch, feeds, rtol=1e-4, atol=1e-5)  # TF's gradient graph
        expected = tf_run(gf, fetch, feeds)
        fwd = convert(frozen, inputs=list(feeds), outputs=["y:0"])  # onnxgrad on the forward
        res = onnxgrad.gradients(fwd, "y:0", ["x:0", "lstm/kernel:0"])  # the frozen weight
        got = ort_run(res.model, feeds, res.grads)
        for e, gv in zip(expected[1:], got):
            np.testing.assert_allclose(gv, e, rtol=1e-4, atol=1e-5)
    assert {"lstm/kernel:0", "lstm/bias:0"} <= {i.name for i in fwd.graph.initializer}
    assert "Loop" in {n.op_type for n in fwd.graph.node}


def _frozen(graph, fetch, add_shapes):
    with graph.as_default(), tf.compat.v1.Session() as s:
        s.run(tf.compat.v1.global_variables_initializer())
        return tf.compat.v1.graph_util.convert_variables_to_constants(
            s, graph.as_graph_def(add_shapes=add_shapes), [t.split(":")[0] for t in fetch])


def _unstack_sum():  # a TensorArray unstack/read loop whose result is summed
    x = tf.compat.v1.placeholder(tf.float32, [6, None], name="x")
    w = tf.compat.v1.get_variable("w", [1], initializer=tf.compat.v1.ones_initializer())
    ta = tf.TensorArray(tf.float32, size=6, clear_after_read=False).unstack(x * w)
    _, acc = tf.compat.v1.while_loop(lambda i, a: i < 6, lambda i, a: (
        i + 1, a + tf.sin(ta.read(i)) * ta.read(i)), [0, tf.zeros_like(x[0])])
    return tf.reduce_sum(acc * acc, name="y"), [x, w], {"x:0": rand(6, 4)}


def _write_stack():  # a write/stack loop
    x = tf.compat.v1.placeholder(tf.float32, [5, None, 3], name="x")
    w = tf.compat.v1.get_variable("w", [3, 4], initializer=tf.compat.v1.glorot_uniform_initializer(
        seed=3))
    xs = tf.TensorArray(tf.float32, size=5).unstack(x)
    hs = tf.TensorArray(tf.float32, size=5)

    def body(t, h, hs):
        h = tf.tanh(tf.matmul(xs.read(t), w) + h)
        return t + 1, h, hs.write(t, h)
    _, _, hs = tf.compat.v1.while_loop(lambda t, *_: t < 5, body, [
        0, tf.zeros(tf.stack([tf.shape(x)[1], 4])), hs])
    return tf.reduce_sum(tf.sin(hs.stack()), name="y"), [x, w], {"x:0": rand(5, 2, 3)}


def _lstm_loop():  # an LSTM written as a while_loop
    x = tf.compat.v1.placeholder(tf.float32, [None, 4, 3], name="x")
    lens = tf.compat.v1.placeholder(tf.int32, [None], name="lens")
    out, c, h = dynamic_rnn_lstm(x, lens, 5)
    y = tf.add(tf.reduce_sum(out * out), tf.reduce_sum(h * c), name="y")
    return y, [x, tf.compat.v1.trainable_variables()[0]], {
        "x:0": rand(3, 4, 3), "lens:0": np.array([4, 2, 3], np.int32)}


def _broadcast_loop():  # a loop whose gradient sums over broadcast axes (w: [4] against [B, 4])
    x = tf.compat.v1.placeholder(tf.float32, [4, None, 4], name="x")
    w = tf.compat.v1.get_variable("w", [4], initializer=tf.compat.v1.ones_initializer())
    b = tf.compat.v1.get_variable("b", [1, 4], initializer=tf.compat.v1.zeros_initializer())
    xs = tf.TensorArray(tf.float32, size=4).unstack(x)
    _, h = tf.compat.v1.while_loop(lambda t, h: t < 4, lambda t, h: (
        t + 1, tf.tanh(h * w + xs.read(t) * 0.5 + b)), [0, tf.zeros_like(x[0])])
    return tf.reduce_sum(h * h, name="y"), [x, w, b], {"x:0": rand(4, 3, 4)}


@pytest.mark.parametrize("add_shapes", [True, False])
@pytest.mark.parametrize("build", [_unstack_sum, _write_stack, _lstm_loop, _broadcast_loop])
def test_frozen_tensor_array_loops(build, add_shapes):
    """tf.gradients over TensorArray while loops, frozen the usual way with and without
    add_shapes: TF's gradient graph converts and equals TF, and so do onnxgrad's gradients of
    the converted forward graph (the frozen weights under their variables' names)."""
    g, (y, xs, feeds) = tf1_graph(build)
    with control_flow(v2=False), g.as_default():
        gs = tf.gradients(y, xs)
    fetch = [y.name] + [t.name for t in gs]
    frozen = _frozen(g, fetch, add_shapes)
    gf = tf.Graph()
    with gf.as_default():
        tf.import_graph_def(frozen, name="")
    check_conversion(gf, fetch, feeds, graph_def=frozen, rtol=1e-4, atol=1e-5)
    expected = tf_run(gf, fetch, feeds)
    if not add_shapes:  # without TF's shapes at all (as where TensorFlow is not installed)
        bare = convert(frozen, inputs=list(feeds), outputs=fetch, tf_shapes=False)
        for e, got in zip(expected, ort_run(bare, feeds, fetch)):
            np.testing.assert_allclose(got, e, rtol=1e-4, atol=1e-5)
    fwd = convert(_frozen(g, [y.name], add_shapes), inputs=list(feeds), outputs=[y.name])
    res = onnxgrad.gradients(fwd, y.name, [t.name for t in xs])
    for e, got in zip(expected[1:], ort_run(res.model, feeds, res.grads)):
        np.testing.assert_allclose(got, e, rtol=1e-4, atol=1e-5)


def test_scatter_gather_concat_split_with_stop_gradient():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
        z = tf.compat.v1.placeholder(tf.float32, [5, 3], name="z")
        a = tf.TensorArray(tf.float32, size=4, clear_after_read=False).scatter([3, 0, 2, 1], x * 2.0)
        b = tf.TensorArray(tf.float32, size=2, infer_shape=False).split(z, [2, 3])
        c = a.gather([1, 3]) * tf.stop_gradient(a.read(0))
        d = b.concat()
        y = tf.add(tf.reduce_sum(c * c), tf.reduce_sum(tf.sin(d) * d) + tf.reduce_sum(
            tf.stop_gradient(x) * x), name="y")
        return x, z, y
    g, (x, z, y) = tf1_graph(build)
    both_routes(g, y, [x, z], {"x:0": rand(4, 3), "z:0": rand(5, 3)})


def test_scatter_with_run_time_indices():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [3, 2], name="x")
        idx = tf.compat.v1.placeholder(tf.int32, [3], name="idx")
        a = tf.TensorArray(tf.float32, size=4, clear_after_read=False).scatter(idx, x * 3.0)
        return tf.identity(a.read(0) + a.read(3) * 2.0, name="y")
    g, y = tf1_graph(build)
    for order in ([0, 3, 1], [3, 2, 0]):
        check_conversion(g, [y], {"x:0": rand(3, 2), "idx:0": np.array(order, np.int32)})


def test_tensor_array_grad_arrays():
    # TensorArrayGradV3: one array per (array, source), zeros shaped like the forward's elements,
    # writes add up; TensorArrayGradWithShape prepends a shape to the elements
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [3, 2], name="x")
        ta = tf.TensorArray(tf.float32, size=3).unstack(x)
        g1, f1 = tf.raw_ops.TensorArrayGradV3(handle=ta.handle, flow_in=ta.flow, source="s")
        f1 = tf.raw_ops.TensorArrayWriteV3(handle=g1, index=1, value=x[0], flow_in=f1)
        g2, f2 = tf.raw_ops.TensorArrayGradV3(handle=ta.handle, flow_in=f1, source="s")
        f2 = tf.raw_ops.TensorArrayWriteV3(handle=g2, index=1, value=x[2], flow_in=f2)
        g3, f3 = tf.raw_ops.TensorArrayGradWithShape(handle=ta.handle, flow_in=f2,
                                                     shape_to_prepend=[4], source="t")
        f3 = tf.raw_ops.TensorArrayWriteV3(handle=g3, index=2, value=tf.ones([4, 2]), flow_in=f3)
        read = lambda h, i, f: tf.raw_ops.TensorArrayReadV3(handle=h, index=i, flow_in=f,  # noqa
                                                            dtype=tf.float32)
        return [tf.identity(read(g2, 1, f2), name="summed"),
                tf.identity(read(g2, 0, f2), name="zero"),
                tf.identity(read(g3, 2, f3), name="prepended"),
                tf.identity(read(g3, 0, f3), name="prepended_zero")]
    g, outs = tf1_graph(build)
    check_conversion(g, outs, {"x:0": rand(3, 2)})


def test_stop_gradients_and_unconnected():
    # the tf.gradients docstring example: a = 0; b = 2a; gradients(a + b, [a, b], stop=[a, b])
    def build():
        p = tf.compat.v1.placeholder(tf.float32, [], name="p")
        a = tf.multiply(p, 1.0, name="a")
        b = tf.multiply(a, 2.0, name="b")
        q = tf.compat.v1.placeholder(tf.float32, [2], name="q")
        return p, a, b, q, tf.add(a, b, name="y")
    g, (p, a, b, q, y) = tf1_graph(build)
    feeds = {"p:0": np.float32(0.0), "q:0": rand(2)}
    both_routes(g, y, [a, b], feeds, stop_gradients=[a, b])
    with g.as_default():
        ga, gb = tf.gradients(y, [a, b], stop_gradients=[a, b])
        full = tf.gradients(y, [a, b])
        gq = tf.gradients(y, [q], unconnected_gradients="zero")
    assert tf_run(g, [ga, gb], feeds) == [1.0, 1.0]
    assert tf_run(g, full, feeds) == [3.0, 1.0]
    model, got = check_conversion(g, [ga, gb] + full + gq, feeds)
    assert [float(v) for v in got[:4]] == [1.0, 1.0, 3.0, 1.0]
    np.testing.assert_array_equal(got[4], np.zeros(2, np.float32))
    both_routes(g, y, [a, q], feeds, unconnected="zero")


def test_cond_becomes_if():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
        s = tf.compat.v1.placeholder(tf.float32, [], name="s")
        y = tf.compat.v1.cond(s > 0, lambda: tf.sin(x) * x, lambda: tf.exp(x) - s)
        return x, s, tf.reduce_sum(y * y, name="y")
    g, (x, s, y) = tf1_graph(build)
    for sv in (1.5, -0.5):
        model, _ = check_conversion(g, [y], {"x:0": rand(3), "s:0": np.float32(sv)})
        both_routes(g, y, [x, s], {"x:0": rand(3), "s:0": np.float32(sv)})
    assert "If" in {n.op_type for n in model.graph.node}


def test_cond_inside_while_and_nested_loops():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")

        def outer(i, acc):
            def inner(j, a):
                return j + 1, a + tf.cos(x * tf.cast(j, tf.float32))
            _, a = tf.compat.v1.while_loop(lambda j, a: j < i, inner, [0, acc])
            a = tf.compat.v1.cond(tf.equal(i % 2, 0), lambda: a * x, lambda: a + x)
            return i + 1, a
        _, acc = tf.compat.v1.while_loop(lambda i, a: i < 4, outer, [0, x])
        return x, tf.reduce_sum(acc, name="y")
    g, (x, y) = tf1_graph(build)
    both_routes(g, y, [x], {"x:0": rand(2)})


def test_stack_push_pop_across_loops():
    # what tf.gradients builds for a while loop: a forward loop that pushes, a backward loop
    # that pops, here written by hand with the raw ops
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
        st = tf.raw_ops.StackV2(max_size=-1, elem_type=tf.float32, stack_name="s")
        pushes = []
        v = x
        for k in range(3):  # pushes ordered by control edges, as in a loop
            with tf.control_dependencies(pushes[-1:]):
                v = tf.sin(v) + float(k)
                pushes.append(tf.raw_ops.StackPushV2(handle=st, elem=v))
        # (a popped value has no static shape, in TF either: reshape so the output has a rank)
        with tf.control_dependencies(pushes):
            a = tf.raw_ops.StackPopV2(handle=st, elem_type=tf.float32)
        with tf.control_dependencies([a]):
            b = tf.raw_ops.StackPopV2(handle=st, elem_type=tf.float32)
        return tf.reshape(a * 10.0 + b, [3], name="y")
    g, y = tf1_graph(build)
    check_conversion(g, [y], {"x:0": rand(3)})


def test_errors_name_the_problem():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
        return tf.raw_ops.BesselJ0(x=x, name="odd")
    g, y = tf1_graph(build)
    with pytest.raises(ConversionError, match="'BesselJ0'.*'odd'"):
        convert(g.as_graph_def(), outputs=[y.name])
    with pytest.raises(ConversionError, match="no node 'nope'"):
        convert(g.as_graph_def(), outputs=["nope:0"])
    with pytest.raises(ConversionError, match="outputs"):
        convert(g.as_graph_def(), outputs=[])
