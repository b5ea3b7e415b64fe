"""openalice-scheduler: a GPU/compute lease service."""

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """The installed distribution's version (pyproject.toml), "0.0.0" when run from a
    tree that was never installed."""
    try:
        return version("openalice-scheduler")
    except PackageNotFoundError:
        return "0.0.0"
