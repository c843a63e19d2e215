"""One host's file system: an overlay (or copy) of the cached base tree plus everything that makes it
that host: identity, sshd address and keys, simulated GPUs, model config and simulators."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from ernie_deploy.errors import DeployError
from ernie_deploy.lab import mounts, wheel
from ernie_deploy.lab.spec import BalancerSpec, HostSpec

SIM_DIR = wheel.SIM_DIR
MODELS_DIR = wheel.PACKAGE_DIR / "data" / "models"
_MACHINE_ID_NAMESPACE = uuid.UUID("0b7d5a8e-3d43-4f0c-8a51-6b5f1c2a9e10")


def create_root(base: Path, machine_dir: Path) -> str:
    """Make machine_dir/root a writable view of `base`; returns the mode used.

    An overlay costs ~5 ms and ~8 MB per host; a full copy (the fallback where overlayfs cannot be
    mounted, e.g. inside another overlay) costs ~1.5 s and ~270 MB.
    """
    root = machine_dir / "root"
    upper, work = machine_dir / "upper", machine_dir / "work"
    for d in (root, upper, work):
        d.mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={base},upperdir={upper},workdir={work}"
    result = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(root)],
                            capture_output=True, text=True, check=False)
    if result.returncode == 0:
        return "overlay"
    shutil.rmtree(upper)
    shutil.rmtree(work)
    root.rmdir()
    copy = subprocess.run(["cp", "--reflink=auto", "-a", str(base), str(root)],
                          capture_output=True, text=True, check=False)
    if copy.returncode != 0:
        raise DeployError(f"cannot create the host's file system: overlay mount failed "
                          f"({result.stderr.strip()}) and copy failed ({copy.stderr.strip()})",
                          where=str(machine_dir), hint="free disk space or use a directory on ext4/xfs")
    return "copy"


def remove_machine(machine_dir: Path) -> None:
    mounts.unmount_and_remove(machine_dir)


def provision(root: Path, host: HostSpec, lab_public_key: str) -> str:
    """Write the host's own files into its tree; returns its `ssh-ed25519 AAAA…` host public key."""
    host_key = _identity(root, host.name, host.address, lab_public_key)
    lab_etc = root / "etc/ernie-lab"
    lab_etc.mkdir(parents=True, exist_ok=True)
    _write(lab_etc / "gpus.json", json.dumps(host.gpus_json(), indent=2) + "\n")
    if host.faults is not None:
        _write(lab_etc / "faults.json", json.dumps(host.faults, indent=2) + "\n")
    else:
        (lab_etc / "faults.json").unlink(missing_ok=True)

    install_simulators(root)
    if not host.bare:
        install_vllm(root, host.installed_version)
    return host_key


def provision_balancer(root: Path, balancer: BalancerSpec, lab_public_key: str) -> str:
    """A balancer's tree: only its identity and SSH access. No GPUs, no simulators, no vLLM; HAProxy is in the
    base tree, disabled, for `deploy` to configure and enable. Returns its host public key."""
    return _identity(root, balancer.name, balancer.address, lab_public_key)


def _identity(root: Path, name: str, address: str, lab_public_key: str) -> str:
    """Hostname, machine id, sshd on `address` with a fresh host key, the lab key for root and deploy."""
    _write(root / "etc/hostname", f"{name}\n")
    _write(root / "etc/hosts", f"127.0.0.1\tlocalhost\n{address}\t{name}\n")
    _write(root / "etc/machine-id", uuid.uuid5(_MACHINE_ID_NAMESPACE, name).hex + "\n")

    key = root / "etc/ssh/ssh_host_ed25519_key"
    for f in (key, key.with_suffix(".pub")):
        f.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{name}", "-f", str(key)],
                   check=True, capture_output=True)
    _write(root / "etc/ssh/sshd_config.d/ernie-lab-listen.conf",
           f"# Only this host's own loopback address: all lab hosts share the machine's network.\n"
           f"ListenAddress {address}:22\n")

    for user, home in (("root", "/root"), ("deploy", "/home/deploy")):
        uid, gid = _ids(root, user)
        ssh_dir = root / home.lstrip("/") / ".ssh"
        ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        auth = ssh_dir / "authorized_keys"
        auth.write_text(lab_public_key.strip() + "\n")
        auth.chmod(0o600)
        for p in (ssh_dir, auth):
            os.chown(p, uid, gid)
    key_type, key_data = key.with_suffix(".pub").read_text().split()[:2]
    return f"{key_type} {key_data}"


def venv_dir(version: str) -> str:
    """Where a lab host has vLLM `version` installed: the planner's default per-version venv path."""
    return f"/opt/vllm/{version}"


def install_vllm(root: Path, version: str) -> None:
    """What an operator's hand-made install leaves: the service user, vLLM `version` in its venv and the
    bundled model configs (no weights), none of it recorded by provisioning."""
    _run(["useradd", "--root", str(root), "--system", "--user-group", "--home-dir", "/var/lib/vllm",
          "--create-home", "--shell", "/usr/sbin/nologin", "vllm"])
    wheel.install_venv(root, venv_dir(version), version)
    install_models(root)


def install_models(root: Path) -> None:
    """Every bundled model config, at /models/<name>/config.json (the lab's `vllm_model` paths)."""
    for model in sorted(p for p in MODELS_DIR.iterdir() if (p / "config.json").is_file()):
        target = root / "models" / model.name
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(model / "config.json", target / "config.json")


SIM_LIB = "/opt/ernie-lab/lib"
# The driver's tool; vLLM itself is a package in a venv (see wheel.py).
ENTRY_POINTS = {"usr/bin/nvidia-smi": "nvidia_smi"}


def entry_script(module: str) -> str:
    """A command that runs one simulator module with the host's python3, the way a console script would."""
    return f'#!/bin/sh\nPYTHONPATH={SIM_LIB} exec python3 -m {wheel.SIM_PACKAGE}.{module} "$@"\n'


def install_simulators(root: Path) -> None:
    """The simulator package as it is in the source tree right now, so a sim edit needs only a new `lab up`:
    nvidia-smi's copy, and the copy inside every simulator venv on the host."""
    target = root / SIM_LIB.lstrip("/") / wheel.SIM_PACKAGE
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(SIM_DIR, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.md"))
    for path, module in ENTRY_POINTS.items():
        script = root / path
        script.parent.mkdir(parents=True, exist_ok=True)
        if script.is_symlink() or script.exists():
            script.unlink()
        script.write_text(entry_script(module))
        script.chmod(0o755)
    wheel.refresh_venvs(root)


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise DeployError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():  # never write through a link into the base tree or the host
        path.unlink()
    path.write_text(text)


def _ids(root: Path, user: str) -> tuple[int, int]:
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user:
            return int(fields[2]), int(fields[3])
    raise DeployError(f"user {user!r} missing from the lab root file system", where=str(root),
                      hint="delete the cached root file system and run `lab up` again")
