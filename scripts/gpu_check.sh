#!/usr/bin/env bash
# The GPU check, one command (under 8 minutes on one H200). Results land in bench/results/ (and in
# $OUT too when set, as on the device machine). Needs torch with CUDA; nvtx, gradio and plotly are not needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The checkout on the import path for a machine where the package is not installed (`pip install -e .`
# finds it the same way); nothing in Python edits sys.path.
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device visible"; print(torch.__version__, torch.cuda.get_device_name(0))'
# Optional packages the image may lack: each one's feature degrades (and says so), nothing stops.
"$PY" -c 'import importlib.util as u; m = [n for n in ("orjson", "nvtx", "pynvml") if u.find_spec(n) is None]; print("optional packages missing:", ", ".join(m) or "none", "(orjson: slower trace parsing; nvtx: torch.cuda.nvtx ranges instead; pynvml: no NVML samples)")'
"$PY" -c 'import numpy, pandas, yaml, scipy' || { echo "numpy, pandas, pyyaml and scipy are needed (pip install -r requirements.txt)"; exit 2; }
# torchao for the fp8 rows: a machine without internet installs the wheel carried in wheels/ (README,
# "GPU extras"); without either, the fp8 rows say torchao is missing and the other rows run.
if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torchao") is None)'; then
  if compgen -G "wheels/torchao-*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps wheels/torchao-*.whl || echo "torchao wheel did not install: fp8 rows will say so"
  else
    echo "torchao is not installed and wheels/ has no torchao wheel: the fp8 rows will say so"
  fi
fi
status=0
"$PY" scripts/gpu_check.py "$@" || status=$?
if [[ -n "${OUT:-}" ]]; then
  cp bench/results/gpu_check_*.md bench/results/gpu_check_*.json "$OUT"/ 2>/dev/null || true
fi
exit $status
