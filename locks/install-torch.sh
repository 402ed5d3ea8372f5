#!/usr/bin/env bash
# Install the CPU build of torch that locks/cpu.txt pins (torch==X+cpu) into the environment of python $1.
#   bash locks/install-torch.sh .venv/bin/python        (make install runs it before the lock)
# PyPI's Linux torch is the CUDA build; the +cpu builds are published on PyTorch's CPU wheel index
# ($RAGEN_TORCH_INDEX, default below). A local wheel source already configured for pip (its find-links) is
# tried first, with no index at all: where it holds the wheel, nothing else is contacted. Otherwise the index
# is probed once (15 s) and, when unreachable, the install stops with one line that names it.
set -euo pipefail
cd "$(dirname "$0")/.."
py="$1"
index="${RAGEN_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
pin="$(grep -E '^torch==' locks/cpu.txt)"
version="${pin#torch==}"
if "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != sys.argv[1])" "$version" 2>/dev/null
then
  exit 0  # already installed
fi
if "$py" -m pip install -q --no-deps --no-index "$pin" >/dev/null 2>&1; then
  exit 0  # from the local wheel source
fi
if ! "$py" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=15)" "$index" \
     >/dev/null 2>&1; then
  echo "error: $pin is published on PyTorch's CPU wheel index $index, which cannot be reached from here, and no" \
       "local wheel source configured for pip holds it: make that index reachable (or set RAGEN_TORCH_INDEX to a" \
       "mirror of it), or put the wheel in a folder named in pip's find-links" >&2
  exit 1
fi
"$py" -m pip install -q --no-deps --index-url "$index" "$pin"
