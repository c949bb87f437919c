"""A 5-turn chat on the real SmolLM2 through the router's OpenAI HTTP front door: every turn
is routed by its templated conversation, so all turns land on one of two replicas and each
finds more of its prompt cached than the turn before."""

from __future__ import annotations

import json

import openai
import pytest
from helpers import Proc, free_port, start_redis, stop_all, wait_until
from test_openai_http import _get

from prefixmesh.openai.http import REPLICA_HEADER

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def _models(router_http: str) -> int:
    status, body = _get(f"http://{router_http}/v1/models")
    return len(json.loads(body)["data"]) if status == 200 else 0


def _health_replicas(router_http: str) -> int:
    status, body = _get(f"http://{router_http}/health")
    return json.loads(body)["replicas"] if status == 200 else 0


def test_five_turn_chat_sticks_and_caches(smollm2_files) -> None:
    redis = start_redis()
    procs: list[Proc] = []
    try:
        for i in range(2):
            procs.append(Proc.cli(f"smol-{i}", *[
                "replica", "--model", str(smollm2_files.path), "--port", str(free_port()),
                "--redis", redis.url, "--namespace", "oais", "--replica-id", f"smol-{i}",
                "--threads", "1", "--max-model-len", "2048",
            ]))  # fmt: skip
        http = f"127.0.0.1:{free_port()}"
        procs.append(Proc.cli("router", *[
            "router", "--port", str(free_port()), "--http-port", http.rsplit(":", 1)[1],
            "--redis", redis.url, "--namespace", "oais",
        ]))  # fmt: skip
        wait_until(procs, lambda: _health_replicas(http) == 2 and _models(http) == 1, "router", 600)

        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0,
                               timeout=300)  # fmt: skip
        messages = [{"role": "system", "content": "You are a helpful assistant. Be brief."}]
        questions = ["What is a cache?", "Why do CPUs have several cache levels?",
                     "What is a prefix cache in LLM serving?", "How does a router use it?",
                     "Summarize our conversation in one sentence."]  # fmt: skip
        cached, prompt, replicas = [], [], []
        for question in questions:
            messages.append({"role": "user", "content": question})
            raw = client.chat.completions.with_raw_response.create(
                model="smollm2", messages=messages, max_tokens=24, temperature=0
            )
            out = raw.parse()
            replicas.append(raw.headers[REPLICA_HEADER])
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
            prompt.append(out.usage.prompt_tokens)
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
        print(f"prompt tokens {prompt}, cached tokens {cached}, replicas {replicas}")
        assert len(set(replicas)) == 1, replicas  # the conversation stuck to one replica
        assert all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached
        assert all(c <= p for c, p in zip(cached, prompt, strict=True))
    finally:
        stop_all(procs)
        redis.stop()
