"""Greedy completions from fresh vLLM engines: the ground truth a pushed version must match.

    python -m uzip_vllm.reference --tp 1 --max-tokens 16 --prompt "Once upon a time" CKPT_DIR [CKPT_DIR ...]

Prints one JSON object: {checkpoint dir: [completion text per prompt]}. Each checkpoint gets
its own engine, built from nothing, without `--comm-plugin` (so it also shows what vLLM does
with the plugin installed but off; set VLLM_PLUGINS to a list without `uzip` to leave the
plugin out entirely).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys


def greedy(llm, prompts: list[str], max_tokens: int) -> list[str]:
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prompt", action="append", required=True)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    args = ap.parse_args(argv)

    import os

    if args.tp == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    # At TP=1 the engine runs in this process (no engine-core or worker process to spawn and
    # import vLLM again): a fresh engine per checkpoint then costs about a second, not a minute.
    inproc = args.tp == 1
    results = {}
    for ckpt in args.checkpoints:
        llm = LLM(model=ckpt, tensor_parallel_size=args.tp, enforce_eager=True, max_model_len=args.max_model_len,
                  seed=0, distributed_executor_backend="uni" if inproc else None)
        results[ckpt] = greedy(llm, args.prompt, args.max_tokens)
        llm.llm_engine.engine_core.shutdown()
        del llm
        if inproc:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        gc.collect()
    json.dump(results, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
