"""onnxgrad: tf.gradients for ONNX models, runnable on a stock ONNX runtime."""
from .autodiff import AggregationMethod, GradientsResult, UnconnectedGradients, gradients
from .errors import NotDifferentiableError
from . import rnn  # noqa: E402  (onnxgrad.rnn.params_size, ...)

__all__ = ["gradients", "GradientsResult", "AggregationMethod", "UnconnectedGradients",
           "NotDifferentiableError"]
__version__ = "0.1.0"
