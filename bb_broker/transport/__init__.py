"""Kombu's side: the `bbmongo://` transport, its wake-ups and the plumbing traffic apart from `jobs`."""
