"""onnxruntime-training 1.19.2 as a side of bench/train_step.py (run in its own virtual
environment: it needs Python <= 3.11 and onnx 1.16, see train_step.ort_training_python).

    python ort_training_side.py SPEC.json    # prints "RESULT {json}" on its last line

SPEC: {"model": .onnx path, "batches": .npz path (x0, y0, x1, y1, ...), "params": the
initializer names to train, "steps", "warmup", "repeat", "threads", "workdir"}. The artifacts
(training, eval and optimizer graphs, checkpoint) come from ``generate_artifacts`` with
onnxruntime's CrossEntropyLoss (mean over the batch) and its AdamW block with torch.optim.AdamW's
defaults (eps 1e-8, weight decay 1e-2), lr 1e-3; each step is the training API's loop:
``module(x, y)`` (forward, backward, the loss copied to the host), ``optimizer.step()``,
``module.lazy_reset_grad()``. Only numpy and onnxruntime-training are imported (no onnxgrad).
"""
import json
import os
import statistics
import sys
import time

from rss import rss_mb


def main(path):
    with open(path) as f:
        spec = json.load(f)
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnxruntime.training import artifacts, onnxblock
    from onnxruntime.training.api import CheckpointState, Module, Optimizer
    base = rss_mb()
    out = os.path.join(spec["workdir"], "artifacts")
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    artifacts.generate_artifacts(
        onnx.load(spec["model"]), requires_grad=spec["params"],
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=onnxblock.optim.AdamW(eps=1e-8, weight_decay=1e-2), artifact_directory=out)
    build_s = time.perf_counter() - t0
    so = ort.SessionOptions()
    so.intra_op_num_threads = spec["threads"]
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    state = CheckpointState.load_checkpoint(os.path.join(out, "checkpoint"))
    module = Module(os.path.join(out, "training_model.onnx"), state,
                    os.path.join(out, "eval_model.onnx"), session_options=so)
    opt = Optimizer(os.path.join(out, "optimizer_model.onnx"), module)
    opt.set_learning_rate(1e-3)
    module.train()
    with np.load(spec["batches"]) as z:
        data = [(z[f"x{i}"], z[f"y{i}"].astype(np.int64)) for i in range(len(z.files) // 2)]

    def step(i):
        x, y = data[i % len(data)]
        loss = module(x, y)
        opt.step()
        module.lazy_reset_grad()
        return float(loss)

    first = step(0)
    for i in range(1, spec["warmup"]):
        step(i)
    rates, cpu_rates, k = [], [], max(spec["warmup"], 1)
    for _ in range(spec["repeat"]):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(spec["steps"]):
            step(k)
            k += 1
        rates.append(spec["steps"] / (time.perf_counter() - t0))
        cpu_rates.append(spec["steps"] / (time.process_time() - c0))
    res = {"steps_per_s": statistics.median(rates), "rates": rates,
           "cpu_steps_per_s": statistics.median(cpu_rates) if spec["threads"] == 1 else None,
           "peak_rss_mb": rss_mb("VmHWM"),
           "base_rss_mb": base, "build_s": build_s, "first_loss": first, "version": ort.__version__}
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
