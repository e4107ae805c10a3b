"""Version matrix: the end-to-end tests against every Celery minor the pins allow, with the Kombu, pymongo and Flower
each one runs with, the lowest and the newest.

Sessions, each in its own venv under .nox:
- `newest`: whatever pip picks within the pins (upgraded on every run);
- `lowest`: the lowest minor each pin allows, read from pyproject.toml;
- `minor(5.4-lowest)` ... `minor(5.7-newest)`: each Celery minor (CELERY_MINORS) at its newest patch, once with the
  lowest Kombu, pymongo and a Flower of the pins (`lowest`), once with the newest the minor allows (`newest`).

`nox -s SESSION` runs the whole selection below; `nox -t short -- short` (`make compat-short`, CI) runs its quick part
on the sessions tagged `short`: one per Celery minor, both ends of pymongo, every Flower minor. Other arguments after
`--` are passed to pytest in place of the selection, e.g. `nox -s lowest -- tests/e2e/test_results_e2e.py -k chord`.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import nox
from packaging.requirements import Requirement

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["newest", "lowest"]  # `nox` alone; `nox -t short` and `-s minor` for the rest
nox.options.reuse_existing_virtualenvs = True

#: The packages whose versions the matrix varies: what bb_broker patches, subclasses or reads the internals of.
VARIED = ("celery", "kombu", "pymongo", "flower")

#: Every Celery minor the pin allows, from its floor (checked against pyproject.toml) to the newest released.
CELERY_MINORS = ("5.4", "5.5", "5.6", "5.7")

#: The Flower each minor's `lowest` session runs (its `newest` session runs the newest Flower): every Flower minor the
#: pin allows meets two Celery minors, and the short sessions meet all three.
LOWEST_SIDE_FLOWER = {"5.4": "2.0", "5.5": "2.0", "5.6": "2.1", "5.7": "2.1"}

#: Lifecycle, results (end to end and the backend alone), chords and canvas, crashes and faults, the event loop, and
#: Flower (its process with the broker tab, and the Jobs tab).
FULL = [
    "tests/unit/test_upstream_celery.py",
    "tests/unit/test_upstream_kombu.py",
    "tests/unit/test_upstream_billiard.py",
    "tests/unit/test_upstream_pymongo.py",
    "tests/unit/test_upstream_flower.py",
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
    "tests/unit/test_upstream_flower.py",
    "tests/flower/test_jobs_view.py::test_lists_counts_and_look_ups",
]

#: Prints the installed version of each package named on its command line, so a session's log says what it tested.
PRINT_VERSIONS = (
    "import sys; from importlib.metadata import version; "
    "print('versions:', ', '.join(f'{name} {version(name)}' for name in sys.argv[1:]))"
)


def pin_floors() -> dict[str, str]:
    """The floor (`major.minor`) of each varied package's pin in pyproject.toml, by package name."""
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    pins = [*project["dependencies"], *project["optional-dependencies"]["flower"]]
    floors = {}
    for pin in map(Requirement, pins):
        if pin.name.lower() not in VARIED:
            continue
        (floor,) = [spec.version for spec in pin.specifier if spec.operator == ">="]
        floors[pin.name.lower()] = ".".join(floor.split(".")[:2])
    missing = set(VARIED) - set(floors)
    if missing:
        raise RuntimeError(f"pyproject.toml pins no floor for {sorted(missing)}")
    if floors["celery"] != CELERY_MINORS[0]:
        raise RuntimeError(f"celery's pin starts at {floors['celery']}: CELERY_MINORS must start there too")
    return floors


def lowest_allowed() -> list[str]:
    """The newest patch of the lowest minor each varied package's pin allows, read from pyproject.toml.

    `celery>=5.5,<6` gives `celery~=5.5.0`: raising a pin's floor moves the lowest session with it.
    """
    return [f"{name}~={floor}.0" for name, floor in pin_floors().items()]


def minor_pins(celery: str, end: str) -> list[str]:
    """The pins of a `minor` session: Celery `celery` at its newest patch; at the `lowest` end, the Kombu of the same
    minor (or the pin's floor, if higher), the lowest pymongo and LOWEST_SIDE_FLOWER's Flower; at the `newest` end,
    whatever pip picks with that Celery (Celery 5.5 caps Kombu at 5.5, 5.4 allows any 5.x from the pin's floor)."""
    if end == "newest":
        return [f"celery~={celery}.0"]
    floors = pin_floors()
    kombu = max(celery, floors["kombu"], key=lambda version: tuple(map(int, version.split("."))))
    return [
        f"celery~={celery}.0",
        f"kombu~={kombu}.0",
        f"pymongo~={floors['pymongo']}.0",
        f"flower~={LOWEST_SIDE_FLOWER[celery]}.0",
    ]


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


@nox.session(tags=["short"])
def newest(session: nox.Session) -> None:
    """The newest release each pin allows (pip's choice, upgraded on every run)."""
    run_selection(session, [])


@nox.session(tags=["short"])
def lowest(session: nox.Session) -> None:
    """The lowest minor each pin allows, at that minor's newest patch."""
    run_selection(session, lowest_allowed())


#: The `minor` sessions the short run takes beside `lowest` (5.4 at the lowest end) and `newest` (5.7 at the newest):
#: the other six, so that every Celery minor meets the lowest and the newest pymongo, Kombu and Flower it allows.
SHORT_MINORS = {(celery, end) for celery in CELERY_MINORS for end in ("lowest", "newest")} - {
    ("5.4", "lowest"),
    ("5.7", "newest"),
}


@nox.session
@nox.parametrize(
    ("celery", "end"),
    [
        nox.param(celery, end, id=f"{celery}-{end}", tags=["short"] if (celery, end) in SHORT_MINORS else [])
        for celery in CELERY_MINORS
        for end in ("lowest", "newest")
    ],
)
def minor(session: nox.Session, celery: str, end: str) -> None:
    """One Celery minor at its newest patch, with the lowest or the newest Kombu, pymongo and Flower it allows."""
    run_selection(session, minor_pins(celery, end))


@nox.session
@nox.parametrize("celery", CELERY_MINORS, ids=list(CELERY_MINORS))
def conformance(session: nox.Session, celery: str) -> None:
    """Celery's own t/integration/test_tasks.py (tools/conformance) on one Celery minor with the newest Kombu and
    pymongo it allows: bbmongo:// beside Redis (redis-server on the PATH), failing when a test fails only on bbmongo://.
    """
    if shutil.which("redis-server") is None:
        session.error("redis-server is not on the PATH: `make conformance` installs it (Debian's redis-server)")
    # pydantic: Celery's integration tests import it (`make conformance` installs it the same way).
    pins = minor_pins(celery, "newest")
    session.install("--upgrade", "--upgrade-strategy", "eager", "-e", ".[dev]", "pydantic", *pins)
    session.run("python", "-c", PRINT_VERSIONS, *VARIED)
    # The shell's CONFORMANCE_BROKERS, CONFORMANCE_K, CONFORMANCE_SUITE_TIMEOUT narrow it as in `make conformance`.
    session.run(
        "python", "-m", "tools.conformance", env={"CONFORMANCE_SUITES": "tasks", "CONFORMANCE_REQUIRE_PARITY": "1"}
    )
