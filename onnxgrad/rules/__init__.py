"""Gradient rules, one module per op family; importing this package registers them all."""
from . import (activations, control, conv, function, linalg, losses, math, norm,  # noqa: F401
               reduce, sequence, shape, vision)
from ..rnn import grad as _rnn  # noqa: F401  (the CudnnRNN family, domain "onnxgrad")
