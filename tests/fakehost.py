"""A scripted stand-in for one SSH host, for orchestration tests without a network.

It understands the few scripts the deploy layer sends (by their labels): it answers facts from its
in-memory state, applies the tar payload of "apply changes" the way the real script would, and keeps
the deploy lock.
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from dataclasses import dataclass, field

from ernie_deploy.remote import lock
from ernie_deploy.remote.ssh import Failure, RemoteError, RunResult, Target

CONFIG = open(  # noqa: SIM115 - read once at import
    __file__.rsplit("/", 1)[0] + "/../ernie_deploy/data/models/ERNIE-4.5-0.3B-PT/config.json").read()


@dataclass
class FakeHost:
    gpus: int = 2
    files: dict[str, str] = field(default_factory=dict)
    active: dict[str, int] = field(default_factory=dict)  # unit → start count (present = running)
    lock_info: str | None = None
    applied: list[str] = field(default_factory=list)
    unreachable: bool = False

    def facts_text(self) -> str:
        gpus = "\n".join(f"{i}, NVIDIA A10, GPU-{i:08d}-0000-0000-0000-000000000000, 23028, 550.127.05"
                         for i in range(self.gpus))
        hashes = "\n".join(f"{hashlib.sha256(c.encode()).hexdigest()}  {p}" for p, c in sorted(self.files.items()))
        units = "\n\n".join(
            f"Id={u}\nLoadState=loaded\nActiveState={'active' if u in self.active else 'inactive'}\n"
            f"SubState=running\nMainPID=100\nInvocationID=x\nNRestarts=0\n"
            f"ExecMainStartTimestampMonotonic={self.active.get(u, 0)}\nUnitFileState=enabled"
            for u in sorted({p.rsplit('/', 1)[1] for p in self.files if p.endswith('.service')}))
        return (f"\n@@ernie-deploy:gpus\n{gpus}\nrc=0\n@@ernie-deploy:topo\n\n@@ernie-deploy:systemd\nsystemd 252\n"
                f"@@ernie-deploy:files\n{hashes}\n@@ernie-deploy:units\n{units}\n"
                f"@@ernie-deploy:model\n{CONFIG}\nrc=0\n@@ernie-deploy:vllm\n0.34.0\nrc=0\n@@ernie-deploy:end\n")

    def apply(self, script: str, stdin: bytes) -> None:
        with tarfile.open(fileobj=io.BytesIO(stdin)) as tar:
            staged = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}  # type: ignore[union-attr]
        tmp_to_src = dict(re.findall(r"install -m \d+ -o root -g root \S+/(f\d+) (\S+)", script))
        tmp_to_src = {v.strip("'"): k for k, v in tmp_to_src.items()}
        for tmp, dest in re.findall(r"mv -f (\S+) (\S+)", script):
            self.files[dest.strip("'")] = staged[tmp_to_src[tmp.strip("'")]]
        for _verb, units in re.findall(r"systemctl (restart|start) (.+)", script):
            for u in units.split():
                self.active[u] = self.active.get(u, 0) + 1
        self.applied.append(script)


@dataclass
class FakeSession:
    host: FakeHost
    target: Target
    commands: int = 0
    history: list[str] = field(default_factory=list)

    def run(self, script: str, *, stdin: bytes = b"", timeout: float = 120.0, check: bool = True,
            label: str | None = None) -> RunResult:
        self.commands += 1
        self.history.append(label or "?")
        h = self.host
        if label == "lock + gather facts":
            token = re.search(r'"token": "([0-9a-f]+)"', script)
            if h.lock_info and (not token or token.group(1) not in h.lock_info):
                return RunResult(label, lock.HELD_EXIT, f"@@ernie-deploy:lock-held\n{h.lock_info}\n".encode(), b"")
            h.lock_info = h.lock_info or re.search(r"'(\{.*?\})'", script).group(1)  # type: ignore[union-attr]
            return RunResult(label, 0, h.facts_text().encode(), b"")
        if label == "gather facts":
            return RunResult(label, 0, h.facts_text().encode(), b"")
        if label == "apply changes":
            h.apply(script, stdin)
            return RunResult(label, 0, b"", b"")
        if label == "release lock":
            h.lock_info = None
            return RunResult(label, 0, b"", b"")
        return RunResult(label or "", 0, b"", b"")

    def close(self) -> None:
        pass


def connector(hosts: dict[str, FakeHost]):  # type: ignore[no-untyped-def]
    def connect(target: Target) -> FakeSession:
        host = hosts[target.name]
        if host.unreachable:
            raise RemoteError(Failure.UNREACHABLE, f"{target.address}:22: connection refused", where=target.name)
        return FakeSession(host, target)

    return connect
