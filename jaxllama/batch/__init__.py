"""`jaxllama run`: a JSONL file of requests in, a JSONL file of completions out (see `runner.py`)."""
