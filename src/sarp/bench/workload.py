"""The built-in workload: seeded multi-turn chat and agentic sessions, so ``sarp bench``
runs on a fresh machine with no data.

Chat sessions share a few system prompts and grow by a user message and a reply per
turn.  Agentic sessions share long tool preambles, grow their context by tens of
blocks per step, and start sub-agents that branch off the main context.  Sessions
interleave in time, as requests from many users do.
"""

from __future__ import annotations

import numpy as np

from .traces import Request


class _Ids:
    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def builtin(
    seed: int = 0, chat_sessions: int = 400, agent_sessions: int = 24
) -> list[Request]:
    """Requests of the built-in workload, in arrival order.

    >>> reqs = builtin(seed=1, chat_sessions=5, agent_sessions=1)
    >>> len(reqs) > 5 and all(r.hashes.dtype == np.uint64 for r in reqs)
    True
    """
    rng = np.random.default_rng(seed)
    ids = _Ids()
    prompts = [ids.take(int(rng.integers(2, 24))) for _ in range(8)]
    preambles = [ids.take(int(rng.integers(60, 160))) for _ in range(3)]
    streams: list[list[Request]] = []
    for s in range(chat_sessions):
        context = list(prompts[int(rng.integers(len(prompts)))])
        turns = []
        for _ in range(int(rng.integers(1, 12))):
            context += ids.take(int(rng.integers(1, 10)))
            turns.append(Request(np.array(context, np.uint64), f"chat-{s}"))
            context += ids.take(int(rng.integers(1, 4)))  # the reply
        streams.append(turns)
    for s in range(agent_sessions):
        context = list(preambles[int(rng.integers(len(preambles)))])
        steps = []
        for _ in range(int(rng.integers(20, 80))):
            context += ids.take(int(rng.integers(4, 40)))
            steps.append(Request(np.array(context, np.uint64), f"agent-{s}"))
            if rng.random() < 0.15:  # a sub-agent: shared preamble, then its own context
                sub = context[: len(preambles[0]) // 2] + ids.take(int(rng.integers(5, 30)))
                for _ in range(int(rng.integers(3, 12))):
                    sub += ids.take(int(rng.integers(4, 30)))
                    steps.append(Request(np.array(sub, np.uint64), f"agent-{s}-sub"))
        streams.append(steps)
    return _interleave(streams, rng)


def _interleave(streams: list[list[Request]], rng: np.random.Generator) -> list[Request]:
    """Merge sessions keeping each one's order, picking the next session at random."""
    owners = np.concatenate([np.full(len(s), i) for i, s in enumerate(streams)])
    rng.shuffle(owners)
    cursor = [0] * len(streams)
    out = []
    for owner in owners.tolist():
        out.append(streams[owner][cursor[owner]])
        cursor[owner] += 1
    return out
