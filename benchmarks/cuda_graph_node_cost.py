"""What a CUDA graph's nodes cost, and what its launch adds to an event-timed replay
(docs/gpu.md, rounds 10 and 11).

Graphs of trivial fill (zero_) and add kernels, each replayed 200 times and timed two ways
(benchmarks/codec_gpu.py): with the GPU idle at the start event, so the host's graph launch is
in the time (time_ms, "host-paced"), and queued behind a spin kernel, so the events bracket the
GPU's work alone (gpu_time_ms). Prints the median per graph shape. Run on a GPU machine:

    python3 -m benchmarks.cuda_graph_node_cost
"""
import torch

from benchmarks.codec_gpu import gpu_time_ms, time_ms


def graph(n_fill: int, n_k: int) -> tuple:
    """A graph of n_fill fills and n_k small kernels, and the buffers it writes (which must
    live as long as it is replayed)."""
    s = torch.cuda.Stream()
    bufs = [torch.empty(130, dtype=torch.int64, device="cuda") for _ in range(n_fill)]
    x = torch.empty(1 << 10, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):  # warm-up outside the capture
        for _ in range(3):
            for b in bufs:
                b.zero_()
            for _ in range(n_k):
                x.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for b in bufs:
            b.zero_()
        for _ in range(n_k):
            x.add_(1)
    return g, (bufs, x)


if __name__ == "__main__":
    torch.cuda.init()
    print(torch.cuda.get_device_name())
    for nf, nk in [(0, 1), (1, 1), (2, 1), (0, 2), (2, 2), (0, 4)]:
        g, _buffers = graph(nf, nk)
        paced = time_ms(lambda r: g.replay(), 200, warmup=3) * 1e3
        gpu, queued = gpu_time_ms(lambda r: g.replay(), 200, warmup=3)
        print(f"fills={nf} kernels={nk}: host-paced {paced:.1f} us, GPU time {gpu * 1e3:.1f} us (queued={queued})")
