"""The operator's side: queries and actions, the `bb-broker` command, doctor, metrics."""
