"""Random Keras models, exported, converted and differentiated, against TF's tape in float64
(tests/keras_gen.py), not derandomized: ``python bench/fuzz_keras.py --runs 4 --examples 50
--seed 1``. Each run is one hypothesis search; a failure is shrunk and printed, and the next
run goes on."""
from __future__ import annotations

from fuzz_runs import main, tests_on_path

tests_on_path()
import keras_gen  # noqa: E402

if __name__ == "__main__":
    main(__doc__, keras_gen, keras_gen.models(), "layers")
