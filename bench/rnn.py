"""RNN forward+backward on onnxruntime CPU against torch.nn.LSTM on CPU, in one run.

    python bench/rnn.py                      # T=50, B=32, input=hidden=256, 2 layers, LSTM
    python bench/rnn.py --threads 2 --repeat 5 --profile

Two onnxgrad graphs are timed, both doing forward + backward in one session.run, against
torch.nn.LSTM (same weights, float32) doing y = lstm(x); (y * gy).sum().backward():

* ``cudnn``: one onnxgrad ``CudnnRNNV2`` node (2 layers) and the ``CudnnRNNBackpropV2`` node that
  ``onnxgrad.gradients`` emits for it; both run as their ONNX function bodies (Scan over time).
* ``onnx``: the model torch.onnx.export writes for the same nn.LSTM (two ONNX LSTM nodes); in its
  gradient model each LSTM node is replaced by a one-layer CudnnRNNV2 (the forward runs once,
  as the function body, and also gives backward its reserve_space), then CudnnRNNBackpropV2.
  Its weights are initializers, so onnxruntime folds and prepacks what they alone determine.

Prints the median times and the ratio ours / torch (lower is better; < 1 means faster than
torch), by wall clock and, at 1 thread, by thread CPU time. With ``--profile``, also where
onnxruntime's time goes (its profiler, by op type).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
import warnings

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper

import onnxgrad
from onnxgrad.rnn import canonical_to_params, params_size
from onnxgrad.rnn.ops import make_node


def torch_lstm(T, B, I, H, L, seed=0):
    import torch
    torch.manual_seed(seed)
    return torch.nn.LSTM(I, H, L)


def cudnn_model(T, B, I, H, L):
    P = params_size("lstm", L, H, I)
    ins = [helper.make_tensor_value_info("x", TP.FLOAT, [T, B, I]),
           helper.make_tensor_value_info("h0", TP.FLOAT, [L, B, H]),
           helper.make_tensor_value_info("c0", TP.FLOAT, [L, B, H]),
           helper.make_tensor_value_info("p", TP.FLOAT, [P])]
    node = make_node("CudnnRNNV2", ["x", "h0", "c0", "p"], ["y", "hn", "cn", "rs", "hr"],
                     name="lstm", rnn_mode="lstm")
    outs = [helper.make_tensor_value_info("y", TP.FLOAT, [T, B, H])]
    m = helper.make_model(helper.make_graph([node], "lstm", ins, outs),
                          opset_imports=[helper.make_opsetid("", 18),
                                         helper.make_opsetid("onnxgrad", 1)], ir_version=10)
    res = onnxgrad.gradients(m, "y", ["x", "p"], grad_ys=["gy"])
    return res


def onnx_export_model(mod, T, B, I):
    import torch
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(mod, (torch.zeros(T, B, I),), f, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y", "hn", "cn"])
    m = onnx.load_from_string(f.getvalue())
    weights = [t.name for t in m.graph.initializer if len(t.dims) >= 2 and t.dims[0] <= 2]
    return onnxgrad.gradients(m, "y", ["x"] + weights, grad_ys=["gy"])


def session(model, threads, profile_dir=None):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if profile_dir:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(profile_dir, "ort")
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def timeit(fns: dict, repeat, warmup=1):
    """Median seconds of each function, wall clock and thread CPU time, the runs interleaved (a
    shared, loaded machine slows all of them alike rather than whichever happened to run during a
    busy spell). At 1 thread both sides run every kernel on the calling thread, so the thread CPU
    time leaves out the time other processes held the core."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    ts = {k: [] for k in fns}
    cs = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t, c = time.perf_counter(), time.thread_time()
            fn()
            cs[k].append(time.thread_time() - c)
            ts[k].append(time.perf_counter() - t)
    return ({k: statistics.median(v) for k, v in ts.items()},
            {k: statistics.median(v) for k, v in cs.items()})


def profile_breakdown(sess, run, top=8):
    """(op type, total ms, share) over one profiled run, from onnxruntime's profiler."""
    run()
    path = sess.end_profiling()
    with open(path) as f:
        events = json.load(f)
    by_op, total, scan = {}, 0.0, 0.0
    for ev in events:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            op = ev.get("args", {}).get("op_name", "?")
            if op in ("Scan", "Loop"):  # its body's nodes are profiled on their own too
                scan += ev["dur"] / 1000
                continue
            by_op[op] = by_op.get(op, 0.0) + ev["dur"] / 1000
            total += ev["dur"] / 1000
    rows = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    return [(op, ms, ms / total if total else 0.0) for op, ms in rows], total, scan


def shape_arguments(doc: str) -> argparse.ArgumentParser:
    """The LSTM's sizes (T, B, I, H, L), shared with bench/rnn_gpu.py."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    for k, v in dict(T=50, B=32, I=256, H=256, L=2).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    return ap


def main(argv=None):
    ap = shape_arguments(__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--skip-onnx", action="store_true", help="only the CudnnRNNV2 graph")
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    T, B, I, H, L = a.T, a.B, a.I, a.H, a.L
    rng = np.random.default_rng(0)
    mod = torch_lstm(T, B, I, H, L)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    gy = rng.standard_normal((T, B, H)).astype(np.float32)
    h0 = np.zeros((L, B, H), np.float32)

    # torch
    xt, gyt = torch.tensor(x, requires_grad=True), torch.tensor(gy)

    def torch_step():
        mod.zero_grad()
        xt.grad = None
        y, _ = mod(xt)
        (y * gyt).sum().backward()

    ws, bs = [], []
    for layer in range(L):
        for k in ("weight_ih", "weight_hh"):
            ws += np.split(getattr(mod, f"{k}_l{layer}").detach().numpy(), 4)
        for k in ("bias_ih", "bias_hh"):
            bs += np.split(getattr(mod, f"{k}_l{layer}").detach().numpy(), 4)
    # canonical order is per layer: input then recurrent weights; biases likewise
    p = canonical_to_params(ws, bs, "lstm", L, H, I).astype(np.float32)

    res = cudnn_model(T, B, I, H, L)
    s = session(res.model, a.threads)
    feeds = {"x": x, "h0": h0, "c0": h0, "p": p, "gy": gy}
    names = ["y"] + res.grads
    out = s.run(names, feeds)
    torch_step()
    err = float(np.abs(out[1] - xt.grad.numpy()).max())
    fns = {"torch": torch_step, "cudnn": lambda: s.run(names, feeds)}
    if not a.skip_onnx:
        res2 = onnx_export_model(mod, T, B, I)
        s2 = session(res2.model, a.threads)
        names2 = ["y"] + res2.grads
        out2 = s2.run(names2, {"x": x, "gy": gy})
        err = max(err, float(np.abs(out2[1] - xt.grad.numpy()).max()))
        fns["onnx"] = lambda: s2.run(names2, {"x": x, "gy": gy})
    t, cpu = timeit(fns, a.repeat)
    t_torch = t["torch"]
    print(f"LSTM T={T} B={B} input={I} hidden={H} layers={L}, forward+backward, float32, "
          f"{a.threads} threads, median of {a.repeat} interleaved runs")
    cpu_col = a.threads == 1
    print("| graph | ours (ms) | torch (ms) | ours / torch |"
          + (" by thread CPU time (ms, ms, ratio) |" if cpu_col else ""))
    print("|---|---|---|---|" + ("---|" if cpu_col else ""))
    labels = {"cudnn": "CudnnRNNV2 + CudnnRNNBackpropV2 (function bodies)",
              "onnx": "torch.onnx-exported ONNX LSTM + its onnxgrad gradient"}
    for k, label in labels.items():
        if k in t:
            print(f"| {label} | {t[k] * 1e3:.1f} | {t_torch * 1e3:.1f} | "
                  f"{t[k] / t_torch:.2f} |"
                  + (f" {cpu[k] * 1e3:.1f}, {cpu['torch'] * 1e3:.1f}, "
                     f"{cpu[k] / cpu['torch']:.2f} |" if cpu_col else ""))
    results = t
    prof_dir = tempfile.mkdtemp() if a.profile else None
    print(f"\nmax |dx - torch dx| = {err:.2e}")
    if a.profile:
        sp = session(res.model, a.threads, prof_dir)
        rows, total, scan = profile_breakdown(sp, lambda: sp.run(names, feeds))
        print(f"\nwhere onnxruntime's time goes (CudnnRNNV2 graph, one profiled run): "
              f"{total:.1f} ms in kernels, of which inside Scan bodies (the per-step cells) "
              f"most; the Scan nodes themselves span {scan:.1f} ms")
        print("| op | ms | share |\n|---|---|---|")
        for op, ms, share in rows:
            print(f"| {op} | {ms:.1f} | {share:.0%} |")
    return results


if __name__ == "__main__":
    main()
