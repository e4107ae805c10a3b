"""The before_task_publish receiver: a publish's flow-control options (unique, serial, rate and fair keys) as its
message's headers, read by the transport."""

from __future__ import annotations

from typing import Any

from celery import signals

from bb_broker.jobs import fair_keys, rate_keys, serial, unique
from bb_broker.upstream import celery as upstream_celery


@signals.before_task_publish.connect
def _flow_control_headers(
    sender: Any = None, body: Any = None, headers: Any = None, properties: Any = None, **_: Any
) -> None:
    """The unique, serial, rate and fair key options of a publish (the call's, from apply_async's keywords, which
    Celery puts in the message's properties; the task's attributes under them) as the message's headers
    (bb_broker.jobs.unique, bb_broker.jobs.serial, bb_broker.jobs.rate_keys and bb_broker.jobs.fair_keys)."""
    if not isinstance(headers, dict) or not isinstance(properties, dict):
        return
    options = (*unique.OPTION_NAMES, *serial.OPTION_NAMES, *rate_keys.OPTION_NAMES, *fair_keys.OPTION_NAMES)
    call = {name: properties.pop(name) for name in options if name in properties}
    task = upstream_celery.registered_task(sender) if isinstance(sender, str) else None
    if isinstance(body, (list, tuple)) and len(body) >= 2:  # Celery's protocol 2: (args, kwargs, embed)
        args, kwargs = body[0], body[1]
    else:  # protocol 1: a dict
        args, kwargs = (body.get("args"), body.get("kwargs")) if isinstance(body, dict) else ((), {})
    args, kwargs, run = args or (), kwargs or {}, getattr(task, "run", None)
    if fair_keys.FAIR_KEY_HEADER not in headers and isinstance(args, (list, tuple)) and isinstance(kwargs, dict):
        # A scheduling hint: options that make no key are logged, and the task is published without one.
        fair_key = fair_keys.publish_fair_key(task, call, str(sender), args, kwargs, run)
        if fair_key is not None:
            headers[fair_keys.FAIR_KEY_HEADER] = fair_key
    try:
        # A header already there is a retry's (its message carries the request's headers), a beat's slot, or set
        # by hand: kept as it is.
        if unique.UNIQUE_KEY_HEADER not in headers:
            headers.update(unique.UniqueOptions.read(task, call).headers(str(sender), args, kwargs, run))
        for header, option, longest in (
            (serial.SERIAL_KEY_HEADER, "serial", serial.MAX_SERIAL_KEY_LENGTH),
            (rate_keys.RATE_KEY_HEADER, "rate", rate_keys.MAX_RATE_KEY_LENGTH),
        ):
            if header not in headers:
                key = unique.option_key(option, task, call, str(sender), args, kwargs, run, max_length=longest)
                if key is not None:
                    headers[header] = key
    except unique.UniqueOptionError as exc:
        # Celery's signals swallow what a receiver raises: the transport raises it, writing nothing.
        headers[unique.UNIQUE_REFUSED_HEADER] = str(exc)
