"""Celery's side of the worker: each job settled where its task's outcome is known (settle.py), by the task signals
(receivers.py), the worker's start and stop (startup.py) and the publish headers (publish_headers.py), whose
receivers connect as they are imported."""

from bb_broker.worker import publish_headers, receivers, startup

__all__ = ["publish_headers", "receivers", "startup"]
