"""Gradient graphs of float16 and bfloat16 models stay valid at every opset: half-precision types
came to ai.onnx ops at different opsets (bfloat16: most at 13, Where at 16, ConstantOfShape at
20), and zeros made with ConstantOfShape or masks made with Where at an older opset gave models
that onnx.checker refuses, written without an error."""
from __future__ import annotations

import onnx
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper

import onnxgrad

UNARY = ["Abs", "Neg", "Relu", "Exp", "Log", "Sqrt", "Tanh", "Sigmoid", "Floor", "Ceil", "Sign",
         "Round", "Reciprocal", "Softplus", "Elu", "LeakyRelu", "HardSigmoid", "Selu", "Erf",
         "Sin", "Cos", "Softmax", "LogSoftmax", "ReduceSum", "ReduceMean", "ReduceMax",
         "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSumExp",
         "ReduceSumSquare", "Identity", "Transpose", "Flatten", "Gelu", "Mish", "HardSwish"]
BINARY = ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "MatMul", "PRelu", "Where"]
HALF = {"float16": TP.FLOAT16, "bfloat16": TP.BFLOAT16}


def _takes(op, opset, type_str):
    """Whether ``op`` exists at ``opset`` and takes ``type_str`` at every input the test feeds a
    half-precision tensor (Where's condition is bool)."""
    try:
        schema = onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return False
    fed = [1, 2] if op == "Where" else [0, 1] if op in BINARY else [0]
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    return all(type_str in allowed.get(schema.inputs[min(i, len(schema.inputs) - 1)].type_str, ())
               for i in fed)


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(op=st.sampled_from(UNARY + BINARY),
       opset=st.integers(13, onnx.defs.onnx_opset_version()),
       dtype=st.sampled_from(sorted(HALF)), unconnected=st.booleans())
def test_half_precision_gradient_graphs_are_valid(op, opset, dtype, unconnected):
    assume(_takes(op, opset, f"tensor({dtype})"))
    t = HALF[dtype]
    ins = ["x"] + (["w"] if op in BINARY else [])
    if op == "Where":
        ins = ["c", "x", "w"]
    attrs = {"keepdims": 0} if op.startswith("Reduce") else {}
    nodes = [helper.make_node(op, ins, ["y"], **attrs)]
    inputs = [helper.make_tensor_value_info("x", t, [2, 3]),
              helper.make_tensor_value_info("u", t, [2])]
    if op in BINARY:
        inputs.append(helper.make_tensor_value_info("w", t, [3, 3] if op == "MatMul" else [2, 3]))
    if op == "Where":
        inputs.append(helper.make_tensor_value_info("c", TP.BOOL, [2, 3]))
    g = helper.make_graph(nodes, "g", inputs, [helper.make_empty_tensor_value_info("y")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    onnx.checker.check_model(m, full_check=True)
    xs = [i for i in ins if i != "c"] + (["u"] if unconnected else [])
    res = onnxgrad.gradients(m, "y", xs, unconnected_gradients="zero")
    onnx.checker.check_model(res.model, full_check=True)
    assert all(name is not None for name in res.grads)
    out = {o.name: o.type.tensor_type.elem_type for o in res.model.graph.output}
    assert all(out[name] == t for name in res.grads)


def test_bfloat16_zeros_keep_the_opset():
    """Zeros in bfloat16 before opset 20 are made in float32 and cast (no upgrade to 20 for
    them); a Where in bfloat16 before opset 16 upgrades the model to 16."""
    def model(op, opset):
        g = helper.make_graph([helper.make_node(op, ["x"], ["y"], keepdims=0)
                               if op.startswith("Reduce") else helper.make_node(op, ["x"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TP.BFLOAT16, [2, 3]),
                                    helper.make_tensor_value_info("u", TP.BFLOAT16, [2])],
                              [helper.make_empty_tensor_value_info("y")])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                                 ir_version=10)
    res = onnxgrad.gradients(model("Floor", 18), "y", ["x", "u"], unconnected_gradients="zero")
    assert res.model.opset_import[0].version == 18
    onnx.checker.check_model(res.model, full_check=True)
    res = onnxgrad.gradients(model("ReduceProd", 13), "y", ["x"])
    assert res.model.opset_import[0].version == 16
    onnx.checker.check_model(res.model, full_check=True)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.sampled_from([TP.FLOAT16, TP.BFLOAT16]), st.integers(13, 21),
       st.sampled_from(["sgd", "momentum", "adam", "adamw"]), st.sampled_from(["mse", "l1"]))
def test_half_precision_train_steps_are_valid(dtype, opset, opt, loss):
    """The step's finite-loss gate read IsInf(loss), which takes float16 and bfloat16 only from
    opset 20: a half model below it got a step onnx.checker and onnxruntime refuse (exit 0 from
    export-train-step). Every optimizer at every opset: a valid step; float16 runs."""
    import numpy as np
    from onnx import numpy_helper

    from onnxgrad.runtime import session
    from onnxgrad.training import SGD, Adam, AdamW, build_train_step
    from onnxgrad.training.losses import attach_loss
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    g = helper.make_graph([helper.make_node("Gemm", ["x", "W", "b"], ["y"], transB=1)], "lin",
                          [helper.make_tensor_value_info("x", dtype, ["N", 4])],
                          [helper.make_tensor_value_info("y", dtype, ["N", 3])],
                          [numpy_helper.from_array(np.ones((3, 4), np_dtype), "W"),
                           numpy_helper.from_array(np.zeros(3, np_dtype), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    optimizer = {"sgd": SGD(lr=0.1), "momentum": SGD(lr=0.1, momentum=0.9),
                 "adam": Adam(lr=0.1), "adamw": AdamW(lr=0.1)}[opt]
    step = build_train_step(attach_loss(m, loss), "loss", optimizer=optimizer)
    onnx.checker.check_model(step.model, full_check=True)
    if dtype == TP.FLOAT16:
        session(step.model)  # onnxruntime loads it (its CPU Gemm has no bfloat16 kernel)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(dtype=st.sampled_from([TP.FLOAT16, TP.BFLOAT16]), scale=st.sampled_from([0.1, 5, 80]),
       clip=st.sampled_from([0.5, 1.0, 1e6]), seed=st.integers(0, 3))
def test_half_precision_gradients_are_clipped_by_their_norm(dtype, scale, clip, seed):
    # the global norm was summed in the gradients' dtype: in float16 the sum of squares is inf
    # past a norm of 256 (the spec's arithmetic, onnx.reference's; onnxruntime's CPU kernels
    # widen), and clip / inf zeroed every gradient. From zero weights and lr 1, SGD's new
    # weights are -g * min(1, clip / (norm + 1e-6)): the unclipped step's, scaled
    import numpy as np
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator
    from onnxgrad.training import SGD, attach_loss, build_train_step
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(seed)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"], transB=1)], "lin",
        [helper.make_tensor_value_info("x", dtype, ["N", 7])],
        [helper.make_tensor_value_info("y", dtype, ["N", 3])],
        [numpy_helper.from_array(np.zeros((3, 7), np_dtype), "W"),
         numpy_helper.from_array(np.zeros(3, np_dtype), "b")])
    model = attach_loss(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)],
                                          ir_version=10), "mse")
    feeds = {"x": (rng.standard_normal((16, 7)) * 10).astype(np_dtype),
             "target": (rng.standard_normal((16, 3)) * scale).astype(np_dtype)}
    got = {}
    for c in (None, clip):
        step = build_train_step(model, model.graph.output[-1].name, optimizer=SGD(lr=1.0),
                                clip_norm=c)
        names = {i.name for i in step.model.graph.input}
        run = {**feeds, **step.initial_params, **step.initial_state(), step.lr: np.array(1.0),
               step.step: np.array(1, np.int64)}
        outs = ReferenceEvaluator(step.model).run(
            step.param_outputs, {k: v for k, v in run.items() if k in names})
        got[c] = [np.asarray(o, np.float64) for o in outs]
    norm = np.sqrt(sum(float((u ** 2).sum()) for u in got[None]))
    assert np.isfinite(norm) and norm > 0  # (a step whose loss is not finite is not taken)
    coef = min(1.0, clip / (norm + 1e-6))
    tol = 1e-2 if dtype == TP.BFLOAT16 else 2e-3
    for clipped, plain in zip(got[clip], got[None]):
        np.testing.assert_allclose(clipped, plain * coef, rtol=tol, atol=tol * coef * np.abs(
            plain).max())


@settings(max_examples=10, deadline=None, derandomize=True)
@given(op=st.sampled_from(["ReduceMean", "GlobalAveragePool", "SoftmaxCrossEntropyLoss",
                           "weighted", "BatchNormalization"]), seed=st.integers(0, 3))
def test_float16_gradients_of_means_over_more_than_65504_values(op, seed):
    # the counts (symbolic dims) and the batch statistics' sum of squares were float16 in the
    # gradient graph: inf past 65504, so 1 / count and r = (var + eps)^-1/2 were 0 and so was
    # every gradient (the spec's arithmetic, onnx.reference's; onnxruntime's CPU kernels widen)
    import numpy as np
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator
    torch = __import__("pytest").importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(seed)
    shape = [2, 3, 200, 200]  # 80,000 values a channel, 240,000 in all
    x = rng.standard_normal(shape).astype(np.float16)
    feeds, inits, sym = {"x": x}, [], ["N", 3, "H", "W"]
    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    if op in ("SoftmaxCrossEntropyLoss", "weighted"):
        labels = rng.integers(0, 3, [2, 200, 200])
        labels[rng.random(labels.shape) < 0.2] = -1
        feeds["labels"] = labels
        w = np.array([0.5, 1.0, 2.0])
        ins = ["x", "labels"] + (["w"] if op == "weighted" else [])
        if op == "weighted":
            inits.append(numpy_helper.from_array(w.astype(np.float16), "w"))
        nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ins, ["y"], ignore_index=-1)]
        want = F.cross_entropy(xt, torch.tensor(labels), ignore_index=-1,
                               weight=torch.tensor(w) if op == "weighted" else None)
        extra = [helper.make_tensor_value_info("labels", TP.INT64, ["N", "H", "W"])]
    else:
        c = rng.standard_normal([2, 3, 1, 1] if op == "GlobalAveragePool" else shape)
        feeds["c"] = c.astype(np.float16)
        inits += [numpy_helper.from_array(np.ones(3, np.float16), n) for n in ("s", "v")]
        inits += [numpy_helper.from_array(np.zeros(3, np.float16), n) for n in ("b", "m")]
        if op == "BatchNormalization":
            first = helper.make_node(op, ["x", "s", "b", "m", "v"], ["z", "rm", "rv"],
                                     training_mode=1)
            z = F.batch_norm(xt, None, None, training=True, eps=1e-5)
        elif op == "GlobalAveragePool":
            first, z = helper.make_node(op, ["x"], ["z"]), xt.mean((2, 3), keepdim=True)
        else:
            first, z = helper.make_node(op, ["x"], ["z"], keepdims=1), xt.mean().reshape(1, 1, 1, 1)
        nodes = [first, helper.make_node("Mul", ["z", "c"], ["zc"]),
                 helper.make_node("ReduceSum", ["zc"], ["y"], keepdims=0)]
        want = (z * torch.tensor(c)).sum()
        extra = [helper.make_tensor_value_info("c", TP.FLOAT16, None)]
    want.backward()
    g = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TP.FLOAT16, sym),
                                         *extra],
                          [helper.make_tensor_value_info("y", TP.FLOAT16, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)
    res = onnxgrad.gradients(m, "y", ["x"])
    got, = ReferenceEvaluator(res.model).run(res.grads, feeds)
    ref = xt.grad.numpy()
    assert np.abs(ref).max() > 0
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=0.05,
                               atol=0.02 * np.abs(ref).max())
