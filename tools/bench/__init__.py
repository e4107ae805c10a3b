"""`make bench`: bbmongo:// against Kombu's mongodb:// and Redis, measured side by side in one run."""
