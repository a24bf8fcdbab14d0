"""Random valid ONNX graphs for the gradient fuzzer (bench/fuzz.py, tests/test_fuzz.py).

A :class:`Spec` is a small record of integers (what hypothesis draws and shrinks); :func:`build`
turns any Spec into a valid model, so a shrunk Spec is still a graph. Its pieces are the cases of
bench/fuzz_cases.py (backend node test cases and hand-written fragments), composed with glue (elementwise ops, broadcasting, MatMul, reshapes, reductions,
Split, Concat, fan-out) that feeds a case's input from earlier tensors as
``C + 0.1 * C * squash(adapt(t))``: the case's own values, moved a little by everything upstream,
so each op stays inside its domain.

The result is a :class:`Problem`: the model in float32 and float64 (same names), the inputs to feed
(a symbolic batch dimension ``N`` at two sizes), and the gradients() call to check (ys, xs,
grad_ys, stop_gradients, unconnected_gradients, scope name, aggregation, a second-order call).
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, os.path.dirname(__file__))
from fuzz_cases import Case, Catalogue, Flags, fits, quiet_session  # noqa: E402

OPSETS = (26, 24, 22, 21, 18)  # model opsets (onnxruntime 1.31 loads up to 26); 0 = the newest
SCOPES = ("gradients", "train/grads", "a/b/c")
AGGREGATIONS = (None, "tree", "accumulate_n")
BATCH_SIZES = (2, 3)  # a symbolic batch dimension is fed at both
JITTER = 0.01  # case values are scaled by 1 + JITTER * U(-1, 1): breaks their exact ties
SQUASH = ("Tanh", "Sin")
UNARY = ("Tanh", "Sigmoid", "Sin", "Neg", "Cos", "Relu", "Abs")  # all have float64 kernels

# ops onnx.reference computes wrongly for inputs the backend cases do not hold (those agree with
# onnxruntime), so a case holding them never relies on it as the float64 oracle
REFERENCE_WRONG = {
    "LpNormalization": "p=1 divides by sum(x), not sum(|x|) (onnx 1.23), wrong for mixed signs",
}


@functools.lru_cache(maxsize=1)
def catalogue() -> Catalogue:
    return Catalogue(probe)


def drawn_ops(cat: Catalogue | None = None) -> dict:
    """op -> (case name, opset) of a case holding it that a graph can draw (probing each op's
    cases until one fits)."""
    cat = cat or catalogue()
    out = {}
    for opset in OPSETS:
        for op in cat.ops(opset):
            for c in cat.cases(op, opset):
                if c.ops <= set(out):
                    continue
                f = cat.flags(c, opset)
                if fits(f, [], np.float32) or fits(f, [], np.float64):
                    out.update({o: (c.name, opset) for o in c.ops if o not in out})
    return out


def problem_of(case: Case, opset: int, dtype=np.float32, symbolic=False) -> Problem:
    """The case alone: its inputs are graph inputs (with ``symbolic``, of symbolic shapes) and
    the xs, its float outputs the ys."""
    b = _Builder(Spec(symbolic=symbolic), dtype=dtype)
    b.opset = opset
    b.add_case(case, [1] * 8)
    b.ys = [n for n, _ in b.made]
    p = b.problem()
    p.xs = [n for n in b.inputs if n.startswith("i")]
    return p


def probe(case: Case, opset: int) -> Flags:
    """Run the case alone, its inputs as graph inputs, in both dtypes (see :class:`Flags`)."""
    from onnxgrad.runtime import runner
    p = problem_of(case, opset)
    feeds = p.feeds(BATCH_SIZES[0])
    shapes = [list(p.shapes[y]) for y in p.ys]
    why = []

    def ort(dtype):
        model = p.model(dtype)
        fd = {k: v.astype(dtype) for k, v in feeds.items()}
        try:
            onnx.checker.check_model(model, full_check=True)
            s = quiet_session(model)
            first, again = s.run(None, fd), s.run(None, fd)
        except Exception as e:  # noqa: BLE001  (a probe reports)
            why.append(f"{np.dtype(dtype).name}: {type(e).__name__}: {str(e)[:200]}")
            return None
        if not all(np.array_equal(a, b, equal_nan=True) for a, b in zip(first, again)):
            why.append("not deterministic (a random op: finite differences cannot judge it)")
            return None
        if [list(np.shape(a)) for a in first] != shapes:
            why.append(f"{np.dtype(dtype).name}: output shapes {[np.shape(a) for a in first]}, "
                       f"the case's {shapes} (the op means something else at opset {opset})")
            return None
        inferred = _inferred_dims(model, p.ys) if case.op in _POOLS else []
        if any(d is not None and (len(d) != len(s) or any(a not in (None, b) for a, b in zip(d, s)))
               for d, s in zip(inferred, shapes)):
            # a ceil_mode MaxPool before opset 22: onnx keeps a last window that starts past the
            # input, the runtimes drop it, and a graph that feeds the output on into a broadcast
            # fails onnx's checker ("gen-invalid"; onnxgrad's handling of such pools has its own
            # test: tests/test_fuzz_regressions.py). STFT's onnx dims are off too (onesided), but
            # its outputs met no such broadcast in fuzzer seeds 36 to 41: it stays drawn
            why.append(f"onnx infers output shapes {inferred} at opset {opset}, the runtimes "
                       f"make {shapes}")
            return None
        return first

    y32, y64 = ort(np.float32), ort(np.float64)
    ref64 = False
    wrong = [n.op_type for n in case.nodes if n.op_type in REFERENCE_WRONG]
    if wrong:
        why.append(f"onnx.reference: {REFERENCE_WRONG[wrong[0]]}")
    elif y32 is not None:
        try:
            m64 = p.model(np.float64)
            onnx.checker.check_model(m64, full_check=True)  # RotaryEmbedding has no float64
            got = runner(m64, "reference")(feeds)
            ref64 = all(np.asarray(g).dtype == np.float64 and np.allclose(
                g, a, rtol=1e-3, atol=1e-3 * (1 + float(np.max(np.abs(a), initial=0))),
                equal_nan=True) for g, a in zip(got, y32))
            if not ref64:
                why.append("onnx.reference's float64 result is not float64, or disagrees")
        except Exception as e:  # noqa: BLE001
            why.append(f"reference float64: {type(e).__name__}: {str(e)[:200]}")
    return Flags(y32 is not None, y64 is not None, ref64, "; ".join(why))


_POOLS = ("MaxPool", "AveragePool", "LpPool")


def _inferred_dims(model, names):
    """onnx's inferred static dims (None where symbolic or unknown) of ``names``."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for o in m.graph.output:
        o.type.tensor_type.ClearField("shape")
    g = onnx.shape_inference.infer_shapes(m).graph
    by = {v.name: v for v in [*g.output, *g.value_info]}
    out = []
    for n in names:
        t = by[n].type.tensor_type if n in by else None
        out.append(None if t is None or not t.HasField("shape") else
                   [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim])
    return out


@dataclass(frozen=True)
class Spec:
    """What one fuzzed graph is made of; every field is interpreted modulo what is available, so
    any Spec (a shrunk one in particular) builds a valid graph."""
    opset: int = 0  # index into OPSETS
    dtype: int = 0  # 0 float32, 1 float64
    batch: bool = False  # the first input has a symbolic batch dim N, fed at two sizes
    symbolic: bool = False  # every other input dim is declared symbolic too
    value_info: bool = False  # the model carries onnx's inferred value_info (as exports do)
    inputs: tuple = ((2, (3, 2, 2)),)  # (rank, dims) per free graph input
    steps: tuple = ()  # (kind, args): kind 0 a case, 1 glue; args are 8 ints
    ys: tuple = (0,)  # picks among the tensors the steps made (0 = the last one)
    xs: tuple = (0,)  # picks among inputs, initializers and made tensors
    stops: tuple = ()  # picks among made tensors and inputs
    grad_ys: tuple = ()  # per y: 0 ones, 1 a new input name, 2 an existing graph input
    unconnected: bool = False  # "zero" (and an unused input to ask about)
    scope: int = 0  # index into SCOPES
    aggregation: int = 0  # index into AGGREGATIONS
    second: tuple = ()  # picks among the first call's gradients: a second-order call on them
    seed: int = 0
    function: int = 0  # one time in three, a run of nodes becomes a model function (see _as_function)


def specs(max_steps: int = 5, max_inputs: int = 3, **fixed):
    """The hypothesis strategy for Specs (``fixed``: Spec fields held at these values)."""
    from hypothesis import strategies as st
    big = st.integers(0, 2**20)
    args = st.tuples(*[big] * 8)
    fields = dict(
        opset=st.integers(0, len(OPSETS) - 1), dtype=st.integers(0, 1),
        batch=st.booleans(), symbolic=st.booleans(), value_info=st.booleans(),
        inputs=st.lists(st.tuples(st.integers(0, 3), st.tuples(*[st.integers(1, 4)] * 3)),
                        min_size=1, max_size=max_inputs).map(tuple),
        steps=st.lists(st.tuples(st.integers(0, 1), args), min_size=1,
                       max_size=max_steps).map(tuple),
        ys=st.lists(big, min_size=1, max_size=3).map(tuple),
        xs=st.lists(big, min_size=1, max_size=4).map(tuple),
        stops=st.lists(big, max_size=2).map(tuple),
        grad_ys=st.lists(st.integers(0, 2), max_size=3).map(tuple),
        unconnected=st.booleans(), scope=st.integers(0, len(SCOPES) - 1),
        aggregation=st.integers(0, len(AGGREGATIONS) - 1),
        second=st.lists(big, max_size=2).map(tuple), seed=st.integers(0, 2**16),
        function=big)
    fields.update({k: st.just(v) for k, v in fixed.items()})
    return st.builds(Spec, **fields)


@dataclass
class Unit:
    """What node-by-node localisation checks alone: a case's nodes, or one glue node."""
    label: str  # "Op (case name)" or "Op (glue)"
    nodes: list  # node names
    inputs: list  # tensor names it reads (outer-scope reads of bodies included)
    held: set  # of those, the ones held constant


@dataclass
class Problem:
    """A model (in either float dtype: same graph, same names) and the gradients() call to check.

    Floats that take the graph's dtype are stored in float64 and cast when the model is made.
    ``grad_ys`` entries are None (ones), ("new", name) or ("existing", name): a graph input that
    only carries the cotangent."""
    opset: int
    nodes: list
    inputs: dict  # name -> (declared shape with "N"/dim_param strings, dtype or None = graph's)
    inits: dict  # name -> (array, takes the graph's dtype)
    outputs: dict  # name -> (declared shape, dtype or None = graph's)
    values: dict  # graph input name -> fn(N) -> float64 array
    ys: list
    xs: list
    grad_ys: list
    stops: list = field(default_factory=list)
    unconnected: str = "none"
    name: str = "gradients"
    aggregation: str | None = None
    second: tuple = ()
    batched: bool = False
    value_info: bool = False
    dtype: np.dtype = np.dtype(np.float32)
    units: list = field(default_factory=list)
    floats: set = field(default_factory=set)  # tensors of the graph's float dtype
    shapes: dict = field(default_factory=dict)  # made tensor -> its shape ("N": the batch)
    function: int = 0  # Spec.function

    @property
    def sizes(self):
        return BATCH_SIZES if self.batched else BATCH_SIZES[:1]

    def feeds(self, n: int, placeholders: bool = False) -> dict:
        """The inputs at batch size n (with ``placeholders``, zeros for grad_ys given as
        existing graph inputs, which the checker otherwise feeds)."""
        out = {k: f(n) for k, f in self.values.items()}
        if placeholders:
            out.update({g[1]: np.zeros([n if d == "N" else d for d in self.inputs[g[1]][0]])
                        for g in self.grad_ys if g and g[0] == "existing"})
        return out

    def call(self) -> dict:
        """gradients() keyword arguments (besides the model)."""
        return dict(ys=list(self.ys), xs=list(self.xs),
                    grad_ys=[g if g is None else g[1] for g in self.grad_ys],
                    stop_gradients=list(self.stops) or None,
                    unconnected_gradients=self.unconnected, name=self.name,
                    aggregation_method=self.aggregation)

    def model(self, dtype=None, functions: bool = True) -> onnx.ModelProto:
        """The model in ``dtype``; ``functions``: with the run of nodes that ``function`` picks
        as a model function (False: every node in the graph, as the units name them)."""
        dtype = np.dtype(dtype or self.dtype)
        elem = helper.np_dtype_to_tensor_dtype(dtype)

        def vi(name, shape, dt):
            e = elem if dt is None else helper.np_dtype_to_tensor_dtype(np.dtype(dt))
            return helper.make_tensor_value_info(name, e, shape)

        nodes, fns = [_retyped(n, elem) for n in self.nodes], []
        if functions and self.function % 3 == 1:
            nodes, fns = _as_function(nodes, self.function // 3, self.opset,
                                      set(self.xs) | set(self.stops), set(self.outputs))
        g = helper.make_graph(
            nodes, "fuzz",
            [vi(n, s, d) for n, (s, d) in self.inputs.items()],
            [vi(n, s, d) for n, (s, d) in self.outputs.items()],
            [numpy_helper.from_array(a.astype(dtype) if f else a, n)
             for n, (a, f) in self.inits.items()])
        ops = [helper.make_opsetid("", self.opset)]
        from onnxgrad.runtime import MAX_IR_VERSION
        ir = min(helper.find_min_ir_version_for(ops), MAX_IR_VERSION)
        if fns:
            ops.append(helper.make_opsetid(FUNCTION_DOMAIN, 1))
        m = helper.make_model(g, opset_imports=ops, ir_version=ir, producer_name="fuzz",
                              functions=fns)
        return onnx.shape_inference.infer_shapes(m) if self.value_info else m


FUNCTION_DOMAIN = "fuzz.fn"


def _as_function(nodes, pick, opset, avoid, outputs):
    """``nodes`` with one run of them moved into a model function, called once in their place
    (``pick`` chooses the run): what exporters of modules as functions write. Nodes with
    subgraphs (their bodies read the outer scope) stay out, and so do nodes making a tensor of
    ``avoid`` (xs and stop_gradients: the oracle cuts the graph at them)."""
    ok = [n.domain in ("", "ai.onnx") and not set(n.output) & avoid and
          not any(a.HasField("g") or a.graphs for a in n.attribute) for n in nodes]
    runs, i = [], 0
    while i < len(nodes):
        j = i
        while j < len(nodes) and ok[j]:
            j += 1
        if j > i:
            runs.append((i, j))
        i = j + 1
    if not runs:
        return nodes, []
    i, j = runs[pick % len(runs)]
    pick //= len(runs)
    start = i + pick % (j - i)
    end = start + 1 + pick // (j - i) % (j - start)
    body = nodes[start:end]
    made = {o for n in body for o in n.output if o}
    later = set(outputs)
    for n in nodes[end:]:
        later.update(_names_read(n))
    ins = list(dict.fromkeys(x for n in body for x in n.input if x and x not in made))
    outs = [o for n in body for o in n.output if o in later]
    if not outs:
        return nodes, []
    f = helper.make_function(FUNCTION_DOMAIN, "Block", ins, outs, body,
                             [helper.make_opsetid("", opset)])
    call = helper.make_node("Block", ins, outs, name="Block_call", domain=FUNCTION_DOMAIN)
    return [*nodes[:start], call, *nodes[end:]], [f]


def _names_read(node):
    """Every name ``node`` reads, in its subgraphs too (a superset of its outer-scope reads)."""
    out = set(node.input)
    for a in node.attribute:
        for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            for n in g.node:
                out |= _names_read(n)
    return out


def _retyped(node, elem):
    """``node`` for a model of float type ``elem``: FLOAT in bodies (types, constants) and in
    dtype/to attributes becomes ``elem`` (for float32, ``node`` itself)."""
    if elem == onnx.TensorProto.FLOAT or not any(
            a.HasField("g") or a.graphs or a.name in ("dtype", "to") for a in node.attribute):
        return node
    n = onnx.NodeProto()
    n.CopyFrom(node)
    _retype_node(n, elem)
    return n


def _retype_node(n, elem):
    for a in n.attribute:
        if a.name in ("dtype", "to") and a.type == onnx.AttributeProto.INT and \
                a.i == onnx.TensorProto.FLOAT:
            a.i = elem
        elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == onnx.TensorProto.FLOAT \
                and n.op_type == "Constant":
            arr = numpy_helper.to_array(a.t).astype(helper.tensor_dtype_to_np_dtype(elem))
            a.t.CopyFrom(numpy_helper.from_array(arr, a.t.name))
        for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            _retype_graph(g, elem)


def _retype_graph(g, elem):
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = elem
    for i, t in enumerate(g.initializer):
        if t.data_type == onnx.TensorProto.FLOAT:
            arr = numpy_helper.to_array(t).astype(helper.tensor_dtype_to_np_dtype(elem))
            g.initializer[i].CopyFrom(numpy_helper.from_array(arr, t.name))
    for n in g.node:
        _retype_node(n, elem)


class _Builder:
    def __init__(self, spec: Spec, dtype=None):
        self.spec = spec
        self.dtype = np.dtype(dtype or (np.float32 if spec.dtype == 0 else np.float64))
        self.opset = OPSETS[spec.opset % len(OPSETS)]
        self.rng = np.random.default_rng(spec.seed)
        self.nodes, self.inputs, self.inits, self.values = [], {}, {}, {}
        self.pool = []  # (name, shape): every tensor of the graph's float dtype, in order
        self.made = []  # (name, shape): the tensors steps made
        self.x_cands = []  # names gradients may be asked for
        self.units = []
        self.floats = set()  # tensors of the graph's float dtype that nodes make
        self.ys = []
        self.used = []  # the cases in the graph
        self.step = 0
        self._count = 0

    # ---- naming and bookkeeping
    def _name(self, kind: str) -> str:
        self._count += 1
        return f"{kind}{self.step}_{self._count}"

    def _node(self, op, inputs, n_out=1, **attrs):
        """A glue node (its own unit for localisation)."""
        name = self._name("n")
        outs = [self._name("t") for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, **attrs))
        self.floats.update(outs)
        self.units.append(Unit(f"{op} (glue)", [name], list(inputs),
                               {i for i in inputs if i in self.inits and not self.inits[i][1]}))
        return outs if n_out > 1 else outs[0]

    def _init(self, arr, follows=True, cand=False):
        name = self._name("c")
        self.inits[name] = (np.asarray(arr), follows)
        if cand:
            self.x_cands.append(name)
        return name

    def _ints(self, vals):
        return self._init(np.asarray(vals, np.int64), follows=False)

    def _made(self, name, shape):
        self.pool.append((name, tuple(shape)))
        self.made.append((name, tuple(shape)))
        self.x_cands.append(name)

    def _pick(self, p, pool=None):
        pool = self.pool if pool is None else pool
        return pool[-1 - p % len(pool)]

    def _declared(self, name, shape):
        if not self.spec.symbolic:
            return list(shape)
        return [d if d == "N" else f"{name}_d{i}" for i, d in enumerate(shape)]

    # ---- graph inputs
    def free_inputs(self):
        for i, (rank, dims) in enumerate(self.spec.inputs):
            shape = tuple(dims[:rank % 4])
            if self.spec.batch and i == 0:
                shape = ("N",) + shape
            name = f"x{i}"
            self.inputs[name] = (self._declared(name, shape), None)
            self.values[name] = functools.partial(_normal, int(self.rng.integers(2**31)), shape)
            self.pool.append((name, shape))
            self.x_cands.append(name)

    # ---- feeding a case input from an earlier tensor
    def adapt(self, t, target, mode):
        """A tensor from ``t`` that broadcasts into ``target`` without growing it."""
        name, shape = t
        if mode == 1:
            return self._node("ReduceMean", [name], keepdims=0)
        if mode == 2 and "N" not in shape + tuple(target) and \
                np.prod(shape) == np.prod(target) > 0:  # (a 0 in Reshape's shape copies a dim)
            return self._node("Reshape", [name, self._ints(target)]) if shape != target else name
        shape = list(shape)
        if len(shape) > len(target):
            lead = len(shape) - len(target)
            name = self._node("ReduceMean", [name, self._ints(range(lead))], keepdims=0)
            shape = shape[lead:]
        off = len(target) - len(shape)
        axes = [i for i, d in enumerate(shape) if d != 1 and d != target[off + i]]
        if axes:
            name = self._node("ReduceMean", [name, self._ints(axes)], keepdims=1)
        return name

    def feed_from(self, t, value, mode, squash):
        """value + 0.1 * value * squash(adapt(t)): near the case's value, depending on t."""
        c = self._init(value, cand=True)
        cs = self._init(0.1 * value, cand=True)
        q = self._node(SQUASH[squash % len(SQUASH)], [self.adapt(t, value.shape, mode)])
        return self._node("Add", [c, self._node("Mul", [cs, q])])

    # ---- steps
    def add_case(self, case: Case, args):
        rename = {}
        for j, (nm, v) in enumerate(case.inputs):
            # onnxruntime 1.31 writes a training-mode BatchNormalization's running statistics
            # over its input_mean/input_var in place, whatever else reads them (an initializer
            # then changes between runs, another consumer reads the new statistics): those are
            # graph inputs of their own here, read by nothing else
            if case.op == "BatchNormalization" and j in (3, 4):
                name = f"i{self.step}_{j}"
                self.inputs[name] = (list(v.shape), None)
                self.values[name] = functools.partial(_const, v)
                if nm not in case.held:
                    self.x_cands.append(name)
                rename[nm] = name
                continue
            if nm in case.held:
                rename[nm] = self._init(v, follows=v.dtype.kind == "f" and nm not in case.fixed)
                continue
            a = args[2 + j % 6]
            wiring = a % 4 if self.pool and np.all(np.isfinite(v)) else a % 2
            v = _jitter(v, self.rng)
            if wiring == 0:
                rename[nm] = self._init(v, cand=True)
            elif wiring == 1:
                name = f"i{self.step}_{j}"
                # onnx's Attention inference makes up dims (and ranks) for symbolic input dims,
                # which the rule refuses (tests/test_fuzz_regressions.py): static inputs here
                dims = list(v.shape) if case.op == "Attention" else self._declared(name, v.shape)
                self.inputs[name] = (dims, None)
                self.values[name] = functools.partial(_const, v)
                self.x_cands.append(name)
                self.pool.append((name, v.shape))
                rename[nm] = name
            else:
                rename[nm] = self.feed_from(self._pick(a >> 2), v, (a >> 12) % 3, a >> 14)
        names = []
        for node in case.nodes:
            n = onnx.NodeProto()
            n.CopyFrom(node)
            n.name = self._name("n")
            names.append(n.name)
            for i, o in enumerate(n.output):
                if o:
                    rename[o] = n.output[i] = self._name("t")
            _rename_inputs(n, rename)
            self.nodes.append(n)
        self.units.append(Unit(f"{case.op} ({case.name})", names,
                               [rename[nm] for nm, _ in case.inputs],
                               {rename[nm] for nm in case.held}))
        self.used.append(case)
        kept = {o for n in self.nodes[-len(case.nodes):] for o in n.output}
        self.floats.update(rename[o] for o, _ in case.outputs
                           if o not in case.fixed and rename[o] in kept)
        for o, s in case.outputs:
            if rename[o] not in kept:
                continue
            if o not in case.fixed:
                self._made(rename[o], s)
            elif o in case.wide:  # a float64 output joins the pool cast to the graph's dtype
                self._made(self._node("CastLike", [rename[o], self._init(np.zeros(()))]), s)
            # else: a float32 output even in the float64 oracle (LayerNormalization's Mean
            # with its default stash_type): float64 finite differences cannot judge it

    def glue(self, args):
        kind = args[0] % 12
        name, shape = self._pick(args[1])
        r = len(shape)
        concrete = [i for i, d in enumerate(shape) if d != "N" and d >= 2]
        if kind == 1:  # binary, broadcasting the second operand into the first
            b = self.adapt(self._pick(args[2]), shape, args[3] % 3)
            op = ("Add", "Sub", "Mul", "Div")[args[4] % 4]
            if op == "Div":
                b = self._node("Add", [self._node("Mul", [b, b]), self._init(np.ones(()))])
            pair = [name, b] if args[5] % 2 == 0 or op == "Div" else [b, name]
            return self._made(self._node(op, pair), shape)
        if kind == 2 and r >= 1 and shape[-1] != "N":  # MatMul with a weight
            k = 1 + args[2] % 3
            w = self._init(self.rng.standard_normal((shape[-1], k)) * 0.5, cand=True)
            return self._made(self._node("MatMul", [name, w]), shape[:-1] + (k,))
        if kind == 3 and r >= 2:  # Transpose
            perms = list(itertools.permutations(range(r)))
            perm = perms[args[2] % len(perms)]
            return self._made(self._node("Transpose", [name], perm=list(perm)),
                              tuple(shape[i] for i in perm))
        if kind == 4 and r >= 2 and "N" not in shape[1:]:  # Reshape keeping the leading dim
            return self._made(self._node("Reshape", [name, self._ints([0, -1])]),
                              (shape[0], int(np.prod(shape[1:]))))
        if kind == 5 and r >= 1:  # a reduction
            axes = [i for i in range(r) if (args[2] >> i) & 1] or [0]
            keep = args[3] % 2
            op = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2",
                  "ReduceLogSumExp")[args[4] % 5]
            out = tuple(1 if i in axes else d for i, d in enumerate(shape)) if keep else \
                tuple(d for i, d in enumerate(shape) if i not in axes)
            return self._made(self._node(op, [name, self._ints(axes)], keepdims=keep), out)
        if kind == 6 and concrete:  # Split: a multi-output node
            ax = concrete[args[2] % len(concrete)]
            d = shape[ax]
            outs = self._node("Split", [name], n_out=2, axis=ax, num_outputs=2)
            for o, size in zip(outs, ((d + 1) // 2, d - (d + 1) // 2)):
                self._made(o, shape[:ax] + (size,) + shape[ax + 1:])
            return
        if kind == 7 and r >= 1:  # Concat with another tensor (or the same one twice)
            b_name, b_shape = self._pick(args[2])
            axes = [i for i in range(r) if len(b_shape) == r and shape[i] != "N"
                    and b_shape[i] != "N"
                    and all(shape[j] == b_shape[j] for j in range(r) if j != i)]
            if not axes:
                b_name, b_shape, axes = name, shape, [i for i in range(r) if shape[i] != "N"]
            if axes:
                ax = axes[args[3] % len(axes)]
                out = shape[:ax] + (shape[ax] + b_shape[ax],) + shape[ax + 1:]
                return self._made(self._node("Concat", [name, b_name], axis=ax), out)
        if kind == 8 and concrete:  # Slice, forwards or reversed
            ax = concrete[args[2] % len(concrete)]
            d = shape[ax]
            if args[3] % 2:
                ins = [name, self._ints([-1]), self._ints([-d - 1]), self._ints([ax]),
                       self._ints([-1])]
                out = shape
            else:
                ins = [name, self._ints([1]), self._ints([d]), self._ints([ax])]
                out = shape[:ax] + (d - 1,) + shape[ax + 1:]
            return self._made(self._node("Slice", ins), out)
        if kind == 9 and r >= 1:  # Softmax / LogSoftmax
            op = ("Softmax", "LogSoftmax")[args[3] % 2]
            return self._made(self._node(op, [name], axis=args[2] % r - r), shape)
        if kind == 10:  # the same tensor twice in one node
            return self._made(self._node("Mul", [name, name]), shape)
        if kind == 11:  # Unsqueeze, or Squeeze of a size-1 axis
            ones = [i for i, d in enumerate(shape) if d == 1]
            if ones and args[2] % 2:
                ax = ones[args[3] % len(ones)]
                return self._made(self._node("Squeeze", [name, self._ints([ax])]),
                                  shape[:ax] + shape[ax + 1:])
            return self._made(self._node("Unsqueeze", [name, self._ints([0])]), (1,) + shape)
        return self._made(self._node(UNARY[args[2] % len(UNARY)], [name]), shape)

    def ancestors(self, names) -> set:
        """The tensors ``names`` depend on (bodies' outer-scope reads included), themselves too."""
        made_by = {o: u for u in self.units for n in self.nodes if n.name in u.nodes
                   for o in n.output if o}
        seen, todo = set(), list(names)
        while todo:
            t = todo.pop()
            if t in seen:
                continue
            seen.add(t)
            if t in made_by:
                todo.extend(made_by[t].inputs)
        return seen

    # ---- the call
    def problem(self) -> Problem:
        s = self.spec
        made = dict(self.made)
        # graph outputs declare their rank only: onnx's own inference of some ops (STFT)
        # contradicts their data
        outputs = {y: ([d if d == "N" else f"{y}_d{i}" for i, d in enumerate(made[y])], None)
                   for y in self.ys}
        grad_ys = []
        for i, y in enumerate(self.ys):
            kind = s.grad_ys[i % len(s.grad_ys)] if s.grad_ys else 0
            if kind == 1:
                grad_ys.append(("new", f"dy{i}"))
            elif kind == 2:
                self.inputs[f"gy{i}"] = (list(made[y]), None)
                grad_ys.append(("existing", f"gy{i}"))
            else:
                grad_ys.append(None)
        # xs and stops mostly among what ys depend on (else most gradients would be None);
        # every fifth pick among all candidates
        up = self.ancestors(self.ys)
        near = [x for x in self.x_cands if x in up] or self.x_cands

        def pick_x(p):
            pool = self.x_cands if p % 5 == 4 else near
            return pool[p // 5 % len(pool)]

        xs = [pick_x(p) for p in s.xs]
        stop_pool = [n for n, _ in self.made if n in up and n not in self.ys] + \
            [n for n in self.inputs if n.startswith("x") and n in up]
        stops = list(dict.fromkeys(stop_pool[-1 - p % len(stop_pool)] for p in s.stops)) \
            if stop_pool else []
        floats = self.floats | {n for n, (s, d) in self.inputs.items() if d is None} | \
            {n for n, (a, f) in self.inits.items() if f}
        return Problem(
            opset=self.opset, nodes=self.nodes, inputs=self.inputs, inits=self.inits,
            outputs=outputs, values=self.values, ys=list(self.ys), xs=xs, grad_ys=grad_ys,
            stops=stops, unconnected="zero" if s.unconnected else "none",
            name=SCOPES[s.scope % len(SCOPES)], aggregation=AGGREGATIONS[s.aggregation % 3],
            second=tuple(s.second), batched=s.batch, value_info=s.value_info,
            dtype=self.dtype, units=self.units, floats=floats, shapes=made,
            function=s.function)


def _rename_inputs(node, rename):
    """Rename what ``node`` reads, its bodies' outer-scope reads included."""
    for i, x in enumerate(node.input):
        if x in rename:
            node.input[i] = rename[x]
    for a in node.attribute:
        for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            local = {v.name for v in g.input} | {t.name for t in g.initializer} | \
                {o for n in g.node for o in n.output}
            inner = {k: v for k, v in rename.items() if k not in local}
            for n in g.node:
                _rename_inputs(n, inner)


def _normal(seed, shape, n):
    dims = tuple(n if d == "N" else d for d in shape)
    return np.random.default_rng(seed).standard_normal(dims)


def _const(v, n):
    return np.asarray(v, np.float64)


def _jitter(v, rng):
    """v scaled by 1 + JITTER * U(-1, 1), and its zeros moved by as much (off kinks at 0)."""
    u = rng.uniform(-1, 1, v.shape)
    return (v * (1 + JITTER * u) + JITTER * u * (v == 0)).astype(np.float64)


def build(spec: Spec, cat: Catalogue | None = None) -> Problem:
    """The Problem a Spec describes (deterministic)."""
    cat = cat or catalogue()
    b = _Builder(spec)
    b.free_inputs()
    for k, (kind, args) in enumerate(spec.steps, start=1):
        b.step = k
        case = cat.pick(args[0], args[1], b.dtype, b.opset, b.used) if kind == 0 else None
        if case is not None:
            b.add_case(case, args)
        else:
            b.glue(args)
    b.step = len(spec.steps) + 1
    if spec.unconnected:
        b.inputs["unused"] = ([2], None)
        b.values["unused"] = functools.partial(_normal, spec.seed, (2,))
        b.x_cands.append("unused")
    if not b.made:  # only possible for a Spec without steps
        b.glue((0,) * 8)
    b.ys = list(dict.fromkeys(b._pick(p, b.made)[0] for p in spec.ys))
    return b.problem()
