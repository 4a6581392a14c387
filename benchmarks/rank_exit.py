"""How a benchmark's rank process leaves torch.distributed: before the interpreter does.

A gloo process group that is still alive when Python finalizes aborts the process about
half the time on the 2-core VM ("terminate called without an active exception", exit -6):
its worker thread drops the last finished work, whose tensors need the GIL to be freed,
finalization refuses the GIL by ending the thread, and C++ terminates (gdb: the
pt_gloo_runloop thread in ~AsyncWork under PyThread_exit_thread). `destroy_process_group()`
alone does not prevent it: communicators, policies and closures still hold the group, some in
reference cycles that only the interpreter's last collection breaks. So the rank's own
function returns first (its locals go), then the groups are destroyed and the cycles
collected here, while the interpreter is whole; torch frees a group without the GIL, so its
threads finish their work and join.
"""

from __future__ import annotations

import gc


def release_process_groups() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
