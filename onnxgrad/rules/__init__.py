"""Gradient rules, one module per op family; importing this package registers them all."""
from . import (activations, attention, control, conv, function, linalg, losses,  # noqa: F401
               math, norm, optional, reduce, sequence, shape, signal, vision)
from ..rnn import grad as _rnn  # noqa: F401  (the CudnnRNN family, domain "onnxgrad")
