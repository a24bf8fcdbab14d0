"""The rule table as a whole (issue 12, items 5 and 6).

- Every float input of every rule gets a gradient, or the ops table says why not
  (``spec.NO_GRADIENT``): a gradient is either exact or refused, never silently missing.
  ``CASES`` holds a small model for every registered ai.onnx op with a float input besides
  its first (the ones where a rule can leave one out), and for the single-input ops whose
  rule is the function-body fallback.
- No rule hard-codes an attribute default (they come from the schemas: ``spec.attr``).
- ``onnxgrad ops --markdown`` is the table in README.md.
"""
from __future__ import annotations

import ast
import os

import numpy as np
import onnx
import onnx.defs
import pytest
from onnx import helper

import onnxgrad
from onnxgrad.registry import supported_ops
from onnxgrad.rules.spec import NO_GRADIENT

F, D, I = np.float32, np.float64, np.int64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# op: (opset, {node input: (dtype, shape) of a graph input | array of an initializer | None for
# an absent one}, attrs, outputs)
CASES = {
    "Attention": (23, {"Q": (F, [1, 2, 3, 4]), "K": (F, [1, 2, 5, 4]), "V": (F, [1, 2, 5, 4]),
                       "mask": (F, [3, 7]), "pk": (F, [1, 2, 2, 4]), "pv": (F, [1, 2, 2, 4])},
                  {}, ["y"]),
    "BatchNormalization": (18, {"x": (F, [2, 3, 4]), "s": (F, [3]), "b": (F, [3]),
                                "m": (F, [3]), "v": (F, [3])}, {}, ["y"]),
    "CastLike": (18, {"x": (F, [2, 3]), "t": (D, [1])}, {}, ["y"]),
    "Clip": (18, {"x": (F, [2, 3]), "lo": (F, []), "hi": (F, [])}, {}, ["y"]),
    "Conv": (18, {"x": (F, [1, 2, 5, 5]), "w": (F, [3, 2, 3, 3]), "b": (F, [3])}, {}, ["y"]),
    "ConvTranspose": (18, {"x": (F, [1, 2, 3, 3]), "w": (F, [2, 3, 2, 2]), "b": (F, [3])}, {},
                      ["y"]),
    "DeformConv": (19, {"x": (F, [1, 2, 4, 4]), "w": (F, [2, 2, 2, 2]),
                        "off": (F, [1, 8, 3, 3]), "b": (F, [2]), "mask": (F, [1, 4, 3, 3])},
                   {}, ["y"]),
    "Dropout": (18, {"x": (F, [2, 3]), "ratio": (F, []), "train": np.array(True)}, {},
                ["y", "mask"]),
    "GRU": (18, {"x": (F, [2, 1, 3]), "w": (F, [1, 12, 3]), "r": (F, [1, 12, 4]),
                 "b": (F, [1, 24]), "sl": None, "h0": (F, [1, 1, 4])}, {"hidden_size": 4},
            ["y"]),
    "Gemm": (18, {"a": (F, [2, 3]), "b": (F, [3, 4]), "c": (F, [4])}, {}, ["y"]),
    "GridSample": (16, {"x": (F, [1, 1, 3, 3]), "grid": (F, [1, 2, 2, 2])}, {}, ["y"]),
    "GroupNormalization": (21, {"x": (F, [1, 4, 3]), "s": (F, [4]), "b": (F, [4])},
                           {"num_groups": 2}, ["y"]),
    "InstanceNormalization": (18, {"x": (F, [1, 2, 3]), "s": (F, [2]), "b": (F, [2])}, {},
                              ["y"]),
    "LSTM": (18, {"x": (F, [2, 1, 3]), "w": (F, [1, 16, 3]), "r": (F, [1, 16, 4]),
                  "b": (F, [1, 32]), "sl": None, "h0": (F, [1, 1, 4]), "c0": (F, [1, 1, 4]),
                  "p": (F, [1, 12])}, {"hidden_size": 4}, ["y"]),
    "LayerNormalization": (18, {"x": (F, [2, 3]), "s": (F, [3]), "b": (F, [3])}, {}, ["y"]),
    "MatMul": (18, {"a": (F, [2, 3]), "b": (F, [3, 4])}, {}, ["y"]),
    "MaxRoiPool": (18, {"x": (F, [1, 1, 5, 5]), "rois": (F, [1, 5])}, {"pooled_shape": [2, 2]},
                   ["y"]),
    "Mod": (18, {"a": (F, [4]), "b": (F, [4])}, {"fmod": 1}, ["y"]),
    "NegativeLogLikelihoodLoss": (18, {"x": (F, [2, 3]), "t": (I, [2]), "w": (F, [3])}, {},
                                  ["y"]),
    "OneHot": (18, {"i": (I, [2]), "d": (I, []), "v": (F, [2])}, {}, ["y"]),
    "PRelu": (18, {"x": (F, [2, 3]), "s": (F, [3])}, {}, ["y"]),
    "Pad": (18, {"x": (F, [2, 3]), "p": (I, [4]), "v": (F, [])}, {}, ["y"]),
    "Pow": (18, {"a": (F, [3]), "b": (F, [3])}, {}, ["y"]),
    "RMSNormalization": (23, {"x": (F, [2, 3]), "s": (F, [3])}, {}, ["y"]),
    "RNN": (18, {"x": (F, [2, 1, 3]), "w": (F, [1, 4, 3]), "r": (F, [1, 4, 4]),
                 "b": (F, [1, 8]), "sl": None, "h0": (F, [1, 1, 4])}, {"hidden_size": 4},
            ["y"]),
    "Resize": (18, {"x": (F, [1, 1, 2, 2]), "roi": (F, [8]), "scales": (F, [4])},
               {"mode": "linear"}, ["y"]),
    "RoiAlign": (16, {"x": (F, [1, 1, 5, 5]), "rois": (F, [1, 4]), "bi": (I, [1])}, {}, ["y"]),
    "RotaryEmbedding": (23, {"x": (F, [1, 2, 3, 4]), "cos": (F, [3, 2]),
                             "sin": (F, [3, 2]), "pos": (I, [1, 3])}, {}, ["y"]),
    "STFT": (17, {"x": (F, [1, 8, 1]), "step": np.array(2), "w": (F, [4])}, {"onesided": 1},
             ["y"]),  # (onnx 1.23 infers an absent onesided as 0: a declared output it contradicts)
    "ScatterElements": (18, {"x": (F, [3]), "i": (I, [2]), "u": (F, [2])}, {}, ["y"]),
    "ScatterND": (18, {"x": (F, [3]), "i": (I, [2, 1]), "u": (F, [2])}, {}, ["y"]),
    "SoftmaxCrossEntropyLoss": (18, {"x": (F, [2, 3]), "t": (I, [2]), "w": (F, [3])}, {},
                                ["y"]),
    "Sub": (18, {"a": (F, [3]), "b": (F, [3])}, {}, ["y"]),
    "TensorScatter": (24, {"past": (F, [1, 4, 2]), "upd": (F, [1, 1, 2])}, {"axis": 1}, ["y"]),
    "Upsample": (9, {"x": (F, [1, 1, 2, 2]), "scales": (F, [4])}, {"mode": "linear"}, ["y"]),
    "Where": (18, {"c": (np.bool_, [3]), "a": (F, [3]), "b": (F, [3])}, {}, ["y"]),
    # a single float input, and the rule the function-body fallback
    "Bernoulli": (22, {"p": (F, [3])}, {}, ["y"]),
}
# multi-input ops whose every float input is covered by their own tests, or whose output is
# not a float tensor (GreaterOrEqual, LessOrEqual); the variadic ones (one formal input)
ELSEWHERE = {"Add", "Mul", "Div", "GreaterOrEqual", "LessOrEqual", "CausalConvWithState",
             "LinearAttention", "SwiGLU", "Range", "Loop", "Scan", "If", "SequenceInsert",
             "SequenceMap", "Concat", "Einsum", "Max", "Min", "Mean", "Sum", "SequenceConstruct"}
_FLOATS = {"tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"}


def _float_inputs(schema):
    tcs = {tc.type_param_str: set(tc.allowed_type_strs) for tc in schema.type_constraints}
    return [f.name for f in schema.inputs if tcs.get(f.type_str, {f.type_str}) & _FLOATS]


def test_every_multi_input_op_is_audited():
    newest = onnx.defs.onnx_opset_version()
    missing = []
    for domain, op, _, until in supported_ops():
        if domain:
            continue
        floats = _float_inputs(onnx.defs.get_schema(op, until or newest, ""))
        if len(floats) > 1 and op not in CASES and op not in ELSEWHERE:
            missing.append(op)
    assert not missing, f"add these ops to CASES: {missing}"


def _case_model(op):
    opset, ins, attrs, outs = CASES[op]
    names = [k if v is not None else "" for k, v in ins.items()]
    while not names[-1]:
        names.pop()
    g = helper.make_graph(
        [helper.make_node(op, names, outs, **attrs)], op,
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(np.dtype(v[0])), v[1])
         for k, v in ins.items() if isinstance(v, tuple)],
        [helper.make_empty_tensor_value_info(o) for o in outs],
        [onnx.numpy_helper.from_array(v, k) for k, v in ins.items() if isinstance(v, np.ndarray)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                          ir_version=11 if opset >= 23 else 10)
    m = onnx.shape_inference.infer_shapes(m)
    first = next(v for v in ins.values() if isinstance(v, tuple))
    for o in m.graph.output:  # GroupNormalization-21 has no shape inference: y is like x
        if not o.type.HasField("tensor_type"):
            o.CopyFrom(helper.make_tensor_value_info(o.name, onnx.TensorProto.FLOAT, first[1]))
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("op", sorted(CASES))
def test_float_inputs_get_a_gradient_or_a_reason(op):
    """Each float input of the op gets a gradient, or NO_GRADIENT names it with the reason
    (which `onnxgrad ops --markdown` prints); a declared input really gets none."""
    m = _case_model(op)
    node = m.graph.node[0]
    schema = onnx.defs.get_schema(op, CASES[op][0], "")
    formal = [schema.inputs[min(i, len(schema.inputs) - 1)].name
              for i in range(len(node.input))]
    floats = {vi.name for vi in m.graph.input
              if vi.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)}
    xs = [x for x in node.input if x in floats]
    res = onnxgrad.gradients(m, m.graph.output[0].name, xs)
    declared = NO_GRADIENT.get(op, {})
    for x, g in zip(xs, res.grads):
        name = formal[list(node.input).index(x)]
        if g is None:
            assert name in declared, f"{op}: input {name!r} gets no gradient and no reason"
        else:
            assert name not in declared, f"{op}: input {name!r} is declared but gets one"


def test_declared_inputs_exist():
    newest = onnx.defs.onnx_opset_version()
    for op, inputs in NO_GRADIENT.items():
        schema = onnx.defs.get_schema(op, newest, "")
        assert set(inputs) <= {f.name for f in schema.inputs}, op
        assert all(why for why in inputs.values()), op


def test_rules_take_attribute_defaults_from_the_schema():
    """No rule passes a default to ``n.attr``: an absent attribute means the schema's default
    (``spec.attr``), the float32 constant the forward uses."""
    rules = os.path.join(ROOT, "onnxgrad", "rules")
    bad = []
    for name in sorted(os.listdir(rules)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(rules, name)).read())
        for call in ast.walk(tree):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "attr" and len(call.args) + len(call.keywords) > 1):
                bad.append(f"{name}:{call.lineno}")
    assert not bad, f"hard-coded attribute defaults: {bad}"


def test_ops_table_in_readme_is_current():
    from onnxgrad.cli import ops_table
    readme = open(os.path.join(ROOT, "README.md")).read()
    start = readme.index("<!-- ops table: onnxgrad ops --markdown -->") + len(
        "<!-- ops table: onnxgrad ops --markdown -->\n")
    end = readme.index("<!-- end ops table -->")
    assert readme[start:end].strip() == ops_table(markdown=True).strip()
