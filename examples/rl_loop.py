"""A minimal RL-style loop with uzip-serve: train step -> push_weights -> rollouts tagged by version.

    # against a running fleet
    uzip coordinator --listen 127.0.0.1:50051 --state ./uzip-state.sqlite3 &
    vllm serve MODEL_DIR --comm-plugin uzip --uzip-coordinator 127.0.0.1:50051 --port 8000 &
    python examples/rl_loop.py --model MODEL_DIR --coordinator 127.0.0.1:50051 --server http://127.0.0.1:8000

    # or let it start both (CPU, the tiny test model from `make setup`)
    python examples/rl_loop.py --spawn

The "policy update" is a real optimizer step (transformers, AdamW) on a reward-weighted
log-likelihood of the rollouts, a REINFORCE-shaped toy: the point is the plumbing, not the
learning. Each rollout is tagged with the version that produced it (`X-Uzip-Weight-Version`),
which is what an off-policy correction needs.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` for --spawn's default model

PROMPTS = ["Once upon a time,", "The best way to learn is", "In the year 2050,", "My favourite food is"]


def reward(text: str) -> float:
    """A toy reward: shorter words are better. Replace with your verifier / reward model."""
    words = text.split()
    return -sum(len(w) for w in words) / max(len(words), 1)


def rollouts(server: str, model: str, n_tokens: int) -> list[dict]:
    from uzip_vllm.demo import http_json

    out = []
    for p in PROMPTS:
        body, headers = http_json(server + "/v1/completions", {"model": model, "prompt": p, "max_tokens": n_tokens,
                                                                "temperature": 1.0, "seed": len(out)})
        version = int(headers.get("x-uzip-weight-version", -1))
        text = body["choices"][0]["text"]
        out.append({"prompt": p, "text": text, "version": version, "reward": reward(text)})
    return out


def train_step(policy, tok, opt, batch: list[dict]) -> float:
    import torch

    rewards = torch.tensor([r["reward"] for r in batch])
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    loss = 0.0
    for r, a in zip(batch, adv):
        ids = tok(r["prompt"] + r["text"], return_tensors="pt").input_ids
        logp = -policy(ids, labels=ids).loss  # mean token log-likelihood
        loss = loss - a * logp / len(batch)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir the engines serve")
    ap.add_argument("--coordinator", help="HOST:PORT of `uzip coordinator`")
    ap.add_argument("--server", help="a vLLM server started with --comm-plugin uzip")
    ap.add_argument("--spawn", action="store_true", help="start a coordinator and a vLLM server here")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import uzip_serve
    from uzip_vllm import demo

    with ExitStack() as stack:
        if args.spawn:
            import tempfile

            from benchmarks import realdata

            args.model = args.model or str(realdata.tiny_dir())
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="uzip-rl-")))
            args.coordinator = demo.start_coordinator(stack, work)
            print(f"starting vllm serve {args.model} --comm-plugin uzip ...", flush=True)
            args.server = demo.start_server(stack, args.model, work, coordinator=args.coordinator, name="rollout")
        if not (args.model and args.coordinator and args.server):
            ap.error("give --model, --coordinator and --server, or --spawn")

        tok = AutoTokenizer.from_pretrained(args.model)
        policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)  # fp32 master weights
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
        # The engines hold bf16: push casts after the lossless transfer. Push what the checkpoint
        # names (tied lm_head is not a checkpoint tensor here).
        names = set(demo.load_state(args.model))

        for step in range(1, args.steps + 1):
            batch = rollouts(args.server, args.model, args.tokens)
            loss = train_step(policy, tok, opt, batch)
            t0 = time.perf_counter()
            state = {k: v.detach().to(torch.bfloat16) for k, v in policy.state_dict().items() if k in names}
            res = uzip_serve.push_weights(state, coordinator=args.coordinator, progress=False)
            demo.wait_version(args.server, res.version)
            seen = sorted({r["version"] for r in batch})
            print(f"step {step}: rollouts from version(s) {seen}, mean reward {sum(r['reward'] for r in batch) / len(batch):.2f}, "
                  f"loss {loss:.3f} -> pushed v{res.version} ({res.raw_bytes / 1e6:.0f} MB, "
                  f"ratio {res.ratio:.3f}) and serving it {time.perf_counter() - t0:.2f} s later", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
