"""vLLM's offline ``LLM`` on the prompts ``bench/offline_vs_vllm.py`` wrote: run in vLLM's venv.

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 .venv-vllm/bin/python bench/vllm_offline.py PROMPTS.json

PROMPTS.json: ``{"model": folder, "dtype": ..., "prompts": [[ids...]], "output_len": N,
"trials": T}``. Prints one line, ``RESULT`` and JSON (vLLM logs to stdout too): start-up seconds, the seconds of each trial
(``reset_prefix_cache()`` before each), and of a repeat without the reset. This
file imports nothing of radixserve: vLLM's venv does not have it.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enable_prefix_caching=True,
        max_model_len=spec.get("max_model_len", 4096),
        # On the CPU backend this is the share of the NUMA node's memory vLLM claims.
        gpu_memory_utilization=spec.get("memory_utilization", 0.4),
        seed=0,
    )
    start_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    sp = SamplingParams(max_tokens=spec["output_len"], temperature=0, ignore_eos=True)
    trials = []
    for _ in range(spec["trials"]):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        trials.append(time.perf_counter() - t)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    repeat = time.perf_counter() - t
    cached = [getattr(o, "num_cached_tokens", None) for o in outs]
    print(
        "RESULT "
        + json.dumps(
            {
                "start_s": start_s,
                "trials": trials,
                "repeat": repeat,
                "first_tokens": list(outs[0].outputs[0].token_ids[:4]),
                "cached_tokens_repeat": sum(c for c in cached if c is not None),
            }
        )
    )


if __name__ == "__main__":
    main()
