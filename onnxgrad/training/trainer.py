"""The Trainer: runs a train-step graph on onnxruntime with the weights kept on the device.

    trainer = Trainer(model, "cross_entropy", optimizer=AdamW(lr=1e-3))
    trainer.fit({"x": X, "target": y}, epochs=5, batch_size=64, checkpoint="ckpt.npz")
    trainer.export("trained.onnx")

How a step runs: the parameters and the optimizer state are OrtValues on the session's device
(CUDA when a CUDA session can be created, else CPU). The parameters are in two sets, because the
step reads them until its end: two IOBindings are built once, one reads set A and writes the
updated parameters into set B, the other the reverse. The optimizer state is one set, read and
written in place by the step's last nodes (see _buffer_sets). Each step binds only the batch,
the learning rate and the step number, runs, reads the scalar loss (the only host copy) and
flips to the other binding. Nothing is copied on the Python side per step.

On CPU, SGD, Adam and AdamW take a fused update instead
(``fused_optimizer``): the step runs the gradient graph, its gradients landing in buffers of their
own, and after a finite loss one C pass per parameter updates the parameters and the state in
place (:mod:`onnxgrad.training.fused`; the same arithmetic as the optimizer graph). The
parameters are then one set. Split steps (below) take it in place of their optimizer graph.

Gradient accumulation (``accumulation_steps=k``): the batch is split into k micro-batches; an
accumulating gradient graph adds w_i * grad_i into running sums on the device, then the
optimizer graph applies them once. The reported loss is sum(w_i * loss_i). w_i is what makes
both the big batch's, up to float rounding, for every built-in loss: norm_i / norm, where a
loss's norm is what it divides its sum by (rows for a mean: every row has as many elements; the
summed weights of the targets for a cross_entropy with class weights or ignore_index), and 1
for reduction="sum"; a micro-batch whose targets are all ignored is skipped (its own mean is
0 / 0). A loss the model computes itself is taken to be a mean over rows (w_i = n_i / N).

A subclass that works on the gradients between the two graphs (data-parallel training,
:mod:`onnxgrad.training.distributed`) sets ``split_step``: the gradient and optimizer graphs then
run as two sessions even without accumulation, the gradients land in the buffers
``_gradient_buffers`` makes, and ``_reduce_gradients`` / ``_apply_gradients`` run between and
after them.

A non-finite loss raises :class:`NonFiniteLossError` naming the step; the step's updates are not
applied. Checkpoints (npz: parameters, optimizer state, step, epoch position, the shuffling RNG's
state, the loss history, and a manifest of each array's dtype, shape and SHA-256) are written
atomically and only with finite values, checked in full before anything is restored, and a
resumed ``fit`` reproduces the uninterrupted run bit for bit on CPU; a checkpoint also records
the optimizer (kind and hyper-parameters) and the batch size, and resumes only with the same ones
(the learning rate may change) and, in the middle of an epoch, the same number of rows. Data is
checked before the first step (``fit``), before each ``step`` and before ``evaluate``: shapes,
finite values, and class labels in range (see losses.check_labels).
"""
from __future__ import annotations

import functools
import json
import math
import os

import numpy as np
import onnx
from onnx import numpy_helper

from .. import runtime
from ..aliasing import statistics_read
from ..errors import (CheckpointError, DataError, InvalidArgumentError, NonFiniteError,
                      NonFiniteLossError, WriteError)
from ..inference import graphs_of, node_subgraphs
from ..storage import external_data_files, keep_data_of
from . import fused
from .losses import LOSSES, attach_loss, check_labels, class_axis_of, load, output_type
from .nchwc import blocked_convs
from .optimizers import check_number
from .optimizers import AdamW, Optimizer
from .grad_layout import stored_gradients
from .step import (_log, _params_to_inputs, _prune, as_module_parameters,
                   build_accumulate_model, build_apply_model, build_gradient_model,
                   build_train_step, with_defaults)

# -1: without a manifest; -1 and -2: Adam's state as torch's m and v (both still read)
CHECKPOINT_FORMAT = "onnxgrad-checkpoint-3"
_LEGACY_FORMATS = ("onnxgrad-checkpoint-1", "onnxgrad-checkpoint-2")
_CHECKPOINT_FORMATS = _LEGACY_FORMATS + (CHECKPOINT_FORMAT,)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover  (macOS, Windows)
        return os.cpu_count() or 1


def session_options(threads: int | None = None, profile: str | None = None,
                    device: str = "cpu", loops: bool = False):
    """Tuned for training: all graph optimisations, one intra-op thread per core, quiet logs;
    on the CPU no memory pattern, unless the model ``loops``: the block onnxruntime plans from
    the first run holds more than its arena reuses on its own (a step's peak RSS: ResNet-18
    816 -> 685 MB, MobileNetV3 489 -> 367 MB, TransformerEncoder 514 -> 362 MB; step time within
    noise, measured one thread), but a Scan or Loop body planned once, rather than allocated
    tensor by tensor at every iteration, makes the LSTM step about 2 % faster at 1 and at 2
    threads for 9 MB (alternated processes)."""
    ort = runtime.ort_module()
    so = runtime.session_options(threads or cores())
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.enable_mem_pattern = device == "cuda" or loops
    if device == "cpu" and _cpu_arena(ort):
        so.add_session_config_entry("session.use_env_allocators", "1")
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.inter_op_num_threads = 1
    # the pool's threads spin between a run's kernels, not after it: there they would take
    # the cores from the fused optimizer's threads and the next step's Python
    so.add_session_config_entry("session.force_spinning_stop", "1")
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    return so


@functools.cache
def _cpu_arena(ort) -> bool:
    """onnxruntime's CPU arena for the steps' sessions, registered once in the process: chunks
    grow by powers of two only up to 16 MB, then by what is asked (the default doubles up to
    1 GB, and the rest of the last chunk stays reserved): ResNet-18's step peak RSS 654 ->
    614 MB (PyTorch's 630 to 640), MobileNetV3's the same, the TransformerEncoder's and the
    U-Net's 12 and 15 MB more (far below PyTorch's still); step times within noise (measured
    in alternated processes). False where it cannot be registered (the sessions keep their
    own arenas)."""
    try:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                 ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(
            {"arena_extend_strategy": 0, "max_power_of_two_extend_bytes": 16 << 20}))
        return True
    except Exception:  # noqa: BLE001  (one registered already, or an older onnxruntime)
        return False


def make_session(model: onnx.ModelProto, device: str = "cpu", threads: int | None = None,
                 profile: str | None = None, options=None):
    """An onnxruntime session for a step's model; on the CPU its Conv nodes run in
    onnxruntime's blocked layout (:mod:`onnxgrad.training.nchwc`)."""
    if runtime.resolve(device) == "cpu":
        model = blocked_convs(model)
    return runtime.session(model, device, options=options or session_options(
        threads, profile, device, loops=_loops(model)))


def _loops(model: onnx.ModelProto) -> bool:
    """Whether a Scan or Loop runs in ``model`` (its functions included: onnxruntime inlines
    them, and the RNN ops' bodies are Scans)."""
    nodes = [n for f in model.functions for n in f.node]
    graphs = graphs_of(model.graph) + [s for n in nodes for g in node_subgraphs(n)
                                       for s in graphs_of(g)]
    nodes += [n for g in graphs for n in g.node]
    return any(n.op_type in ("Scan", "Loop") and n.domain in ("", "ai.onnx") for n in nodes)


def _tqdm():
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm


class Trainer:
    """Train an ONNX model on onnxruntime.

    model: the ONNX model (ModelProto or path); what :meth:`export` writes back with the trained
        weights.
    loss: a loss kind ("mse", "l1", "cross_entropy", "bce"; attached to ``output_name``, default
        the first output, with a new input ``target_name``; ``loss_options`` go to
        :func:`~onnxgrad.training.losses.attach_loss`), or the name of a scalar tensor the model
        already computes.
    optimizer: an :class:`~onnxgrad.training.optimizers.Optimizer` (default AdamW()).
    params / frozen / clip_norm: as :func:`~onnxgrad.training.step.build_train_step`
        (``left_out``, after construction, names the initializers ``params=None`` did not
        train and why).
    lr_schedule: None (the optimizer's lr) or ``f(step) -> lr``, step counted from 1.
    accumulation_steps: split each batch into this many micro-batches (see the module doc):
        the step equals the one-batch step for every built-in loss; a loss the model computes
        itself must be a mean over rows.
    device: "auto" (CUDA when a CUDA session can be created), "cpu" or "cuda".
    threads: intra-op threads (default: the cores this process may use).
    seed: seeds the RNG that shuffles batches in :meth:`fit`.
    progress: show a tqdm bar in :meth:`fit` when tqdm is installed.
    profile: a file prefix: turn on onnxruntime profiling of the step session.
    session_options: an onnxruntime.SessionOptions for the training sessions instead of the
        tuned default (:func:`session_options`: ORT_ENABLE_ALL, one thread per core).
    fused_optimizer: "auto" (default): on CPU, SGD, Adam and AdamW update the parameters with
        one fused C pass after the gradient graph (:mod:`onnxgrad.training.fused`, built with
        the machine's C compiler on first use) instead of the ONNX optimizer nodes; where it
        cannot, the optimizer graph runs. True: the fused update or an error saying why not;
        False: always the optimizer graph.
        ``fused_reason`` says why a Trainer runs without it (None when it runs with it).
    """

    #: run the gradient graph and the optimizer graph as two sessions even without accumulation
    split_step = False

    def __init__(self, model, loss: str, *, output_name: str | None = None,
                 target_name: str = "target", loss_options: dict | None = None,
                 optimizer: Optimizer | None = None, params=None, frozen=None,
                 clip_norm: float | None = None, lr_schedule=None, accumulation_steps: int = 1,
                 device: str = "auto", threads: int | None = None, seed: int = 0,
                 progress: bool = True, profile: str | None = None, session_options=None,
                 fused_optimizer="auto"):
        if not (fused_optimizer is True or fused_optimizer is False or fused_optimizer == "auto"):
            raise InvalidArgumentError(f"fused_optimizer={fused_optimizer!r} must be 'auto', "
                                       "True or False")
        # (a model file's external data, which export and save_checkpoint never write over)
        self._source = model if isinstance(model, (str, os.PathLike)) else None
        self.model = as_module_parameters(load(model))
        self._so = session_options
        if loss in LOSSES:
            self.loss_model = attach_loss(self.model, loss, output_name, target_name=target_name,
                                          **(loss_options or {}))
            self.loss_name = self.loss_model.graph.output[-1].name
            self.loss_kind = loss
        else:
            if loss_options or output_name:
                raise InvalidArgumentError(
                    f"loss={loss!r} names a tensor of the model: output_name and "
                    "loss_options apply to loss kinds only "
                    f"({', '.join(LOSSES)})")
            self.loss_model, self.loss_name, self.loss_kind = self.model, loss, None
        self.output_name = output_name or self.model.graph.output[0].name
        opts = loss_options or {}
        self._ignore_index = opts.get("ignore_index")
        # what the built-in loss divides its sum by (see _loss_norm)
        self._reduction = opts.get("reduction", "mean") if self.loss_kind else None
        self._class_weight = (np.asarray(opts["weight"], np.float64).reshape(-1)
                              if opts.get("weight") is not None else None)
        self._batch_norm = None  # _loss_norm of the whole batch of the step being taken
        self._classes = None  # cross_entropy: the logits' classes dim, once known
        self._class_dim_read = False  # whether the model's shapes were asked for it
        #: the cross_entropy logits' axis of classes (1, or -1 for a converted TF model)
        self.class_axis = class_axis_of(self.model, opts.get("class_axis")) \
            if self.loss_kind == "cross_entropy" else 1
        self.target_name = (self.loss_model.graph.input[-1].name if self.loss_kind else None)
        self.optimizer = optimizer or AdamW()
        self.clip_norm = clip_norm
        self.lr_schedule = lr_schedule
        if isinstance(accumulation_steps, bool) or not isinstance(
                accumulation_steps, (int, np.integer)) or accumulation_steps < 1:
            raise InvalidArgumentError(f"accumulation_steps={accumulation_steps!r} must be an "
                                       "integer >= 1")
        self.accumulation_steps = int(accumulation_steps)
        self._split = self.accumulation_steps > 1 or self.split_step
        if self._split and self._class_weight is not None and (self._class_weight < 0).any():
            # a part whose weights sum to 0 has a loss of x / 0: no weighting of the parts'
            # means gives the batch's sum(w l) / sum(w) then
            raise InvalidArgumentError(
                "loss_options weight: negative class weights "
                f"({self._class_weight.tolist()}) cannot be split into micro-batches or shards "
                "exactly: use accumulation_steps=1 or non-negative weights")
        self.device = runtime.resolve(device)
        self.threads = threads or cores()
        self.progress = progress
        self.profile = profile
        self.rng = np.random.default_rng(seed)
        self.step_count = 0
        self.history: list[float] = []
        self._pos = (0, 0, None)  # fit position: epoch, next batch, that epoch's order
        self._pos_batch_size = None  # the batch size that position counts in
        self._resuming = (None, None)  # (rows, batch_size) of the fit resuming, while it loads
        self._ort = runtime.ort_module()
        self._params_spec = params
        self._frozen = frozen
        self._infer = self._eval = None

        self._fused, self.fused_reason = None, self._fused_obstacle(fused_optimizer)
        if self.fused_reason is None or self._split:
            # the gradient graph (an accumulating one for split steps) without the optimizer
            build = build_accumulate_model if self._split else build_gradient_model
            self._acc = build(self.loss_model, self.loss_name, params, frozen)
        if self.fused_reason is None:
            dtypes = [self._acc.initial_params[p].dtype for p in self._acc.params]
            self.fused_reason = fused.unsupported(self.optimizer, dtypes)
            if self.fused_reason is None:
                self._fused = fused.make(self.optimizer, dtypes[0], self.threads, clip_norm)
        if fused_optimizer is True and self.fused_reason is not None:
            raise InvalidArgumentError(f"fused_optimizer=True: {self.fused_reason}")
        if self._fused is None and not self._split:
            self.train_step = build_train_step(self.loss_model, self.loss_name, params,
                                               self.optimizer, frozen, clip_norm)
            desc = self.train_step
            self._sess = make_session(desc.model, self.device, self.threads, profile, self._so)
        else:
            self.train_step = None  # built on demand by export()
            # the optimizer graph: run for split steps, its state layout only when fused
            self._apply = build_apply_model(self._acc, self.optimizer, clip_norm)
            desc = self._apply
            acc_model, self._stored = self._acc.model, [None] * len(self._acc.grads)
            if self._fused is not None and not self._split:
                sizes = [self._acc.initial_params[p].size for p in self._acc.params]
                acc_model, self._stored = stored_gradients(acc_model, self._acc.loss,
                                                           self._acc.grads, sizes)
            self._acc_sess = make_session(acc_model, self.device, self.threads, profile,
                                          self._so)
            self._sess = None if self._fused is not None else make_session(
                self._apply.model, self.device, self.threads, None, self._so)
        self.params = list(desc.params)
        self.state_names = list(desc.state)
        self._desc = desc
        self._input_dtypes, self._input_shapes = {}, {}
        self._loss_sess = self._acc_sess if self._split or self._fused else self._sess
        for i in self._loss_sess.get_inputs():
            self._input_dtypes[i.name] = _np_dtype(i.type)
            self._input_shapes[i.name] = i.shape
        fwd = self.train_step or self._acc  # the forward's graph
        self.data_inputs = list(fwd.data_inputs)
        #: the float initializers that params=None left out, {name: why} (step.default_params)
        self.left_out = dict(desc.left_out)
        # training-mode BatchNormalization running statistics: one buffer each, read and
        # written by the forward's session (as PyTorch's step updates them)
        self.stat_names = list(fwd.stats)
        self._stat_bufs = [self._new(fwd.initial_stats[n]) for n in self.stat_names]
        stale = sorted(statistics_read(self.model) - set(self.params) - set(self.stat_names))
        if stale:
            _log.warning(
                "BatchNormalization running statistics not updated by the Trainer: %s keep "
                "their values (each is read by more than one training-mode BatchNormalization, "
                "is no initializer, or is read inside a model function or a subgraph; in "
                "training mode the model normalizes with each batch's statistics)",
                ", ".join(stale))

        # device buffers: two sets of params + state; scalars and the loss on the host
        init = dict(desc.initial_params)
        init.update(desc.initial_state(init))
        names = self.params + self.state_names
        init.update(fwd.initial_stats)
        # what a checkpoint holds
        self._specs = {n: (init[n].dtype, init[n].shape) for n in names + self.stat_names}
        fwd.initial_stats = {}
        self._last_checkpoint = None  # (path, step) of the last checkpoint written
        self._sets = self._buffer_sets(names, init)
        self._cur = 0
        # scalars the step reads live on its device and change in place: a host OrtValue bound
        # to a CUDA session is copied to the device when it is bound, not when it is run (the
        # steps after the first read lr 0 and step 0, and went NaN)
        self._lr = self._new(np.zeros((), np.float64))
        self._stepv = self._new(np.zeros((), np.int64))
        loss_type = next(o.type for o in self._loss_sess.get_outputs()
                         if o.name == self.loss_name)
        self._loss = self._ort.OrtValue.ortvalue_from_numpy(np.zeros((), _np_dtype(loss_type)))
        if self._fused is not None:
            self._fused_state = self._fused.state_index(desc.state_of, self.params)
        if self._split:
            self._setup_accumulation(init)
        elif self._fused is not None:
            self._setup_fused(init)
        else:
            self._bindings = [self._bind_step(k) for k in (0, 1)]
        # the values live in the device buffers now: drop the host copies the builders made
        del init
        for d in {id(x): x for x in (desc, self.train_step, getattr(self, "_acc", None))
                  if x is not None}.values():
            d.initial_params = {}

    # -- buffers ---------------------------------------------------------------------------
    def _new(self, arr: np.ndarray):
        ov = self._ort.OrtValue.ortvalue_from_shape_and_type(list(arr.shape), arr.dtype,
                                                             self.device, 0)
        ov.update_inplace(np.ascontiguousarray(arr))
        return ov

    def _buffer_sets(self, names: list[str], values: dict) -> list[list]:
        """The two sets of device buffers (params then state, aligned with ``names``). The
        params alternate (the step reads them until its end); the optimizer state is one set
        of buffers, read and written in place by the step's last nodes: each state value is read
        only by nodes its new value depends on (step._check_state_in_place). A step that is not
        taken leaves it as it was: the one-graph step gates the state's update by the loss
        being finite (optimizers.Scalars.gate); a split step runs its optimizer graph only
        after a finite loss."""
        k = len(self.params)
        state = [self._new(values[n]) for n in names[k:]]
        if self._fused is not None:  # updated in place after the gradient graph: one set
            one = [self._new(values[n]) for n in names[:k]] + state
            return [one, one]
        return [[self._new(values[n]) for n in names[:k]] + state for _ in range(2)]

    def _gradient_buffers(self, values: list[np.ndarray]) -> list:
        """Where a split step's gradients land (aligned with params; what the optimizer reads)."""
        return [self._new(np.zeros_like(v)) for v in values]

    def _bind_step(self, k: int):
        """The binding that reads set k and writes set 1 - k."""
        d, b = self._desc, self._sess.io_binding()
        src, dst = self._sets[k], self._sets[1 - k]
        ins = d.params + d.state
        outs = d.param_outputs + d.state_outputs
        for name, ov in zip(ins, src):
            b.bind_ortvalue_input(name, ov)
        for name, ov in zip(outs, dst):
            b.bind_ortvalue_output(name, ov)
        b.bind_ortvalue_input(d.lr, self._lr)
        b.bind_ortvalue_input(d.step, self._stepv)
        self._bind_statistics(b, d)
        if self._split:
            for name, ov in zip(d.grads, self._grads):
                b.bind_ortvalue_input(name, ov)
        else:
            b.bind_ortvalue_output(d.loss, self._loss)
        return b

    def _bind_statistics(self, b, d) -> None:
        """The running statistics of ``d``'s forward (none in an optimizer graph) in and out of
        one buffer each: the step reads each before the BatchNormalization that updates it."""
        for name, out, ov in zip(d.stats, d.stat_outputs, self._stat_bufs):
            b.bind_ortvalue_input(name, ov)
            b.bind_ortvalue_output(out, ov)

    def _fused_obstacle(self, wanted) -> str | None:
        """Why this Trainer cannot take the fused optimizer, before any graph is built."""
        if wanted is False:
            return "fused_optimizer=False"
        if self.device != "cpu":
            return "the fused optimizer runs on CPU"
        return fused.unsupported(self.optimizer) or fused.unavailable()

    def _setup_fused(self, init):
        """The gradient graph's binding: params in, loss and gradients out into ``_grads``, each
        where and in the shape the graph leaves it (``_stored``; the kernel reads it flat)."""
        a, k = self._acc, len(self.params)
        self._grads = self._gradient_buffers(
            [init[p] if st is None else np.empty(st[1], init[p].dtype)
             for p, st in zip(self.params, self._stored)])
        b = self._acc_sess.io_binding()
        for name, ov in zip(a.params, self._sets[0][:k]):
            b.bind_ortvalue_input(name, ov)
        b.bind_ortvalue_output(a.loss, self._loss)
        self._bind_statistics(b, a)
        for name, st, ov in zip(a.grads, self._stored, self._grads):
            b.bind_ortvalue_output(name if st is None else st[0], ov)
        self._bindings = [b, b]

    def _fused_update(self) -> None:
        """The step being taken, on the buffers in place (the fused kernel)."""
        bufs, k, slots = self._sets[0], len(self.params), []
        for i, state in enumerate(self._fused_state):
            p = bufs[i]
            slots.append((p.data_ptr(), self._grads[i].data_ptr(),
                          *(0 if j is None else bufs[k + j].data_ptr() for j in state),
                          int(np.prod(p.shape(), dtype=np.int64))))
        self._fused.apply(slots, self._lr_now, self.step_count + 1)

    def _setup_accumulation(self, init):
        a = self._acc
        pv = [init[p] for p in self.params]
        self._zeros = [self._new(np.zeros_like(v)) for v in pv]
        self._grads = self._gradient_buffers(pv)
        # micro-batches alternate between _grads and this set, the last one writing _grads
        self._scratch = ([self._new(np.zeros_like(v)) for v in pv]
                         if self.accumulation_steps > 1 else None)
        self._wdtype = pv[0].dtype
        self._weight = self._new(np.zeros((), self._wdtype))  # on the device: see _lr
        # the gradient binding: params and running sums are bound per micro-batch
        self._acc_bind = self._acc_sess.io_binding()
        b = self._acc_bind
        b.bind_ortvalue_input(a.grad_weight, self._weight)
        b.bind_ortvalue_output(a.loss, self._loss)
        self._bind_statistics(b, a)
        if self._fused is None:
            self._bindings = [self._bind_step(k) for k in (0, 1)]

    # -- stepping --------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        lr = self.lr_schedule(step) if self.lr_schedule else self.optimizer.lr
        what = f"the lr_schedule at step {step}" if self.lr_schedule else "the optimizer"
        return check_number(what, "lr", lr)

    def _feed(self, binding, batch: dict):
        for name in self.data_inputs:
            if name not in batch:
                raise DataError(f"the batch has no {name!r} (the step reads {self.data_inputs})")
            binding.bind_cpu_input(name, np.ascontiguousarray(batch[name],
                                                              self._input_dtypes[name]))

    def _run(self, sess, binding):
        sess.run_with_iobinding(binding)
        if self.device == "cuda":
            binding.synchronize_outputs()

    def step(self, batch: dict, total_rows: int | None = None) -> float:
        """One optimizer step on ``batch`` ({input name: array}); returns the loss.

        The batch is checked as :meth:`fit` checks its data (every input the step reads, the
        same number of rows, at least one, shapes the step reads, finite values, valid labels):
        a :class:`DataError` names the array. ``total_rows``: the rows of the whole batch when
        ``batch`` is a shard of it (data parallel, split steps only): the gradients are then
        weighted by len(batch) / total_rows (by 1 for a "sum" loss). A cross_entropy with class
        weights or ignore_index divides by the weights of the whole batch's targets, which a
        shard does not know: it refuses total_rows."""
        # the rows are on axis 0 where the step slices them (micro-batches, shards)
        arrays, _ = self._checked(batch, "batch", rows_on_axis0=self._split)
        return self._take_step(arrays, total_rows)

    def _take_step(self, batch: dict, total_rows: int | None = None) -> float:
        """_step on a checked batch. Its loss normalizer is taken here, from the whole batch,
        before a data-parallel subclass shards it (``_accumulate`` weighs each part by it)."""
        norm = self._loss_norm(batch) if total_rows is None else None
        if norm == 0:
            raise DataError(f"{self._no_targets('the batch')} (step {self.step_count + 1} not "
                            "taken)")
        self._batch_norm = norm
        try:
            return self._step(batch, total_rows)
        finally:
            self._batch_norm = None

    def _loss_norm(self, batch: dict) -> float | None:
        """What the loss divides its sum over ``batch`` by: None for a "sum" loss; for a
        cross_entropy with class weights or ignore_index the sum of its targets' weights
        (torch's sum(w_i l_i) / sum(w_i)); otherwise the rows, which is proportional to the
        element count of a mean loss (every row has as many). A loss the model computes itself
        is taken to be a mean over rows."""
        if self._reduction == "sum":
            return None
        if self.loss_kind == "cross_entropy" and (self._class_weight is not None
                                                  or self._ignore_index is not None):
            t = np.asarray(batch[self.target_name]).astype(np.int64, copy=False)
            if self._ignore_index is not None:
                t = t[t != self._ignore_index]
            if self._class_weight is None:
                return float(t.size)
            # labels are checked: in [0, classes), and the weights have one per class
            return float(np.sum(self._class_weight[t], dtype=np.float64))
        return float(len(next(iter(batch[k] for k in self.data_inputs))))

    def _no_targets(self, what: str) -> str:
        why = [f"ignore_index ({self._ignore_index})"] if self._ignore_index is not None else []
        if self._class_weight is not None:
            why.append("of a class whose weight is 0")
        return (f"every target of {what} is {' or '.join(why)}: its mean cross_entropy is 0 / 0 "
                "(torch gives NaN)")

    def _checked(self, data: dict, what: str, rows_on_axis0: bool = True) -> tuple[dict, int]:
        """``data`` as the step reads it ({input: contiguous array of the step's dtype}) and its
        rows, or a :class:`DataError` naming the array: every input the step reads is there,
        finite, with valid labels (:meth:`check_data`), of the rank and static dims the step
        reads, the same size along each symbolic dim that inputs share (a wrong one would
        reach onnxruntime, or broadcast), and not empty. ``rows_on_axis0``: the rows are on
        axis 0 of every array (what fit, evaluate and micro-batches slice), so all have as many;
        else (one step's batch, as the model reads it: a time-major RNN's x is [T, N, F]) the
        rows are the size of the first symbolic dim."""
        missing = [k for k in self.data_inputs if k not in data]
        if missing:
            raise DataError(f"{what} has no {missing} (the step reads {self.data_inputs})")
        checked = self.check_data(data, what)
        arrays = {k: np.ascontiguousarray(checked[k], self._input_dtypes.get(k))
                  for k in self.data_inputs}
        sym: dict[str, dict[str, int]] = {}  # symbolic dim -> {input: its size there}
        for k, v in arrays.items():
            want = self._input_shapes.get(k)
            # a static dim 0 is checked per step: fit's data and evaluate's are sliced
            first = 1 if rows_on_axis0 else 0
            if want is not None and (len(want) != v.ndim or any(
                    isinstance(w, int) and w != d
                    for w, d in zip(want[first:], v.shape[first:]))):
                shown = [w if isinstance(w, int) else "N" if i == 0 else "?"
                         for i, w in enumerate(want)]
                raise DataError(f"{what} {k!r} has shape {list(v.shape)}, but the step reads "
                                f"{k!r} shaped {shown}" + (
                                f" (the {self.loss_kind} loss wants targets shaped like "
                                f"output {self.output_name!r})"
                                if k == self.target_name else ""))
            for w, d in zip(want or (), v.shape):
                if isinstance(w, str) and w:
                    sym.setdefault(w, {})[k] = d
        if rows_on_axis0:
            for k, v in arrays.items():
                if v.ndim == 0:
                    raise DataError(f"{what} {k!r} is a scalar: rows go on axis 0")
            sizes = {len(v) for v in arrays.values()}
            if len(sizes) != 1:
                raise DataError(f"{what} arrays have different numbers of rows: "
                                f"{ {k: len(v) for k, v in arrays.items()} }")
            rows = sizes.pop()
        else:
            rows = next((min(by.values()) for by in sym.values()), None)
            if rows is None:
                rows = min((len(v) for v in arrays.values() if v.ndim), default=1)
        for dim, by in sym.items():
            if len(set(by.values())) > 1:
                raise DataError(f"{what} arrays disagree on the size of their dim {dim!r}: "
                                f"{by} (the step reads " + ", ".join(
                                    f"{k!r} shaped {self._input_shapes[k]}" for k in by) + ")")
        if rows == 0:
            raise DataError(f"the {what} has no rows")
        return arrays, rows

    def check_data(self, data: dict, what: str = "data", shown: dict | None = None) -> dict:
        """``data`` with its float arrays finite and its class labels valid (as int64), or a
        :class:`DataError` naming the array (``shown`` maps input names to the names the user
        knows) and the row."""
        out = dict(data)
        for k in self.data_inputs:
            if k not in data:
                continue
            v, label = np.asarray(data[k]), f"{what} {(shown or {}).get(k, k)!r}"
            want = self._input_dtypes.get(k)
            if v.dtype.kind in "cUSOVM" or (v.dtype.kind == "b" and (
                    want is None or np.dtype(want).kind != "b")):
                # numpy would drop an imaginary part, read True as 1.0, or fail on a string
                # without naming the array
                raise DataError(f"{label} holds {v.dtype} values, which the step cannot read as "
                                f"{np.dtype(want) if want is not None else 'numbers'}: convert "
                                "it explicitly")
            if k == self.target_name and self.loss_kind == "cross_entropy":
                classes = self._num_classes(data)
                if self._class_weight is not None and classes is not None and \
                        len(self._class_weight) != classes:  # (torch refuses it too)
                    raise InvalidArgumentError(
                        f"the cross_entropy weight has {len(self._class_weight)} entries, but "
                        f"{self.output_name!r} has {classes} classes: give one per class")
                out[k] = check_labels(v, classes, self._ignore_index, label)
            elif v.dtype.kind == "f" and not np.isfinite(v).all():
                idx = tuple(int(i) for i in np.argwhere(~np.isfinite(v))[0])
                raise DataError(f"{label}: {v[idx]} at row {idx[0]}"
                                + (f" (index {list(idx)})" if len(idx) > 1 else "")
                                + ": training data must be finite")
            elif v.dtype.kind == "f" and self._input_dtypes.get(k) is not None and \
                    np.dtype(self._input_dtypes[k]).kind in "iub":
                raise DataError(f"{label} holds {v.dtype} values but the model reads "
                                f"{np.dtype(self._input_dtypes[k])}: convert it explicitly")
        return out

    def _num_classes(self, data: dict) -> int | None:
        """The number of classes of the cross_entropy logits: their static classes dim (1, or
        the last: losses.class_axis_of), or else that of one row of ``data`` run through the
        model."""
        axis = self.class_axis
        if self._classes is None:
            shape = self._input_shapes.get(self.target_name)
            if not self._class_dim_read:  # an output's declared shape, or an inner value's
                self._class_dim_read = True
                t = output_type(self.loss_model, self.output_name).tensor_type
                dims = t.shape.dim if t.HasField("shape") else []
                if len(dims) > 1 and dims[axis].HasField("dim_value"):
                    self._classes = dims[axis].dim_value
            feeds = [k for k in self.data_inputs if k != self.target_name]
            # predict() runs the model's outputs only (an inner output_name is none of them)
            if self._classes is None and shape is not None and all(k in data for k in feeds) \
                    and any(o.name == self.output_name for o in self.model.graph.output):
                out = self.predict({k: np.asarray(data[k])[:1] for k in feeds},
                                   outputs=[self.output_name])[0]
                self._classes = int(out.shape[axis]) if out.ndim > 1 else None
        return self._classes

    def _step(self, batch: dict, total_rows: int | None = None) -> float:
        if total_rows is not None and not self._split:
            raise InvalidArgumentError("total_rows weights the gradients of a split step only")
        n = self.step_count + 1
        self._lr_now = self.lr_at(n)
        self._lr.update_inplace(np.array(self._lr_now, np.float64))
        self._stepv.update_inplace(np.array(n, np.int64))
        if not self._split:  # the one-graph step, or the gradient graph and the fused update
            b = self._bindings[self._cur]
            self._feed(b, batch)
            self._run(self._loss_sess, b)
            loss = float(self._loss.numpy())
            if self._fused is not None and math.isfinite(loss):
                self._fused_update()
        else:
            loss = self._reduce_gradients(self._accumulate(batch, total_rows))
            if math.isfinite(loss):
                self._apply_gradients()
        if not math.isfinite(loss):
            raise NonFiniteLossError(n, loss)
        self._cur = 1 - self._cur
        self.step_count = n
        self.history.append(loss)
        return loss

    def _accumulate(self, batch: dict, total_rows: int | None = None) -> float:
        """Run the gradient graph over the micro-batches of ``batch``: ``_grads`` holds the sum
        of w_i * gradient_i; returns the same weighted sum of the losses.

        Part i's loss is its sum over its norm_i (``_loss_norm``), the batch's the sum over all
        parts over norm, so w_i = norm_i / norm makes both the batch's exactly: rows_i / rows
        for a mean over rows, the sum of the part's target weights over the batch's for a
        weighted or ignore_index cross_entropy, 1 for a "sum" loss. A part with norm_i = 0 (all
        of its targets ignored) adds nothing and is not run (its own loss would be 0 / 0)."""
        a, b = self._acc, self._acc_bind
        rows = len(next(iter(batch[k] for k in self.data_inputs)))
        parts = [p for p in np.array_split(np.arange(rows), self.accumulation_steps) if len(p)]
        if not parts:
            raise DataError("the batch has no rows")
        for k in self.data_inputs:  # (onnxruntime's own error otherwise)
            want = (self._input_shapes.get(k) or [None])[0]
            if isinstance(want, int) and any(len(p) != want for p in parts):
                raise DataError(
                    f"with accumulation_steps={self.accumulation_steps} the batch of {rows} rows "
                    f"is split into micro-batches of {sorted({len(p) for p in parts})} rows, but "
                    f"the model reads {k!r} with a static batch of {want}: export the model with "
                    f"a symbolic batch (torch.onnx: dynamic_axes or dynamic_shapes), or pass "
                    f"batches of {want * self.accumulation_steps} rows")
        slices = [slice(idx[0], idx[-1] + 1) for idx in parts]
        if self._reduction == "sum":
            weights = [1.0] * len(slices)
        else:
            norms = [self._loss_norm({k: batch[k][sl] for k in self.data_inputs})
                     for sl in slices]
            if self._batch_norm is not None:  # the whole batch's, shard or not (_take_step)
                norm = self._batch_norm
            elif total_rows is None:
                norm = self._loss_norm(batch)
            elif self.loss_kind == "cross_entropy" and (self._class_weight is not None or
                                                        self._ignore_index is not None):
                raise InvalidArgumentError(
                    "total_rows: a cross_entropy with class weights or ignore_index divides by "
                    "the weights of all the batch's targets, which a shard of it does not "
                    "know: pass the whole batch to step()")
            else:
                norm = float(total_rows)
            if norm == 0:
                raise DataError(self._no_targets("the batch"))
            weights = [n / norm for n in norms]
        run = [(sl, w) for sl, w in zip(slices, weights) if w != 0]
        params = self._sets[self._cur][:len(self.params)]
        for name, ov in zip(a.params, params):
            b.bind_ortvalue_input(name, ov)
        if not run:  # a shard none of whose targets count: no gradient from this one
            for ov in self._grads:
                ov.update_inplace(np.zeros(ov.shape(), self._wdtype_of(ov)))
            return 0.0
        total, src = 0.0, self._zeros
        for i, (sl, w) in enumerate(run):
            self._weight.update_inplace(np.array(w, self._wdtype))
            dst = self._grads if (len(run) - 1 - i) % 2 == 0 else self._scratch
            for name, ov in zip(a.grads, src):
                b.bind_ortvalue_input(name, ov)
            for name, ov in zip(a.param_outputs, dst):
                b.bind_ortvalue_output(name, ov)
            self._feed(b, {k: batch[k][sl] for k in self.data_inputs})
            self._run(self._acc_sess, b)
            total += w * float(self._loss.numpy())
            src = dst
        return total

    @staticmethod
    def _wdtype_of(ov) -> np.dtype:
        return _np_dtype(ov.data_type())

    def _reduce_gradients(self, loss: float) -> float:
        """Between the gradient and the optimizer graphs of a split step (``_grads`` holds the
        gradients): a subclass may exchange them here. Returns the loss the step reports."""
        return loss

    def _apply_gradients(self) -> None:
        """Run the optimizer graph on ``_grads`` (reads buffer set ``_cur``, writes the other),
        or the fused update (in place)."""
        if self._fused is not None:
            self._fused_update()
        else:
            self._run(self._sess, self._bindings[self._cur])

    # -- the loop --------------------------------------------------------------------------
    def fit(self, data: dict, epochs: int = 1, batch_size: int = 32, shuffle: bool = True, *,
            checkpoint: str | None = None, checkpoint_every: int | None = None,
            resume: str | None = None, callback=None, max_steps: int | None = None,
            drop_last: bool = False) -> list[float]:
        """Train up to epoch ``epochs`` over ``data`` ({input name: array}, rows on axis 0) in
        batches of ``batch_size`` (the last may be smaller, or is skipped with ``drop_last``),
        shuffled by the trainer's RNG. ``epochs`` counts from the trainer's first epoch, as a
        resumed run does (so a resumed run reproduces the uninterrupted one): after
        ``fit(d, epochs=3)``, ``fit(d, epochs=4)`` trains one more epoch, and ``fit(d,
        epochs=3)`` trains nothing (with a warning). ``max_steps`` stops after that many steps.

        checkpoint: a path written (atomically) at the end of each epoch, and every
        ``checkpoint_every`` steps when given. resume: a checkpoint to continue from (the same
        data, epochs and batch size reproduce the uninterrupted run). callback(trainer, loss)
        runs after every step. Returns the losses of the steps this call took."""
        for name, value, least in (("batch_size", batch_size, 1), ("epochs", epochs, 0),
                                   ("max_steps", max_steps, 0),
                                   ("checkpoint_every", checkpoint_every, 1)):
            if value is None and name in ("max_steps", "checkpoint_every"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
                    value < least:
                raise InvalidArgumentError(f"{name}={value!r} must be an integer >= {least}")
        arrays, rows = self._checked(data, "data")
        if drop_last and rows < batch_size:
            raise DataError(f"drop_last: the data has {rows} rows, fewer than one batch of "
                            f"{batch_size}: no step would run")
        if resume:
            # through load_checkpoint (a subclass wraps it), which then also checks that the
            # checkpoint's position fits this data before it restores anything
            self._resuming = (rows, batch_size)
            try:
                self.load_checkpoint(resume)
            finally:
                self._resuming = (None, None)
        else:
            self._check_position(self._pos, self._pos_batch_size, rows, batch_size,
                                 "the trainer's fit position (from load_checkpoint or an "
                                 "earlier fit)", InvalidArgumentError)
        epoch0, batch0, order = self._pos
        self._pos_batch_size = batch_size
        per_epoch = rows // batch_size if drop_last else -(-rows // batch_size)
        todo = max(0, (epochs - epoch0) * per_epoch - batch0)
        if todo == 0 and max_steps != 0:
            _log.warning("fit(epochs=%d) trained nothing: this trainer has already trained %d "
                         "epochs%s, and epochs counts from its first (pass epochs=%d for one "
                         "more)", epochs, epoch0, f" and {batch0} steps" if batch0 else "",
                         epoch0 + 1)
        if max_steps is not None:
            todo = min(todo, max_steps)
        tqdm = _tqdm() if self.progress else None
        bar = tqdm(total=todo, unit="step", dynamic_ncols=True) if tqdm and todo else None
        losses = []
        try:
            for epoch in range(epoch0, epochs):
                if len(losses) == todo:  # (before the next epoch's draw from the RNG)
                    return losses
                if order is None:
                    order = self.rng.permutation(rows) if shuffle else np.arange(rows)
                for bi in range(batch0, per_epoch):
                    if len(losses) == todo:
                        return losses
                    idx = order[bi * batch_size:(bi + 1) * batch_size]
                    loss = self._take_step({k: v[idx] for k, v in arrays.items()})
                    losses.append(loss)
                    self._pos = (epoch, bi + 1, order)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"loss {loss:.4g} epoch {epoch + 1}", refresh=False)
                    if checkpoint and checkpoint_every and self.step_count % checkpoint_every == 0:
                        self._save_during_fit(checkpoint)
                    if callback is not None:
                        callback(self, loss)
                self._pos = (epoch + 1, 0, None)
                batch0, order = 0, None
                if checkpoint:
                    self._save_during_fit(checkpoint)
        finally:
            if bar is not None:
                bar.close()
        return losses

    def _save_during_fit(self, path) -> None:
        """A checkpoint in fit: a failed write stops the run with an error that says which
        checkpoint is intact (the trainer still holds this step's values)."""
        try:
            self.save_checkpoint(path)
        except (WriteError, NonFiniteError) as exc:
            last = self._last_checkpoint
            kept = (f"{last[0]} still holds step {last[1]}" if last and last[0] == path
                    else f"{path} is unchanged")
            stopped = f"training stopped at step {self.step_count}, {kept}"
            if isinstance(exc, WriteError):
                raise WriteError(path, f"{exc.reason}; {stopped}", exc.errno) from exc
            raise NonFiniteError(f"{exc}; {stopped}") from exc

    # -- reading the model -----------------------------------------------------------------
    # OrtValue.numpy() of a CPU buffer is a view of it: these copy, or later steps would change
    # what they returned
    def parameters(self) -> dict[str, np.ndarray]:
        """The current parameters, copied to the host."""
        return {n: np.array(ov.numpy()) for n, ov in zip(self.params, self._sets[self._cur])}

    def statistics(self) -> dict[str, np.ndarray]:
        """The training-mode BatchNormalization running statistics the steps update ({name:
        array}, copies; empty for a model without them)."""
        return {n: np.array(ov.numpy()) for n, ov in zip(self.stat_names, self._stat_bufs)}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The current optimizer state, copied to the host."""
        k = len(self.params)
        return {n: np.array(ov.numpy())
                for n, ov in zip(self.state_names, self._sets[self._cur][k:])}

    @functools.cached_property
    def _source_data(self) -> set:
        """The files the model file the trainer was built from keeps its weights in, which
        export and save_checkpoint never write over (read once, at the first write)."""
        return external_data_files(self._source)

    def _params_session(self, model):
        m = load(model)
        _params_to_inputs(m, self.params)
        return make_session(m, self.device, self.threads)

    def _run_with_params(self, sess, feeds: dict, outputs: list[str]):
        b = sess.io_binding()
        for n, ov in zip(self.params, self._sets[self._cur]):
            b.bind_ortvalue_input(n, ov)
        types = {i.name: _np_dtype(i.type) for i in sess.get_inputs()}
        for n in types:
            if n in self.params:
                continue
            if n not in feeds:
                raise DataError(f"no value for input {n!r}")
            b.bind_cpu_input(n, np.ascontiguousarray(feeds[n], types[n]))
        for o in outputs:
            b.bind_output(o, "cpu")
        sess.run_with_iobinding(b)
        return b.copy_outputs_to_cpu()

    def predict(self, feeds: dict, outputs: list[str] | None = None,
                batch_size: int | None = None) -> list[np.ndarray]:
        """Run the model (without the loss) with the current parameters."""
        if self._infer is None:
            self._infer = self._params_session(self.model)
        outputs = outputs or [o.name for o in self.model.graph.output]
        if batch_size is None:
            return self._run_with_params(self._infer, feeds, outputs)
        rows = len(next(iter(feeds.values())))
        parts = [self._run_with_params(self._infer, {k: v[i:i + batch_size]
                                                     for k, v in feeds.items()}, outputs)
                 for i in range(0, rows, batch_size)]
        return [np.concatenate([p[j] for p in parts]) for j in range(len(outputs))]

    def evaluate(self, data: dict, batch_size: int = 1024) -> float:
        """The loss on all of ``data`` with the current parameters: what the loss gives over
        the whole data at once, run ``batch_size`` rows at a time (each part weighted as in
        gradient accumulation: its rows, or its targets' weights for a cross_entropy with
        class weights or ignore_index, over the data's; 1 for a "sum" loss). The data is
        checked as :meth:`fit` checks it (a :class:`DataError` names the array)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or \
                batch_size < 1:
            raise InvalidArgumentError(f"batch_size={batch_size!r} must be an integer >= 1")
        arrays, rows = self._checked(data, "data")
        norm = self._loss_norm(arrays)
        if norm == 0:
            raise DataError(self._no_targets("the data"))
        if self._eval is None:
            m = load(self.loss_model)
            _prune(m, [self.loss_name], [])
            self._eval = self._params_session(m)
        total = 0.0
        for i in range(0, rows, batch_size):
            part = {k: v[i:i + batch_size] for k, v in arrays.items()}
            w = 1.0 if norm is None else self._loss_norm(part) / norm
            if w != 0:  # a part all of whose targets are ignored adds nothing (its own is 0/0)
                total += w * float(self._run_with_params(self._eval, part,
                                                         [self.loss_name])[0])
        return total

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, path) -> None:
        """Write parameters, optimizer state, step, fit position, RNG state and loss history to
        ``path`` (npz) atomically: a temporary file in the same folder, then a rename. A manifest
        records each array's dtype, shape and SHA-256, which :meth:`load_checkpoint` checks.
        Non-finite parameters or state are never written (a :class:`NonFiniteError`; the file
        already at ``path`` stays as it was)."""
        path = os.fspath(path)
        keep_data_of(self._source, [path], self._source_data)
        epoch, batch, order = self._pos
        k = len(self.params)
        cur = self._sets[self._cur]
        arrays = {
            "format": np.array(CHECKPOINT_FORMAT),
            "param_names": np.array(self.params, dtype=str),
            "state_names": np.array(self.state_names, dtype=str),
            "step": np.array(self.step_count, np.int64),
            "epoch": np.array(epoch, np.int64),
            "batch": np.array(batch, np.int64),
            "order": np.asarray(order if order is not None else [], np.int64),
            "has_order": np.array(order is not None),
            "rng": np.array(json.dumps(self.rng.bit_generator.state)),
            "optimizer": np.array(json.dumps({"type": type(self.optimizer).__name__,
                                              **self.optimizer.config()}, default=str)),
            "history": np.asarray(self.history, np.float64),
            "batch_size": np.array(self._pos_batch_size or -1, np.int64),
        }
        if self.stat_names:  # (absent from checkpoints of models without them, and older ones)
            arrays["stat_names"] = np.array(self.stat_names, dtype=str)
            for i, (name, a) in enumerate(self.statistics().items()):
                _require_finite(a, name, f"not writing the checkpoint {path}")
                arrays[f"stat_{i}"] = a
        for i, ov in enumerate(cur[:k]):
            arrays[f"param_{i}"] = ov.numpy()
        for j, ov in enumerate(cur[k:]):
            arrays[f"state_{j}"] = ov.numpy()
        names = self.params + self.state_names
        for key, name in zip([f"param_{i}" for i in range(k)] +
                             [f"state_{j}" for j in range(len(cur) - k)], names):
            _require_finite(arrays[key], name, f"not writing the checkpoint {path}")
        arrays["manifest"] = np.array(json.dumps(
            {key: _describe(a) for key, a in arrays.items()}, sort_keys=True))
        with runtime.atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)
        self._last_checkpoint = (path, self.step_count)

    def load_checkpoint(self, path) -> None:
        """Restore what :meth:`save_checkpoint` wrote (the same model, params and optimizer).

        Everything is checked before anything is restored: the file is a readable checkpoint,
        complete and intact (each array's SHA-256), made for these parameters and this state
        (names, dtypes, shapes), with finite values, and by the same optimizer: its kind and
        every hyper-parameter but ``lr`` (the state is kept in a form that depends on them,
        Adam's betas, and a resumed run is meant to continue the same one; the learning rate
        is not part of the state, and schedules change it) as this trainer's; otherwise a
        :class:`CheckpointError` says what is wrong (the field, the checkpoint's value and this
        trainer's) and the trainer is unchanged. Checkpoints written before the optimizer was
        recorded are not compared."""
        self._restore(self._read_and_check(path, *self._resuming))

    @staticmethod
    def _check_position(pos, pos_batch_size, rows, batch_size, where, error) -> None:
        """A fit position taken in the middle of an epoch counts batches of that epoch's order:
        it continues only over as many rows in batches of the same size (an order of other rows
        would index past the data, another batch size skip or repeat rows)."""
        epoch, batch, order = pos
        if order is None and batch == 0:
            return  # at the end of an epoch: any data goes on from there
        at = f"{where} stopped after batch {batch} of epoch {epoch + 1}"
        if order is not None and len(order) != rows:
            raise error(f"{at}, an epoch over {len(order)} rows; this fit's data has {rows} "
                        "rows: resume with the same data (or from a checkpoint written at the "
                        "end of an epoch)")
        if pos_batch_size is not None and pos_batch_size != batch_size:
            raise error(f"{at}, in batches of {pos_batch_size}; this fit's batch_size is "
                        f"{batch_size}: resume with batch_size={pos_batch_size} (or from a "
                        "checkpoint written at the end of an epoch)")

    def _check_optimizer(self, path: str, arrays: dict) -> None:
        if "optimizer" not in arrays:
            return
        try:
            old = json.loads(str(arrays["optimizer"]))
        except ValueError as exc:
            raise CheckpointError(f"{path}: corrupt checkpoint (optimizer: {exc})") from None
        new = json.loads(json.dumps({"type": type(self.optimizer).__name__,
                                     **self.optimizer.config()}, default=str))
        if not isinstance(old, dict):
            raise CheckpointError(f"{path}: corrupt checkpoint (optimizer: {old!r})")
        if old.get("type") != new["type"]:
            raise CheckpointError(f"{path}: the checkpoint's optimizer is {old.get('type')}, "
                                  f"this trainer's {new['type']}: its state does not carry over")
        for key in sorted(set(old) | set(new)):
            if key not in ("type", "lr") and old.get(key) != new.get(key):
                raise CheckpointError(
                    f"{path}: the checkpoint was written with {new['type']} {key}="
                    f"{old.get(key)!r}, this trainer's optimizer has {key}={new.get(key)!r}: "
                    "resume with the same hyper-parameters (only lr may change)")

    def _read_and_check(self, path, rows: int | None = None,
                        batch_size: int | None = None) -> tuple:
        """What load_checkpoint restores, every part of it checked (``rows``, ``batch_size``:
        those of the fit that resumes from it)."""
        path = os.fspath(path)
        arrays = _read_checkpoint(path)
        fmt = str(arrays["format"]) if "format" in arrays else None
        if fmt not in _CHECKPOINT_FORMATS:
            raise CheckpointError(f"{path}: not an onnxgrad checkpoint (format {fmt!r})")
        needed = ["param_names", "state_names", "step", "epoch", "batch", "order", "has_order",
                  "rng", "history"]
        if fmt != _LEGACY_FORMATS[0]:
            if "manifest" not in arrays:
                raise CheckpointError(f"{path}: incomplete checkpoint (no manifest)")
            manifest = json.loads(str(arrays["manifest"]))
            for key, want in manifest.items():
                if key not in arrays:
                    raise CheckpointError(f"{path}: incomplete checkpoint ({key!r} is missing)")
                if _describe(arrays[key]) != want:
                    raise CheckpointError(f"{path}: corrupt checkpoint ({key!r} does not match "
                                          "its recorded dtype, shape and SHA-256)")
        missing = [key for key in needed if key not in arrays]
        if missing:
            raise CheckpointError(f"{path}: incomplete checkpoint (no {missing})")
        self._check_optimizer(path, arrays)
        pn, sn = ([str(n) for n in arrays[k]] for k in ("param_names", "state_names"))
        factors = [1.0] * len(sn)
        if fmt in _LEGACY_FORMATS:  # the state of an older form of the optimizer
            legacy = self.optimizer.legacy_slots()
            for j, name in enumerate(sn):
                param, _, slot = str(name).rpartition(".")
                if slot in legacy:
                    sn[j], factors[j] = f"{param}.{legacy[slot][0]}", legacy[slot][1]
        if pn != self.params or sn != self.state_names:
            raise CheckpointError(f"{path}: the checkpoint's parameters/state ({pn}, {sn}) do "
                                  f"not match this trainer's ({self.params}, "
                                  f"{self.state_names})")
        keys = [f"param_{i}" for i in range(len(pn))] + [f"state_{j}" for j in range(len(sn))]
        values = [self._checked_array(path, arrays, key, name, factor)
                  for key, name, factor in zip(keys, self.params + self.state_names,
                                               [1.0] * len(pn) + factors)]
        try:
            rng_state = json.loads(str(arrays["rng"]))
            step, epoch, batch = (int(arrays[k]) for k in ("step", "epoch", "batch"))
            history = [float(x) for x in arrays["history"]]
            order = np.array(arrays["order"], np.int64) if bool(arrays["has_order"]) else None
            probe = np.random.default_rng()
            probe.bit_generator.state = rng_state
            pos_batch_size = int(arrays["batch_size"]) if "batch_size" in arrays else -1
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointError(f"{path}: corrupt checkpoint ({exc})") from None
        pos_batch_size = pos_batch_size if pos_batch_size > 0 else None
        stats = self._checked_statistics(path, arrays)
        if rows is not None:
            self._check_position((epoch, batch, order), pos_batch_size, rows, batch_size,
                                 f"{path}: the checkpoint", CheckpointError)
        return values, step, history, rng_state, (epoch, batch, order), pos_batch_size, stats

    def _checked_array(self, path: str, arrays: dict, key: str, name: str,
                       factor: float = 1.0) -> np.ndarray:
        """The checkpoint's value of ``name`` (times ``factor``), present, of this model's dtype
        and shape, and finite; else a CheckpointError."""
        if key not in arrays:
            raise CheckpointError(f"{path}: incomplete checkpoint (no value for {name!r})")
        a, (dtype, shape) = arrays[key], self._specs[name]
        if a.dtype != dtype or a.shape != shape:
            raise CheckpointError(f"{path}: {name!r} is {a.dtype} {list(a.shape)} in the "
                                  f"checkpoint but {np.dtype(dtype)} {list(shape)} in this "
                                  "model (a checkpoint of another model?)")
        if factor != 1.0:
            a = (a * factor).astype(a.dtype)
        try:
            _require_finite(a, name, "")
        except NonFiniteError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        return a

    def _checked_statistics(self, path: str, arrays: dict) -> list | None:
        """The checkpoint's running statistics, checked as the parameters are; None where it
        holds none (a checkpoint written before they were updated: they stay as they are)."""
        if "stat_names" not in arrays:
            return None
        names = [str(x) for x in arrays["stat_names"]]
        if names != self.stat_names:
            raise CheckpointError(f"{path}: the checkpoint's BatchNormalization statistics "
                                  f"{names} do not match this trainer's {self.stat_names}")
        return [self._checked_array(path, arrays, f"stat_{i}", name)
                for i, name in enumerate(names)]

    def _restore(self, checked: tuple) -> None:
        values, step, history, rng_state, pos, pos_batch_size, stats = checked
        for ov, a in zip(self._sets[self._cur], values):
            ov.update_inplace(np.ascontiguousarray(a))
        for ov, a in zip(self._stat_bufs, stats or []):
            ov.update_inplace(np.ascontiguousarray(a))
        self.step_count, self.history = step, history
        self.rng.bit_generator.state = rng_state
        self._pos, self._pos_batch_size = pos, pos_batch_size

    # -- export ----------------------------------------------------------------------------
    def trained_model(self) -> onnx.ModelProto:
        """The original model with the trained parameters as its initializers (a
        :class:`NonFiniteError` if one holds NaN or inf)."""
        m = load(self.model)
        values = {**self.parameters(), **self.statistics()}
        for name, v in values.items():
            _require_finite(v, name, "not exporting the model")
        for t in m.graph.initializer:
            if t.name in values:
                t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
        return m

    def export(self, path, train_step=None, gradient=None) -> None:
        """Write the trained inference model to ``path`` (IR pinned for onnxruntime, external
        data past 2 GB). ``train_step`` / ``gradient``: also write the train-step graph and the
        gradient graph there, with the current parameters (and optimizer state) as the defaults
        of their inputs, so each is one self-contained .onnx file."""
        keep_data_of(self._source, [path, train_step, gradient], self._source_data)
        runtime.save_model(self.trained_model(), path)
        values = {**self.parameters(), **self.statistics()}  # (defaults where they are inputs)
        if train_step:
            step = self.train_step or build_train_step(
                self.loss_model, self.loss_name, self._params_spec, self.optimizer,
                self._frozen, self.clip_norm)
            state = self.optimizer_state()  # the apply graph's state has the same names
            runtime.save_model(with_defaults(step.model, {**values, **state}), train_step)
        if gradient:
            g = build_gradient_model(self.loss_model, self.loss_name, self._params_spec,
                                     self._frozen)
            runtime.save_model(with_defaults(g.model, values), gradient)

    def end_profiling(self) -> str | None:
        """Stop onnxruntime profiling (``profile=``) and return the trace file."""
        if not self.profile:
            return None
        return self._loss_sess.end_profiling()


def _describe(a: np.ndarray) -> dict:
    """What a checkpoint's manifest records of an array."""
    import hashlib
    return {"dtype": a.dtype.str, "shape": list(a.shape),
            "sha256": hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()}


def _require_finite(a: np.ndarray, name: str, doing: str) -> None:
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        bad = int(np.count_nonzero(~np.isfinite(a)))
        raise NonFiniteError(f"{name!r} holds {bad} NaN or infinite value"
                             f"{'s' if bad > 1 else ''}" + (f": {doing}" if doing else ""))


def _read_checkpoint(path: str) -> dict:
    import zipfile
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, TypeError) as exc:
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt: "
                              f"{exc})") from None


def _np_dtype(ort_type: str):
    table = {"tensor(float)": np.float32, "tensor(double)": np.float64,
             "tensor(float16)": np.float16, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
             "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
             "tensor(int16)": np.int16}
    return table.get(ort_type)

