"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.engine_request import EngineRequest
from replica.outputs import CompletionOutput, RequestOutput, StepOutput
from replica.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs a replica engine in this process for batch generation.

    ``LLM(model="smollm2", dtype="auto", block_size=16, **engine_options)``; any
    ``EngineConfig`` field can be passed by name.
    """

    def __init__(self, model: str = "smollm2", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _add(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
    ) -> list[tuple[str, Prompt]]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("sampling_params must be one object or one per prompt")
        added = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = str(next(self._ids))
            self.engine.add(
                EngineRequest(request_id, prompt, params, priority=priority[i] if priority else 0)
            )
            added.append((request_id, prompt))
        return added

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> Iterator[StepOutput]:
        """Yield every per-step delta (request_id, sample index, new tokens and text)."""
        self._add(prompts, sampling_params, priority)
        while self.engine.has_unfinished_requests():
            yield from self.engine.step()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate to completion; results in the order of ``prompts``."""
        added = self._add(prompts, sampling_params, priority)
        results: dict[str, RequestOutput] = {}
        for request_id, prompt in added:
            request = self.engine._requests[request_id]
            results[request_id] = RequestOutput(
                request_id=request_id,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=list(request.prompt_token_ids),
                num_cached_tokens=0,
                outputs=[
                    CompletionOutput(index=i, text="", token_ids=[], finish_reason=None)
                    for i in range(request.params.n)
                ],
            )
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                result = results[delta.request_id]
                sample = result.outputs[delta.index]
                sample.token_ids.extend(delta.new_token_ids)
                sample.text += delta.new_text
                if delta.new_logprobs:
                    sample.logprobs = (sample.logprobs or []) + delta.new_logprobs
                result.num_cached_tokens = delta.num_cached_tokens
                if delta.finished:
                    sample.finish_reason = delta.finish_reason
                    sample.stop_reason = delta.stop_reason
                    result.finished = all(o.finish_reason for o in result.outputs)
        return [results[request_id] for request_id, _ in added]
