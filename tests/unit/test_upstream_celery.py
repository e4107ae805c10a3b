"""The shapes of Celery that bb_broker/upstream/celery.py relies on: each test fails, naming the Celery change and
the function it breaks, before a user meets the broken behaviour."""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import pytest
from celery import Celery, states

from bb_broker.upstream import celery as upstream_celery
from tests.support.upstream import parameters, source
from tests.support.upstream import where as where_in

where = partial(where_in, upstream_celery)


@pytest.fixture
def app() -> Celery:
    return Celery("contracts", broker="memory://", backend="cache+memory://", set_as_current=False)


# --- Celery ---------------------------------------------------------------------------------------------------------


def test_mark_as_failure_takes_what_the_retry_wrapper_passes_on() -> None:
    from celery.backends.base import BaseBackend

    expected = ["self", "task_id", "exc", "traceback", "request", "store_result", "call_errbacks", "state"]
    found = parameters(BaseBackend.mark_as_failure)
    assert found == expected, (
        f"celery.backends.base.BaseBackend.mark_as_failure now takes {found}, not {expected}: Celery changed how a "
        f"result backend is told of a failure, and the wrapper passes the old arguments on by position; "
        + where("install_failure_as_retry")
    )
    retry = parameters(BaseBackend.mark_as_retry)
    assert retry[:4] == ["self", "task_id", "exc", "traceback"] and "request" in retry, (
        f"celery.backends.base.BaseBackend.mark_as_retry now takes {retry}: Celery changed how RETRY is stored; "
        + where("install_failure_as_retry")
    )


def test_the_retry_wrapper_is_installed_once_around_celerys_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery.backends.base import BaseBackend

    monkeypatch.setattr(BaseBackend, "mark_as_failure", BaseBackend.mark_as_failure)  # put back afterwards
    upstream_celery.install_failure_as_retry(lambda app, request, exc: False)
    installed = BaseBackend.mark_as_failure
    upstream_celery.install_failure_as_retry(lambda app, request, exc: True)
    assert BaseBackend.mark_as_failure is installed
    assert not getattr(installed.__wrapped__, upstream_celery._INSTALLED, False), "wrapped twice"


def test_a_tasks_request_class_is_the_documented_hook_for_a_lost_pool_process(app: Celery) -> None:
    from billiard.einfo import ExceptionWithTraceback
    from celery.worker import strategy
    from celery.worker.request import Request

    assert "symbol_by_name(task.Request)" in source(strategy.default), (
        "celery.worker.strategy.default no longer builds a task's requests from `task.Request`: Celery dropped the "
        "custom request class (its task guide's 'Requests and custom requests'), and a lost pool process's job no "
        "longer hears why; " + where("hook_requests")
    )
    found = parameters(Request.on_failure)
    assert found[:2] == ["self", "exc_info"], (
        f"celery.worker.request.Request.on_failure now takes {found}: Celery changed how the main process reports a "
        "task's failure; " + where("hook_requests")
    )
    on_failure = source(Request.on_failure)
    assert "reject_on_worker_lost" in on_failure and "self.reject(requeue=requeue)" in on_failure, (
        "Request.on_failure no longer rejects a lost pool process's message with requeue: Celery changed "
        "reject_on_worker_lost, and the reason set before it may go nowhere; " + where("hook_requests")
    )
    assert isinstance(Request.message, property) and "exc" in inspect.signature(ExceptionWithTraceback).parameters, (
        "Request.message or billiard's ExceptionWithTraceback(exc, ...) changed: the wrapper reads the message and the "
        "exception through them; " + where("hook_requests")
    )

    @app.task(name="contracts.noop", shared=False)
    def noop() -> None:
        pass

    found = parameters(Request.cancel)
    assert found[:2] == ["self", "pool"] and "self.time_start" in source(Request.cancel), (
        f"celery.worker.request.Request.cancel now takes {found}, or no longer ends only a started run: Celery "
        "changed how it cuts a run short, and an acks_late job cut short may be given back as never started; "
        + where("hook_requests")
    )

    upstream_celery.hook_requests(noop, str, str)
    hooked = noop.Request
    upstream_celery.hook_requests(noop, str, str)
    assert noop.Request is hooked and issubclass(hooked, Request), "the request class was subclassed twice"


def test_the_tracer_calls_task_run_as_it_is_when_it_is_built() -> None:
    from celery.app import trace

    assert "else task.run" in source(trace.build_tracer), (
        "celery.app.trace.build_tracer no longer calls `task.run`: Celery changed what the tracer runs, and a task's "
        "failed attempt the broker runs again would be stored FAILURE; " + where("wrap_task_run")
    )


def test_task_retry_leaves_override_max_retries_on_the_task() -> None:
    from celery.app.task import Task

    assert "self.override_max_retries = max_retries" in source(Task.retry), (
        "celery.app.task.Task.retry no longer leaves `override_max_retries` on the task: Celery changed how a retry's "
        "max_retries reaches autoretry; " + where("forget_retry_override")
    )


def test_a_chain_from_a_message_is_a_private_chain(app: Celery) -> None:
    from celery import canvas, chain, maybe_signature

    assert hasattr(canvas, "_chain"), "celery.canvas._chain is gone: Celery renamed its chain class; " + where(
        "chain_class"
    )
    rebuilt = maybe_signature(dict(app.signature("a") | app.signature("b")), app=app)
    assert isinstance(rebuilt, upstream_celery.chain_class()) and issubclass(chain, upstream_celery.chain_class()), (
        f"a chain rebuilt from its message is a {type(rebuilt).__name__}, not a celery.canvas._chain: Celery changed "
        "its chain classes; " + where("chain_class")
    )


def test_a_publishing_process_apps_and_their_registries_are_found_without_finalizing(app: Celery) -> None:
    from celery import _state

    assert hasattr(_state, "_get_active_apps") and app in _state._get_active_apps(), (
        "celery._state._get_active_apps no longer lists the apps of the process: the unique options of a task "
        "cannot be found; " + where("registered_task")
    )

    @app.task(name="contracts.unique", unique=True, shared=False)
    def unique_task() -> None:
        pass

    unique_task.name  # noqa: B018 (evaluating the task proxy registers the task, as apply_async does)
    assert upstream_celery.registered_task("contracts.unique").unique is True and not app.finalized, (
        "a task is no longer in `app._tasks` once its proxy is evaluated, or reading it finalizes the app; "
        + where("registered_task")
    )
    assert upstream_celery.registered_task("contracts.nowhere") is None


def test_before_task_publish_hands_receivers_the_headers_and_properties_it_publishes(app: Celery) -> None:
    from celery.app import amqp

    body = source(amqp.AMQP._create_task_sender)
    sent = body.index("send_before_publish(")
    assert "properties.update(kwargs)" in body[:sent] and "**properties" in body[sent:], (
        "Celery no longer puts apply_async's unknown keywords in the properties it sends before_task_publish and "
        "then publishes: the per-call unique and serial options cannot be read there; see "
        "bb_broker/worker/publish_headers.py:_flow_control_headers"
    )


def test_a_generator_chord_header_is_a_regen() -> None:
    from celery.utils.functional import regen

    assert upstream_celery.is_lazy_result_list(regen(iter([1]))), (
        "celery.utils.functional.regen no longer returns a celery.utils.functional._regen: Celery changed its lazy "
        "list; " + where("is_lazy_result_list")
    )


def test_result_meta_has_the_fields_a_job_document_keeps(app: Celery) -> None:
    from celery.backends.base import BaseBackend

    found = parameters(BaseBackend._get_result_meta)
    assert found[:5] == ["self", "result", "state", "traceback", "request"] and "format_date" in found, (
        f"celery.backends.base.BaseBackend._get_result_meta now takes {found}: Celery changed how a result's meta "
        "is built; " + where("result_meta")
    )
    meta = upstream_celery.result_meta(app.backend, 1, states.SUCCESS, None, None)
    assert {"date_done", "children"} <= set(meta), (
        f"BaseBackend._get_result_meta returns {sorted(meta)}, without date_done or children; " + where("result_meta")
    )


def test_failing_a_chain_and_calling_errbacks_take_what_the_backend_passes() -> None:
    import celery
    from celery.backends.base import BaseBackend

    if celery.VERSION >= (5, 7):
        found = parameters(BaseBackend._fail_chain)
        assert found[:4] == ["self", "chain", "exc", "traceback"] and {"store_result", "state"} <= set(found), (
            f"celery.backends.base.BaseBackend._fail_chain now takes {found}: Celery changed how a failure reaches "
            "the tasks chained after it; " + where("fail_chain")
        )
    else:  # before 5.7, mark_as_failure fails the chain inline, as upstream_celery._fail_chain_before_celery_5_7 does
        inline = source(BaseBackend.mark_as_failure)
        assert not hasattr(BaseBackend, "_fail_chain"), f"Celery {celery.__version__} has _fail_chain; " + where(
            "fail_chain"
        )
        assert "chain_elem_ctx = Context(chain_elem)" in inline and "on_chord_part_return(chain_elem_ctx" in inline, (
            f"celery.backends.base.BaseBackend.mark_as_failure of Celery {celery.__version__} neither calls "
            "_fail_chain nor fails the chain as 5.4 to 5.6 do: Celery changed how a failure reaches the tasks "
            "chained after it; " + where("fail_chain")
        )
    found = parameters(BaseBackend._call_task_errbacks)
    assert found == ["self", "request", "exc", "traceback"], (
        f"celery.backends.base.BaseBackend._call_task_errbacks now takes {found}; " + where("call_errbacks")
    )


@pytest.mark.parametrize("part", ["alone", "chord part"])
def test_a_failure_reaches_the_tasks_chained_after_it(app: Celery, part: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Through Celery's own _fail_chain from 5.7, as 5.4-5.6's mark_as_failure does it inline before.
    counted: list[str] = []
    monkeypatch.setattr(app.backend, "on_chord_part_return", lambda request, state, exc: counted.append(request.id))
    chained = app.signature("contracts.next").freeze()
    options = {"task_id": chained.id} | ({"chord": {"task": "contracts.body"}} if part == "chord part" else {})
    chain = [dict(app.signature("contracts.next", options=options))]
    upstream_celery.fail_chain(app.backend, chain, KeyError("x"), None, True, states.FAILURE)
    assert app.backend.get_state(chained.id) == states.FAILURE, "the chained task's result is not FAILURE"
    assert counted == ([chained.id] if part == "chord part" else []), "a chained chord part was not counted"


def test_a_task_rejected_without_requeue_is_reported_failed_from_celery_5_7_only() -> None:
    # Before 5.7 the pool process's task_postrun (state REJECTED, the Reject as retval) is all that tells of it.
    import celery
    from celery.app import trace
    from celery.worker.request import Request

    on_failure = source(Request.on_failure)
    reports = "if not exc.requeue:" in on_failure and "signals.task_failure.send(" in on_failure
    assert reports == upstream_celery.fails_rejected_tasks(), (
        f"celery.worker.request.Request.on_failure of Celery {celery.__version__} "
        + ("now" if reports else "no longer")
        + " reports a task that raised Reject(requeue=False) as failed; "
        + where("fails_rejected_tasks")
    )
    tracer = source(trace.build_tracer)
    assert "except Reject as exc:" in tracer and "Info(REJECTED, exc)" in tracer and "task_postrun" in tracer, (
        "celery.app.trace.build_tracer no longer ends a rejecting task with state REJECTED and the Reject as its "
        "retval for task_postrun; " + where("fails_rejected_tasks")
    )


def test_a_task_sent_by_name_stores_its_ignored_result_on_celery_5_6_only(app: Celery) -> None:
    # The message send_task publishes, run through the worker's tracer: whether the task's ignore_result holds.
    import celery
    from celery.app.trace import build_tracer
    from celery.signals import before_task_publish

    @app.task(name="contracts.ignored", ignore_result=True)
    def ignored() -> str:
        return "not kept"

    published: list[dict[str, Any]] = []

    def keep_headers(headers: dict[str, Any], **_: Any) -> None:
        published.append(headers)

    before_task_publish.connect(keep_headers, weak=False)
    try:
        sent = app.send_task("contracts.ignored")
    finally:
        before_task_publish.disconnect(keep_headers)
    build_tracer(ignored.name, ignored, app=app)(sent.id, (), {}, {**published[0], "id": sent.id})
    stored = app.backend.get_state(sent.id) == states.SUCCESS
    assert stored != upstream_celery.ignores_results_of_tasks_sent_by_name(), (
        f"Celery {celery.__version__} "
        + ("now stores" if stored else "no longer stores")
        + " the result of an ignore_result task sent by name; "
        + where("ignores_results_of_tasks_sent_by_name")
    )


def test_a_compressed_result_is_told_by_celerys_own_mark() -> None:
    # result_compression is new in Celery 5.7.0: before it, no result is compressed and there is no mark to look for.
    import celery
    from celery.backends import base

    mark = upstream_celery.compressed_result_mark()
    if celery.VERSION >= (5, 7):
        assert mark is not None and base.compress_payload(b"{}", "zlib").startswith(mark), (
            "celery.backends.base.COMPRESSED_PAYLOAD_MAGIC is gone or no longer starts what compress_payload writes: "
            "Celery changed how a compressed result is told apart; " + where("compressed_result_mark")
        )
    else:
        assert mark is None and not hasattr(base, "compress_payload"), (
            f"Celery {celery.__version__} compresses results (compress_payload) without the mark bb_broker reads; "
            + where("compressed_result_mark")
        )


def test_a_backend_has_its_result_cache_and_eager_check(app: Celery) -> None:
    backend = app.backend
    assert callable(getattr(backend, "_ensure_not_eager", None)), (
        "BaseBackend._ensure_not_eager is gone: Celery changed how a read refuses eager results; "
        + where("refuse_when_eager")
    )
    cache = upstream_celery.result_cache(backend)
    assert hasattr(cache, "get") and hasattr(cache, "__setitem__"), (
        f"BaseBackend._cache is a {type(cache).__name__}, not a mapping: Celery changed its result cache; "
        + where("result_cache")
    )


def test_the_backend_methods_bbmongo_implements_keep_their_parameters() -> None:
    # BaseBackend calls them (store_result, get_task_meta, forget, the group methods); Celery's key-value backends
    # are the reference implementation of the interface.
    from celery.backends.base import BaseKeyValueStoreBackend

    from bb_broker.results.backend import JobResultBackend

    for name in ("_store_result", "_get_task_meta_for", "_forget", "_save_group", "_restore_group", "_delete_group"):
        celerys = [p for p in parameters(getattr(BaseKeyValueStoreBackend, name)) if p != "kwargs"]
        ours = parameters(getattr(JobResultBackend, name))
        assert ours[: len(celerys)] == celerys, (
            f"celery.backends.base.BaseKeyValueStoreBackend.{name} now takes {celerys}, bbmongo:// implements it with "
            f"{ours}: Celery changed its backend interface; see bb_broker/results/backend.py"
        )


def test_the_worker_lists_the_requests_it_holds() -> None:
    # Not a patch: public names, but of Celery's worker internals (bb_broker/worker/startup.py:_HeldRequests: its
    # reserved() keeps their leases fresh from them, its started() keeps a closed consumer from giving back a job that
    # runs on, and a request's worker_pid tells it whose run is gone).
    from celery.worker import state
    from celery.worker.request import Request

    assert hasattr(state.reserved_requests, "__iter__") and isinstance(Request.request_dict, property), (
        "celery.worker.state.reserved_requests or Request.request_dict changed: Celery changed how a worker lists the "
        "requests it holds, and their jobs' leases would go stale; see bb_broker/worker/startup.py:_HeldRequests"
    )
    assert "worker_pid" in source(Request.on_accepted), (
        "Request.on_accepted no longer records the pool process that took the request (worker_pid); see "
        "bb_broker/worker/startup.py:_HeldRequests._run_by_the_gone"
    )
    from celery.app import defaults

    # _cancelled_on_reconnect repeats Celery's own test of the runs it cancels on a reconnect.
    assert "cancel_long_running_tasks_on_connection_loss" in defaults.NAMESPACES["worker"] and hasattr(
        Request, "acknowledged"
    ), "Celery's cancel-on-reconnect setting or Request.acknowledged changed; see bb_broker/worker/startup.py"
    assert hasattr(state.active_requests, "__iter__"), (
        "celery.worker.state.active_requests changed: Celery changed how a worker lists the requests its pool runs, "
        "and a reconnect would give their jobs back to run twice; see bb_broker/worker/startup.py:_HeldRequests"
    )


# --- the app's state, beat's schedules ------------------------------------------------------------------------------


def test_an_apps_dict_keeps_our_state_and_pickling_the_app_carries_none_of_it(app: Celery) -> None:
    import pickle
    import threading

    assert "__slots__" not in vars(type(app)) and upstream_celery.app_state(app) is vars(app), (
        "a Celery app no longer keeps its attributes in a __dict__: bb_broker's per-app state has nowhere to live; "
        + where("app_state")
    )
    key = "bb_broker_contract"
    upstream_celery.app_state(app)[key] = threading.Lock()  # as a relay's sockets or a store's client: unpicklable
    reduced = repr(app.__reduce__())
    copy = pickle.loads(pickle.dumps(app))
    assert key not in reduced and key not in upstream_celery.app_state(copy), (
        "pickling a Celery app now carries its __dict__: bb_broker's stores and relay would travel to pool processes; "
        + where("app_state")
    )
    assert copy.main == app.main


def test_a_solars_next_event_is_found_from_any_moment() -> None:
    from datetime import UTC, datetime, timedelta

    import celery
    from celery.schedules import solar

    london = solar("sunrise", 51.5, 0.0)
    assert {"ephem", "cal"} <= set(vars(london)), (
        "celery.schedules.solar no longer keeps `ephem` and its observer `cal`: Celery changed how a solar schedule "
        "finds its event; " + where("solar_next_event")
    )
    if celery.VERSION >= (5, 7):
        assert callable(getattr(london, "_next_event", None)) and "return start" in source(london._next_event), (
            "solar._next_event is gone, or no longer returns its start when the event never comes: a polar night "
            "would read as an event at that moment; " + where("solar_next_event")
        )
    else:  # 5.4 to 5.6: no _next_event; the search asks the observer as their remaining_estimate does
        assert not hasattr(london, "_next_event") and {"method", "use_center"} <= set(vars(london)), (
            f"celery.schedules.solar of Celery {celery.__version__} has _next_event, or no `method` and "
            "`use_center`; " + where("solar_next_event")
        )
        assert "getattr(self.cal, self.method)(" in source(london.remaining_estimate), (
            "solar.remaining_estimate no longer asks its observer's `method`; " + where("solar_next_event")
        )
    start = datetime(2024, 6, 1, tzinfo=UTC)
    found = upstream_celery.solar_next_event(london, start)
    assert found is not None and timedelta(hours=3) < found - start < timedelta(hours=5), (
        f"London's sunrise after {start} is {found}, not about 03:43 UTC; " + where("solar_next_event")
    )
    night = datetime(2024, 12, 21, tzinfo=UTC)  # the polar night: the next sunrise at 80°N is in February
    found = upstream_celery.solar_next_event(solar("sunrise", 80.0, 0.0), night)
    assert found is not None and datetime(2025, 2, 1, tzinfo=UTC) < found < datetime(2025, 3, 1, tzinfo=UTC), (
        f"the sunrise after the polar night at 80°N is {found}: solar._next_event no longer searches the days "
        "ahead; " + where("solar_next_event")
    )


def test_a_crontab_keeps_its_fields_as_written() -> None:
    from celery.schedules import crontab

    written = crontab(minute="*/15", hour="9-17", day_of_month="1,15", month_of_year="*", day_of_week="mon-fri")
    assert upstream_celery.crontab_fields(written) == ("*/15", "9-17", "1,15", "*", "mon-fri"), (
        "celery.schedules.crontab's _orig_minute, _orig_hour, _orig_day_of_month, _orig_month_of_year or "
        "_orig_day_of_week no longer hold the fields as written: a schedule's stored form would change; "
        + where("crontab_fields")
    )


def test_every_app_of_the_process_is_listed_current_or_not() -> None:
    made = Celery("listed", broker="memory://", set_as_current=False)
    assert any(app is made for app in upstream_celery.apps()), (
        "an app made with set_as_current=False is not in celery._state._apps: Celery changed where it keeps its apps; "
        + where("apps")
    )


class _KeepingProducer:
    """A producer as Celery's send_task uses one (its publish and connection): keeps what it is given."""

    def __init__(self, app: Celery) -> None:
        self.connection = app.connection_for_write()
        self.published: list[tuple[Any, dict[str, Any]]] = []

    def publish(self, body: Any, **options: Any) -> None:
        self.published.append((body, options))


def test_send_task_builds_and_sends_through_the_apps_amqp_once_each_and_a_replay_is_the_same_publish(
    app: Celery,
) -> None:
    from datetime import UTC, datetime

    eta = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    producer = _KeepingProducer(app)
    with upstream_celery.recording_send_task(app) as call:
        app.send_task(
            "t.name",
            args=(1, 2),
            kwargs={"k": 3},
            eta=eta,
            task_id="id-1",
            producer=producer,
            queue="q",
            priority=3,
            serial_key="s-1",
        )
    assert (app.amqp.create_task_message.__wrapped__, app.amqp.send_task_message.__wrapped__) == (
        call.create,
        call.send,
    ), "recording_send_task's wrappers do not call Celery's own builder and sender"
    assert len(call.created) == 1 and len(call.sent) == 1, (
        "Celery's send_task no longer calls app.amqp.create_task_message and send_task_message once each: "
        "bb_broker/upstream/celery.py:recording_send_task and bb_broker/bulk.py:_Shapes cannot replay a publish"
    )
    (created, create_options), (name, send_options) = call.created[0], call.sent[0]
    at = upstream_celery
    assert (created[at.CREATE_TASK_ID], created[1], created[at.CREATE_ARGS], created[at.CREATE_KWARGS]) == (
        "id-1",
        "t.name",
        (1, 2),
        {"k": 3},
    ), "create_task_message's leading arguments moved: see CREATE_TASK_ID, CREATE_ARGS, CREATE_KWARGS"
    assert created[at.CREATE_ETA] == eta, "create_task_message's eta moved: see CREATE_ETA"
    assert name == "t.name" and send_options["serial_key"] == "s-1" and send_options["queue"] is not None
    # Replayed for another task id, its arguments and ETA: the same publish, but for what was given.
    positional = list(created)
    positional[at.CREATE_TASK_ID], positional[at.CREATE_ARGS], positional[at.CREATE_ETA] = "id-2", (7,), None
    call.send(producer, name, call.create(*positional, **create_options), **send_options)
    (first_body, first), (second_body, second) = producer.published
    assert second_body[0] == (7,) and second_body[1:] == first_body[1:]
    differs = {k for k in first["headers"] if first["headers"][k] != second["headers"].get(k)}
    assert differs == {"id", "root_id", "argsrepr", "eta"}, differs
    assert {k for k in first if k != "headers" and first[k] != second[k]} == {"correlation_id"}


def test_a_recorded_send_task_leaves_other_threads_calls_out_and_each_thread_records_its_own(app: Celery) -> None:
    import threading

    recorded: dict[str, list[Any]] = {}
    inside, go = threading.Event(), threading.Event()

    def other_thread() -> None:
        with upstream_celery.recording_send_task(app) as call:  # begun while the main thread records, ended after
            inside.set()
            go.wait(10)
            app.send_task("t.theirs", producer=_KeepingProducer(app))
        recorded["theirs"] = [name for name, _ in call.sent]

    with upstream_celery.recording_send_task(app) as call:
        other = threading.Thread(target=other_thread)
        other.start()
        inside.wait(10)
        app.send_task("t.mine", producer=_KeepingProducer(app))
    go.set()
    other.join()
    with upstream_celery.recording_send_task(app) as again:
        app.send_task("t.again", producer=_KeepingProducer(app))
    assert [name for name, _ in call.sent] == ["t.mine"] and len(call.created) == 1
    assert recorded["theirs"] == ["t.theirs"]
    assert [name for name, _ in again.sent] == ["t.again"]


def test_apply_async_checks_a_typed_tasks_arguments_with_its_header_and_converts_no_plain_ones(app: Celery) -> None:
    @app.task(name="t.typed", shared=False)
    def typed(x: int, y: int) -> int:
        return x + y

    @app.task(name="t.untyped", typing=False, shared=False)
    def untyped(x: int) -> int:
        return x

    check = upstream_celery.argument_check(typed)
    assert check is not None, "Task.__header__ is gone: apply_async's argument check cannot be replayed (bulk.py)"
    check(1, 2)
    with pytest.raises(TypeError):
        check(1, 2, 3)
    assert upstream_celery.argument_check(untyped) is None
    assert "check_arguments = self.__header__" in source(app.Task.apply_async)
    assert not upstream_celery.converts_arguments(typed)


def test_which_pools_end_a_running_task_is_told_by_their_terminate_job() -> None:
    # Celery 5.5.0 gave the gevent pool a terminate_job; prefork's is its billiard pool's, set as the pool starts.
    import celery
    from celery.concurrency import get_implementation
    from celery.concurrency.prefork import TaskPool as PreforkPool

    gevent, threads = get_implementation("gevent")(limit=1), get_implementation("threads")(limit=1)
    try:
        assert upstream_celery.pool_ends_running_tasks(gevent) == (celery.VERSION >= (5, 5)), (
            f"the gevent pool of Celery {celery.__version__} "
            + ("no longer ends" if celery.VERSION >= (5, 5) else "now ends")
            + " a running task (BasePool.terminate_job); "
            + where("pool_ends_running_tasks")
        )
        assert not upstream_celery.pool_ends_running_tasks(threads), (
            "Celery's threads pool now ends a running task: " + where("pool_ends_running_tasks")
        )
    finally:
        threads.on_stop()
    assert "self.terminate_job = " in source(PreforkPool.on_start), (
        "celery.concurrency.prefork.TaskPool.on_start no longer gives the started pool its billiard pool's "
        "terminate_job: " + where("pool_ends_running_tasks")
    )


def test_whether_the_prefork_pool_remembers_busy_processes_through_a_reconnect_is_told_by_its_flush() -> None:
    # Celery 5.7.0 (d4eb32a78) trims AsynPool.flush's busy set to the processes of accepted jobs; before, it cleared it.
    from celery.concurrency import get_implementation
    from celery.concurrency.asynpool import AsynPool
    from celery.concurrency.prefork import TaskPool as PreforkPool

    prefork, threads = PreforkPool(limit=1), get_implementation("threads")(limit=1)
    try:
        clears = "self._busy_workers.clear()" in source(AsynPool.flush)
        assert upstream_celery.pool_remembers_busy_processes_through_a_reconnect(prefork) != clears, (
            "AsynPool.flush " + ("now clears" if clears else "no longer clears") + " its busy processes: "
            + where("pool_remembers_busy_processes_through_a_reconnect")
        )  # fmt: skip
        assert upstream_celery.pool_remembers_busy_processes_through_a_reconnect(threads)
    finally:
        threads.on_stop()


def test_the_censored_settings_come_from_the_function_the_url_censor_wraps(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery.app import utils

    # Celery's own (a backend made earlier in this process installed the censor), put back afterwards.
    monkeypatch.setattr(utils, "filter_hidden_settings", inspect.unwrap(utils.filter_hidden_settings))
    app = Celery("contracts", broker="memory://", set_as_current=False)
    app.conf.result_backend = "bbmongo://ops:pw@127.0.0.1:1/db?tlsCertificateKeyFilePassword=kept-as-written"
    app.conf.bb_nested = {"url": "mongodb://127.0.0.1:1/?tlsCertificateKeyFilePassword=nested-too"}
    shown = app.conf.table(censored=True)
    # Celery 5.4 to 5.6 drop a backend URL's options (Kombu's sanitize_url); 5.7 shows them as written, which the
    # censor is for.
    assert "pw@" not in shown["result_backend"], (
        "Celery's censored settings no longer mask a backend URL's password: " + where("install_url_censor")
    )
    upstream_celery.install_url_censor(lambda url: url.split("?")[0] + "?censored")
    upstream_celery.install_url_censor(lambda url: "installed twice")
    shown = app.conf.table(censored=True)
    assert shown["result_backend"] == "bbmongo://ops:********@127.0.0.1:1/db?censored", (
        "Settings.table(censored=True) no longer calls celery.app.utils.filter_hidden_settings as a module global "
        "at each call: Celery's censoring moved, and credentials among a URL's options show in `inspect conf`; "
        + where("install_url_censor")
    )
    assert shown["bb_nested"] == {"url": "mongodb://127.0.0.1:1/?censored"}
