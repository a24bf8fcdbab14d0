"""Training-step graphs: loss + gradients + optimizer update as one ONNX model.

    step = build_train_step(model, "loss", optimizer=AdamW(lr=1e-3))
    step.model        # inputs: data..., params..., state..., lr (float64 []), step (int64 [])
                      # outputs: loss, updated params..., updated state...
    step.data_inputs, step.params, step.param_outputs, step.state, step.state_outputs, ...

The parameters are graph inputs, not initializers, so a runtime keeps them where it likes (on the
GPU) and swaps them between steps. ``step`` is the number of the step being taken (1 first).
Updated values are named ``<param>.new`` and ``<param>.<slot>.new`` directly on the nodes that
compute them (no Identity copies). A one-output MaxPool of the forward graph gets its Indices
output in the step graph, so its gradient reuses the forward's argmax instead of pooling twice
(except pools over k x k tiles, whose gradient needs no argmax). Convolutions on small images
with a trained kernel take a faster equivalent form first, and a Dropout of constant ratio 0
becomes an Identity (:mod:`.fast_forms`).

Also here: :func:`build_gradient_model` (gradients() with the parameters as inputs), and the two
graphs a gradient-accumulating trainer runs: :func:`build_accumulate_model` (data, params, running
sums -> loss, sums + w * gradients) and :func:`build_apply_model` (params, state, gradients, lr,
step -> updated params and state).
"""
from __future__ import annotations

import ast
import json
import logging
import os
import re
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx.inliner
from onnx import TensorProto, helper, numpy_helper

from ..aliasing import training_bn
from ..autodiff import gradients
from ..inference import FLOAT_TYPES, graphs_of, model_opset, names_read, taken_names
from ..registry import lookup, own_domain
from .losses import load
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..rules.conv import pool_tiles
from ..storage import keep_data_of
from .fast_forms import small_image_convs, zero_dropouts
from .optimizers import AdamW, Builder, Optimizer, Scalars, Slot, check_number, clip_grad_norm

_log = logging.getLogger("onnxgrad.training")


@dataclass
class TrainStep:
    """A built step graph and the roles of its inputs and outputs (all lists aligned)."""
    model: onnx.ModelProto
    loss: str                          # output: the scalar loss
    data_inputs: list[str]             # inputs fed per batch
    params: list[str]                  # inputs: current parameters
    param_outputs: list[str]           # outputs: updated parameters (aligned with params)
    state: list[str] = field(default_factory=list)          # inputs: optimizer state
    state_outputs: list[str] = field(default_factory=list)  # outputs: updated state
    state_of: list[tuple[str, str]] = field(default_factory=list)  # (param, slot) per state
    lr: str | None = "lr"              # input: scalar learning rate (float64, or float32)
    step: str | None = "step"          # input: int64 scalar step number (1 first)
    grads: list[str] = field(default_factory=list)  # inputs (apply) or outputs (gradient model)
    initial_params: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    frozen: list[str] = field(default_factory=list)
    grad_weight: str | None = None     # input of the accumulate graph: the micro-batch weight
    unconnected: list[str] = field(default_factory=list)  # float initializers with no gradient
    # float initializers the default (params=None) does not train: {name: why} (see
    # default_params); empty when params were given
    left_out: dict[str, str] = field(default_factory=dict)
    # training-mode BatchNormalization running statistics: inputs, and outputs updated by the
    # forward (aligned), as PyTorch's step updates them (see expose_statistics)
    stats: list[str] = field(default_factory=list)
    stat_outputs: list[str] = field(default_factory=list)
    initial_stats: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def initial_state(self, params: dict | None = None) -> dict[str, np.ndarray]:
        """Zeros for every state tensor, shaped like its parameter."""
        params = params or self.initial_params
        return {s: np.zeros_like(params[p]) for s, (p, _) in zip(self.state, self.state_of)}

    def save(self, path, with_values: bool = True) -> None:
        """Write the step graph as one .onnx file (external data past 2 GB, IR pinned for
        onnxruntime); with_values stores the current parameters and zero state as initializers
        that double as the inputs' defaults, so the file runs as it is."""
        from ..runtime import save_model
        m = self.model
        if with_values and self.initial_params:
            m = with_defaults(m, {**self.initial_params, **self.initial_state(),
                                  **self.initial_stats})
        save_model(m, path)


def with_defaults(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of model whose inputs named in values get them as initializers (input defaults)."""
    m = load(model)
    inputs = {v.name for v in m.graph.input}
    m.graph.initializer.extend(numpy_helper.from_array(np.asarray(v), k)
                               for k, v in values.items() if k in inputs)
    return m


# a JSON list of the initializers that are the model's weights, under this metadata_props key
# (the TF converter writes it for a SavedModel's variables): trained by default, rather than every
# float initializer (a converted graph's constants, 0.5 in gelu, a norm's epsilon, are some)
WEIGHTS_KEY = "onnxgrad.weights"
# a JSON object {initializer: why} of float initializers that are not weights (a SavedModel's
# non-trainable variables, a TF FusedBatchNorm's frozen moving statistics): never trained by default
NOT_TRAINED_KEY = "onnxgrad.not_trained"


# what torch.export (torch.onnx.export(dynamo=True)) records of each tensor it lifted from the
# module, and the onnxscript optimizer of each initializer it folded
_TORCH_SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
_TORCH_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
_FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"


def default_params(model: onnx.ModelProto) -> tuple[list[str], dict[str, str]]:
    """The initializers trained when ``params`` is not given, and those left out ({name: why}).

    The rule: the float initializers that are the model's parameters, as the exporter recorded
    them where it did: the list under ``WEIGHTS_KEY`` (the TF converter's trainable variables;
    what it lists under ``NOT_TRAINED_KEY``, never); for a
    torch.export model (``torch.onnx.export(dynamo=True)``, which tags what it lifted) the
    tensors tagged PARAMETER, and those the optimizer folded from one (a transposed weight),
    as ``named_parameters()`` gives them, not buffers, constant tensors nor the Python scalars
    of the forward (``val_0``); else every float initializer. Never, whatever the exporter:
    a BatchNormalization's running mean and variance (inputs 3 and 4; buffers, updated by
    statistics, not by gradients), nor an initializer holding NaN or inf (a mask of -inf: no
    finite update exists, and it could be neither checkpointed nor exported). Pass ``params``
    or ``frozen`` to choose otherwise."""
    floats = [t for t in model.graph.initializer if t.data_type in FLOAT_TYPES]
    meta = {p.key: p.value for p in model.metadata_props}
    listed = meta.get(WEIGHTS_KEY)
    not_trained = json.loads(meta.get(NOT_TRAINED_KEY, "{}"))
    left_out = {t.name: not_trained[t.name] for t in floats if t.name in not_trained}
    torch_params = _torch_parameters(model)
    if listed is not None:
        weights = set(json.loads(listed))
        for t in floats:
            if t.name not in weights:
                left_out.setdefault(t.name, f"not among the model's weights ({WEIGHTS_KEY})")
    elif torch_params is not None:
        params, tags = torch_params
        for t in floats:
            kind, folded = tags.get(t.name, (None, None))
            if t.name in params or kind == "PARAMETER" or (folded and params & set(folded)):
                continue
            left_out[t.name] = (f"a torch.export {kind}, not a parameter" if kind else
                                f"folded from {folded}, none of them a parameter" if folded
                                else "a constant of the torch.export program, not a parameter")
    main = {t.name for t in floats}
    for g in graphs_of(model.graph)[1:]:  # (those _hoist_body_weights could not move)
        for t in g.initializer:
            if t.data_type in FLOAT_TYPES and t.name not in main:
                left_out.setdefault(t.name, "an initializer of a subgraph that cannot move to "
                                            "the main graph (its name is defined elsewhere "
                                            "too, or it is the subgraph's output): no "
                                            "parameter")
    stats = _bn_statistics(model)
    for t in floats:
        if t.name in left_out:
            continue
        if t.name in stats:
            left_out[t.name] = f"a BatchNormalization running statistic (of {stats[t.name]!r})"
            if torch_params is not None and listed is None:
                # torch.export's optimizer merges equal tensors: a fresh BatchNorm's weight
                # (ones) and running_var (ones) become one initializer
                left_out[t.name] += (", though torch.export tags it a PARAMETER: the exporter "
                                     "merged it with the statistic, and training it would "
                                     "change both (params=[...] trains it all the same)")
        elif not np.isfinite(numpy_helper.to_array(t)).all():
            left_out[t.name] = "holds NaN or inf"
    if left_out:
        _log.debug("not trained by default: %s", "; ".join(f"{k} ({v})"
                                                           for k, v in left_out.items()))
    return [t.name for t in floats if t.name not in left_out], left_out


_WARNED: set = set()  # (graph, names) the merge warning named: once per process, not per builder


def _hoist_body_weights(m: onnx.ModelProto) -> None:
    """Move the float initializers of ``m``'s subgraphs to its main graph (the bodies read the
    same name from there), except one whose name something else in the model defines too (an
    initializer of another subgraph or of the main graph, an input, a node's output: names may
    repeat across sibling scopes) or that is its subgraph's output (:func:`default_params`
    leaves those out, saying so)."""
    if m.ir_version < 4:  # (every main-graph initializer would have to be an input too)
        return
    graphs = graphs_of(m.graph)
    count: dict[str, int] = {}
    for g in graphs:
        for name in [*(t.name for t in g.initializer), *(v.name for v in g.input),
                     *(o for n in g.node for o in n.output)]:
            count[name] = count.get(name, 0) + 1
    for g in graphs[1:]:
        outs = {o.name for o in g.output}
        moved = [t for t in g.initializer if t.data_type in FLOAT_TYPES
                 and count[t.name] == 1 and t.name not in outs]
        if moved:
            kept = [t for t in g.initializer if t not in moved]
            m.graph.initializer.extend(moved)
            del g.initializer[:]
            g.initializer.extend(kept)


def as_module_parameters(m: onnx.ModelProto) -> onnx.ModelProto:
    """``m`` (changed in place) with its initializers made the module's parameters as PyTorch
    trains them, where a torch.onnx export wrote them otherwise:

    - the TorchScript exporter writes a parameter whose values equal another's (a fresh model's
      LayerNorm weights, its zero biases) as ``Identity(other)``: it trained as one tensor with
      the sum of both gradients. It becomes its own initializer (a parameter torch ties is one
      initializer there, read twice, and stays so);
    - both exporters fold a weight's Transpose into a new constant (TorchScript's
      ``onnx::MatMul_11``, the dynamo optimizer's ``val_4``); where the weight is still an
      initializer (an embedding tied to the output layer), the two trained apart, or the
      constant not at all: it becomes ``Transpose(weight)``, one tensor trained by both uses;
    - torch.export's signature names parameters the model no longer holds: tied ones, but also
      ones its optimizer merged with an equal tensor or folded into a computed one, which train
      as that tensor; a warning names them (``optimize=False`` keeps them apart).
    And for any model: a float initializer of a subgraph (a weight only a Loop's or If's body
    reads) moves to the main graph, where the body reads it from (:func:`_hoist_body_weights`),
    so that it trains as any other initializer (it was left out, silently). Idempotent."""
    _hoist_body_weights(m)
    if m.producer_name != "pytorch":
        return m
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    floats = {k for k, t in inits.items() if t.data_type in FLOAT_TYPES}
    torch_params = _torch_parameters(m)
    if torch_params is None:  # TorchScript: Identity(P) -> Q, Q a parameter of equal value
        # (a module's parameter by its name: not an exporter's "onnx::MatMul_8", a no-op
        # reshape of the same tensor, nor a graph output, the tensor itself returned)
        outputs = {o.name for o in g.output}
        merged = [n for n in g.node if n.op_type == "Identity" and n.input[0] in floats
                  and n.output[0] not in inits and not n.domain and "::" not in n.output[0]
                  and n.output[0] not in outputs]
        for n in merged:
            t = TensorProto()
            t.CopyFrom(inits[n.input[0]])
            t.name = n.output[0]
            g.initializer.append(t)
            g.node.remove(n)
            _log.debug("%s: its own parameter (the exporter wrote it as Identity(%s), their "
                       "values being equal)", n.output[0], n.input[0])
        folded = [k for k in floats if k.startswith("onnx::")]
        weights = [k for k in floats if not k.startswith("onnx::")]
    else:
        params, tags = torch_params
        weights = [k for k in floats if k in params or tags.get(k, (None,))[0] == "PARAMETER"]
        folded = [k for k in floats if k not in weights]
    _tie_folded_transposes(m, folded, weights)
    if torch_params is not None:
        sig = next((p.value for p in g.metadata_props if p.key == _TORCH_SIGNATURE), "")
        targets = re.findall(r"^\s*\S+: PARAMETER target='([^']*)'", sig, re.M)
        # a weight whose transpose (or reshape) the optimizer folded into a new constant, read
        # nowhere else, trains as that constant to the same effect: not said
        laid_out = {f[0] for k, (_, f) in torch_params[1].items()
                    if f and len(f) == 1 and k in inits and len(inits[k].dims) >= 2}
        missing = [t for t in targets if t not in inits and t not in laid_out]
        if missing and (g.name, *missing) not in _WARNED:
            _WARNED.add((g.name, *missing))
            _log.warning(
                "torch.export names parameters this model does not hold as tensors: %s. Tied "
                "to another parameter, they train as that one, as in PyTorch; but torch.onnx's "
                "optimizer (optimize=True, the default) also merges parameters of equal values "
                "(a fresh model's LayerNorm weights) and folds computed ones (exp(scale)) into "
                "constants, which then train as one tensor, or as the folded value: export with "
                "optimize=False to train the module's parameters as PyTorch does",
                ", ".join(missing))
    return m


def _tie_folded_transposes(m: onnx.ModelProto, folded: list, weights: list):
    """Each 2-D initializer of ``folded`` that is exactly the transpose of one of ``weights``
    (not a constant-valued one: equal values say nothing of a tie) becomes that Transpose."""
    g = m.graph
    by_shape: dict = {}
    arrays = {}
    for t in g.initializer:
        if t.name in weights and len(t.dims) == 2:
            by_shape.setdefault(tuple(t.dims), []).append(t)
    ties = []
    for t in list(g.initializer):
        if t.name not in folded or len(t.dims) != 2:
            continue
        for w in by_shape.get((t.dims[1], t.dims[0]), []):
            a = arrays.setdefault(w.name, numpy_helper.to_array(w))
            if a.size > 1 and a.min() != a.max() and np.array_equal(a.T, numpy_helper.to_array(t)):
                ties.append((t, w.name))
                break
    inputs = {v.name: v for v in g.input}  # (keep_initializers_as_inputs lists them there)
    for t, w in ties:
        g.initializer.remove(t)
        if t.name in inputs:
            g.input.remove(inputs[t.name])
        g.node.insert(0, helper.make_node("Transpose", [w], [t.name], perm=[1, 0],
                                          name=f"{t.name}/tied_to/{w}"))
        _log.debug("%s: Transpose(%s) (the exporter folded it into a copy)", t.name, w)


def float_initializers(model: onnx.ModelProto) -> list[str]:
    """The initializers trained by default (:func:`default_params`)."""
    return default_params(model)[0]


def _torch_parameters(model: onnx.ModelProto):
    """For a torch.export model: (the parameters' names, {value: (kind tag, folded_from)});
    None for any other model."""
    sig = next((p.value for p in model.graph.metadata_props if p.key == _TORCH_SIGNATURE), None)
    g = model.graph
    tags = {}
    for v in [*g.input, *g.value_info, *g.initializer]:
        meta = {p.key: p.value for p in v.metadata_props}
        kind, folded = meta.get(_TORCH_KIND), meta.get(_FOLDED_FROM)
        if folded is not None:
            try:
                folded = [str(x) for x in ast.literal_eval(folded)]
            except (ValueError, SyntaxError, TypeError):
                folded = None
        if kind or folded:
            tags[v.name] = (kind, folded)
    if sig is None and not any(k for k, _ in tags.values()):
        return None
    # "p_fc_weight: PARAMETER target='fc.weight'": targets are the initializers' names
    params = set(re.findall(r"^\s*\S+: PARAMETER target='([^']*)'", sig or "", re.M))
    params |= {n for n, (k, _) in tags.items() if k == "PARAMETER"}
    return params, tags


def _bn_statistics(model: onnx.ModelProto) -> dict[str, str]:
    """{name: node} of the tensors read as a BatchNormalization's running mean or variance, in
    the graph, its subgraphs, and the model's functions as they are called."""
    funcs = {(f.domain, f.name): f for f in model.functions}
    out: dict[str, str] = {}

    def walk(nodes, outer, depth):
        # outer: a function body's formal inputs -> the caller's names (None: the main graph)
        def name(x):
            return x if outer is None else outer.get(x)
        for n in nodes:
            if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx"):
                for i in (3, 4):
                    if len(n.input) > i and n.input[i] and name(n.input[i]):
                        out.setdefault(name(n.input[i]), n.name or n.op_type)
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else list(a.graphs)):
                    walk(sub.node, outer, depth)
            f = funcs.get((n.domain, n.op_type))
            if f is not None and depth < 16:
                walk(f.node, {fi: name(ai) for fi, ai in zip(f.input, n.input) if ai}, depth + 1)
    walk(model.graph.node, None, 0)
    return out


def training_statistics(model: onnx.ModelProto) -> dict[str, list[str]]:
    """{running statistic: the outputs holding its new value, one per reader} of the main
    graph's training-mode BatchNormalizations (inputs 3 and 4; outputs 1 and 2, "" unnamed)."""
    opset = model_opset(model)
    outs: dict[str, list[str]] = {}
    for n in model.graph.node:
        if training_bn(n, opset):
            for i, k in ((3, 1), (4, 2)):
                if len(n.input) > i and n.input[i]:
                    outs.setdefault(n.input[i], []).append(n.output[k] if len(n.output) > k
                                                           else "")
    return outs


def expose_statistics(m: onnx.ModelProto, params) -> tuple[list[str], list[str], dict]:
    """Make the running statistics of the main graph's training-mode BatchNormalizations that
    are float initializers (not ``params``) graph inputs of ``m`` (in place), so that a step
    reads them from buffers and writes the node's updated statistics back, as PyTorch's step
    does. Returns (inputs, the node's outputs holding their new values, initial values). A
    statistic read by two such nodes, or whose output is unnamed, stays as it is."""
    inits = {t.name: t for t in m.graph.initializer}
    outs = training_statistics(m)
    stats = [t for t, o in outs.items() if t in inits and t not in params and
             inits[t].data_type in FLOAT_TYPES and len(o) == 1 and o[0]]
    declared = {v.name for v in m.graph.value_info}
    m.graph.value_info.extend(  # the new outputs' types: the statistics'
        helper.make_tensor_value_info(outs[t][0], inits[t].data_type, list(inits[t].dims))
        for t in stats if outs[t][0] not in declared)
    return stats, [outs[t][0] for t in stats], _params_to_inputs(m, stats)


def _resolve_params(m: onnx.ModelProto, params, frozen):
    inits = {t.name: t for t in m.graph.initializer}
    frozen = list(frozen or [])
    for f in frozen:
        if f not in inits:
            raise InvalidArgumentError(f"frozen: no initializer named {f!r}")
    left_out: dict[str, str] = {}
    if params is None:
        chosen, left_out = default_params(m)
        chosen = [n for n in chosen if n not in set(frozen)]
    else:
        chosen = [params] if isinstance(params, str) else list(params)
        for p in chosen:
            if p not in inits:
                raise InvalidArgumentError(f"params: {p!r} is not an initializer of the model")
            if inits[p].data_type not in FLOAT_TYPES:
                raise InvalidArgumentError(f"params: {p!r} is not a float tensor")
        chosen = [p for p in chosen if p not in set(frozen)]
    if len(set(chosen)) != len(chosen):
        raise InvalidArgumentError("params: a name is listed twice")
    return chosen, frozen, left_out


def _check_loss(m: onnx.ModelProto, loss: str):
    if not isinstance(loss, str):
        raise ArgumentTypeError(f"loss must be the name of a scalar tensor, not {loss!r}")
    names = {o.name for o in m.graph.output} | {o for n in m.graph.node for o in n.output}
    if loss not in names:
        outs = [o.name for o in m.graph.output]
        raise InvalidArgumentError(f"loss: no tensor named {loss!r} in the model (its outputs: "
                                   f"{outs})")


def _check_loss_is_scalar(m: onnx.ModelProto, loss: str) -> None:
    """The gradients of a tensor of many elements are those of its sum: a step would descend
    sum(y), and a Trainer could not read it back; only a scalar (or a shape not known) goes."""
    vi = next((v for v in [*m.graph.output, *m.graph.value_info]
               if v.name == loss and v.type.tensor_type.HasField("shape")), None)
    if vi is None:
        try:
            inferred = onnx.shape_inference.infer_shapes(m)
        except Exception:  # noqa: BLE001  (an unknown shape is checked at run time)
            return
        vi = next((v for v in [*inferred.graph.output, *inferred.graph.value_info]
                   if v.name == loss and v.type.tensor_type.HasField("shape")), None)
    if vi is None or not vi.type.tensor_type.shape.dim:
        return
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param or "?"
            for d in vi.type.tensor_type.shape.dim]
    raise InvalidArgumentError(f"loss: {loss!r} has shape {dims}, not a scalar: the loss must "
                               "be a scalar (rank 0), e.g. a ReduceMean or ReduceSum of it "
                               "with keepdims=0, or a loss kind (mse, cross_entropy, ...)")


def _params_to_inputs(m: onnx.ModelProto, params: list[str]) -> dict[str, np.ndarray]:
    """Move ``params`` from initializers to graph inputs; returns their values."""
    g = m.graph
    keep, values = [], {}
    wanted = set(params)
    by_name = {}
    for t in g.initializer:
        if t.name in wanted:
            by_name[t.name] = t
        else:
            keep.append(t)
    existing = {v.name for v in g.input}
    for p in params:
        t = by_name[p]
        values[p] = numpy_helper.to_array(t)
        if p not in existing:
            g.input.append(helper.make_tensor_value_info(p, t.data_type, list(t.dims)))
    del g.initializer[:]
    g.initializer.extend(keep)
    return values


def _prune(m: onnx.ModelProto, outputs: list[str], keep_inputs: list[str]):
    """Set the graph outputs, drop nodes nothing needs, and inputs nothing reads (bar
    ``keep_inputs``)."""
    g = m.graph
    types = {v.name: v for v in [*g.output, *g.value_info, *g.input]}
    new_outs = []
    for o in outputs:
        vi = types.get(o)
        new_outs.append(vi if vi is not None and vi.name == o and vi.type.tensor_type.elem_type
                        else helper.make_empty_tensor_value_info(o))
    needed = set(outputs)
    live = []
    for n in reversed(g.node):
        if any(o in needed for o in n.output):
            live.append(n)
            needed.update(i for i in n.input if i)
            for a in n.attribute:  # subgraphs read outer names implicitly
                for sub in ([a.g] if a.HasField("g") else list(a.graphs)):
                    needed.update(names_read(sub))
    live.reverse()
    del g.node[:]
    g.node.extend(live)
    del g.output[:]
    g.output.extend(new_outs)
    ins = [v for v in g.input if v.name in needed or v.name in keep_inputs]
    del g.input[:]
    g.input.extend(ins)
    inits = [t for t in g.initializer if t.name in needed]
    del g.initializer[:]
    g.initializer.extend(inits)
    vis = [v for v in g.value_info if v.name in needed]
    del g.value_info[:]
    g.value_info.extend(vis)


def _dtype_of(m: onnx.ModelProto, name: str) -> int:
    for v in m.graph.input:
        if v.name == name:
            return v.type.tensor_type.elem_type
    raise KeyError(name)


def build_gradient_model(model, loss: str, params=None, frozen=None, *,
                         statistics: bool = True) -> TrainStep:
    """``gradients(model, loss, params)`` with the parameters as graph inputs.

    Returns a :class:`TrainStep` description whose ``model`` has inputs data + params and
    outputs [loss, gradients...] (``grads``, aligned with ``params``). Parameters the loss does
    not depend on are left as initializers and listed in ``unconnected``. ``statistics``:
    training-mode BatchNormalization running statistics as inputs and outputs too
    (:func:`expose_statistics`; False: they stay initializers, not updated)."""
    m = as_module_parameters(load(model))
    _check_loss(m, loss)
    chosen, frozen, left_out = _resolve_params(m, params, frozen)
    if not chosen:
        raise InvalidArgumentError(
            "no parameters to train: the model has no float initializers (or all are frozen)"
            + (f"; left out by default: {left_out} (pass params=[...] to train them)"
               if left_out else ""))
    # the parameters become graph inputs first: gradients() then sees a small model (no weight
    # data, whatever the model's size) and the step graph reads them as inputs
    values = _params_to_inputs(m, chosen)
    stats, stat_outputs, stat_values = (expose_statistics(m, set(chosen)) if statistics
                                        else ([], [], {}))
    _check_loss_is_scalar(m, loss)  # after the move: the model holds no weights to infer over
    m = _inline_functions(m)
    _expose_pool_indices(m)
    small_image_convs(m, set(chosen), taken_names(m.graph))
    zero_dropouts(m)
    res = gradients(m, [loss], chosen)
    gm = res.model
    params_ok = [p for p, g in zip(chosen, res.grads) if g is not None]
    grads = [g for g in res.grads if g is not None]
    unconnected = [p for p, g in zip(chosen, res.grads) if g is None]
    if not params_ok:
        raise InvalidArgumentError(f"the loss {loss!r} depends on none of the parameters {chosen}")
    if unconnected:  # no gradient: they stay constants (initializers), as torch leaves them
        ins = [v for v in gm.graph.input if v.name not in set(unconnected)]
        del gm.graph.input[:]
        gm.graph.input.extend(ins)
        gm.graph.initializer.extend(numpy_helper.from_array(values.pop(p), p)
                                    for p in unconnected)
    _prune(gm, [loss, *grads, *stat_outputs], stats)
    # an initializer that is also an input (IR < 4 models, keep_initializers_as_inputs) and is
    # not trained is an input with a default, not data each batch must feed
    defaults = {t.name for t in gm.graph.initializer} | set(stats)
    data = [v.name for v in gm.graph.input if v.name not in values and v.name not in defaults]
    return TrainStep(model=gm, loss=loss, data_inputs=data, params=params_ok, param_outputs=[],
                     grads=grads, lr=None, step=None, initial_params=values, frozen=frozen,
                     unconnected=unconnected, left_out=left_out, stats=stats,
                     stat_outputs=stat_outputs, initial_stats=stat_values)


def _inline_functions(m: onnx.ModelProto) -> onnx.ModelProto:
    """The model's own functions inlined, so that the fast forms below see inside (gradients()
    would keep the calls and recompute each body, which onnxruntime merges with the forward).
    onnxgrad's own ops keep their calls, and so does any op with a rule: the rule is the
    gradient (their bodies read as math miss terms, the RNN's reserve_space)."""
    keep = [(f.domain, f.name) for f in m.functions if own_domain(f.domain) or
            lookup(f.domain, f.name, model_opset(m, f.domain)) is not None]
    if len(keep) == len(m.functions):
        return m
    inits = list(m.graph.initializer)  # the inliner serializes: no frozen weights (2 GB limit)
    del m.graph.initializer[:]
    out = onnx.inliner.inline_selected_functions(m, keep, exclude=True)
    out.graph.initializer.extend(inits)
    return out


def _expose_pool_indices(m: onnx.ModelProto):
    """Give each one-output MaxPool its Indices output, so the MaxPool gradient rule reuses the
    forward's argmax instead of running a second MaxPool (the training graph computes it once);
    not to pools over k x k tiles, whose gradient needs none (rules.conv.pool_tiles) and whose
    forward runs several times faster without it."""
    taken = None
    for n in m.graph.node:
        if n.op_type == "MaxPool" and n.domain in ("", "ai.onnx") and len(n.output) == 1 and \
                pool_tiles({a.name: helper.get_attribute_value(a) for a in n.attribute}) is None:
            taken = taken if taken is not None else taken_names(m.graph)
            base, k = f"{n.output[0]}.indices", 0
            name = base
            while name in taken:
                k += 1
                name = f"{base}_{k}"
            taken.add(name)
            n.output.append(name)


SCALAR_DTYPES = {"float64": TensorProto.DOUBLE, "float32": TensorProto.FLOAT}


# ops whose onnxruntime kernels may write their output over an input of the same shape:
# element i is read before it is written (Gemm, by contrast, copies C into its output first)
_IN_PLACE_SAFE = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Where", "Sqrt",
                            "Identity", "Neg", "Abs"})


def _check_state_in_place(nodes: list, state_in: list[str], state_out: list[str]) -> None:
    """The Trainer binds each state input and its output to one buffer: safe only when every
    node that reads the old value runs before the node that writes the new one, i.e. is one
    of its ancestors, and when the writer itself reads it, element by element (an elementwise
    op). Holds for the optimizers here; checked, so that a new one cannot break it silently."""
    producer = {o: n for n in nodes for o in n.output}
    readers: dict[str, list] = {}
    for n in nodes:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    for old, new in zip(state_in, state_out):
        writer = producer.get(new)
        if writer is not None and old in writer.input and writer.op_type not in _IN_PLACE_SAFE:
            raise AssertionError(f"optimizer state {old!r} is read by {writer.name!r} "
                                 f"({writer.op_type}), which writes its new value {new!r} in "
                                 "place: not an elementwise op")
        seen, todo = set(), [writer]
        while todo:
            n = todo.pop()
            if n is None or id(n) in seen:
                continue
            seen.add(id(n))
            todo.extend(producer.get(x) for x in n.input)
        late = [n.name for n in readers.get(old, []) if id(n) not in seen]
        if late:
            raise AssertionError(f"optimizer state {old!r} is read by {late} after its new "
                                 f"value {new!r} is written (in place)")


def _add_optimizer(gm: onnx.ModelProto, desc: TrainStep, grads: list[str],
                   optimizer: Optimizer, clip_norm: float | None, taken: set[str],
                   scalars: str = "float64", loss: str | None = None):
    """Append the optimizer's nodes and inputs to gm; fills desc's state and output lists.
    ``loss``: the step's loss, whose finiteness gates the state's update (see Scalars.gate)."""
    if scalars not in SCALAR_DTYPES:
        raise ValueError(f"scalars={scalars!r} is not one of {', '.join(SCALAR_DTYPES)}")
    g = gm.graph
    b = Builder(taken, "optimizer")
    lr = b.name("lr")
    step = b.name("step")
    g.input.append(helper.make_tensor_value_info(lr, SCALAR_DTYPES[scalars], []))
    g.input.append(helper.make_tensor_value_info(step, TensorProto.INT64, []))
    ok = None
    if loss is not None and optimizer.slots:
        b.prefix = "optimizer"
        kind = next((o.type.tensor_type.elem_type for o in gm.graph.output if o.name == loss),
                    None)
        # IsInf takes float16 and bfloat16 only from opset 20: a half loss is checked widened
        seen = b.op("Cast", loss, to=TensorProto.FLOAT) if kind in (
            TensorProto.FLOAT16, TensorProto.BFLOAT16) else loss
        ok = b.op("Not", b.op("Or", b.op("IsNaN", seen), b.op("IsInf", seen)))
    sc = Scalars(b, lr, step, SCALAR_DTYPES[scalars], ok)
    dtypes = [_dtype_of(gm, p) for p in desc.params]
    if clip_norm is not None:
        clip_norm = check_number("clip_norm", "clip_norm", clip_norm)
        if clip_norm == 0:
            raise InvalidArgumentError("clip_norm=0 would zero every gradient: give a positive "
                                       "norm, or None for no clipping")
        b.prefix = "optimizer/clip"
        grads = clip_grad_norm(b, grads, dtypes, float(clip_norm),
                               [desc.initial_params[p].ndim for p in desc.params])
    state_in, state_out, state_of, p_out = [], [], [], []
    renames: dict[str, str] = {}

    def output(value: str, base: str, dt, shape) -> str:
        """Name ``value`` ``base`` as a graph output: rename the node that makes it (an
        Identity would copy the whole tensor every step) unless it is not ours to rename."""
        name = b.name(base)
        if value in produced_here and value not in renames and value not in fixed:
            renames[value] = name
        else:
            b.nodes.append(helper.make_node("Identity", [value], [name], name=name))
        g.output.append(helper.make_tensor_value_info(name, dt, shape))
        return name

    fixed = set(grads)  # clipped gradients etc. may be shared: never rename those
    for p, gr, dt in zip(desc.params, grads, dtypes):
        b.prefix = f"optimizer/{p}"
        shape = list(desc.initial_params[p].shape)
        st = {}
        for slot in optimizer.slots:
            name = b.name(f"{p}.{slot}")
            g.input.append(helper.make_tensor_value_info(name, dt, shape))
            st[slot] = name
        first = len(b.nodes)
        new_p, new_st = optimizer.update(b, Slot(p, gr, st, dt, sc, len(shape)))
        produced_here = {o for n in b.nodes[first:] for o in n.output}
        p_out.append(output(new_p, f"{p}.new", dt, shape))
        for slot in optimizer.slots:
            state_in.append(st[slot])
            state_out.append(output(new_st[slot], f"{p}.{slot}.new", dt, shape))
            state_of.append((p, slot))
    b.rename(renames)
    _check_state_in_place(b.nodes, state_in, [renames.get(o, o) for o in state_out])
    g.node.extend(b.nodes)
    desc.lr, desc.step = lr, step
    desc.param_outputs, desc.state, desc.state_outputs, desc.state_of = \
        p_out, state_in, state_out, state_of


def build_train_step(model, loss: str, params=None, optimizer: Optimizer | None = None,
                     frozen=None, clip_norm: float | None = None,
                     scalars: str = "float64", *, statistics: bool = True) -> TrainStep:
    """One ONNX model that takes a training step: see the module doc.

    ``model`` (a ModelProto or a path) must compute ``loss`` (a scalar, else an
    InvalidArgumentError; the loss helpers in :mod:`onnxgrad.training.losses` attach one).
    ``params``: initializer names to train (None: the model's parameters as
    :func:`default_params` finds them: float initializers, not BatchNormalization running
    statistics, not ones holding NaN or inf, and for a torch.export model only its PARAMETERs;
    the description's ``left_out`` names the rest; minus ``frozen``). An initializer not trained
    that the model also lists as an input keeps its default, and is no data input.
    ``optimizer``: an :class:`Optimizer` (default
    AdamW()). ``clip_norm``: clip the gradients' global 2-norm first. ``scalars``: the type of
    lr and of the optimizer's scalar arithmetic, "float64" or "float32" (for runtimes without
    float64 kernels, such as onnxruntime-web's WebGPU builds). ``statistics``: as
    :func:`build_gradient_model`'s."""
    optimizer = optimizer or AdamW()
    desc = build_gradient_model(model, loss, params, frozen, statistics=statistics)
    gm = desc.model
    grads = desc.grads
    taken = taken_names(gm.graph)
    _add_optimizer(gm, desc, grads, optimizer, clip_norm, taken, scalars, loss)
    outs = [loss, *desc.param_outputs, *desc.state_outputs, *desc.stat_outputs]
    # lr and step stay inputs even when unread (plain SGD)
    _prune(gm, outs, [desc.lr, desc.step, *desc.stats])
    _reorder_inputs(gm, desc.data_inputs + desc.params + desc.state + [desc.lr, desc.step] +
                    desc.stats)
    desc.grads = []
    onnx.checker.check_model(gm)
    return desc


def _reorder_inputs(gm: onnx.ModelProto, order: list[str]):
    by = {v.name: v for v in gm.graph.input}
    ins = [by[n] for n in order if n in by] + [v for v in gm.graph.input if v.name not in order]
    del gm.graph.input[:]
    gm.graph.input.extend(ins)


def build_accumulate_model(model, loss: str, params=None, frozen=None) -> TrainStep:
    """Gradient accumulation: inputs data, params, running sums (``grads``, one per param) and
    ``grad_weight`` (scalar, the param dtype); outputs loss and sums + grad_weight * gradients
    (in ``param_outputs``). Feed zeros as the sums of the first micro-batch, and n_i / N as the
    weight of a micro-batch of n_i of the N rows: the sums are then the big batch's gradient
    of a per-row mean loss."""
    desc = build_gradient_model(model, loss, params, frozen)
    gm = desc.model
    g = gm.graph
    b = Builder(taken_names(g), "accumulate")
    dtypes = [_dtype_of(gm, p) for p in desc.params]
    w = b.name("grad_weight")
    g.input.append(helper.make_tensor_value_info(w, dtypes[0], []))
    sums, outs = [], []
    weights = {}
    for p, gr, dt in zip(desc.params, desc.grads, dtypes):
        shape = list(desc.initial_params[p].shape)
        s = b.name(f"{p}.grad_sum")
        g.input.append(helper.make_tensor_value_info(s, dt, shape))
        if dt not in weights:
            weights[dt] = w if dt == dtypes[0] else b.op("Cast", w, to=dt)
        o = b.name(f"{p}.grad_sum.new")
        b.op("Add", s, b.op("Mul", gr, weights[dt]), out=o)
        g.output.append(helper.make_tensor_value_info(o, dt, shape))
        sums.append(s)
        outs.append(o)
    g.node.extend(b.nodes)
    _prune(gm, [loss, *outs, *desc.stat_outputs], desc.stats)
    _reorder_inputs(gm, desc.data_inputs + desc.params + sums + [w] + desc.stats)
    desc.grads, desc.param_outputs = sums, outs
    desc.lr, desc.step, desc.grad_weight = None, None, w
    onnx.checker.check_model(gm)
    return desc


def build_apply_model(grad_desc: TrainStep, optimizer: Optimizer | None = None,
                      clip_norm: float | None = None) -> TrainStep:
    """The optimizer alone: inputs params, gradients (``grads``), state, lr, step; outputs the
    updated params and state. ``grad_desc`` describes the parameters (from
    :func:`build_gradient_model` or :func:`build_accumulate_model`)."""
    optimizer = optimizer or AdamW()
    vals = grad_desc.initial_params
    graph = helper.make_graph([], "apply", [], [])
    gm = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    dts = {}
    for p in grad_desc.params:
        dts[p] = helper.np_dtype_to_tensor_dtype(vals[p].dtype)
        gm.graph.input.append(helper.make_tensor_value_info(p, dts[p], list(vals[p].shape)))
    taken = {p for p in grad_desc.params}
    grads = []
    for p in grad_desc.params:
        name = f"{p}.grad"
        while name in taken:
            name += "_"
        taken.add(name)
        gm.graph.input.append(helper.make_tensor_value_info(name, dts[p], list(vals[p].shape)))
        grads.append(name)
    desc = TrainStep(model=gm, loss="", data_inputs=[], params=list(grad_desc.params),
                     param_outputs=[], grads=grads, initial_params=vals,
                     frozen=grad_desc.frozen, unconnected=grad_desc.unconnected,
                     left_out=dict(grad_desc.left_out))
    _add_optimizer(gm, desc, grads, optimizer, clip_norm, taken)
    _reorder_inputs(gm, desc.params + grads + desc.state + [desc.lr, desc.step])
    onnx.checker.check_model(gm)
    return desc


def export_train_step(model, loss: str, path, **kw) -> TrainStep:
    """Build the train step of ``model`` and write it to ``path`` (see TrainStep.save)."""
    keep_data_of(model, [path])
    step = build_train_step(model, loss, **kw)
    step.save(os.fspath(path))
    return step
