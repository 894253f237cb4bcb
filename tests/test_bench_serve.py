"""bench/serve.py attaches to any OpenAI-compatible server (``--url``): a peer whose ``/health`` answers
200 with an empty body (``vllm serve``) or plain text counts as healthy."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.serve import wait_healthy


def _server(answers: list[tuple[int, bytes]]):
    """A server on 127.0.0.1 whose ``/health`` gives ``answers`` in turn (the last one from then on)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            status, body = answers.pop(0) if len(answers) > 1 else answers[0]
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.mark.parametrize(("answers", "expected"), [
    ([(200, b"")], {}),  # vllm serve
    ([(200, b"OK")], {"body": "OK"}),
    ([(503, b'{"status": "starting"}'), (200, b'{"status": "ready"}')], {"status": "ready"}),  # ours
])
def test_wait_healthy_accepts_a_peer_servers_health(answers, expected):
    httpd, base = _server(list(answers))
    try:
        assert wait_healthy(base, timeout_s=10) == expected
    finally:
        httpd.shutdown()


def test_wait_healthy_gives_up_naming_the_last_answer():
    httpd, base = _server([(503, b'{"status": "starting"}')])
    try:
        with pytest.raises(SystemExit, match="not healthy after 1s: .*starting"):
            wait_healthy(base, timeout_s=1)
    finally:
        httpd.shutdown()
