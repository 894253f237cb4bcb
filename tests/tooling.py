"""External tools of the chart and observability tests: helm, promtool, prometheus.

``make test`` installs them into ``.tools/bin`` first (``scripts/install_tools.py``); a test skips,
naming the install step, only where that did not happen (a bare ``pytest`` on a fresh machine).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TOOLS_BIN = REPO / ".tools" / "bin"
CHART = REPO / "helm" / "graphfleet"
MULTI_GROUP_VALUES = CHART / "ci" / "disaggregated-values.yaml"


def tool(name: str) -> str:
    """Path of ``name`` in .tools/bin, else on PATH; skips the test when neither has it."""
    local = TOOLS_BIN / name
    if local.is_file():
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: run `make tools` (python scripts/install_tools.py), "
                    "which puts helm, prometheus and promtool in .tools/bin")
    return found


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """``cmd`` with text output captured; never raises on a non-zero exit."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def helm_template(values: list[Path] = (), sets: list[str] = (), release: str = "gf",
                  namespace: str = "serving") -> list[dict]:
    """The documents ``helm template`` renders (asserting it succeeds)."""
    out = run([tool("helm"), "template", release, str(CHART), "--namespace", namespace,
               *[a for v in values for a in ("-f", str(v))], *[a for s in sets for a in ("--set", s)]])
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


#: The chart's values.yaml, its values.schema.json, and the values files of each rendered case.
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
CASES = {"default": [], "multi-group": [MULTI_GROUP_VALUES]}


def chart_values(case: str) -> dict:
    """values.yaml with the case's file merged over it (maps merge, everything else replaces)."""
    def merge(base, over):
        if isinstance(base, dict) and isinstance(over, dict):
            return {k: merge(base[k], v) if k in base else v for k, v in {**base, **over}.items()}
        return over

    merged = VALUES
    for path in CASES[case]:
        merged = merge(merged, yaml.safe_load(path.read_text()))
    return merged


def rendered_case(case: str) -> tuple[str, dict, list[dict]]:
    """(case name, merged values, rendered documents) of one of :data:`CASES`."""
    return case, chart_values(case), helm_template(CASES[case])


def shutdown_budget(values: dict) -> tuple[int, int]:
    """(drain budget, termination grace period) as values.yaml's `shutdown` comment defines them."""
    sh = values["shutdown"]
    budget = math.ceil(values["config"]["serve"]["drain_timeout_s"] + sh["drainMarginSeconds"])
    return budget, math.ceil(budget + sh["workerHeadStartSeconds"] + sh["rayStopSeconds"])
