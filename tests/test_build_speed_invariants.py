"""The build's faster paths give what the plain ones give.

- ``autodiff._write_values`` writes a ValueInfoProto once per distinct type and frozen shape and
  copies it under each name: the entries equal onnx-ir's own, one by one, made-up dims forgotten.
- ``inference._graphs_and_kinds`` walks a checked model once for its graphs and op kinds: the
  same as ``graphs_of`` and a walk over every node.
- ``inference._may_hold_sequences`` only skips ``_forget_element_symbols`` where it would change
  nothing.
- ``autodiff._values_and_names`` gives the values and the names the separate walks gave.
- ``emitter.V`` reads an unset dtype or shape from the IR once, and keeps a given one.
"""
import os
import sys

import numpy as np
import onnx
import onnx_ir as ir
from hypothesis import HealthCheck, given, seed, settings
from onnx import TensorProto, helper

from onnxgrad.autodiff import _names_in, _prepare, _values_and_names, _write_values
from onnxgrad.emitter import Emitter, V
from onnxgrad.inference import (_forget_element_symbols, _graphs_and_kinds, _kinds,
                                _may_hold_sequences, forget_made_up, graphs_of, model_opset)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import fuzz_graphs  # noqa: E402

F = TensorProto.FLOAT
_SETTINGS = settings(deadline=None, database=None, max_examples=40,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _plain(values) -> list:
    out = []
    for v in values:
        vi = onnx.ValueInfoProto()
        ir.serde.serialize_value_into(vi, v)
        forget_made_up([vi])
        out.append(vi)
    return out


def test_write_values_equals_onnx_irs_entries():
    shared = ir.Shape(["N", 16], frozen=True)
    noted = ir.Shape(["N", 3], frozen=True)
    noted_dims = ir.Shape(["N", 3], denotations=["DATA_BATCH", None], frozen=True)
    f32, f16 = ir.TensorType(ir.DataType.FLOAT), ir.TensorType(ir.DataType.FLOAT16)
    values = [
        ir.Value(name="a", type=f32, shape=shared),
        ir.Value(name="b", type=f32, shape=shared),  # the same shape object
        ir.Value(name="c", type=f32, shape=ir.Shape(["N", 16], frozen=True)),  # equal dims
        ir.Value(name="d", type=f16, shape=shared),  # another dtype
        ir.Value(name="e", type=f32, shape=noted),
        ir.Value(name="f", type=f32, shape=noted_dims),  # same dims, a denotation
        ir.Value(name="g", type=f32, shape=ir.Shape(["unk__0", 2], frozen=True)),  # made up
        ir.Value(name="h", type=f32, shape=ir.Shape([None, 2], frozen=True)),
        ir.Value(name="i", type=f32, shape=ir.Shape(["N", 16])),  # not frozen
        ir.Value(name="j", type=f32, shape=None),
        ir.Value(name="k", type=ir.SequenceType(f32), shape=None),
        ir.Value(name="l", type=f32, shape=shared, doc_string="noted"),
        ir.Value(name="m", type=ir.TensorType(ir.DataType.FLOAT, denotation="IMAGE"),
                 shape=shared),
        ir.Value(name="n", type=f32, shape=shared, metadata_props={"k": "v"}),
    ]
    g = onnx.GraphProto()
    _write_values(g.output, values)
    assert [vi.SerializeToString() for vi in g.output] == \
        [vi.SerializeToString() for vi in _plain(values)]


@seed(5)
@_SETTINGS
@given(fuzz_graphs.specs(max_steps=6))
def test_one_walk_finds_the_graphs_and_kinds(spec):
    m = fuzz_graphs.build(spec).model()
    onnx.checker.check_model(m)
    graphs, kinds = _graphs_and_kinds(m.graph)
    plain = graphs_of(m.graph)
    assert [id(g) for g in graphs] == [id(g) for g in plain] or \
        [g.SerializeToString() for g in graphs] == [g.SerializeToString() for g in plain]
    assert kinds == _kinds(plain)


def _with_subgraphs() -> onnx.ModelProto:
    then = helper.make_graph([helper.make_node("Neg", ["a"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F, None)])
    other = helper.make_graph([helper.make_node("SequenceConstruct", ["a"], ["q"]),
                               helper.make_node("SequenceAt", ["q", "i"], ["u"])], "else", [],
                              [helper.make_tensor_value_info("u", F, None)])
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]),
         helper.make_node("Abs", ["v_in"], ["v_out"])], "body",
        [helper.make_tensor_value_info("it", TensorProto.INT64, []),
         helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", F, ["N", 3])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", F, ["N", 3])])
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("ReduceSum", ["a"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "w"], ["c"]),
             helper.make_node("If", ["c"], ["b"], then_branch=then, else_branch=other),
             helper.make_node("Loop", ["n", "c", "b"], ["y"], body=body)]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 3])],
        [helper.make_tensor_value_info("y", F, ["N", 3])],
        [onnx.numpy_helper.from_array(np.array(0.5, np.float32), "w"),
         onnx.numpy_helper.from_array(np.array(1, np.int64), "i"),
         onnx.numpy_helper.from_array(np.array(2, np.int64), "n")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_one_walk_finds_nested_graphs():
    m = _with_subgraphs()
    onnx.checker.check_model(m)
    graphs, kinds = _graphs_and_kinds(m.graph)
    assert [g.name for g in graphs] == [g.name for g in graphs_of(m.graph)] == \
        ["g", "else", "then", "body"]  # (attributes by name)
    assert kinds == _kinds(graphs_of(m.graph))
    assert ("", "SequenceConstruct") in kinds


def _sequence_skip_is_safe(m: onnx.ModelProto) -> bool:
    """Whether the model may hold sequences; where it says not, forgetting element symbols
    changes nothing in its prepared form."""
    prepared = _prepare(m)[0]
    graphs, kinds = _graphs_and_kinds(prepared.graph)
    may = _may_hold_sequences(graphs, kinds, model_opset(prepared))
    if not may:
        before = prepared.SerializeToString()
        _forget_element_symbols(prepared)
        assert prepared.SerializeToString() == before
    return may


@seed(6)
@_SETTINGS
@given(fuzz_graphs.specs(max_steps=6))
def test_sequence_dims_are_looked_for_where_they_may_be(spec):
    _sequence_skip_is_safe(fuzz_graphs.build(spec).model())


def test_sequences_in_a_branch_are_looked_for():
    assert _sequence_skip_is_safe(_with_subgraphs())
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 3])],
                          [helper.make_tensor_value_info("y", F, ["N", 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    assert not _sequence_skip_is_safe(m)
    m.graph.input.append(helper.make_tensor_sequence_value_info("s", F, ["N", 3]))
    assert _sequence_skip_is_safe(m)  # a sequence input


def test_values_and_names_in_one_walk():
    irm = ir.serde.deserialize_model(_with_subgraphs())
    graph = irm.graph
    values, names = _values_and_names(graph)
    expected = {v.name: v for v in graph.inputs}
    expected.update(graph.initializers)
    expected.update((v.name, v) for node in graph for v in node.outputs if v.name)
    assert values == expected
    assert {n for n in names if n} == {n for n in _names_in(graph) if n}


def test_v_reads_an_unset_dtype_or_shape_once():
    graph = ir.Graph([], [], nodes=[])
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT),
                 shape=ir.Shape(["N", 4], frozen=True))
    e = Emitter(graph, "gradients", 18)
    v = V(x, e)
    assert (v.dtype, v.shape, v.rank) == (ir.DataType.FLOAT, ("N", 4), 2)
    x.type = ir.TensorType(ir.DataType.DOUBLE)  # read once: a V keeps what it read
    assert v.dtype == ir.DataType.FLOAT
    given_ = V(x, e, ir.DataType.FLOAT16, (3,))
    assert (given_.dtype, given_.shape) == (ir.DataType.FLOAT16, (3,))
    unknown = V(ir.Value(name="u"), e)
    assert unknown.dtype is None and unknown.shape is None
    try:
        v.nothing
    except AttributeError:
        pass
    else:
        raise AssertionError("V made up an attribute")
