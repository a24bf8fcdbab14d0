"""Lower ``ai.onnx.preview.training.Gradient`` nodes into plain ONNX.

The ONNX standard's Gradient op (attributes ``xs``, ``y``, optional ``zs``) has no implementation in
any runtime. Each such node is replaced by the gradient subgraph onnxgrad builds: its outputs become
``d y / d xs[i]`` computed by :func:`onnxgrad.gradients`, with the standard's semantics:

* the names in ``xs`` and ``zs`` are the independent variables of the differentiated graph (the
  one that computes ``y`` from them): each output is a partial derivative, every other name of
  ``xs`` and ``zs`` held fixed (passed as ``stop_gradients``), even where one is computed from
  another;
* the node's i-th input is the value at which the i-th name of ``xs`` followed by ``zs`` is taken.
  Where every input is that name itself, the gradient reuses the forward pass; where one is
  another tensor, the graph from those names to ``y`` is copied with the inputs in their places
  (each through an Identity, so a value given twice is still two variables) and differentiated.
  A copy through an If, Loop or Scan is refused.

Values ``y`` depends on that ``xs`` and ``zs`` do not name are held as the graph computes them.
"""
from __future__ import annotations

import onnx
from onnx import helper

from .autodiff import gradients
from .errors import InvalidModelError, UnsupportedError
from .inference import graphs_of, names_read, node_subgraphs, taken_names, unique_name
from .storage import load_model, strip_weights
from .validation import check_model, check_versions

TRAINING_DOMAIN = "ai.onnx.preview.training"


def lower_gradient_ops(model: onnx.ModelProto | str, name: str = "gradients") -> onnx.ModelProto:
    """A copy of ``model`` where every Gradient node is replaced by standard ONNX ops."""
    model = load_model(model)
    check_versions(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    bodies = [(g, "a subgraph (an If, Loop or Scan body)") for g in graphs_of(m.graph)[1:]]
    for f in m.functions:  # (a FunctionProto's nodes, and their subgraphs)
        where = f"model-local function {f.domain}.{f.name}"
        bodies += [(f, where)] + [(g, where) for n in f.node for s in node_subgraphs(n)
                                  for g in graphs_of(s)]
    for body, where in bodies:
        inner = next((n for n in body.node
                      if n.op_type == "Gradient" and n.domain == TRAINING_DOMAIN), None)
        if inner is not None:
            raise UnsupportedError(f"Gradient node {inner.name or '(unnamed)'!r} is inside "
                                   f"{where}: only main-graph Gradient nodes are lowered")
    while True:
        node = next((n for n in m.graph.node
                     if n.op_type == "Gradient" and n.domain == TRAINING_DOMAIN), None)
        if node is None:
            break
        m = _lower_one(m, node, name)
    kept = [o for o in m.opset_import if o.domain != TRAINING_DOMAIN]
    del m.opset_import[:]
    m.opset_import.extend(kept)
    light, weights = strip_weights(m, 1 << 20)  # (the check serialises: past 2 GB it could not)
    check_model(light, weights)
    return m


def _lower_one(m: onnx.ModelProto, node: onnx.NodeProto, name: str) -> onnx.ModelProto:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    dec = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731
    label = f"Gradient node {node.name or '(unnamed)'!r}"
    for key, kind in (("xs", "a list of tensor names"), ("y", "a tensor name")):
        if key not in attrs:
            raise InvalidModelError(f"{label} has no attribute {key!r} ({kind}, required by "
                                    "ai.onnx.preview.training.Gradient)")
    if not isinstance(attrs["y"], bytes) or not attrs["y"]:
        raise InvalidModelError(f"{label}: attribute 'y' must be one tensor name")
    xs = [dec(x) for x in attrs["xs"]]
    zs = [dec(z) for z in attrs.get("zs", [])]
    y = dec(attrs["y"])
    if len(node.output) != len(xs):
        raise InvalidModelError(f"{label} has {len(node.output)} outputs but {len(xs)} xs: "
                                "the standard gives one output per x")
    symbols = xs + zs
    if len(node.input) != len(symbols) or not all(node.input):
        raise InvalidModelError(
            f"{label} has inputs {list(node.input)} for xs + zs = {symbols}: the standard takes "
            "the i-th input as the value of the i-th name of xs followed by zs, one each")
    if len(set(symbols)) != len(symbols):
        raise InvalidModelError(f"{label} names a tensor twice in xs + zs = {symbols}")
    outs = list(node.output)
    # differentiate the graph without the Gradient node (it is no forward computation) and the
    # nodes that read its outputs (an update W - lr * dW): those follow the gradient subgraph
    idx = list(m.graph.node).index(node)
    made = {o for o in outs if o}
    later = set()
    for i in range(idx + 1, len(m.graph.node)):
        if made.intersection(m.graph.node[i].input):
            later.add(i)
            made.update(m.graph.node[i].output)
    if y in made:
        raise InvalidModelError(f"{label}: y {y!r} depends on the node's own outputs")
    after = [m.graph.node[i] for i in sorted(later)]
    base = onnx.ModelProto()
    base.CopyFrom(m)
    del base.graph.node[:]
    base.graph.node.extend(n for i, n in enumerate(m.graph.node) if i != idx and i not in later)
    keep = [o for o in base.graph.output if o.name not in made]
    del base.graph.output[:]
    base.graph.output.extend(keep)
    known = {v.name for v in base.graph.input} | {t.name for t in base.graph.initializer}
    known.update(o for n in base.graph.node for o in n.output)
    missing = [v for v in [*symbols, y] if v not in known]
    if missing:
        raise InvalidModelError(f"{label} names {missing}, which the graph does not compute "
                                "without the node (xs, zs and y must be its tensors)")
    if list(node.input) != symbols:
        base, y, xs = _evaluated_at(base, y, symbols, list(node.input), len(xs), label)
    if not any(o.name == y for o in base.graph.output):  # gradients() needs y typed
        base = onnx.shape_inference.infer_shapes(base)
    res = gradients(base, y, xs, name=name, stop_gradients=symbols,
                    unconnected_gradients="zero")
    out = res.model
    # rename the gradient outputs to the Gradient node's output names
    ren = {g: o for g, o in zip(res.grads, outs) if o}
    for n in out.graph.node:
        n.output[:] = [ren.get(v, v) for v in n.output]
        n.input[:] = [ren.get(v, v) for v in n.input]
    out.graph.node.extend(after)
    grads_out = [o for o in out.graph.output if o.name in ren]
    others = [o for o in out.graph.output if o.name not in ren]
    for o in grads_out:
        o.name = ren[o.name]
    del out.graph.output[:]
    # the original output order; the Gradient node's outputs where they were graph outputs
    by_name = {o.name: o for o in [*others, *grads_out]}
    by_name.update((o.name, o) for o in m.graph.output if o.name in made and o.name not in by_name)
    out.graph.output.extend(by_name[o.name] for o in m.graph.output if o.name in by_name)
    return out


def _evaluated_at(m: onnx.ModelProto, y: str, symbols: list, values: list, n_xs: int,
                  label: str):
    """``m`` with a copy of the nodes that compute ``y`` from ``symbols`` (the names of xs + zs),
    each symbol read as an Identity of its value; returns it, the copy's y and the Identities
    standing for xs."""
    producer = {o: n for n in m.graph.node for o in n.output if o}
    taken = taken_names(m.graph)
    for g in graphs_of(m.graph)[1:]:
        taken |= taken_names(g)
    nodes, seen, stack = [], set(), [y]
    while stack:  # the nodes between the symbols and y
        v = stack.pop()
        n = producer.get(v)
        if v in symbols or n is None or id(n) in seen:
            continue
        seen.add(id(n))
        nodes.append(n)
        stack.extend(_reads(n))
    order = {id(n): i for i, n in enumerate(m.graph.node)}
    nodes.sort(key=lambda n: order[id(n)])
    # only nodes that read a symbol, directly or not, differ in the copy
    ren = {s: unique_name(f"{s}__at", taken) for s in symbols}
    copies = [helper.make_node("Identity", [v], [ren[s]], name=unique_name(f"{s}__at", taken))
              for s, v in zip(symbols, values)]
    for n in nodes:
        if not ren.keys() & _reads(n):
            continue
        if next(node_subgraphs(n), None) is not None:
            raise UnsupportedError(
                f"{label} is evaluated at inputs other than the tensors xs and zs name, through "
                f"{n.op_type} node {n.name or '(unnamed)'!r}: copying a graph with an If, Loop "
                "or Scan is not supported; feed the Gradient node the tensors xs and zs name")
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.input[:] = [ren.get(v, v) for v in n.input]
        outs = [o and unique_name(f"{o}__at", taken) for o in n.output]
        # (an output that is a symbol itself stays the value given for it downstream)
        ren.update((o, new) for o, new in zip(n.output, outs) if o and o not in symbols)
        c.output[:] = outs
        c.name = unique_name(f"{n.name or n.op_type}__at", taken)
        copies.append(c)
    out = onnx.ModelProto()
    out.CopyFrom(m)
    out.graph.node.extend(copies)
    return out, ren.get(y, y), [ren[x] for x in symbols[:n_xs]]


def _reads(n: onnx.NodeProto) -> set:
    """The names a node reads, its subgraphs' reads from the scopes around them included."""
    return {v for v in n.input if v}.union(*(names_read(g) for g in node_subgraphs(n)))


def add_lower_parser(subparsers) -> None:
    """``onnxgrad lower MODEL -o OUT``: wire with ``add_lower_parser(sub)`` in onnxgrad/cli.py."""
    p = subparsers.add_parser("lower", help="lower ai.onnx.preview.training.Gradient nodes into "
                                            "standard ONNX ops")
    p.add_argument("model", help="the input .onnx model")
    p.add_argument("-o", "--output", required=True, help="where to write the lowered model")
    p.set_defaults(func=_cli_lower)


def _cli_lower(args, out) -> int:
    from .runtime import save_model
    save_model(lower_gradient_ops(args.model), args.output)
    print(f"wrote {args.output}", file=out)
    return 0
