"""The grammar-library comparison's pieces that need no timing: every schema's instance is valid
for it, and the report states what was measured."""

from __future__ import annotations

import jsonschema

from bench.studies.grammar_libs import SCHEMAS, installed_mib, report


def test_instances_are_valid_for_their_schemas():
    for schema, instance in SCHEMAS.values():
        jsonschema.validate(instance, schema)


def test_report_lists_rows_libraries_and_what_is_missing():
    row = {"library": "llguidance", "schema": "flat", "compile_ms_median": 0.5,
           "compile_ms_max": 0.9, "first_mask_ms": 0.1, "mask_us_median": 20.0,
           "mask_us_p95": 60.0, "tokens": 19, "accepted": 19}
    data = {"rows": [row], "libraries": {"llguidance": {"version": "1.9", "tokenizer_s": 0.4}},
            "missing": ["xgrammar"], "installed_mib": {"llguidance": 7.5},
            "apply_ms": {"seqgate": 5.0}}
    text = report(data)
    assert "| llguidance | flat | 0.5 / 0.9 ms | 0.1 ms | 20.0 / 60.0 µs | 19/19 |" in text
    assert "xgrammar: not installed" in text and "llguidance 7.5 MiB" in text
    assert "llguidance" in installed_mib()
