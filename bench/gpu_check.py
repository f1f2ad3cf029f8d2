"""The GPU check: the engine's CUDA path proven in one process, every section's result in one JSON.

    bash scripts/gpu_check.sh --prepare             # here, with a package index: fills .gpu/
    bash scripts/gpu_check.sh                       # on the GPU machine, no index: from .gpu/
    bash scripts/gpu_check.sh --device cpu --quick  # the same check on the CPU (in the suite)

The GPU machines we can borrow have PyTorch with CUDA but no package index, take the working tree
plus 64 MiB and give a command about 8 minutes. So `--prepare` gathers into `.gpu/` the wheels of
what seqgate imports that such a machine lacks and the embedded model's config and tokenizer (its
weights are too large to travel); the check makes SmolLM2-shaped weights from a fixed seed, writes
them as a model directory and loads that through the engine's own loader.

Random weights give flat next-token distributions, so near-ties are common: greedy parity is judged
by a top-2-margin rule (every engine token must be the reference's argmax, or within MARGIN of its
logit, given the engine's own prefix) beside the count of outputs equal to `generate` token for
token. Sections run in order of importance until the time budget is spent; each writes its result
to `check.json` as it ends, so a run that is cut short still returns what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
GPU_DIR = ROOT / ".gpu"
SEED = 1234
# fp32 logits on a GPU differ by ~1e-5 between batch shapes (cuBLAS picks kernels by shape); a gap
# under this between the engine's token and the reference's argmax is a near-tie, not a bug.
MARGIN = 2e-3
TRAVEL_LIMIT = 64 * 2**20  # bytes of ignored files a GPU call takes beside the tree
SYSTEM = ("You are a careful assistant for a shipping company. Answer briefly, cite the policy "
          "section when you can, and never invent tracking numbers. Be polite and concise.")
SENTENCES = ("The river ran quietly past the old mill, carrying leaves from the autumn trees. ",
             "Engineers measured the bridge twice before they trusted the numbers. ",
             "In the morning market, traders called out prices for fish, bread and spices. ")

# What seqgate (engine, app, the openai SDK for the HTTP section) imports, by distribution name.
ROOTS = ("litestar", "uvicorn", "msgspec", "llguidance", "openai")
# Distributions the GPU machines' image already has (the device library's KINDS.md, 2026-11-17),
# among those the roots need: carried wheels would shadow them for nothing. typing-extensions and
# anyio travel anyway: pydantic and httpx2 need versions newer than an image may hold.
GPU_IMAGE_HAS = frozenset("""
certifi click h11 httpcore httpx idna jinja2 markupsafe markdown-it-py mdurl multidict numpy
packaging prometheus-client psutil pygments pyyaml rich tqdm tokenizers tiktoken transformers torch
safetensors accelerate huggingface-hub regex filelock fsspec pytest ninja
""".split())
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                   "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_24_x86_64",
                   "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64")


# -- preparing .gpu/ (here, with a package index) --------------------------------------------------
def needed_distributions(roots=ROOTS, has=GPU_IMAGE_HAS) -> dict[str, str]:
    """name -> version (as installed here) of every distribution the roots need on Python 3.12
    that the GPU image lacks."""
    from importlib import metadata

    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
           "platform_machine": "x86_64", "sys_platform": "linux", "extra": ""}
    seen: dict[str, str] = {}
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in has:
            continue
        dist = metadata.distribution(name)
        seen[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(canonicalize_name(req.name))
    return dict(sorted(seen.items()))


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def prepare(dest: Path = GPU_DIR) -> dict:
    """Fill `dest` with wheels, model files and the revision; prove the wheels install for the GPU
    machine's Python. Returns the manifest it writes."""
    shutil.rmtree(dest, ignore_errors=True)
    wheels = dest / "wheels"
    wheels.mkdir(parents=True)
    dists = needed_distributions()
    platforms = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
    _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", *platforms, "-d", str(wheels), "-q",
         *(f"{n}=={v}" for n, v in dists.items()))
    with tempfile.TemporaryDirectory() as target:  # what the GPU machine will do, for its Python
        _pip("install", "--no-index", "--no-deps", "--only-binary=:all:", "--target", target, "-q",
             "--python-version", "3.12", *platforms, *map(str, sorted(wheels.glob("*.whl"))))
    write_model_files(dest / "model")
    manifest = {"distributions": dists, "revision": _git_revision(),
                "bytes": sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))
    if manifest["bytes"] > TRAVEL_LIMIT:
        raise SystemExit(f"{dest} holds {manifest['bytes'] / 2**20:.1f} MiB, over the 64 MiB that "
                         "travels with the tree")
    print(f"{dest}: {len(dists)} wheels and the model files, {manifest['bytes'] / 2**20:.1f} MiB "
          "(the limit for what travels with the tree is 64 MiB)")
    return manifest


def write_model_files(dest: Path) -> Path:
    """The embedded model's config, tokenizer and chat template (not its weights) as a directory:
    from the loader's safetensors cache where it exists (fast), else from the GGUF."""
    from transformers import AutoConfig, AutoTokenizer

    from engine import EngineConfig
    from engine.model.loader import cache_dir, embedded_model_path, gguf_cache_path

    gguf = embedded_model_path()
    cached = gguf_cache_path(gguf, cache_dir(EngineConfig()))
    source = ((cached, {}) if (cached / "config.json").is_file()
              else (gguf.parent, {"gguf_file": gguf.name}))
    dest.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(source[0], **source[1]).save_pretrained(dest)
    AutoTokenizer.from_pretrained(source[0], **source[1]).save_pretrained(dest)
    return dest


def _git_revision() -> str | None:
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


# -- numerical judges ------------------------------------------------------------------------------
def forward_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """fp32 log-probabilities of every next token of `ids`, one unpadded forward through
    transformers' own layers (the engine may have swapped in its own)."""
    from engine.model.llama_layers import original_layers

    with torch.inference_mode(), original_layers(model):
        out = model(torch.tensor([ids], device=model.device)).logits[0]
    return out.float().log_softmax(-1)


def margin_report(model: torch.nn.Module, prompt: list[int], tokens: list[int],
                  margin: float = MARGIN) -> dict:
    """Each engine token against the reference, given the engine's own prefix: the argmax, or a
    near-tie (within `margin` of the argmax's log-probability), or a violation."""
    if not tokens:
        return {"positions": 0, "exact": 0, "near_ties": 0, "violations": 0, "worst_gap": 0.0}
    logp = forward_logits(model, prompt + tokens)[len(prompt) - 1: -1]
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0]
    gap = (logp.max(-1).values - chosen).cpu()
    exact = int((gap == 0).sum())
    violations = int((gap > margin).sum())
    return {"positions": len(tokens), "exact": exact, "near_ties": len(tokens) - exact - violations,
            "violations": violations, "worst_gap": float(gap.max())}


def kl_top1(ref: torch.Tensor, other: torch.Tensor) -> tuple[list[float], list[bool]]:
    """Per position: KL(ref || other) of two log-probability rows; whether their argmaxes agree."""
    kl = (ref.exp() * (ref - other)).sum(-1)
    return kl.tolist(), (ref.argmax(-1) == other.argmax(-1)).tolist()


# -- the check's context ---------------------------------------------------------------------------
class Check:
    """The run: where it writes, what it has loaded, the time left."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.quick = args.quick
        self.device = torch.device(args.device)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget_s
        self.results: dict = {"sections": {}}
        self.model_dir: Path | None = None
        self.models: dict[str, object] = {}  # dtype -> LoadedModel
        self.sequences: list[tuple[list[int], list[int]]] = []  # fp32 engine outputs

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "check.json").write_text(json.dumps(self.results, indent=2, default=str))

    def loaded(self, dtype: str):
        from engine import EngineConfig, load_model

        if dtype not in self.models:
            self.models[dtype] = load_model(EngineConfig(model_id=str(self.model_dir),
                                                         device=str(self.device), dtype=dtype))
        return self.models[dtype]

    def engine(self, dtype: str = "fp32", **config):
        from engine import Engine, EngineConfig

        eng = Engine(EngineConfig(device=str(self.device), **config), loaded=self.loaded(dtype))
        eng.start(background=False)
        return eng

    def prompts(self, count: int, tokenizer) -> list[list[int]]:
        """Chats sharing a system prompt (the prefix cache's case), with user turns of a few to a
        few hundred tokens (to a few dozen with --quick)."""
        out = []
        for i in range(count):
            sentences = (i * 7) % (5 if self.quick else 23)
            body = "".join(SENTENCES[j % len(SENTENCES)] for j in range(sentences))
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": f"{body}Question {i}: what happened next?"}],
                tokenize=False, add_generation_prompt=True)
            out.append(tokenizer.encode(text, add_special_tokens=False))
        return out


def greedy(n: int, **kw):
    from engine import SamplingParams

    return SamplingParams(strategy="greedy", max_new_tokens=n, min_new_tokens=n, **kw)


def drain(handle) -> dict[int, dict]:
    """A finished job's sequences: tokens, finish reason, logprobs."""
    seqs: dict[int, dict] = {}
    for d in handle.iter_sync(timeout=0):
        s = seqs.setdefault(d.index, {"tokens": [], "finish": None, "logprobs": []})
        s["tokens"] += d.token_ids
        s["logprobs"] += d.logprobs or []
        s["finish"] = d.finish_reason or s["finish"]
    return seqs


def release(eng) -> None:
    eng.stop(drain=False)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- sections --------------------------------------------------------------------------------------
def section_env(c: Check) -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "device": str(c.device), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "quick": c.quick,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    manifest = GPU_DIR / "manifest.json"
    info["revision"] = (json.loads(manifest.read_text())["revision"] if manifest.is_file()
                        else _git_revision())
    for name in ROOTS:
        with contextlib.suppress(Exception):
            from importlib import metadata
            info[name] = metadata.version(name)
    if c.on_cuda:
        free, total = torch.cuda.mem_get_info(c.device)
        props = torch.cuda.get_device_properties(c.device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count,
                    free_gib=round(free / 2**30, 2), total_gib=round(total / 2**30, 2))
    return info


def section_model(c: Check) -> dict:
    """SmolLM2-shaped weights from a fixed seed, written as a model directory beside its
    tokenizer files (2 layers with --quick)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    files = Path(c.args.model_files) if c.args.model_files else None
    if files is None or not (files / "config.json").is_file():
        files = write_model_files(c.out / "model-files")
    config = AutoConfig.from_pretrained(files)
    if c.quick:
        config.num_hidden_layers = 2
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    c.model_dir = Path(tempfile.mkdtemp(prefix="seqgate-check-model-"))
    model.save_pretrained(c.model_dir)
    for name in TOKENIZER_FILES:
        if (files / name).is_file():
            shutil.copy(files / name, c.model_dir / name)
    params = sum(p.numel() for p in model.parameters())
    del model
    os.environ["SEQGATE_GPU_MODEL"] = str(c.model_dir)  # the `gpu` tests load it too
    return {"layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "parameters_m": round(params / 1e6, 1), "seed": SEED, "weights": "random"}


def section_parity(c: Check) -> dict:
    """fp32, TF32 off: a rolling batch with splitting, 37-token prompt chunks and the prefix
    cache, against the reference by the margin rule and against `generate` token for token."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    loaded = c.loaded("fp32")
    n_prompts, n_tokens = (4, 8) if c.quick else (12, 24)
    prompts = c.prompts(n_prompts, loaded.tokenizer)
    eng = c.engine(max_rolling_batch_size=16, max_sparsity=0.05, max_splits=3,
                   max_num_batched_tokens=37)
    first = eng.submit(prompts[0], greedy(4))
    eng.run_until_idle()  # the system prompt is cached now
    drain(first)
    handles = []
    for i, ids in enumerate(prompts):
        handles.append(eng.submit(ids, greedy(n_tokens + 2 * (i % 3))))
        if i % 3 == 2:
            eng.step()  # later jobs join a running batch
    stats = eng.run_until_idle()
    cached = eng.stats().cached_tokens
    graphs = _graph_stats(eng)
    release(eng)
    totals: Counter = Counter()
    equal_generate, worst = 0, 0.0
    c.sequences = []
    for ids, h in zip(prompts, handles):
        tokens = drain(h)[0]["tokens"]
        c.sequences.append((ids, tokens))
        rep = margin_report(loaded.model, ids, tokens)
        worst = max(worst, rep.pop("worst_gap"))
        totals.update(rep)
        equal_generate += tokens == reference_generate(loaded.model, ids, len(tokens))
    return {"jobs": len(prompts), "max_sub_batches": max(s.sub_batches for s in stats),
            "cached_prompt_tokens": cached, "cuda_graphs": graphs,
            "equal_to_generate": equal_generate, **totals,
            "worst_gap": worst, "margin": MARGIN, "ok": totals["violations"] == 0}


def reference_generate(model, ids: list[int], n: int) -> list[int]:
    from engine.model.llama_layers import original_layers

    with torch.inference_mode(), original_layers(model):
        out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def section_half(c: Check) -> dict:
    """bf16 and fp16 against fp32: next-token KL and top-1 on the fp32 engine's sequences
    (teacher-forced), then the engine itself in half precision (finite logprobs, full length)."""
    ref_model = c.loaded("fp32").model
    dtypes = ["bf16"] + (["fp16"] if c.on_cuda else [])
    out = {}
    for dtype in dtypes:
        loaded = c.loaded(dtype)
        kls, top1 = [], []
        for ids, tokens in c.sequences:
            ref = forward_logits(ref_model, ids + tokens)[len(ids) - 1:]
            half = forward_logits(loaded.model, ids + tokens)[len(ids) - 1:]
            k, t = kl_top1(ref, half)
            kls += k
            top1 += t
        eng = c.engine(dtype, max_rolling_batch_size=8, max_sparsity=0.05)
        handles = [eng.submit(ids, greedy(12, logprobs=True, top_logprobs=2))
                   for ids, _ in c.sequences[:6]]
        eng.run_until_idle()
        release(eng)
        seqs = [drain(h)[0] for h in handles]
        finite = all(math.isfinite(lp.logprob) for s in seqs for lp in s["logprobs"])
        full = all(len(s["tokens"]) == 12 for s in seqs)
        out[dtype] = {"positions": len(kls), "mean_kl": statistics.fmean(kls) if kls else None,
                      "max_kl": max(kls, default=None),
                      "top1": sum(top1) / len(top1) if top1 else None,
                      "engine_logprobs_finite": finite, "engine_full_length": full,
                      "ok": finite and full and all(math.isfinite(k) for k in kls)}
        c.models.pop(dtype)
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def section_features(c: Check) -> dict:
    """Sampling with and without seeds, contrastive search, a JSON-schema grammar, logprobs,
    penalties, n > 1 and an abort, in one fp32 batch."""
    from engine import SamplingParams
    from engine.sample.grammar import Grammar, GrammarCompiler

    loaded = c.loaded("fp32")
    eng = c.engine(max_rolling_batch_size=16)
    ids = c.prompts(1, loaded.tokenizer)[0]
    compiler = GrammarCompiler(loaded.tokenizer, loaded.model.config.vocab_size,
                               [loaded.tokenizer.eos_token_id])
    # Bounded fields: random weights would otherwise write digits until the token budget ends.
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "open": {"type": "boolean"}},
              "required": ["city", "open"], "additionalProperties": False}
    jobs = {
        "seeded_a": SamplingParams(strategy="sample", seed=7, max_new_tokens=16),
        "seeded_b": SamplingParams(strategy="sample", seed=7, max_new_tokens=16),
        "unseeded_a": SamplingParams(strategy="sample", temperature=1.5, max_new_tokens=16),
        "unseeded_b": SamplingParams(strategy="sample", temperature=1.5, max_new_tokens=16),
        "contrastive": SamplingParams(strategy="contrastive", top_k=4, max_new_tokens=12,
                                      min_new_tokens=12),
        "grammar": SamplingParams(strategy="greedy", max_new_tokens=48,
                                  grammar=compiler.compile(Grammar.json_schema(schema))),
        "logprobs": greedy(8, logprobs=True, top_logprobs=5),
        "penalties": greedy(16, frequency_penalty=1.5, presence_penalty=1.0,
                            repetition_penalty=1.3),
        "n3": SamplingParams(strategy="sample", seed=3, n=3, max_new_tokens=8),
        "abort": greedy(400),
    }
    handles = {k: eng.submit(ids, p) for k, p in jobs.items()}
    for _ in range(3):
        eng.step()
    eng.abort(handles["abort"].job_id)
    eng.run_until_idle()
    release(eng)
    got = {k: drain(h) for k, h in handles.items()}
    text = loaded.tokenizer.decode(got["grammar"][0]["tokens"], skip_special_tokens=True)
    try:
        parsed = json.loads(text)
        grammar_ok = set(parsed) == {"city", "open"} and isinstance(parsed["open"], bool)
    except ValueError:
        grammar_ok = False
    lps = got["logprobs"][0]["logprobs"]
    plain = reference_generate(loaded.model, ids, 16)
    checks = {
        "seeded_equal": got["seeded_a"][0]["tokens"] == got["seeded_b"][0]["tokens"],
        "unseeded_differ": got["unseeded_a"][0]["tokens"] != got["unseeded_b"][0]["tokens"],
        "contrastive_full_length": len(got["contrastive"][0]["tokens"]) == 12,
        "grammar_valid_json": grammar_ok,
        "logprobs_sorted_finite": bool(lps) and all(
            math.isfinite(lp.logprob) and len(lp.top) == 5
            and [t[1] for t in lp.top] == sorted((t[1] for t in lp.top), reverse=True)
            for lp in lps),
        "penalties_change_output": got["penalties"][0]["tokens"] != plain,
        "n3_sequences": sorted(got["n3"]) == [0, 1, 2],
        "abort_finishes_abort": got["abort"][0]["finish"] == "abort",
    }
    return {**checks, "grammar_text": text, "ok": all(checks.values())}


def section_syncs(c: Check) -> dict:
    """Host-device synchronisations per decode step (torch's sync debug mode), with one
    sub-batch, with three and a prompt chunk, and with sampling; where they come from."""
    if not c.on_cuda:
        return {"skipped": "synchronisations are counted on CUDA only"}
    loaded = c.loaded("fp32")
    prompts = c.prompts(12, loaded.tokenizer)
    cases = {
        "greedy_1_sub_batch": (dict(max_rolling_batch_size=16, max_sparsity=1.0),
                               lambda i: greedy(64), None),
        "greedy_3_sub_batches_chunk": (dict(max_rolling_batch_size=16, max_sparsity=0.0,
                                            max_splits=3, max_num_batched_tokens=48),
                                       lambda i: greedy(64), "late"),
        "sample_1_sub_batch": (dict(max_rolling_batch_size=16, max_sparsity=1.0),
                               lambda i: _sample(64, i), None),
    }
    out = {}
    for name, (config, params, late) in cases.items():
        eng = c.engine(**config)
        for i, ids in enumerate(prompts[:8]):
            eng.submit(ids, params(i))
        for _ in range(12):  # every prompt prefilled; decoding
            eng.step()
        if late:  # a long prompt arriving now is prefilled in chunks beside the decoding rows
            eng.submit(prompts[-1] * 3, greedy(8))
        torch.cuda.synchronize()
        counts, sources = [], Counter()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(5):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    stats = eng.step()
                syncs = [w for w in caught if "synchroniz" in str(w.message)]
                counts.append(len(syncs))
                sources.update(f"{_where(w.filename)}:{w.lineno}" for w in syncs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        release(eng)
        out[name] = {"per_step": counts, "sub_batches_last": stats.sub_batches,
                     "prefill_chunks_last": stats.prefill_chunks,
                     "sources": dict(sources.most_common(12))}
    return out


def _where(filename: str) -> str:
    path = Path(filename)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _sample(n: int, i: int):
    from engine import SamplingParams

    return SamplingParams(strategy="sample", temperature=0.8, top_p=0.9, seed=i,
                          max_new_tokens=n, min_new_tokens=n)


def section_profile(c: Check) -> dict:
    """One decode step of 32 rows under torch's profiler: the device kernels that ran, by time;
    which of them are attention."""
    from torch.profiler import ProfilerActivity, profile

    loaded = c.loaded("bf16" if c.on_cuda else "fp32")
    rows = 4 if c.quick else 32
    eng = c.engine("bf16" if c.on_cuda else "fp32", max_rolling_batch_size=rows)
    for ids in (c.prompts(rows, loaded.tokenizer)):
        eng.submit(ids, greedy(64))
    for _ in range(8):
        eng.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if c.on_cuda else [])
    with profile(activities=activities) as prof:
        stats = eng.step()
        if c.on_cuda:
            torch.cuda.synchronize()
    release(eng)
    events = prof.key_averages()
    if c.on_cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        key = "self_device_time_total"
    else:
        kernels, key = list(events), "self_cpu_time_total"
    kernels.sort(key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in kernels) or 1
    top = [{"name": e.key[:120], "calls": e.count, "us": round(getattr(e, key), 1),
            "share": round(getattr(e, key) / total, 3)} for e in kernels[:15]]
    attention = sorted({e.key[:120] for e in kernels
                        if any(s in e.key.lower() for s in ("attention", "fmha", "flash", "sdpa",
                                                              "softmax", "efficient"))})
    # cuDNN's attention costs ~1.4 ms of host time per call at a new KV length (docs/gpu.md).
    cudnn = [k for k in attention if "cudnn" in k]
    return {"rows": rows, "decode_rows": stats.decode_rows, "kernels_launched":
            sum(e.count for e in kernels), "device_us": round(total, 1), "top": top,
            "attention_kernels": attention, "ok": not cudnn}


def section_overhead(c: Check) -> dict:
    """Where a decode step's time goes when the device is not the limit: the cost of one kernel
    launch, transformers' own decoding of one row, the engine's step at 1 and 32 rows (with its
    torch threads and with one), and a Python profile of the 32-row steps."""
    import cProfile
    import pstats

    dtype = "bf16" if c.on_cuda else "fp32"
    loaded = c.loaded(dtype)
    steps = 8 if c.quick else 48
    x = torch.zeros(1, device=c.device)
    for _ in range(100):
        x.add_(1)
    _sync(c)
    t0 = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    _sync(c)
    out = {"launch_us": round((time.perf_counter() - t0) / 2000 * 1e6, 2),
           "torch_threads": torch.get_num_threads()}
    ids = c.prompts(1, loaded.tokenizer)[0]
    reference_generate(loaded.model, ids, 4)
    t0 = time.perf_counter()
    reference_generate(loaded.model, ids, steps)
    out["transformers_ms_per_token_1_row"] = round((time.perf_counter() - t0) / steps * 1e3, 2)
    for rows in (1, 4 if c.quick else 32):
        eng = c.engine(dtype, max_rolling_batch_size=rows, prompt_cache_bytes=0)
        for p in c.prompts(rows, loaded.tokenizer):
            eng.submit(p, greedy(steps * 3 + 16))
        for _ in range(rows + 2):  # every prompt prefilled
            eng.step()
        for threads in (out["torch_threads"], 1):
            torch.set_num_threads(threads)
            times = [eng.step().seconds for _ in range(steps)]
            out[f"engine_ms_per_step_{rows}_rows_{threads}_threads"] = round(
                statistics.median(times) * 1e3, 2)
        torch.set_num_threads(out["torch_threads"])
        if rows > 1:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(10):
                eng.step()
            _sync(c)
            prof.disable()
            st = pstats.Stats(prof)
            rows_ = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:25]
            out["profile_10_steps_by_own_time"] = [
                {"fn": f"{_where(f)}:{line}:{name}", "calls": cc, "own_ms": round(tt * 1e3, 1),
                 "cum_ms": round(ct * 1e3, 1)} for (f, line, name), (cc, _n, tt, ct, _) in rows_]
        release(eng)
    return out


def _sync(c: Check) -> None:
    if c.on_cuda:
        torch.cuda.synchronize()


def section_throughput(c: Check) -> dict:
    """128 prompts x 128 tokens at 1, 32 and 128 concurrent rows (8 prompts at 1 row: it is
    sequential): step time p50, output tokens/s, peak device memory, peak KV bytes."""
    dtype = "bf16" if c.on_cuda else "fp32"
    loaded = c.loaded(dtype)
    plans = ([(1, 2, 8), (4, 4, 8)] if c.quick
             else [(1, 8, 128), (32, 128, 128), (128, 128, 128)])
    prompts = c.prompts(128 if not c.quick else 4, loaded.tokenizer)
    out = {"dtype": dtype}
    for rows, count, n in plans:
        if c.left() < 30:
            out[f"rows_{rows}"] = {"skipped": "out of time"}
            continue
        eng = c.engine(dtype, max_rolling_batch_size=rows, prompt_cache_bytes=0)
        timed, stats = serve_timed(c, eng, prompts, count, n)
        out[f"rows_{rows}"] = {
            "requests": count, **timed, "steps": len(stats),
            "peak_memory_mib": (round(torch.cuda.max_memory_allocated() / 2**20)
                                if c.on_cuda else None),
            "peak_kv_mib": round(eng.stats().peak_kv_bytes / 2**20, 1)}
        release(eng)
    return out


def serve_timed(c: Check, eng, prompts: list[list[int]], count: int, n: int) -> tuple[dict, list]:
    """A warm-up request, then `count` greedy requests of `n` tokens over `prompts` submitted
    at once: tokens, seconds, tokens/s and the p50 of decode-only steps at full rows; and the
    step stats."""
    warm = eng.submit(prompts[0], greedy(4))
    eng.run_until_idle()
    drain(warm)
    if c.on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    handles = [eng.submit(prompts[i % len(prompts)], greedy(n)) for i in range(count)]
    stats = eng.run_until_idle()
    wall = time.perf_counter() - t0
    tokens = sum(len(drain(h)[0]["tokens"]) for h in handles)
    full = min(eng.config.batch_rows, count)
    steps = [s.seconds for s in stats if s.decode_rows == full and not s.prefill_tokens]
    return {"tokens": tokens, "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "decode_step_ms_p50": round(statistics.median(steps) * 1e3, 2) if steps else None
            }, stats


LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64)


def _graph_stats(eng) -> dict | None:
    """The engine's piecewise CUDA graphs: buckets captured, forwards through them, packed
    forwards they did not take; None where it runs without them."""
    graphs = eng.runner.graphs
    return None if graphs is None else dataclasses.asdict(graphs.stats)


def section_cuda_graphs(c: Check) -> dict:
    """The engine with its piecewise CUDA graphs and without (`enforce_eager`), alternating, bf16:
    128 prompts x 128 tokens at 1 row (8 prompts), 32 and 128 rows, SmolLM2-shaped, and at 32
    rows Llama-3.2-1B-shaped: tokens/s, decode-step p50, and what the graphs ran."""
    if not c.on_cuda:
        return {"skipped": "CUDA only"}
    loaded = c.loaded("bf16")
    prompts = c.prompts(128, loaded.tokenizer)
    plans = [("smollm2", loaded, 1, 8, ("graphs", "eager")),
             ("smollm2", loaded, 32, 128, ("eager", "graphs")),
             ("smollm2", loaded, 128, 128, ("graphs", "eager")),
             ("llama_1b", None, 32, 128, ("eager", "graphs"))]
    modes = set(c.args.graph_modes.split(","))
    out: dict = {}
    for model, which, rows, count, order in plans:
        order = [m for m in order if m in modes]
        if which is None:
            if c.left() < 60:
                out[f"{model}_rows_{rows}"] = {"skipped": "out of time"}
                continue
            which = _llama_1b(c, loaded)
        row = out.setdefault(f"{model}_rows_{rows}", {})
        for mode in order:
            if c.left() < 20:
                row[mode] = {"skipped": "out of time"}
                continue
            from engine import Engine, EngineConfig

            eng = Engine(EngineConfig(device=str(c.device), max_rolling_batch_size=rows,
                                      prompt_cache_bytes=0, enforce_eager=mode == "eager"),
                         loaded=which)
            eng.start(background=False)
            timed, _ = serve_timed(c, eng, prompts, count, 128)
            row[mode] = {**timed, "graphs": _graph_stats(eng),
                         "peak_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20)}
            release(eng)
        if all("tokens_per_s" in row.get(m, {}) for m in ("graphs", "eager")):
            row["speed_up"] = round(row["graphs"]["tokens_per_s"] / row["eager"]["tokens_per_s"],
                                    2)
    return out


def _llama_1b(c: Check, small):
    """A Llama-3.2-1B-shaped model: random bf16 weights made on the device, SmolLM2's
    vocabulary and tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine import LoadedModel

    config = AutoConfig.from_pretrained(c.model_dir)
    config.update(LLAMA_1B)
    torch.manual_seed(SEED)
    with torch.device(c.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return LoadedModel(model, small.tokenizer, "llama-1b-shaped", "random", c.device,
                       torch.bfloat16, 0.0, False)


def section_throughput_1b(c: Check) -> dict:
    """A Llama-3.2-1B-shaped model (random bf16 weights made on the device, SmolLM2's vocabulary):
    128 prompts x 128 tokens at 32 and 128 rows, where the GPU does more than launch kernels."""
    if not c.on_cuda or c.quick:
        return {"skipped": "on CUDA without --quick only"}
    if c.left() < 90:
        return {"skipped": "out of time"}
    from engine import Engine, EngineConfig

    small = c.loaded("bf16")
    loaded = _llama_1b(c, small)
    model = loaded.model
    prompts = c.prompts(128, small.tokenizer)
    out = {"parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6)}
    for rows in (32, 128):
        eng = Engine(EngineConfig(device=str(c.device), max_rolling_batch_size=rows,
                                  prompt_cache_bytes=0), loaded=loaded)
        eng.start(background=False)
        timed, _ = serve_timed(c, eng, prompts, len(prompts), 128)
        out[f"rows_{rows}"] = {
            **timed, "peak_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20)}
        release(eng)
    return out


def section_http(c: Check) -> dict:
    """The app on a loopback port, through the openai SDK: a chat, a streamed chat, a completion."""
    import socket

    import openai
    import uvicorn

    from app.factory import create_app
    from app.settings import ServerSettings, Settings
    from engine import Engine, EngineConfig

    config = EngineConfig(device=str(c.device), max_rolling_batch_size=8)
    loaded = c.loaded("bf16" if c.on_cuda else "fp32")
    engine = Engine(config, loaded=loaded)
    engine.start()
    app = create_app(Settings(server=ServerSettings(), engine=config), engine=engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive() or c.left() < 0:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1",
                               api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "Say hello."}]
        chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=12)
        pieces = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model=model, messages=msgs, max_tokens=12, stream=True) if ch.choices]
        done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8)
        return {"model": model, "chat_tokens": chat.usage.completion_tokens,
                "stream_chunks": len(pieces), "completion_tokens": done.usage.completion_tokens,
                "ok": chat.usage.completion_tokens > 0 and len(pieces) > 1
                and done.usage.completion_tokens > 0}
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        engine.stop(drain=False)


def section_memory(c: Check) -> dict:
    """The KV budget: the one the engine sizes for itself on this device (on CUDA from
    gpu_memory_utilization after a warm-up forward), then a budget that holds 8 of 32 concurrent
    greedy requests: all finish, their outputs equal an unbudgeted run, and the slabs' peak
    stays within the batch's share; then the same requests where memory runs out (`oom_run`):
    all finish, by recompute preemption, with the unbudgeted run's outputs."""
    dtype = "fp32"
    loaded = c.loaded(dtype)
    auto = c.engine(dtype)
    sized = auto.kv_budget
    out = {"auto_budget_mib": round(sized.total / 2**20) if sized else None,
           "auto_rows": auto.config.batch_rows}
    release(auto)
    n_tokens = 8 if c.quick else 32
    prompts = c.prompts(8 if c.quick else 32, loaded.tokenizer)
    reserve = max(len(p) for p in prompts) + n_tokens
    per_token = sized.per_token if sized else None
    if per_token is None:
        return {**out, "ok": False, "error": "no KV size per token for this model"}
    rows = 2 if c.quick else 8
    budget = rows * reserve * per_token  # no prefix cache here: the batch gets it all
    runs = {}
    for name, extra in (("unbudgeted", {}), ("budgeted", {"kv_cache_bytes": budget})):
        eng = c.engine(dtype, max_rolling_batch_size=len(prompts), prompt_cache_bytes=0, **extra)
        handles = [eng.submit(p, greedy(n_tokens)) for p in prompts]
        stats = eng.run_until_idle()
        runs[name] = ([drain(h)[0]["tokens"] for h in handles], stats,
                      eng.kv_budget.batch if eng.kv_budget else None)
        release(eng)
    (free, _, _), (held, held_stats, batch_limit) = runs["unbudgeted"], runs["budgeted"]
    peak = max(s.kv_bytes for s in held_stats)
    most_rows = max(s.decode_rows for s in held_stats)
    equal = free == held
    oom = oom_run(c, dtype, prompts, n_tokens, free, len(prompts) * reserve * per_token)
    return {**out, "budget_mib": round(budget / 2**20, 1), "batch_limit_mib":
            round(batch_limit / 2**20, 1), "peak_kv_mib": round(peak / 2**20, 1),
            "most_rows_decoding": most_rows, "requests": len(prompts),
            "outputs_equal_unbudgeted": equal, "out_of_memory": oom,
            "ok": equal and peak <= batch_limit and oom["ok"]}


def oom_run(c: Check, dtype: str, prompts: list[list[int]], n_tokens: int,
            want: list[list[int]], kv_need: int) -> dict:
    """The requests again, admitted as if memory were plenty (a KV budget far above the
    device's) where it is not: on CUDA the caching allocator is capped
    (`set_per_process_memory_fraction`) at what is in use plus a third of the KV the batch would
    take, so allocations fail for real; on the CPU a KV write fails at chosen steps instead.
    Every request must finish without error, by recompute preemption (`seqgate_preemptions`),
    with the unbudgeted run's tokens."""
    from engine.kv.slabs import SlabLayer

    eng = c.engine(dtype, max_rolling_batch_size=len(prompts), prompt_cache_bytes=0,
                   kv_cache_bytes=64 * 2**30)
    real_update = SlabLayer.update
    out: dict = {}
    index = None
    try:
        if c.on_cuda:
            torch.cuda.synchronize(c.device)
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(c.device).total_memory
            cap = torch.cuda.memory_reserved(c.device) + kv_need // 3
            index = c.device.index if c.device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(cap / total, index)
            out["allocator_cap_mib"] = round(cap / 2**20)
        else:
            fail_at = {2, 5}

            def update(layer, *args, **kwargs):  # the third write of a chosen step fails
                writes = out.setdefault("writes", {})
                step = eng.scheduler.step
                writes[step] = writes.get(step, 0) + 1
                if step in fail_at and writes[step] == 3:
                    raise torch.OutOfMemoryError("out of memory (injected on the CPU)")
                return real_update(layer, *args, **kwargs)

            SlabLayer.update = update
        handles = [eng.submit(p, greedy(n_tokens)) for p in prompts]
        t0 = time.perf_counter()
        eng.run_until_idle()
        seconds = time.perf_counter() - t0
        got = [drain(h)[0] for h in handles]
    finally:
        SlabLayer.update = real_update
        out.pop("writes", None)
        if index is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, index)
    stats = eng.stats()
    release(eng)
    errors = sum(g["finish"] == "error" for g in got)
    equal = sum(g["tokens"] == w for g, w in zip(got, want))
    return {**out, "seconds": round(seconds, 2), "out_of_memory_steps": stats.out_of_memory_steps,
            "preemptions": stats.preemptions, "errors": errors, "equal_to_unbudgeted": equal,
            "requests": len(prompts),
            "ok": stats.preemptions > 0 and errors == 0 and equal == len(prompts)}


def section_tests(c: Check) -> dict:
    """The suite's `gpu` tests (tests/engine/test_cuda.py), in this process."""
    if not c.on_cuda:
        return {"skipped": "the gpu tests need a CUDA device"}
    import pytest

    class Tally:
        def __init__(self):
            self.counts: Counter = Counter()
            self.failed: list[str] = []

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                self.counts[report.outcome] += 1
                if report.failed:
                    self.failed.append(f"{report.nodeid}: {str(report.longrepr)[-600:]}")

    tally = Tally()
    code = pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "-x",
                        str(ROOT / "tests/engine/test_cuda.py")], plugins=[tally])
    return {"exit": int(code), **tally.counts, "failed": tally.failed,
            "ok": int(code) in (0, 5) and not tally.failed}


def section_speculative(c: Check) -> dict:
    """Speculative decoding on the device, fp32: prompt lookup and a draft model (the served model
    drafting for itself), each judged against the reference by the margin rule; how many outputs
    equal the run without speculation, and the draft model's acceptance."""
    torch.backends.cuda.matmul.allow_tf32 = False
    loaded = c.loaded("fp32")
    n_prompts, n_tokens = (2, 8) if c.quick else (6, 32)
    prompts = c.prompts(n_prompts, loaded.tokenizer)
    params = [greedy_free(n_tokens) for _ in prompts]
    out: dict = {}
    plain: list[list[int]] = []
    for name, config in (("off", dict(num_speculative_tokens=0)),
                         ("prompt_lookup", dict(num_speculative_tokens=4)),
                         ("draft_model", dict(num_speculative_tokens=4,
                                              speculative_model=str(c.model_dir)))):
        eng = c.engine("fp32", max_rolling_batch_size=4, **config)
        handles = [eng.submit(ids, p) for ids, p in zip(prompts, params)]
        eng.run_until_idle()
        stats = eng.stats()
        release(eng)
        outs = [drain(h)[0]["tokens"] for h in handles]
        totals: Counter = Counter()
        for ids, tokens in zip(prompts, outs):
            rep = margin_report(loaded.model, ids, tokens)
            rep.pop("worst_gap")
            totals.update(rep)
        if name == "off":
            plain = outs
        row = {**totals, "equal_to_off": sum(a == b for a, b in zip(outs, plain))}
        row["drafted"], row["accepted"] = stats.spec_proposed_tokens, stats.spec_accepted_tokens
        out[name] = row
    out["ok"] = all(r["violations"] == 0 for r in out.values() if isinstance(r, dict))
    return out


def greedy_free(n: int):
    """Greedy without min_new_tokens, so that speculation may draft."""
    from engine import SamplingParams

    return SamplingParams(strategy="greedy", max_new_tokens=n)


def section_splitting(c: Check) -> dict:
    """Max-sparsity splitting on the device: 128 prompts x 64 tokens at 32 and 128 rows, with up
    to 3 sub-batches (the CPU's default) and with none (max_splits 1, CUDA's). Splitting saves
    padding, which a GPU hardly pays for, at the price of an attention call per sub-batch per
    layer."""
    if c.quick:
        plans, n = [(4, 8)], 8
    else:
        plans, n = [(32, 128), (128, 128)], 64
    loaded = c.loaded("bf16" if c.on_cuda else "fp32")
    prompts = c.prompts(plans[-1][1], loaded.tokenizer)
    out: dict = {}
    for rows, count in plans:
        for splits in (3, 1):
            label = f"max_splits_{splits}"
            if c.left() < 25:
                out[f"rows_{rows}_{label}"] = {"skipped": "out of time"}
                continue
            eng = c.engine("bf16" if c.on_cuda else "fp32", max_rolling_batch_size=rows,
                           prompt_cache_bytes=0, max_splits=splits)
            timed, stats = serve_timed(c, eng, prompts, count, n)
            out[f"rows_{rows}_{label}"] = {
                "tokens_per_s": timed["tokens_per_s"],
                "decode_step_ms_p50": timed["decode_step_ms_p50"],
                "mean_sub_batches": round(statistics.mean(s.sub_batches for s in stats), 2)}
            release(eng)
    return out


def section_graphs(c: Check) -> dict:
    """What CUDA graphs would buy, before the engine has them: transformers' own model (bf16) over
    its StaticCache, one decode token per row, run eagerly and as one captured graph replayed,
    at 1, 32 and 128 rows with 512 cached positions; SmolLM2-shaped and Llama-3.2-1B-shaped.
    Compare with the engine's step in throughput and throughput_1b."""
    if not c.on_cuda:
        return {"skipped": "CUDA only"}
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(c.model_dir, dtype=torch.bfloat16).to(c.device)
    out = {"smollm2_shaped": _graph_runs(c, model.eval())}
    del model
    config = AutoConfig.from_pretrained(c.model_dir)
    config.update(LLAMA_1B)
    torch.manual_seed(SEED)
    with torch.device(c.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    out["llama_1b_shaped"] = _graph_runs(c, model)
    return out


def _graph_runs(c: Check, model: torch.nn.Module) -> dict:
    cap, filled = 512, 320
    out: dict = {"cache_len": cap, "filled": filled}
    for rows in (1, 32, 128):
        if c.left() < 20:
            out[f"rows_{rows}"] = {"skipped": "out of time"}
            continue
        try:
            with torch.inference_mode():
                out[f"rows_{rows}"] = _graph_run(c, model, rows, cap, filled)
        except Exception as exc:  # capture can refuse a model that synchronises; say where
            out[f"rows_{rows}"] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        gc.collect()
        torch.cuda.empty_cache()
    return out


def _graph_run(c: Check, model: torch.nn.Module, rows: int, cap: int, filled: int) -> dict:
    """One decode step of `rows` rows over `filled` cached positions: eager, then a graph."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=cap)
    model(input_ids=torch.randint(0, 1000, (rows, filled), device=c.device),
          past_key_values=cache, use_cache=True,
          cache_position=torch.arange(filled, device=c.device))
    mask = torch.zeros(rows, 1, 1, cap, dtype=torch.bool, device=c.device)
    mask[..., :filled + 1] = True
    inputs = dict(input_ids=torch.zeros(rows, 1, dtype=torch.long, device=c.device),
                  position_ids=torch.full((rows, 1), filled, device=c.device),
                  cache_position=torch.tensor([filled], device=c.device),
                  attention_mask=mask, past_key_values=cache, use_cache=True)

    def step() -> torch.Tensor:
        return model(**inputs).logits

    row = {"eager_ms": _time_ms(step, c)}
    side = torch.cuda.Stream()  # capture wants its warm-up off the default stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()
    row["graph_ms"] = _time_ms(graph.replay, c)
    row["graph_equals_eager"] = bool(torch.equal(logits.clone(), step()))
    row["speed_up"] = round(row["eager_ms"] / row["graph_ms"], 2)
    return row


def _time_ms(fn: Callable, c: Check, n: int = 30) -> float:
    for _ in range(3):
        fn()
    _sync(c)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(c)
    return round((time.perf_counter() - t0) / n * 1e3, 3)


SECTIONS: list[tuple[str, Callable[[Check], dict]]] = [
    ("env", section_env), ("model", section_model), ("parity", section_parity),
    ("half_precision", section_half), ("features", section_features), ("syncs", section_syncs),
    ("profile", section_profile), ("overhead", section_overhead),
    ("throughput", section_throughput), ("cuda_graphs", section_cuda_graphs),
    ("http", section_http),
    ("memory", section_memory), ("tests", section_tests), ("speculative", section_speculative),
    ("splitting", section_splitting), ("graphs", section_graphs),
    ("throughput_1b", section_throughput_1b),
]


def run(c: Check) -> int:
    failed = 0
    only = set(filter(None, c.args.sections.split(","))) | {"env", "model"}
    for name, fn in SECTIONS:
        if len(only) > 2 and name not in only:
            continue
        if c.left() <= 0:
            c.results["sections"][name] = {"skipped": "out of time"}
            continue
        t0 = time.perf_counter()
        try:
            result = fn(c)
        except Exception as exc:  # one section's failure must not hide the others' results
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-3000:]}
            if name in ("env", "model"):
                c.results["sections"][name] = result
                c.save()
                print(f"[{name}] FAILED: {result['error']}\n{result['traceback']}", flush=True)
                return 1
        result["seconds"] = round(time.perf_counter() - t0, 1)
        c.results["sections"][name] = result
        c.save()
        failed += result.get("ok") is False
        print(f"[{name}] {json.dumps(result, default=str)[:1500]}", flush=True)
    print(summary(c.results["sections"]), flush=True)
    return 1 if failed else 0


def summary(sections: dict) -> str:
    lines = ["", "section          ok     seconds"]
    for name, r in sections.items():
        ok = "skip" if "skipped" in r else {True: "yes", False: "NO", None: "-"}[r.get("ok")]
        lines.append(f"{name:<16} {ok:<6} {r.get('seconds', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", action="store_true", help="fill .gpu/ (needs a package index)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="2 layers, a few short requests")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu"))
    ap.add_argument("--model-files", default=str(GPU_DIR / "model"),
                    help="config and tokenizer (made from the embedded model where absent)")
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting sections after")
    ap.add_argument("--sections", default="", help="comma-separated: run only these (and env, "
                    "model)")
    ap.add_argument("--graph-modes", default="graphs,eager",
                    help="cuda_graphs section: the engine with graphs, without, or both")
    args = ap.parse_args(argv)
    if args.prepare:
        prepare()
        return 0
    if args.device.startswith("cuda"):
        from engine.model.loader import prefer_expandable_segments

        prefer_expandable_segments()  # as the server would, before the first CUDA call
        if not torch.cuda.is_available():
            print("no CUDA device visible to torch", file=sys.stderr)
            return 2
    return run(Check(args))


if __name__ == "__main__":
    sys.exit(main())
