"""No credential travels as a flow-run parameter: a trial's storage URL goes without its password, and the
worker puts it back from its own environment (ragen_core/sweeps/study.py trial_spec, trial_storage)."""

from __future__ import annotations

import json

import pytest

from ragen_core.config import ConfigError, SweepConfig
from ragen_core.sweeps.study import STORAGE_ENV, storage_url, trial_spec, trial_storage

FULL = "postgresql+psycopg2://ragen:hunter2@db-host:5432/optuna"
SHOWN = "postgresql+psycopg2://ragen:***@db-host:5432/optuna"


def test_a_trial_spec_carries_the_storage_without_its_password() -> None:
    spec = trial_spec(SweepConfig(name="s"), FULL, 3)
    assert spec["storage"] == SHOWN and "hunter2" not in json.dumps(spec)
    plain = "sqlite:////data/optuna.db"
    assert trial_spec(SweepConfig(name="s"), plain, 3)["storage"] == plain


def test_the_worker_puts_the_password_back_from_what_it_knows() -> None:
    assert trial_storage(SHOWN, [None, FULL]) == FULL
    assert trial_storage("sqlite:////data/optuna.db", []) == "sqlite:////data/optuna.db"
    other = "postgresql+psycopg2://ragen:x@other-host:5432/optuna"  # another database's password is not used
    with pytest.raises(ConfigError, match=f"set {STORAGE_ENV}"):
        trial_storage(SHOWN, [other, None])


def test_the_storage_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    monkeypatch.delenv(STORAGE_ENV, raising=False)
    assert storage_url(SweepConfig(name="s")) == f"sqlite:///{tmp_path / 'optuna.db'}"
    monkeypatch.setenv(STORAGE_ENV, FULL)
    assert storage_url(SweepConfig(name="s")) == FULL
    assert storage_url(SweepConfig(name="s", storage="sqlite:///x.db")) == "sqlite:///x.db"  # the file wins


def test_the_default_storage_opens_in_a_data_dir_not_made_yet(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A fresh ``$RAGEN_DATA_DIR`` (a study's first run there): the default SQLite storage's folder is made, so
    Optuna opens it, where SQLite alone stops at 'unable to open database file'."""
    import optuna

    fresh = tmp_path / "new" / "data"
    monkeypatch.setenv("RAGEN_DATA_DIR", str(fresh))
    monkeypatch.delenv(STORAGE_ENV, raising=False)
    url = storage_url(SweepConfig(name="s"))
    assert url == f"sqlite:///{fresh / 'optuna.db'}"
    optuna.create_study(study_name="s", storage=url)
    assert (fresh / "optuna.db").is_file()
