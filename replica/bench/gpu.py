"""``prefixmesh bench gpu``: the engine end to end on a CUDA GPU.

1. Parity, in float32: each attention backend's greedy output against a Hugging Face argmax
   loop over the same weights (no KV cache there: the whole sequence every token), for prompts
   that share a 70-token prefix, in 64-token steps so prompts prefill in chunks; a second round
   hits the prefix cache and must give the same tokens.
2. Throughput, in bfloat16: output tok/s of each backend on ``--batch`` prompts of
   ``--prompt-len`` random tokens, ``--max-tokens`` each (default 64 x 200 / 128, the
   ``throughput`` workload), after a warm-up that compiles the kernels.

``--random-weights`` keeps the model's config and tokenizer and draws new weights (seeded), for
a machine that has the config but not the weights (a GPU machine with no network); ``--layers``
then keeps only the first N layers. Without CUDA it runs on the CPU, the Triton backend under
Triton's interpreter (slow: for checking the command, not for timing).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from replica.sampling_params import SamplingParams

HELP = "the engine on a CUDA GPU: both attention backends' parity with HF, and output tok/s"
PARITY_TOKENS = 24


def add_arguments(parser) -> None:
    parser.add_argument("--random-weights", action="store_true",
                        help="the model's config and tokenizer with seeded random weights")  # fmt: skip
    parser.add_argument("--layers", type=int, default=0,
                        help="with --random-weights: keep the first N layers (0: all)")  # fmt: skip
    parser.add_argument("--backends", default="triton,torch", help="attention backends to run")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)


def run(args) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = [b for b in args.backends.split(",") if b]
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as scratch:
        folder = _model_folder(args, Path(scratch))
        parity = _parity(folder, backends, device)
        dtype = "bfloat16" if device == "cuda" else args.dtype
        throughput = {b: _throughput(folder, b, device, dtype, args) for b in backends}
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (no CUDA)"
    print(f"# prefixmesh bench gpu on {name}, torch {torch.__version__}")
    for backend, rounds in parity.items():
        print(f"float32 {backend}: equal to the HF argmax loop {rounds['equal']}, "
              f"cached tokens {rounds['cached_tokens']}")  # fmt: skip
    for backend, row in throughput.items():
        print(f"{dtype} {backend}: {row['tokens']} tokens in {row['seconds']:.2f} s = "
              f"{row['tok_s']:.0f} tok/s ({args.batch} x {args.prompt_len} / {args.max_tokens})")  # fmt: skip
    passed = all(all(all(r) for r in rounds["equal"]) for rounds in parity.values())
    print("parity:", "PASS" if passed else "FAIL")
    return {"device": name, "parity": parity, "parity_passed": passed, "dtype": dtype,
            "throughput": throughput}  # fmt: skip


def _model_folder(args, scratch: Path) -> Path:
    """The model's folder, or with ``--random-weights`` a copy of its config and tokenizer next
    to newly drawn weights (``scratch``)."""
    from replica.loader import resolve_model

    if not args.random_weights:
        return Path(resolve_model(args.model).path)
    # A folder needs only its config and tokenizer here; a name is resolved as usual.
    given = Path(args.model).expanduser()
    source = given if given.is_dir() else Path(resolve_model(args.model).path)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, scratch / name)
    if args.layers:
        config = json.loads((scratch / "config.json").read_text())
        config["num_hidden_layers"] = args.layers
        (scratch / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_pretrained(scratch)).save_pretrained(scratch)
    return scratch


def _parity(folder: Path, backends: list[str], device: str) -> dict:
    """Each backend's greedy tokens (two rounds) against HF's argmax loop, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from replica import LLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    vocab = hf.config.vocab_size
    rng = random.Random(1)
    shared = [rng.randrange(3, vocab) for _ in range(70)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (5, 40, 150)]
    prompts.append([rng.randrange(3, vocab) for _ in range(9)])
    reference = [_hf_greedy(hf, p, device) for p in prompts]
    del hf
    params = SamplingParams(max_tokens=PARITY_TOKENS, temperature=0.0, ignore_eos=True)
    results = {}
    for backend in backends:
        llm = LLM(str(folder), dtype="float32", device=device, attention_backend=backend,
                  num_kv_blocks=512, max_num_batched_tokens=64)  # fmt: skip
        equal, cached = [], []
        for _ in range(2):  # the second round hits the prefix cache
            outs = llm.generate(prompts, params)
            equal.append([o.outputs[0].token_ids == r for o, r in zip(outs, reference)])
            cached.append([o.num_cached_tokens for o in outs])
        llm.engine.check_integrity()
        results[backend] = {"equal": equal, "cached_tokens": cached}
    return results


def _hf_greedy(hf, prompt: list[int], device: str) -> list[int]:
    import torch

    ids = torch.tensor([prompt], device=device)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(PARITY_TOKENS):
            token = int(hf(ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return out


def _throughput(folder: Path, backend: str, device: str, dtype: str, args) -> dict:
    import torch

    from replica import LLM

    llm = LLM(str(folder), dtype=dtype, device=device, attention_backend=backend)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(2)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - start
    llm.engine.check_integrity()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
