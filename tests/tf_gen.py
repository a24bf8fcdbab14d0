"""Random TensorFlow programs of raw ops, converted and differentiated, against TensorFlow.

A generator of the graphs the converter meets beyond Keras's layers (``tests/test_tf_fuzz.py``;
more examples with ``python bench/fuzz_tf.py``): one or two inputs of rank 1 to 4, then 1 to 6
ops, each reading one or two earlier values (a value read twice: gradients that add up) from a
catalogue: elementwise math on its domain, broadcasting binaries, reductions, reshapes and
transposes, slices with strides, gathers with repeated indices, concatenation and splits,
pads, cumulative sums and products, softmax, matrix products, selects, top-k, 2-D
convolutions, transposed convolutions and pools, losses, segment reductions and scatters,
band and diagonal parts, einsum, a boolean mask (a run-time length), and control flow (a while
loop, a cond, a scan, a TensorArray loop, in TF's v1 or v2 form). The graph's placeholders
have unknown dims, or static ones (drawn); a quarter of the programs go through a SavedModel
instead (a tf.function saved and converted from its directory).

Each op is drawn against the values TF computes eagerly for the example's inputs, so its
parameters fit their shapes. The oracle (:func:`check`): the converted forward equals TF's,
``onnxgrad.gradients`` equals ``tf.gradients`` with a non-uniform upstream gradient, and so
does TF's own gradient graph, converted. A float64 program is held to 1e-9 of each tensor's
largest entry; a float32 one to its float64 twin's results (1e-3, plus 10x TF's own float32
error). Every value a program computes is finite (special values:
tests/test_tf_special_values.py). Ties of maxima and the kinks of abs, relu and the like are
not drawn on purpose: random values meet them with probability 0, except where a program
makes them (a value tiled, then reduced by max), and the comparison reports those as found.
"""
from __future__ import annotations

import numpy as np
import onnx
from hypothesis import assume
from hypothesis import strategies as st

import onnxgrad
from onnxgrad.converters.tensorflow import ConversionError, convert
from tf_util import control_flow, eager, ort_run, tf, tf_run, upstream
from util import within

TOL = 1e-9  # max |ours - tf| / max |tf| per tensor, both in float64
FLOOR = 1e-12  # float64 noise where the exact value is 0 by cancellation of O(1) terms
REJECTED: dict = {}
GRAPH_REFUSED: dict = {}  # TF gradient graphs the converter refused (the example still counts)
CHECKED: list = []  # the op names of each example checked


def _reject(why):
    REJECTED[why] = REJECTED.get(why, 0) + 1
    assume(False)


def _pos(x):
    return tf.abs(x) + 0.5


# -- the catalogue: name -> (draw the parameters for these values, apply them) ---------------
# draw(draw, shapes) returns (indices of the values read, params); apply(params, *values)
UNARY = {
    "exp": tf.exp, "tanh": tf.tanh, "sigmoid": tf.sigmoid, "softplus": tf.nn.softplus,
    "square": tf.square, "sin": tf.sin, "cos": tf.cos, "erf": tf.math.erf, "atan": tf.atan,
    "asinh": tf.asinh, "neg": tf.negative, "relu": tf.nn.relu, "relu6": tf.nn.relu6,
    "elu": tf.nn.elu, "selu": tf.nn.selu, "leaky_relu": lambda x: tf.nn.leaky_relu(x, 0.2),
    "softsign": tf.nn.softsign, "expm1": tf.math.expm1, "abs": tf.abs, "sign": tf.sign,
    "log": lambda x: tf.math.log(_pos(x)), "sqrt": lambda x: tf.sqrt(_pos(x)),
    "rsqrt": lambda x: tf.math.rsqrt(_pos(x)), "reciprocal": lambda x: tf.math.reciprocal(_pos(x)),
    "log1p": lambda x: tf.math.log1p(tf.abs(x)), "lgamma": lambda x: tf.math.lgamma(_pos(x)),
    "digamma": lambda x: tf.math.digamma(_pos(x)), "gelu": tf.nn.gelu,
    "gelu_tanh": lambda x: tf.nn.gelu(x, approximate=True), "silu": tf.nn.silu,
    "log_sigmoid": tf.math.log_sigmoid, "erfc": tf.math.erfc, "sinh": tf.sinh, "cosh": tf.cosh,
    "asin": lambda x: tf.asin(0.9 * tf.tanh(x)), "atanh": lambda x: tf.atanh(0.9 * tf.tanh(x)),
    "clip": lambda x: tf.clip_by_value(x, -0.5, 0.7),
}
BINARY = {
    "add": tf.add, "sub": tf.subtract, "mul": tf.multiply,
    "div": lambda a, b: a / (b * b + 1.0), "maximum": tf.maximum, "minimum": tf.minimum,
    "sqdiff": tf.math.squared_difference, "pow": lambda a, b: tf.pow(_pos(a), b),
    "atan2": tf.atan2, "xlogy": lambda a, b: tf.math.xlogy(a, _pos(b)),
    "where": lambda a, b: tf.where(a > b, a, b * 2.0),
}
REDUCE = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max,
          "min": tf.reduce_min, "prod": tf.reduce_prod, "logsumexp": tf.reduce_logsumexp,
          "std": tf.math.reduce_std, "variance": tf.math.reduce_variance}


def _axis(draw, rank):
    return draw(st.integers(-rank, rank - 1))


def _one(draw, shapes, rank_min=1):
    ok = [i for i, s in enumerate(shapes) if len(s) >= rank_min]
    assume(ok)
    return draw(st.sampled_from(ok))


def _unary(draw, shapes):
    return [_one(draw, shapes)], draw(st.sampled_from(sorted(UNARY)))


def _binary(draw, shapes):
    i = _one(draw, shapes)
    a = shapes[i]
    partners = [j for j, b in enumerate(shapes)
                if _broadcasts(a, b) and len(b) <= len(a)]
    j = draw(st.sampled_from(partners))
    return [i, j] if draw(st.booleans()) else [j, i], draw(st.sampled_from(sorted(BINARY)))


def _broadcasts(a, b):
    try:
        np.broadcast_shapes(a, b)
        return True
    except ValueError:
        return False


def _reduce(draw, shapes):
    i = _one(draw, shapes)
    r = len(shapes[i])
    axes = draw(st.one_of(st.none(), st.lists(st.integers(0, r - 1), min_size=1, max_size=r,
                                              unique=True)))
    return [i], (draw(st.sampled_from(sorted(REDUCE))), axes, draw(st.booleans()))


def _reshape(draw, shapes):
    i = _one(draw, shapes)
    n = int(np.prod(shapes[i]))
    dims = []
    rest = n
    for _ in range(draw(st.integers(0, 3))):
        f = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
        dims.append(f)
        rest //= f
    dims.append(rest)
    dims = draw(st.permutations(dims))
    k = draw(st.integers(-1, len(dims) - 1))
    return [i], [(-1 if j == k else d) for j, d in enumerate(dims)]


def _transpose(draw, shapes):
    i = _one(draw, shapes, 2)
    return [i], draw(st.permutations(range(len(shapes[i]))))


def _slice(draw, shapes):
    """A strided slice: per axis start, stop, step (negative steps too), or a new axis."""
    i = _one(draw, shapes)
    spec = []
    for d in shapes[i]:
        step = draw(st.sampled_from([1, 1, 2, -1, -2]))
        start = draw(st.one_of(st.none(), st.integers(-d, d - 1)))
        stop = draw(st.one_of(st.none(), st.integers(-d - 1, d)))
        spec.append((start, stop, step))
    return [i], spec


def _gather(draw, shapes):
    i = _one(draw, shapes)
    r = len(shapes[i])
    axis = draw(st.integers(0, r - 1))
    d = shapes[i][axis]
    idx = draw(st.lists(st.integers(0, d - 1), min_size=1, max_size=5))
    return [i], (axis, idx)


def _gather_nd(draw, shapes):
    i = _one(draw, shapes)
    s = shapes[i]
    depth = draw(st.integers(1, len(s)))
    rows = draw(st.lists(st.tuples(*[st.integers(0, d - 1) for d in s[:depth]]),
                         min_size=1, max_size=4))
    return [i], [list(r) for r in rows]


def _concat(draw, shapes):
    i = _one(draw, shapes)
    a = shapes[i]
    axis = _axis(draw, len(a)) % len(a)
    partners = [j for j, b in enumerate(shapes) if len(b) == len(a) and all(
        x == y for k, (x, y) in enumerate(zip(a, b)) if k != axis)]
    return [i, draw(st.sampled_from(partners))], axis


def _stack(draw, shapes):
    i = _one(draw, shapes)
    partners = [j for j, b in enumerate(shapes) if b == shapes[i]]
    return [i, draw(st.sampled_from(partners))], draw(st.integers(0, len(shapes[i])))


def _split(draw, shapes):
    i = _one(draw, shapes)
    s = shapes[i]
    axis = draw(st.integers(0, len(s) - 1))
    parts = draw(st.sampled_from([p for p in range(1, s[axis] + 1) if s[axis] % p == 0]))
    return [i], (axis, parts, draw(st.integers(0, parts - 1)))


def _unstack(draw, shapes):
    i = _one(draw, shapes, 2)
    s = shapes[i]
    axis = draw(st.integers(0, len(s) - 1))
    return [i], (axis, s[axis], draw(st.integers(0, s[axis] - 1)))


def _pad(draw, shapes):
    i = _one(draw, shapes)
    mode = draw(st.sampled_from(["CONSTANT", "REFLECT", "SYMMETRIC"]))
    top = {"CONSTANT": lambda d: 2, "REFLECT": lambda d: d - 1, "SYMMETRIC": lambda d: d}[mode]
    pads = [[draw(st.integers(0, min(2, top(d)))), draw(st.integers(0, min(2, top(d))))]
            for d in shapes[i]]
    return [i], (mode, pads, draw(st.sampled_from([0.0, 1.5])))


def _tile(draw, shapes):
    i = _one(draw, shapes)
    return [i], [draw(st.integers(1, 2)) for _ in shapes[i]]


def _reverse(draw, shapes):
    i = _one(draw, shapes)
    return [i], draw(st.lists(st.integers(0, len(shapes[i]) - 1), min_size=1, unique=True))


def _expand(draw, shapes):
    i = _one(draw, shapes)
    return [i], draw(st.integers(-len(shapes[i]) - 1, len(shapes[i])))


def _broadcast_to(draw, shapes):
    i = _one(draw, shapes)
    return [i], [draw(st.integers(1, 3)), *[draw(st.sampled_from([d, 2, 3])) if d == 1 else d
                                          for d in shapes[i]]]


def _cumulative(draw, shapes):
    i = _one(draw, shapes)
    name = draw(st.sampled_from(["cumsum", "cumprod", "cumlogsumexp"]))
    exclusive = draw(st.booleans()) and name != "cumlogsumexp"  # (its first value: -inf)
    return [i], (name, _axis(draw, len(shapes[i])), exclusive, draw(st.booleans()))


def _softmax(draw, shapes):
    i = _one(draw, shapes)
    return [i], (draw(st.sampled_from(["softmax", "log_softmax", "l2_normalize"])),
                 _axis(draw, len(shapes[i])))


def _matmul(draw, shapes):
    """a times a's own transpose (or b where the inner dims meet), with transpose flags."""
    i = _one(draw, shapes, 2)
    a = shapes[i]
    ta, tb = draw(st.booleans()), draw(st.booleans())
    k = a[-2] if ta else a[-1]
    partners = [j for j, b in enumerate(shapes) if len(b) == len(a) and b[:-2] == a[:-2]
                and (b[-1] if tb else b[-2]) == k]
    assume(partners)
    return [i, draw(st.sampled_from(partners))], (ta, tb)


def _top_k(draw, shapes):
    i = _one(draw, shapes)
    return [i], (draw(st.integers(1, shapes[i][-1])), draw(st.sampled_from(["values", "sort"])))


def _conv(draw, shapes):
    """NHWC 2-D convolutions (a random constant filter) and pools on a rank-4 value."""
    i = _one(draw, shapes, 4)
    kind = draw(st.sampled_from(["conv", "depthwise", "max_pool", "avg_pool", "resize"]))
    k, s = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    padding = draw(st.sampled_from(["SAME", "VALID"]))
    h, w = shapes[i][1:3]
    assume(padding == "SAME" or (h >= k and w >= k))
    return [i], (kind, k, s, padding, shapes[i][-1], draw(st.integers(1, 3)),
                 draw(st.integers(0, 2**16)))


def _control(draw, shapes):
    """A while loop, a cond, a scan over axis 0 or a TensorArray loop reading another value."""
    i = _one(draw, shapes)
    j = draw(st.sampled_from([j for j, b in enumerate(shapes) if _broadcasts(shapes[i], b)
                              and len(b) <= len(shapes[i])]))
    return [i, j], (draw(st.sampled_from(["while", "cond", "scan", "tensor_array"])),
                    draw(st.integers(1, 3)))


def _apply_control(p, a, b):
    kind, n = p
    a = a + tf.zeros_like(b)  # the loops' carried values keep a shape
    if kind == "while":  # a fixed trip count, a carried value and a read-only one
        return tf.while_loop(lambda t, x: t < n, lambda t, x: (t + 1, tf.tanh(x) * b + x),
                             (tf.constant(0), a))[1]
    if kind == "cond":
        return tf.cond(tf.reduce_sum(a) > 0.0, lambda: tf.sin(a) * b, lambda: a - b)
    if kind == "scan":
        return tf.scan(lambda acc, e: tf.tanh(acc) * 0.5 + e * tf.reduce_mean(b), a)
    rows = a * b  # a TensorArray written per row of axis 0, then stacked
    m = tf.shape(rows)[0]
    ta = tf.TensorArray(rows.dtype, size=m)
    ta = tf.while_loop(lambda t, _: t < m,
                       lambda t, ta: (t + 1, ta.write(t, tf.sin(rows[t]) * rows[m - 1 - t])),
                       (tf.constant(0), ta))[1]
    return ta.stack()


def _apply_conv(p, x):
    kind, k, s, padding, c, m, seed = p
    r = np.random.default_rng(seed)
    f = tf.constant(r.standard_normal((k, k, c, m)), x.dtype)
    if kind == "conv":
        return tf.nn.conv2d(x, f, s, padding)
    if kind == "depthwise":
        return tf.nn.depthwise_conv2d(x, f, [1, s, s, 1], padding)
    if kind == "resize":
        size = tf.shape(x)[1:3] * s + k - 1
        return tf.image.resize(x, size, method=["bilinear", "nearest", "bicubic"][m % 3])
    pool = tf.nn.max_pool2d if kind == "max_pool" else tf.nn.avg_pool2d
    return pool(x, k, s, padding)


def _apply_slice(spec, x):
    return x[tuple(slice(a, b, c) for a, b, c in spec)]


def _apply_reduce(p, x):
    name, axes, keep = p
    return REDUCE[name](x, axis=axes, keepdims=keep)


def _apply_cumulative(p, x):
    name, axis, exclusive, reverse = p
    f = {"cumsum": tf.cumsum, "cumprod": tf.math.cumprod,
         "cumlogsumexp": tf.math.cumulative_logsumexp}[name]
    return f(x, axis=axis, exclusive=exclusive, reverse=reverse)


def _apply_softmax(p, x):
    name, axis = p
    if name == "l2_normalize":
        return tf.math.l2_normalize(x, axis=axis)
    return getattr(tf.nn, name)(x, axis=axis)


def _apply_top_k(p, x):
    k, what = p
    return tf.math.top_k(x, k).values if what == "values" else tf.sort(x, direction="DESCENDING")


def _same_pair(draw, shapes, rank_min=1):
    i = _one(draw, shapes, rank_min)
    return i, draw(st.sampled_from([j for j, b in enumerate(shapes) if b == shapes[i]]))


def _losses(draw, shapes):
    """Cross entropies over the last axis (labels from a second value, made a distribution)
    and tf.nn.l2_loss."""
    i, j = _same_pair(draw, shapes)
    return [i, j], draw(st.sampled_from(["softmax_ce", "sigmoid_ce", "l2_loss", "bias_add"]))


def _apply_losses(p, a, b):
    if p == "softmax_ce":
        return tf.nn.softmax_cross_entropy_with_logits(labels=tf.nn.softmax(b), logits=a)
    if p == "sigmoid_ce":
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.sigmoid(b), logits=a)
    if p == "l2_loss":
        return tf.nn.l2_loss(a) * b  # (a scalar times b: a shape to go on with)
    return tf.nn.bias_add(a, b[(0,) * (len(b.shape) - 1)]) if len(a.shape) >= 2 else a + b


def _segments(draw, shapes):
    """Unsorted segment sums and maxima of the rows of axis 0 (ids drawn, repeats, an empty
    segment), and tensor_scatter_nd_add of another value's rows into a."""
    i = _one(draw, shapes)
    n = shapes[i][0]
    ids = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    kind = draw(st.sampled_from(["sum", "max", "mean", "scatter_add"]))
    return [i], (kind, ids)


def _apply_segments(p, a):
    kind, ids = p
    if kind == "scatter_add":  # a's rows added into themselves at drawn rows (repeats add up)
        rows = [[k % len(ids)] for k in ids]
        return tf.tensor_scatter_nd_add(a, rows, tf.sin(a))
    f = {"sum": tf.math.unsorted_segment_sum, "max": tf.math.unsorted_segment_max,
         "mean": tf.math.unsorted_segment_mean}[kind]
    return f(a, ids, 4)


def _linalg(draw, shapes):
    i = _one(draw, shapes, 2)
    return [i], draw(st.sampled_from(["band_part", "diag_part", "trace", "einsum_dot",
                                      "einsum_outer", "roll", "clip_norm", "gather_batch",
                                      "boolean_mask", "squeeze", "moments"]))


def _apply_linalg(p, a):
    if p == "band_part":
        return tf.linalg.band_part(a, 1, 0)
    if p == "diag_part":
        return tf.linalg.diag_part(a)
    if p == "trace":
        return tf.linalg.trace(a)[..., None] * a[..., 0, :]
    if p == "einsum_dot":
        return tf.einsum("...i,...i->...", a, tf.tanh(a))
    if p == "einsum_outer":
        return tf.einsum("...i,...j->...ij", a[..., 0, :], a[..., -1, :])
    if p == "roll":
        return tf.roll(a, shift=[1, -2], axis=[0, -1])
    if p == "clip_norm":
        return tf.clip_by_norm(a, 1.0, axes=[-1])
    if p == "gather_batch":  # each row of axis 0 gathers its own columns of axis 1
        idx = tf.tile(tf.constant([[1, 0, 1]]), tf.stack([tf.shape(a)[0], 1]))
        return tf.gather(a, idx % tf.shape(a)[1], axis=1, batch_dims=1)
    if p == "boolean_mask":  # a run-time length
        return tf.boolean_mask(a, a > 0.0)
    if p == "squeeze":
        return tf.squeeze(a[:, :1], axis=1)
    mean, var = tf.nn.moments(a, axes=[0], keepdims=True)
    return (a - mean) * tf.math.rsqrt(var + 0.1)


def _tensor_array(draw, shapes):
    """A TensorArray (TF1: TensorArrayV3 and its gradient arrays; v2 control flow: TensorList
    ops) written one way and read another: rows of a value scaled by the mean of a second one,
    written by unstack, a permuting scatter, writes in a drawn order (in a while loop or
    unrolled) or a split into parts of drawn lengths; read by stack, a gather with repeats,
    concat, or reads of drawn indices (in a loop or unrolled; an index read twice: gradient
    writes that add up); what is read times the array's size. Its size static, the value's
    run-time rows, or grown from 0; up to two elements more than are written (then read only
    where written)."""
    i = _one(draw, shapes)
    j = draw(st.sampled_from(range(len(shapes))))
    n = shapes[i][0]
    write = draw(st.sampled_from(["unstack", "scatter", "write_loop", "write_unrolled",
                                  "split"]))
    grows = ["grow"] if write in ("write_loop", "write_unrolled") else []
    size = draw(st.sampled_from(["static", *(["rows"] * (write != "split")), *grows]))
    extra = draw(st.sampled_from([0, 0, 1, 2])) if write != "split" and size != "grow" else 0
    reads = ["concat", "read_unrolled"] if write == "split" else [
        "stack", "gather", "read_loop", "read_unrolled", *(["concat"] * (len(shapes[i]) > 1))]
    read = draw(st.sampled_from(["gather", "read_unrolled"] if extra else reads))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    lengths = tuple(b - a for a, b in zip([0, *cuts], [*cuts, n]))
    count = len(lengths) if write == "split" else n
    idx = tuple(draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=5)))
    return [i, j], (write, read, tuple(draw(st.permutations(range(n)))), lengths, idx, size,
                    draw(st.booleans()), extra)


def array_bulk_write(ta, write, order, lengths, rows):
    """The array after an unstack, scatter or split of ``rows`` (the same calls on
    tf.TensorArray and onnxgrad.TensorArray), or None for the per-index write kinds."""
    if write == "unstack":
        return ta.unstack(rows)
    if write == "scatter":
        return ta.scatter(list(order), rows)
    if write == "split":
        return ta.split(rows, list(lengths))
    return None


def array_bulk_read(ta, read, idx):
    """stack, gather or concat of the array (either API), or None for the single reads."""
    return {"stack": ta.stack, "gather": lambda: ta.gather(list(idx)),
            "concat": ta.concat}.get(read, lambda: None)()


def _apply_tensor_array(p, a, b):
    write, read, order, lengths, idx, size, known, extra = p
    k = tf.reduce_mean(b)
    rows = tf.sin(a) * k
    n = len(order)
    count = len(lengths) if write == "split" else n
    ta = tf.TensorArray(a.dtype, size={"static": count + extra, "rows": tf.shape(a)[0] + extra,
                                       "grow": 0}[size],
                        dynamic_size=size == "grow", clear_after_read=False,
                        element_shape=a.shape[1:] if known and write != "split" else None,
                        infer_shape=write != "split")
    bulk = array_bulk_write(ta, write, order, lengths, rows)
    if bulk is not None:
        ta = bulk
    elif write == "write_unrolled":
        for m, t in enumerate(order):
            ta = ta.write(t, rows[m])
    else:
        perm = tf.constant(order)
        ta = tf.while_loop(lambda t, _: t < tf.shape(a)[0],
                           lambda t, ta: (t + 1, ta.write(tf.gather(perm, t), rows[t])),
                           (tf.constant(0), ta))[1]
    rank = a.shape.rank - (write != "split")  # an element's (TF1 does not always infer it)
    out = array_bulk_read(ta, read, idx)
    part = (lambda x: tf.reduce_sum(x, 0, keepdims=True)) if write == "split" else tf.identity
    if out is not None:
        out.set_shape([None] * (rank + (read != "concat")))
        return out * tf.cast(ta.size(), a.dtype)
    if read == "read_unrolled":
        out = tf.add_n([(m + 1.0) * tf.cos(part(ta.read(t))) for m, t in enumerate(idx)])
    else:  # every index read twice in a loop bounded by the array's size
        m = ta.size()
        out = tf.while_loop(
            lambda t, acc: t < m,
            lambda t, acc: (t + 1, acc + part(ta.read(t)) * tf.cos(part(ta.read(m - 1 - t)))),
            (tf.constant(0), tf.zeros_like(part(ta.read(0)))))[1]
    out.set_shape([None] * rank)
    out = out * tf.cast(ta.size(), a.dtype)
    return tf.reshape(out, [1]) if rank == 0 else out


def _image(draw, shapes):
    """NHWC ops on a rank-4 value: conv2d_transpose, space_to_depth and back, LRN."""
    i = _one(draw, shapes, 4)
    kind = draw(st.sampled_from(["conv_transpose", "space_depth", "lrn"]))
    if kind == "space_depth":
        assume(shapes[i][1] % 2 == 0 and shapes[i][2] % 2 == 0)
    return [i], (kind, shapes[i][-1], draw(st.integers(1, 2)), draw(st.integers(0, 2**16)))


def _apply_image(p, x):
    kind, c, s, seed = p
    if kind == "space_depth":
        return tf.nn.depth_to_space(tf.sin(tf.nn.space_to_depth(x, 2)), 2)
    if kind == "lrn":
        return tf.nn.local_response_normalization(x, depth_radius=1, bias=1.0, alpha=0.5,
                                                  beta=0.75)
    f = tf.constant(np.random.default_rng(seed).standard_normal((2, 2, 3, c)), x.dtype)
    n = tf.shape(x)[0]
    h, w = tf.shape(x)[1] * s, tf.shape(x)[2] * s
    return tf.nn.conv2d_transpose(x, f, tf.stack([n, h, w, 3]), s, "SAME")


OPS = {
    "unary": (_unary, lambda p, x: UNARY[p](x)),
    "binary": (_binary, lambda p, a, b: BINARY[p](a, b)),
    "reduce": (_reduce, _apply_reduce),
    "reshape": (_reshape, lambda p, x: tf.reshape(x, p)),
    "transpose": (_transpose, lambda p, x: tf.transpose(x, p)),
    "slice": (_slice, _apply_slice),
    "gather": (_gather, lambda p, x: tf.gather(x, p[1], axis=p[0])),
    "gather_nd": (_gather_nd, lambda p, x: tf.gather_nd(x, p)),
    "concat": (_concat, lambda p, a, b: tf.concat([a, b], p)),
    "stack": (_stack, lambda p, a, b: tf.stack([a, b], p)),
    "split": (_split, lambda p, x: tf.split(x, p[1], axis=p[0])[p[2]]),
    "unstack": (_unstack, lambda p, x: tf.unstack(x, p[1], axis=p[0])[p[2]]),
    "pad": (_pad, lambda p, x: tf.pad(x, p[1], p[0], constant_values=p[2])),
    "tile": (_tile, lambda p, x: tf.tile(x, p)),
    "reverse": (_reverse, lambda p, x: tf.reverse(x, p)),
    "expand_dims": (_expand, lambda p, x: tf.expand_dims(x, p)),
    "broadcast_to": (_broadcast_to, lambda p, x: tf.broadcast_to(x, p)),
    "cumulative": (_cumulative, _apply_cumulative),
    "softmax": (_softmax, _apply_softmax),
    "matmul": (_matmul, lambda p, a, b: tf.linalg.matmul(a, b, transpose_a=p[0],
                                                         transpose_b=p[1])),
    "top_k": (_top_k, _apply_top_k),
    "conv": (_conv, _apply_conv),
    "control": (_control, _apply_control),
    "losses": (_losses, _apply_losses),
    "segments": (_segments, _apply_segments),
    "linalg": (_linalg, _apply_linalg),
    "image": (_image, _apply_image),
    "tensor_array": (_tensor_array, _apply_tensor_array),
}
ARRAY_OPS = ("tensor_array",) * 4 + ("unary", "binary", "reduce", "control")  # programs(ops=)


@st.composite
def programs(draw, ops=None):
    """(input shapes, steps, static dims?, control flow v2?, seed, dtype, a SavedModel?):
    steps are (op, the indices of the values it reads, params); value i < len(inputs) is
    input i. ``ops``: the op names drawn from (repeats weigh), all of OPS by default."""
    shapes = [tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
              for _ in range(draw(st.integers(1, 2)))]
    seed = draw(st.integers(0, 2**16))
    steps = []
    vals = eager(lambda: [tf.constant(v) for v in _inputs(shapes, seed)])
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(sorted(ops or OPS)))
        args, params = OPS[op][0](draw, [tuple(v.shape) for v in vals])
        try:
            out = eager(OPS[op][1], params, *[vals[i] for i in args])
        except (tf.errors.InvalidArgumentError, ValueError, TypeError, IndexError):
            _reject(f"TF refuses {op}")
        if out.shape.num_elements() == 0 or out.shape.rank == 0 and op != "reduce":
            _reject("empty or scalar")
        if not np.isfinite(out.numpy()).all():  # (special values: test_tf_special_values.py)
            _reject("a value not finite")
        if op == "reduce" and params[0] == "std" and (out.numpy() == 0).any():
            # std over one element: a square root of exactly 0, where TF's SqrtGrad gives 0 for
            # a zero incoming gradient and onnxgrad 0 * inf = NaN, as PyTorch (Guarantees)
            _reject("a square root of exactly 0")
        assume(out.shape.num_elements() <= 4096)
        vals.append(out)
        steps.append((op, args, params))
    dtype = draw(st.sampled_from(["float64", "float64", "float32"]))
    saved = draw(st.sampled_from([False, False, False, True]))
    return shapes, steps, draw(st.booleans()), draw(st.booleans()), seed, dtype, saved


def _inputs(shapes, seed):
    r = np.random.default_rng(seed)
    return [r.standard_normal(s) for s in shapes]


def _run_tf(shapes, steps, static, v2, feeds, dtype):
    """The program as a TF1 graph over ``dtype`` placeholders: (graph def, y, TF's gradients
    wrt every input or None, the upstream gradient, the names of TF's gradient tensors)."""
    graph = tf.Graph()
    with control_flow(v2), graph.as_default():
        vals = [tf.compat.v1.placeholder(dtype, s if static else [None] * len(s), name=f"x{i}")
                for i, s in enumerate(shapes)]
        ins = list(vals)
        for op, args, params in steps:
            vals.append(OPS[op][1](params, *[vals[i] for i in args]))
        y = tf.identity(vals[-1], name="result")
        gy = tf.compat.v1.placeholder(dtype, [None] * y.shape.rank, name="gy")
        try:
            gs = tf.gradients(y, ins, grad_ys=gy)
        except (TypeError, LookupError, ValueError, tf.errors.InvalidArgumentError) as e:
            # (bicubic resizes in float64; a TF1 while loop's gradient of a broadcast value:
            # "Cannot update edge, incompatible shapes", found by bench/fuzz_tf.py seed 23)
            _reject(f"TF cannot differentiate it: {type(e).__name__}")
        fetch = [tf.convert_to_tensor(g) for g in gs if g is not None]
    feeds = {k: v.astype(dtype) for k, v in feeds.items()}
    want_y = tf_run(graph, y, feeds)
    gys = upstream(want_y.shape, dtype)
    got = iter(tf_run(graph, fetch, {**feeds, gy: gys}))
    return graph.as_graph_def(add_shapes=True), want_y, [
        None if g is None else next(got) for g in gs], gys, [t.name for t in fetch]


def check(shapes, steps, static, v2, seed, dtype="float64", saved=False):
    """Build the program as a TF1 graph, convert it (``saved``: the program as a tf.function
    saved as a SavedModel, converted from its directory), and compare the forward and
    onnxgrad's gradients wrt every input with TF's in float64 (a float32 program: within 1e-3
    of the largest entry plus 10x TF's own float32 error, as tests/util.within); TF's own
    gradient graph converted, too."""
    feeds = {f"x{i}:0": v for i, v in enumerate(_inputs(shapes, seed))}
    gd, y64, g64, gys, tf_grads = _run_tf(shapes, steps, static, v2, feeds, "float64")
    # TF's TensorList gather gradient scatters the upstream rows, so repeated indices keep one
    # of them where TF1's TensorArray (and the math) add them up: such a program's reference is
    # its TF1 form, and TF's own v2 gradient graph is held to TF's v2 numbers
    ref_v2 = v2 and not any(op == "tensor_array" and p[1] == "gather" and len(set(p[4])) < len(
        p[4]) for op, _, p in steps)
    tf_g64 = g64
    if ref_v2 != v2:
        g64 = _run_tf(shapes, steps, static, ref_v2, feeds, "float64")[2]
    y32, g32, tf_g32 = y64, g64, tf_g64
    if dtype == "float32":
        gd, y32, tf_g32, _, tf_grads = _run_tf(shapes, steps, static, v2, feeds, "float32")
        g32 = tf_g32 if ref_v2 == v2 else _run_tf(shapes, steps, static, ref_v2, feeds,
                                                  "float32")[2]
        for a, b in zip([y32, *g32], [y64, *g64]):
            if a is not None and not np.array_equal(np.isfinite(a), np.isfinite(b)):
                _reject("float32 overflows")
        scale = max([float(np.abs(g).max(initial=0)) for g in g64 if g is not None] + [0.0])
        for a, b in zip(g32, g64):
            if a is not None and float(np.abs(a - b).max(initial=0)) > 1e-2 * scale:
                _reject("kink (TF's float32 gradient is off its float64 one)")
    feeds = {k: v.astype(dtype) for k, v in feeds.items()}
    try:
        if saved:
            model, names = _saved_model(shapes, steps, static, dtype)
        else:
            model = convert(gd, inputs=list(feeds), outputs=["result:0"], allow_unranked=True)
            names = (list(feeds), "result:0")
    except ConversionError as e:
        _reject(f"refused: {str(e)[:60]}")
    _check_model(model)
    ins, out = names
    got_y = ort_run(model, dict(zip(ins, feeds.values())), [out])[0]
    _close(got_y, y64, y32, "forward")
    before = model.SerializeToString()
    res = onnxgrad.gradients(model, out, ins, grad_ys=["gy"])
    assert model.SerializeToString() == before, "gradients() changed the model it was given"
    _check_model(res.model)
    outs = iter(ort_run(res.model, {**dict(zip(ins, feeds.values())), "gy": gys.astype(dtype)},
                        [g for g in res.grads if g]))
    for name, g, w, w32 in zip(feeds, res.grads, g64, g32):
        ours = None if g is None else next(outs)
        if w is None:
            assert ours is None or not np.any(ours), f"{name}: nonzero where TF has none"
        else:
            _close(np.zeros_like(w) if ours is None else ours, w, w32, f"d/d{name}")
    # TF's own gradient graph, converted: the training graphs TF1 users bring
    try:
        m2 = convert(gd, inputs=[*feeds, "gy:0"], outputs=tf_grads, allow_unranked=True)
    except ConversionError as e:
        GRAPH_REFUSED[str(e)[:80]] = GRAPH_REFUSED.get(str(e)[:80], 0) + 1
    else:
        _check_model(m2)
        outs = iter(ort_run(m2, {**feeds, "gy:0": gys.astype(dtype)}, tf_grads))
        for name, w, w32 in zip(feeds, tf_g64, tf_g32):
            if w is not None:
                _close(next(outs), w, w32, f"d/d{name} (TF's gradient graph, converted)")
    CHECKED.append([f"{op}:{p}" if isinstance(p, str) else f"{op}:{p[0]}" if isinstance(
        p, tuple) and isinstance(p[0], str) else op for op, _, p in steps])


def _check_model(m):
    """onnx's full check; an input or output whose rank TF does not know either is declared
    without a shape (``allow_unranked``: programs of every rank are drawn), which onnx.checker
    refuses on a main graph: those are checked as scalars."""
    probe = onnx.ModelProto()
    probe.CopyFrom(m)
    for vi in [*probe.graph.input, *probe.graph.output]:
        if vi.type.HasField("tensor_type") and not vi.type.tensor_type.HasField("shape"):
            vi.type.tensor_type.shape.SetInParent()
    onnx.checker.check_model(probe, full_check=True)


def _saved_model(shapes, steps, static, dtype):
    """The program as a tf.function of the inputs (TF2: v2 control flow, its ops inside a
    function call), saved with ``tf.saved_model.save`` and converted from the directory:
    (model, (input names in order, output name))."""
    import tempfile

    specs = [tf.TensorSpec(s if static else [None] * len(s), dtype, name=f"x{i}")
             for i, s in enumerate(shapes)]

    @tf.function(input_signature=specs, autograph=False)
    def program(*xs):
        vals = list(xs)
        for op, args, params in steps:
            vals.append(OPS[op][1](params, *[vals[i] for i in args]))
        return {"y": vals[-1]}

    module = tf.Module()
    module.program = program
    with tempfile.TemporaryDirectory() as d:
        eager(tf.saved_model.save, module, d, {"serving_default": program})
        model = convert(d, allow_unranked=True)
    names = [i.name for i in model.graph.input]
    ins = [next(n for n in names if n.split(":")[0].endswith(f"x{i}")) for i in range(len(shapes))]
    return model, (ins, model.graph.output[0].name)


def _close(got, want, tf32, what):
    """got (ours, float64 or float32) against TF's float64 ``want``; ``tf32``: TF's own result
    in the program's dtype, whose error sets the float32 tolerance."""
    got, want, tf32 = np.asarray(got), np.asarray(want), np.asarray(tf32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    ok = np.isfinite(want)
    assert np.isfinite(got[ok]).all(), (f"{what}: not finite where TF's is", got, want)
    err = float(np.abs(got[ok] - want[ok]).max(initial=0))
    scale = float(np.abs(want[ok]).max(initial=0))
    if got.dtype == np.float64:
        assert err <= TOL * scale + FLOOR, f"{what}: max error {err:.3g}, max |tf| {scale:.3g}"
    else:
        noise = float(np.abs(tf32[ok] - want[ok]).max(initial=0))
        assert within(got[ok], want[ok], noise, 1e-5 * scale), \
            f"{what}: max error {err:.3g}, max |tf| {scale:.3g}, TF float32's error {noise:.3g}"
