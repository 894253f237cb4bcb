"""``graphfleet serve`` as a real subprocess (CPU): its own local Ray on a 2-core machine, and refusing an
unreachable Ray address in seconds.

Every test starts its own ``python -m deploy.cli serve`` with ``RAY_ADDRESS`` removed from its
environment (unless the test sets it), so it starts a Ray of its own and never joins another.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
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


# ----- our own Ray, or the given one: never a stale cluster -----

@pytest.mark.timeout(400)
def test_disaggregated_serve_on_its_own_ray_is_ready(serve):
    """On this 2-core machine the default disaggregated fleet (2 ranks) and the replica fit the Ray it starts."""
    s = serve("cluster.mode=disaggregated")
    ready_s = s.wait_ready()
    health = http("GET", f"{s.base}/health")[1]
    assert health["status"] == "ready" and len(health["groups"]) == 2 and health["waiting"] == {}, health
    assert re.search(r"started a local Ray \(GCS [0-9.]+:\d+\)", s.output())
    print(f"ready in {ready_s:.1f}s")


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
