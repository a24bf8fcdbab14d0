"""Helpers the tests share: build small models, check gradients against finite differences."""
from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
from onnx import helper, numpy_helper

import onnxgrad
from onnxgrad.check import check_gradients
from onnxgrad.runtime import ort_module as runtime_module
from onnxgrad.runtime import run


def make_model(nodes, inputs, outputs, inits=None, opset=18, ir_version=10) -> onnx.ModelProto:
    """nodes: NodeProtos; inputs: {name: (np dtype, shape)}; outputs: names (types inferred);
    inits: {name: array} initializers."""
    g = helper.make_graph(
        nodes, "test",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), s)
         for n, (t, s) in inputs.items()],
        [helper.make_empty_tensor_value_info(n) for n in outputs],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in (inits or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    onnx.checker.check_model(m, full_check=True)
    return m


def vi_model(nodes, inputs, outputs, inits=None, opset=18, infer=True) -> onnx.ModelProto:
    """Like make_model, with inputs and outputs given as ValueInfoProtos (sequence types, or
    outputs declared by hand where inference is poor, as for Loop/Scan: ``infer=False``)."""
    g = helper.make_graph(nodes, "test", inputs, outputs,
                          [numpy_helper.from_array(np.asarray(v), n)
                           for n, v in (inits or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    if infer:
        m = onnx.shape_inference.infer_shapes(m)
    onnx.checker.check_model(m, full_check=True)
    return m


def op_model(op, inputs, n_out=1, opset=18, inits=None, **attrs):
    """A one-node model: inputs {name: (dtype, shape)}; outputs y0..yk."""
    outs = ["y"] if n_out == 1 else [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, list(inputs) + list(inits or {}), outs, **attrs)
    return make_model([node], inputs, outs, inits=inits, opset=opset)


def assert_gradients(model, ys, xs, feeds=None, *, f32=True, **kw):
    """The gradient graph passes the checker, matches float64 finite differences, and runs in the
    model's own dtype on onnxruntime CPU with the same numbers. Returns the check report."""
    ys = [ys] if isinstance(ys, str) else list(ys)
    xs = [xs] if isinstance(xs, str) else list(xs)
    report = check_gradients(model, ys, xs, feeds, **kw)
    assert report.ok, str(report)
    res = onnxgrad.gradients(model, ys, xs, grad_ys=list(report.cotangents))
    onnx.checker.check_model(res.model, full_check=True)
    if f32:  # the same graph in the original dtype, on onnxruntime at ORT_ENABLE_ALL (the level
        # users get; the check itself runs at ORT_ENABLE_BASIC), gives the same gradient
        from onnxgrad.runtime import session, session_options
        dtypes = {vi.name: helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
                  for vi in res.model.graph.input}
        inits = {t.name for t in model.graph.initializer}
        fd = {k: v.astype(dtypes[k]) for k, v in {**report.feeds, **report.cotangents}.items()
              if k in dtypes and k not in inits}
        names = [g for g in res.grads if g is not None]
        so = session_options()
        so.graph_optimization_level = runtime_module().GraphOptimizationLevel.ORT_ENABLE_ALL
        outs = dict(zip(names, session(res.model, options=so).run(names, fd)))
        for r, g in zip(report.results, res.grads):
            if g is None:
                continue
            got = np.asarray(outs[g], np.float64)
            tol = 1e-2 if outs[g].dtype in (np.float16,) else 2e-3
            np.testing.assert_allclose(got, r.grad, rtol=tol, atol=tol, err_msg=f"grad of {r.name}")
    return report


def grads_of(model, ys, xs, feeds, **kw):
    """Run gradients() and return (gradient arrays aligned with xs, result)."""
    res = onnxgrad.gradients(model, ys, xs, **kw)
    names = [g for g in res.grads if g is not None]
    vals = dict(zip(names, run(res.model, feeds, outputs=names)))
    return [None if g is None else vals[g] for g in res.grads], res


def central_differences(f, x, step=1.0) -> np.ndarray:
    """d f / d x (f: array -> float) by central differences; with the step of 1, exact for an
    f linear in x (up to rounding)."""
    out = np.zeros(np.shape(x))
    for j in np.ndindex(out.shape):
        a, b = x.copy(), x.copy()
        a[j] += step
        b[j] -= step
        out[j] = (f(a) - f(b)) / (2 * step)
    return out


def rand(shape, lo=-2.0, hi=2.0, away=(), gap=0.1, seed=0, dtype=np.float32):
    """Uniform values in [lo, hi] at least ``gap`` from every point in ``away`` (kinks)."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(lo, hi, shape)
    for _ in range(1000):
        bad = np.zeros(x.shape, bool)
        for k in away:
            bad |= np.abs(x - k) < gap
        if not bad.any():
            break
        x[bad] = rng.uniform(lo, hi, int(bad.sum()))
    assert not bad.any()
    return np.asarray(x, dtype)


def float_constants(model):
    """(node name, dtype) of every float constant the gradient call added."""
    out = []
    for n in model.graph.node:
        if n.name.startswith("gradients/") and n.op_type in ("Constant", "ConstantOfShape"):
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    dt = helper.tensor_dtype_to_np_dtype(a.t.data_type)
                    if np.issubdtype(dt, np.floating):
                        out.append((n.name, dt))
    return out


def run_grads(res, forward, feeds):
    """res.grads on onnxruntime CPU; on onnx.reference only where onnxruntime has no kernel for
    the forward model itself (then its gradient graph cannot be expected to run there either)."""
    from onnxgrad.runtime import session
    try:
        sess = session(res.model)
    except Exception:  # noqa: BLE001
        try:
            session(forward)
        except Exception:  # noqa: BLE001  onnxruntime lacks the forward kernel
            return run(res.model, feeds, outputs=res.grads, prefer="reference")
        raise  # the forward runs on onnxruntime, so its gradient graph must run there too
    return sess.run(res.grads, feeds)


def assert_dtypes_agree(build):
    """``build(dtype) -> (result, gradients)``: the float64 and float16 gradient graphs agree with
    the float32 one, and every float constant they hold has the model's dtype."""
    _, g32 = build(np.float32)
    for dtype, rtol in [(np.float64, 1e-5), (np.float16, 2e-2)]:
        res, got = build(dtype)
        for name, a, b in zip(res.grads, got, g32):
            assert a.dtype == dtype, (name, a.dtype)
            scale = max(1.0, float(np.max(np.abs(b))))
            np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=rtol, atol=rtol * scale,
                                       err_msg=f"{np.dtype(dtype).name} {name}")
        wrong = [(n, d) for n, d in float_constants(res.model) if d != dtype]
        assert not wrong, f"constants not in {np.dtype(dtype).name}: {wrong}"


def made_up_dims(model, skip=()) -> list:
    """(value name, dim name) of every dim named like onnx's inference names the dims it cannot
    compute (unk__N) in the main graph's value_info and outputs, leaving out the names in skip."""
    return [(vi.name, d.dim_param) for vi in [*model.graph.value_info, *model.graph.output]
            if vi.name not in skip for d in vi.type.tensor_type.shape.dim
            if d.dim_param.startswith("unk__")]


@contextlib.contextmanager
def quiet():
    """No warnings, stdout or stderr inside (the torch.onnx exporters' chatter)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def stock_session(model, level=None):
    """A plain onnxruntime CPU session, as a user makes one: every graph optimizer on (or those
    of ``level``, a GraphOptimizationLevel), none of those onnxgrad's own sessions leave out
    (runtime.UNSAFE_OPTIMIZERS), so that the fuzzers check what users run."""
    ort = runtime_module()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if level is not None:
        so.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def within(ours, want, noise, floor=0.0, tol=1e-3) -> bool:
    """The model fuzzers' comparison (tests/torch_gen.py, tests/keras_gen.py): whether ours is
    within tol x max|want|, plus 10x the reference framework's own float32 error (``noise``)
    and ``floor``: where the exact gradient is nearly 0 by cancellation (a norm of a norm's
    output), float32 leaves noise at the scale of the terms that cancel, not of the result."""
    return float(np.abs(ours - want).max(initial=0)) <= \
        tol * float(np.abs(want).max(initial=0)) + 10 * noise + floor + 1e-30


def quiet_export(net, path, args=None, **kw):
    """torch.onnx.export of ``net`` (input "x", output "y") without the exporter's chatter;
    returns the written model."""
    import torch
    with quiet():
        torch.onnx.export(net, args or (torch.randn(3, 4),), path, input_names=["x"],
                          output_names=["y"], **kw)
    return onnx.load(path)


def bn_net(momentum=0.3):
    """bn_train_export's torch net (seeded)."""
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, momentum=momentum),
                               torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 36, 2))


def bn_train_export(path, momentum=0.3, running=None):
    """A Conv-BatchNorm-ReLU-Linear net on 3x8x8 images, exported to ``path`` in training mode
    (its BatchNormalization updates running statistics, symbolic batch); ``running``: (mean,
    var) to start the statistics from. Returns the torch net (the export ran one forward)."""
    import torch
    net = bn_net(momentum)
    if running is not None:
        with torch.no_grad():
            net[1].running_mean.fill_(running[0])
            net[1].running_var.fill_(running[1])
    quiet_export(net.train(), path, (torch.randn(8, 3, 8, 8),), dynamo=False,
                 dynamic_axes={"x": {0: "N"}}, do_constant_folding=False,
                 training=torch.onnx.TrainingMode.TRAINING)
    return net


def torch_train(forward, init, make_opt, clip, batches, lr_schedule=None, frozen=()):
    """The torch.optim loop the Trainer tests compare with: cross_entropy of ``forward(x, p)``
    over ``batches``, ``make_opt`` over the parameters not ``frozen`` (which clipping never
    sees either), lr from ``lr_schedule(step)`` (from 1). Returns (parameters, losses)."""
    import torch
    F = torch.nn.functional
    p = {k: torch.tensor(np.array(v), requires_grad=k not in frozen) for k, v in init.items()}
    trained = [v for k, v in p.items() if k not in frozen]
    opt = make_opt(trained)
    losses = []
    for i, (x, y) in enumerate(batches):
        if lr_schedule:
            for group in opt.param_groups:
                group["lr"] = lr_schedule(i + 1)
        opt.zero_grad()
        loss = F.cross_entropy(forward(torch.tensor(x), p), torch.tensor(y))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(trained, clip)
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().numpy() for k, v in p.items()}, losses
