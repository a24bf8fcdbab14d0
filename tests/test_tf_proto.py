"""onnxgrad.converters.tensorflow.proto: TensorFlow's GraphDef/SavedModel schema without TensorFlow.
TensorFlow (where installed) writes graphs, functions and SavedModels; ours must read them back
exactly as TF's own generated classes and ``tf.make_ndarray`` do."""
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from google.protobuf import text_format

from onnxgrad.converters.tensorflow import proto as P


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow", reason="TensorFlow is the oracle for the TF schema")


def _tp(dtype, shape, **vals):
    t = P.TensorProto(dtype=P.DT[dtype], **vals)
    for d in shape:
        t.tensor_shape.dim.add(size=d)
    return t


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    if a.dtype == object:
        assert a.tolist() == b.tolist()
    else:  # bitwise: NaNs and -0.0 included
        assert a.tobytes() == b.tobytes(), (a, b)


# --------------------------------------------------------------------------- without TensorFlow
def test_import_does_not_load_tensorflow():
    code = ("import sys; from onnxgrad.converters.tensorflow import proto; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; "
            "print(proto.GraphDef.DESCRIPTOR.full_name)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "onnxgrad.tf.GraphDef"


def test_messages_maps_and_oneofs():
    n = P.NodeDef(name="c", op="Const", input=["a", "^b"])
    n.attr["dtype"].type = P.DT["DT_FLOAT"]
    n.attr["value"].tensor.CopyFrom(_tp("DT_FLOAT", [2], float_val=[1.0, 2.0]))
    n.attr["l"].list.i.extend([1, 2])
    n.attr["f"].func.name = "fn"
    n.attr["f"].func.attr["T"].type = P.DT["DT_INT32"]
    g = P.GraphDef(node=[n])
    g.versions.producer = 1234
    g2 = P.GraphDef.FromString(g.SerializeToString())
    assert g2 == g
    a = g2.node[0].attr
    kinds = [a[k].WhichOneof("value") for k in ("dtype", "value", "l", "f")]
    assert kinds == ["type", "tensor", "list", "func"]
    assert "type: DT_FLOAT" in text_format.MessageToString(a["dtype"])  # enum names as in TF
    fd = P.FunctionDef()
    fd.ret["y"] = "add:z:0"
    fd.arg_attr[0].attr["_output_shapes"].list.shape.add().unknown_rank = True
    assert P.FunctionDef.FromString(fd.SerializeToString()) == fd


def test_shape_of():
    s = P.TensorShapeProto()
    assert s.unknown_rank is False and P.shape_of(s) == []
    s.dim.add(size=-1)
    s.dim.add(size=3)
    assert P.shape_of(s) == [None, 3]
    assert P.shape_of(P.TensorShapeProto(unknown_rank=True)) is None


@pytest.mark.parametrize("tensor, expected", [
    (_tp("DT_FLOAT", [], float_val=[2.5]), np.float32(2.5)),
    (_tp("DT_FLOAT", [2, 3], float_val=[1, 2]), np.array([[1, 2, 2], [2, 2, 2]], np.float32)),
    (_tp("DT_INT32", [4]), np.zeros(4, np.int32)),                      # no values: zeros
    (_tp("DT_INT64", [0, 3]), np.zeros((0, 3), np.int64)),              # empty
    (_tp("DT_UINT8", [3], int_val=[255, 7]), np.array([255, 7, 7], np.uint8)),
    (_tp("DT_UINT64", [2], uint64_val=[2**64 - 1]), np.array([2**64 - 1] * 2, np.uint64)),
    (_tp("DT_BOOL", [3], bool_val=[False, True]), np.array([False, True, True])),
    (_tp("DT_HALF", [2], half_val=[0x3C00, 0xC000]), np.array([1, -2], np.float16)),
    (_tp("DT_BFLOAT16", [3], half_val=[0x3F80]), np.ones(3, ml_dtypes.bfloat16)),
    (_tp("DT_COMPLEX64", [2], scomplex_val=[1, 2]), np.array([1 + 2j] * 2, np.complex64)),
    (_tp("DT_STRING", [3], string_val=[b"a", b"bc"]), np.array([b"a", b"bc", b"bc"], object)),
    (_tp("DT_STRING", [2]), np.array([b"", b""], object)),
    (_tp("DT_INT4", [3], int_val=[-8, 7]), np.array([-8, 7, 7], ml_dtypes.int4)),
    (_tp("DT_FLOAT8_E4M3FN", [2], float8_val=b"\x38"), np.ones(2, ml_dtypes.float8_e4m3fn)),
    (_tp("DT_DOUBLE", [2, 2], tensor_content=np.arange(4.0).tobytes()), np.arange(4.0).reshape(2, 2)),
    (_tp("DT_FLOAT_REF", [], float_val=[1]), np.float32(1)),           # reference type -> base
])
def test_tensor_to_numpy(tensor, expected):
    _same(P.tensor_to_numpy(tensor), expected)


def test_tensor_to_numpy_errors():
    with pytest.raises(ValueError, match="DT_RESOURCE"):
        P.tensor_to_numpy(_tp("DT_RESOURCE", []))
    with pytest.raises(ValueError, match="holds 3 values"):
        P.tensor_to_numpy(_tp("DT_FLOAT", [2], float_val=[1, 2, 3]))
    with pytest.raises(ValueError, match="tensor_content holds 2"):
        P.tensor_to_numpy(_tp("DT_FLOAT", [3], tensor_content=np.ones(2, np.float32).tobytes()))
    with pytest.raises(ValueError, match="not fully known"):
        P.tensor_to_numpy(_tp("DT_FLOAT", [-1]))
    assert P.dtype_name(77) == "DataType(77)" and P.dtype_name(119) == "DT_HALF_REF"


def test_load_graph_def_sources(tmp_path):
    g = P.GraphDef(node=[P.NodeDef(name="x", op="Placeholder")])
    (tmp_path / "g.pb").write_bytes(g.SerializeToString())
    extra = "node { name: 'y' op: 'Z' future_field: 3 }"  # a field this schema does not know
    (tmp_path / "g.pbtxt").write_text(text_format.MessageToString(g) + extra)
    assert P.load_graph_def(tmp_path / "g.pb") == g
    assert P.load_graph_def(str(tmp_path / "g.pb")) == g
    assert P.load_graph_def(g.SerializeToString()) == g
    assert P.load_graph_def(g) is g
    assert [n.name for n in P.load_graph_def(tmp_path / "g.pbtxt").node] == ["x", "y"]
    (tmp_path / "bad.pb").write_bytes(b"\xff\xff\xff")
    with pytest.raises(ValueError, match="not a binary GraphDef"):
        P.load_graph_def(tmp_path / "bad.pb")


def test_dtype_table_matches_onnx():
    import onnx.helper
    for i, d in P.DTYPES.items():
        assert P.DT_NAMES[i] == d.name
        if d.onnx is not None and d.np != object:
            assert onnx.helper.tensor_dtype_to_np_dtype(d.onnx) == d.np, d.name


# ------------------------------------------------------------------------ against TensorFlow
def _tf_classes():
    from tensorflow.core.framework import graph_pb2, tensor_pb2
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2
    return graph_pb2, tensor_pb2, meta_graph_pb2, saved_model_pb2


def test_schema_matches_tensorflow(tf):
    """Every field of ours has TF's name, number, type, label and (short) message/enum type;
    the DataType enum is TF's."""
    graph_pb2, tensor_pb2, meta_graph_pb2, saved_model_pb2 = _tf_classes()
    from tensorflow.core.framework import types_pb2
    pool = graph_pb2.GraphDef.DESCRIPTOR.file.pool
    short = lambda d: d and d.full_name.split(".", 1 + d.full_name.startswith("onnxgrad."))[-1]  # noqa: E731
    seen = set()

    def check(ours):
        if ours.full_name in seen:
            return
        seen.add(ours.full_name)
        theirs = pool.FindMessageTypeByName("tensorflow." + short(ours))
        assert ours.GetOptions().map_entry == theirs.GetOptions().map_entry
        for f in ours.fields:
            t = theirs.fields_by_number[f.number]
            assert (f.name, f.type, f.is_repeated) == (t.name, t.type, t.is_repeated), f.full_name
            oneof = lambda x: x.containing_oneof and x.containing_oneof.name  # noqa: E731
            assert oneof(f) == oneof(t), f.full_name
            for a, b in ((f.message_type, t.message_type), (f.enum_type, t.enum_type)):
                assert short(a) == short(b), f.full_name
            if f.message_type:
                check(f.message_type)
    for name in P.FILE.message_types_by_name:
        check(P.FILE.message_types_by_name[name])
    assert P.DT == {v.name: v.number for v in types_pb2.DataType.DESCRIPTOR.values}


_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
           "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128"]


def _const_graph(tf):
    rng = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        tf.compat.v1.placeholder(tf.int32, None, name="unknown_rank")
        for name in _DTYPES:
            dt = tf.as_dtype(name)
            np_dt = dt.as_numpy_dtype
            full = (rng.standard_normal((2, 3)) * 10).astype(np_dt) if dt.is_floating or dt.is_complex \
                else rng.integers(0, 2 if dt.is_bool else 100, (2, 3)).astype(np_dt)
            tf.constant(full, dt, name=f"full_{name}")                          # tensor_content
            tf.constant(full[0, 0], dt, name=f"scalar_{name}")                  # one *_val
            tf.constant(full[0, 1], dt, shape=[4, 5], name=f"splat_{name}")     # splat
            tf.constant(np.zeros((0, 2), np_dt), dt, name=f"empty_{name}")
        tf.constant([b"ab", b"", "\u00e9".encode()], name="strings")
        tf.constant(b"s", shape=[2, 2], name="string_splat")
        tf.constant(b"only", name="string_scalar")
        tf.constant([np.nan, -0.0, np.inf], tf.float32, name="special")
        y = tf.matmul(x, tf.constant(np.ones((3, 2), np.float32)), name="mm")
        with tf.control_dependencies([y]):
            tf.identity(tf.nn.relu(y), name="out")
        tf.reshape(x, [-1], name="flat")
        tf.concat([x, x], axis=1, name="cat")
        tf.cast(x, tf.bfloat16, name="to_bf16")
    return g.as_graph_def()


def _compare_graph(tf, ref, ours):
    """ours (onnxgrad.tf.GraphDef) carries everything ref (TF's GraphDef) does."""
    assert type(ref).FromString(ours.SerializeToString()) == ref  # lossless, skipped fields kept as unknown
    assert ours.versions.producer == ref.versions.producer > 0
    assert len(ours.node) == len(ref.node)
    consts = 0
    for a, b in zip(ours.node, ref.node):
        assert (a.name, a.op, list(a.input), a.device) == (b.name, b.op, list(b.input), b.device)
        assert sorted(a.attr) == sorted(b.attr)
        for k in a.attr:
            text = text_format.MessageToString
            assert text(a.attr[k]) == text(b.attr[k]), (a.name, k)
            if a.attr[k].WhichOneof("value") == "shape":
                dims = tf.TensorShape(b.attr[k].shape)
                assert P.shape_of(a.attr[k].shape) == (dims.as_list() if dims.rank is not None else None)
        if a.op == "Const":
            _same(P.tensor_to_numpy(a.attr["value"].tensor), tf.make_ndarray(b.attr["value"].tensor))
            consts += 1
    return consts


def test_graph_def_matches_tensorflow(tf, tmp_path):
    ref = _const_graph(tf)
    ours = P.load_graph_def(ref.SerializeToString())
    assert _compare_graph(tf, ref, ours) >= 4 * len(_DTYPES)
    # both encodings are exercised: raw tensor_content and splatted *_val fields
    tensors = {n.name: n.attr["value"].tensor for n in ours.node if n.op == "Const"}
    assert tensors["full_float16"].tensor_content and not tensors["splat_float16"].tensor_content
    assert len(tensors["splat_bfloat16"].half_val) == 1 and len(tensors["splat_int64"].int64_val) == 1
    assert P.shape_of(next(n for n in ours.node if n.name == "unknown_rank").attr["shape"].shape) is None
    assert P.shape_of(next(n for n in ours.node if n.name == "x").attr["shape"].shape) == [None, 3]
    # files: binary and text format written by TF
    tf.io.write_graph(ref, str(tmp_path), "g.pb", as_text=False)
    tf.io.write_graph(ref, str(tmp_path), "g.pbtxt", as_text=True)
    assert P.load_graph_def(tmp_path / "g.pb") == ours
    assert P.load_graph_def(tmp_path / "g.pbtxt") == ours
    assert P.load_graph_def(ref) == ours  # from TF's own message


def test_handmade_tensors_match_make_ndarray(tf):
    """TF TensorProtos of partial splats and of dtypes TF's make_tensor_proto writes in its own way."""
    _, tensor_pb2, _, _ = _tf_classes()
    from tensorflow.python.framework import dtypes as D

    def tfp(dtype, shape, **vals):
        t = tensor_pb2.TensorProto(dtype=dtype, **vals)
        for s in shape:
            t.tensor_shape.dim.add(size=s)
        return t

    protos = [
        tfp(1, [2, 3], float_val=[1, 2]), tfp(2, [3], double_val=[-1]), tfp(3, [5], int_val=[1, 2, 3]),
        tfp(19, [3], half_val=[0x3C00, 0x7E00]), tfp(14, [2, 2], half_val=[0x4049]),
        tfp(8, [3], scomplex_val=[1, 2, 3, 4]), tfp(18, [2], dcomplex_val=[5, 6]),
        tfp(7, [2, 2], string_val=[b"x", b"y"]), tfp(10, [3], bool_val=[True]), tfp(9, [2, 2]),
        tfp(22, [3], uint32_val=[2**32 - 1]), tfp(17, [2], int_val=[65535]), tfp(5, [0]),
    ]
    for dt in ("int4", "uint4", "int2", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"):
        d = getattr(D, dt)
        protos += [tf.make_tensor_proto(np.array([1, 2, 1]).astype(d.as_numpy_dtype), dtype=d),
                   tf.make_tensor_proto(np.array(1).astype(d.as_numpy_dtype), dtype=d, shape=[2, 2])]
    for p in protos:
        ours = P.TensorProto.FromString(p.SerializeToString())
        _same(P.tensor_to_numpy(ours), tf.make_ndarray(p))


def test_function_library_matches_tensorflow(tf):
    @tf.function
    def innermost(a):
        return tf.sin(a) * tf.constant(np.float32(2))

    @tf.function
    def inner(a):
        return innermost(a) + tf.constant([1.0, 2.0, 3.0])

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([], tf.int32)])
    def f(x, k):
        y = inner(x) + tf.constant(np.arange(3, dtype=np.float32))
        return {"y": y, "s": tf.reduce_sum(y, axis=tf.constant([1])) * tf.cast(k, tf.float32)}

    ref = f.get_concrete_function().graph.as_graph_def()
    ours = P.load_graph_def(ref.SerializeToString())
    _compare_graph(tf, ref, ours)
    assert len(ours.library.function) == len(ref.library.function) >= 2
    for a, b in zip(ours.library.function, ref.library.function):
        sa, sb = a.signature, b.signature
        assert sa.name == sb.name
        for args_a, args_b in ((sa.input_arg, sb.input_arg), (sa.output_arg, sb.output_arg)):
            args = lambda xs: [(x.name, x.type, x.type_attr, x.number_attr) for x in xs]  # noqa: E731
            assert args(args_a) == args(args_b)
        assert dict(a.ret) == dict(b.ret) and dict(a.control_ret) == dict(b.control_ret)
        assert sorted(a.attr) == sorted(b.attr) and sorted(a.arg_attr) == sorted(b.arg_attr)
        nodes = lambda f: [(n.name, n.op, list(n.input), sorted(n.attr)) for n in f.node_def]  # noqa: E731
        assert nodes(a) == nodes(b)
        for na, nb in zip(a.node_def, b.node_def):
            if na.op == "Const":
                _same(P.tensor_to_numpy(na.attr["value"].tensor), tf.make_ndarray(nb.attr["value"].tensor))
    every_node = list(ours.node) + [n for fn in ours.library.function for n in fn.node_def]
    calls = [n for n in every_node if n.op in ("StatefulPartitionedCall", "PartitionedCall")]
    names = {fn.signature.name for fn in ours.library.function}
    assert calls and all(n.attr["f"].func.name in names for n in calls)


def test_saved_model_matches_tensorflow(tf, tmp_path):
    _, _, _, saved_model_pb2 = _tf_classes()

    class M(tf.Module):
        def __init__(self):
            self.w = tf.Variable(np.ones((3, 2), np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": tf.matmul(x, self.w)}

    m = M()
    tf.saved_model.save(m, str(tmp_path), signatures={"serving_default": m.__call__,
                                                      "other": m.__call__.get_concrete_function()})
    ours = P.load_saved_model_proto(tmp_path)
    ref = saved_model_pb2.SavedModel.FromString((tmp_path / "saved_model.pb").read_bytes())
    assert type(ref).FromString(ours.SerializeToString()) == ref
    assert ours.saved_model_schema_version == ref.saved_model_schema_version == 1
    (mg,), (rg,) = ours.meta_graphs, ref.meta_graphs
    assert list(mg.meta_info_def.tags) == ["serve"]
    assert sorted(mg.signature_def) == sorted(rg.signature_def)
    assert {"serving_default", "other"} <= set(mg.signature_def)
    sig = mg.signature_def["serving_default"]
    assert sig.method_name == "tensorflow/serving/predict"
    assert list(sig.inputs) == ["x"] and list(sig.outputs) == ["y"]
    assert sig.inputs["x"].dtype == P.DT["DT_FLOAT"] and P.shape_of(sig.inputs["x"].tensor_shape) == [None, 3]
    assert sig.inputs["x"].name == rg.signature_def["serving_default"].inputs["x"].name
    _compare_graph(tf, rg.graph_def, mg.graph_def)
    assert P.load_saved_model_proto(tmp_path / "saved_model.pb") == ours


def test_coexists_with_tensorflow_classes(tf):
    graph_pb2, *_ = _tf_classes()
    assert graph_pb2.GraphDef.DESCRIPTOR.full_name == "tensorflow.GraphDef"
    assert P.GraphDef.DESCRIPTOR.full_name == "onnxgrad.tf.GraphDef"
    ref = _const_graph(tf)
    ours = P.GraphDef.FromString(ref.SerializeToString())
    back = graph_pb2.GraphDef.FromString(ours.SerializeToString())
    assert back == ref and not isinstance(ours, graph_pb2.GraphDef)
