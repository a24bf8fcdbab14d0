"""Dropout between the layers of CudnnRNN/V2 (is_training): the seed-determined masks, the
forward and backward ONNX functions against the NumPy reference given the same explicit mask, and
against central differences of the forward (the mask depends only on the seeds and the shapes, so
it is held fixed)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP

import onnxgrad
from onnxgrad.rnn import params_size
from onnxgrad.rnn.ops import reserve_width
from onnxgrad.rnn.reference import dropout_hash, dropout_mask, rnn_backward, rnn_forward

from test_rnn import (BI, UNI, B, H, I, T, _nd, assert_directional_fd, cotangents,  # noqa
                      inputs, rnn_model, session)

pytest.importorskip("onnxruntime")
MODES = ["lstm", "gru", "rnn_tanh", "rnn_relu"]


def test_generator_statistics():
    """The hash is uniform enough for masks: keep rate, independence of neighbours and seeds."""
    idx = np.arange(200_000)
    u = dropout_hash(idx, 3, 4) / (2**31 - 1)
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() * 12 - 1) < 0.01
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01
    for other in [(4, 4), (3, 5), (-3, 4)]:
        assert abs(np.corrcoef(u, dropout_hash(idx, *other) / (2**31 - 1))[0, 1]) < 0.01
    counts, _ = np.histogram(u, 50)
    assert ((counts - 4000) ** 2 / 4000).sum() < 100  # chi-square, 49 dof
    m = dropout_mask((2, 10, 30, 40), 0.3, 1, 2, np.float64)
    assert set(np.unique(m)) == {0.0, 1 / (1 - np.float64(np.float32(0.3)))}
    assert abs((m == 0).mean() - 0.3) < 0.02


def _reserve_split(rs, mode, L, nd, dtype):
    n_rows = L * nd * T * B * reserve_width(mode) * H
    return rs[:n_rows], rs[n_rows:].reshape(L - 1, T, B, nd * H)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op,L,direction,dtype", [("CudnnRNNV2", 2, UNI, np.float64),
                                                  ("CudnnRNN", 3, BI, np.float32)])
def test_dropout_matches_reference_with_the_mask(mode, op, L, direction, dtype):
    rng = np.random.default_rng(11)
    nd, p_drop, seeds = _nd(direction), 0.35, (17, -4)
    ttype = TP.DOUBLE if dtype == np.float64 else TP.FLOAT
    fwd = rnn_model(op, mode, L, direction, ttype, dropout=p_drop, seed=seeds[0],
                    seed2=seeds[1])
    x, h0, c0 = inputs(mode, L, direction, dtype, rng)
    p = (rng.standard_normal(params_size(mode, L, H, I, direction)) * 0.5).astype(dtype)
    feeds = dict(x=x, h0=h0, c0=c0, p=p)
    got = session(fwd).run(["y", "hn", "cn", "rs"], feeds)
    mask = dropout_mask((L - 1, T, B, nd * H), p_drop, *seeds, dtype)
    _, got_mask = _reserve_split(got[3], mode, L, nd, dtype)
    np.testing.assert_array_equal(got_mask, mask)  # the generator, bit for bit
    assert 0 < (mask == 0).mean() < 0.7
    want = rnn_forward(x, h0, c0, p, mode, direction, dropout_mask=mask)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-4, atol=2e-5)
    for g_, w_ in zip(got, want):
        np.testing.assert_allclose(g_, w_, **tol)
    nodrop = rnn_forward(x, h0, c0, p, mode, direction)
    assert not np.allclose(got[0], nodrop[0])

    ys = ["y", "hn"] + (["cn"] if mode == "lstm" else [])
    res = onnxgrad.gradients(fwd, ys, ["x", "h0", "c0", "p"], grad_ys=["g_" + y for y in ys])
    assert any(n.op_type.startswith("CudnnRNNBackprop") and n.overload.endswith(".drop")
               for n in res.model.graph.node)
    gy, ghn, gcn = cotangents(mode, L, direction, dtype, rng)
    cot = {k: v for k, v in dict(g_y=gy, g_hn=ghn, g_cn=gcn).items() if k[2:] in ys}
    grads = session(res.model).run(res.grads, {**feeds, **cot})
    ref = rnn_backward(x, h0, c0, p, gy, ghn, gcn if mode == "lstm" else None, want[3], mode,
                       direction, dropout_mask=mask)
    for name, g_, r_ in zip(["x", "h0", "c0", "p"], grads, ref):
        np.testing.assert_allclose(g_, r_, **tol, err_msg=name)


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_dropout_backward_finite_differences(mode):
    """float64 central differences of the ONNX forward along random directions (same seeds, so the
    same mask at every evaluation) against the ONNX backward."""
    rng = np.random.default_rng(12)
    L, direction = 3, BI
    fwd = rnn_model("CudnnRNNV2", mode, L, direction, TP.DOUBLE, dropout=0.5, seed=5, seed2=6)
    ys = ["y", "hn"] + (["cn"] if mode == "lstm" else [])
    res = onnxgrad.gradients(fwd, ys, ["x", "h0", "c0", "p"], grad_ys=["g_" + y for y in ys])
    f, bwd = session(fwd), session(res.model)
    x, h0, c0 = inputs(mode, L, direction, np.float64, rng)
    prim = dict(x=x, h0=h0, c0=c0,
                p=rng.standard_normal(params_size(mode, L, H, I, direction)) * 0.5)
    gy, ghn, gcn = cotangents(mode, L, direction, np.float64, rng)
    cot = {k: v for k, v in dict(g_y=gy, g_hn=ghn, g_cn=gcn).items() if k[2:] in ys}
    assert_directional_fd(f, bwd, res.grads, ys, prim, cot, rng)


def test_dropout_zero_changes_nothing():
    """dropout=0 (and dropout with one layer, or in inference) builds today's function: the same
    FunctionProto, bit-identical outputs."""
    rng = np.random.default_rng(13)
    plain = rnn_model("CudnnRNNV2", "lstm", 2, UNI, TP.DOUBLE)
    zero = rnn_model("CudnnRNNV2", "lstm", 2, UNI, TP.DOUBLE, dropout=0.0, seed=3)
    infer = rnn_model("CudnnRNNV2", "lstm", 2, UNI, TP.DOUBLE, dropout=0.5, is_training=0)
    assert plain.functions[0].SerializeToString() == zero.functions[0].SerializeToString() == \
        infer.functions[0].SerializeToString()
    x, h0, c0 = inputs("lstm", 2, UNI, np.float64, rng)
    feeds = dict(x=x, h0=h0, c0=c0, p=rng.standard_normal(params_size("lstm", 2, H, I)))
    a, b_, c = (session(m).run(None, feeds) for m in (plain, zero, infer))
    for u, v, w in zip(a, b_, c):
        assert np.array_equal(u, v) and np.array_equal(u, w)
    want = rnn_forward(x, h0, c0, feeds["p"], "lstm")
    np.testing.assert_allclose(a[0], want[0], rtol=1e-12, atol=1e-13)


def test_backward_of_an_inference_forward_is_refused():
    """A backward with dropout reads the masks its forward wrote: a forward with is_training=0
    wrote none, which attach_functions reports at build time (and the body's Reshape named
    reserve_space_has_no_dropout_masks... at run time)."""
    from onnx import helper

    from onnxgrad.rnn.ops import attach_functions, make_node
    L, dt = 2, TP.DOUBLE
    ins = [helper.make_tensor_value_info(n, dt, s) for n, s in
           [("x", [T, B, I]), ("h0", [L, B, H]), ("c0", [L, B, H]),
            ("p", [params_size("lstm", L, H, I)]), ("gy", [T, B, H])]]
    fwd = make_node("CudnnRNNV2", ["x", "h0", "c0", "p"], ["y", "hn", "cn", "rs", "hr"],
                    name="fwd", dropout=0.5, is_training=0)
    bwd = make_node("CudnnRNNBackpropV2", ["x", "h0", "c0", "p", "y", "hn", "cn", "gy", "h0",
                                           "c0", "rs", "hr"], ["dx", "dh", "dc", "dp"],
                    name="bwd", dropout=0.5)
    g = helper.make_graph([fwd, bwd], "g", ins, [helper.make_tensor_value_info("dx", dt, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                            helper.make_opsetid("onnxgrad", 1)], ir_version=10)
    with pytest.raises(ValueError, match=r"fwd.*differ.*\.drop"):
        attach_functions(m)
