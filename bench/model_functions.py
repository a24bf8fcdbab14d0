"""Gradients of a model that calls its own functions, against the same model inlined and torch.

    python bench/model_functions.py                 # 4 blocks, d 512, batch 256, 1 thread
    python bench/model_functions.py --threads 2 --blocks 8

A stack of residual blocks (Linear, LayerNorm, GELU) exported by torch.onnx's TorchScript
exporter with ``export_modules_as_functions``, so that each block is a call of one model function.
gradients() keeps the calls and recomputes each body in the gradient; onnxruntime inlines the
calls and merges that recomputation with the forward. Times, in one run and alternated, the
gradient session of (a) the model with its calls, (b) the same model inlined by onnx.inliner
before gradients(), and (c) torch autograd on the module (forward + backward), and prints the
ratios (a)/(b) and (a)/(c) of the best times.
"""
from __future__ import annotations

import argparse
import io
import time

import numpy as np
import onnx
import onnx.inliner
import torch

import onnxgrad
from onnxgrad.runtime import session


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.norm(self.lin(x)))


class Net(torch.nn.Module):
    def __init__(self, d, blocks):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block(d) for _ in range(blocks)])

    def forward(self, x):
        return self.blocks(x).square().mean()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    net = Net(a.dim, a.blocks)
    x = torch.randn(a.batch, a.dim)
    f = io.BytesIO()
    torch.onnx.export(net, (x,), f, input_names=["x"], output_names=["loss"], dynamo=False,
                      export_modules_as_functions={Block}, opset_version=17)
    model = onnx.load_from_string(f.getvalue())
    params = [t.name for t in model.graph.initializer]
    calls = onnxgrad.gradients(model, "loss", params)
    inlined = onnxgrad.gradients(onnx.inliner.inline_local_functions(model), "loss", params)
    runs = {}
    for name, res in (("calls", calls), ("inlined", inlined)):
        s = session(res.model, threads=a.threads)
        runs[name] = (lambda s=s, g=res.grads: s.run(g, {"x": x.numpy()}))

    def torch_step():
        net.zero_grad()
        net(x).backward()
    runs["torch"] = torch_step
    got = [np.asarray(v) for v in runs["calls"]()]
    want = [np.asarray(v) for v in runs["inlined"]()]
    same = all(np.array_equal(p, q) for p, q in zip(got, want))
    times = {k: [] for k in runs}
    for fn in runs.values():
        fn()
    for _ in range(a.reps):
        for k, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    best = {k: min(v) * 1e3 for k, v in times.items()}
    print(f"{a.blocks} blocks as model-function calls, d {a.dim}, batch {a.batch}, "
          f"{a.threads} thread(s), best of {a.reps} alternated runs (ms):")
    print("| side | ms | ratio of calls' time |")
    print("| --- | ---: | ---: |")
    for k in runs:
        print(f"| {k} | {best[k]:.2f} | {best['calls'] / best[k]:.3f} |")
    print(f"gradients of the calls and of the inlined model bit-identical: {same}")


if __name__ == "__main__":
    main()
