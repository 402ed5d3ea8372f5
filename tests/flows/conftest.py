"""Flow tests run inside one session-wide Prefect test harness (STYLE.md rule 9)."""

from __future__ import annotations

import os

import pytest
from prefect.testing.utilities import prefect_test_harness

from tests.conftest import drain_prefect_workers

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(autouse=True, scope="session")
def prefect_harness():
    # an xdist worker may have run flows on another server before (tests/integration): their events worker
    # would keep sending to it
    drain_prefect_workers()
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture()
def data_dir(tmp_path, monkeypatch):
    """A private RAGEN_DATA_DIR (runs, models, mlflow.db) for one test."""
    d = tmp_path / "data"
    monkeypatch.setenv("RAGEN_DATA_DIR", str(d))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return d


def latest_artifact(key: str):
    """The newest Prefect artifact under ``key`` in the test harness's server (None when there is none)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read():
        async with get_client() as client:
            found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            return max(found, key=lambda a: a.created, default=None)

    return asyncio.run(read())
