"""``GenerateResponse`` protos -> OpenAI response bodies and stream chunks. Torch-free.

Choice ``i`` of a request with several prompts and ``n`` samples each is sample ``i % n`` of
prompt ``i // n`` (OpenAI's order). Usage counts each prompt once (the largest cached count any
of its samples saw) and every generated token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixmesh.openai.schema import ParsedRequest
from proto import prefixmesh_pb2 as pb

TokenText = Callable[[int], str]


def token_text_fn(tokenizer: Any | None) -> TokenText:
    """Token id -> its text; ``token_id:<id>`` (vLLM's spelling) when no tokenizer is known."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.Logprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    completion_tokens: int = 0


@dataclass(slots=True)
class _PromptUsage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    fetched_tokens: int = 0  # of cached_tokens, those whose KV came from a peer replica


class ResponseBuilder:
    """Turns the upstream messages of one HTTP request into OpenAI JSON (whole or chunked)."""

    def __init__(self, parsed: ParsedRequest, model: str, token_text: TokenText) -> None:
        self.parsed = parsed
        self.model = model
        self.token_text = token_text
        self.created = int(time.time())
        self.choices: dict[int, _Choice] = {}
        self.prompts: dict[int, _PromptUsage] = {}
        self.replicas: set[str] = set()
        self._role_sent: set[int] = set()

    @property
    def chat(self) -> bool:
        return self.parsed.kind == "chat"

    def choice_index(self, prompt_index: int, resp: pb.GenerateResponse) -> int:
        return prompt_index * self.parsed.n + resp.index

    def add(self, prompt_index: int, resp: pb.GenerateResponse) -> int:
        """Record one upstream message; returns its choice index."""
        index = self.choice_index(prompt_index, resp)
        choice = self.choices.setdefault(index, _Choice())
        choice.text.append(resp.text)
        choice.logprobs.extend(resp.logprobs)
        if resp.replica_id:
            self.replicas.add(resp.replica_id)
        if resp.finish_reason:
            choice.finish_reason = resp.finish_reason
            choice.stop_reason = resp.stop_reason or None
            choice.completion_tokens = resp.usage.completion_tokens
            usage = self.prompts.setdefault(prompt_index, _PromptUsage())
            usage.prompt_tokens = max(usage.prompt_tokens, resp.usage.prompt_tokens)
            usage.cached_tokens = max(usage.cached_tokens, resp.usage.cached_tokens)
            usage.fetched_tokens = max(usage.fetched_tokens, resp.usage.fetched_tokens)
        return index

    # -- pieces -------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        prompt = sum(u.prompt_tokens for u in self.prompts.values())
        cached = sum(u.cached_tokens for u in self.prompts.values())
        fetched = sum(u.fetched_tokens for u in self.prompts.values())
        completion = sum(c.completion_tokens for c in self.choices.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # fetched_tokens is ours (not OpenAI's): cached tokens a peer replica sent.
            "prompt_tokens_details": {"cached_tokens": cached, "fetched_tokens": fetched},
        }

    def _logprobs(self, entries: list[pb.Logprobs], text_offset: int) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        if self.chat:
            content = []
            for lp in entries:
                token = self.token_text(lp.token_id)
                content.append({
                    "token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
                    "top_logprobs": [
                        {"token": (t := self.token_text(a.token_id)), "logprob": a.logprob,
                         "bytes": list(t.encode())}
                        for a in lp.top
                    ],
                })  # fmt: skip
            return {"content": content}
        tokens, offsets, top = [], [], []
        for lp in entries:
            token = self.token_text(lp.token_id)
            tokens.append(token)
            offsets.append(text_offset)
            text_offset += len(token)
            top.append({self.token_text(a.token_id): a.logprob for a in lp.top})
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _header(self, obj: str) -> dict[str, Any]:
        return {"id": self.parsed.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole response -----------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            text = "".join(c.text)
            entry: dict[str, Any] = {"index": index}
            if self.chat:
                entry["message"] = {"role": "assistant", "content": text}
            else:
                entry["text"] = text
            entry["logprobs"] = self._logprobs(c.logprobs, 0)
            entry["finish_reason"] = c.finish_reason
            entry["stop_reason"] = c.stop_reason
            choices.append(entry)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._header(obj), "choices": choices, "usage": self.usage()}

    # -- streaming ----------------------------------------------------------------------

    def chunks(self, index: int, resp: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The stream chunks for one upstream message (chat: a role chunk first)."""
        out = []
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        c = self.choices[index]
        if self.chat and index not in self._role_sent:
            self._role_sent.add(index)
            role = {"index": index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}  # fmt: skip
            out.append({**self._header(obj), "choices": [role]})
        if not resp.text and not resp.finish_reason and not resp.logprobs:
            return out
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"content": resp.text} if resp.text else {}
        else:
            choice["text"] = resp.text
        before = sum(len(t) for t in c.text[:-1])
        choice["logprobs"] = self._logprobs(list(resp.logprobs), before)
        choice["finish_reason"] = resp.finish_reason or None
        if resp.finish_reason:
            choice["stop_reason"] = resp.stop_reason or None
        out.append({**self._header(obj), "choices": [choice]})
        return out

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._header(obj), "choices": [], "usage": self.usage()}
