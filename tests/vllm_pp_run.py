"""Greedy completions from a pipeline-parallel (PP=2) vLLM engine, with and without
`--comm-plugin uzip`, for tests/test_pipeline_vllm.py (run in a subprocess: vLLM spawns workers).

    python tests/vllm_pp_run.py MODEL --prompt P [--prompt P ...] [--max-tokens N] [--modes uzip,none]

Prints one JSON object as the last line: {mode: {"texts": [...], "counters": [per worker] or null}}.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys


def _allocate_intermediate_buffers(worker) -> bool:
    """vLLM 0.32 on CPU allocates a later PP stage's receive buffers only in the compile
    warm-up, which --enforce-eager skips (the stage then fails an assert on its first step).
    Run on every worker, both modes, before the first request."""
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
        return False
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", action="append", required=True)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--modes", default="uzip,none")
    args = ap.parse_args(argv)

    from vllm import LLM, SamplingParams

    from uzip_vllm import pipeline, plugin

    results = {}
    for mode in args.modes.split(","):
        kwargs = plugin.engine_kwargs(allreduce="never") if mode == "uzip" else {}
        llm = LLM(model=args.model, pipeline_parallel_size=2, enforce_eager=True, max_model_len=512, seed=0,
                  **kwargs)
        llm.collective_rpc(_allocate_intermediate_buffers)
        outs = llm.generate(args.prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                            use_tqdm=False)
        counters = llm.collective_rpc(pipeline.worker_counters) if mode == "uzip" else None
        results[mode] = {"texts": [o.outputs[0].text for o in outs], "counters": counters}
        print(json.dumps({mode: results[mode]}), file=sys.stderr, flush=True)  # progress, if a later mode fails
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    json.dump(results, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
