import pytest

from tests.app.model import shared_model
from tests.app.schema import load_schema_errors


@pytest.fixture(scope="session")
def tokenizer():
    return shared_model().tokenizer


@pytest.fixture(scope="session")
def schema_errors():
    return load_schema_errors()
