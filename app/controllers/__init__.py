"""One controller module per API surface: OpenAI, DJL, operations."""
