import pytest

from tests.app.schema import load_schema_errors


@pytest.fixture(scope="session")
def tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="session")
def schema_errors():
    return load_schema_errors()


@pytest.fixture(scope="session")
def compiler(smollm2):
    """Grammars over the embedded model's tokenizer (the tool and structured-output tests)."""
    from engine.sample.grammar import GrammarCompiler

    return GrammarCompiler(smollm2.tokenizer, smollm2.model.config.vocab_size, [2])
