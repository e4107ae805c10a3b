"""The built artefacts where users install them: `python -m build`'s sdist and wheel (built once per session) pass
`twine check`, hold every file of the package, and the wheel, installed with its dependencies from PyPI into a fresh
venv far from the checkout, runs the README's quick start: a worker, a task, `bb-broker status`, Flower's Jobs tab."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from pymongo.database import Database

from tests.support.flower_process import FlowerProcess
from tests.support.readme import README_URL, block, commands, inline_command
from tests.support.workers import ROOT, Worker, kill_group

# The session's one build and venv serve every test here: under xdist they all run in one pytest process.
# The first test of the group pays for the session's build and fresh venv (an install from the index): over 300 s
# on a 2-core machine at a load of 100, where the quick start itself then ran out of time.
pytestmark = [pytest.mark.xdist_group("built_artefacts"), pytest.mark.timeout(1200)]

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: The dependencies' wheels, kept between runs: each run resolves against PyPI as a user's install does, and fetches
#: only what changed since the last one. Under build/, which git ignores and the copy built below leaves out.
WHEELHOUSE = ROOT / "build" / "wheelhouse"
#: What the checkout leaves out of a build: the build's own leftovers, venvs and caches, a run's data.
NOT_BUILT = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "bb-data", "test-artifacts")


def run(argv: list[str | Path], *, timeout: float = 600, **kwargs: object) -> str:
    """Run a command to its end; its output, or an assertion error that shows it."""
    done = subprocess.run([str(arg) for arg in argv], capture_output=True, text=True, timeout=timeout, **kwargs)
    shown = " ".join(map(str, argv))
    assert done.returncode == 0, f"{shown} exited with {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """`python -m build`'s sdist and wheel (the wheel built from the sdist, as the release builds it), twine-checked."""
    # From a copy: a build writes build/ and bb_broker.egg-info/ into its source, and an egg-info in the checkout
    # would be a second bb-broker distribution to every process the suite starts there.
    source = tmp_path_factory.mktemp("source") / "bb-broker"
    shutil.copytree(ROOT, source, ignore=NOT_BUILT)
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", dist, source])
    (sdist,) = dist.glob("*.tar.gz")
    (wheel,) = dist.glob("*.whl")
    run([sys.executable, "-m", "twine", "check", "--strict", sdist, wheel])
    return Built(sdist, wheel)


def user_env(venv: Path) -> dict[str, str]:
    """A shell with the venv activated, as the README's: neither the checkout nor the suite's venv on any path."""
    suite_bin = str(Path(sys.executable).parent)
    path = [str(venv / "bin"), *(entry for entry in os.environ["PATH"].split(os.pathsep) if entry != suite_bin)]
    return {"PATH": os.pathsep.join(path), "VIRTUAL_ENV": str(venv), "PYTHONPATH": ""}


@pytest.fixture(scope="session")
def venv(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv, made by `python -m venv` outside the checkout, with `bb-broker[flower]` from the wheel."""
    home = tmp_path_factory.mktemp("user")
    made = home / "venv"
    # Without ensurepip's pip (a minute of a loaded machine): the suite's pip installs into it through --python.
    run([sys.executable, "-m", "venv", "--without-pip", made], cwd=home)
    pip = [sys.executable, "-m", "pip", "--python", made / "bin" / "python", "--disable-pip-version-check"]
    wanted = f"{built.wheel}[flower]"
    env = {**os.environ, **user_env(made)}
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    # The dependencies resolved against PyPI, as a user's `pip install` does; the wheels already here are not fetched.
    run([*pip, "download", "--quiet", "--dest", WHEELHOUSE, "--find-links", WHEELHOUSE, wanted], cwd=home, env=env)
    (WHEELHOUSE / built.wheel.name).unlink(missing_ok=True)  # a copy of ours: the next build's would differ
    # What that resolved, installed from here. No bytecode ahead: each process compiles only what it imports.
    offline = ["--no-index", "--find-links", WHEELHOUSE]
    run([*pip, "install", "--quiet", "--no-compile", *offline, wanted], cwd=home, env=env)
    return made


def test_the_sdist_and_the_wheel_hold_every_file_of_the_package_and_nothing_else(built: Built) -> None:
    version = PROJECT["version"]
    assert built.wheel.name == f"bb_broker-{version}-py3-none-any.whl"
    assert built.sdist.name == f"bb_broker-{version}.tar.gz"
    in_wheel = set(zipfile.ZipFile(built.wheel).namelist())
    with tarfile.open(built.sdist) as sdist:
        in_sdist = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    # Every file of the checkout's package: its modules, the Jobs tab's templates, the charts' vendored JS and CSS.
    package = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "bb_broker").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert "bb_broker/contrib/flower/templates/bb_jobs.html" in package
    assert "bb_broker/contrib/flower/static/uPlot.iife.min.js" in package
    assert package - in_wheel == set()
    assert package - in_sdist == set()
    assert {"pyproject.toml", "README.md"} <= in_sdist
    # The wheel is the library only: never the checkout's example app nor its tests.
    assert {name.split("/")[0] for name in in_wheel} == {"bb_broker", f"bb_broker-{version}.dist-info"}

    metadata = email.message_from_string(
        zipfile.ZipFile(built.wheel).read(f"bb_broker-{version}.dist-info/METADATA").decode()
    )
    assert (metadata["Name"], metadata["Version"]) == ("bb-broker", version)  # as `pip install bb-broker` takes it
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_payload() == (ROOT / "README.md").read_text()  # PyPI's page is the README


def test_the_installed_wheel_runs_the_readme_quick_start(venv: Path, tmp_path: Path, broker_url: str, db: Database):
    bin_dir, env = venv / "bin", user_env(venv)
    shell = {**os.environ, **env}
    # The user's project: a directory of its own, the README's app in it, the checkout nowhere on a path.
    (tmp_path / "myapp.py").write_text(block("**2. An app**", "python").replace(README_URL, broker_url))
    imported = run([bin_dir / "python", "-c", "import bb_broker; print(bb_broker.__file__, bb_broker.__version__)"],
                   cwd=tmp_path, env=shell)  # fmt: skip
    where, version = imported.split()
    assert Path(where).is_relative_to(venv) and version == PROJECT["version"]
    assert run([bin_dir / "bb-broker", "--version"], cwd=tmp_path, env=shell).strip() == f"bb-broker {version}"

    worker_command, task_command, status_command = commands("**3. A worker, a task, the counts**")
    assert worker_command[:4] == ["celery", "-A", "myapp", "worker"]
    worker = Worker(broker_url, log_dir=tmp_path, name="installed", app="myapp", extra_args=tuple(worker_command[4:]),
                    env=env, bin_dir=bin_dir, cwd=tmp_path)  # fmt: skip
    worker.start()
    assert task_command[:2] == ["python", "-c"]
    assert run([bin_dir / "python", *task_command[1:]], cwd=tmp_path, env=shell, timeout=120).strip() == "5"
    assert status_command[:2] == ["bb-broker", "status"] and status_command[-1] == README_URL
    status = run([bin_dir / "bb-broker", *status_command[1:-1], broker_url], cwd=tmp_path, env=shell)
    assert re.search(r"^succeeded +1$", status, re.M), status

    flower_command = inline_command("**4. Flower**")
    assert flower_command[:4] == ["bb-broker", "flower", "-A", "myapp"]
    (login,) = [arg.split("=", 1)[1] for arg in flower_command[4:] if arg.startswith("--basic-auth=")]
    flower = FlowerProcess(broker_url, log_dir=tmp_path, app="myapp", launcher="bb-broker", basic_auth=login, env=env,
                           bin_dir=bin_dir, cwd=tmp_path)  # fmt: skip
    try:
        flower.start()
        page = flower.page("/jobs")
        for asset in ("uPlot.iife.min.js", "uPlot.min.css"):
            assert f"/jobs/static/{asset}" in page
            status_code, body = flower.request("GET", f"/jobs/static/{asset}")
            assert (status_code, body) == (200, (ROOT / "bb_broker/contrib/flower/static" / asset).read_text())
        (listed,) = flower.get("/api/jobs")["jobs"]
        assert (listed["kind"], listed["status"]) == ("myapp.add", "succeeded")
    finally:
        kill_group(flower.process)
