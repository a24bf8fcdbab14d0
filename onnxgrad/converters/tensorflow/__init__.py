"""TensorFlow GraphDef -> ONNX, including what other converters reject: TF1 while loops and conds
(Enter/Merge/Switch/NextIteration/Exit -> Loop/If), TensorArrays and stacks (-> ONNX sequences,
gradient arrays named ``<array>@<source>``) and the CudnnRNN family (-> onnxgrad's custom ops).

    from onnxgrad.converters.tensorflow import convert
    model = convert("frozen.pb", inputs=["x:0"], outputs=["y:0"])

Reading a GraphDef needs only protobuf (:mod:`.proto` carries the schema); TensorFlow itself is
needed only to freeze a SavedModel's variables.
"""
from .core import HANDLERS, convert
from .errors import ConversionError, ConversionWarning

__all__ = ["convert", "ConversionError", "ConversionWarning", "HANDLERS"]
