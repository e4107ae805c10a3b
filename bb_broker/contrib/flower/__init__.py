"""Flower for `bbmongo://`: the Broker tab's queue depths, the Jobs tab and its JSON API, Flower's own actions guarded.

`import bb_broker.contrib.flower` in the `flowerconfig.py` Flower reads (`bb-broker flower` does it for you).
"""

from bb_broker.contrib.flower import plugin

plugin.install()
