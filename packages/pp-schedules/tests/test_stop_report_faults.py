"""A stopped pipeline names its cause: a killed rank, a stopped rank, a wrong shape (4 gloo ranks).

Each rank runs 1F1B with a short p2p timeout; one rank misbehaves in the forward of one
microbatch. The survivors publish their positions through the default group's store (a
FileStore here) and each builds the report, which the test reads from ``error.stop_report``.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import ScheduleConfig, get_forward_backward_func
from pp_schedules.runtime._stop_report import StopReport
from pp_state import Placement
from pp_testing import (
    StageStack,
    run_distributed,
    stage_chunks,
    tiny_forward_step,
    tiny_layers,
    tiny_microbatches,
)

pytestmark = pytest.mark.reliability

WIDTH, SEQ, BATCH, PP, M = 4, 2, 2, 4, 6
P2P_TIMEOUT_S, REPORT_WAIT_S = 1.5, 2.0
FAULTY_RANK, FAULTY_MICROBATCH = 2, 3
NAMED = f"rank {FAULTY_RANK} (pipeline stage {FAULTY_RANK} of [0, 1, 2, 3])"

ForwardStep = Callable[[Iterator[Any], StageStack], tuple[torch.Tensor, Callable[..., Any]]]


def _faulty_forward(fault: str) -> ForwardStep:
    inner = tiny_forward_step()
    seen = [0]

    def forward_step(data: Iterator[Any], model: StageStack) -> tuple[torch.Tensor, Any]:
        microbatch = seen[0]
        seen[0] += 1
        faulty = dist.get_rank() == FAULTY_RANK and microbatch == FAULTY_MICROBATCH
        if faulty and fault == "kill":
            os._exit(0)  # dies without a word, as kill -9 would
        if faulty and fault == "stop":
            time.sleep(3 * P2P_TIMEOUT_S + REPORT_WAIT_S)  # stopped past every timeout
        output, loss_func = inner(data, model)
        if faulty and fault == "shape":
            output = output[:, :1]  # breaks the (seq, batch, hidden) contract
        return output, loss_func

    return forward_step


def _run(fault: str) -> dict[str, Any]:
    config = CommConfig(timeout=datetime.timedelta(seconds=P2P_TIMEOUT_S))
    comm = P2PCommunicator(None, config=config)
    placement = Placement.looped(PP, 1)
    chunks = stage_chunks(
        tiny_layers(PP, WIDTH), stages=placement.stages[comm.stage], num_stages=PP
    )
    executor = get_forward_backward_func(comm, config=ScheduleConfig(hidden_size=WIDTH))
    executor.report_wait = REPORT_WAIT_S
    data = tiny_microbatches(M, seq=SEQ, batch=BATCH, width=WIDTH)
    try:
        executor(
            forward_step_func=_faulty_forward(fault), data_iterator=iter(data), model=chunks,
            num_microbatches=M, seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip
    except Exception as error:
        report: StopReport | None = getattr(error, "stop_report", None)
        if report is None:
            raise AssertionError(f"no report on {type(error).__name__}: {error}") from error
        return {"cause": report.cause, "text": report.render(), "error": type(error).__name__}
    return {"cause": None}


def _reports(fault: str) -> dict[int, dict[str, Any]]:
    try:
        results = run_distributed(_run, PP, fault, timeout=90, pg_timeout=30)
    except AssertionError as failed:  # the killed or stopped rank does not finish cleanly
        results_by_rank: dict[int, Any] = getattr(failed, "results", {})
        return results_by_rank
    return dict(enumerate(results))


def test_a_killed_rank_is_named_gone_where_the_plan_put_it() -> None:
    reports = _reports("kill")
    assert sorted(reports) == [0, 1, 3]
    for report in reports.values():
        cause = str(report["cause"])
        assert cause.startswith(
            f"{NAMED} is gone; by the plan it was at F mb {FAULTY_MICROBATCH} chunk 0"
        ), report["text"]
        assert "saw its connection close at step" in cause, cause  # where the survivors wait
    print(reports[0]["text"])  # the docs' example (pytest -s shows it)


def test_a_stopped_rank_is_named_as_the_one_not_answering() -> None:
    reports = _reports("stop")
    survivors = [r for rank, r in reports.items() if rank != FAULTY_RANK]
    assert survivors
    for report in survivors:
        assert str(report["cause"]).startswith(
            f"{NAMED} is not answering (published nothing); by the plan it was at F mb {FAULTY_MICROBATCH}"
        ), report["text"]


def test_a_wrong_shape_is_named_a_contract_mismatch() -> None:
    reports = _reports("shape")
    receiver = reports[FAULTY_RANK + 1]
    assert str(receiver["cause"]).startswith(
        f"contract mismatch between {NAMED} and rank {FAULTY_RANK + 1} (pipeline stage 3"
    ), receiver["text"]
