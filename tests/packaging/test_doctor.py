"""`bb-broker doctor` against a real server: all good, then a server without TTL indexes and change streams."""

from __future__ import annotations

from click.testing import CliRunner
from pymongo import MongoClient

from bb_broker.cli import main
from bb_broker.jobs.store import JobStore
from tests.support.servers import with_database
from tests.support.wire import Profile, WireProxy, amazon_documentdb, ferretdb, standalone


def doctor(url: str) -> tuple[int, dict[str, str], str]:
    result = CliRunner().invoke(main, ["doctor", "--broker", url])
    verdicts = {}
    for line in result.output.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("ok", "degraded", "unsafe", "unknown") and ":" in rest:
            verdicts[rest.strip().split(":", 1)[0]] = status
    return result.exit_code, verdicts, result.output


def scratch_collections(client: MongoClient, database: str) -> list[str]:
    return [name for name in client[database].list_collection_names() if name.startswith(("bb_doctor_", "bb_probe_"))]


#: Every capability the probe (bb_broker/server.py) reports, as doctor names it.
CAPABILITIES = {"change streams", "hint on findAndModify", "hint on updates", "hint on finds", "hint on aggregates",
                "update pipelines", "TTL indexes", "retryable writes"}  # fmt: skip


def test_the_embedded_server_carries_the_broker(own_server) -> None:
    client = MongoClient(own_server.url, tz_aware=True)
    JobStore(client.docdb).ensure_indexes()
    code, verdicts, output = doctor(with_database(own_server.url, "docdb"))
    assert code == 0, output
    assert verdicts["atomic claims"] == "ok" and verdicts["TTL indexes"] == "ok", output
    assert verdicts["change streams"] == "ok" and verdicts["jobs indexes"] == "ok", output
    assert verdicts["clock"] == "ok", output
    assert set(verdicts) == {"server", "atomic claims", "replica set", "clock", "jobs indexes", *CAPABILITIES}
    assert all(verdicts[name] == "ok" for name in CAPABILITIES), output
    assert "ok        server: " in output and "replica set" in output.split("server: ")[1].splitlines()[0]
    assert "each exactly once" in output and output.strip().endswith("verdict: ok")
    assert scratch_collections(client, "docdb") == []  # the probe's collection is dropped


def test_a_server_without_ttl_and_change_streams_is_degraded_and_the_password_never_shown(own_server) -> None:
    client = MongoClient(own_server.url, tz_aware=True)
    client.admin.command("createUser", "bb", pwd="s3cret-pw", roles=[{"role": "root", "db": "admin"}])
    client.admin.command(
        "configureFailPoint",
        "failCommand",
        mode="alwaysOn",
        data={"failCommands": ["createIndexes", "aggregate"], "errorCode": 238},
    )
    url = with_database(f"bbmongo://bb:s3cret-pw@127.0.0.1:{own_server.port}/?authSource=admin", "docdb")
    code, verdicts, output = doctor(url)
    assert code == 0, output  # usable: workers sweep and poll
    assert verdicts["TTL indexes"] == "degraded" and verdicts["change streams"] == "degraded", output
    assert verdicts["atomic claims"] == "ok", output
    # Counts are aggregates: the failing aggregate takes their hint too, and doctor says what each fallback costs.
    assert "verdict: usable, degraded: change streams, hint on aggregates, TTL indexes" in output
    assert "workers and result waiters poll instead of being woken" in output
    assert "s3cret-pw" not in output and "bb:**@127.0.0.1" in output
    assert scratch_collections(client, "docdb") == []


def test_on_an_engine_like_ferretdb_doctor_names_the_server_and_each_fallback_in_use(mongo_url, db) -> None:
    proxy = WireProxy(mongo_url, ferretdb())
    try:
        code, verdicts, output = doctor(with_database(f"mongodb://{proxy.address}", db.name))
    finally:
        proxy.close()
    assert code == 0, output  # usable: the fallbacks carry it
    assert "server: " in output and "standalone" in output.split("server: ")[1].splitlines()[0], output
    assert verdicts["change streams"] == "degraded" and verdicts["hint on findAndModify"] == "degraded", output
    # Each with the server's own refusal and what the fallback costs.
    assert "findAndModify.hint is not implemented yet (code 115 CommandNotSupported)" in output
    assert "claims are not hinted" in output and "poll instead of being woken" in output
    assert verdicts["atomic claims"] == "ok" and verdicts["hint on finds"] == "ok", output


def test_on_a_server_without_update_pipelines_doctor_says_the_sweep_reads_then_writes(mongo_url, db) -> None:
    proxy = WireProxy(mongo_url, amazon_documentdb())
    try:
        code, verdicts, output = doctor(with_database(f"mongodb://{proxy.address}", db.name))
    finally:
        proxy.close()
    assert code == 0, output
    assert verdicts["update pipelines"] == "degraded" and verdicts["hint on findAndModify"] == "ok", output
    line = next(line for line in output.splitlines() if "update pipelines:" in line)
    assert "Failed to parse update: field must be of BSON type object (code 9)" in line, line
    assert "the stale sweep and the release at shutdown read the lost jobs" in line and "a round trip more" in line


def test_claims_whose_answers_the_connection_lost_count_from_the_documents_not_as_unsafe(mongo_url, db) -> None:
    # A loaded machine drops connections under the check's claimers (pymongo's "operation cancelled"): the check
    # failed ("unknown", exit 1), or, where pymongo's retry took another document, found the server "unsafe" though
    # every document was claimed exactly once.
    lost: list[str] = []

    def answer(document: dict) -> dict:
        claimed = (document.get("value") or {}).get("_id") if "lastErrorObject" in document else None
        if isinstance(claimed, str) and claimed.startswith("doc") and len(lost) < 3:
            lost.append(claimed)  # applied on the server, its answer lost on the way back
            return {"ok": 0, "code": 11602, "codeName": "InterruptedDueToReplStateChange", "errmsg": "interrupted",
                    "errorLabels": ["RetryableWriteError"]}  # fmt: skip
        return document

    proxy = WireProxy(mongo_url, Profile("lossy standalone", handshake=standalone().handshake, answer=answer))
    try:
        code, verdicts, output = doctor(with_database(f"mongodb://{proxy.address}", db.name))
    finally:
        proxy.close()
    assert len(lost) == 3 and code == 0 and verdicts["atomic claims"] == "ok", output
    assert "each exactly once (3 of them claimed by a try whose answer the connection lost)" in output
