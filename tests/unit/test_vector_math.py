"""vector_math.resolve: every op torch hands to MKL's vector math is called once on one element of each float dtype,
and a fresh process's first parallel call is then accurate."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ragen_core import vector_math

ROOT = Path(__file__).resolve().parents[2]


def test_the_ops_are_those_the_installed_torch_routes_to_mkl() -> None:
    header = Path(torch.__file__).parent / "include" / "ATen" / "cpu" / "vml.h"
    assert header.is_file(), f"torch's vector math header is not at {header}"
    # the uncommented IMPLEMENT_VML_MKL(op, MklOp) lines; "// IMPLEMENT_VML_MKL(cosh, Cosh)" is off
    routed = set(re.findall(r"^IMPLEMENT_VML_MKL\((\w+),", header.read_text(), flags=re.MULTILINE))
    assert {"cos", "exp", "log", "sqrt"} <= routed  # the pattern still reads the header
    assert routed == set(vector_math.VML_OPS)


class _Calls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in vector_math.VML_OPS:
            self.seen.append((func.__name__.split(".")[0], args[0].dtype, args[0].numel()))
        return out


def test_resolve_calls_each_op_on_one_element_of_each_float_dtype() -> None:
    calls = _Calls()
    with calls:
        vector_math.resolve.__wrapped__()  # the body itself: the cached one may have run already in this process
    wanted = {(op, dtype) for op in vector_math.VML_OPS for dtype in (torch.float32, torch.float64)}
    assert {(op, dtype) for op, dtype, _ in calls.seen} == wanted
    # torch splits a tensor among its threads only past 2,048 elements: one element runs on the calling thread
    assert {n for _, _, n in calls.seen} == {1}


FIRST_COS = """
import torch
torch.set_num_threads(2)
from ragen_core import vector_math
vector_math.resolve()
x = torch.linspace(0.1, 30.0, 2432)  # two chunks: each of the 2 threads calls MKL on one
first = x.cos()
exact = x.double().cos()
print(((first.double() - exact).abs() / exact.abs().clamp(min=1e-30)).max().item() / torch.finfo(torch.float32).eps)
"""


def test_a_fresh_process_first_parallel_cos_is_accurate_once_resolved() -> None:
    """Without resolve(), about one such process in seven has a chunk off by ~1,282 ulp (torch 2.13's oneMKL
    2024.2): six processes catch that in most runs, not every one."""
    errors = [float(subprocess.run([sys.executable, "-c", FIRST_COS], cwd=ROOT, capture_output=True, text=True,
                                   check=True, timeout=120).stdout)
              for _ in range(6)]
    assert max(errors) <= 1.0, errors
