"""Decode attention on CPU as one fused kernel, compiled at first use for the CPU it runs on.

A decode step has one query token per row: the query heads that share a key/value head are that head's few
query rows (3 for SmolLM2), and each (row, key/value head) reads its own keys and values once. That is
memory-bound work of tiny matrix products, which torch's CPU flash kernel runs as small GEMMs with a block
softmax: at 64 rows over 271 cached tokens it takes about twice as long as just reading the keys and values
once (55-58 ms of attention per 30-layer decode step, against 21-29 ms). The kernel here does, per (row,
key/value head), in one pass over the cache and in registers: the query rows' dot products with each key, the
softmax (ATen's vectorised ``exp``), and the probability-weighted sum of the values; it returns the
log-sum-exp too: 35-40 ms at the same shapes. Where torch runs AVX512, a row's scores go 16 keys at a time:
their lane-wise partial dot products, then the 16 sums in one transposing reduction tree instead of 16
horizontal sums (one call: 0.80 against 0.92 ms at 64 rows over 271 columns, 1.60 against 1.83 ms at 32 rows
over 1000, a later turn's own cache); where it runs AVX2 only, 8 keys at a time the same way (0.84-0.91 against
1.08-1.13 ms for the plain loop at 64 rows over 271 columns, one thread, torch told to run AVX2 on an AVX512
machine; alike at 32 rows over 1000), and elsewhere a plain loop. Long caches are then bound by reading the keys
and values from memory.

The cache may be bf16 (the fast step's under bf16 compute): a bf16 is the top half of the fp32 of the same value,
so widening is a zero-extension and a shift. A row's own keys go 64 columns at a time, widened into a buffer that
stays in L1 and scored as above; values are widened in registers as they are weighted, once for the head's query
rows. A chunk of 64 columns that are all masked (a long left padding, a hole) is neither scored nor read. Timed at
26 rows over 900 columns, 30 layers, keys and values coming from memory: 36-40 ms a step against 49-57 ms for an
fp32 cache (with one layer's cache in L2, 3.6-4.0 against 3.0-3.1 ms: the widening's own cost); widening the values
into a buffer too took 54-55 ms. An fp32 cache is read ahead: a row's values are prefetched while its keys
are scored, and the next row's keys while its values are weighted (at 64 rows over 300 columns, 42 against 50 ms a
step); a bf16 cache is not: the same prefetches measured slower there.

Cascade attention (decode_step.SharedPrefix: the N responses of a prompt keep its keys and values once per
group) runs in the same call: given the shared columns and each row's group, a row's scores cover its group's
columns and then its own in one softmax, so nothing is stacked, gathered or merged in Python. The shared keys
come transposed (made once per rollout): a block of 32 keys is scored per query element with no horizontal
sums, which take most of the time of row-wise scoring (the own columns, few, keep the row-wise loop). At the demo's
shapes (64 rows in 8 groups, a 184-token prompt, 25 own tokens): 0.29 ms a layer, against 0.49 ms with the
row-wise scores and 0.73 ms for torch's flash kernel over each group's stacked query rows merged with this
kernel's own part by log-sum-exps. A group's keys are read once per row, but from cache (94 KB a head).

The same build carries the decode step's fp32 weight matmul for CPUs with AVX2 only (:func:`panel_linear`,
used where :func:`panels_pay`): a weight [N, K] packed as panels [N/16, K, 16] (:func:`pack_panels`), a register
tile of 6 rows by 2 vectors of columns running down a panel one cache line of weights per input element, the panels
split between the threads, each panel's first tile prefetching the next. A decode step's 540 MB of fp32 weights
come from memory, and oneDNN's AVX2 kernels wait for them: timed as a step runs them (30 layers' four matmuls and
the output layer, each weight its own), 129 against 160 ms at 64 rows, 26 against 43 ms at 8 (docs/benchmarks.md).

The build also carries the decode step's fused small ops (:func:`step_ops`: a norm with its cast, the rotary
embedding with the cache append, SiLU times up), each one pass over a step's few rows where torch runs several ops,
and the update's bf16 attention, forward and backward, for CPUs with AVX512-BF16 (:func:`segment_ops`; used by
``ragen_core/trainer/attention.py``), its products on AMX tiles through torch's oneDNN micro-kernel where the CPU
has AMX (:func:`segment_amx`).

No library offers this attention for a plain (non-paged) cache with its log-sum-exp: vLLM's CPU kernels need its
paged layout, torch's flash kernel is the one compared above. The source below is written into the build directory
and compiled at first use by ``torch.utils.cpp_extension.load`` (``$CXX``, else ``c++``, and ninja), announced by one
line on stderr that says what it builds and how it ended, for the vector instructions torch itself uses on the CPU
(AVX512 or AVX2: torch's own flags for them, not ``-march=native``, so that a build directory shared by several
machines never hands one a kernel with instructions it lacks). It includes only the ATen headers it uses, not
``torch/extension.h`` (which ``load_inline`` puts first): on 2 AVX512 cores that took a build from 47-54 s to 25 s
(parsing the headers from 28 to 8 s; the rest is the -O3 code generation). The build lives inside the Python
environment that made it (:func:`build_root`), so two virtual environments never rebuild each other's kernel.

A build can never leave a later run waiting: torch guards each build directory with a lock file that has no
owner and waits for it forever, so a process killed while holding it (Ctrl-C during a first rollout, a lost
machine) would hang every later load. Here a process first takes its own lock on the directory, which the
operating system releases when its holder dies, for at most ``LOCK_TIMEOUT_S``; a torch lock file found then
can only belong to a dead process and is removed (``ragen_core/torch_builds.py``). Without a compiler, where the
build fails or the lock is not had in time, or for a shape not instantiated (head sizes 32/64/128, up to 8 query
rows per key/value head), :func:`decode_attention` returns None and the caller uses
``scaled_dot_product_attention``; ``RAGEN_CPU_ATTENTION=0`` turns it off.

Run the tests: ``python -m pytest tests/unit/rollout/test_cpu_attention.py
tests/unit/rollout/test_cpu_attention_build.py -q``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import Timeout

from ragen_core.torch_builds import exclusive_build

__all__ = ["Panels", "Shared", "build_root", "compiler", "decode_attention", "kernel_available", "loss_ops",
           "pack_panels", "panel_linear", "panels_pay", "segment_amx", "segment_ops", "step_ops"]

log = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 600.0
"""How long a process waits for another one's build of the same kernel (a build takes 25-80 s)
before it decodes with torch's attention instead."""

HEAD_SIZES = (32, 64, 128)
CACHE_DTYPES = (torch.float32, torch.bfloat16)
"""The key/value cache dtypes the kernel reads (queries, mask and shared columns are float32)."""
MAX_GROUP = 8
"""Query rows per key/value head the kernel is built for (1..MAX_GROUP)."""

_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#include <limits>
#include <vector>

namespace {
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// s[g * ss + w] = scale * q[g] . k[w] + mask[w] for w < W; a masked column is -inf without reading its key.
template <int G, int D>
void scores(const float* q, const float* k, int64_t kw, const float* mask, int64_t W, int64_t ss, float scale,
            float* s) {
  for (int64_t w = 0; w < W; ++w) {
    if (mask[w] == NEG_INF) {
      for (int g = 0; g < G; ++g) s[g * ss + w] = NEG_INF;
      continue;
    }
    const float* kr = k + w * kw;
    float part[G][16];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 16; ++j) part[g][j] = 0.f;
    for (int i = 0; i < D; i += 16)
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < 16; ++j) part[g][j] += q[g * D + i + j] * kr[i + j];
    for (int g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int j = 0; j < 16; ++j) dot += part[g][j];
      s[g * ss + w] = dot * scale + mask[w];
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The 16 lane sums of v[0..15], in order, in one vector: a transposing reduction tree (45 shuffles and adds
// for 16 sums, where 16 separate horizontal sums take about 4 times as many).
inline __m512 lane_sums16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: (x0+x2, y0+y2, x1+x3, y1+y3) of keys 2i, 2i+1
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per block: the block's sums of keys 4i .. 4i+3
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // blocks (0+1, 2+3) of keys 0-3 then 4-7, and of keys 8-11 then 12-15
  const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e, f, 0x88), _mm512_shuffle_f32x4(e, f, 0xDD));
}

// scores for whole blocks of 16 keys (the rest by scores): per query row, the 16 keys' lane-wise partial dot
// products, then their 16 sums at once (lane_sums16). Masked columns get -inf (their keys are read, not used).
template <int G, int D>
int64_t scores16(const float* q, const float* k, int64_t kw, const float* mask, int64_t W, int64_t ss, float scale,
                 float* s) {
  static_assert(D % 16 == 0, "head size a multiple of 16");
  const __m512 vscale = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(NEG_INF);
  int64_t w0 = 0;
  for (; w0 + 16 <= W; w0 += 16) {
    const __m512 m = _mm512_loadu_ps(mask + w0);
    const __mmask16 masked = _mm512_cmp_ps_mask(m, neg_inf, _CMP_EQ_OQ);
    for (int g = 0; g < G; ++g) {
      __m512 part[16];
      for (int j = 0; j < 16; ++j) {
        const float* kr = k + (w0 + j) * kw;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), _mm512_loadu_ps(kr));
        for (int i = 16; i < D; i += 16)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + i), _mm512_loadu_ps(kr + i), acc);
        part[j] = acc;
      }
      const __m512 sc = _mm512_fmadd_ps(lane_sums16(part), vscale, m);
      _mm512_storeu_ps(s + g * ss + w0, _mm512_mask_blend_ps(masked, sc, neg_inf));
    }
  }
  return w0;
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// The 8 lane sums of v[0..7], in order, in one vector: lane_sums16's reduction tree on 256-bit vectors.
inline __m256 lane_sums8(const __m256* v) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit half: (x0+x2, y0+y2, x1+x3, y1+y3) of keys 2i, 2i+1
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {  // per half: the half's sums of keys 4i .. 4i+3
    const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
    b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  // the two halves added: keys 0-3 from b[0], keys 4-7 from b[1]
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

// scores for whole blocks of 8 keys (the rest by scores), as scores16 with 256-bit vectors.
template <int G, int D>
int64_t scores8(const float* q, const float* k, int64_t kw, const float* mask, int64_t W, int64_t ss, float scale,
                float* s) {
  static_assert(D % 8 == 0, "head size a multiple of 8");
  const __m256 vscale = _mm256_set1_ps(scale), neg_inf = _mm256_set1_ps(NEG_INF);
  int64_t w0 = 0;
  for (; w0 + 8 <= W; w0 += 8) {
    const __m256 m = _mm256_loadu_ps(mask + w0);
    const __m256 masked = _mm256_cmp_ps(m, neg_inf, _CMP_EQ_OQ);
    for (int g = 0; g < G; ++g) {
      __m256 part[8];
      for (int j = 0; j < 8; ++j) {
        const float* kr = k + (w0 + j) * kw;
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q + g * D), _mm256_loadu_ps(kr));
        for (int i = 8; i < D; i += 8)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), _mm256_loadu_ps(kr + i), acc);
        part[j] = acc;
      }
      const __m256 sc = _mm256_fmadd_ps(lane_sums8(part), vscale, m);
      _mm256_storeu_ps(s + g * ss + w0, _mm256_blendv_ps(sc, neg_inf, masked));
    }
  }
  return w0;
}
#endif

// The scores of a row's own columns: whole blocks of 16 keys by scores16 where AVX512 is built (of 8 by scores8
// where AVX2 is), the rest by scores.
template <int G, int D>
void own_scores(const float* q, const float* k, int64_t kw, const float* mask, int64_t W, int64_t ss, float scale,
                float* s) {
  int64_t done = 0;
#if defined(CPU_CAPABILITY_AVX512)
  done = scores16<G, D>(q, k, kw, mask, W, ss, scale, s);
#elif defined(CPU_CAPABILITY_AVX2)
  done = scores8<G, D>(q, k, kw, mask, W, ss, scale, s);
#endif
  if (done < W) scores<G, D>(q, k + done * kw, kw, mask + done, W - done, ss, scale, s + done);
}

// As scores, from keys stored transposed (kt[i * kd + w]: dimension i of key w), as the shared columns are: a block
// of KEY_BLOCK keys at a time, each query element times a row of the block (no horizontal sums, which dominate
// scores above). Masked columns are computed too (the shared keys are finite, padding included) and get -inf.
constexpr int KEY_BLOCK = 32;
template <int G, int D>
void scores_t(const float* q, const float* kt, int64_t kd, const float* mask, int64_t W, int64_t ss, float scale,
              float* s) {
  for (int64_t w0 = 0; w0 < W; w0 += KEY_BLOCK) {
    float acc[G][KEY_BLOCK];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < KEY_BLOCK; ++j) acc[g][j] = 0.f;
    // a last partial block is the full block that ends at W (its first columns again), where W allows
    const int64_t start = (W - w0 >= KEY_BLOCK || W < KEY_BLOCK) ? w0 : W - KEY_BLOCK;
    const int64_t n = std::min<int64_t>(KEY_BLOCK, W - start);
    const float* kr = kt + start;
    if (n == KEY_BLOCK) {
      for (int i = 0; i < D; ++i, kr += kd)
        for (int g = 0; g < G; ++g) {
          const float qi = q[g * D + i];
          for (int j = 0; j < KEY_BLOCK; ++j) acc[g][j] += qi * kr[j];
        }
    } else {
      for (int i = 0; i < D; ++i, kr += kd)
        for (int g = 0; g < G; ++g) {
          const float qi = q[g * D + i];
          for (int64_t j = 0; j < n; ++j) acc[g][j] += qi * kr[j];
        }
    }
    for (int g = 0; g < G; ++g)
      for (int64_t j = w0 - start; j < n; ++j) s[g * ss + start + j] = acc[g][j] * scale + mask[start + j];
  }
}

// Whether every one of the W columns is masked (-inf).
inline bool all_masked(const float* mask, int64_t W) {
  for (int64_t w = 0; w < W; ++w)
    if (mask[w] != NEG_INF) return false;
  return true;
}

// acc[g] += sum_{w < W} p[g * ss + w] * v[w]
template <int G, int D>
void weighted_values(const float* p, int64_t ss, const float* v, int64_t vw, int64_t W, float (&acc)[G][D]) {
  for (int64_t w = 0; w < W; ++w) {
    const float* vr = v + w * vw;
    for (int g = 0; g < G; ++g) {
      const float pw = p[g * ss + w];
      for (int i = 0; i < D; ++i) acc[g][i] += pw * vr[i];
    }
  }
}

using VecF = at::vec::Vectorized<float>;
constexpr int64_t COLS_AHEAD = 64;  // a bf16 row's lines are prefetched this many rows ahead of their use

// n cache rows of D bf16 values (row stride rs, in elements) as fp32 in dst [n][D], by ATen's vectorised load (a
// bf16 is the top half of the fp32 with the same value: a zero-extension and a shift).
template <int D>
inline void widen(const c10::BFloat16* src, int64_t rs, int64_t n, float* dst) {
  static_assert(D % VecF::size() == 0, "head size a multiple of the vector width");
  for (int64_t r = 0; r < n; ++r, src += rs, dst += D) {
    for (int i = 0; i < D; i += 32) __builtin_prefetch(src + COLS_AHEAD * rs + i, 0, 3);
    for (int i = 0; i < D; i += VecF::size()) {
      VecF x;
      at::vec::load_fp32_from_bf16(src + i, x);
      x.store(dst + i);
    }
  }
}

// n cache rows of D elements (row stride rs, in elements) fetched towards L2 ahead of their use. An fp32 cache's
// row fetches its values while its keys are scored and the next (row, head)'s keys while its values are weighted,
// so that memory is read while the scores, the softmax and the sums compute (at 64 rows over 300 columns, 30
// layers: 42 against 50 ms a step, docs/benchmarks.md). A bf16 cache's rows are not: the same prefetches measured
// 2-7% slower there.
template <int D, typename T>
inline void prefetch_rows(const T* x, int64_t rs, int64_t n) {
  for (int64_t r = 0; r < n; ++r, x += rs)
    for (int64_t i = 0; i < D * static_cast<int64_t>(sizeof(T)); i += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(x) + i, 0, 2);
}

// A row's own columns go COLS columns at a time: a chunk whose columns are all masked (left padding, holes) is
// neither scored nor read; a bf16 cache's chunk is widened to fp32 in a buffer of COLS x D floats (in L1) first.
constexpr int64_t COLS = 64;

// The chunk of n cache rows from row w0 of x (T: float or c10::BFloat16), as fp32 rows and their stride.
template <int D, typename T>
inline std::pair<const float*, int64_t> chunk_rows(const T* x, int64_t xw, int64_t w0, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return {x + w0 * xw, xw};
  } else {
    widen<D>(x + w0 * xw, xw, n, buf);
    return {buf, D};
  }
}

// own_scores over a row's W own columns, chunk by chunk; all-masked chunks get -inf unread.
template <int G, int D, typename T>
void own_scores_chunked(const float* q, const T* k, int64_t kw, const float* mask, int64_t W, int64_t ss,
                        float scale, float* s, float* buf, const T* ahead, int64_t aw) {
  for (int64_t w0 = 0; w0 < W; w0 += COLS) {
    const int64_t n = std::min(COLS, W - w0);
    if (all_masked(mask + w0, n)) {
      for (int g = 0; g < G; ++g) std::fill(s + g * ss + w0, s + g * ss + w0 + n, NEG_INF);
      continue;
    }
    if constexpr (std::is_same_v<T, float>) prefetch_rows<D>(ahead + w0 * aw, aw, n);  // the values
    const auto [kc, kcw] = chunk_rows<D>(k, kw, w0, n, buf);
    own_scores<G, D>(q, kc, kcw, mask + w0, n, ss, scale, s + w0);
  }
}

// weighted_values from bf16 values, each widened in registers once for the G query rows
template <int G, int D>
void weighted_values_bf16(const float* p, int64_t ss, const c10::BFloat16* v, int64_t vw, int64_t W,
                          float (&acc)[G][D]) {
  constexpr int L = VecF::size(), NV = D / L;
  VecF a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = VecF::loadu(acc[g] + L * i);
  for (int64_t w = 0; w < W; ++w) {
    const c10::BFloat16* vr = v + w * vw;
    for (int i = 0; i < D; i += 32) __builtin_prefetch(vr + COLS_AHEAD * vw + i, 0, 3);  // all of the row's lines
    VecF x[NV];
    for (int i = 0; i < NV; ++i) at::vec::load_fp32_from_bf16(vr + L * i, x[i]);
    for (int g = 0; g < G; ++g) {
      const VecF pw(p[g * ss + w]);
      for (int i = 0; i < NV; ++i) a[g][i] = at::vec::fmadd(pw, x[i], a[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) a[g][i].store(acc[g] + L * i);
}

// weighted_values over a row's W own columns, chunk by chunk; all-masked chunks (probability 0) are skipped.
template <int G, int D, typename T>
void own_values_chunked(const float* p, int64_t ss, const T* v, int64_t vw, const float* mask, int64_t W,
                        float (&acc)[G][D], const T* ahead, int64_t aw, const float* ahead_mask) {
  for (int64_t w0 = 0; w0 < W; w0 += COLS) {
    const int64_t n = std::min(COLS, W - w0);
    if constexpr (std::is_same_v<T, float>) {  // the next (row, head)'s keys (as many columns), where it reads them
      if (ahead != nullptr && !all_masked(ahead_mask + w0, n)) prefetch_rows<D>(ahead + w0 * aw, aw, n);
    }
    if (all_masked(mask + w0, n)) continue;
    if constexpr (std::is_same_v<T, float>) {
      weighted_values<G, D>(p + w0, ss, v + w0 * vw, vw, n, acc);
    } else {
      weighted_values_bf16<G, D>(p + w0, ss, v + w0 * vw, vw, n, acc);
    }
  }
}

// The shared columns of cascade attention: per prompt group u, keys transposed [U, H, D, P], values [U, H, P, D]
// and the additive mask [U, P]; source[b] is row b's group. They come first in each row's softmax, its own after.
struct Shared {
  const float* k = nullptr;  // transposed: [U, H, D, P]
  const float* v = nullptr;
  const float* mask = nullptr;
  const int64_t* source = nullptr;
  int64_t P = 0, kb = 0, kh = 0, kd = 0, vb = 0, vh = 0, vw = 0, mb = 0;
};

template <int G, int D, typename T>
std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& mask, double scale, const Shared& shared) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t B = q.size(0), H = q.size(1), W = k.size(2), P = shared.P, N = P + W;
  auto qc = q.contiguous();
  auto out = at::empty({B, H, G, D}, q.options());
  auto lse = at::empty({B, H, G}, q.options());
  const float* qp = qc.data_ptr<float>();
  const T* kp = static_cast<const T*>(k.const_data_ptr());  // float or c10::BFloat16
  const T* vp = static_cast<const T*>(v.const_data_ptr());
  const float* mp = mask.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int64_t kb = k.stride(0), kh = k.stride(1), kw = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vw = v.stride(2);
  const int64_t mb = mask.stride(0);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(G * N), rows(COLS * D);
    float* s = buf.data();
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* qr = qp + bh * G * D;
      if (P == 0 && all_masked(mp + b * mb, W)) {  // no real column (a finished decode row): nothing is read
        std::fill(op + bh * G * D, op + (bh + 1) * G * D, 0.f);
        std::fill(lp + bh * G, lp + (bh + 1) * G, NEG_INF);
        continue;
      }
      const int64_t u = P > 0 ? shared.source[b] : 0;
      if (P > 0)
        scores_t<G, D>(qr, shared.k + u * shared.kb + h * shared.kh, shared.kd, shared.mask + u * shared.mb, P, N,
                       sc, s);
      own_scores_chunked<G, D>(qr, kp + b * kb + h * kh, kw, mp + b * mb, W, N, sc, s + P, rows.data(),
                               vp + b * vb + h * vh, vw);
      float inv[G];
      for (int g = 0; g < G; ++g) {
        float* sg = s + g * N;
        const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, sg, N);
        if (mx == NEG_INF) {  // no real column: output 0, log-sum-exp -inf
          for (int64_t w = 0; w < N; ++w) sg[w] = 0.f;
          inv[g] = 0.f;
          lp[bh * G + g] = NEG_INF;
          continue;
        }
        at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp_u20(); }, sg, sg, N);
        const float total = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sg, N);
        inv[g] = 1.f / total;
        lp[bh * G + g] = mx + std::log(total);
      }
      float acc[G][D];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < D; ++i) acc[g][i] = 0.f;
      if (P > 0) weighted_values<G, D>(s, N, shared.v + u * shared.vb + h * shared.vh, shared.vw, P, acc);
      const int64_t nb = (bh + 1) / H, nh = (bh + 1) % H;  // the next (row, head) this thread runs, if any
      own_values_chunked<G, D>(s + P, N, vp + b * vb + h * vh, vw, mp + b * mb, W, acc,
                               bh + 1 < end ? kp + nb * kb + nh * kh : nullptr, kw, mp + nb * mb);
      float* o = op + bh * G * D;
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < D; ++i) o[g * D + i] = acc[g][i] * inv[g];
    }
  });
  return {out, lse};
}

template <int D, typename T>
std::tuple<at::Tensor, at::Tensor> by_group(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& mask, double scale, const Shared& shared) {
  switch (q.size(2)) {
    case 1: return run<1, D, T>(q, k, v, mask, scale, shared);
    case 2: return run<2, D, T>(q, k, v, mask, scale, shared);
    case 3: return run<3, D, T>(q, k, v, mask, scale, shared);
    case 4: return run<4, D, T>(q, k, v, mask, scale, shared);
    case 5: return run<5, D, T>(q, k, v, mask, scale, shared);
    case 6: return run<6, D, T>(q, k, v, mask, scale, shared);
    case 7: return run<7, D, T>(q, k, v, mask, scale, shared);
    case 8: return run<8, D, T>(q, k, v, mask, scale, shared);
  }
  TORCH_CHECK(false, "decode_attention: 1 to 8 query rows per key/value head, got ", q.size(2));
}

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& mask, double scale,
                                                    const std::optional<at::Tensor>& shared_k,
                                                    const std::optional<at::Tensor>& shared_v,
                                                    const std::optional<at::Tensor>& shared_mask,
                                                    const std::optional<at::Tensor>& source) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && mask.scalar_type() == at::kFloat
              && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16)
              && v.scalar_type() == k.scalar_type(),
              "decode_attention: float32 q and mask, float32 or bfloat16 k and v (both the same)");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 2,
              "decode_attention: q, k, v 4-d, mask 2-d");
  const int64_t B = q.size(0), H = q.size(1), W = k.size(2), D = q.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(1) == H && v.size(1) == H && v.size(2) == W
              && k.size(3) == D && v.size(3) == D && mask.size(0) == B && mask.size(1) == W,
              "decode_attention: shapes do not match");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && (W <= 1 || mask.stride(1) == 1),
              "decode_attention: the last dimension of k, v and mask must be contiguous");
  Shared shared;
  at::Tensor source_c;
  const int n_shared = shared_k.has_value() + shared_v.has_value() + shared_mask.has_value() + source.has_value();
  TORCH_CHECK(n_shared == 0 || n_shared == 4,
              "decode_attention: shared_k, shared_v, shared_mask and source go together");
  if (n_shared == 4) {
    const at::Tensor &sk = *shared_k, &sv = *shared_v, &sm = *shared_mask;
    TORCH_CHECK(sk.scalar_type() == at::kFloat && sv.scalar_type() == at::kFloat && sm.scalar_type() == at::kFloat
                && source->scalar_type() == at::kLong, "decode_attention: float32 shared tensors, int64 source");
    TORCH_CHECK(sk.dim() == 4 && sv.dim() == 4 && sm.dim() == 2 && source->dim() == 1,
                "decode_attention: shared_k, shared_v 4-d, shared_mask 2-d, source 1-d");
    const int64_t U = sk.size(0), P = sk.size(3);
    TORCH_CHECK(sk.size(1) == H && sk.size(2) == D && sv.size(0) == U && sv.size(1) == H && sv.size(2) == P
                && sv.size(3) == D && sm.size(0) == U && sm.size(1) == P && source->size(0) == B,
                "decode_attention: shared shapes do not match (shared_k [U, H, D, P], shared_v [U, H, P, D], "
                "shared_mask [U, P], source [B])");
    TORCH_CHECK((P <= 1 || sk.stride(3) == 1) && sv.stride(3) == 1 && (P <= 1 || sm.stride(1) == 1),
                "decode_attention: the last dimension of shared_k, shared_v and shared_mask must be contiguous");
    source_c = source->contiguous();
    const int64_t* src = source_c.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(src[b] >= 0 && src[b] < U, "decode_attention: source must index the shared groups, got ", src[b]);
    shared = Shared{sk.data_ptr<float>(), sv.data_ptr<float>(), sm.data_ptr<float>(), src,
                    P, sk.stride(0), sk.stride(1), sk.stride(2), sv.stride(0), sv.stride(1), sv.stride(2),
                    sm.stride(0)};
  }
  const bool bf16 = k.scalar_type() == at::kBFloat16;
  switch (D) {
    case 32: return bf16 ? by_group<32, c10::BFloat16>(q, k, v, mask, scale, shared)
                         : by_group<32, float>(q, k, v, mask, scale, shared);
    case 64: return bf16 ? by_group<64, c10::BFloat16>(q, k, v, mask, scale, shared)
                         : by_group<64, float>(q, k, v, mask, scale, shared);
    case 128: return bf16 ? by_group<128, c10::BFloat16>(q, k, v, mask, scale, shared)
                          : by_group<128, float>(q, k, v, mask, scale, shared);
  }
  TORCH_CHECK(false, "decode_attention: head size 32, 64 or 128, got ", D);
}
// ---------------------------------------------------------------- the decode step's fp32 weight matmuls
// y [M, N] = x [M, K] · Wᵀ (+ bias), W given as panels [P, K, NR]: NR = 2 vectors of output columns, each
// panel's K rows contiguous (zero columns past N). A 6 x NR register tile (12 vector accumulators) runs over
// the K rows of a panel reading one line of weights per row; the two threads take halves of the panels, and the
// first tile of each panel prefetches the next panel's lines, so the weights stream from memory while the tile
// computes. Rows go 96 at a time, so x stays in L2 while a chunk's panels pass.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
namespace panels {
#if defined(CPU_CAPABILITY_AVX512)
using V = __m512;
constexpr int L = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
#else
using V = __m256;
constexpr int L = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int NV = 2;
constexpr int NR = NV * L;
constexpr int MR = 6;
constexpr int64_t CHUNK = 16 * MR;

// R rows of x (row stride K) times one panel into y (row stride ldy): its first `cols` columns, plus bias.
// The accumulators stay in registers only if nothing indexes them at run time: they leave through `buf`.
template <int R>
inline void tile(const float* __restrict x, int64_t K, const float* __restrict p, const float* next,
                 const float* bias, float* y, int64_t ldy, int64_t cols) {
  V acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    if (next) __builtin_prefetch(next + k * NR, 0, 3);
    V b[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) b[v] = vload(p + k * NR + v * L);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V a = vbcast(x + r * K + k);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(a, b[v], acc[r][v]);
    }
  }
  alignas(64) float buf[R][NR];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) vstore(buf[r] + v * L, acc[r][v]);
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = bias ? buf[r][c] + bias[c] : buf[r][c];
}

// the last rows of a chunk, fewer than MR
template <int R>
inline void rest(int rows, const float* x, int64_t K, const float* p, const float* next, const float* bias, float* y,
                 int64_t ldy, int64_t cols) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R>(x, K, p, next, bias, y, ldy, cols);
    rest<R - 1>(rows, x, K, p, next, bias, y, ldy, cols);
  }
}
}  // namespace panels
#endif

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w, int64_t N, const std::optional<at::Tensor>& bias) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  using namespace panels;
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "panel_linear: float32 tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.is_contiguous(),
              "panel_linear: x [M, K] and contiguous panels [P, K, NR]");
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0);
  TORCH_CHECK(w.size(1) == K && w.size(2) == NR && N > P * NR - NR && N <= P * NR,
              "panel_linear: panels [P, K, ", NR, "] for N outputs and K inputs, got ", w.sizes(), " for N ", N);
  at::Tensor bias_c;
  if (bias.has_value()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == N, "panel_linear: a float32 bias of N");
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias_c.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for (int64_t c0 = 0; c0 < M; c0 += CHUNK) {
    const int64_t c1 = std::min(M, c0 + CHUNK);
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t j = p0; j < p1; ++j) {
        const float* panel = wp + j * K * NR;
        const float* next = j + 1 < p1 ? panel + K * NR : nullptr;
        const int64_t cols = std::min<int64_t>(NR, N - j * NR);
        const float* b = bp ? bp + j * NR : nullptr;
        int64_t m = c0;
        for (; m + MR <= c1; m += MR, next = nullptr)
          tile<MR>(xp + m * K, K, panel, next, b, yp + m * N + j * NR, N, cols);
        if (m < c1) rest<MR - 1>(int(c1 - m), xp + m * K, K, panel, next, b, yp + m * N + j * NR, N, cols);
      }
    });
  }
  return y;
#else
  TORCH_CHECK(false, "panel_linear: built without AVX2 or AVX512");
#endif
}

int64_t panel_width() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return panels::NR;
#else
  return 0;
#endif
}

// ---- the decode step's small ops, fused (decode_step.py): a step's rows are few, so each of these is a pass over
// a few kilobytes, which costs less than calling the separate torch ops it replaces.

// Rows of `width` elements per parallel task: a decode step's few rows run on the calling thread (a parallel
// region costs more than they do), a prefill's thousands are split between the threads.
inline int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

// A float vector rounded to bf16 and back (to-nearest-even, as torch's casts round).
inline std::tuple<VecF, VecF> round_bf16(const VecF& a, const VecF& b) {
  return at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(a, b));
}

// out[m] = w * (x[m] * rsqrt(mean(x[m]^2) + eps)) in float32 (LlamaRMSNorm's arithmetic), stored in out's dtype:
// x [M, H] float32 (last dimension contiguous), w [H] float32; bf16: a bfloat16 result, else float32.
at::Tensor rms_norm_to(const at::Tensor& x, const at::Tensor& w, double eps, bool bf16) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
              w.is_contiguous() && w.numel() == x.size(1), "rms_norm_to: x [M, H] and w [H], float32");
  const int64_t M = x.size(0), H = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({M, H}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, M, rows_per_task(H), [&](int64_t m0, int64_t m1) {
    std::vector<float> row(H);
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = xp + m * xs;
      const float ss = at::vec::map_reduce_all<float>([](VecF v) { return v * v; },
                                                      [](VecF a, VecF b) { return a + b; }, xr, H);
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      at::vec::map2<float>([r](VecF a, VecF b) { return b * (a * VecF(r)); }, row.data(), xr, wp, H);
      if (bf16) {
        at::vec::convert(row.data(), out.data_ptr<c10::BFloat16>() + m * H, H);
      } else {
        std::copy(row.begin(), row.end(), out.data_ptr<float>() + m * H);
      }
    }
  });
  return out;
}

// A decode step's rotary embedding and cache append in one pass. qkv [B, (nh + 2 nkv) d] (float32 or bf16, last
// dimension contiguous) holds each row's query heads, then its key heads, then its value heads; cos, sin [B, d]
// float32. The query and key heads are rotated in float32 (x cos + rotate_half(x) sin); the rotated keys and the
// values go to column `slot` of k_cache and v_cache [B, nkv, capacity, d] (float32 or bf16, last dimension
// contiguous, rounded to their dtype). Returns the rotated queries [B, nkv, nh / nkv, d] float32 (contiguous).
// rotary_prefill does the same for T tokens a row (rotary_rows below covers both).
//
// The N = B·T token rows of qkv, row b's token t at b·T + t, with cos and sin [N, d]: the query heads rotated into
// q [B, nh, T, d] (Q: float or bf16), the key heads rotated and the value heads copied into columns slot + t of row
// b of the caches. Rows are split between the threads where there are many (a prefill's).
template <typename T, typename C, typename Q>
void rotary_rows(const at::Tensor& qkv, const float* cp, const float* sp, at::Tensor& kc, at::Tensor& vc,
                 int64_t slot, int64_t tokens, int64_t nh, int64_t nkv, Q* qp) {
  const int64_t N = qkv.size(0), d = kc.size(3), half = d / 2, rs = qkv.stride(0);
  const T* src = static_cast<const T*>(qkv.const_data_ptr());
  C* kp = static_cast<C*>(kc.data_ptr());
  C* vp = static_cast<C*>(vc.data_ptr());
  at::parallel_for(0, N, rows_per_task(qkv.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / tokens, t = r % tokens, col = slot + t;
      const T* row = src + r * rs;
      const float* c = cp + r * d;
      const float* s = sp + r * d;
      for (int64_t h = 0; h < nh + nkv; ++h) {
        const T* x = row + h * d;
        Q* dst = h < nh ? qp + ((b * nh + h) * tokens + t) * d : nullptr;
        C* kd = h < nh ? nullptr : kp + b * kc.stride(0) + (h - nh) * kc.stride(1) + col * kc.stride(2);
        for (int64_t i = 0; i < d; ++i) {
          const float xi = static_cast<float>(x[i]);
          const float other = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
          const float y = xi * c[i] + other * s[i];
          if (dst) dst[i] = static_cast<Q>(y); else kd[i] = static_cast<C>(y);
        }
      }
      for (int64_t h = 0; h < nkv; ++h) {
        const T* x = row + (nh + nkv + h) * d;
        C* vd = vp + b * vc.stride(0) + h * vc.stride(1) + col * vc.stride(2);
        for (int64_t i = 0; i < d; ++i) vd[i] = static_cast<C>(static_cast<float>(x[i]));
      }
    }
  });
}

// The checks and the dispatch on dtypes of rotary_kv and rotary_prefill: `tokens` a row, queries returned as
// [B, nh, T, d] in bf16 or float32.
at::Tensor rotary_tokens(const char* op, const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, int64_t slot, int64_t tokens, int64_t nh,
                         int64_t nkv, bool q_bf16) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && k_cache.dim() == 4 && v_cache.dim() == 4 &&
              k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k_cache.sizes() == v_cache.sizes(),
              op, ": qkv [B·T, (nh + 2 nkv) d] (T tokens a row, 1 for rotary_kv), caches [B, nkv, capacity, d] with a "
              "contiguous last dimension");
  const int64_t N = qkv.size(0), d = k_cache.size(3), B = k_cache.size(0);
  TORCH_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0 && d % 2 == 0 && qkv.size(1) == (nh + 2 * nkv) * d &&
              tokens > 0 && N == B * tokens && k_cache.size(1) == nkv && 0 <= slot &&
              slot + tokens <= k_cache.size(2),
              op, ": shapes do not match (qkv ", qkv.sizes(), ", cache ", k_cache.sizes(), ", slot ", slot,
              ", tokens ", tokens, ")");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == N * d && sin.numel() == N * d,
              op, tokens == 1 ? ": cos, sin [B, d] float32" : ": cos, sin [B·T, d] float32");
  const auto in = qkv.scalar_type(), cache = k_cache.scalar_type();
  TORCH_CHECK((in == at::kFloat || in == at::kBFloat16) && (cache == at::kFloat || cache == at::kBFloat16) &&
              v_cache.scalar_type() == cache, op, ": float32 or bfloat16 tensors");
  at::Tensor q = at::empty({B, nh, tokens, d}, qkv.options().dtype(q_bf16 ? at::kBFloat16 : at::kFloat));
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  using BF = c10::BFloat16;
  const auto run = [&](auto* qp) {
    using Q = std::remove_pointer_t<decltype(qp)>;
    const bool in32 = in == at::kFloat, cache32 = cache == at::kFloat;
    if (in32 && cache32) rotary_rows<float, float, Q>(qkv, cp, sp, k_cache, v_cache, slot, tokens, nh, nkv, qp);
    else if (in32) rotary_rows<float, BF, Q>(qkv, cp, sp, k_cache, v_cache, slot, tokens, nh, nkv, qp);
    else if (cache32) rotary_rows<BF, float, Q>(qkv, cp, sp, k_cache, v_cache, slot, tokens, nh, nkv, qp);
    else rotary_rows<BF, BF, Q>(qkv, cp, sp, k_cache, v_cache, slot, tokens, nh, nkv, qp);
  };
  if (q_bf16) run(q.data_ptr<BF>()); else run(q.data_ptr<float>());
  return q;
}

at::Tensor rotary_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                     at::Tensor v_cache, int64_t slot, int64_t nh, int64_t nkv) {
  const at::Tensor q = rotary_tokens("rotary_kv", qkv, cos, sin, k_cache, v_cache, slot, 1, nh, nkv, false);
  return q.view({q.size(0), nkv, nh / nkv, q.size(3)});  // [B, nh, 1, d] as each key head's query rows
}

at::Tensor rotary_prefill(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                          at::Tensor v_cache, int64_t slot, int64_t tokens, int64_t nh, int64_t nkv, bool q_bf16) {
  return rotary_tokens("rotary_prefill", qkv, cos, sin, k_cache, v_cache, slot, tokens, nh, nkv, q_bf16);
}

// silu(gate) * up for gate_up [M, 2I] (gate then up, float32 or bf16, last dimension contiguous) -> [M, I] in its
// dtype, rounded as F.silu(gate) * up rounds: silu in float32 (x / (1 + exp(-x))), then to the dtype, then the
// product in float32, then to the dtype.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up [M, 2I] with a contiguous last dimension");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2, rs = gate_up.stride(0);
  at::Tensor out = at::empty({M, I}, gate_up.options());
  const VecF one(1.f);
  auto silu = [&](const VecF& g) { return g / (one + g.neg().exp()); };
  if (gate_up.scalar_type() == at::kFloat) {
    const float* src = gate_up.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, M, rows_per_task(I), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        at::vec::map2<float>([&](VecF g, VecF u) { return silu(g) * u; }, dst + m * I, src + m * rs,
                             src + m * rs + I, I);
    });
    return out;
  }
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_mul: float32 or bfloat16");
  using VecB = at::vec::Vectorized<c10::BFloat16>;
  const c10::BFloat16* src = gate_up.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, M, rows_per_task(I), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const c10::BFloat16* g = src + m * rs;
      const c10::BFloat16* u = g + I;
      c10::BFloat16* o = dst + m * I;
      int64_t i = 0;
      for (; i + VecB::size() <= I; i += VecB::size()) {
        const auto [g0, g1] = at::vec::convert_bfloat16_float(VecB::loadu(g + i));
        const auto [u0, u1] = at::vec::convert_bfloat16_float(VecB::loadu(u + i));
        const auto [s0, s1] = round_bf16(silu(g0), silu(g1));
        at::vec::convert_float_bfloat16(s0 * u0, s1 * u1).store(o + i);
      }
      for (; i < I; ++i) {
        const float gi = static_cast<float>(g[i]);
        const float s = static_cast<float>(static_cast<c10::BFloat16>(gi / (1.f + std::exp(-gi))));
        o[i] = static_cast<c10::BFloat16>(s * static_cast<float>(u[i]));
      }
    }
  });
  return out;
}

// Training attention in bf16 (segment_attention_fwd / _bwd): each query i sees the keys [0, a_i) and [b_i, c_i]
// (bounds [B, Lq, 3]), which covers a causal row, a right-padded one, and a packed row of a shared prompt and its
// replies (trainer/attention.py); with flags on the first range (valid [B, Lk]), also a prefill over kept caches
// with holes (decode_step.py, forward only). A block of 16 query positions times the query heads of one key head
// runs against blocks of 64 keys, skipping those no row of the block sees; the products are vdpbf16ps
// (AVX512-BF16), or oneDNN's AMX micro-kernel where the CPU has AMX, on operands packed in pairs along the sum,
// accumulated in fp32; the softmax is online, in fp32, as FlashAttention-2 runs it. Only these functions carry the
// bf16 instructions (a target attribute), and segment_attention_available() asks the CPU before any runs: the same
// build serves AVX512 CPUs without them.
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define SEG_BF16 1
#define SEG_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
namespace seg {
constexpr int D = 64;    // head size
constexpr int BK = 64;   // keys a block
constexpr int BQ = 16;   // query positions a block (times the heads sharing a key head)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// C[r][0..63] (+)= sum over p < np of A's bf16 pair p of row r times Bp's pairs [p][0..63] (vdpbf16ps).
// A: R rows of bf16, lda elements apart; Bp: [np][64] pairs as uint32; C: R rows of 64 floats, ldc apart.
template <int R>
SEG_TARGET inline void mk(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint32_t* Bp, int np,
                          bool accumulate) {
  __m512 c[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) c[r][v] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int p = 0; p < np; ++p) {
    const uint32_t* b = Bp + p * 64;
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
    __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 16);
    __m512bh b2 = (__m512bh)_mm512_loadu_si512(b + 32);
    __m512bh b3 = (__m512bh)_mm512_loadu_si512(b + 48);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * p, 4);
      __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);
      c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);
      c[r][2] = _mm512_dpbf16_ps(c[r][2], a, b2);
      c[r][3] = _mm512_dpbf16_ps(c[r][3], a, b3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, c[r][v]);
}

// Where oneDNN runs bf16 products on AMX tiles (cpublas::could_pack: its ISA is avx512_core_amx or later), mm
// hands them to torch's oneDNN micro-kernel (cpublas::brgemm; B in the same pairs layout, oneDNN's VNNI format),
// which runs them at 3-6 times mk's rate at these shapes; segment_attention_amx switches it.
std::atomic<bool> amx{false};

// A thread's AMX tile state, given back when it has run its share of a call's blocks.
inline void release_tiles() {
  if (amx.load(std::memory_order_relaxed)) at::native::cpublas::brgemm_release(true);
}

// rows (a multiple of 4) of A against Bp: 4 rows a tile, or one oneDNN call on AMX
SEG_TARGET inline void mm(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint32_t* Bp, int np,
                          int rows, bool accumulate) {
  if (amx.load(std::memory_order_relaxed)) {
    at::native::cpublas::brgemm(rows, 64, 2 * np, lda, 64, ldc, accumulate, (const at::BFloat16*)A,
                                (const at::BFloat16*)Bp, C, true);
    return;
  }
  for (int r = 0; r < rows; r += 4) mk<4>(C + r * ldc, ldc, A + r * lda, lda, Bp, np, accumulate);
}

SEG_TARGET inline void to_bf16(const float* src, uint16_t* dst, int n) {  // n a multiple of 16
  for (int i = 0; i < n; i += 16)
    _mm256_storeu_si256((__m256i*)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
}

// A 16 x 16 block of 32-bit values transposed in registers (unpacks within 128-bit lanes, then lane shuffles).
SEG_TARGET inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + i + 4], 0x88);
      t[8 * h + i + 4] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// Pairs along the columns of 64 rows of 64 (keys): out[p][j] = (x[j][2p], x[j][2p + 1]) for p < 32, i.e. the
// [64][32] pairs transposed, 16 x 16 at a time. Rows j >= n are zero.
SEG_TARGET inline void pack_t(const uint16_t* x, int64_t ldx, int n, uint32_t* out) {
  for (int jb = 0; jb < BK; jb += 16)
    for (int pb = 0; pb < D / 2; pb += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = jb + i < n ? _mm512_loadu_si512(x + (jb + i) * ldx + 2 * pb) : _mm512_setzero_si512();
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (pb + i) * 64 + jb, r[i]);
    }
}

// Pairs along the rows of rows x 64: out[p][c] = (x[2p][c], x[2p + 1][c]); rows >= n are zero; rows even.
SEG_TARGET inline void pack_v(const uint16_t* x, int64_t ldx, int n, int rows, uint32_t* out) {
  for (int p = 0; p < rows / 2; ++p) {
    const int r0 = 2 * p, r1 = 2 * p + 1;
    for (int c = 0; c < D; c += 16) {
      const __m512i lo = r0 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + r0 * ldx + c)))
                                : _mm512_setzero_si512();
      const __m512i hi = r1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + r1 * ldx + c)))
                                : _mm512_setzero_si512();
      _mm512_storeu_si512(out + p * 64 + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

struct Shape {
  int64_t B, Hq, Hkv, G, Lq, Lk, nqb, nkb;
};

// The key range the queries of one block may see: [0, lo) and [hi0, hi1] (union over the block's rows).
struct Span {
  int32_t lo, hi0, hi1;
  bool needs(int kb) const {
    const int32_t k0 = kb * BK, k1 = k0 + BK;  // [k0, k1)
    return (k0 < lo) || (hi0 <= hi1 && k0 <= hi1 && k1 > hi0);
  }
};

inline Span span_of(const int32_t* bounds, int64_t Lq, int64_t qb) {  // bounds [Lq][3]
  Span s{0, std::numeric_limits<int32_t>::max(), -1};
  for (int64_t i = qb * BQ; i < std::min<int64_t>(Lq, (qb + 1) * BQ); ++i) {
    const int32_t a = bounds[3 * i], b = bounds[3 * i + 1], c = bounds[3 * i + 2];
    s.lo = std::max(s.lo, a);
    if (b <= c) {
      s.hi0 = std::min(s.hi0, b);
      s.hi1 = std::max(s.hi1, c);
    }
  }
  return s;
}

// s[0..63] of one row: scaled, keys the row may not see set to -inf. Returns the row's max. valid (nullable):
// the row's key flags from key k0 on (n of them readable), which the first range [0, a) also needs.
SEG_TARGET inline float mask_scale(float* s, int k0, int32_t a, int32_t b, int32_t c, float scale,
                                   const uint8_t* valid = nullptr, int64_t n = 0) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i va = _mm512_set1_epi32(a), vb = _mm512_set1_epi32(b), vc = _mm512_set1_epi32(c);
  const __m512 ninf = _mm512_set1_ps(NEG_INF), vs = _mm512_set1_ps(scale);
  __m512 mx = ninf;
  for (int v = 0; v < 4; ++v) {
    const __m512i j = _mm512_add_epi32(iota, _mm512_set1_epi32(k0 + 16 * v));
    __mmask16 first = _mm512_cmplt_epi32_mask(j, va);
    if (valid != nullptr) {
      const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, n - 16 * v));
      const __m128i flags = _mm_maskz_loadu_epi8(__mmask16((1u << left) - 1u), valid + 16 * v);
      first &= _mm_cmpneq_epi8_mask(flags, _mm_setzero_si128());
    }
    const __mmask16 ok = first | (_mm512_cmpge_epi32_mask(j, vb) & _mm512_cmple_epi32_mask(j, vc));
    const __m512 x = _mm512_mask_blend_ps(ok, ninf, _mm512_mul_ps(_mm512_loadu_ps(s + 16 * v), vs));
    _mm512_storeu_ps(s + 16 * v, x);
    mx = _mm512_max_ps(mx, x);
  }
  return _mm512_reduce_max_ps(mx);
}

using Vec = at::vec::Vectorized<float>;

// The forward of one (batch, key head, query block): online softmax over the key blocks its rows need.
SEG_TARGET void forward_block(const Shape& sh, int64_t b, int64_t kvh, int64_t qb, const uint16_t* q,
                              const int64_t* qs, const uint32_t* kt, const uint32_t* vv, const int32_t* bounds,
                              const uint8_t* valid, float scale, uint16_t* out, const int64_t* os, float* lse,
                              uint16_t* qbuf, float* S, uint16_t* P, float* O, float* m, float* l) {
  // row r is position i0 + r / G of query head kvh * G + r % G: a block's real positions come first, so a short
  // block (a prefill of few tokens, the last block) runs only its real rows (in tiles of 4)
  const int64_t i0 = qb * BQ;
  const int real = int(sh.G * std::min<int64_t>(BQ, sh.Lq - i0));
  const int rows = (real + 3) / 4 * 4;
  const int32_t* bd = bounds + b * sh.Lq * 3;
  for (int r = 0; r < rows; ++r) {
    uint16_t* dst = qbuf + r * D;
    if (r < real)
      std::memcpy(dst, q + b * qs[0] + (kvh * sh.G + r % sh.G) * qs[1] + (i0 + r / sh.G) * qs[2], D * 2);
    else
      std::memset(dst, 0, D * 2);
  }
  for (int r = 0; r < rows; ++r) m[r] = NEG_INF, l[r] = 0.f;
  std::memset(O, 0, sizeof(float) * rows * D);
  const Span span = span_of(bd, sh.Lq, qb);
  const int64_t kv_off = (b * sh.Hkv + kvh) * sh.nkb;
  for (int kb = 0; kb < sh.nkb; ++kb) {
    if (!span.needs(kb)) continue;
    mm(S, BK, qbuf, D, kt + (kv_off + kb) * 32 * 64, D / 2, rows, false);
    for (int r = 0; r < rows; ++r) {
      const int64_t i = r < real ? i0 + r / sh.G : sh.Lq;
      float* s = S + r * BK;
      uint16_t* p = P + r * BK;
      const uint8_t* flags = valid == nullptr ? nullptr : valid + b * sh.Lk + kb * BK;
      const float mx = i < sh.Lq ? mask_scale(s, kb * BK, bd[3 * i], bd[3 * i + 1], bd[3 * i + 2], scale, flags,
                                              sh.Lk - kb * BK)
                                 : NEG_INF;
      if (mx == NEG_INF) {
        std::memset(p, 0, BK * 2);
        continue;
      }
      const float m_new = std::max(m[r], mx);
      const float alpha = std::exp(m[r] - m_new);  // 0 at the first block the row sees
      m[r] = m_new;
      const Vec vm(m_new);
      Vec sum(0.f);
      for (int v = 0; v < BK; v += 16) {
        const Vec e = (Vec::loadu(s + v) - vm).exp_u20();
        e.store(s + v);
        sum = sum + e;
      }
      l[r] = l[r] * alpha + at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
      to_bf16(s, p, BK);
      if (alpha != 1.f) {
        float* o = O + r * D;
        for (int v = 0; v < D; v += 16) (Vec::loadu(o + v) * Vec(alpha)).store(o + v);
      }
    }
    mm(O, D, P, BK, vv + (kv_off + kb) * 32 * 64, BK / 2, rows, true);
  }
  for (int r = 0; r < real; ++r) {
    const int64_t i = i0 + r / sh.G, h = kvh * sh.G + r % sh.G;
    uint16_t* dst = out + b * os[0] + i * os[1] + h * os[2];
    float* o = O + r * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int v = 0; v < D; v += 16) (Vec::loadu(o + v) * Vec(inv)).store(o + v);
    to_bf16(o, dst, D);
    lse[(b * sh.Hq + h) * sh.Lq + i] = l[r] > 0.f ? m[r] + std::log(l[r]) : std::numeric_limits<float>::infinity();
  }
}

// Two rows of 64 floats as pairs along the rows: out[j] = (bf16(r0[j]), bf16(r1[j])).
SEG_TARGET inline void pair_rows(const float* r0, const float* r1, uint32_t* out) {
  for (int v = 0; v < 64; v += 16) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r0 + v)));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r1 + v)));
    _mm512_storeu_si512(out + v, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}

// What the backward reads of one (batch, key head, query block): its rows (zero-padded) as the scores read them,
// transposed [64][rows] as the key and value gradients read them, and each row's log-sum-exp and dO . O.
struct QBlock {
  std::vector<uint16_t> q, dout, qT, doutT;
  std::vector<float> lse, delta;
};

// The backward of one (batch, key head, key block): over the query blocks that see it, the key and value
// gradients of the block, and the query gradients' share from it (into this thread's dq, fp32).
SEG_TARGET void backward_block(const Shape& sh, int64_t b, int64_t kvh, int64_t kb, const std::vector<QBlock>& qbl,
                               const std::vector<Span>& spans, const uint32_t* kt, const uint32_t* vt,
                               const uint32_t* kv, const int32_t* bounds, float scale, float* dq, uint16_t* dk,
                               uint16_t* dv, float* S, float* dP, uint16_t* dSb, uint32_t* Pp, uint32_t* dSp,
                               float* dKT, float* dVT) {
  const int rows = int(sh.G) * BQ;
  const int32_t* bd = bounds + b * sh.Lq * 3;
  const int64_t kv_idx = (b * sh.Hkv + kvh) * sh.nkb + kb;
  std::memset(dKT, 0, sizeof(float) * D * BK);
  std::memset(dVT, 0, sizeof(float) * D * BK);
  for (int64_t qb = 0; qb < sh.nqb; ++qb) {
    const int64_t bq = (b * sh.Hkv + kvh) * sh.nqb + qb;
    if (!spans[b * sh.nqb + qb].needs(int(kb))) continue;
    const QBlock& blk = qbl[bq];
    const int64_t i0 = qb * BQ;
    mm(S, BK, blk.q.data(), D, kt + kv_idx * 32 * 64, D / 2, rows, false);
    mm(dP, BK, blk.dout.data(), D, vt + kv_idx * 32 * 64, D / 2, rows, false);
    for (int r = 0; r < rows; ++r) {
      const int64_t i = i0 + r % BQ;
      float* s = S + r * BK;
      float* dp = dP + r * BK;
      if (i >= sh.Lq) {
        std::memset(s, 0, sizeof(float) * BK);
        std::memset(dp, 0, sizeof(float) * BK);
      } else {
        mask_scale(s, int(kb) * BK, bd[3 * i], bd[3 * i + 1], bd[3 * i + 2], scale);
        const Vec vl(blk.lse[r]), vd(blk.delta[r]), vs(scale);
        for (int v = 0; v < BK; v += 16) {
          const Vec p = (Vec::loadu(s + v) - vl).exp_u20();  // 0 where masked (-inf)
          p.store(s + v);
          (p * (Vec::loadu(dp + v) - vd) * vs).store(dp + v);  // the scores' gradient, times the scale
        }
      }
      to_bf16(dp, dSb + r * BK, BK);
    }
    for (int p = 0; p < rows / 2; ++p) {
      pair_rows(S + 2 * p * BK, S + (2 * p + 1) * BK, Pp + p * 64);
      pair_rows(dP + 2 * p * BK, dP + (2 * p + 1) * BK, dSp + p * 64);
    }
    mm(dVT, BK, blk.doutT.data(), rows, Pp, rows / 2, D, true);   // dV^T [d][keys] += dO^T P
    mm(dKT, BK, blk.qT.data(), rows, dSp, rows / 2, D, true);     // dK^T [d][keys] += Q^T dS
    for (int g = 0; g < sh.G; ++g) {                             // dQ rows += dS K
      const int64_t h = kvh * sh.G + g;
      mm(dq + ((b * sh.Hq + h) * sh.nqb * BQ + i0) * D, D, dSb + g * BQ * BK, BK, kv + kv_idx * 32 * 64, BK / 2,
         BQ, true);
    }
  }
  const int n = int(std::min<int64_t>(BK, sh.Lk - kb * BK));
  for (int j = 0; j < n; ++j) {
    float krow[D], vrow[D];
    for (int c = 0; c < D; ++c) krow[c] = dKT[c * BK + j], vrow[c] = dVT[c * BK + j];
    const int64_t at = ((b * sh.Hkv + kvh) * sh.Lk + kb * BK + j) * D;
    to_bf16(krow, dk + at, D);
    to_bf16(vrow, dv + at, D);
  }
}

// Keys and values of every (batch, key head, key block), packed for the products (pack_t: pairs along the
// head size, as the scores read keys; pack_v: pairs along the keys, as the weighted sum reads values).
SEG_TARGET void pack_kv(const Shape& sh, const uint16_t* x, const int64_t* xs, bool transposed,
                        uint32_t* out) {
  at::parallel_for(0, sh.B * sh.Hkv * sh.nkb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t kb = idx % sh.nkb, bh = idx / sh.nkb, b = bh / sh.Hkv, h = bh % sh.Hkv;
      const uint16_t* src = x + b * xs[0] + h * xs[1] + kb * BK * xs[2];
      const int n = int(std::min<int64_t>(BK, sh.Lk - kb * BK));
      if (transposed)
        pack_t(src, xs[2], n, out + idx * 32 * 64);
      else
        pack_v(src, xs[2], n, BK, out + idx * 32 * 64);
    }
  });
}

Shape shape_of(const at::Tensor& q, const at::Tensor& k) {
  Shape sh;
  sh.B = q.size(0), sh.Hq = q.size(1), sh.Lq = q.size(2), sh.Hkv = k.size(1), sh.Lk = k.size(2);
  sh.G = sh.Hq / sh.Hkv;
  sh.nqb = (sh.Lq + BQ - 1) / BQ, sh.nkb = (sh.Lk + BK - 1) / BK;
  return sh;
}

// Runs work(item, thread) for item < n, items handed out one at a time (their costs differ: causal rows).
template <typename F>
void dynamic_for(int64_t n, F work) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t item = next++; item < n; item = next++) work(item, t);
    release_tiles();
  });
}
}  // namespace seg
#endif

void segment_check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bounds) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "segment_attention: q, k, v must be [B, H, L, 64]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "segment_attention: q, k, v must be bf16");
  TORCH_CHECK(q.size(3) == 64 && k.size(3) == 64 && v.size(3) == 64, "segment_attention: head size must be 64");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "segment_attention: the head dimension must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes(), "segment_attention: k and v differ in shape");
  TORCH_CHECK(q.size(0) == k.size(0) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "segment_attention: query heads must be a multiple of key heads");
  TORCH_CHECK(bounds.scalar_type() == at::kInt && bounds.is_contiguous() && bounds.dim() == 3 &&
                  bounds.size(0) == q.size(0) && bounds.size(1) == q.size(2) && bounds.size(2) == 3,
              "segment_attention: bounds must be contiguous int32 [B, Lq, 3]");
}

bool segment_attention_available() {
#if defined(SEG_BF16)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// Whether the segment kernel's products run on AMX tiles from now on: `enable` where oneDNN has AMX here.
bool segment_attention_amx(bool enable) {
#if defined(SEG_BF16)
  seg::amx = enable && segment_attention_available() && at::native::cpublas::could_pack(at::kBFloat16);
  return seg::amx;
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> segment_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, const at::Tensor& bounds,
                                                          double scale, const std::optional<at::Tensor>& valid) {
  segment_check(q, k, v, bounds);
  TORCH_CHECK(!valid.has_value() || (valid->scalar_type() == at::kBool && valid->is_contiguous() &&
                                     valid->dim() == 2 && valid->size(0) == q.size(0) && valid->size(1) == k.size(2)),
              "segment_attention: valid must be contiguous bool [B, Lk]");
  TORCH_CHECK(segment_attention_available(), "segment_attention: this CPU has no AVX512-BF16");
#if defined(SEG_BF16)
  using namespace seg;
  const Shape sh = shape_of(q, k);
  auto out = at::empty({sh.B, sh.Lq, sh.Hq, D}, q.options());
  auto lse = at::empty({sh.B, sh.Hq, sh.Lq}, q.options().dtype(at::kFloat));
  std::vector<uint32_t> kt(sh.B * sh.Hkv * sh.nkb * 32 * 64), vv(kt.size());
  const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)}, vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)}, os[3] = {out.stride(0), out.stride(1), out.stride(2)};
  pack_kv(sh, (const uint16_t*)k.data_ptr(), ks, true, kt.data());
  pack_kv(sh, (const uint16_t*)v.data_ptr(), vs, false, vv.data());
  const int rows = int(sh.G) * BQ;
  const int64_t threads = at::get_num_threads();
  std::vector<uint16_t> qbuf(threads * rows * D), P(threads * rows * BK);
  std::vector<float> S(threads * rows * BK), O(threads * rows * D), m(threads * rows), l(threads * rows);
  const uint16_t* qp = (const uint16_t*)q.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  float* lp = lse.data_ptr<float>();
  const int32_t* bd = bounds.data_ptr<int32_t>();
  const uint8_t* vp = valid.has_value() ? (const uint8_t*)valid->data_ptr() : nullptr;
  dynamic_for(sh.B * sh.Hkv * sh.nqb, [&](int64_t item, int64_t t) {
    const int64_t qb = sh.nqb - 1 - item % sh.nqb, bh = item / sh.nqb;  // the longest blocks first
    forward_block(sh, bh / sh.Hkv, bh % sh.Hkv, qb, qp, qs, kt.data(), vv.data(), bd, vp, float(scale), op, os, lp,
                  qbuf.data() + t * rows * D, S.data() + t * rows * BK, P.data() + t * rows * BK,
                  O.data() + t * rows * D, m.data() + t * rows, l.data() + t * rows);
  });
  return {out, lse};
#else
  return {};
#endif
}


std::tuple<at::Tensor, at::Tensor, at::Tensor> segment_attention_bwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& dout, const at::Tensor& bounds, double scale) {
  segment_check(q, k, v, bounds);
  TORCH_CHECK(segment_attention_available(), "segment_attention: this CPU has no AVX512-BF16");
  TORCH_CHECK(out.sizes() == dout.sizes() && out.scalar_type() == at::kBFloat16 &&
                  dout.scalar_type() == at::kBFloat16 && out.stride(3) == 1 && dout.stride(3) == 1,
              "segment_attention: out and its gradient must be bf16 [B, Lq, Hq, 64]");
#if defined(SEG_BF16)
  using namespace seg;
  const Shape sh = shape_of(q, k);
  TORCH_CHECK(out.size(0) == sh.B && out.size(1) == sh.Lq && out.size(2) == sh.Hq,
              "segment_attention: out must be [B, Lq, Hq, 64]");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == sh.B * sh.Hq * sh.Lq,
              "segment_attention: lse must be contiguous float [B, Hq, Lq]");
  const int rows = int(sh.G) * BQ;
  const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)};
  const int64_t os[3] = {out.stride(0), out.stride(1), out.stride(2)};
  const int64_t gs[3] = {dout.stride(0), dout.stride(1), dout.stride(2)};
  const uint16_t* qp = (const uint16_t*)q.data_ptr();
  const uint16_t* op = (const uint16_t*)out.data_ptr();
  const uint16_t* gp = (const uint16_t*)dout.data_ptr();
  const float* lp = lse.data_ptr<float>();
  std::vector<QBlock> qbl(sh.B * sh.Hkv * sh.nqb);
  at::parallel_for(0, int64_t(qbl.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t qb = idx % sh.nqb, bh = idx / sh.nqb, b = bh / sh.Hkv, kvh = bh % sh.Hkv;
      QBlock& blk = qbl[idx];
      blk.q.assign(rows * D, 0), blk.dout.assign(rows * D, 0), blk.qT.assign(rows * D, 0);
      blk.doutT.assign(rows * D, 0), blk.lse.assign(rows, 0.f), blk.delta.assign(rows, 0.f);
      for (int r = 0; r < rows; ++r) {
        const int64_t i = qb * BQ + r % BQ, h = kvh * sh.G + r / BQ;
        if (i >= sh.Lq) continue;
        const uint16_t* qr = qp + b * qs[0] + h * qs[1] + i * qs[2];
        const uint16_t* orow = op + b * os[0] + i * os[1] + h * os[2];
        const uint16_t* grow = gp + b * gs[0] + i * gs[1] + h * gs[2];
        float delta = 0.f;
        for (int c = 0; c < D; ++c) {
          blk.q[r * D + c] = qr[c], blk.dout[r * D + c] = grow[c];
          blk.qT[c * rows + r] = qr[c], blk.doutT[c * rows + r] = grow[c];
          delta += float(c10::BFloat16(orow[c], c10::BFloat16::from_bits())) *
                   float(c10::BFloat16(grow[c], c10::BFloat16::from_bits()));
        }
        blk.lse[r] = lp[(b * sh.Hq + h) * sh.Lq + i], blk.delta[r] = delta;
      }
    }
  });
  std::vector<Span> spans(sh.B * sh.nqb);
  for (int64_t b = 0; b < sh.B; ++b)
    for (int64_t qb = 0; qb < sh.nqb; ++qb)
      spans[b * sh.nqb + qb] = span_of(bounds.data_ptr<int32_t>() + b * sh.Lq * 3, sh.Lq, qb);
  const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)}, vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  std::vector<uint32_t> kt(sh.B * sh.Hkv * sh.nkb * 32 * 64), vt(kt.size()), kvp(kt.size());
  pack_kv(sh, (const uint16_t*)k.data_ptr(), ks, true, kt.data());
  pack_kv(sh, (const uint16_t*)v.data_ptr(), vs, true, vt.data());
  pack_kv(sh, (const uint16_t*)k.data_ptr(), ks, false, kvp.data());
  auto dk = at::empty({sh.B, sh.Hkv, sh.Lk, D}, k.options());
  auto dv = at::empty({sh.B, sh.Hkv, sh.Lk, D}, k.options());
  const int64_t threads = at::get_num_threads();
  const int64_t dq_size = sh.B * sh.Hq * sh.nqb * BQ * D;
  std::vector<float> dqt(threads * dq_size, 0.f);
  std::vector<float> S(threads * rows * BK), dP(threads * rows * BK), dKT(threads * D * BK), dVT(threads * D * BK);
  std::vector<uint16_t> dSb(threads * rows * BK);
  std::vector<uint32_t> Pp(threads * rows / 2 * 64), dSp(threads * rows / 2 * 64);
  const int32_t* bd = bounds.data_ptr<int32_t>();
  uint16_t* dkp = (uint16_t*)dk.data_ptr();
  uint16_t* dvp = (uint16_t*)dv.data_ptr();
  const int64_t items = sh.B * sh.Hkv * sh.nkb;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t item = t; item < items; item += threads) {  // round robin: dq's sums in one order every run
        const int64_t kb = item % sh.nkb, bh = item / sh.nkb;
        backward_block(sh, bh / sh.Hkv, bh % sh.Hkv, kb, qbl, spans, kt.data(), vt.data(), kvp.data(), bd,
                       float(scale), dqt.data() + t * dq_size, dkp, dvp, S.data() + t * rows * BK,
                       dP.data() + t * rows * BK, dSb.data() + t * rows * BK, Pp.data() + t * rows / 2 * 64,
                       dSp.data() + t * rows / 2 * 64, dKT.data() + t * D * BK, dVT.data() + t * D * BK);
      }
    release_tiles();
  });
  auto dq = at::empty({sh.B, sh.Hq, sh.Lq, D}, q.options());
  uint16_t* dqp = (uint16_t*)dq.data_ptr();
  at::parallel_for(0, sh.B * sh.Hq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh)
      for (int64_t i = 0; i < sh.Lq; ++i) {
        float row[D];
        const float* src = dqt.data() + (bh * sh.nqb * BQ + i) * D;
        for (int c = 0; c < D; ++c) row[c] = src[c];
        for (int64_t t = 1; t < threads; ++t)
          for (int c = 0; c < D; ++c) row[c] += src[t * dq_size + c];
        to_bf16(row, dqp + (bh * sh.Lq + i) * D, D);
      }
  });
  return {dq, dk, dv};
#else
  return {};
#endif
}

// ---- the output layer's loss terms (ragen_core/trainer/forward.py: _FusedLogprobsEntropy): per row of logits l
// [N, V] (float32 or bf16), with x = scale * l, p = softmax(x), lse = logsumexp(x) and E = sum p x: the log-prob
// x[label] - lse and the entropy lse - E, in float32, one row at a time in a float32 copy that stays in the cache.
// torch's path makes vocabulary-sized fresh tensors (the float32 softmax, the casts), whose first touch costs more
// than the arithmetic.
namespace loss {

// A row of V logits times scale, as float32, in dst.
template <typename T>
inline void scaled_row(const T* src, int64_t V, float scale, float* dst) {
  const VecF s(scale);
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; j + VecF::size() <= V; j += VecF::size()) (VecF::loadu(src + j) * s).store(dst + j);
  } else {
    using VecB = at::vec::Vectorized<c10::BFloat16>;
    for (; j + VecB::size() <= V; j += VecB::size()) {
      const auto [a, b] = at::vec::convert_bfloat16_float(VecB::loadu(src + j));
      (a * s).store(dst + j);
      (b * s).store(dst + j + VecF::size());
    }
  }
  for (; j < V; ++j) dst[j] = static_cast<float>(src[j]) * scale;
}

constexpr int64_t CHUNK = 1024;  // sums run per chunk, then over the chunks: about 100 terms on each lane's chain

// (lse, E) of the float32 row x [V].
inline std::pair<float, float> lse_expected(const float* x, int64_t V) {
  VecF vm(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + VecF::size() <= V; j += VecF::size()) vm = at::vec::maximum(vm, VecF::loadu(x + j));
  float m = at::vec::vec_reduce_all<float>([](VecF& a, VecF& b) { return at::vec::maximum(a, b); }, vm);
  for (; j < V; ++j) m = std::max(m, x[j]);
  const VecF top(m);
  VecF s(0.f), d(0.f);
  float ss = 0.f, ds = 0.f;
  for (int64_t c = 0; c < V; c += CHUNK) {
    const int64_t e = std::min(V, c + CHUNK);
    VecF cs(0.f), cd(0.f);
    j = c;
    for (; j + VecF::size() <= e; j += VecF::size()) {
      const VecF xv = VecF::loadu(x + j);
      const VecF p = (xv - top).exp();
      cs = cs + p;
      cd = at::vec::fmadd(p, xv, cd);
    }
    for (; j < e; ++j) {
      const float p = std::exp(x[j] - m);
      ss += p;
      ds += p * x[j];
    }
    s = s + cs;
    d = d + cd;
  }
  ss += at::vec::vec_reduce_all<float>(std::plus<VecF>(), s);
  ds += at::vec::vec_reduce_all<float>(std::plus<VecF>(), d);
  return {m + std::log(ss), ds / ss};
}

inline void loss_check(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logprobs_entropy: logits [N, V] with a contiguous last dimension");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logprobs_entropy: logits float32 or bfloat16");
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.dim() == 1 && labels.size(0) == logits.size(0) &&
                  labels.is_contiguous(),
              "logprobs_entropy: labels contiguous int64 [N]");
  const int64_t* lab = labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < labels.size(0); ++i)
    TORCH_CHECK(lab[i] >= 0 && lab[i] < logits.size(1), "logprobs_entropy: label ", lab[i], " at row ", i,
                " is not in [0, ", logits.size(1), ")");
}

}  // namespace loss

// (log-prob, entropy, lse, E), each [N] float32: see namespace loss.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprobs_entropy_fwd(const at::Tensor& logits,
                                                                                const at::Tensor& labels,
                                                                                double scale) {
  loss::loss_check(logits, labels);
  const int64_t N = logits.size(0), V = logits.size(1), rs = logits.stride(0);
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor lp = at::empty({N}, f32), ent = at::empty({N}, f32), lse = at::empty({N}, f32),
             expected = at::empty({N}, f32);
  float *lpp = lp.data_ptr<float>(), *entp = ent.data_ptr<float>(), *lsep = lse.data_ptr<float>(),
        *ep = expected.data_ptr<float>();
  const int64_t* lab = labels.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  auto run = [&](auto* src) {
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> x(V);
      for (int64_t i = begin; i < end; ++i) {
        loss::scaled_row(src + i * rs, V, sc, x.data());
        const auto [l, e] = loss::lse_expected(x.data(), V);
        lsep[i] = l;
        ep[i] = e;
        lpp[i] = x[lab[i]] - l;
        entp[i] = l - e;
      }
    });
  };
  if (logits.scalar_type() == at::kFloat)
    run(logits.data_ptr<float>());
  else
    run(logits.data_ptr<c10::BFloat16>());
  return {lp, ent, lse, expected};
}

// The gradient of sum(g_lp * log-prob + g_h * entropy) with respect to the logits, in their dtype: with x = scale * l,
// d/dx_j = -p_j (g_lp + g_h (x_j - E)) + g_lp 1[j = label], p_j = exp(x_j - lse); times scale. in_place: written
// over the logits (each row is read into a float32 copy first) and returned, no vocabulary-sized tensor made.
at::Tensor logprobs_entropy_bwd(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& lse,
                                const at::Tensor& expected, const at::Tensor& g_lp, const at::Tensor& g_h,
                                double scale, bool in_place) {
  loss::loss_check(logits, labels);
  const int64_t N = logits.size(0), V = logits.size(1), rs = logits.stride(0);
  for (const at::Tensor* t : {&lse, &expected, &g_lp, &g_h})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == N && t->is_contiguous(),
                "logprobs_entropy_bwd: lse, expected and the gradients contiguous float32 [N]");
  at::Tensor grad = in_place ? logits : at::empty({N, V}, logits.options());
  const int64_t gs = in_place ? rs : V;  // the gradient's row stride
  const float *lsep = lse.data_ptr<float>(), *ep = expected.data_ptr<float>(), *glp = g_lp.data_ptr<float>(),
              *gh = g_h.data_ptr<float>();
  const int64_t* lab = labels.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  auto run = [&](auto* src, auto* dst) {
    using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(dst)>>;
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> x(V);
      for (int64_t i = begin; i < end; ++i) {
        loss::scaled_row(src + i * rs, V, sc, x.data());
        const float a = glp[i], b = gh[i], l = lsep[i], e = ep[i];
        // -p (a + b (x - E)) scale = p (c0 + c1 x) with c0 = -(a - b E) scale, c1 = -b scale
        const float c0 = -(a - b * e) * sc, c1 = -b * sc;
        const VecF vl(l), v0(c0), v1(c1);
        int64_t j = 0;
        for (; j + VecF::size() <= V; j += VecF::size()) {
          const VecF xv = VecF::loadu(x.data() + j);
          ((xv - vl).exp() * at::vec::fmadd(v1, xv, v0)).store(x.data() + j);
        }
        for (; j < V; ++j) x[j] = std::exp(x[j] - l) * (c0 + c1 * x[j]);
        x[lab[i]] += a * sc;
        scalar_t* out = dst + i * gs;
        if constexpr (std::is_same_v<scalar_t, float>) {
          std::memcpy(out, x.data(), V * sizeof(float));
        } else {
          using VecB = at::vec::Vectorized<c10::BFloat16>;
          j = 0;
          for (; j + VecB::size() <= V; j += VecB::size())
            at::vec::convert_float_bfloat16(VecF::loadu(x.data() + j), VecF::loadu(x.data() + j + VecF::size()))
                .store(out + j);
          for (; j < V; ++j) out[j] = static_cast<scalar_t>(x[j]);
        }
      }
    });
  };
  if (logits.scalar_type() == at::kFloat)
    run(logits.data_ptr<float>(), grad.data_ptr<float>());
  else
    run(logits.data_ptr<c10::BFloat16>(), grad.data_ptr<c10::BFloat16>());
  return grad;
}

}  // namespace

TORCH_LIBRARY(ragen_cpu_attention, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, Tensor? shared_k=None, "
        "Tensor? shared_v=None, Tensor? shared_mask=None, Tensor? source=None) -> (Tensor, Tensor)");
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias=None) -> Tensor");
  m.def("panel_width() -> int", &panel_width);
  m.def("rms_norm_to(Tensor x, Tensor w, float eps, bool bf16) -> Tensor");
  m.def("rotary_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int slot, int nh, "
        "int nkv) -> Tensor");
  m.def("rotary_prefill(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int slot, "
        "int tokens, int nh, int nkv, bool q_bf16) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("segment_attention_available() -> bool", &segment_attention_available);
  m.def("segment_attention_amx(bool enable) -> bool", &segment_attention_amx);
  m.def("segment_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor bounds, float scale, Tensor? valid=None) -> "
        "(Tensor, Tensor)");
  m.def("segment_attention_bwd(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, Tensor bounds, "
        "float scale) -> (Tensor, Tensor, Tensor)");
  m.def("logprobs_entropy_fwd(Tensor logits, Tensor labels, float scale) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("logprobs_entropy_bwd(Tensor logits, Tensor labels, Tensor lse, Tensor expected, Tensor g_lp, Tensor g_h, "
        "float scale, bool in_place=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(ragen_cpu_attention, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("panel_linear", &panel_linear);
  m.impl("rms_norm_to", &rms_norm_to);
  m.impl("rotary_kv", &rotary_kv);
  m.impl("rotary_prefill", &rotary_prefill);
  m.impl("silu_mul", &silu_mul);
  m.impl("segment_attention_fwd", &segment_attention_fwd);
  m.impl("segment_attention_bwd", &segment_attention_bwd);
  m.impl("logprobs_entropy_fwd", &logprobs_entropy_fwd);
  m.impl("logprobs_entropy_bwd", &logprobs_entropy_bwd);
}
"""


_ISA_FLAGS = {
    # the instruction sets torch builds its own AVX2 / AVX512 kernels for (not -march=native: torch's extension
    # cache is keyed by source and flags, not by machine, and may sit on a home directory that several
    # machines share; a kernel built for one CPU must not be loaded by another that lacks its instructions)
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def _capability() -> str:
    """torch's CPU capability: the vector code torch itself runs on the host (AVX512, AVX2, DEFAULT, ...)."""
    return str(torch.backends.cpu.get_cpu_capability())


def _capability_flags(capability: str) -> list[str]:
    """Compiler flags for ATen's vector types at ``capability``, as torch's own kernels are built."""
    if capability in _ISA_FLAGS:
        return [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}", *_ISA_FLAGS[capability]]
    return ["-DCPU_CAPABILITY=DEFAULT"]


def compiler() -> str | None:
    """The C++ compiler torch's extension builder runs (``$CXX``, else ``c++``) as a path, or None where absent."""
    return shutil.which(os.environ.get("CXX", "c++"))


def build_root() -> Path:
    """Where this Python environment keeps its kernel builds: ``$RAGEN_KERNEL_DIR``, else a folder inside the
    environment (``sys.prefix``), else, where that is not writable, one named after it in the user's cache."""
    if os.environ.get("RAGEN_KERNEL_DIR"):
        return Path(os.environ["RAGEN_KERNEL_DIR"])
    versions = f"torch-{torch.__version__}-{sys.implementation.cache_tag}"
    inside = Path(sys.prefix) / "var" / "ragen-kernels" / versions
    existing = next(p for p in inside.parents if p.exists())
    if os.access(existing, os.W_OK):
        return inside
    owner = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ragen" / "kernels" / f"{owner}-{versions}"


def _announce(text: str, end: str = "") -> None:
    print(text, end=end, file=sys.stderr, flush=True)


def _first_errors(err: BaseException) -> str:
    """The compiler's ``error:`` lines of a failed build (else its message's first line), one line of <= 300."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    return " | ".join([line for line in lines if "error:" in line] or lines[:1])[:300]


def _build(directory: Path, name: str, flags: list[str]) -> None:
    """Compile and load the op (ninja skips what is up to date) under this process's lock on ``directory``; say
    so on one line when it compiles, and on one line when it fails. Raises Timeout, or the build's error."""
    from torch.utils.cpp_extension import load

    stamp = directory / "ragen-build.sha256"
    recipe = hashlib.sha256("\0".join([_SOURCE, *flags, torch.__version__]).encode()).hexdigest()
    with exclusive_build(directory, LOCK_TIMEOUT_S):
        built = stamp.exists() and stamp.read_text() == recipe and (directory / f"{name}.so").exists()
        if not built:
            _announce(f"ragen: compiling the CPU decode attention kernel ({name}, {compiler()}) in {directory} ...")
        started = time.monotonic()
        source = directory / f"{name}.cpp"
        if not source.exists() or source.read_text() != _SOURCE:  # rewritten only when changed: ninja reads mtimes
            source.write_text(_SOURCE)
        try:
            load(name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                 build_directory=str(directory), is_python_module=False, verbose=False)
        except BaseException as err:
            why = f"({_first_errors(err)}); decode attention uses torch's flash kernel"
            if built:
                _announce(f"ragen: loading the CPU decode attention kernel from {directory} failed {why}", end="\n")
            else:
                _announce(f" failed after {time.monotonic() - started:.0f} s {why}", end="\n")
            raise
        if not built:
            with tempfile.NamedTemporaryFile("w", dir=directory, delete=False) as f:
                f.write(recipe)
            os.replace(f.name, stamp)
            _announce(f" built in {time.monotonic() - started:.0f} s", end="\n")


def _loaded() -> Any | None:
    """The op, where a build of it is loaded in this process already."""
    try:
        return torch.ops.ragen_cpu_attention.decode_attention
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def _op() -> Any | None:
    """The compiled op (built at the first call in this process, loaded from :func:`build_root` when built
    before), or None."""
    if os.environ.get("RAGEN_CPU_ATTENTION", "1") == "0":
        return None
    if compiler() is None:
        log.warning("no C++ compiler (%s): decode attention stays on torch's flash kernel (cpu_attention.py)",
                    os.environ.get("CXX", "c++"))
        return None
    loaded = _loaded()
    if loaded is not None:  # a library registers its ops once per process: never load a second build
        return loaded
    capability = _capability()
    name = f"ragen_cpu_attention_{capability.lower()}"  # one build per capability in a shared build root
    try:
        _build(build_root() / name, name, ["-O3", "-fopenmp", *_capability_flags(capability)])
    except Timeout:
        log.warning("another process has been building the CPU decode attention kernel for over %.0f s: decode "
                    "attention uses torch's flash kernel in this one", LOCK_TIMEOUT_S)
        return None
    except Exception:  # noqa: BLE001 (no ninja, a compiler error, a broken compiler: said by _build; SDPA works)
        return None
    return torch.ops.ragen_cpu_attention.decode_attention


@dataclass(frozen=True)
class Shared:
    """Columns shared by groups of rows, attended before each row's own (cascade attention, one kernel call):
    ``keys_t`` [U, H, D, P] the keys transposed (the kernel scores a block of keys per query element),
    ``values`` [U, H, P, D], both with a contiguous last dimension; ``mask`` [U, P] additive float (finite
    keys on masked columns too); ``source`` [B] int64, each row's group."""

    keys_t: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor
    source: torch.Tensor


def kernel_available() -> bool:
    """Whether the fused kernel is built (building it now if not)."""
    return _op() is not None


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float, shared: Shared | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``softmax(q kᵀ · scale + mask) v`` and its log-sum-exp, or None where the kernel does not apply.

    q [B, H, G, D] (G query rows per key/value head); keys, values [B, H, W, D] with a contiguous last dimension
    (views into a preallocated cache will do); mask [B, W] additive float (0 on real tokens, -inf elsewhere),
    contiguous along W. Returns (out [B, H, G, D], lse [B, H, G]); a row with no real column gets out 0 and
    lse -inf. None: not float32 on CPU, a head size or group not built, or no kernel (module docstring).

    ``shared``: cascade attention's shared columns (:class:`Shared`), which then come before each row's own
    in one softmax: row b attends to its group's columns ``shared.source[b]`` and then to ``keys[b]``.
    """
    if (q.device.type != "cpu" or q.dtype != torch.float32 or q.shape[-1] not in HEAD_SIZES
            or not 1 <= q.shape[2] <= MAX_GROUP or keys.dtype not in CACHE_DTYPES or values.dtype != keys.dtype
            or keys.stride(-1) != 1 or values.stride(-1) != 1):
        return None
    if shared is not None and (shared.keys_t.dtype != torch.float32 or shared.keys_t.stride(-1) != 1
                               or shared.values.stride(-1) != 1):
        return None
    op = _op()
    if op is None:
        return None
    if shared is None:
        out, lse = op(q, keys, values, mask, scale)
    else:
        out, lse = op(q, keys, values, mask, scale, shared.keys_t, shared.values, shared.mask, shared.source)
    return out, lse


PANEL_CAPABILITIES = ("AVX2",)
"""Where the decode step's fp32 weight matmuls run on :func:`panel_linear` instead of oneDNN's packed weights: where
it was measured faster (module docstring). Its AVX512 build is tested but not used: on 2 AVX512 cores it matched
oneDNN from 4 rows a step (0.87-1.16×) and was clearly faster only at 1 (docs/benchmarks.md)."""


@dataclass(frozen=True)
class Panels:
    """A weight [N, K] as :func:`panel_linear` reads it: ``data`` [P, K, NR], the output columns in panels of NR
    (:func:`pack_panels`), each panel's K rows contiguous; zero columns past ``n``."""

    data: torch.Tensor
    n: int


def panels_pay() -> bool:
    """Whether fp32 weight matmuls of the decode step run on :func:`panel_linear` here: the kernel is built, for a
    capability in :data:`PANEL_CAPABILITIES`, and ``RAGEN_CPU_PANELS`` is not ``0``."""
    return (os.environ.get("RAGEN_CPU_PANELS", "1") != "0" and _capability() in PANEL_CAPABILITIES
            and _op() is not None)


def pack_panels(weight: torch.Tensor) -> Panels | None:
    """``weight`` [N, K] (float32, CPU) as :class:`Panels` (a new tensor), or None where the kernel is not built
    or has no vector code (a DEFAULT build)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or _op() is None:
        return None
    width = int(torch.ops.ragen_cpu_attention.panel_width())
    if width == 0:
        return None
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -n % width)) if n % width else weight  # [P·NR, K]
    return Panels(padded.reshape(-1, width, k).transpose(1, 2).contiguous(), n)


def panel_linear(x: torch.Tensor, weight: Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for the weight ``w`` that ``weight`` packs: x [..., K] float32 -> [..., N]."""
    lead = x.shape[:-1]
    y = torch.ops.ragen_cpu_attention.panel_linear(x.reshape(-1, x.shape[-1]), weight.data, weight.n, bias)
    return y.view(*lead, weight.n)


@functools.cache
def segment_ops() -> Any | None:
    """The update's bf16 attention ops where the kernel is built and the CPU has AVX512-BF16 (else None):
    ``segment_attention_fwd(q, k, v, bounds, scale) -> (out, lse)`` and ``segment_attention_bwd(q, k, v, out, lse,
    grad, bounds, scale) -> (dq, dk, dv)``; q [B, Hq, Lq, 64], k and v [B, Hkv, Lk, 64] bf16, bounds [B, Lq, 3]
    int32: query i attends to the keys [0, a) and [b, c] (the first range only to those ``valid`` [B, Lk] bool
    flags, where given); out [B, Lq, Hq, 64] bf16, lse [B, Hq, Lq] float32. ``RAGEN_SEGMENT_ATTENTION=0`` turns them
    off (the update and the prefill then use torch's attention). Where oneDNN has AMX on this CPU the kernel's
    products run on its tiles (:func:`segment_amx`)."""
    if os.environ.get("RAGEN_SEGMENT_ATTENTION", "1") == "0" or _op() is None:
        return None
    ops = torch.ops.ragen_cpu_attention
    if not ops.segment_attention_available():
        return None
    segment_amx()
    return ops


def segment_amx(enable: bool | None = None) -> bool:
    """Whether the segment kernel's products run on AMX tiles from now on: ``enable`` (None: unless
    ``RAGEN_SEGMENT_AMX=0``) where the kernel runs and oneDNN has AMX on this CPU, else False."""
    if enable is None:
        enable = os.environ.get("RAGEN_SEGMENT_AMX", "1") != "0"
    if _op() is None or not torch.ops.ragen_cpu_attention.segment_attention_available():
        return False
    return bool(torch.ops.ragen_cpu_attention.segment_attention_amx(enable))


@functools.cache
def loss_ops() -> Any | None:
    """The output layer's fused loss terms where the kernel is built (else None): ``logprobs_entropy_fwd(logits,
    labels, scale) -> (logprob, entropy, lse, expected)`` and ``logprobs_entropy_bwd(logits, labels, lse, expected,
    g_logprob, g_entropy, scale, in_place=False) -> grad``; logits [N, V] float32 or bf16 (last dimension
    contiguous), labels [N] int64, the rest [N] float32; the scores are those of softmax(scale * logits), the gradient
    is the logits' own, in their dtype, written over the logits and returned with ``in_place`` (the caller then
    bumps their version: ``torch.autograd.graph.increment_version``). ``RAGEN_FUSED_LOSS=0`` turns them off (the
    trainer then uses losses.logprobs_and_entropy)."""
    if os.environ.get("RAGEN_FUSED_LOSS", "1") == "0" or _op() is None:
        return None
    return torch.ops.ragen_cpu_attention


def step_ops() -> Any | None:
    """The decode step's fused small ops, where the kernel is built (else None): ``rms_norm_to(x, w, eps, bf16)``
    (LlamaRMSNorm of float32 rows, stored in bfloat16 or float32), ``rotary_kv(qkv, cos, sin, k_cache, v_cache,
    slot, nh, nkv)`` (the query and key heads of a step's fused projection rotated, the keys and values written into
    the caches' column ``slot``, the queries returned as [B, nkv, nh / nkv, d] float32), ``rotary_prefill(qkv, cos,
    sin, k_cache, v_cache, slot, tokens, nh, nkv, q_bf16)`` (the same for a prefill's ``tokens`` a row, row b's token
    t in qkv row b·T + t and cache column slot + t, the queries returned as [B, nh, T, d] in bf16 or float32) and
    ``silu_mul(gate_up)``
    (the MLP's ``silu(gate) * up``, rounded as the separate ops round). Each replaces several torch ops on a step's
    few rows: decode_step.py."""
    return torch.ops.ragen_cpu_attention if _op() is not None else None
