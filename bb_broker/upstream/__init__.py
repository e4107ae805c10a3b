"""Every contact with an upstream package's internals, one module per upstream.

- `celery`: Celery's private names (patches of the worker's task run and of the censored settings, the result
  backend's chain and errback helpers, canvas classes, beat's solar and crontab fields, the state bb_broker keeps on
  a Celery app);
- `kombu`: Kombu's virtual transport and serializer registry internals;
- `billiard`: the prefork pool's queues;
- `flower`: Flower's handlers, URL table and templates, and the Tornado template loader under them;
- `pymongo`: pymongo's change-stream buffer.

Each function says what it changes or reads, why no public hook does it, and the releases it was checked against
(`CHECKED_AGAINST` in each module); `tests/unit/test_upstream_*.py` assert the shape each one relies on and fail,
naming the upstream change and the function here, when a release moves it. The rest of bb_broker calls these
functions and touches no private name of those packages itself. What a patch does for the broker (the decision, the
reason it records) is passed in by its caller: these modules know the upstream shapes, not the broker's rules.

Not here: the methods bb_broker.transport overrides on Kombu's virtual Channel, QoS and Transport (`_get`, `_put`,
`_size`, `_purge`, `_delete`, `_new_queue`, `_has_queue`, `_queue_bind`, `_lookup`, `_put_fanout`, `_deliver`):
underscored, but the interface Kombu's virtual transports are written against (its docstrings tell subclasses to
implement them). Their signatures are asserted by the contract tests all the same. Nor are Celery's BaseBackend
methods bb_broker.results implements (`_store_result`, `_get_task_meta_for`, `_forget`, the group ones), for the same
reason, nor the public registries bb_broker/__init__.py adds its names to (Kombu's TRANSPORT_ALIASES, Celery's
BACKEND_ALIASES).

The upstream packages are imported inside the functions: these modules are imported while `celery` and
`kombu.transport` themselves are (bb_broker registers its transport and hooks from their post-import hooks).
"""
