"""One optimizer update of every parameter of a model, alone: onnxgrad's optimizer graph on
onnxruntime, onnxgrad's fused CPU kernel (onnxgrad.training.fused) and PyTorch's optimizer
(fused=True, its fastest CPU path, and its for-loop), in one run.

    python bench/optimizer.py                  # AdamW, ResNet-18's parameters, 1 and 2 threads
    python bench/optimizer.py --optimizer sgd  # SGD with momentum 0.9
    python bench/optimizer.py --model mlp --threads 1

The parameters are the shapes of bench/torch_models.py's module (ResNet-18: 62 tensors, 11.2 M
float32 values; mlp: 784-1024-1024-10). Every side updates the same values with the same
gradients (random, fixed seed) in place, as a training step does: the graph with the Trainer's
bindings (state read and written in one buffer, parameters into the other set), the fused kernel
on the same kind of buffers, torch on its own tensors. Each side runs ``--repeat`` updates after a
warm-up, the sides alternate ``--rounds`` times; the table gives medians and the ratio of the
graph's and torch's time to the fused kernel's (> 1: the fused kernel is faster).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from onnxgrad.training import SGD, AdamW  # noqa: E402


def shapes(model: str) -> list[tuple[int, ...]]:
    import torch_models
    module = torch_models.make(model)[0]
    return [tuple(p.shape) for p in module.parameters()]


OURS = {"adamw": lambda: AdamW(lr=1e-3), "sgd": lambda: SGD(lr=1e-3, momentum=0.9)}


def graph_side(values, grads, threads, opt):
    """The Trainer's one-graph optimizer (build_apply_model) with its in-place bindings."""
    from onnxgrad.training.step import TrainStep, build_apply_model
    from onnxgrad.training.trainer import make_session
    import onnxruntime as ort
    names = [f"p{i}" for i in range(len(values))]
    desc = TrainStep(model=None, loss="", data_inputs=[], params=names, param_outputs=[],
                     initial_params=dict(zip(names, values)))
    ap = build_apply_model(desc, OURS[opt]())
    sess = make_session(ap.model, "cpu", threads)
    ov = ort.OrtValue.ortvalue_from_numpy
    sets = [[ov(v.copy()) for v in values] for _ in range(2)]
    state = [ov(np.zeros_like(values[names.index(p)])) for p, _ in ap.state_of]
    gv = [ov(g) for g in grads]
    lr, step = ov(np.array(1e-3)), ov(np.array(1, np.int64))
    binds = []
    for k in (0, 1):
        b = sess.io_binding()
        for n, x in zip(ap.params, sets[k]):
            b.bind_ortvalue_input(n, x)
        for n, x in zip(ap.param_outputs, sets[1 - k]):
            b.bind_ortvalue_output(n, x)
        for n, x in zip(ap.grads, gv):
            b.bind_ortvalue_input(n, x)
        for n, no, x in zip(ap.state, ap.state_outputs, state):
            b.bind_ortvalue_input(n, x)
            b.bind_ortvalue_output(no, x)
        b.bind_ortvalue_input(ap.lr, lr)
        b.bind_ortvalue_input(ap.step, step)
        binds.append(b)
    cur = [0]

    def update():
        sess.run_with_iobinding(binds[cur[0]])
        cur[0] = 1 - cur[0]
    return update


def fused_side(values, grads, threads, opt):
    from onnxgrad.training import fused
    kern = fused.make(OURS[opt](), np.float32, threads)
    p = [v.copy() for v in values]
    m = [np.zeros_like(v) for v in values]
    s = [np.zeros_like(v) for v in values]
    slots = [(a.ctypes.data, g.ctypes.data, b.ctypes.data,
              c.ctypes.data if opt == "adamw" else 0, 0, a.size)
             for a, g, b, c in zip(p, grads, m, s)]
    keep = (p, m, s)  # the kernel gets raw addresses: the arrays must outlive it

    def update():
        kern.apply(slots, 1e-3, 1)
        return keep
    return update


def torch_side(values, grads, threads, opt, fused_):
    import torch
    torch.set_num_threads(threads)
    ps = [torch.nn.Parameter(torch.tensor(v)) for v in values]
    for p, g in zip(ps, grads):
        p.grad = torch.tensor(g)
    kw = dict(fused=fused_, foreach=False if not fused_ else None)
    o = (torch.optim.AdamW(ps, lr=1e-3, **kw) if opt == "adamw"
         else torch.optim.SGD(ps, lr=1e-3, momentum=0.9, **kw))
    return o.step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet18", choices=["resnet18", "mlp", "mobilenetv3",
                                                            "transformer"])
    ap.add_argument("--optimizer", default="adamw", choices=sorted(OURS))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from onnxgrad.training import fused
    if fused.unavailable():
        sys.exit(f"no fused kernel on this machine: {fused.unavailable()}")
    rng = np.random.default_rng(0)
    shp = shapes(args.model)
    values = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in shp]
    grads = [rng.standard_normal(s).astype(np.float32) * 0.01 for s in shp]
    total = sum(v.size for v in values)
    print(f"# {args.optimizer} update of {args.model}'s {len(shp)} parameters "
          f"({total / 1e6:.1f} M float32), {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; median of {args.rounds} alternated rounds of "
          f"{args.repeat} updates\n")
    print("| threads | onnxgrad graph ms | fused ms | torch fused=True ms | torch for-loop ms | "
          "graph / fused | torch fused / fused |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for t in args.threads:
        o = args.optimizer
        sides = {"graph": graph_side(values, grads, t, o),
                 "fused": fused_side(values, grads, t, o),
                 "torch_fused": torch_side(values, grads, t, o, True),
                 "torch_loop": torch_side(values, grads, t, o, False)}
        times = {k: [] for k in sides}
        for f in sides.values():
            f()
        for _ in range(args.rounds):
            for k, f in sides.items():
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"| {t} | {ms['graph']:.2f} | {ms['fused']:.2f} | {ms['torch_fused']:.2f} | "
              f"{ms['torch_loop']:.2f} | {ms['graph'] / ms['fused']:.2f} | "
              f"{ms['torch_fused'] / ms['fused']:.2f} |")


if __name__ == "__main__":
    main()
