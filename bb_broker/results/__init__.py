"""The `bbmongo://` result backend: a task's state and result on its own job document."""
