"""TF's CudnnRNN family through the converter. TensorFlow has no CPU kernel for these ops, so TF
cannot give numbers: the converted forward and the converted tf.gradients graph (which TF builds
with CudnnRNNBackprop) are checked against PyTorch's nn.LSTM/GRU/RNN (cuDNN's gate order) and
the NumPy reference."""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rnn import BI, UNI, B, H, I, T, torch_canonical, torch_module, torch_run
from tf_util import ort_run, tf, tf1_graph

import onnxgrad
from onnxgrad.check import check_gradients
from onnxgrad.converters.tensorflow import convert
from onnxgrad.rnn import canonical_to_params, params_size, params_to_canonical
from onnxgrad.rnn.reference import rnn_forward


def _nd(direction):
    return 2 if direction == BI else 1


def cudnn_graph(mode, L, direction, op="CudnnRNN"):
    nd = _nd(direction)
    P = params_size(mode, L, H, I, direction)

    def build():
        x = tf.compat.v1.placeholder(tf.float32, [T, None, I], name="x")
        h = tf.compat.v1.placeholder(tf.float32, [L * nd, None, H], name="h")
        c = tf.compat.v1.placeholder(tf.float32, [L * nd, None, H], name="c")
        p = tf.compat.v1.placeholder(tf.float32, [P], name="p")
        gy = tf.compat.v1.placeholder(tf.float32, [T, None, nd * H], name="gy")
        gh = tf.compat.v1.placeholder(tf.float32, [L * nd, None, H], name="gh")
        gc = tf.compat.v1.placeholder(tf.float32, [L * nd, None, H], name="gc")
        fn = getattr(tf.raw_ops, op)
        out = fn(input=x, input_h=h, input_c=c, params=p, rnn_mode=mode, direction=direction,
                 is_training=True)
        loss = tf.reduce_sum(out[0] * gy) + tf.reduce_sum(out[1] * gh)
        if mode == "lstm":
            loss += tf.reduce_sum(out[2] * gc)
        grads = tf.gradients(loss, [x, h, c, p] if mode == "lstm" else [x, h, p])
        return [out[0], out[1]] + ([out[2]] if mode == "lstm" else []) + grads
    return build


@pytest.mark.parametrize("mode,L,direction,op", [
    ("lstm", 2, UNI, "CudnnRNN"), ("lstm", 1, BI, "CudnnRNNV2"), ("gru", 2, BI, "CudnnRNNV2"),
    ("rnn_tanh", 1, UNI, "CudnnRNN"), ("rnn_relu", 2, UNI, "CudnnRNNV2")])
def test_forward_and_backprop_match_torch(mode, L, direction, op):
    g, fetch = tf1_graph(cudnn_graph(mode, L, direction, op))
    model = convert(g.as_graph_def(add_shapes=True), outputs=[t.name for t in fetch])
    ops = {n.op_type for n in model.graph.node}
    assert op in ops and op.replace("RNN", "RNNBackprop") in ops
    m = torch_module(mode, L, direction, dtype=__import__("torch").float32)
    params = canonical_to_params(*torch_canonical(m, mode, L, direction), mode, L, H, I,
                                 direction)
    r = np.random.RandomState(1)
    nd = _nd(direction)
    x, h0, c0 = (r.randn(*s).astype(np.float32) * 0.5
                 for s in ((T, B, I), (L * nd, B, H), (L * nd, B, H)))
    gy, gh, gc = (r.randn(*s).astype(np.float32)
                  for s in ((T, B, nd * H), (L * nd, B, H), (L * nd, B, H)))
    lstm = mode == "lstm"
    feeds = {"x:0": x, "h:0": h0, "c:0": c0, "p:0": params, "gy:0": gy, "gh:0": gh}
    if lstm:
        feeds["gc:0"] = gc  # (TF's ops take input_c in every mode; only LSTM reads it)
    got = dict(zip([t.name for t in fetch], ort_run(model, feeds, [t.name for t in fetch])))
    want = torch_run(m, mode, x, h0, c0 if lstm else None, gy, gh, gc if lstm else None)
    names = [t.name for t in fetch]
    close = dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[names[0]], want["y"], **close)
    np.testing.assert_allclose(got[names[1]], want["hn"], **close)
    k = 2
    if lstm:
        np.testing.assert_allclose(got[names[2]], want["cn"], **close)
        k = 3
    np.testing.assert_allclose(got[names[k]], want["dx"], **close)
    np.testing.assert_allclose(got[names[k + 1]], want["dh0"], **close)
    if lstm:
        np.testing.assert_allclose(got[names[k + 2]], want["dc0"], **close)
    dws, dbs = torch_canonical(m, mode, L, direction, grad=True)
    np.testing.assert_allclose(got[names[-1]], canonical_to_params(dws, dbs, mode, L, H, I,
                                                                   direction), **close)
    ref = rnn_forward(x.astype(np.float64), h0, c0, params.astype(np.float64), mode, direction)
    np.testing.assert_allclose(got[names[0]], ref[0], **close)


def test_params_ops_convert():
    mode, L, direction = "gru", 2, BI
    n = 2 * 6 * L  # GRU: 6 weights and 6 biases per layer and direction

    def build():
        sizes = [tf.constant(L), tf.constant(H), tf.constant(I)]
        size = tf.raw_ops.CudnnRNNParamsSize(num_layers=sizes[0], num_units=sizes[1],
                                             input_size=sizes[2], T=tf.float32, S=tf.int32,
                                             rnn_mode=mode, direction=direction)
        p = tf.compat.v1.placeholder(tf.float32, [None], name="p")
        ws, bs = tf.raw_ops.CudnnRNNParamsToCanonical(
            num_layers=sizes[0], num_units=sizes[1], input_size=sizes[2], params=p,
            num_params=n, rnn_mode=mode, direction=direction)
        back = tf.raw_ops.CudnnRNNCanonicalToParams(
            num_layers=sizes[0], num_units=sizes[1], input_size=sizes[2], weights=ws, biases=bs,
            rnn_mode=mode, direction=direction)
        return [tf.identity(size, name="size"), tf.identity(back, name="back")] + list(ws[:2])
    g, fetch = tf1_graph(build)
    model = convert(g.as_graph_def(add_shapes=True), outputs=[t.name for t in fetch])
    P = params_size(mode, L, H, I, direction)
    params = np.random.RandomState(0).randn(P).astype(np.float32)
    size, back, w0, w1 = ort_run(model, {"p:0": params}, [t.name for t in fetch])
    assert int(np.asarray(size).reshape(-1)[0]) == P
    np.testing.assert_array_equal(back, params)
    ws, _ = params_to_canonical(params, mode, L, H, I, direction)
    np.testing.assert_array_equal(w0.reshape(-1), ws[0].reshape(-1))
    np.testing.assert_array_equal(w1.reshape(-1), ws[1].reshape(-1))


# -- CudnnRNNV3: what Keras's LSTM and GRU trace on a GPU -----------------------------------------
def _keras_cudnn(mode, lengths, go_backwards, return_sequences, tape=False):
    """A Keras LSTM/GRU layer and the graph Keras traces for it on a GPU build of TF
    (keras.src.backend.tensorflow.rnn._cudnn_lstm / _cudnn_gru: CudnnRNNV3, batch-major,
    sequence_lengths from the mask), its weights as the graph's inputs, and the loss's weights
    of the output sequence. ``tape``: the graph returns the loss and a GradientTape's gradients
    of it wrt x and the weights, taken inside the traced function (CudnnRNNBackpropV3)."""
    import importlib

    import keras
    krnn = importlib.import_module("keras.src.backend.tensorflow.rnn")
    cls = keras.layers.LSTM if mode == "lstm" else keras.layers.GRU
    layer = cls(H, return_sequences=True, return_state=True, go_backwards=go_backwards)
    layer.build((B, T, I))
    mask = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
    # what the loss reads of the sequence: the valid steps (Keras's go_backwards outputs run
    # from the last step), or the last output alone
    weight = (mask[:, ::-1] if go_backwards else mask)[..., None] * 0.5 if return_sequences \
        else np.full((B, 1, 1), 0.5)

    def f(x, m, kernel, recurrent, bias):
        if tape:
            with tf.GradientTape() as t:
                t.watch([x, kernel, recurrent, bias])
                loss = forward(x, m, kernel, recurrent, bias)[-1]
            return [loss, *t.gradient(loss, [x, kernel, recurrent, bias])]
        return forward(x, m, kernel, recurrent, bias)

    def forward(x, m, kernel, recurrent, bias):
        zeros = tf.zeros([B, H])
        if mode == "lstm":
            _, out, (h, c) = krnn._cudnn_lstm(x, zeros, zeros, kernel, recurrent, bias, m, False,
                                              go_backwards, return_sequences)
            states = [h, c]
        else:
            _, out, (h,) = krnn._cudnn_gru(x, zeros, kernel, recurrent, bias, m, False,
                                           go_backwards, return_sequences)
            states = [h]
        loss = tf.reduce_sum(out * weight.astype(np.float32)) + tf.reduce_sum(tf.square(h))
        return [out, *states, loss]
    specs = [tf.TensorSpec([B, T, I], tf.float32), tf.TensorSpec([B, T], tf.bool)] + [
        tf.TensorSpec(w.shape, tf.float32) for w in layer.weights]
    # as on a GPU build of TF (this CPU build skips the GRU gate swap cuDNN needs)
    info = dict(tf.sysconfig.get_build_info(), is_cuda_build=True, is_rocm_build=False)
    with mock.patch.object(tf.sysconfig, "get_build_info", lambda: info):
        cf = tf.function(f).get_concrete_function(*specs)
    return layer, mask, weight, cf


@settings(max_examples=8, deadline=None, derandomize=True)
@given(mode=st.sampled_from(["lstm", "gru"]), go_backwards=st.booleans(),
       return_sequences=st.booleans(),
       lengths=st.lists(st.integers(1, T), min_size=B, max_size=B))
def test_v3_from_keras_gpu_path_matches_keras(mode, go_backwards, return_sequences, lengths):
    """The graph Keras traces for an LSTM/GRU on a GPU (CudnnRNNV3) converts (it was refused),
    and gives what Keras's CPU path gives for the same weights and mask, forward and every
    gradient (inputs, kernel, recurrent kernel, bias). cuDNN outputs 0 at padded steps where
    Keras's CPU path carries the last output: the sequences are compared there masked."""
    layer, mask, weight, cf = _keras_cudnn(mode, lengths, go_backwards, return_sequences)
    names, ys = [t.name for t in cf.inputs], [t.name for t in cf.outputs]
    model = convert(cf.graph.as_graph_def(), inputs=names, outputs=ys)
    assert "CudnnRNNV3" not in {n.op_type for n in model.graph.node}
    r = np.random.RandomState(sum(lengths))
    x = r.randn(B, T, I).astype(np.float32)
    feeds = dict(zip(names, [x, mask] + [w.numpy() for w in layer.weights]))
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        out, *states = layer(xt, mask=tf.constant(mask))
        seq = out if return_sequences else out[:, -1:]  # the last output: the final state
        loss = tf.reduce_sum(seq * weight) + tf.reduce_sum(tf.square(states[0]))
    want = tape.gradient(loss, [xt] + layer.trainable_weights)
    got = ort_run(model, feeds, ys)
    close = dict(rtol=1e-4, atol=1e-5)
    # cuDNN outputs 0 at padded steps, where Keras's CPU path carries the last output
    np.testing.assert_allclose(got[0] * (weight > 0), seq.numpy() * (weight > 0), **close)
    for g, w in zip(got[1:-1], states):
        np.testing.assert_allclose(g, w.numpy(), **close)
    np.testing.assert_allclose(got[-1], loss.numpy(), **close)
    res = onnxgrad.gradients(model, ys[-1], [names[0]] + names[2:])
    grads = ort_run(res.model, feeds, res.grads)
    for g, w, what in zip(grads, want, ["x", "kernel", "recurrent_kernel", "bias"]):
        np.testing.assert_allclose(g, w.numpy(), err_msg=what, **close)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(mode=st.sampled_from(["lstm", "gru"]), go_backwards=st.booleans(),
       return_sequences=st.booleans(),
       lengths=st.lists(st.integers(1, T), min_size=B, max_size=B))
def test_v3_keras_gpu_tape_graph_matches_keras(mode, go_backwards, return_sequences, lengths):
    """A GradientTape inside the function Keras traces on a GPU (CudnnRNNBackpropV3, refused
    before): the converted gradient graph gives Keras's CPU gradients for the same weights and
    mask (inputs, kernel, recurrent kernel, bias)."""
    layer, mask, weight, cf = _keras_cudnn(mode, lengths, go_backwards, return_sequences,
                                           tape=True)
    names, ys = [t.name for t in cf.inputs], [t.name for t in cf.outputs]
    model = convert(cf.graph.as_graph_def(), inputs=names, outputs=ys)
    assert "OnnxRNNBackprop" in {n.op_type for n in model.graph.node}
    r = np.random.RandomState(sum(lengths) + 7)
    x = r.randn(B, T, I).astype(np.float32)
    got = ort_run(model, dict(zip(names, [x, mask] + [w.numpy() for w in layer.weights])), ys)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        out, *states = layer(xt, mask=tf.constant(mask))
        seq = out if return_sequences else out[:, -1:]
        loss = tf.reduce_sum(seq * weight) + tf.reduce_sum(tf.square(states[0]))
    want = [loss] + tape.gradient(loss, [xt] + layer.trainable_weights)
    for g, w, what in zip(got, want, ["loss", "x", "kernel", "recurrent_kernel", "bias"]):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-5, err_msg=what)


@pytest.mark.parametrize("mode,direction", [("lstm", BI), ("gru", UNI), ("rnn_tanh", BI)])
def test_v3_time_major_layers_match_torch_packed(mode, direction):
    """Raw CudnnRNNV3, time-major, 2 layers, with sequence lengths: torch's packed sequences on
    the same weights (zeros past each length, the state at each entry's last step, the backward
    direction starting there), forward and the gradient of x and params."""
    import torch
    L, nd = 2, _nd(direction)
    P = params_size(mode, L, H, I, direction)
    lengths = np.array([T, 2, 1], np.int32)[:B]

    def build():
        x = tf.compat.v1.placeholder(tf.float32, [T, B, I], name="x")
        p = tf.compat.v1.placeholder(tf.float32, [P], name="p")
        n = tf.compat.v1.placeholder(tf.int32, [B], name="n")
        h = tf.zeros([L * nd, B, H])
        out = tf.raw_ops.CudnnRNNV3(input=x, input_h=h, input_c=h, params=p, sequence_lengths=n,
                                    rnn_mode=mode, direction=direction, time_major=True)
        loss = tf.reduce_sum(out[0]) + tf.reduce_sum(tf.square(out[1]))
        return [tf.identity(out[0], name="y"), tf.identity(out[1], name="hn"),
                tf.identity(loss, name="loss")]
    g, _ = tf1_graph(build)
    model = convert(g.as_graph_def(add_shapes=True), outputs=["y:0", "hn:0", "loss:0"])
    m = torch_module(mode, L, direction, dtype=torch.float32)
    params = canonical_to_params(*torch_canonical(m, mode, L, direction), mode, L, H, I,
                                 direction).astype(np.float32)
    x = np.random.RandomState(2).randn(T, B, I).astype(np.float32)
    feeds = {"x:0": x, "p:0": params, "n:0": lengths}
    got_y, got_h = ort_run(model, feeds, ["y:0", "hn:0"])
    xt = torch.tensor(x, requires_grad=True)
    packed = torch.nn.utils.rnn.pack_padded_sequence(xt, torch.tensor(lengths),
                                                     enforce_sorted=False)
    out, state = m(packed)
    want_y = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=T)[0]
    want_h = state[0] if mode == "lstm" else state
    close = dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_y, want_y.detach().numpy(), **close)
    np.testing.assert_allclose(got_h, want_h.detach().numpy(), **close)
    (want_y.sum() + (want_h ** 2).sum()).backward()
    res = onnxgrad.gradients(model, "loss:0", ["x:0", "p:0"])
    dx, dp = ort_run(res.model, feeds, res.grads)
    np.testing.assert_allclose(dx, xt.grad.numpy(), **close)
    np.testing.assert_allclose(dp, canonical_to_params(
        *torch_canonical(m, mode, L, direction, grad=True), mode, L, H, I, direction), **close)
    # and central finite differences in float64 (OnnxRNN's gradient rule itself)
    report = check_gradients(model, "loss:0", ["x:0", "p:0"], feeds)
    assert report.ok, str(report)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(mode=st.sampled_from(["lstm", "gru", "rnn_tanh", "rnn_relu"]),
       direction=st.sampled_from([UNI, BI]), L=st.integers(1, 2), time_major=st.booleans(),
       lengths=st.lists(st.integers(1, T), min_size=B, max_size=B), seed=st.integers(0, 99))
def test_v3_backprop_graph_matches_torch_packed(mode, direction, L, time_major, lengths, seed):
    """TF's gradient graph through CudnnRNNV3 (tf.gradients makes CudnnRNNBackpropV3, as a tape
    through a Keras LSTM / GRU traced on a GPU does; it was refused): converted, the gradients
    of a weighted sum of the outputs wrt the input, the initial states and the params equal
    torch's packed sequences on the same weights (time- and batch-major)."""
    import torch
    lstm, nd = mode == "lstm", _nd(direction)
    P = params_size(mode, L, H, I, direction)
    r = np.random.RandomState(seed)
    x = r.randn(T, B, I).astype(np.float32)
    h0, c0 = (r.randn(L * nd, B, H).astype(np.float32) for _ in range(2))
    wy, wh, wc = r.randn(T, B, nd * H), r.randn(L * nd, B, H), r.randn(L * nd, B, H)
    bm = (lambda a: np.swapaxes(a, 0, 1)) if not time_major else (lambda a: a)  # noqa: E731

    def build():
        ph = lambda shape, name: tf.compat.v1.placeholder(tf.float32, shape, name=name)  # noqa
        xt, ht, pt = ph(bm(x).shape, "x"), ph(bm(h0).shape, "h"), ph([P], "p")
        ct = ph(bm(c0).shape, "c") if lstm else tf.zeros([])
        n = tf.compat.v1.placeholder(tf.int32, [B], name="n")
        out = tf.raw_ops.CudnnRNNV3(input=xt, input_h=ht, input_c=ct, params=pt,
                                    sequence_lengths=n, rnn_mode=mode, direction=direction,
                                    time_major=time_major)
        loss = tf.reduce_sum(out[0] * bm(wy).astype(np.float32)) + \
            tf.reduce_sum(out[1] * bm(wh).astype(np.float32))
        if lstm:
            loss += tf.reduce_sum(out[2] * bm(wc).astype(np.float32))
        wrt = [xt, ht, ct, pt] if lstm else [xt, ht, pt]
        return [tf.identity(g, name=f"d{i}") for i, g in enumerate(tf.gradients(loss, wrt))]
    g, grads = tf1_graph(build)
    model = convert(g.as_graph_def(add_shapes=True), outputs=[t.name for t in grads])
    assert "OnnxRNNBackprop" in {n.op_type for n in model.graph.node}
    m = torch_module(mode, L, direction, dtype=torch.float64)
    params = canonical_to_params(*torch_canonical(m, mode, L, direction), mode, L, H, I,
                                 direction).astype(np.float32)
    feeds = {"x:0": bm(x), "h:0": bm(h0), "p:0": params, "n:0": np.array(lengths, np.int32)}
    if lstm:
        feeds["c:0"] = bm(c0)
    got = ort_run(model, feeds, [t.name for t in grads])
    xt, ht, ct = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, h0, c0))
    packed = torch.nn.utils.rnn.pack_padded_sequence(xt, torch.tensor(lengths),
                                                     enforce_sorted=False)
    out, state = m(packed, (ht, ct) if lstm else ht)
    y = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=T)[0]
    states = state if lstm else (state,)
    loss = (y * torch.tensor(wy)).sum() + (states[0] * torch.tensor(wh)).sum()
    if lstm:
        loss = loss + (states[1] * torch.tensor(wc)).sum()
    loss.backward()
    want = [bm(xt.grad.numpy()), bm(ht.grad.numpy())] + ([bm(ct.grad.numpy())] if lstm else [])
    want.append(canonical_to_params(*torch_canonical(m, mode, L, direction, grad=True), mode, L,
                                    H, I, direction))
    for gv, wv, what in zip(got, want, ["x", "h", "c", "p"] if lstm else ["x", "h", "p"]):
        np.testing.assert_allclose(gv, wv, rtol=1e-4, atol=1e-4, err_msg=what)