"""Triton paged-attention kernels against a naive float64 reference and the torch backend.

Without CUDA the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``), so shapes
stay tiny; on a GPU (``kernels/gpu_check.sh``) the same tests run compiled, plus larger cases.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.interface import AttentionMetadata, new_kv_cache
from kernels.torch_ref import TorchAttentionBackend
from kernels.triton_backend import TritonAttentionBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"


@pytest.fixture(autouse=True, scope="module")
def _interpreter_without_gpu():
    """CPU tensors always take Triton's interpreter; the env var says so for any other kernel."""
    with pytest.MonkeyPatch.context() as mp:
        if not ON_GPU:
            mp.setenv("TRITON_INTERPRET", "1")
        yield


TOLERANCE = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


class Case:
    """A packed batch over a paged cache, with the full keys/values kept for the reference.

    ``seqs`` lists ``(cached_len, new_len)`` per sequence: ``(0, n)`` is a plain prefill,
    ``(c, 1)`` a decode, ``(c, n)`` a prefill chunk after a cached prefix.
    """

    def __init__(
        self,
        seqs: list[tuple[int, int]],
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int = 0,
        key_layout: str = "rows",
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.key_layout = key_layout  # of the caches run() hands the backend
        self.seqs = seqs
        self.block_size = block_size
        self.dtype = dtype
        self.scale = head_dim**-0.5
        blocks_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
        num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
        # Physical blocks handed out in a shuffled order so block tables are not contiguous.
        perm = torch.randperm(num_blocks, generator=gen)
        tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
        used = 0
        for b, count in enumerate(blocks_per_seq):
            tables[b, :count] = perm[used : used + count]
            used += count

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        # The cache starts as garbage (NaN-free noise); prefixes are written in, as if cached.
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = rand(*cache_shape)
        self.v_cache = rand(*cache_shape)
        self.keys, self.values = [], []  # full per-sequence [ctx, KVH, D]
        queries, new_k, new_v, slots = [], [], [], []
        for b, (cached, new) in enumerate(seqs):
            ctx = cached + new
            k, v = rand(ctx, num_kv_heads, head_dim), rand(ctx, num_kv_heads, head_dim)
            self.keys.append(k)
            self.values.append(v)
            pos = torch.arange(ctx)
            seq_slots = tables[b, pos // block_size].long() * block_size + pos % block_size
            flat_k = self.k_cache.view(-1, num_kv_heads, head_dim)
            flat_v = self.v_cache.view(-1, num_kv_heads, head_dim)
            flat_k[seq_slots[:cached]] = k[:cached]
            flat_v[seq_slots[:cached]] = v[:cached]
            queries.append(rand(new, num_heads, head_dim))
            new_k.append(k[cached:])
            new_v.append(v[cached:])
            slots.append(seq_slots[cached:])
        self.query = torch.cat(queries).to(DEVICE)
        self.new_k = torch.cat(new_k).to(DEVICE)
        self.new_v = torch.cat(new_v).to(DEVICE)
        self.k_cache = self.k_cache.to(DEVICE)
        self.v_cache = self.v_cache.to(DEVICE)
        q_lens = [n for _, n in seqs]
        seq_lens = [c + n for c, n in seqs]
        self.meta = AttentionMetadata(
            query_start_loc=torch.tensor(
                [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=tables.to(DEVICE),
            slot_mapping=torch.cat(slots).to(DEVICE),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
        )

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh copies of the prefix-only caches (each backend writes its own new tokens), the
        keys in this case's layout (``kernels.interface.new_kv_cache``)."""
        num_blocks, block_size, heads, head_dim = self.k_cache.shape
        k_cache, v_cache = new_kv_cache(
            num_blocks, block_size, heads, head_dim, dtype=self.dtype,
            device=self.k_cache.device, key_layout=self.key_layout,
        )  # fmt: skip
        return k_cache.copy_(self.k_cache), v_cache.copy_(self.v_cache)

    def run(self, backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self.caches()
        backend.prepare(self.meta, self.block_size)
        backend.write_kv(self.new_k, self.new_v, k_cache, v_cache, self.meta.slot_mapping)
        out = backend.attend(self.query, k_cache, v_cache, self.meta, self.scale)
        return out, k_cache, v_cache

    def naive(self) -> torch.Tensor:
        """softmax(Q K^T) V per sequence in float64 with an explicit mask."""
        outs, start = [], 0
        for (cached, new), k, v in zip(self.seqs, self.keys, self.values):
            q = self.query[start : start + new].cpu().double()  # [new, H, D]
            start += new
            group = q.shape[1] // k.shape[1]
            k64 = k.double().repeat_interleave(group, dim=1)  # [ctx, H, D]
            v64 = v.double().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k64) * self.scale
            q_pos = torch.arange(cached, cached + new)[:, None]
            k_pos = torch.arange(cached + new)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v64))
        return torch.cat(outs)


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), ref.cpu().double(), atol=tol, rtol=tol)


# (seqs, block_size, num_heads, num_kv_heads, head_dim, dtype). Cached prefixes end mid-block
# (e.g. 21 with block 16), batches mix decodes, plain prefills and chunks after a prefix.
MIXED = [(21, 1), (0, 7), (35, 12), (4, 1), (16, 16)]
CASES = [
    pytest.param(MIXED, 16, 4, 4, 64, torch.float32, id="mha-b16-d64-f32"),
    pytest.param(MIXED, 16, 6, 2, 64, torch.float32, id="gqa3-b16-d64-f32"),
    pytest.param(MIXED, 32, 4, 1, 128, torch.float32, id="mqa4-b32-d128-f32"),
    pytest.param([(9, 1), (50, 1), (17, 1)], 16, 6, 2, 64, torch.float16, id="decode-f16"),
    pytest.param([(0, 33), (0, 5)], 16, 4, 2, 128, torch.bfloat16, id="prefill-bf16"),
    pytest.param([(40, 9), (3, 1), (0, 20)], 48, 6, 2, 64, torch.float16, id="b48-f16"),
    pytest.param([(70, 20), (63, 1)], 64, 4, 2, 64, torch.bfloat16, id="b64-bf16"),
    # Head dims off the main path: the tiny test model's 16, and 96 (padded to 128 in-kernel).
    pytest.param([(5, 1), (0, 11), (17, 6)], 16, 4, 2, 16, torch.float32, id="d16-f32"),
    pytest.param([(30, 1), (12, 9)], 16, 4, 1, 96, torch.float16, id="d96-f16"),
]
if ON_GPU:  # compiled kernels are fast: add realistic sizes
    CASES += [
        pytest.param(
            [(1000, 1)] * 8 + [(517, 300), (0, 700)],
            16,
            9,
            3,
            64,
            torch.float16,
            id="gpu-smollm2-mixed-f16",
        ),
        pytest.param(
            [(4000, 1)] * 4 + [(2000, 129)],
            32,
            32,
            8,
            128,
            torch.bfloat16,
            id="gpu-llama-mixed-bf16",
        ),
    ]


@pytest.mark.parametrize("seqs, block_size, num_heads, num_kv_heads, head_dim, dtype", CASES)
def test_attention_matches_references(seqs, block_size, num_heads, num_kv_heads, head_dim, dtype):
    case = Case(seqs, block_size, num_heads, num_kv_heads, head_dim, dtype)
    ref = case.naive()
    torch_out, torch_k, torch_v = case.run(TorchAttentionBackend())
    triton_out, triton_k, triton_v = case.run(TritonAttentionBackend())
    check_close(torch_out, ref, dtype)
    check_close(triton_out, ref, dtype)
    # Both backends stored the new keys/values into exactly the same slots.
    assert torch.equal(triton_k, torch_k) and torch.equal(triton_v, torch_v)


def random_case(seed: int) -> Case:
    """A random ragged batch: block size, GQA ratio, head dim, dtype and mix of sequences."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["decode", "prefill", "chunk"])
        if kind == "decode":
            seqs.append((rng.randint(1, 90), 1))
        elif kind == "prefill":
            seqs.append((0, rng.randint(2, 60)))
        else:
            seqs.append((rng.randint(1, 70), rng.randint(2, 45)))
    num_kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 3, 4])
    return Case(
        seqs,
        block_size=rng.choice([16, 32, 48, 80]),
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=rng.choice([64, 128]),
        dtype=rng.choice([torch.float32, torch.float16, torch.bfloat16]),
        seed=seed,
    )


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed):
    case = random_case(seed)
    out, _, _ = case.run(TritonAttentionBackend())
    check_close(out, case.naive(), case.dtype)
    torch_out, _, _ = case.run(TorchAttentionBackend())
    check_close(torch_out, case.naive(), case.dtype)
    # The pure-torch decode path (SDPA over gathered blocks) as well as the C++ CPU kernel.
    sdpa_out, _, _ = case.run(TorchAttentionBackend(use_cpu_kernel=False))
    check_close(sdpa_out, case.naive(), case.dtype)


@pytest.mark.parametrize("tile_n, num_splits", [(16, 1), (16, 3), (64, 2)])
def test_tiles_and_flash_decoding_splits(tile_n, num_splits):
    # Tiles smaller and larger than a block, and splits that leave some programs empty.
    case = Case([(45, 1), (30, 6), (0, 3)], 32, 6, 2, 64, torch.float32, seed=1)
    out, _, _ = case.run(TritonAttentionBackend(tile_n=tile_n, num_splits=num_splits))
    check_close(out, case.naive(), torch.float32)


def test_strided_query_and_kv_views():
    # The model passes q/k/v as column slices of one fused projection: non-contiguous views.
    case = Case([(19, 1), (5, 4)], 16, 4, 2, 64, torch.float32, seed=2)
    tokens = case.query.shape[0]
    fused = torch.zeros(tokens, 4 * 64 + 2 * 2 * 64, device=DEVICE)
    fused[:, : 4 * 64] = case.query.reshape(tokens, -1)
    fused[:, 4 * 64 : 6 * 64] = case.new_k.reshape(tokens, -1)
    fused[:, 6 * 64 :] = case.new_v.reshape(tokens, -1)
    q, k, v = fused.split([4 * 64, 2 * 64, 2 * 64], dim=1)
    q, k, v = q.view(tokens, 4, 64), k.view(tokens, 2, 64), v.view(tokens, 2, 64)
    assert not q.is_contiguous()
    backend = TritonAttentionBackend()
    k_cache, v_cache = case.caches()
    backend.prepare(case.meta, case.block_size)
    backend.write_kv(k, v, k_cache, v_cache, case.meta.slot_mapping)
    out = backend.attend(q, k_cache, v_cache, case.meta, case.scale)
    check_close(out, case.naive(), torch.float32)


@pytest.mark.parametrize("seqs", [[(9, 1), (50, 1), (17, 1)], MIXED], ids=["decode", "mixed"])
def test_attend_writes_into_a_given_buffer(seqs):
    """``out=`` (the buffer the model reuses for every layer): the same output, in the caller's
    tensor, on every path (the C++ decode kernel, its step with prefills, SDPA, Triton)."""
    case = Case(seqs, 16, 6, 2, 64, torch.float32, seed=6)
    backends = [
        TorchAttentionBackend(),
        TorchAttentionBackend(use_cpu_kernel=False, device=DEVICE.type),
        TritonAttentionBackend(),
    ]
    for backend in backends:
        want, _, _ = case.run(backend)
        k_cache, v_cache = case.caches()
        backend.prepare(case.meta, case.block_size)
        backend.write_kv(case.new_k, case.new_v, k_cache, v_cache, case.meta.slot_mapping)
        buffer = torch.full_like(case.query, float("nan"))
        got = backend.attend(case.query, k_cache, v_cache, case.meta, case.scale, out=buffer)
        assert got.data_ptr() == buffer.data_ptr(), type(backend).__name__
        assert torch.equal(buffer, want), type(backend).__name__


def test_torch_path_plain_prefill_reads_the_cache_without_its_new_keys():
    # kernels.bench times attend() alone, after the new keys are already in the cache: a plain
    # prefill on the SDPA path (no C++ kernel: every GPU, PREFIXMESH_CPU_KERNELS=0) then has no
    # kv_written pair and reads the cache, causally.
    case = Case([(0, 20), (5, 1), (0, 7)], 16, 4, 2, 32, torch.float32)
    k_cache, v_cache = case.caches()
    backend = TorchAttentionBackend(use_cpu_kernel=False, device=DEVICE.type)
    slots = case.meta.slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = case.new_k
    v_cache.view(-1, *v_cache.shape[2:])[slots] = case.new_v
    backend.prepare(case.meta, case.block_size)
    out = backend.attend(case.query, k_cache, v_cache, case.meta, case.scale)
    torch.testing.assert_close(out.cpu().double(), case.naive(), atol=2e-4, rtol=2e-4)


def test_store_kv_writes_only_its_slots_and_skips_padding():
    case = Case([(3, 5), (0, 2)], 16, 2, 2, 64, torch.float16, seed=3)
    k_cache, v_cache = case.caches()
    expected_k, expected_v = case.caches()
    slots = case.meta.slot_mapping.clone()
    slots[2] = -1  # a padding token: must not be written anywhere
    TritonAttentionBackend().write_kv(case.new_k, case.new_v, k_cache, v_cache, slots)
    keep = slots >= 0
    expected_k.view(-1, 2, 64)[slots[keep]] = case.new_k[keep]
    expected_v.view(-1, 2, 64)[slots[keep]] = case.new_v[keep]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_multiple_layers_reuse_one_step_plan():
    # prepare() once, then several layers (fresh caches each) attend with the same metadata.
    case = Case([(10, 1), (0, 9)], 16, 6, 2, 64, torch.float32, seed=4)
    backend = TritonAttentionBackend()
    backend.prepare(case.meta, case.block_size)
    ref = case.naive()
    for _ in range(2):
        k_cache, v_cache = case.caches()
        backend.write_kv(case.new_k, case.new_v, k_cache, v_cache, case.meta.slot_mapping)
        out = backend.attend(case.query, k_cache, v_cache, case.meta, case.scale)
        check_close(out, ref, torch.float32)


def test_rejects_bad_head_counts():
    case = Case([(0, 2)], 16, 4, 4, 64, torch.float32)
    k_cache = torch.zeros(4, 16, 3, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TritonAttentionBackend().attend(case.query, k_cache, k_cache, case.meta, 1.0)


def _compile_for_cuda(kernel, arch: int, types: dict[str, str], constexprs: dict) -> None:
    """Compile ``kernel`` to a cubin for ``sm_<arch>`` with the ptxas bundled in triton."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in kernel.arg_names
    }
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32)
    )
    assert compiled.asm["cubin"]


def test_kernels_compile_for_cuda_without_a_gpu():
    # The interpreter does not check GPU-only rules (tl.dot shapes, types, loop-carried values),
    # so compile the real kernels for Hopper and Ampere here, where no GPU is needed.
    from kernels.triton_kernels import get_kernels

    kernels = get_kernels(interpret=False)
    pointers = {
        "key_ptr": "*fp16", "value_ptr": "*fp16", "k_cache_ptr": "*fp16", "v_cache_ptr": "*fp16",
        "slot_mapping_ptr": "*i64",
    }  # fmt: skip
    _compile_for_cuda(
        kernels.store_kv, 90, pointers, dict(NUM_KV_HEADS=3, HEAD_DIM=64, BLOCK_H=4, BLOCK_D=64)
    )
    _compile_for_cuda(
        kernels.merge_splits,
        90,
        {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"},
        dict(NUM_HEADS=9, HEAD_DIM=64, BLOCK_D=64, NUM_SPLITS=4, BLOCK_S=4),
    )
    # (dtype, arch, splits, rows, group, head_dim, tile): decode with splits, prefill tiles.
    variants = [("fp16", 90, 4, 16, 3, 64, 64), ("bf16", 90, 1, 64, 4, 128, 32)]
    variants += [("fp32", 80, 1, 16, 2, 16, 16)]
    for dtype, arch, splits, rows, group, head_dim, tile in variants:
        part = "*fp32" if splits > 1 else f"*{dtype}"
        types = {name: f"*{dtype}" for name in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
        types |= {"part_acc_ptr": part, "part_ml_ptr": part, "scale_log2": "fp32"}
        types |= {
            name: "*i32"
            for name in ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr",
                         "q_block_seq_ptr", "q_block_idx_ptr")
        }  # fmt: skip
        constexprs = dict(
            NUM_HEADS=group * 2, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, head_dim),
            BLOCK_Q=rows // group, BLOCK_M=rows, TILE_N=tile, NUM_SPLITS=splits,
            DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST_DOT=False,
        )  # fmt: skip
        _compile_for_cuda(kernels.paged_attention, arch, types, constexprs)


def test_compiled_kernels_keep_their_constexpr_parameters():
    # A launch binds tl.constexpr parameters at compile time and passes the rest as runtime
    # arguments; the split is read from the annotations. The kernels rebound for the GPU lost
    # theirs once, and every launch on a real GPU failed on the string DOT_PRECISION (the
    # interpreter and the explicit-signature compile above did not notice).
    from kernels import triton_kernels
    from kernels.triton_kernels import get_kernels

    sources = {
        "store_kv": triton_kernels._store_kv_fn,
        "paged_attention": triton_kernels._paged_attention_fn,
        "merge_splits": triton_kernels._merge_splits_fn,
    }
    kernels = get_kernels(interpret=False)
    for name, source in sources.items():
        declared = [p for p, kind in source.__annotations__.items() if "constexpr" in str(kind)]
        bound = [p.name for p in getattr(kernels, name).params if p.is_constexpr]
        assert declared and bound == declared, name
