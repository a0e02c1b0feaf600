"""The ``pp-train`` command: train the bundled GPT on the bundled corpus, with Megatron's flags.

Run it under torchrun (``torchrun --nproc-per-node 4 -m pp_train ...``); the world is split
into tensor-parallel groups, pipeline stages and data-parallel replicas. gloo on CPU, NCCL when
every local rank has a GPU. The flags come from `pp_train.arguments`; the run is the library's
`pretrain` with the GPT's model and datasets providers. The GPT's vocabulary is the
tokenizer's, padded by Megatron's rule (``--make-vocab-size-divisible-by`` x tensor-parallel
size).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from pp_schedules import Costs
from pp_state import ParallelState
from pp_state.collectives import collective
from pp_state.store_channel import StoreChannel, StoreTimeoutError
from pp_tensor import get_rng_tracker, pad_vocab_size
from pp_train.app.auto_schedule import (
    layout_times,
    model_figures,
    warmup_context_parallel_group,
    warmup_costs,
    warmup_tensor_parallel_group,
)
from pp_train.app.corpus import (
    CorpusDataset,
    check_corpus_seq_length,
    corpus_tokens,
    split_corpus,
)
from pp_train.app.gpt import GPTChunk, GPTConfig
from pp_train.app.gpt_config import check_tensor_parallel
from pp_train.arguments import (
    ParallelArgs,
    PretrainConfig,
    add_pretrain_flags,
    pretrain_config_from_args,
)
from pp_train.checkpoint import CheckpointError
from pp_train.context_parallel import get_batch_on_this_cp_rank
from pp_train.data import ByteTokenizer, build_tokenizer, build_train_valid_test_datasets
from pp_train.memory_plan import MemoryPlanError, ModelFigures
from pp_train.pretrain import default_transport, pretrain, print_once
from pp_train.recompute import RecomputeConfig
from pp_train.stop_reports import exit_line, write_line
from pp_train.training import NonFiniteError
from pp_train.world import check_world
from pp_train.wrappers import unwrap_model

__all__ = [
    "build_parser",
    "gpt_forward_step",
    "main",
    "refuse_once",
    "run",
    "validate_args",
]


# How long a rank waits for rank 0 to print a flag error (it may start much later under
# torchrun) before it prints the error itself and leaves.
_ERROR_WAIT_SECONDS = 60.0
_PRINTED = "flag-error/printed"


class _Parser(argparse.ArgumentParser):
    """Under torchrun every process parses the flags; only rank 0 prints the error."""

    def __init__(self, *args: Any, environ: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.environ = os.environ if environ is None else environ

    def error(self, message: str) -> NoReturn:
        """Prints usage and `message` once for the whole job; exits with status 2."""
        refuse_once(self, message, self.environ)


def _print_refusal(parser: argparse.ArgumentParser, message: str) -> None:
    parser.print_usage(sys.stderr)
    write_line(f"{parser.prog}: error: {message}")


def _error_channel(environ: Mapping[str, str]) -> StoreChannel | None:
    """The store rank 0 says it has printed in; None without a job of 2+ ranks."""
    return StoreChannel.from_torchrun_environment(
        environ, namespace="pp-train", timeout=_ERROR_WAIT_SECONDS
    )


def refuse_once(
    parser: argparse.ArgumentParser, message: str, environ: Mapping[str, str]
) -> NoReturn:
    """Exits with status 2 after the job has printed usage and `message` once.

    Every rank checks the same flags. Rank 0 prints its error, then sets a key in the job's
    store holding the message; the others wait for that key, so whichever rank starts first,
    none exits (and none is torn down by torchrun) before rank 0 has printed. A rank whose
    own error differs from rank 0's prints it too; one that waits in vain for 60 s (rank 0
    found no error) or cannot reach the store prints its own. Without a job of 2 or more
    ranks (no ``MASTER_ADDR``, or one process) each rank leaves at once, rank 0 printing.
    """
    if environ.get("RANK", "0") == "0":
        _print_refusal(parser, message)
        _tell_printed(environ, message)
        sys.exit(2)
    try:
        channel = _error_channel(environ)
        if channel is not None and channel.receive(_PRINTED) != message:
            _print_refusal(parser, message)  # another error than the one printed
    except (StoreTimeoutError, RuntimeError, ValueError):
        _print_refusal(parser, message)
    sys.exit(2)


def _tell_printed(environ: Mapping[str, str], message: str) -> None:
    """Publishes the printed `message` for the other ranks."""
    try:
        channel = _error_channel(environ)
        if channel is not None:
            channel.publish(_PRINTED, message)
    except (StoreTimeoutError, RuntimeError, ValueError):
        pass  # printed already; the others time out and print their own


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Megatron's flag names, generated from `pp_train.arguments`' configuration dataclasses.

    The defaults train the small GPT on CPU in about a minute.

    Args:
        environ: The environment torchrun set (default: ``os.environ``); a flag error is
            printed once for the whole job (see `refuse_once`).
    """
    parser = _Parser(
        environ=os.environ if environ is None else environ,
        prog="pp-train",
        description="Train the bundled small GPT with pipeline parallelism (run under torchrun).",
    )
    add_pretrain_flags(parser)
    # The GPT's own defaults, where they differ from the library's (Megatron's). No dropout
    # by default: pipeline ranks draw dropout masks from their own generators, so with it a
    # pipelined run's losses would no longer equal an unpipelined one's.
    parser.set_defaults(
        lr=3e-3, min_lr=3e-4, lr_decay_style="cosine", adam_beta2=0.95,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return parser


def validate_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int
) -> argparse.Namespace:
    """Checks the flags against each other, the world size and the data, before any group.

    Without ``--data-path`` the bundled corpus must hold a sample of ``--seq-length``; the
    GPT must split over ``--tensor-model-parallel-size`` (`check_tensor_parallel`).

    Calls ``parser.error`` (exit status 2, usage and the message) naming the numbers and what
    would work. Sets ``config`` (the `PretrainConfig`) and ``layout`` (its `RunLayout` on the
    world: the schedule resolved once, which `run` hands on to `pretrain`), and from it
    ``virtual_pipeline_model_parallel_size``, ``pipeline_plan`` (the plan of
    ``--pipeline-schedule-file``, else None) and ``pipeline_schedule`` (``auto`` resolved;
    None when the flags leave it to Megatron's default).
    """
    try:
        args.config = pretrain_config_from_args(args)
        args.layout = check_world(args.config, world_size, transport=default_transport())
        if args.config.data.data_path is None:
            check_corpus_seq_length(args.config.model.seq_length)
        parallel = args.config.parallel
        check_tensor_parallel(
            _gpt_config(args.config),
            parallel.tensor_model_parallel_size,
            sequence_parallel=parallel.sequence_parallel_in_use,
        )
        _check_attention_dropout(args.config)
    except ValueError as error:
        parser.error(str(error))
    args.virtual_pipeline_model_parallel_size = args.layout.virtual_pipeline_model_parallel_size
    args.pipeline_plan = args.layout.plan
    # Megatron's convention: None when the flags leave the schedule to the default.
    asked = args.config.parallel.pipeline_schedule
    args.pipeline_schedule = None if asked is None else args.layout.schedule
    return args


def _check_attention_dropout(config: PretrainConfig) -> None:
    """The GPT's context-parallel attention applies no dropout: refused before any group."""
    cp, dropout = config.parallel.context_parallel_size, config.model.attention_dropout
    if cp > 1 and dropout:
        raise ValueError(
            f"--context-parallel-size {cp} with --attention-dropout {dropout}: context-parallel "
            "attention applies no dropout to the attention probabilities; add "
            "--attention-dropout 0"
        )


def _count_over_context_parallel(
    num_tokens: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The microbatch's token count as each context-parallel rank divides its loss sum by.

    The cp ranks' counts summed over the group, over the group's size: each rank's gradient
    is then its tokens' share of the whole sequence's mean (DDP averages over the cp ranks),
    so the loss equals cp 1's even where the loss mask leaves the ranks different counts;
    summed over the ranks (per-token loss) it is the sequence's count. At cp 1: the count.
    """
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:
        return num_tokens
    total = num_tokens.detach().clone()
    with collective("token count all-reduce over context parallel", group=group):
        dist.all_reduce(total, group=group)
    return total / size


_GPTLossFunc = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def gpt_forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, _GPTLossFunc]:
    """Megatron's GPT ``forward_step``: the next microbatch through the chunk, its token losses.

    Under context parallelism the chunk gets this rank's part of the sequence
    (`get_batch_on_this_cp_rank`), position ids and document ids included. The loss function
    returns modern Megatron's ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})``:
    the per-token losses summed under the batch's ``loss_mask`` (float, 0 at tokens without a
    loss; every token when the batch has none) and the tokens counted. The executor divides
    the sum by the count (a microbatch's mean), or with ``--calculate-per-token-loss`` leaves
    it a sum for the whole batch's count.
    """
    chunk = unwrap_model(model)
    device = next(chunk.parameters()).device
    cp_group = getattr(getattr(chunk, "parallel", None), "cp_group", None)
    batch = get_batch_on_this_cp_rank(next(data_iterator), group=cp_group)
    extra = {key: batch[key].to(device) for key in ("position_ids", "document_ids") if key in batch}
    output = model(batch["tokens"].to(device), labels=batch["labels"].to(device), **extra)
    loss_mask = batch.get("loss_mask")

    def loss_func(
        output_tensor: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        losses = output_tensor.float()
        if loss_mask is None:
            mask = torch.ones_like(losses)
        else:
            mask = loss_mask.to(device=losses.device, dtype=torch.float32).view_as(losses)
        loss_sum = (losses * mask).sum()
        num_tokens = mask.sum()
        reported = {"lm loss": torch.stack([loss_sum, num_tokens]).detach()}
        return loss_sum, _count_over_context_parallel(num_tokens, cp_group), reported

    return output, loss_func


def _tokenizer_vocab_size(config: PretrainConfig) -> int:
    """The tokenizer's vocabulary size; without data, the corpus's bytes."""
    data = config.data
    if data.data_path is None:
        return ByteTokenizer.vocab_size
    return build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_size).vocab_size


def _gpt_config(config: PretrainConfig, tokenizer_vocab_size: int | None = None) -> GPTConfig:
    """The GPT's shape, dropout and recompute.

    Its vocabulary is the tokenizer's (`tokenizer_vocab_size`, built when None), padded to a
    multiple of ``--make-vocab-size-divisible-by`` x the tensor-parallel size (Megatron's
    rule).
    """
    model = config.model
    tokens = _tokenizer_vocab_size(config) if tokenizer_vocab_size is None else tokenizer_vocab_size
    vocab = pad_vocab_size(
        tokens,
        model.make_vocab_size_divisible_by,
        config.parallel.tensor_model_parallel_size,
    )
    return GPTConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        seq_length=model.seq_length,
        vocab_size=vocab,
        ffn_hidden_size=model.ffn_hidden_size,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        recompute=model.recompute,
        openai_gelu=model.openai_gelu,
    )


def _gpt_provider(
    gpt: GPTConfig, seed: int, parallel: ParallelArgs, *, tied: bool
) -> Callable[..., torch.nn.Module]:
    """The model provider `pretrain` calls for each chunk of this rank.

    `tied`: the output layer reuses the word embedding (no
    ``--untie-embeddings-and-output-weights``).
    """
    sequence_parallel = parallel.sequence_parallel_in_use
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size

    def model_provider(
        *,
        pre_process: bool,
        post_process: bool,
        vp_stage: int,
        layers: range,
        recompute: RecomputeConfig | None,
        state: ParallelState,
    ) -> torch.nn.Module:
        # `layers`: this chunk's global layers, from the run's per-stage layer counts;
        # `recompute`: the flags' recomputation, or the one --memory-limit-gb chose.
        shape = dataclasses.replace(gpt, recompute=recompute)
        return GPTChunk(
            shape, layers=layers, pre_process=pre_process, post_process=post_process,
            seed=seed, share_embeddings_and_output_weights=tied,
            tp_group=state.group("tp") if tp > 1 else None,
            sequence_parallel=sequence_parallel, rng_tracker=get_rng_tracker(),
            cp_group=state.group("cp") if cp > 1 else None, cp_comm_type=parallel.cp_comm_type,
        )  # fmt: skip

    return model_provider


def _measure_memory(config: PretrainConfig, gpt: GPTConfig, seed: int, tied: bool) -> ModelFigures:
    """One warm-up for both the balanced split's costs and the byte model.

    Each part is measured split over tensor- and context-parallel groups as the run splits
    it, so the figures are one rank's bytes (sequence-sharded under --sequence-parallel and
    context parallelism, the key and value blocks in flight counted).
    """
    half = config.optimizer.bf16 or config.optimizer.fp16
    dtype = (torch.bfloat16 if config.optimizer.bf16 else torch.float16) if half else None
    parallel = config.parallel
    sizes = (parallel.tensor_model_parallel_size, parallel.context_parallel_size,
             parallel.pipeline_model_parallel_size)  # fmt: skip
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    with (
        warmup_tensor_parallel_group(
            sizes[0], sizes[2], context_parallel_size=sizes[1], timeout=timeout
        ) as tp_group,
        warmup_context_parallel_group(*sizes, timeout=timeout) as cp_group,
    ):
        return model_figures(
            gpt, micro_batch_size=config.training.micro_batch_size, seed=seed,
            dtype=dtype or torch.float32, tied=tied, tp_group=tp_group,
            sequence_parallel=parallel.sequence_parallel_in_use, cp_group=cp_group,
            cp_comm_type=parallel.cp_comm_type,
        )  # fmt: skip


def run(args: argparse.Namespace) -> str:
    """Trains the GPT with validated `args` through `pretrain`; returns the exit reason."""
    config: PretrainConfig = args.config
    tokens = _tokenizer_vocab_size(config)
    gpt, seed = _gpt_config(config, tokens), config.training.seed
    tied = not config.model.untie_embeddings_and_output_weights
    print_once(
        f"> padded vocab (size: {tokens}) with {gpt.vocab_size - tokens} dummy tokens "
        f"(new size: {gpt.vocab_size})"
    )

    def datasets_provider(num_samples: tuple[int, int, int]) -> Any:
        if config.data.data_path is not None:  # Megatron's indexed data (--data-path)
            return build_train_valid_test_datasets(
                config.data, seq_length=gpt.seq_length, seed=seed,
                train_valid_test_num_samples=num_samples,
            )  # fmt: skip
        train_tokens, valid_tokens = split_corpus(corpus_tokens())
        return (
            CorpusDataset(train_tokens, gpt.seq_length, seed=seed),
            CorpusDataset(valid_tokens, gpt.seq_length, seed=seed + 1),
            None,
        )

    def measure_chunk(layers: int) -> Costs:
        batch = config.training.micro_batch_size
        return warmup_costs(gpt, layers=layers, micro_batch_size=batch, seed=seed)

    measure_memory = functools.cache(functools.partial(_measure_memory, config, gpt, seed, tied))

    def measure_layout() -> tuple[Costs, float, float]:
        return layout_times(measure_memory(), gpt.recompute)

    return pretrain(
        datasets_provider, _gpt_provider(gpt, seed, config.parallel, tied=tied), gpt_forward_step,
        config=config, checkpoint_args={"vocab_size": tokens, "padded_vocab_size": gpt.vocab_size},
        measure_schedule=measure_chunk,
        measure_layout=measure_layout, measure_memory=measure_memory, layout=args.layout,
        model_name=f"GPT with {gpt.num_layers} layers, hidden {gpt.hidden_size},",
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Parses `argv` (default: the command line), trains, and returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    validate_args(parser, args, int(os.environ.get("WORLD_SIZE", "1")))
    # A live-dump request (pp_train.dump) before or after the training loop, which answers
    # it, must not end the process: SIGUSR2's default action is to terminate.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        run(args)
    except (CheckpointError, NonFiniteError, MemoryPlanError) as error:
        # Every rank refuses together; one clear line instead of a traceback per rank.
        if os.environ.get("RANK", "0") == "0":
            write_line(f"pp-train: error: {error}")
        return 1
    except Exception as error:
        # A stopped pipeline: its report is printed and written; one line names the cause.
        line = exit_line(error, int(os.environ.get("RANK", "0")))
        if line is None:
            raise
        write_line(line)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
