"""Sequence-op gradients (TensorArray semantics) against finite differences, the S@src naming of
gradient sequences, and a sweep over onnx's own sequence / control-flow test cases."""
import functools

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

import onnxgrad
from onnxgrad.runtime import run
from util import assert_gradients, vi_model

F = np.float32
N = h.make_node


def vi(name, t=TP.FLOAT, shape=None):
    return h.make_tensor_value_info(name, t, shape)


model = vi_model


def i64(v):
    return np.array(v, np.int64)


def test_construct_at_reads_add_up():
    # element 1 read twice (once by a negative index): both contributions reach b
    m = model([N("SequenceConstruct", ["a", "b", "c"], ["s"]),
               N("SequenceAt", ["s", "one"], ["r1"]), N("SequenceAt", ["s", "neg2"], ["r2"]),
               N("SequenceAt", ["s", "zero"], ["r0"]), N("Mul", ["r1", "r2"], ["p"]),
               N("Mul", ["p", "r0"], ["y"])],
              [vi("a", shape=[3]), vi("b", shape=[3]), vi("c", shape=[3])], [vi("y", shape=[3])],
              inits={"one": i64(1), "neg2": i64(-2), "zero": i64(0)})
    r = assert_gradients(m, "y", ["a", "b", "c"])
    a, b = r.feeds["a"], r.feeds["b"]
    cot = r.cotangents["__cotangent_0"]
    np.testing.assert_allclose(r.results[1].grad, 2 * b * a * cot, rtol=1e-6)
    np.testing.assert_array_equal(r.results[2].grad, 0)  # c is in the sequence but never read


@pytest.mark.parametrize("pos", [None, 0, 1, -1])
def test_insert(pos):
    ins = ["s0", "t"] + (["pos"] if pos is not None else [])
    m = model([N("SequenceConstruct", ["a", "b"], ["s0"]), N("SequenceInsert", ins, ["s"]),
               N("ConcatFromSequence", ["s"], ["c"], axis=0), N("Mul", ["c", "w"], ["y"])],
              [vi("a", shape=[2]), vi("b", shape=[2]), vi("t", shape=[2])], [vi("y", shape=[6])],
              inits={"pos": i64(pos or 0), "w": np.arange(1, 7, dtype=F)})
    assert_gradients(m, "y", ["a", "b", "t"])


@pytest.mark.parametrize("pos", [None, 0, -2])
def test_erase(pos):
    ins = ["s0"] + (["pos"] if pos is not None else [])
    m = model([N("SequenceConstruct", ["a", "b", "c"], ["s0"]), N("SequenceErase", ins, ["s"]),
               N("ConcatFromSequence", ["s"], ["y"], axis=1, new_axis=1)],
              [vi("a", shape=[2]), vi("b", shape=[2]), vi("c", shape=[2])], [vi("y", shape=[2, 2])],
              inits={"pos": i64(pos or 0)})
    r = assert_gradients(m, "y", ["a", "b", "c"])
    erased = {None: 2, 0: 0, -2: 1}[pos]
    np.testing.assert_array_equal(r.results[erased].grad, 0)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_elements_of_different_sizes(axis):
    shapes = {"a": [2, 3], "b": [2, 1], "c": [2, 2]} if axis else {"a": [1, 3], "b": [3, 3],
                                                                   "c": [2, 3]}
    m = model([N("SequenceConstruct", list(shapes), ["s"]),
               N("ConcatFromSequence", ["s"], ["cat"], axis=axis), N("Sin", ["cat"], ["y"])],
              [vi(k, shape=v) for k, v in shapes.items()], [vi("y")])
    assert_gradients(m, "y", list(shapes))


@pytest.mark.parametrize("split,keepdims", [(None, 1), (None, 0), ("scalar", 1), ("list", 1)])
def test_split_to_sequence(split, keepdims):
    inits, ins = {"w": np.arange(20, dtype=F).reshape(4, 5) / 10}, ["x"]
    if split == "scalar":
        inits["sp"], ins = i64(2), ["x", "sp"]  # chunks 2, 2, 1 along axis 1
    elif split == "list":
        inits["sp"], ins = i64([1, 4]), ["x", "sp"]
    m = model([N("Mul", ["x0", "w"], ["x"]),
               N("SplitToSequence", ins, ["s"], axis=1, keepdims=keepdims),
               N("SequenceAt", ["s", "k"], ["e0"]), N("SequenceAt", ["s", "k"], ["e1"]),
               N("Mul", ["e0", "e1"], ["sq"]), N("ConcatFromSequence", ["s"], ["cat"], axis=1,
                                                 new_axis=0 if keepdims else 1),
               N("ReduceSum", ["sq"], ["r"], keepdims=0), N("Mul", ["cat", "r"], ["y"])],
              [vi("x0", shape=[4, 5])], [vi("y", shape=[4, 5])], inits={**inits, "k": i64(1)})
    assert_gradients(m, "y", ["x0"])


def test_sequence_map_with_tensor_and_captured_inputs():
    b_ = h.make_graph([N("Mul", ["e", "t"], ["m"]), N("Mul", ["m", "w"], ["m2"]),
                       N("Sin", ["m2"], ["o"])], "body",
                      [vi("e", shape=[3]), vi("t", shape=[3])], [vi("o", shape=[3])])
    m = model([N("SequenceConstruct", ["a", "b"], ["s"]),
               N("SequenceMap", ["s", "t"], ["so"], body=b_),
               N("ConcatFromSequence", ["so"], ["y"], axis=0, new_axis=1)],
              [vi("a", shape=[3]), vi("b", shape=[3]), vi("t", shape=[3]), vi("w", shape=[3])],
              [vi("y", shape=[2, 3])])
    assert_gradients(m, "y", ["a", "b", "t", "w"])


def seq_read_model():
    return model([N("SequenceConstruct", ["a", "b"], ["S"]), N("SequenceAt", ["S", "zero"], ["r0"]),
                  N("SequenceAt", ["S", "zero"], ["r1"]), N("Mul", ["r0", "r1"], ["y"])],
                 [vi("a", shape=[3]), vi("b", shape=[3])], [vi("y", shape=[3])],
                 inits={"zero": i64(0)})


def test_gradient_sequence_named_after_source_and_calls_kept_apart():
    res = onnxgrad.gradients(seq_read_model(), "y", ["a"])
    names = {o for n in res.model.graph.node for o in n.output}
    assert "S@gradients" in names
    # a second call on the result keeps its own accumulator: no double counting
    res2 = onnxgrad.gradients(res.model, ["y", res.grads[0]], ["a", "b"])
    names2 = {o for n in res2.model.graph.node for o in n.output}
    assert "S@gradients_1" in names2 and "S@gradients" in names2
    a = np.array([1.0, 2.0, -3.0], F)
    ga, gb = run(res2.model, {"a": a, "b": np.ones(3, F)}, res2.grads)
    np.testing.assert_allclose(ga, 2 * a + 2)  # d/da (a*a + sum(2a)) elementwise
    np.testing.assert_array_equal(gb, 0)


# -- the onnx backend cases as a sweep --------------------------------------------------------
# left out, as they have no float input or output to differentiate: test_if_seq,
# test_sequence_model6 and test_sequence_model8 (they output only lengths);
# test_nothing_to_differentiate below keeps that statement true
NODE_CASES = ["test_loop11", "test_scan9_sum", "test_scan9_multi_state",
              "test_scan9_scalar",
              "test_sequence_map_identity_1_sequence", "test_sequence_map_identity_2_sequences",
              "test_sequence_map_identity_1_sequence_1_tensor",
              "test_sequence_map_add_2_sequences", "test_sequence_map_add_1_sequence_1_tensor",
              "test_split_to_sequence_nokeepdims"]
MODEL_CASES = [f"test_sequence_model{i}" for i in (1, 2, 3, 4, 5, 7)]


@functools.lru_cache(maxsize=None)
def _cases():
    """Import only the case modules needed (collect_testcases() builds every case, ~25 s)."""
    import importlib
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mod in ["node.loop", "node.scan", "node.if_", "node.sequence_map",
                    "node.splittosequence", "model.sequence"]:
            importlib.import_module(f"onnx.backend.test.case.{mod}")
    from onnx.backend.test.case import model as mcases
    from onnx.backend.test.case import node as ncases
    return {c.name: c for c in [*mcases._SimpleModelTestCases, *ncases._NodeTestCases]}


def _tensorize(case):
    """The case's model with sequence inputs built from tensor inputs (SequenceConstruct) and
    sequence outputs read element by element (SequenceAt), so both ends are float tensors."""
    m = onnx.ModelProto.FromString(case.model.SerializeToString())
    inputs, outputs = case.data_sets[0]
    g = m.graph
    feeds, pre, ys = {}, [], []
    for vinfo, val in zip(list(g.input), inputs):
        if vinfo.type.HasField("sequence_type"):
            names = [f"{vinfo.name}__{k}" for k in range(len(val))]
            for nm, arr in zip(names, val):
                feeds[nm] = np.asarray(arr)
                g.input.append(h.make_tensor_value_info(
                    nm, h.np_dtype_to_tensor_dtype(np.asarray(arr).dtype), np.shape(arr)))
            pre.append(N("SequenceConstruct", names, [vinfo.name]))
            g.input.remove(vinfo)
        else:
            feeds[vinfo.name] = np.asarray(val)
    for vinfo, val in zip(list(g.output), outputs):
        if vinfo.type.HasField("sequence_type"):
            for k in range(len(val)):
                nm = f"{vinfo.name}__{k}"
                g.initializer.append(onnx.numpy_helper.from_array(i64(k), f"{nm}_pos"))
                g.node.append(N("SequenceAt", [vinfo.name, f"{nm}_pos"], [nm]))
                g.output.append(h.make_tensor_value_info(
                    nm, h.np_dtype_to_tensor_dtype(np.asarray(val[k]).dtype), None))
                ys.append(nm)
        elif np.asarray(val).dtype.kind == "f":
            ys.append(vinfo.name)
    for n_ in reversed(pre):
        g.node.insert(0, n_)
    for n_ in g.node:  # an explicit dtype, so that the float64 copy of the check retypes it
        if n_.op_type == "SequenceEmpty" and not any(a.name == "dtype" for a in n_.attribute):
            n_.attribute.append(h.make_attribute("dtype", TP.FLOAT))
    xs = [k for k, v in feeds.items() if v.dtype.kind == "f"]
    return m, feeds, ys, xs


@pytest.mark.parametrize("name", MODEL_CASES + NODE_CASES)
def test_onnx_backend_case_sweep(name):
    m, feeds, ys, xs = _tensorize(_cases()[name])
    assert xs and ys
    assert_gradients(m, ys, xs, feeds=feeds, f32=False)


@pytest.mark.parametrize("name", ["test_if_seq", "test_sequence_model6", "test_sequence_model8"])
def test_nothing_to_differentiate(name):
    _, _, ys, xs = _tensorize(_cases()[name])
    assert not xs or not ys


# -- onnxgrad.TensorArray -----------------------------------------------------------------------
from onnxgrad.sequences import Builder, InvalidArgumentError  # noqa: E402


def test_tensor_array_unstack_read_write_stack_gradients():
    b = Builder()
    x = b.input("x", F, [4, 2])
    w = b.input("w", F, [2])
    ta = onnxgrad.TensorArray(b, F, size=4, element_shape=[2], clear_after_read=False)
    ta = ta.unstack(x)
    out = onnxgrad.TensorArray(b, F, size=3, element_shape=[2])
    out = out.write(0, b.node("Mul", [ta.read(0), w]))
    out = out.write(2, b.node("Sin", [ta.read(3)]))
    out = out.write(1, b.node("Mul", [ta.read(3), ta.read(1)]))
    y = b.output(b.node("Mul", [out.stack(), b.node("Cast", [out.size()], to=1)]))
    g = b.output(ta.gather([3, 0]))
    m = b.model()
    xv = np.arange(8, dtype=F).reshape(4, 2) / 4
    wv = np.array([2.0, -1.0], F)
    yv, gv = run(m, {"x": xv, "w": wv}, [y, g])
    np.testing.assert_allclose(yv, 3 * np.stack([xv[0] * wv, xv[3] * xv[1], np.sin(xv[3])]),
                               rtol=1e-6)
    np.testing.assert_allclose(gv, xv[[3, 0]])
    assert_gradients(m, [y, g], ["x", "w"])
    res = onnxgrad.gradients(m, y, "x")
    names = {o for n in res.model.graph.node for o in n.output}
    assert ta.grad("gradients").flow in names  # the source-named gradient sequence


def test_tensor_array_concat_split_and_dynamic_size():
    b = Builder()
    x = b.input("x", F, [5, 3])
    ta = onnxgrad.TensorArray(b, F, size=2).split(x, [2, 3])
    ta2 = onnxgrad.TensorArray(b, F, dynamic_size=True)
    for i in range(3):
        ta2 = ta2.write(i, b.node("Sum", [ta.read(1)] if i else [ta.read(0)]) if i == 0 else
                        b.node("Exp", [b.node("Slice", [x, b.const(np.array([i])),
                                                          b.const(np.array([i + 1]))])]))
    y = b.output(b.node("Mul", [ta2.concat(), ta2.concat()]), F, [4, 3])
    m = b.model()
    assert_gradients(m, y, ["x"])


def test_tensor_array_errors_match_tf():
    b = Builder()
    x = b.input("x", F, [2])
    xi = b.input("xi", np.int32, [2])
    ta = onnxgrad.TensorArray(b, F, size=2, element_shape=[2])
    ta = ta.write(0, x)
    with pytest.raises(InvalidArgumentError, match="already been written to"):
        ta.write(0, x)
    with pytest.raises(InvalidArgumentError, match="not resizeable and size is: 2"):
        ta.write(2, x)
    with pytest.raises(InvalidArgumentError, match="dtype is float32 but Op is trying to write "
                                                   "dtype int32"):
        ta.write(1, xi)
    with pytest.raises(ValueError, match="Inconsistent shapes"):
        ta.write(1, b.input("x3", F, [3]))
    ta.read(0)
    with pytest.raises(InvalidArgumentError, match="cleared after a previous read"):
        ta.read(0)
    # a dynamic index cannot be checked at build time
    ta.write(b.input("i", np.int64, []), x)


# -- lowering the ONNX Gradient op ------------------------------------------------------------
@pytest.mark.parametrize("case", ["test_gradient_of_add", "test_gradient_of_add_and_mul"])
def test_lower_onnx_gradient_cases_run_on_onnxruntime(case, tmp_path):
    import importlib

    from onnxgrad.runtime import session
    importlib.import_module("onnx.backend.test.case.model.gradient")
    from onnx.backend.test.case import model as mcases
    c = next(c for c in mcases._SimpleModelTestCases if c.name == case)
    lowered = onnxgrad.lower_gradient_ops(c.model)
    onnx.checker.check_model(lowered, full_check=True)
    assert all(n.op_type != "Gradient" for n in lowered.graph.node)
    inputs, outputs = c.data_sets[0]
    names = [o.name for o in c.model.graph.output]
    assert [o.name for o in lowered.graph.output] == names
    got = session(lowered).run(names, dict(zip([i.name for i in c.model.graph.input], inputs)))
    for g, want in zip(got, outputs):
        np.testing.assert_allclose(g, want, rtol=1e-6)
    # the command line does the same
    from onnxgrad.cli import main
    from onnxgrad.lower import add_lower_parser
    src, dst = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(c.model, src)
    import argparse
    p = argparse.ArgumentParser()
    add_lower_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["lower", str(src), "-o", str(dst)])
    import io
    assert args.func(args, io.StringIO()) == 0
    assert all(n.op_type != "Gradient" for n in onnx.load(dst).graph.node)
    del main


@pytest.mark.parametrize("lr", [0.1, 0.5])
def test_lower_gradient_read_by_an_update(lr):
    """The standard's training pattern, W_new = W - lr * dW with dW a Gradient output, was
    refused ("input 'dW' made by no node"): the nodes that read the Gradient's outputs follow
    the lowered gradient subgraph."""
    vi = lambda n, s: h.make_tensor_value_info(n, TP.FLOAT, s)  # noqa: E731
    nodes = [h.make_node("Mul", ["W", "X"], ["Y"]),
             h.make_node("Gradient", ["W", "X"], ["dW", "dX"],
                              domain="ai.onnx.preview.training", xs=["W", "X"], y="Y"),
             h.make_node("Mul", ["dW", "lr"], ["step"]),
             h.make_node("Sub", ["W", "step"], ["W_new"])]
    g = h.make_graph(nodes, "g", [vi("W", [3]), vi("X", [3]), vi("lr", [])],
                          [vi("Y", [3]), vi("W_new", [3]), vi("dX", [3])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18),
                                            h.make_opsetid("ai.onnx.preview.training", 1)],
                          ir_version=10)
    lowered = onnxgrad.lower_gradient_ops(m)
    onnx.checker.check_model(lowered, full_check=True)
    assert [o.name for o in lowered.graph.output] == ["Y", "W_new", "dX"]
    W, X = np.array([1., 2., 3.], np.float32), np.array([4., 5., -6.], np.float32)
    y, w_new, dx = run(lowered, {"W": W, "X": X, "lr": np.array(lr, np.float32)})
    np.testing.assert_allclose(w_new, W - lr * X, rtol=1e-6)
    np.testing.assert_allclose(dx, W)


def test_lower_gradient_inside_a_subgraph_is_refused():
    """A Gradient node in an If branch was left in place while the training opset import was
    dropped (an invalid model and onnx's raw ValidationError)."""
    grad = h.make_node("Gradient", ["x"], ["dx"], domain="ai.onnx.preview.training",
                            xs=["x"], y="x")
    branch = h.make_graph([grad], "b", [],
                               [h.make_tensor_value_info("dx", TP.FLOAT, [2])])
    other = h.make_graph([h.make_node("Identity", ["x"], ["o"])], "o", [],
                              [h.make_tensor_value_info("o", TP.FLOAT, [2])])
    g = h.make_graph([h.make_node("If", ["c"], ["y"], then_branch=branch,
                                            else_branch=other)], "g",
                          [h.make_tensor_value_info("x", TP.FLOAT, [2]),
                           h.make_tensor_value_info("c", TP.BOOL, [])],
                          [h.make_tensor_value_info("y", TP.FLOAT, [2])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18),
                                            h.make_opsetid("ai.onnx.preview.training", 1)],
                          ir_version=10)
    with pytest.raises(onnxgrad.UnsupportedError, match="inside a subgraph"):
        onnxgrad.lower_gradient_ops(m)


# -- optionals (issue 12, item 14) ------------------------------------------------------------------
def test_optional_get_element_of_a_tensor_is_the_identity():
    m = model([N("OptionalGetElement", ["x"], ["t"]), N("Mul", ["t", "t"], ["y"])],
              [vi("x", shape=["N", 3])], [vi("y", shape=["N", 3])])
    r = assert_gradients(m, "y", "x")
    np.testing.assert_allclose(r.results[0].grad, 2 * r.feeds["x"] * r.cotangents["__cotangent_0"],
                               rtol=1e-12)


def test_optional_read_twice_and_tested():
    """Optional(x) read by two OptionalGetElements (their optional gradients add up) and by
    OptionalHasElement (a bool: no gradient); the gradient of an optional is an optional."""
    m = model([N("Optional", ["x"], ["o"]), N("OptionalGetElement", ["o"], ["a"]),
               N("OptionalGetElement", ["o"], ["b"]), N("OptionalHasElement", ["o"], ["has"]),
               N("Sin", ["a"], ["sa"]), N("Mul", ["sa", "b"], ["p"]),
               N("Where", ["has", "p", "x"], ["y"])],
              [vi("x", shape=[4])], [vi("y", shape=[4])])
    r = assert_gradients(m, "y", "x")
    x, cot = r.feeds["x"], r.cotangents["__cotangent_0"]
    np.testing.assert_allclose(r.results[0].grad, cot * (np.cos(x) * x + np.sin(x)), rtol=1e-10)
    res = onnxgrad.gradients(m, "y", "x")  # named like a sequence's gradient
    assert any(o.startswith("o@gradients") for nd in res.model.graph.node for o in nd.output)


def test_optional_of_a_sequence():
    m = model([N("SequenceConstruct", ["a", "b"], ["s"]), N("Optional", ["s"], ["o"]),
               N("OptionalGetElement", ["o"], ["s2"]), N("SequenceAt", ["s2", "one"], ["e"]),
               N("Mul", ["e", "a"], ["y"])],
              [vi("a", shape=[3]), vi("b", shape=[3])], [vi("y", shape=[3])],
              inits={"one": i64(1)})
    r = assert_gradients(m, "y", ["a", "b"])
    cot = r.cotangents["__cotangent_0"]
    np.testing.assert_allclose(r.results[0].grad, cot * r.feeds["b"], rtol=1e-10)
    np.testing.assert_allclose(r.results[1].grad, cot * r.feeds["a"], rtol=1e-10)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 5), min_size=2, max_size=4), st.data())
def test_reads_of_elements_of_different_lengths_run(split, data):
    """onnx's inference gives a sequence one element shape, so reads of elements of different
    lengths (a TensorArray split into [5, 3, 4]) shared a made-up dim, unk__0; the gradient
    model declared it and onnxruntime shared one buffer between them ("Shape mismatch
    attempting to re-use buffer"). Every pair of reads, checked in float64 and on onnxruntime."""
    i, j = data.draw(st.integers(0, len(split) - 1)), data.draw(st.integers(0, len(split) - 1))
    total = sum(split)
    m = model([N("SplitToSequence", ["x", "sp"], ["s"], axis=0),
               N("SequenceAt", ["s", "i"], ["a"]), N("SequenceAt", ["s", "j"], ["b"]),
               N("Mul", ["a", "a"], ["a2"]), N("ReduceSum", ["b"], ["rb"], keepdims=0),
               N("Mul", ["a2", "rb"], ["y"])],
              [vi("x", shape=[total])], [vi("y")],
              inits={"sp": i64(split), "i": i64(i), "j": i64(j)})
    assert_gradients(m, "y", ["x"])
