"""A worker node's clock against its head's: `evaldag worker` refuses to join a head whose clock is far off.

A flow run's heartbeat event carries the time its node's clock gave it, and the head's lost-run automation
(evaldag.runtime.cluster.crash_automation) measures its window from that time on the head's clock. A node whose clock lags
the head's by a good part of the window gets its live runs crashed as lost, over and over (evaldag.runtime.liveness then
fences its shards and they are relaunched, to be crashed again). The head's clock is read from the HTTP Date header
of its Prefect API, which every answer carries (a 401 of an API behind auth as well).
"""

from __future__ import annotations

import time
from email.utils import parsedate_to_datetime

from evaldag.errors import StackError

# A lag of 20 s leaves 70 s of the default window (90 s; 40 s of the shortest, 60 s) for a heartbeat sent every 30 s
# to arrive; NTP keeps clocks within milliseconds, so a skew near this is a clock that is not synchronised at all.
MAX_CLOCK_SKEW_S = 20.0
MAX_CLOCK_SKEW_ENV = "EVALDAG_MAX_CLOCK_SKEW_S"   # `evaldag worker --max-clock-skew-s`


def clock_skew(api_url: str) -> tuple[float, float] | None:
    """How far this host's clock is ahead of the head's (negative: behind), in seconds, and the uncertainty of that
    figure, from the Date header of the head's `/health` answer; None when the head does not answer with one."""
    import httpx

    sent = time.time()
    try:
        r = httpx.get(f"{api_url}/health", timeout=10)
    except httpx.HTTPError:
        return None     # an unreachable head is named by cluster.fetch right after, with what to check
    received = time.time()
    try:
        head = parsedate_to_datetime(r.headers["Date"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None
    # a Date is whole seconds, rounded down: the head's time lies in [head, head + 1) at some moment of the round trip
    return (sent + received) / 2 - (head + 0.5), (received - sent) / 2 + 0.5


def check_clock(api_url: str, max_skew_s: float = MAX_CLOCK_SKEW_S) -> float | None:
    """This host's clock skew against the head at `api_url` (see `clock_skew`; None when it cannot be measured, or
    when `max_skew_s` is 0, which turns the check off); a StackError that names the skew and the fix when the skew is
    surely beyond `max_skew_s` (the measurement's uncertainty given to this host)."""
    if max_skew_s <= 0:
        return None
    measured = clock_skew(api_url)
    if measured is None:
        return None
    skew, uncertainty = measured
    if abs(skew) - uncertainty > max_skew_s:
        raise StackError(
            f"this host's clock is {abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} the head's ({api_url}, by "
            f"its HTTP Date header), more than {max_skew_s:g} s: the head judges its lost-run window from the times "
            "this node gives its heartbeats, so live shards here would be crashed as lost. Synchronise the clocks of "
            "this host and the head (chrony or NTP: `chronyc makestep` or `timedatectl set-ntp true`, then "
            "`chronyc tracking` to see it hold) and run the command again; the limit is --max-clock-skew-s "
            f"({MAX_CLOCK_SKEW_ENV}, default {MAX_CLOCK_SKEW_S:g} s)")
    return skew


__all__ = ["MAX_CLOCK_SKEW_ENV", "MAX_CLOCK_SKEW_S", "check_clock", "clock_skew"]
