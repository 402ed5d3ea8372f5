"""Token-space rendering (chat.py): the incremental ids equal the template's own rendering, for several
template families on the tiny tokenizer, and spans give the masks.

Run: .venv/bin/python -m pytest tests/unit/rollout/test_rollout_chat.py -q
"""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from ragen_core.models import load_tokenizer
from ragen_core.rollout.chat import ChatRenderer, assemble

SYSTEM = "You are a careful player."
FIRST = "Rules here.\n\nTurn 1:\nState:\n#P_O#"
USERS = ["Reward:\n-0.1\n\nTurn 2:\nState:\n#_PO#", "Reward:\n0.9\n\nTurn 3:\nState:\n#__√#"]
REPLIES = ["<think>go right</think><answer>Right</answer>", "<think>again</think><answer>Right || Up</answer>",
           "<think>done</think><answer>Up</answer>"]

LLAMA3_LIKE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
    " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA_LIKE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n'"
    " + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
INJECTS_DEFAULT_SYSTEM = (
    "{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nDEFAULT SYSTEM PROMPT<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tokenizer(template: str | None = None, specials: tuple[str, ...] = ()) -> PreTrainedTokenizerBase:
    tok = load_tokenizer("tiny-random")
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    if template is not None:
        tok.chat_template = template
    return tok


def _reply_ids(renderer: ChatRenderer, text: str, stop: bool = True) -> list[int]:
    ids = list(renderer.encode(text))
    return ids + [renderer.stop_token_ids[0]] if stop else ids


def _incremental(renderer: ChatRenderer, replies: list[list[int]]) -> list[int]:
    """head + r0 + t1 + r1 + t2: the context of turn 3, built the way the loop builds it."""
    ids = list(renderer.head_ids(FIRST))
    for reply, user in zip(replies, USERS, strict=True):
        ids += reply + list(renderer.transition_ids(reply, user))
    return ids


def _template_ids(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


CASES = {
    "chatml": (None, ()),
    "llama3-like": (LLAMA3_LIKE, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "gemma-like (no system role)": (GEMMA_LIKE, ("<start_of_turn>", "<end_of_turn>")),
    "injects a default system prompt": (INJECTS_DEFAULT_SYSTEM, ()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_incremental_ids_equal_the_templates_rendering(case: str) -> None:
    template, specials = CASES[case]
    tok = _tokenizer(template, specials)
    renderer = ChatRenderer(tok, SYSTEM)
    replies = [_reply_ids(renderer, r) for r in REPLIES[:2]]
    messages = renderer.messages(FIRST, REPLIES[:2], USERS)
    if case.startswith("gemma"):
        # no system role: the system prompt leads the first user message instead
        assert messages[0] == {"role": "user", "content": f"{SYSTEM}\n\n{FIRST}"}
    else:
        assert messages[0] == {"role": "system", "content": SYSTEM}
    assert _incremental(renderer, replies) == _template_ids(tok, messages)


@pytest.mark.parametrize("case", list(CASES))
def test_end_of_turn_token_is_derived_from_the_template(case: str) -> None:
    template, specials = CASES[case]
    tok = _tokenizer(template, specials)
    renderer = ChatRenderer(tok, SYSTEM)
    expected = {"chatml": "<|im_end|>", "llama3-like": "<|eot_id|>", "gemma-like (no system role)": "<end_of_turn>",
                "injects a default system prompt": "<|im_end|>"}[case]
    assert renderer.end_of_turn_id == tok.convert_tokens_to_ids(expected)
    assert renderer.stop_token_ids[0] == renderer.end_of_turn_id
    assert tok.eos_token_id in renderer.stop_token_ids


def test_no_default_system_prompt_is_injected() -> None:
    tok = _tokenizer(INJECTS_DEFAULT_SYSTEM)
    text = tok.decode(list(ChatRenderer(tok, SYSTEM).head_ids(FIRST)))
    assert "DEFAULT SYSTEM PROMPT" not in text and SYSTEM in text


def test_reply_cut_at_max_new_tokens_is_closed_by_the_transition() -> None:
    tok = _tokenizer()
    renderer = ChatRenderer(tok, SYSTEM)
    cut = _reply_ids(renderer, REPLIES[0], stop=False)[:5]  # no end-of-turn token sampled
    delta = renderer.transition_ids(cut, USERS[0])
    assert tok.decode(list(delta)).startswith("<|im_end|>\n<|im_start|>user\n")
    # after a stopped reply the transition starts right after the sampled <|im_end|>
    stopped = _reply_ids(renderer, REPLIES[0])
    assert tok.decode(list(renderer.transition_ids(stopped, USERS[0]))).startswith("\n<|im_start|>user\n")
    # and the whole context still matches the template, with the cut reply's text as content
    ids = list(renderer.head_ids(FIRST)) + cut + list(delta)
    messages = renderer.messages(FIRST, [tok.decode(cut)], USERS[:1])
    assert ids == _template_ids(tok, messages)


def test_missing_chat_template_is_a_clear_error() -> None:
    tok = _tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        ChatRenderer(tok, SYSTEM)


def test_decode_reply_drops_special_tokens() -> None:
    tok = _tokenizer()
    renderer = ChatRenderer(tok, SYSTEM)
    assert renderer.decode_reply(_reply_ids(renderer, REPLIES[0])) == REPLIES[0]


def test_assemble_spans_masks_and_turn_ends() -> None:
    # head [1 2 3], reply0 [4 5], delta1 [6], reply1 [7 8 9]: a 2-turn training row.
    seq = assemble([1, 2, 3], [[1, 2, 3], [6]], [[4, 5], [7, 8, 9]], [[-0.5, -1.0], [-1.5, -2.0, -2.5]])
    assert seq.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert seq.loss_mask == [False, False, False, True, True, False, True, True, True]
    assert seq.old_logprobs == [0.0, 0.0, 0.0, -0.5, -1.0, 0.0, -1.5, -2.0, -2.5]
    assert seq.turn_ids == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert seq.turn_ends == [False, False, False, False, True, False, False, False, True]
    # one response fewer: the generation context of turn 1 (ends with its prompt delta)
    ctx = assemble([1, 2, 3], [[1, 2, 3], [6]], [[4, 5]], [[-0.5, -1.0]])
    assert ctx.input_ids == [1, 2, 3, 4, 5, 6] and ctx.loss_mask[-1] is False
    # start=1: a re-rendered head replaces turn 1's delta; turn 0 is gone
    dropped = assemble([11, 12], [[1, 2, 3], [6]], [[4, 5], [7, 8, 9]], [[-0.5, -1.0], [-1.5, -2.0, -2.5]], start=1)
    assert dropped.input_ids == [11, 12, 7, 8, 9] and dropped.turn_ids == [1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="logprobs"):
        assemble([1], [[1]], [[4, 5]], [[-0.5]])
