"""``prefixmesh generate``: send one prompt to the router (or a replica) and stream the answer.

The answer goes to stdout as it arrives; a summary line (serving replica, cached prompt tokens,
time to first token, total time) goes to stderr, so ``prefixmesh generate ... > out.txt`` keeps
only the text. ``--json`` prints one JSON object instead, for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import grpc

from prefixmesh import tls
from prefixmesh.auth import bearer_metadata, client_api_key, missing_key_hint
from proto import prefixmesh_pb2 as pb
from proto import prefixmesh_pb2_grpc as pb_grpc

DEFAULT_ROUTER = "127.0.0.1:50050"


@dataclass(slots=True)
class GenerateResult:
    """What one request produced, with client-side timings in seconds."""

    text: str = ""
    replica_id: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    replicas: list[str] = field(default_factory=list)  # more than one after a failover


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixmesh generate",
        description="Send one prompt to a prefixmesh router (or replica) and stream the answer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    parser.add_argument(
        "--router",
        default=os.environ.get("PREFIXMESH_ROUTER", DEFAULT_ROUTER),
        help="router (or replica) address host:port [env PREFIXMESH_ROUTER]",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="API key of the router (or replica) started with --api-key, sent as gRPC metadata "
        "'authorization: Bearer <key>' [env PREFIXMESH_API_KEY] (value not shown)",
    )
    tls.add_client_flags(parser)
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user chat message (the model's chat template)",
    )
    parser.add_argument("--system", default=None, help="system message (implies --chat)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeat)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--priority", type=int, default=0, help="lower is served first")
    parser.add_argument("--cache-salt", default="", help="tenant key: salts never share cache")
    parser.add_argument("--request-id", default="")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole call")
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the router to accept the connection",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, replica, usage, timings) at the end",
    )
    return parser


def build_request(args: argparse.Namespace, prompt: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    request = pb.GenerateRequest(
        request_id=args.request_id,
        sampling=sampling,
        priority=args.priority,
        cache_salt=args.cache_salt,
    )
    if args.chat or args.system is not None:
        messages = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
        messages.append(pb.ChatMessage(role="user", content=prompt))
        request.chat.CopyFrom(pb.ChatMessages(messages=messages))
    else:
        request.text = prompt
    return request


def stream(
    address: str,
    request: pb.GenerateRequest,
    timeout_s: float,
    echo: bool = True,
    connect_timeout_s: float = 10.0,
    api_key: str = "",
    tls_files: tls.TlsFiles | None = None,
) -> GenerateResult:
    """Run one Generate call, writing text deltas to stdout as they arrive if ``echo``.

    Raises ConnectionError if nothing accepts a connection on ``address`` in time.
    """
    result = GenerateResult()
    with tls.channel(address, tls_files) as channel:  # TLS with --tls-ca
        try:
            grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            raise ConnectionError(
                f"nothing answers on {address} (is `prefixmesh up` running?)"
            ) from None
        stub = pb_grpc.GeneratorStub(channel)
        start = time.perf_counter()
        metadata = bearer_metadata(api_key) or None
        for msg in stub.Generate(request, timeout=timeout_s, metadata=metadata):
            if msg.index != 0:
                continue  # only n=1 is shown; the flags never ask for more
            if msg.text or msg.token_ids:
                if not result.ttft_s:
                    result.ttft_s = time.perf_counter() - start
                result.text += msg.text
                if echo:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
            if msg.replica_id and msg.replica_id not in result.replicas:
                result.replicas.append(msg.replica_id)
            if msg.finish_reason:
                result.finish_reason = msg.finish_reason
                result.prompt_tokens = msg.usage.prompt_tokens
                result.completion_tokens = msg.usage.completion_tokens
                result.cached_tokens = msg.usage.cached_tokens
    result.total_s = time.perf_counter() - start
    result.replica_id = result.replicas[-1] if result.replicas else ""
    return result


def summary(r: GenerateResult) -> str:
    decode_s = r.total_s - r.ttft_s
    rate = (r.completion_tokens - 1) / decode_s if r.completion_tokens > 1 and decode_s > 0 else 0
    served = " -> ".join(r.replicas) or "?"
    return (
        f"replica {served} | cached {r.cached_tokens}/{r.prompt_tokens} prompt tokens | "
        f"{r.completion_tokens} tokens ({r.finish_reason or '?'}) | "
        f"TTFT {r.ttft_s * 1000:.0f} ms | total {r.total_s * 1000:.0f} ms | {rate:.1f} tok/s"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    request = build_request(args, prompt)
    api_key = client_api_key(args.api_key)
    try:
        result = stream(
            args.router,
            request,
            args.timeout,
            not args.json,
            args.connect_timeout,
            api_key,
            tls.client_files(args),
        )
    except ConnectionError as err:
        print(f"prefixmesh generate: {err}", file=sys.stderr)
        return 1
    except grpc.RpcError as err:
        code = err.code().name if err.code() else "UNKNOWN"
        hint = missing_key_hint(err.code(), api_key)
        print(
            f"\nprefixmesh generate: {code}: {err.details()} (router {args.router}){hint}",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        print()
        print(summary(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
