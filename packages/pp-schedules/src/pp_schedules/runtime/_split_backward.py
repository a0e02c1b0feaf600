"""A backward in two steps (zero-bubble schedules): input gradients now, weight gradients later.

`backward_input` runs autograd from a stage's outputs to its inputs only, keeping the graph.
On the way it notes the gradient arriving at each node where a parameter's branch leaves the
path to the inputs (a matmul's weight operand, a bias add, ...). `WeightGradients.run` later
starts autograd at exactly those nodes with those gradients and goes to the parameters only,
so no input-gradient work is repeated; parameters that hang off no such node (a stage without
inputs that need gradients, such as the first with its embedding, or a parameter that never
meets the input's path) take a backward from the outputs instead. Gradients are accumulated
by autograd itself, into ``.grad`` and through every hook the parameters have (pp-optim's
contiguous buffers and overlapped all-reduce included).

Activation recomputation (non-reentrant `torch.utils.checkpoint`): a checkpointed forward
recomputes when backward first needs its saved tensors, once per backward call. The W step's
calls share one `torch.utils.checkpoint.GraphExecGroup`, so it recomputes once; but the I and
the W step are separate backwards, so a recomputed chunk runs its forward twice under a split
backward (once in I, once in W) against once under a plain backward. Cost models must count
that extra forward in W.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import Variable
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node
from torch.utils.checkpoint import GraphExecGroup

__all__ = ["WeightGradients", "backward_input"]


def _node_of(tensor: torch.Tensor) -> Node | None:
    """The autograd node a tensor's gradient flows into (its accumulator, for a leaf)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if not tensor.requires_grad:
        return None
    view = tensor.view_as(tensor)  # a leaf's accumulator exists only once something uses it
    assert view.grad_fn is not None
    accumulator: Node | None = view.grad_fn.next_functions[0][0]
    return accumulator


def _users(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For each node reachable from `roots`, the nodes that pass gradients to it."""
    users: dict[Node, list[Node]] = defaultdict(list)
    seen = set(roots)
    todo = list(roots)
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            users[child].append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    for root in roots:
        users.setdefault(root, [])
    return users


def _upstream(starts: Sequence[Node], users: dict[Node, list[Node]]) -> set[Node]:
    """Every node from which one of `starts` is reached (the starts excluded)."""
    found: set[Node] = set()
    todo = list(starts)
    while todo:
        for user in users.get(todo.pop(), ()):
            if user not in found:
                found.add(user)
                todo.append(user)
    return found


def _branch_points(
    accumulator: Node, on_path: set[Node], users: dict[Node, list[Node]]
) -> set[Node]:
    """The nodes on the inputs' path where the branch to `accumulator` leaves it."""
    points: set[Node] = set()
    seen = {accumulator}
    todo = [accumulator]
    while todo:
        for user in users.get(todo.pop(), ()):
            if user in on_path:
                points.add(user)
            elif user not in seen:
                seen.add(user)
                todo.append(user)
    return points


def _check_splittable(points: set[Node], shape: tuple[int, ...]) -> None:
    """Refuse a custom autograd function that computes input and weight gradients together.

    Raises:
        ValueError: Such a function sits where a parameter's branch leaves the inputs' path;
            its backward would run in the I step and again in the W step (twice the work,
            and side effects such as fused gradient accumulation happen twice).
    """
    custom: tuple[type, ...] = (BackwardCFunction,)
    fused = sorted(type(n).__name__ for n in points if isinstance(n, custom))
    if fused:
        raise ValueError(
            f"a zero-bubble schedule cannot split this model's backward: the gradient of a "
            f"parameter of shape {list(shape)} and the stage input's both come from the "
            f"custom autograd function {', '.join(fused)}; use '1f1b' or "
            "'interleaved_1f1b', or let autograd see the weight's use (a plain matmul)"
        )


@dataclasses.dataclass(eq=False)
class _Group:
    """Parameters whose branches leave the inputs' path at the same nodes."""

    params: list[torch.Tensor]
    nodes: list[Node]


@dataclasses.dataclass
class WeightGradients:
    """What the weight-gradient step needs once the input-gradient step has run."""

    roots: tuple[torch.Tensor, ...]
    root_grads: tuple[torch.Tensor, ...]
    groups: list[_Group]
    captured: dict[Node, tuple[torch.Tensor | None, ...]]
    rest: list[torch.Tensor]

    def run(self, before_exit: Callable[[], object] | None = None) -> None:
        """Accumulate every parameter's gradient, then let go of the graph.

        `before_exit`, when given, is called once every gradient is accumulated, still
        inside the group (a measurement sees what the group holds until it ends).

        The engine calls (one per group, one for the rest) run in one
        `torch.utils.checkpoint.GraphExecGroup`: a checkpointed forward is recomputed once for
        the whole step, not once per call. The calls never share a saved tensor (groups that
        meet at a node are merged; the rest's branches meet no group's), as the group requires.
        The rest's call comes last and frees the graph as it goes (a stage whose inputs take
        no gradient, the first, runs its whole backward there, as a plain backward would).
        """
        with GraphExecGroup():
            for group in self.groups:
                self._run_group(group)
            if self.rest and self.roots:
                _engine(
                    self.roots, self.root_grads, tuple(self.rest), accumulate=True,
                    keep_graph=False,
                )  # fmt: skip
            if before_exit is not None:
                before_exit()
        self.groups, self.captured, self.rest = [], {}, []
        self.roots, self.root_grads = (), ()

    def _run_group(self, group: _Group) -> None:
        """Backward from the group's branch points, with their noted gradients, to its params."""
        edges: list[Any] = []
        grads: list[torch.Tensor] = []
        for node in group.nodes:
            for index, grad in enumerate(self.captured.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(grad)
        # A node reached both as a start and from another start keeps its noted gradient.
        clamps = [
            node.register_prehook(_returning(self.captured[node]))
            for node in group.nodes
            if len(group.nodes) > 1 and node in self.captured
        ]
        try:
            if edges:
                _engine(tuple(edges), tuple(grads), tuple(group.params), accumulate=True)
        finally:
            for clamp in clamps:
                clamp.remove()


def _returning(grads: tuple[torch.Tensor | None, ...]) -> Any:
    """A pre-hook that replaces the gradients arriving at a node with `grads`."""
    return lambda _: grads


def _engine(
    tensors: tuple[Any, ...],
    grads: tuple[torch.Tensor, ...],
    inputs: tuple[Any, ...],
    *,
    accumulate: bool,
    keep_graph: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    # The engine directly: a deallocated output (storage freed after its send) would fail
    # the shape check of torch.autograd.backward/grad, and the graph must be kept for W.
    result: tuple[torch.Tensor | None, ...] = Variable._execution_engine.run_backward(
        tensors=tensors,
        grad_tensors=grads,
        keep_graph=keep_graph,
        create_graph=False,
        inputs=inputs,
        allow_unreachable=True,
        accumulate_grad=accumulate,
    )
    return result


def _groups(
    roots: Sequence[Node], inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> tuple[list[_Group], list[torch.Tensor]]:
    """Parameters grouped by where their branches leave the inputs' path; the rest."""
    users = _users(roots)
    starts = [node for node in (_node_of(t) for t in inputs) if node is not None]
    on_path = _upstream(starts, users)
    by_node: dict[Node, int] = {}
    groups: list[_Group] = []
    rest: list[torch.Tensor] = []
    for param in params:
        accumulator = _node_of(param)
        if accumulator is None or accumulator not in users:
            continue  # not used by this stage's graph: no gradient
        points = _branch_points(accumulator, on_path, users)
        if not points:
            rest.append(param)
            continue
        _check_splittable(points, tuple(param.shape))
        owners = sorted({by_node[n] for n in points if n in by_node})
        if owners:
            target = groups[owners[0]]
            for other in owners[1:]:  # merge groups that meet at a node
                target.params += groups[other].params
                target.nodes += [n for n in groups[other].nodes if n not in target.nodes]
                groups[other] = _Group([], [])
        else:
            target = _Group([], [])
            groups.append(target)
        target.params.append(param)
        target.nodes += [n for n in points if n not in target.nodes]
        index = next(i for i, group in enumerate(groups) if group is target)
        for node in target.nodes:
            by_node[node] = index
    return [g for g in groups if g.params], rest


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradients]:
    """The gradients of `inputs` from `outputs`, and what computes the parameters' later.

    Args:
        outputs: The stage's outputs (or its scalar loss, with `grads` None).
        grads: One gradient per output; None for a scalar loss (a gradient of one).
        inputs: The stage's inputs; those that require grad get a gradient.
        params: The parameters whose gradients `WeightGradients.run` accumulates.

    Returns:
        A gradient per input (None where it needs none), and the deferred weight step.
    """
    if grads is None:
        pairs = [(outputs[0], torch.ones_like(outputs[0]))]
    else:
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=False) if o.requires_grad]
    roots = tuple(o for o, _ in pairs)
    root_grads = tuple(g for _, g in pairs)
    wanted = [t for t in inputs if t.requires_grad]
    trainable = [p for p in params if p.requires_grad]
    if not wanted or not roots:
        return [None] * len(inputs), WeightGradients(roots, root_grads, [], {}, trainable)
    groups, rest = _groups(
        [n for n in (_node_of(r) for r in roots) if n is not None], wanted, trainable
    )
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    hooks = [
        node.register_prehook(
            lambda grad_outputs, node=node: captured.__setitem__(node, tuple(grad_outputs))
        )
        for group in groups
        for node in group.nodes
    ]
    try:
        found = _engine(roots, root_grads, tuple(wanted), accumulate=False)
    finally:
        for hook in hooks:
            hook.remove()
    by_input = {id(t): g for t, g in zip(wanted, found, strict=True)}
    input_grads = [
        (by_input.get(id(t)) if by_input.get(id(t)) is not None else torch.zeros_like(t))
        if t.requires_grad
        else None
        for t in inputs
    ]
    return input_grads, WeightGradients(roots, root_grads, groups, captured, rest)
