"""argparse types shared by the command-line modules (onnxgrad/cli.py, onnxgrad/training/cli.py):
each turns a bad value into argparse's own one-line error naming the option."""
from __future__ import annotations

import argparse
import math


def _checked(text: str, kind, ok, need: str):
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"{text!r} {need}")
    return v


def positive_float(text: str) -> float:
    return _checked(text, float, lambda v: 0 < v < math.inf, "must be a positive finite number")


def finite_float(text: str) -> float:
    return _checked(text, float, math.isfinite, "must be a finite number")


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "must be at least 1")


def seed(text: str) -> int:
    return _checked(text, int, lambda v: v >= 0, "is not a seed (an integer >= 0)")
