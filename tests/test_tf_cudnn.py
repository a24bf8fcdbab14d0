"""TF's CudnnRNN family through the converter. TensorFlow has no CPU kernel for these ops, so TF
cannot give numbers: the converted forward and the converted tf.gradients graph (which TF builds
with CudnnRNNBackprop) are checked against PyTorch's nn.LSTM/GRU/RNN (cuDNN's gate order) and
the NumPy reference."""
from __future__ import annotations

import numpy as np
import pytest
from test_rnn import BI, UNI, B, H, I, T, torch_canonical, torch_module, torch_run
from tf_util import ort_run, tf, tf1_graph

from onnxgrad.converters.tensorflow import ConversionError, convert
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


def test_v3_is_a_clear_error():
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [T, B, I], name="x")
        h = tf.zeros([1, B, H])
        p = tf.zeros([params_size("lstm", 1, H, I)])
        out = tf.raw_ops.CudnnRNNV3(input=x, input_h=h, input_c=h, params=p,
                                    sequence_lengths=tf.fill([B], T))
        return out[0]
    g, y = tf1_graph(build)
    with pytest.raises(ConversionError, match="CudnnRNNV3"):
        convert(g.as_graph_def(), outputs=[y.name])
