"""Facts: one shell script that gathers everything in a single round trip, and a pure parser of its output.

Sections are delimited by marker lines (remote/protocol.py) so one command's failure (no nvidia-smi, no model)
is a fact, not a failed gather.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ernie_deploy.checks.deaths import HOST_PATTERN
from ernie_deploy.checks.gpus import csv_number, csv_rows
from ernie_deploy.checks.result import CheckInputError
from ernie_deploy.planning.hostpaths import ENV_DIR, LOCK_DIR, PENDING_FILE, UNIT_DIR
from ernie_deploy.remote import http
from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.protocol import MARK_FUNCTION, sections, sha256sums
from ernie_deploy.remote.systemd import NOW, UnitState, parse_units, show_command

UNIT_GLOB = "ernie-vllm-*.service"


DROPIN_DIRS = (UNIT_DIR, "/run/systemd/system")  # `systemctl edit` and `systemctl edit --runtime`


# Per unit file named in its arguments, one line `UNIT BIND PORT GPUS`: the bind address and port of the first
# ExecStart line that names them (the last --host/--port on it, quotes dropped; 0.0.0.0 and 8000 when absent, as
# vLLM's own defaults) and the first CUDA_VISIBLE_DEVICES. One awk for every unit instead of a sed, head and tr
# per value and unit; a file without those lines (even an empty one) still gets its line.
UNIT_TABLE_AWK = r"""/^ExecStart=/ {
  if (!(FILENAME in port) && match($0, /^ExecStart=.* --port [0-9]+/)) {
    s = substr($0, 1, RLENGTH); sub(/.* --port /, "", s); port[FILENAME] = s }
  if (!(FILENAME in bind) && match($0, /^ExecStart=.* --host [^ ]*/)) {
    s = substr($0, 1, RLENGTH); sub(/.* --host /, "", s); gsub(/["']/, "", s); bind[FILENAME] = s }
}
/^Environment=CUDA_VISIBLE_DEVICES=/ && !(FILENAME in gpus) {
  s = $0; sub(/^Environment=CUDA_VISIBLE_DEVICES=/, "", s); gpus[FILENAME] = s }
END {
  for (i = 1; i < ARGC; i++) {
    f = ARGV[i]; u = f; sub(/.*\//, "", u)
    h = (f in bind) ? bind[f] : ""; if (h == "") h = "0.0.0.0"
    print u, h, ((f in port) ? port[f] : "8000"), gpus[f] } }"""

# Prints a small file with the shell's own read (nothing when it is missing): no `cat` process per section.
PRINT_FUNCTION = ("c() { [ -f \"$1\" ] || return 0; "
                  "while IFS= read -r l || [ -n \"$l\" ]; do printf '%s\\n' \"$l\"; done < \"$1\"; }")


def gather_script(model_path: str, vllm_bin: str, user: str = "vllm") -> str:
    """The facts script. Paths are quoted; nothing secret is read into the output (env files: hashes only).
    Each process it starts costs the host a millisecond or two of CPU, which many hosts sharing cores (and a
    controller next to them) feel: files are hashed and stat'ed in one call each, every unit's settings come
    from one awk and its state from one `systemctl show`, and small files are printed by the shell itself."""
    q = shlex.quote
    config = q(model_path.rstrip('/') + '/config.json')
    dropins = " ".join(f"{d}/{UNIT_GLOB}.d/*.conf" for d in DROPIN_DIRS)
    return f"""
{MARK_FUNCTION}
{PRINT_FUNCTION}
t=$(mktemp -d) || exit 1
trap 'rm -rf "$t"' EXIT
# The slow readers run at once (nvidia-smi initialises the driver, a /health read waits on its instance): the facts
# take as long as the slowest of them, not their sum. One GPU has no links to judge: the topology is read only
# where the GPU query listed more (a process fewer on every single-GPU host).
{{ {{ nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader,nounits 2>&1; \\
  echo "rc=$?"; }} > "$t/gpus"; n=0
  while IFS= read -r l; do case $l in [0-9]*) n=$((n + 1));; esac; done < "$t/gpus"
  [ "$n" -lt 2 ] || nvidia-smi topo -m > "$t/topo" 2>&1; }} &
{{ {version_script(vllm_bin)}; }} > "$t/vllm" 2>&1 &
set --
for f in {UNIT_DIR}/{UNIT_GLOB}; do [ -f "$f" ] && set -- "$@" "$f"; done
if [ $# -gt 0 ]; then
  awk {q(UNIT_TABLE_AWK)} "$@" > "$t/units"
  set --; while read -r u _; do set -- "$@" "$u"; done < "$t/units"
  {show_command('"$@"')} > "$t/show" 2>/dev/null
fi
{{ set --; [ -f "$t/units" ] && while read -r u a p _; do set -- "$@" "$u" "$a" "$p"; done < "$t/units"
[ $# -eq 0 ] || {health_script()}; }} > "$t/health" &
{{ {running_script('"$t/show"')}; }} > "$t/running" 2>/dev/null &
{{ {deaths_script('"$t/show"')}; }} > "$t/deaths" 2>/dev/null &
m systemd; systemctl --version 2>&1
set --
for f in {UNIT_DIR}/{UNIT_GLOB} {ENV_DIR}/ernie-vllm-*.env; do [ -f "$f" ] && set -- "$@" "$f"; done
m files; [ $# -eq 0 ] || sha256sum "$@"
m mtimes; [ $# -eq 0 ] || stat -c '%Y %n' "$@"
m ctimes; [ $# -eq 0 ] || stat -c '%Z %n' "$@"
m units; c "$t/show"
m dropins; set --
for f in {dropins}; do [ -f "$f" ] && set -- "$@" "$f"; done
[ $# -eq 0 ] || sha256sum "$@"
m unitgpus; [ -f "$t/units" ] && while read -r u _ _ g; do printf '%s %s\\n' "$u" "$g"; done < "$t/units"
m now; {NOW}
m wallnow; date +%s.%N
m model; cat {config} 2>&1; rc=$?; echo; echo "rc=$rc"
m modeluser; if id -u {q(user)} >/dev/null 2>&1; then
  runuser -u {q(user)} -- test -r {config} && echo readable || echo unreadable; fi
m lock; c {LOCK_DIR}/info
m pending; c {PENDING_FILE}
wait
m gpus; c "$t/gpus"
m topo; c "$t/topo"
m health; c "$t/health"
m vllm; c "$t/vllm"
m running; c "$t/running"
m deaths; c "$t/deaths"
m end
"""


# One /health read, by bash itself: arguments BIND PORT; prints the HTTP status, or why there is none on stderr
# (exit 1). Same address rule as hostpaths.loopback. /dev/tcp/HOST/PORT is bash's (GNU bash manual,
# "Redirections"; the host's `sh` may be dash, which has none); the status is the second word of the status line
# (RFC 9112 section 4), which uvicorn, vLLM's server, also sends to an HTTP/1.0 request; /health needs no API key.
HEALTH_BASH = r"""case $1 in 0.0.0.0|'') h=127.0.0.1;; ::) h=::1;; *) h=$1;; esac
case $h in *:*) hp="[$h]:$2";; *) hp="$h:$2";; esac
exec 3<>"/dev/tcp/$h/$2" || exit 1
printf 'GET /health HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n' "$hp" >&3
IFS=' ' read -r -t 3 _ c _ <&3 || c=
c=${c%$'\r'}
case $c in [1-5][0-9][0-9]) echo "$c";; *) echo "no HTTP status line from $hp" >&2; exit 1;; esac"""
HEALTH_TIMEOUT_S = 4  # a connect or an answer that hangs (the Python reader's 3 s per request, and the connect)


def health_script() -> str:
    """Shell that reads each `UNIT BIND PORT` triple in "$@" and prints `UNIT STATUS` or `UNIT error REASON`
    per unit, as programs/http_probe.py's health mode does. Where the host has bash and coreutils' `timeout`
    (every systemd host we know of), bash asks /health over its /dev/tcp: a few milliseconds per unit instead of
    a Python start with urllib (about 50 ms of CPU, the most of a no-change run's host time when many hosts
    share the cores); elsewhere the host's python3 does it. HTTP/1.0 with `Connection: close`: one status line
    is all that is read."""
    q = shlex.quote
    return ("if command -v bash >/dev/null 2>&1 && command -v timeout >/dev/null 2>&1; then "
            "while [ $# -ge 3 ]; do "
            f"r=$(timeout {HEALTH_TIMEOUT_S} bash -c {q(HEALTH_BASH)} health \"$2\" \"$3\" 2>&1); "
            "case $? in 0) echo \"$1 $r\";; "
            f"124) echo \"$1 error no answer within {HEALTH_TIMEOUT_S}s\";; "
            # bash says why twice ("health: connect: REASON", then the /dev/tcp line): the first line, bare.
            "*) r=$(printf '%s\\n' \"$r\" | head -n 1); r=${r#health: }; r=${r#line [0-9]*: }; "
            "echo \"$1 error ${r#connect: }\";; "
            "esac; shift 3; done; "
            f"else python3 -c {q(http.PROGRAM)} \"$@\" 2>&1; fi")


def metadata_version(bin_expr: str) -> str:
    """Shell that sets $v to the vLLM version in the package metadata of the interpreter in the shebang of the
    `vllm` script at `bin_expr` (shell text: quoted, or a "$var"); empty when unknown. Read by the shell from the
    one `vllm-*.dist-info/METADATA` in the site-packages of the interpreter's prefix (a venv: PEP 405; the
    file: core metadata's `Version:`), starting no interpreter; where there is none or more than one (a system
    Python's dist-packages, a broken install), that interpreter's importlib.metadata says, in milliseconds."""
    # The shebang's first word, when it names a python, read by the shell itself (no head and sed per read).
    return (f"py=; l=; [ -f {bin_expr} ] && IFS= read -r l < {bin_expr}; "
            "case $l in '#!'*) l=${l#??}; l=${l#\"${l%%[![:space:]]*}\"}; py=${l%%[[:space:]]*}; "
            "case $py in *python*) ;; *) py=;; esac;; esac; v=; "
            "if [ -n \"$py\" ] && [ -x \"$py\" ]; then md=; n=0; "
            "for x in \"${py%/bin/*}\"/lib/python*/site-packages/vllm-*.dist-info/METADATA; do "
            "[ -f \"$x\" ] && md=$x && n=$((n + 1)); done; "
            "if [ \"$n\" -eq 1 ]; then while IFS= read -r l; do "
            "case $l in 'Version:'*) v=${l#Version:}; v=${v# }; break;; esac; done < \"$md\"; fi; "
            "[ -n \"$v\" ] || "
            "v=$(\"$py\" -c 'import importlib.metadata as m; print(m.version(\"vllm\"))' 2>/dev/null) || v=; fi")


def version_script(vllm_bin: str) -> str:
    """The installed vLLM version, from the package metadata (metadata_version), not `vllm --version`, which
    imports torch first and takes 14-24 s with real vLLM 0.33; that stays the fallback (a shebang through
    /usr/bin/env, or no metadata). Prints the version, then rc=."""
    q = shlex.quote
    return (f"{metadata_version(q(vllm_bin))}; "
            f"if [ -n \"$v\" ]; then echo \"$v\"; echo rc=0; else {q(vllm_bin)} --version 2>&1; echo \"rc=$?\"; fi")


def running_script(show_file: str) -> str:
    """Per running managed unit, the `vllm` program its main process runs (from /proc/PID/cmdline: the script
    is argv[1] behind its interpreter, or argv[0]) and that program's version: after a rollback the process can
    run another venv than the default path has. The units and their main PIDs come from `show_file` (shell
    text), the `systemctl show` the facts took of them (blocks split by a blank line, properties in systemd's
    order). One tab-separated line each: unit, program, version
    (empty when unknown). No `vllm --version` fallback here: it would import torch once per instance."""
    return (f"u=; pid=; [ -f {show_file} ] && while IFS= read -r l; do case $l in "
            "Id=*) u=${l#Id=};; MainPID=*) pid=${l#MainPID=};; '') u=; pid=; continue;; esac; "
            "[ -n \"$u\" ] && [ -n \"$pid\" ] || continue; "
            "case \"$pid\" in 0|*[!0-9]*) u=; pid=; continue;; esac; "
            "b=$(tr '\\000' '\\n' < /proc/\"$pid\"/cmdline 2>/dev/null | head -n 2 | grep -m 1 '/vllm$'); "
            "if [ -n \"$b\" ]; then " + metadata_version('"$b"') + "; "
            "printf '%s\\t%s\\t%s\\n' \"$u\" \"$b\" \"$v\"; fi; u=; pid=; "
            f"done < {show_file}")


# Journal lines kept per unit that systemd restarted or does not run: enough for a death, the restarts after it
# and the start that served again (checks/deaths.py), from the unit's last lines only.
DEATH_JOURNAL_LINES = 3000
DEATH_LINES_KEPT = 60


def deaths_script(show_file: str) -> str:
    """Per managed unit that systemd restarted (NRestarts above 0) or does not run, its journal lines that tell a
    death and what followed it (checks/deaths.py's HOST_PATTERN), each behind the unit's name and a space. The
    units come from `show_file`, as in running_script; a unit that runs and was never restarted costs nothing."""
    q = shlex.quote
    return (f"u=; n=; a=; [ -f {show_file} ] && while IFS= read -r l; do case $l in "
            "Id=*) u=${l#Id=};; NRestarts=*) n=${l#NRestarts=};; ActiveState=*) a=${l#ActiveState=};; "
            "'') u=; n=; a=; continue;; esac; "
            "[ -n \"$u\" ] && [ -n \"$n\" ] && [ -n \"$a\" ] || continue; "
            "if [ \"$n\" != 0 ] || [ \"$a\" != active ]; then "
            f"journalctl -u \"$u\" -o short-unix --no-pager -n {DEATH_JOURNAL_LINES} | grep -E {q(HOST_PATTERN)} "
            f"| tail -n {DEATH_LINES_KEPT} | sed \"s|^|$u |\"; fi; u=; n=; a=; "
            f"done < {show_file}")


@dataclass(frozen=True)
class Facts(Intent):
    """Read the host's facts (GPUs, units, managed files, model, vLLM, lock, pending units), then run `extra`,
    more read-only script whose sections come in the same output."""

    op: ClassVar[Op] = Op.FACTS
    model_path: str
    vllm_bin: str
    user: str = "vllm"
    extra: str = ""

    def render(self) -> str:
        return gather_script(self.model_path, self.vllm_bin, self.user) + self.extra


def gather_command(model_path: str, vllm_bin: str, user: str = "vllm", extra: str = "") -> Command:
    return Command(Facts(model_path, vllm_bin, user, extra))


@dataclass(frozen=True)
class GpuFact:
    index: int
    name: str
    uuid: str
    memory_mib: int
    driver: str


@dataclass(frozen=True)
class RunningVllm:
    """The `vllm` program a unit's running process uses, and its version (None: unknown)."""

    bin: str
    version: str | None


@dataclass(frozen=True)
class HostFacts:
    gpus: tuple[GpuFact, ...] = ()
    gpu_error: str | None = None
    nvlink: bool | None = None
    systemd_version: int | None = None
    files: dict[str, str] = field(default_factory=dict)  # path → sha256
    units: dict[str, UnitState] = field(default_factory=dict)
    model_config: dict[str, Any] | None = None
    model_error: str | None = None
    vllm_version: str | None = None
    vllm_error: str | None = None
    lock_info: str | None = None
    pending: tuple[str, ...] = ()  # units whose files were staged but not yet activated (restarted)
    pending_from: dict[str, str] = field(default_factory=dict)  # pending unit → the release it ran when staged
    dropins: dict[str, str] = field(default_factory=dict)  # drop-in path → sha256 (our units' .service.d)
    unit_gpus: dict[str, tuple[int, ...]] = field(default_factory=dict)  # unit → its CUDA_VISIBLE_DEVICES
    health: dict[str, str] = field(default_factory=dict)  # unit → "200", "503" or "error REASON"
    now_us: int | None = None  # the host's monotonic clock (µs), to age ExecMainStartTimestampMonotonic
    model_readable: bool | None = None  # can vllm_user read config.json (None: the user does not exist)
    mtimes: dict[str, int] = field(default_factory=dict)  # managed file → its mtime (epoch seconds)
    wall_now: float | None = None  # the host's clock (epoch seconds), to compare process starts with mtimes
    ctimes: dict[str, int] = field(default_factory=dict)  # managed file → when its inode last changed (arrived)
    running: dict[str, RunningVllm] = field(default_factory=dict)  # running unit → the vLLM its process uses
    # unit systemd restarted or does not run → its journal lines about deaths and runs (deaths_script)
    deaths: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def running_versions(self) -> list[str]:
        """The vLLM versions the running instances use (what serves), each once; "?" for one not known."""
        return sorted({r.version or "?" for r in self.running.values()})

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": [g.__dict__ for g in self.gpus], "gpu_error": self.gpu_error, "nvlink": self.nvlink,
            "systemd_version": self.systemd_version, "files": self.files,
            "units": {k: u.__dict__ for k, u in self.units.items()},
            "model_architecture": (self.model_config or {}).get("architectures"), "model_error": self.model_error,
            "vllm_version": self.vllm_version, "vllm_error": self.vllm_error, "lock": self.lock_info,
            "pending": list(self.pending), "dropins": self.dropins,
            "unit_gpus": {k: list(v) for k, v in self.unit_gpus.items()}, "health": self.health,
            "model_readable_by_user": self.model_readable,
            "running_vllm": {u: {"bin": r.bin, "version": r.version} for u, r in self.running.items()},
        }


def split_rc(body: str) -> tuple[str, int]:
    """Split off the trailing `rc=N` line the script adds after commands whose failure is a fact."""
    lines = body.rstrip("\n").splitlines()
    if lines and lines[-1].startswith("rc="):
        return "\n".join(lines[:-1]).strip(), int(lines[-1][3:] or 1)
    return body.strip(), 0


def parse_gpus(body: str) -> tuple[tuple[GpuFact, ...], str | None]:
    text, rc = split_rc(body)
    if rc != 0:
        return (), text.splitlines()[-1] if text else f"nvidia-smi exited {rc}"
    what = "nvidia-smi --query-gpu"
    try:
        gpus = []
        for lineno, (index, name, uuid, total, driver) in csv_rows(text, 5, what):
            memory = csv_number(total, what, lineno, "memory.total")
            if not index.isdigit() or memory is None:
                raise CheckInputError(f"{what} line {lineno}: {index!r} / {total!r}")
            gpus.append(GpuFact(int(index), name, uuid, int(memory), driver))
    except CheckInputError as exc:
        return (), f"unexpected nvidia-smi output: {exc.message}"
    return tuple(gpus), None


def parse_topology(body: str) -> bool | None:
    """True when every GPU pair is joined by NVLink (NV#), False when any pair is PCIe only."""
    rows = [line.split() for line in body.splitlines() if re.match(r"^GPU\d+\s", line)]
    if not rows:
        return None
    n = len(rows)
    links = [cell for i, row in enumerate(rows) for j, cell in enumerate(row[1:n + 1]) if i != j]
    if not links:
        return None  # a single GPU has no links to judge
    return all(re.fullmatch(r"NV\d+", cell) for cell in links)


def parse_version(text: str) -> str | None:
    # A PEP 440 version with its local label: the CPU build says 0.32.0+cpu, and the planner tells builds apart
    # by that label (vLLM picks its CPU platform by the substring "cpu").
    found = re.search(r"(\d+\.\d+(?:\.\d+)*(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?"
                      r"(?:\+[0-9A-Za-z]+(?:\.[0-9A-Za-z]+)*)?)", text)
    return found.group(1) if found else None


def parse_running(body: str) -> dict[str, RunningVllm]:
    out = {}
    for line in body.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[0] and parts[1]:
            out[parts[0]] = RunningVllm(parts[1], parse_version(parts[2]) if parts[2].strip() else None)
    return out


def parse_facts(text: str) -> HostFacts:
    s = sections(text)
    gpus, gpu_error = parse_gpus(s.get("gpus", "rc=127"))
    files = sha256sums(s.get("files", ""))
    model_text, model_rc = split_rc(s.get("model", "rc=1"))
    model_config, model_error = None, None
    if model_rc == 0:
        try:
            model_config = json.loads(model_text)
        except json.JSONDecodeError as exc:
            model_error = f"config.json is not valid JSON: {exc.msg} (line {exc.lineno})"
    else:
        model_error = model_text.splitlines()[-1] if model_text else "config.json not readable"
    vllm_text, vllm_rc = split_rc(s.get("vllm", "rc=127"))
    version = parse_version(vllm_text) if vllm_rc == 0 else None
    systemd = re.match(r"systemd (\d+)", s.get("systemd", ""))
    return HostFacts(
        gpus=gpus, gpu_error=gpu_error, nvlink=parse_topology(s.get("topo", "")),
        systemd_version=int(systemd.group(1)) if systemd else None, files=files, units=parse_units(s.get("units", "")),
        model_config=model_config, model_error=model_error, vllm_version=version,
        vllm_error=None if version else (vllm_text.splitlines()[-1] if vllm_text else "vllm not runnable"),
        lock_info=s.get("lock") or None,
        pending=tuple(sorted({line.split()[0] for line in s.get("pending", "").splitlines() if line.split()})),
        pending_from={w[0]: w[1] for w in (line.split() for line in s.get("pending", "").splitlines()) if len(w) > 1},
        dropins=sha256sums(s.get("dropins", "")), unit_gpus=_unit_gpus(s.get("unitgpus", "")),
        health={u: rest for u, _, rest in (line.partition(" ") for line in s.get("health", "").splitlines()) if rest},
        now_us=int(s["now"]) if s.get("now", "").strip().isdigit() else None,
        model_readable={"readable": True, "unreadable": False}.get(s.get("modeluser", "").strip()),
        mtimes=_times(s.get("mtimes", "")), ctimes=_times(s.get("ctimes", "")),
        running=parse_running(s.get("running", "")),
        wall_now=_float(s.get("wallnow", "")), deaths=_per_unit(s.get("deaths", "")),
    )


def _per_unit(body: str) -> dict[str, tuple[str, ...]]:
    """`UNIT LINE` lines grouped by unit, in order."""
    out: dict[str, list[str]] = {}
    for line in body.splitlines():
        unit, _, rest = line.partition(" ")
        if rest:
            out.setdefault(unit, []).append(rest)
    return {u: tuple(lines) for u, lines in out.items()}


def _times(body: str) -> dict[str, int]:
    """`stat -c '%Y %n'` (or %Z) lines: path → epoch seconds."""
    return {path: int(t) for t, _, path in (line.partition(" ") for line in body.splitlines()) if t.isdigit() and path}


def _float(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


def _unit_gpus(body: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for line in body.splitlines():
        unit, _, gpus = line.partition(" ")
        out[unit] = tuple(int(g) for g in gpus.split(",") if g.strip().isdigit())
    return out
