"""Training-step throughput: onnxgrad's Trainer on onnxruntime against a PyTorch eager loop.

    python bench/train_step.py                   # every row, CPU, markdown table
    python bench/train_step.py --rows mlp --steps 30 --warmup 5
    python bench/train_step.py --profile mlp     # also onnxruntime's per-node profile of a row
    python bench/train_step.py --device cuda     # what bench/train_gpu.py runs

Rows (AdamW lr 1e-3, cross-entropy, the same initial weights and the same batches on both
sides, random data made once):
    mlp   784-1024-1024-10 (Gemm, Relu), batch 256
    cnn   Conv(1->16, 3x3) Relu MaxPool2 Conv(16->32, 3x3) Relu MaxPool2 Gemm(1568->10) on
          28x28, batch 64
    lstm  ONNX LSTM (hidden 128, input 64, 32 steps) -> last hidden state -> Gemm(128->10),
          batch 64 sequences; torch.nn.LSTM with the same weights (gates reordered)

Each (row, side) runs in its own subprocess, so the peak resident memory (ru_maxrss) is that
side's alone; a run's rate is the median of ``--repeat`` timed windows of ``--steps`` steps after
``--warmup``, and the two sides' runs alternate ``--rounds`` times (medians reported), which
keeps drifting load on a shared machine from favouring one side.
Both sides use the same number of threads (the cores this process may use). Also measured: the
peak float32 GEMM rate of this machine (onnxruntime MatMul 1024x1024 @ 1024x1024), and the MLP
row's achieved GFLOP/s as a fraction of it. Ratios > 1 mean onnxgrad is faster. At 1 thread the
ratio of the two sides' rates by thread CPU time is shown too: both run every kernel on the
calling thread then, so that ratio leaves out the time other processes held the core.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import tempfile
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

ROWS = ("mlp", "cnn", "lstm")


# -- models ------------------------------------------------------------------------------------
def _linear(rng, fan_in, fan_out):
    bound = 1 / np.sqrt(fan_in)
    return (rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32),
            rng.uniform(-bound, bound, fan_out).astype(np.float32))


def mlp_spec(seed=0):
    from onnx import helper
    rng = np.random.default_rng(seed)
    sizes = [784, 1024, 1024, 10]
    w, nodes, h = {}, [], "x"
    for i in range(3):
        w[f"W{i}"], w[f"b{i}"] = _linear(rng, sizes[i], sizes[i + 1])
        out = "logits" if i == 2 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [h, f"W{i}", f"b{i}"], [out], transB=1))
        if i < 2:
            nodes.append(helper.make_node("Relu", [out], [f"a{i}"]))
            h = f"a{i}"
    flops = 256 * (6 * sum(a * b for a, b in zip(sizes, sizes[1:])) - 2 * sizes[0] * sizes[1])
    return dict(nodes=nodes, inits=w, x_shape=(784,), batch=256, flops=flops, name="mlp")


def cnn_spec(seed=0):
    from onnx import helper
    rng = np.random.default_rng(seed)

    def conv(cin, cout):
        bound = 1 / np.sqrt(cin * 9)
        return (rng.uniform(-bound, bound, (cout, cin, 3, 3)).astype(np.float32),
                rng.uniform(-bound, bound, cout).astype(np.float32))
    w = {}
    w["C1"], w["c1"] = conv(1, 16)
    w["C2"], w["c2"] = conv(16, 32)
    w["D"], w["d"] = _linear(rng, 32 * 7 * 7, 10)
    nodes = [helper.make_node("Conv", ["x", "C1", "c1"], ["y1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "C2", "c2"], ["y2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y2"], ["r2"]),
             helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["p2"], ["f"], axis=1),
             helper.make_node("Gemm", ["f", "D", "d"], ["logits"], transB=1)]
    return dict(nodes=nodes, inits=w, x_shape=(1, 28, 28), batch=64, flops=None, name="cnn")


def lstm_spec(seed=0, T=32, I=64, H=128):
    from onnx import helper
    rng = np.random.default_rng(seed)
    b = 1 / np.sqrt(H)
    w = {"W": rng.uniform(-b, b, (1, 4 * H, I)).astype(np.float32),
         "R": rng.uniform(-b, b, (1, 4 * H, H)).astype(np.float32),
         "B": rng.uniform(-b, b, (1, 8 * H)).astype(np.float32)}
    w["D"], w["d"] = _linear(rng, H, 10)
    w["axis0"] = np.array([0], np.int64)
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B"], ["Y", "Y_h"], hidden_size=H),
             helper.make_node("Squeeze", ["Y_h", "axis0"], ["h"]),
             helper.make_node("Gemm", ["h", "D", "d"], ["logits"], transB=1)]
    # x is [T, N, I] (ONNX LSTM's layout, batch on axis 1); the batch is 64 sequences of 32
    return dict(nodes=nodes, inits=w, x_dims=[T, "N", I], batch=64, flops=None, name="lstm",
                T=T, I=I, H=H)


SPECS = {"mlp": mlp_spec, "cnn": cnn_spec, "lstm": lstm_spec}


def x_dims(spec):
    return spec.get("x_dims") or ["N", *spec["x_shape"]]


def onnx_model(spec):
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    g = helper.make_graph(
        spec["nodes"], spec["name"],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims(spec))],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v, k) for k, v in spec["inits"].items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return onnx.shape_inference.infer_shapes(m)


def torch_forward(name):
    import torch
    F = torch.nn.functional
    if name == "mlp":
        def f(x, p):
            h = F.relu(F.linear(x, p["W0"], p["b0"]))
            h = F.relu(F.linear(h, p["W1"], p["b1"]))
            return F.linear(h, p["W2"], p["b2"])
    elif name == "lstm":
        def f(x, p):  # p["lstm"]: a torch.nn.LSTM holding the same weights
            _, (h, _) = p["lstm"](x)
            return F.linear(h[0], p["D"], p["d"])
    else:
        def f(x, p):
            y = F.max_pool2d(F.relu(F.conv2d(x, p["C1"], p["c1"], padding=1)), 2)
            y = F.max_pool2d(F.relu(F.conv2d(y, p["C2"], p["c2"], padding=1)), 2)
            return F.linear(y.flatten(1), p["D"], p["d"])
    return f


def batches(spec, n=8, seed=1):
    rng = np.random.default_rng(seed)
    shape = [spec["batch"] if d == "N" else d for d in x_dims(spec)]
    return [(rng.standard_normal(shape).astype(np.float32),
             rng.integers(0, 10, spec["batch"])) for _ in range(n)]


# -- one side of one row (in a subprocess) -----------------------------------------------------
def _rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_side(row, side, steps, warmup, repeat, device, threads, profile=None):
    spec = SPECS[row]()
    data = batches(spec)
    if side == "onnxgrad":
        from onnxgrad.training import AdamW, Trainer
        __import__("onnxruntime")  # the libraries' own footprint is the baseline
        base = _rss_mb()
        tr = Trainer(onnx_model(spec), "cross_entropy", optimizer=AdamW(lr=1e-3),
                     device=device, threads=threads, progress=False, profile=profile)
        feeds = [{"x": x, "target": y} for x, y in data]

        def step(i):
            return tr.step(feeds[i % len(feeds)])
        sync = None
    else:
        import torch
        base = _rss_mb()
        torch.set_num_threads(threads)
        dev = "cuda" if device == "cuda" else "cpu"
        p = {k: torch.tensor(v, device=dev, requires_grad=True) for k, v in spec["inits"].items()
             if v.dtype == np.float32}
        params = list(p.values())
        if row == "lstm":  # ONNX gates i, o, f, c -> torch's i, f, g, o; B = [Wb, Rb]
            H = spec["H"]
            order = np.concatenate([np.arange(H) + k * H for k in (0, 2, 3, 1)])
            lstm = torch.nn.LSTM(spec["I"], H).to(dev)
            w = spec["inits"]
            with torch.no_grad():
                lstm.weight_ih_l0.copy_(torch.tensor(w["W"][0][order]))
                lstm.weight_hh_l0.copy_(torch.tensor(w["R"][0][order]))
                lstm.bias_ih_l0.copy_(torch.tensor(w["B"][0][:4 * H][order]))
                lstm.bias_hh_l0.copy_(torch.tensor(w["B"][0][4 * H:][order]))
            p = {"lstm": lstm, "D": p["D"], "d": p["d"]}
            params = list(lstm.parameters()) + [p["D"], p["d"]]
        opt = torch.optim.AdamW(params, lr=1e-3)
        fwd = torch_forward(row)
        # batches start on the host and are copied per step, as the Trainer's are
        tdata = [(torch.tensor(x), torch.tensor(y)) for x, y in data]

        def step(i):
            x, y = (t.to(dev) for t in tdata[i % len(tdata)])
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(fwd(x, p), y)
            loss.backward()
            opt.step()
            return loss.item()  # one host copy of the loss per step, as the Trainer does
        sync = torch.cuda.synchronize if dev == "cuda" else None
    for i in range(warmup):
        step(i)
    rates, cpu_rates = [], []
    k = warmup
    for _ in range(repeat):
        if sync:
            sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            step(k)
            k += 1
        if sync:
            sync()
        rates.append(steps / (time.perf_counter() - t0))
        cpu_rates.append(steps / (time.thread_time() - c0))
    out = {"steps_per_s": statistics.median(rates), "rates": rates,
           # at 1 thread both sides run every kernel on this thread: its CPU time leaves out
           # the time other processes held the core (a shared machine), wall time does not
           "cpu_steps_per_s": statistics.median(cpu_rates) if threads == 1 and
           device == "cpu" else None,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "base_rss_mb": base}
    if side == "onnxgrad" and profile:
        out["profile"] = tr.end_profiling()
    if side == "torch" and device == "cuda":
        import torch
        out["peak_device_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def gemm_peak(threads, device="cpu", n=1024, reps=20):
    """GFLOP/s of an onnxruntime MatMul n x n @ n x n (float32), best of ``reps`` runs."""
    from onnx import TensorProto, helper
    from onnxgrad.training.trainer import make_session
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    s = make_session(m, device, threads)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    import onnxruntime as ort
    dev = "cuda" if device == "cuda" else "cpu"
    av, bv = (ort.OrtValue.ortvalue_from_numpy(t, dev, 0) for t in (a, b))
    binding = s.io_binding()
    binding.bind_ortvalue_input("a", av)
    binding.bind_ortvalue_input("b", bv)
    binding.bind_output("c", dev)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        s.run_with_iobinding(binding)
        binding.synchronize_outputs()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def summarize_profile(path, top=12):
    """Total time per node and per op type from an onnxruntime profile (kernel events)."""
    with open(path) as f:
        events = json.load(f)
    by_node, by_op, runs = {}, {}, 0
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            runs += 1
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        name = e["name"][:-len("_kernel_time")]
        op = e.get("args", {}).get("op_name", "?")
        by_node[(name, op)] = by_node.get((name, op), 0) + e["dur"]
        by_op[op] = by_op.get(op, 0) + e["dur"]
    total = sum(by_op.values()) or 1
    runs = max(runs, 1)
    lines = [f"onnxruntime profile ({runs} runs, {total / runs / 1000:.2f} ms of kernels per "
             "run):", "", "| op type | ms/run | share |", "| --- | ---: | ---: |"]
    for op, t in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {op} | {t / runs / 1000:.3f} | {t / total:.1%} |")
    lines += ["", "| node | op | ms/run | share |", "| --- | --- | ---: | ---: |"]
    for (name, op), t in sorted(by_node.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {name} | {op} | {t / runs / 1000:.3f} | {t / total:.1%} |")
    return "\n".join(lines)


# -- the driver --------------------------------------------------------------------------------
def child(args):
    res = run_side(args.child_row, args.child_side, args.steps, args.warmup, args.repeat,
                   args.device, args.threads[0], args.child_profile)
    print("RESULT " + json.dumps(res))


def spawn(row, side, args, threads, profile=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child-row", row, "--child-side", side,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--repeat",
           str(args.repeat), "--device", args.device, "--threads", str(threads)]
    if profile:
        cmd += ["--child-profile", profile]
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{row}/{side} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def main(argv=None):
    from onnxgrad.training.trainer import cores
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed window")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3, help="timed windows per run (median)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of each side, alternated (median of their medians)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, nargs="+", default=[cores()],
                    help="thread counts to run every row at (both sides alike; default: cores)")
    ap.add_argument("--profile", nargs="*", choices=ROWS, default=None,
                    help="profile these rows (all when given alone) with onnxruntime")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--child-row", help=argparse.SUPPRESS)
    ap.add_argument("--child-side", help=argparse.SUPPRESS)
    ap.add_argument("--child-profile", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_row:
        return child(args)
    if args.device == "cuda":
        from onnxgrad.runtime import cuda_available
        if not cuda_available():
            print("no CUDA: onnxruntime cannot create a CUDA session on this machine "
                  "(onnxruntime-gpu, the CUDA/cuDNN libraries and a visible GPU are needed)",
                  file=sys.stderr)
            return 3
    import onnxruntime
    import torch
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# training steps/s, {args.device}, threads {args.threads}, {cores()} cores, load "
          f"average {load:.1f} at the start; onnxruntime {onnxruntime.__version__}, torch "
          f"{torch.__version__}; median over {args.rounds} alternated runs of the median of "
          f"{args.repeat} x {args.steps} steps after {args.warmup}")
    results = {"rows": {}, "gemm_peak_gflops": {}}
    peak = {}
    for t in args.threads:
        peak[t] = gemm_peak(t, args.device)
        results["gemm_peak_gflops"][t] = peak[t]
        print(f"\npeak GEMM (onnxruntime MatMul 1024^3 float32), {t} threads: "
              f"{peak[t]:.1f} GFLOP/s")
    print("\n| row | threads | onnxgrad steps/s | torch steps/s | ratio (ours/torch) | "
          "peak RSS ours MB (+ over imports) | peak RSS torch MB (+ over imports) | "
          "MLP GFLOP/s (fraction of peak) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in args.rows:
        for t in args.threads:
            # alternate the two sides over --rounds subprocess pairs (this machine is shared:
            # load drifts), then take each side's median rate and its largest peak RSS
            runs = {"onnxgrad": [], "torch": []}
            for _ in range(args.rounds):
                for side in runs:
                    runs[side].append(spawn(row, side, args, t))
            ours, ref = ({"steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
                          "rounds": [r["steps_per_s"] for r in rs],
                          "cpu_steps_per_s": (statistics.median(r["cpu_steps_per_s"] for r in rs)
                                              if rs[0].get("cpu_steps_per_s") else None),
                          "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                          "base_rss_mb": min(r["base_rss_mb"] for r in rs)}
                         for rs in runs.values())
            ratio = ours["steps_per_s"] / ref["steps_per_s"]
            cpu_ratio = (ours["cpu_steps_per_s"] / ref["cpu_steps_per_s"]
                         if ours["cpu_steps_per_s"] and ref["cpu_steps_per_s"] else None)
            shown = f"{ratio:.2f}" + (f" (CPU time {cpu_ratio:.2f})" if cpu_ratio else "")
            frac = ""
            if row == "mlp":
                gf = SPECS[row]()["flops"] * ours["steps_per_s"] / 1e9
                gft = SPECS[row]()["flops"] * ref["steps_per_s"] / 1e9
                frac = (f"ours {gf:.1f} ({gf / peak[t]:.0%}); torch {gft:.1f} "
                        f"({gft / peak[t]:.0%})")
            print(f"| {row} | {t} | {ours['steps_per_s']:.2f} | {ref['steps_per_s']:.2f} | "
                  f"{shown} | {ours['peak_rss_mb']:.0f} "
                  f"(+{ours['peak_rss_mb'] - ours['base_rss_mb']:.0f}) | "
                  f"{ref['peak_rss_mb']:.0f} (+{ref['peak_rss_mb'] - ref['base_rss_mb']:.0f}) | "
                  f"{frac} |", flush=True)
            results["rows"][f"{row}/{t}"] = {"onnxgrad": ours, "torch": ref, "ratio": ratio,
                                             "cpu_time_ratio": cpu_ratio}
    if args.profile is not None:
        t = args.threads[0]
        for row in args.profile or args.rows:
            prefix = os.path.join(tempfile.gettempdir(), f"train_step_{row}_profile")
            res = spawn(row, "onnxgrad", argparse.Namespace(**{**vars(args), "repeat": 1}), t,
                        profile=prefix)
            print(f"\n## {row}: where the onnxgrad step's time goes ({t} threads)\n")
            print(summarize_profile(res["profile"]))
            results["rows"].setdefault(f"{row}/{t}", {})["profile"] = res["profile"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
