"""Every rank of this suite starts with pp-train and torch's checkpointing already imported."""

from pp_testing import preload_in_ranks

preload_in_ranks("pp_train.app", "pp_train.checkpoint", "torch.distributed.checkpoint")
