"""The fleet's balancers planned and rendered: which instances each HAProxy fronts, under which names and weights,
the variables' checks, and the rendered configuration, which the real `haproxy` validates and runs."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import needs_haproxy

from ernie_deploy.cli.main import main
from ernie_deploy.errors import DeployError, InventoryError, RenderError
from ernie_deploy.inventory.inventory import load_inventory
from ernie_deploy.planning.balancer import (
    BalancerPlan,
    fleet_plans,
    haproxy_word,
    instance_weight,
    plan_balancers,
    render_balancer,
    split_hosts,
)
from ernie_deploy.planning.plan import PlanContext, plan_hosts

GPU = {"gpu_model": "A10", "gpu_count": 1}
KEY = 'sk-"$%#x y'  # every character HAProxy's quoting or log-format would otherwise take

Balancers = Callable[..., list[BalancerPlan]]


def write(tmp_path: Path, gpus: dict[str, Any], balancers: dict[str, Any] | None = None,
          balancer_vars: dict[str, Any] | None = None) -> Path:
    doc: dict[str, Any] = {"all": {"children": {"gpus": {"hosts": gpus}}}}
    if balancers is not None:
        doc["all"]["children"]["vllm_balancers"] = {"hosts": balancers, "vars": balancer_vars or {}}
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture
def balancers(tmp_path: Path) -> Balancers:
    """Plan the balancers of an inventory of `gpus` and `lb` (one balancer, variables given)."""

    def plan(gpus: dict[str, Any], **lb_vars: Any) -> list[BalancerPlan]:
        inventory = load_inventory(write(tmp_path, gpus, {"lb": {"ansible_host": "10.0.0.5", **lb_vars}}))
        ctx = PlanContext.load(base_dir=tmp_path)
        vllm, lbs = split_hosts(inventory.hosts.values())
        return plan_balancers(lbs, fleet_plans(vllm, ctx), tmp_path)

    return plan


def gpu(address: str, **extra: Any) -> dict[str, Any]:
    return {"ansible_host": address, **GPU, **extra}


# --- who is a balancer --------------------------------------------------------------------------------------

def test_balancer_hosts_are_split_from_vllm_hosts_with_child_groups(tmp_path: Path) -> None:
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump({"all": {"children": {
        "gpus": {"hosts": {"g1": None, "g2": None}},
        "vllm_balancers": {"hosts": {"lb-a": None}, "children": {"edge": {"hosts": {"lb-b": None}}}}}}}))
    inventory = load_inventory(path)
    vllm, lbs = split_hosts(inventory.hosts.values())
    assert [h.name for h in vllm] == ["g1", "g2"] and [h.name for h in lbs] == ["lb-a", "lb-b"]
    vllm, lbs = split_hosts(inventory.select("g2:lb-b"))
    assert [h.name for h in vllm] == ["g2"] and [h.name for h in lbs] == ["lb-b"]


# --- the plan -----------------------------------------------------------------------------------------------

def test_one_backend_per_model_sorted_servers_in_inventory_order(balancers: Balancers) -> None:
    (lb,) = balancers({
        "z1": gpu("10.0.0.21", gpu_count=2, vllm_instances=2, vllm_tensor_parallel_size=1),
        "a1": gpu("10.0.0.11", vllm_served_model_name="baidu/ERNIE"),
        "m1": gpu("10.0.0.12", vllm_host="192.168.7.12", vllm_port=9000),
    })
    assert (lb.host, lb.address, lb.bind, lb.port) == ("lb", "10.0.0.5", "0.0.0.0", 8080)
    assert (lb.admin_socket, lb.config_path, lb.check_interval, lb.template) == (
        "/run/haproxy/admin.sock", "/etc/haproxy/haproxy.cfg", 2.0, None)
    assert [(b.model, b.name) for b in lb.backends] == [("ERNIE-4.5-0.3B-PT", "ERNIE-4.5-0.3B-PT"),
                                                         ("baidu/ERNIE", "baidu_ERNIE")]
    servers = [(s.name, s.host, s.index, s.unit, s.address, s.port) for s in lb.backends[0].servers]
    # A wildcard bind is reached on the host's address; an explicit one as given.
    assert servers == [("z1-0", "z1", 0, "ernie-vllm-0", "10.0.0.21", 8000),
                       ("z1-1", "z1", 1, "ernie-vllm-1", "10.0.0.21", 8001),
                       ("m1-0", "m1", 0, "ernie-vllm-0", "192.168.7.12", 9000)]
    backend, server = lb.server_for("z1", 1) or (None, None)
    assert backend is lb.backends[0] and server is not None and server.port == 8001
    assert lb.server_for("z1", 2) is None


def test_weights_are_the_instances_gpus_or_the_variable(balancers: Balancers) -> None:
    (lb,) = balancers({"tp2": gpu("10.0.0.11", gpu_count=2), "tp1": gpu("10.0.0.12"),
                       "set": gpu("10.0.0.13", gpu_count=2, vllm_balancer_weight=200)})
    assert [(s.name, s.weight) for s in lb.backends[0].servers] == [("tp2-0", 2), ("tp1-0", 1), ("set-0", 200)]


def test_a_weight_beyond_haproxys_range_is_clamped_and_a_bad_variable_is_a_plan_error(
        plan_one: Callable[..., Any]) -> None:
    plan = plan_one(**GPU)
    huge = replace(plan.instances[0], tensor_parallel_size=64, pipeline_parallel_size=8)
    assert instance_weight(plan, huge) == (256, "tensor_parallel_size × pipeline_parallel_size")
    for bad in (0, 257, "heavy"):
        (error,) = plan_one(**GPU, vllm_balancer_weight=bad).errors
        assert "vllm_balancer_weight" in error.message
    assert "1 to 256" in (plan_one(**GPU, vllm_balancer_weight=0).errors[0].fix or "")


def test_balancer_variables_are_not_unknown_on_a_vllm_host_but_their_typos_are(plan_one: Callable[..., Any]) -> None:
    assert plan_one(**GPU, vllm_balancer_port=9090, vllm_balancer_bind="::").ok
    (error,) = plan_one(**GPU, vllm_balancer_wieght=2).errors
    assert error.fix == "did you mean vllm_balancer_weight?"


def test_variables_set_the_listener_socket_config_and_interval(balancers: Balancers) -> None:
    (lb,) = balancers({"g": gpu("10.0.0.11")}, vllm_balancer_port=9443, vllm_balancer_bind="::",
                      vllm_balancer_admin_socket="/run/lb/admin.sock", vllm_balancer_config="/etc/lb/haproxy.cfg",
                      vllm_balancer_check_interval=0.5, vllm_api_key="ignored-on-a-balancer", vllm_port=1)
    assert (lb.bind, lb.port, lb.admin_socket, lb.config_path, lb.check_interval) == (
        "::", 9443, "/run/lb/admin.sock", "/etc/lb/haproxy.cfg", 0.5)


def test_a_relative_template_starts_at_the_inventorys_directory(balancers: Balancers, tmp_path: Path) -> None:
    (tmp_path / "lb.cfg.j2").write_text("# {{ host }}\n")
    (lb,) = balancers({"g": gpu("10.0.0.11")}, vllm_balancer_template="lb.cfg.j2")
    assert lb.template == str(tmp_path / "lb.cfg.j2")
    assert render_balancer(lb) == "# lb\n"


@pytest.mark.parametrize(("variables", "message", "fix"), [
    ({"vllm_balancer_prot": 80}, "unknown variable vllm_balancer_prot", "did you mean vllm_balancer_port?"),
    ({"vllm_balancer_port": 70000}, "vllm_balancer_port must be at least 1 and at most 65535", "8080"),
    ({"vllm_balancer_port": "eighty"}, "vllm_balancer_port must be int", None),
    ({"vllm_balancer_bind": "lb.example"}, "vllm_balancer_bind must be an IP address", "0.0.0.0"),
    ({"vllm_balancer_admin_socket": "run/admin.sock"}, "must be an absolute path", "/run/haproxy/admin.sock"),
    ({"vllm_balancer_admin_socket": "/run/" + "s" * 110}, "a unix socket path may have 107", "shorter"),
    ({"vllm_balancer_config": "/etc/haproxy/../passwd"}, "without '..'", "/etc/haproxy/haproxy.cfg"),
    ({"vllm_balancer_config": "/etc/ha proxy.cfg"}, "must be an absolute path", None),
    ({"vllm_balancer_check_interval": 0}, "vllm_balancer_check_interval must be at least 0.1", "e.g. 2"),
    ({"vllm_balancer_template": "missing.j2"}, "vllm_balancer_template 'missing.j2' is not a file",
     "relative to the inventory's directory"),
])
def test_bad_balancer_variables_name_the_host_the_variable_and_the_fix(
        balancers: Balancers, variables: dict[str, Any], message: str, fix: str | None) -> None:
    with pytest.raises(InventoryError) as caught:
        balancers({"g": gpu("10.0.0.11")}, **variables)
    assert caught.value.where == "lb" and message in caught.value.message
    assert fix is None or fix in (caught.value.hint or "")


def test_every_bad_variable_of_a_balancer_is_named_at_once(balancers: Balancers) -> None:
    with pytest.raises(InventoryError) as caught:
        balancers({"g": gpu("10.0.0.11")}, vllm_balancer_port=0, vllm_balancer_check_interval=-1)
    assert "2 problems" in caught.value.message
    assert "vllm_balancer_port" in caught.value.message and "vllm_balancer_check_interval" in caught.value.message


def test_a_vllm_host_whose_plan_has_errors_makes_the_balancers_unplannable(balancers: Balancers) -> None:
    with pytest.raises(DeployError) as caught:
        balancers({"ok": gpu("10.0.0.11"), "bad": gpu("10.0.0.12", vllm_tensor_parallel_size=3)})
    assert caught.value.where == "bad" and "cannot be planned" in caught.value.message
    assert "ernie-deploy plan --limit bad" in (caught.value.hint or "") and "leave the host out" in (
        caught.value.hint or "")


def test_instances_of_one_model_with_different_api_keys_are_an_error_naming_both(balancers: Balancers) -> None:
    with pytest.raises(InventoryError) as caught:
        balancers({"a": gpu("10.0.0.11", vllm_api_key="k1"), "b": gpu("10.0.0.12", vllm_api_key="k2")})
    assert "on a and b" in caught.value.message and "k1" not in str(caught.value) and "k2" not in str(caught.value)
    with pytest.raises(InventoryError, match="different API keys on a and b"):
        balancers({"a": gpu("10.0.0.11", vllm_api_key="k1"), "b": gpu("10.0.0.12")})
    # One key per model: another model may have its own.
    (lb,) = balancers({"a": gpu("10.0.0.11", vllm_api_key="k1"),
                       "b": gpu("10.0.0.12", vllm_api_key="k2", vllm_served_model_name="other")})
    assert [b.api_key.reveal() if b.api_key else None for b in lb.backends] == ["k1", "k2"]


@pytest.mark.parametrize("model", ['my "model"', "my model", "m$HOME", "m#1", "m'1"])
def test_a_served_model_name_the_configuration_cannot_hold_is_an_error(balancers: Balancers, model: str) -> None:
    with pytest.raises(InventoryError) as caught:
        balancers({"g": gpu("10.0.0.11", vllm_served_model_name=model)})
    assert caught.value.where == "g" and "cannot be placed in the balancer's configuration" in caught.value.message


def test_instances_the_balancer_cannot_name_or_reach_are_errors(balancers: Balancers) -> None:
    with pytest.raises(InventoryError, match=r"binds the loopback address 127\.0\.0\.1, which balancer lb"):
        balancers({"g": gpu("10.0.0.11", vllm_host="127.0.0.1")})
    with pytest.raises(InventoryError, match="cannot name an HAProxy server"):
        balancers({"g/1": gpu("10.0.0.11")})
    with pytest.raises(InventoryError, match="as a-0 is"):
        balancers({"a": gpu("10.0.0.11"), "b": gpu("10.0.0.11")})
    # The lab's hosts bind their own 127.0.0.N: reachable, as is a loopback bind beside the balancer.
    assert balancers({"g": gpu("127.0.0.11", vllm_host="127.0.0.11")})
    assert balancers({"g": gpu("10.0.0.5", vllm_host="127.0.0.1")})


def test_a_balancer_with_nothing_to_front_is_an_error(balancers: Balancers) -> None:
    with pytest.raises(InventoryError, match="no vLLM host for group vllm_balancers to front"):
        balancers({})


def test_backend_names_are_haproxy_names_and_unique(balancers: Balancers) -> None:
    (lb,) = balancers({"a": gpu("10.0.0.11", vllm_served_model_name="org/m"),
                       "b": gpu("10.0.0.12", vllm_served_model_name="org_m"),
                       "c": gpu("10.0.0.13", vllm_served_model_name="vllm")})
    assert [(b.model, b.name) for b in lb.backends] == [("org/m", "org_m"), ("org_m", "org_m_2"), ("vllm", "vllm_2")]


# --- the rendered configuration -----------------------------------------------------------------------------

def test_values_are_quoted_for_haproxy() -> None:
    assert haproxy_word('a"b\\c$d #e') == '"a\\"b\\\\c\\$d #e"'
    with pytest.raises(RenderError, match="control character"):
        haproxy_word("a\nb")


def test_the_configuration_routes_by_model_and_checks_with_a_completion(balancers: Balancers) -> None:
    (lb,) = balancers({"a": gpu("10.0.0.11", vllm_api_key=KEY), "b": gpu("10.0.0.12", gpu_count=2, vllm_api_key=KEY),
                       "c": gpu("10.0.0.13", vllm_served_model_name="other/m")}, vllm_balancer_check_interval=1.5)
    text = render_balancer(lb)
    lines = [line.strip() for line in text.splitlines()]
    assert 'stats socket "/run/haproxy/admin.sock" mode 660 level admin' in lines
    assert 'bind "0.0.0.0:8080"' in lines and "option http-buffer-request" in lines
    assert lines.count("retry-on conn-failure empty-response response-timeout 500 502 503 504") == 1
    assert "option redispatch 1" in lines and "retries 3" in lines
    assert ('use_backend "ERNIE-4.5-0.3B-PT" if { req.body,json_query(\'$.model\') -m str "ERNIE-4.5-0.3B-PT" }'
            in lines)
    assert 'use_backend "other_m" if { req.body,json_query(\'$.model\') -m str "other/m" }' in lines
    assert 'default_backend "ERNIE-4.5-0.3B-PT"' in lines
    assert lines.count("default-server inter 1500ms fall 2 rise 2") == 2
    assert 'server "a-0" "10.0.0.11:8000" check weight 1' in lines
    assert 'server "b-0" "10.0.0.12:8000" check weight 2' in lines
    checks = [line for line in lines if line.startswith("http-check send")]
    assert checks[0] == ('http-check send meth POST uri /v1/completions hdr Content-Type application/json '
                         'hdr Authorization "Bearer sk-\\"\\$%%#x y" body '
                         '"{\\"model\\":\\"ERNIE-4.5-0.3B-PT\\",\\"prompt\\":\\"ping\\",\\"max_tokens\\":1}"')
    assert "Authorization" not in checks[1]  # the other model's instances have no key


def test_a_template_that_fails_names_the_balancer_and_the_template(balancers: Balancers, tmp_path: Path) -> None:
    (tmp_path / "bad.j2").write_text("{{ no_such_value }}\n")
    (lb,) = balancers({"g": gpu("10.0.0.11")}, vllm_balancer_template="bad.j2")
    with pytest.raises(RenderError) as caught:
        render_balancer(lb)
    assert caught.value.where == "lb" and "bad.j2" in caught.value.message and "no_such_value" in caught.value.message
    (tmp_path / "bad.j2").unlink()
    with pytest.raises(RenderError, match=r"bad\.j2"):
        render_balancer(lb)


def haproxy_check(config: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    return subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)


@needs_haproxy
@pytest.mark.parametrize("case", ["one model", "two models", "api key", "weights", "ipv6"])
def test_rendered_configurations_pass_haproxy_check(balancers: Balancers, tmp_path: Path, case: str) -> None:
    gpus = {
        "one model": {"a": gpu("10.0.0.11")},
        "two models": {"a": gpu("10.0.0.11"), "b": gpu("10.0.0.12", vllm_served_model_name="org/other-1.5")},
        "api key": {"a": gpu("10.0.0.11", vllm_api_key=KEY), "b": gpu("10.0.0.12", vllm_api_key=KEY)},
        "weights": {"a": gpu("10.0.0.11", gpu_count=4, vllm_instances=2, vllm_tensor_parallel_size=2),
                    "b": gpu("10.0.0.12", vllm_balancer_weight=256)},
        "ipv6": {"a": gpu("fd00::11"), "b": gpu("10.0.0.12", vllm_host="fd00::12")},
    }[case]
    extra = {"vllm_balancer_bind": "::"} if case == "ipv6" else {}
    (lb,) = balancers(gpus, vllm_balancer_admin_socket=str(tmp_path / "admin.sock"), **extra)
    result = haproxy_check(render_balancer(lb), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the configuration at work: a real HAProxy in front of a stand-in for vLLM ------------------------------

class FakeVllm(http.server.ThreadingHTTPServer):
    """Answers like vLLM: /health 200 always; a completion 200 while serving, 500 while draining (as vLLM
    0.18+ does with --shutdown-timeout: ../shared/reference/real-vllm-cpu.md). Records each check request."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.draining = False
        self.seen: list[dict[str, Any]] = []

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeVllm

    def do_GET(self) -> None:
        self._answer(200 if self.path == "/health" else 404)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.server.seen.append({"path": self.path, "authorization": self.headers.get("Authorization"),
                                 "content_type": self.headers.get("Content-Type"), "body": body.decode()})
        self._answer(500 if self.server.draining else 200)

    def _answer(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        with contextlib.suppress(ConnectionError):  # HAProxy's check closes once it has read the status
            self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def vllm() -> Iterator[FakeVllm]:
    server = FakeVllm()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_status(sock: Path, backend: str, server: str) -> str:
    """The server's status from `show stat` on the admin socket."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(sock))
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    header, *rows = data.decode().splitlines()
    columns = header.lstrip("# ").split(",")
    for row in rows:
        fields = dict(zip(columns, row.split(","), strict=False))
        if fields.get("pxname") == backend and fields.get("svname") == server:
            return fields["status"]
    raise AssertionError(f"{backend}/{server} not in show stat: {data.decode()}")


def wait_status(sock: Path, backend: str, server: str, wanted: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    status = ""
    while time.monotonic() < deadline:
        status = server_status(sock, backend, server) if sock.exists() else "no socket yet"
        if status == wanted:
            return
        time.sleep(0.05)
    raise AssertionError(f"{backend}/{server} is {status!r}, not {wanted!r}, after {timeout} s")


@needs_haproxy
def test_haproxy_checks_with_the_key_and_takes_a_draining_instance_out(
        tmp_path: Path, vllm: FakeVllm) -> None:
    inventory = write(tmp_path, {"g": gpu("127.0.0.1", vllm_host="127.0.0.1", vllm_port=vllm.port, vllm_api_key=KEY)},
                      {"lb": {"ansible_host": "127.0.0.1"}},
                      {"vllm_balancer_admin_socket": str(tmp_path / "admin.sock"), "vllm_balancer_bind": "127.0.0.1",
                       "vllm_balancer_port": free_port(), "vllm_balancer_check_interval": 0.1})
    vllm_hosts, lbs = split_hosts(load_inventory(inventory).hosts.values())
    (lb,) = plan_balancers(lbs, plan_hosts(vllm_hosts, PlanContext.load(base_dir=tmp_path)), tmp_path)
    # chroot and the haproxy user need root; the rest is what a balancer host runs.
    config = re.sub(r"(?m)^\s*(chroot|user|group) .*\n", "", render_balancer(lb))
    (tmp_path / "haproxy.cfg").write_text(config)
    process = subprocess.Popen(["haproxy", "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        sock, backend = tmp_path / "admin.sock", lb.backends[0].name
        wait_status(sock, backend, "g-0", "UP")
        check = vllm.seen[-1]
        assert check == {"path": "/v1/completions", "authorization": f"Bearer {KEY}",
                         "content_type": "application/json",
                         "body": '{"model":"ERNIE-4.5-0.3B-PT","prompt":"ping","max_tokens":1}'}
        vllm.draining = True  # /health stays 200: only the completion check notices
        wait_status(sock, backend, "g-0", "DOWN")
        vllm.draining = False
        wait_status(sock, backend, "g-0", "UP")
    finally:
        process.terminate()
        process.communicate(timeout=10)


# --- the command line ---------------------------------------------------------------------------------------

def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    return write(tmp_path, {"g1": gpu("10.0.0.11", vllm_api_key="sk-topsecret"),
                            "g2": gpu("10.0.0.12", gpu_count=2, vllm_api_key="sk-topsecret")},
                 {"lb": {"ansible_host": "10.0.0.5"}}, {"vllm_balancer_port": 9000})


def test_plan_shows_each_balancer_and_never_as_a_vllm_host(capsys: pytest.CaptureFixture[str], fleet: Path) -> None:
    rc, out, _ = run(capsys, "plan", "-i", str(fleet))
    assert rc == 0 and "balancer lb (10.0.0.5)  haproxy  listens 0.0.0.0:9000" in out
    assert "g2-0" in out and "10.0.0.12:8000" in out
    assert "2 host(s), 0 with errors; 1 balancer(s), 0 with errors" in out
    rc, out, _ = run(capsys, "plan", "-i", str(fleet), "--json")
    doc = json.loads(out)
    assert doc["schema"] == "ernie-deploy/plan/v2" and doc["ok"] is True
    assert [h["host"] for h in doc["hosts"]] == ["g1", "g2"]
    (lb,) = doc["balancers"]
    assert (lb["host"], lb["bind"], lb["port"], lb["ok"]) == ("lb", "0.0.0.0", 9000, True)
    (backend,) = lb["backends"]
    assert backend["default"] and backend["check_sends_api_key"]
    assert [(s["name"], s["weight"], s["address"]) for s in backend["servers"]] == [
        ("g1-0", 1, "10.0.0.11"), ("g2-0", 2, "10.0.0.12")]
    assert "sk-topsecret" not in out


def test_plan_of_a_limit_fronts_the_whole_inventory(capsys: pytest.CaptureFixture[str], fleet: Path) -> None:
    rc, out, _ = run(capsys, "plan", "-i", str(fleet), "--limit", "lb", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["hosts"] == [] and len(doc["balancers"][0]["backends"][0]["servers"]) == 2
    rc, out, _ = run(capsys, "plan", "-i", str(fleet), "--limit", "g1", "--json")
    assert rc == 0 and json.loads(out)["balancers"] == []


def test_plan_names_a_balancer_that_cannot_be_planned(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    inventory = write(tmp_path, {"g": gpu("10.0.0.11")}, {"lb": {"vllm_balancer_bind": "everywhere"}})
    rc, out, _ = run(capsys, "plan", "-i", str(inventory))
    assert rc == 1 and "balancer lb  cannot be planned" in out
    assert "vllm_balancer_bind must be an IP address" in out and "fix: set vllm_balancer_bind" in out
    assert "1 balancer(s), 1 with errors: lb" in out
    rc, out, _ = run(capsys, "plan", "-i", str(inventory), "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False and doc["balancers"][0]["ok"] is False
    assert "vllm_balancer_bind" in doc["balancers"][0]["error"]


def test_render_writes_each_balancers_configuration(capsys: pytest.CaptureFixture[str], fleet: Path,
                                                    tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    rc, out, _ = run(capsys, "render", "-i", str(fleet), "-o", str(out_dir), "--json")
    assert rc == 0
    config = out_dir / "balancers/lb/haproxy.cfg"
    assert str(config) in json.loads(out)["written"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["balancers", "g1", "g2"]
    assert 'server "g2-0" "10.0.0.12:8000" check weight 2' in config.read_text()
    assert stat.S_IMODE(config.stat().st_mode) == 0o600  # it holds the API key


def test_render_of_a_fleet_without_a_key_and_of_a_bad_template(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    (tmp_path / "bad.j2").write_text("{% if %}\n")
    inventory = write(tmp_path, {"g": gpu("10.0.0.11")}, {"good": None, "bad": {"vllm_balancer_template": "bad.j2"}})
    rc, _, err = run(capsys, "render", "-i", str(inventory), "-o", str(tmp_path / "out"))
    flat = re.sub(r"\s+", "", err)  # the console may fold the long temporary path anywhere
    assert rc == 1 and "bad:template" in flat and "bad.j2" in flat, err
    good = tmp_path / "out/balancers/good/haproxy.cfg"
    assert stat.S_IMODE(good.stat().st_mode) == 0o644 and not (tmp_path / "out/balancers/bad").exists()


def test_explain_a_balancer_and_the_balancers_of_a_host(capsys: pytest.CaptureFixture[str], fleet: Path) -> None:
    rc, out, _ = run(capsys, "explain", "-i", str(fleet), "lb")
    assert rc == 0 and "lb: a balancer (group vllm_balancers)" in out
    assert re.search(r"vllm_balancer_port\s+9000\s+inventory variable", out)
    assert re.search(r"vllm_balancer_bind\s+0\.0\.0\.0\s+default", out)
    rc, out, _ = run(capsys, "explain", "-i", str(fleet), "lb", "--json")
    doc = json.loads(out)["balancer"]
    assert doc["settings"]["vllm_balancer_port"] == {"value": 9000, "source": "inventory variable"}
    rc, out, _ = run(capsys, "explain", "-i", str(fleet), "g2", "--json")
    assert json.loads(out)["balancers"] == {"fronted_by": ["lb"], "servers": [
        {"name": "g2-0", "weight": 2, "weight_source": "tensor_parallel_size × pipeline_parallel_size"}]}
    rc, out, _ = run(capsys, "explain", "-i", str(fleet), "g2")
    assert rc == 0 and "balancers lb front its instances as" in out and "sk-topsecret" not in out
