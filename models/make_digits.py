"""Write the bundled demo: a 64-64-10 MLP for scikit-learn's digits and the dataset itself.

    python models/make_digits.py            # writes models/digits_mlp.onnx and models/digits.npz
    python models/make_digits.py --out DIR

digits_mlp.onnx  x [N, 64] float32 -> logits [N, 10]
                 logits = Gemm(Relu(Gemm(x, W1, b1, transB=1)), W2, b2, transB=1)
                 W [out, in] and b initialised as torch.nn.Linear does (uniform in
                 +-1/sqrt(fan_in)) from a fixed seed; ir_version 10, opset 18.
digits.npz       x float32 [1797, 64] (pixel values 0..16 scaled to [0, 1]), y int64 labels 0..9,
                 in sklearn.datasets.load_digits order (scikit-learn ships the data offline; it
                 is needed only to run this script, not to train).

    onnxgrad train models/digits_mlp.onnx --loss cross_entropy --data models/digits.npz \\
        --epochs 10 --batch-size 32 --optimizer adamw --lr 1e-2 --val-split 0.2 \\
        -o digits_trained.onnx --plot loss.png
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 0


def digits_mlp(seed: int = SEED, hidden: int = 64) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)

    def linear(name, fan_in, fan_out):
        bound = 1 / np.sqrt(fan_in)
        w = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32)
        b = rng.uniform(-bound, bound, fan_out).astype(np.float32)
        return [numpy_helper.from_array(w, f"{name}.weight"),
                numpy_helper.from_array(b, f"{name}.bias")]

    inits = linear("fc1", 64, hidden) + linear("fc2", hidden, 10)
    nodes = [
        helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("Gemm", ["a", "fc2.weight", "fc2.bias"], ["logits"], name="fc2",
                         transB=1),
    ]
    graph = helper.make_graph(
        nodes, "digits_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10,
                              producer_name="onnxgrad-models",
                              doc_string="MLP 64-64-10 (ReLU) for the 8x8 digits of scikit-learn")
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model, full_check=True)
    return model


def digits_data():
    from sklearn.datasets import load_digits
    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=HERE, help="folder to write into (default: models/)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    onnx.save(digits_mlp(), os.path.join(args.out, "digits_mlp.onnx"))
    x, y = digits_data()
    np.savez_compressed(os.path.join(args.out, "digits.npz"), x=x, y=y)
    print(f"wrote digits_mlp.onnx and digits.npz ({len(x)} rows) to {args.out}")


if __name__ == "__main__":
    main()
