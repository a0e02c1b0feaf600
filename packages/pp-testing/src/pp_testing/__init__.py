"""Test helpers for the pp packages; no library imports this package.

`run_distributed` runs a plain function on N CPU ranks over gloo with a hard timeout;
`check_installed_alone` checks a package is installed as users get it.
"""

from importlib.metadata import version as _version

from pp_testing.distributed import (
    DistributedTestError,
    RankFailure,
    preload_in_ranks,
    run_distributed,
)
from pp_testing.markers import cuda_device_count, requires_gpus
from pp_testing.models import (
    StageStack,
    reference_run,
    stage_chunks,
    tiny_forward_step,
    tiny_layers,
    tiny_microbatches,
)
from pp_testing.packaging import check_installed_alone, project_requirements

__version__ = _version("pp-testing")

__all__ = [
    "DistributedTestError",
    "RankFailure",
    "StageStack",
    "__version__",
    "check_installed_alone",
    "cuda_device_count",
    "preload_in_ranks",
    "project_requirements",
    "reference_run",
    "requires_gpus",
    "run_distributed",
    "stage_chunks",
    "tiny_forward_step",
    "tiny_layers",
    "tiny_microbatches",
]
