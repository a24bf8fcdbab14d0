"""TF1 control flow -> ONNX: a while frame becomes a ``Loop``, a cond becomes an ``If``.

While frame (Enter -> Merge -> Switch(LoopCond) -> body -> NextIteration -> Merge; Exit): the
Merges are the loop-carried values. TF tests the condition at the top of each iteration, ONNX at
the bottom, so the condition's nodes are converted twice: once before the Loop on the initial
values (``cond`` input) and once at the end of the body on the next values. Resources (TensorArrays,
stacks) that the frame mutates are carried too, so pushes in a forward loop and pops in the
backward loop see one stack. A cond's branches become the ``If``'s two graphs; its Merges are the
``If``'s outputs.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from .core import Converter, Resource, Scope, onnx_dtype
from .errors import ConversionError
from .graph import TFNode, split_ref
from .resources import (GRAD_OPS, MUTATING, apply_scan_writes, ensure_grad, flow_key,
                        mutated, scan_arrays)

ENTER, EXIT = ("Enter", "RefEnter"), ("Exit", "RefExit")
NEXT, SWITCH = ("NextIteration", "RefNextIteration"), ("Switch", "RefSwitch")


def _tensor_vi(c: Converter, name: str, value, dtype_node: TFNode | None):
    r = c.seq_of.get(value) if isinstance(value, str) else None
    if r is not None:
        return helper.make_tensor_sequence_value_info(name, r.dtype, None)
    elem = onnx_dtype(dtype_node.attr["T"].type, dtype_node) if dtype_node else 0
    return helper.make_tensor_value_info(name, elem, None)


class Body:
    """Enter a nested scope (a Loop/If graph) with its own layer of bindings and states."""

    def __init__(self, c: Converter):
        self.c = c

    def __enter__(self) -> Scope:
        c = self.c
        self.saved = c.scope
        c.scope = Scope()
        c.env, c.state = c.env.new_child(), c.state.new_child()
        return c.scope

    def __exit__(self, *exc):
        c = self.c
        c.scope = self.saved
        c.env, c.state = c.env.parents, c.state.parents


def seq_loop(c: Converter, count: str, seq: str, elem: int, step, name: str) -> str:
    """An ONNX Loop run ``count`` times over sequence ``seq`` (element type ``elem``):
    ``step(k, s)`` emits one iteration (k the int64 iteration number) and returns the next s."""
    with Body(c) as body:
        k, cond, s = c.fresh("k"), c.fresh("cond"), c.fresh("seq")
        body.inputs += [helper.make_tensor_value_info(k, TensorProto.INT64, []),
                        helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
                        helper.make_tensor_sequence_value_info(s, elem, None)]
        out = step(k, s)
        cond_out = c.op("Identity", [cond])
        body.outputs += [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
                         helper.make_tensor_sequence_value_info(out, elem, None)]
        graph = body.graph(name)
    return c.op("Loop", [count, "", seq], body=graph)


def graph_output(c: Converter, scope: Scope, value: str, base: str) -> str:
    """A graph output for ``value``: ONNX graph outputs must be made inside the graph."""
    made = {o for n in scope.nodes for o in n.output}
    if value in made:
        return value
    return c.op("Identity", [value], name=base)


def _carried(c: Converter, members: list[TFNode]) -> list[Resource]:
    """Resources created outside ``members`` and mutated inside; gradient TensorArrays first
    created inside are created before the construct, so every iteration adds into one."""
    names = {n.name for n in members}
    out = []
    for key, node in mutated(c.g, members):
        if key[0] in names:
            continue  # created inside: local to one iteration/branch
        if key not in c.state:
            fwd = c.resources.get(key[:-1])
            if len(key) == 1 or fwd is None:
                raise ConversionError(f"{node} uses a TensorArray/stack that is not created yet")
            ensure_grad(c, fwd, key[-1])
        out.append(c.resources[key])
    return out


def convert_loop(c: Converter, fprefix: tuple, members: list[TFNode]) -> None:
    g, level = c.g, len(fprefix)
    frame = fprefix[-1][1]
    at = [n for n in members if len(n.ctx) == level]
    merges = [n for n in at if g.is_loop_merge(n)]
    conds = [n for n in at if n.op == "LoopCond"]
    if len(conds) != 1:
        raise ConversionError(f"while frame {frame!r} has {len(conds)} LoopCond nodes, not 1")
    loopcond = conds[0]
    switches = {n.inputs[0]: n for n in at if n.op in SWITCH and n.inputs[1] == f"{loopcond.name}:0"}
    construct = {n.name for n in at if n.op in ENTER + EXIT + NEXT} | {loopcond.name}
    construct |= {m.name for m in merges} | {s.name for s in switches.values()}

    for n in at:
        if n.op in ENTER:
            c.env[f"{n.name}:0"] = c.x(n)
    init, nxt = {}, {}
    for m in merges:
        for ref in m.inputs:
            p = g.producer(ref)
            if p.op in NEXT:
                nxt[m.name] = p.inputs[0]
            else:
                init[m.name] = c.value(ref)
    handles = [m for m in merges if isinstance(init[m.name], Resource)]
    for m in handles:  # a handle that goes round the loop unchanged
        c.env[f"{m.name}:0"] = init[m.name]
        if f"{m.name}:0" in switches:
            c.env[f"{switches[f'{m.name}:0'].name}:1"] = init[m.name]
    merges = [m for m in merges if m not in handles]
    written = scan_arrays(c, fprefix, members)
    changed = {key for key, n in mutated(g, [n for n in members if n.op not in GRAD_OPS])}
    carried = [r for r in _carried(c, members)  # (what a gradient op makes is made before)
               if r.key in changed and r.key not in c.scan_stacks and r.key not in written]
    names = {n.name for n in members}
    scans = [key for key, push in c.scan_stacks.items()
             if push.ctx == fprefix and push.name in names]
    flow_of = {}
    for m in merges:  # TensorArray flows (incl. accumulators that start as ZerosLike(flow))
        r = c.seq_of.get(init[m.name])
        if r is None and flow_key(g, f"{m.name}:0") is not None:
            r = c.resources.get(flow_key(g, f"{m.name}:0"))
            if r is None:
                raise ConversionError(f"{m} carries the flow of a TensorArray the converter has "
                                      "not seen created")
            init[m.name] = c.get_state(r)
        if r is not None and r.key in written:  # the flow of an array written as scan outputs
            r, init[m.name] = None, c.const(np.zeros((), np.float32))
        flow_of[m.name] = r
    # the flow of an array the loop does not change (TF carries the flows of what it reads, for
    # its gradient accumulators): its state, as it is, not carried round (and copied)
    fixed = [m for m in merges if flow_of[m.name] is not None and flow_of[m.name] not in carried]
    for m in fixed:
        c.env[f"{m.name}:0"] = init[m.name]
        if f"{m.name}:0" in switches:
            c.env[f"{switches[f'{m.name}:0'].name}:1"] = init[m.name]
    handles += fixed
    merges = [m for m in merges if m not in fixed]
    extra = [r for r in carried if r not in flow_of.values()]

    # the condition's own nodes (frame level, between the Merges and LoopCond)
    cond_nodes = _ancestors(g, loopcond, at, construct)

    def condition(values) -> str:
        c.env = c.env.new_child()
        for m, v in zip(merges, values):
            c.env[f"{m.name}:0"] = v
        c.convert_nodes(fprefix, cond_nodes)
        out = c.x(loopcond)
        c.env = c.env.parents
        return out

    cond_init = condition([init[m.name] for m in merges])
    outer_states = [c.get_state(r) for r in extra]
    body_parent = c.scope

    def make_body():
        with Body(c) as body:
            it, cin = c.fresh(f"{frame}/iteration"), c.fresh(f"{frame}/cond_in")
            body.inputs += [helper.make_tensor_value_info(it, TensorProto.INT64, []),
                            helper.make_tensor_value_info(cin, TensorProto.BOOL, [])]
            for m in merges:
                v = c.fresh(f"{m.name}:0")
                body.inputs.append(_tensor_vi(c, v, init[m.name], m))
                c.env[f"{m.name}:0"] = v
                sw = switches.get(f"{m.name}:0")
                if sw is not None:
                    c.env[f"{sw.name}:1"] = v
                if flow_of[m.name] is not None:
                    c.set_state(flow_of[m.name], v)
            for r in extra:
                v = c.fresh(f"{r.key[0]}/state")
                body.inputs.append(helper.make_tensor_sequence_value_info(v, r.dtype, None))
                c.set_state(r, v)
            outer = c.iteration, c.loop_scope
            c.iteration, c.loop_scope = it, body_parent
            c.scan_writes.update(dict.fromkeys(written))
            c.convert_nodes(fprefix, [n for n in members if n.name not in construct])
            c.iteration, c.loop_scope = outer
            nexts = [c.get_state(flow_of[m.name]) if flow_of[m.name] is not None
                     else c.value(nxt[m.name]) for m in merges]
            states = [c.get_state(r) for r in extra]
            pushed, scan_types, stacked_at = _scans(c, body, scans)
            for key in written:
                pushed.extend(c.scan_writes.pop(key))  # (index, value)
                scan_types += [TensorProto.INT64, c.resources[key].dtype]
            cond_out = condition(nexts)
            outs = [cond_out] + nexts + states + pushed
            outs = [graph_output(c, body, v, f"{frame}/out") for v in outs]
            body.outputs += [helper.make_tensor_value_info(outs[0], TensorProto.BOOL, [])]
            body.outputs += [_tensor_vi(c, o, v, m) for o, v, m in zip(outs[1:], nexts, merges)]
            body.outputs += [helper.make_tensor_sequence_value_info(o, r.dtype, None)
                             for o, r in zip(outs[1 + len(merges):], extra)]
            body.outputs += [helper.make_tensor_value_info(o, t, None)
                             for o, t in zip(outs[1 + len(merges) + len(extra):], scan_types)]
            return body.graph(frame.replace("/", "_")), scan_types, stacked_at

    # (each loop decides for itself: a loop nested in a body made assuming no broadcast is not)
    (masks, assumed), c.bga_masks, c.no_broadcast = (c.bga_masks, c.no_broadcast), [], False
    graph, scan_types, stacked_at = make_body()
    loop_in = ["", cond_init] + [init[m.name] for m in merges] + outer_states
    n_out = len(merges) + len(extra) + len(scan_types)
    if not c.bga_masks:
        results = c.op("Loop", loop_in, n_out=n_out, name=f"{frame}/Loop", body=graph)
    else:  # a backward loop: also a body that assumes no shape broadcasts, chosen at run time
        uniform = _no_broadcast(c, c.bga_masks)
        c.no_broadcast = True
        fast = make_body()[0]
        c.no_broadcast = False
        results = c.op("If", [uniform], n_out=n_out, name=f"{frame}/If",
                       then_branch=_one_node(c, "Loop", loop_in, n_out, fast, f"{frame}_fast"),
                       else_branch=_one_node(c, "Loop", loop_in, n_out, graph, frame))
    c.bga_masks, c.no_broadcast = masks, assumed
    results = [results] if isinstance(results, str) else results
    final = dict(zip((m.name for m in merges), results))
    for m in merges:
        if flow_of[m.name] is not None:
            c.set_state(flow_of[m.name], final[m.name])
    for r, v in zip(extra, results[len(merges):]):
        c.set_state(r, v)
    first = len(merges) + len(extra)
    last = None  # the last iteration's number: all the pops of one backward iteration share it
    if any(isinstance(k, int) for k in stacked_at.values()):
        count = c.op("Shape", [results[first]], end=1)
        last = c.op("Sub", [c.op("Squeeze", [count, c.i64(0)]), c.const(1, np.int64)])
    shaped = {}
    for key in scans:  # the pushes, stacked, and the last one's index (resources._pop)
        k = stacked_at[key]
        if not isinstance(k, int):  # a value pushed the same every iteration: the pops read it
            c.state[key] = (k, None)
            continue
        if k not in shaped:  # TF's static shape of the pushes: their rank for ONNX inference
            name, i = split_ref(c.scan_stacks[key].inputs[1])
            dims = _output_shape(c, name, i)
            shaped[k] = results[first + k] if dims is None else c.op("Reshape", [
                results[first + k], c.const(np.array([0] + [d or 0 for d in dims], np.int64))])
        c.state[key] = (shaped[k], last)
    rest = results[first + len({v for v in stacked_at.values() if isinstance(v, int)}):]
    for k, key in enumerate(written):
        apply_scan_writes(c, c.resources[key], rest[2 * k], rest[2 * k + 1])
    for n in at:
        if n.op in EXIT:
            sw = g.producer(n.inputs[0])
            if sw.op not in SWITCH or sw.inputs[0] not in {f"{m.name}:0" for m in merges} | {
                    f"{m.name}:0" for m in handles}:
                raise ConversionError(f"{n} does not leave the loop through its Switch")
            mname = sw.inputs[0].split(":")[0]
            c.env[f"{n.name}:0"] = final.get(mname) or c.env[f"{mname}:0"]


def _no_broadcast(c: Converter, masks: list[str]) -> str:
    """True when no iteration of the backward loop sums a gradient over broadcast axes: every
    BroadcastGradientArgs of popped shapes (ops._bga_of_pops) says none."""
    flat = [c.op("Reshape", [c.op("Cast", [m], to=TensorProto.INT32), c.i64(-1)]) for m in masks]
    any_ = c.op("ReduceMax", [c.op("Concat", flat + [c.const(np.zeros(1, np.int32))], axis=0)],
                keepdims=0)
    return c.op("Not", [c.op("Cast", [any_], to=TensorProto.BOOL)])


def _one_node(c: Converter, op: str, inputs: list, n_out: int, body, name: str):
    """A graph of one node (a Loop) whose outputs are the graph's: an If branch."""
    outs = [c.fresh(f"{name}/out:{k}") for k in range(n_out)]
    node = helper.make_node(op, inputs, outs, name=c.fresh(f"{name}/{op}"), body=body)
    return helper.make_graph([node], f"{name}_branch", [],
                             [helper.make_empty_tensor_value_info(o) for o in outs])


def _output_shape(c: Converter, name: str, i: int):
    """TF's static shape of output i of node ``name`` (add_shapes), or None."""
    shapes = c.attr(c.g.nodes[name], "_output_shapes")
    return shapes[i] if shapes and i < len(shapes) else None


def _scans(c: Converter, body: Scope, scans: list) -> tuple[list, list, dict]:
    """The stacks' pushes in a Loop body as its scan outputs: (values, their types, {key: the
    scan output's position, or the pushed value itself when it is the same every iteration
    (made outside the body)}); a value pushed onto several stacks is one scan output."""
    made = {o for nd in body.nodes for o in nd.output} | {i.name for i in body.inputs}
    values, types, at = [], [], {}
    for key in scans:
        v = c.scan_pushes.pop(key)
        if v not in made:
            at[key] = v
        elif v in values:
            at[key] = values.index(v)
        else:
            at[key] = len(values)
            values.append(v)
            types.append(c.scan_dtype.get(key, c.resources[key].dtype))
    return values, types, at


def _ancestors(g, node: TFNode, at: list[TFNode], stop: set) -> list[TFNode]:
    level = {n.name for n in at}
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for p in g.deps(n):
            if p.name in level and p.name not in stop and p.name not in seen:
                seen.add(p.name)
                todo.append(p)
    return [n for n in at if n.name in seen]


def split_cond(g, prefix: tuple, members: list[TFNode]) -> list[list[TFNode]]:
    """A cond's nodes as one or more Ifs. TF1 builds a cond's gradient inside the forward cond's
    context: the backward nodes of a branch read the forward branch's values *and* the gradient
    of the cond's outputs, so one If for all would depend on itself. Each Merge (output) gets
    the branch nodes it needs (forward values are recomputed where a later If needs them);
    nodes that change a resource (stack pushes) run once: Merges that share one are kept in one
    If."""
    level = len(prefix)
    names = {n.name: n for n in members}
    merges = [n for n in members if len(n.ctx) == level + 1 and n.ctx[level][2] is None]
    roots = merges + [n for n in members if n.op in MUTATING]
    closure = {}
    for r in roots:
        seen, todo = {r.name}, [r]
        while todo:
            for p in g.deps(todo.pop()):
                if p.name in names and p.name not in seen:
                    seen.add(p.name)
                    todo.append(p)
        closure[r.name] = seen
    parent = {r.name: r.name for r in roots}

    def find(a):
        while parent[a] != a:
            a = parent[a]
        return a
    for n in members:  # a resource change inside several closures: those Ifs become one
        if n.op in MUTATING:
            owners = [r.name for r in roots if n.name in closure[r.name]]
            for o in owners[1:]:
                parent[find(o)] = find(owners[0])
    parts: dict[str, set] = {}
    for r in roots:
        parts.setdefault(find(r.name), set()).update(closure[r.name])
    return [[n for n in members if n.name in part] for part in parts.values()] or [members]


def convert_cond(c: Converter, prefix: tuple, key: tuple, members: list[TFNode]) -> None:
    """One cond: ``key`` is (predicate tensor, part) (see Graph._split_conds)."""
    g, level = c.g, len(prefix)
    pred = key[0]
    merges = [n for n in members if len(n.ctx) == level + 1 and n.ctx[level][2] is None]
    carried = _carried(c, members)
    branches = []
    for k in (1, 0):
        lvl = ("C", key, k)
        inner = [n for n in members if n.ctx[level] == lvl]
        with Body(c) as body:
            c.convert_nodes(prefix + (lvl,), inner)
            vals = []
            for m in merges:
                refs = [r for r in m.inputs if len(g.producer(r).output_ctx(int(r.split(":")[1])))
                        > level and g.producer(r).output_ctx(int(r.split(":")[1]))[level] == lvl]
                if len(refs) != 1:
                    raise ConversionError(f"{m} has no single input from branch {k} of the cond "
                                          f"on {pred!r}")
                vals.append(c.value(refs[0]))
            vals += [c.get_state(r) for r in carried]
            outs = [graph_output(c, body, v, f"{pred}/branch{k}/out") for v in vals]
            body.outputs += [_tensor_vi(c, o, v, m) for o, v, m in zip(outs, vals, merges)]
            body.outputs += [helper.make_tensor_sequence_value_info(o, r.dtype, None)
                             for o, r in zip(outs[len(merges):], carried)]
            branches.append(body.graph(f"{pred.replace(':', '_').replace('/', '_')}_{k}"))
    p = c.value(pred)
    results = c.op("If", [p], n_out=len(merges) + len(carried), name=f"{merges[0].name}/If"
                   if merges else None, then_branch=branches[0], else_branch=branches[1])
    results = [results] if isinstance(results, str) else results
    for m, v in zip(merges, results):
        c.env[f"{m.name}:0"] = v
        taken = [i for i, r in enumerate(m.inputs)
                 if g.producer(r).output_ctx(int(r.split(":")[1]))[level] == ("C", key, 1)]
        c.env[f"{m.name}:1"] = c.op("Where", [p, c.const(taken[0], "int32"),
                                              c.const(1 - taken[0], "int32")], name=m.name)
    for r, v in zip(carried, results[len(merges):]):
        c.set_state(r, v)
