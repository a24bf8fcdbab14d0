"""Lower ``ai.onnx.preview.training.Gradient`` nodes into plain ONNX.

The ONNX standard's Gradient op (attributes ``xs``, ``y``, optional ``zs``) has no implementation in
any runtime. Each such node is replaced by the gradient subgraph onnxgrad builds: its outputs become
``d y / d xs[i]`` computed by :func:`onnxgrad.gradients` (zs, the other inputs, are held as given;
the graph is differentiated as it stands, so every value y depends on may be a "zs").
"""
from __future__ import annotations

import onnx
from onnx import helper

from .autodiff import gradients
from .errors import InvalidModelError, UnsupportedError
from .inference import graphs_of
from .storage import load_model

TRAINING_DOMAIN = "ai.onnx.preview.training"


def lower_gradient_ops(model: onnx.ModelProto | str, name: str = "gradients") -> onnx.ModelProto:
    """A copy of ``model`` where every Gradient node is replaced by standard ONNX ops."""
    model = load_model(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inner = next((n for g in graphs_of(m.graph)[1:] for n in g.node
                  if n.op_type == "Gradient" and n.domain == TRAINING_DOMAIN), None)
    if inner is not None:
        raise UnsupportedError(f"Gradient node {inner.name or '(unnamed)'!r} is inside a "
                               "subgraph (an If, Loop or Scan body): only main-graph Gradient "
                               "nodes are lowered")
    while True:
        node = next((n for n in m.graph.node
                     if n.op_type == "Gradient" and n.domain == TRAINING_DOMAIN), None)
        if node is None:
            break
        m = _lower_one(m, node, name)
    kept = [o for o in m.opset_import if o.domain != TRAINING_DOMAIN]
    del m.opset_import[:]
    m.opset_import.extend(kept)
    onnx.checker.check_model(m)
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
    y = dec(attrs["y"])
    if len(node.output) != len(xs):
        raise InvalidModelError(f"{label} has {len(node.output)} outputs but {len(xs)} xs: "
                                "the standard gives one output per x")
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
    if not any(o.name == y for o in base.graph.output):  # gradients() needs y typed
        base = onnx.shape_inference.infer_shapes(base)
    res = gradients(base, y, xs, name=name, unconnected_gradients="zero")
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
