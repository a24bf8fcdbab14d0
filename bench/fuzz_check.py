"""Checking a fuzzed Problem (bench/fuzz_graphs.py): one verdict per graph, the failing node named.

- The generated model must pass ``onnx.checker.check_model(full_check=True)`` and run on
  onnxruntime CPU at ORT_ENABLE_ALL, else the verdict is "gen-invalid" (a fuzzer bug).
- The gradients() call runs on the float64 model; its gradients are compared with float64 central
  differences of sum(y * cotangent) on an oracle copy of the model in which stop_gradients are
  cut (fed their forward values) and intermediate xs are shifted by a fed delta, at every batch
  size. Probes where one-sided differences disagree (a kink or tie) or central differences
  change with the step (a jump) are skipped ("skipped-tie" when nothing else is wrong).
- The same call on the model in its own dtype must give a model that passes the checker and
  gives the same numbers on onnxruntime at ORT_ENABLE_ALL as with its graph optimizations off;
  where its graph is built otherwise than the float64 one, the float64 numbers too (to float32
  accuracy). A tie that rounding resolves either way (the float64 gradient jumps under tiny
  input perturbations) skips the comparison.
- A second-order call (gradients of the first call's gradients) is checked the same way.
- On a failure, every node of the graph is checked alone, fed the values it sees in the graph:
  the first node that fails alone is named; when none does, the engine's composition is.
"""
from __future__ import annotations

import functools
import os
import re
import sys
import traceback
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from onnx import helper

sys.path.insert(0, os.path.dirname(__file__))
import fuzz_cases  # noqa: E402
import fuzz_graphs  # noqa: E402
from fuzz_graphs import Problem  # noqa: E402

FAILURES = ("wrong", "crash", "invalid-model", "gen-invalid")
# refusals of a configuration by an op's rule that are right, with why (message patterns)
ACCEPTED_REFUSALS = {
    # training-mode Dropout whose mask output is absent: the random mask is gone
    r"Dropout node .* has no mask output": "the random mask cannot be recovered",
    # Det's cofactor construction is unrolled over the matrix size (a limitation, listed here
    # so the fuzzer can go on; a rule for symbolic sizes would lift it)
    r"the gradient of Det node .* needs the matrix size": "Det needs a static matrix size",
    # onnx's inference makes up dims of 0 for Attention outputs with some symbolic input dims
    r"gives Attention output .* a dim of 0 that no input has": "onnx's inference is wrong",
}
VERDICTS = ("ok", "skipped-tie", "skipped-domain", "skipped-oracle", "refused") + FAILURES
EPS = 1e-6  # relative finite-difference step (float64)
RTOL, ATOL = 1e-5, 1e-8  # float64 gradient against central differences
NATIVE_RTOL = {np.dtype(np.float32): 2e-3, np.dtype(np.float64): 1e-6}  # at ORT_ENABLE_ALL
MAX_UNIT = 8  # xs with at most this many elements are probed element by element
DIRECTIONS = 3  # random unit directions for larger xs


@dataclass
class Outcome:
    verdict: str
    detail: str = ""
    stage: str = ""  # "first" / "second" (the float64 calls), "first-native" / "second-native"
    #                  (the same calls on the model in its own dtype, at ORT_ENABLE_ALL)
    where: str = ""  # the node that fails alone (its case or glue op), or "engine"
    probes: int = 0  # finite-difference probes compared
    skipped: int = 0  # probes skipped at kinks or ties
    refused_op: tuple = ()  # (domain, op_type, opset) a NotDifferentiableError names
    connected: int = 0  # xs (over sizes and orders) whose gradient is not None

    @property
    def failed(self):
        """wrong, crash, invalid-model, gen-invalid; or a refusal where a rule exists (refusing
        is right only where no rule covers the case, and ACCEPTED_REFUSALS)."""
        if self.verdict == "refused":
            from onnxgrad.registry import lookup
            if any(re.search(pattern, self.detail) for pattern in ACCEPTED_REFUSALS):
                return False
            if not self.refused_op:  # a rule's NotImplementedError: a configuration refused
                return True
            return lookup(*self.refused_op) is not None
        return self.verdict in FAILURES

    def key(self):
        """What makes two failures the same class: verdict, stage and the op blamed."""
        return (self.verdict, self.stage, self.where.split(" ")[0])


class _Fail(Exception):
    def __init__(self, verdict, detail, stage=""):
        super().__init__(detail)
        self.outcome = Outcome(verdict, detail, stage)


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


# ---- running models

class _Runner:
    """onnxruntime CPU at ``level`` ("basic": exact float64 arithmetic; "all": what users get).
    With ``fallback``, onnx.reference takes over where onnxruntime has no kernel for the model's
    types (float64 variants of many ops); when that fails too, the float64 oracle cannot judge
    the graph (:class:`_Fail` "skipped-oracle")."""

    def __init__(self, model, level="basic", fallback=True):
        self.model, self.fallback, self.ref = model, fallback, None
        self.sess = None
        self.declared = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
                         for i in model.graph.input if i.type.tensor_type.elem_type}
        try:
            self.sess = fuzz_cases.quiet_session(model, level)
        except Exception as e:  # noqa: BLE001
            if not (fallback and _missing_kernel(e)):
                raise
            self.why = e
        else:
            self.inputs = {i.name for i in self.sess.get_inputs()}

    def __call__(self, feeds, outputs):
        """Run on ``feeds``, each float array cast to the float type the model declares for it."""
        feeds = {k: np.asarray(v) for k, v in feeds.items()}
        feeds = {k: (v.astype(self.declared[k]) if v.dtype.kind == "f" and k in self.declared
                     else v) for k, v in feeds.items()}
        if self.sess is not None:
            try:
                return self.sess.run(outputs, {k: v for k, v in feeds.items()
                                               if k in self.inputs})
            except Exception as e:  # noqa: BLE001
                if not (self.fallback and _missing_kernel(e)):
                    raise
                self.sess, self.why = None, e
        try:
            if self.ref is None:
                from onnxgrad.runtime import runner
                self.ref = runner(self.model, "reference")
            names = {i.name for i in self.model.graph.input}
            return self.ref({k: v for k, v in feeds.items() if k in names}, outputs)
        except Exception as e:  # noqa: BLE001
            raise _Fail("skipped-oracle", f"onnxruntime: {_short(self.why)}; onnx.reference: "
                        f"{_short(e)}") from e


def _missing_kernel(e: BaseException) -> bool:
    """onnxruntime has no kernel for these types (not: the model is wrong)."""
    msg = str(e)
    return "NOT_IMPLEMENTED" in msg or "not support double" in msg


def _expose(model, names):
    """A copy of ``model`` whose graph outputs also include ``names`` (untyped)."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    have = {o.name for o in m.graph.output}
    for n in dict.fromkeys(names):
        if n not in have:
            m.graph.output.append(helper.make_empty_tensor_value_info(n))
    return m


def _produced(model):
    return {o for n in model.graph.node for o in n.output if o}


def _oracle(model, cut, shift, free):
    """The float64 oracle: ``cut`` tensors (stop_gradients) become graph inputs fed their forward
    values, each ``shift`` tensor x (an intermediate x) becomes x_pre + x__delta, and ``free``
    initializers (xs) become graph inputs, so every x can be perturbed alone."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    g = m.graph
    produced = _produced(m)
    cut = [c for c in dict.fromkeys(cut) if c in produced]
    shift = [s for s in dict.fromkeys(shift) if s in produced and s not in cut]
    rename = {**{c: f"{c}__cut" for c in cut}, **{s: f"{s}__pre" for s in shift}}
    for n in g.node:
        for i, o in enumerate(n.output):
            if o in rename:
                n.output[i] = rename[o]
    dbl = onnx.TensorProto.DOUBLE
    g.input.extend(helper.make_tensor_value_info(c, dbl, None) for c in cut)
    for s in shift:
        g.input.append(helper.make_tensor_value_info(f"{s}__delta", dbl, None))
        g.node.append(helper.make_node("Add", [f"{s}__pre", f"{s}__delta"], [s]))
    inits = [t for t in g.initializer if t.name in free]
    keep = [t for t in g.initializer if t.name not in free]
    del g.initializer[:]
    g.initializer.extend(keep)
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in inits)
    # each Add goes right after the producer of its x_pre (the nodes stay in topological order)
    if shift:
        adds = {n.input[0]: n for n in g.node[len(g.node) - len(shift):]}
        out = []
        for n in g.node[:len(g.node) - len(shift)]:
            out.append(n)
            out.extend(adds[o] for o in n.output if o in adds)
        del g.node[:]
        g.node.extend(out)
    return m


# ---- the finite-difference comparison

@dataclass
class _Tally:
    probes: int = 0
    skipped: int = 0
    connected: int = 0  # xs with a gradient that is not None
    worst: str = ""
    wrong: list = field(default_factory=list)


def _compare(f, feeds, key, x0, grad, rng, tally, label, rtol=RTOL, atol=ATOL, scale=None):
    """Compare ``grad`` (the analytic gradient of f at feeds[key] = x0) with central differences,
    skipping probes at kinks (one-sided differences disagree) and jumps (central differences
    change with the step). ``scale``: the values the step is added to where they are not x0
    (an intermediate x is fed as x_pre + a zero delta: the step must suit x_pre's magnitude,
    or x_pre + step rounds it away; seed 4801 found a 1e-6 step on 5.9e8)."""
    if grad is not None and grad.shape != x0.shape:
        tally.wrong.append(f"{label}: gradient shape {grad.shape}, x shape {x0.shape}")
        return
    g = np.zeros(x0.shape) if grad is None else np.asarray(grad, np.float64)
    tally.connected += grad is not None
    if x0.size == 0:
        return
    if x0.size <= MAX_UNIT:
        probes = [np.eye(x0.size)[i].reshape(x0.shape) for i in range(x0.size)]
    else:
        probes = [d / np.linalg.norm(d) for d in
                  (rng.standard_normal(x0.shape) for _ in range(DIRECTIONS))]
    f0, mag = f({**feeds, key: x0})

    def slopes(h, d):
        fp = f({**feeds, key: np.asarray(x0 + h * d)})[0]
        fm = f({**feeds, key: np.asarray(x0 - h * d)})[0]
        return (fp - f0) / h, (f0 - fm) / h, (fp - fm) / (2 * h)

    for d in probes:
        tally.probes += 1
        # the step grows as sqrt(|x|): rounding x + h stays far below h, and the truncation
        # error stays small for ops that only see differences of large values (Softmax)
        at = x0 if scale is None else np.broadcast_to(np.asarray(scale, np.float64), x0.shape)
        size = np.abs(at[(d != 0) & np.isfinite(at)])
        eps = EPS * np.sqrt(max(1.0, float(np.max(size, initial=0.0))))
        fwd, bwd, num = slopes(eps, d)
        ana = float(np.sum(g * d))
        # float64 round-off of f (relative to its terms' magnitude) over the step, and the
        # truncation of central differences, stay far below this
        tol = atol * (1 + mag) + rtol * max(abs(num), abs(ana))
        if not (np.isfinite(fwd) and np.isfinite(bwd)):
            tally.skipped += 1  # the step leaves the op's domain
            continue
        if abs(fwd - bwd) > tol:  # curved, or a kink: a kink does not shrink with the step
            fwd8, bwd8, _ = slopes(eps / 8, d)
            if abs(fwd8 - bwd8) > abs(fwd - bwd) / 4:
                tally.skipped += 1
                continue
        if np.isfinite(ana) and abs(num - ana) <= tol:
            continue
        if abs(slopes(eps / 8, d)[2] - num) > tol:  # a jump within the step
            tally.skipped += 1
            continue
        where = np.unravel_index(int(np.argmax(np.abs(d))), x0.shape) if x0.size <= MAX_UNIT \
            else "direction"
        tally.wrong.append(f"{label} at {where}: analytic {ana:.6g}"
                           f"{' (gradient None)' if grad is None else ''}, "
                           f"finite differences {num:.6g}")


# ---- one gradients() call, checked

def _call_gradients(model, call, stage):
    import onnxgrad
    before = model.SerializeToString()
    try:
        return onnxgrad.gradients(model, **call)
    except NotImplementedError as e:  # NotDifferentiableError, or a rule refusing a case
        fail = _Fail("refused", _short(e), stage)
        if isinstance(e, onnxgrad.NotDifferentiableError):
            fail.outcome.refused_op = (e.domain, e.op_type, e.opset)
        raise fail from e
    except Exception as e:  # noqa: BLE001
        raise _Fail("crash", _short(e) + "\n" + "".join(traceback.format_exc(limit=-3)),
                    stage) from e
    finally:  # a result or a refusal alike: the model given stays as it was
        if model.SerializeToString() != before:
            raise _Fail("crash", "gradients() changed the model it was given", stage)  # noqa: B012


def _valid(model, stage, level="all", fallback=False):
    """The checker passes ``model``, and onnxruntime loads it (or, with ``fallback``, onnxruntime
    or onnx.reference): its runner."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # noqa: BLE001
        raise _Fail("invalid-model", "checker: " + _short(e), stage) from e
    try:
        return _Runner(model, level, fallback=fallback)
    except Exception as e:  # noqa: BLE001
        raise _Fail("invalid-model", "onnxruntime refuses it: " + _short(e), stage) from e


def _run(runner, feeds, outputs, stage):
    try:
        return runner(feeds, outputs)
    except _Fail:
        raise
    except Exception as e:  # noqa: BLE001
        raise _Fail("invalid-model", "onnxruntime fails running it: " + _short(e), stage) from e


@dataclass
class _Call:
    """One gradients() call to check: its forward model (float64 and native), arguments, and the
    inputs at each batch size (without the cotangents, which this makes)."""
    f64: onnx.ModelProto
    native: onnx.ModelProto
    call: dict
    feeds: dict  # size -> {name: float64 array}
    grad_ys: list  # per y: None, ("new", name) or ("existing", name)
    dtype: np.dtype
    stage: str
    seed: int = 0

    @property
    def native_stage(self):
        return f"{self.stage}-native"


def _check(c: _Call, tally: _Tally):
    """Check one call; returns (res64, res_native, cotangents by size) for a second-order call."""
    ys, xs = c.call["ys"], c.call["xs"]
    stops = c.call.get("stop_gradients") or []
    res64 = _call_gradients(c.f64, c.call, c.stage)
    if c.call["unconnected_gradients"] == "zero" and None in res64.grads:
        raise _Fail("wrong", "unconnected_gradients='zero' gave None", c.stage)
    grun = _valid(res64.model, c.stage, "basic", fallback=True)
    produced = _produced(c.f64)
    cut = [s for s in stops if s in produced]  # stop_gradients that nodes make: fed instead
    shifted = [x for x in xs if x in produced and x not in stops]  # x = x_pre + x__delta
    inits = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64)
             for t in c.f64.graph.initializer}
    oracle = _Runner(_oracle(c.f64, cut, shifted, [x for x in xs if x in inits]))
    exposed = list(dict.fromkeys(list(ys) + cut + shifted))
    forward = _Runner(_expose(c.f64, exposed))
    want = [g for g in res64.grads if g is not None]
    native, cots_by_size = None, {}
    for size, feeds in c.feeds.items():
        base = {**feeds, **_existing_cotangents(c, size)}
        vals = dict(zip(exposed, forward(base, exposed)))
        if not all(np.all(np.isfinite(vals[y])) for y in ys):
            raise _Fail("skipped-domain", "the forward is not finite here", c.stage)
        cots, weights = _cotangents(c, base, vals, size)
        cots_by_size[size] = {**cots, **{k: base[k] for k in base if k not in feeds}}
        full = {**base, **cots}
        got = dict(zip(want, _run(grun, full, want, c.stage)))
        ofeeds = {**base, **{s: vals[s] for s in cut},
                  **{f"{x}__delta": np.zeros(np.shape(vals[x])) for x in shifted},
                  **{x: inits[x] for x in xs if x in inits}}

        def f(fd, _w=weights):
            """sum(y * cotangent) on the oracle, and the magnitude of its terms."""
            terms = [np.asarray(o, np.float64) * w for o, w in zip(oracle(fd, list(ys)), _w)]
            return (float(sum(np.sum(t) for t in terms)),
                    float(sum(np.sum(np.abs(t)) for t in terms)))

        def compare(grads, into, **tol):
            rng = np.random.default_rng(c.seed + 7 * size)
            for x, gname in dict.fromkeys(zip(xs, res64.grads)):
                key = f"{x}__delta" if x in shifted else x
                _compare(f, ofeeds, key, np.asarray(ofeeds[key], np.float64),
                         None if gname is None else grads[gname], rng, into,
                         f"{c.stage} d/d{x}" + (f" (N={size})" if len(c.feeds) > 1 else ""),
                         scale=vals[x] if x in shifted else None, **tol)

        compare(got, tally)
        if native is None:  # the same call on the model in its own dtype, at ORT_ENABLE_ALL
            res_n = res64 if c.native is c.f64 else \
                _call_gradients(c.native, c.call, c.native_stage)
            if [g is None for g in res_n.grads] != [g is None for g in res64.grads]:
                raise _Fail("wrong", f"{c.dtype.name} call: which gradients are None differs "
                            "from the float64 call", c.native_stage)
            native = (res_n, _valid(res_n.model, c.native_stage, "all"))
        if tally.wrong and grun.sess is None:
            # the float64 gradient ran on onnx.reference: where onnxruntime's own gradient
            # agrees with the differences (to its dtype's accuracy), the reference is what errs
            names = [g for g in native[0].grads if g is not None]
            outs = _run(native[1], full, names, c.native_stage)
            by64 = dict(zip(want, (np.asarray(o, np.float64) for o in outs)))
            again = _Tally()
            compare(by64, again, rtol=1e-2, atol=1e-4)
            if not again.wrong:
                raise _Fail("skipped-oracle", "onnx.reference runs the float64 gradient "
                            "differently from onnxruntime's " + c.dtype.name + ", which agrees "
                            "with the differences: " + "; ".join(tally.wrong[:2]), c.stage)
        if tally.wrong and all(" analytic nan" in w or "analytic inf" in w
                               or "analytic -inf" in w for w in tally.wrong) \
                and not _finite_inside(c.f64, base):
            raise _Fail("skipped-domain", "a value inside the forward is not finite here "
                        "(log 0, x / 0): the chain rule meets 0 * inf there, as in any "
                        "framework", c.stage)
        if tally.wrong:
            raise _Fail("wrong", "; ".join(tally.wrong[:3]), c.stage)
        _compare_native(c, native, res64, got, full, grun, tally)
    return res64, native[0], cots_by_size


def _finite_inside(model, feeds) -> bool:
    """Whether every tensor the top graph's nodes make is finite at ``feeds``."""
    names = sorted(_produced(model))
    for v in _Runner(_expose(model, names))(feeds, names):
        try:
            if not np.all(np.isfinite(np.asarray(v, np.float64))):
                return False
        except (TypeError, ValueError):  # a sequence or an optional: not judged here
            continue
    return True


def _existing_cotangents(c: _Call, size: int) -> dict:
    """Values for grad_ys given as existing graph inputs (declared with y's shape)."""
    declared = {i.name: i for i in c.f64.graph.input}
    out = {}
    for g in c.grad_ys:
        if g is not None and g[0] == "existing":
            dims = [size if d.dim_param == "N" else d.dim_value
                    for d in declared[g[1]].type.tensor_type.shape.dim]
            out[g[1]] = np.random.default_rng(c.seed + size).standard_normal(dims)
    return out


def _cotangents(c: _Call, base: dict, vals: dict, size: int):
    """The new grad_ys inputs' values, and each y's weight in f = sum(y * weight)."""
    rng = np.random.default_rng(c.seed + 1000 * size)
    cots, weights = {}, []
    for y, g in zip(c.call["ys"], c.grad_ys):
        if g is None:
            weights.append(np.ones(np.shape(vals[y])))
        elif g[0] == "existing":
            weights.append(base[g[1]])
        else:
            cots[g[1]] = rng.standard_normal(np.shape(vals[y])).astype(vals[y].dtype)
            weights.append(cots[g[1]])
    return cots, weights


def _compare_native(c: _Call, native, res64, got, full, grun, tally):
    """The call on the model in its own dtype gives the same numbers at ORT_ENABLE_ALL as with
    onnxruntime's graph optimizations off (they must keep what the gradient graph means), and
    it is built like the float64 call, else its numbers must match the float64 ones. (float32
    and float64 numbers of the same graph may differ legitimately: a saturated Tanh's 1 - y^2
    is 0 in float32 and 8e-12 in float64, times a large incoming gradient.)"""
    res_n, nrun = native
    names = [g for g in res_n.grads if g is not None]
    outs = _run(nrun, full, names, c.native_stage)
    plain = _run(_Runner(res_n.model, "none", fallback=False), full, names, c.native_stage)
    same = c.native is c.f64 or _structure(res_n.model) == _structure(res64.model)
    want = [g for g in res64.grads if g is not None]
    for x, gname, out, base in zip([x for x, g in zip(c.call["xs"], res64.grads) if g], want,
                                   outs, plain):
        ref, out = got[gname], np.asarray(out, np.float64)
        if out.shape != ref.shape:
            raise _Fail("wrong", f"{c.dtype.name} d/d{x}: shape {out.shape}, float64 gives "
                        f"{ref.shape}", c.native_stage)
        checks = [("without graph optimizations", base, 1e-3)]
        if not same:
            checks.append(("in float64", ref, NATIVE_RTOL[c.dtype]))
        for what, expected, rtol in checks:
            expected = np.asarray(expected, np.float64)
            scale = float(np.max(np.abs(expected))) if expected.size else 0.0
            if np.all(np.abs(out - expected) <= rtol * (scale + np.abs(expected)) + 1e-6):
                continue
            if _near_tie(grun, full, want, got, c):
                tally.skipped += 1
                break
            err = float(np.max(np.abs(out - expected)))
            raise _Fail("wrong", f"{c.dtype.name} d/d{x} at ORT_ENABLE_ALL is off its value "
                        f"{what} by {err:.3g} (scale {scale:.3g})", c.native_stage)


def _structure(model):
    """The nodes of a model as (op, inputs, outputs, attribute names): what a dtype changes
    (constant values, Cast targets) left out."""
    return [(n.op_type, tuple(n.input), tuple(n.output), tuple(a.name for a in n.attribute))
            for n in model.graph.node]


def _near_tie(grun, feeds, want, got, c: _Call):
    """Whether the float64 gradient jumps under relative input perturbations of 1e-4: a tie
    or kink that float32 rounding may resolve either way."""
    rng = np.random.default_rng(c.seed + 99)
    for sign in (1, -1):
        fd = {k: (v * (1 + sign * 1e-4 * rng.uniform(0.5, 1, v.shape)) if v.dtype.kind == "f"
                  else v) for k, v in feeds.items()}
        for name, out in zip(want, grun(fd, want)):
            ref = got[name]
            scale = float(np.max(np.abs(ref))) if ref.size else 0.0
            if np.any(np.abs(np.asarray(out) - ref) > 1e-2 * (1 + scale)):
                return True
    return False


def evaluate(p: Problem, localise: bool = True) -> Outcome:
    """The verdict on one Problem."""
    tally = _Tally()
    try:
        out = _evaluate(p, tally)
    except _Fail as f:
        out = f.outcome
    out.probes, out.skipped, out.connected = tally.probes, tally.skipped, tally.connected
    if out.verdict == "ok" and tally.skipped:
        out.verdict = "skipped-tie"
    if localise and out.verdict in ("wrong", "crash", "invalid-model", "refused"):
        out.where = blame(p, out)
    return out


def _evaluate(p: Problem, tally: _Tally) -> Outcome:
    native = p.model(p.dtype)
    f64 = native if p.dtype == np.float64 else p.model(np.float64)
    feeds = {n: p.feeds(n) for n in p.sizes}
    try:  # the generated model itself: valid, and runs at ORT_ENABLE_ALL
        onnx.checker.check_model(native, full_check=True)
        onnx.checker.check_model(f64, full_check=True)
        run = _Runner(native, "all", fallback=False)
        for n in feeds:
            run(p.feeds(n, placeholders=True), list(p.ys))
    except Exception as e:  # noqa: BLE001
        return Outcome("gen-invalid", _short(e), "generate")
    if f64 is not native:  # the oracle's copy: a case's fixed-dtype input may not mix in float64
        try:             # (a float32 Attention mask against float64 scores: onnxruntime's body)
            run = _Runner(f64)
            for n in feeds:
                run(p.feeds(n, placeholders=True), list(p.ys))
        except _Fail as f:
            return f.outcome
        except Exception as e:  # noqa: BLE001
            return Outcome("skipped-oracle", f"the float64 model does not run: {_short(e)}",
                           "generate")
    call = p.call()
    first = _Call(f64, native, call, feeds, p.grad_ys, p.dtype, "first", seed=len(p.nodes))
    res64, res_n, cots = _check(first, tally)
    grads = [g for g in res64.grads if g is not None]
    if p.second and grads:
        ys2 = list(dict.fromkeys(grads[i % len(grads)] for i in p.second))
        call2 = dict(ys=ys2, xs=list(p.xs), grad_ys=[f"d2y{i}" for i in range(len(ys2))],
                     stop_gradients=None, unconnected_gradients=p.unconnected,
                     name=p.name,
                     aggregation_method=p.aggregation)
        feeds2 = {n: {**feeds[n], **cots[n]} for n in feeds}
        second = _Call(res64.model, res_n.model if p.dtype != np.float64 else res64.model,
                       call2, feeds2, [("new", g) for g in call2["grad_ys"]], p.dtype,
                       "second", seed=len(p.nodes) + 1)
        _check(second, tally)
    return Outcome("ok", stage="all")


# ---- naming the failing node

def unit_problem(p: Problem, unit: fuzz_graphs.Unit, values: dict, second: bool) -> Problem:
    """``unit`` alone, its inputs fed the values they have in ``p``'s graph."""
    nodes = [n for n in p.nodes if n.name in unit.nodes]
    inputs, vals, inits, xs = {}, {}, {}, []
    for name in dict.fromkeys(unit.inputs):
        if name in p.inits:
            inits[name] = p.inits[name]
            if name not in unit.held and p.inits[name][1]:
                xs.append(name)
            continue
        v = np.asarray(values[name])
        own = name in p.floats
        shape = p.inputs[name][0] if name in p.inputs else list(v.shape)  # as declared there
        inputs[name] = (shape, None if own else v.dtype)
        vals[name] = functools.partial(_fixed, v.astype(np.float64) if own else v)
        if own and name not in unit.held:
            xs.append(name)
    made = [o for n in nodes for o in n.output if o]
    # outputs the float64 oracle computes in float64 (not LayerNormalization's float32 Mean)
    ys = [o for o in made
          if isinstance(values.get(o), np.ndarray) and values[o].dtype == np.float64]
    outputs = {y: (list(np.shape(values[y])), None if y in p.floats else values[y].dtype)
               for y in ys}
    return Problem(opset=p.opset, nodes=nodes, inputs=inputs, inits=inits, outputs=outputs,
                   values=vals, ys=ys, xs=xs, grad_ys=[("new", f"dy{i}") for i in range(len(ys))],
                   second=(0, 1) if second else (), dtype=p.dtype, units=[unit],
                   floats=(set(p.floats) & (set(made) | set(inputs)))
                   | {n for n, (_, follows) in inits.items() if follows})


def _fixed(v, n):
    return v


def blame(p: Problem, out: Outcome) -> str:
    """The first unit (a case's nodes, or a glue node) that fails alone, or "engine"."""
    m64 = p.model(np.float64, functions=False)  # the units name the graph's own nodes
    names = [o for n in p.nodes for o in n.output if o]
    feeds = p.feeds(fuzz_graphs.BATCH_SIZES[0], placeholders=True)
    try:
        values = dict(zip(names, _Runner(_expose(m64, names))(feeds, names)))
    except Exception as e:  # noqa: BLE001
        return f"engine (the forward does not run: {_short(e)})"
    values.update(feeds)
    for unit in p.units:
        q = unit_problem(p, unit, values, second=out.stage == "second")
        if not q.ys or not q.xs:
            continue
        alone = evaluate(q, localise=False)
        if alone.verdict in ("wrong", "crash", "invalid-model", "refused"):
            return f"{unit.label}: alone {alone.verdict} at {alone.stage}: {alone.detail}"
    return "engine (every node passes alone)"


# ---- repro text and shrinking

def repro(p: Problem, out: Outcome | None = None) -> str:
    """A printable repro: the verdict, the graph and the call."""
    lines = []
    if out is not None:
        first = out.detail.splitlines()[0] if out.detail else ""
        lines.append(f"verdict: {out.verdict} ({out.stage}): {first}")
        if out.where:
            lines.append(f"node: {out.where}")
    lines.append(onnx.printer.to_text(p.model(p.dtype)))
    call = ", ".join(f"{k}={v!r}" for k, v in p.call().items())
    lines.append(f"onnxgrad.gradients(model, {call})")
    if p.second:
        lines.append(f"then a second-order call on gradients picked by {p.second}")
    if p.batched:
        lines.append(f"N fed at {fuzz_graphs.BATCH_SIZES}")
    return "\n".join(lines)


def shrink(spec, out: Outcome, budget: int = 60):
    """A smaller Spec that fails the same way (same verdict, stage and blamed op); greedy."""
    key = out.key()

    def same(s):
        try:
            o = evaluate(fuzz_graphs.build(s))
        except Exception:  # noqa: BLE001
            return None
        return o if o.key() == key else None

    def candidates(s):
        for i in range(len(s.steps)):
            yield replace(s, steps=s.steps[:i] + s.steps[i + 1:])
        for field_, small in (("second", ()), ("stops", ()), ("grad_ys", ()),
                              ("unconnected", False), ("batch", False), ("symbolic", False),
                              ("value_info", False),
                              ("scope", 0), ("aggregation", 0)):
            if getattr(s, field_) != small:
                yield replace(s, **{field_: small})
        for name in ("xs", "ys"):
            seq = getattr(s, name)
            if len(seq) > 1:
                for i in range(len(seq)):
                    yield replace(s, **{name: seq[:i] + seq[i + 1:]})
        for i in range(len(s.inputs)):
            if len(s.inputs) > 1:
                yield replace(s, inputs=s.inputs[:i] + s.inputs[i + 1:])

    best = out
    progress = True
    while progress and budget > 0:
        progress = False
        for cand in candidates(spec):
            budget -= 1
            o = same(cand)
            if o is not None:
                spec, best, progress = cand, o, True
                break
            if budget <= 0:
                break
    return spec, best
