"""A cloud's instance metadata service on 127.0.0.1, for the spot-notice tests: it serves what a test puts in
``routes`` (the documented answers of Azure, AWS and GCP, or hostile ones), refuses a request without the
headers in ``required``, and records every request."""

from __future__ import annotations

import http.server
import sys
import threading

__all__ = ["MetadataServer"]


class MetadataServer(http.server.ThreadingHTTPServer):
    """Serves ``routes[(method, path)] -> (status, body, headers required)``; records what was asked."""

    daemon_threads = True

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], tuple[int, bytes | callable]] = {}
        self.required: dict[tuple[str, str], dict[str, str]] = {}
        self.asked: list[tuple[str, str, dict]] = []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> MetadataServer:
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()

    def handle_error(self, request, client_address) -> None:
        """A client hanging up mid-answer is what the slow-answer tests do; anything else is printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _serve(self) -> None:
        server: MetadataServer = self.server  # type: ignore[assignment]
        key = (self.command, self.path)
        server.asked.append((self.command, self.path, dict(self.headers)))
        want = server.required.get(key, {})
        if any(self.headers.get(k) != v for k, v in want.items()):
            self.send_response(401)
            self.end_headers()
            return
        status, body = server.routes.get(key, (404, b""))
        if callable(body):
            body(self)
            return
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = _serve
