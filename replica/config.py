"""Engine configuration: one typed object, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from prefixmesh.eviction import DEFAULT_EVICTION, EVICTION_POLICIES

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("auto", "recompute", "swap")


@dataclass(slots=True)
class EngineConfig:
    """Everything that shapes one replica engine.

    ``dtype="auto"`` is bfloat16 on CUDA and on CPUs with native bfloat16 (AMX / AVX-512 BF16,
    measured several times faster), float32 on other CPUs (AVX2 emulates bfloat16 4-5x slower);
    float32 is kept for parity tests against Hugging Face. The KV pool holds
    ``num_kv_blocks`` blocks of ``block_size`` tokens per layer; when unset it is sized from
    ``kv_cache_memory_gb``.
    """

    model: str = "smollm2"
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    # A waiting request whose next uncached prompt blocks are being prefilled right now by a
    # running request waits for them to land in the prefix cache instead of computing them
    # again (SGLang deprioritizes such requests the same way). See Scheduler.schedule.
    wait_for_inflight_prefix: bool = True
    # A waiting request keeps its cached prefix, and the blocks past it that a request queued
    # before it will compute (BlockManager.keep): evicted only after every block no waiting
    # request needs, while the kept blocks are at most this share of the pool (0: off). Under
    # a long queue the prefix the router sent the request for then outlasts the queue
    # (docs/benchmarks.md, "Waiting requests keep their prefix").
    waiting_prefix_share: float = 1.0
    # Which cached, unreferenced block an allocation evicts (prefixmesh/eviction.py): "lru",
    # or "reuse" (never-reused blocks first, ARC-like; docs/notes/2026-12-08-eviction.md).
    eviction: str = DEFAULT_EVICTION
    # Fair shares of each step across tenants (replica/tenant_share.py); with one tenant the
    # schedule is exactly FCFS / priority's. ``tenant_prefill_chunk``: prefill tokens per step
    # the tenants over their share get between them while another is present (0: a quarter
    # of ``max_num_batched_tokens``); present = had work in the last ``tenant_window_s``.
    tenant_fairness: bool = True
    tenant_prefill_chunk: int = 0
    tenant_window_s: float = 10.0
    # How a preempted sequence gives its blocks back: "recompute" drops them (full ones stay in
    # the prefix cache), "swap" copies them to a host pool of ``swap_space_gb`` and back.
    # "auto" swaps where the device has memory of its own (CUDA) and recomputes on CPU.
    preemption_mode: str = "auto"
    swap_space_gb: float = 1.0
    num_host_blocks: int | None = None
    attention_backend: str = "auto"
    num_threads: int | None = None
    seed: int = 0
    # Matmuls cut into fixed row tiles so a token's result does not depend on the batch or
    # chunk it ran in (kernels/cpu_linear.py): a prefix-cache hit, local or fetched from a peer,
    # then gives the cold run's output bit for bit in bfloat16 too. Costs prefill speed on AMX
    # (docs/benchmarks.md, "Batch-invariant mode"), so it is off by default.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES} (got {self.dtype!r})")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (got {self.block_size})")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (got {self.num_kv_blocks})")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 (got {self.max_num_seqs})")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens must be >= block_size (got {self.max_num_batched_tokens})"
            )
        if self.tenant_prefill_chunk < 0 or self.tenant_window_s < 0:
            raise ValueError(
                "tenant_prefill_chunk and tenant_window_s must be >= 0 "
                f"(got {self.tenant_prefill_chunk}, {self.tenant_window_s})"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES} (got {self.preemption_mode!r})"
            )
        if not 0.0 <= self.waiting_prefix_share <= 1.0:
            raise ValueError(
                f"waiting_prefix_share must be in [0, 1] (got {self.waiting_prefix_share})"
            )
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES} (got {self.eviction!r})")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES} "
                f"(got {self.scheduling_policy!r})"
            )
