"""The package version, from installed metadata (a bare checkout falls back to pyproject's)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("seqgate")
except PackageNotFoundError:  # running from a checkout that was never pip-installed
    __version__ = "0.1.0"
