"""Trainer-side cost of CheckpointNotifier.notify(): what one call blocks the training loop for.

Three cases, each measured in this run against its own tiny HTTP server on 127.0.0.1 (no Prefect needed):
- up:        the server answers 204 (the Prefect events endpoint's answer);
- down:      nothing listens on the port (connection refused): the event is spooled to disk (fsync'd);
- blackhole: a socket that accepts connections but never answers: each call waits for the HTTP timeout.
Prints median and worst milliseconds per call, and the ratio down / up.

Usage: .venv/bin/python bench/bench_notify.py [--calls 50] [--blackhole-calls 5] [--timeout-s 0.5]
"""

from __future__ import annotations

import argparse
import logging
import socket
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evaldag.client import CheckpointNotifier  # noqa: E402


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server naming
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def _timed(notifier: CheckpointNotifier, calls: int, folder: Path) -> list[float]:
    ms = []
    for step in range(calls):
        t0 = time.perf_counter()
        notifier.notify(folder, step)
        ms.append((time.perf_counter() - t0) * 1000)
    return ms


def _line(name: str, ms: list[float]) -> str:
    return f"{name:<10} calls={len(ms):<3} median={statistics.median(ms):8.2f} ms   worst={max(ms):8.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--blackhole-calls", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=0.5, help="CheckpointNotifier timeout_s")
    args = ap.parse_args()
    logging.getLogger("evaldag.client.notifier").setLevel(logging.ERROR)      # the down cases warn on every call
    tmp = Path(tempfile.mkdtemp(prefix="bench-notify-"))
    folder = tmp / "checkpoint-1"
    folder.mkdir()

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    up = CheckpointNotifier("bench", api_url=f"http://127.0.0.1:{server.server_address[1]}/api",
                            spool_dir=tmp / "spool-up", timeout_s=args.timeout_s)
    up.notify(folder, 0)                                              # warm-up (imports, first connect)
    up_ms = _timed(up, args.calls, folder)
    server.shutdown()
    server.server_close()
    assert not up.pending(), "events were spooled while the server was up"

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    down = CheckpointNotifier("bench", api_url=f"http://127.0.0.1:{closed}/api", spool_dir=tmp / "spool-down",
                              timeout_s=args.timeout_s)
    down_ms = _timed(down, args.calls, folder)
    assert len(down.pending()) == args.calls

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)                                                   # never accept(): requests hang
    black = CheckpointNotifier("bench", api_url=f"http://127.0.0.1:{hole.getsockname()[1]}/api",
                               spool_dir=tmp / "spool-black", timeout_s=args.timeout_s)
    black_ms = _timed(black, args.blackhole_calls, folder)
    hole.close()

    print(f"notify() cost, timeout_s={args.timeout_s}, max_block_s={up.max_block_s}, retries={up.retries}")
    print(_line("up", up_ms))
    print(_line("down", down_ms) + "   (first call pays the retry cycle; later ones a single refused connect)")
    print(_line("blackhole", black_ms) + "   (bounded by timeout_s per attempt and max_block_s per call)")
    print(f"ratio down/up (median): {statistics.median(down_ms) / statistics.median(up_ms):.2f}")


if __name__ == "__main__":
    main()
