"""The monitoring files under deploy/ are valid: Prometheus alert rules (with promtool unit tests
covering every alert), the example Prometheus config, and the Grafana dashboard, whose PromQL
must parse and whose metric names must all be documented runner metrics.

``metric_names_used()`` is the set of ``elastic_runner_*`` names the dashboard and the alert
expressions query (histograms as ``_bucket``/``_sum``/``_count``), for comparison with a scrape.
"""

from __future__ import annotations

import json
import re
import subprocess
from functools import cache
from pathlib import Path

import yaml

from .needs import debian, require_command

REPO = Path(__file__).resolve().parent.parent
PROM_DIR = REPO / "deploy" / "prometheus"
RULES = PROM_DIR / "elastic-runner-rules.yaml"
RULES_TEST = PROM_DIR / "elastic-runner-rules.test.yaml"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "elastic-runner-dashboard.json"

PROMTOOL_TIMEOUT_S = 60

# The runner's documented metrics: name -> type. Histograms are exported as
# NAME_bucket{le}, NAME_sum and NAME_count.
DOCUMENTED: dict[str, str] = {
    # worker, per rank
    "elastic_runner_step": "gauge",
    "elastic_runner_steps_total": "counter",
    "elastic_runner_epoch": "gauge",
    "elastic_runner_world_size": "gauge",
    "elastic_runner_step_duration_seconds": "histogram",
    "elastic_runner_data_wait_seconds": "histogram",
    "elastic_runner_samples_total": "counter",
    "elastic_runner_tokens_total": "counter",
    "elastic_runner_samples_per_second": "gauge",
    "elastic_runner_tokens_per_second": "gauge",
    "elastic_runner_loss": "gauge",
    "elastic_runner_learning_rate": "gauge",
    "elastic_runner_heartbeat_timestamp_seconds": "gauge",
    "elastic_runner_heartbeat_timeout_seconds": "gauge",
    "elastic_runner_phase": "gauge",
    "elastic_runner_straggler_ratio": "gauge",
    "elastic_runner_skipped_steps_total": "counter",
    "elastic_runner_rollbacks_total": "counter",
    "elastic_runner_process_resident_memory_bytes": "gauge",
    "elastic_runner_cuda_memory_allocated_bytes": "gauge",
    "elastic_runner_cuda_memory_reserved_bytes": "gauge",
    "elastic_runner_eval_metric": "gauge",
    "elastic_runner_early_stopping_best": "gauge",
    "elastic_runner_early_stopping_patience_left": "gauge",
    "elastic_runner_finished": "gauge",
    "elastic_runner_checkpoint_save_duration_seconds": "histogram",
    "elastic_runner_checkpoint_stall_seconds": "histogram",
    "elastic_runner_checkpoint_size_bytes": "gauge",
    "elastic_runner_checkpoint_written_bytes_total": "counter",
    "elastic_runner_checkpoint_last_success_timestamp_seconds": "gauge",
    "elastic_runner_in_place_recoveries_total": "counter",
    "elastic_runner_in_place_steps_redone_total": "counter",
    "elastic_runner_last_recovery_seconds": "gauge",
    "elastic_runner_goodput_seconds": "gauge",
    "elastic_runner_ettr": "gauge",
    "elastic_runner_store_operations_total": "counter",
    # agent, per node
    "elastic_runner_restarts_total": "counter",
    "elastic_runner_rendezvous_total": "counter",
    "elastic_runner_rendezvous_duration_seconds": "histogram",
    "elastic_runner_agent_state": "gauge",
    "elastic_runner_local_ranks": "gauge",
    "elastic_runner_agent_store_operations_total": "counter",
}
AGENT_METRICS = {
    "elastic_runner_restarts_total",
    "elastic_runner_rendezvous_total",
    "elastic_runner_rendezvous_duration_seconds",
    "elastic_runner_agent_state",
    "elastic_runner_local_ranks",
    "elastic_runner_agent_store_operations_total",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_RE = re.compile(r"\belastic_runner_[a-z_]+")
SEVERITIES = {"critical", "warning", "info"}

# Grafana variables -> values that make the PromQL concrete enough to parse.
GRAFANA_VARS = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "job": ".*",
    "rank": ".*",
}


# ---------------------------------------------------------------- loaders and helpers


@cache
def rules_doc() -> dict:
    return yaml.safe_load(RULES.read_text())


@cache
def rules_test_doc() -> dict:
    return yaml.safe_load(RULES_TEST.read_text())


@cache
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_rules() -> list[dict]:
    return [rule for group in rules_doc()["groups"] for rule in group["rules"]]


def alert_rules() -> list[dict]:
    return [rule for rule in all_rules() if "alert" in rule]


def all_panels() -> list[dict]:
    """Top-level panels plus those nested in (collapsed) rows."""
    out = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_targets() -> list[tuple[dict, dict]]:
    return [(p, t) for p in all_panels() for t in p.get("targets", [])]


def dashboard_exprs() -> list[str]:
    return [t["expr"] for _, t in dashboard_targets()]


def variable_queries() -> list[str]:
    out = []
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        q = var["query"]
        out.append(q["query"] if isinstance(q, dict) else q)
    return out


def substitute_grafana_vars(expr: str) -> str:
    """``$name``, ``${name}`` and ``[[name]]`` -> a concrete value (unknown names: ``.*``)."""

    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        name = name.split(":", 1)[0]  # ${var:format}
        return GRAFANA_VARS.get(name, ".*")

    return re.sub(r"\$\{(\w+(?::\w+)?)\}|\$(\w+)|\[\[(\w+)\]\]", value, expr)


def metric_names_used() -> set[str]:
    """Every ``elastic_runner_*`` token in the dashboard's PromQL (panel targets and template
    variable queries) and in the alert rule expressions, as it would appear in a scrape
    (histograms with their ``_bucket``/``_sum``/``_count`` suffix)."""
    texts = dashboard_exprs() + variable_queries() + [r["expr"] for r in all_rules()]
    return {name for text in texts for name in METRIC_RE.findall(text)}


def documented_base(name: str) -> str | None:
    """The documented metric ``name`` belongs to, or None."""
    if name in DOCUMENTED:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and DOCUMENTED.get(base) == "histogram":
            return base
    return None


def promtool_path() -> str:
    """promtool's path. Without it the test skips, or fails in CI (tests/needs.py); the checks
    that need no promtool still run."""
    __tracebackhide__ = True
    return require_command("promtool", debian("prometheus"))


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [promtool_path(), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=PROMTOOL_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"promtool {args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


# ---------------------------------------------------------------- promtool


def test_promtool_check_rules():
    out = promtool("check", "rules", RULES).stdout
    assert f"SUCCESS: {len(all_rules())} rules found" in out


def test_promtool_unit_tests_of_the_rules_pass():
    # rule_files in the test file are relative to it.
    promtool("test", "rules", RULES_TEST.name, cwd=PROM_DIR)


def test_promtool_check_config():
    promtool("check", "config", PROM_CONFIG)


def test_every_dashboard_expression_parses(tmp_path):
    exprs = dashboard_exprs() + variable_queries()
    # label_values(...) is Grafana's variable query syntax, not PromQL: check its selector.
    exprs = [
        m.group(1) if (m := re.fullmatch(r"label_values\((.+),\s*\w+\)", e)) else e for e in exprs
    ]
    rules = [
        {"record": f"dashboard:expr_{i}", "expr": substitute_grafana_vars(e)}
        for i, e in enumerate(exprs)
    ]
    path = tmp_path / "dashboard-exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = promtool("check", "rules", path).stdout
    assert f"SUCCESS: {len(rules)} rules found" in out


# ---------------------------------------------------------------- rules and their tests


def test_rules_file_is_a_plain_rule_file_usable_as_prometheusrule_spec():
    doc = rules_doc()
    assert list(doc) == ["groups"]
    assert [g["name"] for g in doc["groups"]] == ["elastic-runner"]


def test_every_alert_is_complete():
    alerts = alert_rules()
    assert len(alerts) == len({a["alert"] for a in alerts}), "duplicate alert names"
    for rule in alerts:
        name = rule["alert"]
        assert name.startswith("ElasticRunner"), name
        assert "for" in rule, name
        assert rule["labels"]["severity"] in SEVERITIES, name
        ann = rule["annotations"]
        assert ann["summary"].strip() and ann["description"].strip(), name
        assert "{{ $labels." in ann["summary"] + ann["description"], name


def test_expected_alerts_exist():
    assert {a["alert"] for a in alert_rules()} >= {
        "ElasticRunnerRankHeartbeatStale",
        "ElasticRunnerNoRecentCheckpoint",
        "ElasticRunnerRestartLoop",
        "ElasticRunnerStraggler",
        "ElasticRunnerStoppedEarly",
        "ElasticRunnerJobFailed",
        "ElasticRunnerNonFiniteSteps",
    }


def test_every_alert_has_a_firing_and_a_silent_test_case():
    doc = rules_test_doc()
    assert doc["rule_files"] == [RULES.name]
    firing, silent = set(), set()
    for case in doc["tests"]:
        for check in case.get("alert_rule_test", []):
            exp = check.get("exp_alerts") or []
            (firing if exp else silent).add(check["alertname"])
            for alert in exp:
                assert alert.get("exp_labels") and alert.get("exp_annotations"), check
    names = {a["alert"] for a in alert_rules()}
    assert names - firing == set(), "alerts without a firing test case"
    assert names - silent == set(), "alerts without a test case where they must not fire"
    assert (firing | silent) - names == set(), "test cases for unknown alerts"


def test_prometheus_config_scrapes_with_honor_labels_and_loads_the_rules():
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    assert cfg["global"]["scrape_interval"] == "15s"
    assert (PROM_CONFIG.parent / cfg["rule_files"][0]).resolve() == RULES.resolve()
    (scrape,) = cfg["scrape_configs"]
    assert scrape["honor_labels"] is True
    assert scrape["static_configs"][0]["targets"] == ["localhost:9400"]


# ---------------------------------------------------------------- dashboard


def test_dashboard_top_level():
    d = dashboard()
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "time", "refresh", "tags"):
        assert key in d, key
    assert d["uid"] == "elastic-runner" and d["title"] == "elastic-runner"
    assert d["schemaVersion"] == 39
    assert d["time"] == {"from": "now-1h", "to": "now"} and d["refresh"] == "30s"
    assert d["tags"] and all(isinstance(t, str) for t in d["tags"])


def test_dashboard_templating():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "rank"]
    for var in variables.values():
        assert {"name", "type", "hide"} <= set(var), var["name"]
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    expected = {
        "job": "label_values(elastic_runner_step, job)",
        "rank": 'label_values(elastic_runner_step{job=~"$job"}, rank)',
    }
    for name, query in expected.items():
        var = variables[name]
        assert var["type"] == "query", name
        assert var["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, name
        q = var["query"]
        assert (q["query"] if isinstance(q, dict) else q) == query, name
        assert var.get("definition", query) == query, name
        assert var.get("refresh") in (1, 2), name
    rank = variables["rank"]
    assert rank["multi"] is True and rank["includeAll"] is True
    assert rank.get("allValue") == ".*"  # so `rank=~"$rank"` stays short with All selected


def test_dashboard_panels_ids_types_and_datasources():
    panels = all_panels()
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), ids
    for p in panels:
        assert p["type"] in {"row", "timeseries", "stat"}, p
        assert p.get("title"), p["id"]
        if p["type"] == "row":
            assert not p.get("targets"), p["title"]
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        targets = p.get("targets")
        assert targets, p["title"]
        refs = [t.get("refId") for t in targets]
        assert all(refs) and len(refs) == len(set(refs)), (p["title"], refs)
        for t in targets:
            assert isinstance(t.get("expr"), str) and t["expr"].strip(), (p["title"], t)
            assert t.get("datasource", p["datasource"]) == p["datasource"], p["title"]


def test_dashboard_grid_fits_24_columns_without_overlaps():
    boxes = []
    for p in dashboard()["panels"]:  # nested row panels are hidden; they use their own layout
        g = p["gridPos"]
        assert {"x", "y", "w", "h"} <= set(g), p["title"]
        assert all(isinstance(g[k], int) for k in "xywh"), p["title"]
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1, p["title"]
        assert g["x"] + g["w"] <= 24, p["title"]
        boxes.append((p["title"], g))
    for i, (ta, a) in enumerate(boxes):
        for tb, b in boxes[i + 1 :]:
            apart = (
                a["x"] + a["w"] <= b["x"]
                or b["x"] + b["w"] <= a["x"]
                or a["y"] + a["h"] <= b["y"]
                or b["y"] + b["h"] <= a["y"]
            )
            assert apart, f"panels overlap: {ta!r} {a} and {tb!r} {b}"


def test_dashboard_selectors_filter_by_job_and_rate_windows_use_rate_interval():
    for panel, t in dashboard_targets():
        expr = t["expr"]
        # every vector selector of a runner metric filters on the job variable
        for m in re.finditer(r"\b(elastic_runner_[a-z_]+)(\{[^}]*\})?", expr):
            name, matchers = m.group(1), m.group(2) or ""
            assert 'job=~"$job"' in matchers, (panel["title"], name)
            is_agent = documented_base(name) in AGENT_METRICS
            assert not (is_agent and "rank" in matchers), (panel["title"], name)
        # counter/histogram windows come from Grafana, not hard-coded
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window in ("$__rate_interval", "$__range"), (panel["title"], window)


def test_dashboard_covers_the_required_views():
    exprs = "\n".join(dashboard_exprs())
    required = [
        r"rate\(elastic_runner_steps_total\{",
        r"histogram_quantile\(0\.5, .*elastic_runner_step_duration_seconds_bucket",
        r"histogram_quantile\(0\.9, .*elastic_runner_step_duration_seconds_bucket",
        r"histogram_quantile\(0\.99, .*elastic_runner_step_duration_seconds_bucket",
        r"elastic_runner_straggler_ratio\{",
        r"elastic_runner_loss\{",
        r"elastic_runner_eval_metric\{",
        r"elastic_runner_world_size\{",
        r"elastic_runner_restarts_total\{",
        r"elastic_runner_rendezvous_total\{",
        r"elastic_runner_rendezvous_duration_seconds_",
        r"time\(\) - elastic_runner_heartbeat_timestamp_seconds\{",
        r"elastic_runner_checkpoint_stall_seconds_",
        r"elastic_runner_checkpoint_save_duration_seconds_",
        r"time\(\) - max\(elastic_runner_checkpoint_last_success_timestamp_seconds",
        r"rate\(elastic_runner_data_wait_seconds_sum\{.*\}\[\$__rate_interval\]\) / "
        r"rate\(elastic_runner_step_duration_seconds_sum\{",
        r"elastic_runner_samples_per_second\{",
        r"elastic_runner_tokens_per_second\{",
        r"elastic_runner_process_resident_memory_bytes\{",
        r"elastic_runner_cuda_memory_allocated_bytes\{",
        r"elastic_runner_cuda_memory_reserved_bytes\{",
        r"elastic_runner_early_stopping_best\{",
        r"elastic_runner_early_stopping_patience_left\{",
        r"elastic_runner_agent_state\{",
        r"elastic_runner_phase\{",
    ]
    missing = [r for r in required if not re.search(r, exprs)]
    assert missing == []


# ---------------------------------------------------------------- metric names


def test_metric_names_used_are_documented():
    used = metric_names_used()
    assert len(used) > 20  # sanity: the helper sees the dashboard and the rules
    assert sorted(n for n in used if documented_base(n) is None) == []


def test_histograms_are_used_with_a_suffix_and_others_without():
    for name in metric_names_used():
        if DOCUMENTED.get(name) == "histogram":
            raise AssertionError(f"{name} is a histogram: query _bucket, _sum or _count")


def test_metric_names_in_alert_annotations_are_documented():
    text = " ".join(" ".join(r.get("annotations", {}).values()) for r in alert_rules())
    names = set(METRIC_RE.findall(text))
    assert names and sorted(n for n in names if documented_base(n) is None) == []
