"""The shapes of Flower (and Tornado) that bb_broker/upstream/flower.py relies on: each test fails, naming the Flower
change and the function of upstream/flower.py it breaks, before any user sees a broken Broker tab, banner or Jobs
tab."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import tornado.template
import tornado.web

from bb_broker.contrib.flower import (
    flowers_actions,
    health,
    plugin,
    templates,
)
from bb_broker.contrib.flower.flowers_actions import READING_POSTS, WRITE_METHODS
from bb_broker.upstream import flower as upstream_flower
from tests.support.flower_process import FLOWER, FLOWERS_ACTIONS

PATCHES = "bb_broker/upstream/flower.py"

#: The installed Flower's (major, minor): 2.0 and 2.1 differ from 2.2 where the tests below say.


def where(function: str) -> str:
    return f"see {PATCHES}:{function} (checked against {upstream_flower.CHECKED_AGAINST})"


def flower_file(*parts: str) -> Path:
    import flower

    return Path(flower.__file__).parent.joinpath(*parts)


def test_the_broker_factory_is_called_as_the_broker_tab_needs() -> None:
    import flower.views
    from flower.api.tasks import GetQueueLengths
    from flower.utils import broker as flower_broker
    from flower.views.broker import BrokerView

    params = inspect.signature(upstream_flower.flowers_broker_new()).parameters
    assert list(params)[:2] == ["cls", "broker_url"], (
        f"flower.utils.broker.Broker.__new__ now takes {list(params)}: Flower changed its factory's call; "
        + where("install_broker_factory")
    )
    assert {p.kind for p in params.values()} >= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    if FLOWER >= (2, 2):
        assert flower.views.Broker is flower_broker.Broker, (
            "flower.views no longer calls flower.utils.broker.Broker: Flower moved its broker factory; "
            + where("install_broker_factory")
        )
        get_broker = inspect.getsource(flower.views.BaseHandler.get_broker)
        assert "Broker(app.broker_uri_with_password" in get_broker and "broker_options=" in get_broker, (
            "flower.views.BaseHandler.get_broker no longer calls Broker(broker URL, ..., broker_options=...): "
            + where("install_broker_factory")
        )
        assert "except NotImplementedError" in get_broker, "Flower no longer says 'not supported' for an unknown scheme"
        called = "self.get_broker()"
    else:  # Flower 2.0 and 2.1: each handler calls the factory itself (2.0 with the URL of its app's connection)
        called = "Broker(app.broker_uri_with_password" if FLOWER >= (2, 1) else "Broker(app.capp.connection("
    for handler in (BrokerView.get, GetQueueLengths.get):
        source = inspect.getsource(handler)
        assert called == "self.get_broker()" or inspect.getmodule(handler).Broker is flower_broker.Broker, (
            f"{handler.__qualname__}'s module no longer calls flower.utils.broker.Broker; "
            + where("install_broker_factory")
        )
        assert called in source and "await broker.queues(self.get_active_queue_names())" in source, (
            f"{handler.__qualname__} no longer asks the broker for `await .queues(names)`: Flower changed what its "
            "Broker tab reads; see bb_broker/contrib/flower/broker.py:JobQueues"
        )
    template = flower_file("templates", "broker.html").read_text()
    for key in ("name", "messages", "messages_unacknowledged", "messages_ready"):
        assert f"queue.get('{key}'" in template or f"queue['{key}']" in template, (
            f"Flower's broker.html no longer shows {key!r}: its Broker tab changed columns; see "
            "bb_broker/contrib/flower/broker.py:_row"
        )


def test_the_factory_is_wrapped_once_and_flowers_own_still_answers() -> None:
    from flower.utils import broker as flower_broker

    plugin.install()  # again: still one wrapper around Flower's own factory
    assert not getattr(upstream_flower.flowers_broker_new(), upstream_flower.INSTALLED, False), (
        "Flower's factory was wrapped twice"
    )
    with pytest.raises(NotImplementedError):
        flower_broker.Broker("nosuch://host/", http_api=None)
    assert type(flower_broker.Broker("amqp://guest:guest@localhost//", http_api=None)).__name__ == "RabbitMQ"


def test_the_template_loader_reaches_every_page_and_the_anchors_are_there() -> None:
    import flower.command
    import flower.views.workers

    assert "Flower(capp=app, options=options, **settings)" in inspect.getsource(flower.command.flower.callback), (
        "flower.command no longer builds its app with flower.urls.settings: Flower changed where Tornado's settings "
        "come from, and no page shows the banner or the Jobs tab; " + where("install_template_loader")
    )
    loader = upstream_flower.template_loader()
    assert isinstance(loader, upstream_flower.RewritingLoader) and loader.rewrite is templates.template_source
    plugin.install()  # again: the same loader
    assert upstream_flower.template_loader() is loader
    # RewritingLoader overrides Tornado's Loader._create_template, which BaseLoader.load calls for a template not
    # loaded yet.
    assert "self._create_template(name)" in inspect.getsource(tornado.template.BaseLoader.load), (
        "tornado.template.BaseLoader.load no longer calls _create_template(name): Tornado changed how a loader makes "
        "its templates; " + where("RewritingLoader")
    )
    assert list(inspect.signature(tornado.template.Loader._create_template).parameters) == ["self", "name"], (
        "tornado.template.Loader._create_template changed its parameters: " + where("RewritingLoader")
    )
    base = flower_file("templates", "base.html").read_bytes()
    anchor = templates.banner_anchor(base)
    assert anchor is not None and base.count(anchor) == 1, (
        "Flower's base.html no longer has the banner's anchor once: Flower changed its page layout; see "
        "bb_broker/contrib/flower/templates.py:template_source"
    )
    assert "reverse_url('jobs')" in loader.load("navbar.html").code and loader.load("bb_jobs.html")
    flowers_templates = Path(loader.root)
    assert templates.NAVBAR_ANCHOR.search((flowers_templates / "navbar.html").read_text()), (
        "Flower's navbar.html no longer has the Jobs link's anchor; see bb_broker/contrib/flower/templates.py"
    )
    with_banner = templates.template_source(str(flowers_templates), "base.html")
    assert with_banner is not None and b'id="bb-broker-error"' in with_banner
    broker = (flowers_templates / "broker.html").read_text()
    assert templates.BROKER_HEADER_ANCHOR.search(broker) and templates.BROKER_CELL_ANCHOR.search(broker), (
        "Flower's broker.html no longer has the Paused column's anchors; see bb_broker/contrib/flower/templates.py"
    )


def test_a_rewriting_loader_compiles_what_rewrite_gives_and_leaves_the_rest_to_tornado(tmp_path: Path) -> None:
    (tmp_path / "page.html").write_text("{% extends 'base.html' %}{% block body %}page{% end %}")
    (tmp_path / "base.html").write_text("<body>{% block body %}{% end %}</body>")
    asked: list[tuple[str, str]] = []

    def rewrite(root: str, name: str) -> bytes | None:
        asked.append((root, name))
        return b"<main>{% block body %}{% end %}</main>" if name == "base.html" else None

    loader = upstream_flower.RewritingLoader(str(tmp_path), rewrite)
    assert loader.load("page.html").generate() == b"<main>page</main>", (
        "a template extending a rewritten one no longer gets the rewritten source: Tornado changed how its loaders "
        "make templates; " + where("RewritingLoader")
    )
    assert asked == [(loader.root, "page.html"), (loader.root, "base.html")]
    loader.load("page.html")
    assert len(asked) == 2, "Tornado no longer keeps a loaded template: rewrite is asked at every page"


def test_bb_brokers_state_lives_on_flowers_application() -> None:
    import flower.app
    from celery import Celery
    from flower.options import default_options

    for cls in flower.app.Flower.__mro__[:-1]:
        assert "__slots__" not in vars(cls), f"{cls.__qualname__} now has __slots__: " + where("application_state")
        assert upstream_flower.APPLICATION_STATE not in vars(cls), (
            f"{cls.__qualname__} now has an attribute {upstream_flower.APPLICATION_STATE}: "
            + where("application_state")
        )
    application = flower.app.Flower(capp=Celery(broker="memory://"), options=default_options)
    try:
        state = upstream_flower.application_state(application)
        state["jobs_tab"] = tab = object()
        assert upstream_flower.application_state(application)["jobs_tab"] is tab
        other = flower.app.Flower(capp=Celery(broker="memory://"), options=default_options)
        assert upstream_flower.application_state(other) == {}, "two applications share one state"
        other.executor.shutdown()
    finally:
        application.executor.shutdown()


def test_the_workers_page_has_no_prepare_of_its_own() -> None:
    import flower.views
    import flower.views.workers

    # Flower 2.0's flower.js ignores a failed refresh (install_workers_refresh_check says so in one line).
    assert upstream_flower.workers_refresh_shows_failures() == (FLOWER >= (2, 1)), (
        "flower.js no longer turns the Workers refresh dot red on a failed refresh: "
        + where("install_workers_refresh_check")
    )
    own = inspect.getsource(flower.views.workers) + inspect.getsource(flower.views.BaseHandler)
    assert "def prepare" not in own, (
        "Flower's WorkersView or BaseHandler now has a prepare of its own, which the refresh check replaces: "
        + where("install_workers_refresh_check")
    )
    assert flower.views.workers.WorkersView.prepare is health.fail_workers_refresh_while_broker_fails


def test_the_cross_site_check_runs_before_flowers_own() -> None:
    from flower.views import BaseHandler
    from tornado.web import RequestHandler

    plugin.install()
    check = BaseHandler.check_xsrf_cookie
    assert getattr(check, upstream_flower.INSTALLED, False), "BaseHandler.check_xsrf_cookie is not ours"
    flowers = check.flowers
    assert not getattr(flowers, upstream_flower.INSTALLED, False), "BaseHandler.check_xsrf_cookie was wrapped twice"
    assert list(inspect.signature(flowers).parameters) == ["self"], (
        f"Flower's check_xsrf_cookie now takes {list(inspect.signature(flowers).parameters)}: "
        + where("install_cross_site_check")
    )
    # Tornado checks a POST, PUT or DELETE through check_xsrf_cookie when the `xsrf_cookies` setting is on, which
    # Flower 2.2 turns on (before, the Jobs tab's handlers check in their prepare, and the guard on Flower's actions in
    # theirs: access.checks_each_change).
    tornados = inspect.getsource(RequestHandler)
    assert re.search(r'settings\.get\("xsrf_cookies"\):\s*self\.check_xsrf_cookie\(\)', tornados), (
        "Tornado no longer calls check_xsrf_cookie for a request that changes something under xsrf_cookies: "
        + where("install_cross_site_check")
    )


def test_the_jobs_tab_joins_flowers_url_table_once() -> None:
    import flower.app
    from flower.api import BaseApiHandler
    from flower.views import BaseHandler
    from tornado.options import options

    plugin.install()  # twice: still one set of handlers
    table = upstream_flower.url_table()
    patterns = [(h[0] if isinstance(h, tuple) else h.regex.pattern).rstrip("$") for h in table]
    assert patterns.count("/jobs") == 1 and patterns.count("/api/jobs") == 1 and patterns[-1] == ".*", (
        f"the Jobs tab is not once before Flower's catch-all in {patterns}: " + where("install_handlers")
    )
    assert "from .urls import handlers as default_handlers" in inspect.getsource(flower.app), (
        "flower.app no longer builds its application from flower.urls.handlers: Flower changed where its URL table "
        "comes from, and the Jobs tab is nowhere; " + where("install_handlers")
    )
    assert "def get_current_user" in inspect.getsource(BaseHandler), "Flower's BaseHandler has no get_current_user"
    # Flower 2.2 reads its `unauthenticated_api` option; 2.0 and 2.1 the FLOWER_UNAUTHENTICATED_API variable.
    rule = "unauthenticated_api" if FLOWER >= (2, 2) else "FLOWER_UNAUTHENTICATED_API"
    assert rule in inspect.getsource(BaseApiHandler.prepare), (
        "Flower's BaseApiHandler.prepare no longer applies its API's authentication rule: " + where("guard_prepare")
    )
    assert "jobs_admins" in options and ("read_only" in options or FLOWER < (2, 1))  # --read_only is new in 2.1


def test_every_one_of_flowers_actions_is_guarded() -> None:
    """Fails when a Flower release adds an endpoint that acts, or moves what the guard wraps."""
    from flower.api import BaseApiHandler
    from flower.api.control import TaskRevoke
    from tornado.web import RequestHandler

    plugin.install()  # twice: still one guard per handler
    table = upstream_flower.url_table()
    acting = flowers_actions.flowers_actions(table)
    assert {handler.__name__ for handler in acting} == FLOWERS_ACTIONS, (
        "Flower's acting handlers changed: a new one is refused to everyone --jobs_admins does not name until it is "
        "looked at; " + where("guard_prepare")
    )
    ours = {upstream_flower.handler_class_of(spec) for spec in plugin.OUR_HANDLERS}
    for spec in table:
        handler = upstream_flower.handler_class_of(spec)
        writes = [name for name in WRITE_METHODS if getattr(handler, name) is not getattr(RequestHandler, name)]
        if writes:
            assert handler in ours or handler in READING_POSTS or upstream_flower.is_guarded(handler), handler
    for handler in acting:
        assert upstream_flower.is_guarded(handler)
        assert handler.prepare.flowers is BaseApiHandler.prepare, (
            f"{handler.__name__}.prepare is not one guard around BaseApiHandler.prepare: Flower gave it a prepare of "
            "its own; " + where("guard_prepare")
        )
    tasks_table, not_found = READING_POSTS
    assert "return self.get()" in inspect.getsource(tasks_table.post), "Flower's TasksDataTable.post no longer reads"
    assert "HTTPError(404)" in inspect.getsource(not_found.post), "Flower's catch-all POST no longer answers 404"
    revoke = next(s for s in table if isinstance(s, tuple) and s[1] is TaskRevoke)
    assert revoke[0].endswith("/(.+)"), (
        "Flower's revoke no longer takes the task id as its one path argument; see "
        "bb_broker/contrib/flower/flowers_actions.py:_record_revoke"
    )


def test_flowers_event_state_gives_each_workers_node_name_and_process_id() -> None:
    import flower.app
    import flower.events
    from celery.events.state import State, Worker

    assert "self.events = events or Events(" in inspect.getsource(flower.app.Flower.__init__), (
        "Flower's application no longer keeps its Events as `events`: " + where("known_workers")
    )
    assert issubclass(flower.events.EventsState, State), "Flower's event state is no longer Celery's State"
    assert "self.state = EventsState(" in inspect.getsource(flower.events.Events.__init__), (
        "Flower's Events no longer keeps its state as `state`: " + where("known_workers")
    )
    assert {"hostname", "pid"} <= set(Worker._fields), "Celery's event Worker lost hostname or pid"

    class Application:
        events = flower.events.Events.__new__(flower.events.Events)

    Application.events.state = flower.events.EventsState()
    Application.events.state.event({"type": "worker-heartbeat", "hostname": "w1@box", "pid": 4242, "timestamp": 1.0,
                                    "local_received": 1.0, "clock": 1})  # fmt: skip
    assert upstream_flower.known_workers(Application()) == {"w1@box": 4242}
    assert upstream_flower.known_workers(object()) == {}  # an application without events: no worker known


def test_every_request_reaches_the_host_check_before_flowers_routing() -> None:
    import flower.app
    import flower.command
    import tornado.routing
    from tornado.options import options
    from tornado.web import Application

    plugin.install()  # twice: still one wrapper
    find_handler = flower.app.Flower.find_handler
    assert getattr(find_handler, upstream_flower.INSTALLED, False), "Flower.find_handler is not ours"
    assert find_handler.flowers is Application.find_handler, (
        "flower.app.Flower now defines find_handler (or it was wrapped twice): " + where("install_host_check")
    )
    # The HTTP server hands each request to its router, the application (Tornado's _RoutingDelegate).
    assert "self.router.find_handler(request)" in inspect.getsource(tornado.routing), (
        "Tornado no longer routes each request through Application.find_handler: " + where("install_host_check")
    )
    parameters = list(inspect.signature(Application.get_handler_delegate).parameters)
    assert parameters[:3] == ["self", "request", "target_class"], (
        f"Tornado's Application.get_handler_delegate now takes {parameters}: " + where("install_host_check")
    )
    assert "Flower(capp=app, options=options" in inspect.getsource(flower.command.flower.callback), (
        "flower.command no longer builds its application as flower.app.Flower: " + where("install_host_check")
    )
    assert "allowed_hosts" in options


def test_an_http_errors_message_is_its_text_with_its_arguments_in() -> None:
    assert upstream_flower.http_error_message(tornado.web.HTTPError(400, "status '%s' is not one", "%d")) == (
        "status '%d' is not one"
    )
    assert upstream_flower.http_error_message(tornado.web.HTTPError(400, "a 100% bad filter")) == "a 100% bad filter"
    assert upstream_flower.http_error_message(tornado.web.HTTPError(404)) is None
