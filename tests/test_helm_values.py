"""values.yaml and values.schema.json against the config dataclasses: the chart's values mirror the
config's fields and defaults, the schema accepts the shipped values and good overrides and rejects bad
ones with the key path (the chart rendered by a real Helm 3: tests/test_helm.py)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from deploy.config import Config
from deploy.config.loader import DEFAULT_CONFIG_PATH
from tests.tooling import CASES, CHART, SCHEMA, VALUES, by_kind, chart_values, run, tool


def _fields(cls) -> dict[str, typing.Any]:
    return {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}


def _walk(cls, values: dict, schema: dict, path: str = "config"):
    """Assert ``values`` and ``schema`` have exactly the dataclass's fields, with its enums, recursively."""
    fields = _fields(cls)
    assert set(values) == set(fields), f"{path}: values keys differ from {cls.__name__}"
    assert set(schema["properties"]) == set(fields), f"{path}: schema properties differ from {cls.__name__}"
    assert schema["additionalProperties"] is False, path
    for name, hint in fields.items():
        if dataclasses.is_dataclass(hint):
            _walk(hint, values[name], schema["properties"][name], f"{path}.{name}")
        elif typing.get_origin(hint) is typing.Literal:
            assert schema["properties"][name]["enum"] == list(typing.get_args(hint)), f"{path}.{name}"


def test_values_config_mirrors_the_dataclasses():
    _walk(Config, VALUES["config"], SCHEMA["properties"]["config"])
    defaults = yaml.safe_load(Path(DEFAULT_CONFIG_PATH).read_text())
    # The chart's own values: its model mount, every interface, and Serve's proxy (the Service targets it).
    chart_only = {"model.path": "/models/model", "serve.host": "0.0.0.0", "serve.direct_ingress": False}
    for section, keys in defaults.items():
        for key, value in keys.items():
            expected = chart_only.get(f"{section}.{key}", value)
            assert VALUES["config"][section][key] == expected, f"config.{section}.{key}"


def test_schema_accepts_the_shippedchart_values():
    import jsonschema

    for name in CASES:
        jsonschema.validate(chart_values(name), SCHEMA)


@pytest.mark.parametrize("bad, needle", [
    ("config.graphs.decode.backend=cudagraph", "config/graphs/decode/backend"),
    ("config.graphs.prefill.backend=piecewise", "config/graphs/prefill/backend"),
    ("config.graphs.decode.batch_sizes={0,8}", "config/graphs/decode/batch_sizes"),
    ("config.graphs.memory_budget=1", "config/graphs/memory_budget"),
    ("config.graphs.memory_budget=lots", "config/graphs/memory_budget"),
    ("config.graphs.memory_budget=0.5", "config/graphs/memory_budget"),  # --set passes a string: no unit
    ("config.cluster.mode=split", "config/cluster/mode"),
    ("config.cluster.tp_size=0", "config/cluster/tp_size"),
    ("config.cluster.num_decode_groups=0", "config/cluster/num_decode_groups"),
    ("config.cluster.gpus_per_rank=2", "config/cluster/gpus_per_rank"),
    ("config.graphs.decoder.backend=full", "decoder"),
    ("startup.safetyFactor=0.5", "startup/safetyFactor"),
    ("startup.periodSeconds=0", "startup/periodSeconds"),
    ("probes.replicaLiveness.timeoutSeconds=0", "probes/replicaLiveness/timeoutSeconds"),
    ("shutdown.drainMarginSeconds=-1", "shutdown/drainMarginSeconds"),
    ("config.serve.drain_timeout_s=-5", "config/serve/drain_timeout_s"),
    ("config.cluster.cpus_per_rank=0", "config/cluster/cpus_per_rank"),
    ("workers.gpu.replicas=2", "gpu"),
])
def test_schema_rejects_badchart_values(bad, needle):
    out = run([tool("helm"), "template", "gf", str(CHART), "--set", bad])
    assert out.returncode != 0, f"--set {bad} rendered"
    assert "values don't meet the specifications of the schema" in out.stderr
    assert needle in out.stderr, out.stderr


@pytest.mark.parametrize("good", ["config.graphs.memory_budget=0.5", 'config.graphs.memory_budget="4GiB"',
                                  "config.graphs.memory_budget=4294967296", 'config.graphs.decode.backend="breakable"'])
def test_schema_accepts_good_overrides(good):
    out = run([tool("helm"), "template", "gf", str(CHART), "--set-json", good])
    assert out.returncode == 0, out.stderr
    (rayservice,) = by_kind([d for d in yaml.safe_load_all(out.stdout) if d], "RayService")
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    Config.from_dict(args["config"])
