"""``TensorArray``: tf.TensorArray's surface, emitting ONNX sequence ops into a model being built.

A TensorArray is an ONNX sequence value; TF's flow tensor is that value (``ta.flow``). Like TF's,
``write``/``scatter``/``unstack``/``split`` return a new TensorArray (the new flow); reads return
tensor names. Models are built with :class:`Builder`, a thin layer over ``onnx.helper``::

    b = Builder()
    x = b.input("x", np.float32, [4, 2])
    ta = TensorArray(b, np.float32, size=4, element_shape=[2]).unstack(x)
    y = b.node("Mul", [ta.read(1), ta.read(2)])
    b.output(y)
    model = b.model()

Inside a Loop body, wrap the body's sequence input with ``TensorArray(body_builder, dtype,
flow=name)`` and pass ``body_builder.graph()`` as the Loop's ``body``.

Errors TF raises are raised here at build time when the index is static (a Python int): writing an
index twice, reading an index that ``clear_after_read`` cleared, writing past a fixed size, a value
of another dtype or of an incompatible element shape. With a dynamic index (a tensor name) nothing
can be checked at build time and ONNX sequences check nothing either: a dynamic write replaces
the element at that position, growing the array first by zeros shaped like the value where the
position lies past its end (TF's unwritten elements; a while loop writing step t appends); reads
of cleared elements return the element (clear_after_read frees nothing in ONNX). A pre-sized
array keeps its size when unstack or split write fewer elements, as TF's graph arrays do
(eager TensorArrays replace the whole array).

``ta.grad(source)`` names the gradient sequence ``<flow>@<source>`` that ``onnxgrad.gradients(...,
name=source)`` creates when it differentiates through this TensorArray.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .emitter import compatible_dims


class InvalidArgumentError(ValueError):
    """TF's InvalidArgumentError, raised at build time (messages follow TF's)."""


class Builder:
    """Collects nodes, inputs, outputs and initializers; names are unique within the builder."""

    def __init__(self, opset: int = 18, name: str = "graph", prefix: str = ""):
        self.opset, self.name, self.prefix = opset, name, prefix
        self.nodes, self.inputs, self.outputs, self.inits = [], [], [], []
        self.types: dict[str, tuple] = {}  # name -> (np dtype or None, shape or None, is_seq)
        self._n = 0

    def fresh(self, base: str) -> str:
        self._n += 1
        return f"{self.prefix}{base}_{self._n}"

    def input(self, name, dtype, shape=None) -> str:
        self.inputs.append(helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape))
        self.types[name] = (np.dtype(dtype), None if shape is None else list(shape), False)
        return name

    def seq_input(self, name, dtype) -> str:
        self.inputs.append(helper.make_tensor_sequence_value_info(
            name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), None))
        self.types[name] = (np.dtype(dtype), None, True)
        return name

    def const(self, value, name=None) -> str:
        name = name or self.fresh("const")
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        arr = np.asarray(value)
        self.types[name] = (arr.dtype, list(arr.shape), False)
        return name

    def node(self, op_type, inputs, n_out=1, **attrs):
        """Add a node; returns its output name (or a list of names when n_out > 1)."""
        outs = [self.fresh(op_type) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh(op_type),
                                           **attrs))
        return outs[0] if n_out == 1 else outs

    def output(self, name, dtype=None, shape=None, seq=False):
        if dtype is None:
            self.outputs.append(helper.make_empty_tensor_value_info(name))
        elif seq:
            self.outputs.append(helper.make_tensor_sequence_value_info(
                name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), None))
        else:
            self.outputs.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape))
        return name

    def graph(self) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)

    def model(self, ir_version: int = 10) -> onnx.ModelProto:
        m = helper.make_model(self.graph(), opset_imports=[helper.make_opsetid("", self.opset)],
                              ir_version=ir_version)
        m = onnx.shape_inference.infer_shapes(m)
        onnx.checker.check_model(m)
        return m


class _State:
    """What is known statically about one array, shared by the TensorArrays of its flows."""

    def __init__(self, size, dynamic_size, clear_after_read, element_shape):
        self.size, self.dynamic_size = size, dynamic_size
        self.clear_after_read, self.element_shape = clear_after_read, element_shape
        self.written: set[int] = set()
        self.cleared: set[int] = set()
        self.length = None  # the sequence's static length, when known


class TensorArray:
    def __init__(self, builder: Builder, dtype, size=None, dynamic_size=False,
                 clear_after_read=True, element_shape=None, flow=None, name=None,
                 _state=None):
        self.b, self._dtype = builder, np.dtype(dtype)
        self._st = _state or _State(size if isinstance(size, int) else None, dynamic_size,
                                    clear_after_read,
                                    None if element_shape is None else list(element_shape))
        if flow is None:
            flow = self._create(size, name)
        self.flow = flow

    def _create(self, size, name):
        b, st = self.b, self._st
        tt = helper.np_dtype_to_tensor_dtype(self._dtype)
        if isinstance(size, int) and size > 0 and not st.dynamic_size and _full(st.element_shape):
            zeros = b.const(np.zeros([size, *st.element_shape], self._dtype))
            st.length = size
            return b.node("SplitToSequence", [zeros], axis=0, keepdims=0)
        st.length = 0
        return b.node("SequenceEmpty", [], dtype=tt)

    # -- properties ------------------------------------------------------------------------
    dtype = property(lambda self: self._dtype)
    dynamic_size = property(lambda self: self._st.dynamic_size)
    element_shape = property(lambda self: self._st.element_shape)

    def _new(self, flow) -> TensorArray:
        return TensorArray(self.b, self._dtype, flow=flow, _state=self._st)

    def _idx(self, index) -> str:
        return self.b.const(np.array(index, np.int64)) if isinstance(index, int) else index

    # -- reading ---------------------------------------------------------------------------
    def read(self, index) -> str:
        st = self._st
        if isinstance(index, int):
            if index in st.cleared:
                raise InvalidArgumentError(
                    f"Could not read index {index} twice because it was cleared after a "
                    "previous read (perhaps try setting clear_after_read = false?)")
            if st.clear_after_read:
                st.cleared.add(index)
        return self.b.node("SequenceAt", [self.flow, self._idx(index)])

    def gather(self, indices) -> str:
        if not isinstance(indices, str):
            for i in indices:
                self._check_cleared(int(i))
            indices = self.b.const(np.asarray(indices, np.int64))
        return self.b.node("Gather", [self.stack(), indices], axis=0)

    def _check_cleared(self, i):
        if i in self._st.cleared:
            raise InvalidArgumentError(
                f"Could not read index {i} twice because it was cleared after a previous read "
                "(perhaps try setting clear_after_read = false?)")
        if self._st.clear_after_read:
            self._st.cleared.add(i)

    def stack(self) -> str:
        return self.b.node("ConcatFromSequence", [self.flow], axis=0, new_axis=1)

    def concat(self) -> str:
        return self.b.node("ConcatFromSequence", [self.flow], axis=0, new_axis=0)

    def size(self) -> str:
        st = self._st
        if st.size is not None and not st.dynamic_size:  # fixed, written or not (TF's size)
            return self.b.const(np.array(st.size, np.int64))
        return self.b.node("SequenceLength", [self.flow])

    # -- writing ---------------------------------------------------------------------------
    def _check_write(self, index, value):
        st, b = self._st, self.b
        vd, vshape, _ = b.types.get(value, (None, None, False))
        if vd is not None and vd != self._dtype:
            raise InvalidArgumentError(f"TensorArray dtype is {self._dtype.name} but Op is trying "
                                       f"to write dtype {vd.name}.")
        if vshape is not None:
            if st.element_shape is not None and not compatible_dims(vshape, st.element_shape):
                raise ValueError(f"Inconsistent shapes: saw {vshape} but expected "
                                 f"{st.element_shape} (and infer_shape=True)")
            if st.element_shape is None:
                st.element_shape = list(vshape)
        if isinstance(index, int):
            if index in st.written:
                raise InvalidArgumentError(f"Could not write to TensorArray index {index} because "
                                           "it has already been written to.")
            if st.size is not None and not st.dynamic_size and index >= st.size:
                raise InvalidArgumentError(f"Tried to write to index {index} but array is not "
                                           f"resizeable and size is: {st.size}")
            st.written.add(index)

    def write(self, index, value) -> TensorArray:
        self._check_write(index, value)
        st, b = self._st, self.b
        pos = self._idx(index)
        if isinstance(index, int) and st.length is not None and index < st.length:
            erased = b.node("SequenceErase", [self.flow, pos])
            return self._new(b.node("SequenceInsert", [erased, value, pos]))
        if isinstance(index, int) and st.length is not None and index > st.length:
            # fill the gap with zeros (TF's unwritten elements read as zeros)
            flow = self.flow
            z = b.const(np.zeros(st.element_shape, self._dtype)) if _full(
                st.element_shape) else self._zeros_like(value)
            for _ in range(index - st.length):
                flow = b.node("SequenceInsert", [flow, z])
            st.length = index
            ta = self._new(flow)
            return ta.write_append(value)
        if isinstance(index, int):  # at the end
            st.length = None if st.length is None else st.length + 1
            return self._new(b.node("SequenceInsert", [self.flow, value, pos]))
        st.length = None  # a dynamic index: replace, growing first where it lies past the end
        grown = self._grow_to(pos, value)
        return self._new(b.node("SequenceInsert", [b.node("SequenceErase", [grown, pos]),
                                                   value, pos]))

    def _grow_to(self, pos: str, value: str) -> str:
        """The flow grown to pos + 1 elements (if shorter) by zeros shaped like ``value`` (TF's
        unwritten elements): a Loop of max(pos + 1 - length, 0) inserts."""
        b, tt = self.b, helper.np_dtype_to_tensor_dtype(self._dtype)
        i64 = onnx.TensorProto.INT64
        end = b.node("Add", [b.node("Cast", [pos], to=i64), b.const(np.array(1, np.int64))])
        count = b.node("Max", [b.node("Sub", [end, b.node("SequenceLength", [self.flow])]),
                               b.const(np.array(0, np.int64))])
        zeros = self._zeros_like(value)
        it, cond, seq, cond_out, seq_out = (b.fresh(n) for n in ("i", "cond", "seq", "cond_out",
                                                                 "seq_out"))
        body = helper.make_graph(
            [helper.make_node("Identity", [cond], [cond_out]),
             helper.make_node("SequenceInsert", [seq, zeros], [seq_out])], b.fresh("grow"),
            [helper.make_tensor_value_info(it, i64, []),
             helper.make_tensor_value_info(cond, onnx.TensorProto.BOOL, []),
             helper.make_tensor_sequence_value_info(seq, tt, None)],
            [helper.make_tensor_value_info(cond_out, onnx.TensorProto.BOOL, []),
             helper.make_tensor_sequence_value_info(seq_out, tt, None)])
        return b.node("Loop", [count, "", self.flow], body=body)

    def _zeros_like(self, value: str) -> str:
        return self.b.node("ConstantOfShape", [self.b.node("Shape", [value])],
                           value=helper.make_tensor(
                               "zero", helper.np_dtype_to_tensor_dtype(self._dtype), [1], [0]))

    def write_append(self, value) -> TensorArray:
        self._st.length = None if self._st.length is None else self._st.length + 1
        return self._new(self.b.node("SequenceInsert", [self.flow, value]))

    def scatter(self, indices, value) -> TensorArray:
        if isinstance(indices, str):
            raise NotImplementedError("scatter needs static indices (a list of ints)")
        ta = self
        for k, i in enumerate(indices):
            ta = ta.write(int(i), self.b.node("Gather", [value, self.b.const(np.array(k))], axis=0))
        return ta

    def unstack(self, value) -> TensorArray:
        b, st = self.b, self._st
        vd, vshape, _ = b.types.get(value, (None, None, False))
        if vd is not None and vd != self._dtype:
            raise InvalidArgumentError(f"TensorArray dtype is {self._dtype.name} but Op is trying "
                                       f"to write dtype {vd.name}.")
        if vshape:
            n = vshape[0]
            if isinstance(n, int) and st.size is not None and not st.dynamic_size and n > st.size:
                raise InvalidArgumentError(f"Tried to write to index {n - 1} but array is not "
                                           f"resizeable and size is: {st.size}")
            if st.element_shape is not None and not compatible_dims(vshape[1:], st.element_shape):
                raise ValueError(f"Inconsistent shapes: saw {vshape[1:]} but expected "
                                 f"{st.element_shape}")
            st.element_shape = st.element_shape or list(vshape[1:])
            if isinstance(n, int):
                st.written.update(range(n))
        n = vshape[0] if vshape else None
        n = n if isinstance(n, int) else None
        if n is None and st.length:  # rows known at run time only: keep the tail, stacked
            stacked = b.node("ConcatFromSequence", [self.flow], axis=0, new_axis=1)
            tail = b.node("Slice", [stacked, b.node("Shape", [value], start=0, end=1),
                                    b.const(np.array([st.length], np.int64))])
            value, st.length = b.node("Concat", [value, tail], axis=0), None
        return self._new(self._keep_tail(b.node("SplitToSequence", [value], axis=0, keepdims=0),
                                         n))

    def _keep_tail(self, rows: str, n: int | None) -> str:
        """``rows`` (elements 0..n-1 written at once), followed by the array's elements from n
        on where it holds more (a pre-sized array keeps its size, as TF's graph arrays do);
        sets the array's new static length."""
        st, b = self._st, self.b
        if n is not None and st.length is not None and n < st.length:
            for k in range(n, st.length):
                rows = b.node("SequenceInsert", [rows, b.node(
                    "SequenceAt", [self.flow, b.const(np.array(k, np.int64))])])
        else:
            st.length = n
        return rows

    def split(self, value, lengths) -> TensorArray:
        b = self.b
        if not isinstance(lengths, str):
            n = len(lengths)
            st = self._st
            if st.size is not None and not st.dynamic_size and n > st.size:
                raise InvalidArgumentError(f"Tried to write to index {n - 1} but array is not "
                                           f"resizeable and size is: {st.size}")
            st.written.update(range(n))
            return self._new(self._keep_tail(b.node("SplitToSequence", [value, b.const(
                np.asarray(lengths, np.int64))], axis=0), n))
        self._st.length = None
        return self._new(b.node("SplitToSequence", [value, lengths], axis=0))

    # -- the rest of the surface -----------------------------------------------------------
    def grad(self, source: str, flow=None, name=None) -> TensorArray:
        """The gradient TensorArray ``<flow>@<source>`` made by gradients(..., name=source)."""
        return TensorArray(self.b, self._dtype, flow=f"{flow or self.flow}@{source}",
                           _state=_State(self._st.size, False, False, self._st.element_shape))

    def identity(self) -> TensorArray:
        return self._new(self.b.node("Identity", [self.flow]))

    def close(self):
        return None


def _full(shape) -> bool:
    return shape is not None and all(isinstance(d, int) for d in shape)
