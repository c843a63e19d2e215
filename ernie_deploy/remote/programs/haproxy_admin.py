"""Runs on a balancer host: sends commands to HAProxy's runtime API (its admin unix socket) and prints the answers.

Reads `{"socket": PATH, "commands": [...], "mark": MARK, "timeout": SECONDS}` as JSON on stdin and prints one
MARK line of JSON per command: `{"i": N, "answer": TEXT}`. HAProxy closes a non-interactive connection after
one command (management.txt, "Unix Socket commands"), so each command gets a connection of its own. When the
socket cannot be reached the program prints `{"i": "*", "error": KIND, "detail": TEXT}` and stops, KIND being
`missing` (no such file), `denied` (permission), `refused` (a socket nobody listens on: HAProxy is not
running), `timeout` or `other`: the controller turns each into its own problem and fix. No socat needed.

Quoted annotations: the host's python3 may be older than the `X | None` form.
"""

import errno
import json
import socket
import sys
from typing import Any

LIMIT = 4 * 1024 * 1024  # `show stat` of a few hundred servers is far below; a bound all the same


def kind_of(exc: "Exception") -> str:
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, PermissionError):
        return "denied"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, socket.timeout):
        return "timeout"
    if isinstance(exc, OSError) and exc.errno == errno.ENOTSOCK:
        return "missing"
    return "other"


def ask(path: str, command: str, timeout: float) -> str:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        sock.sendall(command.encode() + b"\n")
        chunks = []
        size = 0
        while size < LIMIT:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
            size += len(data)
        return b"".join(chunks).decode(errors="replace")
    finally:
        sock.close()


def main(spec: "dict[str, Any]") -> None:
    mark = spec["mark"]
    for i, command in enumerate(spec["commands"]):
        try:
            answer = ask(spec["socket"], command, float(spec.get("timeout", 10)))
        except Exception as exc:
            record = {"i": "*", "error": kind_of(exc), "detail": str(exc)}
            sys.stdout.write(mark + json.dumps(record) + "\n")
            return
        sys.stdout.write(mark + json.dumps({"i": i, "answer": answer}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(json.load(sys.stdin))
