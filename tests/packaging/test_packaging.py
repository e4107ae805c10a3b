"""The example app beside the package; bb_broker imported before Celery (the built artefacts: test_built_artefacts)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.workers import ROOT


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
        code = f"import bb_broker, {module}, bb_broker.worker"
        imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert imported.returncode == 0, f"{code}:\n{imported.stderr}"
