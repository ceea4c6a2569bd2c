"""Splitwise is authenticated by default (issue 35 item 1): a splitwise role
without a secret does not start; the secret comes from the settings, a key
file fdx creates (0600) or checks, or ``$FDX_SPLITWISE_SECRET``; ``insecure:
true`` only on loopback, said loudly; and the attack the empty default key
allowed (an on-path proxy re-sealing a zeroed payload under the key anyone
can compute) is refused."""
from __future__ import annotations

import logging
import os

import pytest

from fdx.core.assembly import Assembly
from fdx.core.config import ConfigError, FdxConfig
from fdx.core.plugins import get_plugin_manager
from fdx.plugins.cache.splitwise import SECRET_ENV, is_loopback, peer_is_loopback, read_secret_file


@pytest.fixture(autouse=True)
def no_env_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)


def assemble(**splitwise):
    return Assembly(FdxConfig.build(**{"plugins.connector.splitwise": splitwise, "kv_connector": "splitwise"}),
                    get_plugin_manager())


@pytest.mark.parametrize("settings,needle", [
    ({"role": "prefill"}, r"needs a shared secret: set plugins\.connector\.splitwise\.secret, secret_file .*"
                          r"\$FDX_SPLITWISE_SECRET.*insecure: true, on loopback only"),
    ({"role": "decode", "port": 9}, r"needs a shared secret"),
    ({"role": "prefill", "secret": ""}, r"secret is empty"),
    ({"role": "prefill", "secret": "a", "secret_file": "/x"}, r"secret and secret_file are both set"),
    ({"role": "prefill", "secret": "a", "insecure": True}, r"insecure: true beside a secret"),
    ({"role": "decode", "port": 9, "host": "0.0.0.0", "insecure": True}, r"insecure: true is allowed only on "
                                                                         r"loopback, and host is '0\.0\.0\.0'"),
])
def test_a_splitwise_role_without_a_secret_is_a_config_error_naming_the_key(settings, needle):
    with pytest.raises(ConfigError, match=r"config key 'plugins\.connector\.splitwise': .*" + needle):
        assemble(**settings)


def test_the_secret_from_the_environment_or_insecure_on_loopback_is_accepted(monkeypatch):
    assemble(role="decode", port=9, insecure=True)
    assemble(role="decode", port=9, host="::1", insecure=True)
    monkeypatch.setenv(SECRET_ENV, "from-the-environment")
    assemble(role="prefill")
    with pytest.raises(ConfigError, match="insecure: true beside a secret"):
        assemble(role="prefill", insecure=True)


def test_the_engine_refuses_to_start_without_a_secret(tiny_checkpoints):
    from fdx.core.engine import EngineCore
    model = str(tiny_checkpoints["LlamaForCausalLM"][0])
    with pytest.raises(ConfigError, match=r"plugins\.connector\.splitwise.*needs a shared secret"):
        EngineCore(FdxConfig.build(model=model, max_model_len=64, splitwise_role="prefill"), progress=False)


def test_loopback_checks():
    assert all(map(is_loopback, ["127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.1", "::", "example.com", ""]))
    assert peer_is_loopback("tcp://127.0.0.1:5000") and peer_is_loopback("tcp://[::1]:5000")
    assert not peer_is_loopback("tcp://10.1.2.3:5000") and not peer_is_loopback("tcp://*:5000")


def test_a_secret_file_is_created_private_and_a_shared_or_foreign_one_refused(tmp_path, caplog):
    path = tmp_path / "keys" / "splitwise.key"
    with caplog.at_level(logging.WARNING, logger="fdx.cache.splitwise"):
        secret = read_secret_file(str(path))
    assert len(secret) >= 32
    assert (path.stat().st_mode & 0o777) == 0o600
    assert str(path) in caplog.text and "copy the file" in caplog.text
    assert secret not in caplog.text                      # the path is logged, never the secret
    assert read_secret_file(str(path)) == secret          # the second start reads the same one
    path.chmod(0o640)
    with pytest.raises(ValueError, match=r"readable or writable by group or others \(mode 0640\)"):
        read_secret_file(str(path))
    path.chmod(0o600)
    os.chown(path, 65534, -1)
    with pytest.raises(ValueError, match="owned by uid 65534, not by this user"):
        read_secret_file(str(path))
    os.chown(path, os.geteuid(), -1)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(ValueError, match="not a regular file"):
        read_secret_file(str(link))
    (tmp_path / "empty.key").write_text("\n")
    (tmp_path / "empty.key").chmod(0o600)
    with pytest.raises(ValueError, match="is empty"):
        read_secret_file(str(tmp_path / "empty.key"))


# -- the attack, replayed against real engines ----------------------------------------------------

@pytest.mark.slow
def test_a_payload_resealed_under_the_empty_key_is_refused_with_a_secret_from_a_file(
        tiny_checkpoints, tmp_path, monkeypatch):
    """Before: with no secret set (the documented default) every message was
    sealed under the empty key, so an on-path proxy could zero the KV and
    re-seal it (200 with garbage). Now the pair runs on a secret from a key
    file (decode) and the environment (prefill); the same proxy's message is
    refused and counted, and the victim ends cleanly."""
    from serve_utils import free_port
    from splitwise_utils import run
    from test_splitwise_security import COMMON, PROMPT_C, Proxy, greedy, header_at, is_kind, transfer

    from fdx.core.engine import EngineCore
    from fdx.core.request import RequestStatus
    from fdx.plugins.cache.splitwise_wire import mac
    model = str(tiny_checkpoints["LlamaForCausalLM"][0])
    mixed = EngineCore(FdxConfig.build(model=model, **COMMON), progress=False)
    mixed.add_request(mixed.make_request(PROMPT_C, greedy(), request_id="C"))
    ref = run(mixed)[(id(mixed), "C")].output_token_ids
    mixed.shutdown()

    key_file = tmp_path / "splitwise.key"
    port = free_port()
    sw = {"transfer_timeout_s": 3.0}
    dec = EngineCore(FdxConfig.build(model=model, **COMMON, plugins={"connector": {"splitwise": {
        **sw, "role": "decode", "port": port, "secret_file": str(key_file)}}}, kv_connector="splitwise"),
        progress=False)
    monkeypatch.setenv(SECRET_ENV, key_file.read_text().strip())
    pre = EngineCore(FdxConfig.build(model=model, **COMMON, splitwise={**sw, "role": "prefill"}), progress=False)
    peer = f"tcp://127.0.0.1:{port}"
    try:
        assert transfer(pre, dec, peer, PROMPT_C, "ok").output_token_ids == ref

        def zero_and_reseal(direction, frames):
            if direction != "up" or not is_kind(frames, "blocks"):
                return frames
            i = header_at(frames)
            body = [frames[i], *(bytes(len(f)) for f in frames[i + 1:])]
            return [mac("", body), *body]                 # the key the old default used
        before = dec.connector.stats()["splitwise_messages_rejected"]
        proxy = Proxy(peer, zero_and_reseal)
        try:
            r = transfer(pre, dec, proxy.address, PROMPT_C, "victim")
        finally:
            proxy.close()
        assert r.status is RequestStatus.FINISHED_ABORTED and "splitwise" in r.stop_reason
        assert dec.connector.stats()["splitwise_messages_rejected"] > before
        assert dec.kv_cache.num_free_blocks == dec.kv_cache.num_blocks
    finally:
        pre.shutdown()
        dec.shutdown()


@pytest.mark.slow
def test_insecure_on_loopback_is_logged_loudly_and_sends_to_loopback_only(tiny_checkpoints, caplog):
    from serve_utils import free_port
    from test_splitwise_security import COMMON, PROMPT_C, transfer

    from fdx.core.engine import EngineCore
    model = str(tiny_checkpoints["LlamaForCausalLM"][0])
    port = free_port()
    sw = {"transfer_timeout_s": 3.0, "insecure": True}
    with caplog.at_level(logging.WARNING, logger="fdx.cache.splitwise"):
        pre = EngineCore(FdxConfig.build(model=model, **COMMON, plugins={"connector": {"splitwise": {
            **sw, "role": "prefill"}}}, kv_connector="splitwise"), progress=False)
        dec = EngineCore(FdxConfig.build(model=model, **COMMON, plugins={"connector": {"splitwise": {
            **sw, "role": "decode", "port": port}}}, kv_connector="splitwise"), progress=False)
    try:
        assert caplog.text.count("plugins.connector.splitwise.insecure is true") == 2
        assert len(transfer(pre, dec, f"tcp://127.0.0.1:{port}", PROMPT_C, "lo").output_token_ids) > 0
        caplog.clear()
        failed = pre.connector.stats()["splitwise_transfers_failed"]
        with caplog.at_level(logging.WARNING, logger="fdx.cache.splitwise"):
            r = transfer(pre, dec, "tcp://192.0.2.1:9", PROMPT_C, "away")    # TEST-NET: never reached
        assert pre.connector.stats()["splitwise_transfers_failed"] == failed + 1
        assert "sends to loopback peers only" in caplog.text
        assert "splitwise" in (r.stop_reason or "")      # the decode side never got an offer
        assert pre.kv_cache.num_free_blocks == pre.kv_cache.num_blocks
    finally:
        pre.shutdown()
        dec.shutdown()


def test_a_config_error_never_shows_the_secret():
    """Pydantic echoes a model's input in its error; a secret in it is shown as ***."""
    for settings in ({"role": "decode", "secret": "TOPSECRET"},                     # port missing
                     {"role": "prefill", "secret": "TOPSECRET", "secret_file": "/x"},
                     {"role": "prefill", "secret": "TOPSECRET", "insecure": True},
                     {"role": "prefill", "secret": "TOPSECRET", "curve_secret_key": "TOPSECRET"}):
        with pytest.raises(ConfigError) as e:
            assemble(**settings)
        assert "TOPSECRET" not in str(e.value) and "***" in str(e.value)
