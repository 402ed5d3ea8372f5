"""Two-armed bandit with named arms (SPEC §2; RAGEN paper §4, "Bandit" and "BanditRev").

One pull per episode. The low-risk arm pays a fixed ``low_risk_reward`` (SPEC: 0.15; the
reference code used 0.1); the high-risk arm pays ``high_risk_reward`` (1.0) with probability
``high_risk_prob`` (0.25), else 0. The arms' order is shuffled per seed (layout generator);
the payout is drawn from the dynamics generator. Success = the pulled arm has the higher
expected value (ties count as success), computed from the parameters, so with the defaults
(0.15 < 0.25) the high-risk arm is the right choice. The test of the paper is whether the
model reads name semantics (a "Dragon" sounds risky); BanditRev swaps the roles.

    from ragen_core.envs import make
    env = make("Bandit"); obs, _ = env.reset(seed=0); env.step("Dragon")
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field

from ragen_core.envs.base import StepOutcome, TextEnv, checked_params

__all__ = ["BanditEnv"]

ArmName = Annotated[str, Field(min_length=1, max_length=64)]
"""An arm's name: the action the model answers with, so never empty."""


class BanditEnv(TextEnv):
    """Two named arms, one pull (SPEC §2 table, row Bandit)."""

    name = "Bandit"
    budget_from_rollout = False  # one action by the rules of the game

    @checked_params
    def __init__(
        self,
        *,
        low_risk_name: ArmName = "Phoenix",
        high_risk_name: ArmName = "Dragon",
        low_risk_reward: float = 0.15,
        high_risk_reward: float = 1.0,
        high_risk_prob: Annotated[float, Field(ge=0.0, le=1.0)] = 0.25,
        max_steps: Annotated[int, Field(ge=1)] | None = 1,
    ) -> None:
        super().__init__(max_steps=max_steps)
        if low_risk_name.casefold() == high_risk_name.casefold():
            raise ValueError(f"high_risk_name: the two arms need different names, both are {low_risk_name!r}")
        self.low_risk_name = low_risk_name
        self.high_risk_name = high_risk_name
        self.low_risk_reward = float(low_risk_reward)
        self.high_risk_reward = float(high_risk_reward)
        self.high_risk_prob = float(high_risk_prob)
        self.reward_range = (
            min(0.0, self.low_risk_reward, self.high_risk_reward),
            max(0.0, self.low_risk_reward, self.high_risk_reward),
        )
        self._order: tuple[str, str] = (low_risk_name, high_risk_name)
        self._pulled: str | None = None
        self._payout = 0.0

    # expected values decide success (SPEC: "chose the higher-expected-value arm")
    def expected_value(self, arm: str) -> float:
        """Mean payout of ``arm`` under the parameters."""
        if arm == self.high_risk_name:
            return self.high_risk_prob * self.high_risk_reward
        if arm == self.low_risk_name:
            return self.low_risk_reward
        raise KeyError(arm)

    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        arms = (self.low_risk_name, self.high_risk_name)
        self._order = arms if rng.random() < 0.5 else arms[::-1]
        self._pulled = None
        self._payout = 0.0
        return {"arms": list(self._order)}

    def _apply(self, action: str) -> StepOutcome:
        if action == self.high_risk_name:
            payout = self.high_risk_reward if self.np_random.random() < self.high_risk_prob else 0.0
        else:
            payout = self.low_risk_reward
        other = self.low_risk_name if action == self.high_risk_name else self.high_risk_name
        self._pulled, self._payout = action, payout
        success = self.expected_value(action) >= self.expected_value(other)
        return StepOutcome(
            reward=payout, terminated=True, effective=True, success=success,
            info={"pulled": action, "high_risk": action == self.high_risk_name},
        )

    def _action_names(self) -> tuple[str, ...]:
        return self._order

    def _state(self) -> Any:
        # The arms in the order shown, each with its payoff setting, then the pull and its payout (if any).
        payoffs = {self.low_risk_name: [self.low_risk_reward, 1.0],
                   self.high_risk_name: [self.high_risk_reward, self.high_risk_prob]}
        return {"arms": [[arm, *payoffs[arm]] for arm in self._order], "pulled": self._pulled,
                "payout": self._payout if self._pulled is not None else None}

    def _instruction(self) -> str:
        a, b = self._order
        return (
            f"You are playing a bandit game with two arms, named {a} and {b}. "
            "Each arm pays rewards from its own distribution, and the distributions are related "
            "to the arms' names. Think about what each name suggests about how it pays, then pull "
            "the arm you expect to give the higher reward on average."
        )

    def render(self) -> str:
        a, b = self._order
        if self._pulled is None:
            return f"Arms: {a}, {b}. Pull one arm."
        return f"You pulled {self._pulled} and received a reward of {self._payout:.2f}."
