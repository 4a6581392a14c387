"""The compressed tensor-parallel all-reduce inside vLLM (`--comm-plugin uzip`).

Patch point (vLLM 0.32): `GroupCoordinator._all_reduce_out_place` of the *TP group only*,
the method every `tensor_model_parallel_all_reduce` ends in (directly on CPU, through the
`vllm.all_reduce` custom op on CUDA). It is replaced, on that one group object, by a call to
the `uzip::all_reduce` custom op, which torch.compile treats as opaque: Dynamo does not trace
into the ring (its Python, sockets and codec calls), it only sees one op with a fake
implementation, and the op runs eagerly on every forward.

The op runs `uzip_serve.collectives`' ring communicator on the group's gloo (CPU) or NCCL
(CUDA) group. Its adaptive switch sends small messages and fast links to the group's own
all-reduce (the original method, passed as `native_all_reduce`), so on shared memory or
NVLink nothing gets slower; `--uzip-allreduce always` forces the compressed ring.

Compile and graph interplay (set by `plugin._apply_flags`):
- the mode enters `additional_config["uzip"]`, hence the compile-cache key;
- the all-reduce + RMSNorm fusion pass is turned off (it would replace the all-reduce with a
  fused kernel that never reaches the patch);
- CUDA graphs: the op is listed in `splitting_ops`, so piecewise graphs are cut around it
  and it runs outside them. The ring's message sizes depend on the data, so it is not
  capture-safe as a whole, although the GPU codec has a capture-safe variant.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("uzip_vllm")

OP_NAME = "uzip::all_reduce"
_COMMS: dict[str, object] = {}


@torch.library.custom_op(OP_NAME, mutates_args=())
def _uzip_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = _COMMS[group_name].all_reduce(x)
    # A custom op's output may not alias its input (the native fallback can hand back the
    # input it reduced in place).
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        out = out.clone()
    return out


@_uzip_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def install_on_tp_group(mode: str) -> bool:
    """Called on every TP worker after its device and process groups exist (collective:
    building the communicator agrees on settings across the group). Returns whether the
    patch is in place."""
    from vllm.distributed.parallel_state import get_tp_group

    from uzip_serve import collectives

    tp = get_tp_group()
    if tp.world_size == 1 or mode == "never":
        return False
    native = tp._all_reduce_out_place  # the bound original: the adaptive fallback
    group = tp.device_group if tp.device_group is not None else tp.cpu_group
    config = collectives.RingConfig.from_env(compression={"always": "on", "adaptive": "auto"}[mode])
    _COMMS[tp.unique_name] = collectives.build_communicator(group, native_all_reduce=native, config=config)
    name = tp.unique_name

    def _all_reduce_out_place(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.uzip.all_reduce(x, name)

    tp._all_reduce_out_place = _all_reduce_out_place
    logger.info("uzip: TP all-reduce of %s (%d ranks) goes through %s, mode %s", name, tp.world_size, OP_NAME, mode)
    return True


def counters() -> dict:
    from uzip_serve import collectives

    return collectives.counters()
