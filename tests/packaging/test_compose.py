"""compose/: no Docker engine runs here, so the compose file is read and cross-checked, and the commands and
healthchecks it gives each service are parsed by the real entry points or run against the embedded server."""

from __future__ import annotations

import base64
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from pymongo import MongoClient
from pymongo.uri_parser import parse_uri

from bb_broker.connection import parse_broker_url
from tests.support.servers import AUTH_PASSWORD, free_port
from tests.support.workers import ROOT, wait_for

COMPOSE_DIR = ROOT / "compose"
DEPLOYING_GUIDE = ROOT / "docs" / "guides" / "deploying.md"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
#: The broker URL as the file writes it, and the example user and password it takes from compose/.env.
BROKER_URL_TEMPLATE = (
    "bbmongo://${BB_MONGO_USER:?set BB_MONGO_USER in compose/.env}:${BB_MONGO_PASSWORD:?set BB_MONGO_PASSWORD in "
    "compose/.env}@mongo:27017/bountyboard?replicaSet=rs0"
)
APP_SERVICES = ("worker", "flower", "metrics", "producer")
#: How each service's command starts: the entry point and subcommand the deployment guide documents.
ENTRY_POINTS = {
    "worker": "celery -A celery_app worker",
    "flower": "bb-broker flower -A celery_app",
    "metrics": "bb-broker serve-metrics",
    "producer": "python -m celery_app.produce",
}
#: Where a healthcheck's bin directory is: the `celery`, `python` and `bb-broker` of this environment.
VENV_BIN = str(Path(sys.executable).parent)

_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>\w+)")


class MissingVariable(KeyError):
    """A `${NAME:?message}` whose variable is not set."""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution (`$$`, `${X}`, `${X:-default}`, `${X:?error}`) over a loaded document."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("name") or match.group("bare")
        op, arg = match.group("op"), match.group("arg")
        current = env.get(name)
        missing = current is None or (current == "" and op is not None and op.startswith(":"))
        if op in (":?", "?") and missing:
            raise MissingVariable(f"{name}: {arg}")
        if op in (":-", "-") and missing:
            return arg
        return current or ""

    return _VARIABLE.sub(substitute, value)


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {key.strip(): val.strip() for key, val in pairs}


ENV_EXAMPLE = read_env_file(COMPOSE_DIR / ".env.example")
RAW_TEXT = COMPOSE_FILE.read_text()
RAW = yaml.safe_load(RAW_TEXT)
#: The file as compose would run it with the variables of .env.example.
COMPOSE = interpolate(RAW, ENV_EXAMPLE)
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
BROKER_URL = COMPOSE["x-broker-url"]
INIT_SCRIPT = COMPOSE_DIR / "mongo-init.js"


def option(argv: list[str], name: str) -> str:
    """The value of `--name VALUE` or `--name=VALUE` in argv."""
    for index, token in enumerate(argv):
        if token == name:
            return argv[index + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def published_container_ports(service: dict[str, Any]) -> set[int]:
    # Short syntax: "[HOST_IP:]HOST_PORT:CONTAINER_PORT[/PROTOCOL]"; the container port is the last part.
    return {int(str(port).split("/")[0].rsplit(":", 1)[-1]) for port in service.get("ports", [])}


def probe_argv(service: str) -> list[str]:
    """The healthcheck as an argv, the way Docker runs it inside the container."""
    test = SERVICES[service]["healthcheck"]["test"]
    if test[0] == "CMD":
        return list(test[1:])
    assert test[0] == "CMD-SHELL" and len(test) == 2, test
    return ["/bin/sh", "-c", test[1]]


# -- the file, read ------------------------------------------------------------------------------------------


def test_the_services_are_mongo_workers_flower_metrics_and_the_producer() -> None:
    assert set(SERVICES) == {"mongo", *APP_SERVICES}


def test_mongo_is_the_official_image_as_a_single_node_replica_set_on_a_named_volume() -> None:
    mongo = SERVICES["mongo"]
    assert mongo["image"] == "mongo:7"
    assert option(mongo["command"], "--replSet") == "rs0"
    assert "mongo-data:/data/db" in mongo["volumes"]
    assert "mongo-data" in COMPOSE["volumes"]
    script = mongo["healthcheck"]["test"][-1]
    assert mongo["healthcheck"]["test"][0] == "CMD-SHELL" and script.startswith("mongosh ")
    # Idempotent: it initiates only while the set is not yet initiated, so every later run just checks.
    assert re.search(r'if \(e\.codeName !== "NotYetInitialized"\) throw e;\s*rs\.initiate\(', script)
    assert "db.hello().isWritablePrimary" in script
    initiated = re.search(r'rs\.initiate\(\{_id: "(\w+)", members: \[\{_id: 0, host: "([\w.-]+:\d+)"\}\]\}\)', script)
    assert initiated, script
    assert initiated.group(1) == option(mongo["command"], "--replSet")
    assert "ports" not in mongo, "MongoDB stays off the host's network"


def test_mongo_asks_for_a_password_and_its_healthcheck_gives_the_administrators() -> None:
    mongo = SERVICES["mongo"]
    raw_env = RAW["services"]["mongo"]["environment"]
    # The image creates the administrator on the first run, and then starts mongod with --auth every time.
    assert raw_env["MONGO_INITDB_ROOT_USERNAME"].startswith("${MONGO_ROOT_USER:?")
    assert raw_env["MONGO_INITDB_ROOT_PASSWORD"].startswith("${MONGO_ROOT_PASSWORD:?")
    with pytest.raises(MissingVariable):
        interpolate(raw_env, {**ENV_EXAMPLE, "MONGO_ROOT_PASSWORD": ""})
    # A replica set with --auth needs a key file: the entrypoint writes it, readable by mongod's user alone, and
    # hands over to the image's own entrypoint with the command as its arguments.
    key_file = option(mongo["command"], "--keyFile")
    bash, dash_c, script, arg0 = mongo["entrypoint"]
    assert (bash, dash_c) == ("bash", "-c") and arg0
    assert f"> {key_file}\n" in script and f"chown mongodb:mongodb {key_file}" in script
    assert f"chmod 400 {key_file}" in script
    assert script.rstrip().endswith('exec docker-entrypoint.sh "$@"')
    # The healthcheck initiates the set as the administrator, with the credentials from the container's environment.
    check = mongo["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL"
    assert '--username "$MONGO_INITDB_ROOT_USERNAME" --password "$MONGO_INITDB_ROOT_PASSWORD"' in check[1]
    assert "--authenticationDatabase admin" in check[1]


def init_script_roles() -> list[str]:
    """The roles compose/mongo-init.js gives the broker's user, each on the database the script runs in."""
    script = INIT_SCRIPT.read_text()
    assert "user: process.env.BB_MONGO_USER," in script and "pwd: process.env.BB_MONGO_PASSWORD," in script
    roles = re.findall(r'\{ role: "(\w+)", db: db\.getName\(\) \}', script)
    assert roles and "roles: [" in script, script
    return roles


def test_every_service_connects_as_the_broker_user_the_init_script_creates() -> None:
    mongo = SERVICES["mongo"]
    assert f"./{INIT_SCRIPT.name}:/docker-entrypoint-initdb.d/bb-broker-user.js:ro" in mongo["volumes"]
    assert set(init_script_roles()) == {"readWrite", "dbAdmin"}
    # The script reads the user from the mongo service's environment: the same variables the URL is written with.
    raw_env = RAW["services"]["mongo"]["environment"]
    assert raw_env["BB_MONGO_USER"].startswith("${BB_MONGO_USER:?")
    assert raw_env["BB_MONGO_PASSWORD"].startswith("${BB_MONGO_PASSWORD:?")
    parsed = parse_uri(parse_broker_url(BROKER_URL).mongo_uri)
    assert (parsed["username"], parsed["password"]) == (ENV_EXAMPLE["BB_MONGO_USER"], ENV_EXAMPLE["BB_MONGO_PASSWORD"])
    # The user lives where the script runs, which is the URL's database: the URL needs no authSource.
    assert parsed["database"] == mongo["environment"]["MONGO_INITDB_DATABASE"] == "bountyboard"
    assert "authsource" not in {name.lower() for name in parsed["options"]}
    # The passwords travel in a URL as they are written: the example keeps to characters a URL carries unchanged.
    for name in ("BB_MONGO_PASSWORD", "MONGO_ROOT_PASSWORD", "BB_MONGO_USER"):
        assert re.fullmatch(r"[A-Za-z0-9._~-]+", ENV_EXAMPLE[name]), name
    # No command line carries a database password (a process list shows command lines).
    for name, service in SERVICES.items():
        for secret in (ENV_EXAMPLE["BB_MONGO_PASSWORD"], ENV_EXAMPLE["MONGO_ROOT_PASSWORD"]):
            assert secret not in " ".join(service["command"]), name


def test_the_broker_url_is_written_once_and_every_app_service_uses_it() -> None:
    assert RAW_TEXT.count("bbmongo://") == 1, "the broker URL belongs in one place (the x-broker-url anchor)"
    assert RAW["x-broker-url"] == BROKER_URL_TEMPLATE
    for name in APP_SERVICES:
        assert SERVICES[name]["environment"]["BB_BROKER_URL"] == BROKER_URL, name
    assert "--broker" not in SERVICES["metrics"]["command"], "the metrics command reads BB_BROKER_URL"
    # The URL reaches the replica set compose starts: same set name, same member address.
    target = parse_broker_url(BROKER_URL)
    assert target.database == "bountyboard"
    parsed = parse_uri(target.mongo_uri)
    mongo = SERVICES["mongo"]
    assert parsed["options"]["replicaSet"] == option(mongo["command"], "--replSet")
    member = re.search(r'host: "([\w.-]+):(\d+)"', mongo["healthcheck"]["test"][-1])
    assert member is not None
    assert parsed["nodelist"] == [(member.group(1), int(member.group(2)))]
    assert member.group(1) == "mongo", "the member must be registered under the service name the others resolve"


def test_the_app_services_are_built_from_this_project_with_flower() -> None:
    builds = {name: SERVICES[name]["build"] for name in APP_SERVICES}
    images = {SERVICES[name]["image"] for name in APP_SERVICES}
    assert len(images) == 1, "one image, built once, for every app service"
    for build in builds.values():
        assert (COMPOSE_DIR / build["context"]).resolve() == ROOT
        assert (ROOT / build["dockerfile"]).resolve() == COMPOSE_DIR / "Dockerfile"
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    assert re.search(r'^RUN pip install "\.\[flower\]"', dockerfile, re.M)
    copied = {src for line in re.findall(r"^COPY (.+)$", dockerfile, re.M) for src in line.split()[:-1]}
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: no such path in the build context"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", pyproject["project"]["readme"]}
    # The packages setuptools finds: `include` patterns such as "bb_broker*" name their top-level directories.
    found = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    needed |= {pattern.rstrip("*").split(".")[0] for pattern in found}
    assert needed <= copied, f"the Dockerfile does not COPY {needed - copied}, which `pip install .` needs"


def test_each_command_starts_with_the_entry_point_the_deployment_guide_documents() -> None:
    guide = DEPLOYING_GUIDE.read_text()
    for name, entry in ENTRY_POINTS.items():
        assert shlex.join(SERVICES[name]["command"]).startswith(entry + " "), name
        assert entry in guide, f"docs/guides/deploying.md does not mention `{entry}`"


def _celery_context(argv: list[str]) -> tuple[click.Context, click.Command, list[str]]:
    """Parse `celery -A APP SUBCOMMAND ...` with Celery's own CLI, which imports the app as the real one does."""
    from celery.app.utils import find_app
    from celery.bin.base import CLIContext
    from celery.bin.celery import celery

    assert argv[0] == "celery"
    ctx = celery.make_context("celery", list(argv[1:]))
    ctx.obj = CLIContext(app=find_app(ctx.params["app"]), no_color=True, workdir=None, quiet=True)
    at = next(i for i, token in enumerate(argv) if token in celery.list_commands(ctx))
    command = celery.get_command(ctx, argv[at])
    assert command is not None
    return ctx, command, list(argv[at + 1 :])


def test_the_worker_command_is_a_valid_celery_worker_of_the_example_app() -> None:
    argv = SERVICES["worker"]["command"]
    ctx, command, rest = _celery_context(argv)
    assert ctx.obj.app.main == "celery_app"
    params = command.make_context("worker", rest, parent=ctx).params
    assert params["task_events"] is True  # -E: Flower sees the tasks
    assert SERVICES["worker"]["deploy"]["replicas"] >= 2
    assert "container_name" not in SERVICES["worker"] and "ports" not in SERVICES["worker"], "replicas must not clash"


def test_the_flower_command_is_bb_broker_flower_with_options_flower_knows() -> None:
    from flower.options import options

    from bb_broker.cli import main

    argv = SERVICES["flower"]["command"]
    assert argv[:2] == ["bb-broker", "flower"]
    params = main.get_command(click.Context(main), "flower").make_context("flower", list(argv[2:])).params
    assert params["celery_app"] == "celery_app"
    for token in params["flower_args"]:
        assert token.startswith("--") and "=" in token, token
        name = token[2:].split("=", 1)[0]
        assert name.replace("-", "_") in options, f"Flower has no option {name}"
    assert option(argv, "--address") == "0.0.0.0"


def test_the_metrics_command_is_a_registered_bb_broker_command() -> None:
    from importlib.metadata import entry_points

    from bb_broker.cli import main

    argv = SERVICES["metrics"]["command"]
    scripts = {entry.name: entry.value for entry in entry_points(group="console_scripts")}
    assert scripts.get(argv[0]) == "bb_broker.cli:main"
    ctx = main.make_context(argv[0], list(argv[1:]))
    command = main.get_command(ctx, argv[1])
    assert command is not None, f"bb_broker.cli.main has no `{argv[1]}` command yet"
    params = command.make_context(argv[1], list(argv[2:]), parent=ctx).params
    assert params["host"] == "0.0.0.0"
    assert int(params["port"]) == 9808


def test_the_producer_command_is_the_produce_module_with_valid_options() -> None:
    from celery_app.produce import build_parser

    argv = SERVICES["producer"]["command"]
    assert argv[:3] == ["python", "-m", "celery_app.produce"]
    args = build_parser().parse_args(argv[3:])
    assert args.count == 0, "the compose producer runs until stopped"
    assert args.heartbeat is not None
    assert str(args.heartbeat) in SERVICES["producer"]["healthcheck"]["test"][-1]


def test_only_flower_is_published_and_the_metrics_stay_inside_the_compose_network() -> None:
    for name, service in SERVICES.items():
        command = service["command"]
        listens = {int(option(command, "--port"))} if any(t.startswith("--port") for t in command) else set()
        # What a service listens on is published (flower, which asks for a password) or only exposed to the
        # other containers (metrics, which asks nobody).
        assert published_container_ports(service) | {int(port) for port in service.get("expose", [])} == listens
        for port in listens:
            assert f"http://localhost:{port}/" in " ".join(service["healthcheck"]["test"]), name
    assert {name for name, service in SERVICES.items() if service.get("ports")} == {"flower"}
    assert published_container_ports(SERVICES["flower"]) == {5555}
    assert "--basic-auth" in " ".join(SERVICES["flower"]["command"])
    assert SERVICES["metrics"]["expose"] == ["9808"] and "ports" not in SERVICES["metrics"]
    assert "/statuses" in SERVICES["metrics"]["healthcheck"]["test"][-1]


def test_every_service_is_long_running_and_has_a_healthcheck_and_a_restart_policy() -> None:
    for name, service in SERVICES.items():
        check = service.get("healthcheck")
        assert check and not check.get("disable") and check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert {"interval", "timeout", "retries", "start_period"} <= set(check), name
        assert service["restart"] == "unless-stopped", name


def test_the_app_services_wait_for_mongo_to_be_healthy() -> None:
    for name in APP_SERVICES:
        assert SERVICES[name]["depends_on"] == {"mongo": {"condition": "service_healthy"}}, name


def test_flower_credentials_come_from_the_environment_and_are_required() -> None:
    raw_command = RAW["services"]["flower"]["command"]
    assert "--basic-auth=${FLOWER_USER:?" in " ".join(raw_command)
    assert option(SERVICES["flower"]["command"], "--basic-auth") == "admin:change-me"
    with pytest.raises(MissingVariable):
        interpolate(raw_command, {"FLOWER_USER": "admin"})
    used = {m.group("name") or m.group("bare") for m in _VARIABLE.finditer(RAW_TEXT) if m.group(0) != "$$"}
    assert used == set(ENV_EXAMPLE), "every variable the file uses is in .env.example, and nothing else"
    ignored = subprocess.run(["git", "check-ignore", "-q", "compose/.env"], cwd=ROOT, check=False)
    assert ignored.returncode == 0, "compose/.env holds real credentials: git must ignore it"


def test_the_deployment_guide_says_what_runs_and_that_the_file_was_checked_not_run() -> None:
    guide = DEPLOYING_GUIDE.read_text()
    assert "(docs/guides/deploying.md)" in (ROOT / "README.md").read_text(), "the README links to the guide"
    assert "docker compose -f compose/docker-compose.yml up" in guide
    assert "cp compose/.env.example compose/.env" in guide
    assert "not run" in guide and "tests/packaging/test_compose.py" in guide
    services = {row.split("|")[1].strip().split()[0].strip("`") for row in guide.splitlines() if row.startswith("| `")}
    assert services == set(SERVICES), "the guide's table names every service of the file, and only those"


# -- the sharded cluster the forge workflow's `sharded` job runs the suite against ------------------------------

SHARDED_FILE = COMPOSE_DIR / "sharded-cluster.yml"
SHARDED: dict[str, Any] = interpolate(yaml.safe_load(SHARDED_FILE.read_text()), {})  # MONGODB_VERSION's default
SHARDED_SERVICES: dict[str, dict[str, Any]] = SHARDED["services"]
WORKFLOW = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
REPLICA_SETS = ("configsvr", "shard1", "shard2")
ROUTERS = ("mongos1", "mongos2")


def initiated_set(service: str) -> tuple[str, str]:
    """The replica set name and the member's host that the service's healthcheck initiates its set with."""
    script = SHARDED_SERVICES[service]["healthcheck"]["test"][-1]
    assert re.search(r'if \(e\.codeName !== "NotYetInitialized"\) throw e;\s*rs\.initiate\(', script), service
    assert "db.hello().isWritablePrimary" in script, service
    found = re.search(
        r'rs\.initiate\(\{_id: "(\w+)",(?: configsvr: true,)? members: \[\{_id: 0, host: "([\w.-]+:\d+)"', script
    )
    assert found, script
    return found.group(1), found.group(2)


def test_the_sharded_cluster_is_a_config_server_set_two_shard_sets_and_two_routers() -> None:
    assert set(SHARDED_SERVICES) == {*REPLICA_SETS, *ROUTERS}
    for name, service in SHARDED_SERVICES.items():
        assert service["image"] == "mongo:8.0", name
        # Every service is long-running and healthy once it is set up: `up --wait` waits for no container that exits.
        assert service["healthcheck"]["test"][0] == "CMD-SHELL", name
    assert "--configsvr" in SHARDED_SERVICES["configsvr"]["command"]
    assert "configsvr: true" in SHARDED_SERVICES["configsvr"]["healthcheck"]["test"][-1]
    for name in REPLICA_SETS:
        command = SHARDED_SERVICES[name]["command"]
        assert command[0] == "mongod" and "ports" not in SHARDED_SERVICES[name], name
        assert initiated_set(name) == (option(command, "--replSet"), f"{name}:{option(command, '--port')}"), name
    for name in ("shard1", "shard2"):
        command = SHARDED_SERVICES[name]["command"]
        assert "--shardsvr" in command and option(command, "--replSet") == name
        # An idle shard would hold a router's change streams back for up to 10 s (the default).
        assert option(command, "--setParameter") == "periodicNoopIntervalSecs=1", name


def test_the_routers_read_the_config_server_set_and_the_first_adds_both_shards() -> None:
    config = SHARDED_SERVICES["configsvr"]["command"]
    config_set = f"{option(config, '--replSet')}/configsvr:{option(config, '--port')}"
    shards = {f"{name}/{name}:{option(SHARDED_SERVICES[name]['command'], '--port')}" for name in ("shard1", "shard2")}
    for name in ROUTERS:
        router = SHARDED_SERVICES[name]
        assert router["command"][0] == "mongos" and option(router["command"], "--configdb") == config_set, name
        assert router["depends_on"] == {rs: {"condition": "service_healthy"} for rs in REPLICA_SETS}, name
        check = router["healthcheck"]["test"][-1]
        assert "db.adminCommand({listShards: 1})" in check and ".length !== 2" in check, name
    adding = SHARDED_SERVICES["mongos1"]["healthcheck"]["test"][-1]
    assert set(re.findall(r'"(shard\d/[\w.-]+:\d+)"', adding)) == shards and "sh.addShard(shard)" in adding
    assert "addShard" not in SHARDED_SERVICES["mongos2"]["healthcheck"]["test"][-1], "one router adds them"


def test_the_forge_jobs_point_at_a_standalone_mongod_and_at_both_routers() -> None:
    jobs = WORKFLOW["jobs"]
    routers = sorted(
        port.split(":")[1]
        for name in ROUTERS
        for port in SHARDED_SERVICES[name]["ports"]
        if port.startswith("127.0.0.1:")
    )
    sharded = jobs["sharded"]
    assert sharded["env"]["BB_TEST_MONGO_URL"] == f"mongodb://{','.join(f'127.0.0.1:{port}' for port in routers)}/"
    assert sharded["env"]["MONGODB_VERSION"] == "${{ matrix.mongodb }}"
    steps = [step.get("run", "") for step in sharded["steps"]]
    assert any(run.startswith("docker compose -f compose/sharded-cluster.yml up -d --wait") for run in steps)
    standalone = jobs["standalone"]
    assert parse_uri(standalone["env"]["BB_TEST_MONGO_URL"])["options"] == {}, "no replica set, no option"
    started = next(step["run"] for step in standalone["steps"] if "docker run" in step.get("run", ""))
    assert "--replSet" not in started
    for job in (jobs["suite"], sharded, standalone):
        assert "make test" in [step.get("run") for step in job["steps"]]
        assert "8.0" in job["strategy"]["matrix"]["mongodb"]


# -- the healthchecks, run against real processes ------------------------------------------------------------


@contextmanager
def running(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        process = subprocess.Popen(
            argv, env=env, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def app_env(broker_url: str, **extra: str) -> dict[str, str]:
    """The container's environment here: the test database as the broker, this venv's programs on PATH, and the
    example app on PYTHONPATH (the image's /app: the package does not install it)."""
    path = {"PATH": f"{VENV_BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    return {**os.environ, "BB_BROKER_URL": broker_url, **path, **extra}


def with_port(argv: list[str], old: int, new: int) -> list[str]:
    """The argv with a free port in place of the published one, which something else may hold."""
    return [token.replace(str(old), str(new)) for token in argv]


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def probe(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_the_worker_healthcheck_pings_its_own_worker_through_the_broker(broker_url: str, tmp_path: Path) -> None:
    env = app_env(broker_url, HOSTNAME=socket.gethostname())  # Docker sets HOSTNAME to the worker's host name
    log = tmp_path / "worker.log"
    with running(SERVICES["worker"]["command"], env, log) as worker:
        wait_for(lambda: worker.poll() is not None or " ready." in log.read_text(), 90, "the worker to be ready")
        assert worker.poll() is None, log.read_text()[-3000:]
        result = probe(probe_argv("worker"), env)
        assert result.returncode == 0, result.stdout + result.stderr
    assert probe(probe_argv("worker"), env).returncode != 0, "with the worker gone the healthcheck must fail"


def test_the_flower_healthcheck_answers_without_the_basic_auth_credentials(broker_url: str, tmp_path: Path) -> None:
    port = free_port()
    env = app_env(broker_url)
    with running(with_port(SERVICES["flower"]["command"], 5555, port), env, tmp_path / "flower.log") as flower:
        wait_for(lambda: flower.poll() is not None or listening(port), 60, "Flower to listen")
        assert flower.poll() is None, (tmp_path / "flower.log").read_text()[-3000:]
        result = probe(with_port(probe_argv("flower"), 5555, port), env)
        assert result.returncode == 0, result.stdout + result.stderr
        # ... while everything else asks for them.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=10)
        assert refused.value.code == 401
        credentials = base64.b64encode(option(SERVICES["flower"]["command"], "--basic-auth").encode()).decode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/workers", headers={"Authorization": f"Basic {credentials}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200


def test_the_metrics_healthcheck_reads_statuses(broker_url: str, tmp_path: Path) -> None:
    port = free_port()
    env = app_env(broker_url)
    argv = with_port(SERVICES["metrics"]["command"], 9808, port)
    log = tmp_path / "metrics.log"
    with running(argv, env, log) as metrics:
        wait_for(lambda: metrics.poll() is not None or listening(port), 60, "the metrics endpoint to listen")
        assert metrics.poll() is None, log.read_text()[-3000:]
        result = probe(with_port(probe_argv("metrics"), 9808, port), env)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_producer_healthcheck_follows_its_heartbeat(broker_url: str, tmp_path: Path) -> None:
    heartbeat = str(tmp_path / "produce.alive")
    compose_heartbeat = option(SERVICES["producer"]["command"], "--heartbeat")
    env = app_env(broker_url)
    check = [token.replace(compose_heartbeat, heartbeat) for token in probe_argv("producer")]
    assert probe(check, env).returncode != 0, "no heartbeat yet: unhealthy"
    argv = [token.replace(compose_heartbeat, heartbeat) for token in SERVICES["producer"]["command"]]
    with running([*argv, "--count", "1"], env, tmp_path / "producer.log") as producer:
        assert producer.wait(60) == 0, (tmp_path / "producer.log").read_text()
    result = probe(check, env)
    assert result.returncode == 0, result.stdout + result.stderr
    # A heartbeat older than the healthcheck allows is a stuck producer.
    stale = time.time() - 3600
    os.utime(heartbeat, (stale, stale))
    assert probe(check, env).returncode != 0


def test_the_broker_user_the_init_script_creates_runs_the_worker_producer_and_metrics(auth_server, tmp_path) -> None:
    """On a server that checks roles, the user as compose/mongo-init.js creates it does all the broker needs."""
    database = SERVICES["mongo"]["environment"]["MONGO_INITDB_DATABASE"]
    user, password = ENV_EXAMPLE["BB_MONGO_USER"], ENV_EXAMPLE["BB_MONGO_PASSWORD"]
    with MongoClient(f"mongodb://bb:{AUTH_PASSWORD}@127.0.0.1:{auth_server.port}/?authSource=admin") as admin:
        roles = [{"role": role, "db": database} for role in init_script_roles()]
        admin[database].command("createUser", user, pwd=password, roles=roles)
        # The compose URL, pointed at this server (one member, no replica set); its credentials as compose gives them.
        url = BROKER_URL.replace("@mongo:27017/", f"@127.0.0.1:{auth_server.port}/").split("?")[0]
        env = app_env(url)
        with running(SERVICES["worker"]["command"], env, tmp_path / "worker.log"):
            producer = [*SERVICES["producer"]["command"], "--count", "1"]
            with running(producer, env, tmp_path / "producer.log") as sending:
                assert sending.wait(60) == 0, (tmp_path / "producer.log").read_text()[-3000:]
            jobs = admin[database].jobs
            wait_for(lambda: jobs.count_documents({"status": "succeeded"}) >= 2, 120, "the round's jobs to succeed")
        port = free_port()
        with running(with_port(SERVICES["metrics"]["command"], 9808, port), env, tmp_path / "metrics.log") as metrics:
            wait_for(lambda: metrics.poll() is not None or listening(port), 60, "the metrics endpoint to listen")
            assert metrics.poll() is None, (tmp_path / "metrics.log").read_text()[-3000:]
            result = probe(with_port(probe_argv("metrics"), 9808, port), env)
            assert result.returncode == 0, result.stdout + result.stderr
    for log in tmp_path.glob("*.log"):
        assert password not in log.read_text(), log.name
