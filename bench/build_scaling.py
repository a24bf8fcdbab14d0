"""How the cost of building gradient graphs grows with the model.

    python bench/build_scaling.py                 # 1k, 10k, 100k nodes + the MLP node ratio
    python bench/build_scaling.py --sizes 1000 10000 --repeat 3
    python bench/build_scaling.py --profile 10000 # cProfile one gradients() call at that size

Times the ``onnxgrad.gradients`` call alone (the model is built and serialized beforehand; the
call includes everything it does: shape inference, onnx-ir conversion both ways, the sweep),
the median of a few runs, on synthetic "residual ladders" of ``--sizes`` nodes:

    h_{i+1} = h_i + a_i * Tanh(h_i @ W_i)     h: float32 [N, 16] (N symbolic), W_i [16, 16], a_i [16]

four nodes per rung, gradients of sum(h_last) with respect to every W_i and a_i and the input.
Goals: time(100k) / time(10k) < 12 (linear, with slack) and 10k nodes under 1 s.

Also counts gradient-graph nodes per forward node on an MLP 784-1024-1024-10 (Gemm, Relu,
softmax cross-entropy loss) differentiated with respect to all its weights and biases (goal < 3).
Prints a markdown table.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxgrad

D = 16
F32 = TensorProto.FLOAT


def ladder(n_nodes: int, seed: int = 0) -> tuple[onnx.ModelProto, str, list[str]]:
    """A residual ladder of about ``n_nodes`` nodes: (model, y, xs)."""
    rng = np.random.default_rng(seed)
    rungs = max(1, n_nodes // 4)
    nodes, inits, xs = [], [], ["x"]
    h = "x"
    for i in range(rungs):
        w, a = f"W{i}", f"a{i}"
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32), w))
        inits.append(numpy_helper.from_array(np.full(D, 0.1, np.float32), a))
        xs += [w, a]
        nxt = f"h{i + 1}"
        nodes += [helper.make_node("MatMul", [h, w], [f"m{i}"], name=f"r{i}/MatMul"),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"r{i}/Tanh"),
                  helper.make_node("Mul", [f"t{i}", a], [f"s{i}"], name=f"r{i}/Mul"),
                  helper.make_node("Add", [h, f"s{i}"], [nxt], name=f"r{i}/Add")]
        h = nxt
    g = helper.make_graph(nodes, f"ladder{n_nodes}",
                          [helper.make_tensor_value_info("x", F32, ["N", D])],
                          [helper.make_tensor_value_info(h, F32, ["N", D])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return m, h, xs


def mlp(sizes=(784, 1024, 1024, 10), seed: int = 0) -> tuple[onnx.ModelProto, str, list[str]]:
    """An MLP with Gemm + Relu layers and a softmax cross-entropy loss: (model, loss, params)."""
    rng = np.random.default_rng(seed)
    nodes, inits, params = [], [], []
    h = "x"
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        w, b = f"W{i}", f"b{i}"
        inits += [numpy_helper.from_array(
            (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32), w),
            numpy_helper.from_array(np.zeros(fan_out, np.float32), b)]
        params += [w, b]
        out = "logits" if i == len(sizes) - 2 else f"z{i}"
        nodes.append(helper.make_node("Gemm", [h, w, b], [out], name=f"fc{i}"))
        if out != "logits":
            nodes.append(helper.make_node("Relu", [out], [f"h{i}"], name=f"relu{i}"))
            h = f"h{i}"
    nodes += [
        helper.make_node("LogSoftmax", ["logits"], ["logp"], axis=1),
        helper.make_node("Mul", ["labels", "logp"], ["lp"]),
        helper.make_node("Constant", [], ["axis1"],
                         value=numpy_helper.from_array(np.array([1], np.int64))),
        helper.make_node("ReduceSum", ["lp", "axis1"], ["nll_neg"], keepdims=0),
        helper.make_node("Neg", ["nll_neg"], ["nll"]),
        helper.make_node("ReduceMean", ["nll"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(nodes, "mlp",
                          [helper.make_tensor_value_info("x", F32, ["N", sizes[0]]),
                           helper.make_tensor_value_info("labels", F32, ["N", sizes[-1]])],
                          [helper.make_tensor_value_info("loss", F32, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return m, "loss", params


def _median_time(fn, repeat: int):
    """(median wall seconds, median CPU seconds of this process, last result)."""
    wall, cpu, res = [], [], None
    for _ in range(repeat):
        res = None
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        res = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(wall), statistics.median(cpu), res


def time_build(model, y, xs, repeat: int):
    """(median wall s, median CPU s, GradientsResult) of ``onnxgrad.gradients(model, y, xs)``."""
    return _median_time(lambda: onnxgrad.gradients(model, y, xs), repeat)


def time_roundtrip(model, repeat: int) -> float:
    """Median CPU seconds of onnx-ir from_proto + to_proto of ``model``: the floor that any
    gradients() call built on onnx-ir pays, and a yardstick for this machine's speed."""
    import onnx_ir as ir
    return _median_time(lambda: ir.serde.serialize_model(ir.serde.deserialize_model(model)),
                        repeat)[1]


def added_nodes(model, res) -> tuple[int, int]:
    """(all nodes gradients() added, of which Constant nodes)."""
    new = res.model.graph.node[len(model.graph.node):]
    return len(new), sum(n.op_type == "Constant" for n in new)


def profile(n_nodes: int, top: int = 25) -> None:
    model, y, xs = ladder(n_nodes)
    prof = cProfile.Profile()
    prof.enable()
    onnxgrad.gradients(model, y, xs)
    prof.disable()
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        print(f"--- {n_nodes} nodes, sorted by {key} ---")
        print(s.getvalue())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    p.add_argument("--repeat", type=int, default=None,
                   help="runs per size (default 5 below 100k nodes, 3 from 100k)")
    p.add_argument("--profile", type=int, metavar="NODES", help="cProfile one call and stop")
    args = p.parse_args(argv)
    if args.profile:
        profile(args.profile)
        return 0

    rows, secs = [], {}
    for n in args.sizes:
        model, y, xs = ladder(n)
        repeat = args.repeat or (5 if n < 100_000 else 3)
        t, cpu, res = time_build(model, y, xs, repeat)
        base = time_roundtrip(model, repeat)
        added, consts = added_nodes(model, res)
        fwd = len(model.graph.node)
        secs[fwd] = t, cpu
        rows.append((f"ladder, {fwd} nodes", f"{t:.3f}", f"{cpu:.3f}", f"{cpu / fwd * 1e6:.0f}",
                     f"{base:.3f}", f"{cpu / base:.1f}", f"{added / fwd:.2f}", str(repeat)))
        print(f"  {fwd} nodes: {t:.3f} s wall, {cpu:.3f} s CPU, onnx-ir round trip {base:.3f} s",
              file=sys.stderr)

    model, y, params = mlp()
    t, cpu, res = time_build(model, y, params, 3)
    base = time_roundtrip(model, 3)
    added, consts = added_nodes(model, res)
    fwd = len(model.graph.node)
    rows.append((f"MLP 784-1024-1024-10, {fwd} nodes", f"{t:.3f}", f"{cpu:.3f}",
                 f"{cpu / fwd * 1e6:.0f}", f"{base:.3f}", f"{cpu / base:.1f}",
                 f"{added / fwd:.2f} ({(added - consts) / fwd:.2f} without Constant)", "3"))

    print("| model | build s (wall, median) | build s (CPU) | CPU µs / fwd node "
          "| onnx-ir round trip s (CPU) | build / round trip | grad nodes / fwd node | runs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(r) + " |")

    print()
    fwd_sizes = sorted(secs)
    goals = []
    for small, big in zip(fwd_sizes, fwd_sizes[1:]):
        ratio, cpu_ratio = (secs[big][i] / secs[small][i] for i in (0, 1))
        goals.append(f"- time({big}) / time({small}) = {ratio:.2f} wall, {cpu_ratio:.2f} CPU "
                     f"(size ratio {big / small:.0f}; goal < {1.2 * big / small:.0f})")
    for size in fwd_sizes:
        if 9_000 <= size <= 11_000:
            goals.append(f"- {size} nodes: {secs[size][0]:.3f} s wall, {secs[size][1]:.3f} s CPU "
                         "(goal < 1 s)")
    goals.append(f"- MLP: {added / fwd:.2f} gradient nodes per forward node (goal < 3)")
    print("\n".join(goals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
