"""DualPipeV run on real gloo pipelines: each way of running an F&B step equals one process."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import ScheduleConfig, get_forward_backward_func
from pp_schedules.planning import plan
from pp_schedules.runtime import communicating, resolve_for
from pp_testing import (
    StageStack,
    reference_run,
    run_distributed,
    tiny_forward_step,
    tiny_layers,
    tiny_microbatches,
)

WIDTH, SEQ, BATCH, LAYERS = 8, 3, 2, 8


class _Overlapping(StageStack):
    """A chunk with DeepSeek's overlap function: the forward, then the backward, counted."""

    calls: ClassVar[list[str]] = []

    @classmethod
    def overlapped_forward_backward(  # noqa: PLR0917 - DeepSeek's contract is positional
        cls,
        module0: Any,
        inputs0: list[torch.Tensor],
        criterion0: Any,
        labels0: list[torch.Tensor],
        module1: Any,
        loss1: torch.Tensor | None,
        outputs1: list[torch.Tensor] | None,
        output_grads1: list[torch.Tensor] | None,
    ) -> tuple[Any, torch.Tensor | None]:
        outputs0 = module0(*inputs0)
        loss0 = criterion0(outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
        else:
            assert outputs1 is not None
            torch.autograd.backward(outputs1, grad_tensors=output_grads1)
        cls.calls.append(type(module1).__name__)
        return outputs0, loss0


class _Communicating(StageStack):
    """A chunk whose forward waits on a communication stand-in; its backward notes its thread."""

    threads: ClassVar[set[str]] = set()

    def __init__(self, layers: Sequence[torch.nn.Module]) -> None:
        super().__init__(layers)
        for parameter in self.parameters():
            parameter.register_hook(self._note)  # type: ignore[no-untyped-call]

    @staticmethod
    def _note(grad: torch.Tensor) -> torch.Tensor:
        _Communicating.threads.add(threading.current_thread().name)
        return grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with communicating():  # the other half of an F&B step computes meanwhile
            time.sleep(0.002)
        return super().forward(x)


class _Recomputing(_Overlapping):
    """A chunk that recomputes in backward: every layer (full) or its second half (selective)."""

    selective: ClassVar[bool] = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def run(layers: Sequence[torch.nn.Module], value: torch.Tensor) -> torch.Tensor:
            for layer in layers:
                value = torch.tanh(layer(value))
            return value

        layers = list(self.layers)
        if self.selective:  # the first half kept, the second recomputed
            half = len(layers) // 2
            x = run(layers[:half], x)
            layers = layers[half:]
        return checkpoint(run, layers, x, use_reentrant=False)  # type: ignore[no-any-return]


class _Selective(_Recomputing):
    selective: ClassVar[bool] = True


def _chunks(kind: type[StageStack], stages: Sequence[int], num_stages: int) -> list[StageStack]:
    layers = tiny_layers(LAYERS, WIDTH)
    per = LAYERS // num_stages
    return [kind(layers[s * per : (s + 1) * per]) for s in stages]


def _step(m: int, mode: str | None, kind_name: str) -> dict[str, Any]:
    kind = {
        "plain": StageStack, "overlapping": _Overlapping, "communicating": _Communicating,
        "full": _Recomputing, "selective": _Selective,
    }  # fmt: skip
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=60)))
    resolved = resolve_for(comm, "dualpipev", microbatch_counts=[m])
    placement = resolved.placement
    chunks = _chunks(kind[kind_name], placement.stages[comm.stage], placement.num_stages)
    data = tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)
    config = ScheduleConfig(hidden_size=WIDTH, fb_overlap=mode)
    forward_backward = get_forward_backward_func(comm, resolved, config=config)
    store = forward_backward(
        forward_step_func=tiny_forward_step(), data_iterator=[iter(data) for _ in chunks],
        model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    comm.destroy()
    return {
        "losses": [float(d["lm loss"]) for d in store],
        "grads": {
            stage: [(layer.weight.grad, layer.bias.grad) for layer in chunk.layers]
            for stage, chunk in zip(placement.stages[comm.stage], chunks, strict=True)
        },
        "calls": list(_Overlapping.calls),
        "threads": sorted(_Communicating.threads),
    }


@pytest.mark.parametrize(
    ("pp", "m", "mode", "kind"),
    [
        (2, 4, None, "plain"),
        (2, 5, "threads", "communicating"),
        (2, 4, None, "overlapping"),
        (4, 8, "threads", "communicating"),
        (4, 9, "chunk", "overlapping"),
        (4, 8, "sequential", "overlapping"),
        (2, 4, "chunk", "full"),
        (2, 4, "threads", "full"),
        (4, 8, "chunk", "selective"),
        (4, 8, "threads", "selective"),
    ],
)
def test_each_way_of_running_fb_steps_equals_one_process(
    pp: int, m: int, mode: str | None, kind: str
) -> None:
    results = run_distributed(_step, pp, m, mode, kind, timeout=180)
    expected_losses, expected_grads = reference_run(
        tiny_layers(LAYERS, WIDTH), tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)
    )
    assert results[0]["losses"] == pytest.approx(expected_losses, rel=1e-6)  # the V's end
    per = LAYERS // (2 * pp)
    for result in results:
        for stage, grads in result["grads"].items():
            for offset, (weight, bias) in enumerate(grads):
                want_weight, want_bias = expected_grads[stage * per + offset]
                torch.testing.assert_close(weight, want_weight, rtol=1e-5, atol=1e-7)
                torch.testing.assert_close(bias, want_bias, rtol=1e-5, atol=1e-7)
    made = plan("dualpipev", pp_size=pp, num_microbatches=m, vp_size=2)
    assert made.overlapped is not None
    through_chunk = kind in ("overlapping", "full", "selective") and mode in (None, "chunk")
    for rank, result in enumerate(results):
        # Every F&B step of the rank went through the chunk's function, or none did.
        expected = len(made.overlapped[rank]) if through_chunk else 0
        assert len(result["calls"]) == expected
        if kind == "communicating":  # backward halves of F&B steps ran on a thread of their own
            assert "pp-fb-backward" in result["threads"]
            assert "MainThread" in result["threads"]


class _WrongSignature(StageStack):
    @classmethod
    def overlapped_forward_backward(cls, module0: Any, inputs0: Any) -> Any:
        raise AssertionError("never called")


def _refused(schedule: str, mode: str | None, kind_name: str) -> str:
    kinds = {"plain": StageStack, "wrong": _WrongSignature, "overlapping": _Overlapping}
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=30)))
    vp = 1 if schedule == "1f1b" else 2
    resolved = resolve_for(comm, schedule, vp_size=vp, microbatch_counts=[4])
    placement = resolved.placement
    chunks = _chunks(kinds[kind_name], placement.stages[comm.stage], placement.num_stages)
    config = ScheduleConfig(hidden_size=WIDTH, fb_overlap=mode)
    forward_backward = get_forward_backward_func(comm, resolved, config=config)
    data = tiny_microbatches(4, seq=SEQ, batch=BATCH, width=WIDTH)
    try:
        forward_backward(
            forward_step_func=tiny_forward_step(), data_iterator=[iter(data) for _ in chunks],
            model=chunks, num_microbatches=4, seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip
    except ValueError as error:
        return str(error)
    finally:
        comm.destroy()
    return "ran"


@pytest.mark.parametrize(
    ("schedule", "mode", "kind", "message"),
    [
        ("1f1b", "threads", "plain",
         "fb_overlap='threads' overlaps the halves of F&B steps, but the 1f1b schedule has none; "
         "use 'dualpipev', or leave fb_overlap unset"),
        ("zbv", "chunk", "overlapping", "but the zbv schedule has none"),
        ("dualpipev", "chunk", "plain",
         "fb_overlap='chunk' runs F&B steps through the chunk's overlapped_forward_backward, but "
         "no model chunk defines one"),
        ("dualpipev", None, "wrong",
         "model chunk 0's overlapped_forward_backward takes (module0, inputs0), but an F&B step "
         "calls it with DeepSeek's (module0, inputs0, criterion0, labels0, module1, loss1, "
         "outputs1, output_grads1)"),
        ("dualpipev", "both", "plain",
         "fb_overlap 'both' is not a way to run an F&B step; use one of sequential, chunk, "
         "threads"),
    ],
)  # fmt: skip
def test_an_overlap_that_cannot_run_is_refused_before_any_step(
    schedule: str, mode: str | None, kind: str, message: str
) -> None:
    results = run_distributed(_refused, 2, schedule, mode, kind, timeout=90)
    for result in results:
        assert message in result
