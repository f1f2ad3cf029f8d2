"""What detokenization and stop-string matching cost the engine thread: the share of the step's
time spent in `IncrementalDetokenizer.push` and `StopMatcher.feed` (the text work
`TokenDecoder.accept` does per token), at 1 and 32 rows, greedy, with two stop strings. It bounds
what moving that work to the request side (vLLM's output processor) could give back.

    python -m bench.studies.detokenize [--rows 1,32] [--steps 30]
"""

from __future__ import annotations

import statistics
import time

from bench.studies.common import base_parser, fixed_length, load, make_engine
from engine.request.detokenize import IncrementalDetokenizer
from engine.request.stops import StopMatcher

PROMPT = "Write a long story about a cat who travels the world and meets many friends."


def _timed(cls: type, name: str, spent: list[float]) -> None:
    real = getattr(cls, name)

    def wrapper(self, *args):
        t0 = time.perf_counter()
        try:
            return real(self, *args)
        finally:
            spent[0] += time.perf_counter() - t0

    setattr(cls, name, wrapper)


def main(argv: list[str] | None = None) -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    spent = [0.0]
    _timed(IncrementalDetokenizer, "push", spent)
    _timed(StopMatcher, "feed", spent)
    loaded = load(args.threads)
    eng, _ = make_engine(loaded, args.threads, num_speculative_tokens=0, background=False)
    prompt = loaded.tokenizer(PROMPT)["input_ids"]
    for rows in (int(r) for r in args.rows.split(",")):
        params = fixed_length(args.steps + 50)
        params.stop = ["The end of the story.", "\n\n\n"]
        for _ in range(rows):
            eng.submit(prompt, params)
        for _ in range(10):  # past the prefill
            eng.step()
        spent[0], steps = 0.0, []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t0)
        print(f"{rows} rows: step median {statistics.median(steps) * 1e3:.1f} ms; detokenize "
              f"and stop strings {spent[0] * 1e3:.1f} ms of {sum(steps) * 1e3:.0f} ms = "
              f"{100 * spent[0] / sum(steps):.2f}% ({spent[0] / (args.steps * rows) * 1e6:.1f} "
              f"us per token)", flush=True)
        eng.run_until_idle()


if __name__ == "__main__":
    main()
