from ...errors import OnnxgradError


class ConversionError(OnnxgradError, ValueError):
    """A TensorFlow graph that cannot be converted; the message names the node and the reason."""


class ConversionWarning(UserWarning):
    """Converted, with a caveat the message states (an output declared without a shape)."""
