"""llguidance against xgrammar on our workload: the embedded model's tokenizer (49,152 tokens),
the schemas our requests carry, one row's mask per token and a batch's mask application.

    python -m bench.studies.grammar_libs [--repeats 5] [--doc docs/benchmarks/grammar.md]

Run by hand when choosing or upgrading the grammar library (xgrammar is not a dependency:
`pip install xgrammar` first; without it the table has llguidance alone). For each schema and
library: the compile time of a schema never seen before (median and max over `--repeats`, a
fresh compiler each time, the tokenizer view built once beforehand), the first mask after
compiling (lazy set-up), and the per-token mask time (median, p95) while the tokens of a valid
instance are consumed one by one, masks written into a preallocated int32 bitmask. Then the time
to apply a bitmask to [32, vocab] float32 logits: xgrammar's CPU kernel, and seqgate's
(`engine.sample.grammar.unpack_bitmask` and one masked fill). And each library's installed
size, with what it pulls in.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import torch

from bench import provenance
from bench.harness import publish
from bench.servers import local_model_dir
from engine.sample.grammar import JSON_STYLE, unpack_bitmask

SCHEMAS = {
    "flat (3 fields)": (
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "ok": {"type": "boolean"}},
         "required": ["name", "age", "ok"], "additionalProperties": False},
        {"name": "Ada", "age": 36, "ok": True}),
    "nested (arrays, enums, bounds, patterns)": (
        {"type": "object", "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                     "minItems": 1, "maxItems": 3},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
         "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False},
        {"name": "Grace", "age": 45, "score": 0.5, "role": "admin", "tags": ["navy", "cobol"],
         "address": {"city": "Arlington", "zip": "22201"}}),
    "any JSON object": (
        {"type": "object"},
        {"title": "A note", "items": [1, 2, 3], "nested": {"ok": False, "why": None}}),
    "tool call": (
        {"type": "object", "properties": {
            "name": {"const": "get_weather"},
            "arguments": {"type": "object", "properties": {
                "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False}},
         "required": ["name", "arguments"], "additionalProperties": False},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}),
}


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int):
        import llguidance
        import llguidance.hf

        self.lib, self.vocab = llguidance, vocab
        t0 = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.tokenizer_s = time.perf_counter() - t0
        self.version = version("llguidance")

    def compile(self, schema: dict):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        matcher = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int):
        import xgrammar

        self.lib = xgrammar
        t0 = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.tokenizer_s = time.perf_counter() - t0
        self.version = version("xgrammar")

    def compile(self, schema: dict):
        compiler = self.lib.GrammarCompiler(self.info, cache_enabled=False, max_threads=2)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=(", ", ": "))
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


def measure(lib, tokenizer, vocab: int, repeats: int) -> list[dict]:
    rows = []
    words = (vocab + 31) // 32
    for label, (schema, instance) in SCHEMAS.items():
        compiles, firsts = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            matcher = lib.compile(schema)
            t1 = time.perf_counter()
            bitmask = torch.full((1, words), -1, dtype=torch.int32)
            lib.fill(matcher, bitmask)
            compiles.append(t1 - t0)
            firsts.append(time.perf_counter() - t1)
        ids = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
        per_token, accepted = [], 0
        for tok in ids:
            t0 = time.perf_counter()
            lib.fill(matcher, bitmask)
            per_token.append(time.perf_counter() - t0)
            if not lib.accept(matcher, tok):
                break
            accepted += 1
        rows.append({"library": lib.name, "schema": label,
                     "compile_ms_median": round(statistics.median(compiles) * 1e3, 2),
                     "compile_ms_max": round(max(compiles) * 1e3, 2),
                     "first_mask_ms": round(statistics.median(firsts) * 1e3, 2),
                     "mask_us_median": round(statistics.median(per_token) * 1e6, 1),
                     "mask_us_p95": round(_pct(per_token, 0.95) * 1e6, 1),
                     "tokens": len(ids), "accepted": accepted})
    return rows


def apply_times(vocab: int, rows: int = 32, repeats: int = 50) -> dict:
    """Milliseconds to mask [rows, vocab] logits with a bitmask, per implementation."""
    torch.manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(rows, vocab)

    def ours() -> None:
        logits.masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))

    impls = {"seqgate (unpack + masked_fill)": ours}
    try:
        import xgrammar

        def xgr() -> None:
            xgrammar.apply_token_bitmask_inplace(logits.clone(), bitmask, backend="cpu")
        impls["xgrammar apply_token_bitmask_inplace (cpu, incl. a clone)"] = xgr
    except ImportError:
        pass
    out = {}
    for name, fn in impls.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = round((time.perf_counter() - t0) / repeats * 1e3, 2)
    return out


def installed_mib() -> dict:
    """MiB on disk of each library's package directory and of what it pulls in (xgrammar:
    triton)."""
    import importlib.util

    out = {}
    for name in ("llguidance", "xgrammar", "triton"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        out[name] = round(sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
                          / 2**20, 1)
    return out


def report(data: dict) -> str:
    lines = ["| library | schema | compile median / max | first mask | mask per token "
             "median / p95 | instance tokens accepted |", "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['library']} | {r['schema']} | {r['compile_ms_median']} / "
                     f"{r['compile_ms_max']} ms | {r['first_mask_ms']} ms | "
                     f"{r['mask_us_median']} / {r['mask_us_p95']} µs | "
                     f"{r['accepted']}/{r['tokens']} |")
    lines.append("")
    for name, info in data["libraries"].items():
        lines.append(f"- {name} {info['version']}: tokenizer view built in "
                     f"{info['tokenizer_s']:.2f} s")
    for name in data.get("missing", []):
        lines.append(f"- {name}: not installed")
    lines.append("- installed size: " + ", ".join(f"{k} {v} MiB"
                                                 for k, v in data["installed_mib"].items()))
    lines.append("\nApplying a bitmask to [32, 49152] float32 logits: " + "; ".join(
        f"{k} {v} ms" for k, v in data["apply_ms"].items()) + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/grammar.json"))
    ap.add_argument("--doc", type=Path, default=None)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(local_model_dir())
    vocab = len(tokenizer)
    rows, libraries, missing = [], {}, []
    for cls in (Llguidance, Xgrammar):
        try:
            lib = cls(tokenizer, vocab)
        except ImportError:
            missing.append(cls.name)
            continue
        libraries[lib.name] = {"version": lib.version, "tokenizer_s": lib.tokenizer_s}
        rows += measure(lib, tokenizer, vocab, args.repeats)
    data = {"meta": provenance.meta(argv, "bench.studies.grammar_libs", versions_too=False),
            "libraries": libraries, "missing": missing, "rows": rows,
            "apply_ms": apply_times(vocab), "installed_mib": installed_mib()}
    publish(data, args.out, report(data), args.doc, "Grammar libraries on our workload",
            f"SmolLM2's tokenizer ({vocab} tokens).")

if __name__ == "__main__":
    main()
