"""Block identity for prefix reuse: a chained key over (parent key, the
block's token ids, extra keys such as a cache salt), shared by the prefix
cache and the swap connector so that both name a block the same way."""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Iterator, Sequence

ROOT_KEY = b""                 # the parent of a request's first block


def block_key(parent: bytes, tokens: Sequence[int], extra: Sequence[str] = ()) -> bytes:
    """The chained key of a full block: a hash of its parent's key, its
    token ids and extra keys (a cache salt). Stable across processes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    for e in extra:
        b = e.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    return h.digest()


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """What a cached block holds: enough to confirm a hit token by token."""
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    extra: tuple[str, ...] = ()


def extra_keys(request) -> tuple[str, ...]:
    """What else, beside the tokens, a block's identity depends on: the
    cache salt, and for a request that steers its activations (an add in
    ``SamplingParams.activations``) its own id, so that no other request
    is ever served its blocks."""
    salt = () if request.cache_salt is None else ("salt:" + request.cache_salt,)
    acts = request.sampling_params.activations
    if acts and acts.get("add"):
        return salt + ("steered:" + request.request_id,)
    return salt


def block_metas(request, block_size: int, stop: int, start: int = 0,
                memo: list[bytes] | None = None) -> Iterator[tuple[int, BlockMeta]]:
    """(index, BlockMeta) of the request's full blocks ``start .. stop-1``.
    ``memo`` keeps the request's keys computed so far (extended in place)."""
    keys = memo if memo is not None else []
    tokens, extra = request.all_token_ids, extra_keys(request)
    for i in range(len(keys), stop):
        keys.append(block_key(keys[i - 1] if i else ROOT_KEY, tokens[i * block_size:(i + 1) * block_size], extra))
    for i in range(start, stop):
        yield i, BlockMeta(keys[i], keys[i - 1] if i else ROOT_KEY,
                           tuple(tokens[i * block_size:(i + 1) * block_size]), extra)
