"""How the benchmark launches its servers: llama.cpp gets one slot per concurrent request and no
`model` in requests; the others are unchanged by the concurrency."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from bench.servers import (
    LLAMA_CPP,
    LLAMA_CPP_LOOKUP,
    REPO,
    SEQGATE,
    SEQGATE_NO_SPEC,
    SWEEP_SERVERS,
    TF_SERVE,
)


def test_llama_cpp_gets_a_slot_per_concurrent_request():
    spec = LLAMA_CPP.for_concurrency(32)
    argv = spec.argv(Path("/models/x"), 8123)
    assert argv[:3] == [sys.executable, "-m", "bench.llamacpp_server"]
    assert argv[argv.index("--parallel") + 1] == "32" and argv[argv.index("--port") + 1] == "8123"
    assert spec.request_model(Path("/models/x"), "served") is None
    assert "llama.cpp" in SWEEP_SERVERS


def test_the_speculative_peers_keep_their_own_flags():
    argv = LLAMA_CPP_LOOKUP.for_concurrency(4).argv(Path("/models/x"), 8123)
    assert "--lookup" in argv and argv[argv.index("--parallel") + 1] == "4"
    off = SEQGATE_NO_SPEC.argv(Path("/models/x"), 8123)
    assert off[off.index("--num-speculative-tokens") + 1] == "0"


def test_other_servers_ignore_the_concurrency():
    assert SEQGATE.for_concurrency(32) is SEQGATE and TF_SERVE.for_concurrency(8) is TF_SERVE
    assert TF_SERVE.request_model(Path("/models/x"), None) == "/models/x"
    assert SEQGATE.request_model(Path("/models/x"), "SmolLM2") == "SmolLM2"


def test_seqgate_from_another_checkout_runs_its_app_module_there():
    """`bench.serving --checkout DIR`: `python -m app` started with DIR as working directory
    imports that checkout's code, not this one's installed `seqgate` script."""
    spec = dataclasses.replace(SEQGATE, label="seqgate@abc1234", checkout=Path("/src/old"))
    argv = spec.argv(Path("/models/x"), 8123)
    assert argv[:4] == [sys.executable, "-m", "app", "serve"]
    assert argv[argv.index("--model") + 1] == "/models/x"
    # This checkout's the same way, in this checkout: an editable install's `seqgate` script
    # would run the code of the checkout it was installed from, not a worktree's.
    assert SEQGATE.argv(Path("/models/x"), 8123)[:4] == [sys.executable, "-m", "app", "serve"]
    assert SEQGATE.checkout is None and SEQGATE.cwd == REPO
