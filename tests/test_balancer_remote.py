"""The remote side of the balancer: the apply script (run for real with stand-ins for haproxy and systemctl),
the runtime program against a real HAProxy, and `Balancers` over the fake host."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import needs_haproxy
from fakehost import FakeBalancer, FakeHost, connector

from ernie_deploy.errors import DeployError
from ernie_deploy.inventory.inventory import Host
from ernie_deploy.orchestration.balancers import Balancers
from ernie_deploy.orchestration.fleet import Fleet, FleetOptions
from ernie_deploy.planning.balancer import DEBIAN_CONFIG, BalancerBackend, BalancerPlan, BalancerServer
from ernie_deploy.planning.balancer import unit_dropin as dropin_text
from ernie_deploy.planning.hostpaths import AUDIT_LOG
from ernie_deploy.planning.settings import Secret
from ernie_deploy.remote import lock
from ernie_deploy.remote.balancer import (
    ApplyBalancer,
    admin_command,
    admin_problem,
    apply_command,
    parse_admin,
    parse_apply,
    parse_stat,
    set_command,
    set_problem,
)
from ernie_deploy.remote.command import Op

KEY = "sk-balancer-secret"



def plan(host: str = "lb-1", *, config: str = DEBIAN_CONFIG, sock: str = "/run/haproxy/admin.sock",
         servers: tuple[tuple[str, int], ...] = (("gpu-a", 0), ("gpu-b", 0))) -> BalancerPlan:
    backend = BalancerBackend("ernie", "ernie", tuple(
        BalancerServer(f"{h}-{i}", h, i, f"ernie-vllm-{i}", "127.0.0.1", 8000 + i, 1) for h, i in servers),
        Secret(KEY))
    return BalancerPlan(host, "127.0.0.1", "0.0.0.0", 8080, sock, config, 2.0, (backend,))


def config_for(p: BalancerPlan, extra: str = "") -> str:
    lines = ["global", f"  stats socket {p.admin_socket} mode 660 level admin", "defaults", "  mode http"]
    for b in p.backends:
        lines.append(f"backend {b.name}")
        lines += [f"  server {s.name} {s.address}:{s.port} check weight {s.weight}" for s in b.servers]
    return "\n".join(lines) + "\n" + extra


# --- the intents' scripts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [DEBIAN_CONFIG, "/srv/lb/haproxy.cfg"])
@pytest.mark.parametrize("check", [False, True])
def test_apply_script_is_valid_sh(config: str, check: bool) -> None:
    cmd = apply_command(plan(config=config), "cfg", {"action": "balancer apply"}, check=check)
    assert subprocess.run(["sh", "-n"], input=cmd.script, text=True).returncode == 0
    locked = lock.Acquire(lock.LockInfo.mine("deploy"), cmd.intent)
    assert subprocess.run(["sh", "-n"], input=locked.render(), text=True).returncode == 0


def test_admin_script_is_valid_sh_and_commands_are_checked() -> None:
    cmd = admin_command("/run/haproxy/admin.sock", [set_command("ernie", "gpu-a-0", "drain"), "show stat"])
    assert cmd.op is Op.BALANCER_ADMIN
    assert subprocess.run(["sh", "-n"], input=cmd.script, text=True).returncode == 0
    with pytest.raises(ValueError, match="not a runtime command"):
        admin_command("/s", ["set server ernie/a state drain; shutdown sessions server ernie/a"])


def test_the_config_and_its_api_key_travel_on_stdin_only() -> None:
    p = plan()
    cmd = apply_command(p, config_for(p, f'  http-check send hdr Authorization "Bearer {KEY}"\n'), {"a": 1})
    assert cmd.op is Op.BALANCER_APPLY
    assert KEY in cmd.stdin.decode() and KEY not in cmd.script


@pytest.mark.parametrize(("field", "variable"), [("config_path", "vllm_balancer_config"),
                                                  ("admin_socket", "vllm_balancer_admin_socket")])
@pytest.mark.parametrize("bad", ["relative/haproxy.cfg", "/etc/haproxy/a b.cfg", "/etc/$(reboot)", "/etc/../x"])
def test_a_path_that_is_not_plain_is_refused_naming_host_and_variable(field: str, variable: str, bad: str) -> None:
    p = plan(config=bad) if field == "config_path" else plan(sock=bad)
    with pytest.raises(DeployError, match=variable) as err:
        apply_command(p, "cfg", {})
    assert err.value.where == "lb-1" and err.value.hint


def test_a_drop_in_only_outside_debians_defaults() -> None:
    assert dropin_text(DEBIAN_CONFIG, "/run/haproxy") is None
    text = dropin_text("/srv/lb/h.cfg", "/run/lb")
    assert text is not None and "Environment=CONFIG=/srv/lb/h.cfg" in text and "mkdir -p /run/lb" in text
    assert "ExecStartPre" not in (dropin_text("/srv/lb/h.cfg", "/run/haproxy") or "")


# --- the apply script, run for real -------------------------------------------------------------------------

FAKES = {
    # haproxy -c: a file containing BROKEN fails with HAProxy's own kind of message.
    "haproxy": """#!/bin/sh
echo "haproxy $*" >> "$FAKE/calls"
f=$3
if grep -q BROKEN "$f"; then
  echo "[NOTICE]   (1) : haproxy version is 2.6.12"
  echo "[ALERT]    (1) : config : parsing [$f:5] : unknown keyword 'BROKEN' in 'backend' section"
  echo "[ALERT]    (1) : config : Fatal errors found in configuration."
  exit 1
fi
echo "Configuration file is valid"
""",
    # systemctl: the unit's state is a file; $FAKE/fail.ACTION holds how many times ACTION fails yet.
    "systemctl": """#!/bin/sh
echo "systemctl $*" >> "$FAKE/calls"
case "$1" in
  is-active) [ -e "$FAKE/active" ];;
  is-enabled) [ -e "$FAKE/enabled" ];;
  daemon-reload) true;;
  *)
    action=$1; [ "$action" = enable ] && action=start
    n=$(cat "$FAKE/fail.$action" 2>/dev/null || echo 0)
    if [ "$n" -gt 0 ]; then
      echo $((n - 1)) > "$FAKE/fail.$action"; echo "Job for haproxy.service failed." >&2; exit 1
    fi
    touch "$FAKE/active" "$FAKE/enabled";;
esac
""",
    "journalctl": """#!/bin/sh
echo "[ALERT]    (9) : Starting frontend main: cannot bind socket (Address already in use) [0.0.0.0:8080]"
""",
    "apt-get": """#!/bin/sh
echo "apt-get $*" >> "$FAKE/calls"
if [ "$2" = "-y" ] && [ -e "$FAKE/noinstall" ]; then echo "E: Unable to locate package haproxy"; exit 100; fi
[ "$1" = install ] && cp "$FAKE/haproxy.real" "$FAKE/bin/haproxy"
true
""",
    "getent": "#!/bin/sh\nexit 2\n",
}


class Box:
    """A temp directory standing in for a balancer host: fake haproxy, systemctl, journalctl, apt-get."""

    def __init__(self, root: Path, *, haproxy: bool = True, active: bool = True) -> None:
        self.root = root
        (root / "bin").mkdir(parents=True)
        for name, text in FAKES.items():
            path = root / "bin" / name
            path.write_text(text)
            path.chmod(0o755)
        (root / "haproxy.real").write_text(FAKES["haproxy"])
        (root / "haproxy.real").chmod(0o755)
        if not haproxy:
            (root / "bin" / "haproxy").unlink()
        if active:
            (root / "active").touch()
            (root / "enabled").touch()
        self.config = root / "etc" / "haproxy.cfg"
        self.dropin = root / "unit.d" / "ernie-deploy.conf"
        self.audit = root / "audit.log"

    def apply(self, text: str, *, check: bool = False) -> tuple[str, int]:
        p = plan(config=str(self.config), sock=str(self.root / "run" / "admin.sock"))
        cmd = apply_command(p, text, {"action": "balancer apply", "host": "lb-1"}, check=check)
        assert isinstance(cmd.intent, ApplyBalancer)
        script = dataclasses.replace(cmd.intent, dropin=str(self.dropin)).render().replace(AUDIT_LOG, str(self.audit))
        # /usr/sbin is left off PATH: the real haproxy there must not be found.
        env = {"PATH": f"{self.root / 'bin'}:/usr/bin:/bin", "FAKE": str(self.root), "LANG": "C"}
        done = subprocess.run(["sh", "-c", script], input=cmd.stdin, capture_output=True, env=env, timeout=30)
        return done.stdout.decode(), done.returncode

    def result(self, text: str, *, check: bool = False):  # type: ignore[no-untyped-def]
        out, _ = self.apply(text, check=check)
        p = plan(config=str(self.config))
        return parse_apply("lb-1", p, out, check=check)

    def calls(self) -> list[str]:
        path = self.root / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in self.config.parent.iterdir() if "ernie-new" in p.name)


def test_first_apply_stages_privately_and_starts_haproxy(tmp_path: Path) -> None:
    box = Box(tmp_path, active=False)
    applied = box.result("first BALANCER\n")
    assert applied.ok and applied.changed and applied.started and not applied.reloaded
    assert box.config.read_text() == "first BALANCER\n"
    assert stat.S_IMODE(box.config.stat().st_mode) == 0o640
    assert (tmp_path / "run").is_dir()
    assert "Environment=CONFIG=" + str(box.config) in box.dropin.read_text()
    assert "systemctl enable -q --now haproxy" in box.calls()
    assert '"action": "balancer apply"' in box.audit.read_text()
    assert box.leftovers() == []


def test_unchanged_config_reloads_nothing_and_writes_no_audit(tmp_path: Path) -> None:
    box = Box(tmp_path)
    assert box.result("same\n").changed
    box.audit.unlink()
    (tmp_path / "calls").unlink()
    applied = box.result("same\n")
    assert applied.ok and not applied.changed and not applied.reloaded and not applied.started
    assert not any(c.startswith(("systemctl reload", "systemctl restart", "systemctl enable")) for c in box.calls())
    assert not box.audit.exists()


def test_unchanged_config_but_haproxy_stopped_is_started(tmp_path: Path) -> None:
    box = Box(tmp_path)
    box.result("same\n")
    (tmp_path / "active").unlink()
    applied = box.result("same\n")
    assert applied.ok and not applied.changed and applied.started


def test_changed_config_reloads_and_keeps_the_previous_file(tmp_path: Path) -> None:
    box = Box(tmp_path)
    first = box.result("one\n")
    assert first.restarted  # the first apply added the unit drop-in: a new CONFIG needs a restart
    applied = box.result("two\n")
    assert applied.ok and applied.changed and applied.reloaded and not applied.restarted
    assert box.config.read_text() == "two\n"
    assert Path(f"{box.config}.ernie-prev").read_text() == "one\n"
    assert "systemctl reload haproxy" in box.calls()


def test_invalid_config_changes_nothing_and_quotes_haproxy(tmp_path: Path) -> None:
    box = Box(tmp_path)
    box.result("good\n")
    (tmp_path / "calls").unlink()
    out, code = box.apply("backend x\n  BROKEN\n")
    applied = parse_apply("lb-1", plan(config=str(box.config)), out)
    assert code == 1 and not applied.ok and not applied.changed
    assert applied.error is not None and "fails `haproxy -c`" in applied.error
    assert "unknown keyword 'BROKEN'" in applied.error and "Fatal errors found" in applied.error
    assert box.config.read_text() == "good\n" and box.leftovers() == []
    assert not any(c.startswith("systemctl reload") for c in box.calls())


def test_failed_reload_puts_the_old_file_back_and_reloads_it(tmp_path: Path) -> None:
    box = Box(tmp_path)
    box.result("good\n")
    (tmp_path / "fail.reload").write_text("1\n")
    applied = box.result("new but unbindable\n")
    assert not applied.ok and applied.restored and not applied.changed
    assert applied.error is not None and "did not reload" in applied.error and "previous configuration is back" in \
        applied.error and "Address already in use" in applied.error
    assert box.config.read_text() == "good\n"
    assert box.calls().count("systemctl reload haproxy") == 2  # the new file, then the old one again


def test_a_reload_that_fails_for_the_old_file_too_says_so(tmp_path: Path) -> None:
    box = Box(tmp_path)
    box.result("good\n")
    (tmp_path / "fail.reload").write_text("2\n")
    applied = box.result("new\n")
    assert not applied.ok and not applied.restored
    assert applied.error is not None and "did not take it either" in applied.error
    assert box.config.read_text() == "good\n"


def test_failed_first_start_leaves_no_config_behind(tmp_path: Path) -> None:
    box = Box(tmp_path, active=False)
    (tmp_path / "fail.start").write_text("1\n")
    applied = box.result("cfg\n")
    assert not applied.ok and applied.error is not None and "did not start" in applied.error
    assert not box.config.exists() and not box.dropin.exists()


def test_missing_haproxy_is_installed(tmp_path: Path) -> None:
    box = Box(tmp_path, haproxy=False, active=False)
    applied = box.result("cfg\n")
    assert applied.ok and applied.installed and applied.started
    assert any(c.startswith("apt-get install -y -q haproxy") for c in box.calls())


def test_failed_install_quotes_apt(tmp_path: Path) -> None:
    box = Box(tmp_path, haproxy=False)
    (tmp_path / "noinstall").touch()
    applied = box.result("cfg\n")
    assert not applied.ok and applied.error is not None and "Unable to locate package haproxy" in applied.error
    assert any(c.startswith("apt-get update") for c in box.calls())  # retried with a fresh package list
    assert not box.config.exists()


def test_check_mode_changes_nothing(tmp_path: Path) -> None:
    box = Box(tmp_path, active=False)
    applied = box.result("cfg\n", check=True)
    assert applied.ok and applied.check and applied.changed and applied.started  # would start
    assert not box.config.exists() and not box.dropin.exists() and not box.audit.exists()
    assert not any(c.startswith("systemctl") and "is-" not in c for c in box.calls())
    missing = Box(tmp_path / "bare", haproxy=False)
    assert missing.result("cfg\n", check=True).installed and missing.calls() == []


def test_a_script_that_stops_early_is_an_error() -> None:
    applied = parse_apply("lb-1", plan(), "", "sh: 1: sudo: not found")
    assert not applied.ok and applied.error is not None and "sudo: not found" in applied.error


@needs_haproxy
def test_real_haproxy_checks_the_staged_file(tmp_path: Path) -> None:
    box = Box(tmp_path)
    (tmp_path / "bin" / "haproxy").unlink()
    (tmp_path / "bin" / "haproxy").symlink_to(shutil.which("haproxy") or "/usr/sbin/haproxy")
    good = config_for(plan(sock=str(tmp_path / "admin.sock")))
    assert box.result(good).ok
    applied = box.result(good.replace("  mode http", "  mode http\n  balance leastconnn"))
    assert not applied.ok and applied.error is not None and "[ALERT]" in applied.error
    assert "balance only supports" in applied.error and box.config.read_text() == good


# --- the runtime program against a real HAProxy -------------------------------------------------------------



class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def haproxy(tmp_path: Path) -> Iterator[Path]:
    """A real HAProxy with backend `ernie`: server up-0 answers its checks, down-0 points at a closed port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sock = tmp_path / "admin.sock"
    (tmp_path / "h.cfg").write_text(f"""global
  stats socket {sock} mode 660 level admin
defaults
  mode http
  timeout connect 1s
  timeout client 10s
  timeout server 10s
frontend main
  bind 127.0.0.1:{_closed_port()}
  default_backend ernie
backend ernie
  balance leastconn
  option httpchk GET /
  default-server inter 200ms fall 2 rise 2
  server up-0 127.0.0.1:{server.server_address[1]} check weight 3
  server down-0 127.0.0.1:{_closed_port()} check weight 1
""")
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(tmp_path / "h.cfg")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sock.exists(), "haproxy did not create its admin socket"
        yield sock
    finally:
        proc.terminate()
        proc.wait(10)
        server.shutdown()


def _admin(sock: Path, *commands: str):  # type: ignore[no-untyped-def]
    cmd = admin_command(str(sock), commands, timeout=5)
    done = subprocess.run(["sh", "-c", cmd.script], input=cmd.stdin, capture_output=True, timeout=30)
    return parse_admin(done.stdout.decode())


def _stat(sock: Path) -> dict[str, object]:
    return {sv: s for (px, sv), s in parse_stat(_admin(sock, "show stat").answers[0]).items() if px == "ernie"}


def _until_checked(sock: Path) -> None:
    """Until the checks settled: up-0 UP, down-0 DOWN (each needs 2 checks, rise/fall 2)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        live = _stat(sock)
        if live["up-0"].status == "UP" and live["down-0"].status == "DOWN":  # type: ignore[attr-defined]
            return
        time.sleep(0.1)
    raise AssertionError(f"HAProxy's checks did not settle: {_stat(sock)}")


@needs_haproxy
def test_show_stat_reads_servers_without_summary_rows(haproxy: Path) -> None:
    _until_checked(haproxy)
    live = parse_stat(_admin(haproxy, "show stat").answers[0])
    assert ("main", "FRONTEND") not in live and ("ernie", "BACKEND") not in live
    up, down = live[("ernie", "up-0")], live[("ernie", "down-0")]
    assert up.up and up.weight == 3 and up.scur == 0
    assert not down.up and down.weight == 1


@needs_haproxy
def test_drain_then_ready_through_the_admin_socket(haproxy: Path) -> None:
    _until_checked(haproxy)
    answers = _admin(haproxy, set_command("ernie", "up-0", "drain"), "show stat")
    assert answers.error is None and set_problem(answers.answers[0]) is None
    drained = parse_stat(answers.answers[1])[("ernie", "up-0")]
    assert drained.status == "DRAIN" and not drained.up
    answers = _admin(haproxy, set_command("ernie", "up-0", "ready"), "show stat")
    assert set_problem(answers.answers[0]) is None
    assert parse_stat(answers.answers[1])[("ernie", "up-0")].up


@needs_haproxy
def test_an_unknown_server_gives_haproxys_error(haproxy: Path) -> None:
    answers = _admin(haproxy, set_command("ernie", "nope-0", "drain"), set_command("other", "up-0", "drain"))
    assert [set_problem(a) for a in answers.answers.values()] == ["No such server.", "No such backend."]


def test_a_missing_socket_is_a_clear_problem(tmp_path: Path) -> None:
    answers = _admin(tmp_path / "none.sock", "show stat")
    assert answers.error == "missing" and answers.answers == {}
    problem = admin_problem("lb-1", str(tmp_path / "none.sock"), answers.error, answers.detail)
    assert problem.startswith("lb-1: ") and "ernie-deploy deploy -i INV --limit lb-1" in problem


def test_a_socket_nobody_listens_on_means_haproxy_is_not_running(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(path))  # bound, never listening: what a dead HAProxy leaves behind
        answers = _admin(path, "show stat")
    assert answers.error == "refused"
    assert "HAProxy is not running" in admin_problem("lb-1", str(path), answers.error, answers.detail)


def test_socket_problems_are_distinct_and_name_the_host() -> None:
    texts = {kind: admin_problem("lb-9", "/run/haproxy/admin.sock", kind, "x")
             for kind in ("missing", "refused", "denied", "timeout", "python3")}
    assert len(set(texts.values())) == len(texts) and all(t.startswith("lb-9: ") for t in texts.values())
    assert "become root" in texts["denied"]


# --- Balancers over the fake host ---------------------------------------------------------------------------


def _balancers(fakes: dict[str, FakeHost], plans: list[BalancerPlan]) -> Balancers:
    hosts = {p.host: Host(p.host, {"ansible_host": "127.0.0.1", "ansible_user": "root"}) for p in plans}
    return Balancers(Fleet(connector(fakes), FleetOptions()), plans, hosts)


def _deployed(*names: str) -> tuple[dict[str, FakeHost], Balancers]:
    plans = [plan(n) for n in names]
    fakes = {n: FakeHost(balancer=FakeBalancer()) for n in names}
    control = _balancers(fakes, plans)
    assert all(a.ok for a in control.apply(config_for).values())
    return fakes, control


def test_set_state_reaches_every_fronting_balancer() -> None:
    fakes, control = _deployed("lb-1", "lb-2")
    assert control.fronting("gpu-a", 0) == ["lb-1", "lb-2"] and control.fronting("gpu-a", 7) == []
    assert control.set_state("gpu-a", 0, "drain") == []
    for name in ("lb-1", "lb-2"):
        assert fakes[name].balancer.log[-1] == "set ernie/gpu-a-0 drain"  # type: ignore[union-attr]
    seen, problems = control.stats("gpu-a", 0)
    assert problems == [] and {n: s.status for n, s in seen.items()} == {"lb-1": "DRAIN", "lb-2": "DRAIN"}
    assert control.set_state("gpu-a", 0, "ready") == []
    assert all(s.up for s in control.stats("gpu-a", 0)[0].values())
    control.close()


def test_drained_sessions_are_read_until_none() -> None:
    fakes, control = _deployed("lb-1")
    fakes["lb-1"].balancer.draining = [2, 1]  # type: ignore[union-attr]
    control.set_state("gpu-b", 0, "drain")
    assert [control.stats("gpu-b", 0)[0]["lb-1"].scur for _ in range(3)] == [2, 1, 0]


def test_unreachable_balancer_is_a_problem_naming_it_not_an_exception() -> None:
    plans = [plan("lb-1"), plan("lb-2")]
    fakes = {"lb-1": FakeHost(balancer=FakeBalancer()), "lb-2": FakeHost(unreachable=True)}
    control = _balancers(fakes, plans)
    control.apply(config_for)
    problems = control.set_state("gpu-a", 0, "drain")
    assert len(problems) == 1 and problems[0].startswith("lb-2: ") and "unreachable" in problems[0]
    assert fakes["lb-1"].balancer.log[-1] == "set ernie/gpu-a-0 drain"  # type: ignore[union-attr]
    assert [p.split(":")[0] for p in control.unreachable()] == ["lb-2"]
    seen, problems = control.stats("gpu-a", 0)
    assert list(seen) == ["lb-1"] and problems[0].startswith("lb-2: ")
    stats = control.all_stats()
    assert isinstance(stats["lb-2"], str) and "lb-2" in stats["lb-2"]
    assert not control.apply(config_for)["lb-2"].ok


def test_a_balancer_without_haproxy_running_is_unreachable_with_the_fix() -> None:
    fakes = {"lb-1": FakeHost(balancer=FakeBalancer(running=False))}
    control = _balancers(fakes, [plan()])
    (problem,) = control.unreachable()
    assert "HAProxy is not running" in problem and "--limit lb-1" in problem
    fakes["lb-1"].balancer.socket = "missing"  # type: ignore[union-attr]
    assert "does not exist" in control.set_state("gpu-a", 0, "drain")[0]


def test_a_server_the_running_config_lacks_is_named_with_the_fix() -> None:
    fakes, control = _deployed("lb-1")
    fakes["lb-1"].balancer.servers.pop(("ernie", "gpu-b-0"))  # type: ignore[union-attr]
    (problem,) = control.set_state("gpu-b", 0, "drain")
    assert "No such server." in problem and "deploy the balancer first" in problem
    assert "has no server ernie/gpu-b-0" in control.stats("gpu-b", 0)[1][0]


def test_all_stats_is_each_balancers_view_by_server_name() -> None:
    _, control = _deployed("lb-1")
    stats = control.all_stats()["lb-1"]
    assert isinstance(stats, dict) and set(stats) == {"gpu-a-0", "gpu-b-0"}
    assert all(s.up and s.weight == 1 for s in stats.values())


def test_apply_reloads_only_a_changed_config_under_the_deploy_lock() -> None:
    fakes, control = _deployed("lb-1")
    fake = fakes["lb-1"]
    assert fake.balancer is not None and fake.balancer.log == ["reloaded"]
    assert [c.op for c in fake.received[:2]] == [Op.BALANCER_APPLY, Op.RELEASE_LOCK]
    assert isinstance(fake.received[0].intent, lock.Acquire) and fake.lock_info is None
    again = control.apply(config_for)["lb-1"]
    assert again.ok and not again.changed and not again.reloaded and fake.balancer.log == ["reloaded"]
    changed = control.apply(lambda p: config_for(p, "# new\n"))["lb-1"]
    assert changed.reloaded and fake.balancer.log == ["reloaded", "reloaded"]


def test_apply_of_an_invalid_config_changes_nothing_and_hides_the_key() -> None:
    fakes, control = _deployed("lb-1")
    fake = fakes["lb-1"].balancer
    assert fake is not None
    before = fake.config
    fake.invalid = KEY  # HAProxy quotes the offending line: here the one holding the key
    applied = control.apply(lambda p: config_for(p, f"  {KEY}\n"))["lb-1"]
    assert not applied.ok and applied.error is not None and "fails `haproxy -c`" in applied.error
    assert KEY not in applied.error and "[REDACTED]" in applied.error
    assert fake.config == before and fake.log == ["reloaded"]


def test_apply_whose_reload_fails_reports_the_restore() -> None:
    fakes, control = _deployed("lb-1")
    fakes["lb-1"].balancer.reload_fails = True  # type: ignore[union-attr]
    applied = control.apply(lambda p: config_for(p, "# new\n"))["lb-1"]
    assert not applied.ok and applied.restored and applied.error is not None and "is back" in applied.error


def test_apply_in_check_mode_takes_no_lock_and_changes_nothing() -> None:
    fakes = {"lb-1": FakeHost(balancer=FakeBalancer(installed=False, running=False))}
    control = _balancers(fakes, [plan()])
    applied = control.apply(config_for, check=True)["lb-1"]
    assert applied.ok and applied.check and applied.installed and applied.changed and applied.started
    assert fakes["lb-1"].balancer.config is None  # type: ignore[union-attr]
    assert not any(isinstance(c.intent, lock.Acquire) for c in fakes["lb-1"].received)


def test_apply_refuses_while_another_run_holds_the_lock() -> None:
    other = lock.LockInfo.mine("deploy elsewhere")
    fakes = {"lb-1": FakeHost(balancer=FakeBalancer(), lock_info=other.to_json())}
    applied = _balancers(fakes, [plan()]).apply(config_for)["lb-1"]
    assert not applied.ok and applied.error is not None and "deploy lock held" in applied.error
    assert fakes["lb-1"].balancer.config is None  # type: ignore[union-attr]


def test_a_render_error_is_that_balancers_error() -> None:
    def broken(p: BalancerPlan) -> str:
        raise DeployError("template error", where="t.j2", hint="fix the template")

    fakes = {"lb-1": FakeHost(balancer=FakeBalancer())}
    applied = _balancers(fakes, [plan()]).apply(broken)["lb-1"]
    assert applied.error == "t.j2: template error" and applied.hint == "fix the template"
    assert fakes["lb-1"].received == []


def test_a_lock_left_behind_is_an_error_that_keeps_what_was_applied() -> None:
    fakes = {"lb-1": FakeHost(balancer=FakeBalancer(), silent_from=Op.RELEASE_LOCK)}
    applied = _balancers(fakes, [plan()]).apply(config_for)["lb-1"]
    assert applied.changed and applied.reloaded
    assert applied.error is not None and applied.error.startswith("lb-1: ") and "answered nothing" in applied.error


def test_a_plan_without_its_host_is_refused() -> None:
    with pytest.raises(DeployError, match="lb-1"):
        Balancers(Fleet(connector({}), FleetOptions()), [plan()], {})


def test_applied_describes_itself_in_one_line() -> None:
    from ernie_deploy.remote.balancer import Applied

    assert Applied("lb-1").describe() == "HAProxy configuration unchanged"
    assert Applied("lb-1", changed=True, reloaded=True).describe() == "HAProxy configuration changed, reloaded"
    assert Applied("lb-1", installed=True, changed=True, started=True, check=True).describe() == \
        "HAProxy configuration would be installed, changed, started"
    assert Applied("lb-1", error="boom").describe() == "boom"
