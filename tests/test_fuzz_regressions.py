"""Focused regressions for what the gradient fuzzer (tests/test_fuzz.py, bench/fuzz.py) found,
one test per class, each fixed at its root."""
import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad.runtime import session
from util import op_model


# a static element count of zero (an empty input) divided by: ReduceMean, GlobalAveragePool and
# the mean losses raised ZeroDivisionError while building; the gradient of an empty x is empty.
# onnxruntime runs the empty ReduceMean; it refuses the other two forwards themselves (zero
# spatial size; a Reshape with -1 over zero elements), so those are built and checked only
@pytest.mark.parametrize("shape,attrs,inits", [
    ([2, 0, 3], {"keepdims": 0}, {"axes": np.array([1])}),
    ([0, 3], {}, {}),
])
def test_empty_reduce_mean(shape, attrs, inits):
    m = op_model("ReduceMean", {"x": (np.float32, shape)}, inits=inits, **attrs)
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    (g,) = session(res.model).run(res.grads, {"x": np.zeros(shape, np.float32)})
    assert g.shape == tuple(shape)


@pytest.mark.parametrize("op,inputs", [
    ("GlobalAveragePool", {"x": (np.float32, [2, 3, 0])}),
    ("SoftmaxCrossEntropyLoss", {"x": (np.float32, [0, 3]), "labels": (np.int64, [0])}),
])
def test_empty_mean_builds(op, inputs):
    m = op_model(op, inputs)
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    grad = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(res.model).graph.output}
    dims = grad[res.grads[0]].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == inputs["x"][1]
