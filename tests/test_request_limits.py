"""Hostile input through a real Serve app (CPU): limits before work, and a replica that keeps answering.

While 16 streams decode, a 64 MiB body gets 413 before it is read, a 10 MB single-word prompt gets 400
before it is tokenized, and a 15 MiB list of token ids (under the body limit: parsed, in the
preprocessing pool) gets 400 naming max_model_len; every stream completes, ``/health`` keeps
answering, and the figures are printed (``pytest -s``).

The app runs as ``graphfleet serve`` runs it, with its replica serving HTTP itself (Ray Serve's
direct ingress, ``serve.direct_ingress``). On this 2-core machine three runs on 2026-12-02 measured:
the 64 MiB body's 413 in 6-7 ms, the 10 MB prompt's 400 in 71-83 ms (asserted under the issue's 1 s;
through Serve's proxy 147-423 ms, of which about 220 ms carried the body from the proxy to the
replica), ``/health`` at most 16-25 ms (asserted under the issue's 100 ms; through the proxy 65-183
ms), and stream gaps in the hostile window at most 12-15x their median for the worst stream but
1.4-2.0x for the median one (the goal is 2x; printed, not asserted: one or two of the 16 streams
still stall 190-240 ms while the two bodies are refused, on a machine whose two cores also run the
rank, the replica and this test). Before the engine moved out of the replica: 0.58-0.95 s,
0.14-0.24 s, and single streams stalling 1-3 s. The old path (a 64 MiB body tokenized on the
replica's event loop) went 120 s without an answer and had the replica restarted.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest
import ray
from ray import serve

from tests.serve_harness import OVERRIDES, start_local_serve
from tests.serve_harness import http as _http

STREAMS = 16
STREAM_TOKENS = 400
LIMIT = 16 * 1024 * 1024
#: Bounds asserted: the issue's goals (see the module docstring for the measured figures).
REFUSAL_BOUND_S = 1.0
HEALTH_BOUND_S = 0.1
#: Overrides of this app: 16 streams decode together (stream batching as by default: each stream's
#: interval follows the open streams, here 16 / 2000 s, so every step's tokens as they come).
APP_OVERRIDES = [*OVERRIDES, "scheduler.max_running_requests=16", "graphs.decode.max_batch_size=16",
                 "cache.num_pages=640"]
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


@pytest.fixture(scope="module")
def base(checkpoint_dir):
    url = start_local_serve({"model": str(checkpoint_dir("tiny-llama")), "overrides": APP_OVERRIDES,
                             "model_name": "tiny", "fleet": {"name": "lim"}}, "graphfleet-lim", direct_ingress=True)
    yield url
    serve.shutdown()
    ray.shutdown()


def _host_port(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").split(":")
    return host, int(port)


class _Stream(threading.Thread):
    """A streamed completion read on its own thread; ``times`` holds when each chunk with new tokens arrived,
    ``tokens`` how many tokens have arrived."""

    def __init__(self, base: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.base, self.prompt, self.times, self.tokens, self.finish = base, prompt, [], 0, None

    def run(self) -> None:
        conn = http.client.HTTPConnection(*_host_port(self.base), timeout=300)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": "tiny", "prompt": self.prompt, "max_tokens": STREAM_TOKENS, "stream": True, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        for line in resp:  # read cheaply: this process's CPU is the server's CPU on a small machine
            if line.startswith(b"data: {"):
                tokens = int(_COMPLETION_TOKENS.search(line).group(1))
                if tokens > self.tokens:  # a chunk carries the tokens of up to one batching interval
                    self.times.append(time.monotonic())
                    self.tokens = tokens
                if b'"finish_reason":"length"' in line.replace(b" ", b""):
                    self.finish = "length"
        conn.close()


#: GET /health every 20 ms on one kept-alive connection until stdin closes; one line per answer:
#: "<monotonic start> <seconds> <status>". A process of its own, so the test's own threads (16 stream
#: readers, a 64 MiB sender) cannot delay it.
_POLL = """
import http.client, sys, threading, time
host, port = sys.argv[1], int(sys.argv[2])
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
conn = http.client.HTTPConnection(host, port, timeout=30)
while not done.is_set():
    started = time.monotonic()
    conn.request("GET", "/health")
    resp = conn.getresponse()
    resp.read()
    print(started, time.monotonic() - started, resp.status, flush=True)
    time.sleep(0.02)
"""


class _HealthPoller:
    """Polls /health from a process of its own (:data:`_POLL`); ``stop()`` returns (when, seconds, status)s."""

    def __init__(self, base: str) -> None:
        host, port = _host_port(base)
        self.proc = subprocess.Popen([sys.executable, "-c", _POLL, host, str(port)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[tuple[float, float, int]]:
        out, _ = self.proc.communicate(input="", timeout=30)
        return [(float(a), float(b), int(c)) for a, b, c in (line.split() for line in out.splitlines())]


def _raw_post(base: str, body: bytes | int, chunked: bool = False) -> tuple[int, dict, float]:
    """POST ``body`` (or that many spaces) on a raw socket, with a Content-Length or ``chunked`` in 1 MiB
    chunks, sending it on a thread while the answer is read (a server that answers before reading the
    body may reset the connection mid-send). Returns the status, the JSON body and the seconds from the
    first byte sent to the whole answer read."""
    size = body if isinstance(body, int) else len(body)
    sock = socket.create_connection(_host_port(base), timeout=30)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {base.removeprefix('http://')}\r\n"
            f"Content-Type: application/json\r\n{framing}\r\nConnection: close\r\n\r\n").encode()
    started = time.monotonic()

    def send_body() -> None:
        try:
            sock.sendall(head)
            for at in range(0, size, 1 << 20):
                piece = b" " * min(1 << 20, size - at) if isinstance(body, int) else body[at:at + (1 << 20)]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # answered and closed before the body was sent

    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    answer = b""
    while True:
        try:
            part = sock.recv(65536)
        except ConnectionResetError:
            break
        if not part:
            break
        answer += part
        if b"\r\n\r\n" in answer:
            head_end = answer.index(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in answer[:head_end].split(b"\r\n")
                      if line.lower().startswith(b"content-length:")]
            if length and len(answer) >= head_end + 4 + length[0]:
                break
    elapsed = time.monotonic() - started
    sock.close()
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer[answer.index(b"\r\n\r\n") + 4:]), elapsed


def _timed_post(base: str, body: bytes) -> tuple[int, dict, float]:
    started = time.monotonic()
    status, answer, _ = _http("POST", f"{base}/v1/completions", body)
    return status, answer, time.monotonic() - started


@pytest.mark.timeout(300)
def test_hostile_bodies_are_refused_at_once_while_16_streams_run(base):
    word = json.dumps({"model": "tiny", "prompt": "x" * 10_000_000, "max_tokens": 4}).encode()
    ids = json.dumps({"model": "tiny", "prompt": [7] * 5_000_000, "max_tokens": 4}).encode()  # 15 MiB
    assert len(ids) < LIMIT
    poller = _HealthPoller(base)
    streams = [_Stream(base, f"stream {i} of the fleet") for i in range(STREAMS)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 120
    while min(len(s.times) for s in streams) < 20:
        assert time.monotonic() < deadline, [len(s.times) for s in streams]
        time.sleep(0.05)

    window_start = time.monotonic()
    huge = _raw_post(base, 64 * 1024 * 1024)
    single_word = _timed_post(base, word)
    window_end = time.monotonic()
    many_ids = _timed_post(base, ids)
    ids_end = time.monotonic()
    healthy_after = _timed_post(base, json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode())

    for s in streams:
        s.join(240)
    latencies = poller.stop()

    status, err, seconds = huge
    print(f"64 MiB body: {status} in {seconds * 1e3:.0f} ms; 10 MB word: {single_word[0]} in "
          f"{single_word[2] * 1e3:.0f} ms; 15 MiB of ids: {many_ids[0]} in {many_ids[2] * 1e3:.0f} ms")
    assert status == 413 and seconds < 1.0, huge
    assert err["error"]["code"] == "request_too_large" and f"at most {LIMIT} bytes" in err["error"]["message"]
    status, err, seconds = single_word
    assert status == 400 and seconds < REFUSAL_BOUND_S, single_word
    assert err["error"]["code"] == "context_length_exceeded" and err["error"]["param"] == "prompt[0]"
    assert "no token of this model stands for more than" in err["error"]["message"]
    status, err, seconds = many_ids
    assert status == 400 and "max_model_len" in err["error"]["message"], many_ids
    assert healthy_after[0] == 200 and healthy_after[1]["usage"]["completion_tokens"] == 2

    assert [(s.finish, s.tokens) for s in streams] == [("length", STREAM_TOKENS)] * STREAMS
    assert all(code == 200 for _, _, code in latencies)
    window = [lat for t, lat, _ in latencies if window_start <= t <= ids_end]
    outside = [lat for t, lat, _ in latencies if not window_start <= t <= ids_end]
    print("/health ms, in the window / outside: p50 {:.1f} / {:.1f}, max {:.1f} / {:.1f} ({} / {} answers)".format(
        *(1e3 * statistics.median(x) for x in (window, outside)), *(1e3 * max(x) for x in (window, outside)),
        len(window), len(outside)))
    ratios, longest = [], []
    for s in streams:
        gaps = [(a, b) for a, b in zip(s.times, s.times[1:])]
        median = statistics.median(b - a for a, b in gaps)
        during = [b - a for a, b in gaps if b >= window_start and a <= window_end]  # gaps the window overlaps
        ratios.append(max(during) / median)
        longest.append(max(during))
    print(f"stream gaps in the window over their median: max {max(ratios):.2f}, "
          f"median {statistics.median(ratios):.2f}; longest gap {1e3 * max(longest):.0f} ms "
          f"(median stream {1e3 * statistics.median(longest):.0f} ms)")
    assert max(window) < HEALTH_BOUND_S and max(outside) < HEALTH_BOUND_S


@pytest.mark.timeout(120)
def test_a_chunked_body_is_counted_as_it_arrives(base):
    def body(size: int) -> bytes:
        head = b'{"model": "tiny", "prompt": "Hello", "max_tokens": 2, "pad": "'
        return head + b" " * (size - len(head) - 2) + b'"}'

    status, answer, seconds = _raw_post(base, body(LIMIT + (1 << 20)), chunked=True)
    assert status == 413 and answer["error"]["code"] == "request_too_large", answer
    status, answer, _ = _raw_post(base, body(1 << 20), chunked=True)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
