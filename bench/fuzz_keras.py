"""Random Keras models, exported, converted and differentiated, against TF's tape in float64
(tests/keras_gen.py), not derandomized: ``python bench/fuzz_keras.py --runs 4 --examples 50
--seed 1``. Each run is one hypothesis search; a failure is shrunk and printed, and the next
run goes on."""
from __future__ import annotations

import argparse
import os
from collections import Counter
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras_gen  # noqa: E402
from fuzz_runs import search  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--examples", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.time()
    failed = search(keras_gen.models(), lambda case: keras_gen.check(*case), args.runs,
                    args.examples, args.seed)
    print("layers checked:", dict(Counter(c for layers in keras_gen.CHECKED for c in layers)))
    print(f"{args.runs} runs of {args.examples} examples: {failed} failed, "
          f"{time.time() - t0:.0f} s; rejected: {keras_gen.REJECTED}")


if __name__ == "__main__":
    main()
