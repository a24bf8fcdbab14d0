"""Exceptions raised by onnxgrad: one hierarchy under :class:`OnnxgradError`.

Every error a user can provoke (a bad file, a bad name, a bad value, a fault while writing) is an
``OnnxgradError``. Each subclass also derives from the builtin exception a caller would expect
(ValueError, TypeError, FileNotFoundError, OSError, NotImplementedError, FloatingPointError), so
``except ValueError`` code written before this hierarchy keeps working. The command line prints
``str(error)`` of any of them as one line and exits with status 2.
"""


class OnnxgradError(Exception):
    """Base class of every error onnxgrad raises on purpose (a message that names the problem)."""


class InvalidArgumentError(OnnxgradError, ValueError):
    """An argument has a bad value (an unknown tensor name, a non-finite learning rate, ...)."""


class ArgumentTypeError(OnnxgradError, TypeError):
    """An argument has the wrong type (``xs=3``, ``name=None``)."""


class ModelLoadError(OnnxgradError, ValueError):
    """A file or bytes that are not a readable ONNX model (empty, truncated, not protobuf, or a
    model whose external data is missing)."""


class InvalidModelError(OnnxgradError, ValueError):
    """The model given is not one onnxgrad can work on: it fails onnx.checker, its opset or IR
    version is newer than the installed onnx knows, or it contradicts itself (a declared shape
    that shape inference disproves). The message names the tensor, node or version at fault."""


class ModelFileNotFoundError(OnnxgradError, FileNotFoundError):
    """An input file (a model, data, feeds, a checkpoint) does not exist."""

    def __init__(self, path, what: str = "file"):
        super().__init__(2, f"no such {what}", str(path))

    def __str__(self):
        return f"{self.filename}: {self.strerror}"


class WriteError(OnnxgradError, OSError):
    """Writing an output failed (disk full, no permission, ...). Nothing partial was left behind
    and an existing file at the destination is unchanged."""

    def __init__(self, path, reason: str, errno: int | None = None):
        super().__init__(f"{path}: cannot write ({reason}); nothing was written there")
        self.path, self.reason = str(path), reason
        if errno is not None:
            self.errno = errno


class DataError(OnnxgradError, ValueError):
    """Training data or feeds that do not fit the model (shape, dtype, NaN, a label out of
    range): the message names the array, and the row where there is one."""


class CheckpointError(OnnxgradError, ValueError):
    """A checkpoint that cannot be restored: not a checkpoint, truncated or corrupt (checksum), or
    made for another model (names, dtypes or shapes differ)."""


class NonFiniteError(OnnxgradError, FloatingPointError):
    """A NaN or infinite value where a finite one is needed (parameters to checkpoint or export)."""


class NonFiniteLossError(NonFiniteError):
    """The loss was NaN or infinite; ``step`` is the number of the step (1 first)."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"the loss is {loss} at step {step}: training stopped (the updates of "
                         f"step {step} were not applied; lower the learning rate, clip the "
                         "gradients or check the data)")
        self.step, self.loss = step, loss


class UnsupportedError(OnnxgradError, NotImplementedError):
    """A valid input that onnxgrad does not support yet (the message names the structure)."""


class NotDifferentiableError(UnsupportedError):
    """An op on a path from a y to an x has no gradient rule (or none for this use of it).

    Raised with the op type, domain, opset, node name and the path, so the fix
    (a rule, or the tensor to pass in ``stop_gradients``) is obvious. ``reason`` says why an op
    that has a rule cannot be differentiated here.
    """

    def __init__(self, op_type, domain, opset, node_name, path, reason=None):
        self.op_type, self.domain, self.opset, self.node_name, self.path = (
            op_type, domain, opset, node_name, list(path))
        self.reason = reason
        dom = domain or "ai.onnx"
        route = " -> ".join(self.path) if self.path else "?"
        what = (f"no gradient rule for op {op_type!r}" if reason is None else
                f"cannot differentiate op {op_type!r}")
        if reason is None and domain == "com.microsoft.nchwc":
            reason = ("a blocked-layout op that onnxruntime's optimizer writes for this CPU at "
                      "ORT_ENABLE_ALL: save the model at ORT_ENABLE_EXTENDED, whose "
                      "com.microsoft ops onnxgrad differentiates")
        why = "" if reason is None else f" ({reason})"
        super().__init__(
            f"{what} (domain {dom!r}, opset {opset}) at node {node_name!r}{why}, which lies on "
            f"the path {route}. If this input should be held constant, pass one of the tensors "
            f"on that path in stop_gradients.")


class DistributedError(OnnxgradError, RuntimeError):
    """Data-parallel training cannot go on: a rank died or hung (the message names it), the ranks
    disagree (model, data, checkpoint), or the process group could not be formed."""


class DeviceUnavailableError(OnnxgradError, RuntimeError):
    """The device asked for cannot be used here (device="cuda" where no CUDA session can be
    created); the message says what it needs."""


class MissingExtraError(OnnxgradError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


__all__ = ["OnnxgradError", "InvalidArgumentError", "ArgumentTypeError", "ModelLoadError",
           "InvalidModelError", "ModelFileNotFoundError", "WriteError", "DataError",
           "CheckpointError", "NonFiniteError", "NonFiniteLossError", "UnsupportedError",
           "NotDifferentiableError", "DistributedError", "DeviceUnavailableError",
           "MissingExtraError"]
