"""splitwise: prefill/decode disaggregation on the KV connector seam.

An instance runs the connector (``cache.kv_connector: splitwise``) as
``plugins.connector.splitwise.role``: ``prefill`` or ``decode`` (an instance
without it is mixed); its settings are ``SplitwiseConnector.Settings``.
The router (entrypoints/serving/router.py) opens each request on a decode
instance first, marked ``extra_args: {"splitwise": {"remote_prefill":
true}}``; that request waits in the queue (``defer_request``). Then it sends
the same request to a prefill instance with ``max_tokens: 1`` and
``{"splitwise": {"remote_decode": "tcp://<decode connector>"}}``. The prefill
instance computes the prompt and the first token; when the request finishes
its blocks are held (``request_finished`` returns True) and moved:

    prefill (DEALER)                               decode (ROUTER, bound)
    Offer(request_id, offer_nonce, sent_at,    --> match the waiting request,
          num_tokens, first_token)                 allocate its blocks
        <-- Accept(offer_nonce, nonce, block_ids, start, num_tokens) | Refuse(reason)
    Blocks(nonce, block_ids, start, num_tokens) -> checked, written into the
      + one frame per layer                        reserved blocks (engine thread)
                   <-- Confirm | Refuse
    free the blocks (get_finished()[0])            the request joins the batch
                                                   (get_finished()[1])
    (a transfer failing after the Accept: Abort(nonce, reason) --> the request ends)

The decode side loads the prompt's KV except its last token and computes
that one position itself, sampling the first token (as vLLM's NIXL
connector does): the client's one stream comes from the decode instance and
no token is repeated or lost. The prefill side's first token rides in the
Offer; with greedy decoding the two agree (counted in ``stats()``).

Payload: after the header, one frame per layer, each ``[2 (k, v),
num_kv_heads, num_tokens, head_dim]`` in the cache dtype. Chunked by layer,
not streamed layer by layer: the prefill side sends once the request's
prompt is computed (the engine does not pause a forward to send), and a
frame per layer keeps each buffer a contiguous slice that the receiver
checks on its own (its size against the fingerprint) before writing any.

Every message is sealed (plugins/cache/splitwise_wire.py): an HMAC-SHA256
under the shared secret (``secret``, ``secret_file`` or
``$FDX_SPLITWISE_SECRET``, which never travels nor is logged; an instance
with a splitwise role refuses to start without one, unless ``insecure:
true`` on loopback only: ``resolve_secret``) over the
whole message, header and every KV frame, and bound to its transfer by the
transfer id, a nonce each side chose (the decode side's is fresh for each
reservation and used once), per-direction sequence numbers, and on the
decode side the connection that made the Offer. The decode side refuses a
message that fails any check (counted in ``splitwise_messages_rejected``,
logged once per connection) without touching the request it names: only
the prefill instance that owns a reservation (its MAC, nonce and
connection) can end it early, with an Abort. An authenticated Offer for
another model or KV layout (the fingerprint: layers, KV heads, head dim,
dtype, model name) ends the waiting request with a refusal (the router
retries elsewhere). Frames past ``max_frame_bytes`` are dropped by libzmq
before anything is allocated (``zmq.MAXMSGSIZE``). With
``curve_secret_key`` (decode) and ``curve_server_key`` (prefill) the channel
is also encrypted (ZMQ CURVE): docs/security.md. A step not answered within
``transfer_timeout_s`` (or a dead peer) fails the transfer: the prefill side
frees its blocks, the decode side ends the request with an error and frees
its blocks.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import queue
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from typing import Literal
from urllib.parse import urlsplit

import msgspec
import numpy as np
import zmq
import zmq.utils.z85
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import KVConnector
from fdx.core.request import RequestStatus
from fdx.plugins.cache.splitwise_wire import (MAX_HEADER_BYTES, PROTOCOL_VERSION, Abort, Accept, Blocks,
                                              Confirm, Offer, Refuse, ToDecode, ToPrefill, WireError,
                                              read_refusal, seal, unseal, unsigned)

__all__ = ["PROTOCOL_VERSION", "Abort", "Accept", "Blocks", "Confirm", "Offer", "Refuse", "SplitwiseConnector"]

log = logging.getLogger("fdx.cache.splitwise")

POLL_MS = 10
MAX_LOGGED_PEERS = 1024
SECRET_ENV = "FDX_SPLITWISE_SECRET"
SECRET_HELP = ("set plugins.connector.splitwise.secret, secret_file (created with a random secret when missing) "
               f"or ${SECRET_ENV}, the same on the prefill and the decode instances; or insecure: true, on "
               "loopback only (docs/security.md#the-splitwise-kv-channel)")


def _nonce() -> str:
    return secrets.token_hex(16)


def _curve_key(key: str | None, name: str) -> str | None:
    """A CURVE key setting: Z85 text of 40 characters, as ``zmq.curve_keypair()`` makes."""
    if key is None:
        return None
    try:
        ok = isinstance(key, str) and len(key) == 40 and len(zmq.utils.z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a Z85 CURVE key of 40 characters (zmq.curve_keypair())")
    return key


def _splitwise_args(request) -> dict:
    extra = request.sampling_params.extra_args or {}
    sw = extra.get("splitwise")
    return sw if isinstance(sw, dict) else {}


def wire_id(request) -> str:
    """The id both instances know a request by: ``<transfer_id>-<sequence
    index>`` when the router named the transfer (each server names its own
    engine requests ``<its id>-<index>``), else the engine request id."""
    tid = _splitwise_args(request).get("transfer_id")
    if not tid:
        return request.request_id
    return f"{tid}-{request.request_id.rsplit('-', 1)[-1]}"


@dataclass(slots=True)
class SendJob:
    request_id: str                          # the engine's
    wire_id: str                             # on the wire
    block_ids: list[int]
    num_tokens: int
    first_token: int
    peer: str


@dataclass(slots=True)
class SplitwiseStep:
    """The runner side's work for one step (plain data)."""
    sends: list[SendJob] = field(default_factory=list)
    loads: dict[str, tuple[list[int], int, int]] = field(default_factory=dict)  # id -> (blocks, start, n)
    cancels: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _OfferState:
    identity: bytes                          # the connection that made the Offer: its owner
    offer: Offer
    arrived: float
    reached: float | None = None             # when a step first found its request (reserve_timeout counts from here)


@dataclass(slots=True)
class _Reservation:
    """Decode side: blocks reserved for an accepted Offer, until its Blocks arrive."""
    identity: bytes                          # only this connection may send Blocks or Abort
    offer_nonce: str
    nonce: str                               # ours, fresh; required in Blocks and Abort
    block_ids: list[int]
    start: int
    num_tokens: int
    since: float
    engine_id: str
    last_seq: int                            # the owner's last sequence number


class SplitwiseSettings(BaseModel):
    """``plugins.connector.splitwise`` (docs/deployment.md#settings)."""
    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]         # which half of the pair this instance is
    host: str = "127.0.0.1"                    # where a decode instance's connector listens
    port: int = Field(0, ge=0, le=65535)       # its TCP port; required (non-zero) for role decode
    secret: str | None = None                  # shared secret every transfer message must carry
    secret_file: str | None = None             # or a file holding it (created 0600 with a random one if missing)
    insecure: bool = False                     # no secret: messages unauthenticated; loopback only, for tests
    transfer_timeout_s: float = Field(30.0, gt=0)   # a transfer step not answered in time fails
    debug_transfer_delay_s: float = Field(0.0, ge=0)   # test only: hold each transfer open this long
    reserve_timeout_s: float | None = Field(None, gt=0)   # None: min(2, transfer_timeout_s)
    unknown_grace_s: float = Field(2.0, ge=0)  # an offer for a request id never seen is refused after this
    offer_max_age_s: float = Field(60.0, gt=0)   # an older Offer is a replay
    max_frame_bytes: int | None = Field(None, gt=0)   # None: one layer's KV for the longest transfer + 64 KiB
    model_name: str | None = None              # the fingerprint's model name; None: the model file's name
    curve_secret_key: str | None = None        # decode: its CURVE secret key (Z85)
    curve_server_key: str | None = None        # prefill: the decode instances' CURVE public key (Z85)

    @field_validator("curve_secret_key", "curve_server_key")
    @classmethod
    def _z85(cls, value, info):
        return _curve_key(value, info.field_name)

    @model_validator(mode="after")
    def _decode_listens(self):
        if self.role == "decode" and not self.port:
            raise ValueError("port must be set (non-zero) for role decode")
        return self

    @model_validator(mode="after")
    def _authenticated(self):
        """A splitwise role needs a secret (or ``insecure`` on loopback): checked
        here, where a config error names the key; the file is read at start."""
        if self.secret is not None and not self.secret:
            raise ValueError("secret is empty: " + SECRET_HELP)
        if self.secret is not None and self.secret_file is not None:
            raise ValueError("secret and secret_file are both set: choose one")
        given = self.secret is not None or self.secret_file is not None or bool(os.environ.get(SECRET_ENV))
        if self.insecure:
            if given:
                raise ValueError(f"insecure: true beside a secret (secret, secret_file or ${SECRET_ENV}): "
                                 "choose one")
            if not is_loopback(self.host):
                raise ValueError(f"insecure: true is allowed only on loopback, and host is {self.host!r}: "
                                 + SECRET_HELP)
        elif not given:
            raise ValueError("a splitwise role needs a shared secret: " + SECRET_HELP)
        return self


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 possibly in brackets) is this machine's loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def peer_is_loopback(peer: str) -> bool:
    """Whether a ZMQ endpoint (``tcp://host:port``, ``ipc://...``) stays on this machine."""
    if peer.startswith(("ipc://", "inproc://")):
        return True
    try:
        host = urlsplit(peer).hostname
    except ValueError:
        return False
    return bool(host) and is_loopback(host)


def read_secret_file(path: str) -> str:
    """The secret in ``path``: created (mode 0600, a random secret) when it
    does not exist; an existing one must be a regular file owned by this
    user and not readable by group or others. Raises ValueError naming the
    setting and the reason."""
    p = Path(path).expanduser()
    where = f"secret_file {str(p)!r}"
    if not p.exists() and not p.is_symlink():
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
            try:
                os.link(tmp, p)                       # atomic; the peer on this host may have made it first
                log.warning("splitwise: created a new shared secret in %s (mode 0600). Give the peer instances "
                            "the same secret: copy the file to them (e.g. scp -p, keeping mode 0600) and set their "
                            "plugins.connector.splitwise.secret_file to it (docs/deployment.md)", p)
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    try:
        st = os.lstat(p)
    except OSError as e:
        raise ValueError(f"{where}: cannot be read: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{where} is not a regular file (a symlink or a device): refused")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{where} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): refused")
    if st.st_mode & 0o077:
        raise ValueError(f"{where} is readable or writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                         "chmod 600 it")
    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        secret = f.read().strip()
    if not secret:
        raise ValueError(f"{where} is empty")
    return secret


def resolve_secret(sw: SplitwiseSettings) -> str:
    """The connector's HMAC key: ``secret``, else ``secret_file``'s, else
    ``$FDX_SPLITWISE_SECRET``; "" only with ``insecure`` (on loopback, said
    loudly). Never logged."""
    if sw.secret:
        return sw.secret
    if sw.secret_file:
        return read_secret_file(sw.secret_file)
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    if not sw.insecure:                              # the settings validator already refused this
        raise ValueError("a splitwise role needs a shared secret: " + SECRET_HELP)
    log.warning("splitwise: plugins.connector.splitwise.insecure is true: KV transfers are NOT authenticated "
                "(anyone who can reach the connector on this host can forge, alter or replay them); only "
                "loopback peers are used. Set a secret for anything but a test (docs/security.md)")
    return ""


class SplitwiseConnector(KVConnector):
    Settings = SplitwiseSettings

    def __init__(self, settings: SplitwiseSettings | None = None, context=None):
        if not isinstance(settings, SplitwiseSettings):      # built by hand, not by the assembly
            settings = SplitwiseSettings(**(settings or {}))
        super().__init__(settings, context)
        config = self.config
        sw = self.settings
        self.role = sw.role
        try:
            self.secret = resolve_secret(sw)
        except OSError as e:
            raise ValueError(f"secret_file: {e}") from None
        self.insecure = sw.insecure
        self.timeout = float(sw.transfer_timeout_s)
        self.delay = float(sw.debug_transfer_delay_s)
        self.reserve_timeout = float(sw.reserve_timeout_s or min(2.0, self.timeout))
        self.unknown_grace = float(sw.unknown_grace_s)
        self.offer_max_age = float(sw.offer_max_age_s)
        self.max_frame = sw.max_frame_bytes
        model = config.model.model
        self.model_name = str(sw.model_name or (Path(model).name if model else "default"))
        self.fingerprint: dict | None = None
        self.lock = threading.Lock()
        # scheduler side (engine thread)
        self.pending_sends: list[SendJob] = []
        self.pending_loads: dict[str, tuple[list[int], int, int]] = {}
        self.pending_cancels: list[str] = []
        self.expected: dict[str, tuple[float, str]] = {}   # decode: queued requests -> (since, engine id)
        self.settled: set[str] = set()                # decode: queued requests whose offer was taken
        # decode: offers refused before their request was queued here -> (when, why): the request,
        # once it comes, ends at once with the reason instead of waiting for an offer that came
        self.refused_early: dict[str, tuple[float, str]] = {}
        self.step_began = 0.0                         # decode: when the engine last began a step
        self.offers: dict[str, _OfferState] = {}      # decode: offers received (socket thread writes)
        self.accepted: dict[str, _Reservation] = {}
        self.failed: dict[str, str] = {}
        self.first_tokens: dict[str, int] = {}        # decode: the prefill side's first token, to compare
        self.seen_offers: dict[str, float] = {}       # decode: offer nonces of the replay window
        self.logged_peers: set[bytes] = set()
        # runner side
        self.kv_caches: list | None = None
        self.loading: dict[str, tuple[list[int], int, int]] = {}
        self.arrived: dict[str, list[bytes]] = {}     # decode: payloads checked by the socket thread
        self.done_sending: set[str] = set()
        self.done_recving: set[str] = set()
        self.outgoing: queue.Queue = queue.Queue()    # decode: (identity, frames) for the socket thread
        self.counters = {"splitwise_blocks_sent": 0, "splitwise_bytes_sent": 0, "splitwise_blocks_received": 0,
                         "splitwise_bytes_received": 0, "splitwise_transfers_sent": 0,
                         "splitwise_transfers_received": 0, "splitwise_transfers_failed": 0,
                         "splitwise_messages_rejected": 0, "splitwise_transfer_seconds_sum": 0.0,
                         "splitwise_first_token_agree": 0, "splitwise_first_token_differ": 0}
        self.transfer_times: list[float] = []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.zctx = zmq.Context()
        self.sock = None
        self.curve_server_key = sw.curve_server_key
        self.curve_secret_key = sw.curve_secret_key
        if self.role == "decode":
            self.address = f"tcp://{sw.host}:{sw.port}"
            # it listens once the KV spec gives the frame limit (register_kv_caches)

    def _listen(self, max_frame: int):
        """The decode side's ROUTER, bound, frames past ``max_frame`` dropped by libzmq."""
        sock = self.zctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, int(max_frame))
        if self.curve_secret_key:
            sock.curve_server = True
            sock.curve_secretkey = self.curve_secret_key.encode()
            sock.curve_publickey = zmq.curve_public(self.curve_secret_key.encode())
        elif self.settings.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("splitwise: the connector listens on %s without CURVE: the KV travels in the clear "
                        "(set plugins.connector.splitwise.curve_secret_key; docs/security.md)", self.address)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as e:
            sock.close()
            raise ValueError(f"cannot listen on {self.address}: {e}") from None
        return sock

    def frame_limit(self) -> int:
        """The largest frame the decode side takes: one layer's KV for the
        longest transfer the cache can hold, plus room for a header."""
        if self.max_frame is not None:
            return int(self.max_frame)
        tokens = self.spec.num_slots
        if self.config.model.max_model_len:
            tokens = min(tokens, self.config.model.max_model_len)
        return 2 * self.spec.num_kv_heads * tokens * self.spec.head_dim * self.dtype.itemsize + MAX_HEADER_BYTES

    # -- scheduler side: decode ----------------------------------------------------------
    def request_added(self, request) -> None:
        """A decode request is expected from the moment it is queued, not
        from the first step that reaches it: a full batch or a long step
        must not turn its offer into an "unknown request id"."""
        if _splitwise_args(request).get("remote_prefill"):
            key = wire_id(request)
            with self.lock:
                early = self.refused_early.pop(key, None)
                if early is not None:
                    self.failed[request.request_id] = early[1]
                else:
                    self.expected.setdefault(key, (time.monotonic(), request.request_id))

    def defer_request(self, request) -> bool:
        if not _splitwise_args(request).get("remote_prefill"):
            return False
        rid, key, now = request.request_id, wire_id(request), time.monotonic()
        with self.lock:
            if key in self.settled:                     # its offer was taken: admitted like any request
                return False
            self.expected.setdefault(key, (now, rid))   # no offer in time: take_failed ends it
            st = self.offers.get(key)
            if st is not None and st.reached is None:
                st.reached = now
        if st is None:
            return True
        if self._loadable(request, request.num_computed_tokens, st.offer) <= 0:
            with self.lock:                             # nothing worth loading: computed here
                self.offers.pop(key, None)
                self.expected.pop(key, None)
                self.settled.add(key)
            self._reply(st.identity, Accept(PROTOCOL_VERSION, key, 0, st.offer.offer_nonce, "", [], 0, 0))
            return False
        if now - st.reached > self.reserve_timeout:     # offered, but no blocks freed up in time
            with self.lock:
                self.offers.pop(key, None)
            self._refuse(st.identity, key, st.offer.offer_nonce, "no free KV blocks")
            self.failed[rid] = "splitwise: refused: no free KV blocks for the transfer"
            self.counters["splitwise_transfers_failed"] += 1
            return True
        return False

    @staticmethod
    def _loadable(request, num_computed: int, offer: Offer) -> int:
        return min(offer.num_tokens, request.num_prompt_tokens - 1) - num_computed

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        st = self.offers.get(wire_id(request))
        if st is None or not _splitwise_args(request).get("remote_prefill"):
            return 0
        return max(0, self._loadable(request, num_computed_tokens, st.offer))

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        rid, key = request.request_id, wire_id(request)
        with self.lock:
            st = self.offers.pop(key, None)
            if st is not None:
                self.expected.pop(key, None)
                self.settled.add(key)
        if st is None:
            return
        start, offer = request.num_computed_tokens, st.offer
        res = _Reservation(st.identity, offer.offer_nonce, _nonce(), list(block_ids), start, num_external_tokens,
                           time.monotonic(), rid, offer.seq)
        with self.lock:
            self.accepted[key] = res
        self.pending_loads[key] = (list(block_ids), start, num_external_tokens)
        if offer.first_token >= 0:
            self.first_tokens[rid] = offer.first_token
        self._reply(st.identity, Accept(PROTOCOL_VERSION, key, 0, res.offer_nonce, res.nonce, list(block_ids),
                                        start, num_external_tokens))

    def load_async(self, request) -> bool:
        return wire_id(request) in self.accepted

    def take_failed(self) -> dict[str, str]:
        now = time.monotonic()
        self.step_began = now                       # the engine took in its queued requests just before
        for res in list(self.accepted.values()):
            if now - res.since > self.timeout:
                self.failed[res.engine_id] = (f"splitwise: the KV transfer from the prefill instance did not "
                                              f"complete within {self.timeout:g} s")
                self.counters["splitwise_transfers_failed"] += 1
        with self.lock:
            for key, (since, rid) in list(self.expected.items()):
                if now - since > self.timeout and key not in self.offers and key not in self.accepted:
                    del self.expected[key]              # (an aborted request's entry goes too)
                    self.failed[rid] = (f"splitwise: no KV offer from a prefill instance within "
                                        f"{self.timeout:g} s")
            self._forget_old_refusals(now)              # their requests never came
            out, self.failed = self.failed, {}
        return out

    # -- scheduler side: both ---------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int]) -> bool:
        rid, key = request.request_id, wire_id(request)
        with self.lock:
            self.expected.pop(key, None)
            self.settled.discard(key)
            st = self.offers.pop(key, None)
            res = self.accepted.pop(key, None)
        if st is not None:
            self._refuse(st.identity, key, st.offer.offer_nonce, "the decode request ended")
        if res is not None:
            self.pending_loads.pop(key, None)
            self.pending_cancels.append(key)
            self._refuse(res.identity, key, res.offer_nonce, "the decode request ended")
        first_p = self.first_tokens.pop(rid, None)
        if first_p is not None and request.output_token_ids:
            agree = request.output_token_ids[0] == first_p
            self.counters["splitwise_first_token_agree" if agree else "splitwise_first_token_differ"] += 1
        peer = _splitwise_args(request).get("remote_decode")
        if not peer or request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return False
        n = min(request.num_computed_tokens, request.num_prompt_tokens)
        first = request.output_token_ids[0] if request.output_token_ids else -1
        self.pending_sends.append(SendJob(rid, key, list(block_ids), n, int(first), str(peer)))
        return True

    def build_connector_meta(self) -> SplitwiseStep:
        step = SplitwiseStep(self.pending_sends, self.pending_loads, self.pending_cancels)
        self.pending_sends, self.pending_loads, self.pending_cancels = [], {}, []
        return step

    # -- runner side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list, layout) -> None:
        self.kv_caches, self.spec = kv_caches, layout
        dtype = str(kv_caches[0][0].dtype).replace("paddle.", "") if kv_caches else layout.dtype
        self.dtype = np.dtype({"float32": "float32", "float16": "float16"}.get(dtype, "float32"))
        self.fingerprint = {"model": self.model_name, "num_layers": layout.num_layers,
                            "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim, "dtype": dtype}
        if self.role == "decode" and self.sock is None:
            self.sock = self._listen(self.frame_limit())
            t = threading.Thread(target=self._serve, name="splitwise-decode", daemon=True)
            t.start()
            self.threads.append(t)

    def _rows(self, block_ids: list[int], start: int, n: int) -> np.ndarray:
        bs = self.spec.block_size
        pos = np.arange(start, start + n)
        slot = np.asarray(block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs
        return self.spec.kv_rows(slot).reshape(-1)       # [num_kv_heads, n], whatever the layout

    def _read(self, job: SendJob) -> list[np.ndarray]:
        import paddle
        idx = paddle.to_tensor(self._rows(job.block_ids, 0, job.num_tokens))
        shape = [2, self.spec.num_kv_heads, job.num_tokens, self.spec.head_dim]
        view = self.spec.row_view
        return [np.ascontiguousarray(paddle.stack([paddle.gather(view(k), idx), paddle.gather(view(v), idx)])
                                     .numpy().reshape(shape)) for k, v in self.kv_caches]

    def _write(self, block_ids: list[int], start: int, n: int, frames: list[bytes]) -> None:
        import paddle
        idx = paddle.to_tensor(self._rows(block_ids, start, n))
        rows = self.spec.num_kv_heads * n
        for (k, v), frame in zip(self.kv_caches, frames):
            arr = np.frombuffer(frame, dtype=self.dtype).reshape(2, rows, self.spec.head_dim)
            self.spec.row_view(k).scatter_(idx, paddle.to_tensor(arr[0]), overwrite=True)
            self.spec.row_view(v).scatter_(idx, paddle.to_tensor(arr[1]), overwrite=True)

    def _frame_bytes(self, num_tokens: int) -> int:
        return 2 * self.spec.num_kv_heads * num_tokens * self.spec.head_dim * self.dtype.itemsize

    def start_load_kv(self, metadata: SplitwiseStep | None) -> None:
        if metadata is None or self.kv_caches is None:
            return
        for job in metadata.sends:
            data = self._read(job)
            t = threading.Thread(target=self._send_transfer, args=(job, data), name="splitwise-send", daemon=True)
            t.start()
            self.threads = [x for x in self.threads if x.is_alive()] + [t]
        self.loading.update(metadata.loads)
        for rid in metadata.cancels:
            self.loading.pop(rid, None)
        with self.lock:
            arrived, self.arrived = self.arrived, {}
        for key, frames in arrived.items():
            spec = self.loading.pop(key, None)
            with self.lock:
                res = self.accepted.pop(key, None)
            if spec is None or res is None:
                continue                                  # the request ended meanwhile
            block_ids, start, n = spec
            self._write(block_ids, start, n, frames)
            self.done_recving.add(res.engine_id)
            nbytes = sum(len(f) for f in frames)
            c = self.counters
            c["splitwise_blocks_received"] += -(-(start + n) // self.block_size) - start // self.block_size
            c["splitwise_bytes_received"] += nbytes
            c["splitwise_transfers_received"] += 1
            self._record_time(time.monotonic() - res.since)
            self._reply(res.identity, Confirm(PROTOCOL_VERSION, key, res.last_seq, res.offer_nonce, res.nonce))

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self.lock:
            sending, self.done_sending = self.done_sending, set()
        recving, self.done_recving = self.done_recving, set()
        return sending, recving

    def _record_time(self, seconds: float) -> None:
        with self.lock:
            self.counters["splitwise_transfer_seconds_sum"] += seconds
            self.transfer_times.append(seconds)

    def stats(self) -> dict[str, float]:
        with self.lock:
            out = {k: float(v) for k, v in self.counters.items()}
            times = list(self.transfer_times)
        out["splitwise_transfer_seconds_count"] = float(len(times))
        for le in TIME_BUCKETS:
            out[f"splitwise_transfer_seconds_le_{le:g}"] = float(sum(t <= le for t in times))
        return out

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=2)
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.zctx.term() if not self.zctx.closed else None
        self.kv_caches = None

    # -- prefill side: one transfer, on its own thread -----------------------------------------
    def _dealer(self, peer: str):
        sock = self.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES)       # replies carry no payload
        if self.curve_server_key:
            public, secret = zmq.curve_keypair()
            sock.curve_serverkey = self.curve_server_key.encode()
            sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.connect(peer)
        return sock

    def _send_transfer(self, job: SendJob, data: list[np.ndarray]) -> None:
        t0 = time.monotonic()
        ok, why, accept = False, "", None
        if self.insecure and not peer_is_loopback(job.peer):
            with self.lock:
                self.counters["splitwise_transfers_failed"] += 1
                self.done_sending.add(job.request_id)
            log.warning("splitwise: refused to send %s to %s: insecure: true sends to loopback peers only",
                        job.request_id, job.peer)
            return
        sock = self._dealer(job.peer)
        try:
            offer = Offer(PROTOCOL_VERSION, job.wire_id, 0, _nonce(), time.time(), job.num_tokens,
                          job.first_token, self.fingerprint or {})
            sock.send_multipart(seal(self.secret, offer))
            reply = self._await(sock, offer, 0)
            if isinstance(reply, Accept):
                accept = reply
                ok, why = self._send_blocks(sock, offer, reply, data)
                if isinstance(why, Refuse):               # the decode side ended it: no Abort needed
                    why, accept = why.reason, None
            else:
                why = reply.reason if isinstance(reply, Refuse) else str(reply)
        except Exception as e:                    # never let a transfer take the engine down
            why = f"{type(e).__name__}: {e}"
        finally:
            if not ok and accept is not None and accept.nonce:
                self._abort(sock, accept, why)
            sock.close(linger=0)
            with self.lock:
                if ok:
                    self.counters["splitwise_transfer_seconds_sum"] += time.monotonic() - t0
                    self.transfer_times.append(time.monotonic() - t0)
                else:
                    self.counters["splitwise_transfers_failed"] += 1
                self.done_sending.add(job.request_id)     # the blocks go back either way
        if not ok:
            log.warning("splitwise: transfer of %s to %s failed: %s", job.request_id, job.peer, why)

    def _send_blocks(self, sock, offer: Offer, accept: Accept,
                     data: list[np.ndarray]) -> tuple[bool, str | Refuse]:
        """Send the KV the Accept asks for; (done, why not: a reason, or the decode side's Refuse)."""
        if accept.num_tokens == 0:
            return True, ""
        lo, hi = accept.start, accept.start + accept.num_tokens
        if lo < 0 or hi > offer.num_tokens:
            return False, f"the decode side asked for tokens {lo}..{hi}"
        if self.delay:
            self.stop.wait(self.delay)
        frames = [np.ascontiguousarray(d[:, :, lo:hi]) for d in data]
        header = Blocks(PROTOCOL_VERSION, offer.request_id, 1, accept.nonce, accept.block_ids, lo,
                        accept.num_tokens, frames[0].nbytes if frames else 0)
        sock.send_multipart(seal(self.secret, header, frames), copy=False)
        confirm = self._await(sock, offer, 1, accept.nonce)
        if not isinstance(confirm, Confirm):
            return False, confirm
        with self.lock:
            c = self.counters
            c["splitwise_blocks_sent"] += -(-hi // self.block_size) - lo // self.block_size
            c["splitwise_bytes_sent"] += sum(f.nbytes for f in frames)
            c["splitwise_transfers_sent"] += 1
        return True, ""

    def _abort(self, sock, accept: Accept, why: str) -> None:
        """Tell the decode side its reservation will not be filled (it ends the request now)."""
        try:
            sock.send_multipart(seal(self.secret, Abort(PROTOCOL_VERSION, accept.request_id, 2, accept.nonce,
                                                        why[:500])), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _await(self, sock, offer: Offer, seq: int, nonce: str = ""):
        """The decode side's reply to message ``seq`` of this transfer: a
        sealed Accept, Confirm or Refuse bound to ``offer`` (and ``nonce``),
        else a string saying why not."""
        deadline = time.monotonic() + self.timeout
        decoder = msgspec.msgpack.Decoder(ToPrefill)
        while not self.stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return f"no answer from the decode instance within {self.timeout:g} s"
            if not sock.poll(min(100, int(left * 1000) + 1)):
                continue
            frames = sock.recv_multipart()
            if len(frames) == 1:
                return read_refusal(frames[0])
            try:
                msg, _ = unseal(self.secret, frames, decoder)
            except WireError as e:
                return f"a reply that does not authenticate: {e}"
            step_ok = msg.seq == seq or isinstance(msg, Refuse)
            if msg.request_id != offer.request_id or msg.offer_nonce != offer.offer_nonce or not step_ok:
                return f"a reply for another transfer or step ({msg.request_id!r}, seq {msg.seq})"
            if isinstance(msg, Confirm) and msg.nonce != nonce:
                return "a confirmation for another reservation"
            return msg
        return "the engine is stopping"

    # -- decode side: the socket thread ------------------------------------------------------
    def _reply(self, identity: bytes, msg) -> None:
        self.outgoing.put((identity, seal(self.secret, msg)))

    def _refuse(self, identity: bytes, rid: str, offer_nonce: str, why: str) -> None:
        self._reply(identity, Refuse(PROTOCOL_VERSION, rid, why, 0, offer_nonce))

    def _reject(self, identity: bytes | None, rid: str, why: str) -> None:
        """Refuse a message that failed a check; the request it names is left as it was."""
        with self.lock:
            self.counters["splitwise_messages_rejected"] += 1
            first = identity not in self.logged_peers
            if first:
                if len(self.logged_peers) >= MAX_LOGGED_PEERS:
                    self.logged_peers.clear()
                self.logged_peers.add(identity)
        (log.warning if first else log.debug)(
            "splitwise: rejected a message%s: %s%s", f" for {rid!r}" if rid else "", why,
            " (further rejections from this connection are logged at debug level)" if first else "")
        if identity is not None:
            self.outgoing.put((identity, unsigned(Refuse(PROTOCOL_VERSION, rid, why))))

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(ToDecode)
        sock = self.sock
        while not self.stop.is_set():
            try:
                while True:
                    identity, frames = self.outgoing.get_nowait()
                    sock.send_multipart([identity, *frames])
            except queue.Empty:
                pass
            except zmq.ZMQError as e:
                log.warning("splitwise: cannot reply: %s", e)
            self._sweep_unknown()
            try:
                if not sock.poll(POLL_MS):
                    continue
                parts = sock.recv_multipart(copy=True)
            except zmq.ZMQError:
                if self.stop.is_set():
                    return
                continue
            identity = parts[0] if parts else None
            try:
                msg, payload = unseal(self.secret, parts[1:], decoder)
                self._handle(identity, msg, payload)
            except WireError as e:
                self._reject(identity, e.request_id, str(e))
            except Exception as e:                 # a bad message must never stop the thread
                self._reject(identity, "", f"{type(e).__name__}: {e}")

    def _handle(self, identity: bytes, msg, payload: list[bytes]) -> None:
        """An authenticated message: raises WireError if it does not fit the transfer it names."""
        if isinstance(msg, Offer):
            return self._take_offer(identity, msg, payload)
        with self.lock:
            res = self.accepted.get(msg.request_id)
        self._check_owner(identity, msg, res)
        if isinstance(msg, Abort):
            with self.lock:
                res.last_seq = msg.seq
                self.failed[res.engine_id] = f"splitwise: the prefill instance aborted the transfer: {msg.reason}"
            return
        rid = msg.request_id
        if msg.block_ids != res.block_ids or msg.start != res.start or msg.num_tokens != res.num_tokens:
            raise WireError("block ids or token counts differ from the reservation", rid)
        want = self._frame_bytes(res.num_tokens)
        if msg.frame_bytes != want or len(payload) != self.spec.num_layers or any(len(f) != want for f in payload):
            raise WireError(f"payload must be {self.spec.num_layers} frames of {want} bytes", rid)
        with self.lock:
            res.last_seq = msg.seq
            self.arrived[rid] = payload

    def _check_owner(self, identity: bytes, msg: Blocks | Abort, res: _Reservation | None) -> None:
        rid = msg.request_id
        if res is None:
            raise WireError("no reservation for this request id (or it was used)", rid)
        if identity != res.identity:
            raise WireError("not from the connection that made the offer", rid)
        if msg.nonce != res.nonce:
            raise WireError("not this reservation's nonce (a replay?)", rid)
        if msg.seq <= res.last_seq:
            raise WireError(f"sequence number {msg.seq} after {res.last_seq} (a replay?)", rid)

    def _take_offer(self, identity: bytes, msg: Offer, payload: list[bytes]) -> None:
        rid, now = msg.request_id, time.time()
        if payload:
            raise WireError("an offer carries no payload", rid)
        if msg.seq != 0:
            raise WireError(f"an offer with sequence number {msg.seq}", rid)
        if abs(now - msg.sent_at) > self.offer_max_age:
            raise WireError(f"an offer sent {now - msg.sent_at:.0f} s ago (offer_max_age_s "
                            f"{self.offer_max_age:g}; a replay, or the clocks differ)", rid)
        with self.lock:
            self.seen_offers = {n: t for n, t in self.seen_offers.items() if now - t <= 2 * self.offer_max_age}
            if msg.offer_nonce in self.seen_offers:
                raise WireError("an offer seen before (a replay)", rid)
            self.seen_offers[msg.offer_nonce] = now
        if self.fingerprint is not None and msg.fingerprint != self.fingerprint:
            diff = sorted(k for k in set(msg.fingerprint) | set(self.fingerprint)
                          if msg.fingerprint.get(k) != self.fingerprint.get(k))
            return self._refuse_offer(identity, msg, f"another model or KV layout (differs in: {', '.join(diff)})")
        if msg.num_tokens <= 0:
            return self._refuse_offer(identity, msg, f"offer of {msg.num_tokens} tokens")
        with self.lock:
            busy = rid in self.offers or rid in self.accepted
            if not busy:
                self.offers[rid] = _OfferState(identity, msg, time.monotonic())
        if busy:
            raise WireError("a transfer for this request is already under way", rid)

    def _refuse_offer(self, identity: bytes, msg: Offer, why: str) -> None:
        """An authenticated offer the waiting request cannot use: it ends (the router retries elsewhere)."""
        with self.lock:
            self.counters["splitwise_messages_rejected"] += 1
            waiting = self.expected.get(msg.request_id)
            if waiting is not None and msg.request_id not in self.accepted:
                self.failed[waiting[1]] = f"splitwise: refused: {why}"
            elif waiting is None:
                self._remember_refusal(msg.request_id, f"splitwise: refused: {why}")
        log.warning("splitwise: refused the offer for %r: %s", msg.request_id, why)
        self._refuse(identity, msg.request_id, msg.offer_nonce, why)

    def _sweep_unknown(self) -> None:
        """Refuse offers for request ids this instance never saw. The router
        opens the decode request first, but it may not have reached the
        engine yet: an offer is unknown only once the engine began a step
        (having taken in every request queued for it) ``unknown_grace_s``
        after the offer came, so a step that runs long (a cold first
        forward, a busy machine) does not count against it; and in any case
        after ``transfer_timeout_s``."""
        now = time.monotonic()
        with self.lock:     # dropped and remembered at once: a request_added between them would wait 30 s
            stale = [(rid, st) for rid, st in self.offers.items() if rid not in self.expected and (
                self.step_began - st.arrived > self.unknown_grace or now - st.arrived > self.timeout)]
            for rid, _ in stale:
                del self.offers[rid]
                self.counters["splitwise_messages_rejected"] += 1
                self._remember_refusal(rid, "splitwise: the KV offer came before this request reached the decode "
                                            "instance and was refused as unknown (its KV will not come)")
        for rid, st in stale:
            self._refuse(st.identity, rid, st.offer.offer_nonce, "unknown request id")

    def _remember_refusal(self, key: str, why: str) -> None:
        """(Under the lock.) An offer refused before its request was queued
        here: kept for ``transfer_timeout_s`` (at most 4096 of them), so the
        request, when it comes, ends with the reason at once."""
        now = time.monotonic()
        if len(self.refused_early) >= 4096:
            self._forget_old_refusals(now)
            while len(self.refused_early) >= 4096:          # the oldest first
                self.refused_early.pop(next(iter(self.refused_early)))
        self.refused_early[key] = (now, why)

    def _forget_old_refusals(self, now: float) -> None:
        """(Under the lock.) Drop remembered refusals older than ``transfer_timeout_s``."""
        if self.refused_early:
            self.refused_early = {k: v for k, v in self.refused_early.items() if now - v[0] <= self.timeout}


TIME_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


@hookimpl
def fdx_register_connectors(register):
    register("splitwise", SplitwiseConnector)
