"""Storage media (tiers): the names engines send, and the canonical tiers they mean.

Engines name the same tier differently: SGLang's host tier is ``CPU_PINNED``,
vLLM 0.33 defines ``STORAGE`` beside ``GPU`` and ``CPU``, LMCache writes ``cpu``
and ``disk``.  :func:`canonical_medium` maps every known alias to one of
``GPU``, ``CPU`` and ``DISK`` (case-insensitively), so a block the engine calls
``CPU_PINNED`` is stored, removed and weighed as ``CPU``.  A name that is not a
known alias is kept as sent (the router gives it a configurable weight).

A medium must be 1 to 32 characters of letters, digits and ``_ . : -``: a name
is stored with every holder, and a hostile or broken engine must not be able to
grow the holder table with arbitrary strings (NUL, 1,000 characters, ...).
"""

from __future__ import annotations

import re

GPU, CPU, DISK = "GPU", "CPU", "DISK"
CANONICAL_MEDIA = (GPU, CPU, DISK)

# Lower-case alias -> canonical tier.  Sources: vLLM (GPU, CPU, STORAGE),
# SGLang (GPU, CPU_PINNED, DISK), LMCache (cpu, disk, local_cpu, local_disk).
ALIASES: dict[str, str] = {
    "gpu": GPU, "cuda": GPU, "hbm": GPU, "device": GPU,
    "cpu": CPU, "cpu_pinned": CPU, "host": CPU, "dram": CPU, "local_cpu": CPU,
    "pinned": CPU,
    "disk": DISK, "storage": DISK, "ssd": DISK, "nvme": DISK, "local_disk": DISK,
}

MAX_MEDIUM_CHARS = 32
_VALID = re.compile(rf"[A-Za-z0-9_.:\-]{{1,{MAX_MEDIUM_CHARS}}}")


def is_valid_medium(name: object) -> bool:
    """Whether ``name`` is a medium sarp accepts from an engine.

    >>> is_valid_medium("CPU_PINNED"), is_valid_medium("GPU\\x00"), is_valid_medium("x" * 40)
    (True, False, False)
    """
    return isinstance(name, str) and _VALID.fullmatch(name) is not None


def canonical_medium(name: str) -> str:
    """The canonical tier for a medium name: a known alias maps, anything else is kept.

    Cost: one dict lookup.

    >>> canonical_medium("CPU_PINNED"), canonical_medium("storage"), canonical_medium("EXTERNAL")
    ('CPU', 'DISK', 'EXTERNAL')
    """
    return ALIASES.get(name.lower(), name)
