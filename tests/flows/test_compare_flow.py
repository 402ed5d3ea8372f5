"""`ragen compare` on two tiny-model smoke runs (StarPO vs StarPO-S) read back from MLflow:
the table, the PNGs, the comparison's own MLflow run, and unknown runs."""

from __future__ import annotations

import csv
import struct
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from flows.cli import app
from flows.compare import compare
from flows.train import train
from tests.flows.conftest import latest_artifact

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "experiments" / "smoke.yaml")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, which a valid PNG has right after the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two 2-iteration smoke runs, presets starpo and starpo-s, in one sqlite MLflow store."""
    data = tmp_path_factory.mktemp("compare-data")
    uri = f"sqlite:///{data}/mlflow-compare.db"
    mp = pytest.MonkeyPatch()
    mp.setenv("RAGEN_DATA_DIR", str(data))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    common = [f"tracking.uri={uri}", "tracking.artifact_every=0", "trainer.checkpoint_every=0", "eval.seeds=2"]
    a = train(experiment=SMOKE, run_name="cmp-starpo", overrides=["preset=starpo", *common])
    b = train(experiment=SMOKE, run_name="cmp-starpo-s", overrides=["preset=starpo-s", *common])
    yield uri, a, b
    mp.undo()


def test_compare_table_pngs_and_mlflow_run(two_runs, tmp_path):
    uri, a, b = two_runs
    out = tmp_path / "out"
    # one run by name (the tracking URI is found in its run directory's config), one by MLflow run id
    text = compare(runs=["cmp-starpo", b.mlflow_run_id], out_dir=str(out))
    rows = list(csv.DictReader((out / "table.csv").open()))
    assert [(r["run"], r["algo"], r["env"]) for r in rows] == [("cmp-starpo", "starpo", "Bandit"),
                                                              ("cmp-starpo-s", "starpo-s", "Bandit")]
    client = MlflowClient(uri)
    for row, result in zip(rows, (a, b), strict=True):
        val = client.get_metric_history(result.mlflow_run_id, "val/success")
        assert [m.step for m in val] == [0, 1, 2]  # before each update and after the last
        assert float(row["final_success"]) == pytest.approx(val[-1].value)
        assert float(row["peak_success"]) == pytest.approx(max(m.value for m in val))
        assert row["success_from"] == "val" and row["iterations"] == "2" and row["run_id"] == result.mlflow_run_id
        assert row["collapse"] in ("True", "False")  # health metrics were logged, so never n/a
        assert float(row["update_s_mean"]) > 0
    md = (out / "table.md").read_text()
    assert md in text and md.count("\n") == 4 and "| cmp-starpo | starpo | Bandit | val |" in md
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(["curves.png", "train-success-rollouts.png", "validation-success.png",
                           "in-group-reward-std.png", "entropy.png", "grad-norm.png", "response-length-tokens.png",
                           "think-length-tokens.png", "update-seconds.png"])
    assert _png_size(out / "curves.png") == (1100, 1360)  # 2 x 4 subplots of 5.5 x 3.4 in at 100 dpi
    for name in pngs:
        assert _png_size(out / name)[0] > 0
    # the comparison is its own finished MLflow run, next to the runs it compares
    exp = client.get_run(a.mlflow_run_id).info.experiment_id
    cmp_runs = client.search_runs([exp], "tags.kind = 'compare'")
    assert len(cmp_runs) == 1 and cmp_runs[0].info.status == "FINISHED"
    assert cmp_runs[0].data.tags["compared_runs"] == f"{a.mlflow_run_id},{b.mlflow_run_id}"
    assert cmp_runs[0].info.run_name in text
    arts = {x.path for x in client.list_artifacts(cmp_runs[0].info.run_id, "compare")}
    assert {"compare/table.md", "compare/table.csv", "compare/curves.png"} <= arts and len(arts) == 11
    # and the flow run's Markdown artifact in the Prefect UI, keyed by the comparison's name
    artifact = latest_artifact(cmp_runs[0].info.run_name)
    assert artifact is not None and md.splitlines()[2] in artifact.data and cmp_runs[0].info.run_id in artifact.data


def test_unknown_run_is_a_lookup_error_and_exit_status_2(two_runs, tmp_path):
    uri, a, _ = two_runs
    with pytest.raises(LookupError, match="no-such-run"):
        compare(runs=[a.mlflow_run_id, "no-such-run"], out_dir=str(tmp_path / "x"), tracking_uri=uri)
    assert not (tmp_path / "x").exists()
    result = CliRunner().invoke(app, ["compare", "no-such-run", "--out", str(tmp_path / "y")])
    assert result.exit_code == 2 and "no-such-run" in result.output
