"""What opening the side channel connects, on a gloo job of ``WORLD_SIZE`` ranks: ``side_channel_job.py`` (started
on every rank by ``tests.helpers.start_ranks``). Each rank prints one JSON line: the sockets it holds once the job's
group exists, once the side channel is open, and after one exchange on it, with that exchange's result."""

import json
import os
from datetime import timedelta

import torch.distributed as dist

from lightning_ddp_plus.sync.side_channel import SideChannel


def sockets() -> int:
    """The sockets this process holds (a connection to a peer is one)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return held


def main() -> None:
    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    dist.barrier()  # every rank's connections of the job's group are made
    joined = sockets()
    channel = SideChannel(timeout=timedelta(seconds=60))
    channel.start(channel.timeout)
    opened = sockets()
    dist.barrier()  # every rank counted before any exchange on the channel (a peer's first one connects to this rank)
    maximum = channel.maximum([rank])
    used = sockets()
    print(json.dumps({"rank": rank, "joined": joined, "opened": opened, "used": used, "maximum": maximum}), flush=True)
    channel.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
