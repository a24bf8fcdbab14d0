"""The ``onnxgrad`` command.

    onnxgrad grad MODEL -o OUT --ys NAME.. --xs NAME.. [--grad-ys ..] [--stop ..]
                  [--unconnected none|zero] [--aggregation add_n|tree|accumulate_n] [--name SCOPE]
    onnxgrad check MODEL --ys NAME.. --xs NAME.. [--feeds FILE.npz] [--dtype float64|float32]
                   [--rtol R] [--atol A] [--eps E]
    onnxgrad ops [--markdown]
    onnxgrad train / export-train-step ...   (see onnxgrad/training/cli.py)
    onnxgrad lower MODEL -o OUT              (see onnxgrad/lower.py)
    onnxgrad convert GRAPH.pb|SAVEDMODEL_DIR -o MODEL.onnx [--inputs x:0 ..] [--outputs y:0 ..]
                     [--opset N] [--signature NAME]   (TensorFlow -> ONNX)
    onnxgrad web [--port 8000] [--root DIR]   (serve the browser trainer; see onnxgrad/web.py)
    onnxgrad --version

Exit status: 0 on success, 1 when ``check`` finds a gradient that does not match, 2 on an error
(bad arguments, a missing file, an unknown tensor name, an op without a gradient rule). Errors are
one line on stderr starting with ``onnxgrad: error:``; set ONNXGRAD_DEBUG=1 to see the traceback.
"""
from __future__ import annotations

import argparse
import os
import sys

PROG = "onnxgrad"
_ONES = "-"  # in --grad-ys: "ones of y's shape" (what None means in the Python API)


from . import argtypes
from .argtypes import positive_float, positive_int
from .errors import DataError, InvalidArgumentError, OnnxgradError


class UsageError(InvalidArgumentError):
    """A bad command line or input file: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors, in the same one-line form as ours
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _version() -> str:
    from . import __version__
    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="tf.gradients for ONNX models: append gradient "
                "subgraphs that run on a stock ONNX runtime, and check them numerically.")
    p.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def names(q, flag, help_, required=True):
        q.add_argument(flag, nargs="+", action="extend", metavar="NAME", required=required,
                       help=help_)

    g = sub.add_parser("grad", help="append the gradient of sum(ys) w.r.t. xs to a model",
                       description="Append d(sum ys)/d(x) for each x to MODEL and write the "
                       "result to OUT. Prints 'x -> gradient output name' per x ('None' when "
                       "x is unconnected and --unconnected is none).")
    g.add_argument("model", metavar="MODEL", help="the ONNX model to differentiate")
    g.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write the result")
    names(g, "--ys", "tensors to differentiate (their sum)")
    names(g, "--xs", "tensors to differentiate with respect to (inputs, initializers or "
                     "intermediate tensors)")
    names(g, "--grad-ys", "one per y: an existing tensor, a new name (it becomes a graph input "
                          f"fed at run time), or '{_ONES}' for ones (the default)", required=False)
    names(g, "--stop", "tensors held constant (stop_gradients)", required=False)
    g.add_argument("--unconnected", choices=["none", "zero"], default="none",
                   help="gradient of an x that ys do not depend on: no output (none, the "
                        "default) or a zeros output (zero)")
    g.add_argument("--aggregation", choices=["add_n", "tree", "accumulate_n"], default=None,
                   help="how gradients from several consumers are summed (default add_n)")
    g.add_argument("--name", default="gradients", metavar="SCOPE",
                   help="name scope of the added nodes (default 'gradients'; made unique)")
    g.set_defaults(func=_cmd_grad)

    c = sub.add_parser("check", help="check gradients against central finite differences",
                       description="Compare onnxgrad's gradients of MODEL with central finite "
                       "differences. Exits 0 when every x matches, 1 when one does not.")
    c.add_argument("model", metavar="MODEL", help="the ONNX model to check")
    names(c, "--ys", "tensors to differentiate (projected on random cotangents)")
    names(c, "--xs", "graph inputs or initializers to check the gradients of")
    names(c, "--stop", "tensors held constant (stop_gradients)", required=False)
    c.add_argument("--feeds", metavar="FILE.npz",
                   help="input values (np.savez); float inputs not given get random normals")
    c.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                   help="float64 (default) runs a float64 copy of the model; float32 runs it "
                        "as it is, with looser default tolerances")
    c.add_argument("--rtol", type=positive_float, help="relative tolerance")
    c.add_argument("--atol", type=positive_float, help="absolute tolerance")
    c.add_argument("--eps", type=positive_float, help="finite-difference step")
    c.add_argument("--seed", type=argtypes.seed, default=0,
                   help="seed of the random feeds and directions")
    c.add_argument("--dim", type=positive_int, default=2,
                   help="size given to symbolic dims of random feeds (default 2; at least 1: a "
                        "dim of 0 would make an empty tensor, which checks nothing)")
    c.set_defaults(func=_cmd_check)

    o = sub.add_parser("ops", help="list the ops that have gradient rules",
                       description="List the ops with gradient rules and their opset ranges.")
    o.add_argument("--markdown", action="store_true", help="as a markdown table")
    o.set_defaults(func=_cmd_ops)

    v = sub.add_parser("convert", help="convert a TensorFlow GraphDef or SavedModel to ONNX",
                       description="Convert a frozen TensorFlow GraphDef (.pb, .pbtxt) or a "
                       "SavedModel directory to an ONNX model (TF1 and TF2 control flow, "
                       "TensorArrays/TensorLists). A SavedModel needs TensorFlow "
                       "(pip install 'onnxgrad[tensorflow]') to freeze its variables.")
    v.add_argument("source", metavar="GRAPH.pb|SAVEDMODEL_DIR",
                   help="a GraphDef file or a SavedModel directory")
    v.add_argument("-o", "--output", required=True, metavar="MODEL.onnx",
                   help="where to write the ONNX model")
    names(v, "--inputs", "tensors that become model inputs, e.g. x:0 (default: the Placeholders "
                         "the outputs need; for a SavedModel, the signature's inputs)",
          required=False)
    names(v, "--outputs", "tensors to compute, e.g. y:0 (required for a GraphDef; for a "
                          "SavedModel, default the signature's outputs, which may also be named "
                          "by their signature keys)", required=False)
    v.add_argument("--opset", type=int, default=None, metavar="N",
                   help="ONNX opset of the model (default 18)")
    v.add_argument("--signature", default=None, metavar="NAME",
                   help="the SavedModel signature to convert (default serving_default)")
    v.add_argument("--allow-unranked", action="store_true",
                   help="write inputs and outputs whose rank is known only at run time "
                        "without a shape (onnxruntime runs the model; onnx.checker refuses "
                        "it); without this, such a graph is an error")
    v.set_defaults(func=_cmd_convert)

    from .lower import add_lower_parser
    add_lower_parser(sub)

    from .training.cli import add_export_train_step_parser, add_train_parser
    add_train_parser(sub)
    add_export_train_step_parser(sub)

    from .web import add_web_parser
    add_web_parser(sub)
    return p


# -- commands ----------------------------------------------------------------------------------
def _load(path: str):
    from .storage import load_model
    return load_model(path)


def _cmd_grad(args, out) -> int:
    from .autodiff import gradients
    from .runtime import save_model

    model = _load(args.model)
    grad_ys = None
    if args.grad_ys:
        if len(args.grad_ys) != len(args.ys):
            raise UsageError(f"--grad-ys has {len(args.grad_ys)} names but --ys has "
                             f"{len(args.ys)}; give one per y ('{_ONES}' for ones)")
        grad_ys = [None if n == _ONES else n for n in args.grad_ys]
    res = gradients(model, args.ys, args.xs, grad_ys=grad_ys, name=args.name,
                    stop_gradients=args.stop, unconnected_gradients=args.unconnected,
                    aggregation_method=args.aggregation)
    save_model(res.model, args.output)
    for x, g in zip(args.xs, res.grads):
        print(f"{x} -> {g}", file=out)
    return 0


def _load_feeds(path: str, model) -> dict:
    import numpy as np
    from onnx import helper

    from .storage import load_arrays
    feeds = load_arrays(path)
    declared = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input
                if vi.type.HasField("tensor_type")}
    declared.update({t.name: t.data_type for t in model.graph.initializer})
    unknown = sorted(set(feeds) - set(declared))
    if unknown:
        raise UsageError(f"{path}: {', '.join(map(repr, unknown))} "
                         f"{'is not an input' if len(unknown) == 1 else 'are not inputs'} "
                         f"of the model (inputs: {', '.join(map(repr, declared))})")
    out = {}
    for k, v in feeds.items():  # npz files often hold float64 / int32: match the declared type
        want = helper.tensor_dtype_to_np_dtype(declared[k])
        if v.dtype.kind not in "fiub" or (v.dtype.kind == "f" and want.kind in "iub"):
            raise DataError(f"{path}: {k!r} holds {v.dtype} values, but the model's input is "
                            f"{want}")
        if v.dtype.kind == "f" and not np.isfinite(v).all():
            bad = tuple(int(i) for i in np.argwhere(~np.isfinite(v))[0])
            raise DataError(f"{path}: {k!r} holds {v[bad]} at index {list(bad)}: feeds must be "
                            "finite (finite differences of NaN or inf compare nothing)")
        out[k] = v.astype(want) if v.dtype != want else v
    _check_feed_shapes(path, out, model)
    return out


def _check_feed_shapes(path, feeds: dict, model) -> None:
    """Each feed has its input's rank and fixed dims, and a symbolic dim one size throughout."""
    dims: dict[str, tuple[str, int]] = {}
    shapes = {vi.name: vi.type.tensor_type.shape for vi in model.graph.input
              if vi.type.tensor_type.HasField("shape")}
    shapes.update({t.name: t.dims for t in model.graph.initializer if t.name not in shapes})
    for k, v in feeds.items():
        shape = shapes.get(k)
        if shape is None:
            continue
        want = [d if isinstance(d, int) else d.dim_value if d.HasField("dim_value") else
                d.dim_param or "?" for d in getattr(shape, "dim", shape)]
        shown = "[" + ", ".join(map(str, want)) + "]"
        if len(want) != v.ndim:
            raise DataError(f"{path}: {k!r} has shape {list(v.shape)}, but the model's input "
                            f"is shaped {shown} (rank {len(want)})")
        for axis, (w, n) in enumerate(zip(want, v.shape)):
            if isinstance(w, int) and w != n:
                raise DataError(f"{path}: {k!r} has shape {list(v.shape)}, but the model's "
                                f"input is shaped {shown} (axis {axis})")
            if isinstance(w, str) and w != "?":
                seen = dims.setdefault(w, (k, n))
                if seen[1] != n:
                    raise DataError(f"{path}: dim {w!r} is {seen[1]} in {seen[0]!r} but {n} "
                                    f"in {k!r}")


def _cmd_check(args, out) -> int:
    from .check import check_gradients

    model = _load(args.model)
    feeds = _load_feeds(args.feeds, model) if args.feeds else None
    kw = {"stop_gradients": args.stop} if args.stop else {}
    report = check_gradients(model, args.ys, args.xs, feeds, dtype=args.dtype, eps=args.eps,
                             rtol=args.rtol, atol=args.atol, seed=args.seed, dim=args.dim, **kw)
    print(report, file=out)
    if report.ok:
        print("all gradients match", file=out)
        return 0
    bad = [r.name for r in report.results if not r.ok]
    print(f"MISMATCH: {', '.join(bad)}", file=out)
    return 1


def _cmd_convert(args, out) -> int:
    from .converters.tensorflow import convert
    from .runtime import save_model

    src = args.source
    if not os.path.exists(src):
        raise UsageError(f"{src}: no such file or directory")
    saved_model = os.path.isdir(src)
    if saved_model and not any(os.path.exists(os.path.join(src, f))
                               for f in ("saved_model.pb", "saved_model.pbtxt")):
        raise UsageError(f"{src}: a directory without saved_model.pb, not a SavedModel")
    if not saved_model:
        if args.signature is not None:
            raise UsageError("--signature: only a SavedModel directory has signatures")
        if not args.outputs:
            raise UsageError("--outputs: name the tensors to convert (e.g. --outputs y:0); a "
                             "GraphDef has no signature to take them from")
    model = convert(src, inputs=args.inputs, outputs=args.outputs, opset=args.opset,
                    allow_unranked=args.allow_unranked,
                    **({"signature": args.signature} if saved_model else {}))
    save_model(model, args.output)
    ins = ", ".join(i.name for i in model.graph.input)
    outs = ", ".join(o.name for o in model.graph.output)
    print(f"wrote {args.output} (inputs: {ins or 'none'}; outputs: {outs})", file=out)
    return 0


def ops_table(markdown: bool = False) -> str:
    """The supported-ops table, as ``onnxgrad ops`` prints it: the float inputs that get no
    gradient are named with the reason (integer and bool inputs never get one)."""
    from .registry import supported_ops
    from .rules.spec import NO_GRADIENT

    def none_for(op):
        by_reason: dict[str, list[str]] = {}
        for name, why in NO_GRADIENT.get(op, {}).items():
            by_reason.setdefault(why, []).append(name)
        return "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())

    rows = [(d or "ai.onnx", op, str(s), "-" if u is None else str(u), none_for(op))
            for d, op, s, u in supported_ops()]
    head = ("domain", "op", "since", "until", "float inputs without a gradient")
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|---|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
                     for r in [head, *rows])


def _cmd_ops(args, out) -> int:
    print(ops_table(args.markdown), file=out)
    return 0


# -- entry point -------------------------------------------------------------------------------
def _describe(exc: BaseException) -> str | None:
    """The one-line message for an error a user can cause, or None for an unexpected one."""
    if isinstance(exc, OnnxgradError):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename or exc}: no such file"
    if isinstance(exc, (ValueError, TypeError, KeyError, FloatingPointError)):
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        return str(msg)
    try:
        import onnx
        if isinstance(exc, onnx.checker.ValidationError):
            return f"the model is not valid ONNX: {str(exc).strip().splitlines()[0]}"
    except ImportError:  # pragma: no cover
        pass
    return None


_INPUTS = {"model": "the input model", "data": "the training data", "feeds": "the feeds",
           "resume": "the checkpoint resumed from", "source": "the TensorFlow graph"}
_OUTPUTS = {"output": "-o", "gradient": "--gradient", "checkpoint": "--checkpoint",
            "plot": "--plot"}


def _keep_inputs(args) -> None:
    """No output may name a file the command reads (the model and the files of its external
    weights, the data, the feeds) or another output: the run wrote over what it read, or one
    output over another, and exited 0. (--checkpoint may be the --resume file: training goes
    on writing the checkpoint it resumed from.)"""
    outs = [(flag, getattr(args, k)) for k, flag in _OUTPUTS.items()
            if isinstance(getattr(args, k, None), str)]
    if not outs:
        return
    from .errors import WriteError
    if getattr(args, "target", None) == "web":  # the step, and its model and manifest beside it
        from .training.webstep import paths
        outs += [("-o", p) for p in list(paths(args.output).values())[1:]]
    ins = [(k, getattr(args, k)) for k in _INPUTS if isinstance(getattr(args, k, None), str)]
    where = {k: os.path.realpath(p) for k, p in ins}
    from .storage import writable
    for _, o in outs:  # before any work: a run never writes some outputs and fails on another
        writable(o)
    for i, (flag, o) in enumerate(outs):
        real = os.path.realpath(o)
        for flag2, o2 in outs[i + 1:]:
            if real == os.path.realpath(o2):
                raise InvalidArgumentError(f"{flag} and {flag2} name the same file {o}: "
                                           "one would overwrite the other")
        for k, p in ins:
            if real == where[k] and not (k == "resume" and flag == "--checkpoint"):
                raise WriteError(o, f"it is {_INPUTS[k]} ({flag} would overwrite it); choose "
                                    "another file")
            if os.path.isdir(where[k]) and real.startswith(os.path.join(where[k], "")):
                raise WriteError(o, f"it is inside {_INPUTS[k]} {p} ({flag} would write into "
                                    "it); choose a file outside it")
    from .storage import keep_data_of
    keep_data_of(getattr(args, "model", None), [o for _, o in outs])


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (sys.argv[1:] when None); returns the exit status."""
    out = sys.stdout
    try:
        args = build_parser().parse_args(argv)
        if args.command is None:
            raise UsageError(f"give a command (see '{PROG} --help')")
        _keep_inputs(args)
        return args.func(args, out)
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else 0
    except BrokenPipeError:  # `onnxgrad ops | head`: the reader left; end quietly, as C tools do
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001  (one line, never a traceback)
        if os.environ.get("ONNXGRAD_DEBUG"):
            raise
        msg = _describe(exc)
        if msg is None:
            msg = (f"unexpected {type(exc).__name__}: {exc} "
                   "(set ONNXGRAD_DEBUG=1 for the traceback, and please report it)")
        msg = " ".join(str(msg).split())  # one line
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
