"""Real tensors: bit-exact round trips and the compression ratios the codec promises.

The data come from benchmarks/realdata.py (prepared by `make setup`): trained MiniLM
weights and gradients, Gemma-3-270M weights, hidden states and KV cache on real text.
"""

import pytest
import torch

import uzip_serve as uz


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def flat(tensors, dtype):
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def ratio(t):
    frame = uz.compress(t)
    back = uz.decompress(frame)
    assert torch.equal(bits(back), bits(t)), "real tensor did not round-trip bit-exactly"
    return len(frame) / t.nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_minilm_weight_round_trips(realdata, dtype):
    for name, w in realdata("minilm_weights").items():
        if not w.is_floating_point():
            continue
        t = w.to(dtype)
        assert torch.equal(bits(uz.decompress(uz.compress(t))), bits(t)), name


def test_every_gemma_activation_and_gradient_round_trips(realdata):
    for name, t in {**realdata("gemma_activations"), **realdata("minilm_grads")}.items():
        assert torch.equal(bits(uz.decompress(uz.compress(t))), bits(t)), name


def test_gemma_weights_round_trip(realdata):
    w = realdata("gemma_weights")
    # The largest tensor (the tied embedding) and a sample of layer weights.
    names = sorted(w, key=lambda k: -w[k].numel())[:1] + sorted(w)[::25]
    for name in names:
        t = w[name]
        assert torch.equal(bits(uz.decompress(uz.compress(t))), bits(t)), name


# (what, max ratio) from the codec's acceptance table; each set is concatenated the way a
# weight-sync bucket would carry it.
def test_ratio_bf16_weights(realdata):
    weights = [t for t in realdata("minilm_weights").values() if t.is_floating_point()]
    assert ratio(flat(weights, torch.bfloat16)) <= 0.670


def test_ratio_fp32_weights(realdata):
    weights = [t for t in realdata("minilm_weights").values() if t.is_floating_point()]
    assert ratio(flat(weights, torch.float32)) <= 0.840


def test_ratio_fp16_weights(realdata):
    weights = [t for t in realdata("minilm_weights").values() if t.is_floating_point()]
    assert ratio(flat(weights, torch.float16)) <= 0.860


def test_ratio_bf16_kv_cache(realdata):
    act = realdata("gemma_activations")
    assert ratio(flat([v for k, v in sorted(act.items()) if k.startswith("kv.")], torch.bfloat16)) <= 0.700


def test_ratio_bf16_hidden_states(realdata):
    act = realdata("gemma_activations")
    assert ratio(flat([v for k, v in sorted(act.items()) if k.startswith("hidden.")], torch.bfloat16)) <= 0.720


def test_ratio_sparse_fp32_gradients(realdata):
    grads = realdata("minilm_grads")
    sparse = [v for k, v in grads.items() if k.startswith("sparse.")]
    assert sparse, "the prepared gradients have no sparse (embedding) gradient"
    t = flat(sparse, torch.float32)
    assert (t == 0).float().mean() > 0.5, "expected a gradient that is mostly exact zeros"
    assert ratio(t) <= 0.10


def test_ratio_random_bytes():
    gen = torch.Generator().manual_seed(0)
    for nbytes in (1 << 20, (1 << 20) + 13, 16 << 20):
        t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        assert ratio(t) <= 1.002
        assert ratio(t.view(torch.bfloat16) if nbytes % 2 == 0 else t) <= 1.002


def _compress_with(t, block_elems, substream):
    """A frame with other block and sub-stream sizes than compress() writes (the format allows
    any power of two in range; GPU-encoded frames use 512-symbol sub-streams)."""
    from uzip_serve import codec
    from uzip_serve import format as fmt

    out = bytearray(fmt.max_compressed_size(t.nbytes, str(t.dtype).removeprefix("torch."), ndim=t.dim(),
                                            block_elems=block_elems))
    end = codec._encode_host(t, memoryview(out), 1, block_elems=block_elems, substream_elems=substream)
    return bytes(out[:end])


@pytest.mark.parametrize("block_elems,substream", [(256, 64), (4096, 64), (8192, 8192), (65536, 512)])
def test_other_block_and_substream_sizes_round_trip(realdata, block_elems, substream):
    """The decoder's fast loop counts its safe rounds from the sub-stream length, and its pair
    and three-symbol tables depend on the data: run them on real tensors at every shape of
    stream the format allows, not only the default 1024-symbol ones."""
    acts = realdata("gemma_activations")
    weights = realdata("minilm_weights")
    cases = [flat(acts.values(), torch.bfloat16)[: 3 << 18],
             flat(weights.values(), torch.float32)[: 1 << 18],
             flat(weights.values(), torch.float16)[: 1 << 18]]
    for t in cases:
        frame = _compress_with(t, block_elems, substream)
        hdr = uz.read_header(frame)
        assert (hdr.block_elems, hdr.substream_elems) == (block_elems, substream)
        assert torch.equal(bits(uz.decompress(frame)), bits(t)), (t.dtype, block_elems, substream)
        if t.dtype == torch.bfloat16 and block_elems >= 4096:
            assert len(frame) < 0.75 * t.nbytes, "bf16 activations must still compress at these sizes"
