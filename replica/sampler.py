"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

One engine step calls :meth:`Sampler.sample` once for the whole batch. On a small CPU the Python
work per row dominates, so every transformation is one tensor op over the rows that need it and
only the final random draw of rows with their own seed loops in Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from replica.outputs import TokenLogprobs
from replica.sampling_params import SamplingParams

# Temperatures below this are treated as greedy (dividing by them would overflow), as in vLLM.
_SAMPLING_EPS = 1e-5
_MASK64 = (1 << 64) - 1
# Top-k/top-p cutoffs are sought among the tokens with p_i / p_max >= this (found with one compare
# and a nonzero, sorted on their own): torch's CPU topk costs ~0.15 ms a row even for k=1 and a
# full sort ~9 ms a row. Rows where those tokens do not decide the cutoff fall back to either.
_CANDIDATE_WEIGHT = 1e-4
_MAX_CANDIDATES = 1024


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits batch: its parameters, its own generator (seeded requests) or None
    for the sampler's shared one, and token ids forbidden this step (e.g. EOS before
    ``min_tokens``)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    suppress_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SampleResult:
    """The chosen token and, when requested, its log-probabilities."""

    token_id: int
    logprobs: TokenLogprobs | None


def make_generator(seed: int, sample_index: int) -> torch.Generator:
    """A CPU generator for sample ``sample_index`` of a request seeded with ``seed``.

    The state depends only on (seed, index), so a seeded sample is reproducible whatever shares
    its batch, and the n samples of one request draw different streams.
    """
    # splitmix64 finaliser: nearby (seed, index) pairs give unrelated states.
    z = ((seed & _MASK64) + (sample_index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    gen = torch.Generator(device="cpu")
    gen.manual_seed(z)
    return gen


class Sampler:
    """Samples one token per row of a ``[B, V]`` logits tensor, vLLM semantics.

    Order: suppressed ids -> -inf; logprobs from the log-softmax of those logits (before
    temperature and truncation, as vLLM's default); temperature 0 rows take the argmax; other
    rows are divided by their temperature, then top-k, top-p (nucleus, at least one token kept)
    and min-p (relative to the most likely token) mask logits, and a token is drawn by inverse
    CDF with one uniform per row (from the row's own generator when it has one).
    """

    def __init__(self, seed: int | None = None, use_cpu_kernel: bool = True) -> None:
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # Reused [B, V] float32 scratch tensors: a fresh 50 MB tensor (256 x 49152) is mmapped
        # and page-faulted on every step, which costs more than the arithmetic done in it.
        self._scratch: dict[str, torch.Tensor] = {}
        # The C++ argmax (kernels/cpu_ops.py: argmax_rows), 5-10x faster than torch's on a
        # decode step's logits; None where the kernels cannot be built (torch's argmax then).
        self._ops = None
        if use_cpu_kernel:
            from kernels import cpu_ops

            self._ops = cpu_ops.load()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if logits.device.type != "cpu":
            # Generators are CPU generators; a [B, V] copy is cheap next to the forward pass.
            logits = logits.cpu()
        x = self._suppress(logits, rows)

        random_idx = [i for i, r in enumerate(rows) if r.params.temperature >= _SAMPLING_EPS]
        if len(random_idx) < len(rows):
            tokens = self._argmax(x)
        else:
            tokens = [0] * len(rows)
        if random_idx:
            drawn = self._sample_random(x, [rows[i] for i in random_idx], random_idx)
            for i, tok in zip(random_idx, drawn, strict=True):
                tokens[i] = tok

        lp_idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not lp_idx:
            return [SampleResult(t, None) for t in tokens]
        logprobs = self._logprobs(x, rows, lp_idx, tokens)
        return [SampleResult(t, logprobs.get(i)) for i, t in enumerate(tokens)]

    # -- steps ------------------------------------------------------------------------------

    def _argmax(self, x: torch.Tensor) -> list[int]:
        # bf16/fp16 -> fp32 is exact, so the argmax needs no conversion.
        if self._ops is not None and x.stride(-1) == 1:
            return self._ops.argmax_rows(x).tolist()
        return x.argmax(dim=-1).tolist()

    def _buffer(self, name: str, rows: int, vocab: int) -> torch.Tensor:
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != vocab:
            buf = torch.empty((rows, vocab), dtype=torch.float32)
            self._scratch[name] = buf
        return buf[:rows]

    def _suppress(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Logits with suppressed ids at -inf; never modifies the caller's tensor."""
        row_ids: list[int] = []
        col_ids: list[int] = []
        for i, r in enumerate(rows):
            if r.suppress_token_ids:
                row_ids.extend([i] * len(r.suppress_token_ids))
                col_ids.extend(r.suppress_token_ids)
        if not row_ids:
            return logits
        x = self._buffer("suppressed", *logits.shape).copy_(logits)
        x[torch.tensor(row_ids), torch.tensor(col_ids)] = -math.inf
        return x

    def _sample_random(self, x: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> list[int]:
        params = [r.params for r in rows]
        temps = torch.tensor([[p.temperature] for p in params], dtype=torch.float32)
        logits = self._buffer("scaled", len(idx), x.shape[1])
        if len(idx) == x.shape[0]:
            torch.div(x, temps, out=logits)
        else:
            rows_t = torch.tensor(idx)
            if x.dtype == torch.float32:
                torch.index_select(x, 0, rows_t, out=logits)
            else:
                logits.copy_(x[rows_t])
            logits.div_(temps)
        return self._draw(_truncated_weights(logits, params), rows)

    def _draw(self, weights: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """Inverse-CDF draw from unnormalised ``weights``: one uniform per row, so a seeded row
        costs one tiny draw from its own generator (an Exp(1) race would need V of them)."""
        own = [r.generator for r in rows if r.generator is not None]
        if not own:
            u = torch.rand(len(rows), generator=self.generator)
        else:
            n_shared = len(rows) - len(own)
            shared = torch.rand(n_shared, generator=self.generator).tolist() if n_shared else []
            it = iter(shared)
            u = torch.tensor(
                [
                    torch.rand(1, generator=r.generator).item()
                    if r.generator is not None
                    else next(it)
                    for r in rows
                ],
                dtype=torch.float32,
            )
        cdf = torch.cumsum(weights, dim=-1, out=self._buffer("cdf", *weights.shape))
        target = (u * cdf[:, -1]).unsqueeze(1)
        # right=True skips zero-weight tokens: token i wins iff cdf[i-1] <= target < cdf[i].
        tokens = torch.searchsorted(cdf, target, right=True).clamp_max_(weights.shape[1] - 1)
        # Rounding can put the target at the very top of the CDF, past the last token with
        # weight (p ~ 2^-24 per draw): those rows take their last token with weight.
        missed = weights.gather(1, tokens) == 0
        out = tokens.squeeze(1).tolist()
        if bool(missed.any()):
            for i in torch.nonzero(missed.squeeze(1)).flatten().tolist():
                out[i] = int(torch.nonzero(weights[i])[-1])
        return out

    def _logprobs(
        self, x: torch.Tensor, rows: list[SamplingRow], idx: list[int], tokens: list[int]
    ) -> dict[int, TokenLogprobs]:
        sub = x if len(idx) == x.shape[0] else x[torch.tensor(idx)]
        sub = sub.to(torch.float32)
        # log p = l - logsumexp(l), only where needed: no [B, V] log_softmax output.
        row_max = sub.amax(dim=-1, keepdim=True)
        shifted = torch.sub(sub, row_max, out=self._buffer("logprobs", *sub.shape))
        lse = shifted.exp_().sum(dim=-1, keepdim=True).log_().add_(row_max)
        picked = torch.tensor([[tokens[i]] for i in idx])
        chosen = sub.gather(1, picked).sub_(lse).squeeze(1).tolist()
        k_max = max(rows[i].params.logprobs or 0 for i in idx)
        if k_max > 0:
            top = sub.topk(k_max, dim=-1)
            top_vals, top_ids = top.values.sub_(lse).tolist(), top.indices.tolist()
        out: dict[int, TokenLogprobs] = {}
        for j, i in enumerate(idx):
            k = rows[i].params.logprobs or 0
            pairs = list(zip(top_ids[j][:k], top_vals[j][:k], strict=True)) if k else []
            out[i] = TokenLogprobs(token_id=tokens[i], logprob=chosen[j], top=pairs)
        return out


def _truncated_weights(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled ``logits`` (modified in place) -> unnormalised sampling weights
    ``p_i / p_max`` with top-k, top-p and min-p applied (dropped tokens weigh 0).

    All three are thresholds on the weight (tokens tied with the last kept one stay too), so a
    row's result never depends on its batch mates, and one masking pass applies them all.
    """
    vocab = logits.shape[1]
    weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    floor = None
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        floor = _top_k_top_p_floor(weights, top_ks, top_ps)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([[p.min_p] for p in params], dtype=torch.float32)
        floor = min_p if floor is None else torch.maximum(floor, min_p)
    if floor is not None:
        weights.masked_fill_(weights < floor, 0.0)
    return weights


def _top_k_top_p_floor(
    weights: torch.Tensor, top_ks: list[int], top_ps: list[float]
) -> torch.Tensor:
    """The [B, 1] weight below which top-k then top-p drop tokens (0: keep all)."""
    n_rows, vocab = weights.shape
    cand, counts = _candidates(weights)
    floor = torch.zeros((n_rows, 1), dtype=torch.float32)

    k_rows = [i for i, k in enumerate(top_ks) if k < vocab]
    if k_rows:
        pos = torch.tensor([[min(k, cand.shape[1]) - 1] for k in top_ks]).clamp_min_(0)
        floor = cand.gather(1, pos) if cand.shape[1] else floor
        floor.masked_fill_(torch.tensor([[k >= vocab] for k in top_ks]), 0.0)
        short = [i for i in k_rows if counts[i] < top_ks[i]]
        if short:  # the k-th best is below the candidates: ask topk
            rows = torch.tensor(short)
            kth = weights[rows].topk(max(top_ks[i] for i in short), dim=-1).values
            floor[rows] = kth.gather(1, torch.tensor([[top_ks[i] - 1] for i in short]))

    p_rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not p_rows:
        return floor
    p = torch.tensor([[tp if tp < 1.0 else 2.0] for tp in top_ps], dtype=torch.float32)
    if k_rows:
        total = torch.where(weights >= floor, weights, 0.0).sum(dim=-1, keepdim=True)
        cand = cand.masked_fill(cand < floor, 0.0)
    else:
        total = weights.sum(dim=-1, keepdim=True)
    floor_p, covered = _top_p_floor(cand, total, p)
    covered_rows = covered.tolist()
    wide = [i for i in p_rows if not covered_rows[i]]
    if wide:  # the nucleus reaches below the candidates: sort those rows in full
        rows = torch.tensor(wide)
        full = weights[rows].masked_fill_(weights[rows] < floor[rows], 0.0)
        full = full.sort(dim=-1, descending=True).values
        floor_p[rows] = _top_p_floor(full, total[rows], p[rows])[0]
    return torch.maximum(floor, floor_p)


def _candidates(weights: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Each row's weights >= ``_CANDIDATE_WEIGHT``, sorted best first and zero-padded to [B, M],
    and how many each row has (rows with more than ``_MAX_CANDIDATES`` get none)."""
    n_rows = weights.shape[0]
    r, c = torch.nonzero(weights >= _CANDIDATE_WEIGHT, as_tuple=True)
    counts = torch.bincount(r, minlength=n_rows)
    crowded = counts > _MAX_CANDIDATES
    if bool(crowded.any()):
        keep = ~crowded[r]
        r, c = r[keep], c[keep]
        counts.masked_fill_(crowded, 0)
    vals = weights[r, c]
    # Sort by value, then stably by row: rows stay grouped, each sorted best first.
    order = vals.argsort(descending=True, stable=True)
    order = order[r[order].argsort(stable=True)]
    r, vals = r[order], vals[order]
    starts = counts.cumsum(0) - counts
    rank = torch.arange(r.numel()) - starts[r]
    width = int(counts.max()) if r.numel() else 0
    cand = torch.zeros((n_rows, width), dtype=torch.float32)
    cand[r, rank] = vals
    return cand, counts.tolist()


def _top_p_floor(
    sorted_weights: torch.Tensor, total: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest weight top-p keeps among ``sorted_weights`` (best first) and whether that
    cutoff is final (the candidates hold at least ``p`` of the mass).

    A token is dropped once the mass strictly above it reaches ``p`` (vLLM's rule); the best
    token has none above it, so at least one survives. Rows with ``p > 1`` keep everything.
    """
    if sorted_weights.shape[1] == 0:
        return torch.zeros_like(total), torch.zeros(total.shape[0], dtype=torch.bool)
    probs = sorted_weights / total
    cum = probs.cumsum(dim=-1)
    n_keep = ((cum - probs) < p).sum(dim=-1, keepdim=True)
    floor = sorted_weights.gather(1, n_keep - 1)
    floor.masked_fill_(p > 1.0, 0.0)
    return floor, cum[:, -1] >= p.squeeze(1)
