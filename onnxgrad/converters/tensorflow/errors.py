from ...errors import OnnxgradError


class ConversionError(OnnxgradError, ValueError):
    """A TensorFlow graph that cannot be converted; the message names the node and the reason."""
