"""onnxgrad: tf.gradients for ONNX models, runnable on a stock ONNX runtime.

The names below are imported on first use (PEP 562), so that the command line starts without
importing onnx, onnxruntime and the rule table, and an interrupt while they load is the
command's own ("interrupted", exit 130), not a traceback. ``onnxgrad.<submodule>`` (``check``,
``runtime``, ...) imports that submodule on first use too."""
from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from .errors import (ArgumentTypeError, CheckpointError, DataError, InvalidArgumentError,
                     InvalidModelError, ModelFileNotFoundError, ModelLoadError, NonFiniteError,
                     NonFiniteLossError, NotDifferentiableError, OnnxgradError, UnsupportedError,
                     WriteError)

if TYPE_CHECKING:  # what the lazy names are, for readers and type checkers
    from . import rnn, training  # noqa: F401
    from .autodiff import AggregationMethod, GradientsResult, UnconnectedGradients, gradients
    from .lower import lower_gradient_ops
    from .sequences import TensorArray
    from .training import Trainer

_LAZY = {"gradients": "autodiff", "GradientsResult": "autodiff",
         "AggregationMethod": "autodiff", "UnconnectedGradients": "autodiff",
         "lower_gradient_ops": "lower", "TensorArray": "sequences", "Trainer": "training"}

__all__ = ["gradients", "GradientsResult", "AggregationMethod", "UnconnectedGradients",
           "lower_gradient_ops", "TensorArray", "Trainer",
           # errors (onnxgrad.errors): one hierarchy under OnnxgradError
           "OnnxgradError", "InvalidArgumentError", "ArgumentTypeError", "ModelLoadError",
           "InvalidModelError", "ModelFileNotFoundError", "WriteError", "DataError",
           "CheckpointError", "NonFiniteError", "NonFiniteLossError", "UnsupportedError",
           "NotDifferentiableError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f".{name}", __name__):
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
