"""onnx shape inference that also sees the outer-scope Constants a subgraph reads.

onnx's inference types a Loop or Scan body without the values of outer Constants, so a body's
Unsqueeze or Reshape whose axes or shape come from outside gets no shape, and every rank after it
is unknown (rules such as MatMul's need ranks). Copies of those Constants are put at the start of
each body that reads them for the inference run only, and taken out of its result.

onnx 1.23's STFT inference also reads an absent onesided as 0 where the schema's default (and
every runtime) is 1, so the default is written out (and stays in the result, which onnx's checker
then infers right), and the dims declared downstream of such a node, which onnx inferred with the
wrong default, are forgotten before inference gives them again.
"""
from __future__ import annotations

import onnx

_MARK = "onnxgrad_inlined_constant/"


def _subgraphs(node: onnx.NodeProto):
    for a in node.attribute:
        if a.HasField("g"):
            yield a.g
        yield from a.graphs


def _inline(nodes, constants: dict) -> None:
    for node in nodes:
        for body in _subgraphs(node):
            made = {o for n in body.node for o in n.output}
            read = {i for n in body.node for i in n.input} - made
            copies = []
            for name in sorted(read & constants.keys()):
                c = onnx.NodeProto.FromString(constants[name].SerializeToString())
                c.name = _MARK + c.name
                copies.append(c)
            inner = {**constants, **{o: n for n in body.node if n.op_type == "Constant"
                                     for o in n.output}}
            _inline(body.node, inner)
            if copies:
                kept = list(body.node)
                del body.node[:]
                body.node.extend(copies + kept)


def _strip(graph: onnx.GraphProto) -> None:
    gone = {o for n in graph.node if n.name.startswith(_MARK) for o in n.output}
    if gone:
        kept = [n for n in graph.node if not n.name.startswith(_MARK)]
        del graph.node[:]
        graph.node.extend(kept)
        vis = [vi for vi in graph.value_info if vi.name not in gone]
        del graph.value_info[:]
        graph.value_info.extend(vis)
    for n in graph.node:
        for body in _subgraphs(n):
            _strip(body)


def _stft_without_onesided(n: onnx.NodeProto) -> bool:
    return (n.op_type == "STFT" and n.domain in ("", "ai.onnx")
            and not any(a.name == "onesided" for a in n.attribute))


def _forget_dims(graph: onnx.GraphProto, tainted: set) -> None:
    """Make the declared dims of ``tainted`` tensors and of everything computed from them
    unknown (the rank stays)."""
    for n in graph.node:  # topological order
        if tainted.intersection(n.input):
            tainted.update(n.output)
    for vi in list(graph.value_info) + list(graph.output):
        if vi.name in tainted and vi.type.tensor_type.HasField("shape"):
            for d in vi.type.tensor_type.shape.dim:
                d.Clear()


def infer_shapes(model: onnx.ModelProto, **kw) -> onnx.ModelProto:
    """onnx.shape_inference.infer_shapes (a new model) with outer Constants visible in bodies."""
    if not any(_stft_without_onesided(n) or any(True for _ in _subgraphs(n))
               for n in model.graph.node):
        return onnx.shape_inference.infer_shapes(model, **kw)
    m = onnx.ModelProto.FromString(model.SerializeToString())
    stft = [n for n in m.graph.node if _stft_without_onesided(n)]
    for n in stft:
        n.attribute.append(onnx.helper.make_attribute("onesided", 1))
    if stft:
        _forget_dims(m.graph, {o for n in stft for o in n.output})
    _inline(m.graph.node, {o: n for n in m.graph.node if n.op_type == "Constant"
                           for o in n.output})
    m = onnx.shape_inference.infer_shapes(m, **kw)
    _strip(m.graph)
    return m
