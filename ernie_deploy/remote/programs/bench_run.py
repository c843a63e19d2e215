"""Runs on a vLLM host: one `vllm bench serve` against one of its instances, bounded in time.

Reads `{"base": URL, "served": NAME, "argv": [...], "dir": PATH, "user": USER, "timeout": S, "grace": S,
"api_key": KEY or null, "mark": MARK}` as JSON on stdin (the key never reaches a command line: the bench gets it
as OPENAI_API_KEY, which vLLM's openai backend sends as `Authorization: Bearer`). In order, one MARK line of JSON
per event:
* `health`: the instance's /health; anything but 200 ends the run there (no bench against a down instance);
* `metrics` (`when: before`): the instance's request and token counters, the lines of /metrics a stopped run is
  measured from;
* `exit`: the bench's exit code, whether it ran past `timeout` (then it got SIGINT, and SIGKILL `grace` seconds
  later), its seconds and the last lines it printed;
* `metrics` (`when: after`), and `result`: the file vllm bench saved (absent when it saved none).
The bench runs as USER when this runs as root (the instance's service user reads the model directory), in its
own session so the time bound stops every process it started, with its result in `dir`: created here (it must
not exist), removed afterwards; nothing else is written or removed. `error` reports what stopped the program.

Quoted annotations: the host's python3 may be older than the `X | None` form.
"""

import collections
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

COUNTERS = ("vllm:request_success_total", "vllm:generation_tokens_total")
TAIL = 40  # lines of the bench's output kept: its summary table, or the error that ended it


def get(url: str, timeout: float) -> "dict[str, Any]":
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return {"status": resp.status, "body": resp.read(4 * 1024 * 1024).decode(errors="replace"),
                    "error": None}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": "", "error": None}
    except Exception as exc:
        return {"status": None, "body": "", "error": str(getattr(exc, "reason", exc)) or type(exc).__name__}


def counters(base: str) -> str:
    page = get(base + "/metrics", 10)
    return "\n".join(line for line in page["body"].splitlines() if line.startswith(COUNTERS))


def command(spec: "dict[str, Any]") -> "list[str]":
    argv = [str(a) for a in spec["argv"]]
    user = spec.get("user")
    if os.geteuid() == 0 and user and user != "root":
        pwd.getpwnam(user)  # raises KeyError naming a missing user
        return ["runuser", "-u", user, "--", *argv]
    return argv


def environment(spec: "dict[str, Any]") -> "dict[str, str]":
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if spec.get("api_key"):
        env["OPENAI_API_KEY"] = spec["api_key"]
    # The model directory is the tokenizer: nothing to download; caches go to the run's own directory.
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", XDG_CACHE_HOME=os.path.join(spec["dir"], "cache"))
    return env


def default_sigint() -> None:
    """In the bench's process before it runs: SIGINT at its default. Started from a shell's background job or
    under nohup (a local connection run that way), this program inherits SIGINT ignored, exec keeps an ignored
    signal ignored, and vllm bench would never see the time bound's Ctrl-C (only the SIGKILL after the grace,
    which loses its summary)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(spec: "dict[str, Any]", emit: "Any") -> None:
    tail: collections.deque[str] = collections.deque(maxlen=TAIL)
    # preexec_fn: no other thread runs yet (the reader starts after the fork).
    proc = subprocess.Popen(command(spec), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=spec["dir"], env=environment(spec), start_new_session=True,
                            preexec_fn=default_sigint)
    assert proc.stdout is not None
    out = proc.stdout

    def drain() -> None:
        for raw in out:
            tail.append(raw.decode(errors="replace").rstrip("\n"))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    started = time.monotonic()
    timed_out = False
    try:
        code = proc.wait(timeout=float(spec["timeout"]))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGINT)  # vllm bench's Ctrl-C: it cancels its requests and exits
        try:
            code = proc.wait(timeout=float(spec["grace"]))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    seconds = time.monotonic() - started
    reader.join(5)
    emit("exit", code=code, timed_out=timed_out, seconds=seconds, tail=list(tail))


def main(spec: "dict[str, Any]") -> None:
    mark = spec["mark"]

    def emit(event: str, **data: "Any") -> None:
        sys.stdout.write(mark + json.dumps(dict(event=event, **data)) + "\n")
        sys.stdout.flush()

    base = spec["base"]
    health = get(base + "/health", 10)
    emit("health", status=health["status"], error=health["error"])
    if health["status"] != 200:
        return
    emit("metrics", when="before", text=counters(base))
    directory = spec["dir"]
    try:
        os.mkdir(directory, 0o700)
    except OSError as exc:
        emit("error", error=f"cannot create {directory}: {exc}")
        return
    try:
        if os.geteuid() == 0 and spec.get("user"):
            entry = pwd.getpwnam(spec["user"])
            os.chown(directory, entry.pw_uid, entry.pw_gid)
        run(spec, emit)
        emit("metrics", when="after", text=counters(base))
        path = os.path.join(directory, spec["name"])
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                emit("result", text=f.read())
    except (OSError, KeyError) as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main(json.load(sys.stdin))
