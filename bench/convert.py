"""Converter benchmark: a TF1 LSTM written the way dynamic_rnn runs it (TensorArrays in a while
loop) plus its tf.gradients graph (stacks, a backward while loop), converted to ONNX and run on
onnxruntime CPU, against TensorFlow running the same GraphDef and PyTorch's nn.LSTM doing the
same forward+backward, in one run, the three interleaved; wall-clock and process CPU time (the
latter leaves out waiting for a core on a shared machine). Also the conversion time.

    python bench/convert.py [--threads 1] [--batch 32] [--steps 50] [--units 128] [--repeat 20]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def interleaved_ms(fns: dict, repeat: int) -> dict:
    """{name: (median wall ms, median process-CPU ms)}, the sides run in turn each round (so
    that load from other jobs hits all alike). CPU time counts every thread of the process
    (TensorFlow runs its kernels on its own pool threads), and leaves out time spent waiting
    for a core on a shared machine."""
    for fn in fns.values():
        fn()
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            cpu[k].append(time.process_time() - c)
            wall[k].append(time.perf_counter() - t)
    return {k: (1e3 * float(np.median(wall[k])), 1e3 * float(np.median(cpu[k]))) for k in fns}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--units", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args(argv)

    import tensorflow as tf
    import torch
    from test_tf_v1 import dynamic_rnn_lstm
    from tf_util import tf1_graph

    from onnxgrad.converters.tensorflow import convert
    from onnxgrad.runtime import ort_module, session_options

    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    torch.set_num_threads(a.threads)
    T, B, I, H = a.steps, a.batch, a.inputs, a.units

    def build():
        x = tf.compat.v1.placeholder(tf.float32, [None, T, I], name="x")
        lens = tf.compat.v1.placeholder(tf.int32, [None], name="lens")
        out, c, h = dynamic_rnn_lstm(x, lens, H)
        y = tf.reduce_sum(out * out, name="y")
        kernel = tf.compat.v1.trainable_variables()[0]
        return y, tf.gradients(y, [x, kernel])
    g, (y, grads) = tf1_graph(build)
    fetch = [y.name] + [t.name for t in grads]
    r = np.random.RandomState(0)
    feeds = {"x:0": r.randn(B, T, I).astype(np.float32), "lens:0": np.full(B, T, np.int32)}
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=a.threads,
                                      inter_op_parallelism_threads=1)
    with g.as_default(), tf.compat.v1.Session(config=config) as s:
        s.run(tf.compat.v1.global_variables_initializer())
        frozen = tf.compat.v1.graph_util.convert_variables_to_constants(
            s, g.as_graph_def(add_shapes=True), [t.split(":")[0] for t in fetch])
    gf = tf.Graph()
    with gf.as_default():
        tf.import_graph_def(frozen, name="")
    sess_tf = tf.compat.v1.Session(graph=gf, config=config)
    t0 = time.perf_counter()
    model = convert(frozen, inputs=list(feeds), outputs=fetch)
    convert_s = time.perf_counter() - t0
    ort = ort_module()
    sess = ort.InferenceSession(model.SerializeToString(), session_options(a.threads),
                                providers=["CPUExecutionProvider"])
    want = sess_tf.run(fetch, feeds)
    got = sess.run(fetch, feeds)
    err = max(float(np.max(np.abs(w - o) / (np.abs(w) + 1e-3))) for w, o in zip(want, got))

    lstm = torch.nn.LSTM(I, H, batch_first=True)
    xt = torch.tensor(feeds["x:0"], requires_grad=True)

    def torch_step():
        lstm.zero_grad()
        xt.grad = None
        out, _ = lstm(xt)
        (out * out).sum().backward()

    ms = interleaved_ms({"ours": lambda: sess.run(fetch, feeds),
                         "tf": lambda: sess_tf.run(fetch, feeds), "torch": torch_step}, a.repeat)
    print(f"LSTM T={T} B={B} I={I} H={H}, forward + tf.gradients, {a.threads} thread(s); "
          f"{len(model.graph.node)} ONNX nodes, converted in {convert_s:.2f} s, "
          f"max rel. difference to TF {err:.1e}")
    (w_o, c_o), (w_t, c_t), (w_p, c_p) = ms["ours"], ms["tf"], ms["torch"]
    print(f"  {'':24s} {'wall':>9s} {'CPU':>9s}   ours/other: wall, CPU")
    print(f"  onnxruntime (converted) {w_o:7.2f}ms {c_o:7.2f}ms")
    print(f"  TensorFlow (same graph) {w_t:7.2f}ms {c_t:7.2f}ms   {w_o / w_t:.2f}x, {c_o / c_t:.2f}x")
    print(f"  PyTorch nn.LSTM         {w_p:7.2f}ms {c_p:7.2f}ms   {w_o / w_p:.2f}x, {c_o / c_p:.2f}x")


if __name__ == "__main__":
    main()
