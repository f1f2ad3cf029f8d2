PYTHON ?= .venv/bin/python

.PHONY: fuzz openapi openapi-check bench soak

# Schemathesis against a live server with the real model, with a larger budget than the test
# suite's and the coverage phase on (boundary values, wrong types, unsupported methods).
# FUZZ_MAX_EXAMPLES=500 make fuzz for a longer run.
FUZZ_MAX_EXAMPLES ?= 150
fuzz:
	FUZZ_MAX_EXAMPLES=$(FUZZ_MAX_EXAMPLES) FUZZ_COVERAGE=1 \
		$(PYTHON) -m pytest tests/openapi/test_fuzz.py -p no:cacheprovider -q

# Regenerate openapi/openapi.json from the app, or check that the committed copy is current.
openapi:
	$(PYTHON) -m openapi.generate
openapi-check:
	$(PYTHON) -m openapi.generate --check
	$(PYTHON) -m openapi.checks.validate

# Serving benchmark: seqgate (defaults, int4, w8a8) vs transformers serve (with and without
# continuous batching), llama.cpp's server and OpenVINO GenAI (in-process, fp16/int8/int4 weights, in
# its own .venv-openvino made by scripts/install_openvino.sh on first use), the
# prompt-cache and splitting scenarios, speculative decoding on and off against llama.cpp plain
# and with its n-gram speculation (ShareGPT and input-grounded rewriting), greedy agreement; writes bench/results/serving.json and
# docs/benchmarks.md (+ docs/benchmarks/*.png), after the scheduler scenarios (bench.stall: long
# prompts arriving while streams decode; bench.multiturn: the radix prefix cache on three-turn
# chats; bench.structured: JSON-schema requests against the same requests without a schema;
# bench.schema_following: how often plain pydantic models come back valid from the embedded model;
# bench.routing: shared system prompts over 2 replicas per router policy, and the latency the
# replicas add; their reports go to docs/benchmarks/*.md and into docs/benchmarks.md). About an
# hour on 2 cores. The peer without
# continuous batching serves one request at a time, so its concurrency 32 and 64 cells are
# skipped by default (they would only queue, for another half hour).
# BENCH_ARGS=--quick for a smoke run (a few minutes, report in bench/results/quick/).
BENCH_ARGS ?= --skip tf-serve@32 --skip tf-serve@64 --skip seqgate-int4@32 --skip seqgate-int4@64
bench:
	bash scripts/install.sh dev,bench
	case "$(BENCH_ARGS)" in *--quick*) ;; *) \
	  $(PYTHON) -m bench.stall --doc docs/benchmarks/stall.md && \
	  $(PYTHON) -m bench.multiturn --doc docs/benchmarks/multiturn.md && \
	  $(PYTHON) -m bench.structured --doc docs/benchmarks/structured.md && \
	  $(PYTHON) -m bench.schema_following --doc docs/benchmarks/schema_following.md && \
	  $(PYTHON) -m bench.routing --doc docs/benchmarks/routing.md ;; esac
	$(PYTHON) -m bench.serving $(BENCH_ARGS)
	case "$(BENCH_ARGS)" in *--quick*) ;; *) cp bench/results/serving.json docs/benchmarks/ ;; esac

# Soak and fault run: seqgate under mixed ShareGPT load with client disconnects and bad input,
# then SIGTERM with requests in flight, then schemathesis (at least 5,000 cases); writes
# bench/results/soak.json and docs/reliability.md. About 5 minutes of load plus the fuzz run.
# SOAK_ARGS="--duration 60 --concurrency 16 --skip-fuzz" for a smoke run.
SOAK_ARGS ?=
soak:
	bash scripts/install.sh dev,bench
	$(PYTHON) -m bench.soak $(SOAK_ARGS)
