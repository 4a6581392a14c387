"""What an extra node costs in a CUDA graph (docs/gpu.md, round 10).

Graphs of trivial fill (zero_) and add kernels, each replayed 200 times with CUDA events around
the replay; prints the median per graph shape. Run on a GPU machine:

    python3 benchmarks/cuda_graph_node_cost.py
"""
import torch


def timed(n_fill: int, n_k: int = 1, reps: int = 200) -> float:
    """Median GPU time (us) of replaying a graph of n_fill fills and n_k small kernels."""
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
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000)
    ts.sort()
    return ts[len(ts) // 2]


if __name__ == "__main__":
    torch.cuda.init()
    for nf, nk in [(0, 1), (1, 1), (2, 1), (0, 2), (2, 2), (0, 4)]:
        print(f"fills={nf} kernels={nk}: graph {timed(nf, nk):.1f} us")
