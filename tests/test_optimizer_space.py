"""The optimizers over their whole hyper-parameter space, against torch.optim, in float64.

tests/test_training.py checks eight chosen configurations; here hypothesis draws SGD (momentum,
dampening, Nesterov, weight decay), Adam and AdamW (betas anywhere in [0, 1), eps, weight decay,
AMSGrad), gradient clipping, an lr schedule, and the fused C kernel or the optimizer graph. Four
Trainer steps of a float64 MLP must give torch's losses and parameters to 1e-9: in float64 the
two compute the same formulas, so any difference is a wrong formula, not rounding.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import helper

from onnxgrad.training import SGD, Adam, AdamW, Trainer
from onnxgrad.training import fused
from util import make_model, torch_train

torch = pytest.importorskip("torch")


def mlp64(seed):
    rng = np.random.default_rng(seed)
    w = {"W1": rng.standard_normal((7, 5)) * 0.5, "b1": rng.standard_normal(7) * 0.1,
         "W2": rng.standard_normal((4, 7)) * 0.5, "b2": rng.standard_normal(4) * 0.1}
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1),
             helper.make_node("Tanh", ["h"], ["a"]),
             helper.make_node("Gemm", ["a", "W2", "b2"], ["logits"], transB=1)]
    m = make_model(nodes, {"x": (np.float64, ["N", 5])}, ["logits"], inits=w)
    return m, w


def forward(x, p):
    return torch.tanh(x @ p["W1"].T + p["b1"]) @ p["W2"].T + p["b2"]


# [0, 1), with the edges drawn on purpose: onnxruntime's NoopElimination took float64 factors
# within 6e-8 of 1 for 1 (Adam's 1 - beta1 with beta1 = 1e-8)
unit = st.one_of(st.floats(0.0, 0.999), st.sampled_from([1e-8, 1e-12, 1 - 1e-8]))
sgd = st.builds(
    lambda lr, mom, damp, nest, wd: ("SGD", dict(
        lr=lr, momentum=mom, dampening=0.0 if nest and mom else damp,
        nesterov=bool(nest and mom), weight_decay=wd)),
    st.floats(1e-3, 0.5), st.one_of(st.just(0.0), unit), st.one_of(st.just(0.0), unit),
    st.booleans(), st.one_of(st.just(0.0), st.floats(0.0, 0.2), st.just(1 - 1e-8)))
adam = st.builds(
    lambda kind, lr, b1, b2, eps, wd, ams: (kind, dict(
        lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=ams)),
    st.sampled_from(["Adam", "AdamW"]), st.floats(1e-4, 0.1), unit,
    st.one_of(unit, st.floats(0.99, 0.99999)), st.sampled_from([1e-8, 1e-4, 0.1, 1.0, 1 + 1e-8]),
    st.one_of(st.just(0.0), st.floats(0.0, 0.3)), st.booleans())
OURS = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}
THEIRS = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(opt=st.one_of(sgd, adam), clip=st.one_of(st.none(), st.floats(0.05, 3.0)),
       decay=st.one_of(st.none(), st.floats(0.05, 1.0)), fused_kernel=st.booleans(),
       micro=st.sampled_from([1, 2, 3]), frozen=st.sets(st.sampled_from(["W1", "b1", "b2"])),
       seed=st.integers(0, 2**16))
@example(opt=("Adam", dict(lr=0.0625, betas=(1e-8, 0.0), eps=1e-8, weight_decay=0.0,
                           amsgrad=False)), clip=None, decay=None, fused_kernel=False, micro=1,
         frozen=set(), seed=0)
def test_optimizer_steps_are_torch_optim(opt, clip, decay, fused_kernel, micro, frozen, seed):
    """Also with the batch in ``micro`` accumulated micro-batches and ``frozen`` parameters
    (which torch's optimizer and its clipping never see)."""
    kind, kw = opt
    if fused_kernel and fused.unavailable():
        fused_kernel = False  # (no C compiler here: the optimizer graph alone)
    m, w = mlp64(seed)
    rng = np.random.default_rng(seed + 1)
    batches = [(rng.standard_normal((6, 5)), rng.integers(0, 4, 6)) for _ in range(4)]
    sched = None if decay is None else (lambda s: kw["lr"] / (1 + decay * s))
    tr = Trainer(m, "cross_entropy", optimizer=OURS[kind](**kw), clip_norm=clip, device="cpu",
                 lr_schedule=sched, fused_optimizer=fused_kernel, accumulation_steps=micro,
                 frozen=sorted(frozen), progress=False)
    losses = [tr.step({"x": x, "target": y}) for x, y in batches]

    want_p, want = torch_train(forward, w, lambda ps: THEIRS[kind](ps, **kw), clip, batches,
                               sched, frozen)
    np.testing.assert_allclose(losses, want, rtol=1e-9)
    got = {**w, **tr.parameters()}
    for k, v in want_p.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-9, atol=1e-12,
                                   err_msg=f"{kind} {kw} clip={clip}: {k}")
