"""The pieces the gradient fuzzer draws (bench/fuzz_graphs.py): the ONNX backend node test cases
of every op with a gradient rule (bench/conformance.py: attributes, input shapes and values valid
by construction; its exclusions hold here) and hand-written fragments (bench/fuzz_extra.py), and
where each of them runs (probed once, when first drawn).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx

sys.path.insert(0, os.path.dirname(__file__))
import conformance  # noqa: E402
import fuzz_extra  # noqa: E402

MAX_ELEMENTS = 4096  # case inputs larger than this are left out (keeps the runs cheap)
RNN_OPS = {"LSTM", "GRU", "RNN"}

# ops of the rule table the fuzzer does not draw, with why (tests/test_fuzz.py keeps this
# list complete: every other op of onnxgrad.registry.supported_ops() is drawn)
NOT_FUZZED = {
    **dict.fromkeys(["Bernoulli", "RandomNormalLike", "RandomUniformLike"],
                    "random: finite differences cannot judge it"),
    "EyeLike": "no gradient flows: it reads its input's shape only",
    **dict.fromkeys(["BlackmanWindow", "HammingWindow", "HannWindow"],
                    "no float input: the window depends on its size only"),
    **dict.fromkeys(["GreaterOrEqual", "LessOrEqual"], "a bool output: nothing to differentiate"),
    **dict.fromkeys(["CausalConvWithState", "LinearAttention", "SwiGLU", "Range"],
                    "opset 27 or 28: onnxruntime 1.31 loads opsets up to 26"),
    **dict.fromkeys(["Celu", "RotaryEmbedding", "DynamicQuantizeLinear"],
                    "no float64 in the schema: no float64 oracle"),
    **dict.fromkeys(["GlobalLpPool", "MaxRoiPool"],
                    "no float64 kernel in onnxruntime nor onnx.reference: no float64 oracle"),
    **dict.fromkeys(["GroupNormalization", "MeanVarianceNormalization", "Shrink"],
                    "the float64 forward computes in float32 (conformance.FLOAT32_CHECK)"),
    "Upsample": "deprecated since opset 10 (the fuzzed models are opset 18 to 26)",
    **dict.fromkeys(["CudnnRNN", "CudnnRNNV2", "CudnnRNNCanonicalToParams",
                     "CudnnRNNCanonicalToParamsV2", "CudnnRNNParamsToCanonical",
                     "CudnnRNNParamsToCanonicalV2"],
                    "onnxgrad-domain ops: reached through the LSTM/GRU/RNN gradients only"),
    "OnnxRNN": "onnxgrad-domain op (a converted CudnnRNNV3): tests/test_tf_cudnn.py checks its "
               "gradient against Keras and torch's packed sequences",
    **dict.fromkeys(["BiasGelu", "EmbedLayerNormalization", "FastGelu", "FusedConv",
                     "FusedGemm", "FusedMatMul", "MultiHeadAttention", "QuickGelu",
                     "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"],
                    "com.microsoft ops onnxruntime mostly runs in float32 only (no float64 "
                    "oracle): tests/test_rules_contrib.py generates their configurations "
                    "against torch autograd"),
}


def _left_out(name: str, op: str) -> str | None:
    """Why a conformance case is not used here, beyond conformance.EXCLUDED_CASES: no float64
    oracle (conformance.FLOAT32_CHECK: the forward computes in float32 or differently in
    float64), except the RNN family, whose float64 forward runs on onnx.reference."""
    if name in conformance.EXCLUDED_CASES:
        return conformance.EXCLUDED_CASES[name]
    if name in conformance.FLOAT32_CHECK and op not in RNN_OPS:
        return conformance.FLOAT32_CHECK[name]
    return None


@dataclass(frozen=True)
class Case:
    """A few nodes with valid attributes, the values of the tensors they read, which are held
    constant, and their float outputs."""
    name: str
    op: str  # the op under test (the first node's op)
    nodes: tuple  # NodeProtos, names as in the case
    inputs: tuple  # (name, value): tensors the nodes read (bodies' outer-scope reads included)
    held: frozenset  # input names held constant: non-float, NonDifferentiable, frozen, kinked
    fixed: frozenset  # float tensor names that keep the case's dtype (others take the graph's)
    outputs: tuple  # (name, shape): float outputs
    wide: frozenset = frozenset()  # fixed outputs that are float64

    @property
    def ops(self):
        return {n.op_type for n in self.nodes for n in _nodes(n)}


def _case(name, tc) -> Case | None:
    g = tc.model.graph
    if name.endswith(("_expanded", "_expanded_ver18")) or len(g.node) != 1 or not tc.data_sets:
        return None
    node = g.node[0]
    if node.domain not in ("", "ai.onnx") or node.op_type in conformance.EXCLUDED:
        return None
    if _left_out(name, node.op_type):
        return None
    opset = next(o.version for o in tc.model.opset_import if o.domain in ("", "ai.onnx"))
    from onnxgrad.registry import lookup
    if lookup("", node.op_type, max(opset, 13)) is None:
        return None
    inputs, outputs = tc.data_sets[0]
    if len(inputs) != len(g.input) or len(outputs) != len(g.output):
        return None
    values = {}
    for vi, val in zip(list(g.input) + list(g.output), list(inputs) + list(outputs)):
        if not isinstance(val, (np.ndarray, np.generic)) or np.size(val) > MAX_ELEMENTS:
            return None
        values[vi.name] = np.asarray(val)
    if _random(node, values):
        return None  # a new mask on every run: finite differences cannot judge it
    if any(v.dtype == np.float16 for v in values.values()):
        return None  # float16 cases: the float32 case of the same op covers the rule
    ins = [(n, values[n]) for n in node.input if n]
    floats = {n for n, v in ins if v.dtype.kind == "f"}
    positions = {n: i for i, n in enumerate(node.input) if n}
    frozen = conformance.non_differentiable(node, opset) | \
        conformance.KINKED_INPUTS.get(name, set())
    held = {n for n, _ in ins if n not in floats or positions[n] in frozen}
    if not floats - held:
        return None
    schema = onnx.defs.get_schema(node.op_type, opset, "")
    kind_in = {n: _formal(schema.inputs, i) for n, i in positions.items()}
    x_kinds = {kind_in[n] for n in floats - held}
    outs = [(n, _formal(schema.outputs, i)) for i, n in enumerate(node.output) if n]
    outputs = tuple((n, values[n].shape) for n, _ in outs if values[n].dtype.kind == "f")
    if not outputs:
        return None
    fixed = {n for n in floats if kind_in[n] not in x_kinds} | \
        {n for n, k in outs if k not in x_kinds}
    wide = {n for n, _ in outs if n in fixed and values[n].dtype == np.float64}
    return Case(name, node.op_type, (node,), tuple(ins), frozenset(held), frozenset(fixed),
                outputs, frozenset(wide))


def _random(node, values) -> bool:
    """A training-mode Dropout with a ratio above 0 (onnxruntime draws a new mask each run)."""
    if node.op_type != "Dropout" or len(node.input) < 3 or not node.input[2]:
        return False
    ratio = float(values[node.input[1]]) if node.input[1] else 0.5
    return bool(values[node.input[2]]) and ratio > 0


def _formal(params, i):
    params = list(params)
    return params[min(i, len(params) - 1)].type_str if params else ""


def _extra_cases():
    for name, nodes, inputs, held, outputs, fixed in fuzz_extra.fragments():
        yield Case(name, nodes[0].op_type, tuple(nodes),
                   tuple((k, np.asarray(v)) for k, v in inputs.items()), held, fixed,
                   tuple(outputs.items()), fixed)  # their fixed outputs are float64


def _nodes(node):
    yield node
    for a in node.attribute:
        for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            for n in g.node:
                yield from _nodes(n)


def _compatible(case: Case, opset: int) -> bool:
    """Whether every op of the case (bodies included) exists at the model's opset. Many cases
    import opset 28 for ops whose newer versions only add types; :func:`probe` checks that the
    nodes are valid at the model's opset and give the case's output shapes."""
    for node in case.nodes:
        for n in _nodes(node):
            if n.domain not in ("", "ai.onnx"):
                return False
            try:
                onnx.defs.get_schema(n.op_type, opset, "")
            except onnx.defs.SchemaError:
                return False
    return True


@dataclass(frozen=True)
class Flags:
    """Where a case runs, alone: onnxruntime in float32, in float64, and onnx.reference in
    float64 (agreeing with onnxruntime's float32); with why not."""
    ort32: bool
    ort64: bool
    ref64: bool
    why: str = ""


def fits(f: Flags, used: list, dtype) -> bool:
    """Whether a case joins a graph of ``dtype`` holding cases with flags ``used``: the model
    runs on onnxruntime in its dtype, and its float64 oracle runs on onnxruntime (every case
    ort64) or else on onnx.reference (every case ref64)."""
    if np.dtype(dtype) == np.float64:
        return f.ort64
    if not f.ort32 or not (f.ort64 or f.ref64):
        return False
    on_reference = not f.ort64 or any(not u.ort64 for u in used)
    return not on_reference or (f.ref64 and all(u.ref64 for u in used))


class Catalogue:
    """The cases by op; where a case runs is probed (``probe(case, opset) -> Flags``) once, when
    it is first drawn."""

    def __init__(self, probe: Callable):
        self._probe = probe
        by_op: dict[str, list[Case]] = {}
        for name, tc in sorted(conformance.all_cases().items()):
            c = _case(name, tc)
            if c is not None:
                by_op.setdefault(c.op, []).append(c)
        for c in _extra_cases():
            by_op.setdefault(c.op, []).append(c)
        self.by_op = by_op
        self._flags: dict = {}
        self._ops: dict = {}

    def cases(self, op: str, opset: int) -> tuple:
        return tuple(c for c in self.by_op[op] if _compatible(c, opset))

    def ops(self, opset: int) -> tuple:
        if opset not in self._ops:
            self._ops[opset] = tuple(op for op in sorted(self.by_op) if self.cases(op, opset))
        return self._ops[opset]

    def flags(self, case: Case, opset: int) -> Flags:
        key = (case.name, opset)
        if key not in self._flags:
            self._flags[key] = self._probe(case, opset)
        return self._flags[key]

    def pick(self, op_index: int, case_index: int, dtype, opset: int, used: list) -> Case | None:
        """The case that (op_index, case_index) draw, skipping those that cannot join the graph
        (:func:`fits`; the indexes are mixed first: hypothesis favours small integers, the ops
        should not)."""
        op_index, case_index = _mix(op_index), _mix(case_index)
        ops = self.ops(opset)
        for i in range(len(ops)):
            cases = self.cases(ops[(op_index + i) % len(ops)], opset)
            for j in range(len(cases)):
                c = cases[(case_index + j) % len(cases)]
                if fits(self.flags(c, opset), [self.flags(u, opset) for u in used], dtype):
                    return c
        return None


def _mix(i: int) -> int:
    return (i * 0x9E3779B1 + 0x7F4A7C15) % 2**32


def quiet_options(level: str = "all"):
    """onnxruntime SessionOptions at ``level`` ("none", "basic", "all") that log nothing: the fuzzer
    expects kernels to be missing and reports that its own way."""
    from onnxgrad.runtime import ort_module, session_options
    ort = ort_module()
    so = session_options()
    so.log_severity_level = 4
    levels = ort.GraphOptimizationLevel
    so.graph_optimization_level = {"none": levels.ORT_DISABLE_ALL, "basic": levels.ORT_ENABLE_BASIC,
                                   "all": levels.ORT_ENABLE_ALL}[level]
    return so


def quiet_session(model, level="all"):
    """A stock onnxruntime CPU session with :func:`quiet_options`: every graph optimizer of the
    level on, those onnxgrad's own sessions leave out (runtime.UNSAFE_OPTIMIZERS) too, since
    users run the models gradients() returns in sessions of their own."""
    from onnxgrad.runtime import ort_module
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort_module().InferenceSession(data, quiet_options(level),
                                         providers=["CPUExecutionProvider"])
