"""llama.cpp's own HTTP server, as a benchmark peer, from the `xllamacpp` wheel (no compiler).

    python -m bench.llamacpp_server --port P [--parallel N] [--ctx-per-slot 2048] [--threads 2]
                                    [--model GGUF] [--lookup]

Serves the GGUF that seqgate embeds (SmolLM2-135M-Instruct, Q4_1) unless `--model` names
another, with `--parallel` slots (continuous batching over them) and `--ctx-per-slot` tokens of
context each, on 127.0.0.1. Runs until SIGTERM or SIGINT. llama.cpp computes with the Q4_1
weights; seqgate de-quantises the same file, so the two run the same weights at different
precisions. `--lookup` turns on llama.cpp's own n-gram speculation (`--spec-type ngram-simple`
with its defaults: the last 12 tokens looked up in the context, drafts of up to 48).
"""

from __future__ import annotations

import argparse
import signal
import threading


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--parallel", type=int, default=1, help="slots (concurrent sequences)")
    ap.add_argument("--ctx-per-slot", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model's)")
    ap.add_argument("--lookup", action="store_true", help="n-gram (prompt lookup) speculation")
    args = ap.parse_args(argv)
    import xllamacpp

    from engine.model.loader import embedded_model_path

    params = xllamacpp.CommonParams()
    params.model.path = args.model or str(embedded_model_path())
    params.n_parallel = args.parallel
    params.n_ctx = args.parallel * args.ctx_per_slot  # shared out over the slots
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    if args.lookup:
        params.speculative.types = [
            xllamacpp.common_speculative_type.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = xllamacpp.Server(params)
    print(f"llama.cpp server on {server.listening_address}, {args.parallel} slots", flush=True)
    stop.wait()
    del server  # its destructor stops the HTTP loop


if __name__ == "__main__":
    main()
