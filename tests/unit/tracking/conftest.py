"""Fixtures shared by the tracking tests that talk to a real (sqlite) MLflow store."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    # one database per module: creating a fresh MLflow schema costs ~1.5 s
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture(autouse=True)
def _restore_http_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflowLogger sets short HTTP defaults in os.environ; undo after each test
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
