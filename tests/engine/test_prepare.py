"""Model surgery (engine/model/prepare.py) choices that depend on the device."""

from __future__ import annotations

import dataclasses

import torch

from engine import EngineConfig
from engine.model.prepare import prepare


def test_cuda_engine_turns_off_cudnn_attention(tiny_model):
    """cuDNN's attention builds a graph per shape and every decode step has a new KV length:
    the GPU check measured ~1.4 ms of host time per call (docs/gpu.md). Preparing a model for
    CUDA turns that backend off; the CPU leaves the setting alone. (The device is only named
    here: surgery runs on the CPU copy; the GPU check's profile proves which kernels run.)"""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        prepare(tiny_model, EngineConfig(fuse_sub_batches=False))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        on_cuda = dataclasses.replace(tiny_model, device=torch.device("cuda"))
        prepare(on_cuda, EngineConfig(fuse_sub_batches=False))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
