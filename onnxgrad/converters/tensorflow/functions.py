"""TF2 functional control flow and function calls -> ONNX ``Loop`` / ``If`` / inlined nodes.

TF2 (``tf.function``, control flow v2) keeps loops and conds as single ops whose bodies are
``FunctionDef``\\ s of the graph's library:

    While / StatelessWhile(loop vars; cond, body)   -> ``Loop``: ``cond`` is converted once before
        the Loop on the initial values and once at the end of the body on the next values (TF
        tests at the top of an iteration, ONNX at the bottom), like TF1 frames in
        :mod:`.control_flow`. Loop vars the body returns unchanged (captured tensors, which TF
        passes as loop vars) are not carried: the body reads the outer value.
    If / StatelessIf(pred, args; then_branch, else_branch) -> ``If``
    Case / StatelessCase(index, args; branches)     -> nested ``If``\\ s (out of range: the last)
    PartitionedCall / StatefulPartitionedCall(f), or a node whose op is a library function
                                                    -> the function's nodes, inlined

A function body is converted by the same machinery as the main graph (:class:`.core.Converter`,
the op handlers): it becomes a :class:`~.graph.Graph` of its own, whose input args are nodes of
op ``_Arg``; a call binds them to the caller's values in a fresh layer of bindings and converts the
nodes its outputs need into the current ONNX scope (inline, a Loop body or an If branch). Bodies
call other functions (a While inside a body) by the same route.

FunctionDef bodies name tensors ``node:out_arg:index`` (an output *argument* of the op and an
index into it) where GraphDefs say ``node:flat_index``. The flat index needs the op's output
argument structure; it comes from, in this order: the called function's signature (a node whose
op is a library function), the table :data:`OUTPUT_ARGS` below (multi-output ops, with the attr
that sizes each list argument), TensorFlow's op registry (when TensorFlow is installed and already
imported, or when nothing else decides), and otherwise the assumption that an op whose
references all use one argument name has that argument first (true of every single-output op,
and of ops whose only output is a list). Limitation: without TensorFlow loaded, an op missing
from the table whose users read only a later output argument is read at the wrong index; an op
outside all of these whose references use two argument names is an error that names it.

Not supported: functions with attr placeholders (polymorphic FunctionDefs), resource (variable)
loop vars or function args (freeze the variables first: :mod:`.savedmodel` does), and loop vars
whose dtype changes.
"""
from __future__ import annotations

import importlib.util
import sys
from collections import ChainMap
from types import SimpleNamespace

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import tensor_list
from .control_flow import Body
from .core import Converter, needed_nodes, handler, onnx_dtype
from .errors import ConversionError
from .graph import Graph, TFNode
from .proto import DT
from .resources import SPLITTABLE

# op -> its output arguments, in order: (name, None) for one tensor, (name, "attr") for a list
# sized by an int attr (number_attr) or by a list-of-types attr (type_list_attr). Ops missing here
# and not in TF's registry must reference one output argument only (see the module docstring).
OUTPUT_ARGS: dict[str, tuple] = {
    **{op: (("output", "T"),) for op in ("While", "StatelessWhile", "IdentityN")},
    **{op: (("output", "Tout"),) for op in ("If", "StatelessIf", "Case", "StatelessCase",
                                           "PartitionedCall", "StatefulPartitionedCall",
                                           "SymbolicGradient", "RemoteCall")},
    "Split": (("output", "num_split"),), "SplitV": (("output", "num_split"),),
    "Unpack": (("output", "num"),), "ShapeN": (("output", "N"),),
    "DynamicPartition": (("outputs", "num_partitions"),),
    "Switch": (("output_false", None), ("output_true", None)),
    "RefSwitch": (("output_false", None), ("output_true", None)),
    "Merge": (("output", None), ("value_index", None)),
    "RefMerge": (("output", None), ("value_index", None)),
    "Unique": (("y", None), ("idx", None)), "UniqueV2": (("y", None), ("idx", None)),
    "UniqueWithCounts": (("y", None), ("idx", None), ("count", None)),
    "UniqueWithCountsV2": (("y", None), ("idx", None), ("count", None)),
    "TopK": (("values", None), ("indices", None)), "TopKV2": (("values", None), ("indices", None)),
    "BroadcastGradientArgs": (("r0", None), ("r1", None)),
    "MaxPoolWithArgmax": (("output", None), ("argmax", None)),
    "Qr": (("q", None), ("r", None)), "Svd": (("s", None), ("u", None), ("v", None)),
    "SelfAdjointEigV2": (("e", None), ("v", None)),
    "FusedBatchNorm": tuple((a, None) for a in ("y", "batch_mean", "batch_variance",
                                                "reserve_space_1", "reserve_space_2")),
    "FusedBatchNormV2": tuple((a, None) for a in ("y", "batch_mean", "batch_variance",
                                                  "reserve_space_1", "reserve_space_2")),
    "FusedBatchNormV3": tuple((a, None) for a in ("y", "batch_mean", "batch_variance",
                                                  "reserve_space_1", "reserve_space_2",
                                                  "reserve_space_3")),
    "FusedBatchNormGrad": tuple((a, None) for a in ("x_backprop", "scale_backprop",
                                                    "offset_backprop", "reserve_space_3",
                                                    "reserve_space_4")),
    "FusedBatchNormGradV2": tuple((a, None) for a in ("x_backprop", "scale_backprop",
                                                      "offset_backprop", "reserve_space_3",
                                                      "reserve_space_4")),
    "FusedBatchNormGradV3": tuple((a, None) for a in ("x_backprop", "scale_backprop",
                                                      "offset_backprop", "reserve_space_4",
                                                      "reserve_space_5")),
    "TensorListPopBack": (("output_handle", None), ("tensor", None)),
    "TensorListConcat": (("tensor", None), ("lengths", None)),
    "TensorListConcatV2": (("tensor", None), ("lengths", None)),
    "CudnnRNN": tuple((a, None) for a in ("output", "output_h", "output_c", "reserve_space")),
    **{op: tuple((a, None) for a in ("output", "output_h", "output_c", "reserve_space",
                                     "host_reserved")) for op in ("CudnnRNNV2", "CudnnRNNV3")},
    **{op: tuple((a, None) for a in ("input_backprop", "input_h_backprop", "input_c_backprop",
                                     "params_backprop"))
       for op in ("CudnnRNNBackprop", "CudnnRNNBackpropV2", "CudnnRNNBackpropV3")},
    "CudnnRNNParamsToCanonical": (("weights", "num_params"), ("biases", "num_params")),
    "CudnnRNNParamsToCanonicalV2": (("weights", "num_params_weights"),
                                    ("biases", "num_params_biases")),
    **{op: tuple((a, None) for a in ("i", "cs", "f", "o", "ci", "co", "h"))
       for op in ("LSTMBlockCell", "BlockLSTM", "BlockLSTMV2")},
    "GRUBlockCell": tuple((a, None) for a in ("r", "u", "c", "h")),
    "NonMaxSuppressionV4": (("selected_indices", None), ("valid_outputs", None)),
    "NonMaxSuppressionV5": (("selected_indices", None), ("selected_scores", None),
                            ("valid_outputs", None)),
    "SparseSegmentSumGradV2": (("output", None), ("sorted_unique_indices", None)),
    "SoftmaxCrossEntropyWithLogits": (("loss", None), ("backprop", None)),
    "SparseSoftmaxCrossEntropyWithLogits": (("loss", None), ("backprop", None)),
    "TensorArrayV3": (("handle", None), ("flow", None)),
    "TensorArrayGradV3": (("grad_handle", None), ("flow_out", None)),
    "TensorArrayGradWithShape": (("grad_handle", None), ("flow_out", None)),
    "QuantizeV2": (("output", None), ("output_min", None), ("output_max", None)),
    "CTCLoss": (("loss", None), ("gradient", None)),
    "SparseReshape": (("output_indices", None), ("output_shape", None)),
    "Where": (("index", None),),
}

VARIANT, RESOURCE = DT["DT_VARIANT"], DT["DT_RESOURCE"]


# -- FunctionDef -> Graph --------------------------------------------------------------------
class Function:
    """A FunctionDef made ready for conversion: its body as a :class:`Graph` (input args are
    ``_Arg`` nodes named after the args) and its outputs as "node:index" refs of that graph."""

    def __init__(self, fdef, library, lib_sigs: dict):
        sig = fdef.signature
        self.name = sig.name
        if sig.attr:
            raise ConversionError(f"function {self.name!r} has attr placeholders "
                                  f"({', '.join(a.name for a in sig.attr)}); polymorphic "
                                  "functions are not supported")
        self.args = [a.name for a in sig.input_arg]
        self.arg_types = [a.type for a in sig.input_arg]
        self.outputs = [a.name for a in sig.output_arg]
        self.out_types = [a.type for a in sig.output_arg]
        for a in list(sig.input_arg) + list(sig.output_arg):
            if a.number_attr or a.type_list_attr:
                raise ConversionError(f"function {self.name!r}: list argument {a.name!r} is "
                                      "not supported")
        defs = {nd.name: nd for nd in fdef.node_def}
        used: dict[str, set] = {}  # node -> output arg names its users reference
        refs = [s for nd in fdef.node_def for s in nd.input] + [fdef.ret[o] for o in self.outputs
                                                               if o in fdef.ret]
        for s in refs:
            parts = s.lstrip("^").split(":")
            if len(parts) >= 2 and not s.startswith("^"):
                used.setdefault(parts[0], set()).add(parts[1])
        offsets: dict[tuple, int] = {}

        def flat(s: str) -> str:
            if s.startswith("^"):
                return s
            parts = s.split(":")
            if len(parts) == 1:
                return f"{s}:0"  # an input arg (or a node's first output)
            if len(parts) == 2:  # "node:index" (graph syntax) is accepted too
                return s
            node, arg, idx = parts[0], parts[1], int(parts[2])
            if node not in defs:
                raise ConversionError(f"function {self.name!r} reads {s!r}, which no node "
                                      "of the function makes")
            key = (node, arg)
            if key not in offsets:
                offsets[key] = _arg_offset(defs[node], arg, used.get(node, {arg}), lib_sigs,
                                           self.name)
            return f"{node}:{offsets[key] + idx}"

        nodes = [SimpleNamespace(name=a.name, op="_Arg", input=[], attr=_arg_attrs(fdef, i, a))
                 for i, a in enumerate(sig.input_arg)]
        for nd in fdef.node_def:
            nodes.append(SimpleNamespace(name=nd.name, op=nd.op, input=[flat(s) for s in nd.input],
                                         attr=nd.attr))
        missing = [o for o in self.outputs if o not in fdef.ret]
        if missing:
            raise ConversionError(f"function {self.name!r} does not say what its outputs "
                                  f"{missing} are")
        self.rets = [flat(fdef.ret[o]) for o in self.outputs]
        self.graph = Graph(SimpleNamespace(node=nodes, library=library))
        self.nodes = [n for n in needed_nodes(self.graph, self.rets) if n.op != "_Arg"]

    def _through(self, ref: str) -> TFNode:
        p = self.graph.producer(ref)
        while p.op in ("Identity", "Snapshot") and len(p.inputs) == 1:
            p = self.graph.producer(p.inputs[0])
        return p

    def counter(self, j: int) -> bool:
        """Loop var j goes up by one per iteration (its output is input + 1)."""
        p = self._through(self.rets[j])
        if p.op not in ("Add", "AddV2") or len(p.inputs) != 2:
            return False
        ins = [self._through(r) for r in p.inputs]
        one = [q for q in ins if q.op == "Const"]
        arg = [q for q in ins if q.op == "_Arg"]
        return len(one) == 1 and len(arg) == 1 and arg[0].name == self.args[j] and np.array_equal(
            np.reshape(_const_value(one[0]), -1), [1])

    def _only_write(self, i: int) -> TFNode | None:
        """The TensorListSetItem when it is list loop var i's only use and its result (maybe
        through Identity ops) is read by nothing but the body's return as var i: a read of the
        written list in the body (the list made after the loop cannot serve it) rules it out."""
        ref = self.rets[i]
        if self.graph.uses(ref) or self.rets.count(ref) != 1:
            return None
        p = self.graph.producer(ref)
        while p.op in ("Identity", "Snapshot") and len(p.inputs) == 1:
            ref = p.inputs[0]
            if self.graph.uses(ref) != 1:
                return None
            p = self.graph.producer(ref)
        arg = f"{self.args[i]}:0"
        if p.op != "TensorListSetItem" or self.graph.uses(arg) != 1 or p.inputs[0] != arg:
            return None
        return p

    def writes_at_counter(self, i: int):
        """(item ref, counter var j) when list loop var i's only use is a TensorListSetItem at
        the index of a counter loop var j whose result the body returns as var i; else None."""
        p = self._only_write(i)
        idx = None if p is None else self._through(p.inputs[1])
        if idx is None or idx.op != "_Arg" or idx.name not in self.args:
            return None
        j = self.args.index(idx.name)
        return (p.inputs[2], j) if self.counter(j) else None

    def write_grows(self, i: int) -> bool:
        """List loop var i's one write may grow the list (resize_if_index_out_of_bounds)."""
        return _grows(self._only_write(i))

    def writes_at_constant(self, i: int) -> int | None:
        """k when list loop var i's only use is a TensorListSetItem at the constant index k >= 0
        (a Keras RNN without return_sequences writes its output at 0 every iteration) that
        does not grow the list, and the body returns its result as var i; else None."""
        p = self._only_write(i)
        idx = None if p is None else self._through(p.inputs[1])
        if idx is None or idx.op != "Const":
            return None
        k = np.reshape(_const_value(idx), -1)
        if _grows(p) or k.size != 1 or k[0] < 0:
            return None
        return int(k[0])

    def passthrough(self, i: int) -> bool:
        """Output i is input arg i itself, maybe through Identity ops (a While body's unchanged
        loop var)."""
        if i >= len(self.args):
            return False
        ref = self.rets[i]
        while True:
            p = self.graph.producer(ref)
            if p.op == "_Arg":
                return p.name == self.args[i]
            if p.op not in ("Identity", "Snapshot") or len(p.inputs) != 1:
                return False
            ref = p.inputs[0]


def _grows(set_item: TFNode) -> bool:
    a = set_item.attr.get("resize_if_index_out_of_bounds")
    return a is not None and a.b


def _const_value(nd):
    from .core import attr_value
    return attr_value(nd.attr["value"])


def _type_attr(dtype: int):
    from .proto import AttrValue
    a = AttrValue()
    a.type = dtype
    return a


def _arg_offset(nd, arg: str, used: set, lib_sigs: dict, fname: str) -> int:
    """The flat index of the first tensor of output argument ``arg`` of node ``nd``."""
    # TF's registry costs an import of TensorFlow: asked only when TF is loaded anyway, or when
    # the references leave no other way
    spec = _output_args(nd.op, lib_sigs, registry=len(used) > 1 or "tensorflow" in sys.modules)
    if spec is None:
        if len(used) == 1:
            return 0  # one output argument referenced: assume it is the op's first
        raise ConversionError(
            f"function {fname!r}: cannot tell the output layout of op {nd.op!r} (node "
            f"{nd.name!r} has outputs {sorted(used)}); add it to "
            "onnxgrad.converters.tensorflow.functions.OUTPUT_ARGS or install TensorFlow")
    k = 0
    for name, size in spec:
        if name == arg:
            return k
        k += _arg_size(nd, size)
    raise ConversionError(f"function {fname!r}: op {nd.op!r} (node {nd.name!r}) has no output "
                          f"argument {arg!r}")


def _arg_size(nd, size) -> int:
    if size is None:
        return 1
    a = nd.attr[size] if size in nd.attr else None
    if a is None:
        raise ConversionError(f"node {nd.name!r} ({nd.op}) has no attr {size!r} to size its "
                              "outputs")
    kind = a.WhichOneof("value")
    return len(a.list.type) if kind == "list" else int(a.i)


def _output_args(op: str, lib_sigs: dict, registry: bool = True):
    if op in lib_sigs:
        return tuple((a.name, None) for a in lib_sigs[op].output_arg)
    if op in OUTPUT_ARGS:
        return OUTPUT_ARGS[op]
    return _registry_output_args(op) if registry else None


_REGISTRY: dict = {}


def _registry_output_args(op: str):
    """The op's output args from TensorFlow's op registry, when TensorFlow is installed."""
    if op not in _REGISTRY:
        spec = None
        try:
            have_tf = importlib.util.find_spec("tensorflow") is not None
        except (ImportError, ValueError):  # a broken or blocked install
            have_tf = False
        if have_tf:
            try:
                from tensorflow.python.framework import op_def_registry
                od = op_def_registry.get(op)
            except Exception:  # noqa: BLE001  (a broken TF install: fall back to the heuristic)
                od = None
            if od is not None:
                spec = tuple((a.name, a.number_attr or a.type_list_attr or None)
                             for a in od.output_arg)
        _REGISTRY[op] = spec
    return _REGISTRY[op]


# -- calling functions -----------------------------------------------------------------------
def _library(c: Converter) -> dict:
    lib = c.__dict__.get("_fn_library")
    if lib is None:
        library = getattr(c.g, "library", None)
        lib = {f.signature.name: f for f in (library.function if library is not None else ())}
        c.__dict__["_fn_library"] = lib
        c.__dict__["_fn_sigs"] = {k: f.signature for k, f in lib.items()}
        c.__dict__["_fn_cache"] = {}
        c.__dict__["_fn_lib_proto"] = library
    return lib


def function(c: Converter, name: str) -> Function:
    lib = _library(c)
    cache = c.__dict__["_fn_cache"]
    if name not in cache:
        if name not in lib:
            raise ConversionError(f"the graph's library has no function {name!r}")
        cache[name] = Function(lib[name], c.__dict__["_fn_lib_proto"], c.__dict__["_fn_sigs"])
    return cache[name]


def call(c: Converter, name: str, args: list, depth: list | None = None) -> list:
    """Convert function ``name`` on the ONNX values ``args`` into the current scope; returns the
    ONNX values of its outputs."""
    fn = function(c, name)
    if len(args) != len(fn.args):
        raise ConversionError(f"function {name!r} takes {len(fn.args)} inputs, given {len(args)}")
    read = {r.split(":")[0] for n in fn.nodes for r in n.inputs} | {
        r.split(":")[0] for r in fn.rets}
    for a, t, v in zip(fn.args, fn.arg_types, args):
        if a in read and (t == RESOURCE or (t != VARIANT and not isinstance(v, str))):
            raise ConversionError(f"function {name!r}: input {a!r} is a resource (a variable?); "
                                  "freeze the variables into constants first")
    stack = c.__dict__.setdefault("_fn_stack", [])
    if name in stack:
        raise ConversionError(f"function {name!r} calls itself")
    saved = c.g, c.env, c.state, c.node
    c.g = fn.graph
    c.env = ChainMap({f"{a}:0": v for a, v in zip(fn.args, args)})
    c.state = c.state.new_child()
    stack.append(name)
    try:
        c.convert_nodes((), fn.nodes)
        outs = [c.value(r) for r in fn.rets]
    except ConversionError as e:
        if stack[-1] == name and not str(e).startswith("in function"):
            raise ConversionError(f"in function {name!r}: {e}") from e
        raise
    finally:
        stack.pop()
        c.g, c.env, c.state, c.node = saved
    return outs


# -- types of values crossing a Loop/If boundary ------------------------------------------------
def _value_info(c: Converter, name: str, dtype: int, like, n: TFNode, shape=None):
    """Value info of a Loop body input/output or If output of TF dtype ``dtype``: a sequence
    for a TensorList (element type from ``like``, the value it starts as), else a tensor of
    ``shape`` (TF's static shape from the node's ``output_shapes``: None dims unknown; None:
    unknown rank)."""
    if dtype == VARIANT and isinstance(like, str) and like in c.optional_of:
        c.optional_of[name] = c.optional_of[like]
        return helper.make_value_info(name, _optional_type(c.optional_of[like][0]))
    if dtype == VARIANT:
        elem = tensor_list.elem_type(c, like)
        if elem is None:
            raise ConversionError(f"{n}: a variant value that is not a TensorList the converter "
                                  "made")
        tensor_list.mark(c, name, elem, like=like)
        return helper.make_tensor_sequence_value_info(name, elem, None)
    if dtype == RESOURCE:
        raise ConversionError(f"{n}: resource (variable) values cannot cross a loop or cond "
                              "boundary; freeze the variables into constants first")
    return helper.make_tensor_value_info(name, onnx_dtype(dtype, n), shape)


def _output_shapes(c: Converter, n: TFNode, count: int) -> list:
    """TF's static shapes of the node's outputs (its ``output_shapes`` attr), None where
    unknown."""
    shapes = c.attr(n, "output_shapes") or []
    return list(shapes) + [None] * (count - len(shapes)) if len(shapes) <= count else [None] * count


def _outputs(c: Converter, scope, values: list, base: str) -> list[str]:
    """Graph outputs for ``values``: made inside the graph, each name once."""
    made = {o for nd in scope.nodes for o in nd.output}
    seen, outs = set(), []
    for v in values:
        if v not in made or v in seen:
            v = c.op("Identity", [v], name=base)
        seen.add(v)
        outs.append(v)
    return outs


def _as_bool(c: Converter, v: str, dtype: int | None, n: TFNode) -> str:
    """A TF predicate as ONNX's bool: numbers are true when non-zero."""
    if dtype is None or dtype == DT["DT_BOOL"]:
        return v
    if dtype == DT["DT_STRING"]:
        raise ConversionError(f"{n}: a string predicate is not supported")
    return c.op("Cast", [v], to=TensorProto.BOOL)


def _types_attr(c: Converter, n: TFNode, key: str) -> list[int]:
    a = n.attr.get(key)
    if a is None:
        raise ConversionError(f"{n} has no attribute {key!r}")
    return list(a.list.type)


# -- handlers ----------------------------------------------------------------------------------
def _call_outputs(c: Converter, values: list) -> list:
    """An inlined call's results, each as a value of its own (Identity): the converter renames
    a node's outputs to TF's names, and an inlined value may also be read inside a Loop/If body
    the call made, where a rename does not reach. Lists stay as they are."""
    return [v if not isinstance(v, str) or v in c.seq_of else c.op("Identity", [v])
            for v in values]


@handler("PartitionedCall", "StatefulPartitionedCall")
def _partitioned_call(c, n):
    return _call_outputs(c, call(c, c.attr(n, "f"), [c.x(n, i) for i in range(len(n.inputs))]))


@handler("While", "StatelessWhile")
def _while(c, n):
    init = [c.x(n, i) for i in range(len(n.inputs))]
    types = _types_attr(c, n, "T")
    cond_name, body_name = c.attr(n, "cond"), c.attr(n, "body")
    body, cond = function(c, body_name), function(c, cond_name)
    if len(body.outputs) != len(init):
        raise ConversionError(f"{n}: body {body_name!r} returns {len(body.outputs)} values for "
                              f"{len(init)} loop vars")
    cond_t = cond.out_types[0] if cond.out_types else None
    cond_init = _as_bool(c, call(c, cond_name, init)[0], cond_t, n)
    carried = [i for i in range(len(init)) if not body.passthrough(i)]
    scans = _scanned_lists(c, body, cond, init, types, carried)
    carried = [i for i in carried if i not in scans]
    shapes = _output_shapes(c, n, len(init))
    base = n.name
    with Body(c) as scope:
        it, cin = c.fresh(f"{base}/iteration"), c.fresh(f"{base}/cond_in")
        scope.inputs += [helper.make_tensor_value_info(it, TensorProto.INT64, []),
                         helper.make_tensor_value_info(cin, TensorProto.BOOL, [])]
        vals = list(init)
        for i in carried:
            v = c.fresh(f"{base}/{body.args[i]}")
            scope.inputs.append(_value_info(c, v, types[i], init[i], n, shapes[i]))
            vals[i] = v
        pending = {init[i]: None for i in scans}
        c.list_scans.update(pending)
        nxt = call(c, body_name, vals)
        items = [c.list_scans.pop(init[i]) for i in scans]
        for i in range(len(init)):
            if i not in carried:
                nxt[i] = vals[i]
        cond_out = _as_bool(c, call(c, cond_name, nxt)[0], cond_t, n)
        outs = _outputs(c, scope, [cond_out] + [nxt[i] for i in carried] + items, f"{base}/out")
        scope.outputs.append(helper.make_tensor_value_info(outs[0], TensorProto.BOOL, []))
        scope.outputs += [_value_info(c, o, types[i], init[i], n, shapes[i])
                          for o, i in zip(outs[1:], carried)]
        scope.outputs += [helper.make_tensor_value_info(o, tensor_list.elem_type(c, init[i]), None)
                          for o, i in zip(outs[1 + len(carried):], scans)]
        graph = scope.graph(base.replace("/", "_") + "_body")
    if not carried and not scans:  # nothing changes: the loop only runs (or never ends)
        return init
    res = c.op("Loop", ["", cond_init] + [init[i] for i in carried],
               n_out=len(carried) + len(scans), name=f"{base}/Loop", body=graph)
    res = [res] if isinstance(res, str) else res
    out = list(init)
    for i, r in zip(carried, res):
        if types[i] == VARIANT:
            out[i] = tensor_list.mark(c, r, None, like=init[i])
        else:
            out[i] = _rank_hint(c, r, shapes[i])
    for i, r in zip(scans, res[len(carried):]):
        out[i] = tensor_list.written_by_scan(c, init[i], r) if scans[i] is None else \
            tensor_list.written_last_by_scan(c, init[i], r, scans[i])
    return out


def _scanned_lists(c: Converter, body: Function, cond: Function, init: list, types: list,
                   carried: list) -> dict[int, int | None]:
    """The list loop vars a While writes once per iteration and reads nowhere else, at its
    iteration number (a Keras RNN's outputs) or at one constant index of a reserved list (a
    Keras RNN's last output: {i: that index}, else {i: None}): the Loop emits the items as scan
    outputs and the list is made after it (tensor_list.written_by_scan, written_last_by_scan),
    instead of a list copied on every write (and carried, and rebuilt by the gradient)."""
    out = {}
    for i in carried:
        if types[i] != VARIANT or tensor_list.elem_type(c, init[i]) not in SPLITTABLE or (
                i < len(cond.args) and cond.graph.uses(f"{cond.args[i]}:0")) or init[i] in (
                init[k] for k in out):
            continue
        k = body.writes_at_constant(i)
        if k is not None and (tensor_list.reserved(c, init[i]) is not None or
                              not tensor_list.is_lazy(c, init[i])):
            out[i] = k
            continue
        w = body.writes_at_counter(i)
        start = c.consts.get(init[w[1]]) if w is not None and isinstance(init[w[1]], str) \
            else None
        # a list that is not lazy takes the items over its own elements: writes that grow it
        # (a dynamic_size TensorArray, from empty) stay carried
        if start is not None and int(np.reshape(start, -1)[0]) == 0 and (
                tensor_list.is_lazy(c, init[i]) or not body.write_grows(i)):
            out[i] = None
    return out


def _rank_hint(c: Converter, v: str, shape) -> str:
    """ONNX infers only the element type of a Loop's carried outputs; a Reshape to TF's static
    shape (0: keep the dim) gives shape inference the rank and the known dims (a no-op at run
    time)."""
    if shape is None:
        return v
    return c.op("Reshape", [v, c.const(np.array([d if d is not None else 0 for d in shape],
                                                np.int64))])


def _branch(c: Converter, n: TFNode, fname: str, args: list, tout: list[int], tag: str):
    """One If branch: function ``fname`` on ``args`` as an ONNX graph; returns (graph, values)."""
    with Body(c) as scope:
        vals = call(c, fname, args)
        if len(vals) != len(tout):
            raise ConversionError(f"{n}: branch {fname!r} returns {len(vals)} values, "
                                  f"Tout has {len(tout)}")
        outs = _outputs(c, scope, vals, f"{n.name}/{tag}/out")
        shapes = _output_shapes(c, n, len(tout))
        scope.outputs += [_value_info(c, o, t, v, n, s)
                          for o, t, v, s in zip(outs, tout, vals, shapes)]
        return scope.graph(f"{n.name.replace('/', '_')}_{tag}"), vals


def _if_node(c: Converter, n: TFNode, pred: str, then, else_, tout: list[int]) -> list:
    (g1, v1), (g0, v0) = then, else_
    _type_optionals(c, (g1, v1), (g0, v0), tout)
    extra = _split_optionals(c, (g1, v1), (g0, v0), tout)
    res = c.op("If", [pred], n_out=len(g1.output), name=f"{n.name}/If", then_branch=g1,
               else_branch=g0)
    res = [res] if isinstance(res, str) else res
    for j, (k, other) in enumerate(extra):  # the else branch's optional at position k
        c.optional_of[res[len(tout) + j]] = other
        c.optional_union[res[k]] = {other[0]: res[len(tout) + j]}
    res = res[:len(tout)]
    for r, t, v in zip(res, tout, v1):
        if t == VARIANT and v in c.optional_of:
            c.optional_of[r] = c.optional_of[v]
        elif t == VARIANT:
            tensor_list.mark(c, r, None, like=v)
    return res


# -- TF optionals -------------------------------------------------------------------------------
# cond_v2 returns each intermediate a branch's gradient needs as an optional: the value
# (OptionalFromValue) from the branch that made it, OptionalNone from the other; the gradient
# cond reads it back (OptionalGetValue) in the branch that matches. They map onto ONNX's
# optionals; an OptionalNone, which carries no type, takes the type of the value the other
# branch returns at its position.
def _optional_type(elem: int | None):
    return helper.make_optional_type_proto(
        helper.make_tensor_type_proto(elem or TensorProto.FLOAT, None))


def _none(c: Converter, g, elem: int) -> str:
    """A new empty optional of ``elem`` tensors at the end of branch graph ``g``."""
    none = c.fresh(f"{g.name}/none")
    g.node.append(helper.make_node("Optional", [], [none], name=none,
                                   type=helper.make_tensor_type_proto(elem, None)))
    return none


def _type_optionals(c: Converter, then, else_, tout: list[int]) -> None:
    """An OptionalNone returned at a position takes the type the other branch returns there
    (its own node per position: TF returns one OptionalNone at every position)."""
    for k, t in enumerate(tout):
        if t != VARIANT:
            continue
        for (_, known), (g, other) in ((then, else_), (else_, then)):
            elem, depth = c.optional_of.get(known[k], (None, None))
            if elem is None or c.optional_of.get(other[k], (0, 0))[0] is not None:
                continue
            none = _none(c, g, elem)
            g.output[k].name = none
            g.output[k].type.CopyFrom(_optional_type(elem))
            other[k] = none
            c.optional_of[none] = (elem, depth)


def _split_optionals(c: Converter, then, else_, tout: list[int]) -> list:
    """TF shares a position between a then intermediate and an else one of another type (only
    the branch taken reads its own back); an ONNX If's branches return one type per position.
    The else branch's optional moves to a new output at the end, a None of the other type
    filling each gap; OptionalGetValue picks by the type it reads (``optional_union``).
    Returns [(position, (elem, depth) of the moved one)]."""
    (g1, v1), (g0, v0) = then, else_
    extra = []
    for k, t in enumerate(tout):
        a, b = c.optional_of.get(v1[k]), c.optional_of.get(v0[k])
        if t != VARIANT or not a or not b or a[0] is None or b[0] is None or a[0] == b[0]:
            continue
        moved = onnx.ValueInfoProto()
        moved.CopyFrom(g0.output[k])
        g0.output[k].name = _none(c, g0, a[0])
        g0.output[k].type.CopyFrom(_optional_type(a[0]))
        g0.output.append(moved)
        g1.output.append(helper.make_value_info(_none(c, g1, b[0]), _optional_type(b[0])))
        extra.append((k, b))
    return extra


@handler("OptionalFromValue")
def _optional_from_value(c, n):
    types = _types_attr(c, n, "Toutput_types")
    if len(types) != 1:
        raise ConversionError(f"{n}: an optional of {len(types)} components is not supported")
    x = c.x(n)
    if types[0] == VARIANT and x in c.optional_of:
        # ONNX has no optional of an optional (a nested cond's intermediates): it is the same
        # value one level deeper, read back as itself
        v = c.op("Identity", [x])
        elem, depth = c.optional_of[x]
        c.optional_of[v] = (elem, depth + 1)
        return [v]
    v = c.op("Optional", [x])
    c.optional_of[v] = (onnx_dtype(types[0], n), 1)
    return [v]


@handler("OptionalNone")
def _optional_none(c, n):
    v = c.op("Optional", [], type=helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    c.optional_of[v] = (None, None)  # typed by the If it leaves by (_type_optionals)
    return [v]


@handler("OptionalGetValue")
def _optional_get_value(c, n):
    x, read = c.x(n), _types_attr(c, n, "output_types")[0]
    want = None if read == VARIANT else onnx_dtype(read, n)
    if want is not None and c.optional_of.get(x, (want,))[0] != want:
        x = c.optional_union.get(x, {}).get(want, x)  # (see _split_optionals)
    elem, depth = c.optional_of.get(x, (None, 1))
    if depth is not None and depth > 1:
        v = c.op("Identity", [x])
        c.optional_of[v] = (elem, depth - 1)
        return [v]
    return [c.op("OptionalGetElement", [x])]


@handler("OptionalHasValue")
def _optional_has_value(c, n):
    if (c.optional_of.get(c.x(n), (None, 1))[1] or 1) > 1:
        raise ConversionError(f"{n}: whether an optional of an optional holds a value is not "
                              "supported (ONNX has no optional of an optional)")
    return [c.op("OptionalHasElement", [c.x(n)])]


@handler("If", "StatelessIf")
def _if(c, n):
    args = [c.x(n, i) for i in range(1, len(n.inputs))]
    tout = _types_attr(c, n, "Tout")
    tcond = n.attr["Tcond"].type if "Tcond" in n.attr else None
    pred = _as_bool(c, c.x(n, 0), tcond, n)
    then = _branch(c, n, c.attr(n, "then_branch"), args, tout, "then")
    else_ = _branch(c, n, c.attr(n, "else_branch"), args, tout, "else")
    if not tout:
        return []
    return _if_node(c, n, pred, then, else_, tout)


@handler("Case", "StatelessCase")
def _case(c, n):
    idx = c.x(n, 0)
    args = [c.x(n, i) for i in range(1, len(n.inputs))]
    tout = _types_attr(c, n, "Tout")
    branches = c.attr(n, "branches")
    if not tout:
        return []

    def chain(k: int) -> list:  # the values of branch k if idx == k, else of the rest
        if k == len(branches) - 1:  # the last branch: also taken for an index out of range
            return call(c, branches[k], args)
        pred = c.op("Equal", [idx, c.const(k, np.int32)])
        then = _branch(c, n, branches[k], args, tout, f"branch{k}")
        with Body(c) as scope:
            vals = chain(k + 1)
            outs = _outputs(c, scope, vals, f"{n.name}/case{k}/out")
            shapes = _output_shapes(c, n, len(tout))
            scope.outputs += [_value_info(c, o, t, v, n, s)
                              for o, t, v, s in zip(outs, tout, vals, shapes)]
            else_g = scope.graph(f"{n.name.replace('/', '_')}_case{k}")
        return _if_node(c, n, pred, then, (else_g, vals), tout)

    return chain(0)


def is_function(c: Converter, op: str) -> bool:
    return op in _library(c)


def _arg_attrs(fdef, i: int, a) -> dict:
    """An arg's node attributes: its type, and the static shape TF traced the function with
    (``arg_attr`` ``_output_shapes``, where the FunctionDef has it), which handlers read as they
    read any node's (a grouped Conv2D's channel count, inside Keras's jit-compiled conv)."""
    attrs = {"T": _type_attr(a.type)}
    arg = fdef.arg_attr.get(i) if fdef.arg_attr else None
    if arg is not None and "_output_shapes" in arg.attr:
        attrs["_output_shapes"] = arg.attr["_output_shapes"]
    return attrs


def call_handler(c, n):
    """A node whose op is a function of the graph's library (TF's direct function call)."""
    return _call_outputs(c, call(c, n.op, [c.x(n, i) for i in range(len(n.inputs))]))
