"""The engine-client contract (engine.core.client): the local engine and the gateway's view of
Ray replicas both implement it, so the app runs unchanged over either."""

import typing

import pytest

from engine import EngineClient, EngineConfig


def _members() -> set[str]:
    """The contract's attributes and methods."""
    return set(typing.get_type_hints(EngineClient)) | {
        name for name in vars(EngineClient) if not name.startswith("_")}


def test_the_local_engine_is_an_engine_client(tiny_model, make_engine):
    engine = make_engine(tiny_model)
    assert isinstance(engine, EngineClient)
    assert all(hasattr(engine, name) for name in _members())


def test_the_remote_engine_is_an_engine_client(smollm2):
    pytest.importorskip("ray.serve")
    from app.replicas.deployment import ModelInfo
    from app.replicas.remote_engine import RemoteEngine

    class Handle:  # the deployment handle's one call made at construction
        def options(self, **_):
            return self

    info = ModelInfo("m", smollm2.tokenizer, 2048, smollm2.model.config.vocab_size, [2],
                     "cpu", "fp32")
    remote = RemoteEngine(EngineConfig(), Handle(), info)
    assert isinstance(remote, EngineClient)
    assert all(hasattr(remote, name) for name in _members())
