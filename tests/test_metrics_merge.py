"""deploy.metrics_merge: the replica's registry and every rank's text as one exposition."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deploy.metrics_merge import merge_expositions


def _rank_text(group: str, rank: int, passes: float) -> bytes:
    reg = CollectorRegistry()
    labels = {"group": group, "rank": str(rank), "role": "decode"}
    c = Counter("cuda_graph_passes", "Forward passes by mode", ["mode", *labels], registry=reg)
    c.labels(mode="decode_cuda_graph", **labels).inc(passes)
    h = Histogram("graphfleet_step_seconds", "Step time", list(labels), registry=reg)
    h.labels(**labels).observe(0.002)
    Gauge("kv_pages_free", "Free pages", list(labels), registry=reg).labels(**labels).set(rank + 10)
    return generate_latest(reg)


def _families(text: bytes) -> dict[str, tuple[str, list]]:
    return {f.name: (f.type, sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples))
            for f in text_string_to_metric_families(text.decode())}


def test_every_family_once_with_every_source_s_samples():
    api = CollectorRegistry()
    Counter("prompt_tokens", "Prompt tokens", ["model_name"], registry=api).labels("m").inc(7)
    Histogram("time_to_first_token_seconds", "TTFT", ["model_name"], registry=api).labels("m").observe(0.1)
    ranks = [_rank_text("g0", 0, 5), _rank_text("g0", 1, 5), _rank_text("g1", 0, 9)]
    merged = merge_expositions(api, ranks)
    lines = merged.decode().splitlines()
    types = [line.split()[2] for line in lines if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a family declared twice"
    helps = [line.split()[2] for line in lines if line.startswith("# HELP ")]
    assert sorted(helps) == sorted(types)
    expected: dict[str, tuple[str, list]] = {}
    for text in (generate_latest(api), *ranks):  # the union of what each source says
        for name, (kind, samples) in _families(text).items():
            expected.setdefault(name, (kind, []))[1].extend(samples)
    assert _families(merged) == {k: (t, sorted(s)) for k, (t, s) in expected.items()}
    passes = _families(merged)["cuda_graph_passes"][1]
    assert {(dict(lb)["group"], dict(lb)["rank"], v) for n, lb, v in passes if n.endswith("_total")} == \
        {("g0", "0", 5.0), ("g0", "1", 5.0), ("g1", "0", 9.0)}
    by_family: dict[str, int] = {}  # a family's sample lines sit together under its header
    current = None
    for line in lines:
        if line.startswith("# TYPE "):
            current = line.split()[2]
        elif not line.startswith("#"):
            by_family[current] = by_family.get(current, 0) + 1
    assert by_family["kv_pages_free"] == 3


def test_a_family_whose_type_disagrees_is_dropped_from_the_later_source(caplog):
    api = CollectorRegistry()
    Counter("prompt_tokens", "Prompt tokens", ["model_name"], registry=api).labels("m").inc(1)
    bad = b'# HELP prompt_tokens_total x\n# TYPE prompt_tokens_total gauge\nprompt_tokens_total{model_name="z"} 1.0\n'
    with caplog.at_level(logging.WARNING):
        merged = merge_expositions(api, [bad, _rank_text("g0", 0, 1)])
    assert b'model_name="z"' not in merged and b'model_name="m"' in merged and b"cuda_graph_passes_total" in merged
    assert "prompt_tokens_total: type gauge differs from counter" in caplog.text


def test_the_same_series_twice_is_kept_once_and_nothing_merges_to_nothing():
    text = _rank_text("g0", 0, 3)
    merged = merge_expositions(CollectorRegistry(), [text, text])
    assert merged.count(b'cuda_graph_passes_total{group="g0",mode="decode_cuda_graph",rank="0",role="decode"}') == 1
    assert merge_expositions(CollectorRegistry(), []) == b""
