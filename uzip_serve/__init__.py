"""uzip-serve: lossless compression for LLM serving and RL weight-sync traffic.

Public API (kept small; everything heavy is imported on first use)::

    frame = uzip_serve.compress(tensor)          # bytes-like uzip frame
    tensor = uzip_serve.decompress(frame)        # the same bits back
    n = uzip_serve.compress_into(tensor, buf)    # into a preallocated buffer
    uzip_serve.max_compressed_size(nbytes, dtype)
    uzip_serve.push_weights(state_dict, coordinator="host:50051")   # RL weight sync
    uzip_serve.WeightReceiver(model, coordinator=..., receiver_id=...)

`import uzip_serve` loads no compiled extension, torch, CuPy or UCX.
"""

from uzip_serve.format import FORMAT_VERSION, FrameError

__version__ = "0.2.0"

__all__ = [
    "FORMAT_VERSION",
    "FrameError",
    "compress",
    "compress_into",
    "decompress",
    "max_compressed_size",
    "read_header",
    "push_weights",
    "push_weights_async",
    "PushError",
    "PushResult",
    "WeightReceiver",
]


def __getattr__(name):
    # Lazy: the codec pulls in numpy/torch, which `import uzip_serve` must not.
    if name in ("compress", "compress_into", "decompress", "max_compressed_size", "read_header"):
        from uzip_serve import codec

        return getattr(codec, name)
    if name in ("push_weights", "push_weights_async", "PushError", "PushResult", "WeightReceiver"):
        from uzip_serve import weights

        return getattr(weights, name)
    raise AttributeError(f"module 'uzip_serve' has no attribute {name!r}")
