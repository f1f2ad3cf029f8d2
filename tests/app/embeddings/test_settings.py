"""The embedding settings: none by default, and the same option under each of its four names."""

from __future__ import annotations

import argparse

import pytest

from app.embeddings.service import default_threads
from app.settings import SettingsError, add_arguments, load_settings


def test_no_embedding_model_by_default():
    settings = load_settings({}, env={})
    assert settings.embeddings.model is None and settings.embeddings.threads == 0


def test_the_option_from_properties_environment_and_flags(tmp_path):
    props = tmp_path / "serving.properties"
    props.write_text("option.embedding_model=all-minilm-l6-v2\noption.embedding_threads=2\n")
    from_file = load_settings({}, env={}, config_file=str(props))
    assert (from_file.embeddings.model, from_file.embeddings.threads) == ("all-minilm-l6-v2", 2)
    from_env = load_settings({}, env={"SEQGATE_EMBEDDING_MODEL": "/models/bge"},
                             config_file=str(props))
    assert from_env.embeddings.model == "/models/bge"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--embedding-model", "BAAI/bge-small-en-v1.5",
                              "--embedding-threads", "1"])
    from_flags = load_settings(args, env={"SEQGATE_EMBEDDING_MODEL": "/models/bge"})
    assert (from_flags.embeddings.model, from_flags.embeddings.threads) == (
        "BAAI/bge-small-en-v1.5", 1)


def test_invalid_threads_are_refused_by_name():
    with pytest.raises(SettingsError, match="--embedding-threads='-1' is invalid"):
        load_settings({"embedding_threads": "-1"}, env={})


def test_default_threads_are_what_the_engine_leaves():
    assert default_threads(engine_threads=10**6) == 1
    assert default_threads(engine_threads=0) >= 1
