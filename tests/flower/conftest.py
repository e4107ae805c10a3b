"""Fixtures of the Flower tests: Flower processes, stopped after each test, and a headless Chromium."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.support.flower_process import FlowerProcess
from tests.support.workers import process_factory

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM = "/usr/bin/chromium"
#: How long a browser check waits for its condition (text shown, class set): generous, for a busy 2-core machine.
BROWSER_TIMEOUT_MS = 60_000


@pytest.fixture
def flower_launcher() -> str:
    """How flower_factory starts Flower unless a test says: `bb-broker flower`; a module overrides this fixture to
    run `celery flower` instead."""
    return "bb-broker"


@pytest.fixture
def flower_factory(
    request: pytest.FixtureRequest, broker_url: str, tmp_path: Path, flower_launcher: str
) -> Iterator[Callable[..., FlowerProcess]]:
    """`make(**kwargs)` starts a FlowerProcess (`url=` another broker URL than the test's); each is stopped after
    the test, its log shown if the test failed."""

    def build(n: int, **kwargs: Any) -> FlowerProcess:
        kwargs.setdefault("launcher", flower_launcher)
        return FlowerProcess(kwargs.pop("url", broker_url), log_dir=tmp_path, name=f"flower{n}", **kwargs)

    yield from process_factory(request, build, FlowerProcess.stop)


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Debian's Chromium driven by Playwright; every `expect(...)` waits up to BROWSER_TIMEOUT_MS for its condition."""
    from playwright.sync_api import expect, sync_playwright

    if not Path(CHROMIUM).exists():
        raise AssertionError("Chromium is not installed: `make browser` installs Debian's `chromium` package")
    expect.set_options(timeout=BROWSER_TIMEOUT_MS)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()
