"""Random PyTorch modules exported by torch.onnx against torch autograd (tests/torch_gen.py),
not derandomized: ``python bench/fuzz_torch.py --runs 10 --examples 50 --seed 1``. Each run is
one hypothesis search of ``--examples`` modules; a failure is shrunk and printed (the module,
its opset and mode), and the next run goes on. ``--families`` picks the kinds of modules (image,
seq, nd for 1-D and 3-D, wide for a 16-channel stem), ``--via trainer`` checks the training
step's own path instead of ``onnxgrad.gradients`` (tests/torch_gen.py, ``check``)."""
from __future__ import annotations

import argparse
import time

from fuzz_runs import search, tests_on_path

tests_on_path()
import torch_gen  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--examples", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", help="write each case to this file before it runs")
    ap.add_argument("--exporters", nargs="+", default=["torchscript"],
                    choices=["torchscript", "torchscript-folded", "dynamo",
                             "dynamo-optimized"])
    ap.add_argument("--families", nargs="+", default=["image", "seq", "nd"],
                    choices=["image", "seq", "nd", "wide"])
    ap.add_argument("--via", default="gradients", choices=["gradients", "trainer"],
                    help="onnxgrad.gradients, or the training step's path (its forward "
                         "rewrites and blocked convolutions; parameters' gradients only)")
    args = ap.parse_args(argv)
    t0 = time.time()

    def check(case):
        if args.trace:  # the case about to run, for a crash of the process
            with open(args.trace, "w") as f:
                f.write(f"{case[0]}\ninput {case[1]}, opset {case[2]}, training {case[3]}, "
                        f"exporter {case[4]}\n")
        torch_gen.check(*case, via=args.via)

    failed = search(torch_gen.models(tuple(args.exporters), tuple(args.families)), check,
                    args.runs, args.examples, args.seed)
    for d in torch_gen.DIFFERS[:5]:
        print(f"--- exported forward differs from torch's:\n{d}")
    for d in torch_gen.UNRUNNABLE[:3]:
        print(f"--- onnxruntime cannot run the exported forward (the gradient model ran):\n{d}")
    print(f"{len(torch_gen.UNRUNNABLE)} exported forwards onnxruntime could not run")
    print(f"{args.runs} runs of {args.examples} examples: {failed} failed, "
          f"{time.time() - t0:.0f} s; rejected: {torch_gen.REJECTED}")


if __name__ == "__main__":
    main()
