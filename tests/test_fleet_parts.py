# ruff: noqa: F811 - pytest fixtures imported from test_fleet are redefined as test parameters
"""The fleet's pieces without Ray (CPU): fleet options and their errors, role configs, KV page
export and import between two workers, the router's choice, and one engine handing a request off
to another token for token. The fleet on a local Ray is tests/test_fleet.py."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from cluster.kv_transport import KVTransportUnavailable, create_transport
from deploy.config import Config, ConfigError
from fleet.config import FleetConfig, apply_fleet_options, group_layout, role_config
from fleet.request import FleetRequest
from fleet.router import AdmissionGate, GroupLoad, Overloaded, Router
from tests.test_fleet import GREEDY, _config, _prompts, path, reference  # noqa: F401 - fixtures are used by name
from worker.engine import Engine
from worker.kv_pages import KVPagesError, export_pages, import_pages, kv_layout
from worker.worker import Worker


def test_config_transport_and_gate_errors_are_clear(path):
    cfg = _config(path)
    with pytest.raises(ConfigError, match="cluster.decode_tp_size: KV hand-off needs equal tp sizes: "
                                          "prefill_tp_size=2, decode_tp_size=1"):
        apply_fleet_options(cfg, mode="disaggregated", prefill_tp_size=2, decode_tp_size=1)
    with pytest.raises(ConfigError, match="unknown fleet option 'num_groups'"):
        apply_fleet_options(cfg, num_groups=2)
    with pytest.raises(KVTransportUnavailable, match="unknown kv_transport 'smoke'; available: cuda_ipc, nccl, "
                                                     "object_store"):
        create_transport("smoke")
    cfg, fc = apply_fleet_options(cfg, mode="disaggregated", num_decode_groups=2, name="x")
    assert group_layout(cfg.cluster, fc.name) == [("x-p0", "prefill"), ("x-d0", "decode"), ("x-d1", "decode")]
    assert role_config(cfg, "prefill").graphs.capture == "prefill"
    assert role_config(cfg, "decode").graphs.capture == "decode"
    assert role_config(cfg, "colocated").graphs.capture == "both"
    gate = AdmissionGate(2)
    gate.acquire()
    gate.acquire()
    with pytest.raises(Overloaded, match=r"2 requests already waiting .*scheduler\.max_waiting_requests=2"
                                         r".*retry later"):
        gate.acquire()
    gate.release()
    gate.acquire()


def test_fleet_config_declares_no_config_key():
    """FleetConfig holds only what no config section says: the rest is read from its section."""
    def keys(section) -> set[str]:
        found = set()
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            found |= {f.name} | (keys(value) if dataclasses.is_dataclass(value) else set())
        return found

    config_keys = keys(Config())
    assert {"max_waiting_requests", "num_decode_groups", "kv_transport", "request_timeout_s"} <= config_keys
    assert not {f.name for f in dataclasses.fields(FleetConfig)} & config_keys


def test_role_config_without_graphs_for_the_role(path):
    cfg = _config(path, "graphs.capture=decode", "scheduler.async_scheduling=true")
    prefill = role_config(cfg, "prefill")
    assert (prefill.graphs.capture, prefill.scheduler.async_scheduling) == ("none", False)
    assert role_config(cfg, "decode").scheduler.async_scheduling


def test_kv_pages_export_import_roundtrip(path):
    src, dst = Worker.local(_config(path)), Worker.local(_config(path))
    src.kv_cache.kv.normal_()
    payload = export_pages(src, [3, 5, 9])
    assert payload.shape == kv_layout(src).payload_shape(3) == (4, 3, 2, 16, 2, 64)
    import_pages(dst, [7, 2, 4], payload)
    for a, b in ((3, 7), (5, 2), (9, 4)):
        assert torch.equal(dst.kv_cache.kv[:, b], src.kv_cache.kv[:, a])
    assert not dst.kv_cache.kv[:, 1].any()
    with pytest.raises(KVPagesError, match=r"page 0 outside \[1, 128\) \(page 0 is the dummy page\)"):
        export_pages(src, [0])
    with pytest.raises(KVPagesError, match="does not fit 2 pages"):
        import_pages(dst, [1, 2], payload)
    with pytest.raises(KVPagesError, match="dtype torch.float16 differs"):
        import_pages(dst, [1, 2, 3], payload.half())


def test_router_picks_least_loaded_ready_group_with_pages():
    router = Router(page_size=16, max_waiting_requests=4, policy="least_loaded")  # prefix_aware: test_prefix_routing
    req = FleetRequest("r", [1] * 40, GREEDY, 0, None)  # 3 pages of KV
    loads = [GroupLoad("p0", "prefill", True, 100, 2, 8, 500, 2032),
             GroupLoad("p1", "prefill", True, 100, 1, 8, 100, 2032),
             GroupLoad("p2", "prefill", False, 100, 0, 8, 0, 2032),  # not ready
             GroupLoad("p3", "prefill", True, 4, 2, 8, 0, 2032),  # 4 free - 3 needed < 2 running (headroom)
             GroupLoad("d0", "decode", True, 100, 0, 8, 0, 2032)]
    assert router.pick_prefill(loads, req).group_id == "p1"
    router.assign(loads[1], req, req.num_tokens, 1000)
    assert router.pick_prefill(loads, req).group_id == "p0"
    assert router.pick_decode(loads, req).group_id == "d0"
    loads[4].running = 8  # full
    assert router.pick_decode(loads, req) is None


def test_engine_hands_off_to_another_engine_token_for_token(path, reference):
    """The engine half of the hand-off, in-process: admit(on_first_token) -> export -> add_prefilled_request."""
    prompts = _prompts(3, seed=11)
    want = reference(prompts)
    # a prefill engine steps synchronously (as a fleet's prefill role does: fleet.config.role_config)
    pre, dec = Engine(_config(path, "scheduler.async_scheduling=false")), Engine(_config(path))
    free = pre.num_free_pages
    payloads = {}

    def export(req):
        payloads[req.request_id] = (export_pages(pre.worker, req.pages), list(req.output_ids))

    for i, p in enumerate(prompts):
        pre.admit(p, GREEDY, seed=i, request_id=f"r{i}", on_first_token=export)
    handed = [ev for _ in range(10) for ev in pre.step()]
    assert [ev.finish_reason for ev in handed] == ["handoff"] * 3 and pre.num_free_pages == free
    with pytest.raises(RuntimeError, match="link down"):
        dec.add_prefilled_request(prompts[0], payloads["r0"][1], GREEDY, seed=0, request_id="r0",
                                  import_kv=lambda pages: (_ for _ in ()).throw(RuntimeError("link down")))
    assert dec.num_free_pages == free and "r0" not in dec.requests
    for i, p in enumerate(prompts):
        payload, out = payloads[f"r{i}"]
        dec.add_prefilled_request(p, out, GREEDY, seed=i, request_id=f"r{i}",
                                  import_kv=functools.partial(import_pages, dec.worker, payload=payload))
    while dec.has_unfinished():
        dec.step()
    assert [dec.output(f"r{i}").token_ids for i in range(3)] == [o.token_ids for o in want]
    assert [dec.output(f"r{i}").text for i in range(3)] == [o.text for o in want]
