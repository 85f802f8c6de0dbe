"""The house rules (docs/design.md, "Modules"), held by reading the source:

* each third-party dependency enters through its one door (numpy aside: it is the
  language of every per-block array; ``bench/`` aside: it plays the engines and the
  peers, and speaks their wires and storage engines directly);
* the core (the modules of ``sarp/`` itself, the CLI aside) never imports ``serving``,
  ``bench`` or ``workingset``; only the store backends touch a storage client, and
  ``packing``, ``check``, ``recovery`` and ``index`` name the contract, not a backend;
* only ``native`` imports the extension;
* no module imports another's private name, or reaches into another module's or an
  index's private attributes;
* no module is over about 600 lines, and the ``Index`` class is at most about 450.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "sarp"
DOORS = {
    "lmdb": {"lmdb_env.py"},  # the environment; store_lmdb and serve's first answers
    "valkey": {"store_valkey.py"},
    "pyroaring": {"filters.py"},
    "xxhash": {"hashing.py"},
    "cbor2": {"hashing.py"},
    "msgpack": {"serving/events.py"},
    # the event code: live, in line (libzmq's own calls from C, the subscriber's
    # in-line half), replays, and the engines' sockets made before serve's imports
    "zmq": {"serving/subscriber.py", "serving/lane.py", "serving/inline.py",
            "serving/replay.py", "serving/early.py"},
    "httptools": {"serving/wire.py"},
    "orjson": {"serving/http.py"},
    "prometheus_client": {"serving/http.py"},
    "uvloop": {"serving/wire.py"},
    "tqdm": {"recovery.py", "workingset/analyzer.py"},  # progress bars of long work
    "matplotlib": {"workingset/cli.py"},
    "yaml": {"serving/sources.py"},  # the sources file
}
CORE_NEVER = ("serving", "bench", "workingset")
ON_THE_CONTRACT = ("packing.py", "check.py", "recovery.py", "index.py")
MAX_LINES = 630  # "about 600"
MAX_INDEX_LINES = 470  # "about 450"


def modules() -> dict[str, ast.Module]:
    return {str(f.relative_to(SRC)): ast.parse(f.read_text(), str(f))
            for f in sorted(SRC.rglob("*.py"))}


def imports(rel: str, tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(absolute module, names imported from it) for every import, nested ones too."""
    package = ["sarp", *Path(rel).parent.parts]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            out.append((module, [a.name for a in node.names]))
    return out


def test_each_dependency_enters_through_its_one_door():
    std = set(sys.stdlib_module_names) | {"sarp", "numpy", "__future__"}
    wrong = []
    for rel, tree in modules().items():
        if rel.startswith("bench/"):
            continue
        for module, _ in imports(rel, tree):
            top = module.split(".")[0]
            if top not in std and rel not in DOORS.get(top, ()):
                wrong.append(f"{rel} imports {module} (its door: {sorted(DOORS.get(top, []))})")
    assert wrong == []


def test_the_core_never_imports_serving_bench_or_workingset_and_names_no_backend():
    wrong = []
    for rel, tree in modules().items():
        core = "/" not in rel and rel not in ("cli.py", "__init__.py")
        for module, names in imports(rel, tree):
            if not module.startswith("sarp"):
                continue
            parts = module.split(".")
            if core and len(parts) > 1 and parts[1] in CORE_NEVER:
                wrong.append(f"{rel} imports {module}")
            if rel in ON_THE_CONTRACT and any(p.startswith("store_") for p in parts):
                wrong.append(f"{rel} names a backend: {module}")
            if ("_native" in parts or "_native" in names) and rel != "native.py":
                wrong.append(f"{rel} imports the extension (only native.py does)")
    assert wrong == []


def test_no_module_imports_or_reaches_another_modules_private_names():
    wrong = []
    for rel, tree in modules().items():
        sarp_modules = set()
        for module, names in imports(rel, tree):
            if not module.startswith("sarp"):
                continue
            own = rel == "native.py" and names == ["_native"]
            wrong += [f"{rel}: from {module} import {n}" for n in names
                      if n.startswith("_") and not n.startswith("__") and not own]
            sarp_modules.update(n for n in names if not n[0].isupper())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in sarp_modules:
                wrong.append(f"{rel}:{node.lineno}: {owner.id}.{node.attr}")
            if rel.startswith(("serving/", "bench/")) and _names_an_index(owner):
                wrong.append(f"{rel}:{node.lineno}: an index's {node.attr}")
    assert wrong == []


def _names_an_index(node: ast.expr) -> bool:
    """``index``, ``self.index`` or ``self._index`` (how serving and bench hold one)."""
    if isinstance(node, ast.Name):
        return node.id in ("index", "ix")
    return isinstance(node, ast.Attribute) and node.attr in ("index", "_index")


def test_modules_stay_short_and_index_is_a_facade():
    long = {rel: n for rel in modules() if (n := len((SRC / rel).read_text().splitlines()))
            > MAX_LINES}
    tree = modules()["index.py"]
    index = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Index")
    index_lines = index.end_lineno - index.lineno + 1
    assert long == {}
    assert index_lines <= MAX_INDEX_LINES


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("path", ["c", "python"])
def test_one_match_enters_each_room_once(tmp_path, path):
    """A writer's match enters the facade once and the walk once, and nothing below
    calls back up into the index (the per-step tools, the directory, the record check
    and the store's reads, are called from the walk as often as it steps)."""
    import numpy as np

    import sarp
    from sarp import native

    if path == "c" and not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}")
    rng = np.random.default_rng(3)
    chain = rng.integers(1, 1 << 63, 40, dtype=np.uint64)
    with sarp.open(tmp_path / "ix", durability="nosync", segment_blocks=8) as index:
        index.insert(chain, holder="w0")
        index.insert(chain[:20], holder="w1", medium="CPU")  # two holders, steps of 8
        entries: list[str] = []

        def profile(frame, event, arg):
            if event == "call":
                callee = frame.f_globals.get("__name__", "")
                caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
                if callee != caller and callee.startswith("sarp."):
                    entries.append(callee)

        with native.forced(path):
            sys.setprofile(profile)
            try:
                m = index.match(chain)
            finally:
                sys.setprofile(None)
    assert m.num_blocks == 40
    rooms = {room: entries.count(room) for room in ("sarp.index", "sarp.verify", "sarp.recovery",
                                                     "sarp.holders", "sarp.ops", "sarp.packing")}
    assert rooms == {"sarp.index": 1, "sarp.verify": 1, "sarp.recovery": 0, "sarp.holders": 0,
                     "sarp.ops": 0, "sarp.packing": 0}, entries
