#!/usr/bin/env bash
# The GPU check: run once on a CUDA machine, from a checkout of this repository.
#
#   bash bench/gpu_check.sh                 # every GPU this machine has
#   NPROC=1 bash bench/gpu_check.sh         # one GPU only
#
# It installs the GPU environment from its lock into .venv-gpu (locks/gpu.txt: Prefect worker, ragen, vLLM and
# DeepSpeed with vLLM's CUDA torch), then trains with rollout.backend=vllm and trainer.backend=deepspeed on CUDA:
#   1. experiments/smoke.yaml (tiny model), on one GPU;
#   2. experiments/demo.yaml (the default model, LoRA), 5 iterations, on one GPU;
#   3. the same demo on NPROC GPUs (`ragen train --nproc`), if the machine has more than one;
# and prints per run the rollout tok/s (vLLM inside `ragen train`) and update tok/s, from the runs'
# history, as one JSON object per line; the last line is all of them together.
# Everything goes under RAGEN_DATA_DIR (default ./data-gpu-check); nothing leaves the machine.
# Needs: python3.11, an NVIDIA driver (nvidia-smi), about 15 GB of disk for the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-gpu}"
PY="$VENV/bin/python"
export RAGEN_DATA_DIR="${RAGEN_DATA_DIR:-$PWD/data-gpu-check}"
export PREFECT_HOME="${PREFECT_HOME:-$RAGEN_DATA_DIR/prefect}"   # its own ephemeral Prefect database
export PREFECT_SERVER_ANALYTICS_ENABLED=false
unset PIP_CONSTRAINT   # constraints.txt pins the CPU torch; the GPU lock brings its own

command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: this is not a CUDA machine" >&2; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
gpus="$(nvidia-smi --list-gpus | wc -l)"
NPROC="${NPROC:-$gpus}"

if [[ ! -f "$VENV/.ragen-gpu-installed" || locks/gpu.txt -nt "$VENV/.ragen-gpu-installed" ]]; then
  test -x "$PY" || python3.11 -m venv "$VENV" || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q --no-deps -r locks/gpu.txt   # every dependency is in the lock
  "$PY" -m pip install -q --no-deps -e .
  "$PY" -m pip check
  touch "$VENV/.ragen-gpu-installed"
fi
"$PY" - <<'EOF'
import torch, vllm, deepspeed, prefect
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
