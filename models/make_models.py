"""Write the small bundled models into models/ (deterministic: fixed seed, same bytes every run).

    python models/make_models.py            # writes models/mlp.onnx and models/attention.onnx
    python models/make_models.py --out DIR  # somewhere else

mlp.onnx        x [N, 64], labels [N, 10] (one-hot) -> logits [N, 10], loss []
                logits = Gemm(Tanh(x @ W1 + b1), W2, b2)
                loss = ReduceMean(-ReduceSum(labels * Log(Softmax(logits)), axis 1))
attention.onnx  x [N, 8, 16] -> y [N, 8, 16], loss []
                one head of self-attention with Q/K/V/output projections and a residual:
                y = x + Softmax((x Wq)(x Wk)^T / sqrt(16)) (x Wv) Wo,  loss = ReduceMean(y * y)

Both are ir_version 10, opset 18, and pass onnx.checker.check_model(full_check=True).
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 10
OPSET = 18
SEED = 0
HERE = os.path.dirname(os.path.abspath(__file__))


def _init(rng, name, shape, fan_in):
    w = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
    return numpy_helper.from_array(w, name)


def _zeros(name, shape):
    return numpy_helper.from_array(np.zeros(shape, np.float32), name)


def _const(name, value, dtype=np.int64):
    return helper.make_node("Constant", [], [name],
                            value=numpy_helper.from_array(np.asarray(value, dtype), name))


def _finish(graph, doc) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              ir_version=IR_VERSION, producer_name="onnxgrad-models",
                              doc_string=doc)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model, full_check=True)
    return model


def mlp(seed: int = SEED) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    f32 = TensorProto.FLOAT
    inits = [_init(rng, "W1", [64, 32], 64), _zeros("b1", [32]),
             _init(rng, "W2", [32, 10], 32), _zeros("b2", [10])]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["xW1"], name="fc1/MatMul"),
        helper.make_node("Add", ["xW1", "b1"], ["fc1"], name="fc1/Add"),
        helper.make_node("Tanh", ["fc1"], ["h1"], name="act1"),
        helper.make_node("Gemm", ["h1", "W2", "b2"], ["logits"], name="fc2"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=1),
        helper.make_node("Log", ["probs"], ["log_probs"], name="log"),
        helper.make_node("Mul", ["labels", "log_probs"], ["weighted"], name="xent/Mul"),
        _const("axis_1", [1]),
        helper.make_node("ReduceSum", ["weighted", "axis_1"], ["sum_lp"], name="xent/ReduceSum",
                         keepdims=0),
        helper.make_node("Neg", ["sum_lp"], ["per_example"], name="xent/Neg"),
        helper.make_node("ReduceMean", ["per_example"], ["loss"], name="xent/ReduceMean",
                         keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", f32, ["N", 64]),
         helper.make_tensor_value_info("labels", f32, ["N", 10])],
        [helper.make_tensor_value_info("logits", f32, ["N", 10]),
         helper.make_tensor_value_info("loss", f32, [])],
        inits)
    return _finish(graph, "MLP 64-32-10 (Tanh) with a softmax cross-entropy loss")


def attention(seed: int = SEED, seq: int = 8, d: int = 16) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    f32 = TensorProto.FLOAT
    inits = [_init(rng, name, [d, d], d) for name in ("Wq", "Wk", "Wv", "Wo")]
    inits.append(numpy_helper.from_array(np.array(1 / np.sqrt(d), np.float32), "scale"))
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["x", "Wk"], ["k"], name="k_proj"),
        helper.make_node("MatMul", ["x", "Wv"], ["v"], name="v_proj"),
        helper.make_node("Transpose", ["k"], ["kT"], name="k_transpose", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kT"], ["scores_raw"], name="scores"),
        helper.make_node("Mul", ["scores_raw", "scale"], ["scores_scaled"], name="scale_scores"),
        helper.make_node("Softmax", ["scores_scaled"], ["attn"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["attn", "v"], ["ctx"], name="attend"),
        helper.make_node("MatMul", ["ctx", "Wo"], ["proj"], name="o_proj"),
        helper.make_node("Add", ["x", "proj"], ["y"], name="residual"),
        helper.make_node("Mul", ["y", "y"], ["y_sq"], name="loss/square"),
        helper.make_node("ReduceMean", ["y_sq"], ["loss"], name="loss/mean", keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info("x", f32, ["N", seq, d])],
        [helper.make_tensor_value_info("y", f32, ["N", seq, d]),
         helper.make_tensor_value_info("loss", f32, [])],
        inits)
    return _finish(graph, f"single-head self-attention block, seq {seq}, d_model {d}, "
                          "with a residual and loss = mean(y^2)")


MODELS = {"mlp.onnx": mlp, "attention.onnx": attention}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=HERE, help="folder to write into (default: models/)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, make in MODELS.items():
        path = os.path.join(args.out, name)
        onnx.save_model(make(), path)
        print(path)


if __name__ == "__main__":
    main()
