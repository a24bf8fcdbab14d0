"""The training cases tests/test_distributed.py runs on 2 processes (tests/dist_worker.py, started
by torchrun) and on 1 process (in pytest): the same models, data, seed and global batches."""
from __future__ import annotations

import os

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.training import Trainer, make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "models", "digits_mlp.onnx")


def digits(rows: int | None = None, nan_row: int | None = None) -> dict:
    with np.load(os.path.join(ROOT, "models", "digits.npz")) as z:
        data = {"x": z["x"][:rows].copy(), "target": z["y"][:rows].copy()}
    if nan_row is not None:  # finite data (the Trainer refuses NaN data) that overflows the loss
        data["x"][nan_row, :] = 3e38
    return data


def digits_cnn(seed: int = 0):
    """x [N, 64] -> 1x8x8 image -> Conv 4 3x3, Relu, MaxPool 2 -> Conv 8 3x3, Relu,
    AveragePool 2 -> Gemm to 10 logits."""
    rng = np.random.default_rng(seed)
    w = {"C1": rng.standard_normal((4, 1, 3, 3)) * 0.3, "c1": rng.standard_normal(4) * 0.1,
         "C2": rng.standard_normal((8, 4, 3, 3)) * 0.2, "c2": rng.standard_normal(8) * 0.1,
         "D": rng.standard_normal((10, 32)) * 0.2, "d": np.zeros(10),
         "shape": np.array([-1, 1, 8, 8])}
    inits = [numpy_helper.from_array(v.astype(np.int64 if k == "shape" else np.float32), k)
             for k, v in w.items()]
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["img"]),
             helper.make_node("Conv", ["img", "C1", "c1"], ["y1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "C2", "c2"], ["y2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y2"], ["r2"]),
             helper.make_node("AveragePool", ["r2"], ["p2"], kernel_shape=[2, 2],
                              strides=[2, 2]),
             helper.make_node("Flatten", ["p2"], ["f"], axis=1),
             helper.make_node("Gemm", ["f", "D", "d"], ["logits"], transB=1)]
    g = helper.make_graph(nodes, "digits_cnn",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                         ["N", 10])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


ADAMW = ("adamw", {"lr": 1e-2})
# name: model, data rows, Trainer options, fit options; options only DistributedTrainer takes
# (zero, bucket_mb) are dropped for the single-process reference
CASES = {
    "mlp": ("mlp", None, {}, {"batch_size": 64, "max_steps": 20}),
    "cnn": ("cnn", None, {}, {"batch_size": 64, "max_steps": 20}),
    "mlp_zero": ("mlp", None, {"zero": True}, {"batch_size": 64, "max_steps": 20}),
    "cnn_zero": ("cnn", None, {"zero": True}, {"batch_size": 64, "max_steps": 20}),
    # SGD's momentum slot and global-norm clipping, each rank holding half the gradients
    "zero_sgd_clip": ("mlp", None, {"zero": True, "clip_norm": 0.5,
                                    "optimizer": ("sgd", {"lr": 0.05, "momentum": 0.9})},
                      {"batch_size": 64, "max_steps": 20}),
    # one bucket per tensor, and 2 micro-batches per rank
    "buckets": ("mlp", None, {"bucket_mb": 0.005, "accumulation_steps": 2},
                {"batch_size": 64, "max_steps": 20}),
    # 131 rows: batches 64, 64, 3 (the last split 2 + 1)
    "uneven": ("mlp", 131, {}, {"batch_size": 64, "epochs": 2}),
    # 129 rows: the last batch has 1 row, rank 1 none
    "short_last": ("mlp", 129, {"zero": True}, {"batch_size": 64, "epochs": 2}),
    "drop_last": ("mlp", 131, {}, {"batch_size": 64, "epochs": 2, "drop_last": True}),
    # the uninterrupted runs the resume test reproduces
    "resume_ref": ("mlp", 300, {}, {"batch_size": 64, "epochs": 3}),
    "resume_ref_zero": ("mlp", 300, {"zero": True}, {"batch_size": 64, "epochs": 3}),
}
DIST_ONLY = ("zero", "bucket_mb")


def model_of(name: str):
    return MLP if name == "mlp" else digits_cnn()


def trainer(case: str, cls=Trainer, **extra):
    model, _, opts, _ = CASES[case]
    opts = dict(opts)
    name, kw = opts.pop("optimizer", ADAMW)
    if cls is Trainer:
        opts = {k: v for k, v in opts.items() if k not in DIST_ONLY}
    return cls(model_of(model), "cross_entropy", optimizer=make_optimizer(name, **kw),
               device="cpu", threads=1, progress=False, seed=7, **opts, **extra)


def fit(case: str, tr, **extra) -> list[float]:
    _, rows, _, fit_opts = CASES[case]
    return tr.fit(digits(rows), **fit_opts, **extra)
