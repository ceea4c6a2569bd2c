"""The prefix cache: keys, two-phase hits, sharing, LRU eviction, salts;
the swap KV connector (memory and files, across restarts, corrupt files);
and with SmolLM2: outputs identical across schedulers, caches and policies."""
from __future__ import annotations

import hashlib
import logging
import os
from array import array

import numpy as np
import pytest

from fdx.core.assembly import Assembly
from fdx.core.config import FdxConfig
from fdx.core.interfaces import BuildContext, KVCacheSpec
from fdx.core.plugins import get_plugin_manager
from fdx.core.request import Request
from fdx.core.sampling_params import SamplingParams
from fdx.plugins.cache import blocks as blocks_mod
from fdx.plugins.cache.prefix import PrefixKVCache
from fdx.plugins.cache.blocks import ROOT_KEY, BlockMeta, block_key
from fdx.plugins.cache.swap import FORMAT_VERSION, MAGIC, PREFIX_BYTES, FileTier, SwapConnector

BS = 4
LAYERS, KVH, HD = 2, 2, 3


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt, max_model_len=1000)


def admit(kv: PrefixKVCache, req: Request, conn: SwapConnector | None = None) -> int:
    """Look up, then commit the hit with blocks for the rest (and, with a
    connector, load what it holds after the hit); returns the cached tokens."""
    hit = kv.lookup_prefix(req)
    external = conn.get_num_new_matched_tokens(req, hit.num_tokens) if conn is not None else 0
    assert kv.allocate_slots(req, req.num_tokens - hit.num_tokens, prefix=hit)
    req.num_computed_tokens = hit.num_tokens
    if external:
        conn.update_state_after_alloc(req, kv.block_table(req.request_id), external)
        conn.start_load_kv(conn.build_connector_meta())
    req.num_computed_tokens = hit.num_tokens + external
    return req.num_computed_tokens


def compute(kv: PrefixKVCache, req: Request, conn: SwapConnector | None = None) -> None:
    """The model ran the rest of the prompt: fill its new slots, register."""
    if conn is not None:
        for i, b in enumerate(kv.block_table(req.request_id)):
            if i * BS >= req.num_computed_tokens:
                conn.write_block(b, block_data(req.all_token_ids[i * BS:(i + 1) * BS], i))
    req.num_computed_tokens = req.num_tokens
    kv.on_tokens_computed(req)


def finish(kv: PrefixKVCache, req: Request, conn: SwapConnector | None = None) -> None:
    """The request ended: the connector saves its blocks, then they are freed."""
    if conn is not None and conn.request_finished(req, kv.block_table(req.request_id)):
        conn.start_load_kv(conn.build_connector_meta())
        assert conn.get_finished()[0] == {req.request_id}
    kv.free(req)


def block_data(tokens, index: int) -> np.ndarray:
    """Distinct KV for a block's tokens (padding a partial block with -1)."""
    t = np.full(BS, -1.0)
    t[:len(tokens)] = tokens
    base = t[None, None, None, :, None] * 100 + index
    grid = np.arange(LAYERS * 2 * KVH * HD).reshape(LAYERS, 2, KVH, 1, HD)
    return (base + grid * 0.5).astype(np.float32)


def make_cache(num_blocks: int = 8) -> PrefixKVCache:
    cfg = FdxConfig.build(kv_cache="prefix", block_size=BS)
    return PrefixKVCache(None, BuildContext(cfg, num_blocks=num_blocks, block_size=BS))


def make_connector(num_blocks: int, model: str = "fake-model", **cache_cfg) -> SwapConnector:
    import paddle
    cfg = FdxConfig.build(model=model, kv_cache="prefix", block_size=BS, kv_connector="swap",
                          plugins={"connector": {"swap": cache_cfg}})
    conn = SwapConnector(Assembly(cfg, get_plugin_manager()).settings("connector", "swap"),
                         BuildContext(cfg, block_size=BS))
    rows = KVH * num_blocks * BS
    conn.register_kv_caches([(paddle.zeros([rows, HD]), paddle.zeros([rows, HD])) for _ in range(LAYERS)],
                            KVCacheSpec(LAYERS, KVH, HD, num_blocks, BS, "float32"))
    return conn


# -- keys and hits ------------------------------------------------------------

def test_block_key_is_a_chained_hash_of_parent_tokens_and_extra():
    def ref(parent, tokens, extra=()):      # written out independently
        h = hashlib.blake2b(digest_size=16)
        h.update(parent + len(tokens).to_bytes(4, "little") + array("q", tokens).tobytes())
        for e in extra:
            h.update(len(e.encode()).to_bytes(4, "little") + e.encode())
        return h.digest()

    k1 = block_key(ROOT_KEY, [1, 2, 3, 4])
    assert k1 == ref(b"", [1, 2, 3, 4])
    assert block_key(k1, [5, 6, 7, 8]) == ref(k1, [5, 6, 7, 8])
    assert block_key(k1, [5, 6, 7, 8]) != block_key(ROOT_KEY, [5, 6, 7, 8])      # the parent counts
    assert block_key(ROOT_KEY, [1, 2, 3, 4], ("salt:a",)) != k1                  # the salt counts
    assert block_key(ROOT_KEY, [1, 2, 3, 4], ("salt:a",)) != block_key(ROOT_KEY, [1, 2, 3, 4], ("salt:b",))


def test_hits_share_blocks_and_count_holders():
    kv = make_cache()
    a = make_req("a", list(range(1, 11)))                 # 2 full blocks + 2 tokens
    assert admit(kv, a) == 0
    compute(kv, a)
    b = make_req("b", list(range(1, 9)) + [99, 98, 97, 96])   # shares the first 2 blocks
    assert admit(kv, b) == 8
    ta, tb = kv.block_table("a"), kv.block_table("b")
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    assert [kv.pool.ref_counts[x] for x in ta] == [2, 2, 1]
    compute(kv, b)
    assert kv.stats()["prefix_cache_hits"] == 8 and kv.stats()["prefix_cache_queries"] == 22
    kv.free(a)
    assert [kv.pool.ref_counts[x] for x in ta] == [1, 1, 0]
    kv.free(b)
    kv.free(b)                                            # idempotent
    assert kv.num_free_blocks == 8 and set(kv.pool.evictable) == set(ta[:2]) | {tb[2]}


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = make_cache()
    a = make_req("a", list(range(1, 9)))                  # exactly 2 blocks
    admit(kv, a)
    compute(kv, a)
    kv.free(a)
    again = make_req("a2", list(range(1, 9)))
    assert kv.lookup_prefix(again).num_tokens == 4
    assert admit(kv, again) == 4                          # block 2 is recomputed: the model needs token 8
    longer = make_req("a3", list(range(1, 10)))
    assert admit(kv, longer) == 8


def test_a_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(blocks_mod, "block_key", lambda parent, tokens, extra=(): b"same")
    kv = make_cache()
    a = make_req("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    compute(kv, a)
    b = make_req("b", [9, 9, 9, 9, 5])                    # same key, other tokens
    assert kv.lookup_prefix(b).num_tokens == 0
    assert admit(kv, b) == 0
    assert kv.block_table("b")[0] != kv.block_table("a")[0]


def test_salt_isolates_requests():
    kv = make_cache()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a = make_req("a", tokens, salt="tenant-1")
    admit(kv, a)
    compute(kv, a)
    kv.free(a)
    for rid, salt, hit in (("b", None, 0), ("c", "tenant-2", 0), ("d", "tenant-1", 8)):
        r = make_req(rid, tokens, salt=salt)
        assert admit(kv, r) == hit
        kv.free(r)


def test_uncached_free_blocks_go_first_then_lru_tail_first():
    kv = make_cache(num_blocks=6)
    a = make_req("a", list(range(1, 10)))                 # blocks a0 a1 + partial
    admit(kv, a)
    compute(kv, a)
    b = make_req("b", list(range(50, 59)))
    admit(kv, b)
    compute(kv, b)
    ta, tb = kv.block_table("a"), kv.block_table("b")
    kv.free(a)                                            # older: a1, a0 released tail first
    kv.free(b)
    assert list(kv.pool.evictable) == [ta[1], ta[0], tb[1], tb[0]]
    assert set(kv.pool.free_ids) == {ta[2], tb[2]}        # partial blocks are never cached
    c = make_req("c", list(range(100, 115)))              # needs 4 blocks: 2 free + evict a1, a0
    admit(kv, c)
    assert set(kv.block_table("c")) == {ta[2], tb[2], ta[1], ta[0]}
    assert kv.stats()["prefix_cache_evictions"] == 2
    kv.free(c)
    assert admit(kv, make_req("b2", list(range(50, 59)))) == 8     # b survived
    assert admit(kv, make_req("a2", list(range(1, 10)))) == 0      # a did not


def test_lru_touch_on_hit():
    kv = make_cache(num_blocks=4)
    a, b = make_req("a", [1, 2, 3, 4, 0]), make_req("b", [5, 6, 7, 8, 0])
    for r in (a, b):
        admit(kv, r)
        compute(kv, r)
        kv.free(r)
    a2 = make_req("a2", [1, 2, 3, 4, 1])                 # a's block becomes most recent
    admit(kv, a2)
    kv.free(a2)
    c = make_req("c", [9, 9, 9, 9, 9, 9, 9])             # 2 blocks: 2 free ones (partials)
    admit(kv, c)
    d = make_req("d", [7, 7, 7])                          # one more block: evicts b's, not a's
    admit(kv, d)
    assert kv.lookup_prefix(make_req("a3", [1, 2, 3, 4, 2])).num_tokens == 4
    assert kv.lookup_prefix(make_req("b3", [5, 6, 7, 8, 2])).num_tokens == 0


def test_lookup_has_no_side_effects_and_commit_takes_the_hit():
    kv = make_cache(num_blocks=4)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    admit(kv, a)
    compute(kv, a)
    kv.free(a)                                            # a's 2 full blocks: cached, evictable
    b = make_req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    before = (list(kv.pool.ref_counts), list(kv.pool.evictable), kv.num_free_blocks)
    hit = kv.lookup_prefix(b)
    assert hit.num_tokens == 8 and hit.num_evictable == 2
    assert (list(kv.pool.ref_counts), list(kv.pool.evictable), kv.num_free_blocks) == before
    assert not kv.block_table("b")
    # committing needs its 2 evictable blocks plus 1 new one: 4 free, so it fits
    assert kv.allocate_slots(b, 1, prefix=hit)
    assert kv.block_table("b")[:2] == list(hit.block_ids) and kv.num_free_blocks == 1
    # a hit whose evictable blocks leave too little is refused, changing nothing
    c = make_req("c", [1, 2, 3, 4, 5, 6, 7, 8] + list(range(20, 40)))
    hit_c = kv.lookup_prefix(c)
    assert not kv.allocate_slots(c, c.num_tokens - hit_c.num_tokens, prefix=hit_c)
    assert not kv.block_table("c") and kv.num_free_blocks == 1


# -- the swap connector (second tier) ---------------------------------------------

def fill_and_evict(kv: PrefixKVCache, conn: SwapConnector, tokens: list[int], rid: str = "a") -> list[int]:
    """Compute tokens' full blocks, finish (the connector saves them), then
    push them out of the pool."""
    r = make_req(rid, tokens)
    admit(kv, r, conn)
    compute(kv, r, conn)
    finish(kv, r, conn)
    filler = make_req(rid + "-filler", [1000 + i for i in range(kv.num_blocks * BS)])
    assert kv.allocate_slots(filler, filler.num_tokens)
    kv.free(filler)
    return r.all_token_ids


def assert_block_data(kv: PrefixKVCache, conn: SwapConnector, rid: str, tokens: list[int], num_blocks: int) -> None:
    for i, b in enumerate(kv.block_table(rid)[:num_blocks]):
        np.testing.assert_array_equal(conn.read_block(b), block_data(tokens[i * BS:(i + 1) * BS], i))


def test_swap_connector_saves_at_finish_and_loads_back():
    kv, conn = make_cache(num_blocks=4), make_connector(4, max_blocks=8)
    tokens = list(range(1, 11))
    fill_and_evict(kv, conn, tokens)
    assert conn.stats()["swap_blocks"] == 2 and kv.lookup_prefix(make_req("x", tokens)).num_tokens == 0
    again = make_req("again", tokens)
    assert conn.get_num_new_matched_tokens(again, 0) == 8
    assert admit(kv, again, conn) == 8
    assert conn.stats()["swap_loaded_blocks"] == 2
    assert_block_data(kv, conn, "again", tokens, 2)
    # a block the tier has is not saved again
    compute(kv, again, conn)
    assert not conn.request_finished(again, kv.block_table("again"))


def test_file_tier_survives_a_restart(tmp_path):
    tokens = list(range(1, 11))
    kv, conn = make_cache(num_blocks=4), make_connector(4, dir=str(tmp_path))
    fill_and_evict(kv, conn, tokens)
    assert len(list(tmp_path.glob("*.kvb"))) == 2
    kv2, restarted = make_cache(num_blocks=4), make_connector(4, dir=str(tmp_path))
    req = make_req("r", tokens)
    assert admit(kv2, req, restarted) == 8
    assert restarted.stats()["swap_loaded_blocks"] == 2
    assert_block_data(kv2, restarted, "r", tokens, 2)


def test_close_performs_the_saves_still_pending(tmp_path):
    kv, conn = make_cache(num_blocks=8), make_connector(8, dir=str(tmp_path))
    r = make_req("a", list(range(1, 14)))
    admit(kv, r, conn)
    compute(kv, r, conn)
    assert conn.request_finished(r, kv.block_table("a"))      # saves pending, no step ran
    conn.close()
    conn.close()                                               # idempotent
    assert len(list(tmp_path.glob("*.kvb"))) == 3
    kv2, restarted = make_cache(num_blocks=8), make_connector(8, dir=str(tmp_path))
    assert admit(kv2, make_req("b", list(range(1, 14))), restarted) == 12


def test_file_tier_is_bounded(tmp_path):
    kv, conn = make_cache(num_blocks=4), make_connector(4, dir=str(tmp_path), max_blocks=3)
    fill_and_evict(kv, conn, list(range(1, 11)), "a")
    fill_and_evict(kv, conn, list(range(20, 30)), "b")
    assert len(list(tmp_path.glob("*.kvb"))) <= 3 and len(conn.tier) <= 3


def _write_corrupt_files(folder, good: FileTier) -> dict[str, str]:
    """Each kind of bad file, written next to good ones; returns name -> kind."""
    files = sorted(folder.glob("*.kvb"))
    raw = files[0].read_bytes()
    header_len = int.from_bytes(raw[12:16], "little")
    payload_at = PREFIX_BYTES + header_len
    bad = {}
    # flipped payload byte: header fine, checksum wrong
    flipped = bytearray(raw)
    flipped[payload_at + 5] ^= 0xFF
    files[0].write_bytes(bytes(flipped))
    bad[files[0].name] = "checksum"
    # truncated payload
    raw1 = files[1].read_bytes()
    files[1].write_bytes(raw1[:-100])
    bad[files[1].name] = "truncated"
    # garbage and a wrong version
    (folder / ("ab" * 16 + ".kvb")).write_bytes(b"not a kv block at all")
    bad["ab" * 16 + ".kvb"] = "magic"
    (folder / ("cd" * 16 + ".kvb")).write_bytes(MAGIC + (FORMAT_VERSION + 1).to_bytes(4, "little") + bytes(8))
    bad["cd" * 16 + ".kvb"] = "version"
    return bad


def test_corrupt_and_foreign_files_are_ignored_with_a_warning(tmp_path, caplog):
    tokens = list(range(1, 18))                           # 4 full blocks
    kv, conn = make_cache(num_blocks=5), make_connector(5, dir=str(tmp_path))
    fill_and_evict(kv, conn, tokens)
    assert len(list(tmp_path.glob("*.kvb"))) == 4
    bad = _write_corrupt_files(tmp_path, conn.tier)

    # a foreign model: every file is ignored at start-up
    with caplog.at_level(logging.WARNING, logger="fdx.cache.swap"):
        foreign = make_connector(5, model="other-model", dir=str(tmp_path))
    assert len(foreign.tier) == 0
    assert "another model" in caplog.text
    assert admit(make_cache(num_blocks=5), make_req("f", tokens), foreign) == 0

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fdx.cache.swap"):
        restarted = make_connector(5, dir=str(tmp_path))
        assert "bad magic" in caplog.text and "format version" in caplog.text
        req = make_req("r", tokens)
        kv2 = make_cache(num_blocks=5)
        hit = admit(kv2, req, restarted)
    # the chain stops at the first bad block: block 0 or 1 was corrupted
    names = [block_key_chain(tokens)[i].hex() + ".kvb" for i in range(4)]
    first_bad = min(i for i, n in enumerate(names) if n in bad)
    # the lookup reads and checks each block: the chain stops at the first bad one
    assert hit == first_bad * BS
    assert_block_data(kv2, restarted, "r", tokens, first_bad)
    assert "checksum" in caplog.text or "payload is" in caplog.text


def block_key_chain(tokens: list[int], extra=()) -> list[bytes]:
    keys, parent = [], ROOT_KEY
    for i in range(len(tokens) // BS):
        parent = block_key(parent, tokens[i * BS:(i + 1) * BS], extra)
        keys.append(parent)
    return keys


def test_file_tier_rejects_a_renamed_or_tampered_header(tmp_path, caplog):
    kv, conn = make_cache(num_blocks=4), make_connector(4, dir=str(tmp_path))
    fill_and_evict(kv, conn, list(range(1, 11)))
    f = sorted(tmp_path.glob("*.kvb"))[0]
    f.rename(tmp_path / ("ee" * 16 + ".kvb"))            # name no longer matches the key
    with caplog.at_level(logging.WARNING, logger="fdx.cache.swap"):
        restarted = make_connector(4, dir=str(tmp_path))
    assert "file name does not match" in caplog.text
    assert len(restarted.tier) == 1
    # a tampered token list: the key no longer matches its tokens
    meta = BlockMeta(b"\x01" * 16, ROOT_KEY, (1, 2, 3, 4))
    restarted.tier.put(meta, block_data([1, 2, 3, 4], 0))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fdx.cache.swap"):
        make_connector(4, dir=str(tmp_path))
    assert "key does not match its tokens" in caplog.text


# -- with SmolLM2 -----------------------------------------------------------------

SYSTEM = ("You are a careful assistant for a small bakery. The bakery opens at seven in the morning "
          "and closes at six in the evening, every day except Monday. It sells bread, croissants, "
          "cinnamon rolls and three kinds of cake. Answer each question in one short sentence.\n")
QUESTIONS = ["Question: When does the bakery open?\nAnswer:",
             "Question: Which day is the bakery closed?\nAnswer:",
             "Question: What does the bakery sell?\nAnswer:",
             "Question: Can I buy a cake there?\nAnswer:"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _mixed_prompts(tok) -> list[list[int]]:
    system = tok.encode(SYSTEM)
    prompts = [system + tok.encode(q, add_special_tokens=False) for q in QUESTIONS]
    prompts.append(system[:40] + tok.encode(" Unrelated: the sky is", add_special_tokens=False))
    prompts.append(tok.encode("The capital of France is"))
    prompts.append(list(prompts[0]))                      # a whole prompt seen before
    return prompts


def _generate(llm, prompts, priorities=None) -> list[list[int]]:
    eng = llm.engine
    reqs = [eng.make_request(p, GREEDY, priority=(priorities or [0] * len(prompts))[i])
            for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    while eng.has_unfinished():
        eng.step()
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def solo_outputs(smollm_llm):
    prompts = _mixed_prompts(smollm_llm.tokenizer)
    return prompts, [smollm_llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids
                     for p in prompts]


# KV scheduler x KV cache x queue policy pairwise (every pair of values in some row: 6 rows,
# not the 12 of every combination): kind -> its (cache, policy) rows
PAIRWISE = {"v0": [("paged", "fcfs"), ("prefix", "priority"), ("prefix", "lpm")],
            "v1": [("prefix", "fcfs"), ("paged", "priority"), ("paged", "lpm")]}


def test_the_rows_cover_every_pair():
    rows = [(kind, cache, policy) for kind, pairs in PAIRWISE.items() for cache, policy in pairs]
    values = (("v0", "v1"), ("paged", "prefix"), ("fcfs", "priority", "lpm"))
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert {(r[i], r[j]) for r in rows} == {(a, b) for a in values[i] for b in values[j]}, (i, j)


@pytest.mark.parametrize("kind", ["v0", "v1"])
def test_outputs_identical_across_caches_and_policies(smollm_llm, solo_outputs, kind):
    from fdx.entrypoints.bench.prefix import use_scheduling
    prompts, solo = solo_outputs
    priorities = [3, 1, 2, 0, 1, 2, 0]
    for cache, policy in PAIRWISE[kind]:
        # few slots and a small step budget: later requests hit what earlier ones cached,
        # prefills are chunked, and (with v1) decodes mix with prefill chunks
        with use_scheduling(smollm_llm.engine, resource_manager=kind, kv_cache=cache, policy=policy,
                            max_num_seqs=3, max_num_batched_tokens=48) as eng:
            outs = _generate(smollm_llm, prompts, priorities)
            again = _generate(smollm_llm, prompts[:2], priorities[:2])     # warm: hits
            stats = eng.kv_cache.stats()
            assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks
        assert outs == solo, (kind, cache, policy)
        assert again == solo[:2], (kind, cache, policy)
        if cache == "prefix":
            assert stats["prefix_cache_hits"] > 0, (kind, policy, stats)


def test_second_tier_hit_equals_recompute_and_survives_restart(smollm_llm, tmp_path, caplog):
    from fdx.entrypoints.bench.prefix import use_scheduling
    tok = smollm_llm.tokenizer
    a = tok.encode(SYSTEM * 2 + QUESTIONS[0])             # ~140 tokens: 8+ full blocks
    b = tok.encode("Once upon a time, " * 100)[:470]      # 30 blocks: pushes a's blocks out
    (want_a,) = _generate(smollm_llm, [a])                # recompute: the paged engine
    # 32 blocks of 16 = one max_model_len sequence: b evicts a's blocks into files
    with use_scheduling(smollm_llm.engine, kv_cache="prefix", num_kv_blocks=32, swap_dir=str(tmp_path)) as eng:
        assert _generate(smollm_llm, [a]) == [want_a]
        _generate(smollm_llm, [b])
        assert eng.kv_cache.stats()["prefix_cache_evictions"] > 0
        assert len(list(tmp_path.glob("*.kvb"))) > 0
        assert _generate(smollm_llm, [a]) == [want_a]
        stats = {**eng.kv_cache.stats(), **eng.connector.stats()}
        assert stats["swap_loaded_blocks"] > 0, stats
    # a's blocks were saved to files when it finished
    keys = block_key_chain_of(a, 16)
    assert all((tmp_path / (k.hex() + ".kvb")).exists() for k in keys)

    # a new KV cache and tier on the same folder (what a restarted engine builds; the session's
    # engine, not a second float32 SmolLM2 load): a's whole prefix is a hit from the files
    with use_scheduling(smollm_llm.engine, kv_cache="prefix", num_kv_blocks=32, swap_dir=str(tmp_path)) as eng:
        assert _generate(smollm_llm, [a]) == [want_a]
        assert eng.connector.stats()["swap_loaded_blocks"] == (len(a) - 1) // 16

    # corrupt every file but the first of a's chain, add a foreign one: ignored, output unchanged
    for key in keys[1:]:
        f = tmp_path / (key.hex() + ".kvb")
        if f.exists():
            data = bytearray(f.read_bytes())
            data[-7] ^= 0x5A
            f.write_bytes(bytes(data))
    (tmp_path / ("00" * 16 + ".kvb")).write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="fdx.cache.swap"):
        with use_scheduling(smollm_llm.engine, kv_cache="prefix", num_kv_blocks=32, swap_dir=str(tmp_path)) as eng:
            assert _generate(smollm_llm, [a]) == [want_a]
            assert eng.connector.stats()["swap_loaded_blocks"] == 1
    assert "checksum" in caplog.text and "bad magic" in caplog.text


def block_key_chain_of(tokens: list[int], bs: int) -> list[bytes]:
    keys, parent = [], ROOT_KEY
    for i in range(len(tokens) // bs):
        parent = block_key(parent, tokens[i * bs:(i + 1) * bs])
        keys.append(parent)
    return keys


# -- a writer of the tier folder must not steer the engine (docs/security.md) -------

def test_a_symlink_planted_at_the_temp_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    folder = tmp_path / "tier"
    kv, conn = make_cache(num_blocks=4), make_connector(4, dir=str(folder))
    tokens = list(range(1, 11))
    for key in block_key_chain(tokens):
        (folder / f"{key.hex()}.kvb.tmp{os.getpid()}").symlink_to(victim)
    fill_and_evict(kv, conn, tokens)
    assert victim.read_bytes() == b"precious"
    for key in block_key_chain(tokens):                   # the blocks were still saved, as files
        f = folder / (key.hex() + ".kvb")
        assert f.is_file() and not f.is_symlink() and (f.stat().st_mode & 0o777) == 0o600


def test_a_block_file_from_another_tier_folder_is_a_miss(tmp_path, caplog):
    """A's KV under B's key, in a file with a valid checksum (written by an
    fdx tier on the attacker's own folder): the victim's tier does not load it."""
    a, b = list(range(1, 6)), list(range(50, 55))
    kv, conn = make_cache(num_blocks=4), make_connector(4, dir=str(tmp_path / "victim"))
    fill_and_evict(kv, conn, a)
    a0, b0 = block_key_chain(a)[0], block_key_chain(b)[0]
    a_data = conn.tier.get(BlockMeta(a0, ROOT_KEY, tuple(a[:BS])))
    attacker = FileTier(tmp_path / "attacker", 4, conn.tier.fingerprint)
    attacker.put(BlockMeta(b0, ROOT_KEY, tuple(b[:BS])), a_data)
    forged = (tmp_path / "attacker" / (b0.hex() + ".kvb")).read_bytes()
    (tmp_path / "victim" / (b0.hex() + ".kvb")).write_bytes(forged)

    with caplog.at_level(logging.WARNING, logger="fdx.cache.swap"):
        restarted = make_connector(4, dir=str(tmp_path / "victim"))
        assert admit(make_cache(num_blocks=4), make_req("b", b), restarted) == 0
        assert admit(make_cache(num_blocks=4), make_req("b2", b), restarted) == 0
        assert admit(make_cache(num_blocks=4), make_req("a", a), restarted) == BS   # a's own block still hits
    assert caplog.text.count(b0.hex()) == 1 and "HMAC" in caplog.text             # said once
    assert restarted.stats()["swap_ignored_files"] == 1


def test_a_fifo_in_the_tier_folder_does_not_block_the_start(tmp_path, caplog):
    import threading
    fifo = tmp_path / ("ab" * 16 + ".kvb")
    os.mkfifo(fifo)
    made = []
    with caplog.at_level(logging.WARNING, logger="fdx.cache.swap"):
        t = threading.Thread(target=lambda: made.append(make_connector(4, dir=str(tmp_path))), daemon=True)
        t.start()
        t.join(timeout=30)
    if t.is_alive():                    # blocked opening the FIFO: give it a writer so it ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout=10)
        pytest.fail("the tier blocked on a FIFO at start")
    assert len(made[0].tier) == 0 and "not a regular file" in caplog.text


def test_a_folder_others_can_write_to_is_a_config_error(tmp_path):
    from fdx.core.config import ConfigError
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(ConfigError, match=r"plugins\.connector\.swap\.dir.*writable by group or others"):
        make_connector(4, dir=str(folder))
    assert not list(folder.iterdir())                     # nothing written there


def test_a_new_folder_and_the_tier_key_are_owner_only(tmp_path):
    folder = tmp_path / "new" / "tier"
    make_connector(4, dir=str(folder))
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "tier.key").stat().st_mode & 0o777 == 0o600
