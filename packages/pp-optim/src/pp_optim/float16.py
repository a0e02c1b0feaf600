"""`Float16Module`: a model chunk in fp16 or bf16 that speaks fp32 at the pipeline's ends."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Float16Module", "float16_to_fp32", "fp32_to_float16"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _convert(value: Any, convert: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return convert(value)
    if isinstance(value, tuple):
        return tuple(_convert(item, convert) for item in value)
    if isinstance(value, list):
        return [_convert(item, convert) for item in value]
    if isinstance(value, dict):
        return {key: _convert(item, convert) for key, item in value.items()}
    return value


def fp32_to_float16(value: Any, dtype: torch.dtype) -> Any:
    """Casts every fp32 tensor in `value` (nested tuples, lists, dicts) to `dtype`."""
    return _convert(value, lambda t: t.to(dtype) if t.dtype == torch.float32 else t)


def float16_to_fp32(value: Any) -> Any:
    """Casts every fp16/bf16 tensor in `value` (nested tuples, lists, dicts) to fp32."""
    return _convert(value, lambda t: t.float() if t.dtype in _HALF_DTYPES else t)


class Float16Module(torch.nn.Module):
    """Holds a module converted to fp16/bf16; casts its inputs in and its outputs out.

    On the first pipeline stage (`pre_process`) fp32 floating inputs are cast to the half
    dtype; integer inputs such as token ids pass unchanged. On the last stage
    (`post_process`) half outputs (the loss, the logits) are cast back to fp32. Between
    stages activations stay in the half dtype.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        dtype: torch.dtype,
        *,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        """Converts `module` in place to `dtype`.

        Args:
            module: The model chunk.
            dtype: ``torch.float16`` or ``torch.bfloat16``.
            pre_process: This chunk is the pipeline's first (it takes the data).
            post_process: This chunk is the pipeline's last (it makes the loss).

        Raises:
            ValueError: `dtype` is not a half dtype.
        """
        super().__init__()
        if dtype not in _HALF_DTYPES:
            raise ValueError(
                f"Float16Module dtype must be torch.float16 or torch.bfloat16, got {dtype}"
            )
        self.module = module.to(dtype)
        self.dtype = dtype
        self.pre_process = pre_process
        self.post_process = post_process

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Runs the module with half inputs (first stage) and returns fp32 outputs (last stage)."""
        if self.pre_process:
            inputs = fp32_to_float16(inputs, self.dtype)
            kwargs = fp32_to_float16(kwargs, self.dtype)
        outputs = self.module(*inputs, **kwargs)
        if self.post_process:
            outputs = float16_to_fp32(outputs)
        return outputs
