"""`make conformance`: Kombu's and Celery's own integration suites against bbmongo:// (and Redis as the baseline)."""
