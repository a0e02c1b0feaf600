import pp_tensor
from pp_testing import check_installed_alone


def test_installed_alone_with_only_its_declared_layers() -> None:
    check_installed_alone("pp-tensor", pp_tensor)
