"""What the benchmarks share: `import _common` (bench/ is on sys.path when a benchmark runs as a script) puts the
project on sys.path and points EVALDAG_DATA_DIR at the benchmark data mirror beside the project, unless set."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("EVALDAG_DATA_DIR", str(REPO.parent / "shared" / "data"))


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports on 127.0.0.1 that were free a moment ago (all bound at once, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
