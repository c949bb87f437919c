"""Sampler semantics: greedy, truncation rules, seeds, suppression, logprobs, distribution."""

from __future__ import annotations

import math

import pytest
import torch

from replica.sampler import Sampler, SamplingRow, make_generator
from replica.sampling_params import SamplingParams

V = 1000


def _logits(b: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, V, generator=g) * 3).to(dtype)


def _rows(params: list[SamplingParams], seeds: bool = False) -> list[SamplingRow]:
    return [
        SamplingRow(p, make_generator(p.seed, 0) if seeds and p.seed is not None else None)
        for p in params
    ]


def _tokens(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return [r.token_id for r in sampler.sample(logits, rows)]


# Greedy rows take the C++ argmax where the kernels build, torch's otherwise: both, same answer.
KERNEL = pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])


@KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype, kernel: bool) -> None:
    logits = _logits(8, dtype=dtype)
    sampler = Sampler(0, use_cpu_kernel=kernel)
    out = _tokens(sampler, logits, _rows([SamplingParams(temperature=0.0)] * 8))
    assert out == logits.float().argmax(-1).tolist()


@KERNEL
def test_greedy_ties_take_lowest_id(kernel: bool) -> None:
    logits = torch.zeros(1, V)
    logits[0, [7, 3, 500]] = 5.0
    sampler = Sampler(0, use_cpu_kernel=kernel)
    assert _tokens(sampler, logits, _rows([SamplingParams(temperature=0.0)])) == [3]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.5, min_p=1.0),
        SamplingParams(temperature=1.5, top_k=1, top_p=0.5),
    ],
    ids=["top_k=1", "top_p tiny", "min_p=1", "top_k+top_p"],
)
def test_degenerate_truncation_equals_greedy(params: SamplingParams) -> None:
    logits = _logits(16, seed=1)
    # Mixed with unrestricted rows so the batched masks must act per row.
    mates = [SamplingParams(temperature=1.0)] * 4
    out = _tokens(Sampler(0), torch.cat([logits, _logits(4, 9)]), _rows([params] * 16 + mates))
    assert out[:16] == logits.argmax(-1).tolist()


def test_top_k_restricts_to_k_best() -> None:
    logits = _logits(4, seed=2)
    params = [SamplingParams(temperature=5.0, top_k=k) for k in (3, 10, -1, 0)]
    allowed = [set(logits[i].topk(k).indices.tolist()) for i, k in enumerate((3, 10))]
    sampler = Sampler(0)
    for _ in range(30):
        out = _tokens(sampler, logits, _rows(params))
        assert out[0] in allowed[0] and out[1] in allowed[1]


def test_top_p_and_min_p_keep_the_expected_set() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps {0, 1}; min_p=0.25 keeps p >= 0.125: {0, 1, 2}.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().repeat(2, 1)
    params = [SamplingParams(top_p=0.7), SamplingParams(min_p=0.25)]
    sampler = Sampler(0)
    seen: list[set[int]] = [set(), set()]
    for _ in range(300):
        for i, t in enumerate(_tokens(sampler, logits, _rows(params))):
            seen[i].add(t)
    assert seen == [{0, 1}, {0, 1, 2}]


def test_seeded_rows_reproducible_alone_and_in_any_batch() -> None:
    target = _logits(1, seed=3)
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)

    def run(batch: list[tuple[torch.Tensor, SamplingParams]], pos: int) -> list[int]:
        g = make_generator(1234, 0)
        out = []
        for step in range(5):
            rows = [SamplingRow(q, None) for _, q in batch]
            rows.insert(pos, SamplingRow(p, g))
            logits = torch.cat([x for x, _ in batch[:pos]] + [target] + [x for x, _ in batch[pos:]])
            out.append(Sampler(step).sample(logits, rows)[pos].token_id)
        return out

    alone = run([], 0)
    mates = [
        (_logits(1, 10), SamplingParams(temperature=0.0)),
        (_logits(1, 11), SamplingParams(temperature=1.3, min_p=0.1)),
        (_logits(1, 12), SamplingParams(temperature=0.7, top_k=5, seed=7)),
    ]
    assert run(mates, 0) == alone
    assert run(mates, 2) == alone
    assert run(mates[1:], 1) == alone

    # Another seed or another sample index gives another stream (flat logits: many choices).
    flat = torch.zeros(1, V)

    def stream(seed: int, index: int) -> tuple[int, ...]:
        row = SamplingRow(SamplingParams(seed=seed), make_generator(seed, index))
        return tuple(Sampler(0).sample(flat, [row])[0].token_id for _ in range(3))

    assert len({stream(s, i) for s, i in [(1, 0), (2, 0), (1, 1), (1, 2)]}) == 4


def test_same_seed_same_index_gives_identical_sequence() -> None:
    flat = torch.zeros(1, V)
    seqs = []
    for _ in range(2):
        g = make_generator(42, 3)
        row = SamplingRow(SamplingParams(seed=42), g)
        seqs.append([Sampler().sample(flat, [row])[0].token_id for _ in range(10)])
    assert seqs[0] == seqs[1]


def test_distribution_matches_probabilities() -> None:
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 4000
    logits = probs.log().unsqueeze(0).repeat(n, 1)
    out = torch.tensor(_tokens(Sampler(123), logits, _rows([SamplingParams()] * n)))
    counts = torch.bincount(out, minlength=5).float()
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 4 degrees of freedom: P(chi2 > 18.5) ~ 0.001; the seed makes the test deterministic.
    assert chi2 < 18.5, (counts.tolist(), chi2)


def test_temperature_sharpens() -> None:
    probs = torch.tensor([0.6, 0.4])
    n = 2000
    logits = probs.log().unsqueeze(0).repeat(n, 1)
    out = _tokens(Sampler(5), logits, _rows([SamplingParams(temperature=0.25)] * n))
    # T=0.25 -> p0 = 0.6^4 / (0.6^4 + 0.4^4) ~ 0.835
    assert abs(out.count(0) / n - 0.835) < 0.04


def test_suppressed_ids_never_chosen() -> None:
    logits = _logits(6, seed=4)
    best = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=0.5)] * 3
    sampler = Sampler(0)
    for _ in range(20):
        rows = [SamplingRow(p, None, [best[i]]) for i, p in enumerate(params)]
        out = _tokens(sampler, logits, rows)
        assert all(t != b for t, b in zip(out, best, strict=True))
    assert logits.argmax(-1).tolist() == best  # the caller's tensor is untouched


def test_logprobs_match_log_softmax() -> None:
    logits = _logits(3, seed=5)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, top_k=20, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    res = Sampler(0).sample(logits, _rows(params))
    ref = logits.log_softmax(-1)
    lp0 = res[0].logprobs
    assert lp0 is not None and lp0.token_id == res[0].token_id
    assert math.isclose(lp0.logprob, float(ref[0, res[0].token_id]), abs_tol=1e-5)
    top = ref[0].topk(5)
    assert [t for t, _ in lp0.top] == top.indices.tolist()
    values = [v for _, v in lp0.top]
    assert all(
        math.isclose(v, w, abs_tol=1e-5) for v, w in zip(values, top.values.tolist(), strict=True)
    )
    assert [v for _, v in lp0.top] == sorted((v for _, v in lp0.top), reverse=True)
    lp1 = res[1].logprobs
    # Raw logprobs: before temperature and top-k.
    assert lp1 is not None and lp1.top == []
    assert math.isclose(lp1.logprob, float(ref[1, res[1].token_id]), abs_tol=1e-5)
    assert res[2].logprobs is None


def test_logprobs_see_suppression() -> None:
    logits = _logits(1, seed=6)
    best = int(logits.argmax())
    row = SamplingRow(SamplingParams(temperature=0.0, logprobs=3), None, [best])
    lp = Sampler(0).sample(logits, [row])[0].logprobs
    assert lp is not None and best not in [t for t, _ in lp.top]


def _reference_keep(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Kept token ids by a plain full sort: rank < k, then mass strictly above < p."""
    vals, ids = row.sort(descending=True)
    keep = vals.numel() if top_k <= 0 else top_k
    probs = torch.softmax(vals[:keep], -1)
    above = probs.cumsum(-1) - probs
    n = int((above < top_p).sum()) if top_p < 1.0 else keep
    return set(ids[:n].tolist())


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0], ids=["wide", "medium", "peaky"])
def test_top_k_top_p_mask_matches_full_sort(scale: float) -> None:
    from replica.sampler import _truncated_weights

    # Wide rows take the full-sort fallback, peaky rows the top-256 candidate path.
    logits = torch.randn(6, 4000, generator=torch.Generator().manual_seed(7)) * scale
    top_ks = [0, 0, 50, 0, 300, 1]
    top_ps = [0.9, 0.5, 0.8, 1.0, 0.95, 0.3]
    params = [SamplingParams(top_k=k, top_p=p) for k, p in zip(top_ks, top_ps, strict=True)]
    weights = _truncated_weights(logits.clone(), params)
    for i in range(6):
        kept = set(torch.nonzero(weights[i] > 0).flatten().tolist())
        assert kept == _reference_keep(logits[i], top_ks[i], top_ps[i]), i
