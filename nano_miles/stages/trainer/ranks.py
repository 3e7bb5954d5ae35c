"""The trainer as several processes (`trainer.strategy = "fsdp2"`): starting them, and rank 0 telling the others.

Library module used by `procs/trainer.py`. supervisord starts one trainer program, as always; with
fsdp2 that process becomes the launcher (`launch`): torch's elastic agent, as `torchrun --standalone
--nproc-per-node N` runs it, started in-process so the program still exits 0 / 2 / 143 as the stage
contract says (the torchrun command maps every failure of a rank to 1). Each rank runs
`procs/trainer.py` again with torchrun's environment (RANK, WORLD_SIZE, ...).

Rank 0 is the stage: it pulls batches, talks to the producer and the engines, writes checkpoints and
metrics. The other ranks hold their shards of the model and wait for rank 0 to name the next thing
all ranks do together (`Ranks.together`: a step, a weight push, a checkpoint, a load, a probe). The
names travel over a gloo group of their own with a long timeout: rank 0 may wait minutes for data
while the others wait for its next word, and the model's collectives (NCCL on GPUs, with its
watchdog) are never left waiting that long.

A rank that dies ends the program: the agent stops the others (SIGTERM, then SIGKILL) and the
launcher exits 1; supervisord starts it again and it resumes from its checkpoint. Ranks other than 0
ignore SIGTERM: rank 0 stops them once its last step is checkpointed (which needs them), and each
leaves by itself within a second of rank 0's end (`leave_with`).
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

log = logging.getLogger("trainer")

COMMAND_TIMEOUT = timedelta(hours=2)  # the longest rank 0 may spend alone: pulls (900 s), peers (600 s), saves
SHUTDOWN_TIMEOUT_S = 50  # after SIGTERM: the last step's checkpoint, below supervisord's stopwaitsecs (60)
EXIT = "exit"


def is_launcher(strategy: str) -> bool:
    """Is this process the one supervisord started for an fsdp2 trainer (not yet one of its ranks)?"""
    return strategy == "fsdp2" and "RANK" not in os.environ


def launch(script: str, argv: list[str], world_size: int) -> int:
    """Run `script argv` as `world_size` ranks on this host; the program's exit code: rank 0's when it
    refused (2) or finished (0), 143 after SIGTERM, 1 when a rank failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ["NANOMILES_STAGE_PID"] = str(os.getpid())  # whom rank 0's heartbeat names: supervisord's child
    # torch before 2.13 has no `shutdown_timeout` (its ranks get 30 s between SIGTERM and SIGKILL)
    has_grace = "shutdown_timeout" in inspect.signature(LaunchConfig).parameters
    grace = {"shutdown_timeout": SHUTDOWN_TIMEOUT_S} if has_grace else {}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0",  # --standalone: a free port
                          max_restarts=0, monitor_interval=0.1, **grace)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    try:
        elastic_launch(config, entrypoint=sys.executable)(script, *argv)
        return 0
    except ChildFailedError as e:
        # rank 0's own exit (2, 143); killed, or not among the failures (another rank failed while it
        # ran): 1
        code = {f.local_rank: f.exitcode for f in e.failures.values()}.get(0, 1)
        return code if code > 0 else 1
    except SignalException as e:
        return 128 + e.sigval


class Ranks:
    """This process's place among the trainer's ranks, and what they do together (`work`: an object
    every rank builds alike; a command is the name of one of its methods)."""

    def __init__(self, work, rank: int = 0, world: int = 1, group=None):
        self.work, self.rank, self.world, self.group = work, rank, world, group

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def tell(self, command: str, *args) -> None:
        """Rank 0: name what the other ranks do next (they do it as soon as they hear it)."""
        if self.world > 1:
            import torch.distributed as dist
            dist.broadcast_object_list([(command, args)], src=0, group=self.group)

    def together(self, command: str, *args, **here):
        """Rank 0: every rank runs `work.<command>(*args)`, this one with `here` too (what only it has,
        e.g. a file it has read already); this rank's result."""
        self.tell(command, *args)
        return getattr(self.work, command)(*args, **here)

    def serve(self) -> int:
        """A rank other than 0: do what rank 0 names until it says `exit`; its exit code."""
        import torch.distributed as dist
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=self.group)
            command, args = message[0]
            if command == EXIT:
                return args[0]
            try:
                getattr(self.work, command)(*args)
            except self.work.RETRIED.get(command, ()) as e:  # rank 0 met it too, and tries something else next
                log.warning("%s failed on rank %d: %s", command, self.rank, e)

    def finish(self, code: int) -> None:
        """Rank 0, leaving: the other ranks leave with `code`."""
        self.tell(EXIT, code)


def join(device: str) -> tuple[int, object]:
    """Join the ranks torchrun's environment names: (world size, the command group). The model's
    collectives use the default group: NCCL when the trainer is on a GPU, gloo on the CPU."""
    import torch
    import torch.distributed as dist

    from nano_miles.run.process import die_with_parent
    die_with_parent(signal.SIGKILL)  # a launcher gone (killed with its process group): its ranks at once
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 decides when the ranks stop
    is_cuda = device.startswith("cuda")
    if is_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if is_cuda else "gloo")
    group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=group)
    if rank != 0:
        threading.Thread(target=leave_with, args=(pids[0],), daemon=True, name="rank0-watch").start()
    return world, group


def leave_with(pid: int) -> None:
    """A rank other than 0: exit within a second of rank 0's end. A rank waiting for rank 0's next
    word would otherwise wait for the agent's SIGKILL, 30 s later: gloo does not notice a peer that
    died in the middle of nothing."""
    while True:
        time.sleep(0.5)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "gone"
        if state in ("gone", "Z", "X"):  # a zombie is dead: its parent, the agent, has not reaped it yet
            log.error("rank 0 (pid %d) is gone: leaving", pid)
            # 0: the program's status is rank 0's (the agent reports it), and rank 0 may have finished
            # a moment before its word to leave reached this rank
            os._exit(0)


def load_policy(cfg, rank: int = 0):
    """The policy as every rank loads it, on the trainer's device: seeded alike, so that LoRA's new
    adapters are the same on every rank. Rank 0, whose GPU SGLang shares, loads once SGLang holds its share."""
    import torch
    from transformers import AutoModelForCausalLM

    from nano_miles.stages.trainer import lora, peers
    if rank == 0:
        peers.wait_for_engine_share(cfg)
    torch.manual_seed(cfg.run.seed)
    model = AutoModelForCausalLM.from_pretrained(str(cfg.model_dir), dtype=torch.float32)
    return lora.wrap(model, cfg.trainer).to(cfg.trainer.device)  # trainer.lora_rank > 0: adapters train


def serve(cfg, tokenizer, rank: int, world: int, group) -> int:
    """A rank other than 0: its model and learner, then what rank 0 names until it leaves; rank 0's
    exit code."""
    import torch

    from nano_miles.stages.trainer.learner import make_learner
    from nano_miles.stages.trainer.sharded import Work
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt="%H:%M:%S",
                        format=f"%(asctime)s trainer.rank{rank} %(levelname)s %(message)s")
    torch.set_num_threads(cfg.trainer.num_threads)
    model = load_policy(cfg, rank)
    return Ranks(Work(model, make_learner(cfg, model, tokenizer), rank), rank, world, group).serve()
