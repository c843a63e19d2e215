"""How the outside world reaches lab hosts: the lab key, known_hosts, the Ansible inventory and `ssh`."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ernie_deploy.lab.spec import BalancerSpec, HostSpec

LAB_MODEL = "/models/ERNIE-4.5-0.3B-PT"
# The inventory group whose hosts run HAProxy in front of every vLLM instance (docs/balancer.md).
BALANCER_GROUP = "vllm_balancers"
BALANCER_PORT = 8080
# Seconds between HAProxy's health checks of a server: a restarted instance is UP again about two checks after
# it serves (rise 2), so a short interval keeps rehearsals quick.
BALANCER_CHECK_INTERVAL = 1


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
# Real vLLM (the CPU build) starts in 27-74 s on a 2-core machine, 110-170 s at TP 2 beside another start or a
# load, and took over 300 s at TP 2 with a test suite running beside it (docs/lab.md, measured): the budget is
# the tool's default ceiling, not the expected time.
REAL_STARTUP_BUDGET = 600
REAL_STABLE_SECONDS = 5
# What real vLLM needs to serve the lab's model directory: random weights (there are none; `dummy` is vLLM's
# own load format) and no torch.compile (217 s on 2 cores, no faster here: docs/lab.md).
REAL_EXTRA_ARGS = ["--load-format", "dummy", "--enforce-eager"]
# GiB of KV cache per instance: 58,240 tokens at TP 1, room for 14 requests of 4,096 tokens.
REAL_KVCACHE_GIB = 1


def cpu_binds(hosts: Sequence[HostSpec], cpus: int) -> dict[str, str]:
    """VLLM_CPU_OMP_THREADS_BIND per real-vLLM host (the lab's hosts have one instance, its TP the GPU count):
    each host gets CPUs of its own where there are enough, and its ranks share those rather than another host's.
    vLLM's default `auto` fails at TP 2 on a one-NUMA-node machine ("Not enough allowed NUMA nodes"), and a rank
    bound to the CPU of another instance's busy worker got almost no time: a TP-2 start beside a loaded TP-1
    instance hung for minutes on 2 cores (measured, docs/lab.md)."""
    real = [h for h in hosts if h.real]
    share = max(1, cpus // max(1, len(real)))
    binds: dict[str, str] = {}
    for i, h in enumerate(real):
        own = [(i * share + k) % cpus for k in range(share)]
        binds[h.name] = "|".join(str(own[r % len(own)]) for r in range(max(1, h.gpu_count)))
    return binds


def frontend_url(balancer: BalancerSpec) -> str:
    return f"http://{balancer.address}:{BALANCER_PORT}"


def _login_vars(key: Path, known_hosts: Path) -> dict[str, Any]:
    return {
        "ansible_user": "root",
        "ansible_port": 22,
        "ansible_ssh_private_key_file": str(key),
        "ernie_known_hosts": str(known_hosts),
    }


def balancer_group(balancers: Sequence[BalancerSpec], key: Path, known_hosts: Path) -> dict[str, Any]:
    """The `vllm_balancers` group: each balancer's HAProxy listens on its own loopback address (lab hosts share
    this machine's network, so 0.0.0.0 would collide with the other lab hosts' ports)."""
    return {
        "hosts": {b.name: {"ansible_host": b.address, "vllm_balancer_bind": b.address} for b in balancers},
        "vars": {
            **_login_vars(key, known_hosts),
            "vllm_balancer_port": BALANCER_PORT,
            "vllm_balancer_check_interval": BALANCER_CHECK_INTERVAL,
        },
    }


def inventory(hosts: Sequence[HostSpec], key: Path, known_hosts: Path, wheelhouse: Path,
              model_source: Path, index_url: str | None = None, cpus: int = 1,
              balancers: Sequence[BalancerSpec] = ()) -> dict[str, Any]:
    """An Ansible YAML inventory: `all: children: lab: hosts:` (simulated hosts), `lab_real: hosts:`
    (real-vLLM hosts, when the spec has any) with the group vars deploy and provisioning read, and
    `vllm_balancers` (the spec's balancer hosts, when it has any). Each host pins the vLLM version it has
    installed (or, bare, is to get); `vllm_bin` is left to its per-version default, as on a provisioned box."""
    access_vars = {**_login_vars(key, known_hosts), "vllm_model": LAB_MODEL}

    def host_vars(h: HostSpec) -> dict[str, Any]:
        # Lab hosts share this machine's network, so each vLLM binds its own address.
        return {"ansible_host": h.address, "gpu_model": h.gpu_model, "gpu_count": h.gpu_count,
                "vllm_host": h.address, "vllm_version": h.installed_version}

    groups: dict[str, Any] = {}
    sim = [h for h in hosts if not h.real]
    real = [h for h in hosts if h.real]
    if sim:
        groups["lab"] = {
            "hosts": {h.name: host_vars(h) for h in sim},
            "vars": {
                **access_vars,
                # What `provision` installs from: the simulator wheels and a model directory on this machine,
                # both copied over SSH (the air-gapped path).
                "vllm_pip_find_links": str(wheelhouse),
                "vllm_model_source": str(model_source),
                # The simulated vLLM loads in seconds; a short stability window keeps rehearsals quick.
                "vllm_stable_seconds": LAB_STABLE_SECONDS,
            },
        }
    if real:
        if index_url is None:
            raise ValueError("real-vLLM hosts need the lab's package index")
        binds = cpu_binds(hosts, cpus)
        groups["lab_real"] = {
            "hosts": {h.name: {**host_vars(h), "vllm_cpu_omp_threads_bind": binds[h.name]} for h in real},
            "vars": {
                **access_vars,
                # Real vLLM comes from the lab's package index over HTTP on loopback (pkgindex.py), the way
                # a rack installs from its mirror; the model directory is copied over SSH.
                "vllm_pip_index_url": index_url,
                "vllm_model_source": str(model_source),
                "vllm_extra_args": list(REAL_EXTRA_ARGS),
                "vllm_cpu_kvcache_space": REAL_KVCACHE_GIB,
                # No hub: the model directory has everything, and a lookup would only time out.
                "vllm_env": {"HF_HUB_OFFLINE": "1"},
                "vllm_startup_budget": REAL_STARTUP_BUDGET,
                "vllm_stable_seconds": REAL_STABLE_SECONDS,
            },
        }
    if balancers:
        groups[BALANCER_GROUP] = balancer_group(balancers, key, known_hosts)
    return {"all": {"children": groups}}


def write_inventory(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ("# Written by `ernie-deploy lab up`; removed by `lab down`. GPUs are simulated; vLLM is simulated\n"
              "# on the hosts of group lab and real (its CPU build) on those of lab_real; the hosts of group\n"
              "# vllm_balancers run HAProxy in front of them once deployed (docs/lab.md).\n")
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
