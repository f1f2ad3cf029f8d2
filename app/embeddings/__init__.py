"""The embedding model served beside the chat model (`POST /v1/embeddings`).

It is not the chat engine: a small encoder (a sentence-transformers model) with a thread of its
own (`EmbeddingService`), so a forward never waits on a decode step and the other way round.
`model.py` finds and loads the model; `service.py` batches what concurrent requests send. The
HTTP side is app/controllers/embeddings.py, the OpenAI translation adapters/openai_embeddings.py.
Needs the `embeddings` extra (sentence-transformers); nothing here imports it until a model is
asked for.
"""

from app.embeddings.model import EmbeddingModel, load_embedding_model
from app.embeddings.service import EmbeddingQueueFull, EmbeddingService

__all__ = ["EmbeddingModel", "EmbeddingQueueFull", "EmbeddingService", "load_embedding_model"]
