"""Scheduler overhead: the engine's decode step vs a bare model forward on the same batch shape.

    python -m bench.studies.overhead [--jobs 32] [--prompt-tokens 100] [--new-tokens 64]
                                     [--threads N] [--repeats 2] [--quick]

The engine runs `--jobs` ShareGPT prompts of similar length (within ±10% of --prompt-tokens),
greedy, exactly --new-tokens each, driven step by step from this thread (`start(background=False)`,
`step()`). Every prompt is prefilled in step 1, the rows join the batch in step 2; steps
3 … new_tokens are pure decode (no prompt chunk, no regroup) and are the ones measured. Per step:
  - engine step wall: `engine.step()` end to end (schedule, decode, token choice, detokenization,
    stop checks, publish, stats listeners);
  - engine runner.decode: building ids / mask / positions plus the forward;
  - engine model forward: the model call alone (the engine's slab KV cache, written in place).
Bare baselines: the same prompts left-padded into one batch and prefilled in one call, then
`model(ids[b, 1], cache, attention_mask, position_ids)` per step, with
  - a transformers DynamicCache (it grows by torch.cat, so it copies its whole KV every step), and
  - the engine's preallocated slab cache (engine.kv.batch.SlabLayer), which isolates the scheduler.
The bare forwards run in lock step with the engine (engine step k, then bare forward k over the
same KV width, order alternating), so load from other processes hits both alike; overheads are
medians of per-step ratios. The target is < 15% for the step wall.
Writes bench/results/overhead.json.
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import DynamicCache

from bench.harness import markdown_table
from bench.provenance import jsonable
from bench.sharegpt import load_requests
from bench.studies.common import (
    base_parser,
    describe,
    env_info,
    fixed_length,
    load,
    make_engine,
    sync,
    warm_up,
    write_json,
)
from engine.kv.slab_sizing import GROWTH_COLUMNS
from engine.kv.slabs import SlabCache, SlabLayer
from engine.model.runner import cache_keyword

TARGET = 0.15
FIRST_PURE_STEP = 3


class _Clock:
    """Wraps a callable and adds the wall time of each call (GPU work included) to `total`."""

    def __init__(self, fn, device: torch.device):
        self.fn, self.device, self.total = fn, device, 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            sync(self.device)
            self.total += time.perf_counter() - t


class _TimedModel:
    """Stands in for the runner's model: calls are timed, attributes pass through."""

    def __init__(self, model, device: torch.device):
        self._model, self.clock = model, _Clock(model, device)

    def __call__(self, *args, **kwargs):
        return self.clock(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _as_slab(cache: DynamicCache, width: int) -> SlabCache:
    """The prefilled KV copied into the engine's preallocated cache type (same growth columns)."""
    layers = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        kbuf = k.new_zeros((*k.shape[:2], width + GROWTH_COLUMNS, k.shape[-1]))
        vbuf = v.new_zeros((*v.shape[:2], width + GROWTH_COLUMNS, v.shape[-1]))
        kbuf[:, :, :width], vbuf[:, :, :width] = k, v
        layers.append(SlabLayer(kbuf, vbuf, width))
    return SlabCache(layers)


class BareDecode:
    """A left-padded batch decoded with plain model calls; `step()` times one decode forward.

    Forward i (1-based) reads a KV of width max_len + i - 1, as the engine's step i does.
    """

    @torch.inference_mode()
    def __init__(self, loaded, prompts: list[list[int]], slab: bool):
        self.model, self.dev = loaded.model, loaded.device
        width = max(map(len, prompts))
        pad = loaded.tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.dev)
        self.mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                                 device=self.dev)
        self.lengths = self.mask.sum(-1)
        self.cache_kw = cache_keyword(self.model)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=self.mask,
                         position_ids=(self.mask.cumsum(-1) - 1).clamp(min=0),
                         **{self.cache_kw: cache}, use_cache=True, logits_to_keep=1)
        self.cache = _as_slab(cache, width) if slab else cache
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)
        self.i = 0

    @torch.inference_mode()
    def step(self) -> float:
        self.i += 1
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        pos = (self.lengths + self.i - 1)[:, None]
        sync(self.dev)
        t = time.perf_counter()
        out = self.model(input_ids=self.next, attention_mask=self.mask, position_ids=pos,
                         **{self.cache_kw: self.cache}, use_cache=True)
        sync(self.dev)
        elapsed = time.perf_counter() - t
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)
        return elapsed


def run_lockstep(loaded, threads: int, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Drive the engine by hand with both bare loops in lock step; one row per pure decode step."""
    bare = {"bare_dynamic": BareDecode(loaded, prompts, slab=False),
            "bare_slab": BareDecode(loaded, prompts, slab=True)}
    # Prefill every prompt in step 1 (a step's token budget holds them all), so all rows share
    # one history and the batch has the bare loops' shape.
    batch = max(32, len(prompts))
    eng, _ = make_engine(loaded, threads, background=False, max_rolling_batch_size=batch,
                         max_num_batched_tokens=max(512, sum(map(len, prompts)), batch + 1))
    model_clock = _TimedModel(eng.runner.model, loaded.device)
    eng.runner.model = model_clock
    decode_clock = _Clock(eng.runner.decode, loaded.device)
    eng.runner.decode = decode_clock
    handles = [eng.submit(p, fixed_length(new_tokens)) for p in prompts]
    rows = []
    while eng.scheduler.has_work:
        k = eng.scheduler.step + 1
        row = {"step": k}
        paired = 2 <= k <= new_tokens  # engine steps that decode, as the bare loops do
        if paired and k % 2:  # bare first on odd steps
            row.update({name: b.step() for name, b in bare.items()})
        f0, d0 = model_clock.clock.total, decode_clock.total
        sync(loaded.device)
        t = time.perf_counter()
        st = eng.step()
        sync(loaded.device)
        row["wall"] = time.perf_counter() - t
        if paired and not k % 2:
            row.update({name: b.step() for name, b in reversed(bare.items())})
        if st.sub_batches and not st.regrouped and not st.prefill_chunks:
            row.update(sub_batches=st.sub_batches,
                       width=max(sb.width for sb in eng.batch.sub_batches) - 1,
                       forward=model_clock.clock.total - f0,
                       runner_decode=decode_clock.total - d0)
            rows.append(row)
    eng.stop(drain=False)
    for h in handles:  # every job ran its whole budget
        assert sum(len(d.token_ids) for d in h.iter_sync(timeout=0)) == new_tokens
    assert [r["step"] for r in rows] == list(range(FIRST_PURE_STEP, new_tokens + 1)), \
        f"unexpected pure decode steps {[r['step'] for r in rows]}"
    return rows


def main() -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="runs, steps pooled")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.new_tokens, args.repeats = 8, 16, 1
    if args.new_tokens < FIRST_PURE_STEP + 1:
        ap.error(f"--new-tokens must be at least {FIRST_PURE_STEP + 1}")

    loaded = load(args.threads, args.device, args.dtype)
    lo, hi = round(args.prompt_tokens * 0.9), round(args.prompt_tokens * 1.1)
    prompts = [r.prompt_ids for r in load_requests(loaded.tokenizer, args.jobs, seed=args.seed,
                                                   min_prompt=lo, max_prompt=hi)]
    print(f"{len(prompts)} jobs, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {args.new_tokens} new tokens each; threads={args.threads}")
    warm_up(loaded)

    steps = []
    for r in range(args.repeats):
        steps += run_lockstep(loaded, args.threads, prompts, args.new_tokens)
        print(f"run {r + 1}: {args.new_tokens - FIRST_PURE_STEP + 1} pure decode steps")
    subs = {s["sub_batches"] for s in steps}
    if subs != {1}:
        print(f"note: the engine ran {sorted(subs)} sub-batches per step; the bare forward is one "
              f"batch, so the comparison includes splitting")

    names = {
        "bare_dynamic": "bare forward, DynamicCache",
        "bare_slab": "bare forward, slab cache",
        "forward": "engine: model forward",
        "runner_decode": "engine: runner.decode",
        "wall": "engine: step wall",
    }

    def ratio(key: str, base: str) -> float:
        """Median over steps of key / base - 1 (paired within each step)."""
        return describe([s[key] / s[base] - 1 for s in steps])["median"]

    parts = {key: describe([s[key] for s in steps]) for key in names}
    rows = [(names[key], d["count"], d["mean"] * 1e3, d["median"] * 1e3, d["p90"] * 1e3,
             100 * ratio(key, "bare_slab"), 100 * ratio(key, "bare_dynamic"))
            for key, d in parts.items()]
    print()
    print(markdown_table(["per decode step", "steps", "mean ms", "median ms", "p90 ms",
                          "vs bare slab %", "vs bare DynamicCache %"], rows))
    over = {
        "step_wall_vs_bare_slab": ratio("wall", "bare_slab"),
        "step_wall_vs_own_forward": ratio("wall", "forward"),
        "step_wall_vs_bare_dynamic_cache": ratio("wall", "bare_dynamic"),
    }
    labels = {
        "step_wall_vs_bare_slab": "step wall vs bare forward (slab cache)",
        "step_wall_vs_own_forward": "step wall vs its own model forward",
        "step_wall_vs_bare_dynamic_cache": "step wall vs bare forward (DynamicCache)",
    }
    print(f"\n% columns: medians of per-step ratios. Batch {len(prompts)} rows, KV width "
          f"{steps[0]['width']}-{steps[-1]['width']} before each step's forward. Overhead:")
    for key, label in labels.items():
        verdict = "within" if over[key] < TARGET else "OVER"
        print(f"  {label}: {100 * over[key]:+.1f}% ({verdict} the {100 * TARGET:.0f}% target)")

    path = write_json("overhead", {
        "args": jsonable(args),
        "env": env_info(loaded, args.threads),
        "prompt_tokens": [len(p) for p in prompts],
        "per_step_seconds": {names[k]: d for k, d in parts.items()},
        "overhead": over,
        "target": TARGET,
        "steps": steps,
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
