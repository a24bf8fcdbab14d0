"""Numerical gradient checking: onnxgrad's gradients against central finite differences.

The check projects ys onto random cotangents (so a rule that is wrong only in a direction that
``sum(ys)`` hides, Softmax's for instance, still fails), runs a float64 copy of the model where the
ops allow, and compares every element of small xs and random directions of large ones.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .aliasing import private_statistics, statistics_read
from .autodiff import STOP_GRADIENTS_KEY, gradients
from .errors import ArgumentTypeError, InvalidArgumentError, OnnxgradError, UnsupportedError
from .inference import graphs_of, node_subgraphs, unique_name
from .runtime import runner
from .storage import dense_copy, load_model
from .versions import without_ir3_inputs

_LOW = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}


@dataclass
class XReport:
    name: str
    max_abs_err: float
    max_rel_err: float
    checked: int
    ok: bool
    grad: np.ndarray | None = field(default=None, repr=False)  # the analytic gradient checked
    note: str = ""  # what the figures do not say (a gradient of the wrong shape, an empty x)


@dataclass
class CheckReport:
    dtype: str
    results: list[XReport] = field(default_factory=list)
    feeds: dict = field(default_factory=dict, repr=False)  # the inputs the check ran on
    cotangents: dict = field(default_factory=dict, repr=False)  # grad_ys name -> value used

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def __str__(self):
        rows = [f"gradient check ({self.dtype}, central differences):"]
        for r in self.results:
            rows.append(f"  {'ok  ' if r.ok else 'FAIL'} {r.name}: max abs err {r.max_abs_err:.3g}, "
                        f"max rel err {r.max_rel_err:.3g} over {r.checked} probes")
            if r.note:
                rows[-1] += f" ({r.note})"
            elif np.isnan(r.max_abs_err):
                rows[-1] += " (not finite: the ys or the gradient are NaN or inf at these feeds)"
        return "\n".join(rows)


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every float16/float32/bfloat16 tensor, type and cast made
    float64."""
    return _retyped(model, TensorProto.DOUBLE)


def _retyped(model: onnx.ModelProto, to: int) -> onnx.ModelProto:
    """A copy of ``model`` with every float tensor, type and cast of another width made ``to``
    (float64, or float32: the check's copy for onnxruntime's float32 kernels)."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    low = _LOW if to == TensorProto.DOUBLE else (_LOW | {TensorProto.DOUBLE}) - {to}
    _graph64(m.graph, low, to)
    for f in m.functions:
        _nodes64(f.node, low, to)
    return m


def _type64(t: onnx.TypeProto, low, to):
    kind = t.WhichOneof("value")
    if kind == "tensor_type" and t.tensor_type.elem_type in low:
        t.tensor_type.elem_type = to
    elif kind == "sequence_type":
        _type64(t.sequence_type.elem_type, low, to)
    elif kind == "optional_type":
        _type64(t.optional_type.elem_type, low, to)


def _tensor64(t: TensorProto, low, to) -> TensorProto:
    if t.data_type not in low:
        return t
    arr = numpy_helper.to_array(t).astype(onnx.helper.tensor_dtype_to_np_dtype(to))
    return numpy_helper.from_array(arr, t.name)


_FLOAT_VALUES = ("value_float", "value_floats")


def _nodes64(nodes, low, to):
    """The nodes retyped in place; made float64, a Constant whose float comes from a function's
    attribute (``value_float = @alpha``: float32 whatever the caller gives) gets a Cast after
    it."""
    casts = {}
    for i, n in enumerate(nodes):
        _node64(n, low, to)
        if to == TensorProto.DOUBLE and n.op_type == "Constant" and any(
                a.ref_attr_name and a.name in _FLOAT_VALUES for a in n.attribute):
            out = n.output[0]
            n.output[0] = f"{out}__float32"
            casts[i] = onnx.helper.make_node("Cast", [n.output[0]], [out], to=TensorProto.DOUBLE)
    for i in sorted(casts, reverse=True):
        nodes.insert(i + 1, casts[i])


def _node64(n: onnx.NodeProto, low, to):
    # value_float(s) make float32: the same numbers as a tensor; SequenceEmpty's default is float
    if to == TensorProto.DOUBLE and n.op_type == "Constant":
        for k, a in enumerate(n.attribute):
            if a.name in _FLOAT_VALUES and not a.ref_attr_name:
                vals = [a.f] if a.name == "value_float" else list(a.floats)
                dims = [] if a.name == "value_float" else [len(vals)]
                n.attribute[k].CopyFrom(onnx.helper.make_attribute(
                    "value", onnx.helper.make_tensor("value", TensorProto.DOUBLE, dims, vals)))
    if to == TensorProto.DOUBLE and n.op_type == "SequenceEmpty" and \
            not any(a.name == "dtype" for a in n.attribute):
        n.attribute.append(onnx.helper.make_attribute("dtype", TensorProto.DOUBLE))
    for a in n.attribute:
        if a.type == onnx.AttributeProto.TENSOR:
            a.t.CopyFrom(_tensor64(a.t, low, to))
        # (not LayerNormalization's stash_type, as torch.onnx's dynamo exporter writes it: its
        # Mean and InvStdDev are float or bfloat16 only, a float64 one is no valid model; the
        # absent default is float32 too. GroupNormalization's takes float64)
        elif a.type == onnx.AttributeProto.INT and a.i in low and (
                a.name in ("to", "dtype") or a.name == "stash_type"
                and n.op_type != "LayerNormalization"):
            a.i = to
        elif a.type == onnx.AttributeProto.GRAPH:
            _graph64(a.g, low, to)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                _graph64(g, low, to)


def _graph64(g: onnx.GraphProto, low, to):
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        _type64(vi.type, low, to)
    inits = [_tensor64(t, low, to) for t in g.initializer]
    del g.initializer[:]
    g.initializer.extend(inits)
    _nodes64(g.node, low, to)


def _expose(model, ys):
    """A copy of ``model`` in which every y that is an intermediate tensor is also a graph output
    (check_gradients runs the model for ys, and a runtime returns only graph outputs)."""
    outputs = {o.name for o in model.graph.output}
    produced = {o for n in model.graph.node for o in n.output}
    missing = [y for y in dict.fromkeys(ys) if y not in outputs and y in produced]
    if not missing:
        return model
    try:
        typed = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001  (custom ops without inference: outputs stay untyped)
        typed = model
    infos = {vi.name: vi for vi in typed.graph.value_info}
    m = onnx.ModelProto.FromString(model.SerializeToString())
    for y in missing:
        m.graph.output.append(infos.get(y) or onnx.helper.make_empty_tensor_value_info(y))
    return m


def _input_feeds(model, feeds, rng, dim):
    feeds = dict(feeds or {})
    init_names = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in feeds or vi.name in init_names:
            continue
        kind = vi.type.WhichOneof("value")
        if kind != "tensor_type":
            raise InvalidArgumentError(f"check_gradients: input {vi.name!r} is a "
                                       f"{(kind or 'untyped value').replace('_type', '')}: give "
                                       "its value in feeds (onnxgrad check: --feeds FILE.npz)")
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dim for d in tt.shape.dim]
        np_type = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if not np.issubdtype(np_type, np.floating):
            raise InvalidArgumentError(f"check_gradients: input {vi.name!r} is "
                                       f"{np.dtype(np_type).name}: give its value in feeds "
                                       "(onnxgrad check: --feeds FILE.npz); no random value is "
                                       "safe for an integer or bool input (a trip count, an "
                                       "index, a condition)")
        feeds[vi.name] = rng.standard_normal(shape).astype(np_type)
    return feeds


def _promote(model, xs):
    """Make initializer xs graph inputs so that they can be perturbed; returns their values."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    inputs = {vi.name for vi in m.graph.input}
    values = {}
    for t in m.graph.initializer:
        if t.name in xs:
            values[t.name] = numpy_helper.to_array(t)
            if t.name not in inputs:
                m.graph.input.append(onnx.helper.make_tensor_value_info(
                    t.name, t.data_type, list(t.dims)))
    return m, values


def _private_statistics(model):
    """A copy of ``model`` in which each training-mode BatchNormalization has statistics of its
    own (:func:`onnxgrad.aliasing.private_statistics`): onnxruntime writes the updated ones over
    the inputs, so each run of the model itself read the last run's; ys through running_var
    drifted from run to run, and differences made correct gradients FAIL. The statistics are
    graph inputs here (:func:`onnxgrad.aliasing.statistics_read`): onnxruntime folds a copy of
    an initializer into one, whose buffer it would then write over just the same."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    private_statistics(m)
    return m


# -- arguments -----------------------------------------------------------------------------------
def _int_arg(name, value, least):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise InvalidArgumentError(f"check_gradients: {name}={value!r} must be an integer >= "
                                   f"{least}")
    return int(value)


def _float_arg(name, value):
    """None (the default for the dtype) or a positive finite number, as the CLI's --eps etc."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0 < value < np.inf:
        raise InvalidArgumentError(f"check_gradients: {name}={value!r} must be a positive finite "
                                   "number (or None for the default)")
    return float(value)


def _dtype_arg(dtype) -> str:
    try:  # "float64", np.float64 and np.dtype("float64") all name the same thing
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in ("float64", "float32"):
        raise InvalidArgumentError(f"check_gradients: dtype={dtype!r} is not 'float64' (a float64 "
                                   "copy of the model) or 'float32' (the model as it is)")
    return name


def _user_feeds(model, feeds, wide, xs):
    """``feeds`` as arrays of the dtypes ``model`` (the copy that runs) declares, refused with the
    argument named where they do not fit: not an input, not numeric, the wrong rank or size (as
    ``onnxgrad check --feeds`` refuses them), or an x holding NaN (an infinity may be meant: an
    attention mask's -inf, whose gradient is 0; NaN anywhere else shows in the report)."""
    if feeds is None:
        return {}
    if not isinstance(feeds, Mapping):
        raise ArgumentTypeError(f"check_gradients: feeds must be a dict of input name -> value, "
                                f"not {type(feeds).__name__}")
    inputs = {vi.name: vi.type for vi in model.graph.input}  # (fed initializers among them)
    unknown = [k for k in feeds if k not in inputs]
    if unknown:
        known = dict.fromkeys([*inputs, *(t.name for t in model.graph.initializer)])
        raise InvalidArgumentError(
            f"check_gradients: feeds {', '.join(map(repr, unknown))} "
            f"{'is not an input' if len(unknown) == 1 else 'are not inputs'} of the model "
            f"(inputs and initializers: {', '.join(map(repr, known))})")
    out, dims = {}, {}
    for k, v in feeds.items():
        t = inputs[k]
        if t.WhichOneof("value") != "tensor_type" or not t.tensor_type.elem_type:
            out[k] = v  # a sequence or an untyped input: the runtime judges it
            continue
        want = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.tensor_type.elem_type))
        if wide and want.kind == "f":  # (the float64 copy runs float64 whatever was given)
            want = np.dtype(np.float64)
        try:
            a = np.asarray(v)
        except Exception as exc:  # noqa: BLE001  (ragged lists and the like)
            raise InvalidArgumentError(f"check_gradients: feeds[{k!r}] is not an array ({exc})") \
                from None
        if a.dtype.kind not in "fiub" or (a.dtype.kind == "f" and want.kind in "iub"):
            raise InvalidArgumentError(f"check_gradients: feeds[{k!r}] holds {a.dtype} values, "
                                       f"but the model's input is {want}")
        if a.dtype.kind == "f" and k in xs and np.isnan(a).any():
            bad = [int(i) for i in np.argwhere(np.isnan(a))[0]]
            raise InvalidArgumentError(
                f"check_gradients: feeds[{k!r}] holds NaN at index {bad}: an x must not be NaN "
                "(finite differences of NaN compare nothing)")
        a = a.astype(want) if a.dtype != want else a
        if t.tensor_type.HasField("shape"):
            shape = [d.dim_value if d.HasField("dim_value") else d.dim_param or None
                     for d in t.tensor_type.shape.dim]
            shown = "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
            if len(shape) != a.ndim:
                raise InvalidArgumentError(
                    f"check_gradients: feeds[{k!r}] has shape {list(a.shape)}, but the model's "
                    f"input is shaped {shown} (rank {len(shape)})")
            for axis, (w, n) in enumerate(zip(shape, a.shape)):
                if isinstance(w, int) and w != n:
                    raise InvalidArgumentError(
                        f"check_gradients: feeds[{k!r}] has shape {list(a.shape)}, but the "
                        f"model's input is shaped {shown} (axis {axis})")
                if isinstance(w, str) and dims.setdefault(w, (k, n))[1] != n:
                    raise InvalidArgumentError(
                        f"check_gradients: dim {w!r} is {dims[w][1]} in feeds[{dims[w][0]!r}] "
                        f"but {n} in feeds[{k!r}]")
        out[k] = a
    return out


# -- holding tensors constant ----------------------------------------------------------------------
def _stopped(model, stop_gradients) -> list[str]:
    """The tensors gradients() holds constant (its argument and the model's metadata list) that
    the finite differences must hold constant too: those main-graph nodes produce. Graph inputs
    and initializers need nothing: they change only as the x being perturbed, which a stopped x
    still is (stop_gradients=[a, b] with b = 2a gives d/da = 1: a is varied, b is not)."""
    given = [stop_gradients] if isinstance(stop_gradients, str) else list(stop_gradients or [])
    names = list(given)
    try:  # (a malformed list is gradients()'s to refuse; here it only adds names)
        meta = json.loads({p.key: p.value for p in model.metadata_props}
                          .get(STOP_GRADIENTS_KEY, "[]"))
    except ValueError:
        meta = []
    names += meta if isinstance(meta, list) else []
    produced = _produced([model.graph])
    inner = _produced(graphs_of(model.graph)[1:])
    out = []
    for name in dict.fromkeys(n for n in names if isinstance(n, str)):
        if name in produced:
            out.append(name)
        elif name in inner:
            raise UnsupportedError(
                f"check_gradients: {'stop_gradients' if name in given else STOP_GRADIENTS_KEY} "
                f"names {name!r}, a tensor inside an If, Loop or "
                "Scan body: the finite differences cannot hold it constant (it gets a value per "
                "iteration or branch); check a stop on a main-graph tensor instead")
    return out


def _produced(graphs) -> set:
    return {o for g in graphs for n in g.node for o in n.output if o}


def _used(node):
    """The names ``node`` reads, those its subgraphs read from the outer scope included (all
    that the subgraphs read: a superset, which at worst keeps a node alive)."""
    yield from node.input
    for g in node_subgraphs(node):
        for n in g.node:
            yield from _used(n)
        yield from (o.name for o in g.output)


def _cut(model, values: dict, keep=None):
    """A copy of ``model`` in which each tensor of ``values`` (name -> array) is a graph input fed
    that value: its producer's output is renamed to a name nothing reads. With ``keep`` (output
    names) the graph outputs are those and the nodes they no longer need are dropped."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    g = m.graph
    taken = {vi.name for vi in g.input} | {t.name for t in g.initializer}
    taken |= _produced(graphs_of(g)) | {i for n in g.node for i in _used(n)}
    for n in g.node:
        for i, o in enumerate(n.output):
            if o in values:
                n.output[i] = unique_name(f"{o}__cut", taken)
    kept = [vi for vi in g.value_info if vi.name not in values]
    del g.value_info[:]
    g.value_info.extend(kept)
    for name, v in values.items():
        g.input.append(onnx.helper.make_tensor_value_info(
            name, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))
    if keep is not None:
        outs = {o.name: o for o in g.output}
        del g.output[:]
        g.output.extend(outs.get(k) or onnx.helper.make_empty_tensor_value_info(k) for k in keep)
        needed, live = set(keep), []
        for n in reversed(g.node):  # (nodes are in topological order)
            if any(o in needed for o in n.output):
                live.append(n)
                needed.update(_used(n))
        del g.node[:]
        g.node.extend(reversed(live))
    return m


def _values(model, feeds, names, runtime):
    """The values of tensors ``names`` of ``model`` at ``feeds`` (plain arrays only: a sequence
    cannot be made a typed graph input here)."""
    if not names:
        return {}
    vals = runner(_expose(model, names), runtime)(feeds, names)
    return {k: v for k, v in zip(names, vals)
            if isinstance(v, np.ndarray) and v.dtype.kind in "fiub"}


def _reference_reason(run):
    return getattr(run, "on_reference", lambda: None)()


def _no_oracle(why: str, what: str) -> UnsupportedError:
    """``why``: the reason onnx.reference runs the model (runner's ``on_reference()``)."""
    how = "as asked" if why == "preferred" else f"as onnxruntime cannot ({why})"
    return UnsupportedError(
        f"check_gradients: no float64 oracle for this model: onnx.reference runs it in float64 "
        f"{how}, and {what}; check it in float32 (dtype='float32', onnxgrad check --dtype "
        "float32), which onnxruntime runs")


def _as32(values: dict) -> dict:
    return {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in values.items()}


def _oracle_agrees(why: str, model32, feeds, ys, y_vals):
    """The ys onnx.reference computed in float64 (where onnxruntime has no float64 kernel)
    against onnxruntime's float32 run of the same model: the reference follows the newest
    definitions and gets some attributes wrong (LpPool with ceil_mode and dilations, ...), and
    an oracle that computes another function reported correct gradients FAIL."""
    try:
        run32 = runner(model32, "ort", fallback=False)
        types = {vi.name: onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
                 for vi in model32.graph.input if vi.type.HasField("tensor_type")}
        outs = run32({k: np.asarray(v).astype(types.get(k, np.asarray(v).dtype))
                      for k, v in feeds.items()}, ys)
    except Exception:  # noqa: BLE001  (not in float32 either: nothing to compare with)
        return
    for y, a, b in zip(ys, y_vals, outs):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind != "f" or b.dtype.kind != "f":
            continue
        if a.shape != b.shape:
            raise _no_oracle(why, f"its {y!r} has shape {list(a.shape)} where onnxruntime's "
                             f"float32 run gives {list(b.shape)}")
        a, b = a.astype(np.float64), b.astype(np.float64)
        finite = np.isfinite(a) & np.isfinite(b)
        scale = float(np.max(np.abs(b[finite]), initial=0.0))
        diff = float(np.max(np.abs(a - b)[finite], initial=0.0))
        if diff > 1e-2 * scale or np.any(np.isfinite(a) != np.isfinite(b)):
            raise _no_oracle(why, f"its {y!r} differs from onnxruntime's float32 run by up to "
                             f"{diff:.3g} (max |{y}| {scale:.3g}; onnx.reference computes some "
                             "ops otherwise than onnxruntime)")


def _run_gradients(grad_model, base, feeds, cots, want, runtime):
    """The gradients ``want`` of ``grad_model`` (built from ``base``) at ``feeds``.

    onnxruntime first: it runs the Scan bodies of the RNN backward functions in float64, which
    onnx.reference cannot (reverse scans). Where it lacks a float64 kernel for a forward op
    (ONNX RNN), the forward tensors the gradient reads are computed by the forward model's
    runner (which falls back to onnx.reference) and fed to onnxruntime in their place;
    onnx.reference runs it all as the last resort."""
    if runtime != "ort":
        return runner(grad_model, runtime)({**feeds, **cots}, want)
    try:
        return runner(grad_model, "ort", fallback=False)({**feeds, **cots}, want)
    except Exception as exc:  # noqa: BLE001  (the feeds are checked: a kernel is missing)
        first = exc
    forward = {o for n in base.graph.node for o in n.output if o}
    names = [o for n in grad_model.graph.node for o in n.output if o in forward and o not in want]
    try:
        cut = _values(base, feeds, names, runtime)
        return runner(_cut(grad_model, cut, want), "ort", fallback=False)(
            {**feeds, **cots, **cut}, want)
    except Exception:  # noqa: BLE001  (not even that: the reference runs it all)
        pass
    try:
        got = runner(grad_model, "reference")({**feeds, **cots}, want)
    except Exception as last:  # noqa: BLE001
        raise UnsupportedError(
            f"check_gradients: neither onnxruntime nor onnx.reference can run the gradient "
            f"model (onnxruntime: {str(first).strip().splitlines()[0]}; onnx.reference: "
            f"{str(last).strip().splitlines()[0]}); try dtype='float32' (onnxgrad check "
            "--dtype float32)") from last
    # the gradient graph's values are the reference's too: held to onnxruntime's as the ys are
    _oracle_agrees(str(first).strip().splitlines()[0], _retyped(grad_model, TensorProto.FLOAT),
                   {**feeds, **cots}, want, got)
    return got


def check_gradients(model, ys, xs, feeds=None, *, dtype: str = "float64", eps: float | None = None,
                    rtol: float | None = None, atol: float | None = None, directions: int = 3,
                    max_elements: int = 32, seed: int = 0, dim: int = 2, runtime: str = "ort",
                    **grad_kwargs) -> CheckReport:
    """Compare ``gradients(model, ys, xs)`` with central finite differences.

    xs must be graph inputs or initializers. Missing float inputs get random normal values
    (symbolic dims of size ``dim``). xs with at most ``max_elements`` elements are checked
    element by element, larger ones along ``directions`` random unit directions. ``runtime``
    "ort" runs onnxruntime CPU and falls back to onnx.reference for kernels it lacks (the ys
    the reference computes are then compared with onnxruntime's float32 run, and an
    UnsupportedError, not a FAIL, says where they differ: some reference kernels are not
    onnxruntime's functions); "reference" always uses onnx.reference. Tensors in
    ``stop_gradients`` (and the model's ``onnxgrad.stop_gradients`` metadata) are held at their
    values at the feeds while the finite differences vary x, as the partial derivatives
    gradients() gives them assume.
    """
    model = dense_copy(load_model(model))[0]  # (a sparse initializer is checked as an x too)
    model = without_ir3_inputs(model, xs)  # (an x among IR 3's initializers: a feed's input)
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise InvalidArgumentError(f"dim={dim!r}: symbolic dims need a size of at least 1 (an "
                                   "empty tensor would check nothing)")
    dtype = _dtype_arg(dtype)
    if runtime not in ("ort", "reference"):
        raise InvalidArgumentError(f"check_gradients: runtime={runtime!r} is not 'ort' "
                                   "(onnxruntime CPU, onnx.reference where it lacks a kernel) or "
                                   "'reference' (onnx.reference only)")
    seed = _int_arg("seed", seed, 0)
    directions = _int_arg("directions", directions, 1)  # (0 would pass large xs unchecked)
    max_elements = _int_arg("max_elements", max_elements, 0)
    eps, rtol, atol = (_float_arg(k, v) for k, v in (("eps", eps), ("rtol", rtol), ("atol", atol)))
    with np.errstate(over="ignore"):
        if eps is not None and not np.isfinite(np.asarray(eps, dtype) * 2):
            raise InvalidArgumentError(f"check_gradients: eps={eps!r} is too large: the "
                                       f"difference quotient's 2 * eps overflows {dtype}")
    ys = [ys] if isinstance(ys, str) else list(ys)
    xs = [xs] if isinstance(xs, str) else list(xs)
    model = _expose(model, ys)
    wide = dtype == "float64"
    eps = eps or (1e-6 if wide else 1e-2)
    rtol = rtol or (1e-5 if wide else 2e-2)
    atol = atol or (1e-7 if wide else 1e-3)
    rng = np.random.default_rng(seed)
    base = to_float64(model) if wide else model
    fed = set(feeds) if isinstance(feeds, Mapping) else set()
    # (a fed initializer is an input too; so is a BatchNormalization's running statistic, see
    # _private_statistics)
    base, init_values = _promote(base, set(xs) | fed | statistics_read(base))
    feeds = _input_feeds(base, _user_feeds(base, feeds, wide, set(xs)), rng, dim)
    feeds = {k: (v.astype(np.float64) if wide and v.dtype.kind == "f" else v)
             for k, v in feeds.items()}
    feeds.update({k: v for k, v in init_values.items() if k not in feeds})
    missing = [x for x in xs if x not in feeds]
    if missing:
        raise InvalidArgumentError(f"check_gradients: xs {missing} are not graph inputs or "
                                   "initializers")

    cot_names = [f"__cotangent_{i}" for i in range(len(ys))]
    stopped = _stopped(base, grad_kwargs.get("stop_gradients"))  # (refused before any work)
    res = gradients(base, ys, xs, grad_ys=cot_names, **grad_kwargs)
    # the finite differences run a copy in which the stopped tensors are inputs fed their values
    # at the feeds: varying x then moves y only along the paths the gradient follows
    base = _private_statistics(base)
    held = _values(base, feeds, stopped, runtime)
    if set(stopped) - set(held):
        raise UnsupportedError(f"check_gradients: stop_gradients tensors "
                               f"{sorted(set(stopped) - set(held))} are not numeric tensors (a "
                               "sequence, a string): the finite differences cannot hold them "
                               "constant")
    forward = runner(_cut(base, held) if held else base, runtime)
    try:
        y_vals = forward({**feeds, **held}, ys)
    except Exception as exc:  # noqa: BLE001
        why = _reference_reason(forward)
        if not wide or why is None or isinstance(exc, OnnxgradError):
            raise
        raise _no_oracle(why, f"onnx.reference cannot run it ({exc})") from None
    why = _reference_reason(forward)
    if wide and why not in (None, "preferred"):
        twin = _retyped(base, TensorProto.FLOAT)  # (onnxruntime's float32 kernels)
        _oracle_agrees(why, _cut(twin, _as32(held)) if held else twin, {**feeds, **held}, ys,
                       y_vals)
    cots = {c: rng.standard_normal(np.shape(y)).astype(np.asarray(y).dtype)
            for c, y in zip(cot_names, y_vals)}
    want = [g for g in res.grads if g is not None]
    got = dict(zip(want, _run_gradients(res.model, base, feeds, cots, want, runtime))) \
        if want else {}

    def f(fd):
        outs = forward({**fd, **held}, ys)
        return sum(float(np.sum(np.asarray(o, np.float64) * cots[c])) for o, c in zip(outs, cot_names))

    report = CheckReport(dtype)
    for x, gname in zip(xs, res.grads):
        x0 = feeds[x]
        analytic = np.zeros(x0.shape) if gname is None else np.asarray(got[gname], np.float64)
        if analytic.shape != x0.shape:  # (a probe would broadcast against it)
            report.results.append(XReport(
                x, float("nan"), float("nan"), 0, False, analytic,
                f"the gradient has shape {list(analytic.shape)}, x has {list(x0.shape)}"))
            continue
        if x0.size <= max_elements:
            probes = [np.eye(x0.size)[i].reshape(x0.shape) for i in range(x0.size)]
        else:
            probes = [d / np.linalg.norm(d) for d in
                      (rng.standard_normal(x0.shape) for _ in range(directions))]
        abs_err = rel_err = 0.0
        ok, note = True, "" if x0.size else \
            "x has no elements: nothing to compare beyond the gradient's shape"
        finite = np.isfinite(x0)  # (an infinite x, a -inf mask, takes no step at all)
        for d in probes:
            step = (eps * d).astype(x0.dtype)
            hi, lo = x0 + step, x0 - step
            if np.any((hi == lo) & (step != 0) & finite):  # the step is below x's spacing
                big = float(np.max(np.abs(x0[finite & (step != 0)])))
                ok, note = False, (f"eps={eps:g} vanishes against x's values there (|x| up to "
                                   f"{big:g}): nothing was compared; pass a larger eps")
                continue
            num = (f({**feeds, x: hi}) - f({**feeds, x: lo})) / (2 * eps)
            # the analytic slope along the step x actually took: on large values x + step
            # rounds (5.9e8 + 1e-6 is off by 6 %), which made correct gradients FAIL
            with np.errstate(invalid="ignore"):  # (inf - inf where x is infinite: not taken)
                taken = np.where(finite, hi.astype(np.float64) - lo, 2 * step)
            ana = float(np.sum(analytic * taken)) / (2 * eps)
            err = abs(num - ana)
            if not np.isfinite(err):  # (max() would keep 0 over a NaN: a FAIL with error 0)
                abs_err = rel_err = float("nan")
                ok = False
                continue
            abs_err = max(abs_err, err)
            rel_err = max(rel_err, err / max(abs(num), abs(ana), 1e-12))
            ok &= err <= atol + rtol * max(abs(num), abs(ana))
        report.results.append(XReport(x, abs_err, rel_err, len(probes), bool(ok), analytic,
                                      note))
    report.feeds, report.cotangents = feeds, cots
    return report
