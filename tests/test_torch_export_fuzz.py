"""Random PyTorch modules exported by torch.onnx: onnxgrad's gradients against torch autograd
in float64 (the generator and the oracle: ``tests/torch_gen.py``; more examples, not
derandomized: ``python bench/fuzz_torch.py``)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import torch_gen  # noqa: E402

nn = torch.nn


def _two_ceil_pools():
    """What this fuzzer found first (session 34): two 2x2 / 2 MaxPools with pads 1 and ceil_mode
    on 4x7, where onnx's dims for the second pool's input were wrong and its rewrite without
    ceil_mode computed [2, 2] windows instead of [2, 3] (onnxgrad/inference.py)."""
    pool = lambda: torch_gen.Pool((2, 2), (2, 2), (1, 1), (1, 1), True)  # noqa: E731
    return (nn.Sequential(pool(), pool(), nn.Conv2d(1, 1, 1), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(1, 2)), (1, 4, 7), 14, False, "torchscript")


def _avg_pool_3d_ceil():
    """What it found in session 35 (a refusal): ceil_mode and count_include_pad=1, where one
    axis drops a last window and another has a partial one (onnxgrad/inference.py,
    rescaled_floor_pads)."""
    return (nn.Sequential(nn.AvgPool3d(3, 3, 1, ceil_mode=True), nn.Tanh()), (1, 3, 3, 5), 14,
            False, "torchscript")


def _unflatten_then(tail):
    """What it found in session 36 (refusals): ``unflatten`` slices the shape up to a Mod of
    constants that onnx's inference does not follow, so the rank after it was unknown and a
    BatchNorm or an upsampling there was refused (onnxgrad/folding.py)."""
    unfold = torch_gen.Fn("unfold(x, 2) as an image",
                          lambda m, x: torch.nn.functional.unfold(x, 2).unflatten(2, (3, 3)))
    return nn.Sequential(unfold, tail), (1, 4, 4), 14, False, "torchscript"


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(torch_gen.models())
@example(_two_ceil_pools())
@example(_unflatten_then(nn.BatchNorm2d(4)))
@example(_unflatten_then(nn.Upsample(scale_factor=2.0)))
def test_torchscript_exported_modules_match_torch(case):
    assert torch_gen.check(*case)[0] == "x"


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(torch_gen.models(families=("nd",)))
@example(_avg_pool_3d_ceil())
def test_torchscript_exported_signal_and_volume_modules_match_torch(case):
    assert torch_gen.check(*case)[0] == "x"


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(torch_gen.models(families=("wide", "image", "seq")))
def test_training_step_of_exported_modules_matches_torch(case):
    """The training step's own path (its forward rewrites: small-image convolutions as Gemms,
    pools' Indices, inlined functions; convolutions in onnxruntime's blocked layout): the
    parameters' gradients against torch's."""
    assert torch_gen.check(*case, via="trainer")


def _fresh_norms():
    """Two LayerNorms at their fresh values, which the TorchScript exporter's folding writes as
    one parameter and an Identity of it (session 42)."""
    return (nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8),
                          nn.LayerNorm(8), nn.Linear(8, 3)), (6,), 17, True, "torchscript-folded")


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(torch_gen.models(("torchscript-folded",), families=("image", "seq")))
@example(_fresh_norms())
def test_training_step_of_folded_exports_trains_every_parameter(case):
    """The TorchScript exporter's default constant folding merges equal parameters (a norm's
    fresh ones and zeros, kept here) into one initializer read through Identity nodes: the
    training step trained them as one tensor; every parameter the export holds, merged ones
    included, now gets torch's gradient."""
    assert torch_gen.check(*case, via="trainer")


@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(torch_gen.models(("dynamo", "dynamo-optimized")))
def test_dynamo_exported_modules_match_torch(case):
    assert torch_gen.check(*case)[0] == "x"


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.integers(2, 6), st.integers(2, 6), st.sampled_from([2, 3]), st.sampled_from([2, 3, 1]),
       st.sampled_from([1, 1, 0]), st.sampled_from(["max", "avg", "avg_incl"]),
       st.sampled_from([14, 17, 18]))
@example(4, 4, 2, 2, 1, "max", 14)
def test_ceil_mode_pool_behind_dims_onnx_cannot_see(h, w, k, s, p, kind, opset):
    """A ceil_mode pool after an upsampling whose scales the TorchScript exporter computes
    (Concat of Constants: onnx's inference sees no dims after it), where the exporter declares
    the model's output with onnx's dims, which keep a last window the runtimes drop: that
    declaration was taken, and the gradient model's cot input was declared [N, 1, 5, 5] where
    y is [N, 1, 4, 4] (found by bench/fuzz_torch.py, session 35)."""
    p = min(p, k // 2)
    hu, wu = 2 * h - 1, 2 * w - 1  # after the upsampling and a 2x2 / 1 average
    assume(min(hu, wu) + 2 * p >= k)
    pool = torch_gen.Pool((k, k), (s, s), (p, p), (1, 1), True) if kind == "max" else \
        nn.AvgPool2d(k, s, p, ceil_mode=True, count_include_pad=kind == "avg_incl")
    up = torch_gen.Fn("interpolate x2 nearest", lambda m, x: nn.functional.interpolate(
        x, scale_factor=2.0, mode="nearest"))
    module = nn.Sequential(up, nn.AvgPool2d(2, 1), pool)
    assert torch_gen.check(module, (1, h, w), opset, False)[0] == "x"


def test_the_oracle_sees_a_wrong_gradient(monkeypatch):
    """The comparison is not vacuous: gradients 0.5 % off fail it."""
    real = torch_gen.session

    class Off:
        def __init__(self, model):
            self.s = real(model)

        def run(self, names, feeds):  # every gradient 0.5 % off, y as it is
            out = self.s.run(names, feeds)
            return [o if n == "y" else o * np.float32(1.005) for n, o in zip(names, out)]

    module = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(),
                           nn.Linear(3 * 5 * 5, 2))
    torch_gen.check(module, (2, 5, 5), 17, False)
    monkeypatch.setattr(torch_gen, "session", Off)
    with pytest.raises(AssertionError, match="beyond the tolerance"):
        torch_gen.check(module, (2, 5, 5), 17, False)


def test_the_trainer_oracle_sees_a_wrong_gradient(monkeypatch):
    """The training step's path too: gradients 0.5 % off fail it."""
    import onnxgrad.training.trainer as trainer
    real = trainer.make_session

    class Off:
        def __init__(self, *a, **kw):
            self.s = real(*a, **kw)

        def run(self, names, feeds):  # every gradient 0.5 % off, the loss as it is
            out = self.s.run(names, feeds)
            return [out[0]] + [o * np.float32(1.005) for o in out[1:]]

    module = nn.Sequential(nn.Conv2d(2, 16, 3, padding=1), nn.Tanh(),
                           nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(),
                           nn.Linear(16 * 8 * 8, 2))
    torch_gen.check(module, (2, 8, 8), 17, False, via="trainer")
    monkeypatch.setattr(trainer, "make_session", Off)
    with pytest.raises(AssertionError, match="beyond the tolerance"):
        torch_gen.check(module, (2, 8, 8), 17, False, via="trainer")


def test_max_pool_windows_gap():
    """The tie margin of a max pool is the smallest top-2 gap of any window, padding -inf."""
    x = torch.tensor([[[[0.0, 1.0, 1.5], [4.0, 3.0, 9.0]]]], dtype=torch.float64)
    assert torch_gen._window_gap(x, (2, 2), (1, 1), (0, 0), (1, 1), False) == 1.0  # 4 vs 3
    assert torch_gen._window_gap(x, (1, 2), (1, 1), (0, 0), (1, 1), False) == 0.5  # 1.5 vs 1
    # a padded window holds one value and -inf: nothing to tie
    assert torch_gen._window_gap(x[..., :1, :1], (2, 2), (1, 1), (1, 1), (1, 1), False) is None
