"""Training engines: the seam between the update loop and how backward/optimizer steps happen.

The update runs each micro-batch's loss as ``engine.forward(fn, ...)``, then
calls ``engine.backward(loss)``, and ``engine.step()`` once per mini-batch, so a
DeepSpeed engine (ZeRO, several processes) can replace :class:`TorchEngine`
without touching the update math. Code that reads or writes the weights
outside a forward (checkpoints, saving a model, a vLLM weight sync) does so
inside ``engine.full_weights()`` (ZeRO-3 keeps only a slice of each weight).
``ENGINES`` maps ``trainer.backend`` to a factory: "torch" (:class:`TorchEngine`)
and "deepspeed" (``ragen_core.trainer.deepspeed_engine``, imported only when
chosen, so this module never needs deepspeed).

    actor_engine, critic_engine = make_engines(models, cfg)

Run the tests with ``python -m pytest tests/unit/trainer -q``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import nn

from ragen_core.config import ExperimentConfig
from ragen_core.trainer.models import PolicyModels, resolve_device

__all__ = ["ENGINES", "Engine", "Precision", "TorchEngine", "adamw", "bump_versions", "learning_rates", "make_engines",
           "trainable_parameters"]

T = TypeVar("T")


class Engine(Protocol):
    """Forward, backward and optimizer step for one trained module (actor, or critic)."""

    def forward(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, a forward pass of this engine's modules, run the way the engine needs."""

    def full_weights(self, modify: bool = False) -> contextlib.AbstractContextManager[None]:
        """Inside, the modules' parameters hold their whole values (``modify``: writes to them are kept)."""

    def generation_weights(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the modules' own forwards (the hf generator's, the collapse diagnostics') run on whole weights
        and gather nothing per layer; no gradients and no optimizer step inside."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of ``loss`` (a micro-batch's share of the mini-batch loss)."""

    def step(self) -> float:
        """Clip the accumulated gradients to ``grad_clip``, step, zero them; return the pre-clip global norm."""

    @property
    def lr(self) -> float:
        """Learning rate of the first parameter group."""

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(rank, world size): the update trains this process's share of each mini-batch; (0, 1) = all of it."""

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state for checkpoints."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


def adamw(param_groups: list[dict[str, Any]], betas: tuple[float, float], weight_decay: float) -> torch.optim.AdamW:
    """AdamW with the fused kernel: one pass over all parameters, no temporaries of the parameters' size.

    On CPU with SmolLM2-135M a step takes about a fifth of the time of the default ``foreach`` one, which
    also allocates about 0.5 GB of temporaries (a demo iteration takes 4 steps)."""
    return torch.optim.AdamW(param_groups, betas=betas, weight_decay=weight_decay, fused=True)


def bump_versions(params: list[torch.Tensor]) -> None:
    """Move the parameters' version counters after an optimizer step that wrote them.

    Readers of the weights (the hf generator's caches and its fast decode step) see an update by these
    counters, but neither fused AdamW nor DeepSpeed ZeRO-1/2's copy back from its flat buffers moves
    them (measured: both leave ``p._version`` as it was)."""
    torch.autograd.graph.increment_version(params)


class TorchEngine:
    """Plain PyTorch: ``loss.backward()``, ``clip_grad_norm_`` over all parameters, AdamW.

    A step whose gradient norm is not finite is skipped (gradients dropped, the
    optimizer untouched) rather than writing NaN into the weights; ``skipped``
    counts such steps.
    """

    def __init__(
        self, param_groups: list[dict[str, Any]], betas: tuple[float, float], weight_decay: float, grad_clip: float,
        precision: Precision | None = None, frozen: FrozenCasts | None = None,
    ) -> None:
        self.params = [p for g in param_groups for p in g["params"]]
        self.optimizer = adamw(param_groups, betas, weight_decay)
        self.grad_clip = grad_clip
        self.skipped = 0
        self.precision = precision or Precision()
        self.frozen = frozen

    def forward(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self.precision.autocast(), self.frozen.swapped() if self.frozen else contextlib.nullcontext():
            return fn(*args, **kwargs)

    def full_weights(self, modify: bool = False) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the parameters always are the whole weights

    def generation_weights(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        if math.isfinite(norm):
            self.optimizer.step()
            bump_versions(self.params)
        else:
            self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def data_parallel(self) -> tuple[int, int]:
        return 0, 1

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.skipped = int(state.get("skipped", 0))


@dataclasses.dataclass(frozen=True)
class Precision:
    """trainer.precision on a device: the autocast dtype of forwards (None: fp32). Backwards run in the dtypes
    their forwards chose; the trained weights and the optimizer state are fp32 (models.fp32_masters)."""

    device_type: str = "cpu"
    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> Precision:
        device = resolve_device(cfg.model.device)
        if device.type == "cuda":  # TF32 for the fp32 matmuls left (all of them under fp32)
            torch.backends.cuda.matmul.allow_tf32 = cfg.trainer.tf32
            torch.backends.cudnn.allow_tf32 = cfg.trainer.tf32
        return cls(device.type, torch.bfloat16 if compute_precision(cfg) == "bf16" else None)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


class FrozenCasts:
    """Copies in the autocast dtype of the frozen fp32 weights of linear layers (a LoRA base, a reference model),
    kept between forwards and put in their layers' place for each forward under autocast.

    Autocast keeps the casts it makes only of weights that require grad: every forward otherwise casts each frozen
    weight again (on a CPU with AVX512-BF16, those copies take about 8% of the vanilla Bandit update). The copies
    hold the values autocast would compute with, so the results are the same bit for bit.
    A copy is remade when its weight's address or version counter moved (a load_state_dict). The layers hold
    the copies (as frozen Parameters) only inside :meth:`swapped`; a backward after it uses the copies its
    forward saved. An output layer tied to the input embedding gets a copy too, in the linear layer only: the
    embedding's lookup keeps the fp32 weight.
    """

    def __init__(self, modules: Sequence[nn.Module | None], dtype: torch.dtype) -> None:
        present = [m for m in modules if m is not None]
        seen: set[int] = set()
        self.layers: list[nn.Linear] = []
        for m in present:
            for layer in m.modules():
                w = getattr(layer, "weight", None)
                if (isinstance(layer, nn.Linear) and isinstance(w, torch.Tensor) and not w.requires_grad
                        and w.dtype == torch.float32 and id(layer) not in seen):
                    seen.add(id(layer))
                    self.layers.append(layer)
        self.dtype = dtype
        self._copies: dict[int, tuple[tuple[int, int], nn.Parameter]] = {}

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        originals: list[tuple[nn.Linear, nn.Parameter]] = []
        try:
            with torch.no_grad():
                for layer in self.layers:
                    w = cast(nn.Parameter, layer.weight)
                    key = (w.data_ptr(), w._version)
                    hit = self._copies.get(id(layer))
                    if hit is None or hit[0] != key:
                        hit = (key, nn.Parameter(w.detach().to(self.dtype), requires_grad=False))
                        self._copies[id(layer)] = hit
                    originals.append((layer, w))
                    layer._parameters["weight"] = hit[1]
            yield
        finally:
            for layer, w in originals:
                layer._parameters["weight"] = w


def compute_precision(cfg: ExperimentConfig) -> str:
    """trainer.precision with ``auto`` resolved for the run's device: "fp32" or "bf16"."""
    if cfg.trainer.precision != "auto":
        return cfg.trainer.precision
    return "bf16" if resolve_device(cfg.model.device).type == "cpu" and cpu_multiplies_bf16() else "fp32"


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags (Linux /proc/cpuinfo) of bf16 dot-product instructions, which oneDNN's bf16 matmuls run on. Without
them bf16 matmuls are emulated and slower than fp32; with AVX512-BF16 they run at about 4x the fp32 rate at
SmolLM2's shapes."""


def cpu_multiplies_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU this process runs on has bf16 dot-product instructions (:data:`NATIVE_BF16_FLAGS`); False
    where unknown."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in NATIVE_BF16_FLAGS)
    except OSError:
        pass
    return False


def trainable_parameters(*modules: nn.Module | None) -> list[nn.Parameter]:
    """The parameters with ``requires_grad`` of the given modules (None entries skipped), in module order."""
    return [p for m in modules if m is not None for p in m.parameters() if p.requires_grad]


def learning_rates(cfg: ExperimentConfig) -> tuple[float, float]:
    """(actor lr, critic lr). Under LoRA both are multiplied by ``lora_lr_multiplier`` (SPEC §4: LoRA lr ×10),
    since the critic then trains adapters too."""
    mult = cfg.trainer.lora_lr_multiplier if cfg.model.lora_rank > 0 else 1.0
    return cfg.trainer.actor_lr * mult, cfg.trainer.critic_lr * mult


def _torch_engines(models: PolicyModels, cfg: ExperimentConfig) -> tuple[Engine, Engine | None]:
    t = cfg.trainer
    actor_lr, critic_lr = learning_rates(cfg)
    groups = [{"params": trainable_parameters(models.actor), "lr": actor_lr}]
    if models.value_head is not None:  # the head shares the actor's backward, so it shares its engine
        groups.append({"params": trainable_parameters(models.value_head), "lr": critic_lr})
    precision = Precision.of(cfg)
    frozen = None  # on a GPU the copies would cost memory the card needs more than the casts' time
    if precision.dtype is not None and precision.device_type == "cpu":
        frozen = FrozenCasts([models.actor, models.critic, models.ref], precision.dtype)
    actor = TorchEngine(groups, t.betas, t.weight_decay, t.grad_clip, precision, frozen)
    critic = None
    if models.critic is not None:
        critic = TorchEngine([{"params": trainable_parameters(models.critic), "lr": critic_lr}], t.betas,
                             t.weight_decay, t.grad_clip, precision, frozen)
    return actor, critic


def _deepspeed_engines(models: PolicyModels, cfg: ExperimentConfig) -> tuple[Engine, Engine | None]:
    # Imported here, so that deepspeed is needed only when this backend is chosen.
    from ragen_core.trainer.deepspeed_engine import deepspeed_engines

    return deepspeed_engines(models, cfg)


EngineFactory = Callable[[PolicyModels, ExperimentConfig], tuple[Engine, "Engine | None"]]

ENGINES: dict[str, EngineFactory] = {"torch": _torch_engines, "deepspeed": _deepspeed_engines}
"""trainer.backend -> factory of (actor engine, critic engine or None)."""


def make_engines(models: PolicyModels, cfg: ExperimentConfig) -> tuple[Engine, Engine | None]:
    """Engines for ``cfg.trainer.backend``; the critic engine is None without a separate critic."""
    backend = cfg.trainer.backend
    if backend not in ENGINES:
        raise ValueError(
            f"trainer.backend {backend!r} has no engine in this install (available: {sorted(ENGINES)})"
        )
    engines = ENGINES[backend](models, cfg)
    if compute_precision(cfg) == "bf16" and cfg.model.dtype == "float32":
        keep_lora_inputs(models)
    return engines


def keep_lora_inputs(models: PolicyModels) -> None:
    """LoRA layers pass their input to the adapters as it is, instead of casting it to the adapters' dtype.

    Under bf16 autocast over fp32 weights peft would cast each layer's bf16 activations to fp32 for the adapter,
    and autocast cast them straight back to bf16 for its matmul: two copies per adapted layer, forward and
    backward (about 64k copies an update on the demo's Bandit batch). Without the cast autocast alone sets the
    dtype; outside autocast the activations of fp32 frozen weights are fp32 already, so nothing else changes."""
    for module in (models.actor, models.critic):
        if module is None:
            continue
        for layer in module.modules():
            if hasattr(layer, "cast_input_dtype_enabled"):  # peft's tuner layers (peft >= 0.15)
                cast(Any, layer).cast_input_dtype_enabled = False

