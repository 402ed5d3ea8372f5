"""Flow tests run inside one session-wide Prefect test harness (STYLE.md rule 9)."""

from __future__ import annotations

import os

import pytest
from prefect.testing.utilities import prefect_test_harness

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(autouse=True, scope="session")
def prefect_harness():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture()
def data_dir(tmp_path, monkeypatch):
    """A private RAGEN_DATA_DIR (runs, models, mlflow.db) for one test."""
    d = tmp_path / "data"
    monkeypatch.setenv("RAGEN_DATA_DIR", str(d))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return d
