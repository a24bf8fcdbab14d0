"""onnx shape inference that the gradient rules can trust.

What onnx's own ``infer_shapes`` does not do:

- Declared ``value_info`` is a claim, not evidence: a model may declare [7, 5] for a tensor of
  shape [3], and onnx keeps the declared shape over what it infers. The declared entries (and the
  graph outputs' types) are taken out before inference; an entry is put back only where inference
  says nothing that contradicts it (it may add what inference cannot know, as after a custom op),
  and a graph output that inference contradicts is an error naming it.
- Pools with ceil_mode: onnx keeps a last window that starts in the end padding; onnxruntime and
  onnx.reference drop it (as PyTorch does), so the inferred output is one element too long, and
  onnxruntime, which builds on the same inference, folds Shape() of it into a wrong constant.
  Such a pool is rewritten with the equivalent explicit pads and no ceil_mode, so that onnx,
  onnxruntime's static shapes and every runtime agree (:func:`floor_pads`).
- Ops whose outputs keep their input's rank (Split with computed sizes, ReduceSum with computed
  axes, a Conv with a computed kernel, :data:`SAME_RANK`) or change it by a known length
  (:data:`AXES_RANK`) get no shape from onnx at all: they are given their rank; so are a Loop's
  carried outputs, whose shape onnx always drops.
- onnx types a Loop or Scan body without the values of outer Constants, so a body's Unsqueeze or
  Reshape whose axes or shape come from outside gets no shape, and every rank after it is unknown
  (rules such as MatMul's need ranks). Copies of those Constants are put at the start of each
  body that reads them for the inference run only, and taken out of its result. onnx 1.23's STFT
  inference also reads an absent onesided as 0 where the schema's default (and every runtime) is
  1, so the default is written out before inference (and stays: onnx's checker then infers the
  result right), and the dims declared downstream of such a node, which onnx inferred with the
  wrong default, are forgotten.
- onnx has no schema for onnxruntime's own ops (the com.microsoft ops its optimizer writes,
  its ai.onnx-domain SimplifiedLayerNormalization), so nothing after one would be typed: for the
  inference run only, each is replaced by standard stand-in nodes that make outputs of the same
  types and shapes (:func:`_standins`), and put back in the result.
"""
from __future__ import annotations

import functools

import numpy as np
import onnx
import onnx.defs
from onnx import TensorShapeProto, TypeProto

from .errors import InvalidModelError

# the floating-point element types, the ones gradients flow through (TensorProto's ints, which
# onnx_ir's DataType members equal: membership works for both)
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                         onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})

_MARK = "onnxgrad_inlined_constant/"
_POOLS = ("AveragePool", "MaxPool", "LpPool")


@functools.lru_cache(maxsize=None)
def _output_type_params(op_type: str, opset: int) -> tuple | None:
    """Per output of an ai.onnx op: (the indices of the inputs that share its type parameter,
    the one element type its constraint allows or None); None for an op without a schema."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    allowed = {tc.type_param_str: tc.allowed_type_strs for tc in schema.type_constraints}
    elem = {f"tensor({k})": v for k, v in _ELEM_TYPES.items()}
    out = []
    for o in schema.outputs:
        ties = tuple(i for i, f in enumerate(schema.inputs) if f.type_str == o.type_str)
        only = allowed.get(o.type_str, [o.type_str])
        out.append((ties, elem.get(only[0]) if len(only) == 1 else None))
    return tuple(out)


_ELEM_TYPES = {"float": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6,
               "int64": 7, "string": 8, "bool": 9, "float16": 10, "double": 11, "uint32": 12,
               "uint64": 13, "bfloat16": 16}


def schema_output_dtypes(op_type: str, opset: int, in_dtypes: list) -> list:
    """The element type (TensorProto enum) of each output of an ai.onnx node, as far as its
    schema fixes it: the type of an input that shares the output's type parameter (Reshape's
    output is its data's type), or the one type its constraint allows (Shape: int64). onnx's
    shape inference can fail on a node (odd shapes in an expanded function body) whose output
    type is certain all the same."""
    params = _output_type_params(op_type, opset)
    if params is None:
        return []
    out = []
    for ties, only in params:
        tied = [in_dtypes[i] for i in ties if i < len(in_dtypes) and in_dtypes[i] is not None]
        out.append(tied[0] if tied else only)
    return out


def pool_out_len(dim: int, pb: int, pe: int, ek: int, s: int, ceil: bool) -> int:
    """A pool's (or conv's) output length along one axis, as onnxruntime and onnx.reference
    compute it: with ceil_mode, a last window that would start inside the end padding is
    dropped (onnx's shape inference keeps it). ``ek`` is the dilated kernel extent."""
    num = dim + pb + pe - ek
    if not ceil:
        return num // s + 1
    o = -(-num // s) + 1
    if (o - 1) * s >= dim + pb:
        o -= 1
    return o


_GRAPH, _GRAPHS = onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS


def node_subgraphs(node: onnx.NodeProto):
    """The GRAPH and GRAPHS attributes of a NodeProto."""
    for a in node.attribute:
        if a.type == _GRAPH:
            yield a.g
        elif a.type == _GRAPHS:
            yield from a.graphs


def graphs_of(graph: onnx.GraphProto) -> list:
    """graph and every subgraph in it, in a fixed order (the same for a copy)."""
    out = [graph]
    for n in graph.node:
        if n.attribute:
            for sub in node_subgraphs(n):
                out += graphs_of(sub)
    return out


def names_read(graph: onnx.GraphProto) -> set[str]:
    """Every name the nodes of ``graph`` and of its subgraphs read (those from the scopes
    around it among them: ONNX names are not shadowed)."""
    reads = set()
    for n in graph.node:
        reads.update(i for i in n.input if i)
        for sub in node_subgraphs(n):
            reads |= names_read(sub)
    return reads


def bodies_of(model: onnx.ModelProto) -> list:
    """(nodes, ai.onnx opset) of every graph and subgraph of ``model`` and of every model-local
    function body and its subgraphs, in a fixed order (the same for a copy)."""
    opset = model_opset(model)
    out = [(g.node, opset) for g in graphs_of(model.graph)]
    for f in model.functions:
        f_opset = next((o.version for o in f.opset_import if o.domain in ("", "ai.onnx")), opset)
        out.append((f.node, f_opset))
        out += [(g.node, f_opset) for n in f.node if n.attribute
                for sub in node_subgraphs(n) for g in graphs_of(sub)]
    return out


def _inline(nodes, constants: dict) -> None:
    for node in nodes:
        for body in node_subgraphs(node):
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
        for body in node_subgraphs(n):
            _strip(body)


def model_opset(m: onnx.ModelProto, domain: str = "") -> int:
    """The model's opset of ``domain`` (ai.onnx by default; 1 when it imports none)."""
    names = ("", "ai.onnx") if domain in ("", "ai.onnx") else (domain,)
    return next((o.version for o in m.opset_import if o.domain in names), 1)


def constant_tensors(graph: onnx.GraphProto) -> dict:
    """{name: TensorProto} of ``graph``'s initializers and ai.onnx Constant(value) outputs (read
    with numpy_helper.to_array where needed: a model's weights are not copied for a lookup)."""
    out = {t.name: t for t in graph.initializer}
    out.update({n.output[0]: n.attribute[0].t for n in graph.node
                if n.op_type == "Constant" and n.domain in ("", "ai.onnx")
                and len(n.attribute) == 1 and n.attribute[0].name == "value"})
    return out


def taken_names(graph: onnx.GraphProto) -> set[str]:
    """The tensor and node names ``graph`` itself uses (inputs, outputs, initializers, node
    outputs and node names; not its subgraphs')."""
    names = {v.name for v in graph.input} | {v.name for v in graph.output}
    names |= {t.name for t in graph.initializer}
    for n in graph.node:
        names.update(n.output)
        names.add(n.name)
    return names


def unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2`` ..., whichever is not in ``taken`` (added to it)."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


# -- onnxruntime's own ops (rules/contrib.py, ort_internal.py) ------------------------------------
_STANDIN = "onnxgrad_standin/"
CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def ort_internal(n: onnx.NodeProto, opset: int) -> bool:
    """An op onnxruntime's optimizer writes into the ai.onnx domain, where no ONNX opset of the
    model has it: SimplifiedLayerNormalization, LayerNormalization before opset 17."""
    return n.domain in ("", "ai.onnx") and (
        n.op_type == "SimplifiedLayerNormalization" or (
            n.op_type == "LayerNormalization" and opset < 17))


def _needs_standin(n: onnx.NodeProto, opset: int) -> bool:
    return n.domain == "com.microsoft" or ort_internal(n, opset)


def _kinds(graphs: list) -> set:
    """The (domain, op_type) of every node of ``graphs``: one walk, for the questions that
    depend on the op alone (a pass over 100k NodeProtos costs 40 ms)."""
    return {(n.domain, n.op_type) for g in graphs for n in g.node}


# the ai.onnx ops with graph attributes (onnx.checker refuses an attribute a schema lacks)
WITH_SUBGRAPHS = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def _graphs_and_kinds(graph: onnx.GraphProto) -> tuple[list, set]:
    """(graphs_of(graph), their _kinds) in one walk, for a model onnx.checker passed: only
    the ai.onnx ops of WITH_SUBGRAPHS and ops of other domains are asked for subgraphs."""
    graphs, kinds = [graph], set()
    for n in graph.node:
        domain, op = n.domain, n.op_type
        kinds.add((domain, op))
        if op in WITH_SUBGRAPHS or (domain and domain != "ai.onnx"):
            for sub in node_subgraphs(n):
                more, their = _graphs_and_kinds(sub)
                graphs += more
                kinds |= their
    return graphs, kinds


def _any_standin(kinds: set, opset: int) -> bool:
    """Whether a node of one of these (domain, op_type) kinds needs a stand-in
    (:func:`_needs_standin`)."""
    return any(_needs_standin(onnx.NodeProto(domain=d, op_type=op), opset) for d, op in kinds)


def _standins(n: onnx.NodeProto, opset: int) -> list | None:
    """Standard nodes that make the outputs of onnxruntime op ``n`` (com.microsoft, or
    :func:`ort_internal`) with the same types and shapes (onnx's inference knows none of them),
    named ``_STANDIN``; None for other ops."""
    if not _needs_standin(n, opset):
        return None
    op, ins, outs = n.op_type, list(n.input), list(n.output)
    attrs = {a.name: a for a in n.attribute}
    made = []

    def node(op_type, inputs, out=None, **kw):
        out = out or f"{_STANDIN}{outs[0]}/{len(made)}"
        made.append(onnx.helper.make_node(op_type, list(inputs), [out],
                                          name=_STANDIN + (n.name or outs[0]), **kw))
        return out

    def flag(name):
        return name in attrs and attrs[name].i

    def operand(v, side):  # FusedMatMul's op(v): see rules/contrib.py
        t, tb = flag("trans" + side), flag("transBatch" + side)
        if not (t or tb):
            return v
        eq = ("i...j->..." if tb else "...ij->...") + ("ji" if t else "ij")
        return node("Einsum", [v], equation=eq)

    if op in ("Gelu", "QuickGelu") or (op == "FastGelu" and (len(ins) < 2 or not ins[1])):
        node("Identity", ins[:1], outs[0])
    elif op in ("FastGelu", "BiasGelu"):
        node("Add", ins[:2], outs[0])
    elif op == "FusedMatMul":
        node("MatMul", [operand(ins[0], "A"), operand(ins[1], "B")], outs[0])
    elif op in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization",
                "SimplifiedLayerNormalization", "LayerNormalization"):
        skip = op.startswith("Skip")
        s = node("Add", ins[:2]) if skip else ins[0]
        bias = ins[3 if op == "SkipSimplifiedLayerNormalization" else 4:][:1] if skip else []
        if bias and bias[0]:
            s = node("Add", [s, bias[0]])
        axis = attrs["axis"].i if "axis" in attrs else -1
        axes = list(range(axis, 0))  # (a statistic over axis >= 0 is left untyped)
        kw = {"axes": axes} if opset < 18 else {}
        last = [] if kw or not axes else [node("Constant", [], value=onnx.helper.make_tensor(
            "axes", onnx.TensorProto.INT64, [len(axes)], axes))]
        stats = (1, 2) if skip or op == "LayerNormalization" else (1,)
        for i, o in enumerate(outs):
            if o and i in stats and axes:  # float32, 1 along the axes, whatever x's dtype
                node("Cast", [node("ReduceMean", [s, *last], **kw)], o,
                     to=onnx.TensorProto.FLOAT)
            elif o and i not in stats:
                node("Identity", [s], o)
    elif op in ("FusedConv", "FusedGemm"):
        keep = CONV_ATTRS if op == "FusedConv" else ("alpha", "beta", "transA", "transB")
        std = onnx.helper.make_node(op[5:], ins[:3], outs[:1], name=_STANDIN + (n.name or outs[0]))
        std.attribute.extend(a for a in n.attribute if a.name in keep)
        made.append(std)
    elif op == "Attention":  # output: the V part of input @ weights, [B, S, v_hidden]
        qkv = node("MatMul", ins[:2])
        sizes = list(attrs["qkv_hidden_sizes"].ints) if "qkv_hidden_sizes" in attrs else None
        split = [node("Constant", [], value=onnx.helper.make_tensor(
            "sizes", onnx.TensorProto.INT64, [3], sizes))] if sizes else []
        kw = {"num_outputs": 3} if opset >= 18 and not sizes else {}
        parts = [f"{_STANDIN}{outs[0]}/{k}" for k in ("q", "k", "v")]
        made.append(onnx.helper.make_node("Split", [qkv, *split], parts, axis=-1,
                                          name=_STANDIN + (n.name or outs[0]), **kw))
        node("Identity", parts[2:], outs[0])
    elif op == "MultiHeadAttention":  # output [B, S, v_hidden]: from 3-D query and value;
        # packed KV (no value): [B, S, hidden]; other forms: onnx leaves the shape unknown
        value = ins[2] if len(ins) > 2 and ins[2] else ins[0]
        node("Einsum", [ins[0], value], outs[0], equation="bsd,btv->bsv")
    elif op == "EmbedLayerNormalization":  # output and embedding_sum: word_embedding[ids]
        for i in (0, 2):
            if i < len(outs) and outs[i]:
                node("Gather", [ins[2], ins[0]], outs[i])
        if len(outs) > 1 and outs[1]:  # mask_index: int32 [B]
            axes = [node("Constant", [], value=onnx.helper.make_tensor(
                "axes", onnx.TensorProto.INT64, [1], [1]))] if opset >= 13 else []
            total = node("ReduceSum", [ins[0], *axes], keepdims=0,
                         **({} if axes else {"axes": [1]}))
            node("Cast", [total], outs[1], to=onnx.TensorProto.INT32)
    else:
        return None
    return made


def _put_standins(m: onnx.ModelProto) -> list:
    """Each graph's com.microsoft nodes replaced by their stand-ins; returns, per graph, the
    original nodes in order (for :func:`_take_standins`)."""
    opset = model_opset(m)
    out = []
    for g in graphs_of(m.graph):
        nodes, originals = [], []
        for n in g.node:
            made = _standins(n, opset)
            if made is None:
                nodes.append(n)
            else:
                for s in made:  # which original a stand-in replaces
                    s.doc_string = str(len(originals))
                originals.append(n)
                nodes += made
        if originals:
            del g.node[:]
            g.node.extend(nodes)
        out.append(originals)
    return out


def _take_standins(m: onnx.ModelProto, originals: list) -> None:
    for g, orig in zip(graphs_of(m.graph), originals):
        if not orig:
            continue
        nodes, seen = [], set()
        for n in g.node:
            if not n.name.startswith(_STANDIN):
                nodes.append(n)
            elif n.doc_string not in seen:
                seen.add(n.doc_string)
                nodes.append(orig[int(n.doc_string)])
        del g.node[:]
        g.node.extend(nodes)
        vis = [vi for vi in g.value_info if not vi.name.startswith(_STANDIN)]
        del g.value_info[:]
        g.value_info.extend(vis)


def _onnx_infer(m: onnx.ModelProto, graphs: list | None = None, kinds: set | None = None,
                **kw) -> onnx.ModelProto:
    """onnx's inference (a new model) with outer Constants visible in bodies and onnxruntime's
    own ops typed by stand-ins; ``m`` is not changed. ``graphs``, ``kinds``: graphs_of(m.graph)
    and their _kinds, when the caller has them."""
    graphs = graphs_of(m.graph) if graphs is None else graphs
    kinds = _kinds(graphs) if kinds is None else kinds
    if not _any_standin(kinds, model_opset(m)):
        return _infer_standard(m, graphs, kinds, **kw)
    m = onnx.ModelProto.FromString(m.SerializeToString())
    originals = _put_standins(m)
    out = _infer_standard(m, **kw)
    _take_standins(out, originals)
    return out


def _infer_standard(m: onnx.ModelProto, graphs: list | None = None, kinds: set | None = None,
                    **kw) -> onnx.ModelProto:
    """``graphs``, ``kinds``: graphs_of(m.graph) and their _kinds, when the caller has them."""
    graphs = graphs_of(m.graph) if graphs is None else graphs
    if m.functions:
        bodies = [nodes for nodes, _ in bodies_of(m)]
        stft = "STFT" in {n.op_type for nodes in bodies for n in nodes}
    else:
        bodies = [g.node for g in graphs]
        stft = any(op == "STFT" for _, op in (_kinds(graphs) if kinds is None else kinds))
    stft = stft and any(_stft_without_onesided(n) for nodes in bodies for n in nodes)
    if not stft and len(graphs) == 1:  # (no node of the main graph has a subgraph)
        return onnx.shape_inference.infer_shapes(m, **kw)
    m = onnx.ModelProto.FromString(m.SerializeToString())
    for nodes, _ in bodies_of(m) if stft else ():  # (a call is typed by its body)
        for n in filter(_stft_without_onesided, nodes):
            n.attribute.append(onnx.helper.make_attribute("onesided", 1))
    _inline(m.graph.node, {o: n for n in m.graph.node if n.op_type == "Constant"
                           for o in n.output})
    m = onnx.shape_inference.infer_shapes(m, **kw)
    _strip(m.graph)
    return m


# -- declared types against inferred ones ----------------------------------------------------------
MADE_UP = "unk__"  # onnx's inference names a dim it cannot compute unk__0, unk__1, ...


def forget_made_up(entries) -> None:
    """Make the dims named by onnx's inference (unk__N) unknown, in place, in these
    ValueInfoProtos. Each inference run numbers them from 0 again, so one run's unk__1 is not
    another's; and onnxruntime takes equal names for equal sizes: a model declaring two runs'
    unk__1 made its planner share one buffer between tensors of different sizes."""
    for vi in entries:
        for d in _tensor_part(vi.type).tensor_type.shape.dim:
            if d.dim_param.startswith(MADE_UP):
                d.ClearField("dim_param")


def _tensor_part(t: TypeProto) -> TypeProto:
    """The tensor type inside sequences and optionals (t itself for a tensor)."""
    while t.HasField("sequence_type") or t.HasField("optional_type"):
        t = t.sequence_type.elem_type if t.HasField("sequence_type") else \
            t.optional_type.elem_type
    return t


def _dims(t: TypeProto):
    """(elem_type or 0, [int | str | None per dim] or None when the rank is unknown); the
    symbols onnx makes up for dims it cannot compute (unk__N) count as unknown."""
    tt = t.tensor_type
    shape = ([d.dim_value if d.HasField("dim_value") else
              (d.dim_param if d.dim_param and not d.dim_param.startswith(MADE_UP) else None)
              for d in tt.shape.dim] if tt.HasField("shape") else None)
    return tt.elem_type, shape


def _merge(declared: TypeProto, inferred: TypeProto | None, output: bool = False
           ) -> TypeProto | None:
    """What both say of one tensor, or None when they contradict (another rank, another static
    dim; for value_info also another element type). Where inference has a symbol, a declared
    static dim is not taken (the model's inputs say that dim may vary: baking the declared
    value in would be wrong for other sizes). A declared symbol fills an unknown dim only for
    a graph ``output``, the model's interface (elsewhere it would claim, unproven, that two dims
    are equal); an output's element type stands too (onnx and onnxruntime disagree on some,
    such as a float64 LayerNormalization's Mean). Non-tensor types: the inferred one wins."""
    if declared.WhichOneof("value") is None:
        return inferred
    if inferred is None or inferred.WhichOneof("value") is None:  # only what declared says
        inferred = TypeProto()
        inferred.CopyFrom(declared)
        if inferred.HasField("tensor_type"):
            inferred.tensor_type.ClearField("shape")
    if inferred.WhichOneof("value") != declared.WhichOneof("value"):
        return None
    merged = TypeProto()
    merged.CopyFrom(inferred)
    if merged.WhichOneof("value") != "tensor_type":
        return merged
    (de, ds), (ie, ish) = _dims(declared), _dims(inferred)
    if de and ie and de != ie and not output:
        return None
    merged.tensor_type.elem_type = (de or ie) if output else (ie or de)
    if ds is None:
        return merged
    if ish is None:
        ish = [None] * len(ds)
        merged.tensor_type.shape.dim.extend(TensorShapeProto.Dimension() for _ in ds)
    if len(ds) != len(ish):
        return None
    for md, d, i in zip(merged.tensor_type.shape.dim, ds, ish):
        if isinstance(d, int) and isinstance(i, int) and d != i:
            return None
        if isinstance(d, int) and i is None:
            md.dim_value = d
        elif isinstance(d, str) and i is None and output:
            md.dim_param = d
    return merged


def _adds(merged: TypeProto, inferred: TypeProto | None) -> bool:
    return inferred is None or merged != inferred


def _describe(t: TypeProto) -> str:
    if t.WhichOneof("value") != "tensor_type":
        return str(t.WhichOneof("value"))
    e, s = _dims(t)
    name = onnx.TensorProto.DataType.Name(e).lower() if e else "?"
    if s is None:
        return name
    return name + "[" + ", ".join("?" if d is None else str(d) for d in s) + "]"


# -- pools with ceil_mode ----------------------------------------------------------------------
def floor_pads(op_type: str, attrs: dict, spatial: list):
    """For a pool with ceil_mode=1 over the static spatial dims ``spatial`` whose last window
    starts in the end padding (onnx's shape inference keeps that window; onnxruntime,
    onnx.reference and PyTorch drop it): the pads under which the same pool without ceil_mode
    computes the same windows with the same divisors. None when no window is dropped, False
    when no such pads exist (an AveragePool with count_include_pad=1 whose other axis has a
    partial last window: :func:`rescaled_floor_pads`). ``attrs``: the node's attributes by
    name (auto_pad a str)."""
    geo = _ceil_geometry(attrs, spatial)
    if geo is None:
        return None
    pads, ends, _ = geo
    nsp = len(ends)
    counts_pads = op_type == "AveragePool" and attrs.get("count_include_pad", 0)
    if counts_pads and any(e > p for e, p in zip(ends, pads[nsp:])):
        return False  # a partial window's divisor would count the extra padding
    return pads[:nsp] + ends


def _ceil_geometry(attrs: dict, spatial: list):
    """(pads, the end pads that floor mode needs for the same windows, per axis the windows'
    starts) of a ceil_mode pool that drops a window (see :func:`floor_pads`), else None."""
    if not attrs.get("ceil_mode", 0) or attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    k = [int(i) for i in attrs["kernel_shape"]]
    nsp = len(k)
    s = [int(i) for i in attrs.get("strides") or [1] * nsp]
    d = [int(i) for i in attrs.get("dilations") or [1] * nsp]
    pads = [int(i) for i in attrs.get("pads") or [0] * 2 * nsp]
    if attrs.get("auto_pad", "NOTSET") == "VALID":
        pads = [0] * 2 * nsp
    ends, starts, dropped = [], [], False
    for i in range(nsp):
        dim, pb, pe, ek = spatial[i], pads[i], pads[nsp + i], d[i] * (k[i] - 1) + 1
        o = pool_out_len(dim, pb, pe, ek, s[i], True)
        dropped |= o != -(-(dim + pb + pe - ek) // s[i]) + 1
        ends.append(max(0, (o - 1) * s[i] + ek - dim - pb))  # floor mode then gives o windows
        starts.append([j * s[i] - pb for j in range(o)])
    return (pads, ends, starts) if dropped else None


def rescaled_floor_pads(attrs: dict, spatial: list):
    """Where :func:`floor_pads` finds no pads (an AveragePool with count_include_pad=1): the
    pads under which the same pool without ceil_mode and with count_include_pad=0 sums the
    same windows, and the factors [1, 1, *out] (a window's elements of x over its divisor
    with ceil_mode: the padding it covers up to the end pad, not beyond, as onnxruntime and
    PyTorch count it) that turn its averages into the pool's. None with dilations, or where a
    window holds no element of x."""
    geo = _ceil_geometry(attrs, spatial)
    if geo is None or any(int(i) != 1 for i in attrs.get("dilations") or []):
        return None
    pads, ends, starts = geo
    k = [int(i) for i in attrs["kernel_shape"]]
    nsp = len(k)
    factor = np.ones([1, 1] + [len(st) for st in starts])
    for i, st in enumerate(starts):
        st = np.array(st)
        real = np.minimum(st + k[i], spatial[i]) - np.maximum(st, 0)
        if real.min() <= 0:
            return None
        div = np.minimum(st + k[i], spatial[i] + pads[nsp + i]) - st
        factor = factor * (real / div).reshape([-1 if j == i + 2 else 1 for j in range(nsp + 2)])
    return pads[:nsp] + ends, factor


# ops whose outputs have the rank of input 0, but that onnx's shape inference leaves untyped
# unless their other inputs are constants (split sizes, axes, scales, a kernel's shape)
SAME_RANK = frozenset({"Split", "Resize", "DFT", "CenterCropPad", "MaxUnpool", "Conv",
                       "ConvTranspose", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin",
                       "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
                       "ReduceSumSquare"})
# ops whose output rank is a * (input 0's rank) + b * (the length of input 1): Unsqueeze and
# Squeeze with computed axes, Reshape with a computed shape
AXES_RANK = {"Unsqueeze": (1, 1), "Squeeze": (1, -1), "Reshape": (0, 1)}
# ops whose outputs' (rank, input whose dtype they take) are fixed (rank None: input 0's), which
# onnx leaves untyped when dims are symbolic: Attention's present_key, present_value and
# qk_matmul_output; STFT's [batch, frames, bins, 2]
OUTPUT_RANKS = {"Attention": ((None, 0), (4, 1), (4, 2), (4, 0)), "STFT": ((4, 0),)}


# the ops whose output ranks _rank_seeds may tell
_RANKED = frozenset({*SAME_RANK, *AXES_RANK, "Loop", *OUTPUT_RANKS})


def out_rank(op_type: str, keepdims: int, rank: int | None, len1: int | None) -> int | None:
    """The output rank of a SAME_RANK or AXES_RANK op whose input 0 has rank ``rank`` and whose
    input 1 has ``len1`` elements (None: unknown), or None when that does not tell it."""
    if op_type in SAME_RANK:
        return rank if keepdims and rank is not None else None
    a, b = AXES_RANK[op_type]
    if len1 is None or (a and rank is None):
        return None
    return a * (rank or 0) + b * len1


def value_types(graphs: list) -> dict:
    """{name: TypeProto} of the inputs, value_info, outputs and initializers of ``graphs``."""
    types = {}
    for g in graphs:
        types.update((vi.name, vi.type) for vi in [*g.input, *g.value_info, *g.output])
        types.update((t.name, onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)))
                     for t in g.initializer)
    return types


def _rank_seeds(graphs: list) -> list:
    """[(graph index, ValueInfoProto)]: the rank (dims unknown) of each output of a
    :data:`SAME_RANK` or :data:`AXES_RANK` op that inference left without one, where
    :func:`out_rank` tells it."""
    types, out = value_types(graphs), []
    for gi, g in enumerate(graphs):
        for n in g.node:
            if n.op_type == "Loop" and n.domain in ("", "ai.onnx"):
                out += [(gi, vi) for vi in _loop_ranks(n, types)]
                continue
            if n.op_type in OUTPUT_RANKS and n.domain in ("", "ai.onnx"):
                ins = [_dims(types[i]) if i in types else (0, None) for i in n.input]
                for o, (r, src) in zip(n.output, OUTPUT_RANKS[n.op_type]):
                    if r is None and ins[0][1] is not None:
                        r = len(ins[0][1])
                    elem = ins[src][0] if src < len(ins) else 0
                    if o and r and elem and (o not in types or _dims(types[o])[1] is None):
                        out.append((gi, onnx.helper.make_tensor_value_info(o, elem, [None] * r)))
                continue
            if (n.op_type not in SAME_RANK and n.op_type not in AXES_RANK) or n.domain not in (
                    "", "ai.onnx") or not n.input or n.input[0] not in types:
                continue
            elem, shape = _dims(types[n.input[0]])
            axes = _dims(types[n.input[1]])[1] if len(n.input) > 1 and n.input[1] in types else None
            keep = not any(a.name == "keepdims" and a.i == 0 for a in n.attribute)
            rank = out_rank(n.op_type, keep, None if shape is None else len(shape),
                            axes[0] if axes and isinstance(axes[0], int) else None)
            if rank is None or not elem:
                continue
            for o in n.output:
                t = types.get(o)
                if o and (t is None or _dims(t)[1] is None):
                    out.append((gi, onnx.helper.make_tensor_value_info(o, elem, [None] * rank)))
    return out


def _loop_ranks(n: onnx.NodeProto, types: dict) -> list:
    """ValueInfos giving a Loop's outputs their ranks where inference left them without: onnx
    drops the shape of every loop-carried output (it may change between iterations; validation
    refuses a Loop where it does), so a carried output has its initial value's rank, and a scan
    output one more than the body's output."""
    body = next(a.g for a in n.attribute if a.name == "body")
    carried = len(n.input) - 2
    out = []
    for i, o in enumerate(n.output):
        t = types.get(o)
        if not o or (t is not None and _dims(t)[1] is not None):
            continue
        src = types.get(n.input[2 + i]) if i < carried else (
            body.output[1 + i].type if 1 + i < len(body.output) else None)
        if src is None or src.WhichOneof("value") != "tensor_type":
            continue
        elem, shape = _dims(src)
        if elem and shape is not None:
            rank = len(shape) + (i >= carried)
            out.append(onnx.helper.make_tensor_value_info(o, elem, [None] * rank))
    return out


def _add_types(graphs: list, seeds: list) -> None:
    """Put the (graph index, ValueInfoProto) seeds in: a graph output without a shape takes its
    seed as its type (onnx reads no value_info entry for a graph output), others join value_info."""
    for gi, vi in seeds:
        out = next((o for o in graphs[gi].output if o.name == vi.name), None)
        if out is None:
            graphs[gi].value_info.append(vi)
        elif not out.type.tensor_type.HasField("shape"):
            out.type.CopyFrom(vi.type)


def infer_ranks(model: onnx.ModelProto, rounds: int = 4) -> onnx.ModelProto:
    """onnx's inference on ``model`` (a new model), with the ranks :func:`_rank_seeds` tells
    added where onnx finds none, a few rounds deep (for a model onnxgrad wrote itself: its
    declared types are its own)."""
    out = _onnx_infer(model)
    for _ in range(rounds):
        seeds = _rank_seeds(graphs_of(out.graph))
        if not seeds:
            break
        _add_types(graphs_of(out.graph), seeds)
        out = _onnx_infer(out)
    return out


def _has_ceil(n: onnx.NodeProto) -> bool:
    return n.op_type in _POOLS and any(a.name == "ceil_mode" and a.i for a in n.attribute)


def _stft_without_onesided(n: onnx.NodeProto) -> bool:
    return (n.op_type == "STFT" and n.domain in ("", "ai.onnx")
            and not any(a.name == "onesided" for a in n.attribute))


def _stft_default_inside(n: onnx.NodeProto, calls: set) -> bool:
    """``n`` is an STFT without onesided, holds one in a subgraph, or calls one of ``calls``
    (the model-local functions that do): onnx typed its outputs with the wrong default."""
    return _stft_without_onesided(n) or (n.domain, n.op_type, n.overload) in calls or (
        bool(n.attribute) and any(_stft_default_inside(c, calls)
                                  for sub in node_subgraphs(n) for c in sub.node))


def _functions_with_default_stft(m: onnx.ModelProto) -> set:
    """(domain, name, overload) of the model's functions that hold an STFT without onesided,
    or call one that does."""
    calls, grew = set(), True
    while grew:
        grew = False
        for f in m.functions:
            key = (f.domain, f.name, f.overload)
            if key not in calls and any(_stft_default_inside(n, calls) for n in f.node):
                calls.add(key)
                grew = True
    return calls


def _downstream(graph: onnx.GraphProto, names: set) -> set:
    """``names`` and every tensor of ``graph`` computed from them."""
    out = set(names)
    if out:
        for n in graph.node:  # topological order
            if out.intersection(n.input):
                out.update(n.output)
    return out


def _blind_ceil_pools(inferred: onnx.GraphProto) -> set:
    """The outputs of the ceil_mode pools (every graph) whose input's spatial dims onnx's
    inference leaves unknown, so that whether they drop a last window cannot be told."""
    types = value_types(graphs_of(inferred))
    out = set()
    for g in graphs_of(inferred):
        for n in g.node:
            if _has_ceil(n) and n.domain in ("", "ai.onnx") and n.input:
                _, shape = _dims(types[n.input[0]]) if n.input[0] in types else (None, None)
                if shape is None or not all(isinstance(x, int) for x in shape[2:]):
                    out.update(o for o in n.output if o)
    return out


def _forget_dims(graph: onnx.GraphProto, tainted: set) -> set:
    """Make the declared dims of ``tainted`` tensors, and of everything computed from them in
    ``graph``, unknown (the rank stays); returns those tensors' names."""
    late = _downstream(graph, tainted)
    for vi in list(graph.value_info) + list(graph.output):
        if vi.name in late and vi.type.tensor_type.HasField("shape"):
            for d in vi.type.tensor_type.shape.dim:
                d.Clear()
    return late


def _rewrite_ceil_pools(inferred: onnx.GraphProto, graph: onnx.GraphProto) -> set:
    """Give each pool with a window that onnx's inference keeps and the runtimes drop the
    equivalent pads without ceil_mode (in ``graph``, the uninferred copy of ``inferred``), so
    that onnx, onnxruntime's own static shapes and the runtimes agree. Only pools whose input
    dims are right: none computed from a pool rewritten in this pass, whose onnx dims are the
    wrong ones (a second pool sized from them computed other windows; the caller infers again
    and calls once more). Returns the outputs of the pools changed."""
    types = value_types(graphs_of(inferred))
    done, tainted = set(), set()  # tainted: dims that onnx got wrong, as far as this pass sees

    def walk(g: onnx.GraphProto, target: onnx.GraphProto) -> None:
        for n, node in zip(g.node, target.node):
            subs = list(zip(node_subgraphs(n), node_subgraphs(node))) if n.attribute else []
            before = len(done)
            for sub, tsub in subs:
                walk(sub, tsub)
            if len(done) > before or tainted.intersection(n.input) or (tainted and any(
                    tainted.intersection(names_read(sub)) for sub, _ in subs)):
                tainted.update(n.output)
                continue
            if not _has_ceil(n) or n.domain not in ("", "ai.onnx") or n.input[0] not in types:
                continue
            _, shape = _dims(types[n.input[0]])
            if shape is None or len(shape) < 3 or not all(isinstance(x, int) for x in shape[2:]):
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            if isinstance(attrs.get("auto_pad"), bytes):
                attrs["auto_pad"] = attrs["auto_pad"].decode()
            pads = floor_pads(n.op_type, attrs, shape[2:])
            factor = None
            if pads is False:  # count_include_pad=1: averages over x alone, rescaled
                pads, factor = rescaled_floor_pads(attrs, shape[2:]) or (None, None)
            if not pads:
                continue
            drop = ("ceil_mode", "pads", "auto_pad") + (("count_include_pad",) if factor is
                                                         not None else ())
            keep = [a for a in node.attribute if a.name not in drop]
            del node.attribute[:]
            node.attribute.extend(keep)
            node.attribute.append(onnx.helper.make_attribute("pads", pads))
            if factor is not None:
                rescale.append((target, node, factor, types[n.input[0]].tensor_type.elem_type))
            done.update(node.output)
            tainted.update(n.output)

    rescale = []
    walk(inferred, graph)
    if rescale:  # after the walk, which pairs the graphs' nodes by position
        taken = set().union(*map(taken_names, graphs_of(graph)))
        for target, node, factor, elem in rescale:
            y = node.output[0]
            avg, scale, mul = (unique_name(f"{y}_{tag}", taken)
                               for tag in ("over_x", "divisors", "rescaled"))
            node.output[0] = avg
            const = onnx.helper.make_node("Constant", [], [scale], name=scale,
                                          value=onnx.numpy_helper.from_array(factor.astype(
                                              onnx.helper.tensor_dtype_to_np_dtype(elem))))
            mul = onnx.helper.make_node("Mul", [avg, scale], [y], name=mul)
            nodes = list(target.node)
            at = nodes.index(node) + 1
            del target.node[:]
            target.node.extend(nodes[:at] + [const, mul] + nodes[at:])
    return done


def _crops(n: onnx.NodeProto) -> bool:
    return n.op_type == "ConvTranspose" and n.domain in ("", "ai.onnx") and \
        any(a.name == "output_shape" for a in n.attribute)


def _rewrite_conv_transpose_crops(inferred: onnx.GraphProto, graph: onnx.GraphProto) -> set:
    """Give each ConvTranspose whose ``output_shape`` crops its full output the equivalent
    ``pads`` (in ``graph``, the uninferred copy of ``inferred``): onnx's inference types the
    output of such a node [N, C] without its spatial dims, and the gradient built on that rank
    was an invalid model. Only nodes whose input and kernel spatial dims are static. Returns the
    outputs of the nodes changed."""
    types = value_types(graphs_of(inferred))
    done = set()

    def static(name):  # (the spatial dims: the batch and channels may be symbolic)
        _, shape = _dims(types[name]) if name in types else (None, None)
        return shape if shape is not None and all(isinstance(d, int) for d in shape[2:]) \
            else None

    def walk(g: onnx.GraphProto, target: onnx.GraphProto) -> None:
        for n, node in zip(g.node, target.node):
            for sub, tsub in zip(node_subgraphs(n), node_subgraphs(node)):
                walk(sub, tsub)
            if not _crops(n) or len(n.input) < 2:
                continue
            x, w = static(n.input[0]), static(n.input[1])
            if x is None or w is None or len(x) < 3:
                continue
            nsp = len(x) - 2
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            auto = attrs.get("auto_pad", b"NOTSET")
            auto = auto.decode() if isinstance(auto, bytes) else auto
            s = list(attrs.get("strides", [1] * nsp))
            d = list(attrs.get("dilations", [1] * nsp))
            extra = list(attrs.get("output_padding", [0] * nsp))
            full = [si * (xi - 1) + o + (k - 1) * di + 1
                    for si, xi, o, k, di in zip(s, x[2:], extra, w[2:], d)]
            total = [f - o for f, o in zip(full, list(attrs["output_shape"])[-nsp:])]
            if not any(t > 0 for t in total):
                continue  # (onnx types those)
            # a crop: SAME_UPPER keeps the start, the others the end (onnxruntime's, the
            # spec's); an output longer than the full one gets zeros at the end, which is
            # output_padding (up to stride - 1, onnxruntime's limit)
            begin = [0 if t < 0 else t // 2 if auto == "SAME_UPPER" else t - t // 2
                     for t in total]
            extra = [o + max(0, -t) for o, t in zip(extra, total)]
            keep = [a for a in node.attribute if a.name not in ("output_shape", "auto_pad",
                                                                  "pads", "output_padding")]
            del node.attribute[:]
            node.attribute.extend(keep)
            node.attribute.append(onnx.helper.make_attribute(
                "pads", begin + [max(0, t) - b for t, b in zip(total, begin)]))
            node.attribute.append(onnx.helper.make_attribute("output_padding", extra))
            done.update(o for o in node.output if o)

    walk(inferred, graph)
    return done


def infer_shapes(model: onnx.ModelProto, **kw) -> onnx.ModelProto:
    """A new model typed by onnx shape inference, as the module docstring describes. Raises
    InvalidModelError when inference contradicts the type declared for a graph output."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    # (the passes below skip what is absent; none changes which ops there are)
    graphs, kinds = _graphs_and_kinds(m.graph)
    ops = {op for _, op in kinds}
    calls = _functions_with_default_stft(m)
    for g in graphs if calls or "STFT" in ops else ():
        # what onnx inferred (and a model declares) with the wrong default
        _forget_dims(g, {o for n in g.node if _stft_default_inside(n, calls) for o in n.output})
    declared = [[onnx.ValueInfoProto.FromString(vi.SerializeToString()) for vi in g.value_info]
                for g in graphs]
    for g in graphs:
        del g.value_info[:]
    outputs = [onnx.TypeProto.FromString(o.type.SerializeToString()) for o in m.graph.output]
    for o in m.graph.output:
        o.ClearField("type")
    out = _onnx_infer(m, graphs, kinds, **kw)
    adopted = []  # the declared entries that inference does not contradict
    for gi, (g, vis) in enumerate(zip(graphs_of(out.graph) if any(declared) else (), declared)):
        inferred = {vi.name: vi.type for vi in g.value_info} if vis else {}
        made = {o for n in g.node for o in n.output} if vis else set()
        for vi in vis:
            if vi.name not in made:  # an entry for an input, initializer or nothing: not one
                continue             # for value_info to decide
            merged = _merge(vi.type, inferred.get(vi.name))
            if merged is not None and _adds(merged, inferred.get(vi.name)):
                adopted.append((gi, onnx.helper.make_value_info(vi.name, merged)))
    pools = sum(_has_ceil(n) for g in graphs for n in g.node) if not ops.isdisjoint(_POOLS) \
        else 0
    same_rank = sum(n.op_type in _RANKED for g in graphs for n in g.node) \
        if not ops.isdisjoint(_RANKED) else 0
    crops = sum(_crops(n) for g in graphs for n in g.node) if "ConvTranspose" in ops else 0
    # outputs of ceil_mode pools whose dims onnx got wrong (and declared so), and of those whose
    # input dims onnx cannot see: what a model declares downstream of them may be an
    # exporter's copy of onnx's dims (torch.onnx after a Resize whose scales it folded: the
    # output declared 5x5 where the runtimes compute 4x4), which no rewrite can check
    dropped = _blind_ceil_pools(out.graph) if pools else set()
    late = [_forget_dims(g, dropped) for g in graphs] if dropped else [set() for _ in graphs]
    adopted = [(gi, vi) for gi, vi in adopted if vi.name not in late[gi]]
    # integer shape arithmetic on constants that onnx does not follow (folding.py), once
    folded = [(0, vi) for vi in _folded_seeds(m, out)]
    # each pass may type inputs of further ones; a chain of ceil_mode pools takes a pass each
    for _ in range(max(min(pools + same_rank, 8), pools + crops) + 1):
        # (crops first: both pair the inferred graph's nodes with graphs[0]'s by position, and
        # a pool's rewrite may insert nodes; a crop's only changes attributes)
        changed = _rewrite_conv_transpose_crops(out.graph, graphs[0]) if crops else set()
        if pools:
            changed |= _rewrite_ceil_pools(out.graph, graphs[0])
        if changed:  # what was declared from onnx's dims is forgotten too (as for STFT)
            dropped |= changed
            late = [_forget_dims(g, dropped) for g in graphs]
            adopted = [(gi, vi) for gi, vi in adopted if vi.name not in late[gi]]
        seeds = adopted + folded + (_rank_seeds(graphs_of(out.graph)) if same_rank else [])
        adopted, folded = [], []
        _add_types(graphs, seeds)
        if not changed and not seeds:
            break
        out = _onnx_infer(m, graphs, kinds, **kw)
    for o, want in zip(out.graph.output, outputs):
        if o.name in late[0]:  # declared with onnx's dims of a ceil_mode pool: the rank stays
            for d in want.tensor_type.shape.dim:
                d.Clear()
        if not o.HasField("type"):
            o.type.CopyFrom(want)
            continue
        merged = _merge(want, o.type, output=True)
        if merged is None:
            raise InvalidModelError(
                f"the model declares graph output {o.name!r} as {_describe(want)}, but its "
                f"producer makes it {_describe(o.type)} (onnx shape inference). Where the "
                "declaration is wrong (an exporter's: torch.onnx's dynamo exporter declares "
                "cross_entropy(reduction='none') a scalar), clear it and give the model again: "
                f"next(o for o in model.graph.output if o.name == {o.name!r})"
                ".type.tensor_type.ClearField('shape')")
        o.type.CopyFrom(merged)
    if _may_hold_sequences(graphs, kinds, model_opset(m)):
        _forget_element_symbols(out)
    return out


def _folded_seeds(m: onnx.ModelProto, out: onnx.ModelProto) -> list:
    """folding.shape_seeds for ``m`` (``out``: inference's; none where every node output of
    the main graph has a shape)."""
    from .folding import shape_seeds
    return shape_seeds(m, value_types([out.graph]), model_opset(m))


def _may_hold_sequences(graphs: list, kinds: set, opset: int) -> bool:
    """Whether a value of ``graphs`` may be a sequence: a graph input of one (a subgraph's
    too), or an op whose schema may output one (an op of another domain may)."""
    return any(_may_make_sequence(d, op, opset) for d, op in kinds) or any(
        vi.type.WhichOneof("value") not in (None, "tensor_type", "sparse_tensor_type")
        for g in graphs for vi in g.input)


@functools.lru_cache(maxsize=None)
def _may_make_sequence(domain: str, op_type: str, opset: int) -> bool:
    if domain not in ("", "ai.onnx"):
        return True
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return True
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    return any(not t.startswith("tensor(") for o in schema.outputs
               for t in allowed.get(o.type_str, [o.type_str]))


def _forget_element_symbols(model: onnx.ModelProto) -> None:
    """onnx's inference gives a sequence one element shape: elements of different lengths (a
    SplitToSequence of [5, 3, 4]) share one made-up dim, unk__0, which every element read
    from it then carries. Equal names are equal sizes to onnxruntime (its planner shared a
    buffer between reads of 5 and 4 elements: the gradient model failed) and to the rules: such
    a symbol is made unknown wherever it appears."""
    graphs = graphs_of(model.graph)
    entries = [vi for g in graphs for vi in [*g.value_info, *g.output, *g.input]]
    shared = set()
    for vi in entries:
        if vi.type.HasField("sequence_type"):
            shared |= {d.dim_param for d in _tensor_part(vi.type).tensor_type.shape.dim
                       if d.dim_param.startswith(MADE_UP)}
    if not shared:
        return
    for vi in entries:
        for d in _tensor_part(vi.type).tensor_type.shape.dim:
            if d.dim_param in shared:
                d.ClearField("dim_param")
