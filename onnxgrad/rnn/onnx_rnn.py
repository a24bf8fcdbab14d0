"""Gradients of ONNX's own LSTM, GRU and RNN ops, through the CudnnRNN op family.

The rule rearranges the node's W, R and B (ONNX gate order i, o, f, c for LSTM and z, r, h for GRU;
one [num_directions, ...] tensor each) into cuDNN's flat params buffer with standard ops (Reshape,
Gather of the gate blocks, Concat), **replaces the node by the forward op of the family** (which
also returns the reserve_space that backward reads; its output, output_h and output_c, put back
into ONNX's layout, take over the node's outputs: their uses, graph outputs and names), so the
forward runs once, then emits the backward op and maps params_backprop back to the shapes of W,
R and B (the inverse gather). A one-layer ONNX node is num_layers=1; direction "bidirectional" is
cuDNN's bidirectional; "reverse" runs the forward direction on the time-reversed sequence. The
gradient model thus has no ai.onnx LSTM/GRU node left (it runs in float64 and with layout=1 on
onnxruntime, whose kernels have neither); the rule returns its gradients by value
(``Grads(captured=...)``), the node being gone.

* cuDNN's cell (LSTM without peepholes, GRU with linear_before_reset=1, RNN Tanh/Relu; no clip):
  CudnnRNNV2 -> CudnnRNNBackpropV2.
* The cell options cuDNN lacks (GRU linear_before_reset=0, LSTM peepholes P, clip): the same
  pair with those options, ``onnxgrad.OnnxRNN`` -> ``onnxgrad.OnnxRNNBackprop`` (same params
  layout and bodies, see :mod:`onnxgrad.rnn.ops`).
* RNN without clip keeps its node: its reserve_space is the sequence of hidden states, which is
  the node's own output Y (rearranged); LSTM and GRU save gate activations that Y does not hold,
  so their node (and a clipped or masked RNN's) is replaced as above.

* ``sequence_lens`` (variable-length batches; a run-time input or a constant that is not the
  sequence length everywhere): the ``.seq`` variant of OnnxRNN/OnnxRNNBackprop, which takes
  sequence_lens as its last input and masks each step (``t < sequence_lens[b]``): a padded step
  carries h and c unchanged and outputs 0 (onnxruntime's semantics; the reverse direction starts
  at step sequence_lens[b] - 1). "reverse" then reverses each batch entry's valid steps
  (ReverseSequence) instead of the whole time axis, and an RNN's forward is recomputed (its Y is
  0 at padded steps, not the carried state). A sequence_lens that is a constant equal to the
  static sequence length everywhere is ignored (the plain path). Entries must be in [1, T].

Supported: every direction, layout 0 and 1, initial_h / initial_c given or absent, B given or
absent, clip, linear_before_reset 0 and 1, peepholes, default activations (and RNN's Relu),
sequence_lens absent, constant or computed at run time.
Not supported (NotImplementedError naming the node): other activations and input_forget=1.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..registry import Grads, register
from .ops import DOMAIN, MIN_OPSET, Variant, _host_reserved, overload_key

_INT_MIN, _INT_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)

#: cuDNN gate k comes from ONNX gate _PERM[op][k]; _INV the other way
_PERM = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}
_INV = {op: [p.index(k) for k in range(len(p))] for op, p in _PERM.items()}
_DEFAULT_ACTS = {"LSTM": ["sigmoid", "tanh", "tanh"], "GRU": ["sigmoid", "tanh"],
                 "RNN": ["tanh"]}


def _fail(n, what):
    node = n.node
    raise NotImplementedError(
        f"onnxgrad has no gradient for {node.op_type} node {node.name!r} with {what}; supported: "
        "default activations (RNN: Tanh or Relu) and input_forget=0")


def _mode(n, op):
    acts = [a.lower() if isinstance(a, str) else a.decode().lower()
            for a in (n.attr("activations") or [])]
    nd = 2 if n.attr("direction", "forward") == "bidirectional" else 1
    if op == "RNN":
        acts = acts or ["tanh"] * nd
        if len(set(acts)) == 1 and acts[0] in ("tanh", "relu") and len(acts) == nd:
            return "rnn_" + acts[0]
        _fail(n, f"activations={acts}")
    want = _DEFAULT_ACTS[op] * nd
    if acts and acts != want:
        _fail(n, f"activations={acts}")
    return op.lower()


def _seq_lens(n, T):
    """The node's sequence_lens when it needs masking; None when absent or a constant equal to
    the static sequence length everywhere."""
    if n.input(4) is None:
        return None
    lens = n.const(4)
    if lens is not None and isinstance(T, int) and np.all(np.asarray(lens) == T):
        return None
    return n.input(4)


def _flip(e, x):
    """x reversed along axis 0 (time)."""
    return e.Slice(x, [-1], [_INT_MIN], [0], [-1])


def _gates(e, w, perm, nd):
    """[nd, G*H, K] -> [nd, G*H*K], gate blocks reordered by perm (each block H*K contiguous)."""
    return e.Reshape(e.Gather(e.Reshape(w, [nd, len(perm), -1]), perm, axis=1), [nd, -1])


def _zeros(e, shape, dtype):
    return e.op("ConstantOfShape", shape, value=ir.tensor(np.array([0], dtype=dtype.numpy())),
                _dtype=dtype)


def _replace_node(e, f, node, fwd, lstm, nd, layout, direction, flip):
    """Put the family's forward op (built by the scratch emitter ``f``) in place of the ONNX
    node: its outputs in ONNX's form (Y [T, nd, B, H] or layout 1's [B, T, nd, H]; Y_h, Y_c
    [nd, B, H] or [B, nd, H]) take over the node's outputs (:meth:`Emitter.replace`)."""
    y = fwd[0]
    if direction == "reverse":
        y = flip(f, y)
    y = f.Reshape(y, [0, 0, nd, -1])  # [T, B, nd * H] -> [T, B, nd, H]
    new = [f.Transpose(y, perm=[1, 0, 2, 3] if layout else [0, 2, 1, 3]),
           f.Transpose(fwd[1], perm=[1, 0, 2]) if layout else fwd[1]]
    if lstm:
        new.append(f.Transpose(fwd[2], perm=[1, 0, 2]) if layout else fwd[2])
    e.replace(node, f, new)


def _weight_grads(e, op, dp, W, R, Bias, nd, G):
    """(dW, dR, dB or None): params_backprop mapped back to the shapes of W, R and B (the
    inverse of the gate gather)."""
    sW, sR = e.Reshape(e.Size(W), [1]), e.Reshape(e.Size(R), [1])
    wr = e.Reshape(e.Slice(dp, [0], e.Add(sW, sR)), [nd, -1])
    dWp, dRp = e.op("Split", wr, e.Concat(e.Div(sW, [nd]), e.Div(sR, [nd]), axis=0), axis=1,
                    _outputs=2)
    inv = _INV[op]
    back = lambda v, like, idx: e.Reshape(  # noqa: E731
        e.Gather(e.Reshape(v, [nd, len(idx), -1]), idx, axis=1), e.Shape(like))
    dB = None
    if Bias is not None:
        dB = back(e.Slice(dp, e.Add(sW, sR), [_INT_MAX]), Bias,
                  inv + [G + p for p in inv]).with_shape(Bias.shape)
    return back(dWp, W, inv).with_shape(W.shape), back(dRp, R, inv).with_shape(R.shape), dB


@register(["LSTM", "GRU", "RNN"], since=7)
def _onnx_rnn(n, g):
    op = n.node.op_type
    e = n.e
    mode = _mode(n, op)
    lstm = op == "LSTM"
    direction = n.attr("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ValueError(f"{op} node {n.node.name!r}: direction={direction!r}")
    nd = 2 if direction == "bidirectional" else 1
    layout = n.attr("layout", 0)
    if lstm and n.attr("input_forget", 0):
        _fail(n, "input_forget=1")
    clip = n.attr("clip")
    lbr = n.attr("linear_before_reset", 0) if op == "GRU" else 1
    X, W, R = n.ins[:3]
    Bias = n.input(3)
    h0 = n.input(5)
    c0 = n.input(6) if lstm else None
    P = n.input(7) if lstm else None
    xs = X.shape
    T = (xs[1] if layout else xs[0]) if xs is not None and len(xs) == 3 else None
    lens = _seq_lens(n, T)
    variant = Variant(lbr, clip is not None, P is not None, seq=lens is not None)
    # CastLike for the clip bound (15); at 15 onnxruntime finds no shape for a Scan body's
    # output of the clipped cell and refuses the step: 16
    e.need(16 if variant.clip else MIN_OPSET)
    dt = X.dtype
    G = len(_PERM[op])

    # The forward op of the family replaces the node itself (it returns Y, Y_h, Y_c and the
    # reserve_space that backward reads), so the forward runs once. Its inputs and the op are
    # built in a scratch graph and moved in front of the node; the node's outputs are rewired.
    # An RNN without clip or sequence_lens keeps its node: its Y is its reserve_space.
    # (layout 1 is replaced too: onnxruntime's RNN kernel refuses it)
    reuse_y = mode.startswith("rnn") and not variant.clip and not variant.seq and not layout and \
        bool(n.outs) and n.outs[0] is not None and bool(n.outs[0].name)  # (Y may be omitted)
    node = n.node
    replace = not reuse_y and node.graph is not None
    f = e.scratch() if replace else e

    # -- inputs in cuDNN's time-major form -------------------------------------------------
    x = f.Transpose(X, perm=[1, 0, 2]) if layout else X
    lens64 = f.Cast(lens, to=ir.DataType.INT64) if lens is not None else None

    def flip(em, v):
        if lens64 is not None:
            return em.ReverseSequence(v, lens64, batch_axis=1, time_axis=0)
        return _flip(em, v)

    if direction == "reverse":
        x = flip(f, x)
    sx = f.Shape(x)
    H = f.Slice(f.Shape(R), [2], [3])
    state_shape = f.Concat(f.const(np.array([nd], np.int64)), f.Slice(sx, [1], [2]), H, axis=0)

    def state(em, v):
        if v is None:
            return _zeros(em, state_shape, dt)
        return em.Transpose(v, perm=[1, 0, 2]) if layout else v

    h = state(f, h0)
    c = state(f, c0) if lstm else h
    perm = _PERM[op]
    weights = f.Concat(_gates(f, W, perm, nd), _gates(f, R, perm, nd), axis=1)
    if Bias is None:  # nd * 2 * G * H zeros = 2 * Size(R) / H
        biases = _zeros(f, f.Div(f.Reshape(f.Mul(f.Size(R), f.const(np.array(2, np.int64))),
                                           [1]), H), dt)
    else:
        biases = _gates(f, Bias, perm + [G + p for p in perm], nd)
    params = f.Concat(f.Reshape(weights, [-1]), f.Reshape(biases, [-1]), axis=0)

    # -- forward: the family's op in place of the node (or, for an RNN, its own Y) -----------
    cudnn_dir = "bidirectional" if nd == 2 else "unidirectional"
    key = overload_key(mode, cudnn_dir, "linear_input", 1, variant)
    ex = variant.onnx_options
    attrs = dict(rnn_mode=mode, direction=cudnn_dir)
    if ex:
        attrs.update(linear_before_reset=lbr, **({"clip": float(clip)} if variant.clip else {}))
    ex_ins = ([P] if variant.peep else []) if lens is None else [P, lens]
    if reuse_y:
        # the reserve_space of an RNN is its hidden states: Y as [nd, T, B, H], flattened
        Y = n.outs[0]
        ys = e.Transpose(Y, perm=[2, 1, 0, 3] if layout else [1, 0, 2, 3])
        if direction == "reverse":
            ys = e.Slice(ys, [-1], [_INT_MIN], [1], [-1])
        reserve = e.Reshape(ys, [-1])
        fwd = [x, h, c, reserve]  # output/output_h/output_c: the body does not read them
        host = e.const(_host_reserved(mode, cudnn_dir, "linear_input", 1))
    else:
        n_out = 4 if ex else 5
        fwd = f.op("OnnxRNN" if ex else "CudnnRNNV2", x, h, c, params, *ex_ins,
                   _outputs=n_out, _domain=DOMAIN, _dtype=[dt] * 4 + [ir.DataType.INT8],
                   **attrs)
        fwd[0].value.producer().overload = key
        host = None if ex else fwd[4]
        reserve = fwd[3]
        if replace:
            node_inputs = list(node.inputs)  # the node goes: its gradients go by value
            _replace_node(e, f, node, fwd, lstm, nd, layout, direction, flip)

    # -- cotangents in cuDNN's form --------------------------------------------------------
    gY, gYh = n.gs[0], n.gs[1] if len(n.gs) > 1 else None
    gYc = n.gs[2] if lstm and len(n.gs) > 2 else None
    if gY is None:
        dy = _zeros(e, e.Concat(e.Slice(sx, [0], [2]), e.Mul(H, [nd]), axis=0), dt)
    else:  # [T, nd, B, H] (layout 1: [B, T, nd, H]) -> [T, B, nd * H]
        dy = e.Reshape(e.Transpose(gY, perm=[1, 0, 2, 3] if layout else [0, 2, 1, 3]),
                       [0, 0, -1])
        if direction == "reverse":
            dy = flip(e, dy)
    dhn = _zeros(e, state_shape, dt) if gYh is None else state(e, gYh)
    dcn = (_zeros(e, state_shape, dt) if gYc is None else state(e, gYc)) if lstm else dhn

    # -- backward ---------------------------------------------------------------------------
    bwd_ins = [x, h, c, params, fwd[0], fwd[1], fwd[2], dy, dhn, dcn, reserve]
    if ex:
        bwd_ins += ex_ins
    else:
        bwd_ins.append(host)
    n_out = 5 if variant.peep else 4
    res = e.op("OnnxRNNBackprop" if ex else "CudnnRNNBackpropV2", *bwd_ins, _outputs=n_out,
               _domain=DOMAIN, _dtype=[dt] * n_out, **attrs)
    # outputs nobody reads are left unnamed, and the body skips them: input_backprop when X is
    # data (a MatMul over all steps), params_backprop when W, R and B are all frozen (several)
    want_x, want_p = n.wants(X), any(n.wants(v) for v in (W, R, Bias) if v is not None)
    res[0].value.producer().overload = overload_key(
        mode, cudnn_dir, "linear_input", 1, variant.skipping(not want_x, not want_p))
    dx, dh0, dc0, dp = res[:4]

    # -- back to the node's shapes ---------------------------------------------------------
    if not want_x:
        dx.value.name, dx = "", None
    elif direction == "reverse":
        dx = flip(e, dx)
    if dx is not None and layout:
        dx = e.Transpose(dx, perm=[1, 0, 2])
    dW = dR = dB = None
    if want_p:
        dW, dR, dB = _weight_grads(e, op, dp, W, R, Bias, nd, G)
    else:
        dp.value.name = ""
    unstate = lambda v: e.Transpose(v, perm=[1, 0, 2]) if layout else v  # noqa: E731
    grads = [None if dx is None else dx.with_shape(X.shape), dW, dR, dB, None,
             None if h0 is None else unstate(dh0).with_shape(h0.shape)]
    if lstm:
        grads.append(None if c0 is None else unstate(dc0).with_shape(c0.shape))
        grads.append(None if P is None else res[4].with_shape(P.shape))
    grads = tuple(grads[:len(n.ins)])
    if not replace:
        return grads
    return Grads.by_value(e, node_inputs, grads)
