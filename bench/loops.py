"""A Loop-based RNN (T=100, B=32, H=128): forward+backward on onnxruntime CPU (the ONNX Loop and
the backward Loop onnxgrad appends) against PyTorch autograd of the same Python loop.

    python bench/loops.py [--T 100 --B 32 --H 128 --reps 20 --threads N]

Prints the median time of each and the ratio onnxruntime / PyTorch (below 1: onnxruntime faster).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import onnxgrad  # noqa: E402
from onnxgrad.runtime import session  # noqa: E402


def rnn_model(T, B, H):
    vi = h.make_tensor_value_info
    body = h.make_graph(
        [h.make_node("Gather", ["x", "i"], ["xi"], axis=0),
         h.make_node("MatMul", ["xi", "u"], ["xu"]), h.make_node("MatMul", ["h_in", "w"], ["hw"]),
         h.make_node("Add", ["xu", "hw"], ["s"]), h.make_node("Add", ["s", "b"], ["p"]),
         h.make_node("Tanh", ["p"], ["h_out"]), h.make_node("Identity", ["c_in"], ["c_out"]),
         h.make_node("Identity", ["h_out"], ["h_scan"])],
        "cell", [vi("i", TP.INT64, []), vi("c_in", TP.BOOL, []), vi("h_in", TP.FLOAT, [B, H])],
        [vi("c_out", TP.BOOL, []), vi("h_out", TP.FLOAT, [B, H]), vi("h_scan", TP.FLOAT, [B, H])])
    g = h.make_graph(
        [h.make_node("Loop", ["T", "", "h0"], ["hT", "hs"], body=body),
         h.make_node("ReduceSum", ["hs"], ["loss"], keepdims=0)], "rnn",
        [vi("x", TP.FLOAT, ["T", B, H]), vi("h0", TP.FLOAT, [B, H]), vi("u", TP.FLOAT, [H, H]),
         vi("w", TP.FLOAT, [H, H]), vi("b", TP.FLOAT, [H]), vi("T", TP.INT64, [])],
        [vi("loss", TP.FLOAT, [])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18)], ir_version=10)
    onnx.checker.check_model(m, full_check=True)
    return m


def median_time(fn, reps):
    fn()  # warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=100)
    ap.add_argument("--B", type=int, default=32)
    ap.add_argument("--H", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="0: the libraries' defaults")
    a = ap.parse_args(argv)
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)

    rng = np.random.default_rng(0)
    v = {"x": rng.standard_normal((a.T, a.B, a.H)).astype(np.float32),
         "h0": np.zeros((a.B, a.H), np.float32),
         "u": (rng.standard_normal((a.H, a.H)) / np.sqrt(a.H)).astype(np.float32),
         "w": (rng.standard_normal((a.H, a.H)) / np.sqrt(a.H)).astype(np.float32),
         "b": np.zeros(a.H, np.float32), "T": np.array(a.T, np.int64)}
    xs = ["x", "u", "w", "b"]
    res = onnxgrad.gradients(rnn_model(a.T, a.B, a.H), "loss", xs)
    sess = session(res.model, threads=a.threads or None)
    outs = ["loss", *res.grads]
    ort_out = sess.run(outs, v)

    t = {k: torch.tensor(val, requires_grad=k in xs) for k, val in v.items() if k != "T"}

    def torch_step():
        hh, total = t["h0"], 0
        for i in range(a.T):
            hh = torch.tanh(t["x"][i] @ t["u"] + hh @ t["w"] + t["b"])
            total = total + hh.sum()
        return [total, *torch.autograd.grad(total, [t[k] for k in xs])]

    ref = torch_step()
    for got, want, name in zip(ort_out, ref, ["loss", *xs]):  # same numbers first
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=2e-3, atol=2e-3,
                                   err_msg=name)
    t_ort = median_time(lambda: sess.run(outs, v), a.reps)
    t_torch = median_time(torch_step, a.reps)
    print(f"Loop RNN T={a.T} B={a.B} H={a.H}, forward+backward, median of {a.reps}:")
    print(f"  onnxruntime CPU (onnxgrad): {t_ort * 1e3:8.2f} ms")
    print(f"  PyTorch autograd          : {t_torch * 1e3:8.2f} ms")
    print(f"  ratio onnxruntime / PyTorch: {t_ort / t_torch:.2f}")
    return t_ort / t_torch


if __name__ == "__main__":
    main()
