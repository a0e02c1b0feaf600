"""`ProcessGroupCollection`: Megatron's holder of a job's process groups, by short names.

Megatron-LM passes model code, DDP and the gradient finalisation a ``pg_collection`` instead
of letting each read ``parallel_state``. This one has the fields of megatron-core 0.20's
(``megatron.core.process_groups_config``), in its order, filled from an explicit
`ParallelState` (`ProcessGroupCollection.from_parallel_state`) or, as Megatron's
`ProcessGroupCollection.use_mpu_process_groups`, from the default state.

Megatron 0.20 added groups for generalized tensor parallelism, where each weight is also
sharded over a "remat" axis and gathered before use. pp has no such axis (its remat size is
always 1), so the ``*_gtp_remat`` / ``*_egtp_remat`` fields hold the very group of the field
they extend (``dp_cp_gtp_remat`` is ``dp_cp``), as Megatron's are at remat size 1, and
``gtp_remat`` / ``expt_gtp_remat`` are None. Nor does pp build a second data-parallel
communicator for parameter all-gathers: ``dp_cp_ag`` and ``expt_dp_ag`` are None from both
constructors (Megatron's ``use_mpu_process_groups`` leaves them None too), and a gather runs on
the data-parallel group it shards over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch.distributed as dist

from pp_state.default import get_default_state, has_default_state
from pp_state.layout import AnyGroupKind
from pp_state.state import ParallelState

__all__ = ["FIELD_KINDS", "ProcessGroupCollection"]

FIELD_KINDS: Mapping[str, AnyGroupKind | None] = MappingProxyType({
    "tp": "tp",
    "pp": "pp",
    "mp": "mp",
    "embd": "embedding",
    "pos_embd": "position_embedding",
    "cp": "cp",
    "tp_cp": "tp_cp",
    "hcp": None,
    "ep": "ep",
    "expt_tp": "expt_tp",
    "tp_ep": "tp_ep",
    "tp_ep_pp": "tp_ep_pp",
    "tp_ep_pp_with_egtp_remat": "tp_ep_pp",
    "tp_dp_cp": "tp_dp_cp",
    "dp": "dp",
    "dp_cp": "dp_cp",
    "dp_cp_gtp_remat": "dp_cp",
    "dp_cp_ag": None,
    "gtp_remat": None,
    "expt_gtp_remat": None,
    "expt_dp": "expt_dp",
    "expt_dp_gtp_remat": "expt_dp",
    "expt_dp_ag": None,
    "intra_dp_cp": "intra_dp_cp",
    "intra_expt_dp": "intra_expt_dp",
    "inter_dist_opt": "inter_dist_opt",
    "intra_dist_opt": "intra_dist_opt",
})  # fmt: skip
"""Each field -> the `ParallelState` group kind it holds, in megatron-core 0.20's field order.

Three fields share a kind with another (the remat size is 1: ``tp_ep_pp_with_egtp_remat`` is
``tp_ep_pp``, ``dp_cp_gtp_remat`` is ``dp_cp``, ``expt_dp_gtp_remat`` is ``expt_dp``). None:
a group pp-state does not build, always None (``hcp``, ``dp_cp_ag``, ``gtp_remat``,
``expt_gtp_remat``, ``expt_dp_ag``)."""

# Megatron reads these through getters that assert initialisation even when the others are
# asked with check_initialized=False, so asking for them without a state is an error.
_NEED_A_STATE = frozenset({"dp", "dp_cp", "dp_cp_gtp_remat", "intra_dp_cp"})


def _requested(required_pgs: Iterable[str] | None) -> list[str]:
    if required_pgs is None:
        return list(FIELD_KINDS)
    if isinstance(required_pgs, str):
        raise ValueError(
            f"Invalid process groups requested: required_pgs must be a list of field names "
            f"such as ['tp', 'pp'], not the string {required_pgs!r}"
        )
    names = list(required_pgs)
    unknown = [name for name in names if name not in FIELD_KINDS]
    if unknown:
        raise ValueError(
            f"Invalid process groups requested: {unknown}; a ProcessGroupCollection "
            f"holds {', '.join(FIELD_KINDS)}"
        )
    return names


@dataclasses.dataclass(init=False, repr=False, eq=False)
class ProcessGroupCollection:
    """Process groups by Megatron's short names; a field never set is absent (`hasattr`).

    Build it with keyword arguments (``ProcessGroupCollection(tp=tp_group, pp=pp_group)``),
    set fields afterwards, or fill it from a state. A field set to None means "this rank is in
    no such group" (a middle stage's ``embd``, ``inter_dist_opt`` with one optimizer instance;
    ``hcp``, ``dp_cp_ag``, ``gtp_remat``, ``expt_gtp_remat`` and ``expt_dp_ag`` always).
    """

    tp: dist.ProcessGroup | None
    """Tensor parallel."""
    pp: dist.ProcessGroup | None
    """Pipeline parallel."""
    mp: dist.ProcessGroup | None
    """Model parallel: tensor x pipeline."""
    embd: dist.ProcessGroup | None
    """The stages holding a word-embedding copy (first, split, last)."""
    pos_embd: dist.ProcessGroup | None
    """The stages holding a position-embedding copy (first, split)."""
    cp: dist.ProcessGroup | None
    """Context parallel."""
    tp_cp: dist.ProcessGroup | None
    """Tensor x context parallel."""
    hcp: list[dist.ProcessGroup] | None
    """Hierarchical context-parallel groups (not built by pp-state: None)."""
    ep: dist.ProcessGroup | None
    """Expert model parallel."""
    expt_tp: dist.ProcessGroup | None
    """Expert tensor parallel."""
    tp_ep: dist.ProcessGroup | None
    """Expert tensor x expert model parallel."""
    tp_ep_pp: dist.ProcessGroup | None
    """Expert tensor x expert model x pipeline parallel."""
    tp_ep_pp_with_egtp_remat: dist.ProcessGroup | None
    """``tp_ep_pp`` widened over the expert remat axis: the expert analogue of ``mp``. pp's
    remat size is 1, so this is the ``tp_ep_pp`` group itself."""
    tp_dp_cp: dist.ProcessGroup | None
    """Tensor x data x context parallel."""
    dp: dist.ProcessGroup | None
    """Data parallel."""
    dp_cp: dist.ProcessGroup | None
    """Data x context parallel."""
    dp_cp_gtp_remat: dist.ProcessGroup | None
    """Every rank holding its own micro-batches: data x context parallel x the remat axis.
    pp's remat size is 1, so this is the ``dp_cp`` group itself."""
    dp_cp_ag: dist.ProcessGroup | None
    """A second data x context parallel communicator for parameter all-gathers, so they can
    overlap reduce-scatters. pp builds none: always None."""
    gtp_remat: dist.ProcessGroup | None
    """The ranks a generalized-tensor-parallel weight is sharded over. pp has no such
    sharding: always None."""
    expt_gtp_remat: dist.ProcessGroup | None
    """The same for expert weights. Always None in pp."""
    expt_dp: dist.ProcessGroup | None
    """Expert data parallel."""
    expt_dp_gtp_remat: dist.ProcessGroup | None
    """Expert data parallel x the expert remat axis. pp's remat size is 1, so this is the
    ``expt_dp`` group itself."""
    expt_dp_ag: dist.ProcessGroup | None
    """A second expert data-parallel communicator for parameter all-gathers. pp builds none:
    always None."""
    intra_dp_cp: dist.ProcessGroup | None
    """The part of data x context parallel one distributed-optimizer instance shards over."""
    intra_expt_dp: dist.ProcessGroup | None
    """The part of expert data parallel one distributed-optimizer instance shards over."""
    inter_dist_opt: dist.ProcessGroup | None
    """The same position in every distributed-optimizer instance (None with one instance)."""
    intra_dist_opt: dist.ProcessGroup | None
    """The ranks of this rank's distributed-optimizer instance."""

    def __init__(self, **groups: Any) -> None:
        """Set the fields named.

        Raises:
            ValueError: A name that is not a field (Megatron's error type).
        """
        for name, group in groups.items():
            if name not in FIELD_KINDS:
                raise ValueError(
                    f"ProcessGroupCollection has no field {name!r}; fields: "
                    f"{', '.join(FIELD_KINDS)}"
                )
            setattr(self, name, group)

    def __repr__(self) -> str:
        """The fields set, each with its group's size (None where there is no group)."""
        shown = []
        for name in FIELD_KINDS:
            if name in vars(self):
                group = vars(self)[name]
                sizes = (
                    None
                    if group is None
                    else [g.size() for g in group]
                    if isinstance(group, list)
                    else group.size()
                )
                shown.append(f"{name}={sizes}")
        return f"ProcessGroupCollection({', '.join(shown)})"

    @classmethod
    def from_parallel_state(
        cls, state: ParallelState, required_pgs: Iterable[str] | None = None
    ) -> ProcessGroupCollection:
        """This rank's groups of `state`, by field name.

        Args:
            state: The groups to hand out.
            required_pgs: The fields to fill (names in `FIELD_KINDS`); None fills every one.

        Returns:
            A collection with those fields set: this rank's group, or None where it is in no
            group of the kind or pp-state builds no such group (see `FIELD_KINDS`).

        Raises:
            ValueError: An unknown field name.
            StateDestroyedError: `state` was destroyed.
        """
        names = _requested(required_pgs)
        groups: dict[str, Any] = {}
        for name in names:
            kind = FIELD_KINDS[name]
            groups[name] = None if kind is None else state.group_or_none(kind)
        return cls(**groups)

    @classmethod
    def use_mpu_process_groups(
        cls, required_pgs: Iterable[str] | None = None
    ) -> ProcessGroupCollection:
        """The default state's groups (`initialize_model_parallel`), as Megatron's.

        Args:
            required_pgs: The fields to fill; None fills every one.

        Returns:
            A collection with those fields set. Before initialisation the fields read None,
            as Megatron's unchecked getters answer.

        Raises:
            ValueError: An unknown field name (before anything else).
            NotInitializedError: Before initialisation, when ``dp``, ``dp_cp``,
                ``dp_cp_gtp_remat`` or ``intra_dp_cp`` is asked for (all are, by default):
                Megatron asserts there.
        """
        names = _requested(required_pgs)
        if has_default_state() or _NEED_A_STATE.intersection(names):
            return cls.from_parallel_state(get_default_state(), names)
        return cls(**dict.fromkeys(names))
