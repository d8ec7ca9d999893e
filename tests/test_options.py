"""nsqd's flags and config file: classic names and values, clear errors."""

import subprocess
import sys

import pytest

from nsqd.options import from_args, parse_duration_ms


def test_durations_take_go_forms_and_plain_ms():
    assert parse_duration_ms("1h30m") == 90 * 60_000
    assert parse_duration_ms("250ms") == 250
    assert parse_duration_ms("1500") == 1500
    for bad in ("", "1x", "ms", "1h 30m"):
        with pytest.raises(ValueError):
            parse_duration_ms(bad)


@pytest.mark.parametrize("argv,level", [([], 0), (["--tls-required"], 1),
                                        (["--tls-required=true"], 1),
                                        (["--tls-required=false"], 0),
                                        (["--tls-required", "tcp-https"], 2)])
def test_tls_required_takes_classic_values(argv, level):
    assert from_args(argv).tls_required == level


def test_classic_config_file_keys(tmp_path):
    config = tmp_path / "nsqd.toml"
    # (nsqlookupd_tcp_addresses is understood too: tests/test_cli.py)
    config.write_text('auth_http_addresses = ["127.0.0.1:4181", "10.0.0.2:4181"]\n'
                      'msg_timeout = "90s"\n'
                      'tls_required = "tcp-https"\n'
                      'mem-queue-size = 0\n')
    o = from_args(["--config", str(config), "--msg-timeout", "30s"])
    assert o.auth_http_address == ["127.0.0.1:4181", "10.0.0.2:4181"]
    assert o.msg_timeout_ms == 30_000, "the command line wins over the file"
    assert (o.tls_required, o.mem_queue_size) == (2, 0)


def test_bad_config_is_a_clear_error_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("msg_timeout = \n")
    for argv, text in ((["--config", str(tmp_path / "missing.toml")], "cannot read --config"),
                       (["--config", str(bad)], "is not valid TOML"),
                       (["--tls-min-version", "tls9"], "invalid choice")):
        r = subprocess.run([sys.executable, "-m", "nsqd.main", *argv], capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 2, r
        assert text in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_help_explains_the_flags_we_treat_differently():
    r = subprocess.run([sys.executable, "-m", "nsqd.main", "--help"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "accepted for compatibility and ignored" in text  # --mem-queue-size
    assert "syncs every batch before its OK" in text  # --sync-every


@pytest.mark.parametrize("argv, on", [([], True), (["--journal", "false"], False),
                                      (["--journal=1"], True), (["--journal"], True)])
def test_bool_flags_take_true_and_false(argv, on):
    """Every bool option is parsed as one (`--journal false` once came through as the
    string "false", which is true, and the journal stayed on)."""
    import dataclasses

    from nsqd.options import _BOOLS, Options

    assert {f.name for f in dataclasses.fields(Options) if f.type in ("bool", bool)} <= _BOOLS
    assert from_args(argv).journal is on



def test_journal_checkpoint_bytes_is_bounded():
    assert from_args([]).journal_checkpoint_bytes == 64 * 1024 * 1024
    assert from_args(["--journal-checkpoint-bytes", "65536"]).journal_checkpoint_bytes == 65536
    for bad in ("1000", "0", str(2 << 40)):
        with pytest.raises(ValueError, match="--journal-checkpoint-bytes"):
            from_args(["--journal-checkpoint-bytes", bad])
