"""What tests/test_distributed.py starts on every rank with torchrun:

    python -m torch.distributed.run ... tests/dist_worker.py OUTDIR SCENARIO [SCENARIO ...]

cases      every case of dist_cases.CASES; rank 0 writes OUTDIR/<case>.npz
nan        a row that overflows the loss to NaN in rank 1's rows of step 3: each rank writes OUTDIR/nan.<rank>.json
interrupt  the resume_ref runs, stopped at step 7 after a checkpoint at step 6
resume     those runs resumed from their checkpoints; rank 0 writes OUTDIR/resumed*.npz
kill       rank 1 kills itself (SIGKILL) after step 3; timeout 60 s
hang       rank 1 sleeps after step 3; timeout 4 s
batchnorm  OUTDIR/bn.onnx (util.bn_train_export) trained 2 steps of 16 rows, and torch DDP on
           its net with the same shards; rank 0 writes OUTDIR/batchnorm.npz (ours "o:", DDP's "t:")
(the ranks write the time of step 3 to OUTDIR/<kill|hang>.<rank>.json, and a rank that catches
the DistributedError its time and message to OUTDIR/<kill|hang>.error.<rank>.json)
"""
from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_cases import CASES, digits, fit, trainer  # noqa: E402

from onnxgrad.training import SGD, NonFiniteLossError  # noqa: E402
from onnxgrad.errors import DistributedError  # noqa: E402
from onnxgrad.training.distributed import DistributedTrainer  # noqa: E402

TIMEOUT = {"kill": 60.0, "hang": 4.0}
BN_TRAINER = dict(optimizer=SGD(lr=0.1), device="cpu", threads=1, progress=False, seed=3)


def bn_data():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((32, 3, 8, 8)).astype(np.float32),
            "target": rng.standard_normal((32, 2)).astype(np.float32)}


def bn_ddp(path, data, rank):
    """torch DDP (no SyncBatchNorm) on util.bn_net from the model's initial values: 2 SGD steps
    of 16 rows, rank r taking rows r, r + 2, ... of each, as DistributedTrainer shards them."""
    import onnx
    import torch
    from onnx import numpy_helper
    from util import bn_net
    init = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    net = bn_net()
    net.load_state_dict({k: torch.tensor(init[k]) if k in init else v
                         for k, v in net.state_dict().items()})
    ddp = torch.nn.parallel.DistributedDataParallel(net.train())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for j in range(2):
        rows = slice(16 * j + rank, 16 * (j + 1), 2)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(torch.tensor(data["x"][rows])),
                                     torch.tensor(data["target"][rows])).backward()
        opt.step()
    # DDP's reducer lives on in reference cycles (its gradient hooks); freed at exit, after the
    # trainer has closed the process group, it aborted the rank now and then ("terminate
    # called without an active exception"): free it while the group is there
    del opt, ddp
    gc.collect()
    return net


class Stop(Exception):
    pass


def save(path, tr):
    """Rank 0 writes the parameters, optimizer state, losses and memory figures."""
    state = tr.optimizer_state()  # collective with ZeRO
    if tr.rank == 0:
        np.savez(path, history=np.array(tr.history), step=tr.step_count,
                 memory=json.dumps(tr.memory()),
                 **{f"p:{k}": v for k, v in tr.parameters().items()},
                 **{f"s:{k}": v for k, v in state.items()})


def main(out, scenarios):
    tr = None
    for sc in scenarios:
        if sc == "cases":
            for case in CASES:
                tr = trainer(case, DistributedTrainer)
                fit(case, tr)
                save(os.path.join(out, f"{case}.npz"), tr)
        elif sc == "nan":
            tr = trainer("mlp", DistributedTrainer)
            # no shuffle, batch 8: step 3 is rows 16..23; rank 1 has the odd ones
            res = {"rank": tr.rank}
            before = {}

            def keep(t, loss):
                before.update(t.parameters())
            try:
                tr.fit(digits(64, nan_row=19), batch_size=8, shuffle=False, callback=keep)
            except NonFiniteLossError as exc:
                res.update(step=exc.step, ranks=getattr(exc, "ranks", None), msg=str(exc),
                           steps_taken=tr.step_count,
                           unchanged=all(np.array_equal(v, before[k])
                                         for k, v in tr.parameters().items()))
            with open(os.path.join(out, f"nan.{tr.rank}.json"), "w") as f:
                json.dump(res, f)
        elif sc in ("interrupt", "resume"):
            for case in ("resume_ref", "resume_ref_zero"):
                ckpt = os.path.join(out, f"{case}.ckpt.npz")
                tr = trainer(case, DistributedTrainer)
                if sc == "interrupt":
                    def stop(t, loss):
                        if t.step_count == 7:
                            raise Stop
                    try:
                        fit(case, tr, checkpoint=ckpt, checkpoint_every=3, callback=stop)
                    except Stop:
                        pass
                else:
                    fit(case, tr, resume=ckpt)
                    save(os.path.join(out, f"resumed_{case}.npz"), tr)
        elif sc == "batchnorm":
            tr = DistributedTrainer(os.path.join(out, "bn.onnx"), "mse", **BN_TRAINER)
            data = bn_data()
            tr.fit(data, batch_size=16, shuffle=False)
            net = bn_ddp(os.path.join(out, "bn.onnx"), data, tr.rank)
            if tr.rank == 0:
                np.savez(os.path.join(out, "batchnorm.npz"),
                         **{f"o:{k}": v for k, v in {**tr.parameters(),
                                                    **tr.statistics()}.items()},
                         **{f"t:{k}": v.detach().numpy() for k, v in net.state_dict().items()})
        elif sc in ("kill", "hang"):
            tr = trainer("mlp", DistributedTrainer, timeout=TIMEOUT[sc])

            def fault(t, loss):
                if t.step_count == 3:
                    with open(os.path.join(out, f"{sc}.{t.rank}.json"), "w") as f:
                        json.dump({"t": time.time()}, f)
                    if t.rank == 1:
                        if sc == "kill":
                            os.kill(os.getpid(), signal.SIGKILL)
                        time.sleep(300)
            try:
                fit("mlp", tr, callback=fault)
            except DistributedError as exc:
                with open(os.path.join(out, f"{sc}.error.{tr.rank}.json"), "w") as f:
                    json.dump({"t": time.time(), "msg": str(exc)}, f)
                raise
    if tr is not None:
        tr.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
