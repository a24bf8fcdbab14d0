"""The CudnnRNN op family in the custom domain ``onnxgrad``: params layout helpers
(:mod:`.params`), a NumPy reference (:mod:`.reference`), ONNX function bodies for the ops and
:func:`attach_functions` (:mod:`.ops`), and the gradient rule of the forward ops (:mod:`.grad`,
registered when imported)."""
from .ops import attach_functions, make_function, make_node, op_signature
from .params import canonical_to_params, layout, params_size, params_to_canonical
from .reference import dropout_mask, rnn_backward, rnn_forward

__all__ = ["params_size", "canonical_to_params", "params_to_canonical", "layout",
           "attach_functions", "make_function", "make_node", "op_signature", "rnn_forward",
           "rnn_backward", "dropout_mask"]
