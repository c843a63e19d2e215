"""Where a stopped rollout stopped, kept on the controller so `--resume` can continue with the next batch.

One JSON file per (command, inventory, limit, instance) under $ERNIE_DEPLOY_STATE_DIR, else
$XDG_STATE_HOME/ernie-deploy/rollouts, else ~/.local/state/ernie-deploy/rollouts. Written atomically after
every batch and whenever an instance goes out of the load balancer or back (`out`: host → units whose
pre-drain hook ran and whose post-ready did not yet), removed when the rollout completes with every instance
back in rotation.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ernie_deploy.errors import DeployError

SCHEMA = "ernie-deploy/rollout-state/v1"


def state_dir() -> Path:
    explicit = os.environ.get("ERNIE_DEPLOY_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ernie-deploy" / "rollouts"


def key_of(command: str, inventory: str, limit: str | None, instance: str | None) -> str:
    """`inventory`: the sources, resolved (cli/inventories.Sources.key)."""
    text = json.dumps([command, inventory, limit, instance])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class RolloutState:
    key: str
    command: str
    batches: list[list[str]]
    done: list[int] = field(default_factory=list)  # indices of batches finished
    stopped: str = ""  # why it stopped
    time: str = ""
    out: dict[str, list[str]] = field(default_factory=dict)  # host → units out of the load balancer

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "key": self.key, "command": self.command, "batches": self.batches,
                "done": self.done, "stopped": self.stopped, "time": self.time, "out": self.out}


def path_of(key: str) -> Path:
    return state_dir() / f"{key}.json"


def load(key: str) -> RolloutState | None:
    path = path_of(key)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise DeployError(f"cannot read the stopped rollout's state: {exc}", where=str(path),
                          hint="delete the file to start the rollout over without --resume") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise DeployError("not a rollout state file of this version", where=str(path),
                          hint="delete the file to start the rollout over without --resume")
    return RolloutState(str(data["key"]), str(data["command"]), [list(map(str, b)) for b in data["batches"]],
                        [int(i) for i in data.get("done", [])], str(data.get("stopped", "")),
                        str(data.get("time", "")),
                        {str(h): [str(u) for u in units] for h, units in dict(data.get("out") or {}).items()})


def save(state: RolloutState) -> None:
    state.time = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path = path_of(state.key)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".rollout.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(state.to_json(), fh, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def clear(key: str) -> None:
    path_of(key).unlink(missing_ok=True)
