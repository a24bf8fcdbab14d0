"""A Loop's gradient reads dims proven one size as one (onnxgrad.dim_classes): no sums over
axes at run time inside the backward body. Held to float64 finite differences over LSTM-like
bodies whose states, inputs and initial values may each have batch 1 (broadcast) or not, with
dims declared as ints, names or unknown; a state whose shape changes between iterations must
fail at run time, never give a gradient."""
import collections
import re

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper as h

import onnxgrad
from onnxgrad.dim_classes import unify
from util import assert_gradients, vi_model

N = h.make_node
H, D = 2, 3


def vi(name, shape, t=TP.FLOAT):
    return h.make_tensor_value_info(name, t, shape)


def lstm_loop(decl_batch, decl_state, decl_out, decl_width=H, zeros=False, reshape=False):
    """h, c <- one LSTM step of xs[i] for M iterations; decl_*: how the batch dim is declared
    (an int, a name, or None) on the model's inputs, the body's state inputs and outputs, and
    the initial states' width; ``zeros``: the initial states made in the graph from xs's
    shape; ``reshape``: the row read through a Reshape to [-1, D], as TF's list reads are."""
    row = [N("Reshape", ["xr", "rows_shape"], ["xi"])] if reshape else []
    body = h.make_graph(
        [N("Gather", ["xs", "i"], ["xr" if reshape else "xi"], axis=0), *row,
         N("MatMul", ["xi", "W"], ["zx"]),
         N("MatMul", ["h_in", "R"], ["zh"]), N("Add", ["zx", "zh"], ["z0"]),
         N("Add", ["z0", "b"], ["z"]), N("Split", ["z"], ["zi", "zf", "zg", "zo"], axis=1,
                                          num_outputs=4),
         N("Sigmoid", ["zi"], ["gi"]), N("Sigmoid", ["zf"], ["gf"]), N("Tanh", ["zg"], ["gg"]),
         N("Sigmoid", ["zo"], ["go"]), N("Mul", ["gf", "c_in"], ["fc"]),
         N("Mul", ["gi", "gg"], ["ig"]), N("Add", ["fc", "ig"], ["c_out"]),
         N("Tanh", ["c_out"], ["tc"]), N("Mul", ["go", "tc"], ["h_out"]),
         N("Identity", ["cond_in"], ["cond_out"])],
        "body", [vi("i", [], TP.INT64), vi("cond_in", [], TP.BOOL), vi("h_in", decl_state),
                 vi("c_in", decl_state)],
        [vi("cond_out", [], TP.BOOL), vi("h_out", decl_out), vi("c_out", decl_out)],
        [h.make_tensor("rows_shape", TP.INT64, [2], [-1, D])] if reshape else [])
    b = decl_batch
    inputs = [vi("M", [], TP.INT64), vi("xs", ["T", b[0], D]), vi("h0", [b[1], decl_width]),
              vi("c0", [b[2], decl_width]), vi("W", [D, 4 * H]), vi("R", [H, 4 * H]),
              vi("b", [4 * H])]
    outer = [N("Loop", ["M", "", "h0", "c0"], ["hT", "cT"], body=body)]
    if zeros:  # the initial states are zeros as wide as xs's rows, as converters build them
        i64 = TP.INT64
        outer[:0] = [
            N("Shape", ["xs"], ["xs_shape"]), N("Cast", ["xs_shape"], ["shape32"], to=TP.INT32),
            N("Constant", [], ["one"], value=h.make_tensor("one", i64, [1], [1])),
            N("Constant", [], ["two"], value=h.make_tensor("two", i64, [1], [2])),
            N("Slice", ["shape32", "one", "two"], ["rows"]),
            N("Constant", [], ["width"], value=h.make_tensor("width", TP.INT32, [1], [H])),
            N("Concat", ["rows", "width"], ["packed"], axis=0),
            N("Cast", ["packed"], ["packed64"], to=i64),
            N("Constant", [], ["zero"], value=h.make_tensor("zero", TP.FLOAT, [], [0.0])),
            N("Expand", ["zero", "packed64"], ["h0"]), N("Expand", ["zero", "packed64"], ["c0"])]
        inputs = [x for x in inputs if x.name not in ("h0", "c0")]
    return vi_model(outer, inputs, [vi("hT", [None, None]), vi("cT", [None, None])],
                    infer=False)


def _decl(kind, size):
    return {"int": size, "name": "B", "none": None}[kind]


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.tuples(*[st.sampled_from([1, 3])] * 3), trips=st.integers(0, 3),
       kinds=st.tuples(*[st.sampled_from(["int", "name", "none"])] * 3),
       state_kind=st.sampled_from(["unknown", "hidden"]),
       widths=st.sampled_from([(H, H), (H, None), (1, None)]))
@example(batches=(3, 3, 3), trips=2, kinds=("none", "none", "none"), state_kind="hidden",
         widths=(H, H))
@example(batches=(3, 1, 1), trips=1, kinds=("none", "none", "none"), state_kind="hidden",
         widths=(H, H))
@example(batches=(1, 3, 3), trips=2, kinds=("none", "none", "none"), state_kind="hidden",
         widths=(H, H))
@example(batches=(3, 3, 3), trips=2, kinds=("none", "none", "none"), state_kind="hidden",
         widths=(1, None))
def test_lstm_like_loop_gradients(batches, trips, kinds, state_kind, widths):
    bx, bh, bc = batches
    decl = [_decl(k, s) for k, s in zip(kinds, batches)]
    if "name" in kinds and len({s for k, s in zip(kinds, batches) if k == "name"}) > 1:
        decl = [d if d != "B" else None for d in decl]  # one name means one size
    state = {"unknown": [None, None], "hidden": [None, H]}[state_kind]
    width, decl_width = widths  # the initial states' width (1: broadcast up to H), declared
    m = lstm_loop(decl, state, state, decl_width)
    rng = np.random.default_rng(sum(batches) + trips)
    feeds = {"M": np.array(trips, np.int64),
             "xs": rng.standard_normal((max(trips, 1), bx, D)),
             "h0": rng.standard_normal((bh, width)), "c0": rng.standard_normal((bc, width)),
             "W": rng.standard_normal((D, 4 * H)), "R": rng.standard_normal((H, 4 * H)),
             "b": rng.standard_normal(4 * H)}
    may_grow = bh != max(batches) or bc != max(batches) or width != H
    try:  # checked against finite differences: never a wrong gradient
        assert_gradients(m, ["hT", "cT"], ["h0", "c0", "xs", "W", "R", "b"], feeds)
    except AssertionError:
        raise
    except Exception as err:  # refused: only a state whose shape changes, and saying so
        assert may_grow, err
        assert re.search("shape|dimension", str(err), re.I), err


@pytest.mark.parametrize("xs_batch, sums", [(None, 1), ("B", 0)])
def test_the_backward_body_sums_only_where_a_dim_may_be_1(xs_batch, sums):
    """The LSTM-like body with the states' batch unknown: its backward body computes axes at
    run time (NonZero) only for the input row's sum, whose batch may be 1 where the states'
    is not, and not even that where the input and the states share a batch name."""
    m = lstm_loop([xs_batch, "B", "B"], [None, H], [None, H])
    res = onnxgrad.gradients(m, ["hT", "cT"], ["h0", "c0", "W", "R", "b"])
    onnx.checker.check_model(res.model, full_check=True)
    bodies = [a.g for n in res.model.graph.node if n.op_type == "Loop" for a in n.attribute
              if "_grad" in n.name]
    ops = collections.Counter(n.op_type for g in bodies for n in g.node)
    assert ops["NonZero"] == sums, ops


@settings(max_examples=20, deadline=None, derandomize=True)
@given(bx=st.sampled_from([1, 3]), trips=st.integers(0, 3), reshape=st.booleans(),
       decl=st.sampled_from([None, "B", 3]))
def test_loop_from_zeros_made_from_the_input_shape(bx, trips, reshape, decl):
    """Initial states made as zeros [rows of xs, H] (Shape, Cast, Slice, Concat, Expand, as
    converters write them): the states' batch is xs's, proven, so the backward body sums nothing
    at run time and recomputes no product, and the gradients match finite differences."""
    if isinstance(decl, int) and decl != bx:
        decl = None
    m = lstm_loop([decl, None, None], [None, H], [None, H], zeros=True, reshape=reshape)
    rng = np.random.default_rng(bx + trips)
    feeds = {"M": np.array(trips, np.int64), "xs": rng.standard_normal((max(trips, 1), bx, D)),
             "W": rng.standard_normal((D, 4 * H)), "R": rng.standard_normal((H, 4 * H)),
             "b": rng.standard_normal(4 * H)}
    assert_gradients(m, ["hT", "cT"], ["xs", "W", "R", "b"], feeds)
    res = onnxgrad.gradients(m, ["hT", "cT"], ["W", "R", "b"])  # (what training asks)
    ops = collections.Counter(n.op_type for n in res.model.graph.node if n.op_type == "Loop"
                              for a in n.attribute if "_grad" in n.name for n in a.g.node)
    # products: x^T dz, h^T dz, dz R^T; the forward's two are saved, not recomputed
    assert ops["NonZero"] == 0 and ops["MatMul"] + ops["Gemm"] == 3, ops


def _value(name, dims):
    import onnx_ir as ir
    return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(dims))


def _node(op, ins, outs, **attrs):
    import onnx_ir as ir
    return ir.Node("", op, ins, attributes=[ir.AttrInt64(k, v) for k, v in attrs.items()],
                   outputs=outs)


def test_unify_joins_only_a_cycle_of_the_broadcast_order():
    """a <= out and b <= out for a broadcasting op: a and b stay apart (either may be 1);
    with out == a (a carried state), a, out and b's class is still two: b <= a only."""
    a, b, out = _value("a", [None, 4]), _value("b", [None, 4]), _value("out", [None, 4])
    add = _node("Add", [a, b], [out])
    assert unify([add], mutable=[a, b, out]) == set()
    assert [a.shape[0].value, b.shape[0].value, out.shape[0].value] == [None] * 3
    unify([add], equal=[(a, out)], mutable=[a, b, out])
    assert a.shape[0] == out.shape[0] and b.shape[0] != a.shape[0]
    # a Split keeps the other axes: its outputs are its input's rows
    x, p, q = _value("x", [None, 8]), _value("p", [None, 4]), _value("q", [None, 4])
    split = _node("Split", [x], [p, q], axis=1)
    unify([split], mutable=[x, p, q])
    assert x.shape[0] == p.shape[0] == q.shape[0] and str(x.shape[0]) != "None"


@st.composite
def random_bodies(draw):
    """A Loop body of random elementwise ops (broadcasting), MatMuls with an outer weight,
    rows of an outer input and inner Loops, over one or two carried states [batch, H]."""
    k = draw(st.integers(1, 2))
    pool, nodes = [f"s{j}_in" for j in range(k)] + ["xi"], [
        N("Gather", ["xs", "i"], ["xi"], axis=0), N("Identity", ["cond_in"], ["cond_out"])]
    for n in range(draw(st.integers(2, 6))):
        op = draw(st.sampled_from(["Tanh", "Sigmoid", "Sin", "Add", "Mul", "Sub", "MatMul",
                                   "Loop"]))
        a = draw(st.sampled_from(pool))
        out = f"v{n}"
        if op == "Loop":  # nested: two iterations of tanh(v + u * a), u and a from outside
            inner = h.make_graph(
                [N("Mul", ["u", a], [f"ua{n}"]), N("Add", [f"w{n}_in", f"ua{n}"], [f"p{n}"]),
                 N("Tanh", [f"p{n}"], [f"w{n}_out"]), N("Identity", [f"c{n}"], [f"co{n}"])],
                f"inner{n}", [vi(f"j{n}", [], TP.INT64), vi(f"c{n}", [], TP.BOOL),
                              vi(f"w{n}_in", [None, H])],
                [vi(f"co{n}", [], TP.BOOL), vi(f"w{n}_out", [None, H])])
            nodes += [N("Constant", [], [f"two{n}"],
                        value=h.make_tensor(f"two{n}", TP.INT64, [], [2])),
                      N("Loop", [f"two{n}", "", a], [out], body=inner)]
        elif op in ("Add", "Mul", "Sub"):
            nodes.append(N(op, [a, draw(st.sampled_from(pool + ["u"]))], [out]))
        elif op == "MatMul":
            nodes.append(N(op, [a, "W"], [out]))
        else:
            nodes.append(N(op, [a], [out]))
        pool.append(out)
    made = pool[k + 1:]
    outs = [draw(st.sampled_from(made)) for _ in range(k)]
    nodes += [N("Identity", [o], [f"s{j}_out"]) for j, o in enumerate(outs)]
    return k, nodes


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(body=random_bodies(), batches=st.tuples(*[st.sampled_from([1, 3])] * 4),
       trips=st.integers(0, 3), state_decl=st.sampled_from([[None, H], [None, None]]))
def test_random_loop_bodies(body, batches, trips, state_decl):
    """Random bodies, batches 1 or 3 for the input rows, the states and u: where every batch
    is one size the gradient must run and match finite differences; elsewhere it may also be
    refused at run time, by an error about a shape."""
    k, nodes = body
    bx, b0, b1, bu = batches
    states = [b0, b1][:k]
    g = h.make_graph(nodes, "body",
                     [vi("i", [], TP.INT64), vi("cond_in", [], TP.BOOL)] +
                     [vi(f"s{j}_in", state_decl) for j in range(k)],
                     [vi("cond_out", [], TP.BOOL)] + [vi(f"s{j}_out", state_decl)
                                                      for j in range(k)])
    inits = [f"s{j}_0" for j in range(k)]
    m = vi_model([N("Loop", ["M", "", *inits], [f"s{j}_T" for j in range(k)], body=g)],
                 [vi("M", [], TP.INT64), vi("xs", ["T", None, H]), vi("W", [H, H]),
                  vi("u", [None, H])] + [vi(s, [None, H]) for s in inits],
                 [vi(f"s{j}_T", [None, None]) for j in range(k)], infer=False)
    rng = np.random.default_rng(trips + 7 * sum(batches))
    feeds = {"M": np.array(trips, np.int64), "xs": rng.uniform(-1, 1, (max(trips, 1), bx, H)),
             "W": rng.uniform(-1, 1, (H, H)), "u": rng.uniform(-1, 1, (bu, H)),
             **{s: rng.uniform(-1, 1, (b, H)) for s, b in zip(inits, states)}}
    ys, xs = [f"s{j}_T" for j in range(k)], ["xs", "W", "u", *inits]
    try:
        assert_gradients(m, ys, xs, feeds)
    except AssertionError:
        raise
    except Exception as err:
        assert len({bx, bu, *states}) > 1, err
        assert re.search("shape|dimension", str(err), re.I), err


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(index=st.sampled_from(["i", "counter", "negative", "constant"]),
       second=st.sampled_from([None, "gather", "mul"]), trips=st.integers(0, 4),
       opset=st.sampled_from([15, 18]))
def test_rows_read_per_iteration(index, second, trips, opset):
    """An outer tensor read one row per iteration (a TensorArray's elements): its gradient is
    the rows' gradients scattered after the loop (opset 16 on), also where an index repeats,
    counts from the end or is a carried counter; a second read of another kind keeps the sum
    in the loop. Against finite differences, and no tensor of its shape made per iteration."""
    t_max = 4
    idx = {"i": "i", "counter": "k_in", "negative": "neg", "constant": "one"}[index]
    nodes = [N("Constant", [], ["one"], value=h.make_tensor("one", TP.INT64, [], [1])),
             N("Sub", ["i", "four"], ["neg"]), N("Add", ["k_in", "one"], ["k_out"]),
             N("Gather", ["xs", idx], ["xi"], axis=0), N("Add", ["h_in", "xi"], ["p"]),
             N("Tanh", ["p"], ["h_out"]), N("Identity", ["cond_in"], ["cond_out"])]
    if second == "gather":  # a second row, one iteration behind (index 0 where i is 0)
        nodes += [N("Sub", ["i", "one"], ["im1"]), N("Max", ["im1", "zero"], ["prev"]),
                  N("Gather", ["xs", "prev"], ["xp"], axis=0), N("Mul", ["h_out", "xp"], ["q"])]
    elif second == "mul":  # the whole tensor read: its gradient stays a sum in the loop
        nodes += [N("ReduceSum", ["xs", "ax0"], ["xsum"], keepdims=0),
                  N("Mul", ["h_out", "xsum"], ["q"])]
    else:
        nodes += [N("Identity", ["h_out"], ["q"])]
    body = h.make_graph(
        nodes, "body", [vi("i", [], TP.INT64), vi("cond_in", [], TP.BOOL), vi("k_in", [], TP.INT64),
                        vi("h_in", [None, 3])],
        [vi("cond_out", [], TP.BOOL), vi("k_out", [], TP.INT64), vi("q", [None, 3])])
    inits = {"four": np.array(t_max, np.int64), "zero": np.array(0, np.int64),
             "ax0": np.array([0], np.int64), "k0": np.array(0, np.int64)}
    m = vi_model([N("Loop", ["M", "", "k0", "h0"], ["kT", "hT"], body=body)],
                 [vi("M", [], TP.INT64), vi("xs", [t_max, None, 3]), vi("h0", [None, 3])],
                 [vi("hT", [None, 3])], inits=inits, opset=opset, infer=False)
    rng = np.random.default_rng(trips)
    feeds = {"M": np.array(trips, np.int64), "xs": rng.uniform(-1, 1, (t_max, 2, 3)),
             "h0": rng.uniform(-1, 1, (2, 3))}
    assert_gradients(m, "hT", ["xs", "h0"], feeds)
    res = onnxgrad.gradients(m, "hT", ["xs", "h0"])
    after = collections.Counter(nd.op_type for nd in res.model.graph.node)
    if opset >= 16:  # (ScatterND's reduction: opset 16; before it the sum stays in the loop)
        assert (after["ScatterND"] > 0) == (second != "mul"), after


def test_a_named_batch_is_the_same_every_iteration():
    """States and input rows all declared with the batch name of the model's input: the class
    needs no renaming, and its values are still saved (their shape is the same every
    iteration), not recomputed."""
    m = lstm_loop(["B", "B", "B"], ["B", H], ["B", H])
    res = onnxgrad.gradients(m, ["hT", "cT"], ["h0", "c0", "W", "R", "b"])
    fwd = next(nd for nd in res.model.graph.node if nd.op_type == "Loop")
    assert any(o.endswith("_kept") for o in fwd.output), list(fwd.output)
    bwd = [a.g for nd in res.model.graph.node if nd.op_type == "Loop" and "_grad" in nd.name
           for a in nd.attribute]
    ops = collections.Counter(x.op_type for g in bwd for x in g.node)
    assert ops["MatMul"] + ops["Gemm"] == 3 and ops["NonZero"] == 0, ops


def test_a_fed_initializer_is_no_constant_shape():
    """An initializer that is also a graph input may be fed another value: a shape built from
    it says nothing about the zeros' dims (it would join a dim to a size it may not have)."""
    import onnx_ir as ir
    from onnxgrad.dim_classes import made_dims
    shape = ir.Value(name="shape", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([2]),
                     const_value=ir.tensor(np.array([3, H], np.int64)))
    zero = ir.Value(name="zero", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]),
                    const_value=ir.tensor(np.array(0.0, np.float32)))
    out = ir.Value(name="z", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([None, None]))
    node = ir.Node("", "Expand", [zero, shape], outputs=[out])
    graph = ir.Graph([], [out], nodes=[node], initializers=[shape, zero])
    assert made_dims(out) == [(0, 3), (1, H)]
    graph.inputs.append(shape)  # now a caller may feed it
    assert made_dims(out) == []
