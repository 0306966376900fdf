"""The HTTP front end: FastAPI routes, OpenAI / native schemas, errors, the ingress tokenizer,
metrics, and the ingress deployment."""
