import json
from pathlib import Path

import numpy as np
import pytest

import sarp
from sarp.hashing import as_hash, as_hashes, block_digests


def test_all_engine_forms_normalise_to_the_same_uint64():
    big = 2**64 - 5  # uint64 as vLLM sends it
    signed = big - 2**64  # the same bits as SGLang's signed int64
    as_bytes = (b"\xaa" * 24) + big.to_bytes(8, "big")  # low 64 bits, big-endian
    expected = [big, 7]
    assert as_hashes([big, 7]).tolist() == expected
    assert as_hashes([signed, 7]).tolist() == expected
    assert as_hashes([as_bytes, (7).to_bytes(8, "big")]).tolist() == expected
    assert as_hashes(np.array([signed, 7], np.int64)).tolist() == expected
    assert as_hashes(np.array([big, 7], np.uint64)).tolist() == expected
    assert as_hashes(np.array([5, 7], np.int32)).tolist() == [5, 7]


@pytest.mark.parametrize(
    "bad, error, words",
    [
        ([], ValueError, "empty"),
        ([2**64], ValueError, "outside 64 bits"),
        ([-(2**63) - 1], ValueError, "outside 64 bits"),
        ([1.5], TypeError, "float"),
        ([True], TypeError, "bool"),
        (b"abcdefgh", TypeError, "wrap it in a list"),
        ("abc", TypeError, "wrap it in a list"),
        ([b""], ValueError, "empty bytes"),
        (np.zeros((2, 2), np.uint64), ValueError, "one-dimensional"),
        (np.array([1.0]), TypeError, "dtype float64"),
        (42, TypeError, "int"),
    ],
)
def test_bad_hashes_are_refused_with_the_value_named(bad, error, words):
    with pytest.raises(error, match=words):
        as_hashes(bad)


def test_as_hash_refuses_bool_and_wide_ints():
    with pytest.raises(TypeError):
        as_hash(True)
    with pytest.raises(ValueError, match="outside 64 bits"):
        as_hash(2**70)


def test_hash_blocks_is_chained_deterministic_and_full_blocks_only():
    tokens = list(range(100))
    h = sarp.hash_blocks(tokens, 16)
    assert h.dtype == np.uint64 and h.size == 6  # the 4 trailing tokens are not a block
    assert (sarp.hash_blocks(tokens[:48], 16) == h[:3]).all()
    # The hash of block 1 depends on block 0: change one token of block 0.
    other = sarp.hash_blocks([999] + tokens[1:], 16)
    assert (other != h).all()
    # Continuing from a parent gives the same hashes as hashing the whole sequence.
    assert (sarp.hash_blocks(tokens[32:], 16, parent=int(h[1])) == h[2:]).all()
    # A namespace (LoRA name, salt) changes every hash.
    assert (sarp.hash_blocks(tokens, 16, extra="lora-a") != h).all()
    assert sarp.hash_blocks(tokens, 16).tolist() == h.tolist()


def test_hash_blocks_is_stable_across_processes():
    import subprocess
    import sys

    code = "import sarp; print(sarp.hash_blocks(list(range(64)), 16).tolist())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(sarp.hash_blocks(list(range(64)), 16).tolist())


def test_hash_blocks_rejects_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):
        sarp.hash_blocks([1, 2], 0)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        sarp.hash_blocks([-1] * 16, 16)


VECTORS = json.loads((Path(__file__).parent / "vectors" / "engine_hashes.json").read_text())


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _vector_id(v: dict) -> str:
    keys = "keys" if v["extra_keys"] else "plain"
    lora = f"-lora{v['lora_name']}" if v.get("lora_name") else ""
    return f"{v['engine']}-{v['scheme']}-seed{v['seed']}-bs{v['block_size']}-{keys}{lora}"


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=_vector_id)
def test_engine_hashes_from_token_ids_match_the_engines_own_code(vector, monkeypatch):
    # The vectors were made by running vLLM's and SGLang's own hashing code from their
    # released wheels (tests/vectors/make_engine_hashes.py says how).
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    keys = None if vector["extra_keys"] is None else [_tuples(k) for k in vector["extra_keys"]]
    got = sarp.hash_blocks(vector["tokens"], vector["block_size"], scheme=vector["scheme"],
                           seed=vector["seed"], extra_keys=keys)
    assert got.tolist() == sarp.as_hashes(vector["hashes"]).tolist()


def test_engine_schemes_continue_a_chain_from_a_digest_and_refuse_a_64_bit_parent():
    tokens = list(range(64))
    for scheme in ("vllm-sha256", "vllm-sha256-cbor", "sglang"):
        whole = sarp.hash_blocks(tokens, 16, scheme=scheme, seed="1")
        digests = block_digests(tokens[:32], 16, scheme=scheme, seed="1")
        rest = sarp.hash_blocks(tokens[32:], 16, digests[-1], scheme=scheme, seed="1")
        assert whole[2:].tolist() == rest.tolist()
        with pytest.raises(ValueError, match="32-byte digest"):
            sarp.hash_blocks(tokens, 16, int(whole[0]), scheme=scheme)
    with pytest.raises(ValueError, match="scheme"):
        sarp.hash_blocks(tokens, 16, scheme="md5")
    with pytest.raises(ValueError, match="extra_keys"):
        sarp.hash_blocks(tokens, 16, scheme="vllm-sha256", extra_keys=[None])


def test_lists_mixing_small_and_large_ints_take_the_vectorised_path_and_stay_exact():
    big = 2**64 - 3
    assert as_hashes([1, big, 2**63]).tolist() == [1, big, 2**63]
    assert as_hashes([-1, 5]).tolist() == [2**64 - 1, 5]
    assert as_hashes([-1, big]).tolist() == [2**64 - 1, big]  # mixed signs: one by one
    with pytest.raises(ValueError, match="outside 64 bits"):
        as_hashes([1, 2**70])
    with pytest.raises(TypeError, match="bool"):
        as_hashes([1, True])


def test_mixed_bytes_and_ints_are_each_read_as_what_they_are():
    assert as_hashes([b"\x01", 5]).tolist() == [1, 5]
    with pytest.raises(ValueError, match="outside 64 bits"):
        as_hashes([b"\x01", 2**70])


def test_serves_default_scheme_is_vllms_current_default():
    # vLLM 0.33 declares --prefix-caching-hash-algo sha256 by default (read from its
    # wheel by tests/vectors/make_engine_hashes.py); sarp serve hashes token_ids so too
    import contextlib
    import io

    import sarp.cli
    from sarp.hashing import VLLM_ALGOS, VLLM_DEFAULT_SCHEME
    from sarp.serving.http import HttpConfig

    assert VLLM_ALGOS[VLLM_DEFAULT_SCHEME] == VECTORS["vllm_default_algo"]["vllm-0.33.0"]
    assert HttpConfig("ix", "metrics").scheme == VLLM_DEFAULT_SCHEME
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        sarp.cli.main(["serve", "--help"])
    assert f"(default: {VLLM_DEFAULT_SCHEME})" in " ".join(shown.getvalue().split())


@pytest.mark.parametrize("scheme", ["vllm-sha256", "vllm-sha256-cbor", "vllm-xxhash",
                                    "vllm-xxhash-cbor"])
def test_equal_extra_keys_hash_equal_however_they_were_built(scheme):
    # vLLM's tags are literals (one object, which pickle writes once per block); keys
    # decoded from JSON have a string object per tag, and lists for tuples
    tokens = list(range(48))
    literal = [(("mm", "img-a", 0), ("mm", "img-b", 3)), (("lora", "a1", "/p"),), None]
    decoded = json.loads(json.dumps(literal))
    assert decoded[0][0][0] is not decoded[0][1][0]  # two "mm" objects
    got = [sarp.hash_blocks(tokens, 16, scheme=scheme, seed="0", extra_keys=keys).tolist()
           for keys in (literal, decoded)]
    assert got[0] == got[1]
