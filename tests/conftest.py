# Fixture plugins, one per real part the tests stand up: kernel mounts, an
# sshd on loopback, a stand-in libnvidia-ml.so.1, a fake AMD box (KFD
# topology, DRM class and device nodes in a private mount namespace).
pytest_plugins: list[str] = ["mount_fixtures", "sshd_fixtures", "nvml_fixtures"]
pytest_plugins.append("module_fixtures")
pytest_plugins.append("nix_fixtures")
pytest_plugins.append("amd_fixtures")
pytest_plugins.append("fleet_fixtures")
pytest_plugins.append("driver_fixtures")


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    import other_user

    other_user.remove_readable_package()
