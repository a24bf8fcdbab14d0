"""TF2 graphs -> ONNX: functional control flow (While/If/Case with FunctionDef bodies, function
calls), TensorList ops, SavedModel directories (Keras LSTM/GRU) and ``onnxgrad convert``. TF (the
test extra) is the oracle; the converted models run on stock onnxruntime (CPU)."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from tf_util import check_conversion, ort_run, tf, tf1_graph  # (skips the module without TF)

from onnxgrad import cli  # noqa: E402
from onnxgrad.converters.tensorflow import ConversionError, convert  # noqa: E402
from onnxgrad.converters.tensorflow import functions, savedmodel  # noqa: E402
from onnxgrad import NotDifferentiableError  # noqa: E402
from util import assert_gradients  # noqa: E402

RNG = np.random.default_rng(0)


def _concrete(fn, *specs):
    return tf.function(fn).get_concrete_function(*specs)


def tf_graph_run(graph_def, fetches: list[str], feeds: dict) -> list:
    """Run a GraphDef (functions included) in TF: the oracle, in graph mode or eager mode alike
    (other test modules switch this process to TF1 graph mode for good)."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=g) as s:
        return s.run(fetches, feeds)


def check(fn, specs, feeds, rtol=1e-5, atol=1e-6):
    """Trace ``fn`` for ``specs`` (TensorSpecs), convert its GraphDef, run it on onnxruntime with
    ``feeds`` (arrays, one per spec) and compare with TF; returns (model, run) where
    ``run(*arrays)`` checks other inputs on the same model."""
    cf = _concrete(fn, *specs)
    gd = cf.graph.as_graph_def()
    ins = [t.name for t in cf.inputs]
    outs = [t.name for t in cf.outputs]
    model = convert(gd, inputs=ins, outputs=outs)

    def run(*arrays):
        expected = tf_graph_run(gd, outs, dict(zip(ins, arrays)))
        got = ort_run(model, dict(zip(ins, arrays)), outs)
        assert len(got) == len(expected)
        for name, e, g in zip(outs, expected, got):
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=name)

    run(*feeds)
    return model, run, gd


def _ops(model) -> set:
    found = set()

    def walk(g):
        for nd in g.node:
            found.add(nd.op_type)
            for a in nd.attribute:
                if a.g.node:
                    walk(a.g)

    walk(model.graph)
    return found


def _f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


# -- functional control flow ------------------------------------------------------------------
def test_while_tensorarray_and_cond():
    def f(x):
        n = tf.shape(x)[0]
        ta = tf.TensorArray(tf.float32, size=n)

        def body(i, h, ta):
            h = tf.tanh(h + x[i])
            return i + 1, h, ta.write(i, h)

        _, h, ta = tf.while_loop(lambda i, *_: i < n, body, [0, tf.zeros([3]), ta])
        y = tf.cond(tf.reduce_sum(h) > 0, lambda: h * 2.0, lambda: h - 1.0)
        return ta.stack(), y

    model, run, gd = check(f, [tf.TensorSpec([None, 3], tf.float32)], [_f32(6, 3)])
    assert {"While", "StatelessWhile"} & {n.op for n in gd.node}
    assert {"Loop", "If"} <= _ops(model)
    run(_f32(1, 3))  # another length
    run(_f32(4, 3) + 3.0)  # the other branch


def test_nested_while_loops_with_tensorarrays():
    def f(x):  # x: [R, C]; per row, a cumulative product over the columns, stacked
        rows, cols = tf.shape(x)[0], tf.shape(x)[1]
        outer = tf.TensorArray(tf.float32, size=rows)

        def row(i, outer):
            inner = tf.TensorArray(tf.float32, size=cols)

            def col(j, acc, inner):
                acc = acc * x[i, j] + 1.0
                return j + 1, acc, inner.write(j, acc)

            _, _, inner = tf.while_loop(lambda j, *_: j < cols, col, [0, 1.0, inner])
            return i + 1, outer.write(i, inner.stack())

        _, outer = tf.while_loop(lambda i, _: i < rows, row, [0, outer])
        return outer.stack()

    model, run, _ = check(f, [tf.TensorSpec([None, None], tf.float32)], [_f32(3, 4)])
    run(_f32(2, 5))
    loops = [a.g for nd in model.graph.node if nd.op_type == "Loop" for a in nd.attribute]
    assert loops and any(nd.op_type == "Loop" for g in loops for nd in g.node)  # nested


def test_while_maximum_iterations_and_loop_invariants():
    def f(x, w):
        def body(i, h):
            return i + 1, tf.tanh(tf.matmul(h, w) + x)

        return tf.while_loop(lambda i, h: True, body, [0, x], maximum_iterations=4)[1]

    check(f, [tf.TensorSpec([2, 3], tf.float32), tf.TensorSpec([3, 3], tf.float32)],
          [_f32(2, 3), _f32(3, 3)])


def test_cond_with_tensorlist_and_tuple_outputs():
    def f(x, p):
        ta = tf.TensorArray(tf.float32, size=2)

        def yes():
            return ta.write(0, x * 2.0).write(1, x), tf.reduce_sum(x)

        def no():
            return ta.write(0, -x).write(1, x + 1.0), tf.reduce_max(x)

        ta2, s = tf.cond(p, yes, no)
        return ta2.stack(), s

    _, run, _ = check(f, [tf.TensorSpec([3], tf.float32), tf.TensorSpec([], tf.bool)],
                      [_f32(3), np.array(True)])
    run(_f32(3), np.array(False))


def test_switch_case_and_function_calls():
    @tf.function
    def inner(a, b):  # a tf.function called from another: a (Stateful)PartitionedCall
        return a * b + 1.0, a - b

    def f(x, k):
        s, d = inner(x, x)
        y = tf.switch_case(k, [lambda: s, lambda: d * 3.0, lambda: tf.exp(x)])
        return y + s

    _, run, gd = check(f, [tf.TensorSpec([4], tf.float32), tf.TensorSpec([], tf.int32)],
                       [_f32(4), np.array(1, np.int32)])
    ops = {n.op for n in gd.node}
    assert ops & {"PartitionedCall", "StatefulPartitionedCall"} and ops & {"Case",
                                                                            "StatelessCase"}
    for k in (0, 2, 7):  # 7: out of range takes the last branch, as in TF
        run(_f32(4), np.array(k, np.int32))


def test_multi_output_op_in_a_function_body():
    """A loop body reading the second output argument of an op (``TopKV2:indices:0``)."""
    def f(x):
        def body(i, acc):
            v, idx = tf.math.top_k(x + tf.cast(i, tf.float32), k=2)
            return i + 1, acc + tf.cast(idx, tf.float32) + v

        return tf.while_loop(lambda i, _: i < 3, body, [0, tf.zeros([2])])[1]

    cf = _concrete(f, tf.TensorSpec([5], tf.float32))
    body = next(fn for fn in cf.graph.as_graph_def().library.function
                if any(nd.op == "TopKV2" for nd in fn.node_def))
    assert any(":indices:" in i for nd in body.node_def for i in nd.input)
    check(f, [tf.TensorSpec([5], tf.float32)], [_f32(5)])
    # the flat index, from the table and without it
    nd = next(nd for nd in body.node_def if nd.op == "TopKV2")
    assert functions._arg_offset(nd, "indices", {"values", "indices"}, {}, "f") == 1
    assert functions._arg_offset(nd, "values", {"values"}, {}, "f") == 0


def test_unknown_multi_output_op_is_an_error(monkeypatch):
    monkeypatch.setattr(functions, "_registry_output_args", lambda op: None)
    from onnxgrad.converters.tensorflow.proto import NodeDef
    nd = NodeDef(name="n", op="MadeUpOp")
    with pytest.raises(ConversionError, match="output layout of op 'MadeUpOp'"):
        functions._arg_offset(nd, "b", {"a", "b"}, {}, "f")
    assert functions._arg_offset(nd, "a", {"a"}, {}, "f") == 0


def test_tf1_graph_with_control_flow_v2_and_gradients():
    """A TF1 graph built with control flow v2: While/If with function bodies, TensorArrays as
    TensorLists, and tf.gradients through them (accumulator lists pushed in the forward loop and
    popped in the backward one, ZerosLike/AddN of lists)."""
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
        w = tf.constant(RNG.standard_normal((3, 3)).astype(np.float32), name="w")
        ta = tf.TensorArray(tf.float32, size=4).unstack(x)
        out = tf.TensorArray(tf.float32, size=4)

        def body(i, h, out):
            h = tf.tanh(tf.matmul(tf.expand_dims(ta.read(i), 0), w) + h)
            return i + 1, h, out.write(i, h[0])

        _, h, out = tf.while_loop(lambda i, *_: i < 4, body, [0, tf.zeros([1, 3]), out])
        st = out.stack()
        y = tf.cond(tf.reduce_sum(h) > 0, lambda: tf.reduce_sum(st * st),
                    lambda: tf.reduce_sum(st), name="y")
        return [y, *tf.gradients(y, [x, w])]

    g, outs = tf1_graph(build, control_flow_v2=True)
    gd = g.as_graph_def()
    assert {"StatelessWhile", "StatelessIf", "TensorListReserve"} <= {n.op for n in gd.node}
    check_conversion(g, outs, {"x:0": _f32(4, 3)}, graph_def=gd)


# -- TensorList ops ----------------------------------------------------------------------------
def test_tensorarray_ops_in_tf_function():
    def f(x, idx):  # x: [4, 3]
        ta = tf.TensorArray(tf.float32, size=4).unstack(x)  # TensorListFromTensor
        g = ta.gather(idx)  # TensorListGather
        dyn = tf.TensorArray(tf.float32, size=0, dynamic_size=True)  # grows on write
        for k in range(3):
            dyn = dyn.write(k, ta.read(k) * float(k + 1))
        sc = tf.TensorArray(tf.float32, size=5).scatter([4, 0], x[:2])  # ScatterIntoExisting
        parts = tf.TensorArray(tf.float32, size=2, infer_shape=False).split(
            tf.reshape(x, [12]), [5, 7])  # TensorListSplit
        cat = parts.concat()  # TensorListConcatV2
        return g, dyn.stack(), dyn.size(), sc.stack(), cat, ta.size()

    check(f, [tf.TensorSpec([4, 3], tf.float32), tf.TensorSpec([3], tf.int32)],
          [_f32(4, 3), np.array([3, 0, 2], np.int32)])


@settings(max_examples=16, deadline=None, derandomize=True)
@given(st.sampled_from(["iteration", "constant"]), st.booleans(), st.booleans(), st.data())
def test_while_writing_its_list_once_per_iteration(at, shaped, read_back, data):
    """A While that writes its list once per iteration, at the iteration number or at one
    constant index (a Keras RNN without return_sequences writes its output at 0 every time),
    and reads it only after the loop becomes a Loop with a scan output, no list carried or copied
    per write; one that reads the written list back in the body keeps it carried (the form read
    the list from before the loop there: wrong values, no error). Either way the stacked list
    and the last state equal TF's for trip counts from 0 (from 1 for a list of unknown element
    shape, which TF cannot stack unwritten), and the gradient matches float64 finite
    differences."""
    size = 3 if at == "iteration" else data.draw(st.integers(1, 3), label="size")
    k = data.draw(st.integers(0, size - 1), label="index")

    def f(x, steps):  # x [3, 2]
        ta = tf.TensorArray(tf.float32, size=size, element_shape=[3, 2] if shaped else None)

        def body(i, h, ta):
            at_ = i if at == "iteration" else k
            h = tf.tanh(h * 1.5 + x)
            ta = ta.write(at_, h * 2.0)
            return i + 1, (h + ta.read(at_) * 0.5 if read_back else h), ta
        _, h, ta = tf.while_loop(lambda i, h, ta: i < steps, body, [0, x, ta])
        return ta.stack(), h

    specs = [tf.TensorSpec([3, 2], tf.float32), tf.TensorSpec([], tf.int32)]
    model, run, _ = check(f, specs, [_f32(3, 2), np.int32(0 if shaped else 1)])
    ops = _ops(model)
    assert "Loop" in ops and bool({"SequenceInsert", "SequenceErase"} & ops) == read_back
    for n in (1, 3):
        run(_f32(3, 2), np.int32(n))
    x = model.graph.input[0].name
    feeds = {x: _f32(3, 2), model.graph.input[1].name: np.array(2, np.int32)}
    assert_gradients(model, [o.name for o in model.graph.output], [x], feeds)


# one op of a random loop program: (kind, list, index) with kind "write" or "read" and index
# "i" (the iteration number), "i+1", or a constant
_PROGRAM_OP = st.tuples(st.sampled_from(["write", "read", "write_if_even", "gather", "size"]),
                        st.integers(0, 1), st.sampled_from(["i", "i+1", 0, 1, 2]))
_LIST_KIND = st.sampled_from(["reserved", "tensor", "dynamic"])


@settings(max_examples=24, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much])
@given(st.lists(_PROGRAM_OP, min_size=1, max_size=4), st.lists(_LIST_KIND, min_size=2,
                                                               max_size=2),
       st.sampled_from([0, 1, 3]))
@example([("write", 1, "i"), ("read", 1, "i")], ["reserved", "reserved"], 3)  # (found, fixed)
@example([("write", 0, "i")], ["dynamic", "reserved"], 1)  # (found, fixed)
def test_random_while_programs_on_lists(program, kinds, steps):
    """Random TF2 while loops over two TensorArrays (reserved with a known element shape, made
    from a tensor, or growing from empty), whose bodies write (also inside a cond), read, gather
    and size them at the iteration number, the next one or a constant index, in any order,
    around a state h = tanh(1.5 h + x):
    the converted model's stacked lists and final state equal TF's (every loop form: lists
    carried, written as scan outputs, read back, grown), and their gradients match float64
    finite differences. Programs TF itself refuses (a read past a grown list's end) are
    skipped."""
    size = 5  # every index the programs use (up to 3 trips, "i+1") is inside fixed lists

    def idx(i, at):
        return i if at == "i" else i + 1 if at == "i+1" else at

    def make(kind, x):
        if kind == "dynamic":
            return tf.TensorArray(tf.float32, size=0, dynamic_size=True, element_shape=[3, 2])
        ta = tf.TensorArray(tf.float32, size=size, element_shape=[3, 2])
        return ta.unstack(tf.stack([x * (j + 1.0) for j in range(size)])) if kind == "tensor" \
            else ta

    def f(x, steps_):  # x [3, 2]
        def body(i, h, ta0, ta1):
            tas_ = [ta0, ta1]
            h = tf.tanh(h * 1.5 + x)
            for kind, which, at in program:
                ta, k = tas_[which], idx(i, at)
                if kind == "write":
                    tas_[which] = ta.write(k, h * (2.0 + which))
                elif kind == "write_if_even":  # a write inside a cond
                    tas_[which] = tf.cond(i % 2 == 0, lambda: ta.write(k, h * 3.0), lambda: ta)
                elif kind == "read":
                    h = h + 0.5 * ta.read(k)
                elif kind == "gather":
                    h = h + 0.25 * tf.reduce_sum(ta.gather([0, k]), axis=0)
                else:
                    h = h + 0.01 * tf.cast(ta.size(), tf.float32)
            return (i + 1, h, *tas_)
        _, h, ta0, ta1 = tf.while_loop(lambda i, *_: i < steps_, body,
                                       [0, x, *(make(k, x) for k in kinds)])
        return ta0.stack(), ta1.stack(), h

    specs = [tf.TensorSpec([3, 2], tf.float32), tf.TensorSpec([], tf.int32)]
    x0 = _f32(3, 2)
    try:
        tf.function(f).get_concrete_function(*specs)(tf.constant(x0), tf.constant(steps))
    except tf.errors.OpError:
        assume(False)
    model, run, _ = check(f, specs, [x0, np.int32(steps)])
    if steps:
        x = model.graph.input[0].name
        feeds = {x: x0, model.graph.input[1].name: np.array(steps, np.int32)}
        try:
            assert_gradients(model, [o.name for o in model.graph.output], [x], feeds)
        except NotDifferentiableError as err:  # a listed limitation, refused by name
            assert "write_if_even" in {p[0] for p in program} and "cannot be rebuilt" in str(err)


def test_tensorlist_push_pop_and_element_shape():
    def f(x):
        lst = tf.raw_ops.EmptyTensorList(element_shape=tf.constant([3], tf.int32),
                                         max_num_elements=-1, element_dtype=tf.float32)
        for k in range(3):
            lst = tf.raw_ops.TensorListPushBack(input_handle=lst, tensor=x * float(k))
        lst, last = tf.raw_ops.TensorListPopBack(input_handle=lst, element_shape=[3],
                                                 element_dtype=tf.float32)
        shape = tf.raw_ops.TensorListElementShape(input_handle=lst, shape_type=tf.int32)
        n = tf.raw_ops.TensorListLength(input_handle=lst)
        stacked = tf.raw_ops.TensorListStack(input_handle=lst, element_shape=[3],
                                             element_dtype=tf.float32)
        empty = tf.raw_ops.TensorListStack(
            input_handle=tf.raw_ops.TensorListReserve(element_shape=[2], num_elements=0,
                                                      element_dtype=tf.float32),
            element_shape=[2], element_dtype=tf.float32)
        grown = tf.raw_ops.TensorListResize(input_handle=lst, size=4)  # 2 -> 4 (zeros)
        grown = tf.raw_ops.TensorListSetItem(input_handle=grown, index=3, item=x)
        shrunk = tf.raw_ops.TensorListResize(input_handle=grown, size=1)
        return last, shape, n, stacked, empty, tf.raw_ops.TensorListLength(input_handle=grown), \
            tf.raw_ops.TensorListGetItem(input_handle=grown, index=3, element_shape=[3],
                                         element_dtype=tf.float32), \
            tf.raw_ops.TensorListStack(input_handle=shrunk, element_shape=[3],
                                       element_dtype=tf.float32)

    check(f, [tf.TensorSpec([3], tf.float32)], [_f32(3)])


def test_tensorlist_scatter_new_list():
    def f(x):
        lst = tf.raw_ops.TensorListScatterV2(tensor=x, indices=[2, 0], element_shape=[3],
                                             num_elements=4)
        return tf.raw_ops.TensorListStack(input_handle=lst, element_shape=[3],
                                          element_dtype=tf.float32)

    check(f, [tf.TensorSpec([2, 3], tf.float32)], [_f32(2, 3)])


# -- SavedModel: Keras LSTM / GRU ----------------------------------------------------------------
@pytest.fixture(scope="module")
def keras_models(tmp_path_factory):
    """SavedModels of Keras models with an LSTM / a GRU layer (units 8, 5 steps, 3 features)
    and Keras's predict on a batch. Keras needs TF's eager mode, which other test modules switch
    off for the whole process: it runs in an eager-mode context."""
    keras = pytest.importorskip("keras")
    from tensorflow.python.eager import context

    d = tmp_path_factory.mktemp("keras")
    ref = {"x": np.random.default_rng(1).standard_normal((4, 5, 3)).astype(np.float32)}
    with context.eager_mode():
        for name in ("LSTM", "GRU"):
            keras.utils.set_random_seed(0)
            inp = keras.Input((5, 3))
            model = keras.Model(inp, getattr(keras.layers, name)(8)(inp))
            model.export(str(d / name), verbose=False)
            ref[name] = model.predict(ref["x"], verbose=0)
    return d, ref


@pytest.mark.parametrize("name", ["LSTM", "GRU"])
def test_keras_rnn_saved_model_matches_predict(keras_models, name):
    d, ref = keras_models
    onnx_model = convert(d / name)
    (inp,), (out,) = onnx_model.graph.input, onnx_model.graph.output
    assert "Loop" in _ops(onnx_model)
    # the last output, written at 0 every iteration, is a scan output: no list in the loop
    assert not {"SequenceInsert", "SequenceErase"} & _ops(onnx_model)
    got = ort_run(onnx_model, {inp.name: ref["x"]}, [out.name])[0]
    np.testing.assert_allclose(got, ref[name], rtol=1e-5, atol=1e-5)
    if name == "LSTM":  # inputs/outputs may be named by the signature's keys
        ins, outs = savedmodel.signature_names(d / name)
        assert list(ins.values()) == [inp.name] and list(outs.values()) == [out.name]
        same = convert(str(d / name), inputs=list(ins), outputs=list(outs),
                       signature="serving_default")
        assert [o.name for o in same.graph.output] == [out.name]
    else:
        with pytest.raises(ConversionError, match="no signature 'nope'"):
            convert(d / name, signature="nope")


# -- the command line ------------------------------------------------------------------------
def test_cli_convert_graph_def_and_saved_model(tmp_path, capsys, keras_models):
    import onnx

    def f(x):
        return tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h * 2.0 + x), [0, x])[1]

    cf = _concrete(f, tf.TensorSpec([2], tf.float32))
    gd, y = cf.graph.as_graph_def(), cf.outputs[0].name
    pb = tmp_path / "graph.pb"
    pb.write_bytes(gd.SerializeToString())
    out = tmp_path / "g.onnx"
    assert cli.main(["convert", str(pb), "-o", str(out), "--inputs", "x:0", "--outputs", y]) == 0
    assert "wrote" in capsys.readouterr().out
    x = _f32(2)
    got = ort_run(onnx.load(str(out)), {"x:0": x}, [y])[0]
    np.testing.assert_allclose(got, tf_graph_run(gd, [y], {"x:0": x})[0], rtol=1e-6)

    d, ref = keras_models
    out2 = tmp_path / "gru.onnx"
    assert cli.main(["convert", str(d / "GRU"), "-o", str(out2), "--opset", "18",
                     "--signature", "serving_default"]) == 0
    m = onnx.load(str(out2))
    got = ort_run(m, {m.graph.input[0].name: ref["x"]}, [m.graph.output[0].name])[0]
    np.testing.assert_allclose(got, ref["GRU"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["convert", "{tmp}/missing.pb", "-o", "{tmp}/m.onnx", "--outputs", "y:0"], "no such file"),
    (["convert", "{tmp}/graph.pb", "-o", "{tmp}/m.onnx", "--outputs", "nope:0"],
     "the graph has no node 'nope'"),
    (["convert", "{tmp}/graph.pb", "-o", "{tmp}/m.onnx"], "--outputs"),
    (["convert", "{tmp}/sub", "-o", "{tmp}/m.onnx"], "not a SavedModel"),
    (["convert", "{tmp}", "-o", "{tmp}/m.onnx"], "inside the TensorFlow graph"),
])
def test_cli_convert_errors(tmp_path, capsys, argv, message):
    (tmp_path / "sub").mkdir()
    (tmp_path / "graph.pb").write_bytes(
        _concrete(lambda x: x + 1.0, tf.TensorSpec([2], tf.float32)).graph.as_graph_def()
        .SerializeToString())
    code = cli.main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "m.onnx").exists()


def test_missing_tensorflow_is_a_clear_error(tmp_path, capsys, monkeypatch):
    sm = tmp_path / "sm"
    sm.mkdir()
    (sm / "saved_model.pb").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # `import tensorflow` now fails
    with pytest.raises(savedmodel.TensorFlowMissingError, match=r"onnxgrad\[tensorflow\]"):
        convert(sm)
    code = cli.main(["convert", str(sm), "-o", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err
    assert code == 2 and "needs TensorFlow" in err and "pip install 'onnxgrad[tensorflow]'" in err
    assert "Traceback" not in err
