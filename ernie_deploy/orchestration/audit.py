"""The audit record of a change, as every operation writes it to its host's audit log: when, who (user and
controller, as the deploy lock names them), which command, which host, what; each action adds its detail."""

from __future__ import annotations

import time

from ernie_deploy.remote import lock


def record(who: lock.LockInfo, host: str, action: str, **detail: object) -> dict[str, object]:
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "user": who.user,
            "controller": who.controller, "command": who.command, "host": host, "action": action, **detail}
