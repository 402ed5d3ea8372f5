"""The final model as an MLflow model, and its entry in the MLflow model registry (``ragen model register RUN``).

    from ragen_core.tracking.model_registry import load_logged_model, log_model_dir, register_model
    log_model_dir(uri, run_id, Path("data/runs/R/final-model"), step=30)           # full model: transformers flavour
    log_model_dir(uri, run_id, adapter_dir, base_model=Path("data/models/base"))    # LoRA: the adapter over its base
    version = register_model(uri, "starpo-s-Bandit-s0-20261125-120000")            # name or id of the run
    model, tokenizer = load_logged_model(uri, "starpo-s-Bandit-s0-20261125-120000")  # what was logged, loaded back

Why a model and not a folder of files: a folder of safetensors under a run's artifacts is only files, which the
model registry does not accept and nothing loads without knowing ragen's layout. Logged with MLflow's
``transformers`` flavour it is an MLflow (3.x) "logged model" of the run: ``mlflow.transformers.load_model``
gives the model and tokenizer back, and it can be registered and served. A LoRA run's final model is its
adapter; MLflow's flavour keeps just the adapter (under ``peft/``) and refers to the base model's folder
(``base_model_path``), so it loads back as a ``peft.PeftModel`` over that base without copying the base.

Called by :class:`~ragen_core.tracking.MLflowLogger` when it delivers a ``log_model`` entry (so a model logged
while the server is away is logged once it is back), and by the ``ragen model register`` command. Like every
MLflow call here, through an explicit tracking URI and run id (the flavour API reads the process-wide URI, which
is set only for the duration of the call).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

__all__ = ["TASK", "RegisteredVersion", "load_logged_model", "log_model_dir", "logged_model_id", "model_name_for",
           "register_model", "requirements"]

TASK = "text-generation"
"""The transformers pipeline task of every ragen policy (a causal LM that writes replies)."""


@dataclass(frozen=True)
class RegisteredVersion:
    """A model version made by :func:`register_model`."""

    name: str
    version: str
    run_id: str
    source: str
    """Where the registry's copy points: ``models:/<logged model id>``."""


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's process-wide tracking URI set to ``uri`` for the block (the flavour and registry helpers read it).

    MLflow's own ``_use_tracking_uri`` (a private helper, stable from 2.x to 3.17) restores the previous value.
    """
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(uri):
        yield


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Only errors from ``logger_name`` for the block.

    The flavour warns on every local checkpoint that no Hugging Face Hub model card or licence could be fetched
    for it (a folder has neither) and narrates its choices at INFO: noise in a training run's output.
    """
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def log_model_dir(uri: str, run_id: str, path: Path, name: str = "model", base_model: Path | None = None,
                  step: int = 0) -> str:
    """Log the saved model in ``path`` as the run's logged model ``name``; returns its model id.

    A full model directory (config.json and weights) is copied as it is, never loaded (``transformers_model`` as
    a path). A peft adapter (adapter_config.json) is loaded over ``base_model`` (a local model folder: the base
    it was trained from), because MLflow's flavour saves adapters only from a live ``PeftModel``.
    """
    import mlflow.transformers
    from mlflow import MlflowClient

    path = Path(path)
    kwargs: dict[str, Any] = {}
    transformers_model: Any
    if (path / "adapter_config.json").is_file():
        if base_model is None:
            raise ValueError(f"{path} holds a LoRA adapter: log_model_dir needs the base model's folder")
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = AutoModelForCausalLM.from_pretrained(str(base_model))
        transformers_model = {"model": PeftModel.from_pretrained(base, str(path)),
                              "tokenizer": AutoTokenizer.from_pretrained(str(path))}
        kwargs["base_model_path"] = str(base_model)
    else:
        transformers_model = str(path)
    # The logged model is made here, in the run's experiment: left to log_model, MLflow 3.17 puts it into the
    # process's active experiment, which without mlflow.set_experiment is experiment 0 ("Default", ./mlruns).
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    model = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                       params=dict(run.data.params))
    with _tracking_uri(uri), _quiet("mlflow.transformers"):
        mlflow.transformers.log_model(transformers_model, name=name, task=TASK, run_id=run_id, step=step,
                                      model_id=model.model_id,
                                      pip_requirements=requirements(peft="base_model_path" in kwargs), **kwargs)
    return str(model.model_id)


def requirements(peft: bool = False) -> list[str]:
    """The pinned packages a logged policy needs, from this environment.

    Stated, not left to MLflow: its default list for the flavour pins torchvision too, which a text-only
    environment does not have (it then fails with ModuleNotFoundError), and inferring the list would load the
    model in a subprocess.
    """
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for package in ("mlflow", "torch", "transformers", "tokenizers", "safetensors", *(("peft",) if peft else ())):
        try:
            out.append(f"{package}=={version(package)}")
        except PackageNotFoundError:  # mlflow-skinny, say: the name differs; leave it unpinned
            out.append(package)
    return out


def logged_model_id(client: MlflowClient, run: Run, name: str = "model") -> str:
    """The id of run ``run``'s logged model ``name`` (the one logged at the latest step); LookupError if none.

    Needed because in MLflow 3 a logged model lives beside the run, not in its artifacts: ``runs:/<id>/model``
    finds nothing to load, ``models:/<model id>`` does.
    """
    outputs = run.outputs.model_outputs if run.outputs is not None else []
    for out in sorted(outputs, key=lambda o: o.step, reverse=True):
        if client.get_logged_model(out.model_id).name == name:
            return str(out.model_id)
    run_id = run.info.run_id
    raise LookupError(f"MLflow run {run.info.run_name or run_id} ({run_id}) has no logged model {name!r}; it may "
                      "have ended before its final model was saved, or predate models being logged (then its files "
                      "are under the run's model/ artifacts)")


def load_logged_model(uri: str, ref: str, name: str = "model") -> tuple[Any, Any]:
    """(model, tokenizer) of the logged model ``name`` of run ``ref`` (id or name): a transformers model, or a
    PeftModel over its base."""
    import mlflow.transformers
    from mlflow import MlflowClient

    from ragen_core.tracking.history import find_run  # history imports this package's logger: not at module level

    client = MlflowClient(tracking_uri=uri)
    model_id = logged_model_id(client, find_run(client, ref), name)
    with _tracking_uri(uri):
        parts = mlflow.transformers.load_model(f"models:/{model_id}", return_type="components")
    return parts["model"], parts["tokenizer"]


def model_name_for(tags: dict[str, str]) -> str:
    """The registered model's default name from a run's tags: ``ragen-<env>-<preset>`` (``ragen-Bandit-starpo-s``).

    One registered model per env and algorithm, its versions the runs that were registered: what a registry
    list needs to be read at a glance.
    """
    env, preset = tags.get("env") or "env", tags.get("preset") or tags.get("algo") or "run"
    return f"ragen-{env}-{preset}"


def register_model(uri: str, ref: str, name: str | None = None, artifact: str = "model") -> RegisteredVersion:
    """Register the logged model of run ``ref`` (a run id or run name) as a new version of ``name``.

    ``name`` defaults to :func:`model_name_for` the run's tags. Raises LookupError when the run is unknown or
    has no logged model.
    """
    import mlflow
    from mlflow import MlflowClient

    from ragen_core.tracking.history import find_run  # history imports this package's logger: not at module level

    client = MlflowClient(tracking_uri=uri)
    run = find_run(client, ref)
    model_id = logged_model_id(client, run, artifact)
    name = name or model_name_for(dict(run.data.tags))
    with _tracking_uri(uri):
        version = mlflow.register_model(f"models:/{model_id}", name)
    return RegisteredVersion(str(version.name), str(version.version), run.info.run_id, str(version.source))
