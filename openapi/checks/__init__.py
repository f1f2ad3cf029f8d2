"""Development checks of our OpenAPI document (validity, compatibility with OpenAI's schema).

Not part of the installed package: they need openapi-spec-validator, a development dependency.
Run them from a checkout: `python -m openapi.checks.validate` (or `make openapi-check`).
"""
