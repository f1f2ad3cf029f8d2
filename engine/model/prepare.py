"""Model surgery, in one place: what the engine changes in a loaded model before serving it.

Each change computes what the model computed (exactly, or as closely as its dtype allows), only
faster: the packed forward (every sub-batch and prompt chunk of a step in one forward call), fp32
weights read from 4/8-bit blocks for forwards of few rows, bf16 weights laid out once for oneDNN,
the lean Llama layers, and the compiled decode-attention kernel where it builds for this host.
Weight-only quantisation (`quantize`), which changes the weights, is applied here too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from engine.config import ConfigError, EngineConfig
from engine.kernels import native
from engine.model import llama_layers, lowbit, packed_forward, prepack, w8a8
from engine.model.loader import LoadedModel, cache_dir, kv_cache_dtype
from engine.model.quantize import quantize_model

log = logging.getLogger("seqgate.engine")


@dataclass(frozen=True)
class Prepared:
    """What `prepare` changed: the packed forward is on, and how many layers got each path."""

    packed_forward: bool
    prepacked_layers: int
    lean_layers: int
    decode_kernel_layers: int
    kv_dtype: torch.dtype  # the KV cache's (`_kv_dtype`)
    lowbit: lowbit.LowbitReport = field(default_factory=lowbit.LowbitReport)
    w8a8: w8a8.W8A8Report = field(default_factory=w8a8.W8A8Report)
    native: llama_layers.NativeReport = field(default_factory=llama_layers.NativeReport)


def prepare(loaded: LoadedModel, config: EngineConfig) -> Prepared:
    """Install the fast paths the configuration allows into `loaded.model` (in place)."""
    model = loaded.model
    cpu = loaded.device.type == "cpu"
    # Tensor parallelism's layers go through hooks, which these would bypass.
    single = config.tensor_parallel_degree == 1
    dtype = model.get_output_embeddings().weight.dtype
    fp32 = dtype == torch.float32
    # bf16 layers whose values are a GGUF's blocks get them back for forwards of few rows
    # (w8a8's rows below its int8 range too); int4 and int8 round fp32 and bf16 layers alike.
    blockable = fp32 or dtype == torch.bfloat16
    ops = None
    if cpu and single and ((blockable and config.linear_kernel == "auto")
                           or config.decode_attention == "auto" or config.quantize == "w8a8"):
        ops = native.kernels(cache_dir(config))
    blocks = lowbit.LowbitReport()
    if cpu and single and blockable and ops is not None and config.linear_kernel == "auto":
        exact = "none" if config.quantize == "w8a8" else config.quantize
        blocks = lowbit.install(model, ops, exact, cache_dir(config), native.code_key(),
                                config.threads)
        log.info("linear layers: %d in Q4_1 blocks, %d in Q8_0, %d in 16 bits (%s, %.1f MiB), "
                 "the kernel for forwards of at most %d rows%s; ms per pass over all of them at "
                 "n rows, kernel vs PyTorch: %s", blocks.q4_layers, blocks.q8_layers,
                 blocks.h16_layers, blocks.mode, blocks.block_bytes / 2**20, blocks.max_rows,
                 " (rows rounded to 8 bits)" if blocks.int8_rows else "", blocks.timings)
    int8 = _install_w8a8(loaded, config, single, fp32, ops) if config.quantize == "w8a8" else \
        w8a8.W8A8Report()
    # Whether the weights were rounded (the KV may then be narrowed too, `_kv_dtype`).
    quantized = blocks.mode in ("int4", "int8") or int8.layers > 0
    if config.quantize in ("int4", "int8") and blocks.mode == "off":
        if cpu:
            report = quantize_model(model, config.quantize)
            quantized = True
            log.info("quantize=%s: %d layers in int4, %d in int8 (%.1f MiB packed)",
                     config.quantize, report.int4_layers, report.int8_layers,
                     report.packed_bytes / 2**20)
        else:
            log.warning("quantize=%s runs on the CPU only: ignored on %s", config.quantize,
                        loaded.device)
    if loaded.device.type == "cuda":
        # cuDNN's attention builds a graph per shape, and the KV length changes every decode step:
        # ~1.4 ms of host time per call on an H200 (docs/gpu.md). PyTorch's own kernels take masks.
        torch.backends.cuda.enable_cudnn_sdp(False)
    packed = config.fuse_sub_batches and packed_forward.install(model)
    prepacked = prepack.install(model) if single else 0
    lean = llama_layers.install(model) if single else 0
    native_layers = llama_layers.NativeReport()
    if lean and blocks.mode != "off":
        native_layers = llama_layers.time_native(model, cache_dir(config), native.code_key(),
                                                 config.threads)
        log.info("native layers: %d, multiplying in blocks up to %s rows; ms per pass over "
                 "their work around the attention at n rows, in blocks vs dense: %s",
                 native_layers.layers, native_layers.max_rows, native_layers.timings)
    kernel = None
    if config.decode_attention == "auto" and packed and single and cpu:
        kernel = ops
    kv_dtype = _kv_dtype(model, config, dtype, loaded.device, packed, quantized, kernel)
    kernel_layers = packed_forward.use_decode_kernel(model, kernel, kv_dtype)
    if kernel is not None and not kernel_layers:
        log.info("decode attention kernel: this model's head shape is not one it vectorises; "
                 "using PyTorch's SDPA")
    return Prepared(packed, prepacked, lean, kernel_layers, kv_dtype, blocks, int8, native_layers)


def _kv_dtype(model: torch.nn.Module, config: EngineConfig, dtype: torch.dtype,
              device: torch.device, packed: bool, quantized: bool, kernel) -> torch.dtype:
    """The KV cache's dtype. Only the packed forward's attention widens a narrower KV for the
    query, so without it a narrower one set by hand is refused. auto narrows it only where the
    weights were rounded and the decode kernel reads the narrower KV itself: elsewhere every
    step would widen a copy of it, slower than keeping the model's dtype."""
    wanted = kv_cache_dtype(config, dtype, device)
    if wanted == dtype:
        return dtype
    if config.kv_cache_dtype != "auto":
        if not packed:
            raise ConfigError("kv_cache_dtype", config.kv_cache_dtype,
                              f"the model's dtype ({str(dtype).removeprefix('torch.')}) where the "
                              "packed forward is off (fuse_sub_batches, or a model without "
                              "transformers' attention interface)")
        if not packed_forward.decode_kernel_reads(model, kernel, wanted):
            log.warning("kv_cache_dtype=%s under a %s model: the decode-attention kernel does "
                        "not read it here, so every step widens a copy of the KV (slower than "
                        "the model's dtype)", config.kv_cache_dtype,
                        str(dtype).removeprefix("torch."))
        return wanted
    if packed and quantized and packed_forward.decode_kernel_reads(model, kernel, wanted):
        log.info("kv_cache_dtype=auto: the KV cache in %s (weights quantised, %s model)",
                 str(wanted).removeprefix("torch."), str(dtype).removeprefix("torch."))
        return wanted
    return dtype


def _install_w8a8(loaded: LoadedModel, config: EngineConfig, single: bool, fp32: bool,
                  ops: native.Native | None) -> w8a8.W8A8Report:
    """int8 products through the native library where its int32 sums are exact (fp32 or bf16
    models), else through FBGEMM (fp32 models)."""
    if not (single and loaded.device.type == "cpu"):
        log.warning("quantize=w8a8 runs on the CPU without tensor parallelism: ignored")
        return w8a8.W8A8Report()
    if ops is not None and w8a8.native_product(ops) is None:
        ops = None
    if ops is None and not (fp32 and w8a8.available()):
        log.warning("quantize=w8a8 needs the native kernels with exact int8 sums, or an fp32 "
                    "model (--dtype fp32) and FBGEMM: ignored")
        return w8a8.W8A8Report()
    report = w8a8.install(loaded.model, cache_dir(config), native.code_key(), config.threads,
                          ops)
    log.info("w8a8 (%s): %d layers multiply forwards of at least %d rows in int8; ms per pass "
             "over them at n rows, int8 vs exact: %s", report.product, report.layers,
             report.min_rows, report.timings)
    return report


@contextmanager
def original_model(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the model computes as transformers' own does: its own decoder layers,
    linear layers on their fp32 weights (references in tests and checks)."""
    with llama_layers.original_layers(model), lowbit.dense_products(model), \
            w8a8.exact_products(model):
        yield
