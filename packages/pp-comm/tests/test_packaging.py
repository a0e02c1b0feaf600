import pp_comm
from pp_testing import check_installed_alone


def test_installed_alone_with_only_its_declared_layers() -> None:
    check_installed_alone("pp-comm", pp_comm)


def test_public_names_import_from_the_package_and_the_communicator_module() -> None:
    import pp_comm.communicator

    for name in pp_comm.__all__:
        assert getattr(pp_comm, name) is not None
    for name in ("CommConfig", "P2PCommunicator", "P2PHandle", "P2PMessage", "Payload", "Received"):
        assert getattr(pp_comm.communicator, name) is getattr(pp_comm, name)
