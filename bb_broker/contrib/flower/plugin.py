"""The Flower plugin's one entry: `install()` makes every patch of Flower's the Broker tab, the broker banner, the
Jobs and Schedules tabs and the host check need (each patch in bb_broker.upstream.flower, each rule it applies in the
module named for it); importing bb_broker.contrib.flower calls it.

When Flower imports its Celery app's modules as it starts, `_watch_flowers_broker` starts the broker's health check
and, unless Flower is read-only, its share of the charts' summaries.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from celery import Celery, signals
from tornado.options import options as tornado_options

from bb_broker.contrib.flower import (
    access,
    broker,
    flowers_actions,
    handlers,
    health,
    hosts,
    progress,
    rerun,
    schedules_tab,
    steering,
    tab,
    templates,
)
from bb_broker.upstream import flower as upstream_flower

logger = logging.getLogger(__name__)

#: Every handler the plugin adds to Flower's app: the Jobs tab's, its progress, rerun and canvas steering, the
#: Schedules tab's (each guards its own actions; tests/unit/test_upstream_flower.py checks every other one that acts).
OUR_HANDLERS = handlers.HANDLERS + progress.HANDLERS + rerun.HANDLERS + steering.HANDLERS + schedules_tab.HANDLERS


def install() -> None:
    """Make Flower's Broker factory answer `bbmongo://` URLs with `JobQueues`, its pages show the broker's error, and
    add the Jobs and Schedules tabs; calling it again changes nothing."""
    hosts.define_options()
    upstream_flower.install_host_check(hosts.refusal_for)
    upstream_flower.install_template_loader(templates.template_source)
    upstream_flower.install_workers_refresh_check(health.fail_workers_refresh_while_broker_fails)
    upstream_flower.install_cross_site_check(access.refuse_cross_site_without_login)
    tab.define_options()
    upstream_flower.guard_prepares(
        flowers_actions.flowers_actions(upstream_flower.url_table()),
        flowers_actions.refuse_flowers_action_unless_allowed,
    )
    upstream_flower.install_handlers(OUR_HANDLERS, "jobs")
    upstream_flower.install_broker_factory(health.is_ours, broker.JobQueues)


@signals.import_modules.connect
def _watch_flowers_broker(sender: Celery | None = None, **_: Any) -> None:
    # Flower imports its app's modules as it starts: the check starts then, not at the first page.
    if sender is None:
        return
    with sender.connection() as conn:
        broker_url = conn.as_uri(include_password=True)
    if health.is_ours(broker_url):
        health.BrokerHealth.of(broker_url)
        if not upstream_flower.workers_refresh_shows_failures():
            logger.warning("this Flower's Workers page does not show a failed refresh (Flower 2.1 and later do)")
        if "--read_only" in sys.argv and "read_only" not in tornado_options:
            # Flower 2.0 has no read-only mode and drops the option unsaid: every user may act, in any tab.
            logger.warning("this Flower has no --read_only (Flower 2.1 and later have): it is ignored, users may act")
        if not getattr(tornado_options, "read_only", False):  # Flower's options are parsed by now
            tab.start_chart_summaries(sender, broker_url)
