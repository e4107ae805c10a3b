"""Every contact with Flower's and Tornado's internals: each patch of theirs is made here, and only here.

Flower 2 has no extension point: no plugin interface, no way to add a broker, a handler or a template but editing
its modules' tables and classes before it builds its Tornado application. Each function below says what it changes,
why no public hook does it, and the Flower releases it was checked against; tests/unit/test_upstream_flower.py
asserts the shapes each relies on and fails, naming the Flower change and the function here, when a release moves
one. What a patch does for bb_broker (the Broker tab's rows, the banner, who may act) is passed in by
bb_broker.contrib.flower.plugin, whose `install()` makes them all: this module knows Flower's shapes, not the tabs'
rules.

Unlike the other upstream modules, this one imports Flower and Tornado at its top: only the Flower plugin imports it,
in a process running Flower, never while `celery` or `kombu.transport` are being imported.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import tornado.template
import tornado.web
from flower import urls as flower_urls
from flower.app import Flower
from flower.utils import broker as flower_broker
from flower.views import BaseHandler
from flower.views.workers import WorkersView
from tornado.httputil import HTTPServerRequest
from tornado.web import URLSpec

#: The releases every function here was checked against: the contract tests pass on Flower 2.0.1, 2.1.0 and 2.2.0
#: with Tornado 6.6.1; the sources of the Tornado releases they allow (5.0, 5.1.1, 6.0.4 to 6.5.7) were read, and
#: where releases differ each function says how (the tests then fail, naming the place).
CHECKED_AGAINST = "flower 2.0.1, 2.1.0, 2.2.0; tornado 6.6.1 (5.0 to 6.5.7 read)"

#: Marks what this module installed, so that installing twice installs once.
INSTALLED = "_bb_broker_patch"


def install_broker_factory(is_ours: Callable[[str], bool], ours: Callable[..., Any]) -> None:
    """Make Flower's broker factory `flower.utils.broker.Broker(broker_url, *args, **kwargs)` answer `ours(...)` for a
    URL `is_ours` accepts; every other URL still reaches Flower's own `__new__` (idempotent).

    Flower picks the broker class by URL scheme in `Broker.__new__` and raises NotImplementedError for any other, which
    its Broker tab shows as "broker is not supported"; it takes no broker class from its options. Relies on: the
    handlers calling `Broker(app.broker_uri_with_password, http_api=..., broker_options=...)` (BaseHandler.get_broker)
    and `await broker.queues(names)`. Checked against flower 2.2.0; 2.0.1 and 2.1.0 have the same `__new__`, and
    their BrokerView.get and GetQueueLengths.get call `Broker(...)` themselves (no get_broker), which this serves
    the same."""
    factory = flower_broker.Broker
    if getattr(factory.__new__, INSTALLED, False):
        return
    flowers_new = factory.__new__

    def __new__(cls: type, broker_url: str, *args: Any, **kwargs: Any) -> Any:
        if is_ours(broker_url):
            return ours(broker_url, *args, **kwargs)
        return flowers_new(cls, broker_url, *args, **kwargs)

    setattr(__new__, INSTALLED, True)
    __new__.flowers_new = flowers_new  # type: ignore[attr-defined]  # kept on the function for flowers_broker_new
    factory.__new__ = staticmethod(__new__)


def flowers_broker_new() -> Callable[..., Any]:
    """Flower's own `Broker.__new__`, under the one install_broker_factory puts in front of it."""
    new = flower_broker.Broker.__new__
    return getattr(new, "flowers_new", new)


def broker_url_with_password(app: Flower) -> str:
    """The URL of the broker Flower's app watches, password included: `Flower.broker_uri_with_password` (Flower 2.1
    on, a cached property), or on Flower 2.0, which has none, what its own Broker tab passes its factory
    (`app.capp.connection().as_uri(include_password=True)`, flower/views/broker.py). Checked against flower 2.0.1,
    2.1.0, 2.2.0."""
    url = getattr(app, "broker_uri_with_password", None)
    if url is not None:
        return str(url)
    with app.capp.connection() as connection:
        return str(connection.as_uri(include_password=True))


def http_error_message(exc: tornado.web.HTTPError) -> str | None:
    """An HTTPError's message with its arguments in. Tornado 6.6 has `get_message` for it and escapes `log_message`
    when there are no arguments (each % doubled, for its own formatting); before 6.6, `log_message` is the text as
    given."""
    get_message = getattr(exc, "get_message", None)
    if get_message is not None:
        return get_message()
    return exc.log_message % exc.args if exc.log_message and exc.args else exc.log_message


def plain_argument(handler: tornado.web.RequestHandler, name: str, default: Any = None, strip: bool = True) -> Any:
    """A request argument as sent, not HTML-escaped: Tornado's own `RequestHandler.get_argument`, under Flower's
    `BaseHandler.get_argument`, which escapes every value and takes `escape=False` only from Flower 2.2 on (2.0 and
    2.1 have no such parameter: a call with it fails the request). Relies on: Flower's override calling Tornado's
    first, then escaping (its `type` and `required` are not used here). Checked against flower 2.0.1, 2.1.0, 2.2.0."""
    return tornado.web.RequestHandler.get_argument(handler, name, default, strip)


def install_template_loader(rewrite: Callable[[str, str], bytes | None]) -> None:
    """Serve Flower's templates through a Tornado `Loader` on Flower's template path that asks `rewrite(root, name)`
    first for each template it loads: the source it returns is compiled in the template's place; None leaves the
    template to Tornado (the file `name` under `root`) (idempotent).

    `template_loader` is a documented Tornado application setting; Flower builds its application from the module-level
    `flower.urls.settings` dict and takes no setting of its own for it, so the dict is where it goes. Relies on:
    `flower.urls.settings["template_path"]`, and Flower passing `**settings` to its Application
    (flower.command: `Flower(capp=app, options=options, **settings)`). Tornado's loaders take no hook for a template's
    source: `Loader._create_template(name)`, which `BaseLoader.load` calls once per template name, is overridden (and
    called for Flower's own templates). Checked against flower 2.0.1, 2.1.0, 2.2.0 (each writes the places
    bb_broker.contrib.flower.templates splices after its own way: that module finds each release's) and tornado 5.0
    to 6.6.1 (the same `load` and `_create_template(self, name)` in each)."""
    current = flower_urls.settings.get("template_loader")
    if isinstance(current, RewritingLoader) and current.rewrite is rewrite:
        return
    flower_urls.settings["template_loader"] = RewritingLoader(flower_urls.settings["template_path"], rewrite)


class RewritingLoader(tornado.template.Loader):
    """A Tornado template loader that asks `rewrite(root, name)` for a template's source first (see
    install_template_loader)."""

    def __init__(self, root_directory: str, rewrite: Callable[[str, str], bytes | None]) -> None:
        super().__init__(root_directory)
        self.rewrite = rewrite

    def _create_template(self, name: str) -> tornado.template.Template:
        source = self.rewrite(self.root, name)
        if source is None:
            return super()._create_template(name)
        return tornado.template.Template(source, name, self)


def template_loader() -> Any:
    """The template loader Flower's application is built with (None before install_template_loader)."""
    return flower_urls.settings.get("template_loader")


def install_workers_refresh_check(prepare: Callable[[Any], None]) -> None:
    """Run `prepare(handler)` before each request of Flower's Workers page (`WorkersView.prepare`; idempotent).

    Tornado's `prepare` is the documented place for a check before every method, but WorkersView is Flower's class,
    made by Flower's URL table: the only way into it is its attribute. Relies on: neither WorkersView nor Flower's
    BaseHandler defining a prepare of its own (this one replaces Tornado's empty one, calling nothing before it).
    Checked against flower 2.1.0, 2.2.0; 2.0.1's flower.js does not turn the refresh dot red on a failed refresh
    (workers_refresh_shows_failures; Flower says so as it starts, bb_broker.contrib.flower.broker)."""
    if WorkersView.prepare is not prepare:
        WorkersView.prepare = prepare


#: How flower.js's Workers refresh turns its dot red on a failed request (Flower 2.1 and 2.2).
_REFRESH_FAILURE = re.compile(
    r"url: url_prefix\(\) \+ '/workers\?json=1',.*?error: function \(\) \{\s*updateWorkerRefreshStatus\(false\);", re.S
)


def workers_refresh_shows_failures() -> bool:
    """Whether Flower's own flower.js turns the Workers refresh dot red when a refresh fails (not in Flower 2.0)."""
    import flower

    script = Path(flower.__file__).parent / "static" / "js" / "flower.js"
    return bool(_REFRESH_FAILURE.search(script.read_text()))


def install_cross_site_check(check: Callable[[tornado.web.RequestHandler], None]) -> None:
    """Run `check(handler)` first in Flower's `BaseHandler.check_xsrf_cookie`, which Tornado calls for every POST, PUT
    and DELETE to every handler under the `xsrf_cookies` setting (idempotent).

    Flower 2.2 turns Tornado's `xsrf_cookies` on and overrides check_xsrf_cookie in its BaseHandler; before 2.2 it
    turns it on nowhere, so Tornado calls no check_xsrf_cookie (the method is Tornado's own token check, which this
    calls): the Jobs tab's handlers and the guard on Flower's actions then check themselves
    (bb_broker.contrib.flower.access.checks_each_change). Every one of Flower's handlers derives from BaseHandler,
    which is Flower's: its attribute is the only way in. Checked against flower 2.0.1, 2.1.0, 2.2.0."""
    if getattr(BaseHandler.check_xsrf_cookie, INSTALLED, False):
        return
    flowers = BaseHandler.check_xsrf_cookie

    def check_xsrf_cookie(self: BaseHandler) -> None:
        check(self)
        flowers(self)

    setattr(check_xsrf_cookie, INSTALLED, True)
    check_xsrf_cookie.flowers = flowers  # type: ignore[attr-defined]  # Flower's own, kept on its wrapper
    BaseHandler.check_xsrf_cookie = check_xsrf_cookie


def install_host_check(
    refusal_for: Callable[[Any, HTTPServerRequest], type[tornado.web.RequestHandler] | None],
) -> None:
    """Answer each request to Flower's application with the handler `refusal_for(application, request)` names, when it
    names one, before Flower's routing picks a handler (idempotent).

    `Application.find_handler(request)` is Tornado's documented routing entry (the HTTP server calls it for every
    request) and `get_handler_delegate` its documented way to answer with a handler class; Flower builds the
    application from its own class, `flower.app.Flower`, which takes no router or setting for it, so its attribute is
    the only way in. No handler's `prepare` would do: some of Flower's replace it, and static files and the catch-all
    are Tornado's. Relies on: Flower not defining find_handler itself, and serving through `Flower(...)`
    (flower.command). Checked against flower 2.2.0; tornado 6.6.1."""
    if getattr(Flower.find_handler, INSTALLED, False):
        return
    flowers = Flower.find_handler

    def find_handler(self: Flower, request: HTTPServerRequest, **kwargs: Any) -> Any:
        refusal = refusal_for(self, request)
        if refusal is not None:
            return self.get_handler_delegate(request, refusal)
        return flowers(self, request, **kwargs)

    setattr(find_handler, INSTALLED, True)
    find_handler.flowers = flowers  # type: ignore[attr-defined]  # Tornado's own, kept on its wrapper
    Flower.find_handler = find_handler


def url_table() -> list[Any]:
    """Flower's URL table, `flower.urls.handlers`: the list Flower's application is built from (flower.app imports it
    as its default handlers), tuples and URLSpecs, its catch-all `.*` last."""
    return flower_urls.handlers


def handler_class_of(spec: Any) -> type[tornado.web.RequestHandler]:
    """The handler class of a row of Flower's URL table (a tuple or a Tornado URLSpec)."""
    return spec.handler_class if isinstance(spec, URLSpec) else spec[1]


def install_handlers(handlers: list[Any], name: str) -> None:
    """Insert `handlers` into Flower's URL table just before its catch-all (idempotent: a handler called `name`
    there already means they are in).

    Flower builds its application from that list and takes no handlers from its options or configuration file.
    Checked against flower 2.0.1, 2.1.0, 2.2.0."""
    table = url_table()
    if any(getattr(handler, "name", None) == name for handler in table):
        return
    catch_all = next(i for i, h in enumerate(table) if isinstance(h, tuple) and h[0] == r".*")
    table[catch_all:catch_all] = handlers


def guard_prepare(handler_class: type[tornado.web.RequestHandler], guard: Callable[[Any], Awaitable[None]]) -> None:
    """Run `await guard(handler)` after the `prepare` of one of Flower's handler classes, before its method
    (idempotent).

    Tornado runs `prepare` before every method, after the XSRF check; the class is Flower's, made by its URL table, so
    its attribute is the only way in. Flower's own prepare (BaseApiHandler's, which refuses anonymous API use unless
    told) runs first, awaited when it is a coroutine. Checked against flower 2.0.1, 2.1.0, 2.2.0 (before 2.2 that
    prepare reads FLOWER_UNAUTHENTICATED_API itself, not the `unauthenticated_api` option)."""
    if is_guarded(handler_class):
        return
    flowers = handler_class.prepare

    async def guarded_prepare(self: tornado.web.RequestHandler) -> None:
        result = flowers(self)
        if inspect.isawaitable(result):
            await result
        await guard(self)

    setattr(guarded_prepare, INSTALLED, True)
    guarded_prepare.flowers = flowers  # type: ignore[attr-defined]  # Flower's own, kept on its wrapper
    handler_class.prepare = guarded_prepare  # type: ignore[method-assign]  # replacing the method is the patch


def is_guarded(handler_class: type[tornado.web.RequestHandler]) -> bool:
    return getattr(handler_class.prepare, INSTALLED, False)


def guard_prepares(handler_classes: Iterable[type[tornado.web.RequestHandler]], guard: Callable[[Any], Any]) -> None:
    """guard_prepare for each of `handler_classes`."""
    for handler_class in handler_classes:
        guard_prepare(handler_class, guard)


def known_workers(application: Any) -> dict[str, int | None]:
    """The Celery workers Flower's event state knows, by node name (`name@host`), with the process id their
    heartbeats give (None before one came).

    Flower keeps what the workers' events say in `application.events.state`, a `celery.events.state.State` whose
    `workers` maps each node name to a `celery.events.state.Worker` (its `hostname` the node name, its `pid` the
    worker's main process); no API of Flower's gives it to another page. Checked against flower 2.0.1, 2.1.0, 2.2.0
    (celery 5.3 to 5.6's Worker._fields)."""
    events = getattr(application, "events", None)
    state = getattr(events, "state", None)
    workers = getattr(state, "workers", None) or {}
    known: dict[str, int | None] = {}
    for name, worker in list(workers.items()):  # Flower's event loop adds workers meanwhile: a copy
        pid = getattr(worker, "pid", None)
        known[str(name)] = pid if isinstance(pid, int) else None
    return known


#: The attribute of Flower's application that holds bb_broker's state for it (application_state).
APPLICATION_STATE = "_bb_broker"


def application_state(application: Any) -> dict[str, Any]:
    """bb_broker's state for one of Flower's applications (the Jobs tab's threads and client, made on first use), a
    dict kept on the application itself, where every handler reaches it (`handler.application`).

    Flower's application (`flower.app.Flower`, a `tornado.web.Application`) has no place for a plugin's state and its
    handlers are made per request: an attribute of the application's own is the one place shared by all of them for
    its lifetime. Relies on: neither class having `__slots__` or an attribute of this name. Handlers run on the
    application's event loop, one at a time, so no lock is needed. Checked against flower 2.0.1, 2.1.0, 2.2.0 and
    tornado 5.0 to 6.6.1."""
    state: dict[str, Any] = vars(application).setdefault(APPLICATION_STATE, {})
    return state
