"""One rank of an async-save run that is killed while a rank's background write is still
going (tests/test_distributed_async.py). Args: checkpoint dir, JSON out. Env as torchrun's."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import epochal
import epochal.integrations.dcp.storage as storage


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def main() -> int:
    ckpt, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with epochal.Checkpointer(ckpt, async_save=True) as ck:
        ck.save(1, {"model": model, "step": 1})
        ck.wait()
        if rank == 0:
            with open(out, "w") as f:
                json.dump({k: v.tolist() for k, v in model.state_dict().items()}, f)
        if rank == 1:  # rank 1's background write of step 2 never finishes
            real = storage.write_native

            def slow(path, blobs, **kw):  # type: ignore[no-untyped-def]
                say(f"rank {rank} stalling in the background write of {os.path.basename(path)}")
                time.sleep(120)
                return real(path, blobs, **kw)

            storage.write_native = slow
        with torch.no_grad():
            model.weight.add_(1.0)
        ck.save(2, {"model": model, "step": 2})
        say(f"rank {rank} save 2 returned")
        ck.wait()  # blocks: rank 1's write is stalled; the test kills the ranks here
    say(f"rank {rank} finished")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("EPOCHAL_QUIET", "1")
    sys.exit(main())
