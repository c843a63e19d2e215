"""HTTP side of the simulated vLLM: the OpenAI-compatible routes, /health, /metrics and friends.

A deterministic toy generator stands in for the model: the same prompt always yields the same text, at the
speed of the latency model (vllm_latency.py: TP, the batch running at once and the input length set the time to
first token and the time per output token). The engine-side /metrics (TTFT, inter-token latency, prefill and
decode times) observe the times the requests really took, so they agree with what a client measures.
"""

from __future__ import annotations

import hashlib
import json
import re
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

from .vllm_latency import LatencyModel
from .vllm_metrics import Histogram, MetricsStore, render
from .vllm_versions import Profile

# Routes as vLLM logs them at start-up ("Route: %s, Methods: %s"), in its order.
ROUTES: tuple[tuple[str, str], ...] = (
    ("/openapi.json", "HEAD, GET"),
    ("/docs", "HEAD, GET"),
    ("/docs/oauth2-redirect", "HEAD, GET"),
    ("/redoc", "HEAD, GET"),
    ("/health", "GET"),
    ("/load", "GET"),
    ("/ping", "POST"),
    ("/ping", "GET"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
    ("/v1/models", "GET"),
    ("/version", "GET"),
    ("/v1/responses", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/completions", "POST"),
    ("/v1/embeddings", "POST"),
    ("/metrics", "GET"),
)

# EngineDeadError's texts: str(exc) (0.11.0 and 0.34.0 v1/engine/exceptions.py) and, from 0.34, the message
# clients get instead (0.34.0 v1/engine/exceptions.py:24, CLIENT_MESSAGE).
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
ENGINE_DEAD_CLIENT_MESSAGE = "The server had an error while processing your request."

# vLLM's TTFT histogram buckets (v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)

_WORDS = (
    "the", "model", "answers", "with", "care", "and", "a", "steady", "voice", "while", "tokens", "flow", "from",
    "the", "engine", "through", "the", "scheduler", "into", "the", "stream", "so", "every", "client", "sees",
    "text", "arrive", "quickly", "and", "in", "order", "ernie", "serves", "requests", "on", "simulated", "gpus",
    "inside", "the", "rehearsal", "lab", "for", "deployment", "checks",
)
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    """Toy tokenizer: words and punctuation marks, plus one BOS token."""
    return len(_TOKEN_RE.findall(text)) + 1


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def histogram_lines(hist: Histogram, name: str, labels: str) -> list[str]:
    """A histogram in the text form the profiles before 0.32 were written from (Python's float repr for `le`;
    the 0.32 form, Go's, is vllm_metrics.Histogram.lines)."""
    counts = hist.counts or [0] * len(hist.buckets)
    pairs = zip(hist.buckets, counts, strict=True)
    out = [f'{name}_bucket{{{labels},le="{bound}"}} {float(c)}' for bound, c in pairs]
    out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(hist.n)}')
    out.append(f"{name}_count{{{labels}}} {float(hist.n)}")
    out.append(f"{name}_sum{{{labels}}} {hist.total}")
    return out


@dataclass
class ServerState:
    """Everything the request handlers share; all mutation happens under `lock`."""

    profile: Profile
    served_name: str
    model_root: str
    max_model_len: int
    kv_tokens: int
    max_num_seqs: int
    api_keys: list[str] | None
    health_503: Callable[[], bool]
    on_load_change: Callable[[int], None]
    access_log: Callable[[str], None] | None
    created: int = field(default_factory=lambda: int(time.time()))
    # Called (with chat=True/False) when the dead engine ends a stream; the server logs vLLM's line for it.
    on_stream_error: Callable[[bool], None] | None = None
    # Called after a request was refused because the engine is shutting down (0.32: uvicorn's ASGI traceback).
    on_drain_reject: Callable[[], None] | None = None
    # Called after the dead engine's 500 went out: the error handler's terminate_if_errored stops the server.
    on_dead_reply: Callable[[], None] | None = None
    latency: LatencyModel = field(default_factory=LatencyModel)  # TP, faults' latency_scale / token_seconds
    log_stats: bool = True  # False with --disable-log-stats: /metrics has no vllm: family (metrics_text)
    draining: bool = False  # the engine is stopping (0.32): new generation requests fail with 500
    stalled: bool = False  # the engine went and its requests were never finished (0.32's race, `shutdown_stall`)
    # faults.json `stall` (vllm_hang.py): None, "running" (the engine's step hangs) or "waiting" (its scheduler
    # admits nothing); `frozen` holds the gauges a hung engine last reported.
    stall_mode: str | None = None
    frozen: dict[str, float] | None = None
    # A worker died and the executor is still ending the others (vllm_shutdown._executor_grace): the engine's step
    # waits on the dead worker, so nothing runs, while the API server does not know yet (/health 200).
    halted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    inflight: int = 0
    running: int = 0
    waiting: int = 0
    running_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    engine_dead: bool = False
    fingerprint: str | None = None  # system_fingerprint of 0.32's completions ("vllm-0.32.0-8f107172", captured)
    store: MetricsStore = field(default_factory=MetricsStore)  # the 0.32 /metrics (vllm_metrics.py)
    cache_info: dict[str, str] = field(default_factory=dict)  # vllm:cache_config_info's labels (0.32)
    dead: threading.Event = field(default_factory=threading.Event)  # set with engine_dead; wakes generators
    seq_slots: threading.Semaphore = field(init=False)
    idle: threading.Condition = field(init=False)
    unstalled: threading.Condition = field(init=False)  # notified when `stall_mode` changes

    def __post_init__(self) -> None:
        self.seq_slots = threading.Semaphore(self.max_num_seqs)
        self.idle = threading.Condition(self.lock)
        self.unstalled = threading.Condition(self.lock)

    def gauges(self) -> dict[str, float]:
        """The scheduler's gauges as the engine reports them (caller holds `lock`)."""
        usage = min(1.0, self.running_tokens / self.kv_tokens) if self.kv_tokens else 0.0
        return {"running": float(self.running), "waiting": float(self.waiting), "kv_usage": usage}

    def shown_gauges(self) -> dict[str, float]:
        """What /metrics shows (caller holds `lock`): the gauges a hung engine last reported, else the live ones.
        vLLM's Prometheus gauges are set from the SchedulerStats that come with each engine output (v1/metrics/
        loggers.py PrometheusStatLogger.record): an engine stuck in its step sends none, so they stay put."""
        return dict(self.frozen) if self.frozen is not None else self.gauges()

    def set_stall(self, mode: str | None) -> None:
        """Start, change or end a stall (vllm_hang.py); waiting requests and generators wake to look again."""
        with self.lock:
            if mode == "running" and self.stall_mode != "running":
                self.frozen = self.gauges()
            elif mode != "running":
                self.frozen = None
            self.stall_mode = mode
            self.unstalled.notify_all()

    def wait_unstalled(self, modes: tuple[str, ...]) -> None:
        """Block while the stall is one of `modes` or the engine is halted; an engine death (or its end in a
        shutdown) ends the wait."""
        with self.lock:
            while (self.stall_mode in modes or self.halted) and not self.dead.is_set():
                self.unstalled.wait(0.2)

    def halt(self) -> None:
        """The engine stops making progress until it is declared dead (`mark_dead`)."""
        with self.lock:
            self.halted = True
            self.unstalled.notify_all()

    def mark_dead(self) -> None:
        """The engine is gone: /health turns 503 and every request in flight ends at its next token."""
        self.engine_dead = True
        self.dead.set()
        self.set_stall(None)  # a hung engine that is killed stops hanging: its requests get the error now

    def mark_stalled(self) -> None:
        """The engine is gone but nothing tells its requests: they wait for their clients to give up."""
        self.stalled = True
        self.dead.set()
        self.set_stall(None)

    def wait_dead(self, seconds: float) -> bool:
        """Sleep for one generation step; True (at once) if the engine died meanwhile."""
        return self.dead.wait(max(0.0, seconds))


@dataclass(frozen=True)
class Generation:
    prompt_tokens: int
    tokens: list[str]
    finish_reason: str
    key: str  # the request's jitter key in the latency model (its prompt's hash)


def plan_generation(prompt_text: str, prompt_tokens: int, max_tokens: int | None, ignore_eos: bool) -> Generation:
    """Deterministic output: the prompt's hash picks words and a natural length (the timings come from the
    latency model once the request is admitted, as they depend on the load)."""
    seed = _seed(prompt_text)
    natural = 24 + seed % 40
    limit = max_tokens if max_tokens is not None else natural
    count = limit if ignore_eos else min(limit, natural)
    words = [_WORDS[_seed(f"{seed}:{i}") % len(_WORDS)] for i in range(count)]
    tokens = [(" " if i else "") + w for i, w in enumerate(words)]
    finish = "length" if count == limit and (ignore_eos or limit <= natural) else "stop"
    return Generation(prompt_tokens, tokens, finish, f"{seed:x}")


class EngineDied(Exception):
    """A request was ended by the dead engine; its answer (error body or stream end) is already sent."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


def error_body(profile: Profile, err: ApiError) -> dict[str, Any]:
    """vLLM's ErrorResponse: nested {"error": {...}} in newer releases, flat in 0.9.2 [UNVERIFIED cut-over]."""
    inner = {"message": err.message, "type": err.err_type, "param": None, "code": err.status}
    return {"error": inner} if profile.nested_error_body else {"object": "error", **inner}


def chat_prompt(messages: Any) -> tuple[str, int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "BadRequestError")
    text = "".join(f"<{m.get('role', 'user')}>{m.get('content', '')}\n" for m in messages if isinstance(m, dict))
    tokens = sum(count_tokens(str(m.get("content", ""))) + 3 for m in messages if isinstance(m, dict)) + 2
    return text, tokens


def check_length(state: ServerState, prompt_tokens: int, max_tokens: int | None) -> None:
    """400 when prompt + max_tokens exceeds max_model_len ([UNVERIFIED] exact wording per version)."""
    limit = state.max_model_len
    if max_tokens is None:
        if prompt_tokens >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
                "BadRequestError",
            )
        return
    if prompt_tokens + max_tokens > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            "BadRequestError",
        )


def metrics_text(state: ServerState) -> str:
    if state.profile.forms_032:
        with state.lock:
            shown = state.shown_gauges()
            gauges = {"vllm:num_requests_running": shown["running"], "vllm:num_requests_waiting": shown["waiting"],
                      "vllm:num_requests_waiting_by_reason/capacity": shown["waiting"],
                      "vllm:kv_cache_usage_perc": shown["kv_usage"], "vllm:engine_sleep_state/awake": 1.0}
            return render(state.store, gauges, state.served_name, state.cache_info, state.log_stats)
    if not state.log_stats:  # the profiles before 0.32 model only the vllm: families, so the page is empty
        return ""
    labels = f'model_name="{state.served_name}",engine="0"'
    with state.lock:
        shown = state.shown_gauges()
        usage = shown["kv_usage"]
        lines: list[str] = []

        def gauge(name: str, help_text: str, value: float) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {float(value)}"])

        def counter(name: str, help_text: str, samples: Sequence[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"])
            lines.extend(f"{name}_total{{{labels}{extra}}} {float(v)}" for extra, v in samples)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", shown["running"])
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", shown["waiting"])
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        if state.profile.gpu_cache_usage_metric:
            gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", usage)
        counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [("", state.prompt_tokens)])
        counter("vllm:generation_tokens", "Number of generation tokens processed.", [("", state.generation_tokens)])
        reasons = [(f',finished_reason="{r}"', state.success.get(r, 0)) for r in ("stop", "length", "abort")]
        counter("vllm:request_success", "Count of successfully processed requests.", reasons)
        for name, hist, help_text in (
            ("vllm:time_to_first_token_seconds", state.ttft, "Histogram of time to first token in seconds."),
            ("vllm:e2e_request_latency_seconds", state.e2e, "Histogram of e2e request latency in seconds."),
        ):
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} histogram"])
            lines.extend(histogram_lines(hist, name, labels))
    return "\n".join(lines) + "\n"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    state: ServerState  # set on the subclass made by make_handler
    _status = 0  # status of the answer being sent (for the 0.32 HTTP metrics)
    _sent = 0  # its content-length (0 for a stream, as the instrumentator counts it)
    _raw = b""  # the request's body, read before anything is answered

    # -- plumbing --------------------------------------------------------------------------------
    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if self.state.access_log is None:
            return
        status = int(code) if str(code).isdigit() else 0
        phrase = HTTPStatus(status).phrase if status else ""
        host, port = self.client_address[:2]
        self.state.access_log(f'{host}:{port} - "{self.requestline}" {status} {phrase}')

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self._sent += len(body)  # what the instrumentator reads: the content-length header
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, self._dumps(obj).encode())

    def _dumps(self, obj: Any) -> str:
        """FastAPI's responses carry no spaces (0.32 captures); older profiles keep json.dumps' default."""
        return json.dumps(obj, separators=(",", ":")) if self.state.profile.compact_json else json.dumps(obj)

    def _read_body(self) -> None:
        """Read the whole request body (Content-Length, or chunked) before any answer, whatever the route and
        outcome: an answer that leaves body bytes unread desynchronises a keep-alive connection, and a proxy's
        next request on it would be parsed from the leftover bytes (a 400 it does not retry). A body that cannot
        be framed closes the connection after the answer."""
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                parts = []
                while size := int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16):
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline().strip():  # trailer fields, up to the empty line
                    pass
                self._raw = b"".join(parts)
            else:
                length = int(self.headers.get("content-length", 0) or 0)
                if length < 0:
                    raise ValueError(f"negative content-length {length}")
                self._raw = self.rfile.read(length)
        except ValueError:
            self._raw = b""
            self.close_connection = True

    def _body(self) -> dict[str, Any]:
        try:
            data = json.loads(self._raw or b"{}")
        except json.JSONDecodeError as err:
            raise ApiError(400, f"Invalid JSON body: {err}", "BadRequestError") from err
        if not isinstance(data, dict):
            raise ApiError(400, "Request body must be a JSON object", "BadRequestError")
        return data

    def _authorized(self) -> bool:
        keys = self.state.api_keys
        path = self.path.split("?", 1)[0]
        if not keys or not path.startswith(self.state.profile.auth_prefixes):
            return True
        return self.headers.get("authorization", "") in {f"Bearer {k}" for k in keys}

    # -- dispatch --------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status = code
        super().send_response(code, message)

    def _dispatch(self, method: str) -> None:
        state = self.state
        with state.lock:
            state.inflight += 1
        started, self._status, self._sent = time.monotonic(), 0, 0
        try:
            self._read_body()
            self._route(method)
        except ApiError as err:
            self._json(err.status, error_body(state.profile, err))
        except EngineDied:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            with state.lock:
                state.inflight -= 1
                state.idle.notify_all()
            if state.profile.forms_032 and self._status:
                received = len(self._raw)
                state.store.http_done(self.path.split("?", 1)[0], method, self._status, (received, self._sent),
                                      time.monotonic() - started)

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            self._json(401, {"error": "Unauthorized"})
            return
        get_routes: dict[str, Callable[[], None]] = {
            "/health": self._health,
            "/ping": self._health,
            "/version": lambda: self._json(200, {"version": self.state.profile.version}),
            "/load": lambda: self._json(200, {"server_load": self.state.running + self.state.waiting}),
            "/v1/models": self._models,
            "/metrics": lambda: self._send(200, metrics_text(self.state).encode(), "text/plain; version=0.0.4"),
        }
        post_routes: dict[str, Callable[[], None]] = {
            "/ping": self._health,
            "/v1/completions": lambda: self._generate(chat=False),
            "/v1/chat/completions": lambda: self._generate(chat=True),
        }
        routes = post_routes if method == "POST" else get_routes
        if path in routes:
            routes[path]()
        elif path in get_routes or path in post_routes:
            self._json(405, {"detail": "Method Not Allowed"})
        else:
            self._json(404, {"detail": "Not Found"})

    def _health(self) -> None:
        self._send(503 if self.state.engine_dead or self.state.health_503() else 200, b"", "application/json")

    def _models(self) -> None:
        s = self.state
        card = {
            "id": s.served_name,
            "object": "model",
            "created": s.created,
            "owned_by": "vllm",
            "root": s.model_root,
            "parent": None,
            "max_model_len": s.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex[:16] if s.profile.forms_032 else uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": s.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        self._json(200, {"object": "list", "data": [card]})

    # -- generation ------------------------------------------------------------------------------
    def _engine_dead_reply(self) -> None:
        """The answer to a non-streaming request once the engine is dead (new, or in flight when it died).

        0.34: engine_error_handler's JSON 500 with EngineDeadError.CLIENT_MESSAGE (0.34.0
        entrypoints/serve/exception_handling/handlers/vllm_error.py:28-64, error_response.py:68-72);
        0.11: runtime_exception_handler's `Response(status_code=500)`, no body (0.11.0 entrypoints/launcher.py:156-167).
        """
        profile = self.state.profile
        if self.state.stalled:
            self._stall()
        if profile.engine_dead_client_message or profile.engine_dead_text_500:
            message = ENGINE_DEAD_MESSAGE if profile.engine_dead_text_500 else ENGINE_DEAD_CLIENT_MESSAGE
            self._json(500, error_body(profile, ApiError(500, message, "InternalServerError")))
        else:
            self.send_response(500)
            self.send_header("content-length", "0")
            self.end_headers()
        if self.state.on_dead_reply is not None:
            self.state.on_dead_reply()

    def _stall(self) -> NoReturn:
        """The request's engine is gone and nothing ends it: send nothing until the client closes the connection."""
        while True:
            readable, _, _ = select.select([self.connection], [], [], 0.2)
            if readable:
                try:
                    if not self.connection.recv(1, socket.MSG_PEEK):
                        raise EngineDied
                except OSError as err:
                    raise EngineDied from err
                time.sleep(0.2)  # the client sent more (pipelining): it is still there

    def _drain_reject(self) -> None:
        """0.32: once AsyncLLM.shutdown has shut the renderer's executor, tokenizing a new prompt raises
        RuntimeError, which the ASGI app answers 500 with its text (captured drain-new-request.json)."""
        self._body()  # a body that is no JSON object is still FastAPI's 400, before the handler runs
        err = ApiError(500, "cannot schedule new futures after shutdown", "InternalServerError")
        self._json(500, error_body(self.state.profile, err))
        if self.state.on_drain_reject is not None:
            self.state.on_drain_reject()

    def _generate(self, chat: bool) -> None:
        state = self.state
        if state.draining and not state.engine_dead:
            self._drain_reject()
            return
        if state.engine_dead:
            # 0.34 _preflight / 0.11 create_completion: `if engine_client.errored: raise dead_error`.
            self._engine_dead_reply()
            return
        body = self._body()
        model = body.get("model", state.served_name)
        if model != state.served_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
        if chat:
            prompt_text, prompt_tokens = chat_prompt(body.get("messages"))
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            prompt = body.get("prompt", "")
            prompt_text = prompt if isinstance(prompt, str) else json.dumps(prompt)
            prompt_tokens = count_tokens(prompt_text)
            max_tokens = body.get("max_tokens", 16)
        check_length(state, prompt_tokens, max_tokens)
        gen = plan_generation(prompt_text, prompt_tokens, max_tokens, bool(body.get("ignore_eos")))
        # 0.32 ids carry 16 hex digits (captured); the older profiles a whole uuid.
        hex_id = uuid.uuid4().hex[:16] if state.profile.forms_032 else uuid.uuid4().hex
        request_id = ("chatcmpl-" if chat else "cmpl-") + hex_id
        if body.get("stream"):
            # StreamingResponse sends its 200 and headers before the engine has scheduled the request (a queued,
            # or stalled, stream already shows `200 OK` in the access log).
            self._stream_headers()
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            with _scheduled(state, gen) as run:
                self._stream(chat, request_id, model, gen, run, include_usage)
        else:
            with _scheduled(state, gen) as run:
                self._complete(chat, request_id, model, gen, run)

    def _complete(self, chat: bool, rid: str, model: str, gen: Generation, run: _scheduled) -> None:
        for i in range(len(gen.tokens)):
            if self.state.wait_dead(run.delay(i)):
                self._engine_dead_reply()
                raise EngineDied
            run.token_done()
        text = "".join(gen.tokens)
        run.finish()
        usage = _usage(gen)
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": None,
            }
            obj = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                   "choices": [choice], "service_tier": None, "system_fingerprint": None, "usage": usage,
                   "prompt_logprobs": None, "kv_transfer_params": None}
        elif self.state.profile.forms_032:  # captured http/completion.json
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason,
                      "stop_reason": None, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                      "routed_experts": None}
            obj = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                   "choices": [choice], "service_tier": None, "system_fingerprint": self.state.fingerprint,
                   "usage": {**usage, "completion_tokens_details": None}, "kv_transfer_params": None,
                   "ec_transfer_params": None, "metrics": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
            obj = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                   "choices": [choice], "service_tier": None, "system_fingerprint": None, "usage": usage,
                   "kv_transfer_params": None}
        self._json(200, obj)

    def _stream_headers(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def _stream(self, chat: bool, rid: str, model: str, gen: Generation, run: _scheduled, usage: bool) -> None:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choice: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> None:
            obj: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model,
                                   "choices": [choice] if choice else []}
            obj.update(extra or {})
            self._chunk(f"data: {self._dumps(obj)}\n\n".encode())

        for i, token in enumerate(gen.tokens):
            if self.state.wait_dead(run.delay(i)):
                self._stream_engine_dead(chat)
            run.token_done()
            if chat and i == 0:  # the chat generator sends the role with the engine's first output, not before
                event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None})
            last = i == len(gen.tokens) - 1
            finish = gen.finish_reason if last else None
            if chat:
                event({"index": 0, "delta": {"content": token}, "logprobs": None, "finish_reason": finish,
                       **({"stop_reason": None} if last else {})})
            elif self.state.profile.forms_032:  # captured http/stream-complete.txt
                event({"index": 0, "text": token, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                       "prompt_token_ids": None, "token_ids": None},
                      {"system_fingerprint": self.state.fingerprint} if last else None)
            else:
                event({"index": 0, "text": token, "logprobs": None, "finish_reason": finish,
                       "stop_reason": None})
        if usage:
            event(None, {"usage": _usage(gen)})
        run.finish()
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _stream_engine_dead(self, chat: bool) -> NoReturn:
        """The engine died mid-stream: the generator catches EngineDeadError, sends it as one error event and
        then `data: [DONE]`; no choice ever gets its finish_reason (0.34.0 openai/completion/serving.py:620-626,
        chat_completion/serving.py:504-508 and 962-964; 0.11.0 serving_completion.py:490-494,
        serving_chat.py:1143-1149)."""
        state = self.state
        if state.stalled:
            self._stall()
        if state.on_stream_error is not None:
            state.on_stream_error(chat)
        if state.profile.engine_dead_text_500:  # str(exc) as a 500, with json.dumps' spaces (captured)
            err = ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError")
        elif state.profile.engine_dead_client_message:
            err = ApiError(500, ENGINE_DEAD_CLIENT_MESSAGE, "InternalServerError")
        else:  # create_streaming_error_response(str(e)) with its defaults
            err = ApiError(400, ENGINE_DEAD_MESSAGE, "BadRequestError")
        self._chunk(f"data: {json.dumps(error_body(state.profile, err))}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")
        raise EngineDied

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def _usage(gen: Generation) -> dict[str, Any]:
    n = len(gen.tokens)
    return {"prompt_tokens": gen.prompt_tokens, "total_tokens": gen.prompt_tokens + n,
            "completion_tokens": n, "prompt_tokens_details": None}


class _scheduled:
    """Admit a request: wait for one of --max-num-seqs slots, count it as running, update GPU load; then pace
    its tokens by the latency model and observe the times they really took (the engine's histograms)."""

    def __init__(self, state: ServerState, gen: Generation) -> None:
        self.state = state
        self.gen = gen
        self.started = 0.0  # arrival (vLLM's TTFT and e2e count the queue)
        self.admitted = 0.0
        self.first_at: float | None = None
        self.last_at = 0.0
        self.running_at_admission = 1
        self.finished = False
        self.tokens = gen.prompt_tokens + len(gen.tokens)

    def delay(self, index: int) -> float:
        """How long output token `index` takes: the prefill for the first, one decode step for the others. An
        engine whose step hangs (faults.json `stall`) produces nothing until the stall ends or the engine dies."""
        s = self.state
        s.wait_unstalled(("running",))
        if index == 0:
            return s.latency.ttft(self.gen.prompt_tokens, self.running_at_admission, self.gen.key)
        with s.lock:
            running = s.running
        return s.latency.tpot(running, self.gen.key, index)

    def token_done(self) -> None:
        """One output token is out: counted at once, as vLLM counts each engine step's tokens (IterationStats), so
        vllm:generation_tokens_total advances while a long request runs and stops only when the engine does."""
        now = time.monotonic()
        with self.state.lock:
            store = self.state.store
            self.state.generation_tokens += 1
            store.inc("vllm:generation_tokens", 1.0)
            if self.first_at is None:
                self.first_at = now
                self.state.ttft.observe(now - self.started)
                store.observe("vllm:time_to_first_token_seconds", now - self.started)
            else:
                store.observe("vllm:inter_token_latency_seconds", now - self.last_at)
        self.last_at = now

    def __enter__(self) -> _scheduled:
        s = self.state
        self.started = time.monotonic()
        with s.lock:
            s.waiting += 1
        s.seq_slots.acquire()
        # A stalled engine schedules nothing new: the request stays waiting (its slot held) until the stall ends.
        s.wait_unstalled(("running", "waiting"))
        with s.lock:
            s.waiting -= 1
            s.running += 1
            s.running_tokens += self.tokens
            s.prompt_tokens += self.gen.prompt_tokens
            running = self.running_at_admission = s.running
            self.admitted = time.monotonic()
            prompt, store = float(self.gen.prompt_tokens), s.store
            for name in ("vllm:prompt_tokens", "vllm:prefix_cache_queries"):
                store.inc(name, prompt)
            store.inc("vllm:prompt_tokens_by_source", prompt, ("local_compute",))
            store.observe("vllm:request_queue_time_seconds", time.monotonic() - self.started)
            store.observe("vllm:request_prompt_tokens", prompt)
            store.observe("vllm:request_prefill_kv_computed_tokens", prompt)
            store.observe("vllm:request_params_n", 1.0)
            store.observe("vllm:request_params_max_tokens", float(len(self.gen.tokens)))
            store.observe("vllm:request_max_num_generation_tokens", float(len(self.gen.tokens)))
        s.on_load_change(running)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.finish(exc_type is None)

    def finish(self, ok: bool = True) -> None:
        """The engine is done with the request (once): counted, its slot freed. Called before the answer's
        last bytes go out, so a client that reads /metrics right after its answer sees the request finished."""
        if self.finished:
            return
        self.finished = True
        s = self.state
        reason = self.gen.finish_reason if ok else "abort"
        with s.lock:
            s.running -= 1
            s.running_tokens -= self.tokens
            s.success[reason] = s.success.get(reason, 0) + 1
            elapsed = time.monotonic() - self.started
            s.e2e.observe(elapsed)
            running = s.running
            store = s.store
            store.inc("vllm:request_success", 1.0, (reason,))
            for name in ("vllm:e2e_request_latency_seconds", "vllm:request_inference_time_seconds"):
                store.observe(name, elapsed)
            first = self.first_at if self.first_at is not None else time.monotonic()
            store.observe("vllm:request_prefill_time_seconds", first - self.admitted)
            store.observe("vllm:request_decode_time_seconds", max(0.0, self.last_at - first))
            store.observe("vllm:request_generation_tokens", float(len(self.gen.tokens)))
            if ok and len(self.gen.tokens) > 1:
                store.observe("vllm:request_time_per_output_token_seconds",
                              (self.last_at - first) / (len(self.gen.tokens) - 1))
        s.seq_slots.release()
        s.on_load_change(running)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that goes away mid-request (reset, broken pipe) is routine; uvicorn, which vLLM serves with,
        # logs no traceback for it, so neither may the simulator (verify would read one as a start-up error).
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def make_server(sock: Any, state: ServerState) -> ThreadingHTTPServer:
    """Serve on an already bound socket (vLLM binds early and listens only once the engine is up)."""
    handler = type("BoundHandler", (Handler,), {"state": state})
    server = _Server(sock.getsockname()[:2], handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_address = sock.getsockname()[:2]
    server.daemon_threads = True
    server.server_activate()
    return server


def iter_routes() -> Iterator[tuple[str, str]]:
    yield from ROUTES
