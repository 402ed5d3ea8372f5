"""bench/gpu_probe.py with ``--device cpu``: the same code the GPU probe runs, at small shapes, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_probe_runs_on_the_cpu() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_probe.py"), "--device", "cpu"], cwd=ROOT,
                         capture_output=True, text=True, timeout=180, check=False)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and result["pass"], (result.get("failed"), out.stderr[-3000:])
    sections = result["sections"]
    assert set(sections) == {"matmul", "update", "lr_1e6", "rollout", "train"}
    updates = {k: v for k, v in sections["update"].items() if isinstance(v, dict)}
    assert len(updates) == 8 and all(v["mfu"] > 0 and v["tokens_per_s"] > 0 for v in updates.values())
    lr = sections["lr_1e6"]
    assert 0.9 < lr["bf16_over_fp32"] < 1.1 and lr["trap_over_fp32"] < 0.5
    assert sections["rollout"]["fast_decode"] and sections["rollout"]["tok_s"] > 0
    assert sections["train"]["pass"]
    assert {k for k, v in sections["train"].items() if isinstance(v, dict)} == {"starpo-s", "starpo-lora"}
    assert sections["train"]["starpo-lora"]["kl_ref_logged_at"] == [0]  # 2 iterations, the KL logged every 2nd
