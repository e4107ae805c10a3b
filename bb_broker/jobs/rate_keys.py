"""Rate keys: in a queue whose rate is per key (`bb-broker limit mail --rate "10/m per key"`), the jobs of each key
start at most at that rate, whatever the other keys do (the mail of one customer, say).

A task message whose header RATE_KEY_HEADER holds a key becomes a job with that key in `rateKey`; the task options
`rate_key` (the key) and `rate_on` (the arguments the key is made of), on the task or on `apply_async`, set it, as
serial.py's options set a serial key. The jobs without a key count as one more key of their own. Each key has its own
counter in bb_rates, taken as a queue's is (RateCounters.take_start); a claim reads the head of the queue to learn whose
start to take, and a consumer keeps the keys whose next start is ahead (RateHolds) out of its claims until then, so a
busy key never holds back the keys behind it, and nothing polls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bb_broker.jobs.queues import Rate

#: The header of a task message that carries its job's rate key.
RATE_KEY_HEADER = "bb_rate_key"
#: The longest key (it is part of its counter's _id).
MAX_RATE_KEY_LENGTH = 512
#: The options, as task attributes (`@app.task(rate_on=("customer_id",))`) and as `apply_async` keyword arguments;
#: a call's own override the task's.
OPTION_NAMES = ("rate_key", "rate_on")


def is_rate_key(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_RATE_KEY_LENGTH


def counted_key(value: Any) -> str | None:
    """The key a job's `rateKey` is counted under: None, the jobs without a key, for one that is not a string (a hand
    edit: the claim's filter of the held keys tells strings apart from the rest, see RateHolds.due). A string no
    publish writes never gets here: its job fails at its claim (bad_rate_key)."""
    return value if isinstance(value, str) else None


def bad_rate_key(value: Any) -> str | None:
    """Why a job's `rateKey` string is none a claim counts (None when it is one, or is no string at all): a key
    longer than a publish writes is a hand edit, which would become its counter's _id and be sent in every later
    claim's filter while it is held, whatever its size."""
    if isinstance(value, str) and not is_rate_key(value):
        return f"rateKey must be a string of 1 to {MAX_RATE_KEY_LENGTH} characters, not a string of {len(value)}"
    return None


#: The most held keys a claim leaves out by name (the soonest to come back are left to be refused again): the
#: claim's filter must stay far below the server's 16 MB command.
MAX_HELD_KEYS = 1000


@dataclass
class RateHolds:
    """The rate keys of one queue whose next start is ahead, as one consumer last found them: key -> that moment, in
    microseconds of the server's time (None: the jobs without a key). The consumer keeps one per queue and passes it
    to each claim, which forgets the keys whose moment has come and adds those it finds held; valid for `rate` only
    (a rate changed starts counters of its own)."""

    rate: Rate
    until: dict[str | None, int] = field(default_factory=dict)

    def due(self, now_us: int) -> dict[str, Any] | None:
        """The claim filter's condition on `rateKey` that leaves out the held keys (None: none is held)."""
        self.until = {key: moment for key, moment in self.until.items() if moment > now_us}
        if not self.until:
            return None
        latest = sorted(self.until, key=lambda key: self.until[key], reverse=True)[:MAX_HELD_KEYS]
        keys = sorted(key for key in latest if key is not None)
        if None in latest:
            # The jobs counted without a key are those whose rateKey is missing or not a string: only strings remain
            # (`$type` alone would keep an array that holds one).
            return {"$type": "string", "$not": {"$type": "array"}, "$nin": keys}
        return {"$nin": keys}

    def retry_in(self, now_us: int) -> float | None:
        """Seconds until the first held key's next start (None: no key is held)."""
        return (min(self.until.values()) - now_us) / 1_000_000 if self.until else None
