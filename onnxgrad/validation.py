"""Up-front checks of a model handed to gradients(): versions the installed onnx knows, and
onnx.checker (a dangling input, a tensor produced twice, an unknown op, a bad attribute ...).

A model that fails them would otherwise give a gradient graph that fails later, or worse. The
checker runs on the model as onnxgrad sees it: without the data of its large weights (their
names become inputs for the check) and with a placeholder shape where a graph input or output
declares none (the checker asks for one; onnxruntime does not). A graph whose nodes are merely
out of topological order is sorted (the gradient model is written sorted) and checked again.
"""
from __future__ import annotations

import functools
import re

import onnx

from .errors import InvalidModelError
from .inference import graphs_of, node_subgraphs


@functools.lru_cache(maxsize=None)
def _newest_opsets() -> dict[str, int]:
    newest: dict[str, int] = {}
    for schema in onnx.defs.get_all_schemas_with_history():
        newest[schema.domain] = max(newest.get(schema.domain, 0), schema.since_version)
    newest[""] = newest["ai.onnx"] = onnx.defs.onnx_opset_version()
    return newest


def check_versions(model: onnx.ModelProto) -> None:
    """The IR version and every standard domain's opset are ones the installed onnx knows."""
    if model.ir_version > onnx.IR_VERSION:
        raise InvalidModelError(
            f"the model has IR version {model.ir_version}, newer than the installed onnx "
            f"{onnx.__version__} knows (up to {onnx.IR_VERSION}); export it for an older one")
    newest = _newest_opsets()
    for o in model.opset_import:
        top = newest.get(o.domain)
        if top is not None and o.version > top:
            raise InvalidModelError(
                f"the model imports opset {o.version} of domain {o.domain or 'ai.onnx'!r}, newer "
                f"than the installed onnx {onnx.__version__} knows (up to {top}); export it for "
                "an older opset")


def _needs_shape(vi: onnx.ValueInfoProto) -> bool:
    kind = vi.type.WhichOneof("value")
    return kind is None or (kind == "tensor_type" and not vi.type.tensor_type.HasField("shape"))


def check_model(model: onnx.ModelProto, stripped=()) -> onnx.ModelProto:
    """Refuse ``model`` with an InvalidModelError naming what onnx.checker finds wrong; returns
    it, or a copy with its nodes in topological order where that was all that was wrong.
    ``stripped``: names of initializers whose data was taken out (see the module docstring)."""
    check_versions(model)
    g = model.graph
    io_gaps = [vi for vi in g.input if _needs_shape(vi) and vi.type.WhichOneof("value")]
    io_gaps += [vi for vi in g.output if _needs_shape(vi)]
    m = model
    if stripped or io_gaps:  # a copy for the check alone
        m = onnx.ModelProto.FromString(model.SerializeToString())
        gaps = {vi.name for vi in io_gaps}
        for vi in [*m.graph.input, *m.graph.output]:
            if vi.name in gaps:
                if vi.type.WhichOneof("value") is None:
                    vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
                vi.type.tensor_type.shape.SetInParent()
        if stripped:
            names = set(stripped)
            inputs = {vi.name for vi in m.graph.input}
            light = [t for t in m.graph.initializer if t.name in names]
            kept = [t for t in m.graph.initializer if t.name not in names]
            del m.graph.initializer[:]
            m.graph.initializer.extend(kept)
            m.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type,
                                                                    list(t.dims))
                                 for t in light if t.name not in inputs)
    try:
        _check(m, model)
    except onnx.checker.ValidationError as exc:
        msg = " ".join(str(exc).split())
        name = re.search(r"however input '([^']*)' of node", msg)
        if name and _produced(m.graph, name.group(1)):  # only out of order: sort, check again
            return check_model(sort_nodes(model), stripped)
        if name:
            node = next(n for g in graphs_of(m.graph) for n in g.node if name.group(1) in n.input)
            msg = (f"input {name.group(1)!r} of node {node.name!r} ({node.op_type}) is made by "
                   "no node, graph input or initializer")
        raise InvalidModelError(f"the model is not valid ONNX: {msg}") from None
    return model


_DEPRECATED = "onnxgrad.deprecated"  # where deprecated ops go for the checker to pass them


def _check(m: onnx.ModelProto, model: onnx.ModelProto) -> None:
    """onnx.checker.check_model; a deprecated op (GroupNormalization-18, still run by
    onnxruntime) is no error here: its nodes are set aside (in a copy) and the check goes on."""
    while True:
        try:
            return onnx.checker.check_model(m)
        except onnx.checker.ValidationError as exc:
            dep = re.search(r"Op registered for (\w+) is deprecated", str(exc))
            if not dep:
                raise
            if m is model:
                m = onnx.ModelProto.FromString(model.SerializeToString())
            found = False
            for g in graphs_of(m.graph):
                for n in g.node:
                    if n.op_type == dep.group(1) and n.domain in ("", "ai.onnx"):
                        n.domain, found = _DEPRECATED, True
            if not found:
                raise
            if not any(o.domain == _DEPRECATED for o in m.opset_import):
                m.opset_import.add(domain=_DEPRECATED, version=1)


def _produced(graph: onnx.GraphProto, name: str) -> bool:
    return any(any(v.name == name for v in [*g.input, *g.initializer])
               or any(name in n.output for n in g.node) for g in graphs_of(graph))


def node_reads(node: onnx.NodeProto) -> set[str]:
    """What a node reads: its inputs and the outer names its subgraphs read."""
    reads = {i for i in node.input if i}
    for g in node_subgraphs(node):
        made = {o for n in g.node for o in n.output} | {v.name for v in g.input}
        made |= {t.name for t in g.initializer}
        reads |= {r for n in g.node for r in node_reads(n)} - made
    return reads


def sort_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose main graph nodes are in topological order (stable)."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    nodes = list(m.graph.node)
    maker = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    deps = [{maker[r] for r in node_reads(n) if r in maker} for n in nodes]
    order, state = [], [0] * len(nodes)  # 0 new, 1 on the stack, 2 placed
    for start in range(len(nodes)):
        stack = [start]
        while stack:
            i = stack[-1]
            if state[i] == 2:
                stack.pop()
                continue
            state[i] = 1
            todo = [j for j in sorted(deps[i]) if state[j] == 0]
            if todo:
                stack.append(todo[0])
                continue
            if any(state[j] == 1 for j in deps[i]):
                raise InvalidModelError(f"the model is not valid ONNX: node {nodes[i].name!r} "
                                        f"({nodes[i].op_type}) is part of a cycle")
            state[i] = 2
            order.append(nodes[i])
            stack.pop()
    del m.graph.node[:]
    m.graph.node.extend(order)
    return m
