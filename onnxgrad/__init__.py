"""onnxgrad: tf.gradients for ONNX models, runnable on a stock ONNX runtime."""
from .autodiff import AggregationMethod, GradientsResult, UnconnectedGradients, gradients
from .errors import NotDifferentiableError

__all__ = ["gradients", "GradientsResult", "AggregationMethod", "UnconnectedGradients",
           "NotDifferentiableError"]
__version__ = "0.1.0"
