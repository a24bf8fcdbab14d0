"""CudnnRNNParamsSize, CudnnRNNParamsToCanonical(V2), CudnnRNNCanonicalToParams(V2): TF's
signatures (read from TensorFlow's OpDefs), the ONNX function bodies on onnxruntime against the
Python layout helpers (onnxgrad.rnn.params, themselves checked against torch in test_rnn.py), with
num_layers/num_units/input_size fed at run time, and their gradients."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import onnxgrad
from onnxgrad.rnn import canonical_to_params, layout, params_size, params_to_canonical
from onnxgrad.rnn.ops import TF_OPS, attach_functions, make_node, op_signature

ort = pytest.importorskip("onnxruntime")
MODES = ["lstm", "gru", "rnn_tanh", "rnn_relu"]
DIRS = ["unidirectional", "bidirectional"]


def session(m):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def model(nodes, ins, outs):
    g = helper.make_graph(nodes, "g", ins, outs)
    return attach_functions(helper.make_model(g, opset_imports=[
        helper.make_opsetid("", 18), helper.make_opsetid("onnxgrad", 1)], ir_version=10))


def sizes(L, H, I):  # noqa: E741
    return {"L": np.array(L, np.int32), "H": np.array(H, np.int32), "I": np.array(I, np.int32)}


SIZE_INS = [helper.make_tensor_value_info(n, TP.INT32, []) for n in "LHI"]


def test_signatures_are_tensorflows():
    tf_reg = pytest.importorskip("tensorflow.python.framework.op_def_registry")
    for op in TF_OPS:
        od, sig = tf_reg.get(op), op_signature(op)
        assert [a.name for a in od.input_arg] == sig["inputs"], op
        assert [a.name for a in od.output_arg] == sig["outputs"], op
        for a in list(od.input_arg) + list(od.output_arg):
            if a.number_attr:
                assert sig["variadic"][a.name] == a.number_attr, (op, a.name)
        tf_attrs = {a.name: a for a in od.attr if a.type != "type"}
        assert set(sig["attributes"]) - {"T", "S"} == set(tf_attrs), op
        for name, a in tf_attrs.items():
            if a.HasField("default_value"):
                v = a.default_value
                want = {"string": lambda: v.s.decode(), "int": lambda: v.i,
                        "float": lambda: v.f, "bool": lambda: int(v.b)}[a.type]()
                assert sig["attributes"][name] == want, (op, name)
            else:
                assert sig["attributes"][name] is None, (op, name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("direction", DIRS)
@pytest.mark.parametrize("input_mode", ["linear_input", "skip_input", "auto_select"])
def test_params_size_at_run_time(mode, direction, input_mode):
    s_types = [(TP.INT32, np.int32), (TP.INT64, np.int64)]
    for s_type, np_type in s_types:
        node = make_node("CudnnRNNParamsSize", ["L", "H", "I"], ["n"], rnn_mode=mode,
                         direction=direction, input_mode=input_mode, S=s_type)
        sess = session(model([node], SIZE_INS, [helper.make_tensor_value_info("n", s_type,
                                                                              [1])]))
        for L, H, I in [(1, 3, 3), (3, 4, 4), (2, 5, 7), (4, 2, 9)]:  # noqa: E741
            if input_mode == "skip_input" and H != I:
                continue
            got = sess.run(None, sizes(L, H, I))[0]
            assert got.dtype == np_type and got.shape == (1,)
            assert int(got[0]) == params_size(mode, L, H, I, direction, input_mode)


def _lists(mode, L, H, I, direction, input_mode):  # noqa: E741
    regions = layout(mode, L, H, I, direction, input_mode)
    nw = sum(r.kind == "weight" for r in regions)
    return nw, len(regions) - nw


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("direction", DIRS)
@pytest.mark.parametrize("v2,input_mode", [(False, "linear_input"), (True, "linear_input"),
                                           (True, "skip_input"), (True, "auto_select")])
def test_canonical_round_trip_matches_python_helpers(mode, direction, v2, input_mode):
    rng = np.random.default_rng(1)
    L, H = 2, 3
    I = H if input_mode != "linear_input" else 5  # noqa: E741
    resolved = "skip_input" if input_mode == "auto_select" else input_mode
    nw, nb = _lists(mode, L, H, I, direction, resolved)
    counts = dict(num_params_weights=nw, num_params_biases=nb) if v2 else dict(num_params=nw)
    sfx = "V2" if v2 else ""
    ws, bs = [f"w{k}" for k in range(nw)], [f"b{k}" for k in range(nb)]
    attrs = dict(rnn_mode=mode, direction=direction, input_mode=input_mode, **counts)
    to_c = make_node("CudnnRNNParamsToCanonical" + sfx, ["L", "H", "I", "p"], ws + bs, **attrs)
    # canonical inputs may have any shape with the right size: feed them flattened
    flat = [f"f{k}" for k in range(nw + nb)]
    to_p = make_node("CudnnRNNCanonicalToParams" + sfx, ["L", "H", "I"] + flat, ["q"], **attrs)
    P = params_size(mode, L, H, I, direction, resolved)
    m = model([to_c, to_p] + [helper.make_node("Reshape", [n, "m1"], [f]) for n, f in
                              zip(ws + bs, flat)],
              SIZE_INS + [helper.make_tensor_value_info("p", TP.DOUBLE, [P])],
              [helper.make_tensor_value_info(n, TP.DOUBLE, r.shape) for n, r in zip(
                  ws + bs, [r for r in layout(mode, L, H, I, direction, resolved)
                            if r.kind == "weight"] + [r for r in layout(
                                mode, L, H, I, direction, resolved) if r.kind == "bias"])]
              + [helper.make_tensor_value_info("q", TP.DOUBLE, [P])])
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "m1"))
    p = rng.standard_normal(P)
    out = session(m).run(None, {**sizes(L, H, I), "p": p})
    want_w, want_b = params_to_canonical(p, mode, L, H, I, direction, resolved)
    for got, want in zip(out[:-1], want_w + want_b):
        assert got.shape == want.shape and np.array_equal(got, want)
    assert np.array_equal(out[-1], canonical_to_params(want_w, want_b, mode, L, H, I, direction,
                                                       resolved))

    # gradients: each other's (checked against the helpers, the linear maps' own definitions)
    cot = {n: rng.standard_normal(w.shape) for n, w in zip(ws + bs, want_w + want_b)}
    cot_q = rng.standard_normal(P)
    res = onnxgrad.gradients(m, ws[:2] + bs[-1:] + ["q"], ["p"],
                             grad_ys=[f"g_{n}" for n in ws[:2] + bs[-1:]] + ["g_q"])
    feeds = {**sizes(L, H, I), "p": p, "g_q": cot_q,
             **{f"g_{n}": cot[n] for n in ws[:2] + bs[-1:]}}
    got = session(res.model).run(res.grads, feeds)[0]
    zero = {n: np.zeros_like(v) for n, v in cot.items()}
    sel = {**zero, **{n: cot[n] for n in ws[:2] + bs[-1:]}}
    want = canonical_to_params([sel[n] for n in ws], [sel[n] for n in bs], mode, L, H, I,
                               direction, resolved)
    np.testing.assert_allclose(got, want + cot_q, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("v2", [False, True])
def test_canonical_to_params_gradient_keeps_input_shapes(v2):
    rng = np.random.default_rng(2)
    mode, L, H, I, direction = "gru", 2, 3, 4, "bidirectional"  # noqa: E741
    ws, bs = params_to_canonical(rng.standard_normal(params_size(mode, L, H, I, direction)),
                                 mode, L, H, I, direction)
    names = [f"w{k}" for k in range(len(ws))] + [f"b{k}" for k in range(len(bs))]
    shaped = [w.T.copy() if k % 2 else w for k, w in enumerate(ws)] + \
        [b.reshape(1, -1) for b in bs]  # other shapes with the same sizes, as TF allows
    counts = dict(num_params_weights=len(ws), num_params_biases=len(bs)) if v2 else \
        dict(num_params=len(ws))
    node = make_node("CudnnRNNCanonicalToParams" + ("V2" if v2 else ""),
                     ["L", "H", "I"] + names, ["q"], rnn_mode=mode, direction=direction, **counts)
    m = model([node], SIZE_INS + [helper.make_tensor_value_info(n, TP.DOUBLE, a.shape)
                                  for n, a in zip(names, shaped)],
              [helper.make_tensor_value_info("q", TP.DOUBLE, ["n"])])
    feeds = {**sizes(L, H, I), **dict(zip(names, shaped))}
    q = session(m).run(None, feeds)[0]
    np.testing.assert_array_equal(q, np.concatenate([a.reshape(-1) for a in shaped]))
    g = rng.standard_normal(q.shape)
    res = onnxgrad.gradients(m, "q", names, grad_ys="g_q")
    got = session(res.model).run(res.grads, {**feeds, "g_q": g})
    gw, gb = params_to_canonical(g, mode, L, H, I, direction)
    for a, want, like in zip(got, gw + gb, shaped):
        assert a.shape == like.shape
        np.testing.assert_array_equal(a.reshape(-1), want.reshape(-1))


def test_wrong_sizes_fail_by_name_and_static_errors():
    mode, L, H, I = "lstm", 2, 3, 4  # noqa: E741
    nw, nb = _lists(mode, L, H, I, "unidirectional", "linear_input")
    outs = [f"o{k}" for k in range(nw + nb)]
    node = make_node("CudnnRNNParamsToCanonicalV2", ["L", "H", "I", "p"], outs,
                     num_params_weights=nw, num_params_biases=nb)
    m = model([node], SIZE_INS + [helper.make_tensor_value_info("p", TP.FLOAT, ["n"])],
              [helper.make_tensor_value_info(o, TP.FLOAT, None) for o in outs])
    sess = session(m)
    p = np.zeros(params_size(mode, L, H, I), np.float32)
    sess.run(None, {**sizes(L, H, I), "p": p})
    for bad in [sizes(L + 1, H, I), sizes(L, H + 1, I)]:
        with pytest.raises(Exception, match="params_must_have_CudnnRNNParamsSize_elements"):
            sess.run(None, {**bad, "p": p})
    with pytest.raises(ValueError, match="7 weights with 16 biases"):
        model([make_node("CudnnRNNParamsToCanonicalV2", ["L", "H", "I", "p"], outs[:23],
                         num_params_weights=7, num_params_biases=16)], SIZE_INS, [])
    with pytest.raises(NotImplementedError, match="num_proj"):
        model([make_node("CudnnRNNParamsSize", ["L", "H", "I"], ["n"], num_proj=2)], SIZE_INS,
              [])
