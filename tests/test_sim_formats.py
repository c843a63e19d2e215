"""Every line the simulated vLLM logs is a line real vLLM can log: checked against vLLM's own format strings.

tests/fixtures/vllm-formats/<version>.txt holds the logger format strings of that release's wheel
(scripts/vllm_formats.py; header: wheel file name and sha256). For each version with such a fixture the
simulator is run through every profile in `scenarios` (healthy start-ups at TP 1, 2 and 4, every
`fail_startup` value, the runtime knobs that log something, argparse and config errors), and the committed
simulator fixtures of that version (tests/fixtures/logs/sim/) are read too. Every line must be one of:

1. A logger record, `[(PROC pid=N) ]LEVEL MM-DD HH:MM:SS [FILE:LINE] MESSAGE`: some format of that version
   whose path ends in FILE, logged at LEVEL, matches MESSAGE (`%s` matches any text, `%d` an integer, `%.2f`
   a number, ...). vLLM's formatter repeats the header on every line of a multi-line message, so consecutive
   lines with the same header are split into records that each match one (possibly multi-line) format.
   LINE is not checked (the simulator's line numbers are approximate, see the sim README).
2. Exempt, because it is not a vLLM logger record:
   a. traceback text: `Traceback (most recent call last):`, its `File "...", line N, in f` frames with their
      source lines, the chaining lines (`During handling of the above exception ...`, `The above exception
      was the direct cause ...`), and the exception line(s) that end it, up to the next logger record. This
      covers tracebacks that `logger.exception` / `exc_info` append to a record (the header lines after the
      record's `Traceback` line), tracebacks Python prints for an uncaught exception, and the `Process NAME:`
      line multiprocessing prints right before a child's traceback;
   b. argparse's `usage: ...` lines (with their indented continuation lines) and its `PROG: error: ...` line;
   c. uvicorn's own lines (`INFO:     Started server process [N]`, `INFO:     Shutting down`, access lines
      such as `INFO:     127.0.0.1:5000 - "GET /health HTTP/1.1" 200 OK`), which uvicorn formats itself.
   The `(PROC pid=N) ` prefix vLLM's decorate_logs puts on those lines is ignored.
Anything else fails the test, with the line and the closest formats of its file.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import re
import signal
import subprocess
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from simlogs import REPO, SIM_DIR, Scenario, _free_port, _setup, _wait_for, fixture_scenarios, run_all, sim_env

FORMATS_DIR = Path(__file__).parent / "fixtures" / "vllm-formats"
VERSIONS = sorted(p.stem for p in FORMATS_DIR.glob("*.txt"))

_PREFIX = re.compile(r"^\((?P<proc>[\w ]+?)(?: rank=\d+)? pid=\d+\) ")
_HEADER = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<stamp>\d\d-\d\d \d\d:\d\d:\d\d) "
                     r"\[(?P<file>[^\]\s]+?):(?P<lineno>\d+)\] (?P<msg>.*)$")
_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?(?P<type>[diouxXeEfFgGcrsa%])")
_NUMBER = r"\s*[-+]?(?:\d[\d_]*(?:\.\d*)?(?:[eE][-+]?\d+)?|inf|nan)"
_TYPES = {"d": r"\s*[-+]?\d+", "i": r"\s*[-+]?\d+", "u": r"\s*[-+]?\d+", "o": r"\s*[-+]?[0-7]+",
          "x": r"\s*[-+]?(?:0x)?[0-9a-f]+", "X": r"\s*[-+]?(?:0X)?[0-9A-F]+", "c": ".",
          "s": ".*?", "r": ".*?", "a": ".*?", "%": "%"} | dict.fromkeys("eEfFgG", _NUMBER)
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:")
_UVICORN = re.compile(r"^(?:INFO|WARNING|ERROR|DEBUG|CRITICAL|TRACE):\s{2,}\S")
_ARGPARSE_ERROR = re.compile(r"^[\w.-]+(?: [\w.-]+)*: error: ")


def unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r", "t": "\t"}.get(m.group(1), m.group(1)), text)


def to_regex(fmt: str) -> re.Pattern[str]:
    """A logging %-format as a regex over the rendered message (whole match; placeholders may span lines)."""
    out, pos = [], 0
    for m in _SPEC.finditer(fmt):
        out.append(re.escape(fmt[pos:m.start()]))
        out.append(_TYPES[m.group("type")])
        pos = m.end()
    out.append(re.escape(fmt[pos:]))
    return re.compile("".join(out), re.DOTALL)


@dataclass(frozen=True)
class Format:
    path: str
    level: str
    text: str
    regex: re.Pattern[str]


# Formats the extractor cannot read, written out by hand: 0.32's start-up logo is a string.Template substituted
# with the colour codes before it is logged (0.32.0 entrypoints/serve/utils/api_utils.py:325-347, the
# monochrome form; captured in tests/fixtures/real-vllm/0.32.0/).
NOT_EXTRACTED = {
    "0.32.0": ["vllm/entrypoints/serve/utils/api_utils.py\tINFO\t\\n       █     █     █▄   ▄█\\n"
               " ▄▄ ▄█ █     █     █ ▀▄▀ █  version %s\\n  █▄█▀ █     █     █     █  model   %s\\n"
               "   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀\\n"],
}


@cache
def formats(version: str) -> dict[str, list[Format]]:
    """File name (what `[file:line]` shows) -> that file's formats."""
    by_file: dict[str, list[Format]] = {}
    lines = (FORMATS_DIR / f"{version}.txt").read_text().splitlines() + NOT_EXTRACTED.get(version, [])
    for line in lines:
        if line.startswith("#") or not line.strip():
            continue
        path, level, fmt = line.split("\t", 2)
        text = unescape(fmt)
        by_file.setdefault(path.rsplit("/", 1)[-1], []).append(Format(path, level, text, to_regex(text)))
    return by_file


@dataclass(frozen=True)
class Line:
    number: int
    text: str  # as printed
    body: str  # without the (PROC pid=N) prefix
    header: tuple[str, ...] | None  # (prefix, level, stamp, file, lineno) of a logger record
    msg: str


def parse(text: str) -> list[Line]:
    out = []
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("# "):
            continue  # a fixture's header comment
        pm = _PREFIX.match(raw)
        body = raw[pm.end():] if pm else raw
        hm = _HEADER.match(body)
        header = (pm.group(0) if pm else "", *hm.group("level", "stamp", "file", "lineno")) if hm else None
        out.append(Line(number, raw, body, header, hm.group("msg") if hm else body))
    return out


def _segment(msgs: list[str], candidates: list[Format]) -> list[Format] | None:
    """Split consecutive messages into records that each match one format (None: no such split)."""
    best: dict[int, list[Format] | None] = {len(msgs): []}
    for start in range(len(msgs) - 1, -1, -1):
        best[start] = None
        for end in range(start + 1, len(msgs) + 1):
            rest = best[end]
            if rest is None:
                continue
            record = "\n".join(msgs[start:end])
            hit = next((f for f in candidates if f.regex.fullmatch(record)), None)
            if hit:
                best[start] = [hit, *rest]
                break
    return best[0]


def _blocks(lines: list[Line]) -> Iterator[list[Line]]:
    """Runs of lines: logger lines with one header together, every other line on its own."""
    block: list[Line] = []
    for line in lines:
        if block and (line.header is None or line.header != block[0].header):
            yield block
            block = []
        block.append(line)
        if line.header is None:
            yield block
            block = []
    if block:
        yield block


def violations(text: str, version: str) -> tuple[list[str], int, int]:
    """(problems, lines matched to a format, exempt lines) for a log text."""
    table = formats(version)
    problems: list[str] = []
    matched = exempt = 0
    in_traceback = in_usage = False
    for block in _blocks(parse(text)):
        first = block[0]
        if first.header is None:
            body = first.body
            in_usage = body.startswith("usage: ") or (in_usage and body.startswith(" "))
            if in_usage:
                exempt += 1
            elif body == _TRACEBACK or body.startswith("  File ") or body in _CHAINED:
                in_traceback = in_traceback or body == _TRACEBACK
                exempt += 1
            elif in_traceback or _UVICORN.match(body) or _ARGPARSE_ERROR.match(body):
                exempt += 1
            elif re.fullmatch(r"Process [\w-]+:", body):
                exempt += 1  # multiprocessing's header before a child's traceback
            else:
                problems.append(f"line {first.number}: not a logger record and not exempt: {first.text}")
            continue
        in_traceback = False
        msgs = [line.msg for line in block]
        cut = msgs.index(_TRACEBACK) if _TRACEBACK in msgs else len(msgs)
        exempt += len(msgs) - cut
        _, level, _, file, _ = first.header
        candidates = [f for f in table.get(file, []) if f.level in (level, "*")]
        split = _segment(msgs[:cut], candidates) if cut else []
        if split is None:
            near = sorted(table.get(file, []), key=lambda f: -_common_prefix(f.text, msgs[0]))[:3]
            hint = "; ".join(f"{f.level} {f.path}: {f.text!r}" for f in near) or f"no formats for {file}"
            problems.append(f"line {first.number}: {first.text}\n    closest formats: {hint}")
        else:
            matched += cut
    return problems, matched, exempt


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --- what the simulator is run through ----------------------------------------------------------------

FAULTS = ("architecture", "max_model_len", "world_size", "attention_heads", "expert_parallel", "free_memory",
          "nccl", "moe_tp", "cuda_oom", "kv_cache", "address_in_use", "traceback")


def scenarios(version: str) -> dict[str, Scenario]:
    out: dict[str, Scenario] = {}
    for tp in (1, 2, 4):
        out[f"healthy-tp{tp}"] = Scenario(version, ("--tensor-parallel-size", str(tp)), drive="serve")
    out["healthy-tp4-nvlink"] = Scenario(version, ("-tp", "4", "--max-model-len", "4096"), drive="serve",
                                         nvlink=True)
    out["healthy-tp3-unsupported-allreduce"] = Scenario(version, ("-tp", "3"), drive="serve", config="heads-12")
    out["healthy-eager"] = Scenario(version, ("--enforce-eager",), drive="serve")
    out["healthy-no-max-len-key"] = Scenario(version, (), drive="serve", config="no-max-len")
    out["healthy-long-len-allowed"] = Scenario(version, ("--max-model-len", "140000"), drive="serve",
                                               env=(("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1"),))
    if tuple(int(x) for x in version.split(".")) >= (0, 34):
        out["healthy-auto-len"] = Scenario(version, ("--max-model-len", "auto"), drive="serve")
        out["healthy-auto-len-reduced"] = Scenario(
            version, ("--max-model-len", "auto", "--gpu-memory-utilization", "0.12"), drive="serve")
    for tp in (1, 2):
        for fault in FAULTS:
            out[f"fault-{fault}-tp{tp}"] = Scenario(version, ("-tp", str(tp)), faults={"fail_startup": fault},
                                                    config="moe" if fault == "moe_tp" else "ernie")
    out["crash_after_s"] = Scenario(version, ("-tp", "2"), faults={"crash_after_s": 0.3, "health_503": True},
                                    drive="crash")
    out["hang_loading-sigterm"] = Scenario(version, (), faults={"hang_loading": True}, drive="interrupt")
    out["max-len-too-long"] = Scenario(version, ("--max-model-len", "200000"))
    out["kv-cache-too-small"] = Scenario(version, ("--gpu-memory-utilization", "0.12", "--enforce-eager"))
    out["no-kv-memory"] = Scenario(version, ("--gpu-memory-utilization", "0.05",))
    out["ray-backend"] = Scenario(version, ("--distributed-executor-backend", "ray"))
    out["unknown-flag"] = Scenario(version, ("--bogus-flag", "1"))
    return out


def sim_fixtures(version: str) -> list[str]:
    return sorted(name for name, (sc, _) in fixture_scenarios().items() if sc.version == version)


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    """Every scenario of every checked version, run once for the module (in parallel)."""
    runs = {f"{v}/{name}": sc for v in VERSIONS for name, sc in scenarios(v).items()}
    return run_all(runs)


def test_formats_fixtures_exist_with_their_wheel() -> None:
    assert {"0.11.0", "0.34.0"} <= set(VERSIONS)
    for version in VERSIONS:
        head = (FORMATS_DIR / f"{version}.txt").read_text().splitlines()[:4]
        assert head[0].startswith(f"# vLLM {version} logger formats")
        assert re.search(r"sha256 [0-9a-f]{64}", "\n".join(head))


@pytest.mark.parametrize(("version", "name"), [(v, n) for v in VERSIONS for n in scenarios(v)])
def test_simulator_lines_are_real_formats(outputs: dict[str, str], version: str, name: str) -> None:
    text = outputs[f"{version}/{name}"]
    problems, matched, _ = violations(text, version)
    assert not problems, f"{version} {name}:\n" + "\n".join(problems) + f"\n--- output ---\n{text}"
    assert matched > 0 or name == "unknown-flag", text  # argparse exits before vLLM logs anything


@pytest.mark.parametrize(("version", "fixture"), [(v, f) for v in VERSIONS for f in sim_fixtures(v)])
def test_committed_sim_fixtures_are_real_formats(version: str, fixture: str) -> None:
    problems, _, _ = violations((SIM_DIR / fixture).read_text(), version)
    assert not problems, f"{fixture} (regenerate: .venv/bin/python tests/simlogs.py):\n" + "\n".join(problems)


def test_checker_catches_a_wrong_line() -> None:
    good = "(Worker_TP0 pid=7) INFO 01-01 00:00:00 [parallel_state.py:1] "
    assert violations("(APIServer pid=1) INFO 01-01 00:00:00 [model.py:1] Using max model len 4096", "0.34.0")[0] == []
    assert violations("(APIServer pid=1) INFO 01-01 00:00:00 [gpu_model_runner.py:1] Using max model len 4096",
                      "0.34.0")[0]  # right message, wrong file
    assert violations("(APIServer pid=1) WARNING 01-01 00:00:00 [model.py:1] Using max model len 4096",
                      "0.34.0")[0]  # wrong level
    assert violations(good + "rank 0 in world size 2 is assigned as DP rank 0, PP rank 0, TP rank 0, EP rank 0",
                      "0.34.0")[0]
    assert violations("some stray print", "0.34.0")[0]
    exempt = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    boom()\n"
              "ValueError: boom\nINFO:     Started server process [1]\nusage: vllm serve [model_tag] [options]\n"
              "vllm serve: error: unrecognized arguments: --x")
    assert violations(exempt, "0.34.0") == ([], 0, 7)


def test_extractor_rules_on_a_small_wheel(tmp_path: Path) -> None:
    """scripts/vllm_formats.py on a hand-made wheel: each source form becomes the documented %-format."""
    spec = importlib.util.spec_from_file_location("vllm_formats", FORMATS_DIR.parents[2] / "scripts/vllm_formats.py")
    assert spec and spec.loader
    extractor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extractor)
    source = '''
logger = init_logger(__name__)
def f(x, lgr):
    msg = f"User {x} is long."
    logger.info("Using max model len %s", x)
    logger.info("100% done")
    logger.warning_once("%s %s", msg, "Careful.")
    logger.debug("not kept %s", x)
    logger.info(f"took {x:.2f} s, 5% off")
    logger.error("a " + ("b" if x else "c") + " %d", x)
    logger.info("{} items".format(x))
    logger.info(x)
    lgr.info("vLLM server version %s", x)
    logger.exception("line one\\nline two")
def g(backend="nccl"):
    if backend == "cpu":
        backend = "gloo"
    logger.info("backend=%s", backend)
'''
    wheel = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("vllm-9.9.9.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
        zf.writestr("vllm/x.py", source)
    version, lines, counts = extractor.extract(wheel)
    assert version == "9.9.9" and counts["debug"] == 1 and counts["placeholder_only"] == 1
    assert [line.split("\t", 1)[1] for line in lines] == sorted([
        "INFO\tUsing max model len %s", "INFO\t100%% done", "WARNING\tUser %s is long. Careful.",
        "INFO\ttook %s s, 5%% off", "ERROR\ta b %d", "ERROR\ta c %d", "INFO\t%s items",
        "INFO\tvLLM server version %s", "ERROR\tline one\\nline two", "INFO\tbackend=%s",
    ])
    assert all(line.startswith("vllm/x.py\t") for line in lines)


# --- engine death while serving: lines logged only when a child process dies ---------------------------

DEATHS = ("worker-sigterm", "engine-sigterm", "group-sigterm", "chat-worker-sigkill")


def run_death(version: str, how: str) -> str:
    """A healthy TP-2 start, a long stream (chat for "chat-*"), then a child's death: a worker SIGTERMed or
    SIGKILLed, the EngineCore SIGTERMed (dies only before 0.18), or SIGTERM to the whole process group."""
    new = tuple(int(x) for x in version.split(".")) >= (0, 18)
    sc = Scenario(version, ("-tp", "2", *(("--shutdown-timeout", "30") if new and how == "group-sigterm" else ())))
    with tempfile.TemporaryDirectory(prefix="simdeath-") as tmp:
        root = Path(tmp)
        model = _setup(root, sc)
        port = _free_port()
        log = root / "out.log"
        env = sim_env(root)
        with open(log, "wb") as out:
            proc = subprocess.Popen(sc.argv(str(model), port), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=REPO)
        try:
            assert _wait_for(log, proc, "Application startup complete.", time.monotonic() + 20), log.read_text()
            chat = how.startswith("chat")
            body = {"model": "ernie", "max_tokens": 300, "ignore_eos": True, "stream": True,
                    **({"messages": [{"role": "user", "content": "long"}]} if chat else {"prompt": "long"})}
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
            conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body=json.dumps(body),
                         headers={"content-type": "application/json"})
            resp = conn.getresponse()
            resp.readline()
            text = log.read_text()
            proc_name = "Worker_TP1" if "worker" in how else next(
                n for n in ("EngineCore_DP0", "EngineCore_0", "EngineCore") if f"({n} pid=" in text)
            pid = int(re.search(rf"\({proc_name} pid=(\d+)\)", text).group(1))  # type: ignore[union-attr]
            if how == "group-sigterm":
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                os.kill(pid, signal.SIGKILL if how.endswith("sigkill") else signal.SIGTERM)
            if how == "engine-sigterm" and new:
                time.sleep(0.5)  # the engine runs on; stop the server normally
                proc.send_signal(signal.SIGTERM)
            else:
                with contextlib.suppress(http.client.HTTPException, OSError):
                    resp.read()  # to the end the dead engine gives it
            conn.close()
            proc.wait(timeout=20)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        return log.read_text(errors="replace")


@pytest.mark.parametrize(("version", "how"), [(v, h) for v in VERSIONS for h in DEATHS])
def test_engine_death_lines_are_real_formats(version: str, how: str) -> None:
    text = run_death(version, how)
    problems, _, _ = violations(text, version)
    assert not problems, f"{version} {how}:\n" + "\n".join(problems) + f"\n--- output ---\n{text}"
    if how != "engine-sigterm" or tuple(int(x) for x in version.split(".")) < (0, 18):
        assert "EngineDeadError" in text, text
