"""deploy/prometheus: promtool checks the rules and runs their unit tests; the chart ships the same rules.

tests/prometheus/graphfleet-rules.test.yaml holds a firing and a quiet case for every alert.
"""

from __future__ import annotations

import yaml

from tests.tooling import CHART, MULTI_GROUP_VALUES, REPO, by_kind, helm_template, run, tool

RULES = REPO / "deploy" / "prometheus" / "graphfleet-rules.yaml"
THRESHOLDS = REPO / "deploy" / "prometheus" / "graphfleet-thresholds.yaml"
UNIT_TESTS = REPO / "tests" / "prometheus" / "graphfleet-rules.test.yaml"
ALERTS = {"GraphfleetEagerFallbackHigh", "GraphfleetGraphMemoryOverBudget", "GraphfleetCaptureSlow",
          "GraphfleetNoReadyDecodeGroup"}


def _alerts(groups: list[dict]) -> set[str]:
    return {r["alert"] for g in groups for r in g["rules"] if "alert" in r}


def test_promtool_check_rules():
    out = run([tool("promtool"), "check", "rules", str(RULES), str(THRESHOLDS)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert _alerts(yaml.safe_load(RULES.read_text())["groups"]) == ALERTS


def test_promtool_unit_tests():
    out = run([tool("promtool"), "test", "rules", str(UNIT_TESTS)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    cases = [c for t in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    firing = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert firing == quiet == ALERTS


def test_chart_thresholds_default_to_the_plain_file():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    plain = {r["record"]: r["expr"] for r in yaml.safe_load(THRESHOLDS.read_text())["groups"][0]["rules"]}
    assert plain == {
        "graphfleet:threshold_eager_fallback_ratio": f"vector({values['prometheusRule']['eagerFallbackRatio']})",
        "graphfleet:threshold_capture_seconds": f"vector({values['startup']['graphCaptureSeconds']})",
    }


def test_chart_prometheus_rule_ships_the_rules(tmp_path):
    """The rendered PrometheusRule: the rules file's groups verbatim, then thresholds from values in the
    release namespace; promtool accepts it as a rules file."""
    docs = helm_template([MULTI_GROUP_VALUES], namespace="llm")
    (rule,) = by_kind(docs, "PrometheusRule")
    groups = rule["spec"]["groups"]
    assert groups[:-1] == yaml.safe_load(RULES.read_text())["groups"]
    thresholds = {r["record"]: r for r in groups[-1]["rules"]}
    assert thresholds["graphfleet:threshold_eager_fallback_ratio"]["expr"] == "vector(0.1)"
    assert thresholds["graphfleet:threshold_capture_seconds"]["expr"] == "vector(300)"
    assert all(r["labels"] == {"namespace": "llm"} for r in thresholds.values())
    rendered = tmp_path / "rendered-rules.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    out = run([tool("promtool"), "check", "rules", str(rendered)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert by_kind(helm_template(), "PrometheusRule") == []
