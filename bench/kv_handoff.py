"""KV hand-off latency and bandwidth per transport, prefill group -> decode group, by prompt length.

Two Ray worker groups of the fleet (a prefill and a decode group, equal tp sizes; they share one
GPU at ``gpus_per_rank=0.5`` when only one is visible) hand over the KV pages of a prompt of each
length: export on every prefill rank, import into freshly numbered pages on every decode rank.
The pages hold whatever the cache holds (the transfer does not depend on the values). Reported per
transport and length: median export, import and end-to-end hand-off time (export submitted ->
every decode rank has written its pages), bytes moved (all ranks) and GB/s end to end.
Transports this build lacks are listed with the reason. Usage (GPU machine):
``python bench/kv_handoff.py [--preset tinyllama-1.1b] [--tp 1] [--lengths 128,...,8192]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from bench.common import environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from cluster.fleet_group import FleetWorkerGroup  # noqa: E402
from cluster.kv_transport import KVTransportUnavailable, create_transport  # noqa: E402
from deploy.config import load_config  # noqa: E402
from fleet.config import role_config  # noqa: E402

DEFAULT_LENGTHS = "128,256,512,1024,2048,4096,8192"


def handoff_times(transport, prefill, decode, pages: list[int], tokens: int, repeats: int, timeout_s: float):
    """(export_s, import_s, handoff_s) medians over ``repeats`` after one warm-up."""
    exports, imports, totals = [], [], []
    for i in range(repeats + 1):
        start = time.perf_counter()
        payload = transport.export_kv(prefill, pages, tokens)
        refs = [s for s in payload.shards if isinstance(s, ray.ObjectRef)]  # nccl: staged on the device
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        exported = time.perf_counter()
        transport.import_kv(decode, pages, payload, timeout_s)
        done = time.perf_counter()
        if i:
            exports.append(exported - start)
            imports.append(done - exported)
        # End to end without waiting in between (what the fleet does).
        start = time.perf_counter()
        transport.import_kv(decode, pages, transport.export_kv(prefill, pages, tokens), timeout_s)
        if i:
            totals.append(time.perf_counter() - start)
    return statistics.median(exports), statistics.median(imports), statistics.median(totals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--lengths", default=DEFAULT_LENGTHS)
    ap.add_argument("--transports", default="object_store,nccl,cuda_ipc")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    path = ensure_checkpoint(args.preset, Path(args.checkpoints))
    gpus = torch.cuda.device_count()
    share = gpus < 2 * args.tp
    page_size = 16
    pages_needed = -(-max(lengths) // page_size)
    cfg = load_config(None, [f"model.path={path}", "model.dtype=bfloat16", f"cache.page_size={page_size}",
                             f"cache.num_pages={pages_needed + 8}", "scheduler.max_running_requests=8",
                             f"cluster.gpus_per_rank={0.5 if share else 1.0}", "graphs.enabled=false",
                             "cluster.mode=disaggregated", f"cluster.tp_size={args.tp}"])
    ray.init(_node_ip_address="127.0.0.1", num_gpus=gpus, include_dashboard=False)
    prefill = FleetWorkerGroup(role_config(cfg, "prefill"), "bench-p0", "prefill")
    decode = FleetWorkerGroup(role_config(cfg, "decode"), "bench-d0", "decode")
    layout = prefill.kv_layouts(args.timeout_s)[0]
    elem = torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
    bytes_per_page = layout.num_layers * 2 * layout.page_size * layout.num_kv_heads * layout.head_dim * elem
    rows = []
    try:
        for name in args.transports.split(","):
            try:
                transport = create_transport(name)
                transport.check([prefill], [decode], args.timeout_s)
            except KVTransportUnavailable as e:
                rows.append({"transport": name, "available": False, "error": str(e)})
                print(f"{name}: {e}")
                continue
            for n in lengths:
                pages = list(range(1, -(-n // page_size) + 1))
                nbytes = len(pages) * bytes_per_page * args.tp
                export_s, import_s, handoff_s = handoff_times(transport, prefill, decode, pages, n, args.repeats,
                                                              args.timeout_s)
                rows.append({"transport": name, "available": True, "tokens": n, "pages": len(pages),
                             "mbytes": nbytes / 1e6, "export_ms": export_s * 1e3, "import_ms": import_s * 1e3,
                             "handoff_ms": handoff_s * 1e3, "gb_per_s": nbytes / handoff_s / 1e9})
    finally:
        prefill.shutdown()
        decode.shutdown()
        ray.shutdown()
    print_table([r for r in rows if r["available"]],
                ["transport", "tokens", "pages", "mbytes", "export_ms", "import_ms", "handoff_ms", "gb_per_s"])
    out = write_results("kv_handoff", {"env": environment(), "preset": args.preset, "tp": args.tp,
                                       "shared_gpu": share, "rows": rows, "args": vars(args)})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
