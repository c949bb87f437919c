"""Fast unit tests of the replica server's pieces: configuration and request mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_tiny_tokenizer

from prefixmesh.tokenizer import Tokenizer
from proto import prefixmesh_pb2 as pb
from replica.outputs import StepOutput, TokenLogprobs
from replica.server.config import ServerConfig, build_parser, parse_config
from replica.server.request_mapping import engine_request, response, sampling_params


def test_flags_beat_environment_which_beats_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXMESH_PORT", "6000")
    monkeypatch.setenv("PREFIXMESH_MAX_QUEUE", "7")
    monkeypatch.setenv("PREFIXMESH_PREFIX_CACHING", "false")
    config = parse_config(["--max-queue", "9", "--num-blocks", "64", "--threads", "2"])
    assert (config.port, config.max_queue, config.prefix_caching) == (6000, 9, False)
    assert config.grace_period == ServerConfig().grace_period
    engine = config.engine_config()
    assert (engine.num_kv_blocks, engine.num_threads, engine.enable_prefix_caching) == (
        64,
        2,
        False,
    )
    assert engine.max_model_len is None  # 0 = the model's own context


def test_help_documents_every_knob_with_its_default() -> None:
    text = build_parser().format_help()
    for name in ServerConfig.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in text
        assert "PREFIXMESH_" + name.upper() in text
    assert "(default: 256)" in text  # --max-queue


def test_bad_environment_value_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXMESH_PORT", "not-a-port")
    with pytest.raises(SystemExit):
        parse_config([])


@pytest.mark.parametrize("share", ["-0.1", "1.5"])
def test_a_waiting_prefix_share_outside_0_1_is_refused_with_the_flag_named(share: str) -> None:
    with pytest.raises(SystemExit, match=r"--waiting-prefix-share must be in \[0, 1\]"):
        parse_config(["--waiting-prefix-share", share])
    assert parse_config(["--waiting-prefix-share", "0"]).engine_config().waiting_prefix_share == 0


def test_advertised_address_and_replica_id() -> None:
    config = ServerConfig(host="0.0.0.0", advertise_host="replica-3")
    assert config.resolved_advertise_address(5000) == "replica-3:5000"
    assert ServerConfig(advertise_address="x:1").resolved_advertise_address(5000) == "x:1"
    a, b = ServerConfig().resolved_replica_id(5000), ServerConfig().resolved_replica_id(5000)
    assert a.startswith("127.0.0.1-5000-") and a != b  # unique per process
    assert ServerConfig(replica_id="r7").resolved_replica_id(5000) == "r7"


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        ids = [t for m in messages for t in [1, *self.encode(m["content"]), 2]]
        return ids + ([3] if add_generation_prompt else [])


def test_unset_sampling_fields_take_engine_defaults() -> None:
    params = sampling_params(pb.SamplingParams(temperature=0.0, stop=["\n"]))
    assert (params.max_tokens, params.top_p, params.n, params.skip_special_tokens) == (
        16,
        1.0,
        1,
        True,
    )
    assert params.greedy and params.stop == ["\n"] and params.logprobs is None


def test_resume_tokens_extend_the_prompt_and_use_the_budget() -> None:
    request = pb.GenerateRequest(
        text="ab",
        sampling=pb.SamplingParams(max_tokens=10, min_tokens=4),
        resume_token_ids=[7, 8, 9],
    )
    req = engine_request(request, FakeTokenizer(), vocab_size=1000)
    assert req.prompt_token_ids == [97, 98, 7, 8, 9]
    assert (req.engine.params.max_tokens, req.engine.params.min_tokens, req.num_prompt_tokens) == (
        7,
        1,
        2,
    )
    final = StepOutput("e", 0, [5], "x", True, "length", None, 5, 4, 7)
    usage = response(final, "client", "r1", req).usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (2, 10, 2)


def test_the_context_budget_is_settled_before_resumed_tokens_are_subtracted() -> None:
    """fit_context shrinks max_tokens to the room the prompt leaves; a set max_tokens must fit;
    both count the resumed tokens as output (the check is on the whole budget)."""

    def mapped(max_tokens: int, fit: bool, resumed: list[int], text: str = "abcd") -> int:
        sp = pb.SamplingParams(max_tokens=max_tokens, fit_context=fit)
        request = pb.GenerateRequest(text=text, sampling=sp, resume_token_ids=resumed)
        req = engine_request(request, FakeTokenizer(), vocab_size=1000, max_model_len=10)
        return req.engine.params.max_tokens

    assert mapped(1024, True, []) == 6  # 10 - a 4-token prompt
    assert mapped(3, True, []) == 3  # a cap, never raised
    assert mapped(1024, True, [7, 8]) == 4  # room 6, of which 2 resumed
    assert mapped(6, False, [7, 8]) == 4  # 4 + 6 fits: the resumed 2 are part of the 6
    with pytest.raises(ValueError, match="ask for at most 6 tokens"):
        mapped(7, False, [7, 8])
    with pytest.raises(ValueError, match="shorten the prompt"):
        mapped(1024, True, [], text="abcdefghijk")
    unbounded = pb.GenerateRequest(text="abcd", sampling=pb.SamplingParams(max_tokens=1024))
    assert engine_request(unbounded, FakeTokenizer(), 1000).engine.params.max_tokens == 1024


def test_resume_text_chars_maps_to_the_unsent_text(tmp_path: Path) -> None:
    vocab = make_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    prompt, resumed = tok.encode("hello world,"), tok.encode(" the cache prefix")
    text = " the cache prefix"

    def mapped(chars: int | None, **sampling):
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            resume_token_ids=resumed,
            sampling=pb.SamplingParams(max_tokens=16, **sampling),
        )
        if chars is not None:
            request.resume_text_chars = chars
        return engine_request(request, tok, vocab)

    assert mapped(None).engine.unsent_text == mapped(len(text)).engine.unsent_text == ""
    assert mapped(4).engine.unsent_text == text[4:] == " cache prefix"
    assert mapped(0).engine.unsent_text == text
    for bad in (-1, len(text) + 1):
        with pytest.raises(ValueError, match="resume_text_chars"):
            mapped(bad)
    # A whole stop string in the unsent text: that sample had stopped already ...
    with pytest.raises(ValueError, match="resume_text_chars=4 .* 'cache'"):
        mapped(4, stop=["cache"])
    # ... unless its replica was not matching stop strings yet (min_tokens not reached).
    assert (
        mapped(4, stop=["cache"], min_tokens=len(resumed) + 1).engine.unsent_text == " cache prefix"
    )
    no_resume = pb.GenerateRequest(text="hi", resume_text_chars=0)
    assert engine_request(no_resume, tok, vocab).engine.unsent_text == ""


def test_chat_and_response_fields() -> None:
    chat = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="hi")], add_generation_prompt=False
    )
    req = engine_request(pb.GenerateRequest(chat=chat), FakeTokenizer(), vocab_size=1000)
    assert req.prompt_token_ids == [1, 104, 105, 2]
    lp = TokenLogprobs(token_id=5, logprob=-0.5, top=[(5, -0.5), (6, -1.0)])
    out = StepOutput("e", 1, [5], "x", False, None, None, 4, 0, 1, [lp])
    msg = response(out, "client", "r1", req)
    assert (msg.request_id, msg.index, msg.replica_id, msg.finish_reason) == ("client", 1, "r1", "")
    assert not msg.HasField("usage")
    assert [(t.token_id, t.logprob) for t in msg.logprobs[0].top] == [(5, -0.5), (6, -1.0)]
    stop = StepOutput("e", 0, [], "", True, "stop", "###", 4, 0, 3)
    assert response(stop, "c", "r1", req).stop_reason == "###"
