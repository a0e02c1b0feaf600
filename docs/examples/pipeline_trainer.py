"""A pipeline-parallel trainer for any model, from pp-state, pp-comm, pp-schedules and pp-optim.

The model files beside it (hf_llama.py, hf_gpt2.py, sequential.py; hf_llama_cp.py, whose `CP`
splits each sequence over context-parallel ranks) say how their model splits into stages and
runs one microbatch (`build`, `forward_step`, `batches`); this file does the rest, in the order
that works: process groups -> schedule resolved -> model split for its placement, contracts
inferred -> chunks wrapped in pp-optim's DDP -> optimizer -> executor. Arguments: schedule
names (all by default; dualpipev-threads overlaps dualpipev's F&B steps in two threads),
--steps N (5 by default) and --distributed-optimizer; the pipeline is 2 stages, the rest of the
world context (the model file's `CP`, 1 by default) and data parallelism. One process group
serves every schedule; rank 0 prints {schedule: [loss of each step]}. Started by torchrun or as
plain processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), a rank that dies is named by
the survivors (`watch_pipeline`), who leave within a minute.
"""

import datetime
import sys
from typing import Any

import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator
from pp_optim import DDPConfig, DistributedDataParallel, OptimizerConfig, get_megatron_optimizer
from pp_schedules import ScheduleConfig, get_forward_backward_func, resolve_schedule, watch_pipeline
from pp_state import ParallelConfig, ParallelState, collective

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev", "dualpipev-threads")
# A peer silent in a transfer or collective is an error after TIMEOUT (see the page)
STEPS, MICROBATCHES, TIMEOUT = 5, 4, datetime.timedelta(seconds=20)
# Megatron's adam is AdamW: decoupled weight decay 0.01 (its default, written out here) on
# matrices only; clip_grad=1.0 by default, inside step()
OPTIMIZER = OptimizerConfig(lr=1e-3, weight_decay=0.01)


def token_batches(step: int, count: int, *, vocab: int, seq: int = 16) -> list[Any]:
    """`count` microbatches of 2 random sequences: token ids and next-token labels (2, seq)."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(vocab, (count, 2, seq + 1), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def lm_loss(labels: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """Mean next-token cross entropy of batch-first logits, and the executor's loss dict."""
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return loss, {"loss": loss.detach()}


def steps() -> int:
    """--steps N: how many steps each schedule trains (`STEPS` by default)."""
    text = [*sys.argv, ""][sys.argv.index("--steps") + 1] if "--steps" in sys.argv else str(STEPS)
    if not text.isdigit() or int(text) < 1:
        sys.exit(f"--steps must be a whole number of 1 or more, got {text!r}; e.g. --steps 200")
    return int(text)


def train(model: Any, schedule: str, state: ParallelState, comm: P2PCommunicator) -> list[float]:
    """`--steps` steps of `model` (a model file) under `schedule`; the mean loss of each."""
    m, dp, rank = MICROBATCHES, state.data_parallel_size, state.data_parallel_rank
    resolved = resolve_schedule(schedule.removesuffix("-threads"), pp_size=2, microbatch_counts=[m])
    pipe = model.build(resolved, state)  # this rank's chunks for resolved.placement
    ddp = DDPConfig(use_distributed_optimizer="--distributed-optimizer" in sys.argv)
    chunks = [DistributedDataParallel(c, ddp, data_parallel_group=state.group("dp_cp"))
              for c in pipe.chunks]  # fmt: skip
    optimizer = get_megatron_optimizer(OPTIMIZER, chunks, parallel_state=state)
    # dualpipev-threads: dualpipev with its F&B steps overlapped in two threads
    config = ScheduleConfig(fb_overlap="threads" if schedule.endswith("-threads") else None)
    forward_backward = get_forward_backward_func(comm, resolved, config=config)
    losses = []
    # A rank that dies: liveness records, the stop report by global rank (see the page)
    with watch_pipeline(forward_backward, state):
        for step in range(steps()):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            mine = model.batches(step, dp * m)[rank * m : (rank + 1) * m]
            reported = forward_backward(forward_step_func=model.forward_step, model=chunks,
                                        data_iterator=[iter(mine) for _ in chunks],  # one each
                                        num_microbatches=m)  # fmt: skip
            pipe.reduce_tied_grads()  # before the data-parallel sync
            for chunk in chunks:
                chunk.finish_grad_sync()
            optimizer.step()
            # The ranks holding the last stage have the losses (pipeline rank 0 under ZB-V):
            # sum over data (x context) parallelism, then along the pipeline: rank 0, the mean.
            # On the state's groups, which state.destroy() frees: not on the default group.
            loss = torch.stack([r["loss"] for r in reported] or [torch.zeros(())]).mean()
            for kind in ("dp_cp", "pp"):  # a lost peer there: a CollectiveError naming it
                with collective(f"loss all-reduce over {kind}", group=state.group(kind)):
                    dist.all_reduce(loss, group=state.group(kind))
            losses.append(float(loss) / state.group_size("dp_cp"))
    return losses


def main(model: Any) -> None:
    """Train every schedule asked for on the command line; rank 0 prints the losses."""
    steps()  # a bad --steps is refused before any process group starts
    dist.init_process_group("gloo")
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2, timeout=TIMEOUT,
        context_parallel_size=getattr(model, "CP", 1)))  # fmt: skip
    comm = P2PCommunicator.from_parallel_state(state, config=CommConfig(timeout=TIMEOUT))
    schedules = [a for a in sys.argv[1:] if a in SCHEDULES] or SCHEDULES
    losses = {s: train(model, s, state, comm) for s in schedules}
    if state.rank == 0:
        print(losses, flush=True)
    comm.destroy()
    state.destroy()
    dist.destroy_process_group()
