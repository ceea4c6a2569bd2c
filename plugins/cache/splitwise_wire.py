"""The splitwise connector's wire: its messages and how each one is sealed.

A message is a ZMQ multipart ``[mac, header, *payload]``: ``header`` a
tagged msgspec struct in msgpack (never pickle), ``payload`` the KV frames
(Blocks only), and ``mac`` the HMAC-SHA256, under the shared secret, of a
domain tag, the number of frames, and each frame (header and every payload
frame) prefixed by its length: nothing in a message can change, move
between frames or between messages without the secret.

Every header names the transfer (``request_id``), carries ``v``
(``PROTOCOL_VERSION``) and a sequence number ``seq`` that rises strictly
within a transfer in each direction, and binds to the transfer's nonces:
``offer_nonce``, chosen by the prefill side for its Offer (every reply
echoes it), and ``nonce``, chosen by the decode side when it reserves blocks
(in its Accept; every later Blocks or Abort must carry it, and it is used
once). An Offer also carries ``sent_at`` (wall clock): the decode side
refuses an Offer older than ``offer_max_age_s`` or one whose
``offer_nonce`` it has seen, so a recorded Offer cannot be replayed.
"""
from __future__ import annotations

import hashlib
import hmac
import struct

import msgspec

PROTOCOL_VERSION = 2
MAC_BYTES = 32
MAX_HEADER_BYTES = 1 << 16
DOMAIN = b"fdx-splitwise-v2\0"


# prefill -> decode

class Offer(msgspec.Struct, tag="offer"):
    v: int
    request_id: str
    seq: int                                 # 0
    offer_nonce: str                         # fresh, hex; every reply echoes it
    sent_at: float                           # time.time() when sent (replay window)
    num_tokens: int                          # tokens whose KV the prefill side holds
    first_token: int                         # the token the prefill side sampled
    fingerprint: dict[str, str | int]


class Blocks(msgspec.Struct, tag="blocks"):
    v: int
    request_id: str
    seq: int                                 # above the Offer's
    nonce: str                               # the decode side's, from its Accept
    block_ids: list[int]                     # the receiver's, as in its Accept
    start: int
    num_tokens: int
    frame_bytes: int                         # the size of each payload frame (one per layer)


class Abort(msgspec.Struct, tag="abort"):
    v: int
    request_id: str
    seq: int
    nonce: str                               # only the owner of the reservation knows it
    reason: str


# decode -> prefill

class Accept(msgspec.Struct, tag="accept"):
    v: int
    request_id: str
    seq: int                                 # 0
    offer_nonce: str
    nonce: str                               # fresh: required in the Blocks that follow
    block_ids: list[int]                     # the decode request's whole block table
    start: int                               # first token position to send
    num_tokens: int                          # how many (0: nothing wanted, done)


class Confirm(msgspec.Struct, tag="confirm"):
    v: int
    request_id: str
    seq: int
    offer_nonce: str
    nonce: str


class Refuse(msgspec.Struct, tag="refuse"):
    v: int
    request_id: str
    reason: str
    seq: int = 0
    offer_nonce: str = ""                    # empty: a refusal of a message that did not authenticate


ToDecode = Offer | Blocks | Abort
ToPrefill = Accept | Confirm | Refuse
_encoder = msgspec.msgpack.Encoder()


def mac(secret: str, frames: list) -> bytes:
    """HMAC-SHA256 over every frame, each prefixed by its length."""
    h = hmac.new(secret.encode(), DOMAIN + struct.pack("<I", len(frames)), hashlib.sha256)
    for f in frames:
        view = memoryview(f).cast("B")
        h.update(struct.pack("<Q", view.nbytes))
        h.update(view)
    return h.digest()


def seal(secret: str, msg, payload: list | None = None) -> list:
    """The frames of ``msg`` (and its payload), with their MAC in front."""
    frames = [_encoder.encode(msg), *(payload or [])]
    return [mac(secret, frames), *frames]


def unsigned(msg) -> list[bytes]:
    """A Refuse to a sender that did not authenticate: one frame, no MAC,
    readable by a peer of any version (an old one reads its ``v``)."""
    return [_encoder.encode(msg)]


class WireError(Exception):
    """A message that fails a check; ``request_id`` when it named one."""

    def __init__(self, why: str, request_id: str = ""):
        super().__init__(why)
        self.request_id = request_id


def unseal(secret: str, frames: list[bytes], decoder: msgspec.msgpack.Decoder):
    """``(header, payload)`` of a sealed message, or WireError: the MAC is
    checked over all frames before the header is even decoded."""
    if not frames:
        raise WireError("an empty message")
    if len(frames) == 1 or len(frames[0]) != MAC_BYTES:
        raise WireError(_legacy(frames[0]))
    if len(frames[1]) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(frames[1])} bytes")
    if not hmac.compare_digest(frames[0], mac(secret, frames[1:])):
        raise WireError("wrong MAC (another connector secret, or the message was altered)")
    try:
        msg = decoder.decode(frames[1])
    except msgspec.DecodeError as e:
        raise WireError(f"not a splitwise message ({e})") from None
    if msg.v != PROTOCOL_VERSION:
        raise WireError(f"protocol version {msg.v}, expected {PROTOCOL_VERSION}", msg.request_id)
    return msg, frames[2:]


def _legacy(frame: bytes) -> str:
    """Why a one-frame message is refused: an older peer's, or garbage."""
    try:
        head = msgspec.msgpack.decode(frame[:MAX_HEADER_BYTES])
    except msgspec.DecodeError:
        head = None
    if isinstance(head, dict) and "v" in head:
        return (f"protocol version {head['v']}, expected {PROTOCOL_VERSION}: "
                f"upgrade fdx on both sides (v2 seals every message)")
    return "not a splitwise message (no MAC frame)"


def read_refusal(frame: bytes) -> str:
    """The reason in an unsigned one-frame Refuse (for the log: it proves nothing)."""
    try:
        msg = msgspec.msgpack.decode(frame, type=Refuse)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "an unreadable one-frame reply"
    return f"refused (unsigned reply, v{msg.v}): {msg.reason}"
