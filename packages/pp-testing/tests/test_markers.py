import pytest
import torch

from pp_testing import cuda_device_count, requires_gpus


def test_cuda_device_count_matches_torch() -> None:
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert cuda_device_count() == expected


def test_requires_gpus_marks_and_skips_by_device_count() -> None:
    def body() -> None:
        pass

    marked = requires_gpus(cuda_device_count() + 1)(body)
    marks = {mark.name: mark for mark in getattr(marked, "pytestmark", [])}
    assert "gpu" in marks
    assert marks["skipif"].args == (True,)
    assert f"needs {cuda_device_count() + 1} CUDA devices" in marks["skipif"].kwargs["reason"]
    enough = requires_gpus(0)(body)
    assert {m.name: m for m in getattr(enough, "pytestmark", [])}["skipif"].args == (False,)
    assert isinstance(pytest.mark.gpu, pytest.MarkDecorator)
