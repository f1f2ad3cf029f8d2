"""seqgate's published API contract: the committed OpenAPI document and the code that checks it."""
