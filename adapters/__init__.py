"""Protocol translation between OpenAI / DJL requests and engine jobs: pure functions, no I/O."""
