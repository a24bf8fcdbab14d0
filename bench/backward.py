"""Forward+backward time: onnxgrad's gradient graph on onnxruntime CPU against PyTorch autograd.

    python bench/backward.py                      # all rows, markdown table
    python bench/backward.py --rows resnet --repeat 15
    python bench/backward.py --profile            # also onnxruntime's per-node profile (/tmp)

Rows (float32, the same exported network and weights on both sides):
    resnet       tests/test_real_models.py ResNetStack(width 32, blocks (2, 2)), 3x32x32 images,
                 batch 16, BN in inference mode
    transformer  nn.TransformerEncoderLayer(d 256, 8 heads, ff 1024, dropout 0, batch_first) with a
                 boolean key-padding mask, batch 32, seq 64
    r3d          a video ResNet in r3d_18's form (Conv3d stem 3x7x7 stride (1, 2, 2), a basic block
                 of 3x3x3 convolutions, a strided one with a 1x1x1 projection; width 16), clips of
                 8 frames of 56x56, batch 4, BN in inference mode

Ours: ONE session of ``gradients(exported, ["y"], [input] + parameters, grad_ys=["cot"])`` (the
running statistics are not differentiated, as torch does not either), run for every gradient
output; onnxruntime at its default optimisation level. Torch: eager ``y = m(x)``,
``autograd.grad((y * cot).sum(), [x] + parameters)``. Both sides use the same thread count. The
two sides alternate ``--rounds`` times, ``--repeat`` timed calls each after a warm-up; each side's
figure is the median of all its calls. Ratio = ours / torch (<= 1.0 is the goal), by wall-clock
time and by the calling thread's CPU time (time.thread_time; at 1 thread both sides run every kernel
on the calling thread, so it leaves out the time other jobs held the core).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

import onnxgrad  # noqa: E402
from test_real_models import Encoder, ResNetStack, export, randomize  # noqa: E402


class _Block3d(torch.nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        nn = torch.nn
        self.c1, self.b1 = nn.Conv3d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm3d(cout)
        self.c2, self.b2 = nn.Conv3d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm3d(cout)
        self.proj = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv3d(cin, cout, 1, stride, bias=False), nn.BatchNorm3d(cout))

    def forward(self, x):
        y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
        return torch.relu(y + (x if self.proj is None else self.proj(x)))


class R3D(torch.nn.Module):
    """torchvision's r3d_18 in small: its stem, one plain and one strided basic block."""

    def __init__(self, width=16, classes=10):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv3d(3, width, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False),
                                  nn.BatchNorm3d(width), nn.ReLU())
        self.layers = nn.Sequential(_Block3d(width, width, 1), _Block3d(width, 2 * width, 2))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3, 4)))


def _rows():
    rng = np.random.default_rng(0)
    resnet = randomize(ResNetStack(width=32, blocks=(2, 2)))
    x = rng.standard_normal((16, 3, 32, 32)).astype(np.float32)
    enc = randomize(Encoder(d=256, heads=8, ff=1024))
    src = rng.standard_normal((32, 64, 256)).astype(np.float32)
    keep = rng.integers(32, 65, size=32)
    pad = np.arange(64)[None, :] >= keep[:, None]
    r3d = randomize(R3D()).eval()
    clips = rng.standard_normal((4, 3, 8, 56, 56)).astype(np.float32)
    return {"resnet": (resnet, ["x"], [x]), "transformer": (enc, ["src", "pad"], [src, pad]),
            "r3d": (r3d, ["x"], [clips])}


def _ours(module, names, inputs, threads, profile=None):
    model = export(module, inputs, names, names)
    params = [n for n, _ in module.named_parameters()]
    inits = {t.name for t in model.graph.initializer}
    missing = [p for p in params if p not in inits]
    assert not missing, f"parameters not initializers in the export: {missing}"
    t0 = time.perf_counter()
    res = onnxgrad.gradients(model, ["y"], [names[0]] + params, grad_ys=["cot"])
    build = time.perf_counter() - t0
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    sess = ort.InferenceSession(res.model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    feeds = dict(zip(names, inputs))
    y_shape = _forward_shape(model, feeds)
    feeds["cot"] = np.random.default_rng(1).standard_normal(y_shape).astype(np.float32)
    return (lambda: sess.run(res.grads, feeds)), build, len(res.model.graph.node), sess


def _forward_shape(model, feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(["y"], feeds)[0].shape


def _torch(module, names, inputs):
    params = list(module.parameters())
    for p in params:
        p.requires_grad_(True)
    x = torch.tensor(inputs[0], requires_grad=True)
    rest = [torch.tensor(a) for a in inputs[1:]]
    with torch.no_grad():
        cot = torch.tensor(np.random.default_rng(1).standard_normal(
            tuple(module(x, *rest).shape)).astype(np.float32))

    def step():
        y = module(x, *rest)
        return torch.autograd.grad((y * cot).sum(), [x] + params)
    return step


def _time(fn, n):
    """(wall, thread CPU) seconds of each of n calls."""
    wall, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return wall, cpu


def profile_summary(path, top=15):
    """Aggregate an onnxruntime profile: time per op type and the slowest nodes."""
    with open(path) as f:
        events = json.load(f)
    by_op, by_node = collections.Counter(), collections.Counter()
    runs = sum(1 for e in events if e.get("name") == "model_run")
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        a = e.get("args", {})
        by_op[a.get("op_name", "?")] += e["dur"]
        by_node[(e["name"][:-len("_kernel_time")], a.get("op_name", "?"))] += e["dur"]
    total = sum(by_op.values()) or 1
    runs = max(runs, 1)
    lines = [f"  kernel time per run {total / runs / 1e3:.1f} ms ({runs} runs)", "  by op type:"]
    lines += [f"    {op:24s} {t / runs / 1e3:8.2f} ms {100 * t / total:5.1f} %"
              for op, t in by_op.most_common(top)]
    lines.append("  slowest nodes:")
    lines += [f"    {op:16s} {t / runs / 1e3:8.2f} ms {100 * t / total:5.1f} %  {name}"
              for (name, op), t in by_node.most_common(top)]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="*", default=["resnet", "transformer", "r3d"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--profile", action="store_true",
                    help="also profile our session (json under /tmp) and summarise it")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = _rows()
    print(f"threads {args.threads}; median of {args.rounds} x {args.repeat} calls per side\n")
    print("| row | build s | grad-graph nodes | ours ms | torch ms | ours / torch "
          "| ours CPU ms | torch CPU ms | CPU ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    profiles = {}
    for name in args.rows:
        module, names, inputs = rows[name]
        ours, build, n_nodes, _ = _ours(module, names, inputs, args.threads)
        theirs = _torch(module, names, inputs)
        ours(), theirs(), ours(), theirs()  # warm-up
        t_ours, t_torch, c_ours, c_torch = [], [], [], []
        for _ in range(args.rounds):
            w, c = _time(ours, args.repeat)
            t_ours += w
            c_ours += c
            w, c = _time(theirs, args.repeat)
            t_torch += w
            c_torch += c
        a, b = statistics.median(t_ours) * 1e3, statistics.median(t_torch) * 1e3
        ca, cb = statistics.median(c_ours) * 1e3, statistics.median(c_torch) * 1e3
        print(f"| {name} | {build:.2f} | {n_nodes} | {a:.1f} | {b:.1f} | {a / b:.2f} "
              f"| {ca:.1f} | {cb:.1f} | {ca / cb:.2f} |", flush=True)
        if args.profile:
            prefix = f"/tmp/onnxgrad_backward_{name}"
            for old in glob.glob(prefix + "*.json"):
                os.unlink(old)
            run, _, _, sess = _ours(module, names, inputs, args.threads, profile=prefix)
            for _ in range(args.repeat):
                run()
            profiles[name] = sess.end_profiling()
    for name, path in profiles.items():
        print(f"\nprofile of {name} ({path}):\n{profile_summary(path)}")


if __name__ == "__main__":
    main()
