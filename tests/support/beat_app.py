"""The Celery app the beat tests run `celery beat` with: e2e_app.py's tasks, entries from BB_BEAT_SCHEDULE."""

from __future__ import annotations

import json
import os

from tests.support.e2e_app import app

#: {name: {"task": ..., "schedule": seconds, "catch_up": ...}}: what a test configures for its beats.
app.conf.beat_schedule = json.loads(os.environ.get("BB_BEAT_SCHEDULE", "{}"))
app.conf.beat_scheduler = "bb_broker.beat:JobScheduler"
app.conf.bb_beat_missed_after = float(os.environ.get("BB_BEAT_MISSED_AFTER", "10"))
