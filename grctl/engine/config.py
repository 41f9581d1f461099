"""EngineConfig: the engine's knobs (model, scheduling, prefix cache), built once, passed whole.

`grctl serve` composes it into ServeConfig (grctl/config.py) and derives a flag and a GR_<FLAG>
variable from each field (grctl/knobs.py); offline users and tests build it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from grctl.knobs import check_knobs, knob
from grctl.model.dtype_names import SERVED_DTYPE_NAMES

DTYPE_CHOICES = ("auto", *SERVED_DTYPE_NAMES)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = knob(
        None, "HF Qwen3 checkpoint dir; none: the built-in model.", "Model"
    )
    # auto: where the model already is (grctl serve loads it on cuda when available, else cpu)
    device: str = knob("auto", "auto (cuda when available), cpu, cuda or cuda:N.", "Model")
    dtype: str = knob(
        "auto",
        "auto (the checkpoint's), bfloat16, float16, float32 (or bf16, fp16, fp32).",
        "Model",
        choices=DTYPE_CHOICES,
    )
    cuda_graph: bool = knob(
        True,
        "Capture decode steps in CUDA graphs (CUDA only).",
        "Model",
        old_env=("GR_USE_CUDA_GRAPH",),
    )
    return_original_logprob: bool = knob(
        False,
        "Report the model's log_softmax(logits) as logprobs (no temperature, mask or filter) "
        "unless a request says otherwise; else the sampling distribution's.",
        "Logprobs",
        old_env=("SGLANG_RETURN_ORIGINAL_LOGPROB",),  # what SGLang's users already set
    )
    sampling_mask_max_tokens: int = knob(
        4096,
        "Most tokens of one step's sampling support a return_sampling_mask reply lists; a "
        "request whose support is wider is answered 400.",
        "Logprobs",
        min=1,
    )
    deterministic_inference: bool = knob(
        False,
        "Batch-invariant kernels: a request's tokens and logprobs are bit-identical alone or "
        "in any batch, after a prefix-cache hit or miss.",
        "Logprobs",
        aliases=("--enable-deterministic-inference",),  # SGLang's name
    )
    max_running_requests: int = knob(64, "Requests decoded together.", "Scheduling", min=1)
    max_waiting_requests: int = knob(
        1024,
        "Queued requests before 429.",
        "Scheduling",
        min=1,
        aliases=("--max-queued-requests",),  # SGLang's name, the same meaning
    )
    max_context_len: int = knob(
        0,
        "Longest prompt + output, in tokens; 0: the checkpoint's max_position_embeddings, "
        "which it may not exceed.",
        "Scheduling",
        min=0,
        aliases=("--context-length",),  # SGLang's name
    )
    max_beam_width: int = knob(1024, "Largest n (beam width).", "Scheduling", min=1)
    max_new_tokens: int = knob(64, "Largest max_new_tokens a request may ask.", "Scheduling", min=1)
    prefill_token_budget: int = knob(
        8192,
        "Prompt tokens prefilled per step.",
        "Scheduling",
        min=1,
        aliases=("--max-prefill-tokens",),  # SGLang's: a longer prompt is prefilled alone
    )
    max_kv_bytes: int = knob(
        0,
        "Bytes running requests may hold (context KV, beam tails, a step's [beams, vocab] "
        "scores); 0: auto (kv-memory-fraction of "
        "free GPU memory at start on CUDA; no limit on CPU).",
        "Scheduling",
        min=0,
    )
    kv_memory_fraction: float = knob(
        0.4,
        "Share of free GPU memory at start for KV when --max-kv-bytes is 0 (the rest holds "
        "activations, graphs and the allocator's slack).",
        "Scheduling",
        min=0.01,
    )
    max_finished_results: int = knob(
        10_000, "Finished results kept until fetched.", "Scheduling", min=1
    )
    max_finished_result_bytes: int = knob(
        1 << 30,
        "Bytes of finished results kept until fetched (their Python objects, as measured): "
        "past it the oldest unfetched are dropped (a fetch of one is a 404 saying so); 0: no "
        "byte bound.",
        "Scheduling",
        min=0,
    )
    # On by default, as SGLang's radix cache: an entry is only ever used under the weights it
    # was computed with, and every weight write drops them all.
    enable_prefill_cache: bool = knob(
        True,
        "Reuse the KV of cached prompt prefixes across requests (on; off: --disable-radix-cache).",
        "Prefix cache",
        off_flags=("--disable-radix-cache", "--no-enable-prefill-cache"),  # SGLang's, ours
    )
    prefill_cache_max_entries: int = knob(
        4096, "Cache size, in prompts whose end is cached.", "Prefix cache", min=1
    )
    prefill_cache_max_tokens: int = knob(262144, "Cache size, in tokens.", "Prefix cache", min=1)
    prefill_cache_max_bytes: int = knob(
        1 << 31, "Cache size, in bytes of KV and log-probabilities.", "Prefix cache", min=1
    )
    weight_version: str = knob(
        "default", "Version reported until the first update.", "Weight updates"
    )
    pause_timeout_s: float = knob(
        60.0, "Longest wait for the running step when pausing.", "Weight updates", min=0.0
    )
    allow_partial_updates: bool = knob(
        False,
        "Serve tensors of mixed version labels (else 503).",
        "Weight updates",
        aliases=("--allow-partial-weight-update",),
        old_env=("GR_ALLOW_PARTIAL_WEIGHT_UPDATE",),
    )
    enable_weights_cpu_backup: bool = knob(
        False,
        "Keep a host copy of the weights a memory release frees (SGLang's flag); off: they "
        "are dropped, and served again once the trainer pushes them.",
        "Weight updates",
    )
    preserve_parameter_names: str | None = knob(
        None,
        "Comma-separated substrings of parameter names kept in a host copy on release even "
        "without a backup (vLLM's sleep keep-list), e.g. embed_tokens,norm.",
        "Weight updates",
        aliases=("--sleep-preserve-parameter-names",),
    )

    def __post_init__(self) -> None:
        check_knobs(self)
