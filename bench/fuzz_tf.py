"""Random TensorFlow programs of raw ops, converted and differentiated, against TensorFlow
(tests/tf_gen.py), not derandomized: ``python bench/fuzz_tf.py --runs 4 --examples 200
--seed 1``; ``--arrays``: programs mostly of TensorArrays written and read every way
(tf_gen.ARRAY_OPS). Each run is one hypothesis search; a failure is shrunk and printed, and
the next run goes on."""
from __future__ import annotations

import argparse

from fuzz_runs import main, tests_on_path

tests_on_path()
import tf_gen  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--arrays", action="store_true")
    args, rest = ap.parse_known_args()
    main(__doc__, tf_gen, tf_gen.programs(tf_gen.ARRAY_OPS if args.arrays else None), "ops",
         rest)
