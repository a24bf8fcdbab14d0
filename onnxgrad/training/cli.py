"""The training commands of the ``onnxgrad`` CLI (wired in by onnxgrad/cli.py):

    onnxgrad train MODEL --loss {mse,l1,cross_entropy,bce} --data DATA.npz -o trained.onnx
                   [--output-name NAME] [--epochs N] [--batch-size B] [--optimizer {sgd,adam,adamw}]
                   [--lr LR] [--momentum M] [--weight-decay WD] [--clip-norm C]
                   [--accumulate K] [--val-split F] [--checkpoint CKPT] [--resume CKPT]
                   [--plot loss.png] [--device auto|cpu|cuda] [--seed S] [--no-progress]
                   [--drop-last] [--distributed [--zero] [--timeout SECONDS]]
    onnxgrad export-train-step MODEL --loss ... -o step.onnx [--optimizer ...] [--lr ...]

DATA.npz holds arrays ``x`` (the model's input, rows on axis 0) and ``y`` (the targets: int class
labels for cross_entropy, floats otherwise). Each command function takes (args, out) and returns
the exit status; errors are ValueError/KeyError/FileNotFoundError for the main CLI to report.
"""
from __future__ import annotations

import io
import os

import numpy as np

from .. import argtypes
from ..argtypes import finite_float, positive_float, positive_int
from ..errors import DataError, InvalidArgumentError, WriteError
from ..storage import atomic_path, load_arrays, load_model
from .losses import LOSSES
from .optimizers import OPTIMIZERS


def _common(p, need_data: bool):
    p.add_argument("model", metavar="MODEL", help="the ONNX model to train")
    p.add_argument("--loss", required=True, choices=LOSSES,
                   help="the loss attached to the model's output")
    p.add_argument("--output-name", metavar="NAME", default=None,
                   help="the output the loss reads (default: the first output)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                   help="default adamw")
    p.add_argument("--lr", type=finite_float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--momentum", type=finite_float, default=0.0, help="SGD momentum (default 0)")
    p.add_argument("--nesterov", action="store_true", help="SGD Nesterov momentum")
    p.add_argument("--weight-decay", type=finite_float, default=None,
                   help="weight decay (default 0; 1e-2 for adamw, as in PyTorch)")
    p.add_argument("--clip-norm", type=positive_float, default=None, metavar="C",
                   help="clip the gradients' global 2-norm to C")
    p.add_argument("--frozen", nargs="+", default=[], metavar="NAME",
                   help="initializers not to train")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="where to write the result")


def add_train_parser(subparsers):
    """Add ``train`` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "train", help="train an ONNX model on onnxruntime",
        description="Attach a loss to MODEL, train it on DATA.npz (arrays x and y) with the "
        "optimizer running inside the ONNX graph on onnxruntime (CUDA when available), and "
        "write the trained model. Prints the final loss (and accuracy for classification).")
    _common(p, True)
    p.add_argument("--data", required=True, metavar="DATA.npz", help="arrays x and y")
    p.add_argument("--epochs", type=positive_int, default=1)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--accumulate", type=positive_int, default=1, metavar="K",
                   help="split each batch into K micro-batches (gradient accumulation)")
    p.add_argument("--val-split", type=finite_float, default=0.0, metavar="F",
                   help="hold out this fraction of the rows for validation")
    p.add_argument("--checkpoint", metavar="CKPT", help="write a checkpoint here each epoch")
    p.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="STEPS",
                   help="also every STEPS steps")
    p.add_argument("--resume", metavar="CKPT", help="continue from this checkpoint")
    p.add_argument("--plot", metavar="PNG", help="write the loss curve here (needs matplotlib)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--fused-optimizer", choices=["auto", "on", "off"], default="auto",
                   help="the optimizer on CPU as one fused C pass per parameter (auto: where "
                   "the machine has a C compiler and the step allows; on: or an error)")
    p.add_argument("--seed", type=argtypes.seed, default=0,
                   help="shuffling and validation split seed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--drop-last", action="store_true",
                   help="skip each epoch's last batch when it is smaller than --batch-size")
    d = p.add_argument_group("data parallel (start with torchrun; needs onnxgrad[distributed])")
    d.add_argument("--distributed", action="store_true",
                   help="train on every process torchrun started; --batch-size is the global "
                   "batch, split between them")
    d.add_argument("--zero", action="store_true",
                   help="ZeRO stage 1: each process keeps 1/N of the optimizer state")
    d.add_argument("--timeout", type=argtypes.positive_float, default=None, metavar="SECONDS",
                   help="stop with an error naming a rank that died or hung this long "
                   "(default 300)")
    p.set_defaults(func=cmd_train)
    return p


def add_export_train_step_parser(subparsers):
    """Add ``export-train-step`` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "export-train-step", help="write the train-step graph of a model as one .onnx file",
        description="Write one ONNX model that takes a training step of MODEL: inputs the data, "
        "the parameters, the optimizer state, lr (float64) and step (int64, 1 first); outputs "
        "the loss, the updated parameters and the updated state. The model's weights and zero "
        "state are stored as the inputs' defaults, so the file runs as it is. With --target web: "
        "lr is float32, and the weights and the roles go to two files beside OUT (see "
        "onnxgrad/training/webstep.py).")
    _common(p, False)
    p.add_argument("--gradient", metavar="GRAD.onnx",
                   help="also write the gradient graph (data + params -> loss, gradients)")
    p.add_argument("--target", choices=["python", "web"], default="python",
                   help="python (default): one file that runs as it is; web: for onnxruntime-web "
                   "and the browser trainer (onnxgrad web): OUT with float32 scalars and no "
                   "defaults, OUT's .model.onnx (the model and its initial weights) and .json "
                   "(the manifest of roles)")
    p.set_defaults(func=cmd_export_train_step)
    return p


def _optimizer(args):
    from .optimizers import make_optimizer
    kw = {"lr": args.lr}
    if args.weight_decay is not None:
        kw["weight_decay"] = args.weight_decay
    if args.optimizer == "sgd":
        kw.update(momentum=args.momentum, nesterov=args.nesterov)
    elif args.momentum or args.nesterov:
        raise InvalidArgumentError("--momentum and --nesterov apply to --optimizer sgd only")
    return make_optimizer(args.optimizer, **kw)


def _load_model(path):
    return load_model(path)


def _data_input(model):
    inits = {t.name for t in model.graph.initializer}
    ins = [i.name for i in model.graph.input if i.name not in inits]
    if len(ins) != 1:
        raise InvalidArgumentError(
            f"the model has {len(ins)} data inputs ({ins}); `onnxgrad train` feeds "
            "one (array x of DATA.npz): use onnxgrad.Trainer from Python")
    return ins[0]


def _left_out(left_out: dict, shown: int = 3) -> str:
    """How many float initializers the run does not train, counted by why (``--frozen`` keeps
    more; the Python API's ``Trainer.left_out`` names each)."""
    if not left_out:
        return ""
    why: dict[str, int] = {}
    for reason in left_out.values():
        why[reason] = why.get(reason, 0) + 1
    parts = [f"{n} {r}" for r, n in sorted(why.items(), key=lambda t: -t[1])[:shown]]
    more = "; ..." if len(why) > shown else ""
    return f"; {len(left_out)} not trained: {'; '.join(parts)}{more}"


def cmd_train(args, out) -> int:
    from .trainer import Trainer

    model = _load_model(args.model)
    z = load_arrays(args.data, "archive with arrays x and y")
    if "x" not in z or "y" not in z:
        raise DataError(f"{args.data}: needs arrays 'x' and 'y' (has {list(z)})")
    x, y = z["x"], z["y"]
    if x.ndim == 0 or y.ndim == 0 or len(x) != len(y):
        raise DataError(f"{args.data}: x has shape {list(x.shape)} and y {list(y.shape)}: both "
                        "need the same number of rows (axis 0)")
    if not 0 <= args.val_split < 1:
        raise InvalidArgumentError(f"--val-split {args.val_split} must be in [0, 1)")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise InvalidArgumentError("--checkpoint-every must be at least 1")
    if args.resume and not os.path.exists(args.resume):
        raise InvalidArgumentError(f"--resume: {args.resume}: no such checkpoint")
    xin = _data_input(model)
    kw = dict(output_name=args.output_name, optimizer=_optimizer(args), frozen=args.frozen,
              clip_norm=args.clip_norm, accumulation_steps=args.accumulate, device=args.device,
              seed=args.seed, progress=not args.no_progress,
              fused_optimizer={"auto": "auto", "on": True, "off": False}[args.fused_optimizer])
    if args.distributed:  # every rank runs this; rank 0 reports and writes
        from .distributed import DistributedTrainer
        trainer = DistributedTrainer(model, args.loss, zero=args.zero,
                                     timeout=300.0 if args.timeout is None else args.timeout, **kw)
        out = out if trainer.rank == 0 else io.StringIO()
    elif args.zero or args.timeout is not None:
        raise InvalidArgumentError("--zero and --timeout apply to --distributed training only")
    else:
        trainer = Trainer(model, args.loss, **kw)
    checked = trainer.check_data({xin: x, trainer.target_name: y}, args.data,
                                 shown={xin: "x", trainer.target_name: "y"})
    x, y = checked[xin], checked[trainer.target_name]
    order = np.random.default_rng(args.seed).permutation(len(x))
    n_val = int(round(len(x) * args.val_split))
    if n_val >= len(x) > 0:
        raise InvalidArgumentError(f"--val-split {args.val_split} of {len(x)} rows leaves none "
                                   "to train on")
    val_idx, train_idx = order[:n_val], order[n_val:]
    train = {xin: x[train_idx], trainer.target_name: y[train_idx]}
    val = {xin: x[val_idx], trainer.target_name: y[val_idx]} if n_val else None
    print(f"training {os.path.basename(args.model)} on {len(train_idx)} rows"
          + (f" (+{n_val} validation)" if n_val else "")
          + f", {args.optimizer} lr {args.lr}, {args.epochs} epochs of batch {args.batch_size}, "
          f"on {trainer.device}" + (f", {trainer.world_size} processes"
                                    if hasattr(trainer, "world_size") else ""), file=out)
    print(f"  parameters: {len(trainer.params)} tensors" + _left_out(trainer.left_out), file=out)
    import time
    t0 = time.perf_counter()
    trainer.fit(train, epochs=args.epochs, batch_size=args.batch_size,
                checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every,
                resume=args.resume, drop_last=args.drop_last)
    secs = time.perf_counter() - t0
    try:
        trainer.export(args.output)
    except WriteError as exc:
        kept = (f"the checkpoint {args.checkpoint} holds step {trainer.step_count}"
                if args.checkpoint else "the trained weights were not saved (--checkpoint keeps "
                "them when an export fails)")
        raise WriteError(args.output, f"{exc.reason}; {kept}", exc.errno) from exc
    if getattr(trainer, "rank", 0):  # data parallel: rank 0 reports
        return 0
    report = {"train": trainer.evaluate(train)}
    if val:
        report["validation"] = trainer.evaluate(val)
    print(f"{trainer.step_count} steps in {secs:.2f} s", file=out)
    for k, v in report.items():
        print(f"final loss ({k}): {v:.6g}", file=out)
    # (an --output-name inside the graph is no output predict() can read: no accuracy then)
    if args.loss in ("cross_entropy", "bce") and \
            any(o.name == trainer.output_name for o in trainer.model.graph.output):
        for k, part in [("train", train), ("validation", val)]:
            if part is not None:
                acc = accuracy(trainer, part, xin, args.loss)
                print(f"accuracy ({k}): {acc:.4f}", file=out)
    if args.plot:
        msg = plot_losses(trainer.history, args.plot, per_epoch=-(-len(train_idx) //
                                                                   args.batch_size))
        print(msg, file=out)
    print(f"wrote {args.output}", file=out)
    return 0


def accuracy(trainer, data, xin, loss) -> float:
    logits = trainer.predict({xin: data[xin]}, outputs=[trainer.output_name],
                             batch_size=4096)[0]
    y = data[trainer.target_name]
    if loss == "cross_entropy":
        return float(np.mean(np.argmax(logits, axis=trainer.class_axis) == y))
    return float(np.mean((logits > 0) == (y > 0.5)))


def plot_losses(losses, path, per_epoch=None) -> str:
    """Write the loss curve as a PNG with matplotlib; a note when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"matplotlib is not installed: no plot written to {path} "
                "(pip install 'onnxgrad[train]')")
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="loss per step")
    if per_epoch and len(losses) >= per_epoch:
        k = len(losses) // per_epoch
        means = np.asarray(losses[:k * per_epoch]).reshape(k, per_epoch).mean(axis=1)
        ax.plot(np.arange(1, k + 1) * per_epoch, means, "o-", label="epoch mean")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp)
    plt.close(fig)
    return f"wrote the loss curve to {path}"


def cmd_export_train_step(args, out) -> int:
    from .losses import attach_loss
    from .step import build_gradient_model, build_train_step

    model = _load_model(args.model)
    from ..runtime import check_runs_opset
    check_runs_opset(model)  # (a step is for onnxruntime to run)
    if args.target == "web":
        return _export_web(args, model, out)
    lm = attach_loss(model, args.loss, args.output_name)
    loss = lm.graph.output[-1].name
    step = build_train_step(lm, loss, optimizer=_optimizer(args), frozen=args.frozen,
                            clip_norm=args.clip_norm)
    step.save(args.output)
    print(f"wrote {args.output}", file=out)
    print(f"  data inputs: {', '.join(step.data_inputs)}", file=out)
    print(f"  parameters:  {', '.join(step.params)} -> {', '.join(step.param_outputs)}", file=out)
    if step.state:
        print(f"  state:       {', '.join(step.state)}", file=out)
    print(f"  scalars:     {step.lr} (float64), {step.step} (int64, 1 first); "
          f"loss output: {step.loss}", file=out)
    if args.gradient:
        g = build_gradient_model(lm, loss, frozen=args.frozen)
        from .step import with_defaults
        from ..runtime import save_model
        save_model(with_defaults(g.model, g.initial_params), args.gradient)
        print(f"wrote {args.gradient}", file=out)
    return 0


def _export_web(args, model, out) -> int:
    from .webstep import export_web_step, paths

    if args.gradient:
        raise ValueError("--gradient applies to --target python only")
    m = export_web_step(model, args.loss, args.output, output_name=args.output_name,
                        optimizer=_optimizer(args), frozen=args.frozen, clip_norm=args.clip_norm)
    files = paths(args.output)
    print(f"wrote {files['step']} (the step), {files['model']} (the model) and "
          f"{files['manifest']} (the manifest)", file=out)

    def names(tensors):
        return ", ".join(t["name"] for t in tensors)
    print(f"  data inputs: {names(m['inputs'] + m['targets'])}", file=out)
    print(f"  parameters:  {names(m['params'])}", file=out)
    if m["state"]:
        print(f"  state:       {names(m['state'])}", file=out)
    print(f"  scalars:     {m['lr']['name']} (float32), {m['step']['name']} (int64, 1 first); "
          f"loss output: {m['loss']['name']}", file=out)
    return 0
