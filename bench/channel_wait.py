"""What waiting on a Ray Compiled Graph result costs the waiting thread, per step length.

An actor sleeps ``wait`` seconds per call (as a rank waits on its device, using no CPU) behind
a compiled graph; the driver calls ``ray.get`` on each result. For each wait: the driver
thread's CPU time over the wall time (a blocking wait would be near 0%), and the round trip
beyond the wait. Host only: runs anywhere (the fleet loop thread is such a driver).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from bench.common import environment, print_table, write_results  # noqa: E402


@ray.remote(num_cpus=1)
class _Sleeper:
    def step(self, wait_s: float) -> int:
        time.sleep(wait_s)
        return 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waits-ms", default="0,2,20,200", help="actor sleep per call, comma separated")
    ap.add_argument("--seconds", type=float, default=2.0, help="time spent per wait")
    args = ap.parse_args()
    from ray.dag import InputNode, MultiOutputNode

    ray.init(_node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False, log_to_driver=False)
    actor = _Sleeper.remote()
    with InputNode() as inp:
        dag = MultiOutputNode([actor.step.bind(inp)]).experimental_compile()
    rows = []
    try:
        ray.get(dag.execute(0.0))
        for ms in (float(v) for v in args.waits_ms.split(",")):
            wait = ms / 1e3
            calls = max(1, int(args.seconds / max(wait, 1e-3)))
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                ray.get(dag.execute(wait))
            wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
            rows.append({"wait_ms": ms, "calls": calls, "driver_cpu_share": cpu / wall,
                         "overhead_us": (wall / calls - wait) * 1e6})
    finally:
        dag.teardown()
        ray.shutdown()
    print_table(rows, ["wait_ms", "calls", "driver_cpu_share", "overhead_us"])
    print(f"wrote {write_results('channel_wait', {'env': environment(), 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
