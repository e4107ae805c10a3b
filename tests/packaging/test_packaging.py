"""The distribution: the wheel ships `bb_broker` only, never the checkout's example app, and it imports cleanly."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support.workers import ROOT


def test_the_wheel_ships_bb_broker_only(tmp_path: Path) -> None:
    # From a copy: a build/ left in the checkout by an earlier build would be packed again.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "bb-data", "test-artifacts")
    )
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(source)]
    built = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("bb_broker-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    distribution, version = wheel.name.split("-")[:2]
    assert {name.split("/")[0] for name in names} == {"bb_broker", f"{distribution}-{version}.dist-info"}
    assert "bb_broker/ops/cli.py" in names and "bb_broker/transport/channel.py" in names
    the_jobs_tab = {
        "bb_broker/contrib/flower/templates/bb_jobs.html",
        "bb_broker/contrib/flower/templates/bb_job.html",
        "bb_broker/contrib/flower/static/bb_jobs.js",
        "bb_broker/contrib/flower/static/uPlot.iife.min.js",
    }
    assert the_jobs_tab <= set(names)
    assert not [name for name in names if name.startswith(("celery_app", "tests"))]


def test_the_example_app_is_found_from_the_checkout_and_the_compose_image() -> None:
    # `make demo` and the tests run from the checkout, where celery_app is a directory beside bb_broker ...
    found = subprocess.run([sys.executable, "-c", "import celery_app.tasks"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert found.returncode == 0, found.stderr
    # ... and the compose image, which installs the wheel, puts it on PYTHONPATH outside site-packages.
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert "COPY celery_app /app/celery_app" in dockerfile and "PYTHONPATH=/app" in dockerfile


def test_bb_broker_imported_first_lets_any_celery_module_be_imported_next() -> None:
    # bb_broker hooks into celery.signals as Celery imports it: what the hook imports must not need the Celery
    # modules still being imported (celery.result -> celery.app -> celery.signals -> hook -> celery.result).
    for module in ("celery.result", "celery.contrib.testing.manager", "celery.canvas", "celery.app", "celery"):
        code = f"import bb_broker, {module}, bb_broker.worker.hooks"
        imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert imported.returncode == 0, f"{code}:\n{imported.stderr}"
