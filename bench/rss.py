"""Resident memory of this process, for the benchmarks' sides (stdlib only: it also runs in the
onnxruntime-training environment, bench/ort_training_side.py)."""


def rss_mb(field="VmRSS"):
    """This process's resident memory (VmRSS) or its peak (VmHWM) in MB. Not ru_maxrss: Linux
    carries that over from the parent through fork and exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")
