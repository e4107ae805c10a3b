"""Celery's side of the worker: each job settled where its task's outcome is known."""
