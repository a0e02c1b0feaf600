"""pp-optim: the optimizer pieces of pipeline-parallel training, after Megatron-LM.

Loss scaling (`ConstantGradScaler`, `DynamicGradScaler`), optimizer wrappers with Megatron's
step (`Float16OptimizerWithFloat16Params`, `FP32Optimizer`), model-parallel gradient norms,
clipping and zero counting, contiguous grad buffers with bucketed data-parallel all-reduce
(`DistributedDataParallel`), Megatron's distributed optimizer (`DistributedOptimizer`: fp32
parameters and optimizer state sharded over data parallelism), `Float16Module`, and the
learning-rate and weight-decay schedule (`OptimizerParamScheduler`, also built from
Megatron's arguments). Process groups come in as
arguments; pp-optim never reads global state.
"""

from importlib.metadata import version as _version

from pp_optim.distrib_optimizer import ELEMENTWISE_OPTIMIZERS, DistributedOptimizer
from pp_optim.factory import get_megatron_optimizer, get_param_groups
from pp_optim.float16 import Float16Module, float16_to_fp32, fp32_to_float16
from pp_optim.grad_buffer import (
    DDPConfig,
    DistributedDataParallel,
    GradBucket,
    GradSyncError,
    all_reduce_grads,
)
from pp_optim.grad_norm import (
    clip_grad_by_total_norm,
    clip_grad_norm,
    count_zeros,
    get_grad_norm,
    grads_for_norm,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from pp_optim.loss_scaling import ConstantGradScaler, DynamicGradScaler, GradScaler
from pp_optim.lr_flags import LRScheduleArgs
from pp_optim.lr_schedule import (
    HasParamGroups,
    LRDecayStyle,
    LRScheduleConfig,
    OptimizerParamScheduler,
    OptimizerParamSchedulerError,
    WDIncrStyle,
    WSDDecayStyle,
    get_canonical_lr_for_logging,
)
from pp_optim.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    NonFiniteGradError,
    OptimizerConfig,
)
from pp_optim.shard_checkpoint import ShardRange
from pp_optim.timing import (
    OPTIMIZER_TIMERS,
    NullOptimizerTimers,
    OptimizerTimers,
)

__version__ = _version("pp-optim")

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "OPTIMIZER_TIMERS",
    "ConstantGradScaler",
    "DDPConfig",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16Module",
    "Float16OptimizerWithFloat16Params",
    "GradBucket",
    "GradScaler",
    "GradSyncError",
    "HasParamGroups",
    "LRDecayStyle",
    "LRScheduleArgs",
    "LRScheduleConfig",
    "MegatronOptimizer",
    "NonFiniteGradError",
    "NullOptimizerTimers",
    "OptimizerConfig",
    "OptimizerParamScheduler",
    "OptimizerParamSchedulerError",
    "OptimizerTimers",
    "ShardRange",
    "WDIncrStyle",
    "WSDDecayStyle",
    "__version__",
    "all_reduce_grads",
    "clip_grad_by_total_norm",
    "clip_grad_norm",
    "count_zeros",
    "float16_to_fp32",
    "fp32_to_float16",
    "get_canonical_lr_for_logging",
    "get_grad_norm",
    "get_megatron_optimizer",
    "get_param_groups",
    "grads_for_norm",
    "param_is_not_shared",
    "param_is_not_tensor_parallel_duplicate",
]
