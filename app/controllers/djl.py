"""DJL-serving compatibility: POST /invocations (json or jsonlines, as option.output_formatter
says) and GET /ping."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.response import Stream

from adapters.djl import (
    DjlAssembler,
    DjlOutput,
    DjlRequest,
    build_djl_jobs,
    decode_djl,
)
from adapters.errors import DJL_NAMES, ApiError
from adapters.openai_params import JobSpec
from app.api_docs import documented
from app.auth import require_api_key
from app.lifespan import Gateway
from app.streaming import JobStream, closing, collect, open_request
from engine import EngineClient


class DjlController(Controller):
    """DJL's inference and health routes, for clients written against djl-serving."""

    tags = ["DJL"]

    @post("/invocations", operation_id="invocations", summary="Generate (DJL rolling batch)",
          status_code=200, guards=[require_api_key],
          operation_class=documented(DjlRequest, DjlOutput | list[DjlOutput], stream=DjlOutput,
                                     stream_media="application/jsonlines",
                                     errors=("400", "401", "413", "429", "503")))
    async def invocations(self, request: Request, gw: Gateway) -> Response:
        jsonlines_default = gw.settings.server.output_formatter == "jsonlines"

        def prepare(engine: EngineClient, body: bytes
                    ) -> tuple[tuple[DjlRequest, list[DjlAssembler], bool], list[JobSpec]]:
            req, opts = decode_djl(body)
            specs = build_djl_jobs(req, opts, engine.tokenizer, engine.max_model_len,
                                   gw.settings.server.max_tokens_limit)
            jsonlines = bool(req.stream) or jsonlines_default
            if jsonlines and not isinstance(req.inputs, str):
                raise ApiError.bad_request("jsonlines output streams one input at a time: send "
                                           "inputs as a string", param="inputs")
            inputs = [req.inputs] if isinstance(req.inputs, str) else req.inputs
            eos = set(engine.eos_ids)
            assemblers = [DjlAssembler(text, opts, gw.token_text, eos) for text in inputs]
            return (req, assemblers, jsonlines), specs

        (req, assemblers, jsonlines), stream = await open_request(
            gw, request, "/invocations", DJL_NAMES, prepare)
        if jsonlines:
            return Stream(self._lines(stream, assemblers[0]), media_type="application/jsonlines",
                          background=closing(stream))
        await collect(stream, request, lambda i, d: assemblers[i].add(d))
        results = [a.result() for a in assemblers]
        body = results[0] if isinstance(req.inputs, str) else results
        return Response(content=msgspec.json.encode(body), media_type="application/json")

    @staticmethod
    async def _lines(stream: JobStream, assembler: DjlAssembler) -> AsyncIterator[str]:
        try:
            while (item := await stream.next()) is not None:
                for line in assembler.add(item[1]):
                    yield line
        except ApiError as err:  # the request's deadline passed: say so on the last line
            yield msgspec.json.encode(err.body()).decode() + "\n"
        finally:
            stream.close()  # client gone or done: free the slot

    @get("/ping", operation_id="ping", summary="DJL health check")
    async def ping(self, gw: Gateway) -> Response:
        healthy = gw.accepting
        return Response(content={"status": "Healthy" if healthy else "Unhealthy"},
                        status_code=200 if healthy else 503)
