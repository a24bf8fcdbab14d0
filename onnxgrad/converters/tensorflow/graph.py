"""The TensorFlow graph as the converter sees it: nodes with parsed inputs, and the control-flow
context of every node.

TF1 control flow is flat: a while loop is the set of nodes between its ``Enter`` and ``Exit``
nodes (its *frame*), a cond is the set of nodes fed by one predicate's ``Switch`` outputs. The
converter turns each into one ONNX ``Loop`` or ``If``, so it first needs to know which nodes
belong to which. A node's context is a tuple of levels from the outermost in:

    ("F", frame_name)       inside while-loop frame ``frame_name``
    ("C", pred, branch)     inside branch 0 (false) / 1 (true) of the cond on tensor ``pred``;
                            branch None: the cond's ``Merge`` nodes (they close it)

computed in one pass in topological order (TF's own ``ControlFlowInfo`` does the same for frames).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .errors import ConversionError


@dataclass(eq=False)
class TFNode:
    name: str
    op: str
    inputs: list[str]  # data inputs as "node:index"
    controls: list[str]  # control-input node names
    attr: dict  # name -> AttrValue proto
    ctx: tuple = ()
    out_ctx: dict = field(default_factory=dict)  # output index -> context, where it differs

    def __repr__(self):
        return f"{self.op} node {self.name!r}"

    def output_ctx(self, i: int) -> tuple:
        return self.out_ctx.get(i, self.ctx)


def split_ref(ref: str) -> tuple[str, int]:
    name, _, idx = ref.partition(":")
    return name, int(idx) if idx else 0


def parse_input(s: str) -> tuple[str, bool]:
    """A NodeDef input string -> ("node:index", is_control)."""
    if s.startswith("^"):
        return s[1:], True
    name, idx = split_ref(s)
    return f"{name}:{idx}", False


LOOP_OPS = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "NextIteration", "RefNextIteration",
                      "LoopCond"})


class Graph:
    def __init__(self, graph_def):
        self.nodes: dict[str, TFNode] = {}
        for nd in graph_def.node:
            data, ctrl = [], []
            for s in nd.input:
                ref, is_ctrl = parse_input(s)
                (ctrl if is_ctrl else data).append(split_ref(ref)[0] if is_ctrl else ref)
            self.nodes[nd.name] = TFNode(nd.name, nd.op, data, ctrl, dict(nd.attr))
        # tf.gradients' ControlTriggers (b_sync) only order pops against other loop work in TF's
        # executor; here stacks are threaded as values, and their edges would tie a backward
        # loop's cond to the nested loop it waits on, so they are dropped
        triggers = {k for k, n in self.nodes.items() if n.op == "ControlTrigger"}
        for n in self.nodes.values():
            n.controls = [c for c in n.controls if c not in triggers]
            if n.op == "ControlTrigger":
                n.inputs, n.controls = [], []
        self.library = getattr(graph_def, "library", None)
        for n in self.nodes.values():
            for ref in n.inputs:
                if split_ref(ref)[0] not in self.nodes:
                    raise ConversionError(f"{n} reads {ref!r}, which no node of the graph makes")
            for c in n.controls:
                if c not in self.nodes:
                    raise ConversionError(f"{n} has a control input from unknown node {c!r}")
        self.order = self._topological()
        self._contexts()
        self._split_conds()

    def producer(self, ref: str) -> TFNode:
        return self.nodes[split_ref(ref)[0]]

    def uses(self, ref: str) -> int:
        """How many data inputs of the graph's nodes read tensor ``ref``."""
        if not hasattr(self, "_uses"):
            self._uses = {}
            for n in self.nodes.values():
                for r in n.inputs:
                    self._uses[r] = self._uses.get(r, 0) + 1
        return self._uses.get(ref, 0)

    def is_loop_merge(self, n: TFNode) -> bool:
        return n.op in ("Merge", "RefMerge") and any(
            self.producer(r).op in ("NextIteration", "RefNextIteration") for r in n.inputs)

    def deps(self, n: TFNode):
        """Producers of n's inputs (data and control), without the NextIteration back edges."""
        loop_merge = self.is_loop_merge(n)
        for ref in n.inputs:
            p = self.producer(ref)
            if not (loop_merge and p.op in ("NextIteration", "RefNextIteration")):
                yield p
        for c in n.controls:
            yield self.nodes[c]

    def _topological(self) -> list[TFNode]:
        names = list(self.nodes)  # ties go to the GraphDef's order (creation order, as TF runs)
        order = toposort(names, {k: {p.name for p in self.deps(n)} for k, n in self.nodes.items()})
        if order is None:
            raise ConversionError("the graph has a cycle that is not a while loop")
        return [self.nodes[k] for k in order]

    def _is_loop_switch(self, n: TFNode) -> bool:
        return self.producer(n.inputs[1]).op == "LoopCond"

    def _contexts(self) -> None:
        for n in self.order:
            if n.op in ("Merge", "RefMerge") and not self.is_loop_merge(n):
                n.ctx = self._merge_ctx(n)
                n.out_ctx = {0: n.ctx[:-1], 1: n.ctx[:-1]}
                continue
            ctxs = [self.producer(r).output_ctx(split_ref(r)[1]) for r in n.inputs
                    if not (self.is_loop_merge(n) and
                            self.producer(r).op in ("NextIteration", "RefNextIteration"))]
            if n.op not in ("NextIteration", "RefNextIteration"):
                # (a NextIteration may wait on a stack push inside a cond in the loop body; it
                # still belongs to its loop, not to that cond)
                ctxs += [self._control_ctx(self.nodes[c]) for c in n.controls]
            ctx = _deepest(ctxs, n)
            if n.op in ("Enter", "RefEnter"):
                ctx = ctx + (("F", _s(n.attr["frame_name"])),)
            n.ctx = ctx
            if n.op in ("Exit", "RefExit"):
                n.out_ctx = {0: ctx[:-1]}
            elif n.op in ("Switch", "RefSwitch") and not self._is_loop_switch(n):
                pred = self._pred(n.inputs[1])
                n.out_ctx = {k: ctx + (("C", pred, k),) for k in (0, 1)}

    def _pred(self, ref: str) -> str:
        """A cond's predicate, behind identities: tf.cond switches its data on Identity(pred)
        ("cond/pred_id") but hangs the branches' constants, by a control edge, off
        Switch(pred, pred) ("cond/switch_t"); both are the same cond."""
        p = self.producer(ref)
        while p.op == "Identity" and not p.controls:
            ref = p.inputs[0]
            p = self.producer(ref)
        return ref

    def _control_ctx(self, c: TFNode) -> tuple:
        # a control edge from an Exit or a cond Merge leaves the construct, like its data output
        return c.output_ctx(0) if c.op in ("Exit", "RefExit", "Merge", "RefMerge") else c.ctx

    def _split_conds(self) -> None:
        """Conds are found by predicate, but one predicate can drive several conds (tf.gradients
        builds a cond's gradient on the same predicate, and it reads the forward cond's
        outputs): split each predicate's nodes into connected parts, one cond (If) each."""
        parent: dict = {}

        def find(a):
            while parent.setdefault(a, a) != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        def elems(n: TFNode, ref: str | None = None):
            ctx = n.ctx if ref is None else n.output_ctx(split_ref(ref)[1])
            return [(j, lvl[1]) for j, lvl in enumerate(ctx) if lvl[0] == "C"]

        for n in self.order:
            mine = elems(n)
            if not mine:
                continue
            refs = [(r, self.producer(r)) for r in n.inputs] + [
                (None, self.nodes[c]) for c in n.controls]
            for ref, p in refs:
                theirs = dict(elems(p, ref))
                for j, pred in mine:
                    same = theirs.get(j) == pred and p.output_ctx(
                        split_ref(ref)[1] if ref else 0)[:j] == n.ctx[:j]
                    if same:
                        src = (f"{p.name}:{split_ref(ref)[1]}" if p.op in ("Switch", "RefSwitch")
                               and ref else p.name, j)
                        parent[find((n.name, j))] = find(src)

        def relabel(ctx, who):
            return tuple((lvl[0], (lvl[1], find((who, j))[0]), lvl[2]) if lvl[0] == "C" else lvl
                         for j, lvl in enumerate(ctx))

        for n in self.order:
            if any(lvl[0] == "C" for lvl in n.ctx):
                n.ctx = relabel(n.ctx, n.name)
            n.out_ctx = {i: relabel(c, f"{n.name}:{i}" if n.op in ("Switch", "RefSwitch")
                                    else n.name) for i, c in n.out_ctx.items()}

    def _merge_ctx(self, n: TFNode) -> tuple:
        ctxs = [self.producer(r).output_ctx(split_ref(r)[1]) for r in n.inputs]
        base = [c for c in ctxs if c and c[-1][0] == "C"]
        if not base:
            raise ConversionError(f"{n} merges tensors that come from no cond branch")
        # the branches' common level: the shortest branch context (nested conds close first)
        c = min(base, key=len)
        return c[:-1] + (("C", c[-1][1], None),)


def toposort(keys: list, deps: dict) -> list | None:
    """``keys`` ordered so that each comes after its ``deps`` (a set per key; keys not in
    ``keys`` are ignored), ties broken by the order of ``keys``; None when there is a cycle."""
    pos = {k: i for i, k in enumerate(keys)}
    users: dict = {k: [] for k in keys}
    indeg = dict.fromkeys(keys, 0)
    for k in keys:
        for p in deps[k]:
            if p in pos:
                users[p].append(k)
                indeg[k] += 1
    ready = [pos[k] for k in keys if indeg[k] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = keys[heapq.heappop(ready)]
        order.append(k)
        for u in users[k]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, pos[u])
    return order if len(order) == len(keys) else None


def _deepest(ctxs, n) -> tuple:
    best = ()
    for c in ctxs:
        if len(c) > len(best):
            best, c = c, best
        if best[:len(c)] != c:
            raise ConversionError(f"{n} mixes tensors of two different control-flow contexts "
                                  f"({_show(c)} and {_show(best)})")
    return best


def _show(ctx) -> str:
    return " > ".join(f"while {x[1]}" if x[0] == "F" else f"cond on {x[1]}" for x in ctx) or "top"


def _s(attr) -> str:
    return attr.s.decode()


def group_key(level: tuple) -> tuple:
    """Frames group by name; both branches of a cond (and its Merges) group by predicate."""
    return level if level[0] == "F" else ("C", level[1])
