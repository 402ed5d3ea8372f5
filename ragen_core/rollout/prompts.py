"""The words of the dialogue (SPEC §3): instruction block and per-turn user messages, as plain text.

No tokens here: ``chat.py`` puts these texts into the model's own chat template. The first user
message of a context is ``first_user_text(instruction_block(...), turn_text(...))``; every later
turn adds one user message ``turn_text(...)``, which starts with the previous turn's reward.

    block = instruction_block(env.instruction, env.legend, env.action_names, max_actions_per_turn=5)
    text = turn_text(0, obs, actions_left=10, think=True, max_new_tokens=128)

Run its tests: ``.venv/bin/python -m pytest tests/unit/rollout/test_rollout_prompts.py -q``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ragen_core.rollout.chat import ChatRenderer
from ragen_core.rollout.parse import ACTION_SEP

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ragen_core.config import RolloutConfig

__all__ = ["FORMAT_NOTHINK", "FORMAT_THINK", "THOUGHT_PLACEHOLDER", "first_user_text", "fmt_reward",
           "instruction_block", "make_renderer", "reply_prefill", "turn_text"]

THOUGHT_PLACEHOLDER = "[your thoughts]"
"""What the format line puts where a thought goes."""
FORMAT_THINK = f"<think> {THOUGHT_PLACEHOLDER} </think> <answer> [your answer] </answer>"
"""The required reply format with thinking (the reference's wording)."""
FORMAT_NOTHINK = "<answer> [your answer] </answer>"
"""The required reply format in the NoThink variant."""


def instruction_block(
    instruction: str,
    legend: Mapping[str, str],
    action_names: Sequence[str],
    max_actions_per_turn: int,
    *,
    free_form: bool = False,
) -> str:
    """Env rules, symbol legend, action list and the per-turn action budget (SPEC §3, first user message).

    The legend is always printed from ``env.legend``, so renamed symbols (SokobanNewVocab) reach the
    prompt (the reference forgot this, SPEC §2). Free-form envs (WebShop, Countdown) get no action
    list: their actions are text whose form the instruction and each observation describe.
    """
    parts = [instruction.strip()]
    if legend:
        parts.append("Symbols: " + ", ".join(f"{sym} {meaning}" for sym, meaning in legend.items()))
    if action_names and not free_form:
        parts.append("Available actions: " + ", ".join(action_names))
    parts.append(f'You can make up to {max_actions_per_turn} actions, separated by "{ACTION_SEP}".')
    return "\n".join(parts)


def reply_prefill(think: bool, prefill: bool = True) -> str:
    """The tag a reply starts from (SPEC §3): ``<think>``, ``<answer>`` in NoThink, '' when prefill is off."""
    if not prefill:
        return ""
    return "<think>" if think else "<answer>"


def make_renderer(tokenizer: PreTrainedTokenizerBase, cfg: RolloutConfig, system_prompt: str | None = None,
                  prefill: str | None = None) -> ChatRenderer:
    """The renderer of ``cfg``'s dialogues: its system prompt and reply prefill unless given."""
    return ChatRenderer(tokenizer, cfg.system_prompt if system_prompt is None else system_prompt,
                        reply_prefill(cfg.think, cfg.prefill) if prefill is None else prefill)


def fmt_reward(value: float) -> str:
    """A reward as short text: 0.1, -0.1, 10 (rounded to 4 decimals; -0 printed as 0)."""
    rounded = round(float(value), 4) + 0.0
    return f"{rounded:g}"


def turn_text(
    turn_index: int,
    observation: str,
    actions_left: int,
    *,
    think: bool,
    max_new_tokens: int,
    prev_reward: float | None = None,
    prev_penalty: float = 0.0,
) -> str:
    """The user message of turn ``turn_index`` (0-based; shown as ``Turn k:`` with k = index + 1).

    ``prev_reward`` is the previous turn's env reward (None on the first turn); a non-zero
    ``prev_penalty`` is shown on its own line so the model can tell format faults from game rewards.
    """
    lines: list[str] = []
    if prev_reward is not None:
        lines += ["Reward:", fmt_reward(prev_reward)]
        if prev_penalty:
            lines += ["Format penalty (the reply did not follow the format or named an unknown action):",
                      fmt_reward(prev_penalty)]
        lines.append("")
    lines += [f"Turn {turn_index + 1}:", "State:", observation.rstrip("\n")]
    fmt = FORMAT_THINK if think else FORMAT_NOTHINK
    lines.append(
        f"You have {actions_left} actions left. Always output: {fmt} with no extra text. "
        f"Strictly follow this format. Max response length: {max_new_tokens} tokens."
    )
    return "\n".join(lines)


def first_user_text(block: str, text: str) -> str:
    """The first user message of a context: the instruction block, then the first visible turn."""
    return f"{block}\n\n{text}"
