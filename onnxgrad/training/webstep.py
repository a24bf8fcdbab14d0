"""Train steps for the browser: ``onnxgrad export-train-step MODEL --loss .. --target web``.

onnxruntime-web runs onnxgrad's step graphs on its WASM backend as they are (float64 kernels
included), but its WebGPU builds have none for float64, so the web step keeps every scalar in
float32 (lr is a float32 input; see :class:`~onnxgrad.training.optimizers.Scalars`). Three
files, written side by side:

    S.onnx        the step graph: data, params, state, lr (float32 []), step (int64 []),
                  statistics -> loss, updated params, updated state, updated statistics; no
                  input defaults (the page feeds all)
    S.model.onnx  the original model (no loss) with its initial weights, each trained parameter
                  and running statistic stored as raw little-endian bytes: the same bytes
                  ``Trainer.export`` writes
    S.json        the manifest: roles, shapes and dtypes of the step's inputs and outputs, and
                  where each parameter's and statistic's bytes lie in S.model.onnx

Statistics are the running mean and variance of training-mode BatchNormalizations (a
``torch.onnx.export(training=TRAINING)`` model's): each step's forward updates them, as the
Python Trainer's and PyTorch's do, and the page carries them from step to step like the
parameters (a manifest without "stats" has none). The page reads the initial values from those
byte ranges and writes the trained model by overwriting them, so what it downloads is the
original graph with the trained weights and statistics, byte for byte what ``Trainer.export``
writes for the same values, and what it validates is that file.
"""
from __future__ import annotations

import hashlib
import json
import os

from onnx import TensorProto, numpy_helper

from ..storage import keep_data_of, write_together
from ..storage import model_bytes as to_bytes
from .losses import LOSSES, attach_loss, load
from .optimizers import AdamW
from .step import as_module_parameters, build_train_step

FORMAT = "onnxgrad-web-step"
VERSION = 1
# dtypes an onnxruntime-web Tensor can hold (it has no bfloat16 and no float8 types)
WEB_DTYPES = {TensorProto.FLOAT: "float32", TensorProto.DOUBLE: "float64",
              TensorProto.FLOAT16: "float16", TensorProto.INT64: "int64",
              TensorProto.INT32: "int32", TensorProto.INT8: "int8", TensorProto.UINT8: "uint8",
              TensorProto.BOOL: "bool"}
PROTOBUF_LIMIT = 2**31 - 2**20  # one .onnx file; onnxruntime-web's WASM heap is 4 GiB in all


def paths(step_path) -> dict[str, str]:
    """The three files of a web export whose step graph is ``step_path``."""
    step_path = os.fspath(step_path)
    base = step_path[:-5] if step_path.endswith(".onnx") else step_path
    return {"step": step_path, "model": base + ".model.onnx", "manifest": base + ".json"}


def export_web_step(model, loss: str, path, *, output_name: str | None = None, optimizer=None,
                    params=None, frozen=None, clip_norm: float | None = None) -> dict:
    """Write the web step of ``model`` to ``path`` (and its model and manifest beside it, see
    the module doc); returns the manifest. ``loss`` is a loss kind (one of LOSSES, attached to
    ``output_name``) or the name of a scalar tensor the model computes; the rest as
    :func:`~onnxgrad.training.step.build_train_step`."""
    files = paths(path)
    keep_data_of(model, files.values())  # (before the work)
    m = as_module_parameters(load(model))  # (the step trains these: the saved model holds them)
    optimizer = optimizer or AdamW()
    if loss in LOSSES:
        lm = attach_loss(m, loss, output_name)
        loss_name, kind = lm.graph.output[-1].name, loss
        target = lm.graph.input[-1].name
        output_name = output_name or m.graph.output[0].name
    else:
        if output_name:
            raise ValueError("output_name applies to loss kinds only "
                             f"({', '.join(LOSSES)}), not to the tensor {loss!r}")
        lm, loss_name, kind, target = m, loss, None, None
    step = build_train_step(lm, loss_name, params, optimizer, frozen, clip_norm,
                            scalars="float32")
    types = {v.name: v.type.tensor_type for v in step.model.graph.input}
    for name in step.data_inputs + step.params + step.stats:
        if types[name].elem_type not in WEB_DTYPES:
            dt = TensorProto.DataType.Name(types[name].elem_type)
            raise ValueError(f"input {name!r} is {dt}: onnxruntime-web has no tensors of that "
                             f"type (it has {', '.join(sorted(set(WEB_DTYPES.values())))})")

    # the inference model with every trained parameter and statistic as raw bytes
    # (Trainer.trained_model's form)
    weights = {**{p: step.initial_params[p] for p in step.params}, **step.initial_stats}
    for t in m.graph.initializer:
        if t.name in weights:
            t.CopyFrom(numpy_helper.from_array(weights[t.name], t.name))
    if m.ByteSize() > PROTOBUF_LIMIT:
        raise ValueError(f"the model is {m.ByteSize() / 2**30:.1f} GiB: the web target needs it "
                         "in one .onnx file under 2 GiB (onnxruntime-web's WASM memory is 4 GiB "
                         "in all, for the weights, the optimizer state and both copies of each)")
    model_bytes = to_bytes(m)
    ranges = raw_data_ranges(model_bytes)
    for p, w in weights.items():  # the page trusts these ranges: make sure of them
        off, n = ranges[p]
        if model_bytes[off:off + n] != numpy_helper.from_array(w).raw_data:
            raise AssertionError(f"initializer {p!r}: its bytes are not where the ranges say")
    step_bytes = to_bytes(step.model)

    def tensor(name, shape=None):
        tt = types.get(name)
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in tt.shape.dim] if tt is not None else list(shape)
        return {"name": name, "dtype": WEB_DTYPES[tt.elem_type], "shape": dims}

    model_inputs = {v.name for v in m.graph.input} - {t.name for t in m.graph.initializer}
    manifest = {
        "format": FORMAT, "version": VERSION,
        "files": {k: {"name": os.path.basename(files[k]), "bytes": len(b),
                      "sha256": hashlib.sha256(b).hexdigest()}
                  for k, b in (("step", step_bytes), ("model", model_bytes))},
        "loss": {"name": loss_name, "kind": kind, "output": output_name, "target": target},
        "inputs": [tensor(n) for n in step.data_inputs if n in model_inputs],
        "targets": [tensor(n) for n in step.data_inputs if n not in model_inputs],
        "outputs": [o.name for o in m.graph.output],
        "params": [{**tensor(p), "output": o, "offset": ranges[p][0], "length": ranges[p][1]}
                   for p, o in zip(step.params, step.param_outputs)],
        "state": [{**tensor(s), "output": o, "param": p, "slot": slot, "init": "zeros"}
                  for s, o, (p, slot) in zip(step.state, step.state_outputs, step.state_of)],
        "stats": [{**tensor(s), "output": o, "offset": ranges[s][0], "length": ranges[s][1]}
                  for s, o in zip(step.stats, step.stat_outputs)],
        "lr": {"name": step.lr, "dtype": "float32", "default": float(optimizer.lr)},
        "step": {"name": step.step, "dtype": "int64", "first": 1},
        "optimizer": {"type": type(optimizer).__name__, **optimizer.config()},
        "clip_norm": clip_norm,
        "frozen": list(step.frozen),
    }
    write_together({files["model"]: model_bytes, files["step"]: step_bytes,
                    files["manifest"]: (json.dumps(manifest, indent=1) + "\n").encode()})
    return manifest


def raw_data_ranges(data: bytes) -> dict[str, tuple[int, int]]:
    """{initializer name: (offset, length)} of each top-level graph initializer's raw_data in
    the serialized ModelProto ``data``, read from the protobuf wire format (ModelProto.graph = 7,
    GraphProto.initializer = 5, TensorProto.name = 8, TensorProto.raw_data = 9)."""
    ranges = {}
    for field, start, end in _fields(data, 0, len(data)):
        if field != 7:
            continue
        for f2, s2, e2 in _fields(data, start, end):
            if f2 != 5:
                continue
            name, raw = None, None
            for f3, s3, e3 in _fields(data, s2, e2):
                if f3 == 8:
                    name = data[s3:e3].decode()
                elif f3 == 9:
                    raw = (s3, e3 - s3)
            if name is not None and raw is not None:
                ranges[name] = raw
    return ranges


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes, pos: int, end: int):
    """(field number, start, end) of each length-delimited field of the message in
    data[pos:end]; other wire types are skipped."""
    while pos < end:
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, pos = _varint(data, pos)
            yield field, pos, pos + n
            pos += n
        else:
            raise ValueError(f"unexpected protobuf wire type {wire} at byte {pos}")
