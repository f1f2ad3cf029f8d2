"""Model surgery, in one place: what the engine changes in a loaded model before serving it.

Each change computes what the model computed (exactly, or as closely as its dtype allows), only
faster: the packed forward (every sub-batch and prompt chunk of a step in one forward call), bf16
weights laid out once for oneDNN, the lean Llama layers, and the compiled decode-attention
kernel where it builds for this host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.kernels import decode_attention
from engine.model import llama_layers, packed_forward, prepack
from engine.model.loader import LoadedModel, cache_dir

log = logging.getLogger("seqgate.engine")


@dataclass(frozen=True)
class Prepared:
    """What `prepare` changed: the packed forward is on, and how many layers got each path."""

    packed_forward: bool
    prepacked_layers: int
    lean_layers: int
    decode_kernel_layers: int


def prepare(loaded: LoadedModel, config: EngineConfig) -> Prepared:
    """Install the fast paths the configuration allows into `loaded.model` (in place)."""
    model = loaded.model
    if loaded.device.type == "cuda":
        # cuDNN's attention builds a graph per shape, and the KV length changes every decode step:
        # ~1.4 ms of host time per call on an H200 (docs/gpu.md). PyTorch's own kernels take masks.
        torch.backends.cuda.enable_cudnn_sdp(False)
    packed = config.fuse_sub_batches and packed_forward.install(model)
    # Tensor parallelism's layers go through hooks, which these would bypass.
    single = config.tensor_parallel_degree == 1
    prepacked = prepack.install(model) if single else 0
    lean = llama_layers.install(model) if single else 0
    kernel = None
    if (config.decode_attention == "auto" and packed and single
            and loaded.device.type == "cpu"
            and model.get_output_embeddings().weight.dtype == torch.bfloat16):
        kernel = decode_attention.decode_attention_kernel(cache_dir(config))
    kernel_layers = packed_forward.use_decode_kernel(model, kernel)
    if kernel is not None and not kernel_layers:
        log.info("decode attention kernel: this model's head shape is not one it vectorises; "
                 "using PyTorch's SDPA")
    return Prepared(packed, prepacked, lean, kernel_layers)
