"""Gradient rules for control flow: If, Loop, Scan.

Each rule clones the forward body into a new subgraph (recomputing one branch or one iteration),
seeds the cloned outputs with the incoming gradients, and lets the engine differentiate it
(``n.differentiate``), recursively through nested control flow.

- If: an If on the same condition whose branches return the gradients of the outer values the
  branches read (zeros where a branch does not use one).
- Loop: the forward Loop is augmented in place so that every iteration also emits, as scan outputs,
  its iteration number (so a condition-ended loop's trip count is known) and the loop-carried
  tensors the backward body reads at the start of the iteration. The backward Loop runs as many
  iterations in reverse, recomputes iteration t from the saved state, carries the gradients of
  loop-carried values (tensors and sequences) and sums the gradients of outer-scope values as
  extra loop-carried values. Only what the backward body really reads is saved: a loop that writes
  a sequence (a TensorArray) needs nothing saved for it, since SequenceInsert's gradient only reads
  the gradient sequence. A carried sequence the backward body does read (a TensorArray read and
  written in the loop, a stack pushed and popped) cannot be a scan output: the backward Loop
  carries it too, from its final value back, rebuilding the state at the start of each iteration
  by undoing the body's inserts and erases (their positions, and the elements an erase removed,
  are saved per iteration), as TF's stacks replay a while loop in reverse.
- Scan: the forward Scan also emits its state at the start of every iteration; the backward Scan
  runs over the saved states, the scan inputs and the scan outputs' gradients, each in the
  reverse of its forward direction, and emits the scan inputs' gradients along the same axes.
"""
from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
from onnx_ir._cloner import Cloner

from ..dim_classes import made_dims, unify
from ..emitter import V, compatible_dims, dims
from ..errors import NotDifferentiableError
from ..registry import Grads, register, subgraphs
from .sequence import captures, float_value, is_seq, norm_position, position, sop, zeros_for
from .shape import END, _scatter_add
from .shape import _i64 as _as_i64  # (this module's _i64 makes constants)

_INT64_MIN = np.iinfo(np.int64).min


# -- cloning bodies ---------------------------------------------------------------------------
def clone_into(e, body: ir.Graph, value_map: dict) -> dict:
    """Append copies of ``body``'s nodes to ``e.graph``, reading ``value_map[v]`` for each body input
    v (outer-scope values stay shared); every value gets a fresh name. Returns the value map (old
    value -> clone). A float body input's stop or prevent marks (the model's metadata) go to
    the value read for it, where the engine's sweep honours them."""
    vmap = dict(value_map)
    for v in body.inputs:
        if v in vmap and v.meta and float_value(v):
            vmap[v].meta.update({k: m for k, m in v.meta.items() if k.startswith("onnxgrad.")})
    for init in body.initializers.values():  # typed: a float64 initializer stays float64
        arr = init.const_value.numpy()
        vmap[init] = e.const(arr, init.dtype).value
        if vmap[init].shape is None:  # (the emitter keeps its values' shapes apart: the rules
            vmap[init].shape = ir.Shape(arr.shape)  # read a clone's from the value)
    cloner = Cloner(attr_map={}, value_map=vmap, metadata_props={}, allow_outer_scope_values=True)
    for node in body:
        new = cloner.clone_node(node)
        new.name = e.unique(f"{e.prefix}/{node.name or node.op_type}")
        _rename(e, new)
        e.graph.append(new)
    return vmap


def _rename(e, node: ir.Node):
    for out in node.outputs:
        out.name = e.unique(f"{e.prefix}/{out.name or 'v'}")
    for g in subgraphs(node):
        for v in g.inputs:
            v.name = e.unique(f"{e.prefix}/{v.name or 'in'}")
        for inner in g:
            inner.name = e.unique(f"{e.prefix}/{inner.name or inner.op_type}")
            _rename(e, inner)


def finish_body(e, graph: ir.Graph, outs: list[V], likes=None) -> None:
    """Make ``outs`` the outputs of ``graph`` (through Identity where a value is not produced inside
    it, or appears twice), then drop the nodes nothing uses. An output of unknown shape takes
    that of its entry in ``likes`` (the value it is the gradient of): onnxruntime runs a Scan
    only when its body's outputs have shapes, and a gradient of this body needs the ranks."""
    seen = set()
    for o, like in zip(outs, likes or [None] * len(outs)):
        v = o.value
        if (v.producer() is None or v.producer().graph is not graph or v in seen
                or v.is_graph_output()):
            v = e.op("Identity", o, _dtype=o.dtype).value
            v.type = o.value.type
        if v.shape is None and like is not None and like.shape is not None:
            v.shape = like.shape
        seen.add(v)
        graph.outputs.append(v)
    dce(graph)


def dce(graph: ir.Graph) -> None:
    for node in reversed(list(graph)):
        if all(not v.uses() and not v.is_graph_output() for v in node.outputs):
            graph.remove(node, safe=True)


def connected(n, body: ir.Graph, needed, candidates, pairs=None) -> set:
    """The candidates (``body``'s inputs, values it reads from outside) that reach one of the
    ``needed`` body outputs (those with a gradient) in some iteration: ``pairs`` maps a carried
    body input to the body output the next iteration reads it from, which a reached input makes
    needed. The gradient of any other is None (ys do not depend on it), as outside a loop: a
    zero would be "connected" to the caller (an optimizer's weight decay moves it)."""
    reach = {v: n.reached(body, v) for v in candidates}
    needed, hit, grew = set(needed), set(), True
    while grew:
        grew = False
        for v, live in reach.items():
            if v not in hit and not live.isdisjoint(needed):
                hit.add(v)
                grew = True
                if pairs and v in pairs:
                    needed.add(pairs[v])
    return hit


def _typed(name, like: ir.Value) -> ir.Value:
    return ir.Value(name=name, type=like.type, shape=like.shape)


def _scalar(e, name, dtype) -> ir.Value:
    return ir.Value(name=e.unique(name), type=ir.TensorType(dtype), shape=ir.Shape([]))


def _i64(e, x):
    return e.const(np.array(x, np.int64))


# -- If ---------------------------------------------------------------------------------------
@register("If")
def _if(n, g):
    e, node = n.e, n.node
    caps = captures(n)
    built = {}
    for key in ("then_branch", "else_branch") if caps else ():
        body = node.attributes[key].value
        bb = ir.Graph([], [], nodes=[], name=e.unique(f"{e.prefix}/{key}"))
        be = e.child(bb, f"{e.prefix}/{key}")
        vmap = clone_into(be, body, {})
        seeds = {}
        for o, gi in zip(body.outputs, n.gs):
            if gi is not None and float_value(o):
                seeds.setdefault(vmap.get(o, o), []).append(V(gi.value, be, gi.dtype, gi.shape))
        built[key] = (bb, be, n.differentiate(bb, seeds, caps, be))
    # (a value neither branch's gradient reaches gets None, not zeros from both)
    hit = [i for i in range(len(caps)) if any(res[i] is not None for *_, res in built.values())]
    if not hit:
        return None
    caps = [caps[i] for i in hit]
    branches = {}
    for key, (bb, be, res) in built.items():
        outs = [res[i] if res[i] is not None else zeros_for(be, V(c, be))
                for i, c in zip(hit, caps)]
        finish_body(be, bb, outs, caps)
        branches[key] = bb
    out = e.op("If", n.ins[0], _outputs=len(caps), **branches,
               _dtype=[c.dtype for c in caps])
    out = out if isinstance(out, tuple) else (out,)
    for o, c in zip(out, caps):
        o.value.type = c.type
    return Grads((None,), {c: V(o.value, e, c.dtype, None) for o, c in zip(out, caps)})


# -- Loop -------------------------------------------------------------------------------------
def _augment(e, node: ir.Node, body: ir.Graph, values: list[ir.Value], label: str) -> list[V]:
    """Make the forward node also emit each of ``values`` (body values) as a scan output."""
    fe = e.child(body, f"{e.scope}/{node.name or node.op_type}_fwd")
    k = len(node.outputs)
    for v in values:
        body.outputs.append(fe.op("Identity", V(v, fe), _dtype=v.dtype).value)
        body.outputs[-1].type = v.type
    node.resize_outputs(k + len(values))
    outs = []
    for v, o in zip(values, node.outputs[k:]):
        o.name = e.unique(f"{e.scope}/{node.name or node.op_type}_{label}")
        o.type = v.type
        outs.append(V(o, e, v.dtype, None))
    return outs


@register("Loop")
def _loop(n, g):
    e, node = n.e, n.node
    body = node.attributes["body"].value
    nv = len(node.inputs) - 2
    b_iter, b_cond, b_vin = body.inputs[0], body.inputs[1], list(body.inputs[2:])
    b_vout, b_scan = list(body.outputs[1:1 + nv]), list(body.outputs[1 + nv:])
    n_scan = len(b_scan)
    gs_final, gs_scan = n.gs[:nv], n.gs[nv:nv + n_scan]
    caps = captures(n)
    # outer tensors the body reads one row of per iteration (a TensorArray's elements): their
    # rows' gradients are scan outputs, scattered into place once after the loop
    rows = _row_reads(e, body, caps)
    caps = [c for c in caps if c not in rows]
    carried = [j for j in range(nv) if float_value(node.inputs[2 + j])]
    for j in range(nv):
        _same_shape_each_iteration(n, [node.inputs[2 + j], b_vin[j], b_vout[j], node.outputs[j]])
    hit = connected(n, body, [b_vout[j] for j in carried if gs_final[j] is not None] +
                    [o for o, gi in zip(b_scan, gs_scan) if gi is not None],
                    [*(b_vin[j] for j in carried), *caps, *rows],
                    {b_vin[j]: b_vout[j] for j in carried})

    # the iteration count, from a saved iteration number (known after the forward ran)
    (iters,) = _augment(e, node, body, [b_iter], "iters")
    trips = e.Size(iters)
    last = trips - _i64(e, 1)

    # the backward body: k, cond, gradients of the carried values, sums for captured values
    b_k = _scalar(e, f"{e.prefix}/k", ir.DataType.INT64)
    b_c = _scalar(e, f"{e.prefix}/cond", ir.DataType.BOOL)
    g_in = [_typed(e.unique(f"{e.prefix}/g_{b_vin[j].name}"), b_vin[j]) for j in carried]
    acc_in = [_typed(e.unique(f"{e.prefix}/acc_{c.name}"), c) for c in caps]
    for v, c in zip(acc_in, caps):
        v.shape = c.shape
    bb = ir.Graph([b_k, b_c, *g_in, *acc_in], [], nodes=[], name=e.unique(f"{e.prefix}/body"))
    be = e.child(bb, f"{e.prefix}/body")
    ph_t = _scalar(e, f"{e.prefix}/t", ir.DataType.INT64)  # forward iteration T-1-k
    ph = [_typed(e.unique(f"{e.prefix}/state_{v.name}"), v) for v in b_vin]
    # the body's iteration number and condition as it declares them: TorchScript's are [1]
    # (values computed from a scalar there contradicted the shapes the clones keep)
    it, cond_in = V(ph_t, be), np.array(True)
    if b_iter.shape is not None and len(b_iter.shape) == 1:
        it = be.Reshape(it, [1])
    if b_cond.shape is not None and len(b_cond.shape) == 1:
        cond_in = np.array([True])
    vmap = clone_into(be, body, {b_iter: it.value, b_cond: be.const(cond_in).value,
                                 **dict(zip(b_vin, ph))})
    clones = set(bb)
    # a carried tensor of one shape every iteration (guarded) gives the recomputed iteration's
    # dims their sizes: no sums over axes at run time where they are one size
    axes = {j: _guardable(node.inputs[2 + j], b_vout[j]) for j in carried
            if b_vout[j] is not b_vin[j]}
    axes = {j: k for j, k in axes.items() if k is not None}
    same = [(ph[j], v) for j in axes for v in (vmap.get(b_vout[j], b_vout[j]), node.inputs[2 + j])]
    made = [((node.inputs[2 + j], i), d) for j in axes for i, d in made_dims(node.inputs[2 + j])]
    invariant = unify(bb, same, mutable=[*ph, *(o for nd in bb for o in nd.outputs)],
                      prefix=f"{e.prefix}/dim", dims_equal=made)
    _guard(e, node, body, axes)
    seeds = {}
    for j, gv in zip(carried, g_in):
        seeds.setdefault(vmap.get(b_vout[j], b_vout[j]), []).append(V(gv, be))
    for o, gi in zip(b_scan, gs_scan):
        if gi is not None and float_value(o):
            gt = be.Gather(V(gi.value, be, gi.dtype, None), V(ph_t, be), axis=0)
            seeds.setdefault(vmap.get(o, o), []).append(gt)
    reads = [(c, vmap[gn.outputs[0]], vmap.get(gn.inputs[1], gn.inputs[1]))
             for c, gns in rows.items() for gn in gns]
    xs = [ph[j] for j in carried] + caps + [r for _, r, _ in reads]
    res = n.differentiate(bb, seeds, xs, be)
    outs = [be.const(np.array(True))]
    outs += [r if r is not None else zeros_for(be, V(ph[j], be)) for r, j in zip(res, carried)]
    for a, r in zip(acc_in, res[len(carried):len(carried) + len(caps)]):
        a = V(a, be)
        outs.append(a if r is None else _add(be, a, r))
    reads = [(c, g, V(i, be)) for (c, _, i), g in zip(reads, res[len(carried) + len(caps):])
             if g is not None]
    n_loop = len(outs)
    outs += [x for _, g, i in reads for x in (g, i)]
    finish_body(be, bb, outs, [b_c] + [ph[j] for j in carried] + acc_in + [None] * len(reads) * 2)
    _keep(e, be, node, body, bb, clones, invariant, {c: o for o, c in vmap.items()}, ph_t)

    # save what the backward body reads of the state at the start of each iteration: tensors
    # as scan outputs; a carried sequence is rebuilt instead, iteration by iteration in reverse
    # from its final value, by undoing the body's inserts and erases (see _undo_log)
    need = [j for j in range(nv) if ph[j].uses()]
    seqs = [j for j in need if is_seq(b_vin[j])]
    need = [j for j in need if j not in seqs]
    chains = {j: _seq_chain(body, b_vin[j], b_vout[j]) for j in seqs}
    for j, chain in chains.items():
        if chain is None:
            raise NotDifferentiableError(
                "Loop", node.domain, n.opset, node.name,
                [f"(the backward loop reads the carried sequence {b_vin[j].name!r}, which the "
                 "body changes by other ops than SequenceInsert and SequenceErase: its state "
                 "at each iteration cannot be rebuilt)"])
    saved = _augment(e, node, body, [b_vin[j] for j in need], "saved")
    logs = {j: _undo_log(e, node, body, chains[j]) for j in seqs}
    be.prefix = f"{e.prefix}/body"
    for j, s in zip(need, saved):
        got = be.Gather(V(s.value, be, s.dtype, None), V(ph_t, be), axis=0)
        ph[j].replace_all_uses_with(got.value)
    for j in seqs:  # carried: the state at the end of forward iteration t -> at its start
        end = _typed(e.unique(f"{e.prefix}/end_{b_vin[j].name}"), b_vin[j])
        bb.inputs.append(end)
        start = _rebuild(be, chains[j], logs[j], V(ph_t, be), V(end, be))
        ph[j].replace_all_uses_with(start.value)
        if start.value is end:
            start = sop(be, "Identity", start)
        bb.outputs.append(start.value)
    # the rows' gradients and indices are scan outputs: after every carried value
    per_row = list(bb.outputs)[n_loop:n_loop + 2 * len(reads)]
    bb.outputs[n_loop:] = list(bb.outputs)[n_loop + len(per_row):] + per_row
    if ph_t.uses():
        t = V(last.value, be, last.dtype, ()) - V(b_k, be)
        ph_t.replace_all_uses_with(t.value)
    bb.sort()

    inits = []
    for j, gj in zip(carried, (gs_final[j] for j in carried)):
        inits.append(gj if gj is not None else zeros_for(e, n.outs[j]))
    inits += [zeros_for(e, V(c, e)) for c in caps]
    inits += [n.outs[j] for j in seqs]  # rebuilt backwards from the final state
    outs = e.op("Loop", trips, None, *inits, body=bb, _outputs=len(inits) + len(per_row),
                _dtype=[v.dtype for v in inits] + [v.dtype for v in per_row])
    outs = outs if isinstance(outs, tuple) else (outs,)
    for o, v in zip(outs, inits):
        o.value.type = v.value.type
    # with no iteration, the output is the initial value: connected, unless it surely runs
    trip, cond = n.const(0), None if _input(node, 1) is None else n.const(1)
    one = lambda a: np.asarray(a).reshape(-1)[0] if np.size(a) == 1 else None  # noqa: E731
    runs = trip is not None and one(trip) is not None and one(trip) >= 1 and (
        _input(node, 1) is None or cond is not None and bool(one(cond)))
    per_input = [None] * len(node.inputs)
    for k, j in enumerate(carried):
        if gs_final[j] is not None and not runs or b_vin[j] in hit:
            per_input[2 + j] = outs[k]
    grads = {c: o for c, o in zip(caps, outs[len(carried):len(inits)]) if c in hit}
    stacks = outs[len(inits):]
    for (c, _, _), g, i in zip(reads, stacks[0::2], stacks[1::2]):
        c = V(c, e)
        g = e.Reshape(g, e.Concat([-1], e.Slice(e.Shape(c), [1], [END]), axis=0))  # ([0]: none)
        got = _scatter_add(n, "ScatterND", c, e.Unsqueeze(_as_i64(n, i), [-1]), g)
        grads[c.value] = got if c.value not in grads else _add(e, grads[c.value], got)
    for c in rows:  # read, and reached, but no row's gradient made (stopped): zeros
        if c in hit:
            grads.setdefault(c, zeros_for(e, V(c, e)))
    return Grads(per_input, grads)


def _row_reads(e, body: ir.Graph, caps: list) -> dict:
    """The captured float32/64 tensors whose only reads in ``body`` are Gathers of one row
    (axis 0, a scalar index): capture -> those Gathers. Their gradient summed in the backward
    loop would add a tensor of their whole shape per iteration (quadratic in the trip count);
    the rows' gradients scattered after it (ScatterND's reduction, opset 16) are linear."""
    if e.opset < 16:
        return {}
    inside = set(ir.traversal.RecursiveGraphIterator(body))
    out = {}
    for c in caps:
        if c.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE) or not isinstance(
                c.type, ir.TensorType):
            continue
        uses = [u for u, _ in c.uses() if u in inside]
        if uses and all(u.graph is body and u.op_type == "Gather" and u.domain in ("", "ai.onnx")
                        and u.inputs[0] is c and u.inputs[1] is not c
                        and _axis0(u, c) and dims(u.inputs[1]) == () for u in uses):
            out[c] = uses
    return out


def _axis0(node: ir.Node, x: ir.Value) -> bool:
    a = node.attributes.get_int("axis", 0)
    return a == 0 or x.shape is not None and a == -len(x.shape)


# ops whose outputs the backward body recomputes rather than saves: they move or index data
_RECOMPUTED = frozenset({
    "Constant", "Shape", "Size", "Identity", "Gather", "Reshape", "Squeeze", "Unsqueeze",
    "Slice", "Cast", "Transpose", "Flatten", "Expand", "ConstantOfShape", "Range", "Split",
    "Concat"})


def _keep(e, be, node, body, bb, clones, invariant, originals, ph_t) -> None:
    """Save, as scan outputs of the forward Loop, the values of the recomputed iteration that the
    backward body's gradient nodes read, where each is computed (not moved) and has the same
    shape in every iteration (its dims ints or ``invariant``: an outer value's); the gradient
    nodes read them back instead, and the recompute they needed goes. (An output a nested rule
    added to a recomputed node, such as an inner Loop's saved states, has no forward value.)"""
    kept = []
    for nd in bb:  # (a value only a Shape reads is recomputed: saving it would copy it all)
        for v in () if nd in clones or nd.op_type in ("Shape", "Size") else nd.inputs:
            p = None if v is None else v.producer()
            if p is None or p not in clones or v not in originals or v in kept or \
                    p.op_type in _RECOMPUTED or p.domain not in ("", "ai.onnx") or \
                    not isinstance(v.type, ir.TensorType):
                continue
            ds = dims(v)
            if ds is not None and all(isinstance(d, int) or d in invariant for d in ds):
                kept.append(v)
    if not kept:
        return
    stacks = _augment(e, node, body, [originals[v] for v in kept], "kept")
    for v, s in zip(kept, stacks):
        got = be.Gather(V(s.value, be, s.dtype, None), V(ph_t, be), axis=0)
        got.value.shape = v.shape
        for user, i in list(v.uses()):
            if user not in clones and user.graph is bb:
                user.replace_input_with(i, got.value)
    dce(bb)


def _guardable(init: ir.Value, out: ir.Value) -> int | None:
    """The axis of the one unknown dim of body output ``out`` (a carried tensor whose initial
    value is ``init``) when out's other dims are positive ints and init's are the same, or init
    has rank 2 or less: then one element count means one shape, which :func:`_guard` checks.
    -1 when both shapes are the same ints (nothing to check); None otherwise."""
    if init is None or not all(isinstance(v.type, ir.TensorType) for v in (init, out)):
        return None
    a, b = dims(init), dims(out)
    if a is None or b is None or len(a) != len(b):
        return None
    unknown = [i for i, d in enumerate(b) if not isinstance(d, int)]
    if not unknown and a == b:
        return -1
    if len(unknown) != 1 or any(isinstance(d, int) and d <= 0 for d in b):
        return None
    k = unknown[0]
    same = all(x == y for i, (x, y) in enumerate(zip(a, b)) if i != k)
    return k if same or len(b) <= 2 else None


def _guard(e, node: ir.Node, body: ir.Graph, axes: dict[int, int]) -> None:
    """Hold each of these carried tensors (j -> its unknown axis) to its initial value's shape,
    which must have the body output's ints on the other axes (checked once, before the Loop,
    where they are not known: a tensor as long as the other axis, reshaped to its int): each
    iteration's output is reshaped to that shape, which fails on another element count, the
    unknown dim's only other value. Every iteration's shape is then the initial value's, as the
    backward body's dims (:func:`unify`) assume; the forward's values do not change."""
    f, fe = e.scratch("_guard"), e.child(body, f"{e.scope}/{node.name or node.op_type}_fwd")
    for j, k in axes.items():
        if k < 0:
            continue
        init, b_in, b_out = node.inputs[2 + j], body.inputs[2 + j], body.outputs[1 + j]
        want, have = dims(b_out), dims(init)
        shape = f.op("Shape", V(init, f))
        named = f"{e.prefix}/loop_carried_{b_in.name}"  # (onnxruntime's errors name the nodes)
        if any(have[i] != want[i] for i in range(len(want)) if i != k):  # rank 2
            o = 1 - k
            width = f.op("Reshape", f.op("ConstantOfShape", f.op("Slice", shape, [o], [o + 1])),
                         [want[o]])
            width.value.producer().name = e.unique(f"{named}_has_{want[o]}_on_axis_{o}")
            parts = [f.op("Slice", shape, [k], [k + 1]), f.op("Shape", width)]
            shape = f.op("Concat", *(parts if k == 0 else parts[::-1]), axis=0)
        kept = fe.op("Reshape", V(b_out, fe), shape)
        kept.value.producer().name = e.unique(f"{named}_keeps_its_shape_each_iteration")
        kept.value.type, kept.value.shape = b_out.type, b_out.shape
        body.outputs[1 + j] = kept.value
    e.put_before(node, f)


def _same_shape_each_iteration(n, values) -> None:
    """Refuse a loop-carried tensor whose shape changes between iterations (the saved states are
    scan outputs, which must all have one shape), where the known shapes of its initial value,
    the body's input and output and the loop's output show it: another rank or static dim."""
    b_in, b_out = values[1], values[2]
    grow = float_value(b_in) and b_out is not None and b_out.producer() is not None and \
        b_out.producer().op_type == "Concat" and b_in in b_out.producer().inputs
    if grow:  # (torch.cat onto an accumulator, shapes undeclared, as TorchScript writes it)
        raise NotDifferentiableError(
            "Loop", n.node.domain, n.opset, n.node.name, [],
            reason=f"the loop-carried tensor {b_in.name!r} changes shape between iterations "
                   "(the body concatenates onto it), which is not supported")
    shapes = [dims(v) for v in values if v is not None and isinstance(v.type, ir.TensorType)]
    shapes = [s for s in shapes if s is not None]
    for a, b in itertools.combinations(shapes, 2):
        if not compatible_dims(a, b):
            raise NotDifferentiableError(
                "Loop", n.node.domain, n.opset, n.node.name, [],
                reason=f"the loop-carried tensor {values[1].name!r} changes shape between "
                       f"iterations ({list(a)} -> {list(b)}), which is not supported")


# -- carried sequences, rebuilt in reverse -------------------------------------------------------
def _seq_chain(body: ir.Graph, v_in: ir.Value, v_out: ir.Value) -> list[ir.Node] | None:
    """The body nodes that turn carried sequence ``v_in`` into ``v_out``, in order, when each is
    a SequenceInsert, SequenceErase, Identity or appending Loop of the state before it (a
    TensorArray's reads, writes, pushes and pops, a list grown to an index); None when the state
    changes in another way."""
    chain, v = [], v_out
    while v is not v_in:
        p = v.producer()
        if p is None or p.graph is not body or not (p.op_type in _CHAIN_OPS or _appends(p)):
            return None
        chain.append(p)
        v = p.inputs[2] if p.op_type == "Loop" else p.inputs[0]
    return chain[::-1]


_CHAIN_OPS = ("SequenceInsert", "SequenceErase", "Identity")


def _appends(node: ir.Node) -> bool:
    """A Loop whose one carried value is a sequence that its body only appends to."""
    if node.op_type != "Loop" or len(node.inputs) != 3 or len(node.outputs) != 1:
        return False
    body = node.attributes["body"].value
    if len(body.inputs) != 3 or len(body.outputs) != 2:
        return False
    p = body.outputs[1].producer()
    return (p is not None and p.op_type == "SequenceInsert" and _input(p, 2) is None
            and p.inputs[0] is body.inputs[2])


def _undo_log(e, node: ir.Node, body: ir.Graph, chain: list[ir.Node]) -> list[tuple]:
    """Per chain node, what undoing it takes, saved per iteration as scan outputs of the forward
    Loop: an insert's position made non-negative (undone by erasing there), an erase's position
    and the element it removed (put back there), an appending Loop's starting length (undone by
    erasing from the end down to it). One tuple of saved values per node."""
    fe = e.child(body, f"{e.scope}/{node.name or node.op_type}_fwd", outer_consts=False)
    per_node = []
    for op in chain:
        if op.op_type == "Identity":
            per_node.append(())
            continue
        s = V(op.inputs[2] if op.op_type == "Loop" else op.inputs[0], fe)
        length = fe.SequenceLength(s, _dtype=ir.DataType.INT64)
        if op.op_type == "Loop":
            per_node.append((length,))
            continue
        insert = op.op_type == "SequenceInsert"
        p = _input(op, 2 if insert else 1)
        if p is None:  # the end: appended there / the last one erased
            pos = length if insert else length - _i64(fe, 1)
        else:
            pos = norm_position(fe, position(fe, V(p, fe)), length)
        per_node.append((pos,) if insert else (pos, fe.SequenceAt(s, pos, _dtype=s.dtype)))
    flat = _augment(e, node, body, [v.value for vals in per_node for v in vals], "undo")
    out, k = [], 0
    for vals in per_node:
        out.append(tuple(flat[k:k + len(vals)]))
        k += len(vals)
    return out


def _rebuild(be, chain: list[ir.Node], log: list[tuple], t: V, s: V) -> V:
    """The carried sequence at the start of forward iteration ``t``, from ``s``, its state at
    the end: the chain undone from the last node back."""
    for op, saved in reversed(list(zip(chain, log))):
        if not saved:
            continue
        at = [be.Gather(V(v.value, be, v.dtype, None), t, axis=0) for v in saved]
        if op.op_type == "SequenceInsert":
            s = sop(be, "SequenceErase", s, at[0], _dtype=s.dtype)
        elif op.op_type == "SequenceErase":
            s = sop(be, "SequenceInsert", s, at[1], at[0], _dtype=s.dtype)
        else:
            s = _erase_last(be, s, be.SequenceLength(s, _dtype=ir.DataType.INT64) - at[0])
    return s


def _erase_last(e, s: V, count: V) -> V:
    """``s`` without its last ``count`` elements (a Loop of SequenceErase)."""
    k, c = _scalar(e, f"{e.prefix}/k", ir.DataType.INT64), _scalar(e, f"{e.prefix}/c",
                                                                    ir.DataType.BOOL)
    si = ir.Value(name=e.unique(f"{e.prefix}/s"), type=s.value.type)
    g = ir.Graph([k, c, si], [], nodes=[], name=e.unique(f"{e.prefix}/erase_last"))
    ge = e.child(g, f"{e.prefix}/erase_last")
    g.outputs.extend([ge.op("Identity", V(c, ge)).value,
                      sop(ge, "SequenceErase", V(si, ge), _dtype=s.dtype).value])
    return sop(e, "Loop", count, None, s, body=g, _dtype=s.dtype)


def _input(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if len(node.inputs) > i else None


def _add(e, a: V, b: V) -> V:
    if is_seq(a):
        from .sequence import seq_add
        return seq_add(e, a, b)
    return a + b


# -- Scan -------------------------------------------------------------------------------------
@register("Scan", since=9)
def _scan(n, g):
    e, node = n.e, n.node
    body = node.attributes["body"].value
    m = n.attr("num_scan_inputs")
    ns = len(node.inputs) - m
    nso = len(body.outputs) - ns
    in_axes = n.attr("scan_input_axes") or [0] * m
    in_dirs = n.attr("scan_input_directions") or [0] * m
    out_axes = n.attr("scan_output_axes") or [0] * nso
    out_dirs = n.attr("scan_output_directions") or [0] * nso
    b_sin, b_xin = list(body.inputs[:ns]), list(body.inputs[ns:])
    b_sout, b_yout = list(body.outputs[:ns]), list(body.outputs[ns:])
    for v, outer in zip(b_sin + b_xin, node.inputs):  # function bodies may leave them untyped
        if v.type is None and outer is not None and isinstance(outer.type, ir.TensorType):
            v.type = ir.TensorType(outer.dtype)
    caps = captures(n, sequences=False)
    carried = [j for j in range(ns) if float_value(b_sin[j])]
    want_x = [i for i in range(m) if float_value(node.inputs[ns + i]) and n.wants(node.inputs[ns + i])]
    hit = connected(n, body, [b_sout[j] for j in carried if n.gs[j] is not None] +
                    [o for o, gi in zip(b_yout, n.gs[ns:]) if gi is not None],
                    [*(b_sin[j] for j in carried), *caps, *(b_xin[i] for i in want_x)],
                    {b_sin[j]: b_sout[j] for j in carried})

    g_in = [_typed(e.unique(f"{e.prefix}/g_{b_sin[j].name}"), b_sin[j]) for j in carried]
    acc_in = [_typed(e.unique(f"{e.prefix}/acc_{c.name}"), c) for c in caps]
    ph_s = [_typed(e.unique(f"{e.prefix}/state_{v.name}"), v) for v in b_sin]
    ph_x = [_typed(e.unique(f"{e.prefix}/x_{v.name}"), v) for v in b_xin]
    ph_gy = [None if gi is None or not float_value(o) else
             _typed(e.unique(f"{e.prefix}/gy_{o.name}"), o) for o, gi in zip(b_yout, n.gs[ns:])]
    bb = ir.Graph([*g_in, *acc_in], [], nodes=[], name=e.unique(f"{e.prefix}/body"))
    be = e.child(bb, f"{e.prefix}/body")
    vmap = clone_into(be, body, {**dict(zip(b_sin, ph_s)), **dict(zip(b_xin, ph_x))})
    seeds = {}
    for j, gv in zip(carried, g_in):
        seeds.setdefault(vmap.get(b_sout[j], b_sout[j]), []).append(V(gv, be))
    for o, p in zip(b_yout, ph_gy):
        if p is not None:
            seeds.setdefault(vmap.get(o, o), []).append(V(p, be))
    xs = [ph_s[j] for j in carried] + caps + [ph_x[i] for i in want_x]
    res = n.differentiate(bb, seeds, xs, be)
    nc, ncap = len(carried), len(caps)
    outs = [r if r is not None else be.zeros_like(V(ph_s[j], be))
            for r, j in zip(res[:nc], carried)]
    outs += [V(a, be) if r is None else V(a, be) + r for a, r in zip(acc_in, res[nc:nc + ncap])]
    outs += [r if r is not None else be.zeros_like(V(ph_x[i], be))
             for r, i in zip(res[nc + ncap:], want_x)]
    finish_body(be, bb, outs, [ph_s[j] for j in carried] + acc_in + [ph_x[i] for i in want_x])

    # scan inputs of the backward Scan: saved states, forward scan inputs, output gradients
    need_s = [j for j in range(ns) if ph_s[j].uses()]
    need_x = [i for i in range(m) if ph_x[i].uses()]
    need_y = [i for i, p in enumerate(ph_gy) if p is not None and p.uses()]
    if not (need_s or need_x or need_y):
        need_x = [0]  # the backward Scan needs one scan input for its length
    saved = _augment(e, node, body, [b_sin[j] for j in need_s], "saved")
    if need_s:
        extra = len(need_s)
        node.attributes["scan_output_axes"] = ir.AttrInt64s("scan_output_axes",
                                                            [*out_axes, *[0] * extra])
        node.attributes["scan_output_directions"] = ir.AttrInt64s(
            "scan_output_directions", [*out_dirs, *[0] * extra])
    # every backward sequence runs against its forward direction; forward-direction Scans over
    # reversed copies (Slice with step -1) rather than reverse directions, which not every
    # runtime has (onnx.reference has not)
    rev = lambda t, axis: e.Slice(t, [-1], [_INT64_MIN], [axis], [-1])  # noqa: E731
    scan_in, axes = [], []
    for j, s in zip(need_s, saved):
        bb.inputs.append(ph_s[j])
        scan_in.append(rev(s, 0)), axes.append(0)
    for i in need_x:
        bb.inputs.append(ph_x[i])
        x = n.ins[ns + i]
        scan_in.append(x if in_dirs[i] else rev(x, in_axes[i])), axes.append(in_axes[i])
    for i in need_y:
        bb.inputs.append(ph_gy[i])
        gy = n.gs[ns + i]
        scan_in.append(gy if out_dirs[i] else rev(gy, out_axes[i])), axes.append(out_axes[i])

    inits = [n.gs[j] if n.gs[j] is not None else e.zeros_like(n.outs[j]) for j in carried]
    inits += [e.zeros_like(V(c, e)) for c in caps]
    n_out = len(inits) + len(want_x)
    outs = e.op("Scan", *inits, *scan_in, body=bb, num_scan_inputs=len(scan_in),
                scan_input_axes=axes, scan_output_axes=[in_axes[i] for i in want_x],
                _outputs=n_out,
                _dtype=[v.dtype for v in inits] + [node.inputs[ns + i].dtype for i in want_x])
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs = outs[:len(inits)] + tuple(t if in_dirs[i] else rev(t, in_axes[i])
                                     for t, i in zip(outs[len(inits):], want_x))
    # over empty scan inputs, the output is the initial state: connected, unless never empty
    lens = [dims(node.inputs[ns + i])[in_axes[i]] if dims(node.inputs[ns + i]) else None
            for i in range(m)]
    runs = any(isinstance(d, int) and d >= 1 for d in lens)
    per_input = [None] * len(node.inputs)
    for k, j in enumerate(carried):
        if n.gs[j] is not None and not runs or b_sin[j] in hit:
            per_input[j] = outs[k]
    for k, i in enumerate(want_x):
        if b_xin[i] in hit:
            per_input[ns + i] = outs[len(inits) + k]
    return Grads(per_input, {c: o for c, o in zip(caps, outs[nc:nc + ncap]) if c in hit})
