"""`ansible_connection: local` with real systemd: ernie-deploy runs INSIDE one lab host, on an inventory that
names that host with `ansible_connection: local` and `ansible_host: localhost` (and no SSH key at all), and
deploys, verifies and restarts its instance there. The controller running the tests has no systemd, so the
lab host is the one machine here where a local deploy can be real.

The package and its dependencies travel as files: the source tree's ernie_deploy/ and templates/ plus the
installed files of every distribution ernie-deploy requires, copied into the host's root file system (the lab
hosts run Debian bookworm's Python 3.11, the minor version of the venv they are copied from).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

import pytest
import yaml

from ernie_deploy.lab import Lab, LabState
from lab.labhelpers import CLEAN

pytestmark = pytest.mark.lab

HOST = "a10-1"  # one GPU, TP 1: the quickest instance to start
SHIPPED = "opt/ernie-local-test"  # inside the host's root
ROOT = Path(__file__).resolve().parents[2]
# What a lab inventory says about reaching a host over SSH, and what only `provision` reads (controller paths).
DROPPED = ("ansible_host", "ansible_user", "ansible_port", "ansible_ssh_private_key_file", "ernie_known_hosts",
           "vllm_pip_find_links", "vllm_model_source")


def _requirements(name: str) -> list[Distribution]:
    """The installed distributions `name` needs at run time (extras left out), itself excluded."""
    found: dict[str, Distribution] = {}
    todo = [req for req in distribution(name).requires or [] if "extra ==" not in req]
    while todo:
        wanted = re.match(r"[A-Za-z0-9._-]+", todo.pop())
        key = re.sub(r"[-_.]+", "-", wanted.group(0)).lower() if wanted else ""
        if not key or key in found:
            continue
        try:
            found[key] = distribution(key)
        except PackageNotFoundError:  # a requirement for another Python or platform (its marker says so)
            continue
        todo += [req for req in found[key].requires or [] if "extra ==" not in req]
    return list(found.values())


def _ship(dest: Path) -> None:
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "ernie_deploy", dest / "src/ernie_deploy", ignore=skip)
    shutil.copytree(ROOT / "templates", dest / "src/templates", ignore=skip)
    for dist in _requirements("ernie-deploy"):
        for file in dist.files or []:
            if file.parts[0] == ".." or "__pycache__" in file.parts:
                continue  # console scripts outside site-packages, caches
            target = dest / "site" / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(str(dist.locate_file(file))), target)


def _local_inventory(state: LabState) -> dict[str, Any]:
    data = yaml.safe_load(Path(state.inventory).read_text())
    group = data["all"]["children"]["lab"]
    variables = {k: v for k, v in {**group["vars"], **group["hosts"][HOST]}.items() if k not in DROPPED}
    return {"all": {"hosts": {HOST: {**variables, "ansible_connection": "local", "ansible_host": "localhost"}}}}


@pytest.fixture(scope="module")
def shipped(lab: Lab, lab_state: LabState) -> Iterator[Path]:
    """ernie-deploy and a local-connection inventory inside the host (its path there); removed afterwards."""
    dest = lab_state.host(HOST).root / SHIPPED
    lab.ssh(HOST, CLEAN)
    try:
        _ship(dest)
        (dest / "inventory.yml").write_text(yaml.safe_dump(_local_inventory(lab_state)))
        yield Path("/") / SHIPPED
    finally:
        lab.ssh(HOST, CLEAN)
        shutil.rmtree(dest, ignore_errors=True)


def _run(lab: Lab, where: Path, *argv: str) -> tuple[int, dict[str, Any], str]:
    """ernie-deploy run on the host itself: exit code, the host's JSON result, stderr."""
    done = lab.ssh(HOST, f"cd {where} && PYTHONPATH={where}/src:{where}/site python3 -m ernie_deploy {' '.join(argv)}"
                         f" -i inventory.yml --json", timeout=180)
    try:
        (result,) = json.loads(done.stdout)["hosts"]
    except (ValueError, KeyError) as exc:
        raise AssertionError(f"exit {done.returncode}, no JSON: {done.stdout[-2000:]}\n{done.stderr[-2000:]}") from exc
    return done.returncode, result, done.stderr


def test_deploy_verify_restart_on_the_machine_itself(lab: Lab, shipped: Path) -> None:
    # Over SSH these could not pass: the host has no private key and no known_hosts entry for localhost, so a
    # connection would fail (exit 4); every command below ran through the local transport.
    code, deployed, err = _run(lab, shipped, "deploy", "--startup-budget", "60")
    assert code == 0, (deployed, err)
    assert deployed["status"] == "changed" and deployed["host"] == HOST
    state = lab.ssh(HOST, "systemctl is-active ernie-vllm-0; cat /var/log/ernie-deploy/audit.log").stdout
    assert state.startswith("active\n") and "deploy" in state  # the audit line, as over SSH

    code, verified, err = _run(lab, shipped, "verify")
    assert code == 0, (verified, err)
    assert {c["name"] for c in verified["checks"] if c["status"] == "pass"} >= {"systemd", "http_health",
                                                                                 "http_completion"}

    before = lab.ssh(HOST, "systemctl show -p MainPID --value ernie-vllm-0").stdout.strip()
    code, restarted, err = _run(lab, shipped, "restart")
    assert code == 0, (restarted, err)
    after = lab.ssh(HOST, "systemctl show -p MainPID --value ernie-vllm-0").stdout.strip()
    assert after not in ("", "0", before)
    assert lab.ssh(HOST, "ls /var/lib/ernie-deploy/lock 2>&1; true").stdout.count("No such file") == 1  # released
