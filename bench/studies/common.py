"""Shared pieces of the in-process engine studies (no server): flags, threads, model, engine runs,
transformers baselines, stats, and their results files (bench/results/<study>.json, git-ignored).
Tables and paths come from bench/harness.py, which the scenarios share."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import isa_cap
from bench.harness import RESULTS_DIR
from bench.harness import write_json as _write
from engine import Engine, EngineConfig, LoadedModel, SamplingParams, StepStats, load_model
from engine.config import default_num_threads


# -- flags, threads, model -------------------------------------------------------------------------
def base_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the flags every script takes: --threads, --quick, --seed, --out, --device."""
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--threads", type=int, default=default_num_threads(),
                    help="torch intra-op threads, all methods (engine default_num_threads())")
    ap.add_argument("--quick", action="store_true",
                    help="shrink everything (a smoke run of well under a minute)")
    ap.add_argument("--seed", type=int, default=0, help="ShareGPT shuffle seed")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON results path (None: bench/results/<script>.json)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                    help="model dtype for every method "
                         "(auto: bf16 on GPUs and on CPUs with native bf16)")
    return ap


def setup_threads(threads: int) -> int:
    """Use `threads` intra-op threads in the calling thread (the engine sets its own thread's)."""
    torch.set_num_threads(threads)
    return threads


def load(threads: int, device: str = "cpu", dtype: str = "auto") -> LoadedModel:
    """The embedded default model (SmolLM2-135M-Instruct) with `threads` torch threads."""
    setup_threads(threads)
    return load_model(EngineConfig(num_threads=threads, device=device, dtype=dtype))


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a wall-clock reading covers it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def env_info(loaded: LoadedModel, threads: int) -> dict:
    """What the numbers were measured on; the load average says whether the machine was quiet."""
    import transformers

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": loaded.name,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "threads": threads,
        "cores": cores,
        "load_avg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # The ISA caps in force (bench/isa_cap.py: a lower ISA approximated on this CPU).
        "isa_caps": {name: os.environ[name] for cap in isa_cap.CAPS.values() for name in cap
                     if name in os.environ},
    }


def fixed_length(n: int) -> SamplingParams:
    """Greedy, exactly `n` new tokens (EOS blocked until then), so every method does equal work."""
    return SamplingParams(strategy="greedy", max_new_tokens=n, min_new_tokens=n)


# -- timing and statistics ------------------------------------------------------------------------
@dataclass
class Timer:
    seconds: float = 0.0


@contextmanager
def timed():
    """`with timed() as t: ...` then `t.seconds` (perf_counter wall time)."""
    t = Timer()
    start = time.perf_counter()
    try:
        yield t
    finally:
        t.seconds = time.perf_counter() - start


def describe(values: Sequence[float]) -> dict:
    """count, mean, median, p90, min, max of a sample (None for an empty one)."""
    if not values:
        return {"count": 0, "mean": None, "median": None, "p90": None, "min": None, "max": None}
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "mean": statistics.fmean(ordered),
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "min": ordered[0],
        "max": ordered[-1],
    }


# -- the engine -----------------------------------------------------------------------------------
@dataclass
class StepRecorder:
    """A step listener (`engine.add_step_listener(rec)`) keeping every StepStats."""

    steps: list[StepStats] = field(default_factory=list)

    def __call__(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def batch_steps(self) -> list[StepStats]:
        """Steps that ran at least one decode forward (the rolling batch was not empty)."""
        return [s for s in self.steps if s.sub_batches > 0]

    def pure_decode_steps(self) -> list[StepStats]:
        """Decode steps with no prompt chunk and no regroup (nobody joined or left)."""
        return [s for s in self.steps
                if s.sub_batches and not s.prefill_chunks and not s.regrouped]

    def summary(self) -> dict:
        steps = self.batch_steps()
        if not steps:
            return {"steps": len(self.steps)}
        pure = self.pure_decode_steps()
        pure_ids = {s.step for s in pure}
        # Decode steps that also ran prompt chunks or regrouped (the regroup copies KV).
        regroup = [s for s in steps if s.step not in pure_ids]
        return {
            "steps": len(self.steps),
            "decode_steps": len(steps),
            "pure_decode_steps": len(pure),
            "regroup_decode_steps": len(regroup),
            "mean_sub_batches": statistics.fmean(s.sub_batches for s in steps),
            "max_sub_batches": max(s.sub_batches for s in steps),
            "mean_sparsity": statistics.fmean(s.sparsity for s in steps),
            "mean_padded_tokens": statistics.fmean(s.padded_tokens for s in steps),
            "peak_kv_bytes": max(s.kv_bytes for s in self.steps),
            "mean_running": statistics.fmean(s.running for s in steps),
            "step_seconds": sum(s.seconds for s in self.steps),
            "prefill_tokens": sum(s.prefill_tokens for s in self.steps),
            "prefill_step_seconds": sum(s.seconds for s in self.steps if s.prefill_chunks),
            "decode_step_seconds": describe([s.seconds for s in steps]),
            "pure_decode_step_seconds": describe([s.seconds for s in pure]),
            "regroup_decode_step_seconds": describe([s.seconds for s in regroup]),
        }


def make_engine(loaded: LoadedModel, threads: int, background: bool = True,
                **config) -> tuple[Engine, StepRecorder]:
    """A started engine over `loaded`, with a StepRecorder attached."""
    eng = Engine(EngineConfig(num_threads=threads, **config), loaded=loaded)
    rec = StepRecorder()
    eng.add_step_listener(rec)
    eng.start(background=background)
    return eng, rec


def drain(handle) -> list[int]:
    """All token ids of a single-sequence job (blocks until its stream ends); raises on an error."""
    tokens: list[int] = []
    for delta in handle.iter_sync():
        if delta.error:
            raise RuntimeError(f"{delta.job_id}: {delta.error}")
        tokens += delta.token_ids
    return tokens


def run_engine(eng: Engine, jobs: Sequence[tuple[list[int], SamplingParams]]
               ) -> tuple[list[list[int]], float]:
    """Submit every job at once to a background engine; their outputs and the wall time to the
    last token."""
    start = time.perf_counter()
    handles = [eng.submit(ids, params) for ids, params in jobs]
    outputs = [drain(h) for h in handles]
    return outputs, time.perf_counter() - start


# -- transformers baselines -----------------------------------------------------------------------
@contextmanager
def left_padding(tokenizer):
    """The tokenizer set up for batched generate (left padding, a pad token), restored after."""
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        yield tokenizer
    finally:
        tokenizer.padding_side = side
        if pad is None:
            tokenizer.pad_token = pad


@torch.inference_mode()
def hf_generate(loaded: LoadedModel, batch: Sequence[list[int]],
                new_tokens: int) -> list[list[int]]:
    """transformers greedy `generate` on a left-padded batch, exactly `new_tokens` per row."""
    tok = loaded.tokenizer
    with left_padding(tok):
        enc = tok.pad({"input_ids": [list(ids) for ids in batch]}, padding=True,
                      return_tensors="pt")
        pad_id = tok.pad_token_id
    enc = {k: v.to(loaded.device) for k, v in enc.items()}
    out = loaded.model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=pad_id)
    return out[:, enc["input_ids"].shape[1]:].tolist()


def warm_up(loaded: LoadedModel) -> None:
    """One short generate, so no method pays first-call costs (allocator, lazy init)."""
    hf_generate(loaded, [loaded.tokenizer.encode("Hello, warm up.")] * 2, 4)


# -- output ---------------------------------------------------------------------------------------
def mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def write_json(name: str, data: dict, path: Path | None = None) -> Path:
    """Write results to `path` or bench/results/<name>.json; returns where."""
    return _write(path or RESULTS_DIR / f"{name}.json", data, indent=2)
