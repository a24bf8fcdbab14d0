"""Gradients of the model-zoo architectures shipped in the onnx wheel, against finite differences.

    python bench/model_zoo.py                 # all nine, a markdown table
    python bench/model_zoo.py squeezenet vgg19

onnx/backend/test/data/light/light_*.onnx hold the architectures with every weight replaced by a
ConstantOfShape node. ``materialize`` turns those into random initializers (fixed seed): conv and
fully-connected weights He-scaled (std sqrt(2 / fan_in)), BN / Mul scales 1 + 0.1 N(0,1), biases
and shifts 0.1 N(0,1). BN running statistics are then set to the statistics of a random image
(as training would: random statistics let activations grow to inf through shufflenet, and a BN bias
then drowns in float32 rounding), and the last weighted layer before the Softmax is rescaled so the
logits have unit std (a saturated softmax has a vanishing gradient: a vacuous check). Batch 1 (the
models are declared with batch 1). xs = the image and every float initializer.

Oracle (``fd_check``): onnxruntime has no float64 Conv (nor LRN), and onnx.reference is far too
slow at 224x224 (and its LRN is wrong for N != C), so float64 finite differences are out of reach:
the check is float32 central differences of f = sum(softmax * c) (c a random cotangent, reduced in
float64) along one random Gaussian direction d per tensor x (multiplicative, d * x, for BN
variances so they stay positive), with a step relative to the tensor: ``x +- h d``,
``h = eps * |x| / |d|``. Error per tensor:
|fd - <g, d>| / max(|fd|, |<g, d>|, |g| |d| / sqrt(n), floor / FD_TOL), where |g| |d| / sqrt(n) is
the typical size of <g, d> for a random d (a direction nearly orthogonal to g is not judged on
cancellation noise) and floor = FD_ATOL x the model's median of that (dead-ReLU paths give
derivatives of 1e-9 .. 1e-11 whose quotient is exactly 0). Tolerance FD_TOL = 2e-2 for weights.
Steps: FD_LADDER, starting at eps = 1e-2 and walking down to 1e-4 then up to 1e-1 until one agrees:
float32 rounding grows as the step shrinks, ReLU / MaxPool kinks crossed by the step grow with it,
and a kink inside the step changes the quotient while a wrong gradient is wrong at every step.
The image and the first layer's weights have every kink of the net behind them: measured on
inception_v1 cut after its first Relu (one Relu!), the quotient along a random image direction
scatters by +-1e-2 at every step from 1e-2 to 1e-4, and by 6-12 % at the full net, so they get
INPUT_TOL = 1e-1. A tensor whose quotients scatter by more than 10 x FD_TOL across the ladder with
<g, d> inside that scatter is reported "unresolved" (no oracle; the test allows at most 5 %).

Exact oracle (``torch_check``): ``tests/torch_interp.py`` runs the same materialized graph op by
op in torch, in float64, and torch autograd gives the gradient of the same f (same weights, image
and cotangent) w.r.t. the image and every weight; per tensor ||ours - torch|| / ||torch||, ours
being onnxgrad's gradient model on onnxruntime CPU in float32. The interpreter's float32 forward
must equal onnxruntime's (max |diff| / max |y| <= FWD_TOL = 1e-5; measured 4e-7 .. 3e-6). Two
float32 effects set the tolerance, both measured with the interpreter itself in float32 against
float64 ("torch f32 vs f64"): rounding alone gives 1e-6 .. 3e-6 (resnet50, shufflenet,
squeezenet), but a MaxPool window whose two largest inputs differ by ~1e-7 (one in 193600 windows
of inception_v1's first MaxPool) is resolved the other way in float32, which reroutes that
element's gradient and moves every tensor upstream by up to 8e-3 (thread-count dependent). So
the float64 oracle is also run on ours' pieces (``kinks``): each Relu mask and MaxPool argmax
taken from the float32 values the gradient model itself computes (extra outputs of the same run),
the values in float64. That is the gradient a correct float32 backward computes, and ours
matches it to rounding (<= 1.7e-6 on all nine): KINK_TOL = 1e-4 per tensor is asserted (30 x
the largest float32 rounding seen, 3e-6, far below the O(1e-1) of a wrong rule). The same
tolerance is asserted against float64's own pieces except its near-ties (``tie_rel_err``): a
Relu input or a MaxPool window whose float64 decision lies within TIE = 1e-4 x max |input| of
the other side takes the float32 run's decision (either is right there; float32 resolves a
margin of ~1e-7 relative either way, depending on the machine), every other decision is
float64's own; inception_v1: 8.8e-7 (the flip lies within 1e-6 of max |input|: TIE = 1e-6
gives the same, 1e-8 the plain figure). The plain float64 comparison is reported against
TORCH_TOL = 1e-3 (ours <= the float32 interpreter's own figure wherever a tie flips).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import onnx
from onnx import numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # torch_interp

import onnxgrad  # noqa: E402
from fuzz_cases import quiet_session as session  # noqa: E402  (stock onnxruntime)

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
ALL = ("squeezenet", "shufflenet", "bvlc_alexnet", "inception_v1", "zfnet512", "vgg19",
       "inception_v2", "resnet50", "densenet121")
SMALL = ("squeezenet", "shufflenet", "bvlc_alexnet", "inception_v1")
FD_EPS = 1e-2
FD_TOL = 2e-2
INPUT_TOL = 1e-1  # the image and the first layer: every ReLU / MaxPool lies between it and the loss
FD_LADDER = (FD_EPS, FD_EPS / 3, FD_EPS / 10, FD_EPS / 30, FD_EPS / 100, FD_EPS * 3, FD_EPS * 10)
FD_ATOL = 1e-2  # x the median over the model's tensors of |g| |d| / sqrt(n)
FLOATS = (onnx.TensorProto.FLOAT,)
TORCH_TOL = 1e-3  # ||ours - torch64|| / ||torch64|| per tensor, reported (see torch_check)
KINK_TOL = 1e-4  # the same on ours' Relu / MaxPool pieces: asserted (see torch_check)
TIE = 1e-4  # a Relu / MaxPool decision within TIE x max |input| of its other side is a near-tie
FWD_TOL = 1e-5  # the interpreter's float32 forward against onnxruntime's, max |diff| / max |y|


def _consumers(graph):
    out = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            out.setdefault(name, []).append((node, i))
    return out


def _final_use(name, cons):
    """The (node, input index) that really uses ``name``, looking through Unsqueeze / Reshape /
    Identity (the BN scale of densenet is Unsqueeze'd before a Mul)."""
    seen = 0
    while name in cons and seen < 8:
        node, i = cons[name][0]
        if node.op_type in ("Unsqueeze", "Reshape", "Identity", "Squeeze") and i == 0:
            name, seen = node.output[0], seen + 1
            continue
        return node, i
    return None, None


def _init_value(shape, node, i, rng):
    op = node.op_type if node is not None else ""
    shape = tuple(int(s) for s in shape)
    if op in ("Conv", "ConvTranspose") and i == 1 or op in ("Gemm", "MatMul") and i == 1:
        if op == "Gemm":
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            fan_in = shape[1] if trans_b else shape[0]
        elif op == "MatMul":
            fan_in = shape[0]
        else:
            fan_in = int(np.prod(shape[1:]))
        return rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
    if op == "BatchNormalization":
        if i == 1:
            return 1 + 0.1 * rng.standard_normal(shape)
        if i == 4:
            return rng.uniform(0.5, 1.5, shape)
    if op == "Mul":
        return 1 + 0.1 * rng.standard_normal(shape)
    return 0.1 * rng.standard_normal(shape)


def materialize(name, seed=0):
    """(model with random float initializers, data input name, output name, weight names)."""
    m = onnx.load(os.path.join(LIGHT, f"light_{name}.onnx"))
    rng = np.random.default_rng(seed)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    cons = _consumers(g)
    new_inits, keep_nodes, dropped = [], [], set()
    for node in g.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = numpy_helper.to_array(inits[node.input[0]])
            use, i = _final_use(node.output[0], cons)
            v = _init_value(shape, use, i, rng).astype(np.float32)
            new_inits.append(numpy_helper.from_array(v, node.output[0]))
            dropped.add(node.input[0])
        else:
            keep_nodes.append(node)
    for t in g.initializer:
        if t.name in dropped:
            continue
        if t.data_type in FLOATS:  # the few weights stored as values (biases, mostly 0)
            use, i = _final_use(t.name, cons)
            v = _init_value(t.dims, use, i, rng).astype(np.float32)
            new_inits.append(numpy_helper.from_array(v, t.name))
        else:
            new_inits.append(t)
    del g.node[:]
    g.node.extend(keep_nodes)
    del g.initializer[:]
    g.initializer.extend(new_inits)
    names = {t.name for t in new_inits}
    data = [i for i in g.input if i.name not in names and i.name not in dropped]
    del g.input[:]
    g.input.extend(data)
    m.ir_version = 8  # initializers need not be inputs any more
    used = {n for node in g.node for n in node.input}
    weights = [t.name for t in g.initializer if t.data_type in FLOATS and t.name in used]
    assert len(data) == 1, [i.name for i in data]
    out = g.output[0].name
    _bn_statistics(m, data[0].name, rng)
    _calibrate(m, data[0].name, weights, rng)
    onnx.checker.check_model(m)
    return m, data[0].name, out, weights


def _data_shape(m, data):
    vi = next(i for i in m.graph.input if i.name == data)
    return [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]


def _bn_statistics(m, data, rng, passes=60):
    """Set every BatchNormalization's mean and variance to the statistics of its input on a
    random image, as training would have: random statistics let the activations grow by orders of
    magnitude through the blocks (to inf in shufflenet), and then a BN bias is 1e-3 of the
    signal and its gradient drowns in float32 rounding. Later layers depend on earlier ones, so
    passes until every layer has been set from finite inputs (each pass sets at least the next
    one)."""
    bns = [n for n in m.graph.node if n.op_type == "BatchNormalization"]
    if not bns:
        return
    x = rng.standard_normal(_data_shape(m, data)).astype(np.float32)
    inits = {t.name: t for t in m.graph.initializer}
    done = set()
    for _ in range(passes):
        probe = onnx.ModelProto()
        probe.CopyFrom(m)
        del probe.graph.output[:]
        probe.graph.output.extend([onnx.helper.make_empty_tensor_value_info(n.input[0])
                                   for n in bns])
        acts = session(probe).run(None, {data: x})
        for n, a in zip(bns, acts):
            if not np.all(np.isfinite(a)):  # overflowed downstream of random statistics: the
                continue  # next pass, with the layers above normalised, will reach it
            axes = (0,) + tuple(range(2, a.ndim))
            var = a.var(axes)
            var = var + max(1e-3, 0.1 * float(np.median(var)))  # dead channels: no tiny variances
            for name, v in ((n.input[3], a.mean(axes)), (n.input[4], var)):
                inits[name].CopyFrom(numpy_helper.from_array(v.astype(np.float32), name))
            done.add(n.output[0])
        if len(done) == len(bns) and all(np.all(np.isfinite(a)) for a in acts):
            break


def _calibrate(m, data, weights, rng):
    """Scale the last Conv / Gemm before the Softmax so the logits have unit std."""
    sm = next((n for n in m.graph.node if n.op_type == "Softmax"), None)
    if sm is None:
        return
    last = [n for n in m.graph.node if n.op_type in ("Conv", "Gemm")][-1]
    probe = onnx.ModelProto()
    probe.CopyFrom(m)
    del probe.graph.output[:]
    probe.graph.output.extend([onnx.helper.make_empty_tensor_value_info(sm.input[0])])
    x = rng.standard_normal(_data_shape(m, data)).astype(np.float32)
    logits = session(probe).run(None, {data: x})[0]
    c = 1.0 / max(float(np.std(logits)), 1e-6)
    targets = set(last.input[1:])
    for node in reversed(m.graph.node):  # inception_v1 Reshapes its classifier weight first
        if node.op_type in ("Reshape", "Identity", "Unsqueeze") and node.output[0] in targets:
            targets.add(node.input[0])
    for t in m.graph.initializer:
        if t.name in targets:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * np.float32(c), t.name))


def _as_inputs(m, weights):
    """The forward model with every weight a graph input (to perturb it); float initializers that
    no node reads (zfnet512 has one) are dropped."""
    f = onnx.ModelProto()
    f.CopyFrom(m)
    f.graph.input.extend([onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                          for t in f.graph.initializer if t.name in set(weights)])
    keep = [t for t in f.graph.initializer if t.data_type not in FLOATS]
    del f.graph.initializer[:]
    f.graph.initializer.extend(keep)
    return f


def gradients(m, data, out, weights, seed=1):
    """onnxgrad's gradient of f = sum(out * cot) w.r.t. the image and every weight, built once
    and run on onnxruntime CPU (float32) at a random image x0 and cotangent cot (seeded: both
    oracles see the same ones). Returns a dict (``rng`` is left where the draws stopped)."""
    rng = np.random.default_rng(seed)
    xs = [data] + weights
    t0 = time.perf_counter()
    res = onnxgrad.gradients(m, [out], xs, grad_ys=["cot"])
    build = time.perf_counter() - t0
    assert all(g is not None for g in res.grads), [x for x, g in zip(xs, res.grads) if g is None]
    gsess = session(res.model)
    x0 = rng.standard_normal(_data_shape(m, data)).astype(np.float32)
    fwd = session(_as_inputs(m, weights))
    vals = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer if t.name in weights}
    vals[data] = x0
    y = fwd.run([out], vals)[0]
    assert np.all(np.isfinite(y))
    cot = rng.standard_normal(y.shape).astype(np.float32)
    gsess.run(res.grads, {data: x0, "cot": cot})  # warm-up
    t0 = time.perf_counter()
    grads = gsess.run(res.grads, {data: x0, "cot": cot})
    fwdbwd = time.perf_counter() - t0
    return {"rng": rng, "xs": xs, "res": res, "build_s": build, "fwdbwd_s": fwdbwd,
            "grads": grads, "x0": x0, "cot": cot, "y": y, "fwd": fwd, "vals": vals}


def fd_check(m, data, out, weights, seed=1, ours=None):
    """Compare onnxgrad's gradient (``gradients``, built here unless given) with central
    differences per tensor. Returns a dict row."""
    ours = ours or gradients(m, data, out, weights, seed)
    rng, xs, res, grads = ours["rng"], ours["xs"], ours["res"], ours["grads"]
    build, fwdbwd, fwd, vals, cot = (ours[k] for k in ("build_s", "fwdbwd_s", "fwd", "vals",
                                                       "cot"))
    c64 = cot.astype(np.float64)

    def f(feeds):
        return float(np.sum(fwd.run([out], feeds)[0].astype(np.float64) * c64))

    positive = {n.input[4] for n in m.graph.node if n.op_type == "BatchNormalization"}
    first = next(n for n in m.graph.node if data in n.input)
    front = {data, *first.input} & set(xs)  # the image, the first layer: every kink is behind

    def quotient(x, d, eps):
        h = eps * np.linalg.norm(vals[x]) / np.linalg.norm(d)
        hd = (h * d).astype(np.float32)
        return (f({**vals, x: vals[x] + hd}) - f({**vals, x: vals[x] - hd})) / (2 * h)

    dirs, scales = {}, {}
    for x, g in zip(xs, grads):
        assert g.shape == vals[x].shape, (x, g.shape, vals[x].shape)
        assert np.all(np.isfinite(g)), x
        d = rng.standard_normal(g.shape)
        if x in positive:  # variances: a multiplicative direction keeps them positive
            d = d * vals[x]
        dirs[x] = d
        scales[x] = np.linalg.norm(g) * np.linalg.norm(d) / np.sqrt(d.size)
    # derivatives this far below the model's typical one are zero to float32 (dead ReLU paths:
    # the quotient is exactly 0, the analytic value 1e-9): judged against an absolute floor
    floor = FD_ATOL * float(np.median(list(scales.values())))
    errs, unresolved = {}, {}
    for x, g in zip(xs, grads):
        d = dirs[x]
        ana = float(np.sum(g.astype(np.float64) * d))
        scale = max(abs(ana), scales[x], floor / FD_TOL, 1e-30)
        nums, e = [], np.inf
        for eps in FD_LADDER:  # a kink inside the step changes the result, a wrong gradient not
            nums.append(quotient(x, d, eps))
            e = min(e, abs(nums[-1] - ana) / max(scale, abs(nums[-1])))
            if e <= (INPUT_TOL if x in front else FD_TOL):
                break
        errs[x] = e
        spread = (max(nums) - min(nums)) / scale
        settled = abs(ana - float(np.median(nums))) > spread * scale
        if e > FD_TOL and spread > 10 * FD_TOL and not settled:
            unresolved[x] = e  # the quotients never settle, ana within their scatter: no oracle
    tol = {x: (INPUT_TOL if x in front else FD_TOL) for x in xs}
    failures = {k: v for k, v in errs.items() if v > tol[k] and k not in unresolved}
    resolved = [v for k, v in errs.items() if k not in unresolved and k not in front]
    return {"nodes": len(m.graph.node), "grad_nodes": len(res.model.graph.node),
            "tensors": len(xs), "build_s": build, "fwdbwd_s": fwdbwd,
            "max_rel_err": max(resolved),
            "worst": max((k for k in errs if k not in front),
                         key=lambda k: (k not in unresolved, errs[k])),
            "input_rel_err": max(errs[k] for k in front if k in errs),
            "failures": failures, "unresolved": unresolved}


def torch_check(m, data, out, weights, seed=1, ours=None):
    """Compare onnxgrad's gradient (float32, onnxruntime) with torch autograd through
    ``tests/torch_interp.py`` (the same graph, weights, image and cotangent, run op by op in
    torch) in float64: per tensor ||ours - torch|| / ||torch|| (``torch_rel_err``, reported
    against TORCH_TOL), and the same on ours' Relu / MaxPool pieces (``kink_rel_err``, failures
    above KINK_TOL in ``torch_failures``; see the module docstring). The interpreter in float32
    gives ``f32_rel_err``, what a correct float32 gradient can show, and its forward must equal
    onnxruntime's (``fwd_err``: max |diff| / max |y|, a check of the interpreter itself).
    Returns a dict."""
    import torch
    import torch_interp

    ours = ours or gradients(m, data, out, weights, seed)
    xs, grads = ours["xs"], ours["grads"]
    c64 = torch.tensor(ours["cot"].astype(np.float64))
    # the gradient model's own float32 values of every Relu / MaxPool input (extra outputs of
    # the same run; the gradients must come out the same)
    kn = sorted({n.input[0] for n in m.graph.node if n.op_type in ("Relu", "MaxPool")})
    gm = onnx.ModelProto()
    gm.CopyFrom(ours["res"].model)
    have = {o.name for o in gm.graph.output}
    gm.graph.output.extend([onnx.helper.make_empty_tensor_value_info(n) for n in kn
                            if n not in have])
    run = session(gm).run(list(ours["res"].grads) + kn, {data: ours["x0"], "cot": ours["cot"]})
    grads_k, kinks = run[:len(xs)], {n: torch.tensor(v) for n, v in zip(kn, run[len(xs):])}
    rerun = max(float(np.max(np.abs(a - b))) for a, b in zip(grads, grads_k))

    def autograd(dtype, kinks=None, tie=None):
        vals = torch_interp.initializers(m, dtype)
        vals[data] = torch.tensor(ours["x0"].astype(np.float64), dtype=dtype)
        leaves = [vals[x].requires_grad_(True) for x in xs]
        (y,) = torch_interp.run(m, vals, [out], kinks=kinks, tie=tie)
        f = (y.to(torch.float64) * c64).sum()
        return y.detach(), [g.to(torch.float64).numpy() for g in torch.autograd.grad(f, leaves)]

    t0 = time.perf_counter()
    _, g64 = autograd(torch.float64)
    t64 = time.perf_counter() - t0
    _, g64k = autograd(torch.float64, kinks)
    _, g64t = autograd(torch.float64, kinks, TIE)
    y32, g32 = autograd(torch.float32)
    y = ours["y"]
    fwd_err = float(np.max(np.abs(y32.numpy() - y)) / np.max(np.abs(y)))

    def rel(a, b):
        return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b), 1e-300))

    errs = {x: rel(g, t) for x, g, t in zip(xs, grads, g64)}
    errs_k = {x: rel(g, t) for x, g, t in zip(xs, grads_k, g64k)}
    errs_t = {x: rel(g, t) for x, g, t in zip(xs, grads_k, g64t)}
    errs32 = {x: rel(g, t) for x, g, t in zip(xs, g32, g64)}
    worst, worst_k, worst_t, worst32 = (max(e, key=e.get) for e in (errs, errs_k, errs_t, errs32))
    return {"torch_rel_err": errs[worst], "torch_worst": worst, "torch_input_rel_err": errs[data],
            "kink_rel_err": errs_k[worst_k], "kink_worst": worst_k,
            "tie_rel_err": errs_t[worst_t], "tie_worst": worst_t,
            "f32_rel_err": errs32[worst32], "f32_worst": worst32, "fwd_err": fwd_err,
            "rerun_diff": rerun, "torch_s": t64, "torch_errs": errs, "kink_errs": errs_k,
            "f32_errs": errs32,
            "torch_failures": {k: v for k, v in errs_k.items() if v > KINK_TOL},
            "tie_failures": {k: v for k, v in errs_t.items() if v > KINK_TOL},
            "torch_above_tol": {k: v for k, v in errs.items() if v > TORCH_TOL}}


def check_model(name, fd=True, torch=False):
    """The FD row (``fd_check``) and, with ``torch``, the torch-oracle keys (``torch_check``)."""
    m, data, out, weights = materialize(name)
    ours = gradients(m, data, out, weights)
    row = {}
    if torch:
        row.update(torch_check(m, data, out, weights, ours=ours))
    if fd:
        row.update(fd_check(m, data, out, weights, ours=ours))
    return row


def main(argv):
    names = argv or list(ALL)
    print("| model | #nodes | #grad-graph nodes | #tensors | build s | fwd+bwd s "
          "| max rel err (weights) | worst | input + 1st layer rel err | FD unresolved "
          "| torch f64: max norm-rel err (worst) | same Relu/MaxPool pieces "
          "| f64 pieces but near-ties | torch f32 vs f64 | interp fwd err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for name in names:
        try:
            r = check_model(name, torch=True)
        except Exception as exc:  # noqa: BLE001  (a table row, not a traceback)
            print(f"| {name} | error: {type(exc).__name__}: {str(exc)[:200]} |||||||||||||",
                  flush=True)
            ok = False
            continue
        ok &= (not r["failures"] and not r["torch_failures"] and not r["tie_failures"]
               and r["fwd_err"] <= FWD_TOL)
        for k, v in {**r["failures"], **r["unresolved"]}.items():
            print(f"    {'FAIL' if k in r['failures'] else 'unresolved'} {k}: {v:.2e}")
        for k, v in r["torch_failures"].items():
            print(f"    FAIL torch (same pieces) {k}: {v:.2e}")
        for k, v in r["tie_failures"].items():
            print(f"    FAIL torch (float64 pieces but near-ties) {k}: {v:.2e}")
        print(f"| {name} | {r['nodes']} | {r['grad_nodes']} | {r['tensors']} | {r['build_s']:.2f} "
              f"| {r['fwdbwd_s']:.3f} | {r['max_rel_err']:.2e} | {r['worst']} "
              f"| {r['input_rel_err']:.2e} | {len(r['unresolved'])} "
              f"| {r['torch_rel_err']:.1e} ({r['torch_worst']}) | {r['kink_rel_err']:.1e} "
              f"| {r['tie_rel_err']:.1e} | {r['f32_rel_err']:.1e} | {r['fwd_err']:.1e} |",
              flush=True)
    print(f"\nFD tolerance {FD_TOL} weights, {INPUT_TOL} input and first layer (float32 central "
          f"differences, steps {FD_LADDER} relative); torch oracle: {KINK_TOL} per tensor on "
          f"the same Relu / MaxPool pieces and on float64's own pieces except near-ties "
          f"(within {TIE} x max |input|; both asserted), {TORCH_TOL} plain (reported; MaxPool "
          f"near-ties), interpreter forward {FWD_TOL}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
