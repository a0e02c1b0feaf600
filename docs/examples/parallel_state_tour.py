"""Build every parallel group of a job and show who talks to whom.

Run it under torchrun, on CPU (gloo) or GPUs (NCCL):

    torchrun --standalone --nproc-per-node 8 docs/examples/parallel_state_tour.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Every rank builds the same `ParallelState`; each group is then probed with a real all-reduce,
and rank 0 prints the layout, each rank's coordinates and the outcome of the probe.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.distributed as dist

from pp_state import KINDS, ParallelConfig, ParallelState


def parse_args() -> argparse.Namespace:
    """Megatron's flag names for the sizes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    parser.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None)
    parser.add_argument("--order", default="tp-cp-dp-pp")
    parser.add_argument("--timeout-seconds", type=float, default=60.0)
    return parser.parse_args()


def probe(state: ParallelState) -> dict[str, list[int] | None]:
    """For each kind, the ranks an all-reduce over this rank's group actually reached."""
    reached: dict[str, list[int] | None] = {}
    for kind in KINDS:
        if not state.in_group(kind):
            reached[kind] = None
            continue
        one_hot = torch.zeros(state.world_size)
        one_hot[state.rank] = 1.0
        dist.all_reduce(one_hot, group=state.group(kind))
        reached[kind] = [r for r in range(state.world_size) if one_hot[r].item() == 1.0]
    return reached


def main() -> int:
    """Build the state on this rank, probe it, and let rank 0 report; 0 when all groups match."""
    args = parse_args()
    timeout = datetime.timedelta(seconds=args.timeout_seconds)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timeout)
    if backend == "nccl":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    try:
        config = ParallelConfig(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            pipeline_model_parallel_split_rank=args.pipeline_model_parallel_split_rank,
            order=args.order,
            timeout=timeout,
        )
        state = ParallelState.create(config)
        # NCCL collectives need tensors on the device; the probe is tiny either way.
        if backend == "nccl":
            torch.set_default_device("cuda")
        reached = probe(state)
        row = (
            state.rank,
            state.tensor_model_parallel_rank,
            state.pipeline_model_parallel_rank,
            state.data_parallel_rank,
            state.context_parallel_rank,
            state.pipeline_prev_rank,
            state.pipeline_next_rank,
            state.is_rank_in_embedding_group(),
        )
        rows: list[object] = [None] * state.world_size
        dist.all_gather_object(rows, (row, reached))
        layout = state.layout
        ok = all(
            found == next((sorted(g) for g in layout[kind] if rank in g), None)
            for rank, (_, probed) in enumerate(rows)  # type: ignore[misc]
            for kind, found in probed.items()
        )
        if state.rank == 0:
            report(state, rows, ok)
        state.destroy()
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def report(state: ParallelState, rows: list[object], ok: bool) -> None:
    """Print the layout, each rank's coordinates and the probe's verdict."""
    print(f"{state!r}".replace(f"rank={state.rank}, ", "", 1))
    print(f"\nlayout of {state.world_size} ranks, order {state.config.order!r}:")
    for kind, groups in state.layout.items():
        print(f"  {kind:<19} {groups}")
    print("\nrank  tp  pp  dp  cp  prev  next  embedding")
    for (rank, tp, pp, dp, cp, prev, nxt, embedding), _ in rows:  # type: ignore[misc]
        print(f"{rank:>4}  {tp:>2}  {pp:>2}  {dp:>2}  {cp:>2}  {prev:>4}  {nxt:>4}  {embedding}")
    verdict = (
        "every group reached exactly its ranks" if ok else "MISMATCH between groups and layout"
    )
    print(f"\nall-reduce probe over {len(state.layout)} group kinds: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
