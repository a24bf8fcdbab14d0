"""Random PyTorch modules exported by torch.onnx: onnxgrad's gradients against torch autograd
in float64 (the generator and the oracle: ``tests/torch_gen.py``; more examples, not
derandomized: ``python bench/fuzz_torch.py``)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings

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


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(torch_gen.models())
@example(_two_ceil_pools())
def test_torchscript_exported_modules_match_torch(case):
    assert torch_gen.check(*case)[0] == "x"


@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(torch_gen.models(("dynamo", "dynamo-optimized")))
def test_dynamo_exported_modules_match_torch(case):
    assert torch_gen.check(*case)[0] == "x"


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


def test_max_pool_windows_gap():
    """The tie margin of a max pool is the smallest top-2 gap of any window, padding -inf."""
    x = torch.tensor([[[[0.0, 1.0, 1.5], [4.0, 3.0, 9.0]]]], dtype=torch.float64)
    assert torch_gen._window_gap(x, (2, 2), (1, 1), (0, 0), (1, 1), False) == 1.0  # 4 vs 3
    assert torch_gen._window_gap(x, (1, 2), (1, 1), (0, 0), (1, 1), False) == 0.5  # 1.5 vs 1
    # a padded window holds one value and -inf: nothing to tie
    assert torch_gen._window_gap(x[..., :1, :1], (2, 2), (1, 1), (1, 1), (1, 1), False) is None
