"""TensorArrays and stacks: TF resources as ONNX sequence values (DESIGN.md, "TensorArray = ONNX
sequences").

A handle becomes a :class:`Resource`; its contents are an ONNX sequence, the resource's *state*,
which every op reads and replaces in TF's execution order (flow tensors and control edges give
that order; a flow output is bound to the state it leaves behind). ``TensorArrayGradV3(handle,
flow, source)`` is the gradient array ``<array>@<source>``: one per (array, source), its size
frozen at the forward array's, elements zeros shaped like the forward's, and writes add up.
Stacks (what tf.gradients uses to carry values from a forward while loop to the backward one)
push with SequenceInsert and pop from the end.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from .core import Converter, Resource, handler
from .graph import Graph, TFNode

PASS = frozenset({"Enter", "RefEnter", "Identity", "Switch", "RefSwitch", "Merge", "RefMerge",
                  "Exit", "RefExit"})
GRAD_OPS = ("TensorArrayGradV3", "TensorArrayGradWithShape")
MUTATING = frozenset({"TensorArrayWriteV3", "TensorArrayScatterV3", "TensorArraySplitV3",
                      "StackPushV2", "StackPopV2", *GRAD_OPS})


def static_key(g: Graph, ref: str) -> tuple:
    """The resource a handle tensor refers to, traced back to the op that made it."""
    p = g.producer(ref)
    while p.op in PASS:
        p = g.producer(p.inputs[0])
    if p.op in GRAD_OPS:
        return static_key(g, p.inputs[0]) + (p.attr["source"].s.decode(),)
    return (p.name,)


FLOW_OUT = {"TensorArrayV3": 1, "TensorArrayWriteV3": 0, "TensorArrayScatterV3": 0,
            "TensorArraySplitV3": 0, "TensorArrayGradV3": 1, "TensorArrayGradWithShape": 1}


def flow_key(g: Graph, ref: str, _seen=None) -> tuple | None:
    """The resource whose flow ``ref`` is (through Enter/Merge/Add/... of flows), else None."""
    from .core import FLOW_OPS
    seen = set() if _seen is None else _seen
    if ref in seen:
        return None
    seen.add(ref)
    p = g.producer(ref)
    if FLOW_OUT.get(p.op) == int(ref.split(":")[1]):
        return static_key(g, p.inputs[0] if p.op != "TensorArrayV3" else ref) + (
            (p.attr["source"].s.decode(),) if p.op in GRAD_OPS else ())
    if p.op in PASS or p.op in FLOW_OPS or p.op in ("NextIteration", "RefNextIteration"):
        for r in p.inputs:
            k = flow_key(g, r, seen)
            if k is not None:
                return k
    return None


def mutated(g: Graph, members: list[TFNode]):
    """(resource key, node) for each op in ``members`` that changes a resource."""
    seen = {}
    for n in members:
        if n.op in MUTATING:
            seen.setdefault(static_key(g, n.inputs[0]) + (
                (n.attr["source"].s.decode(),) if n.op in GRAD_OPS else ()), n)
    return list(seen.items())


def _i64(c: Converter, idx: str) -> str:
    from .ops import as_i64
    return as_i64(c, idx)


def _zeros(c: Converter, r: Resource, shape: str) -> str:
    """Zeros of the array's element type and the int64 ``shape`` (TF's unwritten elements)."""
    return c.zeros(shape, helper.tensor_dtype_to_np_dtype(r.dtype))


# -- TensorArray ---------------------------------------------------------------------------------
@handler("TensorArrayV3")
def _tensor_array(c: Converter, n: TFNode):
    dtype = c.onnx_type(n, "dtype")
    size = c.const_input(n, 0)
    shape = c.attr(n, "element_shape")
    if (shape is None or None in shape) and c.attr(n, "identical_element_shapes", False):
        shape = _written_shape(c, n) or shape
    r = Resource((n.name,), "tensor_array", dtype, elem_shape=shape)
    c.resources[r.key] = r
    full = shape is not None and all(d is not None for d in shape)
    if size is not None and int(size) > 0 and full and not c.attr(n, "dynamic_size", False):
        from .proto import dtype_info
        zeros = c.const(np.zeros([int(size), *shape], dtype_info(n.attr["dtype"].type).np))
        seq = c.op("SplitToSequence", [zeros], axis=0, keepdims=0)
        c.seq_len[seq] = int(size)
    else:  # unknown element shape: writes insert (TF loops write index t at step t)
        r.fixed_size = False
        seq = c.op("SequenceEmpty", [], dtype=dtype)
        c.seq_len[seq] = 0
        r.unwritten = (seq, c.x(n, 0))  # (the empty state, the size), see _scatter
    r.made = (seq, c.x(n, 0), c.attr(n, "dynamic_size", False))
    c.set_state(r, seq)
    return [r, seq]


def _written_shape(c: Converter, n: TFNode) -> list | None:
    """The static shape of the rows written to array n (all one shape), when TF knows it: then
    the array starts as zeros, which writes in any order, in any loop, replace."""
    for w in c.g.nodes.values():
        if w.op == "TensorArrayWriteV3" and static_key(c.g, w.inputs[0]) == (n.name,):
            name, i = w.inputs[2].split(":")
            shapes = c.attr(c.g.nodes[name], "_output_shapes")
            s = shapes[int(i)] if shapes and int(i) < len(shapes) else None
            return s if s is not None and None not in s else None
    return None


def ensure_grad(c: Converter, fwd: Resource, source: str, prepend: str | None = None) -> Resource:
    key = fwd.key + (source,)
    if key in c.state:
        return c.resources[key]
    r = c.resources.setdefault(key, Resource(key, "tensor_array", fwd.dtype))
    body_in, body_out = c.fresh("element"), c.fresh("zeros")
    zero = helper.make_tensor("zero", fwd.dtype, [1], [0])
    shape = c.fresh("shape")
    nodes = [helper.make_node("Shape", [body_in], [shape])]
    if prepend is not None:
        full = c.fresh("shape")
        nodes.append(helper.make_node("Concat", [prepend, shape], [full], axis=0))
        shape = full
    nodes.append(helper.make_node("ConstantOfShape", [shape], [body_out], value=zero))
    body = helper.make_graph(nodes, "zeros_like", [
        helper.make_tensor_value_info(body_in, fwd.dtype, None)],
        [helper.make_tensor_value_info(body_out, fwd.dtype, None)])
    c.set_state(r, c.op("SequenceMap", [c.get_state(fwd)], name=f"{key[0]}@{source}", body=body))
    return r


@handler(*GRAD_OPS)
def _grad(c: Converter, n: TFNode):
    fwd = c.resource(n)
    prepend = _i64(c, c.x(n, 2)) if n.op == "TensorArrayGradWithShape" else None
    r = ensure_grad(c, fwd, c.attr(n, "source"), prepend)
    if r.key in c.scan_writes:  # written as scan outputs here: its flow is a placeholder
        return [r, c.const(np.zeros((), np.float32))]
    return [r, c.get_state(r)]


def write(c: Converter, r: Resource, seq: str, idx: str, value: str) -> str:
    """The sequence after writing ``value`` at ``idx`` (an int32 or int64 scalar). An array of
    unknown element shape grows by its writes; at a constant index into a sequence of known
    length (writes outside loops, in any order) it replaces, appends, or grows by zeros shaped
    like ``value`` up to it (TF's unwritten elements), else it appends (TF loops write index t
    at step t)."""
    known, i = c.seq_len.get(seq), c.consts.get(idx)
    i = None if i is None else int(i)
    if len(r.key) > 1:  # a gradient array: writes add up
        value = c.op("Add", [c.op("SequenceAt", [seq, idx]), value])
    replace = len(r.key) > 1 or r.fixed_size or (
        known is not None and i is not None and i < known)
    if replace:
        seq = c.op("SequenceErase", [seq, idx])
    elif known is not None and i is not None and i > known:
        zeros = _zeros(c, r, c.op("Shape", [value]))
        for _ in range(i - known):
            seq = c.op("SequenceInsert", [seq, zeros])
    out = c.op("SequenceInsert", [seq, value, idx])
    if known is not None and i is not None:
        c.seq_len[out] = max(known, i + 1)
    return out


@handler("TensorArrayWriteV3")
def _write(c: Converter, n: TFNode):
    r = c.resource(n)
    if r.key in c.scan_writes:  # a scan output of the Loop being made (see scan_arrays)
        c.scan_writes[r.key] = (_i64(c, c.x(n, 1)), c.x(n, 2))
        flow = c.x(n, 3)  # (the flow: a placeholder float the Loop carries)
        return [flow if flow not in c.seq_of else c.const(np.zeros((), np.float32))]
    # (sequence positions may be int32, TF's index type: no Cast per write)
    return [c.set_state(r, write(c, r, c.get_state(r), c.x(n, 1), c.x(n, 2)))]


SPLITTABLE = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT32)  # onnxruntime's


def scan_arrays(c: Converter, fprefix: tuple, members: list[TFNode]) -> dict:
    """TensorArrays that a while frame only writes, once per iteration at its own level (a
    dynamic_rnn's outputs; the gradient arrays of what it reads, in the backward loop): {key:
    write node}. The Loop emits the written values and their indices as scan outputs and the
    writes are applied after it at once (:func:`apply_scan_writes`), instead of a sequence that
    every write copies whole. Arrays of elements of one shape (identical_element_shapes) only,
    of a dtype onnxruntime splits into sequences, with a known size when not written yet (or a
    dynamic one, not written yet)."""
    if c.opset < 16:  # ScatterND's reduction
        return {}
    names = {n.name for n in members}
    touched: dict[tuple, list[TFNode]] = {}
    for n in members:
        if n.op.startswith("TensorArray") and n.op != "TensorArrayV3" and n.op not in GRAD_OPS:
            touched.setdefault(static_key(c.g, n.inputs[0]), []).append(n)
    out = {}
    for key, ns in touched.items():
        fwd, r = c.g.nodes[key[0]], c.resources.get(key)
        # an array whose rows' shape only its first write tells, also written by an outer
        # loop: no zeros exist to scatter into here (the writes insert instead)
        if r is not None and r.unwritten is not None and c.state.get(key) != r.unwritten[0]:
            continue
        # (a dynamic array too, as made: it grows to the largest index written)
        if (len(ns) != 1 or ns[0].op != "TensorArrayWriteV3" or ns[0].ctx != fprefix
                or key[0] in names or fwd.op != "TensorArrayV3"
                or not c.attr(fwd, "identical_element_shapes", False)
                or c.attr(fwd, "dynamic_size", False) and (r is None or r.unwritten is None)
                or c.onnx_type(fwd, "dtype") not in SPLITTABLE):
            continue
        out[key] = ns[0]
    return out


def apply_scan_writes(c: Converter, r: Resource, idx: str, values: str) -> None:
    """The array after the writes of every iteration of a Loop: ``values`` [n, *elem] at
    ``idx`` [n], scattered into its elements (added, for a gradient array), as a sequence again,
    whose stacked form later gathers read directly."""
    seq = c.get_state(r)
    if r.unwritten is not None and r.unwritten[0] == seq:  # zeros of the rows' shape first
        size = c.op("Reshape", [_i64(c, r.unwritten[1]), c.i64(1)])
        if r.made is not None and r.made[2]:  # dynamic: grown to the largest index written
            top = c.op("ReduceMax", [c.op("Concat", [idx, c.i64(-1)], axis=0)], keepdims=1)
            size = c.op("Max", [size, c.op("Add", [top, c.i64(1)])])
        shape = c.op("Concat", [size, c.op("Shape", [values], start=1)], axis=0)
        dense = _zeros(c, r, shape)
        r.unwritten, r.fixed_size = None, True
    else:
        dense = c.stacked.get(seq) or _stack(c, seq)
    # a Loop that runs no iteration gives its scan outputs zero dims past the first (onnxruntime
    # cannot know them): ScatterND refused [0, 0] updates into [1, 5] (tf.scan over one
    # element scans the rest, none; found by bench/fuzz_tf.py). The rows' shape is dense's.
    values = c.op("Reshape", [values, c.op("Concat", [c.op("Shape", [idx]), c.op(
        "Shape", [dense], start=1)], axis=0)])
    dense = c.op("ScatterND", [dense, c.op("Unsqueeze", [idx, c.i64(-1)]), values],
                 reduction="add" if len(r.key) > 1 else "none")
    seq = c.set_state(r, c.op("SplitToSequence", [dense], axis=0, keepdims=0))
    c.stacked[seq] = dense


def _shaped(c: Converter, v: str, dims, lead: int = 0) -> str:
    """v reshaped to TF's static element shape ``dims`` (None dims kept: 0 in Reshape's shape)
    after ``lead`` leading dims, so that ONNX shape inference knows its rank (sequence elements
    carry no shapes); a no-op at run time."""
    if dims is None:
        return v
    shape = np.array([0] * lead + [0 if d is None else d for d in dims], np.int64)
    return c.op("Reshape", [v, c.const(shape)])


@handler("TensorArrayReadV3")
def _read(c: Converter, n: TFNode):
    r = c.resource(n)
    return [_shaped(c, c.op("SequenceAt", [c.get_state(r), c.x(n, 1)]), r.elem_shape)]


def _stack(c: Converter, seq: str) -> str:
    return c.op("ConcatFromSequence", [seq], axis=0, new_axis=1)


@handler("TensorArrayGatherV3")
def _gather(c: Converter, n: TFNode):
    r = c.resource(n)
    dims = c.attr(n, "element_shape") or r.elem_shape
    seq = c.get_state(r)
    stacked = c.stacked.get(seq) or _stack(c, seq)
    return [_shaped(c, c.op("Gather", [stacked, c.x(n, 1)], axis=0), dims, 1)]


@handler("TensorArraySizeV3")
def _size(c: Converter, n: TFNode):
    return [c.op("Cast", [c.op("SequenceLength", [c.get_state(c.resource(n))])],
                 to=TensorProto.INT32)]


@handler("TensorArrayCloseV3", "StackCloseV2")
def _close(c: Converter, n: TFNode):
    return []


def _iota(c: Converter, n: TFNode, i: int) -> TFNode | None:
    """The Range(0, k, 1) that input i is (tf.TensorArray.unstack's and stack's indices)."""
    p = c.g.producer(n.inputs[i])
    if p.op != "Range":
        return None
    start, delta = (c.consts.get(c.value(p.inputs[j])) for j in (0, 2))
    ok = start is not None and delta is not None and int(start) == 0 and int(delta) == 1
    return p if ok else None


def _unstacked(c: Converter, n: TFNode, r: Resource, seq: str, value: str) -> str | None:
    """The array after writing value's k rows at 0, 1, ..., k-1 (TF's Range indices), where
    that needs no per-index writes: the range runs to the array's own size (the gradient of
    stack()), or the array is as made, its other elements zeros (or none: a dynamic array
    grows to k). Else None: a range shorter than the array must leave its tail as it is."""
    rng = _iota(c, n, 1)
    if rng is None:
        return None
    limit = c.g.producer(rng.inputs[1])
    if limit.op == "TensorArraySizeV3" and static_key(c.g, limit.inputs[0]) == r.key[:1]:
        return _replace_all(c, r, seq, c.op("SplitToSequence", [value], axis=0, keepdims=0))
    if len(r.key) > 1 or r.made is None or seq != r.made[0]:
        return None
    _, size, dynamic = r.made
    k = c.op("Shape", [value], start=0, end=1)
    tail = c.op("Max", [c.op("Sub", [c.op("Reshape", [_i64(c, size), c.i64(1)]), k]), c.i64(0)])
    zeros = _zeros(c, r, c.op("Concat", [tail, c.op("Shape", [value], start=1)], axis=0))
    dense = c.op("Concat", [value, zeros], axis=0)
    r.unwritten, r.fixed_size = None, not dynamic
    seq = c.op("SplitToSequence", [dense], axis=0, keepdims=0)
    c.stacked[seq] = dense
    return seq


def _replace_all(c: Converter, r: Resource, seq: str, new: str) -> str:
    """Writing every element (in order): the new elements, added to the old for a gradient."""
    if len(r.key) == 1:
        return new
    a, b, out = c.fresh("a"), c.fresh("b"), c.fresh("sum")
    add = helper.make_graph([helper.make_node("Add", [a, b], [out])], "add", [
        helper.make_tensor_value_info(a, r.dtype, None),
        helper.make_tensor_value_info(b, r.dtype, None)],
        [helper.make_tensor_value_info(out, r.dtype, None)])
    return c.op("SequenceMap", [seq, new], body=add)  # elements may differ in shape


@handler("TensorArrayScatterV3")
def _scatter(c: Converter, n: TFNode):
    r = c.resource(n)
    seq, value = c.get_state(r), c.x(n, 2)
    new = _unstacked(c, n, r, seq, value)
    if new is not None:
        return [c.set_state(r, new)]
    # any other indices: one write per index, in a Loop
    from .control_flow import seq_loop
    idx = _i64(c, c.x(n, 1))
    if r.unwritten is not None and r.unwritten[0] == seq:
        # the first writes into an array of unknown element shape: make its `size` elements
        # first, zeros shaped like the rows written, so writes at any index replace
        size = c.op("Reshape", [_i64(c, r.unwritten[1]), c.i64(1)])
        shape = c.op("Concat", [size, c.op("Shape", [value], start=1)], axis=0)
        seq = c.op("SplitToSequence", [_zeros(c, r, shape)], axis=0, keepdims=0)
        r.fixed_size = True
    const = c.const_input(n, 1)
    if const is not None and const.size <= 64:  # unrolled: plain ops, which onnxgrad differentiates
        for k, i in enumerate(const.reshape(-1).tolist()):
            row = c.op("Gather", [value, c.const(k, np.int64)], axis=0)
            seq = write(c, r, seq, c.const(i, np.int64), row)
        return [c.set_state(r, seq)]
    count = c.op("Shape", [idx], start=0, end=1)
    m = c.op("Squeeze", [count, c.i64(0)])
    return [c.set_state(r, seq_loop(c, m, seq, r.dtype, lambda k, s: write(
        c, r, s, c.op("Gather", [idx, k], axis=0), c.op("Gather", [value, k], axis=0)),
        "scatter"))]


@handler("TensorArraySplitV3")
def _split(c: Converter, n: TFNode):
    r = c.resource(n)
    new = c.op("SplitToSequence", [c.x(n, 1), _i64(c, c.x(n, 2))], axis=0)
    return [c.set_state(r, _replace_all(c, r, c.get_state(r), new))]


@handler("TensorArrayConcatV3")
def _concat(c: Converter, n: TFNode):
    seq = c.get_state(c.resource(n))
    first_dim = helper.make_graph(
        [helper.make_node("Shape", ["e"], ["d"], start=0, end=1)], "first_dim",
        [helper.make_tensor_value_info("e", c.onnx_type(n, "dtype"), None)],
        [helper.make_tensor_value_info("d", TensorProto.INT64, [1])])
    lengths = c.op("SequenceMap", [seq], body=first_dim)
    rest = c.attr(n, "element_shape_except0")
    return [_shaped(c, c.op("ConcatFromSequence", [seq], axis=0, new_axis=0), rest, 1),
            c.op("ConcatFromSequence", [lengths], axis=0, new_axis=0)]


# -- stacks --------------------------------------------------------------------------------------
@handler("StackV2")
def _stack_v2(c: Converter, n: TFNode):
    r = Resource((n.name,), "stack", c.onnx_type(n, "elem_type"))
    c.resources[r.key] = r
    c.set_state(r, c.op("SequenceEmpty", [], dtype=r.dtype))
    return [r]


@handler("StackPushV2")
def _push(c: Converter, n: TFNode):
    r, value = c.resource(n), c.x(n, 1)
    if value in c.seq_of:
        # tf.gradients also saves TensorArray flows; a flow is only an ordering token here (the
        # array's state is threaded separately), so the stack keeps a placeholder scalar
        from .proto import DTYPES
        np_type = next(d.np for d in DTYPES.values() if d.onnx == r.dtype)
        value = c.const(np.zeros((), np_type))
    if r.key in c.scan_stacks:  # a scan output of the Loop being converted (see scan_stacks)
        if value in c.int64_of:  # a shape: pushed as the int64 it was cast from
            value = c.int64_of[value]
            c.scan_dtype[r.key] = TensorProto.INT64
        c.scan_pushes[r.key] = value
    else:
        c.set_state(r, c.op("SequenceInsert", [c.get_state(r), value]))
    return [c.x(n, 1)]


@handler("StackPopV2")
def _pop(c: Converter, n: TFNode):
    r = c.resource(n)
    if r.key in c.scan_stacks:  # the pushes stacked: read iteration k's from the end
        stacked, last = c.get_state(r)
        if last is None:  # pushed the same value every iteration
            return [stacked]
        idx = c.memo(("pop", last, c.iteration), lambda: c.op("Sub", [last, c.iteration]))
        value = c.op("Gather", [stacked, idx], axis=0)
        c.popped[value] = (stacked, idx)
        if c.scan_dtype.get(r.key, r.dtype) != r.dtype:  # int64 shapes (see _push)
            wide, value = value, c.op("Cast", [value], to=r.dtype)
            c.int64_of[value] = wide
            c.popped[value] = (stacked, idx)
        return [value]
    seq, last = c.get_state(r), c.i64(-1)
    value = c.op("SequenceAt", [seq, last])
    c.set_state(r, c.op("SequenceErase", [seq, last]))
    return [value]


def scan_stacks(g: Graph) -> dict:
    """Stacks pushed once per iteration by one while loop and popped once per iteration by
    another (how tf.gradients carries a loop's values to its backward loop), both loops at the
    level where the stack is made: {key: push node}. The pushes become scan outputs of the
    forward Loop and each pop a read of that stacked tensor from the end (the backward loop's
    iteration k pops the push of iteration n - 1 - k), instead of a sequence that every push
    and pop copies whole."""
    ops: dict[tuple, list[TFNode]] = {}
    for n in g.order:
        if n.op in ("StackPushV2", "StackPopV2"):
            ops.setdefault(static_key(g, n.inputs[0]), []).append(n)
    out = {}
    for key, ns in ops.items():
        pushes = [n for n in ns if n.op == "StackPushV2"]
        pops = [n for n in ns if n.op == "StackPopV2"]
        base = g.nodes[key[0]].ctx
        level = [len(n.ctx) == len(base) + 1 and n.ctx[:-1] == base and n.ctx[-1][0] == "F"
                 for n in ns]
        if len(pushes) == 1 and len(pops) <= 1 and all(level) and (
                not pops or pops[0].ctx != pushes[0].ctx):
            out[key] = pushes[0]
    return out
