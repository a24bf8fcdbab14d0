"""A/B of two onnxgrad code trees on one training-step row: onnxgrad's side only, in alternated
child processes.

On a shared machine, a single bench run cannot tell changes of 5 % to 15 % from the machine's
own spells (one process in several can run every kernel 1.4x to 2x slower). Two Trainers in one
process are no fairer: they compete for caches and memory. So each round starts one process per
tree, in alternating order, each running its own tree's ``bench/train_step.py`` child mode (that
script puts its tree first on ``sys.path``), on the same model file and batches. It prints the
ratio of the two sides' medians and the median of the rounds' own ratios.

    python bench/ab.py --old ../onnxgrad-old --row resnet18-ts --threads 2 --rounds 8
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_step  # noqa: E402


def side(tree, prep_path, args):
    """One child process of ``tree``'s train_step.py: its onnxgrad steps/s."""
    cmd = [sys.executable, os.path.join(tree, "bench", "train_step.py"), "--child-prep",
           prep_path, "--child-side", "onnxgrad", "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--repeat", str(args.repeat), "--device", "cpu", "--threads",
           str(args.threads)]
    env = dict(os.environ, PYTHONPATH=tree)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["steps_per_s"]
    raise RuntimeError(f"{tree}: the child failed\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the other code tree (a checkout or worktree)")
    ap.add_argument("--new", default=os.path.dirname(HERE), help="default: this tree")
    ap.add_argument("--row", required=True, choices=train_step.ROWS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args(argv)
    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    for name, tree in trees.items():
        if not os.path.isfile(os.path.join(tree, "bench", "train_step.py")):
            ap.error(f"--{name} {tree}: no bench/train_step.py there")
    with tempfile.TemporaryDirectory() as wd:
        prep = train_step.prepare(args.row, wd)
        prep_path = os.path.join(wd, "prep.json")
        with open(prep_path, "w") as f:
            json.dump(prep, f)
        rates = {k: [] for k in trees}
        for r in range(args.rounds):
            for k in ("old", "new") if r % 2 == 0 else ("new", "old"):
                rates[k].append(side(trees[k], prep_path, args))
    for k, v in rates.items():
        print(f"{k:4s} {trees[k]}: median {statistics.median(v):.3f} steps/s  rounds "
              + " ".join(f"{x:.2f}" for x in v))
    ratio = statistics.median(rates["new"]) / statistics.median(rates["old"])
    # a slow spell of the machine often spans both processes of a round: the round-by-round
    # ratios cancel it where the medians of each side do not
    paired = statistics.median(n / o for n, o in zip(rates["new"], rates["old"]))
    print(f"{args.row}, {args.threads} thread(s), {args.rounds} rounds: new/old {ratio:.3f} "
          f"(medians), {paired:.3f} (median of the rounds' ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
