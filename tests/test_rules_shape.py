"""Gradient rules of onnxgrad/rules/shape.py against float64 central finite differences.

Each test builds a one-op model (int inputs such as shapes, axes, pads and indices are
initializers), asks onnxgrad for its gradient graph and checks it with ``util.assert_gradients``:
random-cotangent central differences in float64, the full ONNX checker on the gradient model, and
the same graph run in float32 on onnxruntime. Symbolic dims ("N") check that the rules read shapes
at run time rather than from the example.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import helper
from util import assert_gradients, grads_of, make_model, op_model, vi_model

import onnxgrad
from onnxgrad.check import check_gradients

F32 = np.float32
I64 = np.int64
END = np.iinfo(np.int64).max


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(F32)


def model(op, ins, floats, inits=None, n_out=1, opset=18, **attrs):
    """One ``op`` node whose inputs are ``ins`` in order ("" for an absent optional input);
    ``floats``: {name: shape} float32 graph inputs; ``inits``: {name: array} initializers."""
    outs = ["y"] if n_out == 1 else [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, ins, outs, **attrs)
    return make_model([node], {k: (F32, s) for k, s in floats.items()}, outs, inits=inits,
                      opset=opset)


def check(m, xs=("x",), ys=("y",), **feeds):
    return assert_gradients(m, list(ys), list(xs), feeds=feeds or None)


# -- reshapes and permutations -----------------------------------------------------------------
@pytest.mark.parametrize("shape_in, target, allowzero", [
    ([2, 3, 4], [6, -1], 0),
    (["N", 3, 4], [0, -1], 0),
    (["N", 3, 4], [-1, 2, 2], 0),
    ([2, 3, 4], [4, 3, 2], 1),
])
def test_reshape(shape_in, target, allowzero):
    m = op_model("Reshape", {"x": (F32, shape_in)}, inits={"s": np.array(target, I64)},
                 allowzero=allowzero)
    check(m)


@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1, -3])
def test_flatten(axis):
    check(op_model("Flatten", {"x": (F32, ["N", 3, 2, 2])}, axis=axis))


@pytest.mark.parametrize("perm", [None, [1, 0, 2], [2, 0, 1], [0, 2, 1]])
def test_transpose(perm):
    kw = {} if perm is None else {"perm": perm}
    check(op_model("Transpose", {"x": (F32, ["N", 3, 4])}, **kw))


@pytest.mark.parametrize("op, shape, axes", [
    ("Squeeze", [2, 1, 3, 1], [1]),
    ("Squeeze", ["N", 1, 3, 1], [-1, 1]),
    ("Squeeze", [1, 3, 1, 2], None),
    ("Unsqueeze", ["N", 3], [0]),
    ("Unsqueeze", [2, 3], [-1, 1]),
])
def test_squeeze_unsqueeze(op, shape, axes):
    inits = None if axes is None else {"a": np.array(axes, I64)}
    check(op_model(op, {"x": (F32, shape)}, inits=inits))


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(mode):
    check(op_model("DepthToSpace", {"x": (F32, ["N", 8, 2, 3])}, blocksize=2, mode=mode))


def test_space_to_depth():
    check(op_model("SpaceToDepth", {"x": (F32, ["N", 2, 4, 2])}, blocksize=2))


@pytest.mark.parametrize("batch_axis, time_axis", [(1, 0), (0, 1)])
def test_reverse_sequence(batch_axis, time_axis):
    shape = [4, 3, 2] if batch_axis == 1 else [3, 4, 2]
    check(op_model("ReverseSequence", {"x": (F32, shape)}, inits={"L": np.array([4, 1, 2], I64)},
                   batch_axis=batch_axis, time_axis=time_axis))


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [1, -3])
def test_cumsum(exclusive, reverse, axis):
    check(op_model("CumSum", {"x": (F32, ["N", 4, 2])}, inits={"a": np.array(axis, I64)},
                   exclusive=exclusive, reverse=reverse), x=rnd(3, 4, 2))


# rows with no zero, one zero, two zeros (the gradient at and past the first zero is exact)
CUMPROD_X = np.array([[[1.5, -0.5], [0.8, 2.0], [-1.2, 0.0], [0.6, 1.1], [1.3, 0.0]],
                      [[0.0, 0.7], [1.4, -0.9], [0.0, 1.6], [0.5, 0.0], [-2.0, 1.2]]], F32)


def _cumprod_model(exclusive, reverse, axis):
    return op_model("CumProd", {"x": (F32, ["N", 5, 2])}, opset=26,
                    inits={"a": np.array(axis, I64)}, exclusive=exclusive, reverse=reverse)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [1, -2])
def test_cumprod(exclusive, reverse, axis):
    check(_cumprod_model(exclusive, reverse, axis), x=CUMPROD_X)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumprod_torch(exclusive, reverse):
    """torch.cumprod's autograd (exact at zeros); exclusive / reverse built from flips and a
    shift."""
    torch = pytest.importorskip("torch")
    (got,), _ = grads_of(_cumprod_model(exclusive, reverse, 1), "y", "x", {"x": CUMPROD_X})
    x = torch.tensor(CUMPROD_X, dtype=torch.float64, requires_grad=True)
    t = x.flip(1) if reverse else x
    if exclusive:
        t = torch.cat([torch.ones_like(t[:, :1]), t[:, :-1]], 1)
    y = torch.cumprod(t, 1)
    (y.flip(1) if reverse else y).sum().backward()
    np.testing.assert_allclose(got, x.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 1, -1])
def test_trilu(upper, k):
    inits = None if k is None else {"k": np.array(k, I64)}
    check(op_model("Trilu", {"x": (F32, ["N", 3, 4])}, inits=inits, upper=upper))


# -- concat / split ----------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis):
    shapes = {0: ([2, 3], [1, 3], [3, 3]), 1: (["N", 1], ["N", 3], ["N", 2]),
              -1: ([2, 2, 1], [2, 2, 3], [2, 2, 2])}[axis]
    m = op_model("Concat", {f"x{i}": (F32, s) for i, s in enumerate(shapes)}, axis=axis)
    check(m, xs=["x0", "x1", "x2"])


def test_concat_one_input():
    check(op_model("Concat", {"x": (F32, ["N", 3])}, axis=1))


@pytest.mark.parametrize("opset, split, attrs, n_out", [
    (18, [1, 3], {"axis": 1}, 2),            # split input
    (18, None, {"axis": -1, "num_outputs": 3}, 3),  # uneven num_outputs: 2, 2, 1
    (13, None, {"axis": 0}, 2),              # equal split, no num_outputs before 18
    (13, [2, 0, 2], {"axis": 1}, 3),         # an empty piece
])
def test_split(opset, split, attrs, n_out):
    shape = {0: [4, 3], 1: ["N", 4], -1: [2, 5]}[attrs["axis"]]
    inits = None if split is None else {"s": np.array(split, I64)}
    m = op_model("Split", {"x": (F32, shape)}, n_out=n_out, opset=opset, inits=inits, **attrs)
    feeds = {"x": rnd(3, 4)} if shape[0] == "N" else {}
    check(m, ys=[f"y{i}" for i in range(n_out)], **feeds)


@pytest.mark.parametrize("used", [["y1"], ["y0", "y2"]])
def test_split_only_some_outputs(used):
    m = op_model("Split", {"x": (F32, ["N", 6])}, n_out=3, axis=1, num_outputs=3)
    check(m, ys=used)


# -- slice / pad -------------------------------------------------------------------------------
SLICES = [  # starts, ends, axes, steps  (x is [3, 5, 4]; None = input absent)
    ([1], [3], None, None),
    ([-4, 1], [END, -1], [1, 0], None),          # negative start, clamped end, axes reordered
    ([0, -100], [2, 100], [-1, 1], [1, 1]),      # clamped both ways, constant unit steps
    ([3], [1], [1], None),                       # empty result
    ([4], [-100], [1], [-2]),                    # negative step to a clamped end
    ([0, 1], [END, 4], [0, 2], [2, 2]),
    ([-1, -1], [-END, 0], [0, 1], [-1, -3]),
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("starts, ends, axes, steps", SLICES)
def test_slice(starts, ends, axes, steps, opset):
    inits = {"s": np.array(starts, I64), "e": np.array(ends, I64)}
    names = ["x", "s", "e"]
    for name, v in (("a", axes), ("st", steps)):
        if v is not None:
            inits[name] = np.array(v, I64)
        names.append(name if v is not None else "")
    while names[-1] == "":
        names.pop()
    m = model("Slice", names, {"x": ["N", 5, 4]}, inits, opset=opset)
    check(m, x=rnd(3, 5, 4))


def test_slice_int32_params_and_runtime_starts():
    """Slice's index inputs may be int32, and starts may only be known at run time."""
    node = helper.make_node("Slice", ["x", "s", "e", "a"], ["y"])
    m = make_model([node], {"x": (F32, ["N", 5]), "s": (np.int32, [1])}, ["y"],
                   inits={"e": np.array([4], np.int32), "a": np.array([1], np.int32)})
    check(m, x=rnd(2, 5), s=np.array([-3], np.int32))


PADS = [  # pads, axes (None: all axes), on x of shape [N, 4]
    ([1, 0, 2, 3], None),
    ([0, 2, 1, 1], None),
    ([2, 1], [-1]),
    ([-1, 1, 1, -2], None),          # negative pads crop
    ([1, -1], [0]),
]


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads, axes", PADS)
def test_pad(mode, pads, axes):
    inits = {"p": np.array(pads, I64)}
    names = ["x", "p"]
    if axes is not None:
        inits["ax"] = np.array(axes, I64)
        names += ["", "ax"]
    m = model("Pad", names, {"x": ["N", 4]}, inits, opset=19, mode=mode)
    check(m, x=rnd(3, 4))


def scalar_c():
    """c0 [1] squeezed to the scalar constant_value c (check_gradients cannot perturb a 0-d x)."""
    return helper.make_node("Squeeze", ["c0"], ["c"])


@pytest.mark.parametrize("pads, axes", PADS[:4])
def test_pad_constant_value(pads, axes):
    names = ["x", "p", "c"] + ([] if axes is None else ["ax"])
    inits = {"p": np.array(pads, I64)}
    if axes is not None:
        inits["ax"] = np.array(axes, I64)
    m = make_model([scalar_c(), helper.make_node("Pad", names, ["y"])],
                   {"x": (F32, ["N", 4]), "c0": (F32, [1])}, ["y"], inits=inits)
    check(m, xs=["x", "c0"], x=rnd(3, 4))


def test_pad_opset13_runtime_pads():
    node = helper.make_node("Pad", ["x", "p", "c"], ["y"])
    m = make_model([scalar_c(), node], {"x": (F32, [3, 4]), "p": (I64, [4]), "c0": (F32, [1])},
                   ["y"], opset=13)
    check(m, xs=["x", "c0"], p=np.array([-1, 2, 1, -1], I64))


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad_opset13(mode):
    """Before opset 18 Pad has no axes input; the pads cover every axis."""
    m = model("Pad", ["x", "p"], {"x": ["N", 4]}, {"p": np.array([1, -1, 0, 2], I64)}, opset=13,
              mode=mode)
    check(m, x=rnd(3, 4))


@pytest.mark.parametrize("target, axes", [([2, 5], None), ([1, 2], None), ([7], [-1]),
                                          ([4, 3], [1, 0])])
def test_center_crop_pad(target, axes):
    kw = {} if axes is None else {"axes": axes}
    m = op_model("CenterCropPad", {"x": (F32, [5, 3])}, inits={"s": np.array(target, I64)}, **kw)
    check(m)


def test_center_crop_pad_symbolic():
    m = op_model("CenterCropPad", {"x": (F32, ["N", 4])}, inits={"s": np.array([1, 7], I64)})
    check(m, x=rnd(3, 4))


# -- broadcasting copies -----------------------------------------------------------------------
@pytest.mark.parametrize("shape, target", [([3, 1], [2, 3, 4]), (["N", 1, 2], [3, 2]),
                                           ([1], [1]), ([2, 3], [1, 3])])
def test_expand(shape, target):
    check(op_model("Expand", {"x": (F32, shape)}, inits={"s": np.array(target, I64)}))


@pytest.mark.parametrize("shape, reps", [([2, 3], [2, 1]), (["N", 2, 1], [1, 3, 2]), ([4], [3])])
def test_tile(shape, reps):
    check(op_model("Tile", {"x": (F32, shape)}, inits={"r": np.array(reps, I64)}))


# -- gathers -----------------------------------------------------------------------------------
GATHERS = [  # x shape, indices, axis
    ([5, 3], [[0, 4], [4, 4]], 0),                 # repeated rows accumulate
    (["N", 4, 2], [3, -1, 0, -4], 1),              # negative indices, repeats
    ([2, 3, 4], [[1, 1], [2, -1], [0, 3]], -1),
    ([4, 3], 2, 0),                                # scalar index
    ([2, 4, 3], -2, -2),
    (["N", 3], 1, 0),                              # scalar index on a symbolic axis
    (["N", 3], -1, 0),
    ([2, "M", 3], 0, 1),
    ([3, 4], [], 1),                               # nothing gathered
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("shape, indices, axis", GATHERS)
def test_gather(shape, indices, axis, opset):
    m = op_model("Gather", {"x": (F32, shape)}, inits={"i": np.array(indices, I64)}, axis=axis,
                 opset=opset)
    check(m)


def test_gather_scalar_index_is_a_pad():
    """A constant scalar index (q, k, v = qkv[0], qkv[1], qkv[2]): g is padded back into place,
    no zeros-and-ScatterND (x of unknown rank: the attention in test_real_models)."""
    m = op_model("Gather", {"x": (F32, ["N", 4, 2])}, inits={"i": np.array(-2, I64)}, axis=1)
    ops = {n.op_type for n in onnxgrad.gradients(m, "y", "x").model.graph.node}
    assert "Pad" in ops and "ScatterND" not in ops


def test_gather_int32_indices_symbolic_rows():
    m = op_model("Gather", {"x": (F32, ["N", 3])}, inits={"i": np.array([[1, 0, 1]], np.int32)})
    check(m, x=rnd(2, 3))


def test_gather_repeated_indices_add_up():
    """An embedding lookup that reads row 1 three times: its gradient is the sum of the three."""
    m = op_model("Gather", {"x": (F32, [3, 2])}, inits={"i": np.array([1, 0, 1, 1], I64)})
    gy = rnd(4, 2, seed=1)
    (g,), _ = grads_of(m, "y", "x", {"x": rnd(3, 2), "gy": gy}, grad_ys=["gy"])
    np.testing.assert_allclose(g, np.stack([gy[1], gy[0] + gy[2] + gy[3], np.zeros(2)]),
                               rtol=1e-6)


@pytest.mark.parametrize("shape, indices, axis", [
    ([3, 4], [[0, 0, 2, 1], [2, 2, 1, 0]], 0),
    (["N", 4], [[3, -1], [0, 0]], 1),
    ([2, 3, 2], [[[0, 1], [-1, 0]], [[1, 1], [2, 2]]], -2),
])
def test_gather_elements(shape, indices, axis):
    m = op_model("GatherElements", {"x": (F32, shape)}, inits={"i": np.array(indices, I64)},
                 axis=axis)
    check(m, x=rnd(2, *shape[1:]) if shape[0] == "N" else rnd(*shape))


@pytest.mark.parametrize("shape, indices, batch_dims", [
    ([4, 3], [[1], [3], [1]], 0),                       # repeated slices
    ([3, 4], [[0, 1], [2, -1], [0, 1]], 0),             # repeated elements, negative index
    ([2, 3, 4], [[[1, 2]], [[-1, 0]]], 0),
    ([2, 3, 4], [[[1], [1]], [[2], [0]]], 1),           # batch_dims, repeated
    (["N", 3, 4], [[[1, 1], [2, 3]], [[0, 0], [0, 0]]], 1),
    ([2, 2, 3, 2], [[[1], [0]], [[2], [2]]], 2),
])
def test_gather_nd(shape, indices, batch_dims):
    m = op_model("GatherND", {"x": (F32, shape)}, inits={"i": np.array(indices, I64)},
                 batch_dims=batch_dims)
    check(m, x=rnd(*[2 if d == "N" else d for d in shape]))


@pytest.mark.parametrize("axis, largest, sorted_", [(-1, 1, 1), (0, 0, 1), (1, 1, 0)])
def test_topk_values(axis, largest, sorted_):
    m = op_model("TopK", {"x": (F32, [4, 5])}, n_out=2, inits={"k": np.array([3], I64)},
                 axis=axis, largest=largest, sorted=sorted_)
    check(m, ys=["y0"])


def test_topk_symbolic():
    m = op_model("TopK", {"x": (F32, ["N", 5])}, n_out=2, inits={"k": np.array([2], I64)})
    check(m, ys=["y0"], x=rnd(3, 5))


# -- scatters ----------------------------------------------------------------------------------
SCATTER_ELEMENTS = [  # data shape, indices, axis (distinct per column / row for "none")
    ([3, 3], [[1, 0, 2], [0, 2, 1]], 0),
    ([3, 4], [[3, -4], [1, 2], [0, -1]], 1),
]


@pytest.mark.parametrize("reduction", ["none", "add", "max", "min", "mul"])
@pytest.mark.parametrize("shape, indices, axis", SCATTER_ELEMENTS)
def test_scatter_elements(shape, indices, axis, reduction):
    idx = np.array(indices, I64)
    m = model("ScatterElements", ["x", "i", "u"], {"x": shape, "u": list(idx.shape)},
              {"i": idx}, axis=axis, reduction=reduction)
    check(m, xs=["x", "u"], x=rnd(*shape, seed=1), u=rnd(*idx.shape, seed=2))


@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
@pytest.mark.parametrize("reduction", ["max", "min"])
def test_scatter_max_min_two_way_tie(op, reduction):
    """A tie between data and an update splits the gradient evenly, which is what central
    differences see at a two-way tie; a repeated index ties two updates."""
    x, u = rnd(2, 3), rnd(2, 3, seed=1)
    u[0, 1] = x[0, 1]   # data/update tie at (0, 1)
    u[1, 2] = u[0, 2] = max(x[0, 2], x[1, 2]) + 1 if reduction == "max" else min(
        x[0, 2], x[1, 2]) - 1  # update/update tie at column 2
    if op == "ScatterElements":
        idx = np.array([[0, 0, 1], [1, 1, 1]], I64)  # row of each element of u, per column
        m = model(op, ["x", "i", "u"], {"x": [2, 3], "u": [2, 3]}, {"i": idx},
                  axis=0, reduction=reduction)
    else:  # the same scatter written with index pairs
        idx = np.array([[[0, 0], [0, 1], [1, 2]], [[1, 0], [1, 1], [1, 2]]], I64)
        m = model(op, ["x", "i", "u"], {"x": [2, 3], "u": [2, 3]}, {"i": idx},
                  reduction=reduction)
    check(m, xs=["x", "u"], x=x, u=u)


def test_scatter_elements_add_repeated():
    idx = np.array([[1, 1, 0], [1, 1, 0]], I64)
    m = model("ScatterElements", ["x", "i", "u"], {"x": ["N", 3], "u": [2, 3]}, {"i": idx},
              reduction="add")
    check(m, xs=["x", "u"], x=rnd(3, 3))


def test_scatter_elements_opset13():
    idx = np.array([[2, 0, 1]], I64)
    m = model("ScatterElements", ["x", "i", "u"], {"x": [3, 3], "u": [1, 3]}, {"i": idx},
              opset=13)
    check(m, xs=["x", "u"])


SCATTER_ND = [  # data shape, indices (distinct), updates shape
    ([4, 3], [[1], [3]], [2, 3]),
    ([3, 4], [[0, 1], [2, -1], [1, 1]], [3]),
]


@pytest.mark.parametrize("reduction", ["none", "add", "max", "min", "mul"])
@pytest.mark.parametrize("shape, indices, ushape", SCATTER_ND)
def test_scatter_nd(shape, indices, ushape, reduction):
    m = model("ScatterND", ["x", "i", "u"], {"x": shape, "u": ushape},
              {"i": np.array(indices, I64)}, reduction=reduction)
    check(m, xs=["x", "u"], x=rnd(*shape, seed=1), u=rnd(*ushape, seed=2))


@st.composite
def _repeated_scatters(draw):
    """A write without reduction whose indices repeat (drawn from few values, negatives too),
    constant or fed at run time, at opsets before and after reduction was added."""
    op = draw(st.sampled_from(["ScatterElements", "ScatterND"]))
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if op == "ScatterElements":
        axis = draw(st.integers(-len(shape), len(shape) - 1))
        ishape = [draw(st.integers(1, d + 2)) if i == axis % len(shape) else
                  draw(st.integers(1, d)) for i, d in enumerate(shape)]
        dim = shape[axis]
        idx = rng.integers(-dim, dim, ishape)
        ushape, attrs = ishape, {"axis": axis}
    else:
        k = draw(st.integers(1, len(shape)))
        rows = draw(st.integers(1, 5))
        idx = np.stack([rng.integers(-d, d, rows) for d in shape[:k]], -1)
        ushape, attrs = [rows, *shape[k:]], {}
    return op, shape, idx.astype(I64), ushape, attrs, draw(st.booleans()), \
        draw(st.sampled_from([13, 16, 18]))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_repeated_scatters())
# updates 0 and 2 both write element 1: only the one the output holds has a gradient (the rule
# gave every repeated update g, as torch's and TF's do, where the output keeps one of them)
@example(("ScatterElements", [3], np.array([1, 0, 1], I64), [3], {"axis": 0}, False, 18))
@example(("ScatterND", [3, 2], np.array([[2], [2]], I64), [2, 2], {}, True, 16))
def test_scatter_repeated_indices_credit_the_kept_write(case):
    op, shape, idx, ushape, attrs, fed, opset = case
    if fed:
        m = make_model([helper.make_node(op, ["x", "i", "u"], ["y"], **attrs)],
                       {"x": (F32, shape), "i": (I64, list(idx.shape)), "u": (F32, ushape)},
                       ["y"], opset=opset)
        check(m, xs=["x", "u"], x=rnd(*shape, seed=1), u=rnd(*ushape, seed=2), i=idx)
    else:
        m = model(op, ["x", "i", "u"], {"x": shape, "u": ushape}, {"i": idx}, opset=opset,
                  **attrs)
        check(m, xs=["x", "u"], x=rnd(*shape, seed=1), u=rnd(*ushape, seed=2))


def test_scatter_nd_add_repeated_symbolic():
    m = model("ScatterND", ["x", "i", "u"], {"x": [4, "N"], "u": [3, "N"]},
              {"i": np.array([[1], [1], [-1]], I64)}, reduction="add")
    check(m, xs=["x", "u"], x=rnd(4, 2), u=rnd(3, 2))


# reduction="mul": y = data * (the product of the updates hitting each element). The updates'
# gradients are products of the OTHER updates, built without dividing by zeros; y is linear in
# each update, so central differences are exact at zeros too. Cases: repeated indices, one zero,
# two zeros on one element, a zero beside non-zero updates on the same element
SCATTER_MUL = {
    "repeated": ([[0, 2, 1], [0, 2, 2], [1, 2, 1]], {}),
    "one_zero": ([[0, 2, 1], [0, 2, 2], [1, 2, 1]], {(1, 0): 0.0}),
    "two_zeros_one_element": ([[0, 2, 1], [0, 2, 2], [1, 2, 1]], {(0, 0): 0.0, (1, 0): 0.0}),
    "zero_among_three": ([[0, 2, 1], [0, 2, 2], [0, 2, 1]], {(2, 1): 0.0}),
    "all_zero": ([[0, 2, 1], [0, 2, 2], [1, 2, 1]], {(0, 1): 0.0, (1, 1): 0.0, (2, 1): 0.0}),
}


def _scatter_mul_case(op, case, x_zero=False):
    """(model, x, u, torch fn) for SCATTER_MUL[case] written as ``op``: a [3, 3] x, updates
    [3, 3] hitting rows idx[r, c] of column c (ScatterND: the same positions as index pairs)."""
    rows, zeros = SCATTER_MUL[case]
    rows = np.array(rows, I64)
    x, u = rnd(3, 3, seed=1), rnd(3, 3, seed=2)
    if x_zero:
        x[0, 0] = 0.0
    for at, v in zeros.items():
        u[at] = v
    cols = np.broadcast_to(np.arange(3), rows.shape)
    if op == "ScatterElements":
        m = model(op, ["x", "i", "u"], {"x": [3, 3], "u": [3, 3]}, {"i": rows}, axis=0,
                  reduction="mul")
    else:
        m = model(op, ["x", "i", "u"], {"x": [3, 3], "u": [3, 3]},
                  {"i": np.stack([rows, cols], -1)}, reduction="mul")
    flat = rows * 3 + cols  # both are the same scatter on the flat elements

    def torch_fn(tx, tu):
        import torch
        out = tx.reshape(-1).scatter_reduce(0, torch.tensor(flat.reshape(-1)), tu.reshape(-1),
                                            reduce="prod", include_self=True)
        return out.reshape(3, 3)
    return m, x, u, torch_fn


@pytest.mark.parametrize("case", list(SCATTER_MUL))
@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
def test_scatter_mul_finite_differences(op, case):
    m, x, u, _ = _scatter_mul_case(op, case)
    check(m, xs=["x", "u"], x=x, u=u)


@pytest.mark.parametrize("case", list(SCATTER_MUL))
@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
def test_scatter_mul_matches_torch_scatter_reduce_prod(op, case):
    torch = pytest.importorskip("torch")
    m, x, u, fn = _scatter_mul_case(op, case, x_zero=True)
    gy = rnd(3, 3, seed=3)
    tx, tu = (torch.tensor(v.astype(np.float64), requires_grad=True) for v in (x, u))
    y_t = fn(tx, tu)
    y_t.backward(torch.tensor(gy.astype(np.float64)))
    m64 = onnxgrad.check.to_float64(m)
    feeds = {"x": x.astype(np.float64), "u": u.astype(np.float64), "gy": gy.astype(np.float64)}
    (gx, gu), res = grads_of(m64, "y", ["x", "u"], feeds, grad_ys=["gy"])
    from onnxgrad.runtime import run
    np.testing.assert_allclose(run(res.model, feeds, outputs=["y"])[0], y_t.detach().numpy(),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gx, tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gu, tu.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_scatter_mul_float16():
    """Half precision: the products and zero counts run in float32 (onnxruntime has no float16
    scatter reductions); the gradient graph runs on onnx.reference in float16 and matches the
    float64 one."""
    m, x, u, _ = _scatter_mul_case("ScatterElements", "one_zero")
    m16 = onnx.ModelProto.FromString(m.SerializeToString())
    for vi in [*m16.graph.input, *m16.graph.output]:
        vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    gy = rnd(3, 3, seed=3)
    feeds = {"x": x, "u": u, "gy": gy}
    (gx, gu), _ = grads_of(m, "y", ["x", "u"], feeds, grad_ys=["gy"])
    res = onnxgrad.gradients(m16, "y", ["x", "u"], grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    from onnxgrad.runtime import run  # onnxruntime has no float16 kernel for the forward node
    hx, hu = run(res.model, {k: v.astype(np.float16) for k, v in feeds.items()},
                 outputs=res.grads, prefer="reference")
    assert hx.dtype == hu.dtype == np.float16
    np.testing.assert_allclose(hx, gx, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(hu, gu, rtol=1e-2, atol=1e-2)


def test_scatter_mul_second_order():
    nodes = [helper.make_node("ScatterElements", ["x", "i", "x"], ["t"], axis=0,
                              reduction="mul"),
             helper.make_node("Mul", ["t", "t"], ["y"])]
    second_order(nodes, [2, 3], {"i": np.array([[1, 0, 1], [1, 1, 0]], I64)}, rnd(2, 3))


# -- higher order ------------------------------------------------------------------------------
def second_order(nodes, x_shape, inits, feeds_x):
    """d/dx and d/dgy of the gradient d(sum(gy * y))/dx, checked by finite differences."""
    m = make_model(nodes, {"x": (F32, x_shape)}, ["y"], inits=inits)
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
    onnx.checker.check_model(res.model, full_check=True)
    report = check_gradients(res.model, res.grads, ["x", "gy"], {"x": feeds_x})
    assert report.ok, str(report)


def test_second_order_through_gather():
    nodes = [helper.make_node("Gather", ["x", "i"], ["t"], axis=0),
             helper.make_node("Mul", ["t", "t"], ["y"])]
    second_order(nodes, ["N", 3], {"i": np.array([[2, 0], [2, 2]], I64)}, rnd(3, 3))


def test_second_order_through_gather_axis1():
    nodes = [helper.make_node("Gather", ["x", "i"], ["t"], axis=1),
             helper.make_node("Mul", ["t", "t"], ["y"])]
    second_order(nodes, [2, 3], {"i": np.array([1, -1, 1], I64)}, rnd(2, 3))


def test_second_order_through_scalar_gather():
    nodes = [helper.make_node("Gather", ["x", "i"], ["t"], axis=1),
             helper.make_node("Mul", ["t", "t"], ["y"])]
    second_order(nodes, ["N", 3], {"i": np.array(-1, I64)}, rnd(2, 3))


@pytest.mark.parametrize("steps", [None, [-2]])
def test_second_order_through_slice(steps):
    inits = {"s": np.array([-1 if steps else 1], I64), "e": np.array([-END if steps else 4], I64),
             "a": np.array([1], I64)}
    ins = ["x", "s", "e", "a"]
    if steps:
        inits["st"] = np.array(steps, I64)
        ins.append("st")
    nodes = [helper.make_node("Slice", ins, ["t"]), helper.make_node("Mul", ["t", "t"], ["y"])]
    second_order(nodes, ["N", 5], inits, rnd(2, 5))


def test_second_order_through_pad_and_gather_nd():
    nodes = [helper.make_node("Pad", ["x", "p"], ["t"], mode="reflect"),
             helper.make_node("GatherND", ["t", "i"], ["u"], batch_dims=1),
             helper.make_node("Mul", ["u", "u"], ["y"])]
    second_order(nodes, [2, 3], {"p": np.array([0, 2, 0, 1], I64),
                                 "i": np.array([[[0], [4]], [[1], [1]]], I64)}, rnd(2, 3))


# -- dtype -------------------------------------------------------------------------------------
def test_float64_model():
    """Rules build their constants in the tensor's dtype: a float64 model works as is."""
    node = helper.make_node("Pad", ["x", "p", "c"], ["y"])
    m = make_model([node], {"x": (np.float64, ["N", 3]), "c": (np.float64, [])}, ["y"],
                   inits={"p": np.array([1, 0, 0, 2], I64)})
    (gx, gc), _ = grads_of(m, "y", ["x", "c"], {"x": np.ones((2, 3)), "c": np.array(5.0)})
    np.testing.assert_array_equal(gx, np.ones((2, 3)))
    assert gc.dtype == np.float64 and gc == 3 * 5 - 6


@pytest.mark.parametrize("op, attrs, inits", [
    ("Gather", {"axis": 0}, {"i": np.array([[1, 1], [0, 1]], I64)}),
    ("Gather", {"axis": 1}, {"i": np.array([2, 2, 0], I64)}),
    ("GatherElements", {"axis": 1}, {"i": np.array([[1, 1, 0], [2, 2, 2]], I64)}),
    ("GatherND", {"batch_dims": 1}, {"i": np.array([[1], [1]], I64)}),
    ("Pad", {"mode": "edge"}, {"p": np.array([1, 2, 0, 1], I64)}),
    ("Slice", {}, {"s": np.array([2], I64), "e": np.array([-END], I64),
                   "a": np.array([1], I64), "st": np.array([-2], I64)}),
])
def test_float16(op, attrs, inits):
    """Half-precision gradients run on onnxruntime CPU (its scatter-add has no float16 kernel,
    so the rules accumulate in float32) and agree with float64 finite differences."""
    m = op_model(op, {"x": (np.float16, [2, 3])}, inits=inits, **attrs)
    check(m)


@pytest.mark.parametrize("op, ins, inits, attrs", [
    ("ScatterElements", ["x", "i", "x"], {"i": np.array([[1, 0, 1, 1], [0, 1, 0, 1]], I64)},
     {"reduction": "max"}),
    ("TopK", ["x", "k"], {"k": np.array([2], I64)}, {}),
    ("Pad", ["x", "p"], {"p": np.array([1, 0, 0, 2], I64)}, {"mode": "wrap"}),
    ("DepthToSpace", ["xs"], {"s": np.array([1, 8, 1, 1], I64)}, {"blocksize": 2, "mode": "CRD"}),
])
def test_second_order_more(op, ins, inits, attrs):
    outs = ["t", "ti"] if op == "TopK" else ["t"]
    nodes = [helper.make_node(op, ins, outs, **attrs), helper.make_node("Mul", ["t", "t"], ["y"])]
    if op == "DepthToSpace":
        nodes.insert(0, helper.make_node("Reshape", ["x", "s"], ["xs"]))
    m = make_model(nodes, {"x": (F32, [2, 4])}, ["y"], inits=inits, opset=19)
    res = onnxgrad.gradients(m, "y", "x", grad_ys=["gy"])
    report = check_gradients(res.model, res.grads, ["x", "gy"], {"x": rnd(2, 4)})
    assert report.ok, str(report)


# -- TensorScatter (KV-cache update) -------------------------------------------------------------
TENSOR_SCATTERS = [  # past shape, update shape, axis (None: the default -2), write_indices
    ([2, 3, 5, 2], [2, 3, 2, 2], None, None),        # prefill: written at 0 .. S-1
    ([2, 3, 5, 2], [2, 3, 2, 2], None, [3, 0]),
    ([2, 3, 5, 2], [2, 3, 1, 2], None, [4, 2]),      # decode: one token per row
    ([2, 5, 3], [2, 2, 3], 1, [1, 3]),
    ([3, 4], [3, 2], -1, [0, 2, 1]),                 # rank 2: sequence is the last axis
    ([2, 2, 3, 4], [2, 2, 3, 3], -1, [1, 0]),
]


@pytest.mark.parametrize("mode", ["linear", "circular"])
@pytest.mark.parametrize("past, upd, axis, w", TENSOR_SCATTERS)
def test_tensor_scatter(past, upd, axis, w, mode):
    inits = None if w is None else {"w": np.array(w, I64)}
    kw = {} if axis is None else {"axis": axis}
    m = model("TensorScatter", ["x", "u"] + ([] if w is None else ["w"]), {"x": past, "u": upd},
              inits, opset=24, mode=mode, **kw)
    assert_gradients(m, "y", ["x", "u"], max_elements=200)


@pytest.mark.parametrize("w", [[3, 4], [4, 2], [0, 4]])
def test_tensor_scatter_circular_wraps_around(w):
    """Positions w[b] + j past the end of the cache come back to its start: with a cache of 5
    and 3 new tokens, row b writes (w[b], w[b] + 1, w[b] + 2) mod 5."""
    m = model("TensorScatter", ["x", "u", "w"], {"x": [2, 5, 2], "u": [2, 3, 2]},
              {"w": np.array(w, I64)}, opset=24, mode="circular", axis=1)
    x, u, gy = rnd(2, 5, 2), rnd(2, 3, 2, seed=1), rnd(2, 5, 2, seed=2)
    (gx, gu), _ = grads_of(m, "y", ["x", "u"], {"x": x, "u": u, "gy": gy}, grad_ys=["gy"])
    want_x, want_u = gy.copy(), np.zeros_like(u)
    for b in range(2):
        for j in range(3):
            k = (w[b] + j) % 5
            want_x[b, k] = 0
            want_u[b, j] = gy[b, k]
    np.testing.assert_array_equal(gx, want_x)
    np.testing.assert_array_equal(gu, want_u)
    assert_gradients(m, "y", ["x", "u"])


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_symbolic_and_runtime_indices(mode):
    """Batch, heads, cache and update lengths symbolic; write_indices fed at run time."""
    node = helper.make_node("TensorScatter", ["x", "u", "w"], ["y"], mode=mode)
    m = make_model([node], {"x": (F32, ["B", "H", "L", 2]), "u": (F32, ["B", "H", "S", 2]),
                            "w": (I64, ["B"])}, ["y"], opset=24)
    w = np.array([1, 3, 0], I64) if mode == "linear" else np.array([4, 2, 3], I64)
    assert_gradients(m, "y", ["x", "u"], {"x": rnd(3, 2, 5, 2), "u": rnd(3, 2, 2, 2, seed=1),
                                          "w": w}, max_elements=100)


def test_tensor_scatter_second_order_and_float16():
    nodes = [helper.make_node("TensorScatter", ["x", "u", "w"], ["t"], mode="circular"),
             helper.make_node("Mul", ["t", "t"], ["y"])]
    m = make_model(nodes, {"x": (F32, [2, 4, 2]), "u": (F32, [2, 2, 2])}, ["y"],
                   inits={"w": np.array([3, 1], I64)}, opset=24)
    res = onnxgrad.gradients(m, "y", ["x", "u"], grad_ys=["gy"])
    report = check_gradients(res.model, res.grads, ["x", "u", "gy"],
                             {"x": rnd(2, 4, 2), "u": rnd(2, 2, 2, seed=1)})
    assert report.ok, str(report)
    h = op_model("TensorScatter", {"x": (np.float16, [2, 4, 2]), "u": (np.float16, [2, 2, 2])},
                 inits={"w": np.array([3, 1], I64)}, opset=24, mode="circular")
    check(h, xs=["x", "u"])


# -- gradients between Transposes, at every onnxruntime optimization level (issue 12, item 15) --
# onnxruntime's transpose optimizer (1.31, from ORT_ENABLE_BASIC up) pushes a Transpose through
# Pad and permutes run-time pads as if they covered every axis, ignoring Pad's ``axes`` input
# (a Gather out of bounds, or silently wrong pads). The gradient of Transpose -> op ->
# Transpose puts the gradient's Transposes on either side of the op's adjoint, which is where
# the optimizer looks; exported models (MobileViT's unfold/fold) are full of that pattern.
def _between_transposes(op, ins, inits, rank=4, perm=(0, 2, 3, 1), **attrs):
    inv = [int(i) for i in np.argsort(perm)]
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=list(perm)),
             helper.make_node(op, ["a", *ins], ["b"], **attrs),
             helper.make_node("Transpose", ["b"], ["t"], perm=inv),
             helper.make_node("Mul", ["t", "t"], ["y"])]
    return make_model(nodes, {"x": (F32, ["N", 3, 4, 5][:rank])}, ["y"], inits=inits)


def _at_every_level(m, xs=("x",), **feeds):
    """The gradient graph gives the same values at every optimization level (and passes the
    float64 check, whose float32 rerun runs at ORT_ENABLE_ALL)."""
    import onnxruntime as ort
    from onnxgrad.runtime import session, session_options
    assert_gradients(m, ["y"], list(xs), feeds=feeds)
    res = onnxgrad.gradients(m, "y", list(xs))
    got = []
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                  ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        so = session_options()
        so.graph_optimization_level = level
        got.append(session(res.model, options=so).run(res.grads, feeds))
    for other in got[1:]:
        for a, b in zip(got[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1], [3], [1], None), ([-3, 0], [END, 2], [2, 1], None), ([1], [4], [3], [2]),
    ([3], [0], [1], [-1])])
def test_slice_between_transposes(starts, ends, axes, steps):
    inits = {"st": np.array(starts), "en": np.array(ends), "ax": np.array(axes)}
    ins = ["st", "en", "ax"]
    if steps is not None:
        inits["sp"] = np.array(steps)
        ins.append("sp")
    _at_every_level(_between_transposes("Slice", ins, inits), x=rnd(2, 3, 4, 5))


@pytest.mark.parametrize("mode,pads", [
    ("constant", [0, 1, -1, 0, 0, 0, 1, 1]), ("constant", [0, -1, 0, 1, 0, 0, -2, 0]),
    ("reflect", [0, 1, 0, 2, 0, 0, 1, 1]), ("edge", [0, 0, 2, 1, 0, 1, 0, 1])])
def test_pad_between_transposes(mode, pads):
    """(A forward Pad with an ``axes`` input between Transposes is itself run wrongly by
    onnxruntime's optimizer; the forward here pads every axis, its gradient crops and pads.)"""
    m = _between_transposes("Pad", ["p"], {"p": np.array(pads)}, mode=mode)
    _at_every_level(m, x=rnd(2, 3, 4, 5))


@pytest.mark.parametrize("op,ins,inits,attrs", [
    ("Slice", ["st", "en", "ax"], {"st": np.array([1]), "en": np.array([3]),
                                   "ax": np.array([1])}, {}),
    ("Pad", ["p", "", "ax"], {"p": np.array([1, -1]), "ax": np.array([2])}, {}),
    ("Pad", ["p", "", "ax"], {"p": np.array([0, -1, 1, 0]), "ax": np.array([-1, 1])}, {}),
])
def test_gradient_pads_cover_every_axis(op, ins, inits, attrs):
    """No Pad that a gradient adds takes Pad's ``axes`` input (see above)."""
    m = model(op, ["x", *ins], {"x": ["N", 3, 4, 5]}, inits, **attrs)
    check(m, x=rnd(2, 3, 4, 5))
    res = onnxgrad.gradients(m, "y", "x")
    pads = [nd for nd in res.model.graph.node
            if nd.op_type == "Pad" and nd.name.startswith("gradients/")]
    assert pads and all(len(nd.input) < 4 or not nd.input[3] for nd in pads)


@pytest.mark.parametrize("target,axes", [([2, 7], [1, 2]), ([4], [-1]), ([1, 6, 3], None)])
def test_center_crop_pad_gradient_pads_every_axis(target, axes):
    """CenterCropPad's function body pads through Pad's axes input, so onnxruntime's optimizer
    breaks the op itself between Transposes; its gradient is a Slice and a full-rank Pad."""
    m = model("CenterCropPad", ["x", "s"], {"x": ["N", 4, 5]}, {"s": np.array(target)},
              axes=axes)
    check(m, x=rnd(2, 4, 5))
    res = onnxgrad.gradients(m, "y", "x")
    assert not [nd for nd in res.model.graph.node
                if nd.name.startswith("gradients/") and nd.op_type == "CenterCropPad"]
    # g comes out of a Transpose (the gradient of the one after the op)
    nodes = [helper.make_node("CenterCropPad", ["x", "s"], ["c"], axes=axes),
             helper.make_node("Transpose", ["c"], ["t"], perm=[2, 0, 1]),
             helper.make_node("Mul", ["t", "t"], ["y"])]
    m = make_model(nodes, {"x": (F32, ["N", 4, 5])}, ["y"], inits={"s": np.array(target)})
    _at_every_level(m, x=rnd(2, 4, 5))


def test_dynamo_exported_unfold_fold_block_at_every_level():
    """A MobileViT-style block exported by torch's dynamo exporter (opset 18): unfold into
    patches (reshape / permute), a slice of the patches between transposes, attention, fold
    back. Its gradient graph crashed onnxruntime from ORT_ENABLE_BASIC up (the Slice gradient's
    Pad with axes, permuted by the transpose optimizer); it must match torch autograd at every
    optimization level."""
    import warnings

    import onnxruntime as ort
    torch = pytest.importorskip("torch")
    F_ = torch.nn.functional

    class Block(torch.nn.Module):
        def __init__(self, c=8, p=2):
            super().__init__()
            self.p = p
            self.conv = torch.nn.Conv2d(c, c, 3, padding=1)
            self.qkv = torch.nn.Linear(c // 2, 3 * (c // 2))
            self.out = torch.nn.Conv2d(c, c, 1)

        def forward(self, x):
            n, c, h, w = x.shape
            p, y = self.p, self.conv(x)
            a, b = y[:, : c // 2], y[:, c // 2:]
            t = a.reshape(n, c // 2, h // p, p, w // p, p).permute(0, 3, 5, 2, 4, 1).reshape(
                n * p * p, (h // p) * (w // p), c // 2)
            t = torch.cat([t[:, :1], t.transpose(1, 2)[:, :, 1:].transpose(1, 2) * 2.0], 1)
            q, k, v = self.qkv(t).chunk(3, dim=-1)
            att = F_.softmax(q @ k.transpose(-1, -2) / 2.0, -1) @ v
            a2 = att.reshape(n, p, p, h // p, w // p, c // 2).permute(0, 5, 3, 1, 4, 2).reshape(
                n, c // 2, h, w)
            z = torch.cat([a2, b[:, :, 1:, :].sum(2, keepdim=True).expand(-1, -1, h, -1)], 1)
            return self.out(z)[:, :, :, 1:]

    torch.manual_seed(0)
    net = Block().eval()
    x0 = torch.randn(2, 8, 4, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = torch.onnx.export(net, (x0,), dynamo=True, opset_version=18, verbose=False).model_proto
    name, out = m.graph.input[0].name, m.graph.output[0].name
    tp = dict(net.named_parameters())
    params = [t.name for t in m.graph.initializer if t.name in tp]
    res = onnxgrad.gradients(m, out, [name, *params], grad_ys=["gy"])
    gy = np.random.default_rng(0).standard_normal(tuple(net(x0).shape)).astype(F32)
    tx = x0.clone().requires_grad_(True)
    want = torch.autograd.grad(net(tx), [tx] + [tp[p] for p in params], torch.tensor(gy))
    from onnxgrad.runtime import session, session_options
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                  ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        so = session_options()
        so.graph_optimization_level = level
        got = session(res.model, options=so).run(res.grads, {name: x0.numpy(), "gy": gy})
        for k, a, b in zip([name, *params], got, want):
            np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-5 * np.abs(b.numpy()).max(),
                                       err_msg=f"{level} {k}")


# -- slices of one tensor along one axis: their gradients joined (generated) -------------------
from hypothesis import HealthCheck  # noqa: E402


@st.composite
def _slicings(draw):
    """x [D, 3] or [3, D], D static or symbolic; 2 to 4 consumers along the D axis, each a
    scalar Gather or a unit-step Slice (bounds from -D-1 to D+1: empty, clamped, negative),
    maybe a dense one."""
    D, axis = draw(st.integers(2, 6)), draw(st.integers(0, 1))
    kinds = draw(st.lists(st.sampled_from(["gather", "slice"]), min_size=2, max_size=4))
    cuts = []
    for kind in kinds:
        if kind == "gather":
            cuts.append(("gather", draw(st.integers(-D, D - 1))))
        else:
            cuts.append(("slice", draw(st.integers(-D - 1, D + 1)),
                         draw(st.integers(-D - 1, D + 1))))
    return D, axis, cuts, draw(st.booleans()), draw(st.booleans())


def _interval(cut, D):
    """[start, stop) of a cut along its axis (ONNX's clamping), empty as (start, start)."""
    if cut[0] == "gather":
        return cut[1] % D, cut[1] % D + 1
    clamp = lambda i: min(max(i + D if i < 0 else i, 0), D)  # noqa: E731
    start = clamp(cut[1])
    return start, max(clamp(cut[2]), start)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_slicings())
def test_slice_gradients_that_meet_are_joined_generated(case):
    """The gradient of x through slices and scalar Gathers along one axis (adjacent, apart,
    overlapping, empty, beside a dense use of x; the axis static or symbolic) is the sum of
    each slice's gradient put back in place (numpy, float64, and finite differences); where
    the placed slices (static bounds: Slices of a static axis, Gathers of index >= 0) do not
    overlap, each run of adjacent ones is one Concat, padded once unless it covers a static
    axis."""
    D, axis, cuts, dense, symbolic = case
    dims = ["D" if symbolic else D, 3]
    shape = [D, 3] if axis == 0 else [3, D]
    nodes, inits, terms = [], {"ax": np.array([axis], np.int64)}, []
    for k, cut in enumerate(cuts):
        if cut[0] == "gather":
            inits[f"i{k}"] = np.array(cut[1], np.int64)
            nodes.append(helper.make_node("Gather", ["x", f"i{k}"], [f"c{k}"], axis=axis))
        else:
            inits[f"s{k}"], inits[f"e{k}"] = np.array([cut[1]]), np.array([cut[2]])
            nodes.append(helper.make_node("Slice", ["x", f"s{k}", f"e{k}", "ax"], [f"c{k}"]))
        terms.append(f"c{k}")
    if dense:
        terms.append("x")
    for t in terms:  # sum(t * t) each: gradient 2 t, put back where t came from
        nodes += [helper.make_node("Mul", [t, t], [f"{t}2"]),
                  helper.make_node("ReduceSum", [f"{t}2"], [f"{t}s"], keepdims=0)]
    nodes.append(helper.make_node("Sum", [f"{t}s" for t in terms], ["y"]))
    m = make_model(nodes, {"x": (np.float64, dims if axis == 0 else dims[::-1])}, ["y"],
                   inits={k: v.astype(np.int64) for k, v in inits.items()})
    x = np.random.default_rng(D * 7 + len(cuts)).uniform(0.5, 2.0, shape)
    ref = 2 * x if dense else np.zeros(shape)
    spans = [_interval(c, D) for c in cuts]
    for start, stop in spans:
        idx = [slice(None)] * 2
        idx[axis] = slice(start, stop)
        ref[tuple(idx)] += 2 * x[tuple(idx)]
    res = onnxgrad.gradients(m, ["y"], ["x"])
    onnx.checker.check_model(res.model, full_check=True)
    got = onnxgrad.runtime.run(res.model, {"x": x}, [res.grads[0]])[0]
    np.testing.assert_allclose(got, ref, rtol=1e-14, atol=0)
    assert_gradients(m, "y", "x", {"x": x})
    # the Pads left: one per slice not placed, and per placed one unless they are joined
    placeable = [s[1] > s[0] and (not symbolic or (c[0] == "gather" and c[1] >= 0))
                 for c, s in zip(cuts, spans)]
    placed = sorted(s for s, ok in zip(spans, placeable) if ok)
    pads = placeable.count(False)
    if len(placed) < 2 or any(a[1] > b[0] for a, b in zip(placed, placed[1:])):
        pads += len(placed)
    else:
        runs = [[placed[0]]]
        for s in placed[1:]:
            if s[0] == runs[-1][-1][1]:
                runs[-1].append(s)
            else:
                runs.append([s])
        pads += sum(1 for r in runs if len(r) == 1 or symbolic or r[0][0] > 0 or r[-1][1] < D)
    assert sum(n.op_type == "Pad" for n in res.model.graph.node) == pads


@pytest.mark.parametrize("ks, pads", [((0, 1, 2), 1), ((0, 2), 2), ((1, -1), 2),
                                      ((2, 0, 1, 0), 4)])
def test_gather_pieces_of_unknown_rank(ks, pads):
    """Scalar Gathers of a tensor whose rank only the run time knows (a Reshape to a fed
    shape, as the TorchScript exporter writes MultiheadAttention's q, k, v): each index's
    gradient goes back in place (numpy); adjacent ones as one Concat padded once (the size of
    the axis is unknown), others (apart, overlapping, or counted from the end) one Pad each."""
    nodes = [helper.make_node("Reshape", ["x0", "shape"], ["x"])]
    for j, k in enumerate(ks):
        nodes += [helper.make_node("Gather", ["x", f"k{j}"], [f"c{j}"], axis=0),
                  helper.make_node("Mul", [f"c{j}", f"c{j}"], [f"q{j}"]),
                  helper.make_node("ReduceSum", [f"q{j}"], [f"s{j}"], keepdims=0)]
    nodes.append(helper.make_node("Sum", [f"s{j}" for j in range(len(ks))], ["y"]))
    D = onnx.TensorProto.DOUBLE
    m = vi_model(nodes, [helper.make_tensor_value_info("x0", D, [12]),
                         helper.make_tensor_value_info("shape", onnx.TensorProto.INT64, ["S"])],
                 [helper.make_tensor_value_info("y", D, [])],
                 inits={f"k{j}": np.array(k, np.int64) for j, k in enumerate(ks)})
    assert not any(vi.name == "x" and vi.type.tensor_type.HasField("shape")
                   for vi in m.graph.value_info)  # x's rank is unknown
    x0 = np.random.default_rng(len(ks)).uniform(0.5, 2.0, 12)
    res = onnxgrad.gradients(m, ["y"], ["x0"])
    onnx.checker.check_model(res.model, full_check=True)
    got = onnxgrad.runtime.run(res.model, {"x0": x0, "shape": np.array([3, 2, 2])},
                               [res.grads[0]])[0]
    ref = np.zeros((3, 4))
    for k in ks:
        ref[k] += 2 * x0.reshape(3, 4)[k]
    np.testing.assert_allclose(got, ref.ravel(), rtol=1e-14, atol=0)
    assert sum(n.op_type == "Pad" for n in res.model.graph.node) == pads


# -- a Transpose's gradient of a Transpose's gradient (generated) ------------------------------
@settings(max_examples=40, deadline=None, derandomize=True)
@given(first=st.permutations(range(4)), data=st.data())
def test_transposes_in_a_row(first, data):
    """x -> Transpose(p) -> Transpose(q) -> * c: where q undoes p the second gradient
    Transpose is left out (its input is the gradient already); any other q keeps both. The
    gradient against finite differences either way."""
    undo = data.draw(st.booleans())
    second = [int(i) for i in np.argsort(first)] if undo else \
        data.draw(st.permutations(range(4)))
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=list(first)),
             helper.make_node("Transpose", ["a"], ["b"], perm=list(second)),
             helper.make_node("Mul", ["b", "c"], ["y"])]
    xs = (2, 3, 4, 5)
    bs = tuple(int(d) for d in np.array(xs)[list(first)][list(second)])
    m = make_model(nodes, {"x": (F32, list(xs)), "c": (F32, list(bs))}, ["y"])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(xs), "c": rng.standard_normal(bs)}
    assert_gradients(m, "y", ["x"], feeds=feeds)
    res = onnxgrad.gradients(m, "y", ["x"])
    transposes = sum(nd.op_type == "Transpose" for nd in res.model.graph.node)
    assert transposes == 2 + (0 if list(np.array(first)[list(second)]) == [0, 1, 2, 3] else 2)
