"""Running models: onnxruntime sessions with deliberate provider choice and quiet logs, with
onnx's reference evaluator as the fallback for what onnxruntime has no kernel for."""
from __future__ import annotations

import functools

import numpy as np
import onnx

from .errors import DeviceUnavailableError, UnsupportedError
from .inference import graphs_of, node_subgraphs
# files (atomic writes, external data past 2 GB) live in storage; these names stay here too
from .storage import MAX_IR_VERSION, atomic_path, load_model, model_bytes, save_model  # noqa: F401


def ort_module():
    """onnxruntime, imported with its default logger quiet."""
    import onnxruntime as ort
    ort.set_default_logger_severity(3)  # no CUDA-missing banners for CPU-only users
    return ort


@functools.lru_cache(maxsize=None)  # (a probe makes a CUDA session: asked once per process)
def cuda_available() -> bool:
    """True only when a CUDA session can actually be created (libraries present, GPU visible)."""
    ort = ort_module()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    so = session_options()
    so.log_severity_level = 4
    ort.set_default_logger_severity(4)  # a missing CUDA library is an answer here, not an error
    try:
        s = ort.InferenceSession(m.SerializeToString(), so,
                                 providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    except Exception:  # noqa: BLE001
        return False
    finally:
        ort.set_default_logger_severity(3)
    return "CUDAExecutionProvider" in s.get_providers()


# float32 means float32: onnxruntime's CUDA provider runs float32 MatMul/Conv in TF32 by
# default (10-bit mantissa), which put a CudnnRNN gradient 4 % off its CPU value on an H200
# (1e-7 with TF32 off) and flips ReLU masks and the sign of first Adam steps near zero
CUDA_OPTIONS = {"use_tf32": "0"}


def resolve(device: str = "auto") -> str:
    """"cpu" or "cuda": the device ``device`` ("auto", "cpu", "cuda") runs on here."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r} is not one of 'auto', 'cpu', 'cuda'")
    if device == "cpu" or (device == "auto" and not cuda_available()):
        return "cpu"
    if not cuda_available():
        raise DeviceUnavailableError(
            "device='cuda' was asked for, but onnxruntime cannot create a CUDA session here "
            f"(available providers: {', '.join(ort_module().get_available_providers())}); it "
            "needs onnxruntime-gpu, the CUDA and cuDNN libraries it was built for and a visible "
            "GPU. Use device='auto' (CUDA when it can be created, else CPU) or 'cpu'")
    return "cuda"


def providers(device: str = "auto") -> list:
    """Execution providers (with their options) for ``device`` in "auto", "cpu", "cuda"."""
    if resolve(device) == "cpu":
        return ["CPUExecutionProvider"]
    return [("CUDAExecutionProvider", dict(CUDA_OPTIONS)), "CPUExecutionProvider"]


def session_options(threads: int | None = None):
    """SessionOptions with quiet logs (and ``threads`` intra-op threads when given)."""
    so = ort_module().SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return so


# onnxruntime's GatherToSliceFusion rewrites Range -> Gather as a Slice over Range's bounds,
# which reads a negative bound as counted from the end: Gather(x, Range(n - 1, -1, -1)) came
# out empty (onnxruntime 1.31); its Pad_Fusion folds a Pad of zeros into a MaxPool, whose pads
# are -inf (ort_fusions.py); its NoopElimination compares a float64 constant with 1 (Mul, Div)
# or 0 (Add, Sub) after casting it to float32, so it removes x * (1 - 1e-8) from a float64
# graph (Adam with beta1 = 1e-8 stepped 1e-8 too far; tests/test_optimizer_space.py). Every
# session onnxgrad makes runs without them (NoopElimination removed no node from the training
# steps of bench/train_step.py's twelve exported models: leaving it out costs them nothing).
UNSAFE_OPTIMIZERS = ["GatherToSliceFusion", "Pad_Fusion", "NoopElimination"]
# Its MatMulScaleFusion folds a Mul or Div by a scalar constant beside a MatMul into FusedMatMul's
# float32 alpha whatever the MatMul's type: a float64 graph's scale is rounded to float32 (the
# gradient of Attention's 1/sqrt(8) came out 4e-8 off). Sessions of a model that holds float64
# run without it too; float32 models keep it (their scale is a float32 already).
FLOAT64_UNSAFE = ["MatMulScaleFusion"]


def unsafe_optimizers(model) -> list[str]:
    """The graph optimizers onnxgrad's sessions of ``model`` (a ModelProto, bytes or a path)
    run without."""
    m = load_model(model, load_external_data=False)
    return UNSAFE_OPTIMIZERS + (FLOAT64_UNSAFE if _holds_float64(m) else [])


def _holds_float64(m: onnx.ModelProto) -> bool:
    dbl = onnx.TensorProto.DOUBLE
    graphs = graphs_of(m.graph) + [g for f in m.functions for n in f.node
                                   for sub in node_subgraphs(n) for g in graphs_of(sub)]
    nodes = [n for g in graphs for n in g.node] + [n for f in m.functions for n in f.node]
    values = [v for g in graphs for v in (*g.input, *g.output, *g.value_info)]
    return (any(v.type.tensor_type.elem_type == dbl for v in values)
            or any(t.data_type == dbl for g in graphs for t in g.initializer)
            or any(a.type == onnx.AttributeProto.TENSOR and a.t.data_type == dbl
                   or a.name == "to" and a.i == dbl for n in nodes for a in n.attribute))


def session(model, device: str = "cpu", threads: int | None = None, options=None):
    """An onnxruntime InferenceSession for a ModelProto (or bytes / path)."""
    ort = ort_module()
    where = providers(device)
    # (a file is read once without its weights to look: most models have nothing to rewrite
    # and go to onnxruntime as they came, external data past 2 GB included)
    light = load_model(model, load_external_data=False)
    if where[0] != "CPUExecutionProvider":
        from .cuda_forms import for_cuda, has_forms
        if has_forms(light):
            model = light = for_cuda(load_model(model))
    unsafe = unsafe_optimizers(light)
    if isinstance(model, onnx.ModelProto):
        model = model_bytes(model)  # (IR 14, onnx's default, pinned to what onnxruntime reads)
    try:
        return ort.InferenceSession(model, options or session_options(threads),
                                    providers=where, disabled_optimizers=unsafe)
    except Exception:  # noqa: BLE001  (onnxruntime's own classes)
        check_runs_opset(light)  # (its error names the opsets; onnxruntime's is a paragraph)
        raise


@functools.lru_cache(maxsize=None)
def newest_opset() -> int:
    """The newest ai.onnx opset the installed onnxruntime loads (onnx may know newer ones)."""
    ort, helper = ort_module(), onnx.helper
    for v in range(onnx.defs.onnx_opset_version(), 0, -1):
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
        g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
        ir = min(helper.find_min_ir_version_for([helper.make_opsetid("", v)]), MAX_IR_VERSION)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", v)], ir_version=ir)
        try:
            ort.InferenceSession(m.SerializeToString(), session_options(),
                                 providers=["CPUExecutionProvider"])
            return v
        except Exception:  # noqa: BLE001  (onnxruntime's own error classes)
            continue
    return 0


def check_runs_opset(model: onnx.ModelProto, what: str = "the model") -> None:
    """An UnsupportedError for a model whose ai.onnx opset onnxruntime does not load (what
    onnxgrad writes for onnxruntime to run, a training step, must load there)."""
    from .inference import model_opset
    opset, top = model_opset(model), newest_opset()
    if opset > top:
        raise UnsupportedError(f"{what} imports ai.onnx opset {opset}; onnxruntime "
                               f"{ort_module().__version__} runs up to opset {top}: export it at "
                               f"opset {top} or older")


def runner(model: onnx.ModelProto, prefer: str = "ort", fallback: bool = True):
    """A function ``(feeds, outputs=None) -> list of arrays`` for ``model``, built once.

    onnxruntime CPU at the basic optimisation level (its fusions store float64 scales in float32,
    which is wrong for numerical checks); onnx.reference where onnxruntime has no kernel
    (float64 variants of some ops, for instance) or when ``prefer`` is "reference". Some kernels
    load but refuse their types only when run ("LSTM operator does not support double yet"):
    the first run that fails so switches this runner to onnx.reference for good. With
    ``fallback=False`` onnxruntime's own errors (loading or running) are raised instead.

    The function's ``on_reference()`` tells the reason onnx.reference runs it (onnxruntime's
    error, or that it was preferred), or None while onnxruntime does."""
    why = "preferred"
    if prefer == "ort":
        ort = ort_module()
        so = session_options()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.log_severity_level = 4  # a failure raises; its log line would only alarm a fallback
        try:
            s = ort.InferenceSession(model_bytes(model), so,
                                     providers=["CPUExecutionProvider"],
                                     disabled_optimizers=unsafe_optimizers(model))
        except Exception as exc:  # noqa: BLE001  (NOT_IMPLEMENTED kernels: use the reference)
            if not fallback:
                raise
            why = _first_line(exc)
        else:
            if not fallback:
                return lambda feeds, outputs=None: s.run(outputs, _arrays(feeds))
            return _falling_back(s, model)
    run = _reference(model)
    run.on_reference = lambda: why
    return run


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _falling_back(s, model):
    """``s.run``, or onnx.reference from the first run that onnxruntime fails with a kernel
    error (not InvalidArgument: bad feeds are the caller's to fix). When the reference fails
    too, onnxruntime's error is the one raised, as it was before the fallback."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state
    kernel_errors = (state.RuntimeException, state.NotImplemented, state.Fail, state.EPFail)
    ref = []

    def run(feeds, outputs=None):
        if not ref:
            try:
                return s.run(outputs, _arrays(feeds))
            except kernel_errors as exc:
                try:
                    fall = _reference(model)
                    out = fall(feeds, outputs)
                except Exception:  # noqa: BLE001
                    raise exc from None
                ref.append((fall, _first_line(exc)))
                return out
        return ref[0][0](feeds, outputs)
    run.on_reference = lambda: ref[0][1] if ref else None
    return run


def _reference(model: onnx.ModelProto):
    from onnx.reference import ReferenceEvaluator
    model = _upgraded(model)
    if model.functions:  # onnx.reference (1.23) fails on a function that calls one listed
        import onnx.inliner  # after it, and on attributes given by reference to some ops
        model = onnx.inliner.inline_local_functions(model)
    ref = ReferenceEvaluator(model, new_ops=_exact_ops())

    def run(feeds, outputs=None):
        return [np.asarray(r) for r in ref.run(outputs, _arrays(feeds))]
    return run


def _upgraded(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` at opset 13 or newer where it is older: onnx.reference computes many ops by
    their newest definition whatever the opset (Softmax-11 along ``axis`` alone, not over the
    dims it coerces to 2-D; Resize-10 with half-pixel coordinates), and refuses others
    (Upsample, Concat-1 without ``axis``). The upgrade is gradients()'s own, checked against
    onnxruntime at the old opsets (tests/test_versions.py)."""
    from .inference import model_opset
    from .registry import MIN_OPSET
    if model_opset(model) >= MIN_OPSET or \
            not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        return model
    from .errors import UnsupportedError
    from .versions import convert_version
    try:
        return convert_version(model, MIN_OPSET)
    except UnsupportedError:  # (the reference may still run it as it is)
        return model


def _arrays(feeds):
    return {k: np.asarray(v) for k, v in feeds.items()}


def run(model: onnx.ModelProto, feeds: dict, outputs=None, prefer: str = "ort") -> list:
    """Run ``model`` once (see :func:`runner`)."""
    return runner(model, prefer)(feeds, outputs)


@functools.lru_cache(maxsize=None)
def _exact_ops():
    """Reference kernels made exact where onnx.reference approximates (its Erf is off by 1e-8,
    which finite differences with a 1e-6 step turn into a 1% error)."""
    import math

    from onnx.reference.op_run import OpRun

    class Erf(OpRun):
        def _run(self, x):
            return (np.vectorize(math.erf, otypes=[x.dtype])(x),)

    class Gelu(OpRun):  # onnx.reference expands it into its own float32 Erf
        def _run(self, x, approximate="none"):
            if approximate == "tanh":
                t = np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))
                return ((0.5 * x * (1 + t)).astype(x.dtype),)
            erf = np.vectorize(math.erf, otypes=[x.dtype])
            return ((0.5 * x * (1 + erf(x / np.sqrt(2)))).astype(x.dtype),)

    class Mean(OpRun):  # onnx.reference's Mean does not broadcast a smaller first input
        def _run(self, *xs):
            return ((sum(np.broadcast_arrays(*xs)) / len(xs)).astype(xs[0].dtype),)

    class LpNormalization(OpRun):  # onnx.reference's p=1 divides by sum(x), not sum(|x|)
        def _run(self, x, axis=-1, p=2):
            norm = np.sum(np.abs(x) ** p, axis=axis, keepdims=True) ** (1.0 / p)
            return (np.where(norm == 0, 0, x / np.where(norm == 0, 1, norm)).astype(x.dtype),)

    class LRN(OpRun):  # onnx.reference's sums the squares over the batch axis where N != C
        def _run(self, x, alpha=1e-4, beta=0.75, bias=1.0, size=1):
            sq, c = np.square(x), x.shape[1]
            lo, hi = (size - 1) // 2, size // 2  # floor((size - 1) / 2), ceil((size - 1) / 2)
            total = np.stack([sq[:, max(0, i - lo):i + hi + 1].sum(axis=1) for i in range(c)], 1)
            return ((x / (bias + alpha / size * total) ** beta).astype(x.dtype),)

    class MeanVarianceNormalization(OpRun):  # its function body adds a float32 epsilon
        def _run(self, x, axes=(0, 2, 3)):
            mean = x.mean(axis=tuple(axes), keepdims=True)
            std = np.sqrt((x * x).mean(axis=tuple(axes), keepdims=True) - mean * mean)
            return (((x - mean) / (std + 1e-9)).astype(x.dtype),)

    from onnx.reference.ops.op_conv_transpose import ConvTranspose as _ConvTranspose

    class ConvTranspose(_ConvTranspose):
        """onnx.reference's mishandles group > 1 and output_shape without auto_pad SAME: here
        it runs group by group with no pads, and its full output is cropped or zero-extended
        to the window the spec's pads / output_shape / auto_pad name."""

        def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None,
                 kernel_shape=None, output_padding=None, output_shape=None, pads=None,
                 strides=None):  # (onnx.reference passes the attributes _run names)
            nsp = X.ndim - 2
            auto = auto_pad.decode() if isinstance(auto_pad, bytes) else (auto_pad or "NOTSET")
            s, d = list(strides or [1] * nsp), list(dilations or [1] * nsp)
            op = list(output_padding or [0] * nsp)
            ek = [(k - 1) * di + 1 for k, di in zip(W.shape[2:], d)]
            full = [si * (xi - 1) + o + e for si, xi, o, e in zip(s, X.shape[2:], op, ek)]
            if output_shape is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
                out = (list(output_shape)[-nsp:] if output_shape is not None
                       else [xi * si for xi, si in zip(X.shape[2:], s)])
                total = [max(0, f - o) for f, o in zip(full, out)]
                begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in total]
            else:
                p = list(pads or [0] * 2 * nsp) if auto == "NOTSET" else [0] * 2 * nsp
                begin = p[:nsp]
                out = [f - a - b for f, a, b in zip(full, p[:nsp], p[nsp:])]
            g = group or 1
            parts = [super(ConvTranspose, self)._run(
                xg, wg, None, auto_pad="NOTSET", dilations=d, group=1, kernel_shape=None,
                output_padding=[0] * nsp, output_shape=None, pads=[0] * (2 * nsp), strides=s)[0]
                for xg, wg in zip(np.split(X, g, axis=1), np.split(W, g, axis=0))]
            y = np.concatenate(parts, axis=1)
            big = np.zeros(y.shape[:2] + tuple(b + o + f for b, o, f in zip(begin, out, full)),
                           y.dtype)
            big[(slice(None), slice(None)) + tuple(slice(0, n) for n in y.shape[2:])] = y
            y = big[(slice(None), slice(None)) + tuple(slice(b, b + o)
                                                       for b, o in zip(begin, out))]
            if B is not None:
                y = y + B.reshape((1, -1) + (1,) * nsp)
            return (np.ascontiguousarray(y).astype(X.dtype),)

    return [Erf, Gelu, Mean, LpNormalization, LRN, MeanVarianceNormalization, ConvTranspose]
