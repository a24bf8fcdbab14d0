"""Data-parallel throughput: onnxgrad's DistributedTrainer against torch DistributedDataParallel,
on the same model, data, global batches and number of processes, in one run.

    python bench/distributed.py                        # both rows, markdown table
    python bench/distributed.py --rows digits --steps 100 --rounds 3

Rows (AdamW lr 1e-3 wd 1e-2, cross-entropy, the same initial weights; global batch split rows
r::N between the ranks, as the trainer does):
    digits  models/digits_mlp.onnx (64-64-10, 4,810 parameters) on scikit-learn's digits,
            global batch 64
    big     784-1024-1024-10 MLP (1.86 M parameters, 7.4 MB of gradients: one bucket) on random
            data, global batch 256

For each row two torchrun jobs run (1 process, then 2 processes; 1 onnxruntime / torch thread
each, gloo over 127.0.0.1). Inside a job the configurations alternate ``--rounds`` times, so that
drifting load on a shared machine favours none: onnxgrad's Trainer (1 process only: one
step, no exchange), DistributedTrainer, DistributedTrainer with ZeRO-1 (2 processes), and torch
DDP (``torch.nn.Linear`` layers holding the same weights, ``torch.optim.AdamW``). A rate is the
median over rounds of ``--steps`` steps after ``--warmup``, timed on rank 0 between barriers.
For onnxgrad the time spent in collectives per step (blocking calls, so waiting for the slower
rank included) and the bytes of the buffers exchanged per step are reported (DDP overlaps its
all-reduce with the backward pass, so its exchange time is not separable). Ratios > 1 mean
onnxgrad is faster: the median over rounds of the ratio within a round, its range, and the
ratio of rank 0's process CPU time per step (its collective threads included), which moves less
when other jobs hold the cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

ROWS = ("digits", "big")


def row_spec(row):
    """(model, {name: initializer}, x, y, global batch)"""
    import onnx
    from onnx import helper, numpy_helper
    if row == "digits":
        m = onnx.load(os.path.join(ROOT, "models", "digits_mlp.onnx"))
        with np.load(os.path.join(ROOT, "models", "digits.npz")) as z:
            x, y = z["x"], z["y"]
        batch = 64
    else:
        rng = np.random.default_rng(0)
        sizes, nodes, inits, h = [784, 1024, 1024, 10], [], [], "x"
        for i in range(3):
            bound = 1 / np.sqrt(sizes[i])
            inits += [numpy_helper.from_array(rng.uniform(-bound, bound, (sizes[i + 1], sizes[i]))
                                              .astype(np.float32), f"fc{i}.weight"),
                      numpy_helper.from_array(rng.uniform(-bound, bound, sizes[i + 1])
                                              .astype(np.float32), f"fc{i}.bias")]
            out = "logits" if i == 2 else f"h{i}"
            nodes.append(helper.make_node("Gemm", [h, f"fc{i}.weight", f"fc{i}.bias"], [out],
                                          transB=1))
            if i < 2:
                nodes.append(helper.make_node("Relu", [out], [f"a{i}"]))
                h = f"a{i}"
        g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", 1, ["N", 784])],
                              [helper.make_tensor_value_info("logits", 1, ["N", 10])], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
        x = rng.standard_normal((4096, 784)).astype(np.float32)
        y = rng.integers(0, 10, 4096)
        batch = 256
    w = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    return m, w, x, y, batch


# -- a worker: one rank of a torchrun job ---------------------------------------------------
def worker(row, configs, steps, warmup, rounds, out):
    import torch
    import torch.distributed as dist
    from onnxgrad.training import AdamW, Trainer
    from onnxgrad.training.distributed import DistributedTrainer

    torch.set_num_threads(1)
    model, w, x, y, batch = row_spec(row)
    opt = dict(optimizer=AdamW(lr=1e-3), device="cpu", threads=1, progress=False)
    trainers = {}
    if "plain" in configs:
        trainers["plain"] = Trainer(model, "cross_entropy", **opt)
    if "ours" in configs:
        trainers["ours"] = DistributedTrainer(model, "cross_entropy", **opt)
    if "zero" in configs:
        trainers["zero"] = DistributedTrainer(model, "cross_entropy", zero=True, **opt)
    rank, world = dist.get_rank(), dist.get_world_size()

    # torch: the same layers and weights, DDP, AdamW (torch's defaults: wd 1e-2)
    names = [k for k in w if k.endswith(".weight")]
    layers = []
    for i, k in enumerate(names):
        lin = torch.nn.Linear(w[k].shape[1], w[k].shape[0])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w[k]))
            lin.bias.copy_(torch.from_numpy(w[k.replace("weight", "bias")]))
        layers += [lin] + ([torch.nn.ReLU()] if i < len(names) - 1 else [])
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    topt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    order = np.random.default_rng(1).permutation(len(x))
    per_epoch = len(x) // batch
    idx = [order[(i % per_epoch) * batch:(i % per_epoch + 1) * batch]
           for i in range(warmup + steps)]

    def run(cfg, i):
        b = idx[i]
        if cfg == "ddp":
            s = b[rank::world]
            topt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(ddp(xt[s]), yt[s])
            loss.backward()
            topt.step()
        else:
            trainers[cfg].step({"x": x[b], "target": y[b]})

    res = {c: [] for c in configs}
    for _ in range(rounds):
        for cfg in configs:
            for i in range(warmup):
                run(cfg, i)
            ex = dict(trainers[cfg].exchange) if cfg in ("ours", "zero") else None
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(warmup, warmup + steps):
                run(cfg, i)
            dist.barrier()
            t1, c1 = time.perf_counter(), time.process_time()
            r = {"steps_s": steps / (t1 - t0), "cpu_ms": (c1 - c0) / steps * 1e3}
            if ex is not None:
                e = trainers[cfg].exchange
                n = e["steps"] - ex["steps"]
                r["exchange_ms"] = (e["seconds"] - ex["seconds"]) / n * 1e3
                r["exchange_kb"] = (e["bytes"] - ex["bytes"]) / n / 1024
            if cfg == "zero":
                r["memory"] = trainers[cfg].memory()
            res[cfg].append(r)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------------
def launch(row, nproc, configs, args):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        if sys.platform.startswith("linux"):
            env["GLOO_SOCKET_IFNAME"] = "lo"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), os.path.abspath(__file__), "--worker", row,
               "--configs", ",".join(configs), "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--rounds", str(args.rounds), "--out", out]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if p.returncode:
            sys.exit(f"{row} x{nproc} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def med(runs, key):
    return statistics.median(r[key] for r in runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", metavar="ROW", help=argparse.SUPPRESS)
    ap.add_argument("--configs", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.configs.split(","), args.steps, args.warmup,
                      args.rounds, args.out)
    print(f"# {os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable; 1 thread per "
          f"process; {args.rounds} rounds of {args.steps} steps\n")
    print("| row | processes | onnxgrad | steps/s | exchange ms/step | exchange KB/step | "
          "torch DDP steps/s | ratio (range) | ratio by CPU time |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in args.rows.split(","):
        for nproc, configs in ((1, ["plain", "ours", "ddp"]), (2, ["ours", "zero", "ddp"])):
            res = launch(row, nproc, configs, args)
            ddp = res["ddp"]
            for cfg in configs[:-1]:
                runs = res[cfg]
                name = {"plain": "Trainer", "ours": "DistributedTrainer",
                        "zero": "DistributedTrainer ZeRO-1"}[cfg]
                ex = (f"{med(runs, 'exchange_ms'):.3f} | {med(runs, 'exchange_kb'):.1f}"
                      if "exchange_ms" in runs[0] else "- | -")
                # ratios within a round (the two sides ran back to back), then their median
                ratios = sorted(a["steps_s"] / b["steps_s"] for a, b in zip(runs, ddp))
                cpu = statistics.median(b["cpu_ms"] / a["cpu_ms"] for a, b in zip(runs, ddp))
                print(f"| {row} | {nproc} | {name} | {med(runs, 'steps_s'):.0f} | {ex} | "
                      f"{med(ddp, 'steps_s'):.0f} | {statistics.median(ratios):.2f}x "
                      f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | {cpu:.2f}x |", flush=True)
                if cfg == "zero":
                    m = runs[-1]["memory"]
                    print(f"|  |  | ZeRO-1 rank 0 buffers: {m['total'] / 2**20:.2f} MB against "
                          f"{m['unsharded_total'] / 2**20:.2f} MB unsharded (optimizer state "
                          f"{m['optimizer_state'] / 2**20:.2f} MB) |  |  |  |  |  |  |",
                          flush=True)


if __name__ == "__main__":
    main()
