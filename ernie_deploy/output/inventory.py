"""What `inventory` prints: exactly ansible-inventory's output (plain text, no console), so the two diff clean."""

from __future__ import annotations

import json
import sys
from typing import Any


def show_graph(text: str) -> None:
    sys.stdout.write(text + "\n")


def show_ansible_json(data: Any) -> None:
    # ansible-inventory's JSON: 4-space indent, sorted keys.
    sys.stdout.write(json.dumps(data, indent=4, sort_keys=True) + "\n")
