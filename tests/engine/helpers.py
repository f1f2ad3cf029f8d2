"""Test helpers: prompts of varied length, a reference greedy decoder, collecting engine output."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicCache

from engine import Engine, EngineConfig, JobHandle, LoadedModel, SamplingParams
from engine.kv.budget import PREFIX_CACHE_SHARE, kv_bytes_per_token
from engine.model.lowbit import BlockLinear
from engine.model.prepare import original_model
from engine.model.runner import cache_keyword

SENTENCES = [
    "The river ran quietly past the old mill, carrying leaves from the autumn trees.",
    "Engineers measured the bridge twice before they trusted the numbers.",
    "A small robot learned to sort coloured blocks by watching children play.",
    "In the morning market, traders called out prices for fish, bread and spices.",
]


def prompt_of(tokenizer, n_sentences: int, question: str) -> list[int]:
    body = " ".join(SENTENCES[i % len(SENTENCES)] for i in range(n_sentences))
    return tokenizer.encode(f"{body}\nQuestion: {question}\nAnswer:")


def varied_prompts(tokenizer, count: int) -> list[list[int]]:
    """Prompts whose lengths span about two orders of magnitude (≈5 to ≈500 tokens)."""
    sizes = [0, 1, 2, 4, 8, 16, 24, 32, 3, 12, 6, 20][:count]
    out = []
    for i, n in enumerate(sizes):
        ids = (
            prompt_of(tokenizer, n, f"what happens in part {i}?")
            if n
            else tokenizer.encode(f"Hi {i}!")
        )
        out.append(ids)
    return out


def reference_greedy(
    model, ids: list[int], max_new_tokens: int, min_new_tokens: int = 0
) -> list[int]:
    """transformers' own greedy decoding, one sequence, no padding (its own decoder layers, also
    where an engine gave the model lean ones)."""
    with torch.inference_mode(), original_model(model):
        out = model.generate(
            torch.tensor([ids], device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            min_new_tokens=min_new_tokens,
        )
    return out[0, len(ids) :].tolist()


def collect(handle: JobHandle) -> dict[int, dict]:
    """Drain a sync handle: per sequence index, its tokens, text, finish reason and deltas."""
    seqs: dict[int, dict] = {}
    for d in handle.iter_sync(timeout=0):
        s = seqs.setdefault(
            d.index, {"tokens": [], "text": "", "finish": None, "deltas": [], "logprobs": []}
        )
        s["tokens"] += d.token_ids
        s["text"] += d.text
        s["deltas"].append(d)
        s["logprobs"] += d.logprobs or []
        if d.finish_reason:
            s["finish"] = d.finish_reason
    return seqs


BUDGET_JOBS, BUDGET_NEW_TOKENS = 32, 12


def budget_workload(tokenizer) -> list[list[int]]:
    """32 prompts of about 10 to 350 tokens, for runs under a KV budget."""
    sizes = [0, 1, 2, 4, 8, 16, 20, 3, 12, 6]
    return [prompt_of(tokenizer, sizes[i % len(sizes)], f"what happens in part {i}?")
            if sizes[i % len(sizes)] else tokenizer.encode(f"Hi {i}!")
            for i in range(BUDGET_JOBS)]


def eight_rows_budget(loaded: LoadedModel, prompts: list[list[int]]) -> int:
    """A KV budget (kv_cache_bytes) whose rolling-batch share holds 8 rows of the longest of
    `prompts` with BUDGET_NEW_TOKENS new tokens."""
    per_token = kv_bytes_per_token(loaded.model.config, loaded.dtype)
    batch = 8 * max(len(p) + BUDGET_NEW_TOKENS for p in prompts) * per_token
    return int(batch / (1 - PREFIX_CACHE_SHARE)) + 1


_UNBUDGETED: dict[tuple, list[dict]] = {}


def unbudgeted_outputs(loaded: LoadedModel, prompts: list[list[int]]) -> list[dict]:
    """Greedy outputs of `prompts` under the automatic KV budget (far from binding) and a
    batch as large as the workload; computed once per model and workload (greedy output does
    not change between runs, and several tests compare against it)."""
    key = (id(loaded.model), tuple(map(tuple, prompts)))
    if key not in _UNBUDGETED:
        _UNBUDGETED[key] = _run_unbudgeted(loaded, prompts)
    return _UNBUDGETED[key]


def _run_unbudgeted(loaded: LoadedModel, prompts: list[list[int]]) -> list[dict]:
    eng = Engine(EngineConfig(max_rolling_batch_size=len(prompts)), loaded=loaded)
    eng.start(background=False)
    try:
        handles = [eng.submit(p, SamplingParams(strategy="greedy",
                                                max_new_tokens=BUDGET_NEW_TOKENS))
                   for p in prompts]
        eng.run_until_idle()
    finally:
        eng.stop(drain=False)
    return [collect(h)[0] for h in handles]


def count_slab_columns(monkeypatch) -> list[int]:
    """Under the device slab policy (memory taken at allocation; here on the CPU), the column
    capacity of every slab the batch allocates, in order."""
    import engine.kv.batch as batch_module
    import engine.kv.slab_sizing as sizing_module

    sizes: list[int] = []
    real = sizing_module.new_slabs

    def counting(like, shapes):
        sizes.append(shapes[0][0][2])
        return real(like, shapes)

    for module in (batch_module, sizing_module):
        monkeypatch.setattr(module, "pages_on_write", lambda device: False)
    monkeypatch.setattr(sizing_module, "new_slabs", counting)
    return sizes


def forward_in_chunks(model: torch.nn.Module, ids: torch.Tensor, cuts: list[int]
                      ) -> tuple[list[torch.Tensor], DynamicCache]:
    """The logits of each forward of `ids` [1, tokens] cut at the `cuts` columns, through one
    DynamicCache, and that cache."""
    cache, logits = DynamicCache(), []
    bounds = [0, *cuts, ids.shape[1]]
    with torch.inference_mode():
        for a, b in zip(bounds, bounds[1:]):
            logits.append(model(input_ids=ids[:, a:b], **{cache_keyword(model): cache},
                                use_cache=True).logits)
    return logits, cache


def python_forward_in_chunks(model: torch.nn.Module, ids: torch.Tensor, cuts: list[int]
                            ) -> tuple[list[torch.Tensor], DynamicCache]:
    """`forward_in_chunks` with every lean layer's native halves turned off (the Python
    forward); they stay off."""
    for layer in model.model.layers:
        vars(layer)["_lean_native"] = None
    return forward_in_chunks(model, ids, cuts)


def assert_same_forwards(a: tuple[list[torch.Tensor], DynamicCache],
                         b: tuple[list[torch.Tensor], DynamicCache]) -> None:
    """Two `forward_in_chunks` results equal bit for bit: logits and KV cache."""
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    for x, y in zip(a[1].layers, b[1].layers, strict=True):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


def fresh_copy(smollm2: LoadedModel) -> LoadedModel:
    """A copy of the shared model as loaded: block layers (an earlier engine's) made plain."""
    model = copy.deepcopy(smollm2.model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, BlockLinear):
                plain = torch.nn.Linear(child.in_features, child.out_features,
                                        bias=child.bias is not None, device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
    model.tie_weights()
    return LoadedModel(model, smollm2.tokenizer, smollm2.name, smollm2.source, smollm2.device,
                       smollm2.dtype, 0.0, False)
