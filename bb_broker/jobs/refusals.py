"""PublishRefused: what the broker's own checks raise when they refuse a publish."""

from __future__ import annotations

from typing import Any

from kombu.exceptions import EncodeError


class PublishRefused(EncodeError):
    """A publish the broker's own checks refuse (a malformed message, a unique option that makes no key, a message
    too large for its document): nothing was written, and the same message is refused whenever it is made again.

    A Kombu EncodeError, so that Celery's tracer records a callback or chain step refused after a task's body ran as
    that task's failure, as it does one it cannot encode, and the broker does not run the body again for it
    (bb_broker.worker.settle.is_retryable: an EncodeError is not retried)."""

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its class, arguments and fields, whatever its own __init__ takes: a refused retry's publish
        raises Reject(this) in a pool process, which sends it to the worker's main process; rebuilt there by calling
        its class with its message alone, a MalformedTaskMessage raised TypeError and ended the worker."""
        return (_rebuilt, (type(self), self.args, vars(self)))


def _rebuilt(kind: type[PublishRefused], args: tuple[Any, ...], fields: dict[str, Any]) -> PublishRefused:
    refused = kind.__new__(kind, *args)
    refused.args = args
    vars(refused).update(fields)
    return refused
