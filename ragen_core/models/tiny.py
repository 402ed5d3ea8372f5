"""The tiny random test model: a 2-layer Llama and a ~1k-token byte-level BPE tokenizer, built in-process.

    model, tokenizer = tiny_random(seed)        # fresh objects, deterministic by seed
    path = ensure_tiny(seed)                    # saved once under models/tiny-random-<seed>

Spec ``"tiny-random"`` or ``"tiny-random:SEED"``. Unit tests use it: no download, and a PPO-like step
takes a fraction of a second. The tokenizer has a ChatML chat template (:data:`CHATML_TEMPLATE`) and
eos = pad = ``<|im_end|>``, as SmolLM2's, so tests see the real model's situation.

Run its tests: ``.venv/bin/python -m pytest tests/unit/test_models.py -q``.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ragen_core.models.cache import (
    check_model_dir,
    clean_leftovers,
    models_dir,
    models_lock,
    publish,
    read_marker,
    staging_dir,
)
from ragen_core.models.spec import TINY_ARCHS

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = ["CHATML_TEMPLATE", "ensure_tiny", "tiny_random", "tiny_tokenizer"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The ChatML chat template (``<|im_start|>role\\n...<|im_end|>\\n``): the tiny tokenizer's, and the fallback of a
GGUF without one."""

# Text the tiny tokenizer's BPE merges are learned from: the shapes of every game's prompts,
# grids and answers (SPEC §2-§3), so that prompts tokenize to a realistic few hundred tokens.
_TINY_CORPUS = """\
You are a helpful assistant. You always think step by step before you answer.
You are playing a game. Make the best move. Reward: 0.0 Reward: 1.0 Reward: -0.1 Reward: 10.0
Turn 1: State: Turn 2: State: Turn 3: State: Turn 4: State: Turn 5: State:
You have 10 actions left. You have 5 actions left. You have 1 action left. Always output:
<think> [Your thoughts] </think> <answer> [your answer] </answer> with no extra text.
Strictly follow this format. You can make up to 5 actions, separated by ||. Max response length: 100 words.
<think>I should move the box to the target first.</think><answer>Left || Up || Right</answer>
<think>The goal is below me, so I go down.</think><answer>Down || Down || Right</answer>
<answer>Up</answer> <answer>Down</answer> <answer>Left</answer> <answer>Right</answer> || Up || Down ||
Actions: Up, Down, Left, Right. Left Down Right Up up down left right UP DOWN LEFT RIGHT
You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.
When you are right next to a box, you can push it by moving in the same direction.
You cannot push a box through a wall, and you cannot pull a box.
The meaning of each symbol in the state is: # wall, _ empty, O target, √ box on target, X box, P player,
S player on target. Other symbols: W wall, . empty, G target, C box on target, B box, A player, @ player on target.
######
#_O__#
#_X__#
#__P_#
#____#
######
WWWWWW
W.G..W
W.B..W
W..A.W
W....W
WWWWWW
You are walking on a frozen lake. The goal is to reach the gift G without falling into a hole O.
The ice is slippery: you may move in a direction you did not intend. P player, _ frozen, O hole,
G goal, X player in hole, √ player on goal.
_P__
_O_G
__O_
____
You are choosing between two slot machines. Which arm do you pull? Phoenix Dragon Teacher Engineer
Trader Librarian. One arm is low risk with a small fixed reward; the other is high risk, high reward.
<answer>Phoenix</answer> <answer>Dragon</answer> <answer>Teacher</answer> <answer>Engineer</answer>
You are web shopping. I will give you instructions about what to do. Search for a product and buy it.
Instruction: i need a long lasting blue cotton shirt for men in size large, and price lower than 40.00 dollars
search[blue cotton shirt] click[Buy Now] click[Back to Search] click[Next >] click[< Prev] click[b07xyz1234]
click[size] click[color] click[large] click[medium] click[small] Price: $19.99 Rating: N.A. [SEP] Results
Using the numbers [3, 5, 7, 2], create an equation that equals 22. You can use basic arithmetic operations
(+, -, *, /) and each number can only be used once. <answer>(7 * 3) + 5 - 4</answer> <answer>8 / 2 + 9</answer>
0 1 2 3 4 5 6 7 8 9 10 11 12 16 20 24 25 32 48 50 64 99 100 123 256 1000 0.1 0.15 0.25 0.5 -1 +10
system user assistant The the a an of to and in is it you that for on with as at by this from or
system
user
assistant
State:
Instruction:
Actions:
success failure done the episode is over. invalid action. format error. no valid action was found.
"""

_TINY_VOCAB_SIZE = 1024
_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    """Train the tiny byte-level BPE once per process; the JSON is the shared immutable part.

    Byte-level, so any text (``√``, emoji) encodes without an unknown token; digits are
    split one by one as SmolLM2's tokenizer does. The BPE trainer breaks ties between equal
    counts by pair id, so the result is the same in every process (a test checks this).
    """
    # Imported here, as everywhere in this package: tokenizers and transformers take seconds to import.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TINY_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(_TINY_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Each line three times so that words seen once in the corpus still get merged.
    lines = _TINY_CORPUS.splitlines(keepends=True)
    tokenizer.train_from_iterator(lines * 3, trainer=trainer)
    return tokenizer.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tiny tokenizer (callers may change ``padding_side`` and the like freely)."""
    # lazily: transformers takes seconds to import and only model code paths need it
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",  # as SmolLM2: pad = eos, so tests see the real model's situation
        unk_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


def _tiny_model(seed: int, vocab_size: int, ids: dict[str, int], arch: str = "llama") -> PreTrainedModel:
    # lazily: transformers takes seconds to import and only model code paths need it
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    # Qwen2 is Llama's shape with biases on the q, k and v projections (and Qwen2.5-0.5B ties its head, the
    # larger ones do not): the same sizes, so the same code paths are exercised
    config_class, model_class = ((LlamaConfig, LlamaForCausalLM) if arch == "llama"
                                 else (Qwen2Config, Qwen2ForCausalLM))
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # head size 32: the smallest vLLM's CPU attention takes (so `rollout.backend: vllm` runs the tiny model
        # too); 2 query heads share 1 KV head, so grouped-query attention stays exercised
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=arch != "qwen2-untied",
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # transformers wraps PreTrainedModel.to in @wraps(nn.Module.to), and typeshed's functools._Wrapped is no
        # descriptor, so mypy sees an unbound function wanting ``self`` first: the annotation is wrong, not the call.
        model = model_class(config).to(torch.float32)  # type: ignore[arg-type]  # transformers' wrapped .to
    model.generation_config.eos_token_id = ids["eos"]
    model.generation_config.pad_token_id = ids["pad"]
    model.generation_config.bos_token_id = ids["bos"]
    return model.eval()


def tiny_random(seed: int = 0, arch: str = "llama") -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A fresh tiny Llama (``arch`` qwen2 / qwen2-untied: a tiny Qwen2) and its tokenizer, built in-process: same
    seed, same weights and ids.

    hidden 64, 2 layers, 2 heads of 32 (1 KV head), MLP 128, context 2048, tied embeddings, vocab
    ~1k byte-level BPE with the ChatML template (``<|im_start|>role\\n...<|im_end|>\\n``),
    eos = pad = ``<|im_end|>``. Each call returns new objects, so one test's training never
    leaks into another's model.
    """
    tokenizer = tiny_tokenizer()
    ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    return _tiny_model(seed, len(tokenizer), ids, arch), tokenizer


def _fingerprint(model: PreTrainedModel, tokenizer_json: str) -> str:
    """sha256 over the tokenizer, the config and every weight: equal fingerprints mean equal models."""
    digest = hashlib.sha256(tokenizer_json.encode("utf-8"))
    digest.update(model.config.to_json_string(use_diff=False).encode("utf-8"))
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode("utf-8"))
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def ensure_tiny(seed: int, arch: str = "llama") -> Path:
    """``models/tiny-random-<seed>`` (``tiny-qwen2-<seed>``...), (re)built when missing, incomplete or not this
    build."""
    prefix = next(p for p, a in TINY_ARCHS.items() if a == arch)
    name = f"{prefix}-{seed}"
    target = models_dir() / name
    model, tokenizer = tiny_random(seed, arch)
    fingerprint = _fingerprint(model, _tiny_tokenizer_json())
    if check_model_dir(target) is None and read_marker(target).get("fingerprint") == fingerprint:
        return target
    with models_lock(None):
        if check_model_dir(target) is None and read_marker(target).get("fingerprint") == fingerprint:
            return target
        clean_leftovers(name)
        with staging_dir(name) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            publish(tmp, target, {"spec": f"{prefix}:{seed}", "fingerprint": fingerprint})
    return target
