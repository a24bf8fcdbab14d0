"""Training-step throughput: onnxgrad's Trainer on onnxruntime against a PyTorch eager loop,
onnxruntime-training 1.19.2 and, for Keras models, TensorFlow, in one run.

    python bench/train_step.py                   # the default rows, CPU, markdown table
    python bench/train_step.py --rows cnn-ts --threads 1 2 --steps 20
    python bench/train_step.py --profile cnn-ts  # also onnxruntime's per-node profile of a row
    python bench/train_step.py --device cuda     # what bench/train_gpu.py runs
    python bench/train_step.py --rows cnn-ts --ort-saved  # the model onnxruntime's optimizer saves

Rows (AdamW lr 1e-3, cross-entropy over 10 classes, the same initial weights and the same
batches on every side, random data made once):
    <model>-ts, <model>-dynamo   the PyTorch model of bench/torch_models.py exported by
          torch.onnx (TorchScript exporter, dynamo=False, in training mode; or the dynamo
          exporter), trained from that ONNX file; the PyTorch side trains the module itself:
          mlp          784-1024-1024-10 (Linear, ReLU), batch 256
          cnn          Conv 3x3 pad 1, ReLU, MaxPool 2, twice, Linear, 1x28x28, batch 64
          resnet18     torchvision's ResNet-18 (BatchNorm on batch statistics), 3x64x64, batch 32
          mobilenetv3  torchvision's MobileNetV3-small, 3x64x64, batch 64
          transformer  nn.TransformerEncoder 2 layers, d 256, 4 heads, [N, 64, 256], batch 32
          unet         a two-level U-Net (BatchNorm, MaxPool 2, ConvTranspose, skips), 3x64x64,
                       batch 16, cross-entropy over 4 classes per pixel
    mlp, cnn, lstm   hand-built ONNX graphs (Gemm; unpadded Conv; ONNX LSTM, hidden 128, 32
          steps, batch 64, against torch.nn.LSTM with the same weights, gates reordered)
    <model>-keras    the Keras model of bench/keras_models.py (cnn: the CNN above, channels
          last; lstm: keras.layers.LSTM 128 over 32 steps of 64, Dense 10; textlstm: an
          Embedding of 32 tokens before that LSTM), saved with
          ``model.export()`` and converted by onnxgrad.converters.tensorflow.convert; the
          baseline side is TensorFlow training the Keras model itself (a tf.function step:
          GradientTape, keras.optimizers.AdamW with torch's defaults, weight decay 1e-2 and eps
          1e-8), from the same initial weights (saved by Keras, loaded by both sides) and batches
The dynamo exporter writes a training-mode BatchNorm as an inference BatchNormalization (running
statistics), which its optimizer then folds into the Conv: for the models with BatchNorm the bench
exports unoptimised, marks those nodes training_mode=1 and then runs the exporter's optimizer, so
that every side trains the same function.

Sides: onnxgrad (Trainer: one step graph, parameters and AdamW state kept as OrtValues and swapped
by IOBinding), the baseline: torch (torch.optim.AdamW with fused=True, its fastest CPU path;
loss.item() per step) or, for the Keras rows, TensorFlow (the loss copied to the host per step),
and onnxruntime-training 1.19.2 (``generate_artifacts`` + its training API, see
bench/ort_training_side.py) for the rows named by ``--ort-training`` (default: the exported MLP
and CNN rows). onnxruntime-training has wheels for Python <= 3.11 only and needs onnx 1.16 (and
imports torch): the bench makes its own virtual environment for it once, under
~/.cache/onnxgrad-bench/ort-training (``pip install onnxruntime-training==1.19.2 onnx==1.16.*
numpy<2 torch==2.13.0`` with a Python 3.10/3.11 found on PATH), reuses it afterwards, and prints a
note and leaves that column empty when it cannot be made.

Each (row, side) runs in its own subprocess, so the peak resident memory (VmHWM) is that
side's alone (also shown: the peak over the RSS after the libraries' imports); a run's rate is the
median of ``--repeat`` timed windows of ``--steps`` steps after ``--warmup``, and the sides' runs
alternate ``--rounds`` times (medians reported), which keeps drifting load on a shared machine
from favouring one side. All sides use the same number of threads. At 1 thread the ratio of the
rates by process CPU time is shown too (every thread of the side's process counted): it leaves
out the time other processes held the core, which wall time on a shared machine does not. Also measured: the peak float32
GEMM rate of this machine (onnxruntime MatMul 1024^3) and the MLP rows' fraction of it. Ratios > 1
mean onnxgrad is faster.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from rss import rss_mb  # noqa: E402

BUILT = ("mlp", "cnn", "lstm")
EXPORTED = ("mlp", "cnn", "resnet18", "mobilenetv3", "transformer", "unet")
EXPORTERS = {"ts": "torchscript", "dynamo": "dynamo"}
KERAS = ("cnn", "lstm", "textlstm")  # bench/keras_models.py, trained against TensorFlow
ROWS = BUILT + tuple(f"{m}-{x}" for m in EXPORTED for x in EXPORTERS) + tuple(
    f"{m}-keras" for m in KERAS)
DEFAULT_ROWS = tuple(r for r in ROWS if "-" in r) + ("lstm",)
ORT_TRAINING_ROWS = ("mlp-ts", "mlp-dynamo", "cnn-ts", "cnn-dynamo")
ORT_TRAINING_VENV = os.path.join(os.path.expanduser("~"), ".cache", "onnxgrad-bench",
                                 "ort-training")
ORT_TRAINING_PACKAGES = ["onnxruntime-training==1.19.2", "onnx==1.16.*", "numpy<2",
                         "torch==2.13.0"]


# -- models ------------------------------------------------------------------------------------
def _linear(rng, fan_in, fan_out):
    bound = 1 / np.sqrt(fan_in)
    return (rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32),
            rng.uniform(-bound, bound, fan_out).astype(np.float32))


def mlp_spec(seed=0):
    from onnx import helper
    rng = np.random.default_rng(seed)
    sizes = [784, 1024, 1024, 10]
    w, nodes, h = {}, [], "x"
    for i in range(3):
        w[f"W{i}"], w[f"b{i}"] = _linear(rng, sizes[i], sizes[i + 1])
        out = "logits" if i == 2 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [h, f"W{i}", f"b{i}"], [out], transB=1))
        if i < 2:
            nodes.append(helper.make_node("Relu", [out], [f"a{i}"]))
            h = f"a{i}"
    flops = 256 * (6 * sum(a * b for a, b in zip(sizes, sizes[1:])) - 2 * sizes[0] * sizes[1])
    return dict(nodes=nodes, inits=w, x_shape=(784,), batch=256, flops=flops, name="mlp")


def cnn_spec(seed=0):
    from onnx import helper
    rng = np.random.default_rng(seed)

    def conv(cin, cout):
        bound = 1 / np.sqrt(cin * 9)
        return (rng.uniform(-bound, bound, (cout, cin, 3, 3)).astype(np.float32),
                rng.uniform(-bound, bound, cout).astype(np.float32))
    w = {}
    w["C1"], w["c1"] = conv(1, 16)
    w["C2"], w["c2"] = conv(16, 32)
    w["D"], w["d"] = _linear(rng, 32 * 7 * 7, 10)
    nodes = [helper.make_node("Conv", ["x", "C1", "c1"], ["y1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "C2", "c2"], ["y2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y2"], ["r2"]),
             helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["p2"], ["f"], axis=1),
             helper.make_node("Gemm", ["f", "D", "d"], ["logits"], transB=1)]
    return dict(nodes=nodes, inits=w, x_shape=(1, 28, 28), batch=64, flops=None, name="cnn")


def lstm_spec(seed=0, T=32, I=64, H=128):
    from onnx import helper
    rng = np.random.default_rng(seed)
    b = 1 / np.sqrt(H)
    w = {"W": rng.uniform(-b, b, (1, 4 * H, I)).astype(np.float32),
         "R": rng.uniform(-b, b, (1, 4 * H, H)).astype(np.float32),
         "B": rng.uniform(-b, b, (1, 8 * H)).astype(np.float32)}
    w["D"], w["d"] = _linear(rng, H, 10)
    w["axis0"] = np.array([0], np.int64)
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B"], ["Y", "Y_h"], hidden_size=H),
             helper.make_node("Squeeze", ["Y_h", "axis0"], ["h"]),
             helper.make_node("Gemm", ["h", "D", "d"], ["logits"], transB=1)]
    # x is [T, N, I] (ONNX LSTM's layout, batch on axis 1); the batch is 64 sequences of 32
    return dict(nodes=nodes, inits=w, x_dims=[T, "N", I], batch=64, flops=None, name="lstm",
                T=T, I=I, H=H)


SPECS = {"mlp": mlp_spec, "cnn": cnn_spec, "lstm": lstm_spec}


def x_dims(spec):
    return spec.get("x_dims") or ["N", *spec["x_shape"]]


def onnx_model(spec):
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    g = helper.make_graph(
        spec["nodes"], spec["name"],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims(spec))],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v, k) for k, v in spec["inits"].items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return onnx.shape_inference.infer_shapes(m)


def torch_forward(name):
    import torch
    F = torch.nn.functional
    if name == "mlp":
        def f(x, p):
            h = F.relu(F.linear(x, p["W0"], p["b0"]))
            h = F.relu(F.linear(h, p["W1"], p["b1"]))
            return F.linear(h, p["W2"], p["b2"])
    elif name == "lstm":
        def f(x, p):  # p["lstm"]: a torch.nn.LSTM holding the same weights
            _, (h, _) = p["lstm"](x)
            return F.linear(h[0], p["D"], p["d"])
    else:
        def f(x, p):
            y = F.max_pool2d(F.relu(F.conv2d(x, p["C1"], p["c1"], padding=1)), 2)
            y = F.max_pool2d(F.relu(F.conv2d(y, p["C2"], p["c2"], padding=1)), 2)
            return F.linear(y.flatten(1), p["D"], p["d"])
    return f


def batches(spec, n=8, seed=1):
    rng = np.random.default_rng(seed)
    shape = [spec["batch"] if d == "N" else d for d in x_dims(spec)]
    return [(rng.standard_normal(shape).astype(np.float32),
             rng.integers(0, 10, spec["batch"])) for _ in range(n)]


# -- what the sides share: files written once by the parent ---------------------------------
def prepare(row, workdir, ort_saved=False):
    """Write the row's ONNX model, batches (npz: x0, y0, ...) and, for exported rows, the
    module's initial state_dict into ``workdir``; returns their paths and the trained params.
    ``ort_saved``: an exported model as onnxruntime's optimizer saves it (its com.microsoft
    fused ops), which both ONNX sides then train."""
    import onnx
    out = {"row": row, "onnx": os.path.join(workdir, f"{row}.onnx"),
           "batches": os.path.join(workdir, f"{row}.npz")}
    if row in BUILT:
        spec = SPECS[row]()
        model, data = onnx_model(spec), batches(spec)
        onnx.save(model, out["onnx"])
        out["params"] = [k for k, v in spec["inits"].items() if v.dtype == np.float32]
    elif row.endswith("-keras"):
        import keras_models
        from onnxgrad.converters.tensorflow import convert
        name = row.rsplit("-", 1)[0]
        module, shape, batch = keras_models.make(name)
        out["state"] = os.path.join(workdir, f"{row}.weights.h5")
        module.save_weights(out["state"])
        onnx.save(convert(keras_models.export(module, os.path.join(workdir, f"{row}.tf"))),
                  out["onnx"])
        out["params"] = keras_models.parameter_names(module)
        rng = np.random.default_rng(1)
        data = [(keras_models.inputs(name, batch, rng), rng.integers(0, 10, batch))
                for _ in range(8)]
    else:
        import torch
        import torch_models
        name, exporter = row.rsplit("-", 1)
        module, shape, batch = torch_models.make(name)
        out["state"] = os.path.join(workdir, f"{row}.pt")
        torch.save(module.state_dict(), out["state"])
        torch_models.export(module, shape, batch, out["onnx"], EXPORTERS[exporter])
        if ort_saved:
            from hf_models import ort_optimized
            onnx.save(ort_optimized(onnx.load(out["onnx"])), out["onnx"])
        inits = {t.name for t in onnx.load(out["onnx"], load_external_data=False)
                 .graph.initializer}
        out["params"] = [k for k, _ in module.named_parameters()]
        missing = [p for p in out["params"] if p not in inits]
        if missing:
            raise RuntimeError(f"{row}: the exported model has no initializers {missing}")
        rng = np.random.default_rng(1)
        data = [(rng.standard_normal((batch, *shape)).astype(np.float32),
                 torch_models.labels(name, batch, shape, rng)) for _ in range(8)]
    np.savez(out["batches"], **{f"{k}{i}": a for i, xy in enumerate(data)
                                 for k, a in zip("xy", xy)})
    return out


def load_batches(path):
    with np.load(path) as z:
        return [(z[f"x{i}"], z[f"y{i}"]) for i in range(len(z.files) // 2)]


# -- one side of one row (in a subprocess) -----------------------------------------------------


def _torch_step(prep, device, threads):
    """The PyTorch side's step function (and the RSS after its imports)."""
    import torch
    base = rss_mb()
    torch.set_num_threads(threads)
    dev = "cuda" if device == "cuda" else "cpu"
    row = prep["row"]
    if row in BUILT:
        spec = SPECS[row]()
        p = {k: torch.tensor(v, device=dev, requires_grad=True)
             for k, v in spec["inits"].items() if v.dtype == np.float32}
        params = list(p.values())
        if row == "lstm":  # ONNX gates i, o, f, c -> torch's i, f, g, o; B = [Wb, Rb]
            H = spec["H"]
            order = np.concatenate([np.arange(H) + k * H for k in (0, 2, 3, 1)])
            lstm = torch.nn.LSTM(spec["I"], H).to(dev)
            w = spec["inits"]
            with torch.no_grad():
                lstm.weight_ih_l0.copy_(torch.tensor(w["W"][0][order]))
                lstm.weight_hh_l0.copy_(torch.tensor(w["R"][0][order]))
                lstm.bias_ih_l0.copy_(torch.tensor(w["B"][0][:4 * H][order]))
                lstm.bias_hh_l0.copy_(torch.tensor(w["B"][0][4 * H:][order]))
            p = {"lstm": lstm, "D": p["D"], "d": p["d"]}
            params = list(lstm.parameters()) + [p["D"], p["d"]]
        fwd = torch_forward(row)

        def model(x):
            return fwd(x, p)
    else:
        import torch_models
        module = torch_models.make(row.rsplit("-", 1)[0])[0].to(dev)
        module.load_state_dict(torch.load(prep["state"]))
        params, model = list(module.parameters()), module
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    # batches start on the host and are copied per step, as the Trainer's are
    tdata = [(torch.tensor(x), torch.tensor(y)) for x, y in load_batches(prep["batches"])]

    def step(i):
        x, y = (t.to(dev) for t in tdata[i % len(tdata)])
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()  # one host copy of the loss per step, as the Trainer does
    return step, base


def _tf_step(prep, threads):
    """The TensorFlow side's step function for a Keras row (and the RSS after its imports)."""
    import keras
    import keras_models
    import tensorflow as tf
    base = rss_mb()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    model = keras_models.make(prep["row"].rsplit("-", 1)[0])[0]
    model.load_weights(prep["state"])
    opt = keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=1e-2, epsilon=1e-8)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    # batches start on the host, as the Trainer's do
    data = load_batches(prep["batches"])

    def step(i):
        x, y = data[i % len(data)]
        return float(train(x, y))
    return step, base


def _tf_version() -> str:
    import tensorflow as tf
    return tf.__version__


def _keras_rows_runnable(rows, device, log=print) -> list:
    """``rows`` without the Keras rows where they cannot run: no TensorFlow installed, or a CUDA
    run (the TensorFlow side is tensorflow-cpu), each said in a note."""
    keras_rows = [r for r in rows if r.endswith("-keras")]
    why = None
    if keras_rows and device == "cuda":
        why = "the TensorFlow side runs on the CPU only (tensorflow-cpu)"
    elif keras_rows and importlib.util.find_spec("tensorflow") is None:
        why = "TensorFlow is not installed (pip install 'onnxgrad[tensorflow]')"
    if why:
        log(f"note: rows {keras_rows} left out: {why}")
        return [r for r in rows if r not in keras_rows]
    return rows


def run_side(prep, side, steps, warmup, repeat, device, threads, profile=None):
    if side == "onnxgrad":
        from onnxgrad.training import AdamW, Trainer
        __import__("onnxruntime")  # the libraries' own footprint is the baseline
        base = rss_mb()
        t0 = time.perf_counter()
        tr = Trainer(prep["onnx"], "cross_entropy", optimizer=AdamW(lr=1e-3),
                     params=prep["params"], device=device, threads=threads, progress=False,
                     profile=profile)
        build_s = time.perf_counter() - t0
        feeds = [{tr.data_inputs[0]: x, "target": y} for x, y in load_batches(prep["batches"])]

        def step(i):
            return tr.step(feeds[i % len(feeds)])
        sync = None
    elif side == "tf":
        step, base = _tf_step(prep, threads)
        build_s, sync = None, None
    else:
        step, base = _torch_step(prep, device, threads)
        build_s = None
        import torch
        sync = torch.cuda.synchronize if device == "cuda" else None
    first = step(0)  # the same weights and batch on every side: the same loss
    for i in range(1, warmup):
        step(i)
    rates, cpu_rates = [], []
    k = max(warmup, 1)
    for _ in range(repeat):
        if sync:
            sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step(k)
            k += 1
        if sync:
            sync()
        rates.append(steps / (time.perf_counter() - t0))
        cpu_rates.append(steps / (time.process_time() - c0))
    out = {"steps_per_s": statistics.median(rates), "rates": rates,
           # at 1 thread the process's CPU time leaves out the time other processes held the
           # core (a shared machine); wall time does not
           "cpu_steps_per_s": statistics.median(cpu_rates) if threads == 1 and
           device == "cpu" else None,
           "peak_rss_mb": rss_mb("VmHWM"),
           "base_rss_mb": base, "build_s": build_s, "first_loss": first}
    if side == "onnxgrad" and profile:
        out["profile"] = tr.end_profiling()
    if side == "torch" and device == "cuda":
        import torch
        out["peak_device_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


# -- onnxruntime-training's own virtual environment ---------------------------------------------
def ort_training_python(log=print):
    """The python of a virtual environment with onnxruntime-training 1.19.2 (made on first use,
    reused later), or None after printing why it cannot be had here."""
    py = os.path.join(ORT_TRAINING_VENV, "bin", "python")
    done = os.path.join(ORT_TRAINING_VENV, ".complete")
    if os.path.exists(done):
        return py
    base = None
    if sys.version_info[:2] in ((3, 10), (3, 11)):
        base = sys.executable
    for name in ("python3.11", "python3.10"):
        base = base or shutil.which(name)
    if base is None:
        log("note: onnxruntime-training 1.19.2 has wheels for Python 3.8 to 3.11 only and no "
            "such Python is on PATH: its column is left out")
        return None
    log(f"note: making onnxruntime-training's environment in {ORT_TRAINING_VENV} (once)")
    try:
        shutil.rmtree(ORT_TRAINING_VENV, ignore_errors=True)
        subprocess.run([base, "-m", "venv", ORT_TRAINING_VENV], check=True,
                       capture_output=True, text=True)
        subprocess.run([py, "-m", "pip", "install", "--quiet", *ORT_TRAINING_PACKAGES],
                       check=True, capture_output=True, text=True, timeout=3600)
        subprocess.run([py, "-c", "import onnxruntime.training.api"], check=True,
                       capture_output=True, text=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        err = getattr(exc, "stderr", "") or str(exc)
        log(f"note: onnxruntime-training 1.19.2 could not be installed ({err.strip()[-300:]}): "
            "its column is left out")
        return None
    open(done, "w").close()
    return py


def spawn_ort_training(py, prep, args, threads):
    with tempfile.TemporaryDirectory(prefix="ortt-") as work:
        spec = {"model": prep["onnx"], "batches": prep["batches"], "params": prep["params"],
                "steps": args.steps, "warmup": args.warmup, "repeat": args.repeat,
                "threads": threads, "workdir": work}
        path = os.path.join(work, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        p = subprocess.run([py, os.path.join(HERE, "ort_training_side.py"), path],
                           capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    lines = [ln for ln in (p.stderr or p.stdout).strip().splitlines() if ln.strip()]
    return {"error": lines[-1][:300] if lines else f"exit {p.returncode}"}


def gemm_peak(threads, device="cpu", n=1024, reps=20):
    """GFLOP/s of an onnxruntime MatMul n x n @ n x n (float32), best of ``reps`` runs."""
    from onnx import TensorProto, helper
    from onnxgrad.training.trainer import make_session
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    s = make_session(m, device, threads)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    import onnxruntime as ort
    dev = "cuda" if device == "cuda" else "cpu"
    av, bv = (ort.OrtValue.ortvalue_from_numpy(t, dev, 0) for t in (a, b))
    binding = s.io_binding()
    binding.bind_ortvalue_input("a", av)
    binding.bind_ortvalue_input("b", bv)
    binding.bind_output("c", dev)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        s.run_with_iobinding(binding)
        binding.synchronize_outputs()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def summarize_profile(path, top=12):
    """Time per node and per op type from an onnxruntime profile (kernel events): each node's
    median event times its events per run, so that a run the machine preempted (one event of
    tens of milliseconds among ones of a few, seen on this shared machine) does not count."""
    with open(path) as f:
        events = json.load(f)
    durs, runs = {}, 0
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            runs += 1
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        key = (e["name"][:-len("_kernel_time")], e.get("args", {}).get("op_name", "?"))
        durs.setdefault(key, []).append(e["dur"])
    runs = max(runs, 1)
    by_node = {k: statistics.median(d) * len(d) / runs for k, d in durs.items()}
    by_op = {}
    for (_, op), t in by_node.items():
        by_op[op] = by_op.get(op, 0) + t
    total = sum(by_op.values()) or 1
    lines = [f"onnxruntime profile ({runs} runs, {total / 1000:.2f} ms of kernels per run, "
             "medians):", "", "| op type | ms/run | share |", "| --- | ---: | ---: |"]
    for op, t in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {op} | {t / 1000:.3f} | {t / total:.1%} |")
    lines += ["", "| node | op | ms/run | share |", "| --- | --- | ---: | ---: |"]
    for (name, op), t in sorted(by_node.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {name} | {op} | {t / 1000:.3f} | {t / total:.1%} |")
    return "\n".join(lines)


# -- the driver --------------------------------------------------------------------------------
def child(args):
    with open(args.child_prep) as f:
        prep = json.load(f)
    res = run_side(prep, args.child_side, args.steps, args.warmup, args.repeat, args.device,
                   args.threads[0], args.child_profile)
    print("RESULT " + json.dumps(res))


def spawn(prep_path, side, args, threads, profile=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child-prep", prep_path,
           "--child-side", side, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--repeat", str(args.repeat), "--device", args.device, "--threads", str(threads)]
    if profile:
        cmd += ["--child-profile", profile]
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{prep_path}/{side} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def _combine(rs):
    """One side's runs of a row: median rate, largest peak RSS, smallest baseline."""
    ok = [r for r in rs if "error" not in r]
    if not ok:
        return {"error": rs[0]["error"]}
    cpu = [r["cpu_steps_per_s"] for r in ok if r.get("cpu_steps_per_s")]
    return {"steps_per_s": statistics.median(r["steps_per_s"] for r in ok),
            "rounds": [r["steps_per_s"] for r in ok],
            "cpu_steps_per_s": statistics.median(cpu) if cpu else None,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in ok),
            "base_rss_mb": min(r["base_rss_mb"] for r in ok),
            "build_s": statistics.median(r["build_s"] for r in ok) if ok[0].get("build_s")
            is not None else None, "first_loss": ok[0]["first_loss"]}


def _ratio(ours, other):
    """'speed ratio (CPU time ratio)' of ours over other, or '-'."""
    if not other or "error" in other:
        return "-", None, None
    r = ours["steps_per_s"] / other["steps_per_s"]
    c = (ours["cpu_steps_per_s"] / other["cpu_steps_per_s"]
         if ours.get("cpu_steps_per_s") and other.get("cpu_steps_per_s") else None)
    return f"{r:.2f}" + (f" (CPU {c:.2f})" if c else ""), r, c


def _rss(side):
    if not side or "error" in side:
        return "-"
    return f"{side['peak_rss_mb']:.0f} (+{side['peak_rss_mb'] - side['base_rss_mb']:.0f})"


def main(argv=None):
    from onnxgrad.training.trainer import cores
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), choices=ROWS)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed window")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3, help="timed windows per run (median)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of each side, alternated (median of their medians)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="thread counts to run every row at (all sides alike)")
    ap.add_argument("--ort-training", nargs="*", default=list(ORT_TRAINING_ROWS), choices=ROWS,
                    metavar="ROW", help="rows that also run onnxruntime-training 1.19.2 "
                    "(none when given alone)")
    ap.add_argument("--profile", nargs="*", choices=ROWS, default=None,
                    help="profile these rows (all when given alone) with onnxruntime")
    ap.add_argument("--ort-saved", action="store_true",
                    help="exported rows as onnxruntime's optimizer saves them "
                         "(ORT_ENABLE_EXTENDED: com.microsoft fused ops), for both ONNX sides")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--child-prep", help=argparse.SUPPRESS)
    ap.add_argument("--child-side", help=argparse.SUPPRESS)
    ap.add_argument("--child-profile", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_prep:
        return child(args)
    if args.device == "cuda":
        from onnxgrad.runtime import cuda_available
        if not cuda_available():
            print("no CUDA: onnxruntime cannot create a CUDA session on this machine "
                  "(onnxruntime-gpu, the CUDA/cuDNN libraries and a visible GPU are needed)",
                  file=sys.stderr)
            return 3
        args.ort_training = []
    import onnxruntime
    import torch
    args.rows = _keras_rows_runnable(args.rows, args.device)
    ortt = [r for r in args.rows if r in args.ort_training]
    ortt_py = ort_training_python() if ortt else None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# training steps/s, {args.device}, threads {args.threads}, {cores()} cores, load "
          f"average {load:.1f} at the start; onnxruntime {onnxruntime.__version__}, torch "
          f"{torch.__version__}; median over {args.rounds} alternated runs of the median of "
          f"{args.repeat} x {args.steps} steps after {args.warmup}")
    results = {"rows": {}, "gemm_peak_gflops": {}, "load_start": load}
    peak = {}
    for t in args.threads:
        peak[t] = gemm_peak(t, args.device)
        results["gemm_peak_gflops"][t] = peak[t]
        print(f"\npeak GEMM (onnxruntime MatMul 1024^3 float32), {t} threads: "
              f"{peak[t]:.1f} GFLOP/s")
    print("\n| row | threads | onnxgrad steps/s | torch (TF) steps/s | vs torch (TF) | "
          "ORT-training steps/s | vs ORT-training | peak RSS MB (+ over imports): onnxgrad | "
          "torch (TF) | ORT-training | note |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    work = tempfile.mkdtemp(prefix="train_step-")
    try:
        for row in args.rows:
            prep = prepare(row, work, args.ort_saved)
            prep_path = os.path.join(work, f"{row}.json")
            with open(prep_path, "w") as f:
                json.dump(prep, f)
            for t in args.threads:
                # alternate the sides over --rounds subprocess runs (this machine is shared:
                # load drifts), then take each side's median rate and its largest peak RSS
                baseline = "tf" if row.endswith("-keras") else "torch"
                sides = ["onnxgrad", baseline] + (["ort-training"] if row in ortt and ortt_py
                                                  else [])
                runs = {s: [] for s in sides}
                for _ in range(args.rounds):
                    for side in sides:
                        runs[side].append(spawn_ort_training(ortt_py, prep, args, t)
                                          if side == "ort-training" else
                                          spawn(prep_path, side, args, t))
                res = {s: _combine(rs) for s, rs in runs.items()}
                ours, ref, ot = res["onnxgrad"], res[baseline], res.get("ort-training")
                shown, ratio, cpu_ratio = _ratio(ours, ref)
                shown_ot, ratio_ot, cpu_ratio_ot = _ratio(ours, ot)
                note = [f"vs TensorFlow {_tf_version()}"] if baseline == "tf" else []
                if row.startswith("mlp"):
                    flops = SPECS["mlp"]()["flops"]
                    note.append(f"GEMM peak fraction: ours "
                                f"{flops * ours['steps_per_s'] / 1e9 / peak[t]:.0%}, torch "
                                f"{flops * ref['steps_per_s'] / 1e9 / peak[t]:.0%}")
                for name, side in ((baseline, ref), ("ORT-training", ot)):
                    if side and "error" not in side and abs(side["first_loss"] - ours[
                            "first_loss"]) > 1e-4 * max(1.0, abs(ours["first_loss"])):
                        note.append(f"first loss differs: ours {ours['first_loss']:.6g}, "
                                    f"{name} {side['first_loss']:.6g}")
                if ot and "error" in ot:
                    note.append(f"ORT-training failed: {ot['error']}")
                ot_rate = f"{ot['steps_per_s']:.2f}" if ot and "error" not in ot else "-"
                print(f"| {row} | {t} | {ours['steps_per_s']:.2f} | {ref['steps_per_s']:.2f} | "
                      f"{shown} | {ot_rate} | {shown_ot} | {_rss(ours)} | {_rss(ref)} | "
                      f"{_rss(ot)} | {'; '.join(note)} |", flush=True)
                results["rows"][f"{row}/{t}"] = {
                    **res, "ratio": ratio, "cpu_time_ratio": cpu_ratio,
                    "ratio_ort_training": ratio_ot, "cpu_time_ratio_ort_training": cpu_ratio_ot}
        if ortt and not ortt_py:
            print("\nnote: no onnxruntime-training column (see the note above)")
        if args.profile is not None:
            t = args.threads[0]
            for row in args.profile or args.rows:
                prep_path = os.path.join(work, f"{row}.json")
                if not os.path.exists(prep_path):
                    with open(prep_path, "w") as f:
                        json.dump(prepare(row, work, args.ort_saved), f)
                prefix = os.path.join(tempfile.gettempdir(), f"train_step_{row}_profile")
                res = spawn(prep_path, "onnxgrad",
                            argparse.Namespace(**{**vars(args), "repeat": 1}), t,
                            profile=prefix)
                print(f"\n## {row}: where the onnxgrad step's time goes ({t} threads)\n")
                print(summarize_profile(res["profile"]))
                results["rows"].setdefault(f"{row}/{t}", {})["profile"] = res["profile"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
