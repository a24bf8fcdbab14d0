#!/usr/bin/env bash
# Everything a session lent a GPU checks there, as one bounded script (device time is scarce):
#   bash bench/gpu_checks.sh OUTDIR
# It needs onnxruntime-gpu importable and a CUDA build of torch (its nvidia-* wheels hold the
# CUDA, cuBLAS and cuDNN libraries onnxruntime loads). Each step has its own time limit and
# its log in OUTDIR; a failing step does not stop the next one.
set -u
OUT=${1:-/tmp/onnxgrad-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
LIBS=$(find "$SITE/nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
export LD_LIBRARY_PATH=${LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 60 "$OUT/$name.log"
  echo "=== $name rc $rc"
}

nvidia-smi -L
python3 -c "import onnxruntime as o, torch; print('onnxruntime', o.__version__, \
o.get_available_providers()); print('torch', torch.__version__, torch.cuda.is_available())"
python3 -c "from onnxgrad.runtime import cuda_available as c; print('cuda session:', c())"

step tests 240 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_cuda.py \
  "tests/test_rnn.py::test_cuda_backward_matches_cpu"
step rnn_gpu 90 python3 bench/rnn_gpu.py
step nccl 90 torchrun --nproc-per-node 1 -m onnxgrad train models/digits_mlp.onnx \
  --loss cross_entropy --data models/digits.npz --epochs 2 --batch-size 64 --lr 1e-2 \
  -o "$OUT/trained.onnx" --distributed --device cuda --no-progress
rm -f "$OUT/trained.onnx"
step train_gpu "${TRAIN_SECONDS:-300}" python3 bench/train_gpu.py --rounds 1 --repeat 3 \
  --steps 30 --warmup 5 --json "$OUT/train_gpu.json" ${TRAIN_ROWS:+--rows $TRAIN_ROWS}
