"""The build's own shortcuts give the IR onnx-ir's reader gives, and the constants numpy gives.

``autodiff._deserialize`` types the main graph's values from value_info once per distinct type
(shared frozen shapes) instead of letting onnx-ir read every entry; the rules then see exactly
what onnx-ir would have given them. Checked on random graphs (the fuzz generator, after the same
preparation as a gradients() call) and on the entries that need onnx-ir's full reader.
"""
import os
import sys

import numpy as np
import onnx
import onnx_ir as ir
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from util import made_up_dims

import onnxgrad
from onnxgrad.autodiff import _deserialize, _names_in, _prepare, _unique_scope

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import fuzz_graphs  # noqa: E402

F = TensorProto.FLOAT


def _both(model: onnx.ModelProto, prepare: bool = True):
    """(onnx-ir's model, ours, the entries kept) of one copy of ``model``, prepared as a
    gradients() call prepares it (shape inference), or as it is."""
    proto = _prepare(model)[0] if prepare else model
    theirs = ir.serde.deserialize_model(onnx.ModelProto.FromString(proto.SerializeToString()))
    mine, kept = _deserialize(onnx.ModelProto.FromString(proto.SerializeToString()),
                              {vi.name for vi in model.graph.value_info})
    return theirs, mine, kept


def _typing(irm: ir.Model) -> list:
    """Every value of every graph: (name, type, shape, doc_string, metadata), in graph order."""
    out = []
    for graph in [irm.graph, *(g for n in ir.traversal.RecursiveGraphIterator(irm.graph)
                               for a in n.attributes.values()
                               for g in ([a.value] if a.type == ir.AttributeType.GRAPH else
                                         a.value if a.type == ir.AttributeType.GRAPHS else []))]:
        values = [*graph.inputs, *graph.initializers.values(),
                  *(v for node in graph for v in node.outputs), *graph.outputs]
        out += [(v.name, repr(v.type), repr(v.shape), v.doc_string, dict(v.metadata_props))
                for v in values]
    return out


def _same(model: onnx.ModelProto, prepare: bool = True):
    theirs, mine, kept = _both(model, prepare)
    assert _typing(mine) == _typing(theirs)
    # and the model each writes back is the same, value_info included
    assert ir.serde.serialize_model(mine) == ir.serde.serialize_model(theirs)
    return kept


@seed(11)
@settings(deadline=None, database=None, max_examples=60,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(fuzz_graphs.specs(max_steps=6))
def test_typing_matches_onnx_ir_on_random_graphs(spec):
    _same(fuzz_graphs.build(spec).model())


def test_entries_that_need_onnx_irs_full_reader():
    """An entry with a doc_string or metadata, one for a graph output
    (whose own declaration wins in onnx-ir), a sequence, and a subgraph's own value_info."""
    then = helper.make_graph([helper.make_node("Neg", ["a"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F, None)])
    other = helper.make_graph([helper.make_node("Abs", ["a"], ["u"])], "else", [],
                              [helper.make_tensor_value_info("u", F, None)])
    then.value_info.append(helper.make_tensor_value_info("t", F, ["K"]))
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("ReduceSum", ["a"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "w"], ["c"]),
             helper.make_node("If", ["c"], ["b"], then_branch=then, else_branch=other),
             helper.make_node("SequenceConstruct", ["a", "a"], ["q"]),
             helper.make_node("SequenceAt", ["q", "i"], ["r"]),
             helper.make_node("Add", ["b", "r"], ["y"])]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 3])],
        [helper.make_tensor_value_info("y", F, ["N", 3])],
        [onnx.numpy_helper.from_array(np.array(0.5, np.float32), "w"),
         onnx.numpy_helper.from_array(np.array(1, np.int64), "i")])
    noted = helper.make_tensor_value_info("a", F, ["N", 3], doc_string="after the Relu")
    tagged = helper.make_tensor_value_info("s", F, [])
    tagged.metadata_props.add(key="k", value="v")
    g.value_info.extend([noted, tagged, helper.make_tensor_value_info("w", F, []),
                         helper.make_tensor_value_info("y", F, [None, 3]),
                         helper.make_tensor_sequence_value_info("q", F, ["N", 3]),
                         helper.make_tensor_value_info("r", F, ["N", 3]),
                         helper.make_tensor_value_info("b", F, ["N", 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    _same(m, prepare=False)  # (the preparation rewrites entries without doc_string, metadata)
    kept = _same(m)
    # the declared entries go back into the result (the initializer's was dropped by the
    # preparation's shape inference, which keeps entries only for values nodes make)
    assert sorted(vi.name for vi in kept) == ["a", "b", "q", "r", "s", "y"]


def test_scope_search_matches_names_under_it():
    """_unique_scope's one-string search: taken by an equal name, a name under scope/, or a
    sequence gradient ...@scope, and by nothing else (a prefix alone is not under it)."""
    def scope_for(names, name="gradients"):
        nodes = [helper.make_node("Identity", ["x"], [n]) for n in names]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1])],
                              [helper.make_tensor_value_info(n, F, [1]) for n in names])
        return _unique_scope(_names_in(ir.serde.deserialize_graph(g)), name)

    assert scope_for(["gradients"]) == "gradients_1"
    assert scope_for(["gradients/a", "gradients_1"]) == "gradients_2"
    assert scope_for(["seq@gradients"]) == "gradients_1"
    assert scope_for(["gradientsX", "gradients_", "my/gradients", "gradients@x"]) == "gradients"
    assert scope_for(["a/b/c"], "a/b") == "a/b_1"
    assert scope_for(["a/bc"], "a/b") == "a/b"


def test_opset_retry_keeps_the_declared_types():
    """A rule that needs a newer opset (GatherND's gradient: ScatterND with reduction="add",
    opset 16) makes the call upgrade the prepared model and start again; the retry starts from
    the model as prepared, declared types included (here the int64 indices that a custom op
    makes: untyped, they could be float, and the path would run through the op)."""
    nodes = [helper.make_node("Foo", ["x"], ["idx"], domain="my"),
             helper.make_node("GatherND", ["x", "idx"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [3, 4])],
                          [helper.make_tensor_value_info("y", F, None)])
    g.value_info.append(helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 1]))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13),
                                            helper.make_opsetid("my", 1)], ir_version=8)
    res = onnxgrad.gradients(m, "y", ["x"])
    assert {o.domain: o.version for o in res.model.opset_import}[""] == 16
    assert [vi.type.tensor_type.elem_type for vi in res.model.graph.value_info
            if vi.name == "idx"] == [TensorProto.INT64]
    assert any(n.op_type == "ScatterND" for n in res.model.graph.node)


def test_ranks_that_only_data_propagation_finds():
    """Whisper's decoder, exported by the TorchScript exporter, builds its position ids as
    Expand(Unsqueeze(Range(0, T)), ConstantOfShape(Shape(Concat(...)))): the Expand's rank is
    the length of a shape computed from a shape, which onnx's inference finds only with data
    propagation. Without it the LayerNormalization after was refused (its rank unknown); the
    gradient agrees with finite differences."""
    from onnxgrad.check import check_gradients
    i64 = TensorProto.INT64
    consts = {"zero": 0, "one": 1, "ax0": [0], "one1": [1]}
    nodes = [helper.make_node("Constant", [], [k], value=helper.make_tensor(
        k, i64, [] if isinstance(v, int) else [len(v)], [v] if isinstance(v, int) else v))
        for k, v in consts.items()]
    nodes += [
        helper.make_node("Shape", ["x"], ["sx"]),
        helper.make_node("Gather", ["sx", "one"], ["t"], axis=0),
        helper.make_node("Range", ["zero", "t", "one"], ["r"]),
        helper.make_node("Unsqueeze", ["r", "ax0"], ["u"]),
        helper.make_node("Unsqueeze", ["t", "ax0"], ["t1"]),
        helper.make_node("Concat", ["one1", "t1"], ["cat"], axis=0),
        helper.make_node("Shape", ["cat"], ["scat"]),
        helper.make_node("ConstantOfShape", ["scat"], ["ones"], value=helper.make_tensor(
            "v", i64, [1], [1])),
        helper.make_node("Expand", ["u", "ones"], ["ids"]),
        helper.make_node("Gather", ["pos", "ids"], ["p"], axis=0),
        helper.make_node("Add", ["x", "p"], ["h"]),
        helper.make_node("LayerNormalization", ["h", "g", "b"], ["y"], axis=-1),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["B", "T", 4])],
                          [helper.make_tensor_value_info("y", F, None)],
                          [onnx.numpy_helper.from_array(
                              np.random.default_rng(0).standard_normal((16, 4)).astype(
                                  np.float32), "pos"),
                           onnx.numpy_helper.from_array(np.full(4, 1.5, np.float32), "g"),
                           onnx.numpy_helper.from_array(np.full(4, 0.1, np.float32), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.random.default_rng(1).standard_normal((2, 5, 4)).astype(np.float32)
    report = check_gradients(m, "y", ["x", "pos", "g", "b"], {"x": x})
    assert report.ok, str(report)


@seed(12)
@settings(deadline=None, database=None, max_examples=60,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(fuzz_graphs.specs(max_steps=6, batch=True, symbolic=True))
def test_what_the_call_writes_names_no_made_up_dim(spec):
    """onnx's inference names dims it cannot compute unk__0, unk__1, ... anew in every run; a
    value_info entry or output the call adds that carries one can meet another run's same name
    for another size, which onnxruntime takes for one size (see test_rules_contrib's
    encoder-decoder test). On random graphs with symbolic dims, none is written."""
    p = fuzz_graphs.build(spec)
    model = p.model()
    try:
        res = onnxgrad.gradients(model, **p.call())
    except onnxgrad.OnnxgradError:  # a listed refusal (the fuzzer's oracle judges those)
        return
    before = {vi.name for vi in [*model.graph.value_info, *model.graph.output]}
    written = made_up_dims(res.model, skip=before)
    assert not written, written


_FLOATS = [ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16]
_FLOAT_NUMBERS = st.one_of(st.sampled_from([0.0, -0.0, 1.0, 0.5, -2.5, 1e-30, 3e38, float("inf"),
                                            float("-inf"), float("nan")]),
                           st.floats(allow_nan=True, allow_infinity=True, width=32))


@settings(deadline=None, max_examples=60)
@given(st.lists(st.one_of(
    st.tuples(_FLOAT_NUMBERS, st.sampled_from(_FLOATS)),
    st.tuples(st.one_of(st.integers(-3, 3), st.booleans()), st.sampled_from(
        _FLOATS + [ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL])),
    st.tuples(st.lists(st.integers(-(1 << 40), 1 << 40), max_size=4).map(
        lambda v: tuple(v) if len(v) % 2 else v), st.just(ir.DataType.INT64))),
    min_size=1, max_size=12))
@example([(0.0, ir.DataType.FLOAT), (-0.0, ir.DataType.FLOAT), (0, ir.DataType.FLOAT)])
@example([(1, ir.DataType.FLOAT), (1.0, ir.DataType.FLOAT), (True, ir.DataType.FLOAT),
          (1, ir.DataType.DOUBLE), (1, ir.DataType.INT64)])
@example([([1, 2], ir.DataType.INT64), ((1, 2), ir.DataType.INT64), ([1, 3], ir.DataType.INT64),
          ([], ir.DataType.INT64), ((), ir.DataType.INT64)])
def test_constants_found_without_numpy_are_the_ones_numpy_makes(requests):
    """``Emitter.const`` finds Python numbers and int lists it made before by a key of its own
    (a numpy conversion per constant cost a few percent of a build): every constant it hands
    out holds exactly the bytes numpy gives the request (-0.0 is not 0.0; 1, True and 1.0
    share a float constant), two requests share a node exactly when those bytes (dtype and
    shape included) are equal, and scalars widened for a broadcasting op keep their value."""
    from onnxgrad.emitter import Emitter
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    e = Emitter(ir.Graph([x], [], nodes=[], opset_imports={"": 18}, name="g"), "s", 18)
    seen = {}
    for value, dtype in requests * 2:  # every request twice
        with np.errstate(over="ignore"):  # (3e38 as float16)
            want = np.asarray(value, dtype=dtype.numpy())
            got = e.const(value, dtype)
        t = got.value.producer().attributes["value"].value.numpy()
        assert t.dtype == want.dtype and t.shape == want.shape and t.tobytes() == want.tobytes()
        key = (want.dtype.str, want.shape, want.tobytes())
        assert seen.setdefault(key, got.value) is got.value, (value, dtype)
        if want.ndim == 0 and dtype == ir.DataType.FLOAT:  # widened against x [2, 3]
            wide = e.op("Add", e.wrap(x), got).value.producer().inputs[1]
            c = wide.producer().attributes["value"].value.numpy()
            assert c.shape == (1, 1) and c.tobytes() == want.tobytes()
    assert len(set(seen.values())) == len(seen)
