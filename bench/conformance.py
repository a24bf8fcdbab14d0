"""Conformance sweep: onnxgrad's gradients on the ONNX backend node test cases.

For every case of an ai.onnx op with float tensor inputs and outputs (inputs < 10k elements, ops
that are differentiable by nature), every float output is differentiated with respect to every
float input and compared with central finite differences (onnxgrad.check.check_gradients, float64
where the runtime allows). Prints pass / unsupported (NotDifferentiableError) / fail per op.

    python bench/conformance.py [--per-op N] [--op Resize ...] [--pass-list] [-v]

--pass-list prints the names of the passing cases (tests/test_conformance.py pins that list).
A few cases are checked in float32 (FLOAT32_CHECK), have an input held constant (KINKED_INPUTS)
or are excluded (EXCLUDED_CASES), each with the reason written beside it; excluded cases are
counted in their own column.
"""
from __future__ import annotations

import argparse
import functools
import signal
import sys
import time
from collections import Counter, defaultdict

import numpy as np
import onnx
from onnx import TensorProto

FLOAT = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16}
MAX_ELEMENTS = 10_000
PER_OP = 10_000  # cases per op (the first ones, in name order): all of them by default

# not differentiable by nature: comparisons and logic, integer and bit ops, random ops, shape-only
# or index-valued ops, quantization, string ops
EXCLUDED = frozenset("""
Equal Less Greater LessOrEqual GreaterOrEqual Not And Or Xor IsNaN IsInf
BitShift BitwiseAnd BitwiseOr BitwiseXor BitwiseNot BitCast
RandomNormal RandomNormalLike RandomUniform RandomUniformLike Bernoulli Multinomial
Shape Size ConstantOfShape EyeLike Range Constant NonZero ArgMax ArgMin Unique
QuantizeLinear DequantizeLinear DynamicQuantizeLinear QLinearConv QLinearMatMul MatMulInteger
ConvInteger StringNormalizer StringConcat StringSplit RegexFullMatch TfIdfVectorizer
NonMaxSuppression Optional OptionalGetElement OptionalHasElement
""".split())

# cases checked in float32 instead of float64, with why: their forward does not run in float64
# (the check's float64 copy), so float64 central differences would measure float32 round-off
FLOAT32_CHECK = {
    # onnxruntime has no float64 Resize, and onnx.reference sizes align_corners from the
    # unrounded scale (x * 3 / (2.4 - 1)) where onnxruntime, which the gradient follows, uses
    # the output's length: check_gradients refuses that float64 oracle (session 41)
    "test_resize_downsample_scales_linear_align_corners":
        "onnx.reference's align_corners with scales is not onnxruntime's",
    "test_resize_downsample_scales_cubic_align_corners":
        "onnx.reference's align_corners with scales is not onnxruntime's",
    # stash_type (float32 by default) keeps the forward's statistics in float32 even in the
    # float64 copy: float64 differences are noise there (rel err ~0.4); in float32 they pass
    "test_group_normalization_epsilon": "GroupNormalization-21 computes in its stash_type",
    "test_group_normalization_example": "GroupNormalization-21 computes in its stash_type",
    # onnxruntime's float64 Attention runs the function body, whose softmax over a fully masked
    # row is NaN; the float32 kernel (and the cases' expected outputs) give 0 there, as the
    # gradient rule does
    "test_attention_23_boolmask_fullymasked_row_nan_robustness":
        "float64 Attention gives NaN on fully masked rows",
    "test_attention_23_fullymasked_qk_matmul_output_mode3_zero":
        "float64 Attention gives NaN on fully masked rows",
    "test_attention_24_fullymasked_qk_matmul_output_mode3_zero":
        "float64 Attention gives NaN on fully masked rows",
    "test_attention_causal_boolmask_nan_robustness":
        "float64 Attention gives NaN on fully masked rows",
    # is_causal with nonpad_kv_seqlen: onnxruntime's float64 path (its bundled function body,
    # from before onnx 1.23's errata) aligns the causal mask top-left; the float32 kernel, the
    # cases' expected outputs, onnx.reference and the rule align it bottom-right (offset =
    # nonpad_kv_seqlen - q_len). tests/test_rules_vision.py checks them in float64 on
    # onnx.reference and against torch
    **{f"test_attention_4d_{v}": "float64 Attention aligns nonpad causal masks top-left"
       for v in ("causal_nonpad_attn_mask_composition", "causal_nonpad_batch_prefill",
                 "causal_nonpad_continued_prefill",
                 "causal_nonpad_negative_offset_structural_empty", "gqa_causal_nonpad_decode")},
    # onnxruntime's CPU LSTM and GRU kernels are float32 only ("does not support double yet",
    # raised at run time, so there is no fallback to onnx.reference)
    **{f"test_{op}_{v}": f"onnxruntime has no float64 {op.upper()} kernel"
       for op, vs in (("gru", ("defaults", "bidirectional", "reverse", "seq_length",
                               "with_initial_bias")),
                      ("lstm", ("defaults", "bidirectional", "reverse", "with_initial_bias",
                                "with_peepholes")),
                      ("simple_rnn", ("defaults", "bidirectional", "reverse",
                                      "with_initial_bias")), ("rnn", ("seq_length",)))
       for v in vs},
    # LinearAttention (no onnxruntime kernel) runs its schema's function body, which casts to
    # float32 (Cast to=FLOAT) and back: the float64 copy computes in float32
    **{name: "LinearAttention's function body computes in float32" for name in (
        f"test_linear_attention_{v}" for v in (
            "decode_step delta explicit_scale gated gated_delta gated_delta_beta_scalar "
            "gated_delta_gqa gated_delta_mqa gated_per_head_decay linear linear_t1_no_past "
            "no_past_explicit_zeros prefill_with_past").split())},
    # onnxruntime has no float64 MeanVarianceNormalization; onnx.reference runs the schema's
    # function body, whose epsilon Constant is float32 (a type error on float64 inputs)
    "test_mvn": "no float64 MeanVarianceNormalization in onnxruntime or onnx.reference",
    # onnxruntime's float64 Shrink rounds through float32 (Shrink(-2 + 1e-6) + 2 - 1e-6 is
    # -4.6e-8), which the 1e-6 steps of the float64 check cannot survive
    **{f"test_shrink_{v}": "onnxruntime's float64 Shrink computes in float32"
       for v in ("hard", "soft")},
    # CausalConvWithState's types are float, float16 and bfloat16 (no double); onnxruntime 1.31
    # does not load opset 27, and onnx.reference's kernel (like the schema's function body,
    # Cast to=FLOAT around the SiLU) computes the activation in float32 even in the float64 copy
    # (forward off float64 torch by 3e-7, float64 differences off by ~1). The gradient matches
    # float64 torch to float32 round-off (tests/test_rules_conv.py)
    **{f"test_causal_conv_with_state_{v}": "CausalConvWithState computes its SiLU in float32"
       for v in ("silu", "silu_with_past_state", "swish_alias")},
}

# cases left out of pass / fail because the oracle itself disagrees with the runtimes, with why
EXCLUDED_CASES = {
    # onnx.reference (the float64 fallback: onnxruntime has no float64 MaxUnpool) scatters into
    # the default output shape and pads it to output_shape; onnxruntime, and MaxPool's indices
    # that MaxUnpool consumes, address the output_shape tensor itself. The rule follows
    # onnxruntime (tests/test_rules_conv.py checks it against numpy)
    "test_maxunpool_export_with_output_shape":
        "onnx.reference's MaxUnpool with output_shape places values differently from onnxruntime",
    # Scan-8 (opset 8, older than the opsets onnxgrad differentiates) has a batch axis that
    # onnx's 8 -> 9 version-converter adapter strips from the declared shapes; onnxgrad refuses
    # such models with a clear error (tests/test_control_flow.py) instead of a wrong gradient
    "test_scan_sum": "Scan-8 (opset 8): onnx's version converter drops its batch axis",
    # float16 LinearAttention: its function body computes in float32, so the float64 copy
    # measures float32 round-off, and float16 differences are too coarse; tests/test_conformance.py
    # checks the same inputs in float32
    "test_linear_attention_fp16": "no finite-difference oracle (float32 body, float16 inputs)",
    # float16 CausalConvWithState with SiLU: the float64 copy computes the SiLU in float32 (as in
    # FLOAT32_CHECK), and float16 differences are too coarse (the _expanded case fails them the
    # same way); tests/test_rules_conv.py checks float16 models against torch in float64
    "test_causal_conv_with_state_silu_fp16":
        "no finite-difference oracle (float32 SiLU in the float64 copy, float16 inputs)",
    # float16 inputs with softmax_precision=FLOAT and a fully masked row: the float64 copy still
    # runs the softmax in float32 (differences are round-off), with softmax_precision=DOUBLE
    # onnxruntime's float64 function body gives NaN on the masked row, and float16 differences
    # are too coarse; tests/test_rules_vision.py checks fully masked rows against torch instead
    "test_attention_24_qk_matmul_output_mode3_softmax_precision":
        "no finite-difference oracle (float32 softmax in the float64 copy, NaN rows otherwise)",
    # the float16 twin of test_attention_4d_gqa_causal_nonpad_decode (in FLOAT32_CHECK): the
    # float64 copy is misaligned as there, and float16 differences are too coarse; tests/
    # test_rules_vision.py checks the float16 gradients against torch
    "test_attention_4d_gqa_causal_nonpad_decode_fp16":
        "float64 Attention aligns nonpad causal masks top-left; float16 differences too coarse",
    # qk_matmul_output_mode=2 with is_causal: that output is -inf at the masked scores, so every
    # finite difference is inf - inf (NaN). tests/test_rules_vision.py checks y and the presents
    # with finite differences and all four outputs against torch autograd
    **{f"test_attention_4d_with_past_and_present_qk_matmul_bias_{v}_mask_causal":
       "qk_matmul_output holds -inf (masked scores): its finite differences are NaN"
       for v in ("3d", "4d")},
    # example inputs exactly where the op is not differentiable: central differences average two
    # one-sided slopes there (or see a jump, or an infinite slope); the rules are checked off
    # these points in tests/test_rules_*.py
    **{f"test_{case}": f"input at {where}" for case, where in (
        ("acosh_example", "x = 1 (infinite slope)"),
        ("elu_example", "x = 0 (slopes 1 and alpha)"),
        ("selu_example", "x = 0 (slopes gamma and gamma * alpha)"),
        ("leakyrelu_example", "x = 0 (slopes 1 and alpha)"),
        ("thresholdedrelu_example", "x = alpha = 2 (a jump)"),
        ("floor_example", "x = 2 (a jump)"),
        ("round", "x = k + 0.5 (jumps)"),
        ("sign", "x = 0 (a jump)"),
        ("reduce_min_default_axes_keepdims_example", "tied minima"),
        ("hardmax_one_hot", "tied maxima (x = [3, 3, 3, 1]: a jump)"),
        ("maxpool_3d_dilations", "tied maxima (x repeats along depth)"),
        ("maxpool_3d_dilations_use_ref_impl", "tied maxima (x repeats along depth)"),
        ("l2normalization_axis_0", "a zero-norm slice (0 / 0)"),
        ("pow", "negative bases with fractional exponents (NaN)"),
        *((f"mod_float_edge_cases_fmod_0_{t}", "+-inf, NaN and zero divisors (no derivative)")
          for t in ("float16", "float32", "float64")))},
}


@functools.lru_cache(maxsize=1)
def all_cases() -> dict:
    """name -> TestCase of the node tests (built once per process: ~25 s)."""
    from onnx.backend.test.case.node import collect_testcases
    return {c.name: c for c in collect_testcases()}


def _elem(vi):
    t = vi.type
    return t.tensor_type.elem_type if t.WhichOneof("value") == "tensor_type" else None


# inputs held constant beyond what the schemas mark, with why
FROZEN_INPUTS = {
    # Upsample's scales: its schema leaves them uncategorized, Resize (which Upsample becomes in
    # the opset upgrade) marks scales NonDifferentiable; the output sizes are integer functions
    # of them
    "Upsample": {1},
}


# inputs held constant in single cases, with why: the case's values sit where the op has kinks,
# so central differences average two one-sided derivatives that no gradient can match
KINKED_INPUTS = {
    # the offsets are (mostly) 0: every sample sits on integer coordinates, where bilinear
    # sampling has kinks (and the zero padding at the border more). x, W, B and mask are still
    # checked; the offset gradient is the right-sided derivative there (torchvision's convention),
    # which tests/test_rules_vision.py checks with one-sided differences on these same inputs,
    # and with central differences off the kinks
    "test_basic_deform_conv_with_padding": {2},
    "test_basic_deform_conv_without_padding": {2},
    "test_deform_conv_with_mask_bias": {2},
    "test_deform_conv_with_multiple_offset_groups": {2},
    # integer rois in output_half_pixel mode: the bilinear samples sit on integer coordinates
    # (kinks of the weights; in max mode also ties among the zero-weight taps). X is still
    # checked; tests/test_rules_vision.py checks the rois' gradient off the kinks
    "test_roialign_aligned_false": {1},
    "test_roialign_mode_max": {1},
}


def non_differentiable(node, opset):
    """Input positions the op's schema marks NonDifferentiable (shapes, scales, indices ...),
    and those FROZEN_INPUTS names."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return set()
    formal = list(schema.inputs)
    out = set(FROZEN_INPUTS.get(node.op_type, ()))
    for i in range(1, len(node.input)):  # input 0 is the data (AffineGrid's theta is mislabeled)
        p = formal[min(i, len(formal) - 1)] if formal else None
        if p is not None and p.differentiation_category == \
                onnx.defs.OpSchema.DifferentiationCategory.NonDifferentiable:
            out.add(i)
    return out


def _freeze(model, names, feeds):
    """A copy of model with the inputs ``names`` turned into initializers of their case values."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    keep = [vi for vi in m.graph.input if vi.name not in names]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.initializer.extend(onnx.numpy_helper.from_array(feeds[n], n) for n in names)
    return m


def build(case):
    """(op, model, xs, ys, feeds) ready for the check: the inputs the op's schema calls
    NonDifferentiable are frozen into initializers (rules may then read them as constants)."""
    op, xs, ys, feeds = describe(case)
    node = case.model.graph.node[0]
    opset = next(o.version for o in case.model.opset_import if o.domain in ("", "ai.onnx"))
    held = non_differentiable(node, opset) | KINKED_INPUTS.get(case.name, set())
    frozen = {node.input[i] for i in held if i < len(node.input) and node.input[i]}
    frozen &= set(feeds)
    model = _freeze(case.model, frozen, feeds) if frozen else case.model
    xs = [x for x in xs if x not in frozen]
    return op, model, xs, ys, {k: v for k, v in feeds.items() if k not in frozen}


def describe(case):
    """(op, xs, ys, feeds) for an eligible case, else None."""
    g = case.model.graph
    if case.name.endswith(("_expanded", "_expanded_ver18")) or len(g.node) != 1:
        return None
    node = g.node[0]
    if node.domain not in ("", "ai.onnx") or node.op_type in EXCLUDED:
        return None
    if not case.data_sets:
        return None
    inputs, _ = case.data_sets[0]
    if len(inputs) != len(g.input):
        return None
    feeds = {}
    for vi, val in zip(g.input, inputs):
        if not isinstance(val, np.ndarray) or val.size >= MAX_ELEMENTS:
            return None
        feeds[vi.name] = val
    xs = [vi.name for vi in g.input if _elem(vi) in FLOAT]
    ys = [vi.name for vi in g.output if _elem(vi) in FLOAT]
    if not xs or not ys or any(_elem(vi) is None for vi in g.output):
        return None
    return node.op_type, xs, ys, feeds


@functools.lru_cache(maxsize=1)
def eligible(per_op: int = PER_OP) -> dict:
    """op -> [case names] (at most per_op each, in name order)."""
    out = defaultdict(list)
    for name in sorted(all_cases()):
        d = describe(all_cases()[name])
        if d is not None and len(out[d[0]]) < per_op:
            out[d[0]].append(name)
    return dict(out)


class _Timeout(Exception):
    pass


def check_case(name: str, timeout: int = 60):
    """('pass' | 'unsupported' | 'fail' | 'excluded', detail) for one case (FLOAT32_CHECK and
    EXCLUDED_CASES above say which cases are treated differently, and why)."""
    import onnxgrad
    from onnxgrad.check import check_gradients
    if name in EXCLUDED_CASES:
        return "excluded", EXCLUDED_CASES[name]
    case = all_cases()[name]
    op, model, xs, ys, feeds = build(case)
    dtype = "float32" if name in FLOAT32_CHECK else "float64"
    if not xs:
        return "unsupported", "no differentiable float input"

    def alarm(*_):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout)
    try:
        report = check_gradients(model, ys, xs, feeds, max_elements=16, directions=2,
                                 unconnected_gradients="zero", dtype=dtype)
    except onnxgrad.NotDifferentiableError as e:
        return "unsupported", f"no rule: {e.op_type}"
    except _Timeout:
        return "fail", f"timeout {timeout}s"
    except Exception as e:  # noqa: BLE001  (a sweep reports, it does not stop)
        return "fail", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if report.ok:
        return "pass", ""
    bad = [r for r in report.results if not r.ok]
    return "fail", "; ".join(f"{r.name}: rel err {r.max_rel_err:.2g}" for r in bad)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-op", type=int, default=PER_OP)
    ap.add_argument("--op", nargs="*", help="only these ops")
    ap.add_argument("--pass-list", action="store_true", help="print the passing case names")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per failing case")
    args = ap.parse_args(argv)
    t0 = time.time()
    ops = eligible(args.per_op)
    if args.op:
        ops = {k: v for k, v in ops.items() if k in args.op}
    table, passing, notes = {}, [], []
    for op in sorted(ops):
        counts = Counter()
        for name in ops[op]:
            status, detail = check_case(name)
            counts[status] += 1
            if status == "pass":
                passing.append(name)
            elif args.verbose or status in ("fail", "excluded"):
                notes.append(f"  {status:11s} {name}: {detail}")
        table[op] = counts
    print(f"{'op':28s} {'pass':>5s} {'unsup':>5s} {'fail':>5s} {'excl':>5s}")
    total = Counter()
    for op, c in table.items():
        total.update(c)
        print(f"{op:28s} {c['pass']:5d} {c['unsupported']:5d} {c['fail']:5d} {c['excluded']:5d}")
    print(f"{'TOTAL (' + str(len(table)) + ' ops)':28s} {total['pass']:5d} "
          f"{total['unsupported']:5d} {total['fail']:5d} {total['excluded']:5d}")
    print(f"ops fully passing: {sum(1 for c in table.values() if c['pass'] and not c['fail'] and not c['unsupported'])}"
          f"; {time.time() - t0:.0f} s")
    if notes:
        print("\nnot passing:")
        print("\n".join(notes))
    if args.pass_list:
        print("\nPASSING = [")
        print("\n".join(f"    {n!r}," for n in passing))
        print("]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
