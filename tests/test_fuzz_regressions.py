"""Focused regressions for what the gradient fuzzer (tests/test_fuzz.py, bench/fuzz.py) found,
one test per class, each fixed at its root."""
import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad.runtime import session
from util import assert_gradients, make_model, op_model


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


# onnx 1.23 infers STFT's output without onesided as two-sided ([.., 16, ..] here: the runtime
# gives 9); onnxgrad wrote the onesided=1 it adds for its own inference into the forward node,
# so the result contradicted the declared output type and failed the checker
def test_stft_keeps_its_node_and_declared_types():
    def model(**attrs):
        node = onnx.helper.make_node("STFT", ["x", "step", "", "length"], ["y"], **attrs)
        return make_model([node], {"x": (np.float64, [1, 32, 1])}, ["y"],
                          inits={"step": np.array(8), "length": np.array(16)})

    m, explicit = model(), model(onesided=1)  # the same op: onesided defaults to 1
    assert [d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim] == [1, 3, 16, 2]
    res = onnxgrad.gradients(m, "y", "x")
    onnx.checker.check_model(res.model, full_check=True)
    assert res.model.graph.node[0] == m.graph.node[0]
    assert_gradients(explicit, "y", "x")
    x = np.random.default_rng(0).standard_normal((1, 32, 1))
    want = onnxgrad.gradients(explicit, "y", "x")
    np.testing.assert_allclose(session(res.model).run(res.grads, {"x": x})[0],
                               session(want.model).run(want.grads, {"x": x})[0], rtol=1e-12)
