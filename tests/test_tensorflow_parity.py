"""onnxgrad against TensorFlow (control flow v1: TensorArrayV3 / TensorArrayGradV3 inside
tf.while_loop) and against PyTorch autograd, on the dynamic-RNN-with-TensorArray computation."""
import numpy as np
import pytest

import onnxgrad
from onnxgrad.check import to_float64
from onnxgrad.runtime import run
from test_control_flow import ta_rnn_model

T, B, D, H = 4, 2, 2, 3


def _values(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((T, B, D)), "h0": rng.standard_normal((B, H)) * 0.5,
            "u": rng.standard_normal((D, H)) * 0.7, "w": rng.standard_normal((H, H)) * 0.5,
            "c1": rng.standard_normal((T, B, H)), "c2": rng.standard_normal((B, H))}


def _onnxgrad(v):
    """d(sum(outs * c1) + sum(hT * c2)) / d(x, h0, u, w) from the ONNX Loop, in float64."""
    m = to_float64(ta_rnn_model())
    res = onnxgrad.gradients(m, ["outs", "hT"], ["x", "h0", "u", "w"], grad_ys=["c1", "c2"])
    return run(res.model, v, res.grads)


def test_tensorarray_while_loop_v1_matches_tf_gradients():
    tf = pytest.importorskip("tensorflow")
    v = _values()
    tf.compat.v1.disable_control_flow_v2()
    try:
        g = tf.Graph()
        with g.as_default():
            ph = {k: tf.compat.v1.placeholder(tf.float64, a.shape, name=k) for k, a in v.items()}
            xs = tf.TensorArray(tf.float64, size=T).unstack(ph["x"])
            out0 = tf.TensorArray(tf.float64, size=T)

            def body(i, h, ta):
                h = tf.tanh(tf.matmul(xs.read(i), ph["u"]) + tf.matmul(h, ph["w"]))
                return i + 1, h, ta.write(i, h)

            _, h_t, ta = tf.compat.v1.while_loop(lambda i, *_: i < T, body,
                                                 [tf.constant(0), ph["h0"], out0])
            loss = tf.reduce_sum(ta.stack() * ph["c1"]) + tf.reduce_sum(h_t * ph["c2"])
            grads = tf.gradients(loss, [ph["x"], ph["h0"], ph["u"], ph["w"]])
            ops = {op.type for op in g.get_operations()}
            assert {"TensorArrayV3", "TensorArrayGradV3", "Enter", "Exit"} <= ops  # v1 graph
            with tf.compat.v1.Session(graph=g) as s:
                want = s.run(grads, {ph[k]: a for k, a in v.items()})
    finally:
        tf.compat.v1.enable_control_flow_v2()
    for got, w, name in zip(_onnxgrad(v), want, ["x", "h0", "u", "w"]):
        np.testing.assert_allclose(got, w, rtol=1e-9, atol=1e-12, err_msg=name)


def test_dynamic_rnn_loop_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    v = _values(1)
    t = {k: torch.tensor(a, requires_grad=k in ("x", "h0", "u", "w")) for k, a in v.items()}
    h, outs = t["h0"], []
    for i in range(T):  # the same Python loop, differentiated by autograd
        h = torch.tanh(t["x"][i] @ t["u"] + h @ t["w"])
        outs.append(h)
    loss = (torch.stack(outs) * t["c1"]).sum() + (h * t["c2"]).sum()
    want = torch.autograd.grad(loss, [t["x"], t["h0"], t["u"], t["w"]])
    for got, w, name in zip(_onnxgrad(v), want, ["x", "h0", "u", "w"]):
        np.testing.assert_allclose(got, w.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)
