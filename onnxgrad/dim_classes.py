"""Which unknown dims of a graph are provably one size: the classes of the broadcast order.

A dim ``a`` broadcasts to ``b`` (a <= b) when a is 1 or a == b. A broadcasting op puts each
input's dim <= the output's along the same (right-aligned) axis; ops that keep a dim (unary
elementwise ops, a MatMul's rows, a Concat's other axes, a Gather's other axes, a Transpose's
permuted axes, a Reshape's copied ones), and the
pairs a caller knows equal, put it both ways. The order is antisymmetric (a <= b <= a means
a == b), so the dims on one cycle of these edges are one size: each strongly connected
component is a class. :func:`unify` names each class's dims alike (its int when it has one),
so that a gradient rule's ``sum_to`` sees equal symbols and sums over nothing, where an unknown
dim would make it compute the axes at run time (eight nodes a sum, per iteration in a loop).
A class never joins dims that could differ at run time in a graph that runs: each edge holds
for every run that does not fail.
"""
from __future__ import annotations

import onnx_ir as ir

from .emitter import dims
from .registry import constant_value

_BROADCAST = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Where", "PRelu", "Mod",
    "BitShift", "And", "Or", "Xor", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"})
_KEEPS = frozenset({  # the first input's shape is the first output's
    "Identity", "Cast", "CastLike", "Neg", "Abs", "Reciprocal", "Sqrt", "Exp", "Log", "Erf",
    "Sin", "Cos", "Tan", "Tanh", "Sigmoid", "Sign", "Relu", "Not", "Floor", "Ceil", "IsNaN",
    "IsInf", "Cosh", "Sinh", "Softplus", "Softsign", "Atan", "Asin", "Acos", "Elu", "Selu",
    "LeakyRelu", "HardSigmoid", "HardSwish", "Gelu", "Softmax", "LogSoftmax", "Clip", "Round"})


def _shape(v):
    return None if v is None or not isinstance(v.type, ir.TensorType) else dims(v)


def _edges(node: ir.Node):
    """(a, b, both) per dim relation of ``node``: dim a <= dim b, or a == b when ``both``; a dim
    is (value, axis)."""
    op, ins, outs = node.op_type, node.inputs, node.outputs
    if node.domain not in ("", "ai.onnx") or not outs:
        return
    out = outs[0]
    so = _shape(out)
    if so is None:
        return
    if op in _BROADCAST:
        for x in ins:
            sx = _shape(x)
            if sx is not None and len(sx) <= len(so):
                lead = len(so) - len(sx)
                yield from (((x, i), (out, lead + i), False) for i in range(len(sx)))
    elif op in _KEEPS and ins and ins[0] is not None:
        sx = _shape(ins[0])
        if sx is not None and len(sx) == len(so):
            yield from (((ins[0], i), (out, i), True) for i in range(len(sx)))
    elif op in ("MatMul", "Gemm") and len(ins) >= 2 and ins[0] is not None and ins[1] is not None:
        sa, sb = _shape(ins[0]), _shape(ins[1])
        if sa is None or sb is None or len(sa) < 2 or len(sb) < 2:
            return
        a_rows, a_cols, b_rows, b_cols = len(sa) - 2, len(sa) - 1, len(sb) - 2, len(sb) - 1
        if op == "Gemm":
            if node.attributes.get_int("transA", 0):
                a_rows, a_cols = a_cols, a_rows
            if node.attributes.get_int("transB", 0):
                b_rows, b_cols = b_cols, b_rows
            if len(ins) > 2 and ins[2] is not None:
                sc = _shape(ins[2])
                if sc is not None and len(sc) <= 2:
                    yield from (((ins[2], i), (out, 2 - len(sc) + i), False)
                                for i in range(len(sc)))
        a, b, r = ins[0], ins[1], len(so)
        yield (a, a_rows), (out, r - 2), True
        yield (b, b_cols), (out, r - 1), True
        yield (a, a_cols), (b, b_rows), True
        for x, sx in ((a, sa), (b, sb)) if op == "MatMul" else ():  # batch dims broadcast
            lead = r - len(sx)
            yield from (((x, i), (out, lead + i), False) for i in range(len(sx) - 2))
    elif op in ("Split", "Concat"):
        axis = node.attributes.get_int("axis", 0)
        vals = [v for v in (ins[:1] if op == "Split" else ins) if v is not None] + \
            [v for v in outs if v is not None]
        shapes = [_shape(v) for v in vals]
        if any(s is None or len(s) != len(so) for s in shapes):
            return
        axis %= len(so)
        for v in vals[1:]:
            yield from (((vals[0], i), (v, i), True) for i in range(len(so)) if i != axis)
    elif op == "Gather" and len(ins) == 2 and ins[0] is not None and ins[1] is not None:
        sd, si = _shape(ins[0]), _shape(ins[1])
        if sd is None or si is None or not sd or len(so) != len(sd) - 1 + len(si):
            return
        axis = node.attributes.get_int("axis", 0) % len(sd)
        yield from (((ins[0], i), (out, i if i < axis else i - 1 + len(si)), True)
                    for i in range(len(sd)) if i != axis)
    elif op == "Reshape" and len(ins) == 2 and ins[0] is not None:
        sx, want = _shape(ins[0]), _ints(ins[1])
        if sx is None or want is None or len(want) != len(so):
            return
        zero_copies = not node.attributes.get_int("allowzero", 0)
        kept = [i for i, w in enumerate(want) if w == 0 and zero_copies and i < len(sx)]
        yield from (((ins[0], i), (out, i), True) for i in kept)
        # the one -1 is the input's dim there when every other dim is the input's own int
        rest = [i for i, w in enumerate(want) if w == -1]
        if len(rest) == 1 and len(sx) == len(want) and all(
                i == rest[0] or isinstance(sx[i], int) and sx[i] == w > 0
                for i, w in enumerate(want)):
            yield (ins[0], rest[0]), (out, rest[0]), True
    elif op == "Transpose" and ins[0] is not None:
        sx = _shape(ins[0])
        perm = node.attributes.get_ints("perm", list(reversed(range(len(so)))))
        if sx is not None and len(sx) == len(so) == len(perm):
            yield from (((ins[0], p), (out, i), True) for i, p in enumerate(perm))


def _ints(v) -> list | None:
    """The values of a constant int tensor (:func:`~onnxgrad.registry.constant_value`), flat,
    or None."""
    arr = constant_value(v)
    return [int(x) for x in arr.reshape(-1)] if arr is not None and arr.dtype.kind in "iu" \
        else None


_INT_TYPES = frozenset({6, 7, 12, 13})  # int32, int64, uint32, uint64: a dim's value kept


def _rank(v):
    s = _shape(v)
    return None if s is None else len(s)


def shape_elements(v, depth=0) -> list | None:
    """What each element of the 1-D int tensor ``v`` (a shape being built) is: an int, a dim
    (value, axis) that Shape read, or None (not known); None when even its length is not.
    Follows Shape, Cast, Slice (step 1), Gather, Squeeze, Unsqueeze, Reshape, Concat and
    constants: how converters build the shape of a loop's initial zeros from the input's."""
    ints = _ints(v)
    if ints is not None:
        return ints
    p = None if v is None or depth > 16 else v.producer()
    if p is None:
        return None
    op, ins = p.op_type, p.inputs
    if op == "Shape":
        sx = _shape(ins[0])
        if sx is None:
            return None
        start = p.attributes.get_int("start", 0)
        end = p.attributes.get_int("end", len(sx))
        return [(ins[0], i) for i in range(len(sx))][start:end]
    if op == "Cast" and p.attributes.get_int("to", 0) not in _INT_TYPES:
        return None
    if op in ("Cast", "Squeeze", "Unsqueeze", "Reshape", "Identity"):  # (the same elements)
        return shape_elements(ins[0], depth + 1)
    if op == "Concat":  # of 1-D parts
        parts = [shape_elements(x, depth + 1) if _rank(x) in (0, 1) else None for x in ins]
        return None if any(q is None for q in parts) else [e for q in parts for e in q]
    if _rank(ins[0]) != 1:
        return None
    if op == "Slice":
        el, args = shape_elements(ins[0], depth + 1), [_ints(x) for x in ins[1:]]
        if el is None or any(a is None for a in args[:2]) or \
                any(a not in (None, [0]) for a in args[2:3]) or \
                any(a not in (None, [1]) for a in args[3:4]):
            return None
        return el[args[0][0]:args[1][0]] if len(args[0]) == len(args[1]) == 1 else None
    if op == "Gather":
        el, idx = shape_elements(ins[0], depth + 1), _ints(ins[1])
        if el is None or idx is None or any(not -len(el) <= i < len(el) for i in idx):
            return None
        return [el[i] for i in idx]
    return None


def made_dims(v) -> list:
    """(axis of v, dim it equals) pairs for a value an Expand of a scalar or a ConstantOfShape
    makes from a shape that :func:`shape_elements` follows: dims (value, axis) or ints."""
    p = None if v is None else v.producer()
    if p is None or p.domain not in ("", "ai.onnx"):
        return []
    if p.op_type == "ConstantOfShape" or p.op_type == "Expand" and _shape(p.inputs[0]) == ():
        el = shape_elements(p.inputs[-1])
        sv = _shape(v)
        if el is not None and sv is not None and len(el) == len(sv):
            return [(i, d) for i, d in enumerate(el) if d is not None]
    return []


def _components(succ: dict) -> list[list]:
    """The strongly connected components of the graph ``succ`` (node -> successors), by
    Tarjan's algorithm without recursion (a loop body may hold thousands of dims)."""
    index, low, on, stack, comps, count = {}, {}, set(), [], [], 0
    for root in succ:
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = count
        count += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = count
                    count += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(succ.get(w, ()))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    comps.append(comp)
    return comps


def unify(nodes, equal=(), mutable=(), prefix="dim", dims_equal=()) -> set:
    """Name alike the dims of ``mutable`` values that the edges of ``nodes``, and the pairs of
    values in ``equal`` (same shape, dim by dim) and of dims in ``dims_equal`` (an int for a
    dim of that size), prove one size: a class's int where it has
    one, else a name it has (one that values outside ``mutable`` carry first), else
    ``{prefix}{k}``. Dims with one name are one size (onnx's inference names them so), so a
    name joins its dims' classes, and every mutable dim of a renamed name follows. Returns the
    names of the classes with a dim of a value outside ``mutable``: in a loop body, the
    dims that are the same in every iteration (an outer value's)."""
    succ: dict = {}

    def link(a, b, both):
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
        if both:
            succ[b].append(a)

    for node in nodes:
        for a, b, both in _edges(node):
            link(a, b, both)
    for x, y in equal:
        sx, sy = _shape(x), _shape(y)
        if sx is not None and sy is not None and len(sx) == len(sy):
            for i in range(len(sx)):
                link((x, i), (y, i), True)
    for a, b in dims_equal:
        link(a, ("int", b) if isinstance(b, int) else b, True)
    mutable = [v for v in dict.fromkeys(mutable) if _shape(v) is not None]
    fixed = {v for v, _ in succ if not isinstance(v, str)} - set(mutable)
    for v in [*fixed, *mutable]:
        for i, d in enumerate(_shape(v)):
            if isinstance(d, str):
                link((v, i), ("name", d), True)
    renames, fresh, invariant = {}, 0, set()  # (value, axis) or ("name", name) -> its dim
    for comp in _components(succ):
        ds = [c[1] if c[0] in ("name", "int") else _shape(c[0])[c[1]] for c in comp]
        outer = any(c[0] in fixed for c in comp)
        if len(comp) < 2 or None not in ds and len(set(ds)) == 1:  # (nothing to rename)
            if outer and isinstance(ds[0], str):
                invariant.add(ds[0])
            continue
        ints = {d for d in ds if isinstance(d, int)}
        if len(ints) > 1:  # a graph that cannot run (two sizes proven one): leave it be
            continue
        names = sorted({c[1] for c in comp if c[0] == "name"})
        outside = sorted({_shape(c[0])[c[1]] for c in comp if c[0] in fixed} & set(names))
        if ints:
            new = ints.pop()
        elif names:
            new = (outside or names)[0]
        else:
            new, fresh = f"{prefix}{fresh}", fresh + 1
        renames.update((c, new) for c in comp)
        if isinstance(new, str) and outer:
            invariant.add(new)
    for v in mutable:
        old = _shape(v)
        ds = [renames.get(("name", d), d) if isinstance(d, str) else
              renames.get((v, i), d) if d is None else d for i, d in enumerate(old)]
        if ds != list(old):
            v.shape = ir.Shape(ds)
    return invariant
