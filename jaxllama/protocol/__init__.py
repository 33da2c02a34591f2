"""The OpenAI request and response shapes, shared by the batch runner (`jaxllama run`) and the server."""
