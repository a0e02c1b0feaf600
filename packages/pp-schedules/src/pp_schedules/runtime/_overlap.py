"""F&B steps: one microbatch's forward and another's backward run together (DualPipeV).

A plan's F&B step (``F3&B1.1``) runs one of three ways, chosen by
``ScheduleConfig.fb_overlap``:

- ``"sequential"``: the forward, then the backward, as any two steps (the default when no
  chunk brings an overlap function);
- ``"chunk"``: through the chunk's own function, with DeepSeek's contract: a classmethod
  ``overlapped_forward_backward(module0, inputs0, criterion0, labels0, module1, loss1,
  outputs1, output_grads1) -> (outputs0, loss0)`` of the forward's chunk class, which runs
  ``module0(*inputs0)`` (and ``criterion0(*outputs0, *labels0)`` on the last stage) and the
  backward of ``loss1`` or of ``outputs1`` with ``output_grads1``, interleaving them as it
  likes (the default when a chunk defines one);
- ``"threads"``: pp's own overlap for any chunk. The two halves run in two threads that
  share the rank's compute lock (one device computes one thing at a time): each holds it
  while it computes and lets it go while it waits on communication (its receives, and the
  chunk's own collectives wrapped in `communicating`, an expert all-to-all say), so the
  other half computes meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from pp_schedules.planning import Action, Placement

__all__ = [
    "FB_OVERLAPS",
    "OVERLAP_FUNCTION",
    "check_fb_overlap",
    "communicating",
    "overlap_function",
    "run_fb_step",
]

FB_OVERLAPS = ("sequential", "chunk", "threads")
"""The ways an F&B step runs (`ScheduleConfig.fb_overlap`)."""

OVERLAP_FUNCTION = "overlapped_forward_backward"
"""The classmethod a chunk class defines to run its F&B steps itself (DeepSeek's contract)."""

_PARAMETERS = (
    "module0", "inputs0", "criterion0", "labels0", "module1", "loss1", "outputs1",
    "output_grads1",
)  # fmt: skip

_held = threading.local()


class PlanWalk(Protocol):
    """What an F&B step uses of a call's walk (`pp_schedules.runtime._plan_walk.PlanWalk`)."""

    x: Any
    call: Any
    placement: Placement
    recorder: Any

    def forward(self, action: Action) -> None: ...

    def backward(self, action: Action) -> None: ...

    def begin_forward(self, action: Action) -> list[torch.Tensor] | None: ...

    def forward_outputs(
        self, action: Action, output: Any, loss_func: Callable[..., Any]
    ) -> list[torch.Tensor]: ...

    def end_forward(
        self,
        action: Action,
        inputs: list[torch.Tensor] | None,
        outputs: list[torch.Tensor],
        start: float,
    ) -> None: ...

    def begin_backward(
        self, action: Action
    ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None, list[torch.Tensor]]: ...

    def backward_roots(
        self, outputs: list[torch.Tensor], grads: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor | None, list[tuple[torch.Tensor, torch.Tensor]]]: ...

    def end_backward(
        self,
        action: Action,
        inputs: list[torch.Tensor] | None,
        grads: list[torch.Tensor] | None,
        start: float,
    ) -> None: ...


@contextlib.contextmanager
def communicating() -> Iterator[None]:
    """Wait on communication in this block: the other half of an F&B step computes meanwhile.

    Inside a half of an F&B step run with ``fb_overlap="threads"`` it lets the rank's compute
    lock go for the block and takes it back after; anywhere else it does nothing. Wrap a
    chunk's own waits for its collectives in it (a mixture-of-experts layer's dispatch and
    combine all-to-all, say); the executor wraps its own waits for receives.
    """
    lock: threading.Lock | None = getattr(_held, "lock", None)
    if lock is None:
        yield
        return
    lock.release()
    try:
        yield
    finally:
        lock.acquire()


def overlap_function(chunk: torch.nn.Module) -> Callable[..., Any] | None:
    """The chunk's `OVERLAP_FUNCTION`: its class's, or that of a module it wraps (`.module`)."""
    current: Any = chunk
    for _ in range(8):  # wrappers (DDP, Float16Module) nest a few levels at most
        found = getattr(type(current), OVERLAP_FUNCTION, None)
        if callable(found):
            return found  # type: ignore[no-any-return]
        current = getattr(current, "module", None)
        if not isinstance(current, torch.nn.Module):
            return None
    return None


def _check_signature(function: Callable[..., Any], chunk: int) -> None:
    """The function takes DeepSeek's eight arguments, by those names, in that order.

    Raises:
        ValueError: Naming the parameters found and the ones expected.
    """
    try:
        found = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: take it as it is
        return
    if found != _PARAMETERS:
        raise ValueError(
            f"model chunk {chunk}'s {OVERLAP_FUNCTION} takes ({', '.join(found)}), but an F&B "
            f"step calls it with DeepSeek's ({', '.join(_PARAMETERS)}); define it as a "
            "classmethod with those parameters, returning (outputs0, loss0)"
        )


def check_fb_overlap(
    fb_overlap: str | None, chunks: Sequence[torch.nn.Module], overlapped: bool, schedule: str
) -> str:
    """How this call runs its F&B steps, checked before any step.

    Args:
        fb_overlap: `ScheduleConfig.fb_overlap` (None: the chunk's function if it has one,
            else sequential).
        chunks: The call's model chunks.
        overlapped: Whether the plan has F&B steps.
        schedule: The schedule's name, for messages.

    Raises:
        ValueError: An unknown way, a way that overlaps with a schedule without F&B steps, a
            "chunk" way without a chunk function, or a chunk function whose signature is
            not DeepSeek's.
    """
    if fb_overlap is not None and fb_overlap not in FB_OVERLAPS:
        raise ValueError(
            f"fb_overlap {fb_overlap!r} is not a way to run an F&B step; use one of "
            f"{', '.join(FB_OVERLAPS)} (or None: the chunk's function if it has one)"
        )
    if not overlapped:
        if fb_overlap in ("chunk", "threads"):
            raise ValueError(
                f"fb_overlap={fb_overlap!r} overlaps the halves of F&B steps, but the "
                f"{schedule} schedule has none; use 'dualpipev', or leave fb_overlap unset"
            )
        return "sequential"
    functions = [overlap_function(chunk) for chunk in chunks]
    if fb_overlap in (None, "chunk"):
        for index, function in enumerate(functions):
            if function is not None:
                _check_signature(function, index)
    if fb_overlap == "chunk" and not any(functions):
        raise ValueError(
            f"fb_overlap='chunk' runs F&B steps through the chunk's {OVERLAP_FUNCTION}, but "
            f"no model chunk defines one; define it on the chunk class, or use "
            "fb_overlap='threads' (pp's own overlap) or 'sequential'"
        )
    if fb_overlap is None:
        return "chunk" if any(functions) else "sequential"
    return fb_overlap


def run_fb_step(walk: PlanWalk, mode: str, forward: Action, backward: Action) -> None:
    """Run one F&B step of `walk` the way `mode` says (`check_fb_overlap`)."""
    if mode == "threads":
        _in_threads(walk, forward, backward)
    elif mode == "chunk":
        _through_chunk(walk, forward, backward)
    else:
        walk.forward(forward)
        walk.backward(backward)


def _in_threads(walk: PlanWalk, forward: Action, backward: Action) -> None:
    """The forward on this thread, the backward on another, sharing the compute lock."""
    lock: threading.Lock = walk.x.compute_lock
    failures: list[BaseException] = []

    def half(run: Callable[[Action], None], action: Action, holding: bool) -> None:
        if not holding:
            lock.acquire()
        _held.lock = lock
        try:
            run(action)
        except BaseException as error:  # raised again on the walk's thread
            failures.append(error)
        finally:
            _held.lock = None
            lock.release()

    lock.acquire()  # the forward starts first; the backward computes when it waits
    worker = threading.Thread(
        target=half, args=(walk.backward, backward, False), name="pp-fb-backward", daemon=True
    )
    worker.start()
    half(walk.forward, forward, True)
    worker.join()
    if failures:
        raise failures[0]


class _Captured:
    """What the forward step called the chunk with: the overlap function calls it itself."""

    def __init__(self) -> None:
        self.args: tuple[Any, ...] | None = None
        self.kwargs: dict[str, Any] = {}


class _Capture:
    """The chunk as the forward step sees it: every attribute its own, but a call recorded."""

    def __init__(self, chunk: torch.nn.Module, captured: _Captured) -> None:
        object.__setattr__(self, "_chunk", chunk)
        object.__setattr__(self, "_captured", captured)

    def __call__(self, *args: Any, **kwargs: Any) -> _Captured:
        captured: _Captured = object.__getattribute__(self, "_captured")
        captured.args, captured.kwargs = args, kwargs
        return captured

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_chunk"), name)


def _forward_call(walk: PlanWalk, action: Action) -> tuple[Any, list[Any], Callable[..., Any]]:
    """The module the overlap function calls, its positional inputs, and the loss function.

    The forward step runs on a stand-in of the chunk that records its call; keyword
    arguments are bound to the module it is given.

    Raises:
        ValueError: The forward step changed the chunk's output before returning it.
    """
    call, chunk = walk.call, walk.call.chunks[action.chunk]
    captured = _Captured()
    output, loss_func = call.forward_step_func(
        call.iterators[action.chunk], _Capture(chunk, captured)
    )
    if output is not captured or captured.args is None:
        raise ValueError(
            f"the F&B step {action} runs the chunk's forward through its {OVERLAP_FUNCTION}, "
            "so forward_step_func must call the chunk once and return its output as it is "
            f"(got {type(output).__name__}); return the chunk's output and do the rest in "
            "loss_func, or use fb_overlap='threads'"
        )
    module = functools.partial(chunk, **captured.kwargs) if captured.kwargs else chunk
    return module, list(captured.args), loss_func


def _through_chunk(walk: PlanWalk, forward: Action, backward: Action) -> None:
    """The chunk's `OVERLAP_FUNCTION` runs the forward of one and the backward of the other."""
    function = overlap_function(walk.call.chunks[forward.chunk])
    assert function is not None
    inputs = walk.begin_forward(forward)
    module0, inputs0, loss_func = _forward_call(walk, forward)
    last = walk.placement.is_last(walk.x.rank, forward.chunk)
    criterion0 = None
    if last:

        def criterion0(*outputs: Any) -> torch.Tensor:
            return walk.forward_outputs(forward, outputs[0] if len(outputs) == 1 else outputs,
                                        loss_func)[0]  # fmt: skip

    grads, backward_inputs, outputs = walk.begin_backward(backward)
    loss1, roots = walk.backward_roots(outputs, grads)
    start = walk.recorder.now() if walk.recorder is not None else 0.0
    outputs0, loss0 = function(
        module0, inputs0, criterion0, [], walk.call.chunks[backward.chunk], loss1,
        [o for o, _ in roots] or None, [g for _, g in roots] or None,
    )  # fmt: skip
    made = [loss0] if last else walk.forward_outputs(forward, outputs0, loss_func)
    walk.end_forward(forward, inputs, made, start)
    walk.end_backward(backward, backward_inputs, grads, start)
