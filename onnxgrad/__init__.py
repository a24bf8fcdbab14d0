"""onnxgrad: tf.gradients for ONNX models, runnable on a stock ONNX runtime."""
from .autodiff import AggregationMethod, GradientsResult, UnconnectedGradients, gradients
from .errors import NotDifferentiableError
from .lower import lower_gradient_ops
from .sequences import TensorArray
from . import rnn  # noqa: E402  (onnxgrad.rnn.params_size, ...)
from . import training  # noqa: E402
from .training import Trainer

__all__ = ["gradients", "GradientsResult", "AggregationMethod", "UnconnectedGradients",
           "NotDifferentiableError", "lower_gradient_ops", "TensorArray", "Trainer"]
__version__ = "0.1.0"
