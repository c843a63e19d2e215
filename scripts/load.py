"""A small bounded load for the demo: COUNT completions spread over the lab's instances, by a client that
tries the next instance when one refuses (as a client behind a simple balancer with retries would), so an
instance being restarted costs retries, not requests. Prints what it sent, retried and lost.

    python scripts/load.py INVENTORY_JSON COUNT SECONDS
"""

from __future__ import annotations

import http.client
import json
import signal
import sys
import time


def complete(backend: str, model: str) -> bool:
    host, port = backend.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _stop)  # the demo ends the load with SIGTERM once the restart is done
    backends, count, seconds = json.loads(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    sent = retried = lost = 0
    deadline = time.monotonic() + seconds
    try:
        for k in range(count):
            if time.monotonic() > deadline:
                break
            order = backends[k % len(backends):] + backends[:k % len(backends)]
            sent += 1
            for n, (backend, model) in enumerate(order):
                if complete(backend, model):
                    retried += n > 0
                    break
            else:
                lost += 1
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    print(f"load: {sent} requests, {retried} retried on another instance, {lost} lost")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
