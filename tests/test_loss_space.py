"""The loss helpers over their whole option space, against torch.nn.functional, in float64.

tests/test_training.py checks eight chosen losses; here hypothesis draws the loss, the output's
rank (2 to 4, a symbolic batch), the reduction, cross_entropy's class axis (1, or the last one
as a Keras model has it), class weights (zeros too) and ignore_index (labels ignored or not, a
label that is never drawn), bce's pos_weight (a scalar or one per last-axis element) and logits
up to +-60, where a naive log(sigmoid) overflows, and exactly 0 (a quarter of them). The loss
and its gradient with respect to the logits must be torch's to 1e-10.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import helper

from onnxgrad.runtime import session
from onnxgrad.training import attach_loss
from util import grads_of, make_model

torch = pytest.importorskip("torch")
F = torch.nn.functional


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["mse", "l1", "bce", "cross_entropy"]))
    rank = draw(st.integers(2, 4))
    shape = [draw(st.integers(1, 5))] + [draw(st.integers(1, 4)) for _ in range(rank - 1)]
    opts = {"reduction": draw(st.sampled_from(["mean", "sum"]))}
    scale = draw(st.sampled_from([0.0, 1.0, 5.0, 60.0]))  # (0: a zero-initialised layer's)
    seed = draw(st.integers(0, 2**16))
    if kind == "cross_entropy":
        opts["class_axis"] = draw(st.sampled_from([1, -1]))
        classes = shape[opts["class_axis"]]
        if draw(st.booleans()):
            opts["weight"] = draw(st.lists(st.sampled_from([0.0, 0.3, 1.0, 4.0]),
                                           min_size=classes, max_size=classes))
        ignore = draw(st.sampled_from([None, 0, classes - 1, -100, classes + 3]))
        if ignore is not None:
            opts["ignore_index"] = ignore
    if kind == "bce":
        pw = draw(st.sampled_from([None, "scalar", "vector"]))
        if pw == "scalar":
            opts["pos_weight"] = draw(st.sampled_from([0.5, 3.0]))
        elif pw == "vector":
            opts["pos_weight"] = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]),
                                               min_size=shape[-1], max_size=shape[-1]))
    return kind, shape, opts, scale, seed


def _torch(kind, opts, x, t):
    red = opts["reduction"]
    if kind == "mse":
        return F.mse_loss(x, t, reduction=red)
    if kind == "l1":
        return F.l1_loss(x, t, reduction=red)
    if kind == "bce":
        pw = opts.get("pos_weight")
        return F.binary_cross_entropy_with_logits(
            x, t, reduction=red, pos_weight=None if pw is None else torch.tensor(pw, dtype=x.dtype))
    if opts["class_axis"] == -1:
        x = torch.movedim(x, -1, 1)
    w = opts.get("weight")
    return F.cross_entropy(x, t, reduction=red, ignore_index=opts.get("ignore_index", -100),
                           weight=None if w is None else torch.tensor(w, dtype=x.dtype))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(cases())
def test_losses_are_torch(case):
    kind, shape, opts, scale, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * scale
    x[rng.random(shape) < 0.25] = 0.0  # bce is smooth at 0, where Relu's and Abs's slopes are 0
    if kind == "cross_entropy":
        axis = opts["class_axis"] % len(shape)
        classes = shape[axis]
        t = rng.integers(0, classes, [d for i, d in enumerate(shape) if i != axis])
        if "ignore_index" in opts and opts["ignore_index"] < classes:
            t[rng.random(t.shape) < 0.3] = opts["ignore_index"]
        elif opts.get("ignore_index") == -100:
            t[rng.random(t.shape) < 0.3] = -100
        kept = t != opts.get("ignore_index", -100)
        w = np.asarray(opts.get("weight", np.ones(classes)))
        # a mean over no weight at all is 0 / 0 (torch: NaN): not a case a batch should reach
        assume(opts["reduction"] == "sum" or w[np.where(kept, t, 0)][kept].sum() > 0)
    elif kind == "bce":
        t = rng.random(shape)
    else:
        t = rng.standard_normal(shape) * scale
    m = make_model([helper.make_node("Identity", ["x"], ["y"])],
                   {"x": (np.float64, ["N", *shape[1:]])}, ["y"])
    lm = attach_loss(m, kind, **opts)
    feeds = {"x": x, "target": t}
    (gx,), _ = grads_of(lm, "loss", "x", feeds)
    loss, = session(lm).run(["loss"], feeds)
    xt = torch.tensor(x, requires_grad=True)
    want = _torch(kind, opts, xt, torch.tensor(t))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(2, 5), st.integers(-2, 2), st.sampled_from(["static", "symbolic"]),
       st.sampled_from(["weight", "pos_weight", "flat"]))
def test_loss_constants_that_do_not_fit_the_classes_are_refused(classes, off, dim, which):
    """torch refuses a cross_entropy weight that is not one per class, and a pos_weight that
    does not broadcast: attach_loss took a longer weight and trained with its first C entries
    (a [2, 2] weight was flattened), a shorter one failed in the Trainer with numpy's
    IndexError, and a pos_weight of another length at the first step inside onnxruntime. Now
    a static class dim refuses them by name; a symbolic one fails at run time by a node named
    for the check, and the Trainer refuses before its first step."""
    from onnxgrad.errors import InvalidArgumentError
    from onnxgrad.training import SGD, Trainer
    n = classes + off
    assume(n > 0)
    m = make_model([helper.make_node("Mul", ["x", "s"], ["y"])],
                   {"x": (np.float64, ["N", classes if dim == "static" else "C"])}, ["y"],
                   {"s": np.array(1.0)})
    kind = "bce" if which == "pos_weight" else "cross_entropy"
    value = np.ones((n, 1)) if which == "flat" else np.ones(n)
    opts = {"pos_weight" if which == "pos_weight" else "weight": value}
    x = np.random.default_rng(classes).standard_normal((4, classes))
    t = np.random.default_rng(n).random((4, classes)) if kind == "bce" else \
        np.arange(4) % classes
    fits = which != "flat" and (off == 0 or (which == "pos_weight" and n == 1))  # (broadcasts)
    if which == "flat" or (dim == "static" and not fits):
        with pytest.raises(InvalidArgumentError, match="weight"):
            attach_loss(m, kind, **opts)
        return
    lm = attach_loss(m, kind, **opts)
    if fits:
        session(lm).run(["loss"], {"x": x, "target": t})
    else:
        with pytest.raises(Exception, match=f"{which}_must_have"):
            session(lm).run(["loss"], {"x": x, "target": t})
        if kind == "cross_entropy":
            tr = Trainer(m, kind, optimizer=SGD(lr=0.1), device="cpu", progress=False,
                         loss_options=opts)
            with pytest.raises(InvalidArgumentError, match=f"{n} entries.*{classes} classes"):
                tr.step({"x": x, "target": t})


@pytest.mark.parametrize("opset", [7, 8, 9, 10, 13])
def test_bce_pos_weight_per_class_at_old_opsets(opset):
    """A pos_weight vector's length check slices Shape(y) with Slice's inputs (opset 10): on an
    opset 7 to 9 model it wrote Slice-10's form (onnx's ValidationError from the Trainer)."""
    rng = np.random.default_rng(opset)
    x, t = rng.standard_normal((4, 3)), rng.random((4, 3))
    pw = [2.0, 0.5, 3.0]
    m = make_model([helper.make_node("Identity", ["x"], ["y"])], {"x": (np.float64, ["N", 3])},
                   ["y"], opset=opset, ir_version=3 if opset < 8 else 4)
    lm = attach_loss(m, "bce", pos_weight=pw)
    feeds = {"x": x, "target": t}
    (gx,), _ = grads_of(lm, "loss", "x", feeds)
    xt = torch.tensor(x, requires_grad=True)
    F.binary_cross_entropy_with_logits(xt, torch.tensor(t), pos_weight=torch.tensor(pw)).backward()
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
