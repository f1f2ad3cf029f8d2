"""Operations: /health, /version, /metrics, /tokenize, /detokenize."""

from __future__ import annotations

import platform

from litestar import Controller, Request, Response, get, post

from adapters.errors import LOADING_RETRY_AFTER, ApiError
from adapters.openai_chat import render_prompt, template_messages
from adapters.openai_types import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from app.api_docs import documented
from app.auth import is_authorized, require_api_key
from app.controllers.openai import decode, json_response
from app.lifespan import Gateway
from app.metrics import CONTENT_TYPE
from app.version import __version__


class OpsController(Controller):
    """Health, version, metrics and tokenizer routes for operators and tooling."""

    tags = ["Operations"]

    @get("/health", operation_id="health", summary="200 once the model answers; 503 while "
         "loading or draining")
    async def health(self, gw: Gateway) -> Response:
        status = gw.status
        body: dict = {"status": status}
        if gw.replica_report is not None:  # engine replicas: what each last reported
            body["replicas"] = gw.replica_report()
        if status == "ok":
            return Response(content=body, status_code=200)
        headers = {"Retry-After": str(LOADING_RETRY_AFTER)} \
            if status in ("loading", "no_replicas") else None
        return Response(content=body, status_code=503, headers=headers)

    @get("/version", operation_id="version", summary="Versions and the engine's configuration "
         "(with API keys set: the configuration only for a caller with a key)")
    async def version(self, request: Request, gw: Gateway) -> dict:
        import torch
        import transformers

        if not is_authorized(request):
            return {"version": __version__}

        cfg = gw.settings.engine
        engine = gw.engine
        running = engine.config if engine else cfg  # as the engine resolved it (auto values)
        return {
            "version": __version__,
            "model": gw.model_name,
            "max_model_len": engine.max_model_len if engine else None,
            "device": str(engine.loaded.device) if engine else None,
            "dtype": str(engine.loaded.dtype).removeprefix("torch.") if engine else None,
            "engine": {"max_rolling_batch_size": running.batch_rows,
                       "job_queue_size": cfg.job_queue_size, "max_sparsity": cfg.max_sparsity,
                       "max_splits": running.splits, "decoding_strategy": cfg.decoding_strategy,
                       "num_threads": cfg.threads, "quantize": cfg.quantize,
                       "kernels": _kernels(engine),
                       "speculative": {
                           "method": "draft_model" if cfg.speculative_model else "ngram",
                           "model": cfg.speculative_model,
                           "num_speculative_tokens": cfg.num_speculative_tokens,
                           "speculative_max_rows": cfg.speculative_max_rows}},
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }

    @get("/metrics", operation_id="metrics", summary="Prometheus metrics", media_type=CONTENT_TYPE)
    async def metrics(self, gw: Gateway) -> Response:
        return Response(content=gw.metrics.render(), media_type=CONTENT_TYPE)

    @post("/tokenize", operation_id="tokenize", summary="Token ids of a text or a chat",
          status_code=200, guards=[require_api_key],
          operation_class=documented(TokenizeRequest, TokenizeResponse,
                                     errors=("400", "401", "404", "503")))
    async def tokenize(self, request: Request, gw: Gateway) -> Response:
        engine = gw.require_ready()
        body = await request.body()

        def tokenize() -> list[int]:
            req = decode(request, body, TokenizeRequest, gw.model_name)
            if (req.prompt is None) == (req.messages is None):
                raise ApiError.bad_request("send exactly one of prompt or messages",
                                           param="prompt")
            if req.messages is not None:
                return render_prompt(engine.tokenizer, template_messages(req.messages))
            add = True if req.add_special_tokens is None else req.add_special_tokens
            return engine.tokenizer.encode(req.prompt, add_special_tokens=add)

        ids = await gw.off_loop(tokenize)
        return json_response(TokenizeResponse(tokens=ids, count=len(ids),
                                              max_model_len=engine.max_model_len))

    @post("/detokenize", operation_id="detokenize", summary="Text of token ids", status_code=200,
          guards=[require_api_key],
          operation_class=documented(DetokenizeRequest, DetokenizeResponse,
                                     errors=("400", "401", "404", "503")))
    async def detokenize(self, request: Request, gw: Gateway) -> Response:
        engine = gw.require_ready()
        body = await request.body()

        def detokenize() -> str:
            req = decode(request, body, DetokenizeRequest, gw.model_name)
            vocab = len(engine.tokenizer)
            if bad := [t for t in req.tokens if not 0 <= t < vocab]:
                raise ApiError.bad_request(f"token id {bad[0]} is outside the vocabulary "
                                           f"[0, {vocab})", param="tokens")
            return engine.tokenizer.decode(req.tokens)

        text = await gw.off_loop(detokenize)
        return json_response(DetokenizeResponse(prompt=text))


def _kernels(engine) -> dict | None:
    """The paths the engine chose on this host (None for a replica set: each chose its own)."""
    blocks = getattr(engine, "linear_blocks", None)
    if blocks is None:
        return None
    return {"decode_attention_layers": engine.decode_kernel_layers,
            "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
            "linear": {"mode": blocks.mode, "q4_layers": blocks.q4_layers,
                       "q8_layers": blocks.q8_layers, "h16_layers": blocks.h16_layers,
                       "int8_rows": blocks.int8_rows, "max_rows": blocks.max_rows,
                       "ms_per_pass_kernel_vs_torch": blocks.timings},
            "w8a8": _w8a8(getattr(engine, "int8_layers", None)),
            "native_layers": _native(getattr(engine, "native_layers", None))}


def _native(report) -> dict | None:
    if report is None or not report.layers:
        return None
    return {"layers": report.layers, "max_rows": report.max_rows,
            "ms_per_pass_blocks_vs_dense": report.timings}


def _w8a8(report) -> dict | None:
    if report is None or not report.layers:
        return None
    return {"layers": report.layers, "product": report.product, "min_rows": report.min_rows,
            "ms_per_pass_int8_vs_exact": report.timings}
