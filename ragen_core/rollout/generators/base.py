"""The Generator protocol shared by the generation backends (hf, vllm) and the records it exchanges.

A generator turns token-id prompts into sampled token ids, their log-probabilities under the sampling
distribution, and a finish reason per row. The multi-turn loop (``ragen_core.rollout``) codes against
this protocol only, so backends are interchangeable (DESIGN §4 "Generation").

Log-probability convention (the one the trainer recomputes, so PPO ratios start at exactly 1):
``logprob = log_softmax(logits / temperature)[sampled_id]``. top-p only restricts which ids can be
sampled; the reported log-probability is NOT renormalised over the nucleus. With ``temperature == 0``
decoding is greedy and the reported log-probability is ``log_softmax(logits)[argmax]``.

Nothing to run here; see ``hf.py`` and ``vllm_backend.py``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

FINISH_STOP = "stop"
"""A stop token (e.g. the end-of-turn token) was sampled; it is the last of ``token_ids``."""
FINISH_LENGTH = "length"
"""``max_new_tokens`` (or the model's context length) was reached before a stop token."""

STAT_KEYS = ("prefill_tokens", "prefill_seconds", "decode_tokens", "decode_seconds", "generated_tokens")
"""Counters every backend's ``stats`` reports (cumulative since construction)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one call's continuations (the same for every row of the call)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    max_new_tokens: int = 128
    """Most tokens sampled per row (also capped by the model's context length)."""
    stop_token_ids: tuple[int, ...] = ()
    """A row stops right after sampling one of these; the stop token is included in ``token_ids``."""
    seed: int | None = None
    """When set, sampling is reproducible: row ``i`` draws from its own stream seeded by ``(seed, streams[i])``."""
    streams: tuple[int, ...] | None = None
    """The stream of each row (one per prompt; default: the row's index). The rollout loop passes each episode's
    global index, so an episode samples the same tokens whichever other episodes share the call: the ones still
    live, or only this process's share of the groups in a multi-process run."""
    last_turn: bool = False
    """No session of this call has a next turn (the rollout loop's last allowed turn): a backend that keeps each
    row's cache for its session's next call (hf) keeps none. Reuse of caches kept before still applies."""

    def stream(self, row: int) -> int:
        """The random stream of row ``row`` (its index unless ``streams`` says otherwise)."""
        return row if self.streams is None else self.streams[row]

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # normalise a list (or any iterable) to a tuple so the frozen record stays hashable and immutable
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.streams is not None:
            object.__setattr__(self, "streams", tuple(int(r) for r in self.streams))


@dataclass(frozen=True)
class Generation:
    """What one prompt row produced."""

    token_ids: tuple[int, ...]
    """Exactly the sampled ids, including the stop token when one was sampled."""
    logprobs: tuple[float, ...]
    """Log-prob of each sampled id under ``log_softmax(logits / temperature)`` (module docstring)."""
    finish_reason: str
    """``"stop"`` or ``"length"``."""
    values: tuple[float, ...] | None = None
    """With a value head (``HFGenerator(value_head=...)``): per sampled id, the head's value of the state it was
    sampled in (the hidden state its logits came from), i.e. what the trainer's critic forward gives at that
    position (``trainer.models.critic_values``); None when the backend records no values."""


@runtime_checkable
class Generator(Protocol):
    """Samples continuations of token-id prompts (the rollout loop's only view of a model)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        session_ids: Sequence[Hashable] | None = None,
    ) -> list[Generation]:
        """One ``Generation`` per prompt, in order.

        ``prompts`` are the FULL token context of each row. With ``session_ids`` (one per row, distinct),
        a backend may reuse what it kept for that session when the cached tokens (previous prompt +
        generated ids) are a prefix of the new prompt, prefilling only the new suffix; otherwise it falls
        back to a full prefill. Outputs do not depend on whether a cache was reused (logprobs within 1e-4).
        """
        ...

    def end_sessions(self, session_ids: Iterable[Hashable]) -> None:
        """Forget the named sessions and free their caches (unknown ids are ignored)."""
        ...

    def update_weights(self, model: torch.nn.Module) -> None:
        """Generate with ``model``'s current weights from now on (call after each trainer update)."""
        ...

    @property
    def stats(self) -> dict[str, float]:
        """Cumulative counters; at least the keys in ``STAT_KEYS``."""
        ...
