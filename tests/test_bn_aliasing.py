"""onnxruntime writes a training-mode BatchNormalization's updated statistics over its
input_mean / input_var buffers (onnxgrad/aliasing.py). The gradient graphs onnxgrad writes give
each such input a private copy: the caller's feeds are never written, a model function's body
recomputed for its gradient reads the statistics the call read, and the forward and gradient
values equal a numpy oracle (float64, central differences of it) at every optimization level.
The hypothesis test draws where the BatchNormalization sits (main graph, model function), where
its statistics come from (inputs, initializers, computed), what reads them besides it, and which
of its outputs the loss uses; it fails without the guard."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.runtime import ort_module

D = TensorProto.DOUBLE
C, SHAPE = 3, (4, 3, 2, 2)
EPS = 2.0 ** -10  # attributes are float32: exact values
LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_ALL")


def bn_reference(x, s, b, m, v, momentum, eps):
    """ONNX BatchNormalization in training mode (biased batch variance, as onnxruntime)."""
    axes = (0, 2, 3)
    mu, var = x.mean(axis=axes), x.var(axis=axes)
    ch = (1, -1, 1, 1)
    y = (x - mu.reshape(ch)) / np.sqrt(var.reshape(ch) + eps) * s.reshape(ch) + b.reshape(ch)
    return y, m * momentum + mu * (1 - momentum), v * momentum + var * (1 - momentum)


def build(where: str, source: str, twice: bool, uses: tuple, opset: int):
    """A model computing loss = Σ wy·y + Σ rm² + Σ (rv · rv) (the terms in ``uses``) of one
    training BatchNormalization, or of two with different momenta reading the same statistics
    (``twice``); the statistics are graph inputs, initializers, or Abs of inputs."""
    momenta = (0.75, 0.5) if twice else (0.75,)  # exact in the float32 attribute
    inputs = ["x", "s", "b"]
    inits, pre = {}, []
    stats = ["m", "v"]
    if source == "input":
        inputs += stats
    elif source == "initializer":
        inits = {"m": np.linspace(-0.5, 0.5, C), "v": np.linspace(0.5, 1.5, C)}
    else:  # computed: an intermediate read by the BatchNormalizations and by a Neg
        inputs += ["m_in", "v_in"]
        pre = [helper.make_node("Abs", [f"{k}_in"], [k]) for k in stats]
    body, terms = [], []
    for k, mom in enumerate(momenta):
        y, rm, rv = f"y{k}", f"rm{k}", f"rv{k}"
        body.append(helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], [y, rm, rv],
                                     training_mode=1, momentum=mom, epsilon=EPS))
        if "y" in uses:
            body += [helper.make_node("Mul", [y, "wy"], [f"{y}w"])]
            terms.append(f"{y}w")
        if "rm" in uses:
            body.append(helper.make_node("Mul", [rm, rm], [f"{rm}2"]))
            terms.append(f"{rm}2")
        if "rv" in uses:
            body.append(helper.make_node("Mul", [rv, rv], [f"{rv}2"]))
            terms.append(f"{rv}2")
    if source == "computed":  # another reader of the statistics
        body.append(helper.make_node("Neg", ["v"], ["nv"]))
        terms.append("nv")
    sums = [f"sum_{t}" for t in terms]
    body += [helper.make_node("ReduceSum", [t], [s_], keepdims=0) for t, s_ in zip(terms, sums)]
    body.append(helper.make_node("Sum", sums, ["loss"]))
    inits["wy"] = np.cos(np.arange(np.prod(SHAPE))).reshape(SHAPE)
    opsets = [helper.make_opsetid("", opset)]
    if where == "function":
        formal = ["x", "s", "b", "m", "v", "wy"]
        fn = helper.make_function("blocks", "Block", formal, ["loss"], body, opsets)
        body, functions = [helper.make_node("Block", formal, ["loss"], domain="blocks")], [fn]
        opsets = opsets + [helper.make_opsetid("blocks", 1)]
    else:
        functions = []
    shapes = {"x": SHAPE}
    g = helper.make_graph(pre + body, "bn",
                          [helper.make_tensor_value_info(n, D, shapes.get(n, [C])) for n in inputs],
                          [helper.make_tensor_value_info("loss", D, [])],
                          [numpy_helper.from_array(np.asarray(v, np.float64), n)
                           for n, v in inits.items()])
    m = helper.make_model(g, opset_imports=opsets, functions=functions, ir_version=10)
    onnx.checker.check_model(m, full_check=True)
    return m, momenta


def oracle_loss(feeds, stats, source, momenta, uses):
    """The model's loss in numpy from ``feeds`` and the statistics' values ``stats``."""
    m, v = stats
    if source == "computed":
        m, v = np.abs(m), np.abs(v)
    wy = np.cos(np.arange(np.prod(SHAPE))).reshape(SHAPE)
    total = -v.sum() if source == "computed" else 0.0
    for mom in momenta:
        y, rm, rv = bn_reference(feeds["x"], feeds["s"], feeds["b"], m, v, mom, EPS)
        total += ("y" in uses) * (y * wy).sum() + ("rm" in uses) * (rm * rm).sum() + \
            ("rv" in uses) * (rv * rv).sum()
    return total


def central_differences(f, point):
    out = np.zeros_like(point)
    for i in np.ndindex(point.shape):
        hi, lo = point.copy(), point.copy()
        hi[i] += 1e-6
        lo[i] -= 1e-6
        out[i] = (f(hi) - f(lo)) / 2e-6
    return out


def run_level(model, feeds, names, level):
    ort = ort_module()
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.log_severity_level = 3
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(names, feeds)


def check(where, source, twice, uses, opset, level, seed=0):
    model, momenta = build(where, source, twice, uses, opset)
    before = model.SerializeToString()
    rs = np.random.RandomState(seed)
    feeds = {"x": rs.randn(*SHAPE), "s": rs.rand(C) + 0.5, "b": rs.randn(C)}
    stat_names = {"input": ("m", "v"), "computed": ("m_in", "v_in"), "initializer": ()}[source]
    stats = [rs.randn(C), rs.rand(C) + 0.5] if stat_names else \
        [numpy_helper.to_array(t) for t in model.graph.initializer if t.name in "mv"]
    feeds.update(zip(stat_names, stats))
    xs = ["x", "s", "b", *stat_names]
    res = onnxgrad.gradients(model, ["loss"], xs)
    assert model.SerializeToString() == before
    onnx.checker.check_model(res.model, full_check=True)
    kept = {k: v.copy() for k, v in feeds.items()}
    names = ["loss"] + [g for g in res.grads if g]
    # every run of a session is the oracle's (three runs). Before session 30 an initializer's
    # statistics drifted at ORT_ENABLE_BASIC and above (onnxruntime folded the copy into an
    # initializer of its own and updated it on every run); the gradient graph holds no
    # training-mode node since (the rule writes it out)
    runs = 3
    got = [run_level(res.model, feeds, names, level) for _ in range(runs)][-1]
    for k, v in feeds.items():  # the caller's arrays are never written
        np.testing.assert_array_equal(v, kept[k], err_msg=f"feed {k} was written")

    def loss_of(name):
        def f(point):
            fe = {**feeds, name: point}
            st = [fe[k] for k in stat_names] if stat_names else stats
            return oracle_loss(fe, st, source, momenta, uses)
        return f

    want = oracle_loss(feeds, stats, source, momenta, uses)
    np.testing.assert_allclose(got[0], want, rtol=1e-10, err_msg="forward")
    grads = iter(got[1:])
    for x, name in zip(xs, res.grads):
        fd = central_differences(loss_of(x), feeds[x])
        g = np.zeros_like(fd) if name is None else next(grads)  # None: unconnected
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-6, err_msg=f"d loss / d {x}")


@pytest.mark.parametrize("level", LEVELS)
def test_model_function_recompute_reads_the_calls_statistics(level):
    """The fuzzer's case (seed 4502): the running variance feeds the loss inside a model
    function; the gradient's recomputed body read the statistics the call had already updated
    (at ORT_DISABLE_ALL) and the feeds changed."""
    check("function", "input", False, ("rv",), 15, level)


@pytest.mark.parametrize("source", ["input", "initializer", "computed"])
def test_two_batchnorms_share_statistics(source):
    """Two training BatchNormalizations reading the same statistics: each reads them as given
    (onnxruntime alone makes the first's running outputs the second's)."""
    check("main", source, True, ("y", "rm", "rv"), 15, "ORT_DISABLE_ALL")


@settings(derandomize=True, max_examples=40, deadline=None)
@given(where=st.sampled_from(["main", "function"]),
       source=st.sampled_from(["input", "initializer", "computed"]),
       twice=st.booleans(),
       uses=st.sets(st.sampled_from(["y", "rm", "rv"]), min_size=1).map(tuple),
       opset=st.sampled_from([14, 15, 18]), level=st.sampled_from(LEVELS),
       seed=st.integers(0, 3))
def test_drawn_batchnorm_graphs(where, source, twice, uses, opset, level, seed):
    check(where, source, twice, uses, opset, level, seed)
