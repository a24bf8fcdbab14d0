"""Adam and AdamW as one fused CPU pass per parameter, for the Trainer on CPU.

As ONNX ops AdamW is 12 passes over every parameter (``optimizers.Adam.update``), each memory
bound: 39 ms for ResNet-18's 11.2 M parameters at one thread, the whole gap of its training step
to PyTorch's. This module holds the same update as one C loop that reads p, g and the two sums
once and writes them once: 8.3 ms, as PyTorch's ``fused=True`` (8.4; bench/optimizer.py). The
C compiler of the machine (``$CC``, else ``cc``) builds it on first use into the user's cache;
without one the Trainer runs the ONNX optimizer graph as before
(``Trainer(fused_optimizer="auto")``). The ONNX graph stays
the definition: exported train steps, data-parallel, browser and CUDA training use it, and the
tests hold the two to each other.

The loop does what the graph's nodes do, in the same order and float type, each operation
rounded on its own (no contraction into FMA, no fast-math): with the same scalars the results
are the graph's, bit for bit. The scalars (step size, eps', decay) are computed here in float64
as the graph computes them (``optimizers.Adam._scalars`` with float64 scalars) and cast once.
A step whose loss is not finite does not call the kernel at all (the graph gates its update by
the same test).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from .optimizers import Adam, AdamW

_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>

typedef struct { void *p; const void *g; void *s1; void *s2; void *smax; int64_t n; } og_slot;
typedef struct { const og_slot *sl; int ns; const void *k; int flags; int64_t lo, hi; } og_job;

enum { DECOUPLED = 1, L2 = 2, AMSGRAD = 4 };

/* k: decay, weight_decay, beta1, beta2, step_size, eps'. Elements [lo, hi) of the parameters
   laid end to end; the same expressions as the ONNX nodes, each rounded to T. */
#define OG_ADAM(NAME, T, SQRT)                                                               \
static void NAME(const og_job *j) {                                                          \
    const T *k = (const T *)j->k;                                                            \
    const T decay = k[0], wd = k[1], b1 = k[2], b2 = k[3], step = k[4], eps = k[5];          \
    int64_t base = 0;                                                                        \
    for (int s = 0; s < j->ns; base += j->sl[s].n, s++) {                                    \
        int64_t a = j->lo > base ? j->lo - base : 0;                                         \
        int64_t b = j->hi - base < j->sl[s].n ? j->hi - base : j->sl[s].n;                   \
        T *restrict p = (T *)j->sl[s].p;                                                     \
        const T *restrict g = (const T *)j->sl[s].g;                                         \
        T *restrict m = (T *)j->sl[s].s1, *restrict v = (T *)j->sl[s].s2;                    \
        T *restrict mx = (T *)j->sl[s].smax;                                                 \
        if (j->flags == DECOUPLED) {            /* AdamW: the common case, vectorised */     \
            for (int64_t i = a; i < b; i++) {                                                \
                T gi = g[i], pi = p[i] * decay;                                              \
                T mi = m[i] * b1 + gi, vi = v[i] * b2 + gi * gi;                             \
                m[i] = mi; v[i] = vi;                                                        \
                p[i] = pi - mi / (SQRT(vi) + eps) * step;                                    \
            }                                                                                \
            continue;                                                                        \
        }                                                                                    \
        for (int64_t i = a; i < b; i++) {                                                    \
            T gi = g[i], pi = p[i];                                                          \
            if (j->flags & DECOUPLED) pi = pi * decay;                                       \
            if (j->flags & L2) gi = gi + p[i] * wd;                                          \
            T mi = m[i] * b1 + gi, vi = v[i] * b2 + gi * gi;                                 \
            m[i] = mi; v[i] = vi;                                                            \
            if (j->flags & AMSGRAD) { vi = mx[i] >= vi ? mx[i] : vi; mx[i] = vi; }           \
            p[i] = pi - mi / (SQRT(vi) + eps) * step;                                        \
        }                                                                                    \
    }                                                                                        \
}
OG_ADAM(og_adam_f32, float, sqrtf)
OG_ADAM(og_adam_f64, double, sqrt)

static void *og_run(void *arg) {
    const og_job *j = (const og_job *)arg;
    if (j->flags & 8) og_adam_f64(j); else og_adam_f32(j);
    return 0;
}

/* Split the elements into `threads` ranges (multiples of 64) and run them in parallel. */
int og_adam(const og_slot *sl, int ns, const void *k, int flags, int is_double, int threads) {
    int64_t total = 0;
    for (int s = 0; s < ns; s++) total += sl[s].n;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (total < 65536 * (int64_t)threads) threads = 1;
    og_job jobs[64];
    pthread_t tid[64];
    int started[64] = {0};
    for (int t = 0; t < threads; t++) {
        int64_t lo = total * t / threads, hi = total * (t + 1) / threads;
        lo -= lo % 64; if (t + 1 < threads) hi -= hi % 64; else hi = total;
        og_job jb = {sl, ns, k, flags | (is_double ? 8 : 0), lo, hi};
        jobs[t] = jb;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tid[t], 0, og_run, &jobs[t]) == 0;
    og_run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], 0); else og_run(&jobs[t]);
    }
    return 0;
}
"""

# no -ffast-math, no -march: every operation rounded as onnxruntime's kernels round it
_FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared", "-pthread"]


class _Slot(ctypes.Structure):
    _fields_ = [("p", ctypes.c_void_p), ("g", ctypes.c_void_p), ("s1", ctypes.c_void_p),
                ("s2", ctypes.c_void_p), ("smax", ctypes.c_void_p), ("n", ctypes.c_int64)]


_lib: ctypes.CDLL | None = None
_why: str | None = None


def _cache_dir() -> str:
    base = os.environ.get("ONNXGRAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "onnxgrad")
    return base


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
    lib.og_adam.argtypes = [ctypes.POINTER(_Slot), ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_int, ctypes.c_int]
    lib.og_adam.restype = ctypes.c_int
    return lib


def unsupported(optimizer, clip_norm, dtypes=None) -> str | None:
    """Why this step cannot take the fused update (None when it can; ``dtypes``, the
    parameters' dtypes, are checked when given)."""
    if type(optimizer) not in (Adam, AdamW):
        return f"{type(optimizer).__name__} has no fused kernel (Adam and AdamW have)"
    if clip_norm is not None:
        return "clip_norm needs the norm of all gradients first"
    if dtypes is None:
        return None
    kinds = {np.dtype(d) for d in dtypes}
    if len(kinds) != 1 or kinds.pop() not in (np.dtype(np.float32), np.dtype(np.float64)):
        return "the parameters are not all float32 or all float64"
    return None


class FusedAdam:
    """Applies ``optimizer`` (Adam or AdamW) to parameter, gradient and state buffers in place:
    ``apply(params, grads, states, lr, step)`` with buffers as raw addresses and sizes."""

    def __init__(self, optimizer: Adam, dtype, threads: int):
        lib = library()
        if lib is None:
            raise RuntimeError(unavailable())
        self.lib, self.opt, self.threads = lib, optimizer, max(1, int(threads))
        self.dtype = np.dtype(dtype)
        wd = optimizer.weight_decay
        self.flags = ((1 if optimizer.decoupled and wd != 0 else 0)
                      | (2 if not optimizer.decoupled and wd != 0 else 0)
                      | (4 if optimizer.amsgrad else 0))

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

    def apply(self, slots: list[tuple[int, int, int, int, int, int]], lr: float,
              step: int) -> None:
        """slots: (p, g, s1, s2, smax or 0, number of elements) per parameter."""
        arr = (_Slot * len(slots))(*[_Slot(*s) for s in slots])
        k = self.scalars(lr, step)
        self.lib.og_adam(arr, len(slots), k.ctypes.data, self.flags,
                         int(self.dtype == np.float64), self.threads)
