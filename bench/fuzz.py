"""Gradient fuzzer: random valid ONNX graphs over the whole rule table, every gradient checked
against float64 finite differences (bench/fuzz_graphs.py builds them, bench/fuzz_check.py judges).

    python bench/fuzz.py [--graphs 10000 | --minutes N] [--seed S] [--max-steps 5] [--no-shrink]
                         [--functions]

Prints graphs/minute, the verdict counts (ok / skipped-tie / skipped-domain / refused / wrong /
crash / invalid-model / gen-invalid) and, for each class of failure (verdict, stage, the op that
fails alone), a shrunk repro: the printable ONNX graph and the gradients() call. The goal is 0
wrong, 0 crash, 0 invalid-model. tests/test_fuzz.py runs the same generator, bounded, in CI.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(__file__))
import fuzz_check  # noqa: E402
import fuzz_graphs  # noqa: E402


def run(graphs: int, minutes: float | None, seed: int, max_steps: int, shrink: bool,
        verbose: bool = False, log=print, functions: bool = False):
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    counts = collections.Counter()
    failures: dict = {}  # key -> (spec, outcome)
    ops = collections.Counter()
    t0 = time.time()
    deadline = t0 + 60 * minutes if minutes else None

    class Done(Exception):
        pass

    strategy = fuzz_graphs.specs(max_steps=max_steps)
    if functions:  # every graph has a model function (Spec.function % 3 == 1)
        strategy = strategy.map(lambda s: dataclasses.replace(s, function=3 * s.function + 1))

    @hseed(seed)
    @settings(max_examples=graphs, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(spec):
        if deadline and time.time() > deadline:
            raise Done()
        p = fuzz_graphs.build(spec)
        ops.update(u.label.split(" ")[0] for u in p.units if not u.label.endswith("(glue)"))
        try:
            out = fuzz_check.evaluate(p)
        except Exception as e:  # noqa: BLE001  (a bug of the fuzzer itself: report, go on)
            out = fuzz_check.Outcome("fuzzer-error", f"{type(e).__name__}: {e}", "fuzzer")
        counts[out.verdict] += 1
        if out.failed or out.verdict in ("refused", "fuzzer-error"):
            failures.setdefault(out.key(), (spec, out, p))
            if verbose:
                log(f"  {out.verdict} {out.stage} {out.where[:120]}: {out.detail[:200]}")
        n = sum(counts.values())
        if n % 250 == 0:
            rate = n / (time.time() - t0) * 60
            log(f"{n} graphs, {rate:.0f}/min: {dict(counts)}")

    try:
        one()
    except Done:
        pass
    elapsed = time.time() - t0
    n = sum(counts.values())
    log(f"\n{n} graphs in {elapsed:.0f} s: {n / elapsed * 60:.0f} graphs/minute (seed {seed})")
    for v in fuzz_check.VERDICTS + ("fuzzer-error",):
        log(f"  {v:15s} {counts[v]}")
    covered = fuzz_graphs.catalogue().by_op
    log(f"ops drawn: {len(ops)} of {len(covered)} in the catalogue")
    for key, (spec, out, p) in sorted(failures.items(), key=lambda kv: kv[0]):
        log(f"\n=== {' / '.join(key)} ===")
        if shrink and out.failed:
            spec, out = fuzz_check.shrink(spec, out)
            p = fuzz_graphs.build(spec)
        log(fuzz_check.repro(p, out))
        log(f"spec: {spec!r}")
    return counts, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=5)
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--functions", action="store_true",
                    help="every graph moves a run of its nodes into a model function")
    ap.add_argument("-v", "--verbose", action="store_true", help="a line per failure as found")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    counts, _ = run(args.graphs, args.minutes, args.seed, args.max_steps, not args.no_shrink,
                    args.verbose, log=lambda s: print(s, flush=True), functions=args.functions)
    return 1 if any(counts[v] for v in fuzz_check.FAILURES + ("fuzzer-error",)) else 0


if __name__ == "__main__":
    sys.exit(main())
