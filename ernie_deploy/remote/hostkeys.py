"""How unknown SSH host keys are treated; apart from ssh.py so the command line can offer the choices without
loading the SSH library."""

from __future__ import annotations

from enum import Enum


class HostKeyPolicy(Enum):
    STRICT = "strict"
    ACCEPT_NEW = "accept-new"
