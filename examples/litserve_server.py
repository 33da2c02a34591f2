"""Serve a model with LitServe, the way LitGPT documents it: a `LitAPI` whose `setup` loads the model with
`LLM.load` and whose `predict` calls `generate`.

    pip install litserve
    python examples/litserve_server.py [--model CKPT] [--port 8000] [--max-tokens 200]
    curl -X POST localhost:8000/predict -H 'Content-Type: application/json' \\
         -d '{"prompt": "What do llamas eat?", "max_tokens": 40, "temperature": 0}'
    # {"output": "...", "finish_reason": "stop", "usage": {...}}

For an OpenAI-compatible server with continuous batching across requests, use `jaxllama serve` instead.
"""

from __future__ import annotations

import argparse

import litserve as ls
from fastapi import HTTPException

# Request fields passed on to `LLM.generate`.
SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop")


class JaxLlamaAPI(ls.LitAPI):
    """One prompt in, its completion out."""

    def __init__(self, model: str | None = None, max_tokens: int = 200):
        super().__init__()
        self.model, self.max_tokens = model, max_tokens

    def setup(self, device):
        # LitServe's `device` is not used: JAX places the model on the devices it finds (a GPU or TPU if any).
        from jaxllama import LLM

        self.llm = LLM.load(self.model, max_slots=1)

    def decode_request(self, request):
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise HTTPException(400, "'prompt' must be a string")
        return prompt, {"max_tokens": self.max_tokens, **{k: request[k] for k in SAMPLING if k in request}}

    def predict(self, x):
        prompt, sampling = x
        try:
            return self.llm.generate(prompt, **sampling)
        except (TypeError, ValueError) as e:
            raise HTTPException(400, str(e)) from None

    def encode_response(self, output):
        return {"output": output.text, "finish_reason": output.finish_reason, "usage": output.usage}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a converted checkpoint folder (default: the default model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per answer when a request does not say")
    args = parser.parse_args()
    api = JaxLlamaAPI(args.model, args.max_tokens)
    # One inference worker: JAX spreads the model over every device itself, so LitServe must not start one
    # worker per GPU ("cpu" here only tells LitServe not to manage devices).
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=False)
    server.run(host=args.host, port=args.port, generate_client_file=False)


if __name__ == "__main__":
    main()
