"""A stand-in for Prefect's events endpoint (POST /api/events), for the tests of the trainers' client and of the
example trainer: it records what is posted and answers scripted statuses, optionally late."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeEventsServer:
    """Records POST bodies; answers statuses from `script` (then `default`), optionally after a delay.

    `requests` records every request, of any method, as (method, path, Authorization header or None); a 3xx answer
    carries `location` as its Location header; a GET is answered 200, as a login page would be.
    """

    def __init__(self) -> None:
        self.received: list[tuple[str, list]] = []
        self.requests: list[tuple[str, str, str | None]] = []
        self.location: str | None = None
        self.script: list[int] = []
        self.default = 204
        self.delay_s = 0.0
        self.release = threading.Event()          # set at teardown to cut delays short
        self.port: int | None = None
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ids(self) -> list[str]:
        return [body[0]["id"] for _, body in self.received]

    def events(self) -> list[dict]:
        """Every event POSTed to /api/events so far, in order."""
        return [event for path, body in self.received if path == "/api/events" for event in body]

    def start(self, port: int = 0) -> "FakeEventsServer":
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server naming
                owner.requests.append(("POST", self.path, self.headers.get("Authorization")))
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if owner.delay_s:
                    owner.release.wait(owner.delay_s)
                owner.received.append((self.path, body))
                self._answer(owner.script.pop(0) if owner.script else owner.default)

            def do_GET(self):  # noqa: N802 - http.server naming
                owner.requests.append(("GET", self.path, self.headers.get("Authorization")))
                self._answer(200)

            def _answer(self, status: int) -> None:
                payload = b"" if status == 204 else json.dumps({"detail": f"status {status}"}).encode()
                try:
                    self.send_response(status)
                    if 300 <= status < 400 and owner.location:
                        self.send_header("Location", owner.location)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass                      # the client timed out first (the slow-server test)

            def log_message(self, *args):
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        # A short poll interval makes stop() quick (shutdown() waits for the next poll).
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening: connections to the port are then refused."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
