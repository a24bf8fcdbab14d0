"""TensorFlow's GraphDef / SavedModel schema without TensorFlow.

The subset of TensorFlow's ``.proto`` files the converter reads is written out below as a table
(``_SCHEMA``), with TensorFlow's field names, numbers and types, turned into a
``FileDescriptorProto`` and into message classes at import time. The package is ``onnxgrad.tf``
and the classes live in a private descriptor pool, so they never clash with TensorFlow's own
``tensorflow.*`` classes when both are loaded in one process. Fields left out (``debug_info``,
``saver_def``, ``object_graph_def``, ...) are kept as unknown fields on parse and ignored.

Also here: the DataType table (:data:`DTYPES`), :func:`tensor_to_numpy`, :func:`shape_of`,
:func:`load_graph_def` and :func:`load_saved_model_proto`.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import ml_dtypes
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory, text_format
from onnx import TensorProto as _O

PACKAGE = "onnxgrad.tf"

# message -> "field number type[*]; ..." ("*": repeated, "map<K,V>": map field, "@name": member of
# oneof ``name``). Types: proto scalars, DataType (the enum below), or a message of this table.
_SCHEMA = {
    "GraphDef": "node 1 NodeDef*; versions 4 VersionDef; version 3 int32; library 2 FunctionDefLibrary",
    "VersionDef": "producer 1 int32; min_consumer 2 int32; bad_consumers 3 int32*",
    "NodeDef": "name 1 string; op 2 string; input 3 string*; device 4 string; "
               "attr 5 map<string,AttrValue>; experimental_debug_info 6 NodeDef.ExperimentalDebugInfo",
    "NodeDef.ExperimentalDebugInfo": "original_node_names 1 string*; original_func_names 2 string*",
    "AttrValue": "s 2 bytes @value; i 3 int64 @value; f 4 float @value; b 5 bool @value; "
                 "type 6 DataType @value; shape 7 TensorShapeProto @value; tensor 8 TensorProto @value; "
                 "list 1 AttrValue.ListValue @value; func 10 NameAttrList @value; "
                 "placeholder 9 string @value",
    "AttrValue.ListValue": "s 2 bytes*; i 3 int64*; f 4 float*; b 5 bool*; type 6 DataType*; "
                           "shape 7 TensorShapeProto*; tensor 8 TensorProto*; func 9 NameAttrList*",
    "NameAttrList": "name 1 string; attr 2 map<string,AttrValue>",
    "TensorShapeProto": "dim 2 TensorShapeProto.Dim*; unknown_rank 3 bool",
    "TensorShapeProto.Dim": "size 1 int64; name 2 string",
    "TensorProto": "dtype 1 DataType; tensor_shape 2 TensorShapeProto; version_number 3 int32; "
                   "tensor_content 4 bytes; half_val 13 int32*; float_val 5 float*; double_val 6 double*; "
                   "int_val 7 int32*; string_val 8 bytes*; scomplex_val 9 float*; int64_val 10 int64*; "
                   "bool_val 11 bool*; dcomplex_val 12 double*; uint32_val 16 uint32*; "
                   "uint64_val 17 uint64*; float8_val 18 bytes",
    "FunctionDefLibrary": "function 1 FunctionDef*; gradient 2 GradientDef*",
    "GradientDef": "function_name 1 string; gradient_func 2 string",
    "FunctionDef": "signature 1 OpDef; attr 5 map<string,AttrValue>; "
                   "arg_attr 7 map<uint32,FunctionDef.ArgAttrs>; "
                   "resource_arg_unique_id 8 map<uint32,uint32>; "
                   "node_def 3 NodeDef*; ret 4 map<string,string>; control_ret 6 map<string,string>",
    "FunctionDef.ArgAttrs": "attr 1 map<string,AttrValue>",
    "OpDef": "name 1 string; input_arg 2 OpDef.ArgDef*; output_arg 3 OpDef.ArgDef*; "
             "control_output 20 string*; attr 4 OpDef.AttrDef*; summary 5 string; description 6 string; "
             "is_commutative 18 bool; is_aggregate 16 bool; is_stateful 17 bool; "
             "allows_uninitialized_input 19 bool; is_distributed_communication 21 bool",
    "OpDef.ArgDef": "name 1 string; description 2 string; type 3 DataType; type_attr 4 string; "
                    "number_attr 5 string; type_list_attr 6 string; is_ref 16 bool",
    "OpDef.AttrDef": "name 1 string; type 2 string; default_value 3 AttrValue; description 4 string; "
                     "has_minimum 5 bool; minimum 6 int64; allowed_values 7 AttrValue",
    "OpList": "op 1 OpDef*",
    "SavedModel": "saved_model_schema_version 1 int64; meta_graphs 2 MetaGraphDef*",
    "MetaGraphDef": "meta_info_def 1 MetaGraphDef.MetaInfoDef; graph_def 2 GraphDef; "
                    "signature_def 5 map<string,SignatureDef>",
    "MetaGraphDef.MetaInfoDef": "meta_graph_version 1 string; stripped_op_list 2 OpList; tags 4 string*; "
                                "tensorflow_version 5 string; tensorflow_git_version 6 string; "
                                "stripped_default_attrs 7 bool; function_aliases 8 map<string,string>",
    "SignatureDef": "inputs 1 map<string,TensorInfo>; outputs 2 map<string,TensorInfo>; "
                    "method_name 3 string; defaults 4 map<string,TensorProto>",
    "TensorInfo": "name 1 string @encoding; coo_sparse 4 TensorInfo.CooSparse @encoding; "
                  "dtype 2 DataType; tensor_shape 3 TensorShapeProto",
    "TensorInfo.CooSparse": "values_tensor_name 1 string; indices_tensor_name 2 string; "
                            "dense_shape_tensor_name 3 string",
}

# tensorflow.DataType, in value order from 0; DT_<X>_REF = DT_<X> + 100.
_DT_BASE = ("INVALID FLOAT DOUBLE INT32 UINT8 INT16 INT8 STRING COMPLEX64 INT64 BOOL QINT8 QUINT8 "
            "QINT32 BFLOAT16 QINT16 QUINT16 UINT16 COMPLEX128 HALF RESOURCE VARIANT UINT32 UINT64 "
            "FLOAT8_E5M2 FLOAT8_E4M3FN FLOAT8_E4M3FNUZ FLOAT8_E4M3B11FNUZ FLOAT8_E5M2FNUZ INT4 UINT4 "
            "INT2 UINT2 FLOAT4_E2M1FN").split()
DT: dict[str, int] = {f"DT_{n}": i for i, n in enumerate(_DT_BASE)}
DT.update({f"DT_{n}_REF": i + 100 for i, n in enumerate(_DT_BASE) if i})
DT_NAMES: dict[int, str] = {v: k for k, v in DT.items()}

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {t: getattr(_F, "TYPE_" + t.upper())
            for t in "double float int32 int64 uint32 uint64 bool string bytes".split()}


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(name="onnxgrad/tf_subset.proto", package=PACKAGE,
                                             syntax="proto3")
    enum = fdp.enum_type.add(name="DataType")
    for name, number in DT.items():
        enum.value.add(name=name, number=number)
    msgs = {}
    for full in _SCHEMA:  # parents come before their nested messages in the table
        parent, _, short = full.rpartition(".")
        msgs[full] = (msgs[parent].nested_type if parent else fdp.message_type).add(name=short)

    def set_type(f, t):
        if t in _SCALARS:
            f.type = _SCALARS[t]
        elif t == "DataType":
            f.type, f.type_name = _F.TYPE_ENUM, f".{PACKAGE}.DataType"
        else:
            assert t in _SCHEMA, t
            f.type, f.type_name = _F.TYPE_MESSAGE, f".{PACKAGE}.{t}"

    for full, spec in _SCHEMA.items():
        m, oneofs = msgs[full], {}
        for item in spec.split(";"):
            name, number, t, *oneof = item.split()
            f = m.field.add(name=name, number=int(number), json_name=_camel(name, lower=True))
            f.label = _F.LABEL_REPEATED if t.endswith("*") or t.startswith("map<") else _F.LABEL_OPTIONAL
            if t.startswith("map<"):  # map<K,V>: a repeated nested XxxEntry {key = 1; value = 2}
                key, value = t[4:-1].split(",")
                entry = m.nested_type.add(name=_camel(name) + "Entry")
                entry.options.map_entry = True
                for i, (fname, ft) in enumerate((("key", key), ("value", value)), 1):
                    set_type(entry.field.add(name=fname, number=i, json_name=fname,
                                             label=_F.LABEL_OPTIONAL), ft)
                f.type, f.type_name = _F.TYPE_MESSAGE, f".{PACKAGE}.{full}.{entry.name}"
            else:
                set_type(f, t.rstrip("*"))
            if oneof:
                o = oneof[0].lstrip("@")
                if o not in oneofs:
                    oneofs[o] = len(m.oneof_decl)
                    m.oneof_decl.add(name=o)
                f.oneof_index = oneofs[o]
    return fdp


def _camel(name: str, lower: bool = False) -> str:
    s = "".join(p[:1].upper() + p[1:] for p in name.split("_"))
    return s[:1].lower() + s[1:] if lower else s


POOL = descriptor_pool.DescriptorPool()  # private: TF's "tensorflow.*" classes live in the default pool
POOL.Add(_file_descriptor())
FILE = POOL.FindFileByName("onnxgrad/tf_subset.proto")


def _cls(name: str):
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


GraphDef, NodeDef, VersionDef = _cls("GraphDef"), _cls("NodeDef"), _cls("VersionDef")
AttrValue, NameAttrList = _cls("AttrValue"), _cls("NameAttrList")
TensorProto, TensorShapeProto = _cls("TensorProto"), _cls("TensorShapeProto")
FunctionDefLibrary, FunctionDef = _cls("FunctionDefLibrary"), _cls("FunctionDef")
GradientDef = _cls("GradientDef")
OpDef, OpList = _cls("OpDef"), _cls("OpList")
SavedModel, MetaGraphDef = _cls("SavedModel"), _cls("MetaGraphDef")
SignatureDef, TensorInfo = _cls("SignatureDef"), _cls("TensorInfo")


# ---------------------------------------------------------------------------------------- dtypes
class DType(NamedTuple):
    name: str             # "DT_FLOAT"
    np: np.dtype          # numpy dtype of tensor_to_numpy's result (object for strings)
    onnx: int | None      # onnx.TensorProto elem type; None where ONNX has no such type
    field: str            # the TensorProto *_val field holding values outside tensor_content


_md = ml_dtypes
DTYPES: dict[int, DType] = {DT[n]: DType(n, np.dtype(d), o, f) for n, d, o, f in [
    ("DT_FLOAT", np.float32, _O.FLOAT, "float_val"),
    ("DT_DOUBLE", np.float64, _O.DOUBLE, "double_val"),
    ("DT_HALF", np.float16, _O.FLOAT16, "half_val"),
    ("DT_BFLOAT16", _md.bfloat16, _O.BFLOAT16, "half_val"),
    ("DT_INT8", np.int8, _O.INT8, "int_val"),
    ("DT_INT16", np.int16, _O.INT16, "int_val"),
    ("DT_INT32", np.int32, _O.INT32, "int_val"),
    ("DT_INT64", np.int64, _O.INT64, "int64_val"),
    ("DT_UINT8", np.uint8, _O.UINT8, "int_val"),
    ("DT_UINT16", np.uint16, _O.UINT16, "int_val"),
    ("DT_UINT32", np.uint32, _O.UINT32, "uint32_val"),
    ("DT_UINT64", np.uint64, _O.UINT64, "uint64_val"),
    ("DT_BOOL", np.bool_, _O.BOOL, "bool_val"),
    ("DT_STRING", object, _O.STRING, "string_val"),
    ("DT_COMPLEX64", np.complex64, _O.COMPLEX64, "scomplex_val"),
    ("DT_COMPLEX128", np.complex128, _O.COMPLEX128, "dcomplex_val"),
    ("DT_INT4", _md.int4, _O.INT4, "int_val"),
    ("DT_UINT4", _md.uint4, _O.UINT4, "int_val"),
    ("DT_INT2", getattr(_md, "int2", None), getattr(_O, "INT2", None), "int_val"),
    ("DT_UINT2", getattr(_md, "uint2", None), getattr(_O, "UINT2", None), "int_val"),
    ("DT_FLOAT8_E5M2", _md.float8_e5m2, _O.FLOAT8E5M2, "float8_val"),
    ("DT_FLOAT8_E4M3FN", _md.float8_e4m3fn, _O.FLOAT8E4M3FN, "float8_val"),
    ("DT_FLOAT8_E4M3FNUZ", _md.float8_e4m3fnuz, _O.FLOAT8E4M3FNUZ, "float8_val"),
    ("DT_FLOAT8_E5M2FNUZ", _md.float8_e5m2fnuz, _O.FLOAT8E5M2FNUZ, "float8_val"),
    ("DT_FLOAT8_E4M3B11FNUZ", _md.float8_e4m3b11fnuz, None, "float8_val"),
    ("DT_FLOAT4_E2M1FN", getattr(_md, "float4_e2m1fn", None), getattr(_O, "FLOAT4E2M1", None), "float8_val"),
] if d is not None}  # int2/uint2/float4 need ml_dtypes>=0.5


def dtype_name(dtype: int) -> str:
    """"DT_FLOAT" for 1, "DT_FLOAT_REF" for 101, "DataType(77)" for values TF does not define."""
    return DT_NAMES.get(dtype, f"DataType({dtype})")


def base_dtype(dtype: int) -> int:
    """The DataType under a reference type (DT_FLOAT_REF -> DT_FLOAT); others unchanged."""
    return dtype - 100 if dtype > 100 else dtype


def dtype_info(dtype: int) -> DType:
    """The :class:`DType` of a DataType (reference types read as their base type), or ValueError."""
    try:
        return DTYPES[base_dtype(dtype)]
    except KeyError:
        raise ValueError(f"TensorFlow dtype {dtype_name(dtype)} has no numpy/ONNX equivalent") from None


# ---------------------------------------------------------------------------------------- values
def shape_of(shape) -> list[int | None] | None:
    """A TensorShapeProto as a list of dims (None for unknown, i.e. -1, dims); None for unknown rank."""
    if shape.unknown_rank:
        return None
    return [d.size if d.size >= 0 else None for d in shape.dim]


def tensor_to_numpy(t) -> np.ndarray:
    """The value of a TensorProto, like ``tf.make_ndarray``: from ``tensor_content`` (raw
    little-endian bytes) or else from the dtype's ``*_val`` field, where fewer values than the shape
    holds are padded by repeating the last one (all zeros / b"" when there are none)."""
    info = dtype_info(t.dtype)
    shape = shape_of(t.tensor_shape)
    if shape is None or None in shape:
        raise ValueError(f"{info.name} tensor of not fully known shape {shape}")
    n = math.prod(shape)
    if t.tensor_content:
        if info.np == object:
            raise ValueError("DT_STRING tensor stored in tensor_content is not supported")
        data = np.frombuffer(t.tensor_content, info.np)
        if data.size != n:
            raise ValueError(f"{info.name} tensor_content holds {data.size} values, shape {shape} needs {n}")
        return data.reshape(shape).copy()
    raw = getattr(t, info.field)
    if info.field == "string_val":
        values = np.empty(len(raw), object)
        values[:] = list(raw)
    elif info.field == "half_val":  # float16 / bfloat16 bits in an int32 each
        values = np.array(raw, np.int32).astype(np.uint16).view(info.np)
    elif info.field == "float8_val":  # one byte per value
        values = np.frombuffer(raw, np.uint8).view(info.np)
    elif info.field in ("scomplex_val", "dcomplex_val"):  # (real, imag) pairs
        values = np.array(raw, info.field == "scomplex_val" and np.float32 or np.float64).view(info.np)
    else:
        base = {"int_val": np.int32, "int64_val": np.int64, "uint32_val": np.uint32,
                "uint64_val": np.uint64}.get(info.field, info.np)
        values = np.array(raw, base).astype(info.np)
    if values.size > n:
        raise ValueError(f"{info.name} tensor holds {values.size} values, shape {shape} needs {n}")
    if values.size < n:  # TF's splat encoding
        fill = values[-1] if values.size else (b"" if info.np == object else info.np.type(0))
        pad = np.empty(n - values.size, info.np)
        pad[...] = fill
        values = np.concatenate([values, pad])
    return values.reshape(shape)


# --------------------------------------------------------------------------------------- loading
_TEXT_SUFFIXES = (".pbtxt", ".pbtext", ".txt", ".prototxt")


def _parse(msg_cls, data: bytes, text: bool, what: str):
    from .errors import ConversionError
    msg = msg_cls()
    if not data.strip():
        raise ConversionError(f"{what} is empty, not a {msg_cls.__name__}")
    if text:
        try:
            text_format.Parse(data.decode("utf-8"), msg, allow_unknown_field=True,
                              allow_unknown_extension=True, descriptor_pool=POOL)
        except (text_format.ParseError, UnicodeDecodeError) as e:
            raise ConversionError(f"{what} is not a text-format {msg_cls.__name__}: {e}") \
                from None
    else:
        try:
            msg.ParseFromString(data)
        except message.DecodeError as e:
            raise ConversionError(f"{what} is not a binary {msg_cls.__name__}: {e}") from None
    return msg


def _read(src, msg_cls, text: bool | None):
    if isinstance(src, message.Message):  # ours, or TensorFlow's own class of the same message
        return src if isinstance(src, msg_cls) else _parse(msg_cls, src.SerializeToString(), False, "message")
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _parse(msg_cls, bytes(src), bool(text), "bytes")
    path = os.fspath(src)
    if not os.path.exists(path):
        from ...errors import ModelFileNotFoundError
        raise ModelFileNotFoundError(path)
    with open(path, "rb") as f:
        data = f.read()
    if text is None:
        text = path.lower().endswith(_TEXT_SUFFIXES)
    return _parse(msg_cls, data, text, path)


def load_graph_def(src, text: bool | None = None):
    """A GraphDef from a path (binary ``.pb``; ``.pbtxt``/``.txt``/``.prototxt`` are read as text
    format), from serialized bytes, or from a GraphDef message (e.g. TensorFlow's own)."""
    return _read(src, GraphDef, text)


def load_saved_model_proto(src):
    """The SavedModel proto of a SavedModel directory (``saved_model.pb``, or else
    ``saved_model.pbtxt``), of a path to that file itself, or of its bytes."""
    if isinstance(src, (str, os.PathLike)) and os.path.isdir(src):
        pb = os.path.join(src, "saved_model.pb")
        src = pb if os.path.exists(pb) else os.path.join(src, "saved_model.pbtxt")
    return _read(src, SavedModel, None)


__all__ = ["GraphDef", "NodeDef", "VersionDef", "AttrValue", "NameAttrList", "TensorProto",
           "TensorShapeProto", "FunctionDefLibrary", "FunctionDef", "GradientDef", "OpDef", "OpList",
           "SavedModel", "MetaGraphDef", "SignatureDef", "TensorInfo", "DT", "DT_NAMES", "DType",
           "DTYPES", "dtype_name", "base_dtype", "dtype_info", "shape_of", "tensor_to_numpy",
           "load_graph_def", "load_saved_model_proto"]
