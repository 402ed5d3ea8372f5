"""The documentation site builds strictly and reads right in a real browser.

``mkdocs build --strict`` (mkdocs.yml: a broken link or anchor, a page left out of the navigation, a warning of
the reference generator or of mkdocstrings each fail it) runs as a user runs it, into a temporary folder. The
built site is then served on 127.0.0.1 and Debian's headless chromium opens its home page and the generated
configuration reference. The two screenshots are kept as test output in ``test-output/docs-site/`` (git-ignored;
``$RAGEN_SCREENSHOTS`` too when set).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
KEPT = REPO / "test-output" / "docs-site"


def nav_pages(nav: list[Any]) -> list[str]:
    """The Markdown files mkdocs.yml's nav names, in order."""
    out: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out.extend(nav_pages(value) if isinstance(value, list) else [value])
    return out


def page_dir(site: Path, page: str) -> Path:
    """Where mkdocs (use_directory_urls) writes a page: index.md at its folder, x.md at x/index.html."""
    stem = page.removesuffix(".md")
    return site / (stem.removesuffix("index") if stem.endswith("index") else stem + "/") / "index.html"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": f"{BIN}:/usr/bin:/bin", "DISABLE_MKDOCS_2_WARNING": "true",
                               "NO_MKDOCS_2_WARNING": "1", "HOME": str(out)})
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{log[-5000:]}"
    assert not re.search(r"^(WARNING|ERROR)\b", log, re.M), log[-5000:]
    return out


def test_strict_build_makes_every_page_of_the_navigation(site: Path) -> None:
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # no !!python tags read
    pages = nav_pages(config["nav"])
    assert len(pages) == len(set(pages)) >= 30
    missing = [p for p in pages if not page_dir(site, p).is_file()]
    assert missing == []
    # every Markdown file under docs/ is in the navigation (strict mode also refuses an omitted page)
    written = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert written <= set(pages)
    # the reference pages are made at build time, from the code
    config_page = page_dir(site, "reference/config.md").read_text()
    assert "trainer.precision" in config_page and "algorithm.kl_in_reward" in config_page
    assert "rollout/reward_std_all" in page_dir(site, "reference/metrics.md").read_text()
    assert "--workers" in page_dir(site, "reference/cli.md").read_text()
    assert "open_session" in page_dir(site, "reference/api.md").read_text()


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(site)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import urllib.request

        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                import time

                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


def keep_screenshot(driver: Any, tmp_path: Path, name: str) -> Path:
    import os

    path = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    for folder in (KEPT, *([Path(os.environ["RAGEN_SCREENSHOTS"])] if os.environ.get("RAGEN_SCREENSHOTS") else [])):
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, folder / path.name)
    return path


def test_home_and_a_reference_page_read_right_in_a_browser(chrome: Any, served: str, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    chrome.get(served + "/")
    text = chrome.find_element(By.TAG_NAME, "body").text
    assert "make demo" in text and "make test" in text, text[:2000]
    nav = chrome.find_element(By.CSS_SELECTOR, "nav.md-nav--primary").text  # the sidebar
    assert "Getting started" in nav and "Reference" in nav, nav
    keep_screenshot(chrome, tmp_path, "docs-home")

    chrome.get(served + "/reference/config/")
    text = chrome.find_element(By.TAG_NAME, "body").text
    assert "Configuration reference" in text
    # a row of the generated table, rendered: key, type, default and doc
    rows = [r.text for r in chrome.find_elements(By.TAG_NAME, "tr")]
    precision = next(r for r in rows if r.startswith("trainer.precision"))
    assert "fp32" in precision and "bf16" in precision and "autocast" in precision, precision
    keep_screenshot(chrome, tmp_path, "docs-reference-config")
