"""GET /v1/models, /health and /metrics (Prometheus text, read with prometheus_client's own parser)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server import CHAT, CONTEXT, MODEL_NAME


def test_models_lists_the_served_model(live):
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].owned_by == "jaxllama" and models.data[0].model_extra["max_model_len"] == CONTEXT


def test_health(live):
    r = httpx.get(f"{live.url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def _samples(live) -> dict:
    r = httpx.get(f"{live.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_requests_tokens_and_latencies(live, reference):
    before = _samples(live)
    live.client().chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0)
    after = _samples(live)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("jaxllama_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert moved("jaxllama_requests_finished_total", finish_reason="length") == 1
    assert moved("jaxllama_prompt_tokens_total") == reference["chat"].prompt_tokens
    assert moved("jaxllama_completion_tokens_total") == 12
    assert moved("jaxllama_time_to_first_token_seconds_count") == 1
    assert moved("jaxllama_inter_token_latency_seconds_count") == 11  # one gap between each two of 12 tokens
    assert moved("jaxllama_time_to_first_token_seconds_sum") > 0
    assert after[("jaxllama_requests_running", ())] == 0 and after[("jaxllama_requests_waiting", ())] == 0


def test_metrics_count_refused_requests(live):
    before = _samples(live)
    r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "temperature": -1}, timeout=10)
    assert r.status_code == 400
    after = _samples(live)
    key = ("jaxllama_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))
    assert after[key] - before.get(key, 0) == 1
