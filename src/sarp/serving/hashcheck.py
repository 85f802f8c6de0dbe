"""serve's check that the engines hash blocks as its HTTP service will hash token ids.

A router that queries by token ids gets nothing if sarp hashes them in another scheme,
seed or block size than the engines (vLLM's default is ``sha256`` and its seed
``PYTHONHASHSEED``; a mismatch used to answer 0 blocks, silently).  An engine's store
that starts a chain and carries its tokens (no LoRA, no extra keys) has hashes that
follow from its tokens alone, so serve recomputes them for an engine's first such
stores (:func:`sarp.serving.events.root_stores`) under ``--hash-scheme`` and
``--hash-seed``, and, when they differ, tries the other known schemes and seeds to
name the one the engine uses.  A mismatch is counted per source
(``sarp_source_hash_mismatches_total``), logged once, and shown in ``/readyz``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..hashing import SCHEMES, VLLM_DEFAULT_SEED, hash_blocks
from .events import Stored, root_stores

log = logging.getLogger("sarp.subscriber")
OTHER_SEEDS = (None, VLLM_DEFAULT_SEED, "0")  # None: $PYTHONHASHSEED, else the default


@dataclass(frozen=True, slots=True)
class HashCheck:
    """The scheme and seed serve hashes token ids with (``--hash-scheme``,
    ``--hash-seed``).

    >>> tokens = list(range(32))
    >>> hashes = hash_blocks(tokens, 16, scheme="vllm-sha256-cbor", seed="0")
    >>> HashCheck("vllm-sha256", "0").verdict([(hashes, tokens, 16)])
    (False, 'the hashes follow from the tokens with --hash-scheme vllm-sha256-cbor --hash-seed 0')
    >>> HashCheck("vllm-sha256-cbor", "0").verdict([(hashes, tokens, 16)])
    (True, '')
    """

    scheme: str
    seed: str | None = None

    def check_batch(self, key: str, payload: bytes, batch, stats) -> bool:
        """Check source ``key``'s batch if it has a store that starts a chain and carries
        its tokens; count and name a mismatch in ``stats`` (its ``SourceStats``) and log
        it.  True when a check was made (the source needs no other until it is cleared).
        """
        if not any(type(e) is Stored and e.parent is None for e in batch.events):
            return False
        verdict = self.verdict(root_stores(payload))
        if verdict is None:
            return False
        stats.hash_checks += 1
        stats.hash_note = verdict[1]
        if not verdict[0]:
            stats.hash_mismatches += 1
            log.warning("sarp: %s: its block hashes do not follow from its tokens with "
                        "--hash-scheme %s --hash-seed %s: token-id queries will match nothing "
                        "of it; %s", key, self.scheme, self.seed, verdict[1])
        return True

    def verdict(self, stores: list[tuple[np.ndarray, list[int], int]]) -> tuple[bool, str] | None:
        """``(True, "")`` when every store's hashes follow from its tokens as configured;
        ``(False, note)`` when one does not, the note naming the scheme and seed that
        would (or saying none of the known ones does); None for nothing to check.
        Cost: one hash per block of the stores, and per known scheme on a mismatch."""
        if not stores:
            return None
        for hashes, tokens, size in stores:
            if not _follows(hashes, tokens, size, self.scheme, self.seed):
                return False, _name_match(hashes, tokens, size)
        return True, ""


def _follows(hashes: np.ndarray, tokens: list[int], size: int, scheme: str,
             seed: str | None) -> bool:
    try:
        return hash_blocks(tokens, size, scheme=scheme, seed=seed).tolist() == hashes.tolist()
    except ValueError:  # tokens out of the scheme's range
        return False


def _name_match(hashes: np.ndarray, tokens: list[int], size: int) -> str:
    for scheme in SCHEMES:
        for seed in OTHER_SEEDS if scheme.startswith("vllm") else (None,):
            if _follows(hashes, tokens, size, scheme, seed):
                how = f"--hash-scheme {scheme}"
                if seed is not None:
                    how += f" --hash-seed {seed}"
                return f"the hashes follow from the tokens with {how}"
    return ("no known scheme and seed gives the engine's hashes from its tokens (another "
            "seed? set PYTHONHASHSEED on the engines and pass it as --hash-seed)")
