"""`python -m bb_broker.cli`: the `bb-broker` command."""

from bb_broker.cli.main import main

if __name__ == "__main__":  # not when a tool imports every module of the package
    main()
