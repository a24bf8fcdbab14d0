"""Training-step throughput on CUDA: the rows of bench/train_step.py on a GPU.

    python bench/train_gpu.py                # every row; exits 3 with a message without CUDA
    python bench/train_gpu.py --rows mlp --steps 50

onnxgrad's Trainer on onnxruntime's CUDA provider (parameters and optimizer state stay in GPU
memory as OrtValues, swapped between steps; only the loss is copied to the host) against a
PyTorch eager loop on the same GPU (torch.cuda.synchronize around each timed window, loss.item()
per step on both sides). Peak device memory for torch is torch.cuda.max_memory_allocated; the
peak GEMM rate is an onnxruntime CUDA MatMul 1024^3 in float32 (TF32 off, onnxruntime's default).
Prepared for a lent GPU machine: it needs onnxruntime-gpu with its CUDA/cuDNN libraries and a
CUDA build of torch there.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from onnxgrad.runtime import cuda_available
    if not cuda_available():
        print("train_gpu: no CUDA here: onnxruntime cannot create a CUDA session (it needs "
              "onnxruntime-gpu, the CUDA and cuDNN libraries and a visible GPU); run "
              "bench/train_step.py for the CPU figures", file=sys.stderr)
        return 3
    try:
        import torch
        if not torch.cuda.is_available():
            print("train_gpu: torch has no CUDA on this machine: install a CUDA build of torch "
                  "to get the comparison rows", file=sys.stderr)
            return 3
    except ImportError:
        print("train_gpu: torch is not installed (pip install 'onnxgrad[bench]')",
              file=sys.stderr)
        return 3
    from train_step import main as bench_main
    args = list(sys.argv[1:] if argv is None else argv)
    return bench_main(["--device", "cuda", "--steps", "50", "--warmup", "10", "--threads", "1",
                       *args])


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
