"""onnxgrad: tf.gradients for ONNX models, runnable on a stock ONNX runtime."""
from .autodiff import AggregationMethod, GradientsResult, UnconnectedGradients, gradients
from .errors import (ArgumentTypeError, CheckpointError, DataError, InvalidArgumentError,
                     InvalidModelError, ModelFileNotFoundError, ModelLoadError, NonFiniteError,
                     NonFiniteLossError, NotDifferentiableError, OnnxgradError, UnsupportedError,
                     WriteError)
from .lower import lower_gradient_ops
from .sequences import TensorArray
from . import rnn  # noqa: E402  (onnxgrad.rnn.params_size, ...)
from . import training  # noqa: E402
from .training import Trainer

__all__ = ["gradients", "GradientsResult", "AggregationMethod", "UnconnectedGradients",
           "lower_gradient_ops", "TensorArray", "Trainer",
           # errors (onnxgrad.errors): one hierarchy under OnnxgradError
           "OnnxgradError", "InvalidArgumentError", "ArgumentTypeError", "ModelLoadError",
           "InvalidModelError", "ModelFileNotFoundError", "WriteError", "DataError",
           "CheckpointError", "NonFiniteError", "NonFiniteLossError", "UnsupportedError",
           "NotDifferentiableError"]
__version__ = "0.1.0"
