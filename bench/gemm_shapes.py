"""The GEMM kernels alone: onnxruntime's MatMul (MLAS) against PyTorch's torch.mm on the shapes
the MLP and Transformer rows of bench/train_step.py multiply, in one run.

    python bench/gemm_shapes.py                 # 1 and 2 threads
    python bench/gemm_shapes.py --threads 1

Those rows spend 85 % to 97 % of their step in GEMMs, so their ratio to PyTorch cannot pass
this one by much. Each shape is M x K x N (float32, A [M, K] @ B [K, N]); each side runs it
``--repeat`` times after a warm-up, the best of ``--rounds`` windows, one side right after the
other for each shape. Ratios > 1: onnxruntime faster.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

# (M, K, N): the MLP's forward and weight/input gradients (batch 256), the Transformer's
# linear layers over its 2048 tokens (d 256, feed-forward 1024) and their gradients
SHAPES = [(1024, 1024, 1024), (256, 784, 1024), (256, 1024, 1024), (1024, 256, 1024),
          (784, 256, 1024), (2048, 256, 1024), (256, 2048, 1024), (2048, 1024, 256)]


def _ort_matmul(m, k, n, threads):
    import onnxruntime as ort
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "mm",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [k, n])],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [m, n])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    io = sess.io_binding()
    io.bind_cpu_input("a", rng.random((m, k), np.float32))
    io.bind_cpu_input("b", rng.random((k, n), np.float32))
    io.bind_output("c")
    return lambda: sess.run_with_iobinding(io)


def _torch_mm(m, k, n, threads):
    import torch
    torch.set_num_threads(threads)
    a, b, c = torch.rand(m, k), torch.rand(k, n), torch.empty(m, n)
    return lambda: torch.mm(a, b, out=c)


def _best_rate(fn, flops, repeat, rounds):
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return flops / best / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    print("| M x K x N | threads | onnxruntime GFLOP/s | torch GFLOP/s | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for t in args.threads:
        for m, k, n in SHAPES:
            flops = 2 * m * k * n
            ours = _best_rate(_ort_matmul(m, k, n, t), flops, args.repeat, args.rounds)
            theirs = _best_rate(_torch_mm(m, k, n, t), flops, args.repeat, args.rounds)
            print(f"| {m} x {k} x {n} | {t} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
