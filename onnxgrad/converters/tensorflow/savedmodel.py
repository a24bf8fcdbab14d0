"""SavedModel directories -> a frozen GraphDef for the converter (needs TensorFlow).

A SavedModel keeps its weights in variables, which the graph reads through resource handles;
ONNX wants them as constants. Freezing uses TensorFlow itself: ``tf.saved_model.load``, the
signature's concrete function, and ``convert_variables_to_constants_v2`` with TF2 control flow
kept functional (While/If with function bodies, which :mod:`.functions` converts). TensorFlow is
an optional dependency (``pip install 'onnxgrad[tensorflow]'``); a GraphDef ``.pb`` converts
without it.

The signature (default ``serving_default``) gives the default inputs and outputs; either can also
be named by the signature's keys (``keras_tensor``, ``output_0``) instead of tensor names. The
ONNX model's inputs and outputs keep the frozen graph's tensor names (``keras_tensor:0``,
``Identity:0``): :func:`signature_names` maps keys to them. The frozen variables are initializers
named after the variables (``dense/kernel:0``); the trainable ones are listed in the model's
metadata as its weights (what :class:`onnxgrad.Trainer` trains by default), the others (a layer's
state: BatchNormalization's moving statistics, Normalization's mean and variance) as not trained.
"""
from __future__ import annotations

import os

from .errors import ConversionError

DEFAULT_SIGNATURE = "serving_default"
INSTALL_HINT = "pip install 'onnxgrad[tensorflow]'"


class TensorFlowMissingError(ConversionError):
    """TensorFlow is needed (to freeze a SavedModel's variables) but is not installed."""


def import_tensorflow():
    """TensorFlow, or an error that says it is missing and how to install it."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import tensorflow as tf
    except ImportError as e:
        raise TensorFlowMissingError(
            "converting a SavedModel needs TensorFlow, to freeze its variables into constants, "
            f"and TensorFlow is not installed ({e}); install it with: {INSTALL_HINT} "
            "(a frozen GraphDef .pb converts without it)") from None
    return tf


def is_saved_model(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, f)) for f in ("saved_model.pb", "saved_model.pbtxt"))


def freeze(path, signature: str | None = None):
    """Freeze signature ``signature`` of the SavedModel at ``path``. Returns (GraphDef as bytes,
    {input key: tensor name}, {output key: tensor name}, {name of a Const node that holds a
    variable: whether the variable is trainable}), keys in the signature's order. Those Consts are
    named after their variables ("dense/kernel"), not after the function's placeholders
    ("unknown", "unknown_0", ...).

    Freezing runs in TF's eager mode, also in a process that switched it off (TF1-style code).
    The last result is kept per directory state, so converting one SavedModel again (other
    outputs, say) does not freeze it again."""
    if not is_saved_model(path):
        raise ConversionError(f"{os.fspath(path)}: not a SavedModel directory (no saved_model.pb)")
    tf = import_tensorflow()
    sig = signature or DEFAULT_SIGNATURE
    key = (os.path.realpath(path), sig, _state(path))
    if key not in _FROZEN:
        _FROZEN.clear()  # keep one: a frozen graph may be large
        with _eager_mode():
            _FROZEN[key] = _freeze(tf, path, sig)
    return _FROZEN[key]


_FROZEN: dict = {}


def _state(path) -> tuple:
    """What changes when a SavedModel directory is rewritten: its files' sizes and times."""
    out = []
    for root, _, files in os.walk(path):
        for f in sorted(files):
            st = os.stat(os.path.join(root, f))
            out.append((os.path.relpath(os.path.join(root, f), path), st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


def _freeze(tf, path, sig: str):
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    try:
        loaded = tf.saved_model.load(os.fspath(path))
    except Exception as e:  # noqa: BLE001  (TF raises many kinds for a bad directory)
        raise ConversionError(f"{os.fspath(path)}: TensorFlow cannot load this SavedModel "
                              f"({type(e).__name__}: {str(e).strip().splitlines()[0]})") from None
    sigs = getattr(loaded, "signatures", {}) or {}
    if sig not in sigs:
        have = ", ".join(map(repr, sigs)) or "none"
        raise ConversionError(f"{os.fspath(path)}: no signature {sig!r} (the SavedModel has: "
                              f"{have})")
    fn = sigs[sig]
    try:
        frozen = convert_variables_to_constants_v2(fn, lower_control_flow=False)
    except Exception as e:  # noqa: BLE001
        # a graph that assigns a variable cannot be frozen: Keras's RNNs with dropout advance
        # their SeedGenerator's integer state in every call, inference too. Those integer
        # variables stay variables; the converter leaves out what only updates them (nothing
        # the outputs read), and refuses a graph whose outputs read one.
        frozen = _freeze_keeping_integer_state(fn)
        if frozen is None:
            raise ConversionError(_freeze_failure(tf, path, sig, fn, e)) from None
    specs = fn.structured_input_signature[1] or {}
    in_keys = sorted(specs)  # TF flattens a dict by sorted key
    ins = [t for t in frozen.inputs if t.dtype != tf.resource]
    if len(ins) != len(in_keys):
        in_keys = [t.name.split(":")[0] for t in ins]
    out_struct = fn.structured_outputs
    out_keys = sorted(out_struct) if isinstance(out_struct, dict) else [
        f"output_{i}" for i in range(len(frozen.outputs))]
    gd = frozen.graph.as_graph_def(add_shapes=True)
    rename, trainable = _variable_names(fn, {n.name for n in gd.node}, _frozen(loaded))
    _rename_nodes(gd, rename)
    inputs = dict(zip(in_keys, (_renamed(t.name, rename) for t in ins)))
    outputs = dict(zip(out_keys, (_renamed(t.name, rename) for t in frozen.outputs)))
    return gd.SerializeToString(), inputs, outputs, trainable


# ops that write a resource variable, which TF's freezer cannot make a constant
ASSIGNS = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
ASSIGN_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter",
                   "ResourceStridedSliceAssign")


def _freeze_failure(tf, path, sig: str, fn, error: Exception) -> str:
    """Why freezing failed: TF's own error, and, where the graph writes float variables (what
    freezing cannot keep), those writes."""
    text = next((line for line in str(error).strip().splitlines() if line.strip()), "")
    msg = (f"{os.fspath(path)}: TensorFlow cannot freeze signature {sig!r} into constants "
           f"({type(error).__name__}: {text})")
    writes = _float_variable_writes(tf, fn)
    if not writes:
        return msg
    more = f" and {len(writes) - 3} more" if len(writes) > 3 else ""
    return (f"{msg}; a graph that assigns float variables cannot be frozen, and this one does "
            f"({', '.join(writes[:3])}{more}): a stateful RNN does (stateful=True keeps its "
            "states in variables every call assigns: build it with stateful=False and pass "
            "the states as inputs, initial_state), and so does a layer in training mode "
            "(Keras's model.export() traces a BatchNormalization after a Resizing layer so: "
            "export an endpoint that calls the model with training=False instead, "
            "keras.export.ExportArchive.add_endpoint)")


def _float_variable_writes(tf, fn) -> list[str]:
    """The nodes of ``fn``'s graph and of the functions it calls that write a float variable."""
    try:
        gd = fn.graph.as_graph_def()
    except Exception:  # noqa: BLE001  (no graph to read: nothing to say about it)
        return []
    nodes = [*gd.node, *(nd for f in gd.library.function for nd in f.node_def)]
    out = []
    for nd in nodes:
        if nd.op not in ASSIGNS and not nd.op.startswith(ASSIGN_PREFIXES):
            continue
        key = "dtype" if "dtype" in nd.attr else "T" if "T" in nd.attr else None
        if key is None or tf.as_dtype(nd.attr[key].type).is_floating:
            out.append(f"{nd.op} {nd.name!r}")
    return out


def _freeze_keeping_integer_state(fn):
    """``fn`` frozen with its integer variables (random-seed states) left as resource inputs,
    or None when TensorFlow cannot do that either."""
    from tensorflow.python.framework import convert_to_constants as ctc

    by_handle = {id(v.handle): v for v in getattr(fn, "variables", ())}
    keep = [internal.op.name for external, internal in getattr(fn.graph, "captures", ())
            if id(external) in by_handle and by_handle[id(external)].dtype.is_integer]
    if not keep:
        return None
    try:
        data = ctc._FunctionConverterDataInEager(  # (the denylist is not in the public API)
            func=fn, lower_control_flow=False, aggressive_inlining=False,
            variable_names_denylist=keep)
        gd, converted = ctc._replace_variables_by_constants(converter_data=data)
        return ctc._construct_concrete_function(fn, gd, converted)
    except Exception:  # noqa: BLE001
        return None


def _frozen(loaded) -> set:
    """The handles (ids) of the variables the SavedModel lists as not trainable: Keras's
    ``model.export()`` lists a layer's weights there when ``layer.trainable = False`` (a frozen
    base model, an Embedding(trainable=False), the kernel ``enable_lora`` freezes), where the
    variables' own ``trainable`` flag stays True."""
    try:
        return {id(v.handle) for v in getattr(loaded, "non_trainable_variables", ()) or ()}
    except Exception:  # noqa: BLE001  (an object that cannot list them: the flags decide)
        return set()


def _variable_names(fn, taken: set, frozen: set = frozenset()) -> tuple[dict, dict]:
    """({frozen constant's node name: its variable's name}, {variable's name: trainable}):
    freezing turns each captured variable into a Const named after the function's placeholder
    for it ("unknown", "unknown_0", ...); the variable's own name ("dense/kernel") says what it
    is, and its ``trainable`` flag, unless ``frozen`` (:func:`_frozen`) holds it, whether
    training changes it (Keras's BatchNormalization moving statistics are variables that are
    not)."""
    by_handle = {id(v.handle): v for v in getattr(fn, "variables", ())}
    out, used, trainable = {}, set(taken), {}
    for external, internal in getattr(fn.graph, "captures", ()):
        v = by_handle.get(id(external))
        if v is None:
            continue
        base = v.name.split(":")[0]
        name, k = base, 0
        while name in used:
            k += 1
            name = f"{base}_{k}"
        used.add(name)
        out[internal.op.name] = name
        trainable[name] = bool(getattr(v, "trainable", True)) and id(v.handle) not in frozen
    return out, trainable


def _rename_nodes(gd, rename: dict) -> None:
    for n in gd.node:
        if n.name in rename:
            n.name = rename[n.name]
        for i, ref in enumerate(n.input):
            ctrl = ref.startswith("^")
            name, sep, idx = ref.lstrip("^").partition(":")
            if name in rename:
                n.input[i] = ("^" if ctrl else "") + rename[name] + sep + idx


def _renamed(tensor: str, rename: dict) -> str:
    name, sep, idx = tensor.partition(":")
    return rename.get(name, name) + sep + idx


def _eager_mode():
    """TF's eager mode for the duration (freezing needs it), also in a process that switched it
    off for TF1-style graph code."""
    try:
        from tensorflow.python.eager import context
        return context.eager_mode()
    except (ImportError, AttributeError):  # pragma: no cover  (a TF without it: as it is)
        import contextlib
        return contextlib.nullcontext()


def signature_names(path, signature: str | None = None) -> tuple[dict, dict]:
    """({input key: tensor name}, {output key: tensor name}) of a SavedModel's signature."""
    _, ins, outs, _ = freeze(path, signature)
    return ins, outs


def load_saved_model(path, inputs=None, outputs=None, signature: str | None = None):
    """(GraphDef, input names, output names, variable nodes) for :func:`.core.convert`: the
    frozen signature, with names given as signature keys turned into tensor names and defaults
    filled in."""
    from .proto import load_graph_def

    gd_bytes, sig_in, sig_out, variables = freeze(path, signature)

    def resolve(names, table):
        if names is None:
            return list(table.values())
        names = [names] if isinstance(names, str) else list(names)
        return [table.get(nm, nm) for nm in names]

    return (load_graph_def(gd_bytes), resolve(inputs, sig_in), resolve(outputs, sig_out),
            variables)

