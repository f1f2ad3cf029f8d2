import pytest

from tests.app.schema import load_schema_errors


@pytest.fixture(scope="session")
def tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="session")
def schema_errors():
    return load_schema_errors()
