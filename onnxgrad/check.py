"""Numerical gradient checking: onnxgrad's gradients against central finite differences.

The check projects ys onto random cotangents (so a rule that is wrong only in a direction that
``sum(ys)`` hides, Softmax's for instance, still fails), runs a float64 copy of the model where the
ops allow, and compares every element of small xs and random directions of large ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .autodiff import gradients
from .errors import InvalidArgumentError
from .runtime import runner
from .storage import dense_copy, load_model

_LOW = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}


@dataclass
class XReport:
    name: str
    max_abs_err: float
    max_rel_err: float
    checked: int
    ok: bool
    grad: np.ndarray | None = field(default=None, repr=False)  # the analytic gradient checked


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
        return "\n".join(rows)


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every float16/float32/bfloat16 tensor, type and cast made float64."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    _graph64(m.graph)
    for f in m.functions:
        _nodes64(f.node)
    return m


def _type64(t: onnx.TypeProto):
    kind = t.WhichOneof("value")
    if kind == "tensor_type" and t.tensor_type.elem_type in _LOW:
        t.tensor_type.elem_type = TensorProto.DOUBLE
    elif kind == "sequence_type":
        _type64(t.sequence_type.elem_type)
    elif kind == "optional_type":
        _type64(t.optional_type.elem_type)


def _tensor64(t: TensorProto) -> TensorProto:
    if t.data_type not in _LOW:
        return t
    arr = numpy_helper.to_array(t).astype(np.float64)
    return numpy_helper.from_array(arr, t.name)


_FLOAT_VALUES = ("value_float", "value_floats")


def _nodes64(nodes):
    """The nodes made float64 in place; a Constant whose float comes from a function's attribute
    (``value_float = @alpha``: float32 whatever the caller gives) gets a Cast after it."""
    casts = {}
    for i, n in enumerate(nodes):
        _node64(n)
        if n.op_type == "Constant" and any(a.ref_attr_name and a.name in _FLOAT_VALUES
                                           for a in n.attribute):
            out = n.output[0]
            n.output[0] = f"{out}__float32"
            casts[i] = onnx.helper.make_node("Cast", [n.output[0]], [out], to=TensorProto.DOUBLE)
    for i in sorted(casts, reverse=True):
        nodes.insert(i + 1, casts[i])


def _node64(n: onnx.NodeProto):
    if n.op_type == "Constant":  # value_float(s) make float32: the same numbers as a tensor
        for k, a in enumerate(n.attribute):
            if a.name in _FLOAT_VALUES and not a.ref_attr_name:
                vals = [a.f] if a.name == "value_float" else list(a.floats)
                dims = [] if a.name == "value_float" else [len(vals)]
                n.attribute[k].CopyFrom(onnx.helper.make_attribute(
                    "value", onnx.helper.make_tensor("value", TensorProto.DOUBLE, dims, vals)))
    if n.op_type == "SequenceEmpty" and not any(a.name == "dtype" for a in n.attribute):
        n.attribute.append(onnx.helper.make_attribute("dtype", TensorProto.DOUBLE))  # default float
    for a in n.attribute:
        if a.type == onnx.AttributeProto.TENSOR:
            a.t.CopyFrom(_tensor64(a.t))
        elif a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype", "stash_type") and a.i in _LOW:
            a.i = TensorProto.DOUBLE
        elif a.type == onnx.AttributeProto.GRAPH:
            _graph64(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                _graph64(g)


def _graph64(g: onnx.GraphProto):
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        _type64(vi.type)
    inits = [_tensor64(t) for t in g.initializer]
    del g.initializer[:]
    g.initializer.extend(inits)
    _nodes64(g.node)


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
            raise ValueError(f"check_gradients: input {vi.name!r} is a "
                             f"{(kind or 'untyped value').replace('_type', '')}: give its value "
                             "in feeds (onnxgrad check: --feeds FILE.npz)")
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dim for d in tt.shape.dim]
        np_type = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if not np.issubdtype(np_type, np.floating):
            raise ValueError(f"check_gradients: input {vi.name!r} is {np.dtype(np_type).name}: "
                             "give its value in feeds (onnxgrad check: --feeds FILE.npz); no "
                             "random value is safe for an integer or bool input (a trip count, "
                             "an index, a condition)")
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


def check_gradients(model, ys, xs, feeds=None, *, dtype: str = "float64", eps: float | None = None,
                    rtol: float | None = None, atol: float | None = None, directions: int = 3,
                    max_elements: int = 32, seed: int = 0, dim: int = 2, runtime: str = "ort",
                    **grad_kwargs) -> CheckReport:
    """Compare ``gradients(model, ys, xs)`` with central finite differences.

    xs must be graph inputs or initializers. Missing float inputs get random normal values
    (symbolic dims of size ``dim``). xs with at most ``max_elements`` elements are checked
    element by element, larger ones along ``directions`` random unit directions. ``runtime``
    "ort" runs onnxruntime CPU and falls back to onnx.reference for kernels it lacks;
    "reference" always uses onnx.reference.
    """
    model = dense_copy(load_model(model))[0]  # (a sparse initializer is checked as an x too)
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise InvalidArgumentError(f"dim={dim!r}: symbolic dims need a size of at least 1 (an "
                                   "empty tensor would check nothing)")
    ys = [ys] if isinstance(ys, str) else list(ys)
    xs = [xs] if isinstance(xs, str) else list(xs)
    model = _expose(model, ys)
    wide = dtype == "float64"
    eps = eps or (1e-6 if wide else 1e-2)
    rtol = rtol or (1e-5 if wide else 2e-2)
    atol = atol or (1e-7 if wide else 1e-3)
    rng = np.random.default_rng(seed)
    base = to_float64(model) if wide else model
    base, init_values = _promote(base, set(xs))
    feeds = {k: (v.astype(np.float64) if wide and v.dtype.kind == "f" else v)
             for k, v in _input_feeds(base, feeds, rng, dim).items()}
    feeds.update({k: v for k, v in init_values.items() if k not in feeds})
    missing = [x for x in xs if x not in feeds]
    if missing:
        raise ValueError(f"check_gradients: xs {missing} are not graph inputs or initializers")

    cot_names = [f"__cotangent_{i}" for i in range(len(ys))]
    res = gradients(base, ys, xs, grad_ys=cot_names, **grad_kwargs)
    forward = runner(base, runtime)
    y_vals = forward(feeds, ys)
    cots = {c: rng.standard_normal(np.shape(y)).astype(np.asarray(y).dtype)
            for c, y in zip(cot_names, y_vals)}
    want = [g for g in res.grads if g is not None]
    got = dict(zip(want, runner(res.model, runtime)({**feeds, **cots}, want)))

    def f(fd):
        outs = forward(fd, ys)
        return sum(float(np.sum(np.asarray(o, np.float64) * cots[c])) for o, c in zip(outs, cot_names))

    report = CheckReport(dtype)
    for x, gname in zip(xs, res.grads):
        x0 = feeds[x]
        analytic = np.zeros(x0.shape) if gname is None else np.asarray(got[gname], np.float64)
        if x0.size <= max_elements:
            probes = [np.eye(x0.size)[i].reshape(x0.shape) for i in range(x0.size)]
        else:
            probes = [d / np.linalg.norm(d) for d in
                      (rng.standard_normal(x0.shape) for _ in range(directions))]
        abs_err = rel_err = 0.0
        ok = True
        for d in probes:
            step = (eps * d).astype(x0.dtype)
            num = (f({**feeds, x: x0 + step}) - f({**feeds, x: x0 - step})) / (2 * eps)
            ana = float(np.sum(analytic * d))
            err = abs(num - ana)
            abs_err = max(abs_err, err)
            rel_err = max(rel_err, err / max(abs(num), abs(ana), 1e-12))
            ok &= err <= atol + rtol * max(abs(num), abs(ana))
        report.results.append(XReport(x, abs_err, rel_err, len(probes), bool(ok), analytic))
    report.feeds, report.cotangents = feeds, cots
    return report
