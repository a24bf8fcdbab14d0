"""SGD, Adam and AdamW as one fused CPU pass per parameter, for the Trainer on CPU.

As ONNX ops AdamW is 12 passes over every parameter (``optimizers.Adam.update``), each memory
bound: 39 ms for ResNet-18's 11.2 M parameters at one thread, the whole gap of its training step
to PyTorch's. This module holds the same updates as C loops that read p, g and the state once
and write them once: AdamW 8.3 ms there, as PyTorch's ``fused=True`` (8.4), SGD with momentum
4.4 against the graph's 10.3 (bench/optimizer.py). The machine's C compiler (``$CC``, else
``cc``) builds them on first use into the user's cache; without one the Trainer runs the ONNX
optimizer graph as before (``Trainer(fused_optimizer="auto")``). The ONNX graph stays the
definition: exported train steps, browser and CUDA training use it, and the tests hold the two
to each other.

The loops do what the graph's nodes do, in the same order and float type, each operation
rounded on its own (no contraction into FMA, no fast-math): with the same scalars the results
are the graph's, bit for bit. The scalars (Adam's step size, eps' and decay; SGD's first-step
factors) are computed here in float64 as the graph computes them (``optimizers.Adam._scalars``,
``optimizers.SGD._scalars``, float64 scalars) and cast once. A step whose loss is not finite
does not call the kernel at all (the graph gates its state's update by the same test).
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from .optimizers import SGD, Adam, AdamW

_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>

/* pout: where the new parameters go (0: over p, in place) */
typedef struct { void *p; const void *g; void *s1; void *s2; void *smax; int64_t n;
                 void *pout; } og_slot;
/* one optimizer on elements [a, b) of one parameter (k: its scalars in the parameter's type),
   or a sum over them (returned; the updates return 0) */
typedef double (*og_range)(const og_slot *s, const void *k, int flags, int64_t a, int64_t b);
typedef struct { const og_slot *sl; int ns; const void *k; int flags; og_range f;
                 int64_t lo, hi; double sum; } og_job;

enum { DECOUPLED = 1, L2 = 2, AMSGRAD = 4 };                /* Adam's flags */
enum { WD = 1, MOMENTUM = 2, DAMPENING = 4, NESTEROV = 8 };  /* SGD's flags */
enum { CLIP = 16 };  /* both: g times the clipping coefficient, the last scalar, first */

/* NAME(s, k, flags, a, b) calls one copy of BODY per flags value, in which the flags are
   constants: each copy's loop has no branch and is vectorised (a loop testing five flags is
   not: gcc unswitches only three) */
#define OG_CASE(BODY, F) case F: return BODY(s, kv, F, a, b);
#define OG_CASE4(BODY, F) \
    OG_CASE(BODY, F) OG_CASE(BODY, F + 1) OG_CASE(BODY, F + 2) OG_CASE(BODY, F + 3)
#define OG_DISPATCH(NAME, BODY)                                                              \
static double NAME(const og_slot *s, const void *kv, int flags, int64_t a, int64_t b) {     \
    switch (flags) {                                                                         \
        OG_CASE4(BODY, 0) OG_CASE4(BODY, 4) OG_CASE4(BODY, 8) OG_CASE4(BODY, 12)             \
        OG_CASE4(BODY, 16) OG_CASE4(BODY, 20) OG_CASE4(BODY, 24) OG_CASE4(BODY, 28)          \
    }                                                                                        \
    return BODY(s, kv, flags, a, b);                                                         \
}
#define OG_BODY(NAME) static inline __attribute__((always_inline)) double NAME(              \
    const og_slot *s, const void *kv, const int flags, int64_t a, int64_t b)

/* The expressions of the ONNX nodes (optimizers.py), each operation rounded to T.
   Adam's k: decay, weight_decay, beta1, beta2, step_size, eps'. */
#define OG_ADAM(NAME, T, SQRT)                                                               \
OG_BODY(NAME##_body) {                                                                       \
    const T *k = (const T *)kv;                                                              \
    const T decay = k[0], wd = k[1], b1 = k[2], b2 = k[3], step = k[4], eps = k[5];          \
    const T clip = k[6];                                                                     \
    const T *p = (const T *)s->p;                                                            \
    T *po = s->pout ? (T *)s->pout : (T *)s->p;                                              \
    const T *restrict g = (const T *)s->g;                                                   \
    T *restrict m = (T *)s->s1, *restrict v = (T *)s->s2, *restrict mx = (T *)s->smax;       \
    for (int64_t i = a; i < b; i++) {                                                        \
        T gi = g[i], pi = p[i];                                                              \
        if (flags & CLIP) gi = gi * clip;                                                    \
        if (flags & DECOUPLED) pi = pi * decay;                                              \
        if (flags & L2) gi = gi + p[i] * wd;                                                 \
        T mi = m[i] * b1 + gi, vi = v[i] * b2 + gi * gi;                                     \
        m[i] = mi; v[i] = vi;                                                                \
        if (flags & AMSGRAD) { vi = mx[i] >= vi ? mx[i] : vi; mx[i] = vi; }                  \
        po[i] = pi - mi / (SQRT(vi) + eps) * step;                                           \
    }                                                                                        \
    return 0;                                                                                \
}                                                                                            \
OG_DISPATCH(NAME, NAME##_body)
/* SGD's k: lr, weight_decay, the momentum factor and (1 - dampening) of this step (0 and 1 on
   the first), momentum (Nesterov's term), the clipping coefficient. */
#define OG_SGD(NAME, T)                                                                      \
OG_BODY(NAME##_body) {                                                                       \
    const T *k = (const T *)kv;                                                              \
    const T lr = k[0], wd = k[1], mom_t = k[2], damp_t = k[3], momentum = k[4], clip = k[5]; \
    const T *p = (const T *)s->p;                                                            \
    T *po = s->pout ? (T *)s->pout : (T *)s->p;                                              \
    const T *restrict g = (const T *)s->g;                                                   \
    T *restrict buf = (T *)s->s1;                                                            \
    for (int64_t i = a; i < b; i++) {                                                        \
        T pi = p[i], d = g[i];                                                               \
        if (flags & CLIP) d = d * clip;                                                      \
        if (flags & WD) d = d + pi * wd;                                                     \
        if (flags & MOMENTUM) {                                                              \
            T bi = buf[i] * mom_t + ((flags & DAMPENING) ? d * damp_t : d);                  \
            buf[i] = bi;                                                                     \
            d = (flags & NESTEROV) ? d + bi * momentum : bi;                                 \
        }                                                                                    \
        po[i] = pi - d * lr;                                                                 \
    }                                                                                        \
    return 0;                                                                                \
}                                                                                            \
OG_DISPATCH(NAME, NAME##_body)
/* the sum of g * g in double (for the clipping norm) */
#define OG_SUMSQ(NAME, T)                                                                    \
static double NAME(const og_slot *s, const void *kv, int flags, int64_t a, int64_t b) {     \
    const T *g = (const T *)s->g;                                                            \
    double acc = 0;                                                                          \
    for (int64_t i = a; i < b; i++) acc += (double)g[i] * (double)g[i];                      \
    return acc;                                                                              \
}
OG_ADAM(og_adam_f32, float, sqrtf)
OG_ADAM(og_adam_f64, double, sqrt)
OG_SGD(og_sgd_f32, float)
OG_SGD(og_sgd_f64, double)
OG_SUMSQ(og_sumsq_f32, float)
OG_SUMSQ(og_sumsq_f64, double)

/* the job's elements [lo, hi) of the parameters laid end to end */
static void *og_run(void *arg) {
    og_job *j = (og_job *)arg;
    int64_t base = 0;
    for (int s = 0; s < j->ns && base < j->hi; base += j->sl[s].n, s++) {
        int64_t a = j->lo > base ? j->lo - base : 0;
        int64_t b = j->hi - base < j->sl[s].n ? j->hi - base : j->sl[s].n;
        if (a < b) j->sum += j->f(&j->sl[s], j->k, j->flags, a, b);
    }
    return 0;
}

/* Split the elements into `threads` ranges (multiples of 64, at least 65536 elements each), run
   them in parallel, and return the sum of what they return. */
static double og_parallel(const og_slot *sl, int ns, const void *k, int flags, og_range f,
                          int threads) {
    int64_t total = 0;
    for (int s = 0; s < ns; s++) total += sl[s].n;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (total / 65536 < threads) threads = total / 65536 > 1 ? (int)(total / 65536) : 1;
    og_job jobs[64];
    pthread_t tid[64];
    int started[64] = {0};
    for (int t = 0; t < threads; t++) {
        int64_t lo = total * t / threads, hi = total * (t + 1) / threads;
        lo -= lo % 64;
        hi = t + 1 < threads ? hi - hi % 64 : total;
        og_job jb = {sl, ns, k, flags, f, lo, hi, 0.0};
        jobs[t] = jb;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tid[t], 0, og_run, &jobs[t]) == 0;
    og_run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], 0); else og_run(&jobs[t]);
    }
    double sum = 0;
    for (int t = 0; t < threads; t++) sum += jobs[t].sum;
    return sum;
}

int og_adam(const og_slot *sl, int ns, const void *k, int flags, int is_double, int threads) {
    og_parallel(sl, ns, k, flags, is_double ? og_adam_f64 : og_adam_f32, threads);
    return 0;
}

int og_sgd(const og_slot *sl, int ns, const void *k, int flags, int is_double, int threads) {
    og_parallel(sl, ns, k, flags, is_double ? og_sgd_f64 : og_sgd_f32, threads);
    return 0;
}

double og_sumsq(const og_slot *sl, int ns, int is_double, int threads) {
    return og_parallel(sl, ns, 0, 0, is_double ? og_sumsq_f64 : og_sumsq_f32, threads);
}
"""

# the flag bits of the C source's enums
_DECOUPLED, _L2, _AMSGRAD = 1, 2, 4                  # Adam
_WD, _MOMENTUM, _DAMPENING, _NESTEROV = 1, 2, 4, 8   # SGD
_CLIP = 16                                           # both

# no -ffast-math, no -march: every operation rounded as onnxruntime's kernels round it
_FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared", "-pthread"]


class _Slot(ctypes.Structure):
    _fields_ = [("p", ctypes.c_void_p), ("g", ctypes.c_void_p), ("s1", ctypes.c_void_p),
                ("s2", ctypes.c_void_p), ("smax", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("pout", ctypes.c_void_p)]


_lib: ctypes.CDLL | None = None
_why: str | None = None


def _cache_dir() -> str:
    return os.environ.get("ONNXGRAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "onnxgrad")


def library() -> ctypes.CDLL | None:
    """The compiled kernel library (built once per source, compiler and flags, then reused),
    or None when this machine cannot build it (:func:`unavailable` says why)."""
    global _lib, _why
    if _lib is not None or _why is not None:
        return _lib
    try:
        _lib = _load()
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        _why = str(exc) or type(exc).__name__
    return _lib


def unavailable() -> str | None:
    """Why the kernel library cannot be had here (None when it can)."""
    library()
    return _why


def _load() -> ctypes.CDLL:
    if not sys.platform.startswith(("linux", "darwin")):
        raise RuntimeError(f"the fused optimizer is built for Linux and macOS, not {sys.platform}")
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH (set CC)")
    key = hashlib.sha256("\0".join([_SOURCE, path, *_FLAGS, sys.platform]).encode())
    out_dir = _cache_dir()
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, f"fused-{key.hexdigest()[:16]}.so")
    if not os.path.exists(target):
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            src, so = os.path.join(tmp, "fused.c"), os.path.join(tmp, "fused.so")
            with open(src, "w") as f:
                f.write(_SOURCE)
            run = subprocess.run([path, *_FLAGS, src, "-o", so, "-lm"], capture_output=True,
                                 text=True, timeout=120)
            if run.returncode != 0:
                raise RuntimeError(f"{cc} could not build the fused optimizer: "
                                   f"{run.stderr.strip()[:500]}")
            os.replace(so, target)  # atomic: another process sees the whole library or none
    lib = ctypes.CDLL(target)
    for fn in (lib.og_adam, lib.og_sgd):
        fn.argtypes = [ctypes.POINTER(_Slot), ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
    lib.og_sumsq.argtypes = [ctypes.POINTER(_Slot), ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.og_sumsq.restype = ctypes.c_double
    return lib


def unsupported(optimizer, dtypes=None) -> str | None:
    """Why this step cannot take the fused update (None when it can; ``dtypes``, the
    parameters' dtypes, are checked when given)."""
    if type(optimizer) not in _KERNELS:
        return (f"{type(optimizer).__name__} has no fused kernel "
                "(SGD, Adam and AdamW have)")
    if dtypes is None:
        return None
    kinds = {np.dtype(d) for d in dtypes}
    if len(kinds) != 1 or kinds.pop() not in (np.dtype(np.float32), np.dtype(np.float64)):
        return "the parameters are not all float32 or all float64"
    return None


def make(optimizer, dtype, threads: int, clip_norm: float | None = None) -> "Fused":
    """The fused update of ``optimizer`` (SGD, Adam or AdamW) for parameters of ``dtype``, the
    gradients first clipped to the global 2-norm ``clip_norm`` when given."""
    return _KERNELS[type(optimizer)](optimizer, dtype, threads, clip_norm)


class Fused:
    """Applies an optimizer to parameter, gradient and state buffers in place:
    ``apply(slots, lr, step)``, each slot (p, g, s1, s2, smax, number of elements[, pout])
    with the buffers' raw addresses (0 for a state the optimizer does not keep; pout, where the
    new parameters go, p itself when left out). ``state`` names the
    optimizer's state slots in the order s1, s2, smax. With ``clip_norm`` the gradients are
    scaled as torch.nn.utils.clip_grad_norm_ (and optimizers.clip_grad_norm) scale them,
    g * min(1, clip_norm / (norm + 1e-6)), the norm over all slots' gradients summed in float64
    (the graph sums each gradient in its dtype: the two agree to rounding, not bit for bit)."""
    state: tuple[str, ...] = ()
    entry = ""

    def __init__(self, optimizer, dtype, threads: int, clip_norm: float | None = None):
        lib = library()
        if lib is None:
            raise RuntimeError(unavailable())
        self.lib, self.fn, self.opt = lib, getattr(lib, self.entry), optimizer
        self.threads, self.dtype = max(1, int(threads)), np.dtype(dtype)
        self.clip_norm = clip_norm
        self.flags = self._flags()

    def state_index(self, state_of: list[tuple[str, str]], params: list[str]) -> list[tuple]:
        """Per parameter, the positions of its s1, s2 and smax among the state tensors
        (``state_of``: (parameter, slot) of each), None where the optimizer keeps none."""
        at = {ps: j for j, ps in enumerate(state_of)}
        slots = (*self.state, None, None)[:3]
        return [tuple(at.get((p, slot)) for slot in slots) for p in params]

    def _flags(self) -> int:
        raise NotImplementedError

    def scalars(self, lr: float, step: int) -> np.ndarray:
        raise NotImplementedError

    def apply(self, slots: list[tuple], lr: float, step: int, clip: bool = True) -> None:
        """One step; ``clip=False``: the gradients are clipped already (ZeRO clips the global
        norm between its exchanges)."""
        arr = (_Slot * len(slots))(*[_Slot(*s) for s in slots])
        dbl, flags, coef = int(self.dtype == np.float64), self.flags, 1.0
        if clip and self.clip_norm is not None:
            norm = math.sqrt(self.lib.og_sumsq(arr, len(slots), dbl, self.threads))
            coef, flags = min(1.0, self.clip_norm / (norm + 1e-6)), flags | _CLIP
        k = np.append(self.scalars(lr, step), self.dtype.type(coef))
        self.fn(arr, len(slots), k.ctypes.data, flags, dbl, self.threads)


class FusedAdam(Fused):
    state, entry = ("exp_sum", "exp_sum_sq", "max_exp_sum_sq"), "og_adam"

    def _flags(self) -> int:
        o = self.opt
        return ((_DECOUPLED if o.decoupled and o.weight_decay != 0 else 0)
                | (_L2 if not o.decoupled and o.weight_decay != 0 else 0)
                | (_AMSGRAD if o.amsgrad else 0))

    def scalars(self, lr: float, step: int) -> np.ndarray:
        """decay, weight_decay, beta1, beta2, step size, eps' in the parameters' dtype, computed
        in float64 as the graph's float64 scalars are (optimizers.Adam._scalars)."""
        o = self.opt
        b1, b2 = o.betas
        t = np.float64(step)
        bc1 = np.float64(1.0) - np.power(np.float64(b1), t)
        bc2 = np.float64(1.0) - np.power(np.float64(b2), t)
        root = np.sqrt(bc2 / np.float64(1.0 - b2))
        step_size = (np.float64(lr) / bc1) * (root * np.float64(1.0 - b1))
        eps = np.float64(o.eps) * root
        decay = np.float64(1.0) - np.float64(lr) * np.float64(o.weight_decay)
        return np.array([decay, o.weight_decay, b1, b2, step_size, eps], np.float64) \
            .astype(self.dtype)


class FusedSGD(Fused):
    state, entry = ("momentum_buffer",), "og_sgd"

    def _flags(self) -> int:
        o = self.opt
        return ((_WD if o.weight_decay != 0 else 0) | (_MOMENTUM if o.momentum != 0 else 0)
                | (_DAMPENING if o.dampening != 0 else 0) | (_NESTEROV if o.nesterov else 0))

    def scalars(self, lr: float, step: int) -> np.ndarray:
        """lr, weight_decay, this step's momentum factor and 1 - dampening ((0, 1) on the first
        step: the buffer starts as the gradient), momentum; as optimizers.SGD._scalars."""
        o = self.opt
        first = step == 1
        return np.array([lr, o.weight_decay, 0.0 if first else o.momentum,
                         1.0 if first else 1.0 - o.dampening, o.momentum], np.float64) \
            .astype(self.dtype)


_KERNELS = {SGD: FusedSGD, Adam: FusedAdam, AdamW: FusedAdam}
