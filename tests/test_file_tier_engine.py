"""The prefix cache's file tier (plugins/cache/swap.py) against a writer of
its folder, through a real engine on a tiny model (issue 21, item 6;
docs/security.md "Files and sockets are the owner's"). The component tests
in test_prefix_cache.py drive the connector by hand; these start an ``LLM``
with ``swap_dir`` and check what a user would see: the answer."""
from __future__ import annotations

import os
import threading
import time

import pytest

from fdx.core.sampling_params import SamplingParams
from fdx.plugins.cache.blocks import ROOT_KEY, BlockMeta, block_key
from fdx.plugins.cache.swap import FileTier

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
A = [1000 + i for i in range(2 * BS + 3)]            # two full blocks and a tail
B = [3000 + i for i in range(2 * BS + 3)]


def _llm(model: str, swap_dir=None):
    from fdx import LLM
    tier = {"kv_cache": "prefix", "swap_dir": str(swap_dir)} if swap_dir is not None else {}
    return LLM(model, max_model_len=256, num_kv_blocks=32, block_size=BS, progress=False, **tier)


def _tokens(llm, prompt: list[int]) -> list[int]:
    return llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids


def _keys(tokens: list[int]) -> list[tuple[bytes, bytes, tuple[int, ...]]]:
    """(key, parent, tokens) of each full block of ``tokens``."""
    out, parent = [], ROOT_KEY
    for i in range(len(tokens) // BS):
        block = tuple(tokens[i * BS:(i + 1) * BS])
        key = block_key(parent, block)
        out.append((key, parent, block))
        parent = key
    return out


@pytest.fixture(scope="module")
def plain(tiny_model):
    """The answers with no tier at all."""
    llm = _llm(tiny_model)
    return {"A": _tokens(llm, A), "B": _tokens(llm, B)}


def test_a_forged_block_file_is_a_miss_and_the_answer_is_unchanged(tiny_model, plain, tmp_path):
    """A writer of the folder, without the tier key, puts A's KV under B's
    block keys with a recomputed checksum (an fdx tier of their own wrote
    it). A restarted engine on the folder does not load it: B's answer
    equals B's answer with no tier, and the first forged file of B's chain
    is counted as ignored (a miss there ends the lookup)."""
    victim = tmp_path / "victim"
    llm = _llm(tiny_model, victim)
    assert _tokens(llm, A) == plain["A"]            # A's blocks are saved to files when it finishes
    fingerprint = llm.engine.connector.tier.fingerprint
    a_data = [llm.engine.connector.tier.get(BlockMeta(k, p, t)) for k, p, t in _keys(A)]
    assert all(d is not None for d in a_data)
    del llm
    attacker = FileTier(tmp_path / "attacker", 8, fingerprint)     # its own key, not the victim's
    for (key, parent, block), data in zip(_keys(B), a_data):
        attacker.put(BlockMeta(key, parent, block), data)
        name = key.hex() + ".kvb"
        (victim / name).write_bytes((tmp_path / "attacker" / name).read_bytes())

    restarted = _llm(tiny_model, victim)
    assert _tokens(restarted, B) == plain["B"]
    stats = restarted.engine.connector.stats()
    assert stats["swap_loaded_blocks"] == 0 and stats["swap_ignored_files"] == 1, stats   # the chain's first
    assert _tokens(restarted, A) == plain["A"]      # A's own files are still hits
    assert restarted.engine.connector.stats()["swap_loaded_blocks"] >= len(_keys(A))


def test_a_fifo_named_like_a_block_file_does_not_hang_the_start(tiny_model, plain, tmp_path):
    """A FIFO named ``<key>.kvb`` (opening it for reading would block until
    someone writes): the engine starts within a bounded time and answers
    as with no tier."""
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    key = _keys(B)[0][0]
    os.mkfifo(folder / (key.hex() + ".kvb"))
    made: list = []
    t0 = time.monotonic()
    starter = threading.Thread(target=lambda: made.append(_llm(tiny_model, folder)), daemon=True)
    starter.start()
    starter.join(timeout=120)
    if starter.is_alive():                           # blocked on the FIFO: give it a writer so it ends
        os.close(os.open(folder / (key.hex() + ".kvb"), os.O_WRONLY | os.O_NONBLOCK))
        starter.join(timeout=10)
        pytest.fail("the engine start blocked on a FIFO in the tier folder")
    print(f"\nengine start with a FIFO in the tier folder: {time.monotonic() - t0:.1f} s")
    assert _tokens(made[0], B) == plain["B"]


def test_symlinks_planted_in_the_folder_are_not_followed(tiny_model, plain, tmp_path):
    """Symlinks at the names the engine writes (each block's file and the
    temporary name of older fdx, ``<key>.kvb.tmp<pid>``), pointing at a
    file of the victim: after a request has saved its blocks, that file is
    unchanged and each block file is a regular 0600 file."""
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"precious")
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    for key, _, _ in _keys(A):
        os.symlink(precious, folder / f"{key.hex()}.kvb.tmp{os.getpid()}")
        os.symlink(precious, folder / f"{key.hex()}.kvb")
    llm = _llm(tiny_model, folder)
    assert _tokens(llm, A) == plain["A"]
    llm.engine.connector.close()                     # the saves still pending are written now
    assert precious.read_bytes() == b"precious"
    for key, _, _ in _keys(A):
        f = folder / f"{key.hex()}.kvb"
        assert f.is_file() and not f.is_symlink() and (f.stat().st_mode & 0o777) == 0o600, f
