"""Commands a balancer host runs: apply HAProxy's configuration, and drive HAProxy's runtime API.

Apply (`ApplyBalancer`): the rendered configuration comes on stdin (it holds the instances' API key, so never
on a command line), is staged beside its target (0640, group haproxy), checked with `haproxy -c`, and only
then moved in and HAProxy reloaded (Debian's unit reloads without dropping connections: master-worker mode,
its ExecReload checks the file and sends USR2). A file that fails the check changes nothing; an identical file
changes nothing (HAProxy is only started when it does not run); a reload or start that fails puts the previous
file back and reloads it, so nothing is left half-applied. HAProxy is installed from the distribution's
packages when missing. A configuration or admin socket outside Debian's defaults gets a unit drop-in, so the
unit runs that file and creates the socket's directory at every start (/run is emptied at boot).

Runtime (`BalancerAdmin`): programs/haproxy_admin.py, run by the host's python3, sends `set server B/S state
X` and `show stat` to the admin socket, one connection per command. `parse_stat` and `set_problem` read the
answers; `admin_problem` turns a socket that cannot be reached into a sentence naming the host and the fix.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, ClassVar

from ernie_deploy.errors import DeployError
from ernie_deploy.planning.balancer import BalancerPlan, unit_dropin
from ernie_deploy.remote.audit import audit_line
from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.programs import program
from ernie_deploy.remote.protocol import MARK, marker, records, split


@dataclass(frozen=True)
class ServerStat:
    """One server as HAProxy's `show stat` reports it (orchestration/balancers.py re-exports it: the rollout's
    contract names it there, and remote/ may not import orchestration/)."""

    status: str  # UP, DOWN, DRAIN, MAINT, NOLB, or a transition such as "DOWN 1/2" / "UP 1/2"
    scur: int  # current sessions
    weight: int
    # The last health check's result (HAProxy's management guide, "show stat" field 36): L7TOUT is a check that
    # got no answer in time, L7STS a bad status, L4CON a refused connection; "" when not reported.
    check_status: str = ""

    @property
    def up(self) -> bool:
        """Taking traffic: checked and healthy, in neither drain nor maintenance."""
        return self.status == "UP" or self.status.startswith("UP ")


# Where deploy writes HAProxy's unit drop-in (planning.balancer.unit_dropin) when it needs one.
DROPIN = "/etc/systemd/system/haproxy.service.d/ernie-deploy.conf"
PROGRAM = program("haproxy_admin")
ANSWER = "haproxy"  # the record tag of the admin program's answers
# A path that goes into a shell script and a systemd unit as it is: no quoting rule of either can bite.
_SAFE_PATH = re.compile(r"/[A-Za-z0-9._+/-]+")


def deploy_hint(host: str) -> str:
    return f"deploy the balancer first: ernie-deploy deploy -i INV --limit {host}"


def checked_path(plan: BalancerPlan, value: str, variable: str) -> str:
    if not _SAFE_PATH.fullmatch(value) or "/../" in f"{value}/" or value.endswith("/"):
        raise DeployError(f"{variable} {value!r} is not a plain absolute path", where=plan.host,
                          hint=f"set {variable} to an absolute path of letters, digits and . _ + - /")
    return value


@dataclass(frozen=True)
class ApplyBalancer(Intent):
    """Stage the configuration read from stdin, check it with `haproxy -c`, then (unless `check`) move it in and
    reload or start HAProxy, putting the old file back when that fails. Prints a section per event: `installed`
    (or `install` in check mode), `unchanged` / `changed`, `reloaded` / `restarted` / `started` (`start` in
    check mode: it does not run), `restored`, `error KIND` with the quoted output, `done` at a success."""

    op: ClassVar[Op] = Op.BALANCER_APPLY
    config: str
    socket_dir: str
    check: bool
    audit: dict[str, Any]
    dropin: str = DROPIN

    def render(self) -> str:
        q = shlex.quote
        text = unit_dropin(self.config, self.socket_dir)
        if text is None:
            unit_differs = '[ -e "$DROPIN" ] && UNIT=1'
            write_unit = 'rm -f "$DROPIN"'
        else:
            unit_differs = f'printf %s {q(text)} | cmp -s - "$DROPIN" || UNIT=1'
            write_unit = f'mkdir -p "$(dirname "$DROPIN")" && printf %s {q(text)} > "$DROPIN"'
        return f"""set -u
m() {{ printf '\\n{MARK}%s\\n' "$1"; }}
CONFIG={q(self.config)}
DIR={q(str(PurePosixPath(self.config).parent))}
SOCKDIR={q(self.socket_dir)}
DROPIN={q(self.dropin)}
CHECK={1 if self.check else 0}
NEW="$CONFIG.ernie-new"
PREV="$CONFIG.ernie-prev"
UNIT=0
DID=0
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
# Quote the last lines of what failed, blank lines left out, then stop.
fail() {{ rm -f "$NEW"; m "error $1"; grep -v '^[[:space:]]*$' "$LOG" | tail -n 12; exit 1; }}
journal() {{ journalctl -u haproxy -n 8 -o cat --no-pager >>"$LOG" 2>&1 || true; }}
# The configuration holds the API key: read it from stdin before anything else can, into a file only root reads.
if [ "$CHECK" = 1 ]; then NEW=$(mktemp); elif ! mkdir -p "$DIR" 2>"$LOG"; then fail stage; fi
umask 077
cat > "$NEW" 2>"$LOG" || fail stage
umask 022
if ! command -v haproxy >/dev/null 2>&1; then
  if [ "$CHECK" = 1 ]; then rm -f "$NEW"; m install; m changed; m start; m done; exit 0; fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo 'haproxy is not installed and this host has no apt-get' >"$LOG"; fail install
  fi
  export DEBIAN_FRONTEND=noninteractive
  # A host with an old package list gets a fresh one, only when the install needs it.
  {{ apt-get install -y -q haproxy || {{ apt-get update -q && apt-get install -y -q haproxy; }}; }} \
    </dev/null >"$LOG" 2>&1 || fail install
  m installed
  DID=1
fi
if [ "$CHECK" = 0 ] && getent group haproxy >/dev/null 2>&1; then chgrp haproxy "$NEW" 2>"$LOG" || fail stage; fi
chmod 0640 "$NEW"
haproxy -c -f "$NEW" >"$LOG" 2>&1 || fail invalid
# HAProxy binds its admin socket there at start; the unit drop-in recreates it after a reboot.
if [ "$CHECK" = 0 ]; then mkdir -p "$SOCKDIR" 2>"$LOG" || fail stage; fi
{unit_differs}
if [ -f "$CONFIG" ] && cmp -s "$NEW" "$CONFIG" && [ "$UNIT" = 0 ]; then
  rm -f "$NEW"
  m unchanged
else
  m changed
  if [ "$CHECK" = 1 ]; then rm -f "$NEW"; else
    HAD=0; DHAD=0
    if [ -f "$CONFIG" ]; then cp -p "$CONFIG" "$PREV" 2>"$LOG" || fail stage; HAD=1; fi
    if [ -f "$DROPIN" ]; then cp -p "$DROPIN" "$DROPIN.ernie-prev" 2>"$LOG" || fail stage; DHAD=1; fi
    mv -f "$NEW" "$CONFIG" 2>"$LOG" || fail stage
    DID=1
    if [ "$UNIT" = 1 ]; then {{ {write_unit}; }} 2>"$LOG" && systemctl daemon-reload 2>>"$LOG" || fail stage; fi
    # A changed unit (another CONFIG) needs a restart: a reload re-executes with the old arguments.
    if systemctl is-active -q haproxy; then WAS=1; ACTION=reload; [ "$UNIT" = 0 ] || ACTION=restart
    else WAS=0; ACTION=start; fi
    if [ "$ACTION" = start ]; then OK=0; systemctl enable -q --now haproxy >"$LOG" 2>&1 && OK=1
    else OK=0; systemctl "$ACTION" haproxy >"$LOG" 2>&1 && OK=1; fi
    if [ "$OK" = 0 ]; then
      journal
      if [ "$HAD" = 1 ]; then cp -p "$PREV" "$CONFIG"; else rm -f "$CONFIG"; fi
      if [ "$UNIT" = 1 ]; then
        if [ "$DHAD" = 1 ]; then mv -f "$DROPIN.ernie-prev" "$DROPIN"; else rm -f "$DROPIN"; fi
        systemctl daemon-reload >/dev/null 2>&1
      fi
      if [ "$WAS" = 1 ]; then
        if systemctl "$ACTION" haproxy >/dev/null 2>&1; then m restored; else m restore-failed; fi
      else m restored; fi
      fail "$ACTION"
    fi
    rm -f "$DROPIN.ernie-prev"
    case "$ACTION" in reload) m reloaded;; restart) m restarted;; *) m started;; esac
  fi
fi
if ! systemctl is-active -q haproxy; then
  if [ "$CHECK" = 1 ]; then m start
  else
    systemctl enable -q --now haproxy >"$LOG" 2>&1 || {{ journal; fail start; }}
    m started
    DID=1
  fi
elif [ "$CHECK" = 0 ]; then
  # Running but not enabled would not come back after a reboot.
  systemctl is-enabled -q haproxy 2>/dev/null || systemctl enable -q haproxy >/dev/null 2>&1 || true
fi
if [ "$DID" = 1 ]; then {audit_line(self.audit)}; fi
m done
"""


@dataclass(frozen=True)
class Applied:
    """What applying a balancer's configuration did (in check mode: would do). `error` quotes HAProxy's own
    words (or systemd's, or apt's); nothing was changed by an apply with an error, unless `restored` is False
    after a failed reload (then the previous file is back but HAProxy could not reload it either)."""

    host: str
    changed: bool = False  # the file differed from the one in place (or the unit's drop-in did)
    installed: bool = False  # the haproxy package was installed
    reloaded: bool = False  # a running HAProxy reloaded the new file without dropping connections
    restarted: bool = False  # a running HAProxy was restarted (its unit changed: another config path)
    started: bool = False  # HAProxy did not run and was enabled and started
    restored: bool = False  # a failed reload or start put the previous file back
    check: bool = False  # check mode: nothing was changed; the fields say what would be
    error: str | None = None
    hint: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        """One line: what happened on the balancer."""
        if self.error is not None:
            return self.error
        would = "would be " if self.check else ""
        done = [w for w, on in (("installed", self.installed), ("changed", self.changed),
                                ("reloaded", self.reloaded), ("restarted", self.restarted),
                                ("started", self.started)) if on]
        return f"HAProxy configuration {would}{', '.join(done)}" if done else "HAProxy configuration unchanged"


def apply_command(plan: BalancerPlan, config: str, audit: dict[str, Any], *, check: bool = False) -> Command:
    """The apply of `config` (the rendered configuration) on `plan`'s balancer host; its paths are refused
    unless plain (they reach a shell script and a systemd unit)."""
    path = checked_path(plan, plan.config_path, "vllm_balancer_config")
    sock = checked_path(plan, plan.admin_socket, "vllm_balancer_admin_socket")
    intent = ApplyBalancer(path, str(PurePosixPath(sock).parent), check, audit)
    return Command(intent, stdin=config.encode(), timeout=900, check=False)


_ERRORS = {
    "stage": "could not stage the configuration in {dir}",
    "install": "could not install HAProxy",
    "invalid": "the configuration fails `haproxy -c`, nothing was changed",
    "reload": "HAProxy did not reload the new configuration",
    "restart": "HAProxy did not restart with the new configuration",
    "start": "HAProxy did not start",
}


def parse_apply(host: str, plan: BalancerPlan, stdout: str, stderr: str = "", *, check: bool = False) -> Applied:
    """What the apply script reported. A script that ended without `done` or an error (killed, no sh) is an
    error quoting its stderr."""
    events = {s.header: s.body for s in split(stdout)}
    installed = ("install" if check else "installed") in events
    started = ("start" if check else "started") in events
    failed = next((h for h in events if h.startswith("error ")), None)
    if failed is not None:
        kind = failed.partition(" ")[2]
        what = _ERRORS.get(kind, f"{kind} failed").format(dir=str(PurePosixPath(plan.config_path).parent))
        quoted = events[failed]
        if kind in ("reload", "restart", "start"):
            what += (": the previous configuration is back" if "restored" in events else
                     ": the previous configuration is back on disk but HAProxy did not take it either")
        hint = {"invalid": "fix the template or the vllm_balancer_* variables (the line numbers are those of "
                           "the file `ernie-deploy render` writes as balancers/HOST/haproxy.cfg)",
                "install": "install HAProxy from the distribution's packages on the host (apt-get install "
                           "haproxy), then deploy again"}.get(kind, f"see `journalctl -u haproxy` on {host}")
        # Whatever it staged did not stay; an install did.
        return Applied(host, installed=installed, restored="restored" in events, check=check,
                       error=f"{what}:\n{quoted}" if quoted else what, hint=hint)
    if "done" not in events:
        tail = "\n".join(stderr.strip().splitlines()[-5:]) or "(no output)"
        return Applied(host, check=check, error=f"the apply script stopped before it finished: {tail}",
                       hint=f"check that {host} runs a POSIX sh and that the SSH user may become root")
    return Applied(host, changed="changed" in events, installed=installed, reloaded="reloaded" in events,
                   restarted="restarted" in events, started=started, check=check)


# --- the runtime API ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BalancerAdmin(Intent):
    """Commands for HAProxy's runtime API on the balancer host (`set server B/S state X`, `show stat`), sent
    by programs/haproxy_admin.py; the commands and the socket come on stdin."""

    op: ClassVar[Op] = Op.BALANCER_ADMIN
    socket: str
    commands: tuple[str, ...]

    def render(self) -> str:
        return (f"if command -v python3 >/dev/null; then python3 -c {shlex.quote(PROGRAM)}; "
                f"else printf '{marker(ANSWER)}%s\\n' '{{\"i\": \"*\", \"error\": \"python3\", \"detail\": "
                f"\"python3 not found on the host\"}}'; fi\n")


_COMMAND = re.compile(r"(show stat|set server [A-Za-z0-9._:-]+/[A-Za-z0-9._:-]+ state (drain|ready|maint))")


def admin_command(socket: str, commands: Sequence[str], timeout: float = 10.0) -> Command:
    """The runtime commands, each checked against the few this tool sends (a name reaching HAProxy's CLI
    could otherwise carry a second command after a ';')."""
    for c in commands:
        if not _COMMAND.fullmatch(c):
            raise ValueError(f"not a runtime command ernie-deploy sends: {c!r}")
    spec = {"socket": socket, "commands": list(commands), "mark": marker(ANSWER), "timeout": timeout}
    return Command(BalancerAdmin(socket, tuple(commands)), stdin=json.dumps(spec).encode(), timeout=timeout * 3 + 30,
                   check=False)


def set_command(backend: str, server: str, state: str) -> str:
    return f"set server {backend}/{server} state {state}"


SHOW_STAT = "show stat"


@dataclass(frozen=True)
class AdminAnswers:
    answers: dict[int, str]  # command index → HAProxy's answer
    error: str | None = None  # why the socket could not be reached: missing, denied, refused, timeout, ...
    detail: str = ""


def parse_admin(text: str) -> AdminAnswers:
    answers: dict[int, str] = {}
    for record in records(text, ANSWER):
        try:
            data = json.loads(record)
        except ValueError:
            continue
        if data.get("i") == "*":
            return AdminAnswers(answers, str(data.get("error") or "other"), str(data.get("detail") or ""))
        if isinstance(data.get("i"), int):
            answers[data["i"]] = str(data.get("answer", ""))
    return AdminAnswers(answers)


def admin_problem(host: str, socket: str, error: str, detail: str) -> str:
    """A socket that could not be reached, as a sentence naming the balancer host and the fix."""
    fix = deploy_hint(host)
    return {
        "missing": f"{host}: HAProxy's admin socket {socket} does not exist (HAProxy is not installed, not running, "
                   f"or runs another configuration): {fix}",
        "refused": f"{host}: nothing answers on HAProxy's admin socket {socket}: HAProxy is not running there "
                   f"(`systemctl status haproxy` on {host}); {fix}",
        "denied": f"{host}: permission denied on HAProxy's admin socket {socket}: the SSH user must become root "
                  f"on the balancer (ansible_become: true, with NOPASSWD sudo)",
        "timeout": f"{host}: HAProxy's admin socket {socket} did not answer in time ({detail}): check HAProxy on "
                   f"{host} (`systemctl status haproxy`)",
        "python3": f"{host}: python3 not found on the balancer host: install python3 there "
                   f"(ernie-deploy drives HAProxy's admin socket with it)",
    }.get(error, f"{host}: HAProxy's admin socket {socket} could not be used: {detail or error}")


def set_problem(answer: str) -> str | None:
    """HAProxy's answer to `set server`: empty when it did it, else its words ("No such server.")."""
    text = " ".join(answer.split())
    return text or None


def parse_stat(text: str) -> dict[tuple[str, str], ServerStat]:
    """`show stat`'s CSV as (proxy, server) → stat; the FRONTEND and BACKEND summary rows are left out."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("# "):
        return {}
    columns = lines[0][2:].split(",")
    try:
        px, sv, scur, status, weight = (columns.index(c) for c in ("pxname", "svname", "scur", "status", "weight"))
    except ValueError:
        return {}
    check = columns.index("check_status") if "check_status" in columns else None
    out: dict[tuple[str, str], ServerStat] = {}
    for line in lines[1:]:
        row = line.split(",")
        if len(row) <= max(px, sv, scur, status, weight) or row[sv] in ("FRONTEND", "BACKEND"):
            continue
        checked = row[check].lstrip("* ") if check is not None and check < len(row) else ""
        out[(row[px], row[sv])] = ServerStat(row[status], _int(row[scur]), _int(row[weight]), checked)
    return out


def _int(value: str) -> int:
    return int(value) if value.strip().isdigit() else 0
