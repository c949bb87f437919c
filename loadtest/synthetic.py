"""Synthetic workloads: shared-prefix groups (with Zipf popularity and multi-turn
conversations) and unique random prompts. Fully deterministic for a given seed, so ``--compare``
sends byte-identical requests to every policy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadtest.request import LoadRequest
from loadtest.tokens import TokenBlocks

# TokenBlocks namespaces, so that system prompts, questions and answers never collide.
_NS_SYSTEM, _NS_QUESTION, _NS_ANSWER, _NS_RANDOM = 2, 3, 4, 5


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    """``num_groups`` system prompts, each shared by ``prompts_per_group`` conversations.

    A request is ``system prompt + question`` (single turn). With ``turns > 1`` each conversation
    grows its own prefix: turn t sends ``system + q0 + a0 + ... + q_t``, where the answers are
    fixed synthetic tokens of ``output_len`` (so the workload is known before the run and its best
    possible hit rate can be computed). Turn t+1 of every conversation is scheduled after all turn
    t requests. ``zipf > 0`` draws each conversation's group with probability ~ 1 / rank**zipf
    instead of giving every group exactly ``prompts_per_group`` conversations.
    """

    num_groups: int = 8
    prompts_per_group: int = 16
    system_prompt_len: int = 512
    question_len: int = 64
    output_len: int = 32
    zipf: float = 0.0
    turns: int = 1
    seed: int = 0


@dataclass(frozen=True, slots=True)
class RandomSpec:
    """Unique random prompts; lengths uniform in ``len * [1 - range_ratio, 1 + range_ratio]``."""

    num_requests: int = 100
    input_len: int = 256
    output_len: int = 32
    range_ratio: float = 0.0
    seed: int = 0


def _groups_of_conversations(spec: SharedPrefixSpec, rng: np.random.Generator) -> np.ndarray:
    n = spec.num_groups * spec.prompts_per_group
    if spec.zipf > 0:
        weights = 1.0 / np.arange(1, spec.num_groups + 1) ** spec.zipf
        return rng.choice(spec.num_groups, size=n, p=weights / weights.sum())
    groups = np.repeat(np.arange(spec.num_groups), spec.prompts_per_group)
    rng.shuffle(groups)
    return groups


def shared_prefix_requests(spec: SharedPrefixSpec, blocks: TokenBlocks) -> list[LoadRequest]:
    for name in ("num_groups", "prompts_per_group", "output_len", "turns"):
        if getattr(spec, name) < 1:
            raise ValueError(f"{name} must be >= 1 (got {getattr(spec, name)})")
    rng = np.random.default_rng(spec.seed)
    groups = _groups_of_conversations(spec, rng)
    system = [blocks.random(spec.system_prompt_len, _NS_SYSTEM, g) for g in range(spec.num_groups)]
    history = [list(system[int(g)]) for g in groups]  # each conversation's prefix so far
    requests: list[LoadRequest] = []
    for turn in range(spec.turns):
        order = rng.permutation(len(groups))
        for conv in order:
            question = blocks.random(spec.question_len, _NS_QUESTION, int(conv), turn)
            prompt = history[conv] + question
            requests.append(
                LoadRequest(
                    index=len(requests),
                    token_ids=prompt,
                    max_tokens=spec.output_len,
                    group=int(groups[conv]),
                    turn=turn,
                )
            )
            if turn + 1 < spec.turns:
                answer = blocks.random(spec.output_len, _NS_ANSWER, int(conv), turn)
                history[conv] = prompt + answer
    return requests


def random_requests(spec: RandomSpec, blocks: TokenBlocks) -> list[LoadRequest]:
    rng = np.random.default_rng(spec.seed)

    def length(mean: int) -> int:
        lo = max(1, int(mean * (1 - spec.range_ratio)))
        hi = max(lo, int(mean * (1 + spec.range_ratio)))
        return int(rng.integers(lo, hi + 1))

    return [
        LoadRequest(
            index=i,
            token_ids=blocks.random(length(spec.input_len), _NS_RANDOM, spec.seed, i),
            max_tokens=length(spec.output_len),
        )
        for i in range(spec.num_requests)
    ]
