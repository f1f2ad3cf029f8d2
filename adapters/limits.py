"""How large a request's shape may be: bounds checked before anything is tokenized or submitted.

Per-job bounds (stop strings, logit_bias, stop_token_ids, n, top_logprobs) live with the engine's
`SamplingParams`; these are the bounds of the request around the jobs. Each caps work or memory
that one client could otherwise make the server spend (README: "Limits").
"""

from __future__ import annotations

MAX_MESSAGES = 4096  # chat messages in one request
MAX_CONTENT_PARTS = 256  # content parts in one message
MAX_PROMPTS = 64  # prompts in one /v1/completions request, inputs in one DJL request
MAX_CHOICES = 64  # prompts × n in one /v1/completions request
MAX_TOOLS = 128  # tools (or legacy functions) in one chat request, as OpenAI allows
