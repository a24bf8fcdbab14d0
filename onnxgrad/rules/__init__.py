"""Gradient rules, one module per op family; importing this package registers them all."""
from . import (activations, control, conv, linalg, losses, math, norm, reduce,  # noqa: F401
               sequence, shape)
from ..rnn import grad as _rnn  # noqa: F401  (the CudnnRNN family, domain "onnxgrad")
