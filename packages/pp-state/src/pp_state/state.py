"""`ParallelState`: every process group of a job, built once from a frozen config."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping

import torch.distributed as dist

from pp_state.collectives import collective
from pp_state.coordinates import RankCoordinates, coordinates_in
from pp_state.errors import DistributedNotInitializedError, ParallelSizeError
from pp_state.layout import (
    ALL_KINDS,
    DEFAULT_ORDER,
    EXPERT_KINDS,
    KINDS,
    AnyGroupKind,
    ExpertGroupKind,
    GroupKind,
    check_split_rank,
    expert_rank_layout,
    find_group,
    group_containing,
    parse_order,
    rank_layout,
)
from pp_state.numbers import check_int
from pp_state.placement import Placement
from pp_state.stages import (
    after_split,
    at_split,
    before_split,
    checked_stage,
    first_stage,
    in_embedding_group,
    last_stage,
)

__all__ = ["ParallelConfig", "ParallelState", "StateDestroyedError"]


class StateDestroyedError(RuntimeError):
    """A `ParallelState` was used after `ParallelState.destroy`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the ranks of a job are split into parallel groups.

    The data-parallel size is what remains: world size // (tp * pp * cp). Expert layers
    (mixture of experts) are laid out a second time over the same ranks, as in Megatron:
    expert tensor parallel x expert model parallel x pipeline, the expert data-parallel size
    being what remains.
    """

    tensor_model_parallel_size: int = 1
    """Ranks each layer's tensors are split over (tp)."""

    pipeline_model_parallel_size: int = 1
    """Pipeline stages (pp)."""

    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank for the interleaved schedule; None when not interleaving.
    Needs a pipeline size of 2 or more."""

    context_parallel_size: int = 1
    """Ranks each sequence is split over (cp)."""

    pipeline_model_parallel_split_rank: int | None = None
    """Encoder-decoder models: the pipeline stage where the decoder starts (1 .. pp-1)."""

    expert_model_parallel_size: int = 1
    """Ranks the experts of each mixture-of-experts layer are spread over (ep). Above 1, the
    order must name "ep"."""

    expert_tensor_parallel_size: int | None = None
    """Ranks each expert's tensors are split over; None takes the tensor-parallel size."""

    num_distributed_optimizer_instances: int = 1
    """Replicas of the distributed optimizer: each shards its state over a run of
    consecutive ranks of the data x context parallel group (and of the expert data-parallel
    group); it must divide both sizes."""

    order: str = DEFAULT_ORDER
    """Axes from fastest- to slowest-varying rank coordinate, as in Megatron (whose default
    this is; with ep 1 it is the layout of "tp-cp-dp-pp")."""

    timeout: datetime.timedelta = datetime.timedelta(minutes=30)
    """How long a collective on these groups may wait before it fails (Megatron's
    distributed_timeout_minutes defaults to 30)."""

    backend: str | None = None
    """torch.distributed backend of the groups; None takes the default group's."""

    def __post_init__(self) -> None:
        """Checks everything that does not need the world size.

        Raises:
            TypeError: A field has the wrong type.
            ValueError: A size is below 1, the order is invalid (or leaves out an axis of
                size above 1), the virtual size comes without a pipeline, or the split rank is
                outside the pipeline.
        """
        self._check_sizes()
        pp = self.pipeline_model_parallel_size
        vp = self.virtual_pipeline_model_parallel_size
        if vp is not None:
            if isinstance(vp, bool) or not isinstance(vp, int):
                raise TypeError(
                    f"virtual_pipeline_model_parallel_size must be an int or None, got {vp!r}"
                )
            if vp < 1:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size must be 1 or more, got {vp}"
                )
            if pp < 2:
                raise ParallelSizeError(
                    f"virtual_pipeline_model_parallel_size {vp} needs pipeline_model_parallel_size "
                    f"of 2 or more, got {pp}: the interleaved schedule runs over a pipeline; "
                    "leave the virtual size as None"
                )
        self._check_order()
        if not isinstance(self.timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {self.timeout!r}")
        if self.timeout <= datetime.timedelta(0):
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.backend is not None and not isinstance(self.backend, str):
            raise TypeError(
                f"backend must be a name such as 'gloo' or 'nccl', or None; got {self.backend!r}"
            )
        check_split_rank(self.pipeline_model_parallel_split_rank, pp)

    def _check_sizes(self) -> None:
        sizes = {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.expert_tensor_parallel_size,
            "num_distributed_optimizer_instances": self.num_distributed_optimizer_instances,
        }
        for name, value in sizes.items():
            if value is None and name == "expert_tensor_parallel_size":
                continue
            check_int(name, value, 1)

    def _check_order(self) -> None:
        sizes = {
            "tp": self.tensor_model_parallel_size,
            "pp": self.pipeline_model_parallel_size,
            "cp": self.context_parallel_size,
            "ep": self.expert_model_parallel_size,
        }
        parse_order(self.order, sizes)
        if self.expert_tensor_parallel_size is not None:
            name = {"tp": "expert_tensor_parallel_size"}
            parse_order(self.order, {"tp": self.expert_tensor_parallel_size}, names=name)

    def layout(self, world_size: int) -> dict[GroupKind, list[list[int]]]:
        """The rank layout of this config on `world_size` ranks (see `rank_layout`)."""
        return rank_layout(
            world_size,
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            order=self.order,
            pipeline_model_parallel_split_rank=self.pipeline_model_parallel_split_rank,
        )

    def expert_layout(self, world_size: int) -> dict[ExpertGroupKind, list[list[int]]]:
        """The expert and optimizer-instance groups on `world_size` ranks (`expert_rank_layout`)."""
        return expert_rank_layout(
            world_size,
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            num_distributed_optimizer_instances=self.num_distributed_optimizer_instances,
            order=self.order,
        )


def _check_kind(kind: str) -> AnyGroupKind:
    if kind not in ALL_KINDS:
        raise ValueError(f"unknown group kind {kind!r}; valid kinds: {', '.join(ALL_KINDS)}")
    return kind


class ParallelState:
    """The process groups of one job and this rank's place in them.

    Build it with `ParallelState.create` on every rank after
    ``torch.distributed.init_process_group``. Every group of every kind is created once, on
    all ranks, in the same order (torch.distributed requires that); kinds whose groups hold the
    same ranks share one process group. Nothing here changes after construction, except
    `destroy`.
    """

    def __init__(
        self,
        config: ParallelConfig,
        *,
        rank: int,
        world_size: int,
        groups: Mapping[AnyGroupKind, dist.ProcessGroup],
        layout: Mapping[AnyGroupKind, list[list[int]]],
        owned: list[dist.ProcessGroup],
    ) -> None:
        """Use `ParallelState.create`; this constructor only stores what it built."""
        self._config = config
        self._rank = rank
        self._world_size = world_size
        self._groups = dict(groups)
        self._layout = {kind: [list(g) for g in groups_] for kind, groups_ in layout.items()}
        # None where this rank is in no group of a kind (middle stages and embeddings; the
        # inter-instance kind with one optimizer instance).
        self._mine = {kind: find_group(self._layout[kind], rank) for kind in ALL_KINDS}
        pipeline_index = self._layout["pp"].index(group_containing(self._layout["pp"], rank))
        self._embedding_ranks = self._layout["embedding"][pipeline_index]
        self._position_embedding_ranks = self._layout["position_embedding"][pipeline_index]
        self._owned = owned
        self._destroyed = False

    @classmethod
    def create(cls, config: ParallelConfig | None = None) -> ParallelState:
        """Create every process group of `config` on the default (world) process group.

        Every rank of the job must call this, with the same config. With gloo it returns on
        no rank before every rank has created every group, so destroying them straight away is
        safe.

        Args:
            config: Sizes and options; the default is everything of size 1 (pure data parallel).

        Returns:
            This rank's view of the groups.

        Raises:
            DistributedNotInitializedError: torch.distributed is not initialised (a
                RuntimeError and an AssertionError).
            ParallelSizeError: The world size does not fit the config; the message names the
                numbers (a ValueError and a RuntimeError; an AssertionError too where Megatron
                asserts). Raised before any group is created.
            CollectiveError: A rank died or did not arrive while the others waited for every
                rank to finish creating gloo groups.
        """
        config = config or ParallelConfig()
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedNotInitializedError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group "
                "(torchrun sets up the environment for it) before ParallelState.create"
            )
        rank, world_size = dist.get_rank(), dist.get_world_size()
        # Every size is checked (both layouts computed) before any group is created.
        layout: dict[AnyGroupKind, list[list[int]]] = {}
        layout.update(config.layout(world_size).items())
        layout.update(config.expert_layout(world_size).items())
        by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        owned: list[dist.ProcessGroup] = []
        groups: dict[AnyGroupKind, dist.ProcessGroup] = {}
        for kind in ALL_KINDS:
            for ranks in layout[kind]:
                key = tuple(ranks)
                if key not in by_ranks:
                    # Every rank creates every group, members or not, in one global order.
                    group = dist.new_group(
                        list(ranks), timeout=config.timeout, backend=config.backend
                    )
                    by_ranks[key] = group
                    if rank in ranks:
                        owned.append(group)
                if rank in ranks:
                    groups[kind] = by_ranks[key]
        _wait_for_every_rank(config.backend)
        return cls(
            config, rank=rank, world_size=world_size, groups=groups, layout=layout, owned=owned
        )

    # ----------------------------------------------------------------------------- lifecycle
    def destroy(self) -> None:
        """Destroy the process groups this state created.

        Afterwards every question about groups, ranks or stages raises `StateDestroyedError`
        (the config and sizes stay readable). Calling it twice is harmless. The default
        (world) group is left alone.
        """
        if self._destroyed:
            return
        self._destroyed = True
        if dist.is_initialized():
            for group in self._owned:
                dist.destroy_process_group(group)
        self._owned.clear()
        self._groups.clear()

    @property
    def destroyed(self) -> bool:
        """Whether `destroy` was called."""
        return self._destroyed

    def _alive(self) -> None:
        if self._destroyed:
            raise StateDestroyedError("this ParallelState was destroyed; create a new one")

    # ----------------------------------------------------------------------------- sizes
    @property
    def config(self) -> ParallelConfig:
        """The config this state was built from."""
        return self._config

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        return self._world_size

    @property
    def tensor_model_parallel_size(self) -> int:
        """Size of the tensor-parallel group."""
        return self._config.tensor_model_parallel_size

    @property
    def pipeline_model_parallel_size(self) -> int:
        """Number of pipeline stages."""
        return self._config.pipeline_model_parallel_size

    @property
    def context_parallel_size(self) -> int:
        """Size of the context-parallel group."""
        return self._config.context_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Size of the data-parallel group (without context parallel)."""
        return self.group_size("dp")

    @property
    def virtual_pipeline_model_parallel_size(self) -> int | None:
        """Model chunks per pipeline rank, or None when not interleaving."""
        return self._config.virtual_pipeline_model_parallel_size

    @property
    def pipeline_model_parallel_split_rank(self) -> int | None:
        """The first decoder stage of an encoder-decoder pipeline, or None."""
        return self._config.pipeline_model_parallel_split_rank

    @property
    def tensor_model_parallel_rank(self) -> int:
        """This rank's position in its tensor-parallel group."""
        return self.group_rank("tp")

    @property
    def pipeline_model_parallel_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.group_rank("pp")

    @property
    def data_parallel_rank(self) -> int:
        """This rank's position in its data-parallel group."""
        return self.group_rank("dp")

    @property
    def context_parallel_rank(self) -> int:
        """This rank's position in its context-parallel group."""
        return self.group_rank("cp")

    # ----------------------------------------------------------------------------- experts
    @property
    def expert_model_parallel_size(self) -> int:
        """Ranks the experts are spread over (ep)."""
        return self._config.expert_model_parallel_size

    @property
    def expert_tensor_parallel_size(self) -> int:
        """Ranks each expert's tensors are split over (the tensor-parallel size by default)."""
        return self.group_size("expt_tp")

    @property
    def expert_data_parallel_size(self) -> int:
        """Size of the expert data-parallel group: world // (expert tp * ep * pp)."""
        return self.group_size("expt_dp")

    @property
    def num_distributed_optimizer_instances(self) -> int:
        """Replicas of the distributed optimizer over the data-parallel ranks."""
        return self._config.num_distributed_optimizer_instances

    @property
    def expert_model_parallel_rank(self) -> int:
        """This rank's position in its expert model-parallel group."""
        return self.group_rank("ep")

    @property
    def expert_tensor_parallel_rank(self) -> int:
        """This rank's position in its expert tensor-parallel group."""
        return self.group_rank("expt_tp")

    @property
    def expert_data_parallel_rank(self) -> int:
        """This rank's position in its expert data-parallel group."""
        return self.group_rank("expt_dp")

    # ----------------------------------------------------------------------------- groups
    @property
    def layout(self) -> dict[GroupKind, list[list[int]]]:
        """Every group of every dense kind, as global ranks (a copy; see `rank_layout`)."""
        return {kind: [list(g) for g in self._layout[kind]] for kind in KINDS}

    @property
    def expert_layout(self) -> dict[ExpertGroupKind, list[list[int]]]:
        """Every expert and optimizer-instance group (a copy; see `expert_rank_layout`)."""
        return {kind: [list(g) for g in self._layout[kind]] for kind in EXPERT_KINDS}

    def _member(self, kind: str) -> list[int]:
        self._alive()
        ranks = self._mine[_check_kind(kind)]
        if ranks is None:
            if kind == "inter_dist_opt":
                raise ValueError(
                    "there is no inter_dist_opt group: with num_distributed_optimizer_instances "
                    f"{self.num_distributed_optimizer_instances} no group spans instances; "
                    "it exists with 2 or more"
                )
            raise ValueError(
                f"rank {self._rank} is in no {kind} group: its pipeline's {kind} ranks are "
                f"{self.embedding_ranks if kind == 'embedding' else self.position_embedding_ranks}"
            )
        return ranks

    def in_group(self, kind: AnyGroupKind) -> bool:
        """Whether this rank is in a group of `kind`.

        Always, except the embedding kinds (middle stages) and ``inter_dist_opt`` with one
        optimizer instance.
        """
        return self._mine[_check_kind(kind)] is not None

    def group(self, kind: AnyGroupKind) -> dist.ProcessGroup:
        """This rank's process group of `kind` ("tp", "pp", "dp", "dp_cp", "ep", "expt_dp", ...).

        Raises:
            ValueError: `kind` is not one of `ALL_KINDS`, or this rank is in no group of it (a
                middle stage has no embedding group).
            StateDestroyedError: `destroy` was called.
        """
        self._alive()
        self._member(kind)
        return self._groups[kind]

    def group_or_none(self, kind: AnyGroupKind) -> dist.ProcessGroup | None:
        """This rank's process group of `kind`, or None where it is in none (see `in_group`).

        What Megatron's module globals hold: a middle stage's embedding group is None.

        Raises:
            ValueError: `kind` is not one of `ALL_KINDS`.
            StateDestroyedError: `destroy` was called.
        """
        self._alive()
        return self.group(kind) if self.in_group(kind) else None

    def coordinates(self, rank: int | None = None) -> RankCoordinates:
        """Where global rank `rank` (this one by default) sits: pipeline, stage, dp, tp.

        ``state.coordinates(1).describe()`` is ``rank 1 (pipeline stage 0 of [1, 3], dp 1,
        tp 0)``, how stop reports and errors name a rank.

        Raises:
            ValueError: `rank` is not a rank of the job.
        """
        self._alive()
        return coordinates_in(self._layout, self._rank if rank is None else rank)

    def group_ranks(self, kind: AnyGroupKind) -> list[int]:
        """Global ranks of this rank's group of `kind`, in group-rank order."""
        return list(self._member(kind))

    def group_rank(self, kind: AnyGroupKind) -> int:
        """This rank's position in its group of `kind`."""
        return self._member(kind).index(self._rank)

    def group_size(self, kind: AnyGroupKind) -> int:
        """Number of ranks in this rank's group of `kind`."""
        return len(self._member(kind))

    def copy_groups(
        self, kind: AnyGroupKind, *, timeout: datetime.timedelta | None = None
    ) -> dist.ProcessGroup | None:
        """Create a second process group for every group of `kind`: same ranks, own communicator.

        A collective call: every rank must make it, with the same arguments. A copy lets one
        kind of traffic (an all-gather) progress beside another (a reduce-scatter) on the same
        ranks. The copies belong to this state: `destroy` destroys them. Like `create`, it
        returns on no rank before every rank holds its copy.

        Args:
            kind: The groups to copy.
            timeout: Timeout of the copies; None takes the config's.

        Returns:
            This rank's copy, or None where this rank is in no group of `kind`.
        """
        self._alive()
        mine = None
        for ranks in self._layout[_check_kind(kind)]:
            group = dist.new_group(
                list(ranks), timeout=timeout or self._config.timeout, backend=self._config.backend
            )
            if self._rank in ranks:
                self._owned.append(group)
                mine = group
        _wait_for_every_rank(self._config.backend)
        return mine

    def src_rank(self, kind: AnyGroupKind) -> int:
        """Global rank of the first member of this rank's group of `kind` (broadcast source)."""
        return self._member(kind)[0]

    # ----------------------------------------------------------------------------- pipeline
    @property
    def pipeline_first_rank(self) -> int:
        """Global rank of the first stage of this rank's pipeline."""
        return self.group_ranks("pp")[0]

    @property
    def pipeline_last_rank(self) -> int:
        """Global rank of the last stage of this rank's pipeline."""
        return self.group_ranks("pp")[-1]

    @property
    def pipeline_next_rank(self) -> int:
        """Global rank of the next stage; the last stage's next is the first (a ring)."""
        stages = self.group_ranks("pp")
        return stages[(self.pipeline_model_parallel_rank + 1) % len(stages)]

    @property
    def pipeline_prev_rank(self) -> int:
        """Global rank of the previous stage; the first stage's previous is the last (a ring)."""
        stages = self.group_ranks("pp")
        return stages[(self.pipeline_model_parallel_rank - 1) % len(stages)]

    def is_pipeline_first_stage(
        self,
        *,
        ignore_virtual: bool = True,
        vp_stage: int | None = None,
        placement: Placement | None = None,
    ) -> bool:
        """Whether this rank runs the first pipeline stage.

        Args:
            ignore_virtual: Answer for the physical stage, whatever the model chunk.
            vp_stage: The model chunk asked about; required when interleaving and
                `ignore_virtual` is False. Only the chunk holding virtual stage 0 is first.
            placement: Which virtual stage each (rank, chunk) holds; looped (Megatron's)
                by default.

        Raises:
            ValueError: `vp_stage` is missing or out of range.
        """
        return first_stage(
            self.pipeline_model_parallel_rank,
            self.virtual_pipeline_model_parallel_size,
            ignore_virtual=ignore_virtual,
            vp_stage=vp_stage,
            pp_size=self.pipeline_model_parallel_size,
            placement=placement,
        )

    def is_pipeline_last_stage(
        self,
        *,
        ignore_virtual: bool = True,
        vp_stage: int | None = None,
        placement: Placement | None = None,
    ) -> bool:
        """Whether this rank runs the last pipeline stage; see `is_pipeline_first_stage`.

        With the looped placement only the last chunk (vp_stage == vp - 1) of the last rank is
        last; with the V placement it is chunk 1 of rank 0.
        """
        return last_stage(
            self.pipeline_model_parallel_rank,
            self.pipeline_model_parallel_size,
            self.virtual_pipeline_model_parallel_size,
            ignore_virtual=ignore_virtual,
            vp_stage=vp_stage,
            placement=placement,
        )

    def _stage(self, rank: int | None) -> int:
        if rank is None:
            return self.pipeline_model_parallel_rank
        return checked_stage(rank, self.pipeline_model_parallel_size)

    def is_pipeline_stage_before_split(self, rank: int | None = None) -> bool:
        """Whether a pipeline stage (this rank's by default) is in the encoder.

        True for every stage when there is no split rank or no pipeline.
        """
        return before_split(
            self._stage(rank),
            self.pipeline_model_parallel_size,
            self.pipeline_model_parallel_split_rank,
        )

    def is_pipeline_stage_after_split(self, rank: int | None = None) -> bool:
        """Whether a pipeline stage (this rank's by default) is in the decoder.

        True for every stage when there is no split rank or no pipeline.
        """
        return after_split(
            self._stage(rank),
            self.pipeline_model_parallel_size,
            self.pipeline_model_parallel_split_rank,
        )

    def is_pipeline_stage_at_split(self) -> bool:
        """Whether this rank is the last encoder stage (the next stage is the decoder's first)."""
        return at_split(
            self.pipeline_model_parallel_rank,
            self.pipeline_model_parallel_size,
            self.pipeline_model_parallel_split_rank,
        )

    # ----------------------------------------------------------------------------- embeddings
    @property
    def embedding_ranks(self) -> list[int]:
        """Global ranks holding the word embedding in this rank's pipeline (first, split, last)."""
        return list(self._embedding_ranks)

    @property
    def position_embedding_ranks(self) -> list[int]:
        """Global ranks holding the position embedding in this rank's pipeline (first, split)."""
        return list(self._position_embedding_ranks)

    def is_rank_in_embedding_group(
        self, *, ignore_virtual: bool = True, vp_stage: int | None = None
    ) -> bool:
        """Whether this rank holds a copy of the word embedding that must stay in sync.

        With interleaving and `ignore_virtual` False, the first stage holds it only in chunk 0
        and the last stage only in the last chunk.
        """
        return in_embedding_group(
            self._rank,
            self.embedding_ranks,
            pp_rank=self.pipeline_model_parallel_rank,
            pp_size=self.pipeline_model_parallel_size,
            vp_size=self.virtual_pipeline_model_parallel_size,
            ignore_virtual=ignore_virtual,
            vp_stage=vp_stage,
        )

    def is_rank_in_position_embedding_group(self) -> bool:
        """Whether this rank holds a position embedding shared with the decoder's first stage."""
        return self._rank in self.position_embedding_ranks

    def __repr__(self) -> str:
        """Sizes and this rank's coordinates."""
        return (
            f"ParallelState(rank={self._rank}, world_size={self._world_size}, "
            f"tp={self.tensor_model_parallel_size}, pp={self.pipeline_model_parallel_size}, "
            f"dp={self.data_parallel_size}, cp={self.context_parallel_size}, "
            f"vp={self.virtual_pipeline_model_parallel_size}, "
            f"pp_rank={self.pipeline_model_parallel_rank}, "
            f"tp_rank={self.tensor_model_parallel_rank}"
            f"{', destroyed' if self._destroyed else ''})"
        )


def _wait_for_every_rank(backend: str | None) -> None:
    """A world barrier after creating gloo groups.

    gloo connects a group's members while creating it, and one member's `new_group` can return
    while another is still connecting to it. A rank that went on to destroy its groups would
    close that connection under its peer ("Connection closed by peer"). NCCL connects lazily,
    at a group's first collective, so it needs no wait.
    """
    if "gloo" not in str(backend or dist.get_backend()):
        return
    with collective("wait for every rank to finish creating the process groups"):
        dist.barrier()
