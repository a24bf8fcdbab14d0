"""Data-parallel training on torch.distributed: the same onnxgrad graphs on N processes.

    torchrun --nproc-per-node 2 -m onnxgrad train MODEL --loss ... --data DATA.npz --distributed

or, in a script that torchrun starts on every rank:

    trainer = DistributedTrainer(model, "cross_entropy", optimizer=AdamW(lr=1e-3))
    trainer.fit(data, epochs=5, batch_size=64)   # 64 rows per step in all: 32 on each of 2 ranks
    trainer.export("trained.onnx")               # rank 0 writes
    trainer.close()

A step: every rank runs the gradient graph on its shard of the global batch, weighting its
gradients by rows_r / rows, so that their sum over the ranks is the whole batch's gradient (exact
for a loss that is a mean over rows, uneven shards included); the gradients land in views of flat
torch tensors (~25 MB buckets) shared with onnxruntime through DLPack, so nothing is copied on
either side (on CUDA they never leave the GPU); the buckets are summed with all-reduce; then every
rank runs the optimizer on the sums (on CPU the fused kernel, onnxgrad.training.fused, else the
optimizer graph). The weighted loss and one non-finite flag per rank
travel at the end of the first float32/float64 bucket: every rank sees the same global loss and,
when any rank's loss is not finite, every rank stops at the same step before any update.

ZeRO stage 1 (``zero=True``): the parameters and the gradients of one dtype are laid out in
one flat buffer of N equal segments, and rank r keeps the optimizer state of segment r only. The
gradients are reduce-scattered (rank r receives the sums of its segment), rank r runs the
optimizer (fused kernel or graph) on its segment as one flat tensor (the optimizers are
elementwise), and the
segments are all-gathered into the flat parameter buffer, of which the gradient graph's
parameters are views. The result equals the unsharded run bit for bit (the same elementwise
update of the same sums); ``memory()`` reports what it saves.

Data: every rank gets the same data and seed, hence the same permutation per epoch; global batch j
is rows [j B, (j+1) B) of it and rank r takes every N-th row from the r-th: torch's
DistributedSampler order. The batch size is the global one, so 1 and N processes take the same
steps, and a checkpoint resumes under any number of processes.

Checkpoints are :class:`Trainer`'s: rank 0 writes (with ZeRO the state is gathered to it first),
every rank reads, and the ranks check that they resumed at the same position. A rank that dies or
does not reach a collective within ``timeout`` seconds stops the others with a
:class:`~onnxgrad.errors.DistributedError` naming it (found through the rendezvous store), or,
when torchrun sees a rank die first, torchrun ends the job and names it.

torch is an optional extra (``pip install 'onnxgrad[distributed]'``), imported only here.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import time
import zlib
from dataclasses import dataclass

import numpy as np

from .. import runtime
from ..aliasing import statistics_read
from ..errors import DistributedError, InvalidArgumentError, MissingExtraError
from .optimizers import SGD, Adam, AdamW
from .step import TrainStep, _log, build_apply_model
from .trainer import NonFiniteLossError, Trainer, cores, make_session

BUCKET_MB = 25.0


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise MissingExtraError("data-parallel training needs PyTorch (torch.distributed): "
                                "pip install 'onnxgrad[distributed]'") from exc
    if not dist.is_available():
        raise MissingExtraError("this PyTorch build has no torch.distributed: install a standard "
                                "build (pip install 'onnxgrad[distributed]')")
    return torch, dist


class RankNonFiniteLossError(NonFiniteLossError):
    """The loss was not finite on ``ranks`` at ``step``: every rank stopped there, no update
    of that step applied."""

    def __init__(self, step: int, loss: float, ranks: list[int]):
        super().__init__(step, loss)
        self.ranks = list(ranks)

    def __str__(self):
        where = (f"non-finite loss on rank {', '.join(map(str, self.ranks))}" if self.ranks
                 else "the sum of the ranks' losses overflowed")
        return f"{super().__str__()} [{where}]"


@dataclass
class Layout:
    """Where each parameter's gradient (and with ZeRO the parameter) lives in flat buffers:
    ``slots[i]`` = (buffer, offset); ``sizes`` / ``dtypes`` per buffer; ``ctrl`` = (buffer,
    offset) of the control values (the weighted loss, one non-finite flag per rank), or None
    when they travel in a tensor of their own."""
    slots: list[tuple[int, int]]
    sizes: list[int]
    dtypes: list[np.dtype]
    ctrl: tuple[int, int] | None


def plan_layout(numels: list[int], dtypes: list, world: int, zero: bool,
                bucket_bytes: int) -> Layout:
    """Without ZeRO: all-reduce buckets, the parameters of one dtype in order, cut before
    ``bucket_bytes`` are passed (at least one parameter each); the control values at the end of
    the first float32/float64 bucket. With ZeRO: one buffer per dtype, padded to N equal
    segments (rank r owns segment r); the control values on their own."""
    dtypes = [np.dtype(d) for d in dtypes]
    nctrl = world + 1
    groups: list[list[int]] = []
    for dt in dict.fromkeys(dtypes):
        idx = [i for i, d in enumerate(dtypes) if d == dt]
        if zero:
            groups.append(idx)
            continue
        cur, size = [], 0
        for i in idx:
            n = numels[i] * dt.itemsize
            if cur and size + n > bucket_bytes:
                groups.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += n
        groups.append(cur)
    slots, sizes, ctrl = [None] * len(dtypes), [], None
    for f, idx in enumerate(groups):
        off = 0
        for i in idx:
            slots[i] = (f, off)
            off += numels[i]
        if not zero and ctrl is None and dtypes[idx[0]] in (np.float32, np.float64):
            ctrl, off = (f, off), off + nctrl
        sizes.append(world * -(-off // world) if zero else off)
    return Layout(slots, sizes, [dtypes[idx[0]] for idx in groups], ctrl)


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


class _Group:
    """The process group, and the rendezvous store that names a dead or hung rank."""

    store = None     # a PrefixStore when onnxgrad formed the group
    created = False  # whether close() should destroy it
    timeout = None   # the group's timeout (s), when onnxgrad formed it

    def __init__(self, dist, backend: str, timeout: float, device_id=None):
        import datetime
        self.dist = dist
        if not dist.is_initialized():
            need = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                    if k not in os.environ]
            if need:
                raise DistributedError(
                    f"no process group and no {', '.join(need)} in the environment: start the "
                    "processes with torchrun (torchrun --nproc-per-node N ...), or call "
                    "torch.distributed.init_process_group before")
            td = datetime.timedelta(seconds=timeout)
            try:
                store, rank, world = next(dist.rendezvous("env://", timeout=td))
                kw = {"device_id": device_id} if device_id is not None else {}
                dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                        timeout=td, **kw)
            except (RuntimeError, ValueError, OSError) as exc:
                raise DistributedError(f"rank {os.environ['RANK']}: the process group did not "
                                       f"form within {timeout:g} s (a rank did not start, or "
                                       f"cannot reach {os.environ['MASTER_ADDR']}:"
                                       f"{os.environ['MASTER_PORT']}): {exc}") from exc
            _Group.store = dist.PrefixStore("onnxgrad", store)
            _Group.created, _Group.timeout = True, timeout
            atexit.register(_destroy, dist)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.backend = str(dist.get_backend())
        if self.backend != backend:
            raise DistributedError(f"the process group's backend is {self.backend}, but the "
                                   f"trainer's device needs {backend}")

    def call(self, what: str, fn):
        """Run the collective(s) ``fn``; a failure becomes an error naming the rank that is gone."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001  (gloo/NCCL raise RuntimeError subclasses)
            if isinstance(exc, DistributedError):
                raise
            raise self.failure(what, exc) from exc

    def failure(self, what: str, exc: BaseException) -> DistributedError:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        here = f"(seen from rank {self.rank}: {detail})"
        if self.store is None:
            return DistributedError(f"{what} failed on rank {self.rank}: {detail}")
        missing = self._unresponsive()
        if missing is None:
            return DistributedError(f"{what} failed, and the rendezvous store does not answer "
                                    f"either: the launcher or the host that keeps the store is "
                                    f"gone {here}")
        if missing:
            who = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
            return DistributedError(f"{who} stopped responding during {what}: dead, or hung "
                                    f"past the {self.timeout:g} s timeout {here}")
        return DistributedError(f"{what} failed although every rank still answers {here}")

    def _unresponsive(self) -> list[int] | None:
        """The ranks that do not check in within the grace time (None: no store)."""
        run = (f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
               f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        key = f"alive/{run}/{{}}".format
        try:
            self.store.set(key(self.rank), "1")
            deadline = time.monotonic() + min(5.0, self.timeout / 2)  # for live ranks to answer
            while True:
                missing = [r for r in range(self.world)
                           if r != self.rank and not self.store.check([key(r)])]
                if not missing or time.monotonic() > deadline:
                    return missing
                time.sleep(0.05)
        except Exception:  # noqa: BLE001  (the store is gone too)
            return None


def _select_gpu(torch, local_rank: int, local_world: int, device: str) -> None:
    """One GPU per process: onnxruntime's sessions and buffers use device 0 of the process, so
    each local rank sees only its own GPU (set before anything touches CUDA)."""
    if local_world <= 1:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v for v in visible.split(",") if v.strip()] if visible is not None else \
        [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < local_world:
        if device == "cuda":
            raise DistributedError(f"{local_world} processes on this host but {len(ids)} GPUs: "
                                   "one GPU per process (fewer processes, or --device cpu)")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # device auto: every rank trains on the CPU
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[local_rank]


class DistributedTrainer(Trainer):
    """A :class:`Trainer` whose steps run on every process of a torch.distributed job.

    Takes the Trainer's arguments, plus:
    zero: ZeRO stage 1: each rank keeps and updates the optimizer state of 1/N of the parameter
        elements (see the module doc); the same results, less memory per rank. Needs an
        elementwise optimizer (SGD, Adam, AdamW).
    timeout: seconds a rank waits for the others in a collective before the job stops with an
        error naming the rank that is gone (found in min(5, timeout / 2) more seconds).
    bucket_mb: the size of the all-reduce buckets.

    ``fit(data, batch_size=B)`` takes the whole data on every rank and B is the global batch;
    ``step(batch)`` takes the global batch. Every rank must construct the trainer with the same
    model, optimizer and seed (checked). Call :meth:`save_checkpoint`, :meth:`load_checkpoint`,
    :meth:`export` and, with ``zero``, :meth:`optimizer_state` on every rank: they exchange data.
    """

    split_step = True

    def __init__(self, model, loss: str, *, zero: bool = False, timeout: float = 300.0,
                 bucket_mb: float = BUCKET_MB, device: str = "auto", threads: int | None = None,
                 seed: int = 0, progress: bool = True, **kw):
        torch, dist = _torch()
        if not hasattr(runtime.ort_module().OrtValue, "from_dlpack"):
            raise MissingExtraError("data-parallel training needs an onnxruntime whose OrtValue "
                                    "speaks DLPack (1.31 or newer)")
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise InvalidArgumentError(f"timeout={timeout!r} must be a positive number of seconds")
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise InvalidArgumentError(f"bucket_mb={bucket_mb!r} must be positive")
        if zero and type(kw.get("optimizer") or AdamW()) not in (SGD, Adam, AdamW):
            raise InvalidArgumentError(f"zero=True updates flat slices of the parameters: it "
                                       f"needs an elementwise optimizer (SGD, Adam, AdamW), "
                                       f"not {type(kw['optimizer']).__name__}")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if device != "cpu":
            _select_gpu(torch, local_rank, local_world, device)
        cuda = runtime.resolve(device) == "cuda"
        self._torch, self._dist = torch, dist
        self._tdev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(0)
        self._group = _Group(dist, "nccl" if cuda else "gloo", float(timeout),
                             self._tdev if cuda else None)
        self.rank, self.world_size = self._group.rank, self._group.world
        # the trainer that forms the group sets its timeout; later ones share it
        self.zero, self.timeout = bool(zero), _Group.timeout or float(timeout)
        self._bucket_bytes = int(bucket_mb * 2**20)
        #: exchange totals: steps, seconds in collectives, bytes of the buffers exchanged
        self.exchange = {"steps": 0, "seconds": 0.0, "bytes": 0}
        super().__init__(model, loss, device="cuda" if cuda else "cpu", seed=seed,
                         threads=threads or max(1, cores() // max(1, local_world)),
                         progress=progress and self.rank == 0, **kw)
        if self.zero:
            self._setup_zero()
        self._agree("the model, optimizer, ZeRO setting or seed", json.dumps(
            [self.params, self.state_names, [list(s) for s, _ in self._meta],
             [str(d) for _, d in self._meta], type(self.optimizer).__name__,
             self.optimizer.config(), self.clip_norm, self.zero, seed], default=str))
        self._broadcast_params()
        norms = sorted(statistics_read(self.model))
        if norms and self.rank == 0:
            _log.warning(
                "training-mode BatchNormalization (running statistics %s): each process "
                "normalizes with the statistics of its own rows and updates its own running "
                "statistics, as torch DDP without SyncBatchNorm does, so the steps are not one "
                "process's on the same batches; rank 0's statistics are checkpointed and "
                "exported", ", ".join(norms))

    # -- buffers: flat torch tensors, onnxruntime views of them ------------------------------
    def _buffer_sets(self, names, values):
        k = len(self.params)
        self._meta = [(tuple(values[p].shape), values[p].dtype) for p in self.params]
        self._plan()
        if not self.zero:
            return super()._buffer_sets(names, values)
        sets = []
        for s in (0, 1):
            params = [self._view(self._pflat[s][g], off, shape)
                      for (g, off), (shape, _) in zip(self._slot, self._meta)]
            for ov, p in zip(params, self.params):
                ov.update_inplace(np.ascontiguousarray(values[p]))
            # the state lives in flat slices (_zstate); these stand in for the Trainer's
            state = [self._new(np.zeros(0, values[n].dtype)) for n in names[k:]]
            sets.append(params + state)
        return sets

    def _gradient_buffers(self, values):
        return [self._view(self._gflat[f], off, shape)
                for (f, off), (shape, _) in zip(self._slot, self._meta)]

    def _view(self, flat, offset: int, shape):
        return self._ort.OrtValue.from_dlpack(flat[offset:offset + _numel(shape)].view(shape))

    def _tensor(self, size: int, dtype):
        return self._torch.zeros(size, dtype=getattr(self._torch, np.dtype(dtype).name),
                                 device=self._tdev)

    def _plan(self):
        n = self.world_size
        lay = plan_layout([_numel(s) for s, _ in self._meta], [d for _, d in self._meta], n,
                          self.zero, self._bucket_bytes)
        self._slot, self._ctrl_at, self._nctrl = lay.slots, lay.ctrl, n + 1
        self._gflat = [self._tensor(s, d) for s, d in zip(lay.sizes, lay.dtypes)]
        # the control values on their own, when no bucket carries them (+ the squared gradient
        # norm with ZeRO and clipping)
        self._ctrl_sep = None if lay.ctrl else self._tensor(
            self._nctrl + (self.zero and self.clip_norm is not None), np.float64)
        if self.zero:
            self._seg = [s // n for s in lay.sizes]
            self._rflat = self._gflat if n == 1 else [self._tensor(s, d)
                                                      for s, d in zip(self._seg, lay.dtypes)]
            self._pflat = [[self._tensor(s, d) for s, d in zip(lay.sizes, lay.dtypes)]
                           for _ in range(2)]

    def _setup_zero(self):
        """The optimizer over this rank's segments (one flat "parameter" per dtype), with its
        state, reading the segments of one parameter set and writing the other's: the fused
        kernel's slots, else the optimizer graph's bindings."""
        r = self.rank
        names = [f"zero_segment_{g}" for g in range(len(self._seg))]
        shapes = {nm: np.zeros(s, _np(self._rflat[g]))
                  for g, (nm, s) in enumerate(zip(names, self._seg))}
        z = build_apply_model(TrainStep(model=None, loss="", data_inputs=[], params=names,
                                        param_outputs=[], initial_params=shapes),
                              self.optimizer, None)  # clipping: the global norm, in _reduce
        self._zdesc = z
        self._zgroup = [names.index(p) for p, _ in z.state_of]
        state = [self._new(shapes[p]) for p, _ in z.state_of]  # one set, updated in place
        self._zstate = [state, state]  # (as the Trainer's: see Trainer._buffer_sets)
        seg = [[self._view(pf, r * s, (s,)) for pf, s in zip(self._pflat[k], self._seg)]
               for k in (0, 1)]
        grads = [self._view(rf, 0, (s,)) for rf, s in zip(self._rflat, self._seg)]
        if self._fused is not None:  # the fused update: segment k in, segment 1 - k out
            at = self._fused.state_index(z.state_of, names)
            self._zfused = [
                [(seg[k][g].data_ptr(), grads[g].data_ptr(),
                  *(0 if j is None else state[j].data_ptr() for j in at[g]), self._seg[g],
                  seg[1 - k][g].data_ptr()) for g in range(len(names))] for k in (0, 1)]
            self._zkeep = (seg, grads)  # the views whose addresses the kernel gets
            return
        self._zsess = self._session(z.model)
        self._zbind = []
        for k in (0, 1):
            b = self._zsess.io_binding()
            for name, out, grad, src, dst, g in zip(z.params, z.param_outputs, z.grads, seg[k],
                                                    seg[1 - k], grads):
                b.bind_ortvalue_input(name, src)
                b.bind_ortvalue_output(out, dst)
                b.bind_ortvalue_input(grad, g)
            for name, out, src, dst in zip(z.state, z.state_outputs, self._zstate[k],
                                           self._zstate[1 - k]):
                b.bind_ortvalue_input(name, src)
                b.bind_ortvalue_output(out, dst)
            b.bind_ortvalue_input(z.lr, self._lr)
            b.bind_ortvalue_input(z.step, self._stepv)
            self._zbind.append(b)

    def _session(self, model):
        return make_session(model, self.device, self.threads, None, self._so)

    def exchange_views(self) -> list[tuple[str, object, object]]:
        """(parameter, the OrtValue its gradient is written to, the torch tensor the collectives
        send it from) per parameter: two views of the same memory, a slice of a flat buffer."""
        return [(p, ov, self._gflat[f][off:off + _numel(shape)].view(shape))
                for p, ov, (f, off), (shape, _) in zip(self.params, self._grads, self._slot,
                                                       self._meta)]

    # -- collectives -----------------------------------------------------------------------
    def _sync(self):
        if self.device == "cuda":  # torch's stream and onnxruntime's do not wait for each other
            self._torch.cuda.current_stream().synchronize()

    def _agree(self, what: str, text: str):
        """Stop unless every rank has the same ``text``."""
        t = self._torch.tensor([zlib.crc32(text.encode())], dtype=self._torch.int64,
                               device=self._tdev)
        out = self._tensor(self.world_size, np.int64)
        self._group.call(f"checking {what}", lambda: _all_gather(self._dist, out, t))
        got = out.tolist()
        bad = [r for r, v in enumerate(got) if v != got[0]]
        if bad:
            raise DistributedError(f"{what} differ between the ranks: rank "
                                   f"{', '.join(map(str, bad))} against rank 0")

    def _broadcast_params(self):
        if self.zero:
            tensors = self._pflat[self._cur]
        else:
            tensors = [self._torch.from_dlpack(ov)
                       for ov in self._sets[self._cur][:len(self.params)]]
        self._sync()
        self._group.call("broadcasting the parameters from rank 0",
                         lambda: [self._dist.broadcast(t, 0) for t in tensors])
        self._sync()

    def _accumulate(self, batch, total_rows=None):
        if not len(next(iter(batch[k] for k in self.data_inputs))):  # a short last batch
            for f in self._gflat:
                f.zero_()
            return 0.0
        return super()._accumulate(batch, total_rows)

    def _reduce_gradients(self, loss: float) -> float:
        dist, n = self._dist, self.step_count + 1
        ctrl = np.zeros(self._nctrl + (self.zero and self.clip_norm is not None))
        ctrl[0] = loss
        ctrl[1 + self.rank] = 0.0 if math.isfinite(loss) else 1.0
        t0 = time.perf_counter()
        what = f"the gradient exchange of step {n}"
        solo = self.world_size == 1  # nothing to exchange (with ZeRO, _rflat is _gflat)
        # blocking calls, bucket after bucket: gloo's async path costs twice the latency of a
        # small bucket here, and NCCL's blocking calls only enqueue on the stream anyway
        if self.zero:
            if not solo:
                self._group.call(what, lambda: [_reduce_scatter(dist, r, g)
                                                for r, g in zip(self._rflat, self._gflat)])
            if self.clip_norm is not None:  # the squared norm of this rank's share
                ctrl[-1] = sum(self._torch.linalg.vector_norm(
                    r, dtype=self._torch.float64).item() ** 2 for r in self._rflat)
        elif not solo:
            if self._ctrl_at is not None:
                f, off = self._ctrl_at
                self._gflat[f][off:off + self._nctrl].copy_(self._torch.from_numpy(ctrl))
            self._group.call(what, lambda: [dist.all_reduce(f) for f in self._gflat])
        if solo:
            got = ctrl.tolist()
        elif self._ctrl_sep is not None:
            self._ctrl_sep.copy_(self._torch.from_numpy(ctrl))
            self._group.call(what, lambda: dist.all_reduce(self._ctrl_sep))
            got = self._ctrl_sep.tolist()
        else:
            f, off = self._ctrl_at
            got = self._gflat[f][off:off + self._nctrl].tolist()  # waits for NCCL too
        self._count(time.perf_counter() - t0, [] if solo else self._gflat)
        total, flags = got[0], got[1:1 + self.world_size]
        if any(flags) or not math.isfinite(total):
            raise RankNonFiniteLossError(n, total, [r for r, f in enumerate(flags) if f])
        if self.zero and self.clip_norm is not None:  # torch.nn.utils.clip_grad_norm_
            coef = min(1.0, self.clip_norm / (math.sqrt(got[-1]) + 1e-6))
            for r in self._rflat:
                r.mul_(coef)
            self._sync()
        return total

    def _apply_gradients(self):
        if not self.zero:
            return super()._apply_gradients()
        if self._fused is not None:
            self._fused.apply(self._zfused[self._cur], self._lr_now, self.step_count + 1,
                              clip=False)  # clipped in _reduce_gradients (the global norm)
        else:
            self._run(self._zsess, self._zbind[self._cur])
        dst, r = self._pflat[1 - self._cur], self.rank
        if self.world_size == 1:
            return
        t0 = time.perf_counter()
        self._group.call(f"gathering the parameters of step {self.step_count + 1}", lambda: [
            _all_gather(self._dist, p, p[r * s:(r + 1) * s]) for p, s in zip(dst, self._seg)])
        self._sync()
        self._count(time.perf_counter() - t0, dst, steps=0)

    def _count(self, seconds, tensors, steps=1):
        e = self.exchange
        e["steps"] += steps
        e["seconds"] += seconds
        e["bytes"] += sum(t.numel() * t.element_size() for t in tensors)

    # -- the loop ----------------------------------------------------------------------------
    def _step(self, batch: dict, total_rows: int | None = None) -> float:
        """One step on the global ``batch`` (the same on every rank; ``step`` and ``fit`` check
        it first): this rank trains on its rows r, r + N, ...; returns the loss of the whole
        batch."""
        rows = len(next(iter(batch[k] for k in self.data_inputs if k in batch), ()))
        shard = {k: v[self.rank::self.world_size] for k, v in batch.items()}
        return super()._step(shard, total_rows=rows)

    def fit(self, data: dict, epochs: int = 1, batch_size: int = 32, shuffle: bool = True,
            **kw) -> list[float]:
        """:meth:`Trainer.fit` on every rank, ``batch_size`` rows per step in all (see the class
        doc). The ranks must pass the same data and arguments (checked)."""
        if batch_size < self.world_size:
            raise InvalidArgumentError(f"batch_size={batch_size} is the global batch: it must be at least "
                             f"the number of processes ({self.world_size})")
        probe = [[list(np.shape(data[k])), str(np.asarray(data[k]).dtype), zlib.crc32(
            np.ascontiguousarray(np.asarray(data[k])[::max(1, len(data[k]) // 16)]).tobytes())]
            for k in self.data_inputs if k in data]
        self._agree("the data or fit arguments", json.dumps(
            [probe, epochs, batch_size, shuffle, kw.get("drop_last", False),
             kw.get("max_steps"), bool(kw.get("resume"))]))
        return super().fit(data, epochs, batch_size, shuffle, **kw)

    # -- the state: with ZeRO, gathered where it is needed -----------------------------------
    @contextlib.contextmanager
    def _whole_state(self, to):
        """With ZeRO: put the whole optimizer state in the Trainer's buffer set on rank ``to``
        ("all": every rank), gathered from the segments; None: zeros on every rank (to load
        into). Yields the full flat state buffers (aligned with the segments' state)."""
        if not self.zero:
            yield None
            return
        k, cur, r = len(self.params), self._sets[self._cur], self.rank
        here = to in (None, "all", r)
        full = [self._tensor(self._seg[g] * self.world_size, _np(self._rflat[g])) if here
                else None for g in self._zgroup]
        if to is not None:
            mine = [self._torch.from_dlpack(ov) for ov in self._zstate[self._cur]]
            seg = [self._seg[g] for g in self._zgroup]
            self._sync()
            self._group.call("gathering the optimizer state", lambda: [
                _all_gather(self._dist, f, m) if to == "all" else self._dist.gather(
                    m, list(f.split(s)) if r == to else None, dst=to)
                for f, m, s in zip(full, mine, seg)])
            self._sync()
        held = {}
        if here:
            at = {(self._zdesc.params[g], slot): j
                  for j, ((_, slot), g) in enumerate(zip(self._zdesc.state_of, self._zgroup))}
            for j, (p, slot) in enumerate(self._desc.state_of):
                i = self.params.index(p)
                g, off = self._slot[i]
                held[j] = cur[k + j]
                cur[k + j] = self._view(full[at[(self._zdesc.params[g], slot)]], off,
                                        self._meta[i][0])
        try:
            yield full
        finally:
            for j, ov in held.items():
                cur[k + j] = ov

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The whole optimizer state (with ZeRO gathered from the segments: call on every
        rank)."""
        with self._whole_state("all"):
            return super().optimizer_state()

    def save_checkpoint(self, path) -> None:
        """Rank 0 writes the checkpoint (:meth:`Trainer.save_checkpoint`, atomic); every rank
        calls this, and every rank stops if rank 0 could not write."""
        err = None
        with self._whole_state(0):
            if self.rank == 0:
                try:
                    super().save_checkpoint(path)
                except Exception as exc:  # noqa: BLE001  (re-raised below, after telling all)
                    err = exc
        ok = self._torch.tensor([err is None], dtype=self._torch.int64, device=self._tdev)
        self._group.call("writing the checkpoint", lambda: self._dist.broadcast(ok, 0))
        if err is not None:
            raise err
        if not ok.item():
            raise DistributedError(f"rank 0 could not write the checkpoint {path} (its error "
                                   "says why): training stopped on every rank")

    def load_checkpoint(self, path) -> None:
        """Every rank reads ``path``; the ranks then check they all resumed at the same step."""
        err = None
        with self._whole_state(None) as full:
            try:
                super().load_checkpoint(path)
                if full is not None:  # keep this rank's segment of the state
                    r = self.rank
                    for ov, f, g in zip(self._zstate[self._cur], full, self._zgroup):
                        s = self._seg[g]
                        self._torch.from_dlpack(ov).copy_(f[r * s:(r + 1) * s])
                    self._sync()
            except Exception as exc:  # noqa: BLE001  (re-raised below, after telling all)
                err = exc
        epoch, batch, _ = self._pos
        mine = [int(err is None), self.step_count, epoch, batch]
        t = self._torch.tensor(mine, dtype=self._torch.int64, device=self._tdev)
        out = self._tensor(len(mine) * self.world_size, np.int64)
        self._group.call("resuming", lambda: _all_gather(self._dist, out, t))
        rows = out.view(self.world_size, len(mine)).tolist()
        if err is not None:
            raise err
        failed = [r for r, row in enumerate(rows) if not row[0]]
        if failed:
            raise DistributedError(f"rank {', '.join(map(str, failed))} could not read the "
                                   f"checkpoint {path} (its error says why)")
        if any(row[1:] != rows[0][1:] for row in rows):
            at = "; ".join(f"rank {r}: step {s}, epoch {e}, batch {b}"
                           for r, (_, s, e, b) in enumerate(rows))
            raise DistributedError(f"the ranks read different checkpoints from {path} ({at}): "
                                   "every host must see the same file")
        self._broadcast_params()

    def export(self, path, train_step=None, gradient=None) -> None:
        """Rank 0 writes (see :meth:`Trainer.export`); call on every rank."""
        if self.rank == 0:
            return super().export(path, train_step, gradient)
        if train_step and self.zero:
            self.optimizer_state()  # rank 0 gathers the state: take part

    def memory(self) -> dict[str, int]:
        """Bytes of the training buffers this rank holds, by role, and the total an unsharded
        data-parallel rank holds for the same model (ZeRO saves the difference)."""
        def size(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        numels = [_numel(s) for s, _ in self._meta]
        param = sum(m * np.dtype(d).itemsize for m, (_, d) in zip(numels, self._meta))
        slots = len(self.optimizer.slots)
        work = param * (2 if self.accumulation_steps > 1 else 1)  # zeros (+ scratch)
        if self.zero:
            held = {"parameters": size(self._pflat[0] + self._pflat[1]),
                    "gradients": size({id(t): t for t in self._gflat + self._rflat +
                                       [self._ctrl_sep]}.values()) + work,
                    "optimizer_state": slots * size(self._rflat)}
        else:
            held = {"parameters": 2 * param, "gradients": size(self._gflat + [self._ctrl_sep]) +
                    work, "optimizer_state": slots * param}
        held["total"] = sum(held.values())
        ddp = plan_layout(numels, [d for _, d in self._meta], self.world_size, False,
                          self._bucket_bytes)
        grads = sum(s * d.itemsize for s, d in zip(ddp.sizes, ddp.dtypes)) + \
            (0 if ddp.ctrl else 8 * self._nctrl)
        held["unsharded_total"] = 2 * param + grads + work + slots * param
        return held

    def close(self) -> None:
        """Destroy the process group if onnxgrad formed it (else at exit), after the last
        trainer that uses it."""
        _destroy(self._dist)


def _destroy(dist):
    if _Group.created and dist.is_initialized():
        dist.destroy_process_group()
    _Group.created, _Group.store, _Group.timeout = False, None, None


def _np(t) -> np.dtype:
    """The numpy dtype of a torch tensor (bfloat16 through ml_dtypes)."""
    name = str(t.dtype).removeprefix("torch.")
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _all_gather(dist, out, t):
    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, t)


def _reduce_scatter(dist, out, t):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, t)
