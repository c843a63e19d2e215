"""`export prometheus`: the plan's vLLM instances as a Prometheus and Grafana pack (docs/observability.md).

Written from the plan, like `export ansible`, touching no host:
  * targets/vllm.json: Prometheus file-based service discovery (one entry per instance, its /metrics at
    address:port; labels host, unit, model, tp, release);
  * rules/vllm-alerts.yml: alert rules (instance down, stalled, stuck, KV cache near full, restarted), the
    stall and stuck thresholds from the hosts' vllm_progress_* variables (checks/progress.py);
  * grafana/vllm-<version>.json: a Grafana dashboard per vLLM version of the plan;
  * prometheus.yml: a scrape configuration reading the targets and the rules.

Every metric name the rules and dashboards use is looked up in the metric families of the plan's vLLM version
(data/vllm_metrics/<version>.txt, extracted from the real wheel by scripts/vllm_metrics.py): a name the
version does not emit is an error naming the metric and the version, never a panel that stays empty.

vLLM serves /metrics outside its API key (vllm/entrypoints/serve/middleware/authenticate.py guards only paths
under /v1, /v2, /inference and /cohere), so the scrape needs no credential and no key is written anywhere.
Pure: plans in, files out; the CLI writes them.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from ernie_deploy.checks.progress import Thresholds
from ernie_deploy.errors import ConfigError, InventoryError
from ernie_deploy.export.ansible import ExportFile
from ernie_deploy.planning.plantypes import HostPlan, InstancePlan
from ernie_deploy.planning.render import RenderedFile
from ernie_deploy.planning.versions import parse_version

JOB = "ernie-vllm"
TARGETS = "targets/vllm.json"
RULES = "rules/vllm-alerts.yml"
CONFIG = "prometheus.yml"
TARGET_LABELS = ("host", "unit", "model", "tp", "release")
# Every series of a target carries its labels: aggregations keep them, so an alert names host, unit and model.
BY = ", ".join(("instance", *TARGET_LABELS))
KV_FULL = 0.95  # KV cache usage (0..1) above which new requests queue or preempt others
KV_FULL_FOR = "5m"
DOWN_FOR = "1m"
RESTART_WINDOW = "15m"
# increase() needs two samples inside its range: the progress window is stretched to this many scrapes.
MIN_SCRAPES = 4
# Series that are not vLLM's own: `up` is Prometheus's per-target series; process_start_time_seconds comes from
# prometheus_client's process collector, which vLLM's /metrics serves (tests/fixtures/real-vllm/0.32.0/http/
# metrics.txt).
OUTSIDE_VLLM = {"up": "Prometheus", "process_start_time_seconds": "prometheus_client's process collector"}
_WILDCARDS = ("0.0.0.0", "::", "")
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
_NAME_IN_EXPR = re.compile(r"(?<![\w:])(vllm:[A-Za-z0-9_:]+|process_[a-z_]+|up)(?![\w:(])")
# The samples a family shows on a page (prometheus_client's exposition): family name + suffix.
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "summary": ("", "_count", "_sum", "_created"), "info": ("",), "stateset": ("",)}


@dataclass(frozen=True)
class Family:
    name: str
    kind: str
    labels: tuple[str, ...]  # "?" where the extraction could not read one


@dataclass(frozen=True)
class MetricNames:
    """The metric families one vLLM version defines (data/vllm_metrics/<version>.txt)."""

    version: str
    families: Mapping[str, Family]

    def series(self) -> dict[str, str]:
        """Each sample name a page can show → its family."""
        return {f.name + s: f.name for f in self.families.values() for s in SUFFIXES[f.kind]}

    def missing(self, names: Iterable[str]) -> list[str]:
        series = self.series()
        return sorted(n for n in set(names) if n not in series and n not in OUTSIDE_VLLM)


def _data_dir() -> Any:
    return resources.files("ernie_deploy") / "data" / "vllm_metrics"


def known_versions() -> list[str]:
    names = [p.name.removesuffix(".txt") for p in _data_dir().iterdir() if p.name.endswith(".txt")]
    return sorted(names, key=parse_version)


def parse_names(text: str, version: str, where: str) -> MetricNames:
    families: dict[str, Family] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 4 or parts[1] not in SUFFIXES:
            raise ConfigError(f"line {number} is not family<TAB>kind<TAB>labels<TAB>path", where=where,
                              hint="regenerate the file with scripts/vllm_metrics.py")
        labels = () if parts[2] == "-" else tuple(parts[2].split(","))
        families.setdefault(parts[0], Family(parts[0], parts[1], labels))
    return MetricNames(version, families)


def metric_names(version: str, where: str = "vllm_version") -> MetricNames:
    """The families of the vLLM release `version` (a local suffix, 0.32.0+cpu, is that release)."""
    wanted = parse_version(version, where)
    for known in known_versions():
        if parse_version(known) == wanted:
            path = _data_dir() / f"{known}.txt"
            return parse_names(path.read_text(encoding="utf-8"), known, f"ernie_deploy/data/vllm_metrics/{known}.txt")
    raise ConfigError(f"no metric names are recorded for vLLM {version} (known: {', '.join(known_versions())})",
                      where=where, hint="extract them from its wheel with scripts/vllm_metrics.py "
                                        "(docs/observability.md), or pin a version that has them")


def names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (vllm:*, process_*, up; functions and labels are not names)."""
    return set(_NAME_IN_EXPR.findall(re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)))


def check_names(exprs: Iterable[str], names: MetricNames, what: str) -> None:
    """Refuse a pack that reads a metric `names.version` does not emit."""
    missing = names.missing(n for e in exprs for n in names_in(e))
    if missing:
        raise ConfigError(f"{what} read{'s' if len(missing) == 1 else ''} {', '.join(missing)}, which vLLM "
                          f"{names.version} does not emit", where=f"ernie_deploy/data/vllm_metrics/{names.version}.txt",
                          hint="use the version's name (the data file lists its families), or regenerate the file "
                               "with scripts/vllm_metrics.py if the version is wrong there")


def release_digest(files: Sequence[RenderedFile]) -> str:
    """The hash part of the release id a deploy of these files records (`<UTC time>-<digest>`, remote/converge.py
    release_id): the label matches `ernie-deploy status`'s release ids by their suffix."""
    return hashlib.sha256("".join(f"{f.path}\0{f.sha256}\n" for f in sorted(files, key=lambda f: f.path))
                          .encode()).hexdigest()[:8]


def scrape_address(plan: HostPlan, inst: InstancePlan) -> str:
    """address:port Prometheus scrapes: the host's address for a wildcard bind, else the bind address."""
    address = plan.address if inst.host in _WILDCARDS else inst.host
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        if not _HOST_NAME.fullmatch(address):
            raise InventoryError(f"instance {inst.unit}'s address {address!r} is neither an IP address nor a host "
                                 "name", where=plan.name,
                                 hint="set ansible_host (or vllm_host) to the address Prometheus reaches it on"
                                 ) from None
        return f"{address}:{inst.port}"
    return f"[{address}]:{inst.port}" if ip.version == 6 else f"{address}:{inst.port}"


def targets(plans: Sequence[HostPlan], releases: Mapping[str, str]) -> list[dict[str, Any]]:
    """file_sd entries: one per instance (https://prometheus.io/docs/prometheus/latest/configuration/
    configuration/#file_sd_config)."""
    entries: list[dict[str, Any]] = []
    seen: dict[str, str] = {}  # address:port → the instance scraped there
    for p in plans:
        for i in p.instances:
            address, name = scrape_address(p, i), f"{p.name} {i.unit}"
            other = seen.setdefault(address, name)
            if other != name:
                raise InventoryError(f"instance {name} is at {address}, as {other} is: Prometheus would scrape one "
                                     "page for both", where=p.name,
                                     hint="give each inventory host its own ansible_host or vllm_port")
            entries.append({"targets": [address], "labels": {
                "host": p.name, "unit": f"{i.unit}.service", "model": i.served_model_name,
                "tp": str(i.tensor_parallel_size), "release": releases[p.name]}})
    return entries


def _seconds(value: float) -> str:
    return f"{max(1, round(value))}s"


def _host_selector(hosts: Sequence[str], every: bool) -> str:
    if every:
        return f'job="{JOB}"'
    pattern = "|".join(re.escape(h) for h in hosts)
    return f'job="{JOB}",host=~"{_promql_string(pattern)}"'


def _promql_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def progress_rules(hosts: Sequence[str], th: Thresholds, every: bool, scrape_s: float) -> list[dict[str, Any]]:
    """Stalled and stuck, as checks/progress.py judges them, over a window long enough for Prometheus."""
    window = max(th.window_s, MIN_SCRAPES * scrape_s)
    r = _seconds(window)
    sel = _host_selector(hosts, every)
    # min_tokens is per progress window: the same rate over the longer range.
    min_tokens = th.min_tokens * window / th.window_s
    return [
        {"alert": "VllmStalled",
         "expr": f"sum by ({BY}) (min_over_time(vllm:num_requests_running{{{sel}}}[{r}])) > 0\n"
                 f"and on (instance)\nsum by ({BY}) (increase(vllm:generation_tokens_total{{{sel}}}[{r}])) "
                 f"< {min_tokens:g}",
         "for": r, "labels": {"severity": "critical"},
         "annotations": {
             "summary": "vLLM {{ $labels.unit }} on {{ $labels.host }} is stalled: requests run, no tokens come out",
             "description": f"Requests ran for all of the last {r} but fewer than {min_tokens:g} tokens were "
                            "generated ({{ $labels.model }}, release {{ $labels.release }}). /health still answers "
                            "200 on a hung engine. Fix: `ernie-deploy restart --limit {{ $labels.host }}` "
                            "(or `watch --restart-stalled`)."}},
        {"alert": "VllmStuck",
         "expr": f"sum by ({BY}) (max_over_time(vllm:num_requests_running{{{sel}}}[{r}])) == 0\n"
                 f"and on (instance)\nsum by ({BY}) (delta(vllm:num_requests_waiting{{{sel}}}[{r}])) "
                 f">= {th.stuck_growth:g}",
         "for": r, "labels": {"severity": "critical"},
         "annotations": {
             "summary": "vLLM {{ $labels.unit }} on {{ $labels.host }} is stuck: the queue grows, nothing runs",
             "description": f"No request ran for {r} while the waiting queue grew by {th.stuck_growth:g} or more. "
                            "Fix: read its journal (`ernie-deploy logs --limit {{ $labels.host }}`), then restart "
                            "it."}},
    ]


def rules(thresholds: Mapping[str, Thresholds], scrape_s: float) -> dict[str, Any]:
    """The rule file (https://prometheus.io/docs/prometheus/latest/configuration/alerting_rules/)."""
    groups: dict[Thresholds, list[str]] = {}
    for host, th in thresholds.items():
        groups.setdefault(th, []).append(host)
    progress = [rule for th, hosts in groups.items() for rule in progress_rules(hosts, th, len(groups) == 1,
                                                                                 scrape_s)]
    sel = f'job="{JOB}"'
    return {"groups": [{"name": "ernie-vllm", "rules": [
        {"alert": "VllmInstanceDown", "expr": f"up{{{sel}}} == 0", "for": DOWN_FOR, "labels": {"severity": "critical"},
         "annotations": {"summary": "vLLM {{ $labels.unit }} on {{ $labels.host }} is down",
                         "description": "Prometheus cannot read {{ $labels.instance }}/metrics. Fix: `ernie-deploy "
                                        "status --limit {{ $labels.host }}` says why."}},
        *progress,
        {"alert": "VllmKvCacheNearlyFull", "expr": f"max by ({BY}) (vllm:kv_cache_usage_perc{{{sel}}}) > {KV_FULL:g}",
         "for": KV_FULL_FOR, "labels": {"severity": "warning"},
         "annotations": {"summary": "vLLM {{ $labels.unit }} on {{ $labels.host }}: KV cache "
                                    "{{ $value | humanizePercentage }} full",
                         "description": f"Above {KV_FULL:.0%} for {KV_FULL_FOR}: new requests wait or preempt others. "
                                        "Fix: more instances of {{ $labels.model }}, or a shorter max_model_len."}},
        {"alert": "VllmRestarted", "expr": f"changes(process_start_time_seconds{{{sel}}}[{RESTART_WINDOW}]) > 0",
         "labels": {"severity": "warning"},
         "annotations": {"summary": "vLLM {{ $labels.unit }} on {{ $labels.host }} restarted",
                         "description": f"Its process start time changed within {RESTART_WINDOW}. A restart nobody "
                                        "ran: read its journal (`ernie-deploy logs --limit {{ $labels.host }}`)."}},
    ]}]}


def rule_exprs(doc: Mapping[str, Any]) -> list[str]:
    return [str(r["expr"]) for g in doc["groups"] for r in g["rules"]]


# (title, unit, [(expr, legend)]): every panel of the dashboard; the filters select the dashboard's variables.
_F = f'job="{JOB}",host=~"$host",model=~"$model"'
PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("Instances up", "none", ((f"up{{{_F}}}", "{{host}} {{unit}}"),)),
    ("Requests running", "none", ((f"sum by (host, unit) (vllm:num_requests_running{{{_F}}})", "{{host}} {{unit}}"),)),
    ("Requests waiting", "none", ((f"sum by (host, unit) (vllm:num_requests_waiting{{{_F}}})", "{{host}} {{unit}}"),)),
    ("Generated tokens / s", "short",
     ((f"sum by (host, unit) (rate(vllm:generation_tokens_total{{{_F}}}[$__rate_interval]))", "{{host}} {{unit}}"),)),
    ("Prompt tokens / s", "short",
     ((f"sum by (host, unit) (rate(vllm:prompt_tokens_total{{{_F}}}[$__rate_interval]))", "{{host}} {{unit}}"),)),
    ("KV cache usage", "percentunit",
     ((f"max by (host, unit) (vllm:kv_cache_usage_perc{{{_F}}})", "{{host}} {{unit}}"),)),
    ("Time to first token", "s", tuple(
        (f"histogram_quantile({q}, sum by (le, model) (rate(vllm:time_to_first_token_seconds_bucket{{{_F}}}"
         f"[$__rate_interval])))", f"p{round(q * 100)} {{{{model}}}}") for q in (0.5, 0.99))),
    ("Inter-token latency", "s", tuple(
        (f"histogram_quantile({q}, sum by (le, model) (rate(vllm:inter_token_latency_seconds_bucket{{{_F}}}"
         f"[$__rate_interval])))", f"p{round(q * 100)} {{{{model}}}}") for q in (0.5, 0.99))),
    ("End-to-end request latency", "s", tuple(
        (f"histogram_quantile({q}, sum by (le, model) (rate(vllm:e2e_request_latency_seconds_bucket{{{_F}}}"
         f"[$__rate_interval])))", f"p{round(q * 100)} {{{{model}}}}") for q in (0.5, 0.99))),
    ("Finished requests / s", "reqps",
     ((f"sum by (model, finished_reason) (rate(vllm:request_success_total{{{_F}}}[$__rate_interval]))",
       "{{model}} {{finished_reason}}"),)),
    ("Preemptions / s", "short",
     ((f"sum by (host, unit) (rate(vllm:num_preemptions_total{{{_F}}}[$__rate_interval]))", "{{host}} {{unit}}"),)),
)


def dashboard(version: str) -> dict[str, Any]:
    """A Grafana dashboard (https://grafana.com/docs/grafana/latest/dashboards/build-dashboards/view-dashboard-json-model/)
    for the instances of one vLLM version; built here from PANELS, not copied from vLLM's."""
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels = [{
        "id": n + 1, "type": "timeseries", "title": title, "datasource": ds,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (n % 2), "y": 8 * (n // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + k), "datasource": ds, "expr": expr, "legendFormat": legend}
                    for k, (expr, legend) in enumerate(queries)],
    } for n, (title, unit, queries) in enumerate(PANELS)]

    def variable(name: str) -> dict[str, Any]:
        return {"name": name, "type": "query", "datasource": ds, "refresh": 2, "includeAll": True, "multi": True,
                "current": {"text": "All", "value": "$__all"}, "allValue": ".*",
                "query": {"query": f'label_values(up{{job="{JOB}"}}, {name})', "refId": name}}

    return {
        "title": f"vLLM {version} (ernie-deploy)", "uid": f"ernie-vllm-{version}".replace(".", "-"),
        "tags": ["vllm", "ernie-deploy"], "schemaVersion": 39, "editable": True, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"}, "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}},
            variable("host"), variable("model")]},
        "panels": panels,
    }


def dashboard_exprs(doc: Mapping[str, Any]) -> list[str]:
    return [str(t["expr"]) for p in doc["panels"] for t in p["targets"]]


def scrape_config(scrape_s: float) -> dict[str, Any]:
    """prometheus.yml (https://prometheus.io/docs/prometheus/latest/configuration/configuration/); its paths are
    relative to the file's own directory."""
    interval = _seconds(scrape_s)
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [RULES],
            "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics",
                                "file_sd_configs": [{"files": [TARGETS], "refresh_interval": "1m"}]}]}


class _Dumper(yaml.SafeDumper):
    """Multi-line text (a rule's expression) as a literal block, as it reads in the rule file."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                             style="|" if "\n" in s else None))


def _yaml(data: Any, header: str) -> str:
    return header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def export_files(plans: Sequence[HostPlan], releases: Mapping[str, str], thresholds: Mapping[str, Thresholds],
                 scrape_s: float = 15.0) -> list[ExportFile]:
    """Every file of the pack. `releases`: each host's release digest (release_digest of its rendered files);
    `thresholds`: each host's progress thresholds (checks/progress.thresholds_of). Raises ConfigError before
    anything is written when a rule or panel reads a metric one of the plan's versions does not emit."""
    if scrape_s <= 0:
        raise ConfigError(f"the scrape interval must be above 0 seconds, got {scrape_s:g}", where="--scrape-interval",
                          hint="give seconds, e.g. 15")
    versions: dict[str, MetricNames] = {}
    for plan in plans:
        names = metric_names(plan.version, f"{plan.name}: vllm_version")
        versions.setdefault(names.version, names)
    rule_doc = rules({p.name: thresholds[p.name] for p in plans}, scrape_s)
    for names in versions.values():
        check_names(rule_exprs(rule_doc), names, f"the alert rules ({RULES})")
    dashboards = {v: dashboard(v) for v in versions}
    for v, doc in dashboards.items():
        check_names(dashboard_exprs(doc), versions[v], f"the Grafana dashboard for vLLM {v}")
    header = "# Written by `ernie-deploy export prometheus` from the plan; a re-export replaces it.\n"
    files = [
        ExportFile(CONFIG, _yaml(scrape_config(scrape_s), header)),
        ExportFile(TARGETS, json.dumps(targets(plans, releases), indent=2) + "\n"),
        ExportFile(RULES, _yaml(rule_doc, header)),
        *(ExportFile(f"grafana/vllm-{v}.json", json.dumps(doc, indent=2) + "\n") for v, doc in dashboards.items()),
    ]
    return files
