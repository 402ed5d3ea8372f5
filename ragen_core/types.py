"""Typed records passed between the parts of ragen_core (STYLE.md rule 4).

Turn and Trajectory are what a rollout produces (plain Python, serialisable to
Parquet); TokenBatch is what the trainer consumes (tensors, one row per
trajectory); UpdateStats is what one update reports.

Token alignment convention used everywhere: every per-token tensor of a
TokenBatch is aligned with ``input_ids`` positions. ``old_logprobs[b, t]`` is
log p(input_ids[b, t] | input_ids[b, :t]); position 0 is never trained.
Turn boundaries are explicit (``turn_ids``, ``turn_ends``), never inferred from
non-zero rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily so env-only users pay nothing
    import torch


@dataclass(frozen=True)
class Turn:
    """One turn of a multi-turn episode: what the model saw, sampled and got."""

    observation: str
    """The state text shown to the model at this turn."""
    prompt_ids: tuple[int, ...]
    """Token ids added to the context before this reply (env/user text and template tokens)."""
    response_ids: tuple[int, ...]
    """Exactly the sampled token ids, including the end-of-turn token when it was sampled."""
    logprobs: tuple[float, ...]
    """Log-probabilities of ``response_ids`` under the sampling distribution."""
    response_text: str
    """The assistant message as it reads: the prefilled tag (``Trajectory.meta["prefill"]``, part of the
    prompt) and then the decoded reply; for reading and parsing only (training uses ``response_ids``)."""
    actions: tuple[str, ...]
    """Actions of the reply that were valid and executed, in order."""
    reward: float
    """Sum of env rewards of the executed actions."""
    penalty: float
    """Format penalty of this turn (0.0 or e.g. -0.1), plus any partial format credit."""
    parse_ok: bool
    """True when the reply parsed and named only valid actions."""
    finish_reason: str = "stop"
    """'stop' (end-of-turn sampled) or 'length' (max new tokens reached)."""
    think_tokens: int = 0
    """Number of tokens inside <think>...</think> (0 in NoThink mode)."""
    n_effective_actions: int = 0
    """Executed actions that changed the env state."""


@dataclass(frozen=True)
class Trajectory:
    """A whole episode: the unit StarPO optimises (SPEC §1)."""

    env_tag: str
    seed: int
    group_id: int
    turns: tuple[Turn, ...]
    success: bool
    terminated: bool
    """The env reached a terminal state (gymnasium meaning)."""
    truncated: bool
    """The episode was cut by a turn or action budget (gymnasium meaning)."""
    dropped_turns: int = 0
    """Older turns removed by the context guard when building the training sequence."""
    meta: dict = field(default_factory=dict)

    @property
    def env_return(self) -> float:
        """Raw env reward, penalties excluded (used by the uncertainty filter, SPEC §4)."""
        return float(sum(t.reward for t in self.turns))

    @property
    def total_return(self) -> float:
        """Env reward plus format penalties: the trajectory's training reward."""
        return float(sum(t.reward + t.penalty for t in self.turns))

    @property
    def n_actions(self) -> int:
        return sum(len(t.actions) for t in self.turns)

    @property
    def n_effective_actions(self) -> int:
        return sum(t.n_effective_actions for t in self.turns)

    @property
    def response_tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.turns)


@dataclass(frozen=True)
class TokenBatch:
    """Trainer input: one right-padded row per trajectory; all [B, T] tensors aligned to input_ids."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] bool, False on padding
    loss_mask: torch.Tensor  # [B, T] bool, True exactly on tokens the model generated
    old_logprobs: torch.Tensor  # [B, T] float, sampling logprobs where loss_mask, else 0
    rewards: torch.Tensor  # [B, T] float, reward placed on the last generated token (or each turn's)
    turn_ids: torch.Tensor  # [B, T] long, turn index of each token, -1 on padding
    turn_ends: torch.Tensor  # [B, T] bool, True on the last generated token of each turn
    group_ids: torch.Tensor  # [B] long, trajectories sharing an initial state
    returns: torch.Tensor  # [B] float, trajectory total_return (GRPO input)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: torch.Tensor | list[int]) -> TokenBatch:
        """A new batch with only ``rows`` (used for mini-batches and filtering)."""
        import torch

        idx = torch.as_tensor(rows, dtype=torch.long)
        gi = self.group_ids.index_select(0, idx)
        sub = {name: getattr(self, name).index_select(0, idx) for name in _ROW_FIELDS}
        # trim columns that are padding in every selected row
        width = int(sub["attention_mask"].any(0).nonzero().max().item()) + 1 if len(idx) else 0
        sub = {k: v[:, :width] if v.dim() == 2 else v for k, v in sub.items()}
        return TokenBatch(**sub, group_ids=gi, returns=self.returns.index_select(0, idx))


_ROW_FIELDS = ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "rewards", "turn_ids", "turn_ends")


@dataclass(frozen=True)
class UpdateStats:
    """What one update (all optimizer steps of one rollout batch) reports, as flat metrics."""

    metrics: dict[str, float]
    """Namespaced metric name (actor/..., critic/..., response/..., timing/..., perf/...) -> value."""
    optimizer_steps: int = 0
