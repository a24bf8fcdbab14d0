"""The run loop the model fuzzers share (bench/fuzz_torch.py, bench/fuzz_keras.py): ``runs``
hypothesis searches of ``examples`` cases each, seeded ``seed * 1000 + run``; a failure is
shrunk, printed, and the next run goes on."""
from __future__ import annotations

import sys
import traceback

from hypothesis import HealthCheck, given, seed, settings


def search(strategy, check, runs: int, examples: int, base_seed: int) -> int:
    """Run the searches; returns how many failed."""
    failed = 0
    for r in range(runs):
        @seed(base_seed * 1000 + r)
        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def run(case):
            check(case)

        try:
            run()
        except Exception:
            failed += 1
            print(f"=== run {r} (seed {base_seed * 1000 + r}) failed")
            traceback.print_exc(limit=2)
        sys.stdout.flush()
    return failed
