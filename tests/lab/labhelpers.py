"""Helpers for lab tests: bounded polling and hand-written systemd units that clean up after themselves."""

from __future__ import annotations

import time
from collections.abc import Callable

from ernie_deploy.lab import Lab


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass (always bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class Units:
    """Hand-written systemd units on lab hosts; every unit made here is stopped and removed afterwards."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.made: list[tuple[str, str]] = []

    def start(self, host: str, name: str, exec_start: str, env: dict[str, str] | None = None,
              extra: str = "") -> None:
        env_lines = "".join(f"Environment={k}={v}\n" for k, v in (env or {}).items())
        unit = (f"[Unit]\nDescription=lab test {name}\n[Service]\nType=simple\nUser=vllm\n{env_lines}"
                f"ExecStart={exec_start}\n{extra}")
        self.made.append((host, name))
        done = self.lab.ssh(host, f"cat > /etc/systemd/system/{name}.service && systemctl daemon-reload && "
                                  f"systemctl start {name}.service", input=unit)
        assert done.returncode == 0, done.stderr

    def state(self, host: str, name: str) -> str:
        return self.lab.ssh(host, f"systemctl is-active {name}.service").stdout.strip()

    def journal(self, host: str, name: str) -> str:
        return self.lab.ssh(host, f"journalctl -u {name}.service --no-pager -o cat").stdout

    def wait_state(self, host: str, name: str, wanted: str, timeout: float = 30.0) -> str:
        wait_for(lambda: self.state(host, name) == wanted, timeout, interval=0.3)
        return self.state(host, name)

    def cleanup(self) -> None:
        for host, name in reversed(self.made):
            self.lab.ssh(host, f"systemctl stop {name}.service; systemctl reset-failed {name}.service; "
                               f"rm -f /etc/systemd/system/{name}.service; systemctl daemon-reload")
