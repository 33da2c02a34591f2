"""The OpenAI-compatible HTTP server (`jaxllama serve`): the FastAPI app (`app`), the engine thread (`worker`) and
the Prometheus metrics (`metrics`)."""
