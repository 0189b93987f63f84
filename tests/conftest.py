# Fixture plugins, one per real part the tests stand up: kernel mounts, an
# sshd on loopback, a stand-in libnvidia-ml.so.1, a fake AMD box (KFD
# topology, DRM class and device nodes in a private mount namespace).
pytest_plugins: list[str] = ["mount_fixtures", "sshd_fixtures", "nvml_fixtures"]
pytest_plugins.append("module_fixtures")
pytest_plugins.append("nix_fixtures")
pytest_plugins.append("amd_fixtures")
pytest_plugins.append("fleet_fixtures")
pytest_plugins.append("driver_fixtures")


_FLODL_HOMES: list[str] = []


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    import shutil

    import other_user

    other_user.remove_readable_package()
    for made in _FLODL_HOMES:
        shutil.rmtree(made, ignore_errors=True)


def pytest_configure(config: object) -> None:
    # A prepared box hands its libtorch to floDl under the training user's
    # FLODL_HOME, else ~/.flodl (prepare.handoff). Not root, the training
    # user is whoever runs the suite: their real ~/.flodl is no test's to
    # write. A test that looks at the hand-off sets FLODL_HOME itself.
    import os
    import tempfile

    if os.geteuid() != 0 and "FLODL_HOME" not in os.environ:
        _FLODL_HOMES.append(tempfile.mkdtemp(prefix="fdl-tests-flodl-"))
        os.environ["FLODL_HOME"] = os.path.join(_FLODL_HOMES[-1], "flodl")
