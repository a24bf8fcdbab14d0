"""The run loop the model fuzzers share (bench/fuzz_torch.py, bench/fuzz_keras.py,
bench/fuzz_tf.py): ``runs`` hypothesis searches of ``examples`` cases each, seeded
``seed * 1000 + run``; a failure is shrunk, printed, and the next run goes on."""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections import Counter

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


def main(doc: str, gen, strategy, what: str, argv=None):
    """The command line of a fuzzer over a generator module of tests/ (``gen``: its
    ``check(*case)``, ``CHECKED`` lists of what each example held, ``REJECTED`` counts)."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--examples", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.time()
    failed = search(strategy, lambda case: gen.check(*case), args.runs, args.examples,
                    args.seed)
    print(f"{what} checked:", dict(Counter(c for case in gen.CHECKED for c in case)))
    print(f"{args.runs} runs of {args.examples} examples: {failed} failed, "
          f"{time.time() - t0:.0f} s; rejected: {gen.REJECTED}")


def tests_on_path():
    """Put tests/ (the generators) on sys.path; TF quiet."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests"))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
