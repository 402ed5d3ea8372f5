"""ragen_core/memory.py's huge pages: the switch is set for torch unless set already, and the `ragen` command's
processes run with it (their large tensors on 2 MiB pages where the kernel gives them).

Run: .venv/bin/python -m pytest tests/unit/test_memory.py -q
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ragen_core import memory

ROOT = Path(__file__).resolve().parents[2]


def test_use_huge_pages_sets_the_switch_and_keeps_an_explicit_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory.HUGE_PAGES_ENV, raising=False)
    memory.use_huge_pages()
    assert memory.HUGE_PAGES_ENV == "THP_MEM_ALLOC_ENABLE"  # the name torch's CPU allocator reads
    assert os.environ[memory.HUGE_PAGES_ENV] == "1"
    monkeypatch.setenv(memory.HUGE_PAGES_ENV, "0")
    memory.use_huge_pages()
    assert os.environ[memory.HUGE_PAGES_ENV] == "0"


def _kernel_gives_huge_pages() -> bool:
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return bool(re.search(r"\[(always|madvise)\]", setting))


def test_the_ragen_command_runs_torch_on_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command of `ragen` (main) sees the switch on; where the kernel gives huge pages, a large tensor it makes
    lies on them (AnonHugePages of the process grows)."""
    monkeypatch.delenv(memory.HUGE_PAGES_ENV, raising=False)
    code = ("import os, re, sys\n"
            "import flows.cli as c\n"
            "@c.app.command('probe')\n"
            "def probe() -> None:\n"
            "    import torch\n"
            "    def huge() -> int:\n"
            "        text = open('/proc/self/smaps_rollup').read()\n"
            "        return int(re.search(r'AnonHugePages:\\s+(\\d+)', text).group(1))\n"
            "    before = huge()\n"
            "    x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched\n"
            "    print(os.environ.get('THP_MEM_ALLOC_ENABLE'), huge() - before, int(x[0]))\n"
            "c.main()\n")
    out = subprocess.run([sys.executable, "-c", code, "probe"], capture_output=True, text=True, check=False,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    switch, grown_kib, _ = out.stdout.split()
    assert switch == "1"
    if _kernel_gives_huge_pages() and Path("/proc/self/smaps_rollup").exists():
        assert int(grown_kib) >= 32 * 1024  # at least half of the 64 MiB on 2 MiB pages
