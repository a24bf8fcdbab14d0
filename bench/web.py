"""Training in the browser: steps/s of onnxgrad's web train steps on onnxruntime-web (WASM, threads
under cross-origin isolation) against TensorFlow.js 4.22 training the same MLP in the same page
(its WASM backend, as many threads), and against onnxruntime Python on the same step graph.

    python bench/web.py                        # both rows, markdown table
    python bench/web.py --rows digits --steps 50 --rounds 5 --json

Rows (Adam lr 1e-3, no weight decay, on both sides, since TensorFlow.js has no AdamW;
cross-entropy; the same initial weights; 4 random batches made once and cycled):
    digits  the bundled digits MLP 64-64-10 (Gemm, Relu), batch 32
    mlp     784-1024-1024-10 (Gemm, Relu), batch 256 (bench/train_step.py's MLP)

Needs Debian's chromium and `npm ci` in web/ (with its dev dependencies: TensorFlow.js). The two
browser sides alternate timed windows of --steps steps, --rounds times, after --warmup steps; a
rate is the median window. onnxruntime Python runs the same step file with the parameters and
optimizer state kept in OrtValues swapped between steps (the Trainer's IOBinding ping-pong), one
window set before the browser runs and one after, with the same number of intra-op threads.
Ratios > 1 mean onnxgrad on onnxruntime-web is faster; in parentheses, the median of the ratios of
paired windows (each TensorFlow.js window runs right after an onnxgrad one), steadier on a shared
machine.
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
import urllib.parse

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

ROWS = ("digits", "mlp")


def build(row: str, folder: str) -> dict:
    """Export the row's web step into folder; returns the browser case."""
    import onnx
    from onnxgrad.training import Adam
    from onnxgrad.training.webstep import export_web_step
    if row == "digits":
        model = onnx.load(os.path.join(ROOT, "models", "digits_mlp.onnx"))
        layers, batch = [["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]], 32
    else:
        import train_step
        model = train_step.onnx_model(train_step.mlp_spec())
        layers, batch = [[f"W{i}", f"b{i}"] for i in range(3)], 256
    export_web_step(model, "cross_entropy", os.path.join(folder, f"{row}.onnx"),
                    optimizer=Adam(lr=1e-3))
    return {"name": row, "layers": layers, "batch": batch, "lr": 1e-3}


def python_rates(folder: str, case: dict, threads: int, steps: int, warmup: int,
                 rounds: int) -> list[float]:
    """Windows of steps/s of the same step file on onnxruntime Python (ORT_ENABLE_ALL)."""
    import onnx
    from onnx import numpy_helper
    from onnxgrad.runtime import ort_module
    from onnxgrad.training.trainer import make_session
    ort = ort_module()
    man = json.load(open(os.path.join(folder, f"{case['name']}.json")))
    sess = make_session(onnx.load(os.path.join(folder, man["files"]["step"]["name"])),
                        threads=threads)
    init = {t.name: numpy_helper.to_array(t) for t in
            onnx.load(os.path.join(folder, man["files"]["model"]["name"])).graph.initializer}
    roles = man["params"] + man["state"]
    start = [init[t["name"]] if "offset" in t else np.zeros(t["shape"], np.float32)
             for t in roles]
    sets = [[ort.OrtValue.ortvalue_from_numpy(np.array(v)) for v in start] for _ in range(2)]
    rng = np.random.default_rng(1)
    nin, b = man["inputs"][0]["shape"][1], case["batch"]
    batches = [(rng.random((b, nin), np.float32), rng.integers(0, 10, b).astype(np.int64))
               for _ in range(4)]
    loss = ort.OrtValue.ortvalue_from_numpy(np.zeros((), np.float32))
    lr = ort.OrtValue.ortvalue_from_numpy(np.array(case["lr"], np.float32))
    bindings = []
    for k in (0, 1):
        bd = sess.io_binding()
        for t, src, dst in zip(roles, sets[k], sets[1 - k]):
            bd.bind_ortvalue_input(t["name"], src)
            bd.bind_ortvalue_output(t["output"], dst)
        bd.bind_ortvalue_output(man["loss"]["name"], loss)
        bd.bind_ortvalue_input(man["lr"]["name"], lr)
        bindings.append(bd)

    def step(n):
        bd = bindings[n % 2]
        x, y = batches[n % len(batches)]
        bd.bind_cpu_input(man["inputs"][0]["name"], x)
        bd.bind_cpu_input(man["targets"][0]["name"], y)
        bd.bind_cpu_input(man["step"]["name"], np.array(n + 1, np.int64))
        sess.run_with_iobinding(bd)
        return float(loss.numpy())

    for n in range(warmup):
        step(n)
    rates, n = [], warmup
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step(n)
            n += 1
        rates.append(steps / (time.perf_counter() - t0))
    return rates


def browser(folder: str, cases: list[dict], threads: int, timeout: int) -> dict:
    from onnxgrad import web
    if not os.path.isdir(os.path.join(ROOT, "web", "node_modules", "@tensorflow", "tfjs")):
        raise SystemExit("TensorFlow.js is not installed: run `npm ci` in web/ (the benchmark "
                         "needs its dev dependencies)")
    srv = web.start(os.path.join(ROOT, "web"), port=0, mounts={"/data/": folder})
    try:
        q = urllib.parse.urlencode({"cases": json.dumps(cases), "threads": threads})
        proc = subprocess.run(["node", os.path.join(ROOT, "web", "tools", "page.mjs"),
                               f"{srv.url}bench.html?{q}", str(timeout)],
                              capture_output=True, text=True, timeout=timeout + 60)
    finally:
        srv.shutdown()
        srv.server_close()
    if proc.returncode != 0:
        raise SystemExit(f"the browser run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout)
    if "error" in res:
        raise SystemExit(f"the page failed: {res['error']}\n" + "\n".join(res["log"][-20:]))
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--steps", type=int, default=None, help="steps per timed window "
                   "(default 100 for digits, 10 for mlp)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None,
                   help="threads on every side (default: the cores this process may use)")
    p.add_argument("--timeout", type=int, default=900, help="for the browser run, seconds")
    p.add_argument("--json", action="store_true", help="print the raw results as JSON too")
    args = p.parse_args(argv)
    from onnxgrad.training.trainer import cores
    threads = args.threads or cores()
    default_steps = {"digits": 100, "mlp": 10}
    with tempfile.TemporaryDirectory() as folder:
        cases = []
        for row in args.rows:
            c = build(row, folder)
            c.update(steps=args.steps or default_steps[row], warmup=args.warmup,
                     rounds=args.rounds)
            cases.append(c)
        py = {c["name"]: python_rates(folder, c, threads, c["steps"], c["warmup"], c["rounds"])
              for c in cases}
        res = browser(folder, cases, threads, args.timeout)
        for c in cases:
            py[c["name"]] += python_rates(folder, c, threads, c["steps"], c["warmup"],
                                          c["rounds"])
    env = res["env"]
    print(f"threads {threads} (onnxruntime-web {env['ort']}: {env['threads']}, cross-origin "
          f"isolated: {env['isolated']}; TensorFlow.js {env['tfjs']} WASM: set to {threads}, "
          f"getThreadsCount() says {env['tfjsThreadsReported']}); {env['userAgent']}")
    print()
    print("| row | onnxgrad on onnxruntime-web WASM | TensorFlow.js WASM | onnxruntime Python "
          "(same graph) | vs TensorFlow.js (paired windows) | vs onnxruntime Python |")
    print("|---|---:|---:|---:|---:|---:|")
    names = {"digits": "digits MLP 64-64-10, batch 32",
             "mlp": "MLP 784-1024-1024-10, batch 256"}
    for r in res["results"]:
        ours, tfjs, pyr = r["onnxgrad"], r["tfjs"], statistics.median(py[r["name"]])
        w = r["windows"]  # each TensorFlow.js window ran right after an onnxgrad one
        paired = statistics.median(a / b for a, b in zip(w["onnxgrad"], w["tfjs"]))
        print(f"| {names[r['name']]} | {ours:.1f} steps/s | {tfjs:.1f} steps/s | "
              f"{pyr:.1f} steps/s | {ours / tfjs:.2f}x ({paired:.2f}x) | {ours / pyr:.2f}x |")
    print()
    for r in res["results"]:
        f = r["first"]
        print(f"{r['name']}: first loss onnxgrad {f['onnxgrad']:.6f}, TensorFlow.js "
              f"{f['tfjs']:.6f} (same weights, same batch); windows onnxgrad "
              f"{[round(v, 1) for v in r['windows']['onnxgrad']]}, TensorFlow.js "
              f"{[round(v, 1) for v in r['windows']['tfjs']]}, Python "
              f"{[round(v, 1) for v in py[r['name']]]}")
    if args.json:
        print(json.dumps({"browser": res, "python": py}))


if __name__ == "__main__":
    main()
