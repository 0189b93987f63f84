pytest_plugins: list[str] = []
pytest_plugins.append("mount_fixtures")
