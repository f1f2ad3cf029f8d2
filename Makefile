PYTHON ?= .venv/bin/python

.PHONY: fuzz openapi openapi-check

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
	$(PYTHON) -m openapi.validate
