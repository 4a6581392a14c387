"""The `uzip` weight-transfer backend: vLLM workers as uzip coordinator receivers.

Worker side. Each worker owns a `uzip_serve.WeightReceiver` that registers with the
coordinator under `<prefix>-dp<d>-pp<p>-tp<t>`. It expects exactly the tensors of the
served checkpoint (names, full shapes and dtypes read from the safetensors headers): vLLM's
own weight loaders do the tensor-parallel slicing (fused QKV, vocab padding, replicated KV
heads), so every TP rank receives full tensors, and the coordinator chains the ranks
(relaying) so the trainer's link carries each byte once. Versions are staged in host memory,
beside the served weights; nothing touches the model until the API server applies a
committed version, through vLLM's own weight-update verbs:

    uzip_pin(v)  ->  start_weight_update  ->  update_weights({"version": v})  ->  finish_weight_update

`start`/`finish` wrap vLLM's layerwise reload (writing CPU parameters in place does not
work: vLLM repacks them), and `start_weight_update` refuses before touching the model when
no committed version is pinned, so a failed swap leaves the old weights served.

Trainer side. `UzipTrainerWeightTransferEngine` is the counterpart registered in vLLM's
trainer factory; it is `uzip_serve.push_weights` over a `WeightSource`.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from uzip_vllm.plugin import CONFIG_KEY

logger = logging.getLogger("uzip_vllm")

_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def checkpoint_dir(model: str, revision: str | None = None) -> Path:
    if os.path.isdir(model):
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, allow_patterns=["*.safetensors", "*.json"],
                                  local_files_only=True))


def checkpoint_specs(model: str, revision: str | None = None) -> dict[str, torch.Tensor]:
    """name -> a meta tensor of the checkpoint tensor's shape and dtype (safetensors headers only)."""
    files = sorted(checkpoint_dir(model, revision).glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"uzip: {model} has no .safetensors files; the uzip backend needs them to know which "
                           "tensors a push must carry")
    specs = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in _ST_DTYPES:
                raise RuntimeError(f"uzip: {f.name}:{name} has dtype {meta['dtype']}, not supported")
            specs[name] = torch.empty(meta["shape"], dtype=_ST_DTYPES[meta["dtype"]], device="meta")
    return specs


def read_token(token_file: str | None) -> str | None:
    if not token_file:
        return None
    return Path(token_file).read_text().strip() or None


def refresh_tied_embeddings(model: torch.nn.Module) -> int:
    """Re-derives the state of modules that share their weight with a reloaded one.

    vLLM ties `lm_head` to `embed_tokens` by sharing the Parameter. The layerwise reload
    updates that Parameter through `embed_tokens`, but nothing is loaded into `lm_head`, so
    its derived state is not rebuilt: on CPU that is the packed GEMM weight, and the logits
    kept coming from the old embeddings (measured on vLLM 0.32 CPU with Gemma-3: the reloaded
    model's greedy text differed from a fresh engine's while every parameter was equal).
    Returns how many modules were refreshed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: dict[int, torch.nn.Module] = {}
    refreshed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.numel() == 0:
            continue
        first = owners.setdefault(id(weight), module)
        if first is not module and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
            module.quant_method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


@dataclass
class UzipInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: workers registered with the coordinator when the engine started."""


@dataclass
class UzipUpdateInfo(WeightTransferUpdateInfo):
    version: int


class UzipWeightTransferEngine(WeightTransferEngine[UzipInitInfo, UzipUpdateInfo]):
    init_info_cls = UzipInitInfo
    update_info_cls = UzipUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        cfg = (vllm_config.additional_config or {}).get(CONFIG_KEY)
        if not cfg or not cfg.get("coordinator"):
            raise RuntimeError("the 'uzip' weight-transfer backend needs `--comm-plugin uzip --uzip-coordinator "
                               "HOST:PORT` (offline: `LLM(..., **uzip_vllm.engine_kwargs(coordinator=...))`)")
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        from uzip_serve.weights import WeightReceiver

        pc = vllm_config.parallel_config
        self.receiver_id = (f"{cfg['receiver_id']}-dp{pc.data_parallel_rank}-pp{get_pp_group().rank_in_group}"
                            f"-tp{get_tp_group().rank_in_group}")
        specs = checkpoint_specs(self.model_config.model, self.model_config.revision)
        from uzip_serve.p2p.config import TransportConfig

        # A worker shares its cores with vLLM's own threads. So: UCX's thread progress mode,
        # whose completions arrive as Python futures and whose idle wait costs no CPU (the
        # blocking mode, the default elsewhere, was measured spinning ~0.9 core in an idle
        # worker between pushes); and a 30 s deadline, not 10 s, because a relay's connect or
        # chunk may wait for a busy core (the coordinator's lease still notices a dead worker
        # within seconds).
        config = TransportConfig.from_env(
            progress_mode=os.environ.get("UZIP_P2P_PROGRESS", "thread"),
            deadline_s=float(os.environ.get("UZIP_P2P_DEADLINE_S", "30")))
        self.receiver = WeightReceiver(specs, coordinator=cfg["coordinator"], receiver_id=self.receiver_id,
                                       token=read_token(cfg.get("token_file")), host=cfg.get("p2p_host", "127.0.0.1"),
                                       config=config)
        self.receiver.start()
        self._pinned: tuple[int, dict[str, torch.Tensor]] | None = None
        self.applied_version = 0
        logger.info("uzip: %s registered with %s at %s, expecting %d tensors", self.receiver_id, cfg["coordinator"],
                    self.receiver.address, len(specs))

    # -- the two-phase apply, driven by the API server (uzip_vllm.server) --
    def pin(self, version: int, timeout_s: float) -> int:
        """Waits until the receiver holds committed `version` (its watch may lag the server's by a
        moment) and pins it, so a newer commit cannot swap it out before it is applied. Returns the
        receiver's committed version: `version` when pinned."""
        deadline = time.monotonic() + timeout_s
        while self.receiver.version < version and time.monotonic() < deadline:
            time.sleep(0.02)
        with self.receiver.reading() as held:
            self._pinned = (held, self.receiver.tensors) if held == version else None
        return held

    def unpin(self) -> None:
        self._pinned = None

    # -- vLLM's weight-update verbs --
    def init_transfer_engine(self, init_info: UzipInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        if self._pinned is None:  # refuse before the layerwise reload touches the model
            raise RuntimeError(f"uzip: {self.receiver_id} has no committed version pinned; pushes go through the "
                               "coordinator (uzip_serve.push_weights) and the server applies them on commit")
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: UzipUpdateInfo) -> None:
        if self._pinned is None or self._pinned[0] != update_info.version:
            raise RuntimeError(f"uzip: asked to load version {update_info.version}, pinned "
                               f"{self._pinned[0] if self._pinned else None}")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(iter(self._pinned[1].items()))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_embeddings(self.model)
        version = self._pinned[0]
        self._pinned = None
        self.applied_version = version
        with self.receiver.reading() as held:
            if held == version:  # the model has its own copy now; a newer commit keeps its staging
                self.receiver.release()

    def shutdown(self) -> None:
        self.receiver.stop()


class UzipWorkerExtension:
    """Methods vLLM adds to each worker (`worker_extension_cls`) for the API server's
    `collective_rpc` calls. `self` is the vLLM worker."""

    def uzip_counters(self) -> dict[str, Any]:
        """The compressed all-reduce's counters in this worker (uzip_serve.collectives)."""
        from uzip_vllm import allreduce

        return allreduce.counters()

    def _uzip(self) -> UzipWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, UzipWeightTransferEngine):
            raise RuntimeError("uzip weight transfer is not enabled on this worker")
        return engine

    def uzip_status(self) -> dict[str, Any]:
        e = self._uzip()
        return {"receiver_id": e.receiver_id, "address": e.receiver.address, "committed": e.receiver.version,
                "applied": e.applied_version, "last_error": e.receiver.last_error}

    def uzip_pin(self, version: int, timeout_s: float = 30.0) -> int:
        return self._uzip().pin(version, timeout_s)

    def uzip_unpin(self) -> None:
        self._uzip().unpin()

    def uzip_apply(self, version: int) -> int:
        """Loads the pinned version through vLLM's weight-update verbs; returns it."""
        self.start_weight_update()
        self.update_weights({"version": version})
        self.finish_weight_update()
        return self._uzip().applied_version


@dataclass
class UzipTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "uzip"
    coordinator: str = "127.0.0.1:50051"
    token_file: str | None = None
    timeout_s: float = 300.0
    progress: bool = False


class UzipTrainerWeightTransferEngine(TrainerWeightTransferEngine[UzipTrainerInitInfo]):
    """`send_weights()` pushes the source as the next version. The coordinator commits it only
    when every registered receiver holds it whole, and each vLLM server then swaps on its own:
    the inference-side client is not needed."""

    init_info_cls = UzipTrainerInitInfo

    def __init__(self, *, client=None, source=None, is_sender: bool = True, info: UzipTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.last_result = None

    @classmethod
    def trainer_init(cls, init_info: UzipTrainerInitInfo, *, client=None, source=None):
        return cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)

    def send_weights(self) -> None:
        if self.source is None:
            raise ValueError("uzip: send_weights needs a WeightSource (trainer_init(..., source=...))")
        if not self.is_sender:  # materializing is a collective: every rank iterates
            for _ in self.source:
                pass
            return
        from uzip_serve.weights import push_weights

        self.last_result = push_weights(iter(self.source), coordinator=self.info.coordinator,
                                        token=read_token(self.info.token_file), timeout=self.info.timeout_s,
                                        progress=self.info.progress)


