"""nsqd/identify.py against the nsqd v1.3.0 reference, by example and by property."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nsqd.identify import ClientSettings, IdentifyLimits, initial_settings, negotiate
from nsqwire.errors import ProtocolError

REFERENCE = json.loads((Path(__file__).parent / "data" / "nsqd-v1.3.0.json").read_text())
TCP_CASES = {case["case"]: case for case in REFERENCE["tcp"]}
LIMITS = IdentifyLimits()
REPLY_KEYS = ["max_rdy_count", "version", "max_msg_timeout", "msg_timeout", "tls_v1", "deflate", "deflate_level",
              "max_deflate_level", "snappy", "sample_rate", "auth_required", "output_buffer_size",
              "output_buffer_timeout"]


def identify_body(sent: str) -> bytes:
    """The JSON body of a reference `IDENTIFY\\n[4-byte size][body]`."""
    data = sent.encode("latin-1")
    assert data.startswith(b"IDENTIFY\n")
    assert int.from_bytes(data[9:13], "big") == len(data) - 13
    return data[13:]


@pytest.mark.parametrize("name", ["identify_feature_negotiation", "identify_plain", "identify_bad_json",
                                  "identify_heartbeat_out_of_range", "identify_twice"])
def test_reference(name):
    settings = None
    for exchange in TCP_CASES[name]["exchanges"]:
        expected = exchange["frames"][0]
        try:
            settings, reply = negotiate(identify_body(exchange["sent"]), LIMITS, settings)
        except ProtocolError as exc:
            assert (expected["frame"], exc.text, exc.fatal) == ("error", expected["data"], True)
            assert exchange["connection_closed_after"]
        else:
            assert (expected["frame"], reply.decode()) == ("response", expected["data"])
            assert not exchange["connection_closed_after"]


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def reply_of(**fields) -> dict:
    _, reply = negotiate(body(feature_negotiation=True, **fields), LIMITS)
    assert list(json.loads(reply)) == REPLY_KEYS
    return json.loads(reply)


@pytest.mark.parametrize(("fields", "reason"), [
    ({"heartbeat_interval": 999}, "heartbeat interval (999) is invalid"),
    ({"heartbeat_interval": 60001}, "heartbeat interval (60001) is invalid"),
    ({"heartbeat_interval": -2}, "heartbeat interval (-2) is invalid"),
    ({"output_buffer_timeout": 24}, "output buffer timeout (24) is invalid"),
    ({"output_buffer_timeout": 30001}, "output buffer timeout (30001) is invalid"),
    ({"output_buffer_size": 63}, "output buffer size (63) is invalid"),
    ({"output_buffer_size": 65537}, "output buffer size (65537) is invalid"),
    ({"sample_rate": 100}, "sample rate (100) is invalid"),
    ({"sample_rate": -1}, "sample rate (-1) is invalid"),
    ({"msg_timeout": 999}, "msg timeout (999) is invalid"),
    ({"msg_timeout": 900001}, "msg timeout (900001) is invalid"),
    # nsqd checks in this order: heartbeat, buffer timeout, buffer size, sample rate, msg timeout.
    ({"msg_timeout": 1, "output_buffer_size": 1, "output_buffer_timeout": 1}, "output buffer timeout (1) is invalid"),
])
def test_out_of_range_settings(fields, reason):
    with pytest.raises(ProtocolError) as info:
        negotiate(body(**fields), LIMITS)
    assert (info.value.text, info.value.fatal) == (f"E_BAD_BODY IDENTIFY {reason}", True)


@pytest.mark.parametrize("raw", [
    b'{"heartbeat_interval": "1000"}', b'{"heartbeat_interval": 1000.0}', b'{"heartbeat_interval": 1e3}',
    b'{"heartbeat_interval": true}', b'{"tls_v1": 1}', b'{"client_id": 5}', b'{"sample_rate": 2147483648}',
    b'{"msg_timeout": 9223372036854775808}', b"[]", b'"x"', b"5", b"NaN", b'{"a": Infinity}', b"{} x",
    b"\xef\xbb\xbf{}", b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
])
def test_what_go_refuses_to_decode(raw):
    with pytest.raises(ProtocolError) as info:
        negotiate(raw, LIMITS)
    assert (info.value.text, info.value.fatal) == ("E_BAD_BODY IDENTIFY failed to decode JSON body", True)


def test_what_go_decodes_leniently():
    settings, reply = negotiate(b'{"Client_ID": "a\xff", "HEARTBEAT_INTERVAL": 5000, "msg_timeout": null, "x": [1]}',
                                LIMITS)
    assert reply == b"OK"
    assert (settings.client_id, settings.heartbeat_interval_ms, settings.msg_timeout_ms) == ("a\ufffd", 5000, 60000)
    assert negotiate(b"null", LIMITS) == (initial_settings(LIMITS), b"OK")


def test_special_values():
    settings, _ = negotiate(body(heartbeat_interval=-1, output_buffer_timeout=-1), LIMITS)
    assert (settings.heartbeat_interval_ms, settings.output_buffer_timeout_ms) == (-1, 0)
    assert reply_of(output_buffer_size=-1, output_buffer_timeout=100)["output_buffer_size"] == 1
    assert reply_of(output_buffer_size=-1, output_buffer_timeout=100)["output_buffer_timeout"] == 0
    limits = reply_of(heartbeat_interval=60000, output_buffer_size=65536, output_buffer_timeout=30000,
                      sample_rate=99, msg_timeout=900000)
    assert (limits["output_buffer_size"], limits["output_buffer_timeout"], limits["sample_rate"],
            limits["msg_timeout"]) == (65536, 30000, 99, 900000)


def test_a_second_identify_starts_from_the_first():
    first, _ = negotiate(body(client_id="a", hostname="h", heartbeat_interval=2000, msg_timeout=5000,
                              sample_rate=10, output_buffer_size=100, extend_support=True), LIMITS)
    second, _ = negotiate(body(user_agent="u"), LIMITS, first)
    assert (second.client_id, second.hostname, second.user_agent) == ("", "", "u")
    assert (second.heartbeat_interval_ms, second.msg_timeout_ms, second.output_buffer_size) == (2000, 5000, 100)
    assert second.sample_rate == 0  # nsqd stores the sample rate unconditionally
    assert second.extend_support


def test_upgrades_need_negotiation_and_server_support():
    wanted = {"tls_v1": True, "deflate": True, "deflate_level": 3}
    plain, reply = negotiate(body(**wanted), IdentifyLimits(tls_available=True, deflate_available=True))
    assert reply == b"OK" and not (plain.tls_v1 or plain.deflate)
    assert reply_of(**wanted)["tls_v1"] is False
    settings, reply = negotiate(body(feature_negotiation=True, **wanted),
                                IdentifyLimits(tls_available=True, deflate_available=True, auth_required=True))
    assert (settings.tls_v1, settings.deflate, settings.deflate_level, settings.snappy) == (True, True, 3, False)
    assert json.loads(reply)["auth_required"] is True
    settings, _ = negotiate(body(feature_negotiation=True, deflate=True, deflate_level=9),
                            IdentifyLimits(deflate_available=True))
    assert settings.deflate_level == 6  # clamped to max_deflate_level
    assert reply_of(deflate=True, deflate_level=3)["deflate_level"] == 6  # deflate unavailable: level unused


def test_snappy_and_deflate_together_are_refused():
    both = IdentifyLimits(snappy_available=True, deflate_available=True)
    with pytest.raises(ProtocolError) as info:
        negotiate(body(feature_negotiation=True, snappy=True, deflate=True), both)
    assert (info.value.text, info.value.fatal) == (
        "E_IDENTIFY_FAILED cannot enable both deflate and snappy compression", True)
    settings, _ = negotiate(body(feature_negotiation=True, snappy=True), both)
    assert settings.snappy and not settings.deflate


json_values = st.none() | st.booleans() | st.integers(-2000, 1_000_000) | st.text(max_size=4) | st.floats()
identify_fields = st.dictionaries(
    st.sampled_from(["client_id", "hostname", "user_agent", "heartbeat_interval", "output_buffer_size",
                     "output_buffer_timeout", "feature_negotiation", "tls_v1", "snappy", "deflate",
                     "deflate_level", "sample_rate", "msg_timeout", "extend_support", "other"]),
    json_values, max_size=8)
generous = IdentifyLimits(tls_available=True, snappy_available=True, deflate_available=True)


def check_settings(settings: ClientSettings, limits: IdentifyLimits) -> None:
    assert settings.heartbeat_interval_ms == -1 or 1000 <= settings.heartbeat_interval_ms <= 60000
    assert settings.output_buffer_size == 1 or 64 <= settings.output_buffer_size <= limits.max_output_buffer_size
    assert settings.output_buffer_timeout_ms == 0 or 25 <= settings.output_buffer_timeout_ms <= 30000
    assert 1000 <= settings.msg_timeout_ms <= limits.max_msg_timeout_ms
    assert 0 <= settings.sample_rate <= 99 and 1 <= settings.deflate_level <= limits.max_deflate_level
    assert not (settings.snappy and settings.deflate)


@given(identify_fields, st.sampled_from([LIMITS, generous]))
def test_any_identify_gives_sane_settings_or_a_fatal_error(fields, limits):
    try:
        settings, reply = negotiate(json.dumps(fields).encode(), limits)
    except ProtocolError as exc:
        assert exc.fatal and exc.code in ("E_BAD_BODY", "E_IDENTIFY_FAILED")
        return
    check_settings(settings, limits)
    if settings.feature_negotiation:
        answer = json.loads(reply)
        assert list(answer) == REPLY_KEYS
        assert (answer["msg_timeout"], answer["output_buffer_size"]) == (settings.msg_timeout_ms,
                                                                          settings.output_buffer_size)
    else:
        assert reply == b"OK"


@given(st.binary(max_size=64))
def test_any_bytes_give_only_protocol_errors(raw):
    try:
        check_settings(negotiate(raw, generous)[0], generous)
    except ProtocolError as exc:
        assert exc.fatal
