"""No secret goes out (prepare/host/redact.py): a credential in a URL is refused
in the box's own settings before it can reach a command line, and hidden in
everything fdl-prepare prints, whoever wrote the text; key material pasted
where a key's path belongs is never quoted back."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
from console import fdl_prepare

from prepare import config
from prepare.cli import progress
from prepare.fail import Fail
from prepare.host.redact import credentials, redact
from prepare.notes import print_notes

TOKEN = "ghp_s3cr3tT0ken"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"git+https://user:{TOKEN}@git.example/r.git?ref=main", "git+https://***@git.example/r.git?ref=main"),
        (f"https://{TOKEN}@github.com/o/r", "https://***@github.com/o/r"),
        (f"fetching 'git+http://u:{TOKEN}@h/r' failed", "fetching 'git+http://***@h/r' failed"),
        (f"sshfs://data:{TOKEN}@h/x", "sshfs://data:***@h/x"),
        ("git+ssh://git@host/r.git?ref=main", "git+ssh://git@host/r.git?ref=main"),
        ("sshfs://data@storage/srv", "sshfs://data@storage/srv"),
        ("mail root@localhost", "mail root@localhost"),
    ],
)
def test_user_info_is_hidden_over_http_and_a_password_over_anything(text, shown):
    assert redact(text) == shown


def test_what_counts_as_a_credential_in_a_url():
    assert credentials(f"git+https://user:{TOKEN}@h/r") == "a password"
    assert credentials(f"https://{TOKEN}@h/r") == "a user name or token"
    assert credentials("git+ssh://git@h/r") is None
    assert credentials("github:owner/repo/main") is None


@pytest.fixture
def box(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "home").mkdir()
    (tmp_path / "stage").mkdir()
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp_path / "stage"),
        "LD_LIBRARY_PATH": str(tmp_path / "no-nvml-here"),
        "FDL_PREPARE_CONFIG": os.devnull,
    }


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--source", f"git+https://user:{TOKEN}@git.example/train.git?ref=main"], "source.from"),
        (["--source", f"git+https://{TOKEN}@github.com/o/train.git?ref=main"], "source.from"),
        (["--flake", f"git+https://x-access-token:{TOKEN}@github.com/o/fleet?ref=main"], "flake"),
        (["--source", f"git+https://git.example/train.git?ref=main&access_token={TOKEN}"], "source.from"),
        (["--flake", f"https://git.example/fleet.tar.gz?private_token={TOKEN}"], "flake"),
    ],
    ids=["password", "token-as-user", "flake", "token-in-the-query", "flake-token-in-the-query"],
)
def test_a_url_with_a_credential_is_refused_before_any_command_and_never_quoted(box, tmp_path, flags, field):
    state = tmp_path / "state"
    argv = ["--cpu-only", "--libtorch", "cpu", "--state-dir", str(state), "--json"]
    if "--flake" not in flags:
        argv += ["--flake", "path:/srv/fdl"]
    done = fdl_prepare(box, *argv, *flags)
    assert done.returncode == 78, done.stderr
    assert TOKEN not in done.stdout + done.stderr
    out = json.loads(done.stdout)
    assert out["message"].startswith(f"{field} = '") and "(hidden here)" in out["message"]
    assert "netrc-file" in out["message"] and "access-tokens" in out["message"]
    assert not state.exists()  # no nix call, so no argv ever held it


def test_a_substituter_with_a_credential_is_refused_and_not_quoted(tmp_path):
    path = tmp_path / "prepare.toml"
    path.write_text(f'[join.nix]\nsubstituters = ["https://ci:{TOKEN}@cache.example.org"]\n')
    with pytest.raises(Fail) as caught:
        config.load(path)
    assert caught.value.permanent
    assert TOKEN not in caught.value.message and "netrc-file" in caught.value.message
    assert "https://***@cache.example.org" in caught.value.message


@pytest.mark.parametrize("param", ["access_token", "token", "X-Amz-Signature", "password"])
def test_a_substituter_with_a_token_in_its_query_is_refused_and_not_quoted(tmp_path, param):
    path = tmp_path / "prepare.toml"
    path.write_text(f'[join.nix]\nsubstituters = ["https://cache.example.org/fleet?{param}={TOKEN}&priority=30"]\n')
    with pytest.raises(Fail) as caught:
        config.load(path)
    fail = caught.value
    assert fail.permanent and fail.reason == "config.invalid"
    assert TOKEN not in fail.message and f"a token in its query ({param}=)" in fail.message
    assert f"https://cache.example.org/fleet?{param}=***&priority=30" in fail.message


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (
            f"unable to download 'https://h/x.tar.gz?access_token={TOKEN}': HTTP error 403",
            "unable to download 'https://h/x.tar.gz?access_token=***': HTTP error 403",
        ),
        (f"git+https://h/r?ref=main&private_token={TOKEN}", "git+https://h/r?ref=main&private_token=***"),
        ("file:///srv/cache?secret-key=/etc/nix/cache.secret", "file:///srv/cache?secret-key=/etc/nix/cache.secret"),
        ("git+https://h/r?ref=main&rev=abc", "git+https://h/r?ref=main&rev=abc"),
    ],
)
def test_a_token_in_a_urls_query_is_hidden_wherever_it_is_quoted(text, shown):
    assert redact(text) == shown


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (
            f"sshfs -o 'ProxyCommand=ssh -W %h:%p bastion --token {TOKEN}' -o Port=22 -- h:/d /m",
            "sshfs -o 'ProxyCommand=***' -o Port=22 -- h:/d /m",
        ),
        (f"['SetEnv=API_TOKEN={TOKEN}', 'Port=22', 'SendEnv={TOKEN}']", "['SetEnv=***', 'Port=22', 'SendEnv=***']"),
        # Every one of them on a line, not only the first.
        (
            f"sftp -o 'ProxyCommand=/bin/nc --token {TOKEN}' -o 'SetEnv=A={TOKEN}' -o Port=1",
            "sftp -o 'ProxyCommand=***' -o 'SetEnv=***' -o Port=1",
        ),
        # Unquoted, nothing marks the value's end: the rest of the line goes.
        (f"-o SetEnv=A={TOKEN} -o Port=1\nnext line", "-o SetEnv=***\nnext line"),
        (f"ssh -oSetEnv=API_TOKEN={TOKEN}", "ssh -oSetEnv=***"),
        (f"KnownHostsCommand=/usr/bin/keys --auth {TOKEN}", "KnownHostsCommand=***"),
        (f'-o "RemoteCommand=run {TOKEN}" -o Port=22', '-o "RemoteCommand=***" -o Port=22'),
        (f"-o 'localcommand=echo {TOKEN}'", "-o 'localcommand=***'"),
        (f"-o 'ssh_command=ssh -o SetEnv=T={TOKEN}'", "-o 'ssh_command=***'"),
        (f"SendEnv={TOKEN}", "SendEnv=***"),
        # ssh's own words about a keyword, and look-alike keys, stay.
        ("keyword setenv extra arguments at end of line", "keyword setenv extra arguments at end of line"),
        ("MySetEnv=1 notProxyCommand=2 Port=22", "MySetEnv=1 notProxyCommand=2 Port=22"),
    ],
)
def test_a_secret_carrying_ssh_options_value_is_hidden_wherever_it_is_quoted(text, shown):
    assert redact(text) == shown


KEY = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\n"
    "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
    "-----END OPENSSH PRIVATE KEY-----\n"
)


def test_key_material_pasted_as_the_identity_file_is_refused_and_never_echoed(tmp_path):
    path = tmp_path / "prepare.toml"
    path.write_text(f'[join.ssh]\nidentity_file = """{KEY}"""\n')
    with pytest.raises(Fail) as caught:
        config.load(path)
    message = caught.value.message
    assert caught.value.permanent and "join.ssh.identity_file" in message
    assert "looks like a private key itself" in message and "<private key material, not shown>" in message
    assert "b3BlbnNzaC1rZXktdjE" not in message and "BEGIN" not in message


def test_key_material_in_a_spec_built_in_code_is_refused_and_never_echoed():
    from prepare import PrepareSpec, SshSpec, prepare

    with pytest.raises(Fail) as caught:
        prepare(PrepareSpec(cpu_only=True, ssh=SshSpec(identity_file=KEY.replace("\n", " "))), [])
    assert "PrepareSpec.ssh.identity_file" in caught.value.message
    assert "b3BlbnNzaC1rZXktdjE" not in caught.value.message


def test_notes_and_progress_lines_hide_credentials_whoever_wrote_them():
    out = io.StringIO()
    print_notes("fdl-prepare", [f"fetched https://u:{TOKEN}@h/x"], file=out)
    render = progress.renderer(out, live=False)
    render({"type": "download-start", "id": 1, "name": f"https://{TOKEN}@cache.example.org/nar/x.nar"})
    render({"type": "step", "name": "wait", "detail": f"git+https://u:{TOKEN}@h/r"})
    assert TOKEN not in out.getvalue()
    assert "https://***@cache.example.org" in out.getvalue()


@pytest.mark.nix
def test_a_credential_nix_itself_quotes_from_a_flakes_own_input_is_hidden(nix_env, make_flake, tmp_path):
    # Text fdl-prepare did not write: the flake's own input, with a token,
    # fails to fetch, and nix quotes its URL in the error.
    flake = make_flake(
        flake_nix=(
            "{ inputs.private = { "
            f'url = "http://ci:{TOKEN}@127.0.0.1:1/private.tar.gz"; flake = false; }}; '
            "outputs = { self, private }: { }; }\n"
        )
    )
    from nix_fixtures import build

    from prepare.spec import PrepareSpec

    events = io.StringIO()
    notes: list[str] = []
    spec = PrepareSpec(libtorch="cpu", cpu_only=True, flake=flake, state_dir=str(tmp_path / "state"))
    with pytest.raises(Fail) as caught:
        build(spec, notes, progress=progress.renderer(events, live=False))
    said = caught.value.message + "\n".join(notes) + events.getvalue()
    # Nix's own error quotes the URL it could not download, token and all.
    assert "http://***@127.0.0.1:1/private.tar.gz" in caught.value.message
    assert TOKEN not in said


def test_a_secret_in_an_ssh_option_never_reaches_the_verbose_lines_the_journal_or_json(box, tmp_path):
    # `check` reaches the data host with sftp: -v shows that command line,
    # and the failure its try-it-by-hand line, each with ssh.options in it.
    if shutil.which("sftp") is None:
        pytest.skip("sftp (openssh-client) is not installed")
    done = fdl_prepare(
        box,
        "check",
        "-v",
        "--json",
        "--cpu-only",
        "--data-source",
        "sshfs://root@127.0.0.1:1/srv/data",
        "--data-path",
        str(tmp_path / "data"),
        "--ssh-option",
        f"ProxyCommand=/bin/false --token {TOKEN}",
        "--ssh-option",
        f"SetEnv=API_TOKEN={TOKEN}",
    )
    assert done.returncode in (75, 78), done.stderr
    assert TOKEN not in done.stdout + done.stderr
    assert "running: sftp" in done.stderr and "'ProxyCommand=***'" in done.stderr
    assert "ProxyCommand=***" in json.loads(done.stdout)["fail"]["message"]
