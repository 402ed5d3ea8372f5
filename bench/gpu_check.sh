#!/usr/bin/env bash
# The GPU check: run once on a CUDA machine, from a checkout of this repository.
#
#   bash bench/gpu_check.sh                 # every GPU this machine has
#   NPROC=1 bash bench/gpu_check.sh         # one GPU only
#
# It installs the GPU environment from its lock into .venv-gpu (locks/gpu.txt: Prefect worker, ragen, vLLM and
# DeepSpeed with vLLM's CUDA torch, psycopg2 for a PostgreSQL Optuna storage, pytest for the suite), then trains
# with rollout.backend=vllm and trainer.backend=deepspeed on CUDA:
#   1. experiments/smoke.yaml (tiny model), on one GPU;
#   2. experiments/demo.yaml (the default model, LoRA), 5 iterations, on one GPU;
#   3. the same demo on NPROC GPUs (`ragen train --nproc`), if the machine has more than one;
# and prints per run the rollout tok/s (vLLM inside `ragen train`) and update tok/s, from the runs'
# history, as one JSON object per line; the last line is all of them together.
# Everything goes under RAGEN_DATA_DIR (default ./data-gpu-check); nothing leaves the machine.
# Needs: the Python the lock was resolved for (3.11), an NVIDIA driver (nvidia-smi) recent enough for the lock's
# CUDA (580.65.06 for CUDA 13.0), about 15 GB of disk for the environment. Both are checked before installing.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the lock needs, read from the lock's own inputs so that a re-resolved lock carries its requirements along.
# The Python: locks/gpu.txt holds wheels for the version locks/compile.sh resolves it for (--python-version).
NEED_PYTHON="$(sed -nE 's/.*--python-version ([0-9]+\.[0-9]+).*/\1/p' locks/compile.sh | head -n1)"
# The CUDA of the locked torch: its runtime's pin (nvidia-cuda-runtime==13.0.96 for CUDA 13; the CUDA 12 wheels
# were named nvidia-cuda-runtime-cu12), major.minor.
LOCK_CUDA="$(sed -nE 's/^nvidia-cuda-runtime(-cu[0-9]+)?==([0-9]+\.[0-9]+)\..*/\2/p' locks/gpu.txt | head -n1)"
# The oldest Linux driver that runs it, from NVIDIA's CUDA Toolkit release notes ("CUDA Driver": the minimum driver
# for CUDA minor version compatibility, and the toolkit's own driver) and docs.nvidia.com/deploy/cuda-compatibility:
#   CUDA 13.x: >= 580 (the R580 branch); CUDA 13.0 GA's driver is >= 580.65.06, the first R580 release for Linux.
#   CUDA 12.x: >= 525.60.13.
case "${LOCK_CUDA%%.*}" in
  13) MIN_DRIVER=580.65.06 ;;
  12) MIN_DRIVER=525.60.13 ;;
  *) MIN_DRIVER="" ;;
esac
[[ -n "$NEED_PYTHON" ]] || { echo "gpu_check: no --python-version in locks/compile.sh" >&2; exit 1; }
[[ -n "$MIN_DRIVER" ]] || {
  echo "gpu_check: no driver minimum for the lock's CUDA '${LOCK_CUDA:-?}' (nvidia-cuda-runtime pin in locks/gpu.txt)" \
    "in bench/gpu_check.sh: add it from NVIDIA's CUDA release notes" >&2
  exit 1
}
VENV="${VENV:-.venv-gpu}"
PY="$VENV/bin/python"
export RAGEN_DATA_DIR="${RAGEN_DATA_DIR:-$PWD/data-gpu-check}"
export PREFECT_HOME="${PREFECT_HOME:-$RAGEN_DATA_DIR/prefect}"   # its own ephemeral Prefect database
export PREFECT_SERVER_ANALYTICS_ENABLED=false
unset PIP_CONSTRAINT   # constraints.txt pins the CPU torch; the GPU lock brings its own

command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: this is not a CUDA machine" >&2; exit 1; }
driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1)" || true
driver="${driver//[[:space:]]/}"
if [[ -z "$driver" || "$(printf '%s\n' "$MIN_DRIVER" "$driver" | sort -V | head -n1)" != "$MIN_DRIVER" ]]; then
  echo "gpu_check: locks/gpu.txt's torch is built for CUDA $LOCK_CUDA, which needs NVIDIA driver >= $MIN_DRIVER;" \
    "found ${driver:-none (nvidia-smi gave no driver_version)}: upgrade the driver" >&2
  exit 1
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
gpus="$(nvidia-smi --list-gpus | wc -l)"
NPROC="${NPROC:-$gpus}"

# The interpreter the environment has (an existing $VENV), else the one it would be made with.
if [[ -x "$PY" ]]; then
  base="$PY" fix="remove $VENV and run again with python$NEED_PYTHON installed"
else
  base="$(command -v "python$NEED_PYTHON" || command -v python3 || true)" fix="install python$NEED_PYTHON"
fi
found="$([[ -n "$base" ]] && "$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)"
if [[ "$found" != "$NEED_PYTHON" ]]; then
  echo "gpu_check: locks/gpu.txt is resolved for Python $NEED_PYTHON; found" \
    "${found:-no python$NEED_PYTHON or python3 that runs}${found:+ ($base)}: $fix" >&2
  exit 1
fi

if [[ ! -f "$VENV/.ragen-gpu-installed" || locks/gpu.txt -nt "$VENV/.ragen-gpu-installed" ]]; then
  test -x "$PY" || "$base" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q --no-deps -r locks/gpu.txt   # every dependency is in the lock
  "$PY" -m pip install -q --no-deps -e .
  "$PY" -m pip check
  touch "$VENV/.ragen-gpu-installed"
fi
"$PY" - <<'EOF'
import torch, vllm, deepspeed, prefect, psycopg2, pytest
assert torch.cuda.is_available(), "torch does not see a GPU"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, "
      f"deepspeed {deepspeed.__version__}, prefect {prefect.__version__}, {torch.cuda.device_count()} GPU(s)")
EOF

GPU_SETTINGS=(--set rollout.backend=vllm --set trainer.backend=deepspeed --set model.device=cuda)
stamp="$(date +%Y%m%d-%H%M%S)"
results=()

run() {  # name, nproc, experiment, extra args...
  local name="$1-$stamp" nproc="$2" exp="$3"
  shift 3
  echo "== $name: ragen train $exp --nproc $nproc ${GPU_SETTINGS[*]} $*" >&2
  local visible
  visible="$(seq -s, 0 $((nproc - 1)))"
  CUDA_VISIBLE_DEVICES="$visible" "$VENV/bin/ragen" train "$exp" --run-name "$name" --nproc "$nproc" \
    "${GPU_SETTINGS[@]}" "$@" >&2
  results+=("$("$PY" - "$name" "$nproc" <<'EOF'
import json, statistics, sys
from ragen_core.store.run_dir import RunDir
name, nproc = sys.argv[1], int(sys.argv[2])
rows = [r for r in RunDir.find(name).read_history() if "perf/rollout_tokens_per_s" in r]
later = rows[1:] or rows  # the first iteration includes vLLM's and DeepSpeed's start-up work
mean = lambda key: round(statistics.fmean(r[key] for r in later), 1)
print(json.dumps({"run": name, "gpus": nproc, "iterations": len(rows),
                  "rollout_tok_s": mean("perf/rollout_tokens_per_s"), "update_tok_s": mean("perf/update_tokens_per_s"),
                  "rollout_s": mean("timing/rollout_s"), "update_s": mean("timing/update_s")}))
EOF
)")
  echo "${results[-1]}"
}

run smoke 1 experiments/smoke.yaml
run demo 1 experiments/demo.yaml --set trainer.iterations=5 --set eval.every=0
if (( NPROC > 1 )); then
  run demo-x"$NPROC" "$NPROC" experiments/demo.yaml --set trainer.iterations=5 --set eval.every=0
fi
printf '%s\n' "${results[@]}" | "$PY" -c "import json, sys; print(json.dumps([json.loads(l) for l in sys.stdin]))"
