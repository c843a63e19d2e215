"""ernie_host.py: the one program the exported Ansible role runs on a host (with `ansible.builtin.script`).

It keeps ernie-deploy's record on the host, so `ernie-deploy status`, `releases` and `rollback` see what
Ansible did and the two never deploy at once: the same deploy lock (an atomic mkdir plus its details file),
the same audit log, releases and pending list (remote/lock.py, remote/state.py, remote/converge.py). And it
judges a start-up log the way ernie-deploy's checks do: `export ansible` fills DATA with the project's own
regular expressions (checks/logscan.py, data/signatures.yml), and tests/test_export_checker.py runs this
program and the project's checks over the same log fixtures and requires the same verdicts.
# >>> balancers
With balancers in the inventory it also drives their HAProxy through its admin socket (the `haproxy` command).
# <<< balancers

Standard library only, Python 3.8 syntax: it runs with the host's python3, which may be old.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

DATA: dict[str, Any] = {}  # replaced by `ernie-deploy export ansible` with the checks' patterns

# Where ernie-deploy keeps its record: `export ansible` writes these lines from planning/hostpaths.py.
STATE_DIR = "/var/lib/ernie-deploy"
LOCK_DIR = "/var/lib/ernie-deploy/lock"
RELEASES_DIR = "/var/lib/ernie-deploy/releases"
PENDING_FILE = "/var/lib/ernie-deploy/pending"
AUDIT_LOG = "/var/log/ernie-deploy/audit.log"
UNIT_DIR = "/etc/systemd/system"
ENV_DIR = "/etc/ernie-deploy"
HELD_EXIT = 75  # the lock is held by someone else (remote/lock.py's HELD_EXIT)


# --- log verdicts ------------------------------------------------------------------------------------

def _rx(name: str) -> re.Pattern[str]:
    return re.compile(DATA["patterns"][name])


def strip_prefix(line: str) -> str:
    text = line.rstrip("\r\n")
    for name in ("journal_prefix", "proc_prefix", "log_header"):
        text = _rx(name).sub("", text, count=1)
    return text


def last_start(lines: list[str]) -> int:
    starts = [i for i, line in enumerate(lines) if _rx("start").search(strip_prefix(line))]
    if starts:
        return starts[-1]
    args = [i for i, line in enumerate(lines) if _rx("non_default").search(strip_prefix(line))]
    return args[-1] if args else 0


def _last(lines: list[str], rx: re.Pattern[str]) -> re.Match[str] | None:
    for line in reversed(lines):
        m = rx.search(strip_prefix(line))
        if m:
            return m
    return None


def tp_verdict(lines: list[str], tp: int) -> tuple[str, str]:
    """("pass" | "fail" | "warn", why): the tensor parallel size the last start-up really uses."""
    seg = lines[last_start(lines):]
    evidence: list[tuple[str, int]] = []
    engine = _last(seg, _rx("engine"))
    if engine:
        m = _rx("cfg_tp").search(engine.group("config"))
        if m:
            evidence.append(("engine config", int(m.group(1))))
    args = _last(seg, _rx("non_default"))
    if args:
        m = _rx("arg_tp").search(args.group("args"))
        evidence.append(("non-default args", int(m.group(1)) if m else 1))
    using = _last(seg, _rx("using_tp"))
    if using:
        evidence.append(("Using tensor parallel size", int(using.group(1))))
    ranks: set[int] = set()
    stated: set[int] = set()
    for raw in seg:
        line = raw.rstrip("\r\n")
        w = _rx("worker").match(_rx("journal_prefix").sub("", line, count=1))
        if w:
            ranks.add(int(w.group("tp") if w.group("tp") is not None else w.group("rank")))
            continue
        r = _rx("rank").match(strip_prefix(line))
        if r:
            stated.add(int(r.group("tp")))
    workers = ranks or stated
    if not evidence:
        return "warn", f"no start-up line states the tensor parallel size (plan: TP {tp})"
    wrong = [(src, n) for src, n in evidence if n != tp]
    if wrong:
        return "fail", f"plan says TP {tp}, vLLM uses TP {wrong[0][1]} ({wrong[0][0]})"
    if tp > 1 and workers and len(workers) != tp:
        return "fail", f"plan says TP {tp}, but the log shows {len(workers)} TP worker process(es)"
    if tp > 1 and not workers:
        return "warn", f"Using tensor parallel size {tp}, but no Worker_TP lines to cross-check"
    if tp == 1 and len(workers) > 1:
        return "fail", f"plan says TP 1, but the log shows {len(workers)} TP workers"
    return "pass", f"Using tensor parallel size {tp} (vLLM's {evidence[0][0]} says so)"


def stopping(lines: list[str]) -> list[bool]:
    """Per line: its run is being stopped on purpose and no engine death came yet (checks/signatures.py's
    stopping): the EngineDeadError tracebacks such a stop logs are its shutdown, not a crash."""
    out = []
    stopped = died = False
    for raw in lines:
        line = raw.rstrip("\r\n")
        if _rx("run_begins").search(line):
            stopped = died = False
        died = died or bool(_rx("engine_died").search(line))
        stopped = stopped or bool(_rx("stop_trigger").search(line))
        out.append(stopped and not died)
    return out


def stop_headline(lines: list[str]) -> str | None:
    """The line that began the last run's intended stop, without prefixes (signatures.py's intended_stop)."""
    begins = 0
    for i, line in enumerate(lines):
        if _rx("run_begins").search(line.rstrip("\r\n")):
            begins = i
    for line in lines[begins:]:
        if _rx("stop_trigger").search(line.rstrip("\r\n")):
            return strip_prefix(line).strip()
    return None


def _find(sig: dict[str, Any], msgs: list[str], start: int,
          quiet: list[bool]) -> tuple[int, int, re.Match[str]] | None:
    regexes = [re.compile(p) for p in sig["regex"]]
    end = re.compile(sig["end"]) if sig.get("end") else None
    for i in range(start, len(msgs)):
        found = None
        for rx in regexes:
            found = rx.search(msgs[i])
            if found:
                break
        if found is None:
            continue
        j = i if end is None else next((k for k in range(i + 1, min(len(msgs), i + 1 + DATA["max_span"]))
                                        if end.search(msgs[k])), None)
        if j is None or (sig["shutdown"] and quiet[i] and quiet[j]):
            continue
        return i, j, found
    return None


def fatal_matches(lines: list[str]) -> list[dict[str, Any]]:
    """The fatal start-up signatures in `lines`, in order of first appearance (checks/signatures.py's scan)."""
    msgs = [strip_prefix(line) for line in lines]
    quiet = stopping(lines)
    found = []
    for sig in DATA["signatures"]:
        first = _find(sig, msgs, 0, quiet)
        if first is None:
            continue
        i, j, _ = first
        found.append({"signature": sig["name"], "severity": sig["severity"], "line_no": i,
                      "headline": msgs[j].strip(), "cause": sig["cause"], "generic": sig["generic"]})
    if any(not m["generic"] and m["severity"] == "fail" for m in found):
        found = [m for m in found if not m["generic"]]
    return sorted(found, key=lambda m: m["line_no"])


def fatal_verdict(lines: list[str]) -> tuple[str, list[dict[str, Any]]]:
    matches = fatal_matches(lines)
    if not matches:
        return "pass", []
    return ("fail" if any(m["severity"] == "fail" for m in matches) else "warn"), matches


# --- the host's state ----------------------------------------------------------------------------------

def run(argv: list[str]) -> str:
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, check=False).stdout


def show(unit: str, prop: str) -> str:
    return run(["systemctl", "show", "-p", prop, "--value", unit]).strip()


def journal(unit: str) -> list[str]:
    """The messages of the unit's current run (its InvocationID), as `journalctl -o cat` prints them."""
    invocation = show(unit, "InvocationID")
    if not invocation:
        return []
    text = run(["journalctl", "_SYSTEMD_INVOCATION_ID=" + invocation, "+", "INVOCATION_ID=" + invocation,
                "-o", "cat", "--no-pager"])
    return text.splitlines()


def sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


def managed_paths(units: list[str]) -> list[str]:
    out = []
    for unit in units:
        out += [UNIT_DIR + "/" + unit + ".service", ENV_DIR + "/" + unit + ".env"]
    return out


def releases() -> list[dict[str, Any]]:
    """Oldest first, unreadable records skipped (remote/releases.py's parse_list)."""
    out = []
    try:
        names = sorted(n for n in os.listdir(RELEASES_DIR) if not n.endswith(".tmp"))
    except OSError:
        return []
    for name in names:
        try:
            with open(os.path.join(RELEASES_DIR, name, "release.json")) as fh:
                out.append(json.load(fh))
        except (OSError, ValueError):
            continue
    return out


def running_release(unit: str, files: dict[str, str | None], kept: list[dict[str, Any]]) -> str | None:
    """The newest of the `kept` releases whose unit and env file are the installed ones (remote/releases.py)."""
    paths = managed_paths([unit])
    for release in reversed(kept):
        recorded = release.get("files", {})
        if paths[0] in recorded and all(recorded.get(p) == files.get(p) for p in paths):
            return str(release["id"])
    return None


def pending() -> dict[str, str]:
    out = {}
    try:
        with open(PENDING_FILE) as fh:
            for line in fh:
                words = line.split()
                if words and words[0] not in out:
                    out[words[0]] = words[1] if len(words) > 1 else ""
    except OSError:
        pass
    return out


def write_pending(entries: dict[str, str]) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(PENDING_FILE + ".new", "w") as fh:
        for unit, release in entries.items():
            fh.write((unit + " " + release).strip() + "\n")
    os.replace(PENDING_FILE + ".new", PENDING_FILE)


def audit(record: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(AUDIT_LOG), exist_ok=True)
    with open(AUDIT_LOG, "a") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")
    os.chmod(AUDIT_LOG, 0o600)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def who(args: argparse.Namespace) -> dict[str, Any]:
    return {"time": now_iso(), "user": args.user, "controller": args.controller, "command": args.command}


# --- commands ------------------------------------------------------------------------------------------

def cmd_lock(args: argparse.Namespace) -> int:
    if args.action == "release":
        try:
            with open(LOCK_DIR + "/info") as fh:
                mine = args.token in fh.read()
        except OSError:
            mine = False
        if mine:
            shutil.rmtree(LOCK_DIR, ignore_errors=True)
        return 0
    os.makedirs(STATE_DIR, exist_ok=True)
    os.chmod(STATE_DIR, 0o755)
    info = {"token": args.token, "user": args.user, "controller": args.controller, "pid": args.pid,
            "command": args.command, "since": time.time()}
    try:
        os.mkdir(LOCK_DIR)
    except FileExistsError:
        try:
            with open(LOCK_DIR + "/info") as fh:
                held = fh.read()
        except OSError:
            held = ""
        if args.token in held:
            return 0
        try:
            holder = json.loads(held)
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(holder["since"])))
            print("deploy lock held by {}@{} (pid {}) since {}: {}".format(
                holder["user"], holder["controller"], holder["pid"], when, holder["command"]))
        except (ValueError, KeyError, TypeError):
            print(f"deploy lock held (no readable details in {LOCK_DIR}/info)")
        print("wait for that run to finish; if it died, `ernie-deploy lock -i INV --break` removes it")
        return HELD_EXIT
    with open(LOCK_DIR + "/info.tmp", "w") as fh:
        fh.write(json.dumps(info, sort_keys=True) + "\n")
    os.replace(LOCK_DIR + "/info.tmp", LOCK_DIR + "/info")
    return 0


def cmd_state(args: argparse.Namespace) -> int:
    """What each unit runs now: active or not, pending, the release it runs, and every managed file's hash."""
    files = {p: sha256(p) for p in managed_paths(args.units)}
    marked, kept = pending(), releases()
    units = {}
    for unit in args.units:
        service = unit + ".service"
        units[unit] = {"active": show(service, "ActiveState") in ("active", "activating", "reloading"),
                       "pending": service in marked, "release": running_release(unit, files, kept)}
    print(json.dumps({"units": units, "files": files}, sort_keys=True))
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    """Record a release of the managed files as they now are (converge.stage_command's release), mark the
    running units whose files changed pending with the release they ran, and append the audit line."""
    before = json.loads(args.before)
    files = {p: sha256(p) for p in managed_paths(args.units)}
    changed = sorted(p for p, h in files.items() if h != before["files"].get(p))
    if not changed:
        return 0
    digest = hashlib.sha256("".join(f"{p}\0{files[p]}\n" for p in sorted(files)).encode()).hexdigest()[:8]
    stamp = time.time()
    rid = time.strftime("%Y%m%dT%H%M%S", time.gmtime(stamp)) + f".{int(stamp * 1000) % 1000:03d}Z-{digest}"
    touched = sorted({os.path.basename(p).rsplit(".", 1)[0] for p in changed})
    running = [u for u in touched if before["units"].get(u, {}).get("active")]
    record = dict(who(args), host=args.host, action="stage",
                  files=[{"path": p, "old_sha256": before["files"].get(p), "new_sha256": files[p]} for p in changed],
                  restart=[u + ".service" for u in running],
                  start=[u + ".service" for u in touched if u not in running], prune=[])
    release = dict(record, id=rid, files=files, changed=changed)
    os.umask(0o077)
    for path in (STATE_DIR, RELEASES_DIR):
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o700)
    marked = pending()
    for unit in running:
        marked.setdefault(unit + ".service", before["units"][unit].get("release") or "")
    write_pending(marked)
    tmp = os.path.join(RELEASES_DIR, rid + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for path in files:
        os.makedirs(tmp + os.path.dirname(path), exist_ok=True)
        shutil.copy2(path, tmp + path)
    with open(tmp + "/release.json", "w") as fh:
        fh.write(json.dumps(release, sort_keys=True, indent=1) + "\n")
    os.rename(tmp, os.path.join(RELEASES_DIR, rid))
    protect = {str(u.get("release")) for u in before["units"].values() if u.get("release")}
    kept = [r["id"] for r in releases()]
    for old in kept[:-max(1, args.keep)]:
        if old != rid and old not in protect:
            shutil.rmtree(os.path.join(RELEASES_DIR, old), ignore_errors=True)
    audit(record)
    print("release " + rid)
    return 0


def cmd_started(args: argparse.Namespace) -> int:
    """The unit runs its files now: take it off the pending list."""
    marked = pending()
    if marked.pop(args.unit + ".service", None) is not None:
        write_pending(marked)
    audit(dict(who(args), host=args.host, action=args.action, unit=args.unit + ".service"))
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    """Put a unit's files back as the release it ran has them (remote/releases.py's restore); print `none`
    when no release has the unit (a first deploy: the caller stops and disables it)."""
    if not args.release:
        print("none")
        return 0
    src = os.path.join(RELEASES_DIR, args.release)
    os.umask(0o077)
    for path in managed_paths([args.unit]):
        if os.path.exists(src + path):
            tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".new")
            shutil.copy2(src + path, tmp)
            os.replace(tmp, path)
    audit(dict(who(args), host=args.host, action="rollback", unit=args.unit + ".service", release=args.release))
    print("restored " + args.release)
    return 0


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except Exception:
        return None


def cmd_wait(args: argparse.Namespace) -> int:
    """Wait until the unit answers /health 200 for `stable` seconds; end at once, naming the signature, when
    its journal shows a fatal start-up line or systemd restarted it, and naming the stop when it is being
    stopped (readiness.py's gate, in small)."""
    service = args.unit + ".service"
    restarts = show(service, "NRestarts")
    deadline = time.monotonic() + args.timeout
    healthy_since: float | None = None
    while True:
        state = show(service, "ActiveState")
        lines = journal(service)
        verdict, matches = fatal_verdict(lines)
        if verdict == "fail":
            top = next(m for m in matches if m["severity"] == "fail")
            print("{} failed to start: {}: {} ({})".format(service, top["signature"], top["headline"], top["cause"]))
            return 1
        stop = stop_headline(lines)
        if stop is not None:
            # Someone else stopped it (systemctl stop, the host shutting down): it will not become ready.
            print(f"{service} was stopped while waiting for it to become ready ({stop}): a stop was requested, "
                  "not a crash")
            return 1
        if state == "failed" or show(service, "NRestarts") != restarts:
            print(f"{service} exited during start-up (state {state}); journalctl -u {service} shows why")
            return 1
        if state == "active" and _health(args.url) == 200:
            healthy_since = healthy_since if healthy_since is not None else time.monotonic()
            if time.monotonic() - healthy_since >= args.stable:
                print(f"{service} ready: /health 200 for {args.stable:.0f}s")
                return 0
        else:
            healthy_since = None
        if time.monotonic() > deadline:
            print(f"{service} not ready after {args.timeout:.0f}s (state {state})")
            return 2
        time.sleep(args.interval)


def cmd_check(args: argparse.Namespace) -> int:
    """The start-up log of the unit's current run: the tensor parallel size in use and no fatal lines."""
    if args.log is None:
        lines = journal(args.unit + ".service")
    else:
        with open(args.log) as fh:
            lines = fh.read().splitlines()
    tp, tp_why = tp_verdict(lines, args.tp)
    fatal, matches = fatal_verdict(lines)
    stop = stop_headline(lines)
    clean = "no fatal start-up errors in the log" if stop is None else \
        f"no fatal start-up errors in the log; the run was stopped on request ({stop}): what it logged after that " \
        "is its shutdown, not a crash"
    out = {"tensor_parallel": {"status": tp, "message": tp_why},
           "startup_errors": {"status": fatal, "signatures": [m["signature"] for m in matches],
                              "message": "; ".join("{}: {}".format(m["signature"], m["headline"]) for m in matches)
                              or clean}}
    print(json.dumps(out, sort_keys=True))
    return 1 if "fail" in (tp, fatal) else 0


# >>> balancers
# --- HAProxy's runtime API (the balancers of docs/balancer.md) -------------------------------------------

_HAPROXY_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


def haproxy_command(path: str, command: str, timeout: float = 10.0) -> str:
    """Send one command to HAProxy's admin socket and return its whole answer: a non-interactive command gets
    one answer, then HAProxy closes the connection (management.txt, section 9.3)."""
    import socket  # here: an export without balancers ships no part of this command

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(path)
        conn.sendall(command.encode() + b"\n")
        chunks = []
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        conn.close()
    return b"".join(chunks).decode(errors="replace")


def socket_problem(path: str, exc: OSError) -> str:
    """Why HAProxy's admin socket could not be used, and what to do about it."""
    if isinstance(exc, FileNotFoundError):
        return (f"no HAProxy admin socket at {path}: HAProxy is not running with this configuration (its global "
                "section needs `stats socket ... level admin`); run site.yml to deploy the balancer")
    if isinstance(exc, PermissionError):
        return f"permission denied on HAProxy's admin socket {path}: run as root or as a member of its group"
    if isinstance(exc, ConnectionRefusedError):
        return f"HAProxy's admin socket {path} refuses connections: HAProxy is not running (systemctl status haproxy)"
    return f"HAProxy's admin socket {path}: {exc}"


def server_stat(csv_text: str, backend: str, server: str) -> dict[str, Any] | None:
    """One server's row of `show stat` (CSV whose first line, "# pxname,svname,...", names the columns)."""
    lines = csv_text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return None
    columns = lines[0][2:].split(",")
    for line in lines[1:]:
        values = line.split(",")
        row = {name: values[i] for i, name in enumerate(columns) if i < len(values)}
        if row.get("pxname") == backend and row.get("svname") == server:
            return {"backend": backend, "server": server, "status": row.get("status", ""),
                    "scur": int(row.get("scur") or 0), "weight": int(row.get("weight") or 0)}
    return None


def cmd_haproxy(args: argparse.Namespace) -> int:
    """`set`: one server's administrative state (drain or ready); HAProxy answers an empty line when it took the
    command, an error text otherwise. `stat`: one server as `show stat` reports it, as JSON."""
    backend, _, server = args.server.partition("/")
    # HAProxy's own name characters only: a space or newline would smuggle a second runtime command in.
    if not (_HAPROXY_NAME.fullmatch(backend) and _HAPROXY_NAME.fullmatch(server)):
        print(f"{args.server!r} is not BACKEND/SERVER in HAProxy's name characters (letters, digits, - _ . :)")
        return 2
    if args.action == "set" and args.state is None:
        print("set needs the state: drain or ready")
        return 2
    try:
        if args.action == "set":
            answer = haproxy_command(args.socket, f"set server {backend}/{server} state {args.state}").strip()
            if answer:
                print(f"HAProxy refused `set server {backend}/{server} state {args.state}`: {answer}")
                return 1
            print(f"{backend}/{server} {args.state}")
            return 0
        stat = server_stat(haproxy_command(args.socket, "show stat"), backend, server)
    except OSError as exc:
        print(socket_problem(args.socket, exc))
        return 1
    if stat is None:
        print(f"HAProxy's show stat has no server {backend}/{server}: its configuration does not front this "
              "instance yet; run site.yml to deploy the balancer")
        return 1
    print(json.dumps(stat, sort_keys=True))
    return 0


# <<< balancers
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ernie_host.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    sub.required = True

    def whom(q: argparse.ArgumentParser) -> None:
        q.add_argument("--user", default="ansible")
        q.add_argument("--controller", default="")
        q.add_argument("--command", default="ansible-playbook")
        q.add_argument("--host", default="")

    q = sub.add_parser("lock")
    q.add_argument("action", choices=("acquire", "release"))
    q.add_argument("--token", required=True)
    q.add_argument("--pid", type=int, default=0)
    whom(q)
    q.set_defaults(func=cmd_lock)
    q = sub.add_parser("state")
    q.add_argument("units", nargs="+")
    q.set_defaults(func=cmd_state)
    q = sub.add_parser("record")
    q.add_argument("--before", required=True, help="the state command's JSON from before the files were copied")
    q.add_argument("--keep", type=int, default=5)
    q.add_argument("units", nargs="+")
    whom(q)
    q.set_defaults(func=cmd_record)
    q = sub.add_parser("started")
    q.add_argument("unit")
    q.add_argument("--action", default="start")
    whom(q)
    q.set_defaults(func=cmd_started)
    q = sub.add_parser("restore")
    q.add_argument("unit")
    q.add_argument("release", nargs="?", default="")
    whom(q)
    q.set_defaults(func=cmd_restore)
    q = sub.add_parser("wait")
    q.add_argument("unit")
    q.add_argument("--url", required=True)
    q.add_argument("--timeout", type=float, default=600)
    q.add_argument("--stable", type=float, default=10)
    q.add_argument("--interval", type=float, default=0.5)
    q.set_defaults(func=cmd_wait)
    q = sub.add_parser("check")
    q.add_argument("unit")
    q.add_argument("--tp", type=int, required=True)
    q.add_argument("--log", help="judge this file instead of the unit's journal")
    q.set_defaults(func=cmd_check)
    # >>> balancers
    q = sub.add_parser("haproxy", help="one command to HAProxy's runtime API on this host")
    q.add_argument("--socket", required=True, help="HAProxy's admin socket (stats socket ... level admin)")
    q.add_argument("action", choices=("set", "stat"))
    q.add_argument("server", help="BACKEND/SERVER")
    q.add_argument("state", nargs="?", choices=("drain", "ready"), help="for set: the state to put it in")
    q.set_defaults(func=cmd_haproxy)
    # <<< balancers
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
