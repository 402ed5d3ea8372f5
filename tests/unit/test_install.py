"""The install's torch step (locks/install-torch.sh): where neither a local wheel source nor PyTorch's CPU wheel
index can be had, it stops with one line that names the index, before pip says anything deep in a log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_without_a_source_for_the_cpu_torch_the_install_stops_with_one_line_naming_the_index(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=240)
    # no pip configuration (so no local wheel source), and an index address nothing listens on
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, RAGEN_TORCH_INDEX="http://127.0.0.1:9/whl/cpu")
    out = subprocess.run(["bash", "locks/install-torch.sh", str(venv / "bin" / "python")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("error: torch==") and "+cpu" in lines[0]
    assert "http://127.0.0.1:9/whl/cpu" in lines[0]
    assert not list(venv.glob("lib/python*/site-packages/torch"))
