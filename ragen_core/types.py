"""Typed records passed between the parts of ragen_core (STYLE.md rule 4).

Turn and Trajectory are what a rollout produces (plain Python, serialisable to
Parquet; ``Trajectory.meta`` is a :class:`TrajectoryMeta`); TokenBatch is what the
trainer consumes (tensors, one row per trajectory); UpdateStats is what one update
reports. One training iteration hands them on as :class:`RolloutBatch` (rollout ->
filter, diagnostics, record) and :class:`Selection` (filter -> update, record).

Token alignment convention used everywhere: every per-token tensor of a
TokenBatch is aligned with ``input_ids`` positions. ``old_logprobs[b, t]`` is
log p(input_ids[b, t] | input_ids[b, :t]); position 0 is never trained.
Turn boundaries are explicit (``turn_ids``, ``turn_ends``), never inferred from
non-zero rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

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
    values: tuple[float, ...] = ()
    """The critic head's value of the state before each of ``response_ids`` at sampling time (``Generation.values``;
    empty when the generator records none). It spares the update a forward for its old values (trainer.update)."""
    state_key: str = ""
    """Key of the env state this turn acted on (``info["state_key"]`` before its actions; equal keys = equal states).
    GiGPO's step groups are the turns of one prompt group with equal keys; '' (unknown) never joins a step group."""


class TrajectoryMeta(TypedDict, total=False):
    """What ``rollout.loop`` records next to a trajectory's turns (JSON in the Parquet shard's ``meta_json``).

    Every key is optional to readers: trajectories built elsewhere than the rollout loop (by hand in tests, by
    another producer) may lack any of them, so readers use ``meta.get(key, default)``.
    """

    env_name: str
    """The registered env name (``EnvConfig.name``; ``Trajectory.env_tag`` is its label)."""
    member: int
    """Index of this trajectory within its prompt group (0..N-1)."""
    dynamics_seed: int
    """The env's ``options={"dynamics_seed": ...}`` at reset (its own luck within the group)."""
    system_prompt: str
    """The system prompt the trajectory was rendered with."""
    prefill: str
    """The tag prefilled at the start of every assistant message ('' when none); part of the prompt."""
    instruction: str
    """The instruction block of the first user message (to re-render the head exactly)."""
    user_texts: list[str]
    """One user message per turn, as rendered (the first without the instruction block)."""
    named_actions: list[int]
    """Per turn: how many actions the reply named."""
    unknown_actions: list[int]
    """Per turn: how many of those the env did not recognise (or rejected)."""
    context_overflow: bool
    """True when even the instruction and the newest turn no longer fitted the context (episode truncated)."""


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
    meta: TrajectoryMeta = field(default_factory=TrajectoryMeta)
    """Rendering and diagnostic facts of the rollout (see :class:`TrajectoryMeta`)."""

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
    """Trainer input: one right-padded row per trajectory (or per turn, ``episode_ids``); [B, T] tensors aligned to
    input_ids."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] bool, False on padding
    loss_mask: torch.Tensor  # [B, T] bool, True exactly on tokens the model generated
    old_logprobs: torch.Tensor  # [B, T] float, sampling logprobs where loss_mask, else 0
    rewards: torch.Tensor  # [B, T] float, reward placed on the last generated token (or each turn's)
    turn_ids: torch.Tensor  # [B, T] long, turn index of each token, -1 on padding
    turn_ends: torch.Tensor  # [B, T] bool, True on the last generated token of each turn
    group_ids: torch.Tensor  # [B] long, trajectories sharing an initial state
    returns: torch.Tensor  # [B] float, trajectory total_return (GRPO input)
    old_values: torch.Tensor | None = None  # [B, T] float, critic head values at sampling where loss_mask, else 0
    # Per turn of the trajectory (K = the most turns of a row, Trajectory.turns order, also turns the row dropped):
    turn_rewards: torch.Tensor | None = None  # [B, K] float, each turn's reward + penalty, 0 past the last turn
    turn_states: torch.Tensor | None = None  # [B, K] long, each turn's state key as an id (same key, same id), -1 after
    # Per-turn rows (rollout.context_window K): each row is one turn of a trajectory; rows sharing an id are one
    # trajectory's turns (GRPO's group statistics count it once). None: each row is a whole trajectory.
    episode_ids: torch.Tensor | None = None  # [B] long

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: torch.Tensor | list[int]) -> TokenBatch:
        """A new batch with only ``rows`` (used for mini-batches and filtering)."""
        # lazily: types.py stays torch-free for env-only users (see the TYPE_CHECKING import)
        import torch

        idx = torch.as_tensor(rows, dtype=torch.long)
        gi = self.group_ids.index_select(0, idx)
        sub = {name: getattr(self, name).index_select(0, idx) for name in _ROW_FIELDS}
        # trim columns that are padding in every selected row
        width = int(sub["attention_mask"].any(0).nonzero().max().item()) + 1 if len(idx) else 0
        if self.old_values is not None:
            sub["old_values"] = self.old_values.index_select(0, idx)
        sub = {k: v[:, :width] if v.dim() == 2 else v for k, v in sub.items()}
        # per-turn tensors [b, K] are indexed by turn, not cut like the token columns
        rewards = None if self.turn_rewards is None else self.turn_rewards.index_select(0, idx)
        states = None if self.turn_states is None else self.turn_states.index_select(0, idx)
        episodes = None if self.episode_ids is None else self.episode_ids.index_select(0, idx)
        return TokenBatch(**sub, group_ids=gi, returns=self.returns.index_select(0, idx), turn_rewards=rewards,
                          turn_states=states, episode_ids=episodes)


_ROW_FIELDS = ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "rewards", "turn_ids", "turn_ends")


@dataclass(frozen=True)
class UpdateStats:
    """What one update (all optimizer steps of one rollout batch) reports, as flat metrics."""

    metrics: dict[str, float]
    """Namespaced metric name (actor/..., critic/..., response/..., timing/..., perf/...) -> value."""
    optimizer_steps: int = 0


class RolloutBatch:
    """One iteration's trajectories and their metrics: the rollout step's output.

    A plain class on purpose, like :class:`Selection`: Prefect walks (and may rebuild) dataclass task
    arguments, and these travel between Prefect tasks.
    """

    iteration: int
    """The iteration that sampled them (the policy after ``iteration`` updates)."""
    trajectories: list[Trajectory]
    """P·k prompt groups × N responses, group by group (``group_id`` says which)."""
    metrics: dict[str, float]
    """Rollout metrics (env/, rollout/, response/, timing/, perf/)."""

    def __init__(self, iteration: int, trajectories: list[Trajectory], metrics: dict[str, float]) -> None:
        self.iteration = iteration
        self.trajectories = trajectories
        self.metrics = metrics


class Selection:
    """The rows the group filter kept, as a TokenBatch, and which trajectories they are: the update's input."""

    batch: TokenBatch
    """The kept trajectories' training rows: B = kept rows (0 when no group was kept), group by group in
    ascending group id, rollout order within a group (``trainer.filter.FilterResult.batch``); under
    ``rollout.context_window`` K, one row per turn with a reply of those trajectories, in that order."""
    kept: list[bool]
    """[len(trajectories)] one flag per trajectory of the RolloutBatch: True when its row is in ``batch``."""
    metrics: dict[str, float]
    """The filter's metrics (rollout/: kept groups, reward std of all and of the kept ones, ...)."""
    think_tokens: list[float]
    """[B] ``<think>`` tokens of each kept row, summed over its turns (for the response/ metrics)."""
    advantage_scale: float
    """Multiplies the advantages of this update (the filter's ``advantage_scale``; 1.0 = unchanged)."""

    def __init__(self, batch: TokenBatch, kept: list[bool], metrics: dict[str, float],
                 think_tokens: list[float], advantage_scale: float = 1.0) -> None:
        self.batch = batch
        self.kept = kept
        self.metrics = metrics
        self.think_tokens = think_tokens
        self.advantage_scale = advantage_scale
