"""Random Keras models, exported, converted and differentiated, against TF's tape in float64
(tests/keras_gen.py), not derandomized: ``python bench/fuzz_keras.py --runs 4 --examples 50
--seed 1``. Each run is one hypothesis search; a failure is shrunk and printed, and the next
run goes on. ``--converter tf2onnx`` converts with tf2onnx (``pip install tf2onnx``) instead
of onnxgrad's converter, and compares the input's gradient alone (its graphs fold and rename
the weights)."""
from __future__ import annotations

import argparse

from fuzz_runs import main, tests_on_path

tests_on_path()
import keras_gen  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--converter", choices=["onnxgrad", "tf2onnx"], default="onnxgrad")
    known, rest = ap.parse_known_args()
    keras_gen.CONVERTER = known.converter
    main(__doc__, keras_gen, keras_gen.models(), "layers", rest)
