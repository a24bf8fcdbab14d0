"""Gradient rules, one module per op family; importing this package registers them all."""
from . import (activations, attention, contrib, control, conv, function, linalg,  # noqa: F401
               losses, math, norm, optional, reduce, sequence, shape, signal, vision)
from ..rnn import grad as _rnn  # noqa: F401  (the CudnnRNN family, domain "onnxgrad")
