"""Text environments for multi-turn agent RL (SPEC §2): game rules only, no tokens, no prompts.

    from ragen_core.envs import make, list_envs
    env = make("Sokoban")
    obs, info = env.reset(seed=123)
    obs, reward, terminated, truncated, info = env.step("Up")

Registered: Bandit, BanditRev, BanditTest, Sokoban, LargerSokoban, SokobanNewVocab,
FrozenLake, WebShop, Countdown. Play one by hand: ``ragen play Sokoban --seed 3``.
Importing this package loads no env module (and never torch); ``make`` imports lazily.
"""

from ragen_core.envs.base import StepOutcome, TextEnv
from ragen_core.envs.registry import EnvSpec, env_spec, list_envs, make, register

__all__ = ["EnvSpec", "StepOutcome", "TextEnv", "env_spec", "list_envs", "make", "register"]
