"""Version matrix: the end-to-end tests against the lowest and the newest Celery, Kombu, pymongo, Flower allowed.

`nox -s newest lowest` (`make compat`) runs the whole selection below in each session's own venv under .nox;
`nox -s newest lowest -- short` (`make compat-short`, CI) runs its quick part. Other arguments after `--` are passed
to pytest in place of the selection, e.g. `nox -s lowest -- tests/e2e/test_results_e2e.py -k chord`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import nox
from packaging.requirements import Requirement

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["newest", "lowest"]
nox.options.reuse_existing_virtualenvs = True

#: The packages whose versions the matrix varies: what bb_broker patches, subclasses or reads the internals of.
VARIED = ("celery", "kombu", "pymongo", "flower")

#: Lifecycle, results (end to end and the backend alone), chords and canvas, crashes and faults, the event loop, and
#: Flower (its process with the broker tab, and the Jobs tab).
FULL = [
    "tests/unit/test_upstream_celery.py",
    "tests/unit/test_upstream_kombu.py",
    "tests/unit/test_upstream_billiard.py",
    "tests/unit/test_upstream_pymongo.py",
    "tests/unit/test_flower_contracts.py",
    "tests/e2e/test_lifecycle_e2e.py",
    "tests/e2e/test_results_e2e.py",
    "tests/database/test_results_backend.py",
    "tests/faults/test_faults.py",
    "tests/faults/test_worker_stops.py",
    "tests/e2e/test_event_loop_e2e.py",
    "tests/flower/test_flower.py",
    "tests/flower/test_jobs_view.py",
]

#: A few minutes on CI: a test of each area whose behaviour leans most on the varied packages' internals.
SHORT = [
    "tests/e2e/test_lifecycle_e2e.py::test_success_failure_backoff_and_final_attempt",
    "tests/e2e/test_lifecycle_e2e.py::test_worker_killed_mid_task_its_job_is_requeued_and_run_again",
    "tests/e2e/test_lifecycle_e2e.py::test_a_task_that_rejects_its_message_without_requeue_never_runs_again",
    "tests/e2e/test_results_e2e.py::test_a_reject_without_requeue_fails_at_once",
    "tests/e2e/test_results_e2e.py::test_an_errback_runs_once_after_the_last_attempt",
    "tests/e2e/test_results_e2e.py::test_a_chord_whose_last_part_is_in_a_group_nested_in_its_header",
    "tests/e2e/test_results_e2e.py::test_a_failed_chain_step_fails_the_rest_of_the_chain",
    "tests/e2e/test_results_e2e.py::test_a_worker_killed_in_the_middle_of_a_chord",
    "tests/database/test_results_backend.py",
    "tests/e2e/test_event_loop_e2e.py::test_the_worker_runs_celerys_event_loop_except_on_a_green_pool",
    "tests/e2e/test_event_loop_e2e.py::test_a_saturated_worker_answers_remote_control_and_its_revokes_take_effect",
    "tests/unit/test_upstream_celery.py",
    "tests/unit/test_upstream_kombu.py",
    "tests/unit/test_upstream_billiard.py",
    "tests/unit/test_upstream_pymongo.py",
    "tests/unit/test_flower_contracts.py",
    "tests/flower/test_jobs_view.py::test_lists_counts_and_look_ups",
]

#: Prints the installed version of each package named on its command line, so a session's log says what it tested.
PRINT_VERSIONS = (
    "import sys; from importlib.metadata import version; "
    "print('versions:', ', '.join(f'{name} {version(name)}' for name in sys.argv[1:]))"
)


def lowest_allowed() -> list[str]:
    """The newest patch of the lowest minor each varied package's pin allows, read from pyproject.toml.

    `celery>=5.5,<6` gives `celery~=5.5.0`: raising a pin's floor moves the lowest session with it.
    """
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    pins = [*project["dependencies"], *project["optional-dependencies"]["flower"]]
    lowest = []
    for pin in map(Requirement, pins):
        if pin.name.lower() not in VARIED:
            continue
        (floor,) = [spec.version for spec in pin.specifier if spec.operator == ">="]
        major, minor = floor.split(".")[:2]
        lowest.append(f"{pin.name}~={major}.{minor}.0")
    missing = set(VARIED) - {requirement.split("~=")[0].lower() for requirement in lowest}
    if missing:
        raise RuntimeError(f"pyproject.toml pins no floor for {sorted(missing)}")
    return lowest


def run_selection(session: nox.Session, pins: list[str]) -> None:
    """Install the checkout with its dev extra under `pins` and run the selected tests."""
    # The checkout's own pins with the session's: pip refuses a combination they do not allow, so a session
    # can never test a version the pyproject excludes.
    session.install("--upgrade", "--upgrade-strategy", "eager", "-e", ".[dev]", *pins)
    session.run("python", "-c", PRINT_VERSIONS, *VARIED)
    if session.posargs == ["short"]:
        tests = SHORT
    elif session.posargs:
        tests = session.posargs
    else:
        tests = FULL
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests)


@nox.session
def newest(session: nox.Session) -> None:
    """The newest release each pin allows (pip's choice, upgraded on every run)."""
    run_selection(session, [])


@nox.session
def lowest(session: nox.Session) -> None:
    """The lowest minor each pin allows, at that minor's newest patch."""
    run_selection(session, lowest_allowed())
