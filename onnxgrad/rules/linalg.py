"""Gradient rules: MatMul, Gemm, Einsum and Det.

MatMul and Gemm gradients stay MatMul/Gemm/Transpose (onnxruntime runs them on its GEMM kernels);
Einsum's gradient for operand i is an Einsum of the output gradient with the other operands whose
output subscripts are operand i's, then indices that appear only in operand i are broadcast back,
repeated indices (diagonals, traces) are put back on the diagonal with identity masks, and
broadcast ellipsis dimensions are summed away.

Det's gradient is the cofactor matrix, d det(X) / dX_ij = (-1)^(i+j) det(X without row i and
column j), built from Det itself on the n^2 minors: ONNX has no matrix inverse or solve, and unlike
det(X) * inv(X)^T the cofactors are exact for singular X too (O(n^5) work, meant for small n).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from ..emitter import broadcast_dims
from ..inference import FLOAT_TYPES
from ..registry import register
from .spec import attr

_INT64_MAX = np.iinfo(np.int64).max


def _swap_last(e, v, rank):
    """Transpose of the last two axes."""
    perm = list(range(rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    shape = v.shape
    return e.op("Transpose", v, perm=perm,
                _shape=None if shape is None else tuple(shape[p] for p in perm))


def _last_dim(e, v):
    """v's last dimension: an int when static, else a 1-D int64 tensor of one element."""
    s = v.shape
    if s is not None and s and isinstance(s[-1], int):
        return s[-1]
    return e.Slice(e.Shape(v), [-1], [_INT64_MAX])


def _flat2d(e, v, last):
    """Reshape v to [-1, last]."""
    shape = [-1, last] if isinstance(last, int) else e.Concat(e.const(np.array([-1], np.int64)),
                                                             last, axis=0)
    return e.op("Reshape", v, shape, _shape=(None, last) if isinstance(last, int) else None)


def _matmul_shape(a, b):
    """Static numpy-matmul shape of a @ b for ranks >= 2 (None when unknown)."""
    if a is None or b is None:
        return None
    batch = broadcast_dims([a[:-2], b[:-2]])
    return None if batch is None else batch + (a[-2], b[-1])


def _lead_t(e, v, last):
    """v[..., L] as an [L, prod(...)] matrix, materialized: Reshape to [-1, L], Transpose, and a
    Reshape that keeps onnxruntime from folding the Transpose into its GEMM as transA (a
    Transpose straight on v would be merged with a Transpose that produced v into one slow
    general permutation)."""
    flat = _flat2d(e, v, last)
    t = e.op("Transpose", flat, perm=[1, 0])
    shape = [last, -1] if isinstance(last, int) else e.Concat(
        last, e.const(np.array([-1], np.int64)), axis=0)
    return e.op("Reshape", t, shape, _shape=(last, None) if isinstance(last, int) else None)


def _weight_grad(e, a, g, shape):
    """reshape(a, [-1, K])^T @ reshape(g, [-1, N]) for a[..., K], g[..., N] of one rank > 2.

    MLAS's GEMM with transA is 1.5x to 2x slower than without (K, N = 256, 1024 over 2048 rows,
    one thread: ~30 ms against ~18 ms, and the Transpose of a 2 MB operand takes 0.5 ms), so the
    smaller of the two operands is transposed explicitly and the product is a plain MatMul:
    a^T @ g, or (g^T @ a)^T when g is the narrower one."""
    ka, kg = _last_dim(e, a), _last_dim(e, g)
    if isinstance(ka, int) and isinstance(kg, int) and kg < ka:
        dbt = e.op("MatMul", _lead_t(e, g, kg), _flat2d(e, a, ka),
                   _shape=None if shape is None else shape[::-1])
        return e.op("Transpose", dbt, perm=[1, 0], _shape=shape)
    return e.op("MatMul", _lead_t(e, a, ka), _flat2d(e, g, kg), _shape=shape)


@register("MatMul")
def _matmul(n, g):
    e = n.e
    a, b = n.ins
    ra, rb = a.rank, b.rank
    if ra is None or rb is None:
        raise NotImplementedError(
            f"MatMul gradient ({n.node.name!r}) needs the ranks of both operands; run shape "
            "inference or declare the input shapes")
    if ra == 1 and rb == 1:  # dot product: y is a scalar
        return g * b, g * a
    if ra == 2 and rb == 2:  # Gemm transposes inside its kernel: no Transpose nodes
        return (e.op("Gemm", g, b, transB=1, _shape=a.shape),
                e.op("Gemm", a, g, transA=1, _shape=b.shape))
    sa, sb = a.shape, b.shape
    ys = n.y.shape if n.y.shape is not None else g.shape
    # numpy promotes a 1-D operand to a matrix ([K] -> [1, K] on the left, [K, 1] on the
    # right) and drops that axis from the result: put it back in g
    g2, g2s = g, ys
    if ra == 1:
        g2s = None if ys is None else ys[:-1] + (1, ys[-1])
        g2 = e.op("Unsqueeze", g, [-2], _shape=g2s)
    if rb == 1:
        g2s = None if ys is None else ys + (1,)
        g2 = e.op("Unsqueeze", g, [-1], _shape=g2s)
    # the promoted operands, transposed
    if ra == 1:
        a_t = e.op("Unsqueeze", a, [-1], _shape=None if sa is None else sa + (1,))
    else:
        a_t = _swap_last(e, a, ra)
    if rb == 1:
        b_t = e.op("Unsqueeze", b, [0], _shape=None if sb is None else (1,) + sb)
    else:
        b_t = _swap_last(e, b, rb)

    # dA = g @ B^T, summed over the batch dims A was broadcast along
    da_shape = _matmul_shape(g2s, b_t.shape)
    da = e.op("MatMul", g2, b_t, _shape=da_shape)
    if ra == 1:
        da = e.op("Squeeze", da, [-2], _shape=None if da_shape is None else
                  da_shape[:-2] + da_shape[-1:])
    # dB = A^T @ g, summed over the batch dims B was broadcast along
    if ra > 2 and rb <= 2:
        # the common x[..., K] @ W[K, N]: one GEMM over the flattened batch rather than a
        # batched product and a ReduceSum over the batch
        db_shape = None if sb is None else (sb + (1,) if rb == 1 else sb)
        db = _weight_grad(e, a, g2, db_shape)
    else:
        db_shape = _matmul_shape(a_t.shape, g2s)
        db = e.op("MatMul", a_t, g2, _shape=db_shape)
    if rb == 1:
        db = e.op("Squeeze", db, [-1], _shape=None if db_shape is None else db_shape[:-1])
    return n.sum_to(da, a), n.sum_to(db, b)


@register("Gemm")
def _gemm(n, g):
    # Y = alpha * A' @ B' + beta * C, A' = A^T if transA, B' = B^T if transB
    e = n.e
    a, b, c = n.ins[0], n.ins[1], n.input(2)
    alpha, beta = attr(n, "alpha"), attr(n, "beta")
    ta, tb = int(attr(n, "transA")), int(attr(n, "transB"))
    al = None if alpha == 1.0 else alpha

    def gemm(p, q, tp, tq, shape):
        return e.op("Gemm", p, q, alpha=al, transA=tp or None, transB=tq or None, _shape=shape)

    # dA' = alpha g B'^T ; dB' = alpha A'^T g ; transposed back where A or B was
    if ta == 0:
        da = gemm(g, b, 0, 1 - tb, a.shape)        # g @ B'^T
    else:
        da = gemm(b, g, tb, 1, a.shape)            # (g @ B'^T)^T = B' @ g^T
    if tb == 0:
        db = gemm(a, g, 1 - ta, 0, b.shape)        # A'^T @ g
    else:
        db = gemm(g, a, 1, ta, b.shape)            # (A'^T @ g)^T = g^T @ A'
    dc = None
    if c is not None:
        dc = n.sum_to(g, c)
        if beta != 1.0:
            dc = dc * beta
    return da, db, dc


# -- Einsum -----------------------------------------------------------------------------------
def _tokens(term: str, eq: str) -> list[str]:
    out, i = [], 0
    while i < len(term):
        if term.startswith("...", i):
            out.append("...")
            i += 3
        elif term[i].isalpha():
            out.append(term[i])
            i += 1
        else:
            raise ValueError(f"Einsum equation {eq!r}: cannot read {term!r}")
    return out


def parse_einsum(eq: str, n_inputs: int):
    """(input subscripts, output subscripts) as token lists ('...' is one token); the implicit
    output is the letters that appear once, in alphabetical order, after the ellipsis."""
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    ins = [_tokens(t, eq) for t in lhs.split(",")]
    if len(ins) != n_inputs:
        raise ValueError(f"Einsum equation {eq!r} has {len(ins)} terms for {n_inputs} inputs")
    if arrow:
        out = _tokens(rhs, eq)
    else:
        counts = Counter(t for s in ins for t in s if t != "...")
        out = (["..."] if any("..." in s for s in ins) else []) + sorted(
            t for t, k in counts.items() if k == 1)
    if len(set(out)) != len(out):
        raise ValueError(f"Einsum equation {eq!r}: an output subscript repeats")
    return ins, out


def _uniq(seq):
    return list(dict.fromkeys(seq))


@register("Einsum")
def _einsum(n, g):
    e = n.e
    eq = n.attr("equation")
    eq = eq.decode() if isinstance(eq, bytes) else eq
    xs = list(n.ins)
    ins, out = parse_einsum(eq, len(xs))

    # ellipsis: its rank in each operand (from the static ranks)
    ell = {}
    for i, s in enumerate(ins):
        if "..." in s:
            if xs[i].rank is None:
                raise NotImplementedError(
                    f"Einsum gradient ({eq!r}): an operand with '...' needs a known rank")
            ell[i] = xs[i].rank - (len(s) - 1)
    ell_rank = max(ell.values(), default=0)
    if ell and "..." not in out:
        if ell_rank:
            raise ValueError(f"Einsum equation {eq!r}: '...' in the inputs but not in the output")
        ins = [[t for t in s if t != "..."] for s in ins]
        ell = {}

    if len(set(ell.values())) > 1:  # onnx's shape inference rejects this too
        raise NotImplementedError(
            f"Einsum gradient ({eq!r}): '...' stands for different numbers of dims "
            f"{sorted(set(ell.values()))} in different operands")

    grads = []
    for i, s in enumerate(ins):
        if xs[i].dtype not in FLOAT_TYPES:
            grads.append(None)
            continue
        others = [(out, g)] + [(ins[j], xs[j]) for j in range(len(xs)) if j != i]
        avail = {t for sj, _ in others for t in sj}
        target = [t for t in _uniq(s) if t == "..." or t in avail]
        # an operand without '...' beside others with one: onnxruntime wants '...' in the
        # output too, so it goes first and is summed away below
        ell_extra = "..." in avail and "..." not in s
        if ell_extra:
            target = ["..."] + target
        if len(others) == 1 and out == target:
            d = g
        elif len(others) == 1 and "..." not in out and sorted(out) == sorted(target):
            d = e.Transpose(g, perm=[out.index(t) for t in target])
        else:
            eq_i = ",".join("".join(sj) for sj, _ in others) + "->" + "".join(target)
            d = e.Einsum(*[v for _, v in others], equation=eq_i)
        if ell_extra:
            target = target[1:]
            if ell_rank:
                d = e.reduce("ReduceSum", d, list(range(ell_rank)), keepdims=0)

        # lay d out as operand i: one axis per subscript of i ('...' expanded)
        pos, rank = [], 0
        for t in s:
            pos.append(rank)
            rank += ell_rank if t == "..." else 1
        first = {}
        for k, t in enumerate(s):
            first.setdefault(t, k)
        new_axes = [pos[k] for k, t in enumerate(s)
                    if t != "..." and (first[t] != k or t not in target)]
        if new_axes:
            d = e.Unsqueeze(d, new_axes)
        x_i = xs[i]
        # a repeated subscript reads a diagonal: the gradient lives on it, zeros elsewhere
        for t in _uniq(s):
            at = [pos[k] for k, u in enumerate(s) if u == t and t != "..."]
            for q in at[1:]:
                d = d * _eye(e, x_i, at[0], q, rank, xs[i].dtype)
        # a subscript only operand i has was summed away: its gradient is broadcast back
        if any(t != "..." and t not in avail and s.count(t) == 1 for t in s):
            d = e.op("Expand", d, e.Shape(x_i), _shape=x_i.shape)
        if "..." in s:  # ellipsis dims broadcast against other operands are summed back
            d = n.sum_to(d, x_i)
        grads.append(d)
    return tuple(grads)


def _eye(e, x, p, q, rank, dtype):
    """An identity mask on axes p and q of x's rank (size 1 on the other axes)."""
    sh = x.shape
    if sh is not None and isinstance(sh[p], int):
        k = sh[p]
        return e.const(np.eye(k).reshape([k if a in (p, q) else 1 for a in range(rank)]), dtype)
    dim = e.Gather(e.Shape(x), e.const(np.array(p, np.int64)))
    r = e.Range(e.const(np.array(0, np.int64)), dim, e.const(np.array(1, np.int64)))
    m = e.Cast(e.Equal(e.Unsqueeze(r, [1]), e.Unsqueeze(r, [0])), to=dtype)
    others = [a for a in range(rank) if a not in (p, q)]
    return e.Unsqueeze(m, others) if others else m


@register("Det", since=11)
def _det(n, g):
    x, shape = n.x, n.x.shape
    if shape is None or not isinstance(shape[-1], int):
        raise NotImplementedError(f"the gradient of Det node {n.node.name!r} needs the matrix "
                                  f"size of {x.name!r} (its last dim), which is not static")
    k, size = len(shape) - 2, shape[-1]
    g = n.e.Unsqueeze(g, [-2, -1])
    if size == 1:
        return n.e.Expand(g, n.e.Shape(x))
    others = np.array([[j for j in range(size) if j != i] for i in range(size)], np.int64)
    minors = n.e.Gather(n.e.Gather(x, others, axis=-2), others, axis=-1)  # [.., i, n-1, j, n-1]
    minors = n.e.Transpose(minors, perm=list(range(k)) + [k, k + 2, k + 1, k + 3])
    sign = n.e.const(np.fromfunction(lambda i, j: (-1.0) ** (i + j), (size, size)), x.dtype)
    return g * (n.e.Det(minors) * sign)
