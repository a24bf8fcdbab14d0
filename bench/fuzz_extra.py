"""Hand-written fragments for the gradient fuzzer: rules that no usable ONNX backend node test
case reaches (Cast, Trilu, If, Loop, Scan, sequences, optionals, MaxRoiPool ...).

Each fragment is a few nodes, the values of the tensors it reads (graph inputs of the fragment,
including outer-scope values its bodies capture), which of them are held constant, and its float
outputs with their shapes. Float types inside bodies are written as FLOAT: a float64 model turns
them into DOUBLE (bench/fuzz_graphs.py)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

F = TensorProto.FLOAT


def _r(shape, seed, lo=-1.5, hi=1.5):
    return np.random.default_rng(seed).uniform(lo, hi, shape)


def _i64(v):
    return np.asarray(v, np.int64)


def fragments():
    """(name, nodes, inputs {name: value}, held names, outputs {name: shape}, fixed names)
    rows; ``fixed`` float tensors keep their dtype (the others take the graph's)."""
    n = helper.make_node
    rows = []

    def add(name, nodes, inputs, held, outputs, fixed=()):
        rows.append((name, nodes, inputs, frozenset(held), outputs, frozenset(fixed)))

    add("extra_cast_roundtrip", [n("Cast", ["x"], ["y"], to=TensorProto.DOUBLE)],
        {"x": _r((2, 3), 1)}, (), {"y": (2, 3)}, fixed=("y",))
    add("extra_castlike", [n("CastLike", ["x", "like"], ["y"])],
        {"x": _r((2, 3), 2), "like": np.zeros((), np.float64)}, ("like",), {"y": (2, 3)},
        fixed=("like", "y"))
    for upper in (0, 1):
        add(f"extra_trilu_upper{upper}", [n("Trilu", ["x", "k"], ["y"], upper=upper)],
            {"x": _r((3, 4), 3), "k": _i64(1 - 2 * upper)}, ("k",), {"y": (3, 4)})
    for p in (2, 3):
        add(f"extra_globallppool_p{p}", [n("GlobalLpPool", ["x"], ["y"], p=p)],
            {"x": _r((2, 3, 3, 3), 4)}, (), {"y": (2, 3, 1, 1)})
    for op in ("Mish", "Round", "Sign"):
        add(f"extra_{op.lower()}", [n(op, ["x"], ["y"])], {"x": _r((2, 3), 5, -3, 3)}, (),
            {"y": (2, 3)})
    add("extra_onehot", [n("OneHot", ["indices", "depth", "values"], ["y"], axis=-1)],
        {"indices": _i64([[1, 4], [0, -1]]), "depth": _i64(5), "values": _r((2,), 20)},
        ("indices", "depth"), {"y": (2, 2, 5)})
    add("extra_maxroipool", [n("MaxRoiPool", ["x", "rois"], ["y"], pooled_shape=[2, 2])],
        {"x": _r((1, 2, 6, 6), 6), "rois": np.array([[0, 0, 0, 3, 3], [0, 1, 2, 5, 4]], float)},
        ("rois",), {"y": (2, 2, 2, 2)})

    # Conv with 16 or more input channels on small images: the weight gradient's gathered form
    # (the backend test cases have one channel)
    for name, xs, ws, ys, attrs in [
            ("3x3_pad", (1, 16, 5, 4), (3, 16, 3, 3), (1, 3, 5, 4), dict(pads=[1, 1, 1, 1])),
            ("strided_dilated", (2, 16, 6, 5), (2, 16, 2, 3), (2, 2, 3, 3),
             dict(strides=[2, 1], dilations=[1, 2], pads=[1, 0, 0, 2])),
            ("1d", (2, 17, 7), (2, 17, 3), (2, 2, 4), dict(strides=[2], pads=[2, 1]))]:
        add(f"extra_conv_wide_{name}", [n("Conv", ["x", "w"], ["y"], **attrs)],
            {"x": _r(xs, 30), "w": _r(ws, 31)}, (), {"y": ys})

    # MaxPool over k x k tiles with several channels and a row or column in no tile: the
    # gradient's folded form (the backend test cases have one channel)
    for k, xs in ((2, (2, 3, 5, 4)), (3, (1, 4, 6, 7))):
        add(f"extra_maxpool_tiles_k{k}", [n("MaxPool", ["x"], ["y"], kernel_shape=[k, k],
                                            strides=[k, k])],
            {"x": _r(xs, 32 + k)}, (), {"y": (xs[0], xs[1], xs[2] // k, xs[3] // k)})

    # a bias broadcast over the leading axes of a tensor of 32768 elements or more: its
    # gradient is summed by a MatMul with ones (Emitter._sum_leading), with the rows counted at
    # run time when the batch is symbolic (the backend test cases are all smaller)
    for op, bs in (("Add", (180,)), ("Mul", (200, 180))):
        add(f"extra_{op.lower()}_bias_summed_as_a_product",
            [n(op, ["x", "b"], ["y"])], {"x": _r((2, 200, 180), 40), "b": _r(bs, 41)}, (),
            {"y": (2, 200, 180)})

    # If: both branches read outer-scope tensors (captured values get gradients)
    then_g = helper.make_graph(
        [n("Tanh", ["a"], ["then_t"]), n("Mul", ["then_t", "b"], ["then_y"])], "then_branch",
        [], [helper.make_tensor_value_info("then_y", F, [2, 3])])
    else_g = helper.make_graph(
        [n("Sin", ["a"], ["else_s"]), n("Add", ["else_s", "b"], ["else_y"])], "else_branch",
        [], [helper.make_tensor_value_info("else_y", F, [2, 3])])
    for c in (True, False):
        add(f"extra_if_{'then' if c else 'else'}",
            [n("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)],
            {"cond": np.array(c), "a": _r((2, 3), 7), "b": _r((2, 3), 8)}, ("cond",),
            {"y": (2, 3)})

    # Loop: a carried value, a scan output, an outer-scope weight
    body = helper.make_graph(
        [n("Identity", ["loop_cond_in"], ["loop_cond_out"]),
         n("Mul", ["loop_v_in", "w"], ["loop_m"]), n("Tanh", ["loop_m"], ["loop_t"]),
         n("Add", ["loop_t", "loop_v_in"], ["loop_v_out"]),
         n("Mul", ["loop_v_out", "w"], ["loop_scan"])], "loop_body",
        [helper.make_tensor_value_info("loop_iter", TensorProto.INT64, []),
         helper.make_tensor_value_info("loop_cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("loop_v_in", F, [2, 3])],
        [helper.make_tensor_value_info("loop_cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("loop_v_out", F, [2, 3]),
         helper.make_tensor_value_info("loop_scan", F, [2, 3])])
    add("extra_loop", [n("Loop", ["trips", "cond", "v0"], ["v", "scans"], body=body)],
        {"trips": _i64(3), "cond": np.array(True), "v0": _r((2, 3), 9), "w": _r((2, 3), 10)},
        ("trips", "cond"), {"v": (2, 3), "scans": (3, 2, 3)})

    # Scan: a state, a scanned input, an outer-scope weight, a constant in the body
    body = helper.make_graph(
        [n("Constant", [], ["scan_half"], value=helper.make_tensor("h", F, [], [0.5])),
         n("Mul", ["scan_s_in", "scan_half"], ["scan_a"]), n("Mul", ["scan_x", "w"], ["scan_b"]),
         n("Tanh", ["scan_b"], ["scan_c"]), n("Add", ["scan_a", "scan_c"], ["scan_s_out"]),
         n("Mul", ["scan_s_out", "scan_x"], ["scan_y"])], "scan_body",
        [helper.make_tensor_value_info("scan_s_in", F, [3]),
         helper.make_tensor_value_info("scan_x", F, [3])],
        [helper.make_tensor_value_info("scan_s_out", F, [3]),
         helper.make_tensor_value_info("scan_y", F, [3])])
    for reverse in (0, 1):
        add(f"extra_scan_reverse{reverse}",
            [n("Scan", ["s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1,
               scan_input_directions=[reverse])],
            {"s0": _r((3,), 11), "xs": _r((4, 3), 12), "w": _r((3,), 13)}, (),
            {"s": (3,), "ys": (4, 3)})

    # sequences: construct, insert, erase, at, length, concat
    add("extra_sequence_ops",
        [n("SequenceConstruct", ["a", "b"], ["seq"]), n("SequenceInsert", ["seq", "c"], ["seq2"]),
         n("SequenceErase", ["seq2", "zero"], ["seq3"]),
         n("ConcatFromSequence", ["seq3"], ["y"], axis=0, new_axis=1),
         n("SequenceAt", ["seq2", "last"], ["at"]), n("SequenceLength", ["seq3"], ["len"]),
         n("Cast", ["len"], ["lenf"], to=F), n("Mul", ["at", "lenf"], ["z"])],
        {"a": _r((2, 3), 14), "b": _r((2, 3), 15), "c": _r((2, 3), 16), "zero": _i64(0),
         "last": _i64(-1)}, ("zero", "last"), {"y": (2, 2, 3), "z": (2, 3)})
    add("extra_split_to_sequence",
        [n("SplitToSequence", ["a"], ["seq"], axis=0),
         n("SequenceAt", ["seq", "two"], ["z"]),
         n("ConcatFromSequence", ["seq"], ["y"], axis=1)],
        {"a": _r((4, 3), 17), "two": _i64(2)}, ("two",), {"z": (1, 3), "y": (1, 12)})
    map_body = helper.make_graph(
        [n("Tanh", ["map_x"], ["map_t"]), n("Mul", ["map_t", "map_x"], ["map_y"])], "map_body",
        [helper.make_tensor_value_info("map_x", F, [2, 3])],
        [helper.make_tensor_value_info("map_y", F, [2, 3])])
    add("extra_sequence_map",
        [n("SequenceEmpty", [], ["empty"], dtype=F), n("SequenceInsert", ["empty", "a"], ["s1"]),
         n("SequenceInsert", ["s1", "b"], ["s2"]),
         n("SequenceMap", ["s2"], ["mapped"], body=map_body),
         n("ConcatFromSequence", ["mapped"], ["y"], axis=0, new_axis=1)],
        {"a": _r((2, 3), 18), "b": _r((2, 3), 19)}, (), {"y": (2, 2, 3)})
    # optional-typed values: wrapped and read back (and OptionalGetElement of a plain tensor)
    add("extra_optional",
        [n("Optional", ["a"], ["opt"]), n("OptionalGetElement", ["opt"], ["got"]),
         n("OptionalGetElement", ["b"], ["plain"]), n("Mul", ["got", "plain"], ["y"])],
        {"a": _r((2, 3), 21), "b": _r((2, 3), 22)}, (), {"y": (2, 3)})
    return rows
