import pp_testing
from pp_testing import check_installed_alone


def test_installed_alone() -> None:
    check_installed_alone("pp-testing", pp_testing)
