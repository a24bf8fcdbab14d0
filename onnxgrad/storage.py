"""Reading and writing model files: clear errors for what is not a model, external data past
protobuf's 2 GB limit, and writes that leave either the old file or the new one, never half.

Writes: every file is written under a temporary name in the destination's folder,
``.<name>.onnxgrad-<pid>-<random>.tmp``, flushed to disk, then renamed over the destination in one
step. A failed write (disk full, no permission) removes its temporary file and raises
:class:`~onnxgrad.errors.WriteError`; the destination is unchanged. A write killed midway leaves
its temporary file behind: the next write to the same destination removes those whose process is
gone (the pid in the name), so concurrent writers never remove each other's. A destination that
is a symbolic link is written through: the link stays, its target gets the new content and keeps
its permission bits (as an existing regular file does).

Models past 2 GB keep their initializers in a data file beside them,
``<name>.<pid>-<random>.data``, named afresh on each write: the model that refers to it is
renamed into place last, so a reader never sees a model with another write's data, and the data
file the old model used is removed afterwards (unless another model in the folder reads it: a
copy). The data file of a killed write stays: a name says nothing of which model reads it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from .errors import (ArgumentTypeError, DataError, InvalidArgumentError, InvalidModelError,
                     ModelFileNotFoundError, ModelLoadError, OnnxgradError, UnsupportedError,
                     WriteError)
from .inference import graphs_of

# onnx 1.23 writes IR 14 by default; onnxruntime 1.31 reads up to IR 13
MAX_IR_VERSION = 13
# protobuf cannot serialise a message of 2 GiB; leave room for the graph itself
EXTERNAL_DATA_ABOVE = 2**31 - 2**20
# tensors of at least this many bytes go to the data file (onnx's own default threshold)
EXTERNAL_MIN_BYTES = 1024
_ALIGN = 4096  # data offsets aligned to pages, so a runtime may map the file


# -- reading -----------------------------------------------------------------------------------
def external_data_files(path) -> set[str]:
    """The files (real paths: a folder reached by a link too) that the model file ``path`` keeps
    its external tensors in; empty when it has none, is no readable model, or ``path`` is no
    path (a model in memory)."""
    if not isinstance(path, (str, os.PathLike)):
        return set()
    try:
        m = onnx.load(os.fspath(path), load_external_data=False)
    except Exception:  # noqa: BLE001  (the command that reads it says what is wrong)
        return set()
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    return {os.path.realpath(os.path.join(folder, _location(t))) for g in graphs_of(m.graph)
            for t in g.initializer if external(t) and _location(t)}


def load_model(src, load_external_data: bool = True, what: str = "model") -> onnx.ModelProto:
    """An ONNX model from a path or bytes (a ModelProto is returned as it is), or a
    :class:`ModelLoadError` that says why the file is not one (empty, not protobuf, no graph,
    external data missing), naming the file."""
    if isinstance(src, onnx.ModelProto):
        return src
    if isinstance(src, (bytes, bytearray, memoryview)):
        label, data = "the bytes given", bytes(src)
        return _check_loaded(_parse(data, label), label)
    if not isinstance(src, (str, os.PathLike)):
        raise ArgumentTypeError(f"{what} must be an onnx.ModelProto or a path (or the model's "
                                f"bytes), not {type(src).__name__}")
    path = os.fspath(src)
    if not os.path.exists(path):
        raise ModelFileNotFoundError(path)
    if os.path.isdir(path):
        raise ModelLoadError(f"{path}: is a directory, not an ONNX model")
    if os.path.getsize(path) == 0:
        raise ModelLoadError(f"{path}: the file is empty, not an ONNX model")
    try:
        with open(path, "rb") as f:
            m = _parse(f.read(), path)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc.strerror or exc})") from None
    _check_loaded(m, path)
    if load_external_data:  # every tensor, subgraphs and Constant nodes included
        base = os.path.dirname(os.path.abspath(path))
        try:
            external_data_helper.load_external_data_for_model(m, base)
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise ModelLoadError(f"{path}: its external data cannot be read from {base} "
                                 f"({exc})") from None
    return m


def load_arrays(path, what: str = ".npz archive") -> dict:
    """The arrays of an ``np.savez`` archive, read whole (no pickles), or a clear error: a missing
    file, a single .npy array, a truncated or corrupt archive."""
    import zipfile

    import numpy as np
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelFileNotFoundError(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            if not isinstance(data, np.lib.npyio.NpzFile):
                raise DataError(f"{path}: expected an {what} (np.savez), not a single array")
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        if isinstance(exc, OnnxgradError):
            raise
        why = "not an np.savez archive" if "allow_pickle" in str(exc) else exc
        raise DataError(f"{path}: not a readable {what} ({why})") from None
    except TypeError:  # np.load of a single .npy returns an array, which is no context manager
        raise DataError(f"{path}: expected an {what} (np.savez), not a single array") from None


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    from google.protobuf.message import DecodeError
    m = onnx.ModelProto()
    try:
        m.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{label}: not an ONNX model (protobuf cannot decode it: "
                             f"{exc})") from None
    return m


def _check_loaded(m: onnx.ModelProto, label: str) -> onnx.ModelProto:
    # protobuf decodes many byte strings without complaint (an empty one is a valid empty
    # message): a model has at least an IR version and a graph
    if m.ir_version <= 0 or not m.HasField("graph"):
        missing = "IR version" if m.ir_version <= 0 else "graph"
        raise ModelLoadError(f"{label}: not an ONNX model (no {missing}; is it a truncated "
                             "file or another format?)")
    return m


def external(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


def _location(t: onnx.TensorProto) -> str | None:
    """The file an external tensor's data is in, relative to its model's folder."""
    return dict((e.key, e.value) for e in t.external_data).get("location")


def tensor_nbytes(t: onnx.TensorProto) -> int:
    """The size of ``t``'s data, from its dims (serialising a tensor past 2 GiB fails)."""
    if external(t):
        return int(dict((e.key, e.value) for e in t.external_data).get("length", 0) or 0)
    n = 1
    for d in t.dims:
        n *= d
    if t.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        itemsize = 8
    return n * itemsize


# -- weights apart ------------------------------------------------------------------------------
def dense_tensor(sp: onnx.SparseTensorProto) -> onnx.TensorProto:
    """The dense TensorProto of a SparseTensorProto, named as its values are. Its indices are
    linear ([NNZ]) or coordinates ([NNZ, rank]), as the ONNX spec allows; onnx's checker
    vets them first (a count or index that does not fit is an InvalidModelError)."""
    try:
        onnx.checker.check_sparse_tensor(sp, onnx.checker.DEFAULT_CONTEXT)
    except onnx.checker.ValidationError as exc:
        raise InvalidModelError(f"sparse tensor {sp.values.name!r} is malformed: "
                                f"{str(exc).strip()}") from None
    values = numpy_helper.to_array(sp.values)
    idx = numpy_helper.to_array(sp.indices).astype(np.int64)
    dense = np.zeros(tuple(sp.dims), values.dtype)
    if idx.ndim == 2:
        dense[tuple(idx.T)] = values
    else:
        dense.reshape(-1)[idx] = values
    return numpy_helper.from_array(dense, sp.values.name)


def _sparse_constant(n: onnx.NodeProto) -> bool:
    return n.op_type == "Constant" and n.domain in ("", "ai.onnx") and any(
        a.name == "sparse_value" for a in n.attribute)


def dense_copy(model: onnx.ModelProto):
    """``model``'s sparse tensors as dense ones, for onnx-ir, which reads none (a sparse
    initializer is dropped, a Constant's sparse_value fails): (a copy in which every graph's
    sparse initializers are initializers and every Constant(sparse_value) is a
    Constant(value), and a function that puts the main graph's sparse Constants back into a
    model made from that copy), or (``model``, None) when it has none. The initializers stay
    dense: onnx's shape inference types a sparse initializer as a sparse tensor, which no op
    takes, so a model that keeps one fails ``check_model(full_check=True)``."""
    from .inference import graphs_of

    if not any(g.sparse_initializer or any(map(_sparse_constant, g.node))
               for g in graphs_of(model.graph)):
        return model, None
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for g in graphs_of(m.graph):
        g.initializer.extend(dense_tensor(sp) for sp in g.sparse_initializer)
        del g.sparse_initializer[:]
        for n in filter(_sparse_constant, g.node):
            a = next(a for a in n.attribute if a.name == "sparse_value")
            a.CopyFrom(onnx.helper.make_attribute("value", dense_tensor(a.sparse_tensor)))
    constants = {n.output[0]: n for n in model.graph.node if _sparse_constant(n)}

    def restore(out: onnx.ModelProto) -> onnx.ModelProto:
        for n in out.graph.node:
            if n.op_type == "Constant" and n.output and n.output[0] in constants:
                del n.attribute[:]
                n.attribute.extend(constants[n.output[0]].attribute)
        return out

    return m, restore


def strip_weights(model: onnx.ModelProto, min_bytes: int, only=None):
    """A copy of ``model`` whose graph initializers of ``min_bytes`` or more (of a dtype in
    ``only``, when given) carry no data (name, dtype and dims only), and those initializers
    (the caller's own TensorProtos, not copies). The weights are never copied: a model past
    2 GB costs its graph, not its size. ``model`` itself (no copy) when none qualifies."""
    def wanted(t):
        return (only is None or t.data_type in only) and (
            external(t) or tensor_nbytes(t) >= min_bytes)

    if not any(wanted(t) for t in model.graph.initializer):
        return model, {}
    light = onnx.ModelProto()
    for fd, value in model.ListFields():
        if fd.name != "graph":
            _copy_field(light, fd, value)
    big = {}
    for fd, value in model.graph.ListFields():
        if fd.name != "initializer":
            _copy_field(light.graph, fd, value)
    light.graph.SetInParent()
    for t in model.graph.initializer:
        if wanted(t):
            big[t.name] = t
            stub = light.graph.initializer.add(name=t.name, data_type=t.data_type)
            stub.dims.extend(t.dims)
            if t.doc_string:
                stub.doc_string = t.doc_string
        else:
            light.graph.initializer.add().CopyFrom(t)
    return light, big


def _copy_field(dst, fd, value) -> None:
    if fd.is_repeated:
        getattr(dst, fd.name).extend(value)
    elif fd.message_type is not None:
        getattr(dst, fd.name).CopyFrom(value)
    else:
        setattr(dst, fd.name, value)


# -- writing -----------------------------------------------------------------------------------
_TMP = re.compile(r"\.(?P<name>.+)\.onnxgrad-(?P<pid>\d+)-[0-9a-f]+\.tmp(\.\w+)?")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_stale_temporaries(path) -> list[str]:
    """Remove the temporary files that killed writes to ``path`` left in its folder (those whose
    writing process is gone); returns what was removed."""
    folder, base = os.path.split(os.path.abspath(os.fspath(path)))
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for n in names:
        m = _TMP.fullmatch(n)
        if m and m["name"] == base and not _alive(int(m["pid"])):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, n))
                removed.append(n)
    return removed


def keep_data_of(model, paths, data: set | None = None) -> None:
    """Refuse (a WriteError) to write any of ``paths`` over a file the model file ``model``
    keeps its external tensors (weights) in: the model would still load, with other weights.
    Only an existing file can be one, so the model is read only then (``data``: its
    :func:`external_data_files`, where the caller keeps them)."""
    existing = [p for p in paths if p is not None and os.path.isfile(p)]
    if existing and data is None:
        data = external_data_files(model)
    for p in existing:
        if os.path.realpath(p) in data:
            raise WriteError(p, f"it holds the external data (the weights) of "
                                f"{os.fspath(model)}; choose another file")


def destination(path) -> str:
    """Where a write to ``path`` lands: through symbolic links to their target."""
    path = os.fspath(path)
    return os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)


def write_error(path, exc: OSError) -> WriteError:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        reason = "no space left on the device"
    return WriteError(path, reason, exc.errno)


def writable(path: str) -> None:
    """A :class:`WriteError` for a path no file can be written at (no name, a folder, a device
    or a pipe, which a write would replace, a path under a file); nothing is written. Also run
    before a command's work by the CLI, for each of its outputs."""
    if not path or path.endswith((os.sep, "/")):
        raise WriteError(path, "it names no file" if not path else
                         "it ends with a separator, so it names a folder: give a file name")
    if os.path.isdir(path):
        raise WriteError(path, "it is a directory")
    if os.path.exists(path) and not os.path.isfile(path):
        raise WriteError(path, "it is not a regular file (a device, a pipe or a socket), which "
                               "a write would replace")
    up = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(up) and os.path.dirname(up) != up:
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise WriteError(path, f"{up} is a file, not a folder")


@contextlib.contextmanager
def atomic_path(path, suffix=""):
    """Yield a temporary path in ``path``'s folder; on success it replaces ``path`` in one rename
    (an existing file keeps its permission bits, a new one gets what the umask gives), on failure
    it is removed and an OSError becomes a :class:`WriteError` naming ``path``: never half a
    file. ``suffix`` ends the temporary name (for writers that read the format from it)."""
    shown = os.fspath(path)
    writable(shown)
    target = destination(path)
    folder, base = os.path.split(target)
    tmp = os.path.join(folder,
                       f".{base}.onnxgrad-{os.getpid()}-{secrets.token_hex(4)}.tmp{suffix}")
    made = []  # folders this write creates, removed again if it fails
    up = folder
    while not os.path.exists(up) and os.path.dirname(up) != up:
        made.append(up)
        up = os.path.dirname(up)
    try:
        try:
            os.makedirs(folder, exist_ok=True)
            remove_stale_temporaries(target)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            os.close(fd)
        except OSError as exc:
            if isinstance(exc, WriteError):
                raise
            raise write_error(shown, exc) from None
    except BaseException:
        _remove_folders(made)
        raise
    try:
        yield tmp
        with contextlib.suppress(FileNotFoundError):  # else: what the umask gave at creation
            os.chmod(tmp, os.stat(target).st_mode & 0o7777)
        _fsync_path(tmp)
        os.replace(tmp, target)
        _fsync_dir(folder)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        _remove_folders(made)
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise write_error(shown, exc) from exc
        raise


def _remove_folders(made: list) -> None:
    for folder in made:  # (deepest first; one that holds anything else stays)
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _fsync_path(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder) -> None:
    with contextlib.suppress(OSError):  # not every filesystem syncs folders
        _fsync_path(folder)


def save_model(model: onnx.ModelProto, path, base_dir=None) -> None:
    """Write ``model`` to ``path`` atomically (see the module doc), pinned to an IR version
    onnxruntime reads. Past 2 GB its initializers go to a data file beside it. ``model`` is
    never changed. Initializers whose data is still in an external file (a model loaded with
    ``load_external_data=False``) are copied from ``base_dir``, the folder that model was
    loaded from; without it they are an error, never a model that points at a missing file."""
    if not isinstance(model, onnx.ModelProto):
        raise ArgumentTypeError(f"model must be an onnx.ModelProto, not {type(model).__name__}")
    unloaded = [t.name for t in model.graph.initializer if external(t)]
    if unloaded and base_dir is None:
        more = f" (and {len(unloaded) - 1} more)" if len(unloaded) > 1 else ""
        raise InvalidArgumentError(
            f"initializer {unloaded[0]!r}{more} keeps its data in an external file that was not "
            "loaded: pass base_dir (the folder the model was loaded from) or load the model with "
            "its external data")
    total = sum(tensor_nbytes(t) for t in model.graph.initializer)
    if unloaded or total > EXTERNAL_DATA_ABOVE:
        _save_with_data_file(model, path, base_dir)
        return
    data = model_bytes(model)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def model_bytes(model: onnx.ModelProto) -> bytes:
    """``model`` serialised as one file, pinned to an IR version onnxruntime reads."""
    if model.ir_version > MAX_IR_VERSION:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        copy.ir_version = MAX_IR_VERSION
        model = copy
    from google.protobuf.message import EncodeError
    try:
        return model.SerializeToString()
    except (EncodeError, ValueError) as exc:  # past 2 GB
        raise UnsupportedError(
            "the model is over 2 GB outside its graph's initializers (in Constant nodes or "
            f"subgraphs), which cannot be written as one file ({exc})") from None


def write_together(files: dict) -> None:
    """Write {path: bytes} as one set: every file under its temporary name first, then the
    renames one after another with SIGINT and SIGTERM held until the last is done, so that an
    interrupted run leaves the old set or the new one, not a mix (a web export's step, model
    and manifest, whose hashes must agree)."""
    import signal
    import threading
    with contextlib.ExitStack() as stack:
        for path, data in files.items():
            suffix = os.path.splitext(os.fspath(path))[1]
            tmp = stack.enter_context(atomic_path(path, suffix))
            with open(tmp, "wb") as f:
                f.write(data)
        if threading.current_thread() is not threading.main_thread():
            stack.close()  # (only the main thread may set handlers)
            return
        # (Python-level handlers: any thread of the process may take the signal itself)
        held: list = []
        before = {s: signal.signal(s, lambda signum, _: held.append(signum))
                  for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            stack.close()  # (each atomic_path renames its file into place)
        finally:
            for s, handler in before.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
            for s in held[:1]:
                signal.raise_signal(s)


def _save_with_data_file(model, path, base_dir) -> None:
    target = destination(path)
    folder, base = os.path.split(target)
    light, big = strip_weights(model, EXTERNAL_MIN_BYTES)
    if light is model:  # no tensor is large: many small ones
        raise UnsupportedError("the model is over 2 GB in initializers of under "
                               f"{EXTERNAL_MIN_BYTES} bytes each, which cannot be written")
    light.ir_version = min(light.ir_version, MAX_IR_VERSION)
    location = f"{base}.{os.getpid()}-{secrets.token_hex(4)}.data"
    data_path = os.path.join(folder, location)
    old = _data_files_of(target)
    old_model = None
    if old:
        with contextlib.suppress(OSError), open(target, "rb") as f:
            old_model = f.read()
    try:
        os.makedirs(folder, exist_ok=True)
        with open(data_path, "xb") as f:
            for stub in light.graph.initializer:
                t = big.get(stub.name)
                if t is None:
                    continue
                pad = -f.tell() % _ALIGN
                f.write(b"\0" * pad)
                offset = f.tell()
                f.write(_tensor_bytes(t, base_dir))
                stub.raw_data = b""  # onnx's helper wants the field present; it holds no data
                external_data_helper.set_external_data(stub, location, offset, f.tell() - offset)
                stub.ClearField("raw_data")
            f.flush()
            os.fsync(f.fileno())
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(light.SerializeToString())
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(data_path)
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise write_error(os.fspath(path), exc) from exc
        raise
    for name in old - {location}:  # the old model's data, unless a copy of it reads it too
        if not _read_elsewhere(folder, name, old_model, {target}):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def _tensor_bytes(t: onnx.TensorProto, base_dir) -> bytes:
    if external(t):
        copy = onnx.TensorProto()
        copy.CopyFrom(t)  # no data in it: only where the data is
        try:
            external_data_helper.load_external_data_for_tensor(copy, os.fspath(base_dir))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise InvalidArgumentError(f"initializer {t.name!r}: its external data cannot be "
                                       f"read from base_dir {os.fspath(base_dir)} ({exc})") \
                from None
        return copy.raw_data
    if t.HasField("raw_data"):
        return t.raw_data
    return onnx.numpy_helper.to_array(t).tobytes()  # typed fields: small tensors, in practice


def _data_files_of(target: str) -> set[str]:
    """The data file(s) of the model now at ``target`` (written by an earlier write to it), to
    remove once the new model is in place. Never a file by the name alone: a model moved or
    copied away keeps reading the data file it was written with, so data files of killed
    writes stay (a model elsewhere may be the one that reads them)."""
    pattern = re.compile(re.escape(os.path.basename(target)) + r"\.(\d+)-[0-9a-f]{8}\.data")
    with contextlib.suppress(Exception):  # noqa: BLE001  (no readable model there: nothing)
        current = onnx.load(target, load_external_data=False)
        return {loc for t in current.graph.initializer
                if (loc := _location(t)) and pattern.fullmatch(loc)}
    return set()


def _read_elsewhere(folder: str, name: str, old: bytes | None, skip: set) -> bool:
    """Whether a file in ``folder`` other than ``skip`` reads data file ``name``: a byte-for-byte
    copy of the replaced model ``old`` (whatever its name: ``model.onnx.bak``), or a model file
    (``.onnx`` in any case, small enough to be one with external data) that names it."""
    with contextlib.suppress(OSError):
        for n in os.listdir(folder):
            path = os.path.join(folder, n)
            if path in skip or not os.path.isfile(path):
                continue
            size = os.path.getsize(path)
            if old is not None and size == len(old):
                with contextlib.suppress(OSError), open(path, "rb") as f:
                    if f.read() == old:
                        return True
            if n.lower().endswith(".onnx") and size < (64 << 20):
                with contextlib.suppress(Exception):  # noqa: BLE001  (not a model: no reader)
                    m = onnx.load(path, load_external_data=False)
                    if any(_location(t) == name for t in m.graph.initializer):
                        return True
    return False
