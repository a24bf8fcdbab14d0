"""Loops whose carried sequence the body reads and changes (a TensorArray read and written in a
while loop, a stack pushed and popped): the backward loop rebuilds the sequence's state at each
iteration from its final state, undoing the body's inserts and erases. Checked against float64
finite differences, on hand-written loops and on random read/write/push/pop programs."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper as h

import onnxgrad
from util import assert_gradients, vi_model

N = h.make_node
D = 3  # element size


def vi(name, t=TP.FLOAT, shape=None):
    return h.make_tensor_value_info(name, t, shape)


def seq_vi(name):
    return h.make_tensor_sequence_value_info(name, TP.FLOAT, None)


def loop_model(body_nodes, trips, length, extra_inits=()):
    """Loop(trips) carrying S (from SplitToSequence(x), ``length`` elements of size D) and h;
    ``body_nodes`` map (S, h) -> (S_out, h_out) with t the iteration number; y stacks the final
    S, hf is the final h."""
    body = h.make_graph(
        body_nodes + [N("Identity", ["c"], ["c_out"])], "body",
        [vi("t", TP.INT64, []), vi("c", TP.BOOL, []), seq_vi("S"), vi("h", shape=[D])],
        [vi("c_out", TP.BOOL, []), seq_vi("S_out"), vi("h_out", shape=[D])],
        [h.make_tensor("one", TP.INT64, [], [1]), *extra_inits])
    nodes = [N("SplitToSequence", ["x"], ["S0"], axis=0, keepdims=0),
             N("Loop", ["trips", "", "S0", "h0"], ["Sf", "hf"], body=body),
             N("ConcatFromSequence", ["Sf"], ["y"], axis=0, new_axis=1)]
    return vi_model(nodes, [vi("x", shape=[length, D]), vi("h0", shape=[D]), vi("w", shape=[D])],
                    [vi("y", shape=["n", D]), vi("hf", shape=[D])],
                    inits={"trips": np.array(trips, np.int64)},
                    infer=False)


def test_read_previous_write_next():
    """S[t+1] = tanh(S[t] * w + S[t+1]): each step reads what the step before wrote."""
    m = loop_model([
        N("SequenceAt", ["S", "t"], ["r"]), N("Add", ["t", "one"], ["t1"]),
        N("SequenceAt", ["S", "t1"], ["r1"]), N("Mul", ["r", "w"], ["rw"]),
        N("Add", ["rw", "r1"], ["a"]), N("Tanh", ["a"], ["v"]),
        N("SequenceErase", ["S", "t1"], ["S1"]), N("SequenceInsert", ["S1", "v", "t1"], ["S_out"]),
        N("Add", ["h", "v"], ["h_out"])], trips=4, length=5)
    assert_gradients(m, ["y", "hf"], ["x", "h0", "w"])


def test_push_in_one_loop_pop_in_another():
    """What tf.gradients builds: a forward loop pushes onto a stack, a second loop pops."""
    push = h.make_graph(
        [N("Mul", ["h", "w"], ["hw"]), N("Sin", ["hw"], ["h_out"]),
         N("SequenceInsert", ["S", "h_out"], ["S_out"]), N("Identity", ["c"], ["c_out"])],
        "push", [vi("t", TP.INT64, []), vi("c", TP.BOOL, []), seq_vi("S"), vi("h", shape=[D])],
        [vi("c_out", TP.BOOL, []), seq_vi("S_out"), vi("h_out", shape=[D])])
    pop = h.make_graph(
        [N("SequenceAt", ["S", "last"], ["v"]), N("SequenceErase", ["S", "last"], ["S_out"]),
         N("Mul", ["a", "v"], ["av"]), N("Add", ["av", "v"], ["a_out"]),
         N("Identity", ["c"], ["c_out"])],
        "pop", [vi("t", TP.INT64, []), vi("c", TP.BOOL, []), seq_vi("S"), vi("a", shape=[D])],
        [vi("c_out", TP.BOOL, []), seq_vi("S_out"), vi("a_out", shape=[D])],
        [h.make_tensor("last", TP.INT64, [], [-1])])
    m = vi_model([N("SequenceEmpty", [], ["S0"], dtype=TP.FLOAT),
                  N("Loop", ["trips", "", "S0", "h0"], ["S1", "hf"], body=push),
                  N("Loop", ["trips", "", "S1", "h0"], ["S2", "y"], body=pop)],
                 [vi("h0", shape=[D]), vi("w", shape=[D])], [vi("y", shape=[D]), vi("hf", shape=[D])],
                 inits={"trips": np.array(3, np.int64)}, infer=False)
    assert_gradients(m, ["y", "hf"], ["h0", "w"])


def test_a_state_changed_otherwise_is_refused():
    """A carried sequence rebuilt from scratch each iteration (not by inserts and erases) cannot
    be undone: a clear refusal, not a wrong gradient."""
    m = loop_model([
        N("SequenceAt", ["S", "t"], ["r"]), N("Mul", ["r", "w"], ["v"]),
        N("SequenceConstruct", ["v", "v", "v", "v"], ["S_out"]), N("Add", ["h", "v"], ["h_out"])],
        trips=2, length=4)
    with pytest.raises(onnxgrad.NotDifferentiableError, match="cannot be rebuilt"):
        onnxgrad.gradients(m, "hf", ["x", "w"])


# -- random programs ------------------------------------------------------------------------------
# one body step: ("read", a, b) h = tanh(h + S[(a*t + b) mod len] * w); ("write", a, b)
# S[(a*t + b) mod len] = sin(h) * w; ("push",) S.append(sin(h * w)); ("pop",)
# h = tanh(h + S.pop() * h); ("grow", n) a nested Loop appends cos(h) n times (the converter's
# growing of a TF list to an index). Bounded, so that finite differences stay accurate
STEP = st.one_of(
    st.tuples(st.just("read"), st.integers(0, 2), st.integers(-3, 3)),
    st.tuples(st.just("write"), st.integers(0, 2), st.integers(-3, 3)),
    st.tuples(st.just("push")), st.tuples(st.just("pop")),
    st.tuples(st.just("grow"), st.integers(0, 2)))


def program_model(steps, trips, length):
    nodes, s, hv, k = [], "S", "h", 0

    def fresh(base):
        nonlocal k
        k += 1
        return f"{base}{k}"

    def position(a, b):  # (a*t + b) mod len(S), computed at run time
        ln, at, ab, p = fresh("len"), fresh("at"), fresh("ab"), fresh("p")
        nodes.extend([N("SequenceLength", [s], [ln]), N("Mul", ["t", f"c{a}"], [at]),
                      N("Add", [at, f"c{b}"], [ab]), N("Mod", [ab, ln], [p], fmod=0)])
        return p

    for step in steps:
        if step[0] == "read":
            r, m, a, t = fresh("r"), fresh("m"), fresh("a"), fresh("h")
            nodes += [N("SequenceAt", [s, position(*step[1:])], [r]), N("Mul", [r, "w"], [m]),
                      N("Add", [hv, m], [a]), N("Tanh", [a], [t])]
            hv = t
        elif step[0] == "write":
            p = position(*step[1:])
            v, vw, e, ins = fresh("v"), fresh("vw"), fresh("S"), fresh("S")
            nodes += [N("Sin", [hv], [v]), N("Mul", [v, "w"], [vw]),
                      N("SequenceErase", [s, p], [e]), N("SequenceInsert", [e, vw, p], [ins])]
            s = ins
        elif step[0] == "push":
            m, v, ins = fresh("m"), fresh("v"), fresh("S")
            nodes += [N("Mul", [hv, "w"], [m]), N("Sin", [m], [v]),
                      N("SequenceInsert", [s, v], [ins])]
            s = ins
        elif step[0] == "grow":
            v, ins = fresh("v"), fresh("S")
            inner = h.make_graph(
                [N("SequenceInsert", ["gs", v], ["gs_out"]), N("Identity", ["gc"], ["gc_out"])],
                fresh("grow"), [vi("gk", TP.INT64, []), vi("gc", TP.BOOL, []), seq_vi("gs")],
                [vi("gc_out", TP.BOOL, []), seq_vi("gs_out")])
            nodes += [N("Cos", [hv], [v]), N("Loop", [f"c{step[1]}", "", s], [ins], body=inner)]
            s = ins
        else:
            r, e, m, a, t = fresh("r"), fresh("S"), fresh("m"), fresh("a"), fresh("h")
            nodes += [N("SequenceAt", [s, "cm1"], [r]), N("SequenceErase", [s], [e]),
                      N("Mul", [r, hv], [m]), N("Add", [hv, m], [a]), N("Tanh", [a], [t])]
            s, hv = e, t
    nodes += [N("Identity", [s], ["S_out"]), N("Identity", [hv], ["h_out"])]
    consts = [h.make_tensor(f"c{i}", TP.INT64, [], [i]) for i in range(-3, 4)]
    consts.append(h.make_tensor("cm1", TP.INT64, [], [-1]))
    return loop_model(nodes, trips, length, extra_inits=consts)


def _length_needed(steps, trips) -> int:
    """The fewest elements S must start with so that every read, write and pop meets a
    non-empty sequence (a pop leaves one at least) and the final one is not empty."""
    n = low = 0
    for _ in range(trips):
        for step in steps:
            if step[0] in ("push", "grow"):
                n += 1 if step[0] == "push" else step[1]
            elif step[0] == "pop":
                low = min(low, n - 2)
                n -= 1
            else:
                low = min(low, n - 1)
    return max(1, -low, 1 - n)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=1, max_size=5), trips=st.integers(0, 3),
       extra=st.integers(0, 2))
def test_random_read_write_push_pop_programs(steps, trips, extra):
    m = program_model(steps, trips, _length_needed(steps, trips) + extra)
    assert_gradients(m, ["y", "hf"], ["x", "h0", "w"])
