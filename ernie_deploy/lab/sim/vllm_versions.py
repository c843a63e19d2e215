"""Per-version behaviour of the simulated vLLM, from docs/vllm-facts.md
(#vllm-model-registry, #start-up-errors, #version-differences).

Each profile states only differences docs/vllm-facts.md#version-differences lists (or, where marked [UNVERIFIED],
our best guess). A claimed version that has no profile of its own uses the nearest lower one.
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
PROFILES[(0, 24, 0)] = replace(PROFILES[(0, 20, 0)], version="0.24.0", engine_proc="EngineCore")
# docs/vllm-facts.md#version-differences: the KV-OOM message reads "model's" from 0.27.1 on.
PROFILES[(0, 27, 1)] = replace(PROFILES[(0, 24, 0)], version="0.27.1", kv_typo_models=False)
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
