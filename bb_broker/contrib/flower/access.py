"""Who may act in the Jobs and Schedules tabs and through Flower's own actions.

Flower's `--read_only` stops every action; `--jobs_admins=alice,bob` (or FLOWER_JOBS_ADMINS) lets only those users
act (basic-auth user names or OAuth e-mail addresses); everyone else reads, and gets a 403 to act. Without a login
(--no-auth), a request that says it comes from another site is refused; with users too on a Flower before 2.2, which
checks no request's site itself.
"""

from __future__ import annotations

import base64
from urllib.parse import urlparse

import tornado.web
from flower.views import BaseHandler


def user_name(handler: BaseHandler) -> str:
    """Who is asking: the basic-auth user name, the OAuth user, or "anonymous" when Flower asks nobody."""
    options = handler.application.options
    if options.basic_auth:
        header = handler.request.headers.get("Authorization", "")
        try:
            scheme, encoded = header.split(None, 1)
            if scheme == "Basic":
                return base64.b64decode(encoded).decode().partition(":")[0]
        except (ValueError, UnicodeDecodeError):
            pass
    user = handler.current_user
    return user if isinstance(user, str) else "anonymous"


def admins(handler: BaseHandler) -> list[str]:
    names = getattr(handler.application.options, "jobs_admins", None) or []
    return [name.strip() for entry in names for name in str(entry).split(",") if name.strip()]


def read_only(handler: BaseHandler) -> bool:
    # Flower has had --read_only since 2.1; before, there is no such option (and nothing is read-only).
    return bool(getattr(handler.application.options, "read_only", False))


def can_act(handler: BaseHandler) -> bool:
    """Actions are for everyone Flower lets in, unless Flower is read-only or --jobs_admins names the few."""
    if read_only(handler):
        return False
    allowed = admins(handler)
    return not allowed or user_name(handler) in allowed


def refuse_unless_allowed(handler: BaseHandler) -> None:
    if read_only(handler):
        raise tornado.web.HTTPError(403, "Flower is read-only (--read_only): no job or queue can be changed")
    if not can_act(handler):
        who = user_name(handler)
        raise tornado.web.HTTPError(403, f"{who} may read the jobs but not act on them (see --jobs_admins)")


def checks_each_change(handler: BaseHandler) -> bool:
    """Whether Tornado calls the handler's `check_xsrf_cookie` before each request that changes something (POST, PUT,
    DELETE, PATCH): only under the application's `xsrf_cookies` setting, which Flower turns on from 2.2. Before, no
    check of Flower's runs: the Jobs tab's handlers and the guard on Flower's actions make theirs themselves."""
    return bool(handler.settings.get("xsrf_cookies"))


def refuse_cross_site_without_login(handler: BaseHandler) -> None:
    """Flower checks where a request that changes something comes from only when it has users. Without (--no-auth),
    a page of another site open in the operator's browser could post to it: to the Jobs tab's API and Flower's own
    when FLOWER_UNAUTHENTICATED_API opens them (Flower then even answers every origin). So refuse_cross_site."""
    options = handler.application.options
    if options.basic_auth or options.auth:
        return  # Flower's own check (and its users' credentials) apply
    refuse_cross_site(handler)


def refuse_cross_site(handler: BaseHandler) -> None:
    """Refuse (403) a request that says it comes from another site (cross_site_refusal)."""
    refusal = cross_site_refusal(handler)
    if refusal is not None:
        raise tornado.web.HTTPError(403, "%s", refusal)


def cross_site_refusal(handler: BaseHandler) -> str | None:
    """Why a request that says it comes from another site (Sec-Fetch-Site, Origin, else Referer) is refused; None for
    one of this Flower's pages and for a script's, which says nothing. With users it is Flower 2.2's own check
    (Sec-Fetch-Site, Origin), for a Flower before 2.2, which has none."""
    options = handler.application.options
    headers, host = handler.request.headers, handler.request.host
    site, origin, referer = headers.get("Sec-Fetch-Site"), headers.get("Origin"), headers.get("Referer")
    if site is not None and site != "same-origin":
        source = f"Sec-Fetch-Site {site}"
    elif origin is not None and urlparse(origin).netloc != host:
        source = f"Origin {origin}"
    elif origin is None and referer is not None and urlparse(referer).netloc != host:
        source = f"Referer {referer}"
    else:
        return None
    without_login = "" if options.basic_auth or options.auth else "Flower runs without login (--no-auth) and "
    return (
        f"cross-site request refused: {without_login}this request's {source[:200]} is not a page of this Flower "
        f"({host})"
    )
