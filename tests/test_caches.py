"""What a box's caches did, read from Nix's log in the words of each version.

tests/test_fleet.py meets every case with real Nix 2.8 (a daemon that drops
a cache, a key nobody trusts, a server that is gone). Nix 2.26 words two of
them differently; the records here are its words, as its source writes them
(src/libstore/daemon.cc, src/libstore/build/substitution-goal.cc), fed
through the same reader, so both versions are held to the same notes."""

from __future__ import annotations

import json

import pytest

from prepare import config
from prepare.fail import Fail
from prepare.nix import caches
from prepare.nix.log import Log
from prepare.plan import plan
from prepare.spec import NixSpec, PrepareSpec

CACHE = "http://127.0.0.1:8080"
PATH = "/nix/store/cjfq262knklm8pq3cr2grdr80862a027-fdl-test-training-cpu"
KEY = "fleet-1:nTCg+w7fzWq/2GnSQsukdCOyvv3lZ8Sr6Hu7I5UqB7E="
# A secret key's shape (64 bytes): never to be echoed back.
SECRET = "fleet-1:" + "9rM5LzWSI6fJf" + "A" * 73 + "=="


def record(**fields: object) -> str:
    return "@nix " + json.dumps(fields)


def log_of(*lines: str) -> Log:
    log = Log()
    for line in lines:
        log.feed(line)
    return log


def daemon_says(text: str) -> str:
    # A daemon's message reaches its client at error level, "warning:" first.
    return record(action="msg", level=0, msg=f"\u001b[35;1mwarning:\u001b[0m {text}")


@pytest.mark.parametrize(
    "said",
    [
        f"ignoring untrusted substituter '{CACHE}'",  # 2.8
        f"ignoring untrusted substituter '{CACHE}', you are not a trusted user.\n"
        "Run `man nix.conf` for more information on the `substituters` configuration option.",  # 2.26
        # 2.34 double-quotes paths in other messages: either quote, or none
        f'ignoring untrusted substituter "{CACHE}", you are not a trusted user.',
        f"ignoring untrusted substituter {CACHE}, you are not a trusted user.",
    ],
)
def test_a_cache_the_daemon_drops_is_permanent_on_every_version(said):
    log = log_of(daemon_says(said))
    fail = caches.untrusted(log, (CACHE,))
    assert isinstance(fail, Fail) and fail.permanent
    assert f"ignores the binary cache {CACHE}" in fail.message
    assert "trusted-substituters" in fail.message and "trusted-users" in fail.message
    # A daemon's warning is not the call's error.
    assert log.errors == []


def test_a_cache_the_box_did_not_configure_is_not_the_boxs_problem():
    log = log_of(daemon_says("ignoring untrusted substituter 'https://someone-elses.cachix.org'"))
    assert caches.untrusted(log, (CACHE,)) is None


def test_the_cache_is_matched_without_its_query_or_trailing_slash():
    url = "ssh-ng://cache?remote-store=/srv/store"
    log = log_of(daemon_says(f"ignoring untrusted substituter '{url}'"))
    assert caches.untrusted(log, (url,)) is not None
    assert caches.uri(url) == "ssh-ng://cache" and caches.uri(CACHE + "/") == CACHE


@pytest.mark.parametrize(
    "said",
    [
        f"the substitute for '{PATH}' from '{CACHE}' is not signed by any of the keys in 'trusted-public-keys'",
        f"ignoring substitute for '{PATH}' from '{CACHE}', as it's not signed by any of the keys in "
        "'trusted-public-keys'",  # 2.26 and 2.34
        f'ignoring substitute for "{PATH}" from "{CACHE}", as it\'s not signed by any of the keys in '
        '"trusted-public-keys"',
        f"ignoring substitute for {PATH} from {CACHE}, as it's not signed by any of the keys in trusted-public-keys",
    ],
)
def test_a_path_signed_by_no_trusted_key_is_named_as_refused_on_every_version(said):
    build = record(action="start", id=7, type=105, text="building", fields=[PATH.replace("-cpu", "-cpu.drv")])
    log = log_of(record(action="msg", level=1, msg=f"warning: {said}"), build)
    notes: list[str] = []
    caches.note(log, (CACHE,), notes)
    refused = [n for n in notes if "signed by no trusted key" in n]
    assert refused and f"binary cache {CACHE} offered fdl-test-training-cpu" in refused[0]
    assert "built here instead" in refused[0] and "--trusted-public-key" in refused[0]
    assert "built here: 1 derivation (fdl-test-training-cpu)" in notes


def test_keys_the_daemon_ignores_for_an_untrusted_user_are_said():
    log = log_of(
        daemon_says(
            "ignoring the client-specified setting 'trusted-public-keys', because it is a restricted setting and "
            "you are not a trusted user"
        )
    )
    notes: list[str] = []
    caches.note(log, (CACHE,), notes)
    assert any("ignored trusted_public_keys" in n and "trusted-users" in n for n in notes)


def test_substitutions_are_counted_per_cache_with_their_bytes():
    lines = [
        record(action="start", id=1, type=108, fields=[PATH, CACHE], text=""),
        record(action="start", id=2, type=100, fields=[PATH, CACHE, "local"], text="copying"),
        record(action="start", id=3, type=101, fields=[f"{CACHE}/nar/x.nar.xz"], text="downloading"),
        record(action="result", id=3, type=105, fields=[2048, 2048, 0, 0]),
        record(action="stop", id=3),
        record(action="start", id=4, type=108, fields=["/nix/store/a-other", "ssh-ng://cache"], text=""),
        record(action="start", id=5, type=100, fields=["/nix/store/a-other", "ssh-ng://cache", "local"], text=""),
        record(action="result", id=5, type=105, fields=[4096, 4096, 0, 0]),
    ]
    notes: list[str] = []
    caches.note(log_of(*lines), (CACHE, "ssh-ng://cache?remote-store=/x"), notes)
    assert f"binary cache {CACHE}: substituted 1 path (2.0 KiB downloaded): fdl-test-training-cpu" in notes
    assert any(n.startswith("binary cache ssh-ng://cache: substituted 1 path (4.0 KiB unpacked)") for n in notes)
    assert "built here: 0 derivations" in notes


@pytest.mark.parametrize("quote", ["'", '"', ""])
def test_an_unreachable_cache_is_a_note_with_curls_reason(quote):
    lines = [
        record(action="msg", level=0, msg=f"disabling binary cache {quote}{CACHE}{quote} for 60 seconds"),
        record(
            action="msg",
            level=1,
            msg=f"warning: unable to download {quote}{CACHE}/nix-cache-info{quote}: Couldn't connect to server (7); "
            "retrying",
        ),
    ]
    notes: list[str] = []
    log = log_of(*lines)
    caches.note(log, (CACHE,), notes)
    assert f"binary cache {CACHE} could not be reached (Couldn't connect to server (7))" in notes[-1]
    assert log.errors == []


def test_an_unreachable_cache_in_2_34s_words_is_the_same_note():
    said = (
        f"warning: unable to download '{CACHE}/nix-cache-info': Could not connect to server (7) Failed to connect "
        "to 127.0.0.1:8080 after 0 ms: Could not connect to server"
    )
    notes: list[str] = []
    caches.note(log_of(record(action="msg", level=1, msg=said)), (CACHE,), notes)
    assert f"binary cache {CACHE} could not be reached (Could not connect to server (7) Failed to connect" in notes[-1]


def test_no_cache_configured_and_none_used_adds_no_note():
    notes: list[str] = []
    caches.note(Log(), (), notes)
    assert notes == []


# -- the config ------------------------------------------------------------------------------------


def test_a_secret_key_among_the_trusted_keys_is_refused_without_being_shown(tmp_path):
    path = tmp_path / "prepare.toml"
    path.write_text(f'[join.nix]\ntrusted_public_keys = ["{SECRET}"]\n')
    with pytest.raises(Fail) as caught:
        config.load(path)
    assert caught.value.permanent
    assert "SECRET signing key" in caught.value.message and "'fleet-1'" in caught.value.message
    assert SECRET.split(":", 1)[1] not in caught.value.message


def test_a_secret_key_in_a_spec_built_in_code_is_refused_without_being_shown():
    with pytest.raises(Fail) as caught:
        plan(PrepareSpec(nix=NixSpec(trusted_public_keys=(SECRET,))))
    assert "PrepareSpec.nix.trusted_public_keys" in caught.value.message
    assert SECRET.split(":", 1)[1] not in caught.value.message


def test_the_caches_and_keys_resolve_from_file_and_flags_like_every_list():
    file = {"nix": {"substituters": ["https://a.example"], "trusted_public_keys": [KEY]}}
    spec = config.resolve(file, {"nix": {"substituters": ["https://b.example"]}}, {})
    assert spec.nix == NixSpec(substituters=("https://b.example",), trusted_public_keys=(KEY,))


def test_a_store_nix_names_by_its_scheme_alone_is_named_by_the_configured_one():
    # 2.26 reports an ssh-ng store as a bare "ssh-ng://" in its substitute
    # activity; 2.8 says "ssh-ng://cache".
    notes: list[str] = []
    lines = [record(action="start", id=4, type=108, fields=["/nix/store/a-other", "ssh-ng://"], text="")]
    caches.note(log_of(*lines), (CACHE, "ssh-ng://cache?remote-store=/x"), notes)
    assert any(n.startswith("binary cache ssh-ng://cache: substituted 1 path") for n in notes), notes


@pytest.mark.parametrize(
    ("url", "setting"),
    [
        ("http://127.0.0.1:8080?trusted=1", "trusted=1"),
        ("https://cache.example.org?priority=30&trusted=true", "trusted=true"),
        ("/srv/store?require-sigs=false", "require-sigs=false"),
        ("ssh-ng://builder?remote-store=local%3Frequire-sigs%3Dfalse", "require-sigs=false"),
    ],
)
def test_a_store_url_that_turns_signature_checks_off_is_refused_permanent_naming_the_setting(tmp_path, url, setting):
    # Nix would take a path from such a store unsigned: a box would run as
    # root whatever the store (or whoever reaches it) serves.
    path = tmp_path / "prepare.toml"
    path.write_text(f'[join.nix]\nsubstituters = ["{url}"]\n')
    with pytest.raises(Fail) as caught:
        config.load(path)
    fail = caught.value
    assert fail.permanent and fail.reason == "config.invalid"
    assert "join.nix.substituters" in fail.message and setting in fail.message
    assert "without a signature from a trusted key" in fail.message
