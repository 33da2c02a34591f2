"""What chunked prefill buys a server: how long running requests wait for a token while long prompts arrive.

    python -m benchmarks.chunked_prefill [--running 32] [--running-prompt 500] [--arriving 4] [--prompt 1500]
                                         [--max-tokens 120] [--budgets 512,2048,0] [--rounds 3] [--slots 64]

On the default model (SmolLM2-135M-Instruct, as `jaxllama run` loads it), one engine; for each step budget
(`EngineOptions.step_tokens`; 0: none, every prompt computed whole in one step), `running` requests with random
prompts of `running_prompt` tokens decode (greedy, `max_tokens` each), and once each has its first token, `arriving`
random prompts of `prompt` tokens are added. Prints, per budget: the running requests' longest wait between two of
their tokens and the 99th percentile of those waits, the arriving prompts' time to first token (mean and longest),
and the seconds from their arrival until every request ended (what the budget costs in throughput; the running
prompts' own prefill before it, whose time varies most, is left out). A first round compiles every program; then
`rounds` timed rounds of each budget, the budgets alternating (this machine's speed drifts), each starting with no
prompt cached; the figures are the medians. The running prompts are long enough that the KV cache, grown to the
arriving prompts' length by the first round, is not shrunk between rounds and grown again while they wait (that
copy would count as a wait).
"""

from __future__ import annotations

import time

import fire
import numpy as np

from jaxllama.engine.request import Request, SamplingParams

WHOLE = 10**9  # a budget no prompt reaches: each computed whole


def _round(engine, budget: int, running: tuple[int, int], arriving: tuple[int, int], max_tokens: int, seed: int):
    """One timed round on `engine` with step budget `budget`, (requests, prompt tokens) `running` and `arriving`
    -> its figures."""
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size
    engine.step_tokens = budget
    engine.prefixes.truncate(0)  # nothing cached from the last round
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    short = [Request(f"run{i}", rng.integers(3, vocab, running[1]).tolist(), greedy) for i in range(running[0])]
    first_tokens = SamplingParams(max_tokens=8, temperature=0.0)
    long = [Request(f"new{i}", rng.integers(3, vocab, arriving[1]).tolist(), first_tokens) for i in range(arriving[0])]
    for r in short:
        engine.add(r)
    times: dict[str, list[float]] = {}
    added = None
    while engine.has_work():
        updates = engine.step()
        now = time.perf_counter()
        for u in updates:
            if u.tokens:
                times.setdefault(u.id, []).append(now)
        if added is None and all(r.id in times for r in short):
            added = time.perf_counter()
            for r in long:
                engine.add(r)
    wall = time.perf_counter() - added
    waits = np.concatenate([np.diff(times[r.id]) for r in short])
    ttft = np.array([times[r.id][0] - added for r in long])
    return dict(longest=waits.max(), p99=np.percentile(waits, 99), ttft=ttft.mean(), ttft_max=ttft.max(), wall=wall)


def main(
    running: int = 32,
    running_prompt: int = 500,
    arriving: int = 4,
    prompt: int = 1500,
    max_tokens: int = 120,
    budgets: str | tuple = "512,2048,0",
    rounds: int = 3,
    slots: int = 64,
    seed: int = 0,
):
    from jaxllama import LLM

    budgets = [int(b) for b in (budgets.split(",") if isinstance(budgets, str) else budgets)]
    llm = LLM.load(max_slots=slots, max_context=max(2048, prompt + 64))
    engine = llm.engine
    shapes = (running, running_prompt), (arriving, prompt)
    _round(engine, WHOLE, shapes[0], shapes[1], max_tokens, seed)  # compiles
    for budget in budgets:  # compiles what a chunk's shapes need
        _round(engine, budget or WHOLE, shapes[0], shapes[1], max_tokens, seed)
    figures = {budget: [] for budget in budgets}
    for i in range(rounds):
        for budget in budgets:
            figures[budget].append(_round(engine, budget or WHOLE, shapes[0], shapes[1], max_tokens, seed + 1 + i))
    print(f"{running} requests of {running_prompt} prompt tokens running (max_tokens {max_tokens}),", end=" ")
    print(f"{arriving} prompts of {prompt} tokens arriving; medians of {rounds} rounds")
    header = ("longest wait s", 15), ("p99 wait s", 12), ("TTFT mean s", 13), ("TTFT max s", 12), ("from arrival s", 16)
    print(f"{'step budget':<14}" + "".join(f"{name:>{width}}" for name, width in header))
    for budget in budgets:
        f = {k: float(np.median([r[k] for r in figures[budget]])) for k in figures[budget][0]}
        name = str(budget) if budget else "none (whole)"
        print(
            f"{name:<14}{f['longest']:>15.2f}{f['p99']:>12.2f}{f['ttft']:>13.2f}{f['ttft_max']:>12.2f}{f['wall']:>16.1f}"
        )


if __name__ == "__main__":
    fire.Fire(main)
