"""evaldag.runtime.node_clock with a fake head: a worker node reads the head's clock from its HTTP Date header and
`evaldag worker` refuses to join beyond the limit, naming the skew and the fix."""

from __future__ import annotations

import time
from email.utils import formatdate

import httpx
import pytest
from typer.testing import CliRunner

from evaldag.runtime import node_clock
from evaldag.cli import app
from evaldag.errors import StackError
from evaldag.runtime.stack import Stack


def _head_answering(monkeypatch, clock_offset_s: float | None, status: int = 200) -> list[str]:
    """A fake head whose /health answers with an HTTP Date `clock_offset_s` seconds from this host's clock (no Date
    header for None); returns the URLs asked."""
    asked = []

    def get(url, **kw):
        asked.append(url)
        headers = {} if clock_offset_s is None else {"Date": formatdate(time.time() + clock_offset_s, usegmt=True)}
        return httpx.Response(status, headers=headers, json=True, request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", get)
    return asked


def test_clock_skew_is_read_from_the_heads_date_header(monkeypatch):
    asked = _head_answering(monkeypatch, -45)
    skew, uncertainty = node_clock.clock_skew("http://head:4200/api")
    assert asked == ["http://head:4200/api/health"]
    assert 43 <= skew <= 47 and uncertainty < 2                  # this host is 45 s ahead of the head
    _head_answering(monkeypatch, -45, status=401)                # an API behind auth dates its refusal too
    assert 43 <= node_clock.clock_skew("http://head:4200/api")[0] <= 47
    _head_answering(monkeypatch, None)
    assert node_clock.clock_skew("http://head:4200/api") is None    # nothing to compare with: no refusal on a guess

    def unreachable(url, **kw):
        raise httpx.ConnectError("connection refused")

    monkeypatch.setattr(httpx, "get", unreachable)
    assert node_clock.clock_skew("http://head:4200/api") is None    # cluster.fetch names an unreachable head


def test_check_clock_refuses_beyond_the_limit_with_the_fix(monkeypatch):
    _head_answering(monkeypatch, 45)                             # the head is 45 s ahead: this node lags
    with pytest.raises(StackError) as err:
        node_clock.check_clock("http://head:4200/api")
    message = str(err.value)
    assert "behind" in message and "4" in message and "chrony" in message and "NTP" in message
    assert "--max-clock-skew-s" in message and str(int(node_clock.MAX_CLOCK_SKEW_S)) in message
    _head_answering(monkeypatch, -45)
    with pytest.raises(StackError, match="ahead"):
        node_clock.check_clock("http://head:4200/api")
    _head_answering(monkeypatch, 5)
    assert 3 <= -node_clock.check_clock("http://head:4200/api") <= 7   # within the limit: the skew is returned
    _head_answering(monkeypatch, 45)
    assert node_clock.check_clock("http://head:4200/api", max_skew_s=60) is not None
    assert node_clock.check_clock("http://head:4200/api", max_skew_s=0) is None     # 0 turns the check off


def test_evaldag_worker_refuses_to_join_a_head_whose_clock_is_far_off(tmp_path, monkeypatch):
    started = []

    def up(self, **kw):
        started.append(self.settings.server)
        raise StackError("stack.up reached")

    monkeypatch.setattr(Stack, "up", up)
    monkeypatch.setenv("EVALDAG_HOME", str(tmp_path))
    monkeypatch.delenv("EVALDAG_MAX_CLOCK_SKEW_S", raising=False)
    asked = _head_answering(monkeypatch, 45)
    result = CliRunner().invoke(app, ["worker", "--server", "http://head:4200/api"])
    assert result.exit_code == 1 and started == [] and asked == ["http://head:4200/api/health"]
    assert "behind" in result.output and "chrony" in result.output
    # in sync: the node goes on to start its workers
    _head_answering(monkeypatch, 1)
    result = CliRunner().invoke(app, ["worker", "--server", "http://head:4200"])
    assert "stack.up reached" in result.output and started
    # the limit is a setting: the command line, or EVALDAG_MAX_CLOCK_SKEW_S
    _head_answering(monkeypatch, 45)
    result = CliRunner().invoke(app, ["worker", "--server", "http://head:4200", "--max-clock-skew-s", "60"])
    assert "stack.up reached" in result.output
    monkeypatch.setenv("EVALDAG_MAX_CLOCK_SKEW_S", "60")
    result = CliRunner().invoke(app, ["worker", "--server", "http://head:4200"])
    assert "stack.up reached" in result.output
