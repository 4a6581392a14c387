"""What `register()` installs into vLLM, and how `--comm-plugin uzip` reaches every process.

No vLLM hook hands a plugin the argument parser, so the flags are added by wrapping
`EngineArgs.add_cli_args` (vLLM loads general plugins first, then calls it). The parsed
choice is carried to the engine core and the workers in `additional_config["uzip"]`, never
only through the environment: `additional_config` survives into every worker and is part
of `VllmConfig.compute_hash()`, so a compiled graph made without the plugin is never reused
with it (and the other way round).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from typing import Any

logger = logging.getLogger("uzip_vllm")

CONFIG_KEY = "uzip"
WORKER_EXTENSION = "uzip_vllm.weight_transfer.UzipWorkerExtension"
_registered = False
# Set in the API server process once `--comm-plugin uzip` is parsed (see _apply_flags).
SERVER_CONFIG: dict[str, Any] | None = None


def add_flags(parser) -> None:
    group = parser.add_argument_group(
        title="uzip-serve", description="Lossless compressed communication (uzip-serve). "
        "Off unless --comm-plugin uzip is given.")
    group.add_argument("--comm-plugin", choices=["none", "uzip"], default="none",
                       help="Communication plugin. 'uzip': versioned weight pushes through a uzip coordinator "
                            "(with --uzip-coordinator) and the compressed tensor-parallel all-reduce.")
    group.add_argument("--uzip-coordinator", metavar="HOST:PORT", default=None,
                       help="The uzip coordinator (`uzip coordinator --listen ...`) this server takes weight "
                            "versions from. Each worker registers as a receiver.")
    group.add_argument("--uzip-token-file", metavar="FILE", default=None,
                       help="File holding the coordinator's auth token (read by each worker; the token itself "
                            "never enters the vLLM config).")
    group.add_argument("--uzip-receiver-id", metavar="ID", default=None,
                       help="Prefix of this server's receiver ids (one per worker: ID-dp0-pp0-tp0, ...). "
                            "Default: vllm-<hostname>-<pid>.")
    group.add_argument("--uzip-p2p-host", metavar="HOST", default="127.0.0.1",
                       help="Address the workers' P2P listeners bind to and advertise to the coordinator.")
    group.add_argument("--uzip-allreduce", choices=["adaptive", "always", "never"], default="adaptive",
                       help="Compressed TP all-reduce: 'adaptive' compresses only where the measured link, "
                            "codec speed and ratio say it pays; 'never' keeps vLLM's all-reduce.")


def config_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The `additional_config["uzip"]` entry for parsed flags; None without `--comm-plugin uzip`."""
    if getattr(args, "comm_plugin", "none") != "uzip":
        for flag in ("uzip_coordinator", "uzip_token_file", "uzip_receiver_id"):
            if getattr(args, flag, None):
                raise ValueError(f"--{flag.replace('_', '-')} needs --comm-plugin uzip")
        return None
    token_file = getattr(args, "uzip_token_file", None)
    if token_file and not os.path.isfile(token_file):
        raise ValueError(f"--uzip-token-file {token_file}: no such file")
    return {
        "coordinator": getattr(args, "uzip_coordinator", None),
        "token_file": os.path.abspath(token_file) if token_file else None,
        "receiver_id": getattr(args, "uzip_receiver_id", None) or f"vllm-{socket.gethostname()}-{os.getpid()}",
        "p2p_host": getattr(args, "uzip_p2p_host", "127.0.0.1"),
        "allreduce": getattr(args, "uzip_allreduce", "adaptive"),
    }


def engine_kwargs(*, coordinator: str | None = None, token_file: str | None = None, receiver_id: str | None = None,
                  p2p_host: str = "127.0.0.1", allreduce: str = "adaptive") -> dict[str, Any]:
    """The keyword arguments that turn the plugin on for the offline `vllm.LLM(...)` API."""
    ns = argparse.Namespace(comm_plugin="uzip", uzip_coordinator=coordinator, uzip_token_file=token_file,
                            uzip_receiver_id=receiver_id, uzip_p2p_host=p2p_host, uzip_allreduce=allreduce)
    cfg = config_from_args(ns)
    kwargs: dict[str, Any] = {"additional_config": {CONFIG_KEY: cfg}, "worker_extension_cls": WORKER_EXTENSION}
    if coordinator:
        kwargs["weight_transfer_config"] = {"backend": "uzip"}
    return kwargs


def _apply_flags(engine_args, args: argparse.Namespace):
    global SERVER_CONFIG
    cfg = config_from_args(args)
    if cfg is None:
        return engine_args
    engine_args.additional_config = {**(engine_args.additional_config or {}), CONFIG_KEY: cfg}
    if cfg["coordinator"]:
        from vllm.config.weight_transfer import WeightTransferConfig

        wtc = engine_args.weight_transfer_config
        backend = wtc.get("backend") if isinstance(wtc, dict) else getattr(wtc, "backend", None)
        if wtc is not None and backend != "uzip":
            raise ValueError(f"--uzip-coordinator uses the 'uzip' weight-transfer backend, but "
                             f"--weight-transfer-config asks for {backend!r}")
        engine_args.weight_transfer_config = WeightTransferConfig(backend="uzip")
    if engine_args.worker_extension_cls not in ("", WORKER_EXTENSION):
        raise ValueError(f"--comm-plugin uzip installs its worker extension, but --worker-extension-cls is "
                         f"already {engine_args.worker_extension_cls!r}")
    engine_args.worker_extension_cls = WORKER_EXTENSION
    if cfg["allreduce"] != "never":
        _prepare_compilation(engine_args)
    SERVER_CONFIG = cfg
    logger.info("uzip: on (coordinator=%s, receiver ids %s-*)", cfg["coordinator"], cfg["receiver_id"])
    return engine_args


def _prepare_compilation(engine_args) -> None:
    """The compressed all-reduce must stay reachable and outside CUDA graphs
    (uzip_vllm.allreduce): no all-reduce+RMSNorm fusion, and its op splits the graphs."""
    from vllm.config import CompilationConfig

    from uzip_vllm.allreduce import OP_NAME

    cc = engine_args.compilation_config
    if isinstance(cc, dict):
        cc = CompilationConfig(**cc)
    cc.pass_config.fuse_allreduce_rms = False
    if cc.splitting_ops is not None and OP_NAME not in cc.splitting_ops:
        cc.splitting_ops.append(OP_NAME)
    engine_args.compilation_config = cc


def _install_worker_hooks() -> None:
    """In each worker, once its process groups exist, put the TP all-reduce on the ring."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    orig = WorkerWrapperBase.init_device

    def init_device(self):
        orig(self)
        cfg = (self.vllm_config.additional_config or {}).get(CONFIG_KEY) if self.vllm_config else None
        if cfg and cfg.get("allreduce", "adaptive") != "never":
            from vllm.config import set_current_vllm_config

            from uzip_vllm import allreduce

            with set_current_vllm_config(self.vllm_config):
                allreduce.install_on_tp_group(cfg["allreduce"])
        # Compressed PP activation send/recv (issue 12): uzip_vllm.pipeline, collective over the PP group.
        if cfg: from uzip_vllm import pipeline; pipeline.install_on_pp_group(cfg)  # noqa: E701,E702

    WorkerWrapperBase.init_device = init_device


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from uzip_vllm import check_vllm_version

    check_vllm_version()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.engine.arg_utils import EngineArgs

    # Lazy, like vLLM's own backends: ucxx/grpc load only in a process that uses the backend.
    if "uzip" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("uzip", "uzip_vllm.weight_transfer", "UzipWeightTransferEngine")
    if "uzip" not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine("uzip", "uzip_vllm.weight_transfer",
                                                     "UzipTrainerWeightTransferEngine")

    orig_add = EngineArgs.add_cli_args

    def add_cli_args(parser, *a, **kw):
        parser = orig_add(parser, *a, **kw)
        if not any(o == "--comm-plugin" for act in parser._actions for o in act.option_strings):
            add_flags(parser)
        return parser

    EngineArgs.add_cli_args = staticmethod(add_cli_args)

    orig_from = EngineArgs.from_cli_args.__func__

    def from_cli_args(cls, args):
        return _apply_flags(orig_from(cls, args), args)

    EngineArgs.from_cli_args = classmethod(from_cli_args)

    # The API server's routes and version gate. vLLM loads endpoint plugins only when named in
    # VLLM_PLUGINS; `--comm-plugin uzip` is the operator's explicit opt-in here, so ours joins
    # the list whenever the flag was parsed in this process (and only then).
    import vllm.plugins as vp

    orig_load = vp.load_endpoint_plugins

    def load_endpoint_plugins(supported_tasks=None):
        plugins = orig_load(supported_tasks)
        if SERVER_CONFIG is not None and not any(getattr(p, "name", "") == "uzip" for p in plugins):
            from uzip_vllm.server import UzipEndpointPlugin

            plugins.append(UzipEndpointPlugin())
        return plugins

    vp.load_endpoint_plugins = load_endpoint_plugins

    # KV-cache transfer for disaggregated prefill/decode (issue 8): `--kv-transfer-config
    # '{"kv_connector":"UzipConnector",...}'`. Registered lazily, inert unless named.
    from uzip_vllm import kv_connector; kv_connector.register()  # noqa: E702

    _install_worker_hooks()
