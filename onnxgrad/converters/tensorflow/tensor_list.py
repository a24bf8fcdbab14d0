"""TF2 TensorLists (``tf.TensorArray`` inside ``tf.function``, Keras RNN loops) as ONNX sequences.

A TensorList is a value (a ``DT_VARIANT`` tensor), not a resource: every op takes a list and
returns a new one, so a list maps directly onto an ONNX sequence value and a loop-carried list
onto a loop-carried sequence; nothing is threaded by hand as for TF1 TensorArrays
(:mod:`.resources`).

``TensorListReserve`` with a fully known element shape (a constant, or a shape computed at run
time, as TF2 gradients do) makes ``num_elements`` zeros. With a constant, partly known one
(Keras's ``[-1, units]``: the batch is unknown) it makes an empty *lazy* list that grows as it
is written: ``TensorListSetItem`` first grows it to its reserved length (or past it, to the
index) with zeros shaped like the written value (what TF reads from an unwritten element), so
writes in any order work and ONNX never sees stand-in elements of a wrong shape;
``TensorListLength`` says the reserved length from the start. A list never written stays empty
(``TensorListStack`` of it fails where TF would give zeros of a shape it infers).
``TensorListSetItem`` replaces an element (``SequenceErase`` + ``SequenceInsert``);
``resize_if_index_out_of_bounds`` (``dynamic_size=True`` arrays) grows the list the same way.

Reads that take an ``element_shape`` input (GetItem, Stack, Gather, PopBack) reshape their result
to it (0 for unknown dims: a no-op at run time) so that ONNX shape inference knows its rank.
``TensorListElementShape`` gives the first element's shape (TF's -1 dims are the run-time ones
here; an empty list fails). ``TensorListStack`` of an empty list with a fully known element shape
gives ``[0, *shape]``. ``TensorListResize`` pads with scalar zeros (it cannot tell the element
shape): a grown list stacks once those elements are written.

Which values are lists, and their element types, is recorded (:func:`mark`, :func:`elem_type`):
a Loop/If body that carries a list declares it as ``sequence(tensor(T))``.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from .control_flow import seq_loop
from .core import Converter, Resource, handler
from .errors import ConversionError
from .graph import TFNode
from .ops import as_i64
from .proto import dtype_info

I64 = TensorProto.INT64


# -- which values are lists ---------------------------------------------------------------------
# A list value is registered in ``c.seq_of`` like a TF1 TensorArray state, with a Resource of kind
# "tensor_list" shared by all versions of one list (``like``): it carries the element type, and
# ``fixed_size=False`` marks a *lazy* list (see :func:`_reserve`). Registered values keep their
# names (the converter renames only plain tensors to TF's names), and code that asks whether a
# value is a sequence (graph outputs, TF1 loops carrying one) sees lists as such.
def mark(c: Converter, seq: str, elem: int | None, like: str | None = None,
         lazy: bool | None = None) -> str:
    """Record that ONNX value ``seq`` is a list of ``elem`` tensors (default: a new version of the
    list ``like``, same type and laziness); returns ``seq``."""
    r = c.seq_of.get(like) if like is not None else None
    if r is None or (elem is not None and elem != r.dtype) or (
            lazy is not None and lazy == r.fixed_size):
        if elem is None:
            elem = elem_type(c, like)
        r = Resource(key=(seq,), kind="tensor_list", dtype=elem, fixed_size=not lazy)
    c.set_state(r, seq)
    return seq


def elem_type(c: Converter, value) -> int | None:
    """The element type of sequence value ``value``, or None when it is not a known sequence."""
    r = c.seq_of.get(value) if isinstance(value, str) else None
    return None if r is None else r.dtype


def is_lazy(c: Converter, value) -> bool:
    r = c.seq_of.get(value) if isinstance(value, str) else None
    return r is not None and r.kind == "tensor_list" and not r.fixed_size


def reserved(c: Converter, value) -> str | None:
    """A lazy list's reserved length (int64 scalar value), when TensorListReserve gave one."""
    return c.seq_of[value].reserved if is_lazy(c, value) else None


def _seq(c: Converter, n: TFNode, i: int = 0) -> str:
    v = c.x(n, i)
    if elem_type(c, v) is None:
        raise ConversionError(f"{n}: input {i} ({n.inputs[i]}) is not a TensorList the converter "
                              "made")
    return v


def _elem(c: Converter, n: TFNode, key: str = "element_dtype") -> int:
    return c.onnx_type(n, key)


def _np_elem(n: TFNode, key: str = "element_dtype"):
    return dtype_info(n.attr[key].type).np


def _known_shape(c: Converter, n: TFNode, i: int) -> list[int] | None:
    """The element_shape input as a list of dims when constant and fully known, else None."""
    s = c.const_input(n, i)
    if s is None or s.ndim != 1 or (s < 0).any():
        return None
    return [int(d) for d in s]


def _with_shape(c: Converter, n: TFNode, i: int, v: str, lead: int = 0) -> str:
    """v, reshaped to tell ONNX shape inference what input i (an element_shape) says: its rank
    and its known dims (a no-op at run time; 0 in Reshape's shape keeps the input's dim). ``lead``
    dims (a stacked list's length) come first."""
    s = c.const_input(n, i)
    if s is None or s.ndim != 1:
        return v
    dims = [0] * lead + [int(d) if d >= 0 else 0 for d in s]
    return c.op("Reshape", [v, c.const(np.array(dims, np.int64))])


def _stack(c: Converter, seq: str) -> str:
    return c.op("ConcatFromSequence", [seq], axis=0, new_axis=1)


def _set(c: Converter, seq: str, idx: str, value: str, grow: bool | None = None) -> str:
    """``seq`` with element ``idx`` replaced by ``value``. A lazy list (see :func:`_reserve`) or
    one that may ``grow`` first grows to idx + 1 elements, with zeros shaped like ``value`` (what
    TF reads from an element not written yet)."""
    if grow or (grow is None and is_lazy(c, seq)):
        seq = _pad(c, seq, idx, value)
    return c.op("SequenceInsert", [c.op("SequenceErase", [seq, idx]), value, idx])


def _pad(c: Converter, seq: str, idx: str, value: str) -> str:
    """Grow ``seq`` to idx + 1 elements, and a lazy list at once to its reserved length (TF's
    length from the start, which TensorListLength must say)."""
    elem = elem_type(c, seq)
    size = c.op("Add", [idx, c.const(1, np.int64)])
    length = reserved(c, seq)
    if length is not None:
        size = c.op("Max", [size, length])
    count = c.op("Max", [c.op("Sub", [size, c.op("SequenceLength", [seq])]),
                         c.const(0, np.int64)])
    zero = c.op("ConstantOfShape", [c.op("Shape", [value])],
                value=helper.make_tensor("zero", elem, [1], [0]))
    return seq_loop(c, count, seq, elem, lambda k, s: c.op("SequenceInsert", [s, zero]), "grow")


def _zeros_seq(c: Converter, n: TFNode, count: str, shape) -> str:
    """A sequence of ``count`` (int64 scalar value) zero elements of ``shape``: a list of dims,
    or an int64 shape value known only at run time."""
    dtype, np_t = _elem(c, n), _np_elem(n)
    k = c.consts.get(count)
    if k is not None and int(k) == 0:
        return c.op("SequenceEmpty", [], dtype=dtype)
    if k is not None and isinstance(shape, list):
        zeros = c.const(np.zeros([int(k), *shape], np_t))
        return c.op("SplitToSequence", [zeros], axis=0, keepdims=0)
    # a count or shape known only at run time (a count maybe 0): a Loop that appends one zero
    # element per iteration
    zero = c.const(np.zeros(shape, np_t)) if isinstance(shape, list) else c.op(
        "ConstantOfShape", [shape], value=helper.make_tensor("zero", dtype, [1], [0]))
    return seq_loop(c, count, c.op("SequenceEmpty", [], dtype=dtype), dtype,
                    lambda k, s: c.op("SequenceInsert", [s, zero]), "reserve")


# -- making lists ------------------------------------------------------------------------------
@handler("EmptyTensorList")
def _empty(c, n):
    return [mark(c, c.op("SequenceEmpty", [], dtype=_elem(c, n)), _elem(c, n))]


@handler("TensorListReserve")
def _reserve(c, n):
    """Zeros when the element shape is fully known, or given at run time (TF2 gradients take it
    from TensorListElementShape: then it must be fully known when the list is made); a constant,
    partly known shape makes an empty, *lazy* list: it grows as it is written, so ONNX never sees
    stand-ins of a wrong shape."""
    like = c.list_shape_of.get(c.x(n, 0))
    if like is not None and like == c.list_length_of.get(c.x(n, 1)) and not is_lazy(c, like):
        # TF's gradients reserve a list shaped and sized like the forward one: its unset elements
        # are zeros shaped like that list's own (TensorListConcat sizes them from its lengths,
        # AddN takes the other list's), also when its elements differ in shape (a ragged split)
        return [_zeros_like_list(c, like, _elem(c, n), new_list=True)]
    shape = _known_shape(c, n, 0)
    count = as_i64(c, c.x(n, 1))
    if shape is not None:
        return [mark(c, _zeros_seq(c, n, count, shape), _elem(c, n))]
    if c.const_input(n, 0) is None:
        return [mark(c, _zeros_seq(c, n, count, as_i64(c, c.x(n, 0))), _elem(c, n))]
    seq = mark(c, c.op("SequenceEmpty", [], dtype=_elem(c, n)), _elem(c, n), lazy=True)
    c.seq_of[seq].reserved = count
    return [seq]


@handler("TensorListFromTensor")
def _from_tensor(c, n):
    seq = c.op("SplitToSequence", [c.x(n, 0)], axis=0, keepdims=0)
    c.stacked[seq] = c.x(n, 0)  # (reads gather from the tensor itself)
    return [mark(c, seq, _elem(c, n))]


@handler("TensorListSplit")
def _split(c, n):  # (tensor, element_shape, lengths)
    seq = c.op("SplitToSequence", [c.x(n, 0), as_i64(c, c.x(n, 2))], axis=0)
    return [mark(c, seq, _elem(c, n))]


@handler("TensorListScatter", "TensorListScatterV2")
def _scatter(c, n):  # (tensor, indices, element_shape[, num_elements])
    t, idx = c.x(n, 0), as_i64(c, c.x(n, 1))
    length = c.op("Add", [c.op("ReduceMax", [idx], keepdims=1), c.i64(1)])
    if n.op == "TensorListScatterV2":
        length = c.op("Max", [length, c.op("Reshape", [as_i64(c, c.x(n, 3)), c.i64(1)])])
    shape = c.op("Concat", [length, c.op("Shape", [t], start=1)], axis=0)
    zeros = c.op("ConstantOfShape", [shape], value=helper.make_tensor(
        "zero", _elem(c, n), [1], np.zeros(1, _np_elem(n))))
    full = c.op("ScatterND", [zeros, c.op("Unsqueeze", [idx, c.i64(1)]), t])
    return [mark(c, c.op("SplitToSequence", [full], axis=0, keepdims=0), _elem(c, n))]


# -- reading -----------------------------------------------------------------------------------
@handler("TensorListGetItem")
def _get(c, n):  # (handle, index, element_shape)
    seq = _seq(c, n)
    if seq in c.stacked:
        return [_with_shape(c, n, 2, c.op("Gather", [c.stacked[seq], c.x(n, 1)], axis=0))]
    if not is_lazy(c, seq) or (c.const_input(n, 2) is not None and _known_shape(c, n, 2) is None):
        # (a lazy list whose element shape TF does not know fully: an unwritten element has no
        # shape to give, TF fails to read it as well)
        return [_with_shape(c, n, 2, c.op("SequenceAt", [seq, c.x(n, 1)]))]
    # a lazy list may not have grown to the index yet: TF reads zeros of element_shape there
    from .control_flow import Body, graph_output
    idx = as_i64(c, c.x(n, 1))
    inside = c.op("Less", [idx, c.op("SequenceLength", [seq])])
    elem = elem_type(c, seq)
    branches = []
    for k in (1, 0):
        with Body(c) as body:
            v = c.op("SequenceAt", [seq, idx]) if k else c.op(
                "ConstantOfShape", [as_i64(c, c.x(n, 2))],
                value=helper.make_tensor("zero", elem, [1], [0]))
            out = graph_output(c, body, v, f"{n.name}/item")
            body.outputs.append(helper.make_tensor_value_info(out, elem, None))
            branches.append(body.graph(f"{n.name.replace('/', '_')}_{k}"))
    return [_with_shape(c, n, 2, c.op("If", [inside], then_branch=branches[0],
                                      else_branch=branches[1]))]


@handler("TensorListStack")
def _stack_op(c, n):  # (handle, element_shape)
    seq = _seq(c, n)
    if seq in c.stacked:
        return [_with_shape(c, n, 1, c.stacked[seq], lead=1)]
    shape = _known_shape(c, n, 1)
    if shape is None:
        return [_with_shape(c, n, 1, _stack(c, seq), lead=1)]
    # a fully known element shape: an empty list stacks to [0, *shape] (ONNX's concat of an
    # empty sequence fails)
    from .control_flow import Body, graph_output
    empty = c.op("Equal", [c.op("SequenceLength", [seq]), c.const(0, np.int64)])
    branches = []
    for k in (1, 0):
        with Body(c) as body:
            v = c.const(np.zeros([0, *shape], _np_elem(n))) if k else _stack(c, seq)
            out = graph_output(c, body, v, f"{n.name}/stacked")
            body.outputs.append(helper.make_tensor_value_info(out, _elem(c, n), None))
            branches.append(body.graph(f"{n.name.replace('/', '_')}_{k}"))
    return [_with_shape(c, n, 1, c.op("If", [empty], then_branch=branches[0],
                                      else_branch=branches[1]), lead=1)]


@handler("TensorListGather")
def _gather(c, n):  # (handle, indices, element_shape)
    seq = _seq(c, n)
    return [_with_shape(c, n, 2, c.op("Gather", [c.stacked.get(seq) or _stack(c, seq),
                                                c.x(n, 1)], axis=0), lead=1)]


@handler("TensorListConcat", "TensorListConcatV2")
def _concat(c, n):  # -> (tensor, lengths)
    seq = _seq(c, n)
    first_dim = helper.make_graph(
        [helper.make_node("Shape", ["e"], ["d"], start=0, end=1)], "first_dim",
        [helper.make_tensor_value_info("e", _elem(c, n), None)],
        [helper.make_tensor_value_info("d", I64, [1])])
    lengths = c.op("SequenceMap", [seq], body=first_dim)
    return [c.op("ConcatFromSequence", [seq], axis=0, new_axis=0),
            c.op("ConcatFromSequence", [lengths], axis=0, new_axis=0)]


@handler("TensorListLength")
def _length(c, n):
    seq = _seq(c, n)
    length = c.op("SequenceLength", [seq])
    if reserved(c, seq) is not None:  # a lazy list not grown yet has its reserved length
        length = c.op("Max", [length, reserved(c, seq)])
    out = c.op("Cast", [length], to=TensorProto.INT32)
    c.list_length_of[out] = c.list_length_of[f"{n.name}:0"] = seq  # (renamed to TF's name)
    return [out]


@handler("TensorListElementShape")
def _element_shape(c, n):
    shape = c.op("Shape", [c.op("SequenceAt", [_seq(c, n), c.i64(0)])])
    t = c.onnx_type(n, "shape_type") if "shape_type" in n.attr else TensorProto.INT32
    out = shape if t == I64 else c.op("Cast", [shape], to=t)
    c.list_shape_of[out] = c.list_shape_of[f"{n.name}:0"] = _seq(c, n)  # (renamed to TF's name)
    return [out]


# -- changing ----------------------------------------------------------------------------------
@handler("TensorListSetItem")
def _set_item(c, n):  # (handle, index, item)
    seq, idx, value = _seq(c, n), as_i64(c, c.x(n, 1)), c.x(n, 2)
    if seq in c.list_scans:  # the loop's write at its iteration number: a scan output
        c.list_scans[seq] = value
        return [seq]
    grow = bool(c.attr(n, "resize_if_index_out_of_bounds", False)) or is_lazy(c, seq)
    return [mark(c, _set(c, seq, idx, value, grow), None, like=seq)]


@handler("TensorListPushBack")
def _push(c, n):
    seq = _seq(c, n)
    return [mark(c, c.op("SequenceInsert", [seq, c.x(n, 1)]), None, like=seq)]


@handler("TensorListPopBack")
def _pop(c, n):  # -> (output_handle, tensor)
    seq, last = _seq(c, n), c.i64(-1)
    value = _with_shape(c, n, 1, c.op("SequenceAt", [seq, last]))
    return [mark(c, c.op("SequenceErase", [seq, last]), None, like=seq), value]


@handler("TensorListScatterIntoExistingList")
def _scatter_into(c, n):  # (handle, tensor, indices): one replacement per index, in a Loop
    from .control_flow import Body
    seq, t, idx = _seq(c, n), c.x(n, 1), as_i64(c, c.x(n, 2))
    elem = elem_type(c, seq)
    with Body(c) as body:
        k, cond, s = c.fresh("k"), c.fresh("cond"), c.fresh("seq")
        body.inputs += [helper.make_tensor_value_info(k, I64, []),
                        helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
                        helper.make_tensor_sequence_value_info(s, elem, None)]
        out = _set(c, mark(c, s, None, like=seq), c.op("Gather", [idx, k], axis=0),
                   c.op("Gather", [t, k], axis=0))
        cond_out = c.op("Identity", [cond])
        body.outputs += [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
                         helper.make_tensor_sequence_value_info(out, elem, None)]
        graph = body.graph("scatter_into")
    count = c.op("Squeeze", [c.op("Shape", [idx], start=0, end=1), c.i64(0)])
    return [mark(c, c.op("Loop", [count, "", seq], body=graph), None, like=seq)]


@handler("TensorListResize")
def _resize(c, n):  # (handle, size): drop elements past size, or append zeros (scalar stand-ins)
    seq, size = _seq(c, n), as_i64(c, c.x(n, 1))
    elem = elem_type(c, seq)
    from .control_flow import Body
    length = c.op("SequenceLength", [seq])
    # keep min(size, length) elements, then append max(0, size - length) stand-ins
    keep = c.op("Min", [size, length])
    with Body(c) as body:
        k, cond, s = c.fresh("k"), c.fresh("cond"), c.fresh("seq")
        body.inputs += [helper.make_tensor_value_info(k, I64, []),
                        helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
                        helper.make_tensor_sequence_value_info(s, elem, None)]
        out = c.op("SequenceInsert", [s, c.op("SequenceAt", [seq, k])])
        cond_out = c.op("Identity", [cond])
        body.outputs += [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
                         helper.make_tensor_sequence_value_info(out, elem, None)]
        graph = body.graph("resize_keep")
    kept = c.op("Loop", [keep, "", c.op("SequenceEmpty", [], dtype=elem)], body=graph)
    zero = c.const(np.zeros((), helper.tensor_dtype_to_np_dtype(elem)))
    with Body(c) as body:
        k, cond, s = c.fresh("k"), c.fresh("cond"), c.fresh("seq")
        body.inputs += [helper.make_tensor_value_info(k, I64, []),
                        helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
                        helper.make_tensor_sequence_value_info(s, elem, None)]
        out = c.op("SequenceInsert", [s, zero])
        cond_out = c.op("Identity", [cond])
        body.outputs += [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
                         helper.make_tensor_sequence_value_info(out, elem, None)]
        graph = body.graph("resize_pad")
    pad = c.op("Max", [c.op("Sub", [size, length]), c.const(0, np.int64)])
    return [mark(c, c.op("Loop", [pad, "", kept], body=graph), None, like=seq)]


def _zero_rows(c: Converter, init: str, rows: str, stacked: str) -> str:
    """``rows`` (int64 [1]) zeros of list ``init``'s type, each shaped like ``stacked``'s rows."""
    dims = c.op("Concat", [rows, c.op("Shape", [stacked], start=1)], axis=0)
    return c.op("ConstantOfShape", [dims],
                value=helper.make_tensor("zero", elem_type(c, init), [1], [0]))


def _dense_list(c: Converter, init: str, dense: str) -> str:
    """A new list of ``init``'s type holding ``dense``'s rows, whose stacked form reads use."""
    seq = mark(c, c.op("SplitToSequence", [dense], axis=0, keepdims=0), elem_type(c, init),
               lazy=False)
    c.stacked[seq] = dense
    return seq


def written_by_scan(c: Converter, init: str, stacked: str) -> str:
    """The list ``init`` after a Loop wrote element k at iteration k: ``stacked`` [n, *elem],
    the values written (scan outputs), over the list's first n elements (a lazy list: zeros past
    them to its reserved length), as a new list whose stacked form reads use directly."""
    n = c.op("Shape", [stacked], end=1)
    if is_lazy(c, init):
        rest = c.op("Max", [c.op("Sub", [c.op("Reshape", [reserved(c, init) or c.const(
            0, np.int64), c.i64(1)]), n]), c.i64(0)])
        dense = c.op("Concat", [stacked, _zero_rows(c, init, rest, stacked)], axis=0)
    else:
        old = c.stacked.get(init) or _stack(c, init)
        iota = c.op("Range", [c.const(0, np.int64), c.op("Squeeze", [n, c.i64(0)]),
                              c.const(1, np.int64)])
        dense = c.op("ScatterND", [old, c.op("Unsqueeze", [iota, c.i64(1)]), stacked])
    return _dense_list(c, init, dense)


def written_last_by_scan(c: Converter, init: str, stacked: str, k: int) -> str:
    """The list ``init`` after a Loop wrote its element ``k`` at every iteration: ``stacked``
    [n, *elem] the values written (scan outputs); element k is the last of them (none when n is
    0), every other element as it was (a lazy list's: zeros shaped like them, to its reserved
    length)."""
    n = c.op("Shape", [stacked], end=1)
    m = c.op("Min", [n, c.i64(1)])  # 0 or 1 element written
    last = c.op("Slice", [stacked, c.op("Sub", [n, m]), n, c.i64(0)])
    if is_lazy(c, init):
        old = _zero_rows(c, init, c.op("Reshape", [reserved(c, init), c.i64(1)]), stacked)
    else:
        old = c.stacked.get(init) or _stack(c, init)
    at = c.op("Expand", [c.const(np.array([[k]], np.int64)), c.op("Concat", [m, c.i64(1)],
                                                                  axis=0)])
    return _dense_list(c, init, c.op("ScatterND", [old, at, last]))


# -- arithmetic on lists (TF2 gradients: ZerosLike of a list, AddN of gradient lists) -----------
def list_arithmetic(c: Converter, n: TFNode) -> list:
    """ZerosLike/OnesLike of a list: a list of zeros/ones shaped like its elements; Add/AddN of
    lists: the element-wise sums (the lists must have one length)."""
    vals = [c.x(n, i) for i in range(len(n.inputs))]
    seqs = [v for v in vals if elem_type(c, v) is not None]
    if len(seqs) != len(vals):
        raise ConversionError(f"{n} combines a TensorList with a tensor")
    if n.op in ("ZerosLike", "OnesLike"):
        return [_zeros_like_list(c, seqs[0], elem_type(c, seqs[0]), int(n.op == "OnesLike"))]
    return [_map(c, seqs, elem_type(c, seqs[0]), "AddN_elements",
                 lambda names: [helper.make_node("Sum", names, ["y"])])]


def _zeros_like_list(c: Converter, seq: str, elem: int, fill: int = 0,
                     new_list: bool = False) -> str:
    """A list of ``elem`` zeros (or ``fill``) shaped like each element of ``seq``: a version of
    ``seq``, or a ``new_list``."""
    return _map(c, [seq], elem, "fill_elements", lambda names: [
        helper.make_node("Shape", names, ["s"]),
        helper.make_node("ConstantOfShape", ["s"], ["y"], value=helper.make_tensor(
            "v", elem, [1], [fill]))], in_elem=elem_type(c, seq), new_list=new_list)


def _map(c: Converter, seqs: list, elem: int, name: str, nodes, in_elem=None,
         new_list: bool = False) -> str:
    """SequenceMap of ``nodes(input names)`` (one output "y" of ``elem``) over ``seqs``."""
    names = [f"e{k}" for k in range(len(seqs))]
    body = helper.make_graph(nodes(names), name,
                             [helper.make_tensor_value_info(x, in_elem or elem, None)
                              for x in names],
                             [helper.make_tensor_value_info("y", elem, None)])
    out = c.op("SequenceMap", seqs, body=body)
    return mark(c, out, elem) if new_list else mark(c, out, elem, like=seqs[0])
