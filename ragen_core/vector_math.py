"""MKL's vector math set up on one thread before a process's first large float op, so that no op is computed at low
accuracy.

    from ragen_core import vector_math
    vector_math.resolve()   # idempotent; load_model calls it (ragen_core/models/loading.py)

On a CPU, torch hands a contiguous float32 or float64 tensor's cos, sin, exp, log, sqrt, tanh, erf and a few more
to MKL's vector math (VML; ``ATen/cpu/vml.h``); a tensor of more than 2,048 elements is split among the intra-op
threads, each calling it on its own chunk. The oneMKL that torch's wheels bundle (2024.2) picks its kernels on the
process's first VML call, and when that first call runs on several threads at once, one thread can run a
low-accuracy kernel on its whole chunk, though the call asks for high accuracy (pytorch/pytorch#188792; oneMKL 2025.0
and later do not show it). Later calls are right: only that first call can be wrong, but what it computed stays
wrong wherever it is kept.

After one call on a single element, made on one thread, the first call split among threads was right in every fresh
process tried. Left as it was, the first rotary embedding of a run
(a prefill's ``cos``) could be that call, and a seeded run then sampled other tokens in some processes
(docs/benchmarks.md has the counts).

:func:`resolve` makes one single-element call of each op that torch routes to VML, in float32 and float64 (the
header's ``IMPLEMENT_VML_MKL`` list, which the test checks against the installed torch). A single element is not
split, so the call runs on the calling thread alone. Where torch has no MKL the same ops run torch's own vectorised
code, and the calls cost microseconds.

Tests: ``.venv/bin/python -m pytest tests/unit/test_vector_math.py -q``.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["VML_OPS", "resolve"]

VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt", "tan",
           "tanh", "trunc")
"""The torch ops whose float32 and float64 CPU kernels call MKL's vector math (``IMPLEMENT_VML_MKL`` in
``ATen/cpu/vml.h``)."""


@functools.cache
def resolve() -> None:
    """Call each of :data:`VML_OPS` once on one element of each float dtype, on this thread (once a process)."""
    with torch.inference_mode():
        for dtype in (torch.float32, torch.float64):
            one = torch.full((1,), 0.5, dtype=dtype)  # inside every op's domain (acos, erfinv, log ...)
            for op in VML_OPS:
                getattr(torch, op)(one)
