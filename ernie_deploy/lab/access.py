"""How the outside world reaches lab hosts: the lab key, known_hosts, the Ansible inventory and `ssh`."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ernie_deploy.lab.spec import HostSpec

LAB_MODEL = "/models/ERNIE-4.5-0.3B-PT"


def ensure_key(path: Path) -> str:
    """The lab's ed25519 key pair (made once per lab, 0600); returns the public key line."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ernie-lab", "-f", str(path)],
                       check=True, capture_output=True)
    path.chmod(0o600)
    return path.with_suffix(".pub").read_text().strip()


def write_known_hosts(path: Path, host_keys: dict[str, str]) -> None:
    """`127.0.0.N ssh-ed25519 AAAA…` lines: exactly the keys the hosts were given, nothing learnt."""
    path.write_text("".join(f"{address} {key}\n" for address, key in host_keys.items()))
    path.chmod(0o644)


LAB_STABLE_SECONDS = 2


def inventory(hosts: Sequence[HostSpec], key: Path, known_hosts: Path, wheelhouse: Path,
              model_source: Path) -> dict[str, Any]:
    """An Ansible YAML inventory: `all: children: lab: hosts:` plus the group vars deploy and provisioning
    read. Each host pins the vLLM version it has installed (or, bare, is to get); `vllm_bin` is left to its
    per-version default, as on a provisioned box."""
    return {
        "all": {
            "children": {
                "lab": {
                    "hosts": {
                        # Lab hosts share this machine's network, so each vLLM binds its own address.
                        h.name: {"ansible_host": h.address, "gpu_model": h.gpu_model, "gpu_count": h.gpu_count,
                                 "vllm_host": h.address, "vllm_version": h.installed_version}
                        for h in hosts
                    },
                    "vars": {
                        "ansible_user": "root",
                        "ansible_port": 22,
                        "ansible_ssh_private_key_file": str(key),
                        "ernie_known_hosts": str(known_hosts),
                        "vllm_model": LAB_MODEL,
                        # What `provision` installs from: the simulator wheels and a model directory on this
                        # machine, both copied over SSH (the air-gapped path).
                        "vllm_pip_find_links": str(wheelhouse),
                        "vllm_model_source": str(model_source),
                        # The simulated vLLM loads in seconds; a short stability window keeps rehearsals quick.
                        "vllm_stable_seconds": LAB_STABLE_SECONDS,
                    },
                }
            }
        }
    }


def write_inventory(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Written by `ernie-deploy lab up`; removed by `lab down`. Hosts are simulated (docs/lab.md).\n"
    path.write_text(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False))


def ssh_argv(address: str, key: Path, known_hosts: Path, user: str = "root", connect_timeout: int = 5) -> list[str]:
    """The real `ssh` client with strict host-key checking against the lab's own known_hosts only."""
    return [
        "ssh", "-q",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "BatchMode=yes",
        "-o", "IdentitiesOnly=yes",
        "-o", f"ConnectTimeout={connect_timeout}",
        "-o", "LogLevel=ERROR",
        "-i", str(key),
        f"{user}@{address}",
    ]


def wait_ssh(address: str, key: Path, known_hosts: Path, deadline: float,
             cancel: threading.Event | None = None) -> bool:
    """Poll a strict `ssh … true` until it works, the (monotonic) deadline passes or `cancel` is set."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or (cancel is not None and cancel.is_set()):
            return False
        try:
            done = subprocess.run([*ssh_argv(address, key, known_hosts, connect_timeout=2), "true"],
                                  capture_output=True, timeout=max(1.0, min(left, 10.0)), check=False)
            if done.returncode == 0:
                return True
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.2)
