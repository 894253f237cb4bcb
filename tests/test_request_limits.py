"""Hostile input through a real Serve app (CPU): limits before work, and a replica that keeps answering.

While 16 streams decode, a 64 MiB body gets 413 before it is read, a 10 MB single-word prompt gets 400
before it is tokenized, and a 15 MiB list of token ids (under the body limit: parsed, in the
preprocessing pool) gets 400 naming max_model_len; every stream completes, ``/health`` keeps
answering, and the figures are printed (``pytest -s``).

The app runs as ``graphfleet serve`` runs it, with its replica serving HTTP itself (Ray Serve's
direct ingress, ``serve.direct_ingress``). On this 2-core machine runs on 2026-12-02 measured:
the 64 MiB body's 413 in 4-10 ms, the 10 MB prompt's 400 in 71-121 ms (asserted under the issue's 1 s;
through Serve's proxy 147-423 ms, of which about 220 ms carried the body from the proxy to the
replica), ``/health`` at most 16-25 ms (asserted under the issue's 100 ms; through the proxy 65-183
ms), and every stream's longest gap in the hostile window 1.1-1.6x its median gap (asserted under 250 ms or the
issue's 2x). By 1070efd (2026-12-05) the 10 MB prompt's 400 had grown to 450-580 ms and ``/health`` to
45-215 ms, failing this test in three fresh-clone suites and alone: per body the replica's loop wrote two
fresh 10 MB regions (the chunks joined, then a new shared-memory segment), page by page, on a virtual
machine whose host backs memory as it is first touched. Read straight into a segment the replica keeps
(:mod:`deploy.shared_bodies`), three runs gave 67-80 ms, ``/health`` at most 8-20 ms and stream gaps
at most 0.9-1.7x their median. The streams ask for ``logprobs: 0``, so every token reaches them in a chunk: without it
a token whose text is held back (a split character, a skipped special token: the random-weight
model emits runs of 20-35 such) sends no chunk, and those runs, not the server, made the "12-15x"
this test printed before. Before the engine moved out of the replica: 0.58-0.95 s,
0.14-0.24 s, and single streams stalling 1-3 s. The old path (a 64 MiB body tokenized on the
replica's event loop) went 120 s without an answer and had the replica restarted.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest
import ray
from ray import serve

from tests.serve_harness import OVERRIDES, HealthPoller, host_port, start_local_serve
from tests.serve_harness import http as _http

STREAMS = 16
STREAM_TOKENS = 400
LIMIT = 16 * 1024 * 1024
#: Bounds asserted: the issue's goals (see the module docstring for the measured figures).
REFUSAL_BOUND_S = 1.0
HEALTH_BOUND_S = 0.1
GAP_BOUND = 2.0  # a stream's longest gap in the hostile window over its median gap
#: ... unless that gap is still under this: on a busy 2-core machine the OS alone gives every stream
#: one 80-96 ms hiccup now and then (2026-12-03: 2.07x and 3.38x at d6e3a5c, where the 2x came from),
#: while the failure this guards against, a body parsed or tokenized on the replica's loop, stalled
#: streams 1-3 s (and /health, bounded above, catches a blocked loop at 100 ms).
STALL_FLOOR_S = 0.25
#: Overrides of this app: 16 streams decode together (stream batching as by default: each stream's
#: interval follows the open streams, here 16 / 2000 s, so every step's tokens as they come).
APP_OVERRIDES = [*OVERRIDES, "scheduler.max_running_requests=16", "graphs.decode.max_batch_size=16",
                 "cache.num_pages=640"]


@pytest.fixture(scope="module")
def base(checkpoint_dir):
    url = start_local_serve({"model": str(checkpoint_dir("tiny-llama")), "overrides": APP_OVERRIDES,
                             "model_name": "tiny", "fleet": {"name": "lim"}}, "graphfleet-lim", direct_ingress=True)
    yield url
    serve.shutdown()
    ray.shutdown()


#: ``STREAMS`` streamed completions, read by one asyncio loop in a process of its own, so neither the
#: test's threads (the hostile bodies' senders) nor 16 reader threads queueing for one GIL delay the
#: stamp of a chunk. Prints "ready" once every stream has ``min_chunks`` chunks, then, when all end,
#: one JSON line per stream: ``{"times": [monotonic time of each chunk with new tokens], "tokens",
#: "finish"}``.
_READ_STREAMS = """
import asyncio, json, re, sys, time
host, port, n, max_tokens, min_chunks = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
pattern = re.compile(rb'"completion_tokens":\\s*(\\d+)')
results = [{"times": [], "tokens": 0, "finish": None, "status": None} for _ in range(n)]

async def read(i):
    r = results[i]
    body = json.dumps({"model": "tiny", "prompt": f"stream {i} of the fleet", "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True, "temperature": 0, "logprobs": 0,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\\r\\nHost: %s:%d\\r\\nContent-Type: application/json\\r\\n"
                 b"Content-Length: %d\\r\\nConnection: close\\r\\n\\r\\n%s" % (host.encode(), port, len(body), body))
    await writer.drain()
    r["status"] = int((await reader.readline()).split()[1])
    while True:  # SSE lines inside the chunked framing: the framing's size lines never start with "data:"
        line = await reader.readline()
        if not line:
            break
        if line.startswith(b"data: {"):
            tokens = int(pattern.search(line).group(1))
            if tokens > r["tokens"]:  # a chunk carries the tokens of up to one batching interval
                r["times"].append(time.monotonic())
                r["tokens"] = tokens
            if b'"finish_reason":"length"' in line.replace(b" ", b""):
                r["finish"] = "length"
    writer.close()

async def main():
    tasks = [asyncio.create_task(read(i)) for i in range(n)]
    while min(len(r["times"]) for r in results) < min_chunks and not all(t.done() for t in tasks):
        await asyncio.sleep(0.05)
    print("ready", flush=True)
    await asyncio.wait_for(asyncio.gather(*tasks), 240)

asyncio.run(main())
for r in results:
    print(json.dumps(r), flush=True)
"""


class _Streams:
    """:data:`_READ_STREAMS` in a process of its own: ``wait_ready()``, then ``results()``."""

    def __init__(self, base: str, min_chunks: int = 20) -> None:
        host, port = host_port(base)
        self.proc = subprocess.Popen([sys.executable, "-c", _READ_STREAMS, host, str(port), str(STREAMS),
                                      str(STREAM_TOKENS), str(min_chunks)], stdout=subprocess.PIPE, text=True)

    def wait_ready(self) -> None:
        assert self.proc.stdout.readline().strip() == "ready"

    def results(self) -> list[dict]:
        out, _ = self.proc.communicate(timeout=300)
        return [json.loads(line) for line in out.splitlines()]


def _raw_post(base: str, body: bytes | int, chunked: bool = False) -> tuple[int, dict, float]:
    """POST ``body`` (or that many spaces) on a raw socket, with a Content-Length or ``chunked`` in 1 MiB
    chunks, sending it on a thread while the answer is read (a server that answers before reading the
    body may reset the connection mid-send). Returns the status, the JSON body and the seconds from the
    first byte sent to the whole answer read."""
    size = body if isinstance(body, int) else len(body)
    sock = socket.create_connection(host_port(base), timeout=30)
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
    poller = HealthPoller(base)
    readers = _Streams(base)
    readers.wait_ready()

    window_start = time.monotonic()
    huge = _raw_post(base, 64 * 1024 * 1024)
    single_word = _timed_post(base, word)
    window_end = time.monotonic()
    many_ids = _timed_post(base, ids)
    ids_end = time.monotonic()
    healthy_after = _timed_post(base, json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode())

    streams = readers.results()
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

    assert [(s["status"], s["finish"], s["tokens"]) for s in streams] == [(200, "length", STREAM_TOKENS)] * STREAMS
    assert all(code == 200 for _, _, code in latencies)
    window = [lat for t, lat, _ in latencies if window_start <= t <= ids_end]
    outside = [lat for t, lat, _ in latencies if not window_start <= t <= ids_end]
    print("/health ms, in the window / outside: p50 {:.1f} / {:.1f}, max {:.1f} / {:.1f} ({} / {} answers)".format(
        *(1e3 * statistics.median(x) for x in (window, outside)), *(1e3 * max(x) for x in (window, outside)),
        len(window), len(outside)))
    ratios, longest = [], []
    for s in streams:
        gaps = [(a, b) for a, b in zip(s["times"], s["times"][1:])]
        median = statistics.median(b - a for a, b in gaps)
        during = [b - a for a, b in gaps if b >= window_start and a <= window_end]  # gaps the window overlaps
        ratios.append(max(during) / median)
        longest.append(max(during))
    print(f"stream gaps in the window over their median: max {max(ratios):.2f}, "
          f"median {statistics.median(ratios):.2f}; longest gap {1e3 * max(longest):.0f} ms "
          f"(median stream {1e3 * statistics.median(longest):.0f} ms)")
    assert max(window) < HEALTH_BOUND_S and max(outside) < HEALTH_BOUND_S
    assert all(r < GAP_BOUND or gap < STALL_FLOOR_S for r, gap in zip(ratios, longest, strict=True)), \
        list(zip(ratios, longest, strict=True))


@pytest.mark.timeout(120)
def test_a_chunked_body_is_counted_as_it_arrives(base):
    def body(size: int) -> bytes:
        head = b'{"model": "tiny", "prompt": "Hello", "max_tokens": 2, "pad": "'
        return head + b" " * (size - len(head) - 2) + b'"}'

    status, answer, seconds = _raw_post(base, body(LIMIT + (1 << 20)), chunked=True)
    assert status == 413 and answer["error"]["code"] == "request_too_large", answer
    status, answer, _ = _raw_post(base, body(1 << 20), chunked=True)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
