"""`python -m bb_broker.cli`: the `bb-broker` command without its console script."""

from bb_broker.cli import main

main()
