"""Gradient rules: the com.microsoft ops that onnxruntime's graph optimizer writes into a model
saved after its optimizations (``SessionOptions.optimized_model_filepath``): Gelu, FastGelu,
BiasGelu, QuickGelu, FusedMatMul, FusedGemm, FusedConv, SkipLayerNormalization and
SkipSimplifiedLayerNormalization; and Attention, MultiHeadAttention and EmbedLayerNormalization,
which its transformers optimizer (``onnxruntime.transformers.optimizer``) writes for BERT-like
models (MultiHeadAttention for T5, BART and Whisper, and with ``use_multi_head_attention``).

The forward keeps onnxruntime's fused kernel. Each rule emits the op's expansion into standard ops
(what the kernel computes: tests/test_rules_contrib.py runs the kernel against PyTorch) and lets
the sweep differentiate it (:func:`~onnxgrad.rules.function.differentiate_expansion`), so the gradient
graph holds standard ops only and every derivative is one of the audited rules. Expansion nodes
that no gradient reads (FusedMatMul's product, Conv's output) are dropped. FusedConv and FusedGemm
take the activation's derivative from the fused output where it is a function of it (Relu, Tanh,
Sigmoid, HardSigmoid; LeakyRelu with alpha >= 0), so the convolution is not computed twice.
onnx's shape inference knows none of these ops: :mod:`onnxgrad.inference` types their outputs
from stand-ins of the same shapes.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ..inference import CONV_ATTRS
from ..registry import register, table
from .function import differentiate_expansion as _expand
from .spec import attr

MS = "com.microsoft"
INT64 = ir.DataType.INT64
_SQRT_2_PI = math.sqrt(2 / math.pi)


def _gelu(e, x):
    return 0.5 * x * (1 + e.Erf(x * (1 / math.sqrt(2))))


def _tanh_gelu(e, x):
    return 0.5 * x * (1 + e.Tanh(_SQRT_2_PI * (x + 0.044715 * x * x * x)))


def _biased(n):
    return n.x if n.input(1) is None else n.x + n.input(1)


table({
    "Gelu": lambda n, g: _expand(n, lambda e: [_gelu(e, n.x)]),
    "BiasGelu": lambda n, g: _expand(n, lambda e: [_gelu(e, _biased(n))]),
    "FastGelu": lambda n, g: _expand(n, lambda e: [_tanh_gelu(e, _biased(n))]),
    "QuickGelu": lambda n, g: _expand(n, lambda e: [n.x * e.Sigmoid(n.x * attr(n, "alpha"))]),
}, domain=MS)


# -- FusedMatMul ---------------------------------------------------------------------------------
def _operand(e, v, trans: bool, trans_batch: bool, side: str):
    """op(v) of FusedMatMul: transBatch moves dim 0 behind the batch dims, trans swaps the last
    two (onnxruntime's kernel; a rank-1 operand takes neither)."""
    if not (trans or trans_batch):
        return v
    r = v.rank
    if r is None or r < 2 or (trans_batch and r < 3):
        raise NotImplementedError(
            f"FusedMatMul with trans{side}={int(trans)}, transBatch{side}={int(trans_batch)} "
            f"needs operand {side} of known rank >= {3 if trans_batch else 2} (rank {r})")
    perm = list(range(1, r - 1)) + [0, r - 1] if trans_batch else list(range(r))
    if trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return e.Transpose(v, perm=perm)


@register("FusedMatMul", domain=MS)
def _fused_matmul(n, g):
    alpha = float(attr(n, "alpha"))

    def build(e):
        a = _operand(e, n.ins[0], attr(n, "transA"), attr(n, "transBatchA"), "A")
        b = _operand(e, n.ins[1], attr(n, "transB"), attr(n, "transBatchB"), "B")
        p = e.MatMul(a, b)
        return [p if alpha == 1.0 else p * alpha]
    return _expand(n, build)


# -- layer norms with a skip connection ----------------------------------------------------------
def _skip_norm(n, simplified: bool):
    """output = norm(s) * gamma (+ beta), s = input + skip (+ bias) over the last axis; outputs
    1 and 2 (the mean and 1/std onnxruntime's training kernels keep, in float32 whatever the
    input's dtype) are refused as differentiation targets."""
    if any(g is not None for g in n.gs[1:3]):
        raise NotImplementedError(
            f"{n.node.op_type}'s mean and inv_std_var outputs are on the path: only output 0 "
            "and input_skip_bias_sum are differentiated")
    eps = float(attr(n, "epsilon"))
    x, skip, gamma = n.ins[0], n.ins[1], n.ins[2]
    beta, bias = (None, n.input(3)) if simplified else (n.input(3), n.input(4))

    def build(e):
        s = x + skip if bias is None else x + skip + bias
        return [_layer_norm(e, s, gamma, beta, eps, simplified), None, None, s]
    return _expand(n, build)


def _layer_norm(e, s, gamma, beta, eps, simplified=False):
    """(s - mean) / sqrt(var + eps) * gamma (+ beta) over the last axis; RMSNorm (no mean,
    mean(s^2) for var) when simplified."""
    d = s if simplified else s - e.reduce("ReduceMean", s, [-1])
    y = d / e.Sqrt(e.reduce("ReduceMean", d * d, [-1]) + eps) * gamma
    return y if beta is None else y + beta


register("SkipLayerNormalization", domain=MS)(lambda n, g: _skip_norm(n, False))
register("SkipSimplifiedLayerNormalization", domain=MS)(lambda n, g: _skip_norm(n, True))


# -- FusedConv, FusedGemm: a Conv or Gemm and an activation --------------------------------------
def _activation(n):
    """(name, params) of the fused activation; FusedConv gives its parameters as
    activation_params, FusedGemm as activation_alpha / activation_beta."""
    name = attr(n, "activation")
    if n.node.op_type == "FusedConv":
        params = list(n.attr("activation_params") or [])
    else:
        params = [p for p in (n.attr("activation_alpha"), n.attr("activation_beta"))
                  if p is not None]
    known = {"Relu": 0, "Tanh": 0, "Sigmoid": 0, "LeakyRelu": 1, "HardSigmoid": 2, "Clip": 2}
    if name not in known or len(params) < known[name]:
        raise NotImplementedError(
            f"{n.node.op_type} with activation {name!r} and parameters {params}: onnxruntime "
            f"fuses {sorted(known)} (LeakyRelu with alpha, HardSigmoid and Clip with two)")
    return name, [float(p) for p in params]


def _activation_grad(e, name, params, y, g):
    """dL/d(pre-activation) from the fused output y where the activation's derivative is a
    function of y (the forward rules' own forms); None where it is not."""
    zero = e.const(0, g.dtype)
    if name == "Relu" or (name == "LeakyRelu" and params[0] >= 0):
        slope = zero if name == "Relu" else g * params[0]
        return e.Where(e.Greater(y, e.const(0, y.dtype)), g, slope)
    if name == "Sigmoid":
        return g * y * (1 - y)
    if name == "Tanh":
        return g * (1 - y * y)
    if name == "HardSigmoid":
        inside = e.And(e.Greater(y, zero), e.Less(y, e.const(1, y.dtype)))
        return e.Where(inside, g * params[0], zero)
    return None


def _apply(e, name, params, t):
    if name == "LeakyRelu":
        return e.LeakyRelu(t, alpha=params[0])
    if name == "HardSigmoid":
        return e.HardSigmoid(t, alpha=params[0], beta=params[1])
    if name == "Clip":
        return e.Clip(t, e.const(params[0], t.dtype), e.const(params[1], t.dtype))
    return e.op(name, t)


def _fused(n, g, linear):
    """Gradient of act(linear(e)): seeded at linear's output with the activation's derivative
    read off the output, else through the activation recomputed."""
    name, params = _activation(n)
    gz = _activation_grad(n.e, name, params, n.y, g)
    if gz is not None:
        return _expand(n, lambda e: [linear(e)], [gz])
    return _expand(n, lambda e: [_apply(e, name, params, linear(e))])


@register("FusedConv", domain=MS)
def _fused_conv(n, g):
    attrs = {k: attr(n, k) for k in CONV_ATTRS if n.attr(k) is not None}
    x, w, b, z = n.ins[0], n.ins[1], n.input(2), n.input(3)

    def conv(e):
        y = e.Conv(x, w, b, **attrs)
        return y if z is None else y + z
    return _fused(n, g, conv)


@register("FusedGemm", domain=MS)
def _fused_gemm(n, g):
    attrs = {k: attr(n, k) for k in ("alpha", "beta", "transA", "transB")}
    return _fused(n, g, lambda e: e.Gemm(*n.ins[:2], n.input(2), **attrs))


# -- BERT's attention and embeddings (onnxruntime's transformers optimizer) ----------------------
def _heads(e, t, n_heads):
    """[B, S, N*d] -> [B, N, S, d]."""
    return e.Transpose(e.Reshape(t, [0, 0, n_heads, -1]), perm=[0, 2, 1, 3])


def _masked(e, n, mask, scores, fill):
    """The scores with the masks applied, as onnxruntime's kernel does: ``fill``
    (mask_filter_value) added where mask_index masks a key (key lengths [B] for right padding,
    a key mask [B, T] or an attention mask [B, S, T], 0 meaning masked), and keys after the
    query left out altogether under unidirectional=1 (-inf: a query whose every earlier key is
    padding attends those, not the future ones). Only with as many keys as queries: where they
    differ, onnxruntime 1.31's CPU MultiHeadAttention follows no alignment of the two that we
    could find (measured), so the expansion fails at run time in a Reshape instead."""
    dims = e.Shape(scores)

    def arange(axis):  # 0 .. dims[axis] - 1, int64
        return e.Range(e.const(0, INT64), e.Squeeze(e.Slice(dims, [axis], [axis + 1]), [0]),
                       e.const(1, INT64))
    if mask is not None:
        rank = mask.rank
        if rank == 1:  # Reshape to [B]: a [2B] end/start index fails here, not silently
            lengths = e.Cast(e.Reshape(mask, e.Slice(dims, [0], [1])), to=INT64)
            masked = e.Unsqueeze(e.GreaterOrEqual(e.Unsqueeze(arange(3), [0]),
                                                  e.Unsqueeze(lengths, [1])), [1, 2])
        elif rank in (2, 3):
            masked = e.Unsqueeze(e.Not(e.Greater(mask, e.const(0, mask.dtype))),
                                 [1, 2] if rank == 2 else [1])
        else:
            raise NotImplementedError(
                f"{n.node.op_type} node {n.node.name!r}: "
                f"{'mask_index' if n.node.op_type == 'Attention' else 'key_padding_mask'} of "
                f"rank {rank}: onnxgrad takes key lengths [B], a key mask [B, T] or an "
                "attention mask [B, S, T]")
        zero = e.const(0, scores.dtype)
        scores = scores + e.Where(masked, e.const(fill, scores.dtype), zero)
    if attr(n, "unidirectional"):
        keys = arange(3)
        queries = e.Reshape(arange(2), e.Shape(keys))  # as many as keys, or a run-time error
        future = e.Greater(e.Unsqueeze(keys, [0]), e.Unsqueeze(queries, [1]))
        scores = e.Where(future, e.const(-np.inf, scores.dtype), scores)
    return scores


def _attend(e, n, q, k, v, heads, scale, attention_bias, mask):
    """Merged heads of softmax(q k^T * scale + attention_bias + mask) v; q, k, v [B, *, N*d]."""
    q, k, v = (_heads(e, t, heads) for t in (q, k, v))
    scores = (q @ e.Transpose(k, perm=[0, 1, 3, 2])) * scale
    if attention_bias is not None:  # [B or 1, N or 1, S, T]
        scores = scores + attention_bias
    fill = attr(n, "mask_filter_value")
    p = e.Softmax(_masked(e, n, mask, scores, -10000.0 if fill is None else fill), axis=-1)
    return e.Reshape(e.Transpose(p @ v, perm=[0, 2, 1, 3]), [0, 0, -1])


def _no_state(n, inputs):
    """Refuse past state and the present/qk outputs (a decoder's key-value cache)."""
    for i, what in inputs:
        if n.input(i) is not None:
            raise NotImplementedError(f"{n.node.op_type} with a {what} input")
    if any(gy is not None for gy in n.gs[1:]):
        raise NotImplementedError(f"{n.node.op_type} with a present or qk output on the path")


@register("Attention", domain=MS)
def _ms_attention(n, g):
    """output = concat over heads of softmax(q k^T * scale + attention_bias + mask) v,
    [q, k, v] = input @ weights + bias (without past state or rotary embedding)."""
    _no_state(n, ((4, "past"), (6, "past_sequence_length")))
    if attr(n, "do_rotary"):
        raise NotImplementedError("Attention with a rotary embedding")
    heads = int(attr(n, "num_heads"))
    x, w, bias, mask = n.ins[0], n.ins[1], n.input(2), n.input(3)
    sizes = attr(n, "qkv_hidden_sizes")
    if not sizes:
        if w.shape is None or not isinstance(w.shape[-1], int):
            raise NotImplementedError("Attention needs a static weights shape (or "
                                      "qkv_hidden_sizes)")
        sizes = [w.shape[-1] // 3] * 3
    scale = attr(n, "scale") or 1 / math.sqrt(sizes[0] // heads)

    def build(e):
        qkv = x @ w if bias is None else x @ w + bias
        q, k, v = e.Split(qkv, sizes, axis=-1, _outputs=3)
        return [_attend(e, n, q, k, v, heads, scale, n.input(5), mask)]
    return _expand(n, build)


@register("MultiHeadAttention", domain=MS)
def _ms_multi_head_attention(n, g):
    """output = concat over heads of softmax(q k^T * scale + attention_bias + mask) v with
    [q, k, v] = [query, key, value] + bias, from separate 3-D query, key and value (self or
    cross attention; not the packed QKV/KV or [B, N, T, d] key forms, nor past state)."""
    _no_state(n, ((6, "past_key"), (7, "past_value"), (8, "past_sequence_length"),
                  (9, "cache_indirection")))
    query, key, value, bias, mask = (n.input(i) for i in range(5))
    if key is None or value is None or any(t.rank != 3 for t in (query, key, value)):
        raise NotImplementedError(
            "MultiHeadAttention takes 3-D query, key and value here (not packed QKV or KV, "
            "nor a [batch, heads, length, head_size] key and value)")
    heads = int(attr(n, "num_heads"))
    hidden, v_hidden = query.shape[-1], value.shape[-1]
    if not isinstance(hidden, int) or (bias is not None and not isinstance(v_hidden, int)):
        raise NotImplementedError("MultiHeadAttention needs static hidden sizes")
    scale = attr(n, "scale") or 1 / math.sqrt(hidden // heads)

    def build(e):
        q, k, v = query, key, value
        if bias is not None:
            bq, bk, bv = e.Split(bias, [hidden, hidden, v_hidden], axis=0, _outputs=3)
            q, k, v = q + bq, k + bk, v + bv
        return [_attend(e, n, q, k, v, heads, scale, n.input(5), mask)]
    return _expand(n, build)


@register("EmbedLayerNormalization", domain=MS)
def _embed_layer_norm(n, g):
    """s = word_embedding[input_ids] + position_embedding[position_ids or 0..S-1]
    (+ segment_embedding[segment_ids]); output = LayerNorm(s) * gamma + beta; embedding_sum = s."""
    ids, seg_ids, word, pos, seg, gamma, beta = (n.input(i) for i in range(7))
    pos_ids, eps = n.input(8), float(attr(n, "epsilon"))

    def build(e):
        if pos_ids is None:
            count = e.Slice(e.Shape(ids), [1], [2])
            at = e.Range(e.const(0, INT64), e.Squeeze(count, [0]), e.const(1, INT64))
        else:
            at = pos_ids
        s = e.Gather(word, ids) + e.Gather(pos, at)
        if seg is not None and seg_ids is not None:
            s = s + e.Gather(seg, seg_ids)
        return [_layer_norm(e, s, gamma, beta, eps), None, s]
    return _expand(n, build)
