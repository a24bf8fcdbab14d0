"""The CudnnRNN family on onnxruntime-gpu's CUDA provider, against torch's cuDNN LSTM.

    python bench/rnn_gpu.py                  # T=50, B=32, input=hidden=256, 2 layers
    python bench/rnn_gpu.py --repeat 20 --T 100

1. Builds forward + backward (CudnnRNNV2 and the CudnnRNNBackpropV2 that onnxgrad.gradients
   emits, both as ONNX function bodies) and a session on CUDAExecutionProvider.
2. Checks, from onnxruntime's profiler, which provider ran every node of the expanded functions
   (Scan bodies included). Nodes on CPU are listed; int64 shape arithmetic (Shape, Slice/Concat/
   Mul of shapes...) that onnxruntime places on CPU on purpose is reported apart from float
   compute nodes, and any float compute node off CUDA makes the script exit 1.
3. Compares the gradients with torch.nn.LSTM on CUDA (cuDNN) and times both (median, with
   synchronisation), forward + backward.

Exits 0 with a clear message when no CUDA session can be created (no GPU, or a CPU-only
onnxruntime), so it can sit in a job list that also runs on CPU machines.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rnn import shape_arguments  # noqa: E402  (bench/rnn.py: the same LSTM sizes)

SHAPE_OPS = {"Shape", "Size", "Slice", "Concat", "Mul", "Add", "Sub", "Div", "Gather",
             "Unsqueeze", "Squeeze", "Reshape", "Constant", "ConstantOfShape", "Cast", "Neg",
             "Range", "Equal", "Where", "ReduceSum", "Abs"}


def placements(profile_path):
    """{(node name, op type): provider} for every kernel run in the profile."""
    with open(profile_path) as f:
        events = json.load(f)
    out = {}
    for ev in events:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            args = ev.get("args", {})
            out[(ev["name"][:-len("_kernel_time")], args.get("op_name", "?"))] = \
                args.get("provider", "?")
    return out


def main(argv=None):
    ap = shape_arguments(__doc__)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args(argv)

    from onnxgrad.runtime import cuda_available
    if not cuda_available():
        print("rnn_gpu: no CUDA session can be created here (no GPU, or onnxruntime without "
              "CUDAExecutionProvider); nothing to do.")
        return 0
    import onnxruntime as ort
    import torch

    from rnn import cudnn_model  # bench/rnn.py

    from onnxgrad.rnn import canonical_to_params
    T, B, I, H, L = a.T, a.B, a.I, a.H, a.L
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    mod = torch.nn.LSTM(I, H, L).to(dev)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    gy = rng.standard_normal((T, B, H)).astype(np.float32)
    h0 = np.zeros((L, B, H), np.float32)
    ws, bs = [], []
    for layer in range(L):
        for k in ("weight_ih", "weight_hh"):
            ws += np.split(getattr(mod, f"{k}_l{layer}").detach().cpu().numpy(), 4)
        for k in ("bias_ih", "bias_hh"):
            bs += np.split(getattr(mod, f"{k}_l{layer}").detach().cpu().numpy(), 4)
    p = canonical_to_params(ws, bs, "lstm", L, H, I).astype(np.float32)

    res = cudnn_model(T, B, I, H, L)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "ort_gpu")
    s = ort.InferenceSession(res.model.SerializeToString(), so,
                             providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    print("session providers:", s.get_providers())
    feeds = {"x": x, "h0": h0, "c0": h0, "p": p, "gy": gy}
    names = ["y"] + res.grads
    out = s.run(names, feeds)
    where = placements(s.end_profiling())
    off = {k: v for k, v in where.items() if v != "CUDAExecutionProvider"}
    compute_off = {k: v for k, v in off.items() if k[1] not in SHAPE_OPS}
    print(f"nodes run: {len(where)}; on CUDAExecutionProvider: {len(where) - len(off)}; "
          f"elsewhere: {len(off)} (shape arithmetic: {len(off) - len(compute_off)}, "
          f"compute: {len(compute_off)})")
    for (name, op), prov in sorted(compute_off.items())[:40]:
        print(f"  NOT ON CUDA: {op} {name} -> {prov}")

    # numbers against torch's cuDNN LSTM
    xt = torch.tensor(x, device=dev, requires_grad=True)
    gyt = torch.tensor(gy, device=dev)

    def torch_step():
        mod.zero_grad()
        xt.grad = None
        y, _ = mod(xt)
        (y * gyt).sum().backward()
        if dev == "cuda":
            torch.cuda.synchronize()

    torch_step()
    err = float(np.abs(out[1] - xt.grad.cpu().numpy()).max())
    print(f"max |dx - torch({dev}) dx| = {err:.2e}")

    # timing (onnxruntime's run returns host arrays: that copy is included, as a user sees it)
    s2 = ort.InferenceSession(res.model.SerializeToString(), providers=[
        "CUDAExecutionProvider", "CPUExecutionProvider"])
    ts = {"ours": [], "torch": []}
    for fn in (lambda: s2.run(names, feeds), torch_step):
        fn()
    for _ in range(a.repeat):
        t = time.perf_counter()
        s2.run(names, feeds)
        ts["ours"].append(time.perf_counter() - t)
        t = time.perf_counter()
        torch_step()
        ts["torch"].append(time.perf_counter() - t)
    ours, theirs = statistics.median(ts["ours"]), statistics.median(ts["torch"])
    print(f"LSTM T={T} B={B} input={I} hidden={H} layers={L}, forward+backward, float32")
    print(f"| ours (onnxruntime CUDA, ms) | torch {dev} (ms) | ours / torch |")
    print(f"|---|---|---|\n| {ours * 1e3:.2f} | {theirs * 1e3:.2f} | {ours / theirs:.2f} |")
    ok = not compute_off and err < 1e-3
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
