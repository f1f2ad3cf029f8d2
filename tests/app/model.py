"""One SmolLM2 load per test session, shared by tests/app and tests/adapters.

Engines built on it share the weights (an Engine takes an already loaded model), so the few
differently configured servers the tests need cost no extra load.
"""

from __future__ import annotations

from functools import lru_cache

from engine import EngineConfig, LoadedModel, load_model


@lru_cache(maxsize=1)
def shared_model() -> LoadedModel:
    return load_model(EngineConfig())
