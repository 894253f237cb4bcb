"""``graphfleet serve`` as a real subprocess (CPU): its own local Ray on a 2-core machine, refusing an
unreachable Ray address in seconds, and its graceful drain on SIGTERM (real signals, real HTTP streams).

Every test starts its own ``python -m deploy.cli serve`` with ``RAY_ADDRESS`` removed from its
environment (unless the test sets it), so it starts a Ray of its own and never joins another.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.client import HTTPConnection
from pathlib import Path

import pytest

from tests.serve_harness import OVERRIDES, free_port, http

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    return free_port()


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _listener(port: int) -> str:
    """The command line of the process listening on 127.0.0.1:``port`` (from /proc), or ""."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN on the port
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return ""


class Serve:
    """A ``graphfleet serve`` subprocess on a free loopback port, its output in ``log``."""

    def __init__(self, model: Path, log: Path, *sets: str, args: tuple[str, ...] = (), env: dict | None = None):
        self.port, self.log = free_port(), log
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "deploy.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(self.port), *args, *[a for s in sets for a in ("--set", s)]]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env or _env(), cwd=REPO)

    def wait_ready(self, timeout_s: float = 240) -> float:
        """Seconds until ``GET /health`` answered 200 (fails if the process exits or time runs out)."""
        started, end = time.monotonic(), time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}:\n{self.output()[-3000:]}"
            try:
                if http("GET", f"{self.base}/health")[0] == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            assert time.monotonic() < end, f"serve not ready after {timeout_s}s:\n{self.output()[-3000:]}"
            time.sleep(0.5)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("tiny-llama")


@pytest.fixture
def serve(model, tmp_path):
    """``serve(*sets)`` -> a started :class:`Serve` (killed at the end of the test if still running)."""
    started: list[Serve] = []

    def start(*sets: str, **kw) -> Serve:
        started.append(Serve(model, tmp_path / f"serve{len(started)}.log", *OVERRIDES, *sets, **kw))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@dataclass
class Stream:
    """One streamed completion read on a thread: its chunks' finish reasons, error events, [DONE]."""

    port: int
    body: dict
    chunks: int = 0
    finish_reason: str | None = None
    errors: list[dict] = field(default_factory=list)
    done: bool = False
    ended_at: float | None = None
    failure: str | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        try:
            conn = HTTPConnection("127.0.0.1", self.port, timeout=120)
            conn.request("POST", "/v1/completions", json.dumps({**self.body, "stream": True}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, (resp.status, resp.read())
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    self.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    self.errors.append(event["error"])
                    continue
                self.chunks += 1
                self.finish_reason = event["choices"][0]["finish_reason"] or self.finish_reason
        except Exception as e:  # noqa: BLE001 (the test asserts on it)
            self.failure = f"{type(e).__name__}: {e}"
        finally:
            self.ended_at = time.monotonic()


def _first_chunks(streams: list[Stream]) -> None:
    _wait(lambda: all(st.chunks >= 1 for st in streams) or any(st.failure for st in streams), 120,
          "every stream's first chunk")
    assert not [st.failure for st in streams if st.failure], streams


def _wait(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.05)


def _max_tokens(base: str) -> int:
    return http("GET", f"{base}/v1/models")[1]["data"][0]["max_model_len"] - 8


def _sigterm_and_wait(s: Serve, within_s: float, after_signal=None) -> tuple[float, set[int]]:
    """SIGTERM the serve process (then call ``after_signal()``); (seconds until it exited, the
    processes it had started)."""
    ours = _descendants(s.proc.pid)
    assert any("raylet" in Path(f"/proc/{p}/comm").read_text() for p in ours if _alive(p)), "no raylet of ours"
    sent = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    if after_signal is not None:
        after_signal()
    try:
        s.proc.wait(within_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve did not exit within {within_s}s of SIGTERM:\n{s.output()[-4000:]}")
    return time.monotonic() - sent, ours


def _assert_ray_gone(ours: set[int]) -> None:
    _wait(lambda: not [p for p in ours if _alive(p)], 20, "every Ray process of the serve to exit")


# ----- our own Ray, or the given one: never a stale cluster -----

@pytest.mark.timeout(400)
def test_disaggregated_serve_on_its_own_ray_is_ready_then_drains_8_streams_on_sigterm(serve):
    """On this 2-core machine the default disaggregated fleet (2 ranks) and the replica fit the Ray it
    starts; SIGTERM lets 8 open streams finish (less work than the 30 s drain timeout), answers a new
    request with 503 and Retry-After meanwhile, releases everything and exits 0."""
    s = serve("cluster.mode=disaggregated", "scheduler.max_running_requests=8")
    ready_s = s.wait_ready()
    health = http("GET", f"{s.base}/health")[1]
    assert health["status"] == "ready" and len(health["groups"]) == 2 and health["waiting"] == {}, health
    assert re.search(r"started a local Ray \(GCS [0-9.]+:\d+\)", s.output())
    # serve.direct_ingress (default): the API replica itself listens on the port, not Serve's proxy.
    assert "ServeReplica" in _listener(s.port), _listener(s.port)

    streams = [Stream(s.port, {"prompt": f"Stream {i} sails at dawn", "max_tokens": 160, "ignore_eos": True}).start()
               for i in range(8)]
    _first_chunks(streams)
    assert not any(st.done for st in streams), "the streams ended before the drain: make them longer"
    refused: list = []

    def request_during_drain():
        try:
            while not refused and not all(st.done for st in streams):
                status, body, headers = http("POST", f"{s.base}/v1/completions", {"prompt": "Hi", "max_tokens": 1})
                if status == 503:
                    refused.append((status, body, headers, sum(not st.done for st in streams)))
                time.sleep(0.1)
        except OSError:  # the server is gone: the assertions below say what was seen
            pass

    prober = threading.Thread(target=request_during_drain, daemon=True)
    elapsed, ours = _sigterm_and_wait(s, 30 + 10, prober.start)
    prober.join(5)
    assert s.proc.returncode == 0, s.output()[-4000:]
    for st in streams:
        st.thread.join(10)
        assert st.failure is None and st.done and st.errors == [], (st, s.output()[-3000:])
        assert st.finish_reason in ("length", "stop"), st
    assert refused, "no request was refused during the drain"
    status, body, headers, open_streams = refused[0]
    assert open_streams > 0, "the 503 came after every stream had ended: not during the drain"
    assert headers.get("retry-after") == "1" and body["error"]["code"] == "draining"
    assert "draining" in body["error"]["message"] and body["error"]["type"] == "service_unavailable"
    _assert_ray_gone(ours)
    out = s.output()
    drained = re.search(r"drained: \{'finished': (\d+), 'aborted': (\d+)", out)
    assert "SIGTERM: draining" in out and drained, out[-3000:]
    assert int(drained.group(1)) >= 8 and drained.group(2) == "0", drained.group(0)  # + probes let in before it
    print(f"ready in {ready_s:.1f}s; exited {elapsed:.1f}s after SIGTERM")


@pytest.mark.timeout(300)
def test_a_drain_timeout_shorter_than_the_streams_aborts_them_with_an_error_and_exits_0(serve):
    s = serve("serve.drain_timeout_s=2")
    s.wait_ready()
    max_tokens = _max_tokens(s.base)
    streams = [Stream(s.port, {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}).start()
               for _ in range(2)]
    _first_chunks(streams)
    elapsed, ours = _sigterm_and_wait(s, 2 + 10)
    assert s.proc.returncode == 0, s.output()[-4000:]
    for st in streams:
        st.thread.join(10)
        assert st.failure is None and st.done and st.finish_reason == "abort", st
        [error] = st.errors
        assert error["code"] == "draining" and error["type"] == "service_unavailable", error
        assert error["message"] == ("request aborted: the server is shutting down: the request did not finish "
                                    "within the drain timeout (2s)")
    _assert_ray_gone(ours)
    assert "'finished': 0, 'aborted': 2" in s.output()
    print(f"exited {elapsed:.1f}s after SIGTERM (drain timeout 2s)")


@pytest.mark.timeout(300)
def test_graphfleet_drain_drains_a_running_app_as_the_charts_prestop_does(serve, tmp_path):
    """``graphfleet drain`` (the head pod's preStop) reaches the replica through Ray: the stream open
    finishes, the app then refuses requests, and the serve process still exits 0 on SIGTERM."""
    # The stream must still be open when the drain (a process that imports Ray and joins the cluster
    # first, seconds on 2 cores) reaches the replica, and finish within the drain timeout.
    s = serve("serve.drain_timeout_s=90")
    s.wait_ready()
    gcs = re.search(r"started a local Ray \(GCS ([0-9.]+:\d+)\)", s.output()).group(1)
    stream = Stream(s.port, {"prompt": "Hello", "max_tokens": 600, "ignore_eos": True}).start()
    _first_chunks([stream])
    # The local Ray uses token authentication; Ray sends the token to an address given explicitly only when
    # told to (as a pod of a cluster with authOptions is).
    drain = subprocess.run([sys.executable, "-m", "deploy.cli", "drain", "--ray-address", gcs, "--wait-s", "150"],
                           capture_output=True, text=True, env=_env(RAY_AUTH_MODE="token"), cwd=REPO, timeout=200)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    report = json.loads(drain.stdout.strip().splitlines()[-1])
    assert (report["finished"], report["aborted"], report["flushed"]) == (1, 0, True), report
    stream.thread.join(10)
    assert stream.done and stream.finish_reason == "length" and stream.errors == [], stream
    status, body, headers = http("POST", f"{s.base}/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert status == 503 and headers.get("retry-after") == "1" and body["error"]["code"] == "draining", body
    status, body, _ = http("GET", f"{s.base}/health")
    assert status == 503 and body["status"] == "stopped", body
    elapsed, ours = _sigterm_and_wait(s, 90 + 10)
    assert s.proc.returncode == 0, s.output()[-4000:]
    _assert_ray_gone(ours)


@pytest.mark.timeout(200)
def test_sigterm_while_a_group_waits_for_resources_cancels_the_start_and_exits_0(serve):
    """A rank asking for more CPUs than this machine has: /health says what it waits for within 10 s of the
    app answering, and SIGTERM ends the wait (no start timeout to sit out) with exit 0."""
    s = serve("cluster.cpus_per_rank=64")
    end = time.monotonic() + 180
    while _health_status(s.base) != 503:  # nothing listens yet, then Serve's 404 before the route
        assert time.monotonic() < end and s.proc.poll() is None, s.output()[-3000:]
        time.sleep(0.2)
    answered = time.monotonic()
    while not (body := http("GET", f"{s.base}/health")[1])["waiting"]:
        assert time.monotonic() - answered < 10, body
        time.sleep(0.2)
    waiting = body["waiting"][next(iter(body["waiting"]))]
    assert waiting["asked"] == {"bundle": {"CPU": 64.0}, "count": 1} and waiting["available"]["CPU"] < 64
    elapsed, ours = _sigterm_and_wait(s, 30)
    assert s.proc.returncode == 0, s.output()[-4000:]
    _assert_ray_gone(ours)
    print(f"waiting reported {time.monotonic() - answered - elapsed:.1f}s after /health answered; "
          f"exited {elapsed:.1f}s after SIGTERM")


def _health_status(base: str) -> int | None:
    try:
        return http("GET", f"{base}/health")[0]
    except OSError:
        return None


def test_a_ray_address_that_is_no_host_port_is_refused_naming_it(model, tmp_path):
    s = Serve(model, tmp_path / "serve.log", *OVERRIDES, args=("--ray-address", "gcs-without-port"))
    assert s.proc.wait(30) != 0
    assert "Ray address 'gcs-without-port' is not HOST:PORT" in s.output(), s.output()[-3000:]


@pytest.mark.parametrize("how", ["--ray-address", "RAY_ADDRESS"])
def test_an_unreachable_ray_address_fails_in_seconds_naming_it(model, tmp_path, how):
    address = f"127.0.0.1:{_closed_port()}"
    with socket.socket() as probe:  # nothing listens there
        assert probe.connect_ex(("127.0.0.1", int(address.split(":")[1]))) != 0
    args = ("--ray-address", address) if how == "--ray-address" else ()
    env = _env(RAY_ADDRESS=address) if how == "RAY_ADDRESS" else _env()
    s = Serve(model, tmp_path / "serve.log", *OVERRIDES, args=args, env=env)
    started = time.monotonic()
    try:
        s.proc.wait(30)
    except subprocess.TimeoutExpired:
        s.stop()
        pytest.fail(f"serve with an unreachable Ray at {address} still runs after 30s:\n{s.output()[-3000:]}")
    took = time.monotonic() - started
    assert s.proc.returncode != 0
    assert f"cannot reach the Ray cluster at {address}" in s.output(), s.output()[-3000:]
    print(f"{how}: exited {s.proc.returncode} after {took:.1f}s")
