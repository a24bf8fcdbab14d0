"""A guard against onnxruntime's in-place BatchNormalization statistics.

onnxruntime's BatchNormalization in training mode declares its running mean and variance outputs
aliases of its ``input_mean`` / ``input_var`` (it writes the updated statistics over them), even
where that buffer is a caller's feed, an initializer or a tensor other nodes read. Any other
reader then sees the updated values or not, by execution order: the gradient of a model
function recomputes the body beside the call, so the graph reads the same statistics twice, and
at ORT_DISABLE_ALL the second copy read what the first wrote (a wrong gradient); the caller's
numpy feeds changed with every run.

:func:`private_statistics` gives each such input of a training-mode BatchNormalization, and
each argument of a model-function call that reaches one, that is not already private to it
(made by a node of the same graph and read by nothing else; a function's formal inputs are, as
their calls' arguments are made so) its own copy: ``Max(t, t)``, exact for every value (NaN and
-0.0 included) and float type, and kept by onnxruntime's optimizer, which removes ``Mul(t, 1)``
and aliases ``Identity``. The k-th copy of one tensor takes k + 1 operands, so that onnxruntime's
CommonSubexpressionElimination cannot merge two copies back into one shared buffer.
"""
from __future__ import annotations

from collections import Counter

import onnx

from .inference import graphs_of, model_opset, names_read, node_subgraphs, unique_name

_STATS = (3, 4)  # input_mean, input_var


def training_bn(n: onnx.NodeProto, opset: int) -> bool:
    """Whether ``n`` is a BatchNormalization in training mode (the one that writes its inputs)."""
    if n.op_type != "BatchNormalization" or n.domain not in ("", "ai.onnx"):
        return False
    if opset >= 14:
        return any(a.name == "training_mode" and a.i for a in n.attribute)
    return any(n.output[1:])  # BatchNormalization-9: the statistics outputs mean training


class _Guard:
    def __init__(self, model: onnx.ModelProto):
        self.opset = model_opset(model)
        self.funcs = {(f.domain, f.name): f for f in model.functions}
        self.formals: dict = {}  # function key -> its formal inputs' indices that reach a BN
        self.copies: Counter = Counter()

    def _opset_of(self, f) -> int:
        return next((o.version for o in f.opset_import if o.domain in ("", "ai.onnx")),
                    self.opset)

    def slots(self, n: onnx.NodeProto, opset: int) -> tuple:
        """The input indices of ``n`` at which onnxruntime may write the statistics."""
        if training_bn(n, opset):
            return _STATS
        key = (n.domain, n.op_type)
        if key not in self.funcs:
            return ()
        if key not in self.formals:
            self.formals[key] = ()  # a recursive call reaches nothing new
            f = self.funcs[key]
            read = self.stat_reads(f.node, self._opset_of(f))
            self.formals[key] = tuple(i for i, x in enumerate(f.input) if x in read)
        return self.formals[key]

    def stat_reads(self, nodes, opset: int) -> set:
        """Names read at such slots by ``nodes`` and their subgraphs."""
        out = set()
        for n in nodes:
            out.update(n.input[i] for i in self.slots(n, opset) if i < len(n.input))
            for body in node_subgraphs(n):
                out |= self.stat_reads(body.node, opset)
        return out

    def guard(self, nodes, private: set, outputs: set, opset: int, taken: set) -> list | None:
        """``nodes`` with the copies they need, or None when they need none."""
        made = private | {o for n in nodes for o in n.output if o}
        reads = Counter(i for n in nodes for i in n.input if i)
        for n in nodes:
            for body in node_subgraphs(n):
                reads.update(names_read(body))
        out, changed = [], False
        for n in nodes:
            for i in self.slots(n, opset):
                t = n.input[i] if i < len(n.input) else ""
                if t and (t not in made or reads[t] > 1 or t in outputs):
                    self.copies[t] += 1
                    copy = unique_name(f"{t}/private", taken)
                    out.append(onnx.helper.make_node("Max", [t] * (self.copies[t] + 1), [copy],
                                                     name=copy))
                    n.input[i] = copy
                    changed = True
            out.append(n)
        return out if changed else None


def statistics_read(model: onnx.ModelProto) -> set[str]:
    """The names in ``model``'s main graph that a training-mode BatchNormalization reads as
    its running statistics: directly, in a subgraph, or inside a model function it is passed
    to."""
    gd = _Guard(model)
    return gd.stat_reads(model.graph.node, gd.opset)


def private_statistics(model: onnx.ModelProto) -> None:
    """Copies, in place in ``model``, where onnxruntime would write a training-mode
    BatchNormalization's statistics over a buffer something else reads (module docstring)."""
    gd = _Guard(model)
    # (nodes, names private to them, graph outputs, opset) of every graph and function body
    bodies = [(g.node, set(), {o.name for o in g.output}, gd.opset)
              for g in graphs_of(model.graph)]
    for f in model.functions:
        op = gd._opset_of(f)
        bodies.append((f.node, set(f.input), set(f.output), op))
        bodies += [(g.node, set(), {o.name for o in g.output}, op) for n in f.node
                   for sub in node_subgraphs(n) for g in graphs_of(sub)]
    if not any(n.op_type == "BatchNormalization" for b in bodies for n in b[0]):
        return
    taken = {o for b in bodies for n in b[0] for o in [*n.input, *n.output, n.name]}
    taken |= {i.name for g in graphs_of(model.graph) for i in [*g.input, *g.initializer]}
    for nodes, private, outputs, op in bodies:
        guarded = gd.guard(list(nodes), private, outputs, op, taken)
        if guarded is not None:
            del nodes[:]
            nodes.extend(guarded)
