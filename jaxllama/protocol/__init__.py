"""The OpenAI side of the batch runner (`jaxllama run`) and the server: reading request bodies (`requests`), the
request pipeline from a body to prompt token ids (`pipeline`), response shapes (`responses`), and the one table
from failure classes to OpenAI error codes and HTTP statuses (`errors`)."""
