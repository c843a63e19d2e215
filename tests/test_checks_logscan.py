"""Log signatures and start-up keyword checks, proven on real vLLM log excerpts (fixtures/logs/real, each
file names its public source) and on the lab simulator's output (fixtures/logs/sim, labelled as such)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ernie_deploy.checks.logscan import check_startup_log, last_start
from ernie_deploy.checks.signatures import intended_stop, load_signatures, parse_signatures, scan, strip_prefix
from ernie_deploy.errors import ConfigError

LOGS = Path(__file__).parent / "fixtures" / "logs"
PKG = Path(__file__).resolve().parent.parent / "ernie_deploy" / "checks"


def read(rel: str) -> list[str]:
    """Fixture lines without the leading `# ` source comment."""
    lines = (LOGS / rel).read_text().splitlines()
    while lines and lines[0].startswith("# "):
        lines.pop(0)
    return lines


def names(rel: str, context: dict | None = None) -> list[str]:
    return [m.signature for m in scan(read(rel), context)]


# --- one real excerpt (or, where none is public, the verified source text) per signature -------------

REAL = [
    ("real/attention-heads-pydantic.log", "attention_heads_tp"),
    ("real/attention-heads-valueerror.log", "attention_heads_tp"),
    ("real/max-model-len-pydantic.log", "max_model_len_too_long"),
    ("real/kv-cache-models-s.log", "kv_cache_too_small"),
    ("real/kv-cache-v0.log", "kv_cache_too_small"),
    ("real/no-kv-cache-memory.log", "no_kv_cache_memory"),
    ("real/no-kv-cache-memory-v0.log", "no_kv_cache_memory"),
    ("real/free-memory.log", "free_memory_on_device"),
    ("real/world-size.log", "world_size_exceeds_gpus"),
    ("real/SOURCE-ONLY-world-size-0.34.log", "world_size_exceeds_gpus"),
    ("real/unsupported-architecture.log", "unsupported_architecture"),
    ("real/SOURCE-ONLY-expert-parallel-dense.log", "expert_parallel_dense"),
    ("real/cuda-oom.log", "cuda_out_of_memory"),
    ("real/address-in-use.log", "address_in_use"),
    ("real/address-in-use-torch.log", "address_in_use"),
    ("real/nccl-error.log", "nccl_error"),
    ("real/engine-dead.log", "engine_dead"),
    ("real/unrecognized-arguments.log", "unrecognized_arguments"),
    ("real/systemd-start-limit.log", "systemd_start_limit"),
    ("real/systemd-restarting.log", "systemd_restarting"),
]


@pytest.mark.parametrize(("fixture", "signature"), REAL)
def test_real_excerpt_matches_its_signature(fixture: str, signature: str) -> None:
    assert signature in names(fixture)


def test_every_signature_has_a_real_or_source_fixture() -> None:
    covered = {s for _, s in REAL} | {"python_traceback"}  # traceback: sim fixtures below + real suppression
    assert {s.name for s in load_signatures()} == covered


SIM_FAULTS = ["address_in_use", "architecture", "attention_heads", "cuda_oom", "expert_parallel", "free_memory",
              "kv_cache", "nccl", "traceback", "world_size"]
SIM_EXPECT = {"address_in_use": "address_in_use", "architecture": "unsupported_architecture",
              "attention_heads": "attention_heads_tp", "cuda_oom": "cuda_out_of_memory",
              "expert_parallel": "expert_parallel_dense", "free_memory": "free_memory_on_device",
              "kv_cache": "kv_cache_too_small", "nccl": "nccl_error", "traceback": "python_traceback",
              "world_size": "world_size_exceeds_gpus"}


@pytest.mark.parametrize("version", ["0.11.0", "0.34.0"])
@pytest.mark.parametrize("fault", SIM_FAULTS)
def test_simulator_fault_is_named_exactly(version: str, fault: str) -> None:
    # The specific root cause only: the trailing "RuntimeError: Engine core initialization failed" traceback
    # is not reported next to it.
    assert names(f"sim/fault-{version}-{fault}.log") == [SIM_EXPECT[fault]]


def test_simulator_max_len_and_unknown_flag() -> None:
    assert names("sim/fault-0.34.0-max_model_len.log") == ["max_model_len_too_long"]
    assert names("sim/fault-0.34.0-unknown_flag.log") == ["unrecognized_arguments"]


HEALTHY = ["sim/healthy-0.34.0-tp2.log", "sim/healthy-0.34.0-tp4.log", "sim/healthy-0.11.0-tp2.log",
           "sim/healthy-0.11.0-tp1.log", "sim/healthy-0.9.2-tp2.log", "real/healthy-kv-0.10.log",
           "real/healthy-kv-0.24.log", "real/healthy-routes-0.11.log", "real/healthy-v0-engine-tp2.log"]


@pytest.mark.parametrize("fixture", HEALTHY)
def test_healthy_startup_matches_nothing(fixture: str) -> None:
    assert names(fixture) == []


# --- what a match carries ---------------------------------------------------------------------------


def test_attention_heads_fix_lists_valid_tp_and_plan_value() -> None:
    [m] = scan(read("real/attention-heads-pydantic.log"), {"tensor_parallel_size": 3})
    assert "1, 2, 4, 8, 16, 32, 64" in m.fix
    assert "the plan has 3" in m.fix
    assert "size 3 does not divide" in m.cause and "64 attention heads" in m.cause


def test_placeholders_from_the_plan_and_unknown_ones_are_visible() -> None:
    [m] = scan(read("real/address-in-use.log"), {"port": 8001, "unit": "vllm-ernie-0.service"})
    assert "sport = :8001" in m.fix and "vllm-ernie-0.service" in m.fix
    [bare] = scan(read("real/address-in-use.log"))
    assert "<port>" in bare.fix


def test_max_len_fix_names_the_derived_limit() -> None:
    [m] = scan(read("sim/fault-0.34.0-max_model_len.log"))
    assert "at most" not in m.fix and "131072 or less" in m.fix
    assert m.headline.startswith("Value error, User-specified max_model_len (200000)")


def test_traceback_evidence_ends_with_the_exception_line() -> None:
    [m] = scan(read("sim/fault-0.34.0-traceback.log"))
    assert m.signature == "python_traceback"
    assert m.lines[0].endswith("Traceback (most recent call last):")
    assert any("AttributeError: 'NoneType' object has no attribute 'shape'" in line for line in m.lines)
    assert "AttributeError" in m.cause
    assert m.count == 3  # worker log, stderr copy, API server's RuntimeError


def test_generic_traceback_is_suppressed_by_a_specific_cause_in_a_real_log() -> None:
    assert names("real/address-in-use.log") == ["address_in_use"]
    assert names("real/attention-heads-valueerror.log") == ["attention_heads_tp"]


def test_restart_counter_is_a_warning_and_start_limit_a_failure() -> None:
    found = {m.signature: m.severity for m in scan(read("real/systemd-start-limit.log"))}
    assert found == {"systemd_restarting": "warn", "systemd_start_limit": "fail"}


def test_journal_prefixes_are_stripped() -> None:
    raw = ("Dec 02 18:45:58 gpu-a10-01 vllm[22283]: (Worker_TP0 pid=22283) ERROR 12-02 18:45:58 "
           "[multiproc_executor.py:597]   File \"x.py\", line 1")
    assert strip_prefix(raw) == '  File "x.py", line 1'
    assert strip_prefix("2025-12-02T18:45:58+0000 host vllm[1]: INFO 12-02 18:45:58 [core.py:1] hi") == "hi"
    assert strip_prefix("(VllmWorkerProcess pid=1) ERROR 07-24 14:07:40 worker.py:226] boom") == "boom"


def test_journal_formatted_log_still_matches() -> None:
    lines = [f"Dec 02 18:45:58 gpu-a10-01 vllm[1]: {line}" for line in read("sim/fault-0.34.0-nccl.log")]
    assert [m.signature for m in scan(lines)] == ["nccl_error"]


def test_bad_signature_file_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="invalid regular expression"):
        parse_signatures({"signatures": [{"name": "x", "regex": "(", "cause": "c", "fix": "f"}]}, "test.yml")
    with pytest.raises(ConfigError, match="unknown key"):
        parse_signatures({"signatures": [{"name": "x", "regex": "a", "cause": "c", "fix": "f", "bogus": 1}]}, "t")


# --- check_startup_log ------------------------------------------------------------------------------


def by_name(results: list) -> dict:
    return {r.name: r for r in results}


def test_healthy_tp2_passes_everything() -> None:
    res = by_name(check_startup_log(read("sim/healthy-0.34.0-tp2.log"), tp=2, max_model_len=None,
                                    kv_tokens_estimate=2_200_000))
    assert {r.status for r in res.values()} == {"pass"}
    tp = res["tensor_parallel"]
    assert tp.summary.startswith("Using tensor parallel size 2 ✓ (")
    # vLLM never prints that phrase: the evidence it stands on is in the summary itself.
    assert "tensor_parallel_size=2" in tp.summary and "Worker_TP0, Worker_TP1 started" in tp.summary
    assert "tensor_parallel_size=2" in tp.evidence[0]
    assert sum("Worker_TP" in e for e in tp.evidence) == 2
    assert "131072" in res["max_model_len"].summary
    assert "17.07x" in res["kv_cache"].summary


@pytest.mark.parametrize("fixture", ["sim/healthy-0.11.0-tp1.log"])
def test_tp1_without_workers_does_not_fail(fixture: str) -> None:
    res = by_name(check_startup_log(read(fixture), tp=1, max_model_len=None, kv_tokens_estimate=None))
    assert res["tensor_parallel"].status == "pass"
    assert res["tensor_parallel"].summary.startswith("Using tensor parallel size 1 ✓ (")


def test_092_worker_prefix_counts_ranks() -> None:
    res = by_name(check_startup_log(read("sim/healthy-0.9.2-tp2.log"), tp=2, max_model_len=None,
                                    kv_tokens_estimate=None))
    assert res["tensor_parallel"].status == "pass"


def test_tp_mismatch_plan_2_vllm_4() -> None:
    res = by_name(check_startup_log(read("sim/healthy-0.34.0-tp4.log"), tp=2, max_model_len=4096,
                                    kv_tokens_estimate=None))
    tp = res["tensor_parallel"]
    assert tp.status == "fail"
    assert tp.summary.startswith("plan says TP 2, vLLM uses TP 4 (engine config line: ")
    assert "tensor_parallel_size=4" in tp.summary


def test_worker_count_mismatch() -> None:
    lines = [line for line in read("sim/healthy-0.34.0-tp4.log") if "(Worker_TP3 " not in line]
    tp = by_name(check_startup_log(lines, tp=4, max_model_len=4096, kv_tokens_estimate=None))["tensor_parallel"]
    assert tp.status == "fail"
    assert "3 TP worker process(es): Worker_TP0, Worker_TP1, Worker_TP2" in tp.summary


def test_034_rank_lines_cross_check_the_workers() -> None:
    # 0.34's rank line adds PCP, ETP and EPLB ranks (source-text fixture from the 0.34.0 wheel).
    lines = read("real/SOURCE-ONLY-rank-line-0.34.log")
    assert names("real/SOURCE-ONLY-rank-line-0.34.log") == []
    res = by_name(check_startup_log(lines, tp=2, max_model_len=32768, kv_tokens_estimate=None))
    tp = res["tensor_parallel"]
    assert tp.status == "pass" and tp.summary.startswith("Using tensor parallel size 2 ✓ (")
    assert [e.split(")")[0] for e in tp.evidence[1:]] == ["(Worker_TP0 pid=4251", "(Worker_TP1 pid=4252"]
    assert "PCP rank 0, TP rank 1, ETP rank 1" in tp.evidence[2]
    assert res["max_model_len"].status == "pass"
    missing = [line for line in lines if "(Worker_TP1 " not in line]
    tp = by_name(check_startup_log(missing, tp=2, max_model_len=None, kv_tokens_estimate=None))["tensor_parallel"]
    assert tp.status == "fail" and "1 TP worker process(es): Worker_TP0" in tp.summary


@pytest.mark.parametrize("form", [
    "rank {r} in world size 2 is assigned as DP rank 0, PP rank 0, TP rank {r}, EP rank {r}",  # 0.11.0
    "rank {r} in world size 2 is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank {r}, ETP rank {r}, "
    "EP rank N/A, EPLB rank N/A",  # 0.34.0
])
def test_rank_lines_count_ranks_without_worker_prefixes(form: str) -> None:
    head = read("real/SOURCE-ONLY-rank-line-0.34.log")[:2]
    both = [f"INFO 07-06 22:51:55 [parallel_state.py:1] {form.format(r=r)}" for r in (0, 1)]
    tp = by_name(check_startup_log(head + both, tp=2, max_model_len=None, kv_tokens_estimate=None))["tensor_parallel"]
    assert tp.status == "pass" and tp.evidence[1:] == tuple(both)
    tp = by_name(check_startup_log(head + both[:1], tp=2, max_model_len=None,
                                   kv_tokens_estimate=None))["tensor_parallel"]
    assert tp.status == "fail" and "1 TP worker process(es)" in tp.summary


def test_guide_form_is_accepted_and_cross_checked() -> None:
    good = by_name(check_startup_log(["INFO 01-01 00:00:00 [x.py:1] Using tensor parallel size 1"], tp=1,
                                     max_model_len=None, kv_tokens_estimate=None))["tensor_parallel"]
    assert good.status == "pass"
    bad = by_name(check_startup_log(["Using tensor parallel size 4"], tp=2, max_model_len=None,
                                    kv_tokens_estimate=None))["tensor_parallel"]
    assert bad.status == "fail" and "vLLM uses TP 4" in bad.summary


def test_real_v0_engine_line_gives_tp_and_len() -> None:
    res = by_name(check_startup_log(read("real/healthy-v0-engine-tp2.log"), tp=2, max_model_len=32700,
                                    kv_tokens_estimate=None))
    assert res["tensor_parallel"].status == "warn"  # TP 2 confirmed, but no Worker_TP lines in the excerpt
    assert res["max_model_len"].status == "pass"


def test_wrong_context_length() -> None:
    ml = by_name(check_startup_log(read("sim/healthy-0.34.0-tp4.log"), tp=4, max_model_len=8192,
                                   kv_tokens_estimate=None))["max_model_len"]
    assert ml.status == "fail"
    assert ml.summary.startswith("plan says max_model_len 8192, vLLM uses 4096")


def test_kv_estimate_off_by_half_warns_quoting_both() -> None:
    kv = by_name(check_startup_log(read("real/healthy-kv-0.24.log"), tp=1, max_model_len=None,
                                   kv_tokens_estimate=1_135_956))["kv_cache"]
    assert kv.status == "warn"
    assert "567,978" in kv.summary and "1,135,956" in kv.summary and "-50%" in kv.summary
    assert "4.33x at 131,072" in kv.summary


def test_kv_within_tolerance_passes_two_line_real_form() -> None:
    kv = by_name(check_startup_log(read("real/healthy-kv-0.10.log"), tp=1, max_model_len=None,
                                   kv_tokens_estimate=1_000_000))["kv_cache"]
    assert kv.status == "pass" and "922,496" in kv.summary and "23.06x" in kv.summary


def test_expect_and_forbid_with_placeholders() -> None:
    res = check_startup_log(read("sim/healthy-0.34.0-tp2.log"), tp=2, max_model_len=None, kv_tokens_estimate=None,
                            expect=[r"tensor_parallel_size={tensor_parallel_size}\b", r"served_model_name={name}",
                                    "Resolved architecture: Ernie4_5_ForCausalLM"],
                            forbid=["Custom allreduce is disabled", r"served_model_name={name}"],
                            values={"tensor_parallel_size": 2, "name": "ernie"})
    status = {r.name: r.status for r in res}
    assert status[r"expect tensor_parallel_size={tensor_parallel_size}\b"] == "pass"
    assert status["expect served_model_name={name}"] == "pass"
    assert status["expect Resolved architecture: Ernie4_5_ForCausalLM"] == "fail"
    assert status["forbid Custom allreduce is disabled"] == "pass"
    assert status["forbid served_model_name={name}"] == "fail"


def test_placeholder_value_is_literal_not_regex() -> None:
    res = check_startup_log(["served_model_name=ernieX5"], tp=1, max_model_len=None, kv_tokens_estimate=None,
                            expect=["served_model_name={name}"], values={"name": "ernie.5"})
    assert res[3].status == "fail"


def test_bad_regex_and_unknown_placeholder_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"expect pattern 'Using \(tp' is not a valid regular expression"):
        check_startup_log([], tp=1, max_model_len=None, kv_tokens_estimate=None, expect=["Using (tp"])
    with pytest.raises(ConfigError, match=r"unknown placeholder \{tp\}"):
        check_startup_log([], tp=1, max_model_len=None, kv_tokens_estimate=None, forbid=["x{tp}"])


def test_fatal_signature_fails_with_cause_and_fix() -> None:
    res = by_name(check_startup_log(read("sim/fault-0.34.0-attention_heads.log"), tp=3, max_model_len=None,
                                    kv_tokens_estimate=None, context={"unit": "vllm-ernie-0.service"}))
    fatal = res["startup_errors"]
    assert fatal.status == "fail"
    assert fatal.summary.startswith("attention_heads_tp: ValueError: Total number of attention heads (16)")
    assert fatal.fix and "1, 2, 4, 8, 16" in fatal.fix
    assert res["kv_cache"].status == "warn"  # never got that far


def test_keyword_checks_read_the_last_start_only() -> None:
    old = read("sim/healthy-0.34.0-tp4.log")
    new = read("sim/healthy-0.34.0-tp2.log")
    assert last_start(old + new) == len(old)
    res = by_name(check_startup_log(old + new, tp=2, max_model_len=None, kv_tokens_estimate=None))
    assert res["tensor_parallel"].status == "pass"


def test_checks_package_is_pure() -> None:
    forbidden = {"rich", "paramiko", "fabric", "subprocess", "socket", "requests", "urllib", "time", "datetime"}
    for path in PKG.glob("*.py"):
        mods = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods.add(node.module.split(".")[0])
        assert not mods & forbidden, f"{path.name} imports {mods & forbidden}"


def test_the_allowed_long_length_warning_is_not_a_fatal_error() -> None:
    """With VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 vLLM logs the error's first sentence as a warning and starts: only
    the error form (which goes on with 'To allow overriding ...') is fatal."""
    from ernie_deploy.checks.signatures import scan

    warning = ("(APIServer pid=1) WARNING 12-03 16:00:00 [model.py:2722] User-specified max_model_len (200000) is "
               "greater than the derived max_model_len (max_position_embeddings=131072 or model_max_length=None in "
               "model's config.json). VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model "
               "uses relative position encoding (RoPE), positions exceeding derived_max_model_len lead to nan.")
    assert [m for m in scan([warning]) if m.severity == "fail"] == []
    fatal = [m.signature for m in scan(read("real/max-model-len-pydantic.log")) if m.severity == "fail"]
    assert "max_model_len_too_long" in fatal


# --- an intended stop is a shutdown, not a crash -----------------------------------------------------

STOP = "real/stop-abort-0.32.log"
TRIGGER = "[shutdown] API server: shutdown triggered"
# systemd's own lines around a `systemctl stop` of the unit, as `journalctl -o short-iso` prints them (systemd 252+
# puts the unit's name before its description).
SYSTEMD_STOPPING = ("2026-12-05T10:04:43+0000 gpu-a10-01 systemd[1]: Stopping ernie-vllm-0.service - vLLM serving "
                    "ernie on port 8000 (ernie-deploy ernie-vllm-0)...")
SYSTEMD_STOPPED = ("2026-12-05T10:04:44+0000 gpu-a10-01 systemd[1]: ernie-vllm-0.service: Deactivated successfully.",
                   "2026-12-05T10:04:44+0000 gpu-a10-01 systemd[1]: Stopped ernie-vllm-0.service - vLLM serving ernie "
                   "on port 8000 (ernie-deploy ernie-vllm-0).")
# vLLM 0.32.0 v1/executor/multiproc_executor.py:316, logged by the EngineCore's worker monitor (source text).
WORKER_DIED = ("(EngineCore pid=2837) ERROR 12-05 10:04:43 [multiproc_executor.py:316] Worker proc VllmWorker-0 died "
               "unexpectedly (exit code: -9), shutting down executor.")


def stop_log() -> list[str]:
    return read(STOP)


def at_trigger(lines: list[str]) -> int:
    return next(i for i, line in enumerate(lines) if TRIGGER in line)


def test_a_real_aborted_stop_is_a_shutdown_not_a_fatal_error() -> None:
    """systemctl stop of real vLLM 0.32 with a stream in flight: its EngineDeadError tracebacks are the abort."""
    lines = stop_log()
    assert sum("EngineDeadError" in line for line in lines) == 2  # the output handler's and the stream's, at ERROR
    assert names(STOP) == []
    res = by_name(check_startup_log(lines, tp=1, max_model_len=None, kv_tokens_estimate=None))
    fatal = res["startup_errors"]
    assert fatal.status == "pass", fatal.summary
    assert "stopped on request ([shutdown] API server: shutdown triggered)" in fatal.summary
    assert "engine_dead" in fatal.summary and "not a crash" in fatal.summary
    assert fatal.evidence == (next(line for line in lines if TRIGGER in line),)
    stop = intended_stop(lines)
    assert stop is not None and stop.quiet == ("engine_dead", "python_traceback")


def test_the_same_stop_in_the_journal_and_by_systemd_alone() -> None:
    """As journalctl shows it, with systemd's lines; and without vLLM's trigger line (a vLLM that does not log
    it), systemd's "Stopping ..." alone says the stop was asked for."""
    lines = [f"2026-12-05T10:04:43+0000 gpu-a10-01 vllm[2776]: {line}" for line in stop_log()]
    at = at_trigger(lines)
    journal = [*lines[:at], SYSTEMD_STOPPING, *lines[at:], *SYSTEMD_STOPPED]
    assert [m.signature for m in scan(journal)] == []
    systemd_only = [line for line in journal if TRIGGER not in line]
    assert [m.signature for m in scan(systemd_only)] == []
    stop = intended_stop(systemd_only)
    assert stop is not None and stop.headline.startswith("Stopping ernie-vllm-0.service")
    plain = stop_log()  # as `journalctl -o cat` prints it: systemd's line has no prefix either
    assert [m.signature for m in scan([*plain[:at], SYSTEMD_STOPPING.split(": ", 1)[1], *plain[at + 1:]])] == []


def test_vllm_lines_that_look_like_a_stop_are_not_one() -> None:
    """vLLM's own "Stopping profiler..." (0.34.0 serve/profile/api_router.py) is no stop of the unit."""
    lines = [line for line in stop_log() if TRIGGER not in line]
    at = next(i for i, line in enumerate(lines) if "stopping engine client" in line)
    profiler = "(APIServer pid=2776) INFO 12-05 10:04:43 [api_router.py:54] Stopping profiler..."
    assert "engine_dead" in [m.signature for m in scan([*lines[:at], profiler, *lines[at:]])]
    assert intended_stop([*lines[:at], profiler, *lines[at:]]) is None


def test_an_engine_death_during_the_stop_is_still_a_crash() -> None:
    """A worker dying while the engine drains (or before the stop) is a death: vLLM never logs these lines when
    it stops on purpose, so the EngineDeadError lines after it are the death's."""
    lines = stop_log()
    at = at_trigger(lines)
    during = [*lines[:at + 1], WORKER_DIED, *lines[at + 1:]]
    assert [m.signature for m in scan(during)] == ["engine_dead"]
    stop = intended_stop(during)
    assert stop is not None and stop.quiet == ()  # nothing after the death is the stop's
    before = [*lines[:at], WORKER_DIED, *lines[at:]]
    assert [m.signature for m in scan(before)] == ["engine_dead"]
    res = by_name(check_startup_log(during, tp=1, max_model_len=None, kv_tokens_estimate=None))
    assert res["startup_errors"].status == "fail" and res["startup_errors"].summary.startswith("engine_dead: ")


def test_a_crash_before_the_stop_is_still_a_crash() -> None:
    """The real engine death (no stop asked for) and a stop asked for after it: the death stays a failure."""
    dead = read("real/engine-dead.log")
    assert [m.signature for m in scan([*dead, SYSTEMD_STOPPING, *SYSTEMD_STOPPED])] == ["engine_dead"]


# Real vLLM stopped by SIGTERM after a healthy start: the given capture, and the abort and drain stops
# scripts/capture-real-vllm records (serve-*.log) as they arrive.
REAL_STOPS = [LOGS / STOP, *sorted((LOGS.parent / "real-vllm").glob("*/serve-*.log"))]


@pytest.mark.parametrize("log", REAL_STOPS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_real_stops_have_no_fatal_line(log: Path) -> None:
    lines = log.read_text(errors="replace").splitlines()
    assert [m.signature for m in scan(lines)] == []
    assert intended_stop(lines) is not None


def test_a_real_drain_refusing_a_new_request_is_the_stop_too() -> None:
    """--shutdown-timeout 30: a request that arrives during the drain is answered 500 with an ASGI traceback
    (`RuntimeError: cannot schedule new futures after shutdown`), and the stream still running at the timeout
    is cut with an EngineDeadError: both are the stop's."""
    real = LOGS.parent / "real-vllm" / "0.32.0"
    refused = (real / "serve-tp1-drain.run3.log").read_text().splitlines()
    assert any("RuntimeError: cannot schedule new futures after shutdown" in line for line in refused)
    stop = intended_stop(refused)
    assert scan(refused) == [] and stop is not None and stop.quiet == ("python_traceback",)
    cut = (real / "serve-tp1-drain.log").read_text().splitlines()
    assert any("stopping engine client mode=drain timeout=30s" in line for line in cut)
    stop = intended_stop(cut)
    assert scan(cut) == [] and stop is not None and stop.quiet == ("engine_dead", "python_traceback")


def test_a_stop_of_an_earlier_run_does_not_excuse_a_later_one() -> None:
    """Lines of two runs (the stopped one, then a new start that crashes): only the first run was stopped."""
    lines = stop_log()
    again = [next(line for line in lines if "non-default args" in line), *read("real/engine-dead.log")]
    assert [m.signature for m in scan([*lines, *again])] == ["engine_dead"]
    assert intended_stop([*lines, *again]) is None
