"""The report link between a group's leader and the fleet: real TCP on 127.0.0.1, no Ray."""

from __future__ import annotations

import pickle
import queue
import socket
import threading
import time

import pytest

from cluster.group_messages import EngineLoad, GroupReport
from cluster.report_link import HEARTBEAT_S, MAX_FRAME_BYTES, LinkAddress, LinkClosed, ReportReader, ReportServer
from worker.outputs import RequestEvent


class Leader:
    """A stand-in for EngineHost's two calls the server makes: reports come from a queue."""

    def __init__(self) -> None:
        self.reports: queue.Queue = queue.Queue()
        self.stopping = False
        self.takes = 0

    def take(self, wait_s: float) -> GroupReport:
        self.takes += 1
        try:
            return self.reports.get(timeout=wait_s)
        except queue.Empty:
            return GroupReport(step_s=0.25)  # a heartbeat


@pytest.fixture
def served():
    leader = Leader()
    server = ReportServer("127.0.0.1", leader.take, lambda: leader.stopping)
    server.start()
    yield leader, server
    server.close()


def _report(n: int) -> GroupReport:
    events = [RequestEvent(f"r{i}-0", [i, i + 1], "ab", i == 0, "stop" if i == 0 else None, [-0.5, -1.0],
                           phases=(0.1, 0.2) if i == 1 else None) for i in range(n)]
    return GroupReport(events=events, accepted=["x-1"], load=EngineLoad(10, 20, 3, 40), applied=7, step_s=0.0)


def test_reports_arrive_in_order_with_every_field(served):
    leader, server = served
    assert server.address.host == "127.0.0.1" and server.address.port > 0
    reader = ReportReader(server.address)
    try:
        for n in (64, 1, 0):
            leader.reports.put(_report(n))
        got = [reader.read(5.0) for _ in range(3)]
    finally:
        reader.close()
    assert [len(r.events) for r in got] == [64, 1, 0]
    assert got[0].events == _report(64).events
    assert (got[0].accepted, got[0].load, got[0].applied) == (["x-1"], EngineLoad(10, 20, 3, 40), 7)


def test_an_idle_leader_sends_heartbeats(served):
    _, server = served
    reader = ReportReader(server.address)
    try:
        started = time.monotonic()
        beat = reader.read(HEARTBEAT_S + 5.0)
        assert beat.step_s == 0.25 and beat.events == []
        assert time.monotonic() - started < HEARTBEAT_S + 1.0
    finally:
        reader.close()


def test_a_wrong_token_is_refused_and_nothing_it_sends_is_unpickled(served, tmp_path):
    leader, server = served
    marker = tmp_path / "unpickled"

    class Bomb:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    intruder = socket.create_connection((server.address.host, server.address.port), timeout=5.0)
    intruder.sendall(b"\0" * 32 + pickle.dumps(Bomb()))
    intruder.settimeout(5.0)
    try:
        assert intruder.recv(1) == b""  # closed on it, no report sent
    except ConnectionResetError:  # closed with its bytes unread
        pass
    intruder.close()
    assert not marker.exists()

    wrong = LinkAddress(server.address.host, server.address.port, b"\1" * 32)
    with pytest.raises(LinkClosed):
        ReportReader(wrong).read(5.0)
    # The rightful client is still served afterwards.
    leader.reports.put(_report(2))
    reader = ReportReader(server.address)
    try:
        assert len(reader.read(5.0).events) == 2
    finally:
        reader.close()


def test_the_last_report_then_the_end_when_the_leader_stops(served):
    leader, server = served
    reader = ReportReader(server.address)
    try:
        leader.stopping = True
        leader.reports.put(_report(3))
        assert len(reader.read(5.0).events) == 3
        with pytest.raises(LinkClosed):
            reader.read(5.0)
    finally:
        reader.close()


def test_a_silent_leader_times_the_read_out():
    """A leader stuck (SIGSTOPped, say) sends not even heartbeats: the read raises TimeoutError."""
    blocked = threading.Event()
    server = ReportServer("127.0.0.1", lambda wait_s: blocked.wait(), lambda: False)
    server.start()
    reader = ReportReader(server.address)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.read(0.3)
        assert time.monotonic() - started < 2.0
    finally:
        blocked.set()
        reader.close()
        server.close()


def test_closing_the_reader_wakes_a_blocked_read(served):
    _, server = served
    reader = ReportReader(server.address)
    outcome: list = []

    def read() -> None:
        try:
            while True:
                reader.read(30.0)
        except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
            outcome.append(e)

    t = threading.Thread(target=read)
    t.start()
    time.sleep(0.2)
    started = time.monotonic()
    reader.close()
    t.join(5.0)
    assert not t.is_alive() and time.monotonic() - started < 2.0
    assert isinstance(outcome[0], LinkClosed)


def test_a_read_after_the_reader_was_closed_is_the_link_ending(served):
    # The fleet's watcher closes the reader when a rank dies; a read that starts just after must
    # say the link ended (so the fleet reports the watcher's reason), not fail with EBADF.
    _, server = served
    reader = ReportReader(server.address)
    reader.close()
    with pytest.raises(LinkClosed, match="Bad file descriptor"):
        reader.read(1.0)


def test_a_frame_over_the_limit_is_refused_as_corrupt():
    listener = socket.create_server(("127.0.0.1", 0))
    token = b"\7" * 32

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(32)
        conn.sendall((MAX_FRAME_BYTES + 1).to_bytes(8, "big"))
        time.sleep(1.0)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    reader = ReportReader(LinkAddress("127.0.0.1", listener.getsockname()[1], token))
    try:
        with pytest.raises(LinkClosed, match="over the"):
            reader.read(5.0)
    finally:
        reader.close()
        listener.close()


def test_a_closed_server_stops_listening():
    server = ReportServer("127.0.0.1", lambda wait_s: GroupReport(), lambda: False)
    server.start()
    address = server.address
    server.close()
    time.sleep(1.5)  # the accept loop looks once a second
    with pytest.raises(OSError):
        ReportReader(address, connect_timeout_s=2.0).read(2.0)
