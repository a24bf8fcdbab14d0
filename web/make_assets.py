"""Write the browser trainer's bundled assets into web/assets/ (same bytes every run):

    python web/make_assets.py

digits.bin             the digits of models/digits.npz in a compact form the page fetches:
                       b"OGDIGIT1", then uint32 little-endian rows_train, rows_val, features (64),
                       classes (10); then uint8 pixels (x * 16, the 0..16 counts of scikit-learn's
                       digits) row after row, the training rows first; then one uint8 label per row.
                       The split is `onnxgrad train --val-split 0.2 --seed 0`'s.
digits_step.*          `onnxgrad export-train-step models/digits_mlp.onnx --loss cross_entropy
                       --optimizer adamw --lr 1e-2 --target web -o web/assets/digits_step.onnx`
"""
from __future__ import annotations

import os
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MAGIC = b"OGDIGIT1"
VAL_SPLIT, SEED = 0.2, 0


def split(n: int):
    """(train rows, validation rows) as `onnxgrad train --val-split 0.2 --seed 0` takes them."""
    order = np.random.default_rng(SEED).permutation(n)
    n_val = int(round(n * VAL_SPLIT))
    return order[n_val:], order[:n_val]


def digits_bin(npz: str) -> bytes:
    with np.load(npz) as z:
        x, y = z["x"], z["y"]
    px = x * 16
    if not np.array_equal(px, np.round(px)) or px.min() < 0 or px.max() > 16:
        raise ValueError(f"{npz}: x is not k/16 for k in 0..16: the uint8 form would lose data")
    tr, va = split(len(x))
    rows = np.concatenate([tr, va])
    head = MAGIC + struct.pack("<4I", len(tr), len(va), x.shape[1], int(y.max()) + 1)
    return head + px[rows].astype(np.uint8).tobytes() + y[rows].astype(np.uint8).tobytes()


def main(out: str = os.path.join(HERE, "assets")) -> None:
    sys.path.insert(0, ROOT)
    from onnxgrad.runtime import atomic_path
    from onnxgrad.training import AdamW
    from onnxgrad.training.webstep import export_web_step

    os.makedirs(out, exist_ok=True)
    with atomic_path(os.path.join(out, "digits.bin"), ".bin") as tmp, open(tmp, "wb") as f:
        f.write(digits_bin(os.path.join(ROOT, "models", "digits.npz")))
    export_web_step(os.path.join(ROOT, "models", "digits_mlp.onnx"), "cross_entropy",
                    os.path.join(out, "digits_step.onnx"), optimizer=AdamW(lr=1e-2))
    print(f"wrote digits.bin and digits_step.{{onnx,model.onnx,json}} to {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
