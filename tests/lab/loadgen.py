"""A bounded load generator that acts as the load balancer in front of the lab's instances (or, `through`, sends
everything to a real balancer's frontend), and a sampler that records which hosts are down every 100 ms.

The rotation is a JSON file of "address:port" backends; the rollout's pre-drain hook removes an instance from
it, the post-ready hook puts it back (rotation.py is the hook). Every request goes to a backend in rotation
at the moment it is sent; a request that fails, or a stream that ends without its finish_reason and
[DONE], counts as lost.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOOK = Path(__file__).with_name("rotation.py")


def hook(rotation: Path, action: str) -> str:
    """The shell command a rollout runs as its pre-drain (remove) or post-ready (add) hook."""
    return f"{sys.executable} {HOOK} {rotation} {action}"


@dataclass
class Outcome:
    backend: str
    stream: bool
    ok: bool
    detail: str
    started: float  # wall clock (time.time())
    ended: float


@dataclass
class LoadBalancer:
    rotation: Path
    model: str
    workers: int = 6
    max_seconds: float = 180.0  # always bounded, even when a test forgets to stop it
    api_key: str | None = None  # sent as a bearer token when the instances require one (vllm_api_key)
    stream_tokens: int = 120  # per streamed request; real vLLM on 2 CPU cores makes ~10 tokens/s
    tokens: int = 24  # per non-streamed request
    # Seconds a request may take before it counts as lost. Real vLLM on 2 cores serving alone while the other
    # instance loads answered an 8-token request in over 30 s (measured): slow, not lost.
    request_timeout: float = 30.0
    # Seconds each worker waits between its requests. Real vLLM on 2 cores: a saturating load on the instance that
    # serves starves the restarting TP-2 instance's rank on the same CPU, and its start took 7.8 min (measured).
    pause: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _next: int = 0

    def removals(self) -> list[tuple[float, str]]:
        """(time, backend) of each time the pre-drain hook took a backend out of the rotation."""
        path = Path(f"{self.rotation}.events")
        events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [(e["t"], e["backend"]) for e in events if e["action"] == "remove"]

    def backends(self) -> list[str]:
        try:
            return list(json.loads(self.rotation.read_text()))
        except (OSError, ValueError):
            return []

    def start(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        for k in range(self.workers):
            t = threading.Thread(target=self._work, args=(k, deadline), daemon=True)
            t.start()
            self._threads.append(t)

    def finish(self) -> list[Outcome]:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=30)
        return self.outcomes

    def _pick(self) -> str | None:
        with self._lock:
            backends = self.backends()
            if not backends:
                return None
            self._next += 1
            return backends[self._next % len(backends)]

    def _work(self, k: int, deadline: float) -> None:
        n = 0
        while not self.stop.is_set() and time.monotonic() < deadline:
            backend = self._pick()
            if backend is None:
                time.sleep(0.05)
                continue
            n += 1
            stream = (n + k) % 2 == 0
            t0 = time.time()  # wall clock: compared with the rotation's events, written by the hook processes
            ok, detail = complete(backend, self.model, stream, self.stream_tokens if stream else self.tokens,
                                  self.api_key, self.request_timeout)
            with self._lock:
                self.outcomes.append(Outcome(backend, stream, ok, detail, t0, time.time()))
            if self.pause:
                self.stop.wait(self.pause)

def through(frontend: str, model: str, directory: Path, **options: Any) -> LoadBalancer:
    """A load whose every request goes to one "address:port", a real balancer's frontend, which does the
    balancing (the rotation holds that one entry, and no hook ever changes it)."""
    rotation = directory / "frontend.json"
    rotation.write_text(json.dumps([frontend]))
    return LoadBalancer(rotation, model, **options)


@dataclass
class Sampler:
    """Every 100 ms: which hosts have an instance that does not answer /health 200."""

    instances: dict[str, list[str]]  # host → its "address:port" backends
    interval: float = 0.1
    max_seconds: float = 180.0
    samples: list[tuple[float, frozenset[str]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def finish(self) -> list[tuple[float, frozenset[str]]]:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return self.samples

    def down(self) -> frozenset[str]:
        out = set()
        for host, backends in self.instances.items():
            for backend in backends:
                if not healthy(backend):
                    out.add(f"{host} {backend}")
        return frozenset(out)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        while not self.stop.is_set() and time.monotonic() < deadline:
            t0 = time.monotonic()
            self.samples.append((t0, self.down()))
            time.sleep(max(0.0, self.interval - (time.monotonic() - t0)))

    def most_hosts_down(self) -> int:
        return max((len({d.split(" ")[0] for d in down}) for _, down in self.samples), default=0)


def complete(backend: str, model: str, stream: bool, max_tokens: int, api_key: str | None = None,
             timeout: float = 30.0) -> tuple[bool, str]:
    """One completion: (whether it ended properly, a detail). A stream ended properly when a choice got its
    finish_reason, no error event came and the last event is [DONE] (vLLM sends an error event and [DONE]
    when the engine dies mid-stream)."""
    host, port = backend.rsplit(":", 1)
    body = {"model": model, "prompt": "Tell me about the sea", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, "ignore_eos": True}
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        data = resp.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        # A chunked stream cut by a dying server ends in IncompleteRead: lost, and counted (an uncaught one would
        # end the worker thread without recording the request).
        return False, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    if resp.status != 200:
        return False, f"HTTP {resp.status}: {data[:200]}"
    if not stream:
        return ("choices" in data, data[:200])
    events = [line[6:] for line in data.splitlines() if line.startswith("data: ")]
    chunks = [_event(e) for e in events[:-1]]
    # Real vLLM writes compact JSON, the simulator Python's default separators: read the events, not their text.
    finished = any(c.get("finish_reason") for chunk in chunks for c in chunk.get("choices", []))
    errored = any("error" in chunk for chunk in chunks)
    return (bool(events) and events[-1] == "[DONE]" and finished and not errored,
            f"{len(events)} events, finished={finished}, error={errored}")


def _event(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {"error": f"not JSON: {text[:80]}"}
    return value if isinstance(value, dict) else {"error": f"not an object: {text[:80]}"}


def healthy(backend: str) -> bool:
    host, port = backend.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=0.5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()
