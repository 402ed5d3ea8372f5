"""Loss masks on the DEFAULT model's chat template (SmolLM2-135M-Instruct), scripted and really sampled.

Needs the converted model under $RAGEN_DATA_DIR/models (``ragen model fetch``); marked slow.
The tiny model's version of these checks is tests/unit/rollout/test_rollout_batch.py.

Run: .venv/bin/python -m pytest -m slow tests/integration/test_masks_default_model.py -q
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from ragen_core.config import EnvConfig, RolloutConfig
from ragen_core.models import DEFAULT_MODEL, load_model, load_tokenizer
from ragen_core.rollout.batch import build_token_batch, mask_problems
from ragen_core.rollout.chat import ChatRenderer
from ragen_core.rollout.generators import make_generator
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.prompts import first_user_text
from ragen_core.rollout.scripted import ScriptedGenerator

pytestmark = pytest.mark.slow

REPLIES = ["<think>The box is left of me.</think><answer>Left || Up</answer>",
           "<think>déjà vu √ 🙂</think><answer>Right</answer>", "I will not follow the format.",
           "<think>" + "very long thinking " * 30 + "</think><answer>Down</answer>"]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return load_tokenizer(DEFAULT_MODEL)


@pytest.mark.parametrize("env", ["Sokoban", "FrozenLake"])
def test_scripted_replies_masks_are_exact(tok: PreTrainedTokenizerBase, env: str) -> None:
    cfg = RolloutConfig(max_new_tokens=48)  # the long reply is cut: finish_reason 'length'
    gen = ScriptedGenerator(tok, lambda c, r, p: REPLIES[(c + r) % len(REPLIES)])
    trajs = run_rollouts(EnvConfig(name=env), gen, tok, cfg, seeds=[3, 4], n_per_group=2)
    batch = build_token_batch(trajs, tok, cfg)
    assert mask_problems(batch, trajs, tok) == []
    renderer = ChatRenderer(tok, cfg.system_prompt)
    assert renderer.end_of_turn_text == "<|im_end|>" and renderer.stop_token_ids == (tok.eos_token_id,)
    for b, t in enumerate(trajs):
        mask, tids, ids = batch.loss_mask[b], batch.turn_ids[b], batch.input_ids[b]
        for k, turn in enumerate(t.turns):
            text = tok.decode(ids[mask & (tids == k)].tolist())
            # decoding the masked tokens gives back exactly the reply after the prefilled tag (part of the
            # prompt, SPEC §3), plus <|im_end|> when it was sampled
            prefill = t.meta["prefill"]
            assert prefill == "<think>" and turn.response_text.startswith(prefill)
            reply = turn.response_text.removeprefix(prefill)
            assert text == (reply + "<|im_end|>" if turn.finish_reason == "stop" else reply)
            # a scripted reply that starts with the prefilled tag continues after it (scripted.py)
            assert reply in [r.removeprefix(prefill) for r in REPLIES] or turn.finish_reason == "length"
        masked = tok.decode(ids[mask].tolist())
        assert "State:" not in masked and "<|im_start|>" not in masked
        # the row is the template's own rendering of the dialogue, token for token
        texts = t.meta["user_texts"]
        messages = renderer.messages(first_user_text(t.meta["instruction"], texts[0]),
                                     [turn.response_text for turn in t.turns], texts[1:])
        template = tok.apply_chat_template(messages, tokenize=False)
        row = ids[batch.attention_mask[b]].tolist()
        assert "You are a helpful AI assistant named SmolLM" not in template  # no injected default system prompt
        assert tok(template, add_special_tokens=False)["input_ids"][: len(row)] == row
        # ... and exactly one of the contexts the generator got at the last turn, plus the last reply
        last_call = gen.calls[len(t.turns) - 1]
        assert any(row == list(p) + list(t.turns[-1].response_ids) for p in last_call.prompts)


def test_sampled_replies_masks_and_logprobs(tok: PreTrainedTokenizerBase) -> None:
    model = load_model(DEFAULT_MODEL)
    cfg = RolloutConfig(max_turns=2, max_new_tokens=24)
    trajs = run_rollouts(EnvConfig(name="Sokoban"), make_generator("hf", model, tok), tok, cfg, seeds=[3],
                         n_per_group=2, sampling_seed=0)
    batch = build_token_batch(trajs, tok, cfg)
    assert mask_problems(batch, trajs, tok) == []
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
    logp = torch.log_softmax(logits[:, :-1].float() / cfg.temperature, -1)
    logp = logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.loss_mask[:, 1:]
    # the trained row reproduces the sampler's log-probs: the model saw exactly these contexts
    torch.testing.assert_close(logp[mask], batch.old_logprobs[:, 1:][mask], atol=2e-3, rtol=0)
