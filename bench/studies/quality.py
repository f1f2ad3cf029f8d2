"""How far each weight format moves the model's next-token distributions from fp32's.

    python -m bench.studies.quality [--num-answers 200] [--max-answer 64] [--max-prompt 256]
                                    [--variants bf16,int4,int8,torch-int4,w8a8,...] [--quick]

ShareGPT first turns with their recorded replies (chat template, reply truncated to
--max-answer tokens), teacher-forced through the fp32 model and through each variant, one
sequence per forward. At every reply position: KL(fp32 || variant) over the whole vocabulary,
whether the two argmaxes agree, and the variant's negative log-likelihood of the recorded token
(perplexity = exp of its mean). Variants:
  bf16        the model cast to bf16 (the default on CPUs with native bf16);
  int4        `--quantize int4` on an fp32 model: layers rounded to Q4_1 blocks, head to Q8_0
              (engine/model/blocks.py);
  int8        `--quantize int8` on an fp32 model: every layer rounded to Q8_0 blocks;
  int4-q8, int8-q8
              the same blocks with each row rounded to 8 bits per 32 columns and the products
              summed in integers (csrc/q8_rows.cpp, llama.cpp's arithmetic), on every forward:
              what `--quantize int4` / `int8` compute in forwards of few rows (decode steps
              and drafts; prompt chunks past the kernel's row limit multiply as int4 / int8
              above);
  bf16-int4-q8
              int4-q8 on the bf16 model (`--quantize int4` where the CPU has bf16 in
              hardware): the rows rounded from bf16, the results rounded to bf16;
  torch-int4  PyTorch's int4 format, computed in fp32 (engine/model/quantize.py: where the
              blocks are not used), layers int4 with groups of 32, head int8 per row.
  w8a8        `--quantize w8a8`: the decoder's layers in int8 weights (per channel) times int8
              activations (per token) on every forward (the engine uses it only from a row
              count measured on the host); the head exact (engine/model/w8a8.py). FBGEMM's
              product: 7-bit weights.
  w8a8-native the same through the native library's product (8-bit weights; oneDNN's int8
              sums on VNNI or AMX, its own int16 pairs elsewhere on x86), which the engine
              uses wherever the library has an exact one, with each layer's work between its
              products in the library's fused passes, as the engine runs it
              (engine.model.llama_layers); `w8a8-onednn` is its older name;
  bf16-w8a8   that product on the bf16 model (`--quantize w8a8` on an AVX512-BF16 CPU).
Any of them with `-kv16` appended also attends over keys and values rounded to fp16, as the
engine's KV cache holds them under `kv_cache_dtype` fp16 (the default for int4, int8 and w8a8
on an fp32 CPU model).
The fp32 weights of the embedded model are themselves Q4_1/Q8_0 blocks, so the default fp32
path (which reads those blocks exactly) is the reference itself. Writes
bench/results/quality.json.
"""

from __future__ import annotations

import copy
import math
import time

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from bench.harness import markdown_table
from bench.provenance import cpu_isa
from bench.sharegpt import shuffled_exchanges
from bench.studies.common import base_parser, env_info, load, write_json
from engine.kernels import native
from engine.model import llama_layers, lowbit, w8a8
from engine.model.blocks import rounded_blocks
from engine.model.loader import default_cache_dir
from engine.model.quantize import quantize_model

VARIANTS = ("bf16", "int4", "int8", "int4-q8", "int8-q8", "bf16-int4-q8", "torch-int4", "w8a8",
            "w8a8-native", "bf16-w8a8", "exact")
# Any variant with this suffix also keeps its KV in fp16 ("int4-q8-kv16").
KV16 = "kv16"


def _kv16(model: torch.nn.Module) -> torch.nn.Module:
    """`model` attending over keys and values rounded to fp16, as a KV cache kept in fp16
    holds them (`kv_cache_dtype`; each token's own too: the cache takes them before the
    attention reads them)."""
    def attention(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, key.half().to(query.dtype),
                                      value.half().to(query.dtype), *args, **kwargs)

    AttentionInterface.register(KV16, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(KV16, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(KV16)
    return model


def _rounded(model: torch.nn.Module, layers: str) -> torch.nn.Module:
    """A copy whose linear layers hold their rounded blocks' weights (int4: layers Q4_1, the
    head Q8_0 with weights of its own; int8: all Q8_0)."""
    out = copy.deepcopy(model)
    head = out.get_output_embeddings()
    for module in list(out.modules()):
        if type(module) is not torch.nn.Linear:
            continue
        kind = "q4" if layers == "int4" and module is not head else "q8"
        blocks = rounded_blocks(module.weight, kind)
        if blocks is not None:
            module.weight = torch.nn.Parameter(blocks.dense(), requires_grad=False)
    return out


def variant(model: torch.nn.Module, name: str) -> torch.nn.Module:
    if name.endswith(f"-{KV16}"):
        return _kv16(variant(model, name.removesuffix(f"-{KV16}")))
    if name == "bf16":
        return copy.deepcopy(model).to(torch.bfloat16)
    if name in ("int4", "int8"):
        return _rounded(model, name)
    if name in ("int4-q8", "int8-q8", "bf16-int4-q8", "exact"):
        # bf16-int4-q8: int4 as the engine runs it on a bf16 model (the default dtype where
        # the CPU has bf16 in hardware).
        out = copy.deepcopy(model)
        if name.startswith("bf16-"):
            out = out.to(torch.bfloat16)
        ops = native.kernels(default_cache_dir())
        if ops is None:
            raise RuntimeError(f"{name}: the native kernels do not build here")
        quantize = "none" if name == "exact" else name.removeprefix("bf16-").removesuffix("-q8")
        lowbit.install(out, ops, quantize, None)
        for layer in out.modules():
            if isinstance(layer, lowbit.BlockLinear):
                assert layer.int8_rows == (name != "exact")
                layer.max_rows = 1 << 30  # the kernel on every forward, as on decode steps
        return out
    if name == "torch-int4":
        out = copy.deepcopy(model)
        quantize_model(out, "int4")
        return out
    if name in ("w8a8", "w8a8-native", "bf16-w8a8"):
        out = copy.deepcopy(model)
        if name == "bf16-w8a8":
            out = out.to(torch.bfloat16)
        ops = None if name == "w8a8" else native.kernels(default_cache_dir())
        if name != "w8a8" and (ops is None or w8a8.native_product(ops) is None):
            raise RuntimeError(f"{name}: the native kernels have no exact int8 product here")
        w8a8.install(out, None, ops=ops)
        if ops is not None:
            # The engine's path: each layer's work between its int8 products in the native
            # library's fused passes (engine.model.llama_layers, csrc/int8_linear.cpp).
            llama_layers.install(out)
        for layer in out.modules():
            if isinstance(layer, w8a8.W8A8Linear):
                layer.min_rows = 0
            native_layer = vars(layer).get("_lean_native")
            for stacked in native_layer.int8 if native_layer is not None else ():
                stacked.min_rows = 0
        return out
    raise ValueError(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}")


def sequences(tokenizer, count: int, seed: int, max_prompt: int, max_answer: int):
    """(ids, first reply position) of `count` ShareGPT exchanges."""
    out = []
    for user, reply in shuffled_exchanges(seed):
        if len(out) == count:
            break
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                               tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer = tokenizer.encode(reply, add_special_tokens=False)[:max_answer]
        if len(ids) <= max_prompt and len(answer) >= 2:
            out.append((ids + answer, len(ids)))
    return out


@torch.inference_mode()
def log_probs(model: torch.nn.Module, ids: list[int], start: int) -> torch.Tensor:
    """Log-probabilities (fp32) of the next token at each reply position."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1:-1]
    return logits.float().log_softmax(-1)


def main() -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--num-answers", type=int, default=200)
    ap.add_argument("--max-answer", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    if args.quick:
        args.num_answers, args.max_answer = 8, 16
    loaded = load(args.threads, args.device, "fp32")
    reference = loaded.model.eval()
    seqs = sequences(loaded.tokenizer, args.num_answers, args.seed, args.max_prompt,
                     args.max_answer)
    names = ["w8a8-native" if n == "w8a8-onednn" else n for n in args.variants.split(",")]
    models = {name: variant(reference, name).eval() for name in names}
    sums = {name: {"kl": 0.0, "nll": 0.0, "agree": 0, "seconds": 0.0} for name in ["fp32", *names]}
    positions = 0
    for ids, start in seqs:
        ref = log_probs(reference, ids, start)
        targets = torch.tensor(ids[start:])
        positions += len(targets)
        sums["fp32"]["nll"] -= ref.gather(1, targets[:, None]).sum().item()
        for name, model in models.items():
            began = time.perf_counter()
            got = log_probs(model, ids, start)
            sums[name]["seconds"] += time.perf_counter() - began
            sums[name]["kl"] += (ref.exp() * (ref - got)).sum().item()
            sums[name]["nll"] -= got.gather(1, targets[:, None]).sum().item()
            sums[name]["agree"] += int((got.argmax(-1) == ref.argmax(-1)).sum())
    rows, result = [], {"env": {**env_info(loaded, args.threads), "isa": cpu_isa()},
                        "answers": len(seqs), "positions": positions, "variants": {}}
    for name, s in sums.items():
        entry = {"mean_kl": s["kl"] / positions, "perplexity": math.exp(s["nll"] / positions),
                 "top1_agreement": (s["agree"] / positions) if name != "fp32" else 1.0}
        result["variants"][name] = entry
        rows.append([name, f"{entry['mean_kl']:.2e}", round(entry["perplexity"], 3),
                     round(entry["top1_agreement"], 4)])
    print(f"ISA: {' '.join(cpu_isa()) or 'unknown'}; {len(seqs)} answers, {positions} positions")
    print(markdown_table(["weights", "mean KL vs fp32", "perplexity", "top-1 = fp32's"], rows))
    write_json("quality", result, args.out)


if __name__ == "__main__":
    main()
