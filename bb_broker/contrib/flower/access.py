"""Who may act in the Jobs and Schedules tabs and through Flower's own actions.

Flower's `--read_only` stops every action; `--jobs_admins=alice,bob` (or FLOWER_JOBS_ADMINS) lets only those users
act (basic-auth user names or OAuth e-mail addresses); everyone else reads, and gets a 403 to act. Without a login
(--no-auth), a request that says it comes from another site is refused.
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


def refuse_cross_site_without_login(handler: BaseHandler) -> None:
    """Flower checks where a request that changes something comes from only when it has users. Without (--no-auth),
    a page of another site open in the operator's browser could post to it: to the Jobs tab's API and Flower's own
    when FLOWER_UNAUTHENTICATED_API opens them (Flower then even answers every origin). So a request that says it
    comes from another site (Sec-Fetch-Site, Origin, else Referer) is refused; a script's, which says nothing, is not.
    """
    options = handler.application.options
    if options.basic_auth or options.auth:
        return  # Flower's own check (and its users' credentials) apply
    headers, host = handler.request.headers, handler.request.host
    site, origin, referer = headers.get("Sec-Fetch-Site"), headers.get("Origin"), headers.get("Referer")
    if site is not None and site != "same-origin":
        source = f"Sec-Fetch-Site {site}"
    elif origin is not None and urlparse(origin).netloc != host:
        source = f"Origin {origin}"
    elif origin is None and referer is not None and urlparse(referer).netloc != host:
        source = f"Referer {referer}"
    else:
        return
    raise tornado.web.HTTPError(
        403,
        "%s",
        f"cross-site request refused: Flower runs without login (--no-auth) and this request's {source[:200]} is not "
        f"a page of this Flower ({host})",
    )
