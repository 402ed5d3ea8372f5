"""One decode step of a Llama-family model without ``model.forward``: the hf generator's default decode path.

``HFGenerator`` (hf.py) prefills through :meth:`LlamaDecodeStep.prefill` (the same weights and arithmetic, T
tokens a row, attention by ``scaled_dot_product_attention`` with a mask that is causal over the new tokens) and
then runs every decode step through :meth:`LlamaDecodeStep.step`, where ``RolloutConfig.fast_decode`` is on (the
default) and :func:`decode_step_for` covers the model: Llama- or Qwen2-shaped, SiLU MLP without biases, no sliding
window, weights not partitioned by ZeRO-3. For any other model, or with ``fast_decode`` off, prefills and decode
steps go through ``model.forward``. The prefill gains most under LoRA: ``model.forward`` runs each adapted layer
as the base matmul plus the adapter's two small ones, where the fused weights have the adapters merged.

Why: a decode step feeds one token per row, so its weight matmuls have as many rows as the batch: small
matmuls, which MKL (behind ``F.linear``) runs at about half its large-matmul rate. ``model.forward``'s own
per-step machinery costs little at 64 rows (this step on unpacked weights is no faster), so the gain is in
running the same arithmetic on the same weights directly, with the matmuls on packed weights:

- q, k and v come from one matmul (the three projections' weights concatenated), gate and up from one;
- on a CPU with oneDNN and fp32 weights, every weight matmul runs on weights packed once into oneDNN's blocked layout
  (``mkldnn._reorder_linear_weight``, as inductor's CPU freezing does): with SmolLM2's shapes 205 GFLOP/s at
  64 rows against 113 through ``F.linear``, and 2.8-3.3x faster at 8-17 rows. On a CPU with AVX2 only, fp32 weights
  are packed in panels for cpu_attention.py's panel matmul instead, which keeps up with the weights streaming from
  memory where oneDNN's AVX2 kernels do not (1.2-1.7x at 1-64 rows; ``RAGEN_CPU_PANELS=0`` keeps oneDNN).
  Elsewhere ``F.linear``;
- ``compute_dtype`` bf16 over fp32 weights (the trainer's resolved ``trainer.precision``, engine_settings.py)
  runs the weight matmuls on bf16 copies of the weights (packed for oneDNN's bf16 kernels where the CPU has
  them), the activations cast to bf16 on the way in, as ``torch.autocast`` would. The MLP's SiLU and product
  stay bf16 between its two matmuls, as under autocast, and the o and down outputs are added to the fp32
  residual stream as they are (the sum promotes them), so those matmuls' outputs are never cast on their own;
  the residual stream, the norms and the rotary embedding stay fp32. Keys and values go into the cache in bf16
  (``cache_dtype``), as autocast's projections make them: half the bytes a decode step reads and a turn copies.
  The fused kernel reads them with fp32 queries and accumulates in fp32; torch's attention (the prefill's, and
  the step's without the kernel) runs in bf16, as under autocast;
- rotary embeddings come from the model's own rotary module (so any rope scaling it has is kept);
- a step's rows are few, so its small ops cost their calls more than their arithmetic: on a CPU build of
  cpu_attention.py's kernel, each norm and its cast to the matmuls' dtype run as one op, the rotary embedding of
  the query and key heads with the keys' and values' cache writes as one, and the MLP's SiLU and product as one
  (``cpu_attention.step_ops``; :meth:`LlamaDecodeStep._fused_ops` says where they apply); a prefill runs its norms,
  its rotary embedding with the cache writes, and its SiLU the same way (one pass over its rows where torch makes
  two or more), its queries coming out in the dtype its attention reads;
- keys and values are appended in place into the preallocated cache of ``kv.growing_cache`` (the cache the
  prefill filled, with room for the replies), so cross-turn reuse and dropping finished rows work unchanged;
- attention stacks the query heads that share a key/value head as its query rows (no grouped-query expansion
  of the cache) and runs, on CPU with fp32 queries over an fp32 or bf16 cache, as the fused kernel of
  cpu_attention.py; without that kernel (CUDA, no compiler, a head size it is not built for) as
  ``scaled_dot_product_attention`` with the row mask;
- cascade attention, where a batch's rows come in prompt groups on CPU (the N responses of a prompt on their
  first turn, :func:`cascade_pays`): the prompt's keys and values are kept once per group (:class:`SharedPrefix`)
  and each row attends to its group's columns and then its own in one call of the fused kernel (without it,
  :meth:`LlamaDecodeStep._cascade` merges two attention calls by their log-sum-exps);
- only the last position exists, so the output layer makes [B, V] logits; the final-norm hidden state is kept
  (``last_hidden``) for a value head.

Fused weights are built at the first step and rebuilt after ``invalidate``, which the generator calls
when the weights changed (``update_weights``, or the parameters' version counters moved: an optimizer
step or ``load_state_dict`` moves them); the packed output layer is reused while its weight is unchanged.
Under a peft LoRA wrapper the active adapters are merged into the fused copies (``merged_state_dict``); the
model is left as it is. Results equal ``model.forward`` up to float rounding
(the tests check the logits and the sampled log-probs against it and against a full re-prefill).

Run the tests: ``python -m pytest tests/unit/rollout/test_decode_step.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from ragen_core.rollout.generators.cpu_attention import (
    Panels,
    Shared,
    decode_attention,
    pack_panels,
    panel_linear,
    panels_pay,
    segment_ops,
    step_ops,
)

__all__ = ["LlamaDecodeStep", "SharedPrefix", "decode_step_for"]

Weight = torch.Tensor | Panels
"""A fused weight of the step: a plain or oneDNN-packed tensor, or cpu_attention's panels."""

_MODEL_TYPES = ("llama", "qwen2")
"""Llama, and Qwen2: Llama's layers with biases on the q, k and v projections (the paper's model family)."""


@dataclass
class SharedPrefix:
    """The first ``width`` cache columns of a decode batch whose rows come in prompt groups (the N responses
    of a prompt, prefilled once): their keys and values once per group, for cascade attention.

    The batch cache then holds only the columns after these, each row's own (the tokens it decodes): the
    prompt is never copied per row, and dropping finished rows copies only their own columns. A row's whole
    cache (kept between turns) is its group's columns here followed by its own.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer, (keys, values) [U, nkv, width, d] of the U distinct prompts."""
    mask: torch.Tensor
    """[U, width] 1 on real tokens (left padding 0)."""
    source: torch.Tensor
    """[B] long: the prompt (index into U) of each batch slot."""
    _plan: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None = None
    _additive: torch.Tensor | None = None
    _keys_t: list[torch.Tensor] | None = None
    _values32: list[torch.Tensor] | None = None

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """[U, width] the shared columns' additive mask (0 on real tokens, -inf on left padding)."""
        if self._additive is None or self._additive.dtype != dtype:
            self._additive = _additive(self.mask, dtype)
        return self._additive

    def keys_t(self, layer: int) -> torch.Tensor:
        """[U, nkv, d, width] the layer's keys transposed, in fp32, as the fused kernel scores them
        (cpu_attention.Shared); left padding zeroed. Made for every layer at the first call (the keys do not change
        while decoding)."""
        if self._keys_t is None:
            pad = (self.mask == 0)[:, None, None, :]
            self._keys_t = [k.transpose(2, 3).float().contiguous().masked_fill_(pad, 0.0) for k, _ in self.layers]
        return self._keys_t[layer]

    def values32(self, layer: int) -> torch.Tensor:
        """[U, nkv, width, d] the layer's values in fp32, as the fused kernel reads shared columns (the batch's
        own columns may be bf16). Made for every layer at the first call."""
        if self._values32 is None:
            self._values32 = [v.float() for _, v in self.layers]
        return self._values32[layer]

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the batch slots ``keep`` ([K] long), as the batch cache does."""
        self.source, self._plan = self.source[keep], None

    def plan(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """(gather [U·n] slot of each group's j-th query row, B for a hole; back [B] each slot's place in
        that layout; n the largest group; the prefix's additive mask [U, 1, 1, width])."""
        if self._plan is None or self._plan[3].dtype != dtype:
            source = self.source.tolist()
            groups = int(self.mask.shape[0])
            members: list[list[int]] = [[] for _ in range(groups)]
            for slot, u in enumerate(source):
                members[u].append(slot)
            n = max(len(m) for m in members)
            gather = torch.full((groups * n,), len(source), dtype=torch.long)
            back = torch.empty(len(source), dtype=torch.long)
            for u, slots in enumerate(members):
                for j, slot in enumerate(slots):
                    gather[u * n + j] = slot
                    back[slot] = u * n + j
            device = self.mask.device
            self._plan = (gather.to(device), back.to(device), n, self.additive(dtype)[:, None, None, :])
        return self._plan


def cascade_pays(groups: int, rows: int) -> bool:
    """Whether cascade attention is used: prompts shared by two rows or more on average, on a CPU build with
    the flash kernel that returns log-sum-exps (measured at 64 rows in groups of 8 over a 190-token prompt:
    0.41-0.62 ms a layer against 0.89-1.31 ms)."""
    return 2 * groups <= rows and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


@dataclass
class _Layer:
    norm1: torch.Tensor  # [H] input RMSNorm weight
    qkv: Weight  # [(nh + 2 nkv) d, H]
    o: Weight  # [H, nh d]
    norm2: torch.Tensor  # [H]
    gate_up: Weight  # [2 I, H]
    down: Weight  # [H, I]
    qkv_bias: torch.Tensor | None = None  # [(nh + 2 nkv) d]: Qwen2's (Llama's with attention_bias)
    o_bias: torch.Tensor | None = None  # [H]: Llama's with attention_bias


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain ``*ForCausalLM`` under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decode_step_for(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> LlamaDecodeStep | None:
    """A :class:`LlamaDecodeStep` for ``model`` (its weight matmuls in ``compute_dtype``, None: the weights'
    own dtype), or None when its architecture is not covered."""
    base = _base_model(model)
    config = getattr(base, "config", None)
    if config is None or getattr(config, "model_type", None) not in _MODEL_TYPES:
        return None
    if getattr(config, "mlp_bias", False) or getattr(config, "use_sliding_window", False):
        return None
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return None
    inner = getattr(base, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
        return None
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return None  # DeepSpeed ZeRO-3 partitions the weights; only its hooks in model.forward gather them
    return LlamaDecodeStep(model, compute_dtype)


class LlamaDecodeStep:
    """``step(ids, positions, mask, cache) -> logits [B, V]``; see the module docstring.

    ``compute_dtype`` bf16 over fp32 weights runs the weight matmuls as ``torch.autocast`` would: on bf16
    copies of the weights (packed for oneDNN's bf16 kernels on a CPU that has them), the activations cast to
    bf16 on the way in and the results back to fp32, so the residual stream, the norms and the rotary embedding
    stay fp32; the cache the generator makes for it holds bf16 keys and values (``cache_dtype``). On a CPU with
    AVX512-BF16, at SmolLM2's shapes and 64 rows, the layers' and the output layer's matmuls take 20 ms a step
    against 36 in fp32."""

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> None:
        self.model = model
        # transformers' config and modules are untyped attributes of nn.Module: Any here, checked in decode_step_for
        base: Any = _base_model(model)
        self.n_layers = len(base.model.layers)
        self.rotary: Any = base.model.rotary_emb
        c: Any = base.config
        self.n_heads = int(c.num_attention_heads)
        self.n_kv = int(c.num_key_value_heads)
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        self.eps = float(c.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self._stale = True  # fused weights to (re)build before the next step
        self._layers: list[_Layer] = []
        self._embed = self._final_norm = torch.empty(0)
        self._head: Weight = torch.empty(0)
        # the packed output layer's source and its key (address, version, shape, in panels)
        self._head_source: tuple[tuple[int, int, tuple[int, ...], bool], torch.Tensor] | None = None
        self.last_hidden: torch.Tensor | None = None
        """[B, H] the final-norm hidden state of the last ``step`` (the one the logits came from)."""
        param = next(model.parameters())
        self.matmul_dtype = compute_dtype or param.dtype
        """The weight matmuls' dtype; activations of another dtype are cast to it and back."""
        self.cache_dtype = self.matmul_dtype
        """The keys' and values' dtype of the caches the generator makes for this step: the matmuls', as under
        autocast (module docstring). A cache handed in keeps its own dtype."""
        self.packed = (param.device.type == "cpu" and param.dtype == torch.float32
                       and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                       and (self.matmul_dtype == torch.float32
                            or (self.matmul_dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())))
        """Weights packed for oneDNN (module docstring); else plain ``F.linear``."""
        self.panels = False
        """fp32 weights packed in panels for cpu_attention.panel_linear instead (module docstring); decided at the
        first build of the fused weights."""

    # ------------------------------------------------------------------ weights

    def invalidate(self) -> None:
        """The model's weights changed: rebuild the fused weights before the next step. The generator,
        which tracks weight changes (``update_weights``, version counters), calls this."""
        self._stale = True

    def _build(self) -> None:
        from ragen_core.models.causal_lm import merged_state_dict

        sd = merged_state_dict(self.model)  # plain names, LoRA deltas added; no copies for a plain model
        n = self.n_layers
        prefix = "model."
        dt = self.matmul_dtype
        panels = self.panels = self.packed and dt == torch.float32 and panels_pay()

        def weight(w: torch.Tensor) -> Weight:  # a matmul's weight in the matmuls' dtype, packed where they are
            w = w.to(dt)
            return _pack(w, panels) if self.packed else w

        with torch.no_grad():
            self._layers = []
            for i in range(n):
                p = f"{prefix}layers.{i}."
                biases = [b for x in "qkv" if (b := sd.get(p + f"self_attn.{x}_proj.bias")) is not None]
                o_bias = sd.get(p + "self_attn.o_proj.bias")
                self._layers.append(_Layer(
                    norm1=sd[p + "input_layernorm.weight"],
                    qkv=weight(torch.cat([sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"],
                                          sd[p + "self_attn.v_proj.weight"]]).contiguous()),
                    o=weight(sd[p + "self_attn.o_proj.weight"]),
                    norm2=sd[p + "post_attention_layernorm.weight"],
                    gate_up=weight(torch.cat([sd[p + "mlp.gate_proj.weight"],
                                              sd[p + "mlp.up_proj.weight"]]).contiguous()),
                    down=weight(sd[p + "mlp.down_proj.weight"]),
                    qkv_bias=torch.cat(biases).contiguous().to(dt) if len(biases) == 3 else None,
                    o_bias=None if o_bias is None else o_bias.to(dt),
                ))
            self._embed = sd[prefix + "embed_tokens.weight"]
            self._final_norm = sd[prefix + "norm.weight"]
            head = sd.get("lm_head.weight", self._embed)
            if self.packed:
                # the output layer (tied to the embedding, no adapter under LoRA) is mostly unchanged by an update:
                # packing its 49k x 576 weights again took 45 ms of the ~0.25 s rebuild after every update. Its
                # source is kept alive, so no other tensor can take its address: the same address and version
                # counter then mean the same values (a new .data or an in-place step changes one of them)
                key = (head.data_ptr(), head._version, tuple(head.shape), panels)
                if self._head_source is None or key != self._head_source[0]:
                    self._head, self._head_source = _pack(head.to(self.matmul_dtype), panels), (key, head.detach())
            else:
                self._head = head.to(self.matmul_dtype)
        self._stale = False

    def _linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None,
                keep: bool = False) -> torch.Tensor:
        """x @ weight.T (+ bias) in the matmuls' dtype; the result back in x's dtype, or as it came where
        ``keep`` (the caller's next op is the MLP's bf16 product, or a sum with the fp32 residual stream)."""
        if isinstance(weight, Panels):  # fp32 activations and weights
            return panel_linear(x, weight, bias)
        dtype = x.dtype
        if dtype != self.matmul_dtype:
            x = x.to(self.matmul_dtype)
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        else:
            y = F.linear(x, weight, bias)
        return y if keep else y.to(dtype)

    # ------------------------------------------------------------------ the step

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; LlamaRMSNorm's arithmetic in fp32
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        # as LlamaRMSNorm: in fp32, then back to the input's dtype, times the weight
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             cache: DynamicCache, prefix: SharedPrefix | None = None) -> torch.Tensor:
        """Feed ``ids`` ([B] long) at ``positions`` ([B] long); ``mask`` [B, W + 1] (1 on real tokens,
        this step's column included) covers the cache's W tokens and this one. Appends this token's keys
        and values to ``cache`` and returns the next-token logits [B, V] (their hidden state: ``last_hidden``).
        Weights as of the first step after construction or the last ``invalidate``. ``prefix``: the first columns
        of ``mask``, shared by prompt groups and held there, not in ``cache``, which then holds the columns after
        them (cascade attention: one call of the fused kernel, cpu_attention.Shared; :meth:`_cascade` without
        it); or None."""
        if self._stale:
            self._build()
        b = ids.shape[0]
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        x = self._embed[ids]  # [B, H]
        cos, sin = self.rotary(x[:, None, :], positions[:, None])  # [B, 1, d] each
        cos, sin = cos[:, None, :, :], sin[:, None, :, :]  # [B, 1, 1, d]: over heads
        # the additive float mask, built once per step: the fused kernel (cpu_attention.py) and cascade's flash
        # call take it; the bool mask cost the same inside SDPA (measured: 59 ms for 30 layers either way)
        additive = _additive(mask, x.dtype)  # [B, W + 1]
        attn_mask = additive[:, None, None, :]  # [B, 1, 1, W + 1]
        # A finished row still in the batch (this step's column masked) gets a wholly masked row for the fused
        # kernel, which then reads none of its cache (on the FrozenLake study's rollout a fifth of the columns a
        # step reads) and returns zeros; its output is never sampled. Torch's attention keeps the real mask: a
        # wholly masked row would make NaN keys and values for this step's column.
        kernel_mask = additive.masked_fill((mask[:, -1] == 0)[:, None], float("-inf")) if prefix is None else additive
        if prefix is not None:
            own_mask = additive[:, prefix.width :]  # [B, S] the columns after the shared ones (this step's included)
            shared_mask = prefix.additive(x.dtype)
        k_end = (nh + nkv) * d
        layers = cast(list[Any], cache.layers)
        ops = self._fused_ops(x) if all(hasattr(kv, "grow") for kv in layers) else None
        if ops is not None:
            rows_cos, rows_sin = cos.reshape(b, d), sin.reshape(b, d)  # [B, d] each
            low = self.matmul_dtype == torch.bfloat16
        for i, (layer, kv) in enumerate(zip(self._layers, layers, strict=True)):
            # One query token per row: the nh // nkv query heads that share a key/value head become that
            # head's query rows, so attention reads each cached key and value once, with no GQA expansion
            # (heads h*g .. h*g+g-1 use kv head h, as transformers' repeat_kv orders them). Measured at batch
            # 64 over a 240-token cache: 48 ms for 30 layers against 56 with enable_gqa.
            if ops is not None:  # the same arithmetic in fewer, fused ops (_fused_ops)
                qkv = self._linear(ops.rms_norm_to(x, layer.norm1, self.eps, low), layer.qkv, layer.qkv_bias,
                                   keep=True)  # [B, (nh + 2 nkv) d] in the matmuls' dtype
                k_buf, v_buf, slot = kv.grow(1)
                q = ops.rotary_kv(qkv, rows_cos, rows_sin, k_buf, v_buf, slot, nh, nkv)  # [B, nkv, nh // nkv, d]
                keys, values = kv.keys, kv.values  # [B, nkv, W + 1, d] views of the preallocated cache
            else:
                h = self._rms(x, layer.norm1)
                qkv = self._linear(h, layer.qkv, layer.qkv_bias)  # [B, (nh + 2 nkv) d]
                qk = qkv[:, :k_end].view(b, nh + nkv, 1, d)
                qk = qk * cos + _rotate_half(qk) * sin  # rotary on the query and key heads at once
                q, k = qk[:, :nh], qk[:, nh:]
                v = qkv[:, k_end:].view(b, nkv, 1, d)
                keys, values = kv.update(k, v)  # [B, nkv, W + 1, d] views of the preallocated cache
                q = q.reshape(b, nkv, nh // nkv, d)
            if prefix is not None:
                # one kernel call: each row's softmax over its group's shared columns, then its own
                shared = Shared(prefix.keys_t(i), prefix.values32(i), shared_mask, prefix.source)
                fused = decode_attention(q, keys, values, own_mask, self.scale, shared=shared)
                a = fused[0] if fused is not None else self._cascade(q, keys, values, prefix, i, own_mask)
            elif (fused := decode_attention(q, keys, values, kernel_mask, self.scale)) is not None:
                a = fused[0]  # [B, nkv, nh // nkv, d]: the fused kernel of cpu_attention.py
            else:  # in the cache's dtype (the output goes to the o projection's bf16 matmul as it is)
                a = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=attn_mask,
                                                   scale=self.scale)
            x = x + self._linear(a.reshape(b, nh * d), layer.o, layer.o_bias, keep=True)
            if ops is not None:
                gate_up = self._linear(ops.rms_norm_to(x, layer.norm2, self.eps, low), layer.gate_up, keep=True)
                x = x + self._linear(ops.silu_mul(gate_up), layer.down, keep=True)
            else:
                h = self._rms(x, layer.norm2)
                gate, up = self._linear(h, layer.gate_up, keep=True).chunk(2, dim=-1)
                x = x + self._linear(F.silu(gate) * up, layer.down, keep=True)
        hidden = self._rms(x, self._final_norm)  # [B, H] the last hidden state (a value head reads it)
        self.last_hidden = hidden
        return self._linear(hidden, self._head)

    def _fused_ops(self, x: torch.Tensor) -> Any | None:
        """cpu_attention's fused small ops for a step or prefill of the residual stream ``x``, or None (the separate
        torch ops then run). They apply on a CPU build of the kernel, to an fp32 residual stream with matmuls in fp32
        or bf16 on packed weights (oneDNN or panels: a contiguous [B, N] output); a step's rotary embedding and cache
        append also need growing caches (``kv.grow``). Per layer of a step they replace the norms' casts to the
        matmuls' dtype, the query and key heads' cast back to fp32, rotary's seven ops, the cache writes and the
        MLP's split, SiLU and product: at 17 rows a step over a 600-token cache, SmolLM2 with bf16 matmuls, a step
        took 36.2-36.3 ms against 41.3-44.3 ms (docs/benchmarks.md). A prefill fuses its norms with their casts, its
        rotary embedding with the cache writes (on growing caches; ``rotary_prefill``) and its SiLU with the
        product."""
        if (x.device.type != "cpu" or x.dtype != torch.float32 or not self.packed or self.head_dim % 2
                or self.matmul_dtype not in (torch.float32, torch.bfloat16)):
            return None
        return step_ops()

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: DynamicCache) -> torch.Tensor:
        """Feed ``ids`` ([B, T] long, left-padded) at ``positions`` ([B, T] long) on top of ``cache`` (W - T
        columns filled, room for T more); ``mask`` [B, W] (1 on real tokens) covers the cache and the new tokens.
        Appends the new tokens' keys and values to ``cache`` and returns the logits of the last position [B, V]
        (its hidden state: ``last_hidden``). The same weights and arithmetic as :meth:`step`, with T tokens a row:
        the weight matmuls get B·T rows, at the packed kernels' full rate, and a query attends to the real
        columns up to its own. A padding query attends to itself too, so every row of the softmax has a term and
        the keys and values written for padding stay finite (the mask hides them from later queries)."""
        if self._stale:
            self._build()
        b, t = ids.shape
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        g, width = nh // nkv, mask.shape[1]
        x = self._embed[ids]  # [B, T, H]
        cos, sin = self.rotary(x, positions)  # [B, T, d] each
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, d]: over heads
        own = width - t + torch.arange(t, device=ids.device)  # [T] each query's column
        # A query attends to the real columns before its own, and to its own. On a bf16 cache where the CPU has
        # AVX512-BF16 that is cpu_attention's segment kernel: bounds (own, own, own), the real columns as the flags
        # of the first range. Elsewhere SDPA, with the g query heads that share a key/value head as its query rows
        # (as in step) and an additive mask [B, 1, g·T, W].
        seg = segment_ops() if self.cache_dtype == torch.bfloat16 and d == 64 and x.device.type == "cpu" else None
        if seg is not None:
            bounds = own.to(torch.int32)[:, None].expand(b, t, 3).contiguous()  # [B, T, 3]
            real = (mask != 0).contiguous()  # [B, W]
        else:
            cols = torch.arange(width, device=ids.device)
            allowed = ((mask[:, None, :] != 0) & (cols <= own[:, None])) | (cols == own[:, None])  # [B, T, W]
            additive = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill_(~allowed,
                                                                                               float("-inf"))
            attn_mask = additive[:, None, None].expand(b, 1, g, t, width).reshape(b, 1, g * t, width)
        k_end = (nh + nkv) * d
        layers = cast(list[Any], cache.layers)
        ops = self._fused_ops(x)
        low = self.matmul_dtype == torch.bfloat16
        # the rotary embedding and the cache append as one op, as a step runs them, where the cache grows in place
        rotary = ops if ops is not None and all(hasattr(kv, "grow") for kv in layers) else None
        rows_cos, rows_sin = cos.reshape(b * t, d), sin.reshape(b * t, d)  # [B·T, d] each
        for layer, kv in zip(self._layers, layers, strict=True):
            if rotary is not None:
                qkv = self._linear(rotary.rms_norm_to(x.view(b * t, -1), layer.norm1, self.eps, low), layer.qkv,
                                   layer.qkv_bias, keep=True)  # [B·T, (nh + 2 nkv) d] in the matmuls' dtype
                k_buf, v_buf, slot = kv.grow(t)
                # [B, nh, T, d], in the cache's dtype, which attention below reads them in
                q = rotary.rotary_prefill(qkv, rows_cos, rows_sin, k_buf, v_buf, slot, t, nh, nkv,
                                          k_buf.dtype == torch.bfloat16)
                keys, values = kv.keys, kv.values  # [B, nkv, W, d]
            else:
                if ops is not None:  # the norm's output in the matmuls' dtype; rotary below in fp32, as without
                    qkv = self._linear(ops.rms_norm_to(x.view(b * t, -1), layer.norm1, self.eps, low), layer.qkv,
                                       layer.qkv_bias, keep=True).float().view(b, t, -1)
                else:
                    h = self._rms(x, layer.norm1)
                    qkv = self._linear(h.view(b * t, -1), layer.qkv, layer.qkv_bias).view(b, t, -1)
                qk = qkv[..., :k_end].view(b, t, nh + nkv, d).transpose(1, 2)  # [B, nh + nkv, T, d]
                qk = qk * cos + _rotate_half(qk) * sin
                q, k = qk[:, :nh], qk[:, nh:]
                v = qkv[..., k_end:].view(b, t, nkv, d).transpose(1, 2)  # [B, nkv, T, d]
                keys, values = kv.update(k, v)  # [B, nkv, W, d]
            if seg is not None:  # [B, T, nh, d] bf16
                a = seg.segment_attention_fwd(q.to(torch.bfloat16), keys, values, bounds, self.scale, real)[0]
                a = a.reshape(b * t, nh * d)
            else:
                q = q.reshape(b, nkv, g * t, d).to(keys.dtype)  # heads h·g .. h·g + g - 1 read key/value head h
                a = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=self.scale)
                # reshape: CUDA's kernels may return [B, nkv, g·T, d] in another memory layout than a CPU's
                a = a.reshape(b, nh, t, d).transpose(1, 2).reshape(b * t, nh * d)
            x = x + self._linear(a, layer.o, layer.o_bias, keep=True).view(b, t, -1)
            if ops is not None:
                gate_up = self._linear(ops.rms_norm_to(x.view(b * t, -1), layer.norm2, self.eps, low),
                                       layer.gate_up, keep=True)
                x = x + self._linear(ops.silu_mul(gate_up), layer.down, keep=True).view(b, t, -1)
            else:
                h = self._rms(x, layer.norm2).view(b * t, -1)
                gate, up = self._linear(h, layer.gate_up, keep=True).chunk(2, dim=-1)
                x = x + self._linear(F.silu(gate) * up, layer.down, keep=True).view(b, t, -1)
        hidden = self._rms(x[:, -1], self._final_norm)  # [B, H]
        self.last_hidden = hidden
        return self._linear(hidden, self._head)

    def _cascade(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: SharedPrefix, layer: int,
                 own_mask: torch.Tensor) -> torch.Tensor:
        """Attention of q [B, nkv, g, d] over the cache without the fused kernel, in two parts merged by their
        log-sum-exps (cascade attention, as in FlashInfer and vLLM): the shared columns once per prompt group,
        that group's query rows stacked ([U, nkv, n·g, d]), then each row over its own columns
        (``keys``/``values``, the batch cache). The same softmax over the union, up to float rounding; the shared
        keys are read U times instead of B."""
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        _, nkv, g, d = q.shape
        pk, pv = prefix.layers[layer]
        gather, back, n, shared_mask = prefix.plan(pk.dtype)
        groups = shared_mask.shape[0]
        cq = q.to(pk.dtype)  # in the cache's dtype
        stacked = torch.cat([cq, cq.new_zeros(1, nkv, g, d)])[gather]  # [U·n, nkv, g, d]; row B: a hole's zeros
        stacked = stacked.view(groups, n, nkv, g, d).transpose(1, 2).reshape(groups, nkv, n * g, d)
        o1, l1 = flash(stacked, pk, pv, 0.0, False, attn_mask=shared_mask, scale=self.scale)
        o1 = o1.view(groups, nkv, n, g, d).transpose(1, 2).reshape(groups * n, nkv, g, d)[back]  # [B, nkv, g, d]
        l1 = l1.view(groups, nkv, n, g).transpose(1, 2).reshape(groups * n, nkv, g)[back]  # [B, nkv, g]
        own = decode_attention(q, keys, values, own_mask, self.scale)  # a row's own columns: the fused kernel
        o2, l2 = own if own is not None else flash(cq, keys, values, 0.0, False,
                                                   attn_mask=own_mask[:, None, None, :].to(pk.dtype), scale=self.scale)
        top = torch.maximum(l1, l2)
        w1, w2 = (l1 - top).exp_(), (l2 - top).exp_()
        total = w1 + w2
        # the log-sum-exps are fp32 whatever q's dtype: the merged output goes back to q's (a bf16 model's)
        return (o1 * (w1 / total)[..., None] + o2 * (w2 / total)[..., None]).to(q.dtype)


PACK_ROWS_HINT = 64
"""The batch size oneDNN's packed layout is chosen for; measured fast for 1 to 64 rows (module docstring)."""


def _pack(weight: torch.Tensor, panels: bool) -> Weight:
    """``weight`` [N, K] packed (a new tensor): in panels for ``cpu_attention.panel_linear`` where ``panels``
    (falling back to oneDNN where the kernel does not pack it), else in oneDNN's blocked layout for
    ``mkldnn._linear_pointwise``."""
    packed = pack_panels(weight) if panels else None
    return packed if packed is not None else torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(),
                                                                                     PACK_ROWS_HINT)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An attention mask (1 on real tokens) as the additive float mask: 0 on real tokens, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask == 0, float("-inf"))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
