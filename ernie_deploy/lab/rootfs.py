"""The lab's base root file system: Debian bookworm with systemd and sshd, built once with debootstrap.

The build is cached under a key made of everything that shapes it (suite, packages, architecture and
ROOTFS_VERSION, bumped whenever `_customize` changes), so a second `lab up` never touches the network.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ernie_deploy.errors import DeployError
from ernie_deploy.lab import mounts

SUITE = "bookworm"
# Everything a simulated GPU host needs: an init (systemd), a login path (sshd, sudo), the simulators'
# runtime (python3), what provisioning needs to install vLLM (python3-venv, which brings pip's wheel for
# ensurepip) and the tools deploy code and tests reach for (ip, ps, pkill). Real vLLM's CPU build needs
# libnuma (its worker dies in init_cpu_memory_env without it) and, from TP 2 on, a C++ compiler and Python's
# headers (torch's inductor builds a kernel at the first forward pass: "InvalidCxxCompiler: No working C++
# compiler found", then "Python.h: No such file or directory"; vLLM's CPU installation page lists gcc/g++ as a
# requirement): docs/lab.md. A balancer host runs Debian's own HAProxy (2.6 on bookworm), the one `deploy` drives
# on a real one; every container boots this same tree, so the package is everywhere but enabled nowhere
# (BALANCER_UNIT below).
PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "openssh-server", "python3", "python3-venv", "iproute2", "procps", "sudo",
    "libnuma1", "g++", "python3-dev", "haproxy",
)
# Bump when _customize changes so an old cached tree is not reused.
ROOTFS_VERSION = 3
DEFAULT_CACHE = Path("/var/cache/ernie-deploy")
# Units that make no sense in a container sharing the host network and disk: periodic apt/fstrim jobs
# would reach the network or the host's disks, a getty on tty1 never finds a terminal.
MASKED_UNITS = (
    "apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer", "e2scrub_reap.service",
    "fstrim.timer", "dpkg-db-backup.timer", "getty@tty1.service", "systemd-networkd-wait-online.service",
)
# Debian's postinst enables HAProxy with its sample config. Disabled (not masked) in the image: GPU hosts must
# not run it, and on a balancer host `deploy` is what enables and starts it, as on a box that just got the
# package.
BALANCER_UNIT = "haproxy.service"

Progress = Callable[[str], None]


def cache_dir() -> Path:
    return Path(os.environ.get("ERNIE_LAB_CACHE") or DEFAULT_CACHE)


def debian_arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def cache_key(suite: str = SUITE, packages: tuple[str, ...] = PACKAGES, arch: str | None = None) -> str:
    blob = json.dumps({"suite": suite, "packages": sorted(packages), "arch": arch or debian_arch(),
                       "version": ROOTFS_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def rootfs_path(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / f"rootfs-{SUITE}-{debian_arch()}-{cache_key()}"


# ---------------------------------------------------------------------------------------------------------
# Mirror discovery: the lab uses whatever Debian mirror this machine's apt already uses.


def parse_one_line_sources(text: str) -> list[tuple[str, list[str]]]:
    """(uri, suites) from sources.list one-line format: `deb [options] uri suite [components]`."""
    found: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        line = re.sub(r"\[[^\]]*\]", " ", line[4:])
        words = line.split()
        if len(words) >= 2:
            found.append((words[0], [words[1]]))
    return found


def parse_deb822_sources(text: str) -> list[tuple[str, list[str]]]:
    """(uri, suites) from deb822 `.sources` stanzas with `Types: deb` (skipping `Enabled: no`)."""
    found: list[tuple[str, list[str]]] = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0].isspace() and key:
                fields[key] += " " + line.strip()
                continue
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        suites = fields.get("suites", "").split()
        found.extend((uri, suites) for uri in fields.get("uris", "").split())
    return found


def find_mirror(suite: str = SUITE, apt_dir: Path = Path("/etc/apt")) -> str:
    """The first configured mirror that serves `suite` itself (not -security or -updates)."""
    override = os.environ.get("ERNIE_LAB_MIRROR")
    if override:
        return override
    entries: list[tuple[str, list[str]]] = []
    sources = apt_dir / "sources.list"
    if sources.is_file():
        entries += parse_one_line_sources(sources.read_text())
    part = apt_dir / "sources.list.d"
    if part.is_dir():
        for f in sorted(part.iterdir()):
            if f.suffix == ".list":
                entries += parse_one_line_sources(f.read_text())
            elif f.suffix == ".sources":
                entries += parse_deb822_sources(f.read_text())
    for uri, suites in entries:
        if suite in suites and uri.startswith(("http://", "https://", "file:/")):
            return uri
    raise DeployError(
        f"no apt source for Debian {suite} found", where=str(apt_dir),
        hint=f"add a '{suite}' entry to /etc/apt/sources.list(.d) or set ERNIE_LAB_MIRROR to a Debian mirror URL",
    )


# ---------------------------------------------------------------------------------------------------------
# Build


@contextlib.contextmanager
def locked(cache: Path) -> Iterator[None]:
    """Serialise builds: two `lab up` at once would otherwise both download the same tree. Every build into
    `cache` takes it (this root file system and realvllm's package index), so scripts/test's two pytest processes
    can boot their labs at once on a fresh machine: one builds, the other waits and then finds it cached, and the
    leftover cleanup in each build never meets another process's build in progress."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_rootfs(progress: Progress, cache: Path | None = None) -> tuple[Path, float | None]:
    """The cached base tree, building it first if needed. Returns (path, build seconds or None if cached)."""
    cache = cache or cache_dir()
    final = rootfs_path(cache)
    if (final / ".ernie-lab-rootfs").is_file():
        return final, None
    with locked(cache):
        if (final / ".ernie-lab-rootfs").is_file():
            return final, None
        # Leftovers of a crashed build are never reused: only a renamed tree counts as a cache entry.
        for stale in cache.glob(".build-*"):
            if stale.is_dir():
                mounts.unmount_and_remove(stale)
            else:
                stale.unlink()
        tmp = cache / f".build-{final.name}-{os.getpid()}"
        started = time.monotonic()
        try:
            _debootstrap(tmp, progress)
            _customize(tmp)
            (tmp / ".ernie-lab-rootfs").write_text(json.dumps({
                "suite": SUITE, "packages": list(PACKAGES), "arch": debian_arch(),
                "version": ROOTFS_VERSION, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }) + "\n")
            if final.exists():  # a tree without the marker: an old half-copied entry
                mounts.unmount_and_remove(final)
            os.rename(tmp, final)
        except BaseException:
            mounts.unmount_and_remove(tmp)
            raise
        return final, time.monotonic() - started


def _debootstrap(target: Path, progress: Progress) -> None:
    if shutil.which("debootstrap") is None:
        raise DeployError("debootstrap is not installed", hint="apt-get install debootstrap")
    mirror = find_mirror()
    progress(f"building the lab root file system (debootstrap {SUITE} from {mirror}; about a minute)")
    cmd = [
        "debootstrap", "--variant=minbase", f"--arch={debian_arch()}",
        f"--include={','.join(PACKAGES)}", SUITE, str(target), mirror,
    ]
    log = target.parent / f"{target.name}.log"
    with open(log, "w") as fh:
        result = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise DeployError(f"debootstrap failed (exit {result.returncode}):\n{tail}", where=str(log),
                          hint="check the mirror is reachable, or set ERNIE_LAB_MIRROR")
    log.unlink(missing_ok=True)


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise DeployError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")


def _customize(root: Path) -> None:
    """Everything every host shares: the login user, sudo, sshd policy, masked units, no baked-in identity.
    The service user is not here: a bare host gets it from provisioning, a ready one from machine.py."""
    _run(["useradd", "--root", str(root), "--user-group", "--create-home", "--shell", "/bin/bash", "deploy"])
    sudoers = root / "etc/sudoers.d/deploy"
    sudoers.write_text("deploy ALL=(ALL) NOPASSWD:ALL\n")
    sudoers.chmod(0o440)
    # debootstrap's postinst generated host keys here; every host gets its own at `lab up` instead.
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/ssh/sshd_config.d/ernie-lab.conf").write_text(
        "# ernie-deploy rehearsal lab: key-only logins; ListenAddress is in ernie-lab-listen.conf\n"
        "HostKey /etc/ssh/ssh_host_ed25519_key\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UseDNS no\n"
        # Many parallel test connections per host: the default 10:30:100 drops some of them.
        "MaxStartups 100:30:200\n"
        "MaxSessions 100\n"
    )
    _run(["systemctl", f"--root={root}", "mask", *MASKED_UNITS])
    _run(["systemctl", f"--root={root}", "disable", BALANCER_UNIT])
    (root / "etc/tmpfiles.d/ernie-lab.conf").write_text(
        "# Simulated GPU memory bookkeeping; any service user may hold GPU memory, as on real hosts.\n"
        "d /run/ernie-lab 0755 root root -\n"
        "d /run/ernie-lab/gpu 0777 root root -\n"
    )
    # An empty machine-id makes systemd treat each boot as a first boot; the host's own id is set per host.
    (root / "etc/machine-id").write_text("")
    for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for f in (root / d).glob("*"):
            if f.is_file():
                f.unlink()
