"""seqgate's HTTP layer: Litestar app, settings, CLI. No model logic lives here."""

from app.version import __version__

__all__ = ["__version__"]
