"""ansible-vault decryption (inventory/vault.py) and the vault password sources (cli/vaultpass.py).

tests/fixtures/vault holds values and files ansible-vault encrypted (its README says how), so the decryption is
checked against the real format without ansible-core; the round trips encrypt with the real ansible-vault when it
is installed (ansible-core is a test dependency). `encrypt` below writes the format independently, with
cryptography's PBKDF2 and HMAC where the module uses hashlib's, for what ansible-vault never writes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from binascii import hexlify, unhexlify
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from vaulthelp import encrypt

from ernie_deploy.cli import vaultpass
from ernie_deploy.cli.vaultpass import vault_secrets
from ernie_deploy.errors import DeployError, ExitCode, InventoryError
from ernie_deploy.inventory import vault
from ernie_deploy.inventory.vault import NO_PASSWORD_HINT, VaultSecret, decrypt, is_vaulted

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vault"
PASSWORD = b"lab-vault-pass"
PROD_PASSWORD = b"prod-vault-pass"
DEFAULT = VaultSecret("default", PASSWORD)
PROD = VaultSecret("prod", PROD_PASSWORD)
FILE_PLAINTEXT = 'db_user: ernie\ngreeting: "grüße — ключ"\n'
ANSIBLE_VAULT = shutil.which("ansible-vault", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                     os.environ.get("PATH", "")]))
# Skipped only on a developer machine without ansible-core (the committed fixtures still test the format there);
# in CI (.ci/run sets ERNIE_LAB_REQUIRED=1) ansible-core is a test dependency, so a missing one fails instead.
needs_ansible_vault = pytest.mark.skipif(
    ANSIBLE_VAULT is None and not os.environ.get("CI") and os.environ.get("ERNIE_LAB_REQUIRED") != "1",
    reason="ansible-vault (ansible-core) not installed: pip install -e .[test]")


class VaultLoader(yaml.SafeLoader):
    """Reads `!vault |` values as their text, as the inventory hands them to decrypt."""


def _vault_scalar(loader: yaml.SafeLoader, node: yaml.Node) -> str:
    assert isinstance(node, yaml.ScalarNode)
    return loader.construct_scalar(node)


VaultLoader.add_constructor("!vault", _vault_scalar)


def vault_strings(text: str) -> dict[str, str]:
    data: dict[str, str] = yaml.load(text, Loader=VaultLoader)  # a SafeLoader subclass
    return data


def body(*parts: bytes) -> str:
    """A vault body: the hex of its parts joined by newlines."""
    return hexlify(b"\n".join(parts)).decode()


def error_of(vaulttext: str | bytes, secrets: list[VaultSecret], what: str = "variable 'db_password'") -> str:
    with pytest.raises(InventoryError) as info:
        decrypt(vaulttext, secrets, where="group_vars/all.yml:3", what=what)
    assert info.value.where == "group_vars/all.yml:3" and info.value.exit_code == ExitCode.INPUT
    return str(info.value)


def assert_nothing_secret(message: str, vaulttext: str | bytes, *secrets: bytes | str) -> None:
    """No password, plaintext or piece of ciphertext (any 16 hex digits of the body) in a message."""
    text = vaulttext.decode() if isinstance(vaulttext, bytes) else vaulttext
    for secret in secrets:
        assert (secret.decode() if isinstance(secret, bytes) else secret) not in message
    for line in text.splitlines()[1:]:
        for i in range(0, max(len(line) - 15, 1), 8):
            assert line[i:i + 16] not in message, "a piece of the ciphertext is in the message"


# -- decrypting ansible-vault's own output (committed fixtures) ------------------------------------------------


def test_fixture_strings_decrypt_in_both_formats() -> None:
    values = vault_strings((FIXTURES / "strings.yml").read_text())
    assert values["db_password"].startswith("$ANSIBLE_VAULT;1.1;AES256\n")
    assert values["api_key"].startswith("$ANSIBLE_VAULT;1.2;AES256;prod\n")
    assert decrypt(values["db_password"], [DEFAULT], where="w", what="db_password") == "s3cret-db-pass"
    assert decrypt(values["api_key"], [PROD], where="w", what="api_key") == "prod-api-key-Ω"


@pytest.mark.parametrize("name", ["vars-1.1.yml", "vars-1.2.yml"])
def test_fixture_files_decrypt_as_text_or_bytes(name: str) -> None:
    path = FIXTURES / name
    assert decrypt(path.read_text(), [DEFAULT, PROD], where=name, what=name) == FILE_PLAINTEXT
    assert decrypt(path.read_bytes(), [PROD, DEFAULT], where=name, what=name) == FILE_PLAINTEXT


def test_the_fixture_passwords_are_the_files_next_to_them() -> None:
    assert vault_secrets([str(FIXTURES / "password")], [f"prod@{FIXTURES / 'prod-password'}"], False, {}) == [
        PROD, DEFAULT]


def test_is_vaulted_follows_ansible_is_encrypted() -> None:
    text = (FIXTURES / "vars-1.1.yml").read_text()
    assert is_vaulted(text) and is_vaulted(text.encode()) and is_vaulted("$ANSIBLE_VAULT")
    assert not is_vaulted(" " + text)  # no whitespace skipped
    assert not is_vaulted("\n" + text)
    assert not is_vaulted(text + "é") and not is_vaulted(text.encode() + b"\xff")  # the format is ASCII
    assert not is_vaulted("db_password: hunter2") and not is_vaulted(b"") and not is_vaulted("$ansible_vault")


def test_a_secret_never_shows_its_password() -> None:
    assert "lab-vault-pass" not in repr(DEFAULT) and "lab-vault-pass" not in str(DEFAULT)
    assert repr(DEFAULT) == "VaultSecret(label='default')"


# -- which password decrypts -----------------------------------------------------------------------------------


def record_derivations(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The passwords decrypt derives keys from, in order (the cache is skipped, so each try shows)."""
    tried: list[bytes] = []
    derive = vault._derive.__wrapped__

    def recording(password: bytes, salt: bytes) -> tuple[bytes, bytes, bytes]:
        tried.append(password)
        return derive(password, salt)

    monkeypatch.setattr(vault, "_derive", recording)
    return tried


def test_the_vault_ids_password_is_tried_first(monkeypatch: pytest.MonkeyPatch) -> None:
    tried = record_derivations(monkeypatch)
    wrong = VaultSecret("default", b"not-it")
    assert decrypt((FIXTURES / "vars-1.2.yml").read_text(), [wrong, PROD], where="w", what="w") == FILE_PLAINTEXT
    assert tried == [PROD_PASSWORD]


def test_a_1_1_envelope_tries_default_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """ansible-core takes a 1.1 envelope's vault id to be its default identity, `default`."""
    tried = record_derivations(monkeypatch)
    assert decrypt((FIXTURES / "vars-1.1.yml").read_text(), [PROD, DEFAULT], where="w", what="w") == FILE_PLAINTEXT
    assert tried == [PASSWORD]


def test_every_password_is_tried_whatever_its_label(monkeypatch: pytest.MonkeyPatch) -> None:
    """ansible-core's default vault_id_match=False: the label orders the tries but does not restrict them."""
    tried = record_derivations(monkeypatch)
    secrets = [VaultSecret("dev", b"dev-pass"), VaultSecret("other", PROD_PASSWORD)]
    assert decrypt((FIXTURES / "vars-1.2.yml").read_text(), secrets, where="w", what="w") == FILE_PLAINTEXT
    assert tried == [b"dev-pass", PROD_PASSWORD]


def test_a_value_decrypted_again_reuses_its_keys() -> None:
    text = encrypt(b"cached", b"cache-pass")
    secret = VaultSecret("default", b"cache-pass")
    before = vault._derive.cache_info().hits
    assert decrypt(text, [secret], where="w", what="w") == decrypt(text, [secret], where="w", what="w") == "cached"
    assert vault._derive.cache_info().hits > before


# -- errors ----------------------------------------------------------------------------------------------------


def test_no_password_given() -> None:
    text = (FIXTURES / "vars-1.1.yml").read_text()
    message = error_of(text, [], what="the file group_vars/all/vault.yml")
    assert message == ("group_vars/all.yml:3: the file group_vars/all/vault.yml is encrypted with ansible-vault and "
                       f"no vault password was given\n  fix: {NO_PASSWORD_HINT}")
    assert NO_PASSWORD_HINT == ("give one with --vault-password-file FILE, --vault-id [LABEL@]SOURCE, "
                                "--ask-vault-pass or ANSIBLE_VAULT_PASSWORD_FILE")


def test_wrong_password_without_a_vault_id() -> None:
    text = (FIXTURES / "vars-1.1.yml").read_text()
    message = error_of(text, [VaultSecret("default", b"wrong-pass"), VaultSecret("dev", b"wrong-too")])
    assert "no vault password given decrypts variable 'db_password': tried 2 passwords (labelled default, dev)" in (
        message)
    assert "fix: give the password it was encrypted with" in message
    assert_nothing_secret(message, text, "wrong-pass", "wrong-too", FILE_PLAINTEXT, "ernie")


def test_wrong_password_names_the_vault_id() -> None:
    text = (FIXTURES / "vars-1.2.yml").read_text()
    message = error_of(text, [DEFAULT])
    assert ("no vault password given decrypts variable 'db_password': it is encrypted for vault id 'prod'; "
            "tried 1 password (labelled default)") in message
    assert "--vault-id prod@FILE" in message
    assert_nothing_secret(message, text, PASSWORD, PROD_PASSWORD, FILE_PLAINTEXT)


def test_a_tampered_ciphertext_fails_its_hmac() -> None:
    header, *lines = (FIXTURES / "vars-1.1.yml").read_text().splitlines()
    salt, signature, ciphertext = unhexlify("".join(lines)).split(b"\n")
    flipped = ciphertext[:-1] + (b"0" if ciphertext[-1:] != b"0" else b"1")  # still hex, one nibble changed
    text = f"{header}\n{body(salt, signature, flipped)}\n"
    message = error_of(text, [DEFAULT])
    assert "no vault password given decrypts" in message
    assert_nothing_secret(message, text, PASSWORD, FILE_PLAINTEXT)


def test_a_damaged_vault_id_is_not_shown() -> None:
    """The header's line break lost: the vault id runs into the first line of the body, which ansible-core would
    take as the label; the message leaves it out rather than show ciphertext."""
    original = (FIXTURES / "vars-1.2.yml").read_text()
    text = original.replace("prod\n", "prod\0", 1)
    message = error_of(text, [DEFAULT, PROD])
    assert "no vault password given decrypts variable 'db_password': tried 2 passwords (labelled default, prod)" in (
        message)
    assert "vault id" not in message.split("fix:")[0]
    assert_nothing_secret(message, original, PASSWORD, PROD_PASSWORD, FILE_PLAINTEXT)


@pytest.mark.parametrize(("vaulttext", "detail"), [
    ("hunter2-plain-secret", "it does not start with $ANSIBLE_VAULT"),
    ("  $ANSIBLE_VAULT;1.1;AES256\n6162\n", "it does not start with $ANSIBLE_VAULT"),
    ("$ANSIBLE_VAULT;1.1;AES256é\n", "it does not start with $ANSIBLE_VAULT"),
    ("$ANSIBLE_VAULT", "its first line is not $ANSIBLE_VAULT;VERSION;CIPHER[;VAULT_ID]"),
    ("$ANSIBLE_VAULT;1.1\n6162\n", "its first line is not $ANSIBLE_VAULT;VERSION;CIPHER[;VAULT_ID]"),
    ("$ANSIBLE_VAULT;1.1;AES\n6162\n", "its cipher 'AES' is not supported (ansible-vault writes AES256)"),
    ("$ANSIBLE_VAULT;1.1;AES256 " + "3132" * 20 + "\n6162\n",
     "its cipher is not supported"),  # a line break lost: the cipher name runs into the body, so is not shown
    ("$ANSIBLE_VAULT;1.1;AES256\nnot-hex-at-all\n", "its body is not the hexadecimal salt, HMAC and ciphertext"),
    ("$ANSIBLE_VAULT;1.1;AES256\n616\n", "its body is not the hexadecimal salt"),  # odd length
    ("$ANSIBLE_VAULT;1.1;AES256\n", "its body is not the hexadecimal salt"),  # header only
    (f"$ANSIBLE_VAULT;1.1;AES256\n{body(b'00', b'11')}\n", "its body is not the hexadecimal salt"),  # two parts
    (f"$ANSIBLE_VAULT;1.1;AES256\n{body(b'0g', b'11', b'22')}\n", "its body is not the hexadecimal salt"),
    (f"$ANSIBLE_VAULT;1.1;AES256\n{body(b'00', b'1', b'22')}\n", "its body is not the hexadecimal salt"),
    ("$ANSIBLE_VAULT;1.1;AES256\n6162 \n", "its body is not the hexadecimal salt"),  # ansible-core strips no line
])
def test_malformed_values(vaulttext: str, detail: str) -> None:
    message = error_of(vaulttext, [DEFAULT])
    assert f"variable 'db_password' is a malformed ansible-vault value: {detail}" in message
    assert "fix: encrypt the value again (ansible-vault encrypt_string" in message
    assert "hunter2" not in message and "lab-vault-pass" not in message


def test_a_malformed_value_is_told_before_a_missing_password() -> None:
    assert "malformed" in error_of("$ANSIBLE_VAULT;1.1;AES256\nzz\n", [])


def test_a_signed_value_with_bad_padding() -> None:
    """The HMAC matches (so the password is right), but the plaintext was never padded: not ansible-vault's."""
    text = encrypt(b"sixteen bytes!!?" + b"x" * 15 + b"\x07", PASSWORD, pad=False)
    message = error_of(text, [DEFAULT])
    assert "malformed ansible-vault value: it decrypts, but its padding is not PKCS#7" in message
    assert_nothing_secret(message, text, PASSWORD, "sixteen bytes")


def test_a_plaintext_that_is_not_utf8() -> None:
    text = encrypt(b"caf\xe9 latin-1", PASSWORD, label="dev")
    message = error_of(text, [DEFAULT])
    assert "variable 'db_password' decrypts to bytes that are not UTF-8 text" in message
    assert_nothing_secret(message, text, PASSWORD, "latin-1")


def test_our_encrypt_helper_matches_the_format() -> None:
    assert decrypt(encrypt("ünïcode\n".encode(), PASSWORD, label="dev"), [DEFAULT], where="w", what="w") == "ünïcode\n"


@settings(max_examples=150, deadline=None)
@given(position=st.integers(min_value=0), replacement=st.binary(min_size=1, max_size=3))
def test_no_other_exception_escapes(position: int, replacement: bytes) -> None:
    """Whatever a byte or three of a vault file become, decrypt gives the plaintext or an InventoryError."""
    original = (FIXTURES / "vars-1.2.yml").read_bytes()
    at = position % len(original)
    mangled = original[:at] + replacement + original[at + len(replacement):]
    try:
        assert decrypt(mangled, [DEFAULT, PROD], where="w", what="w") == FILE_PLAINTEXT
    except InventoryError as exc:
        assert_nothing_secret(str(exc), original, PASSWORD, PROD_PASSWORD, FILE_PLAINTEXT)


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text().map(lambda t: "$ANSIBLE_VAULT;" + t),
                 st.binary().map(lambda b: b"$ANSIBLE_VAULT;1.2;AES256;x\n" + b)))
def test_no_other_exception_escapes_for_any_text(vaulttext: str | bytes) -> None:
    with contextlib.suppress(InventoryError):
        decrypt(vaulttext, [DEFAULT], where="w", what="w")


# -- round trips with the real ansible-vault ------------------------------------------------------------------


def ansible_vault(tmp_path: Path, *args: str, stdin: str | None = None) -> str:
    assert ANSIBLE_VAULT
    # No ansible.cfg or ANSIBLE_* setting of the developer's may change what is written.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["ANSIBLE_CONFIG"] = str(tmp_path / "ansible.cfg")
    (tmp_path / "ansible.cfg").write_text("[defaults]\n")
    done = subprocess.run([ANSIBLE_VAULT, *args], cwd=tmp_path, input=stdin, capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def passwords(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "pw").write_text("round-trip-pass\n")
    (tmp_path / "prod-pw").write_text("round-trip-prod\n")
    return tmp_path / "pw", tmp_path / "prod-pw"


ROUND_TRIP_TEXT = "line one: ä ☃\n  indented: 'quotes' \"and\" $dollars {{ jinja }}\n\ttab\n"


@needs_ansible_vault
@pytest.mark.parametrize("vault_id", [None, "label"])
def test_encrypt_string_round_trip(tmp_path: Path, passwords: tuple[Path, Path], vault_id: str | None) -> None:
    pw, prod_pw = passwords
    option = ["--vault-password-file", str(pw)] if vault_id is None else ["--vault-id", f"{vault_id}@{prod_pw}"]
    out = ansible_vault(tmp_path, "encrypt_string", *option, "--stdin-name", "secret", stdin=ROUND_TRIP_TEXT)
    value = vault_strings(out)["secret"]
    assert value.splitlines()[0] == ("$ANSIBLE_VAULT;1.1;AES256" if vault_id is None
                                     else "$ANSIBLE_VAULT;1.2;AES256;label")
    secrets = vault_secrets([str(pw)], [f"label@{prod_pw}"], False, {})
    assert decrypt(value, secrets, where="w", what="w") == ROUND_TRIP_TEXT
    # And only the right password opens it.
    wrong = [s for s in secrets if s.label != ("default" if vault_id is None else "label")]
    assert_nothing_secret(error_of(value, wrong), value, "round-trip", ROUND_TRIP_TEXT)


@needs_ansible_vault
@pytest.mark.parametrize("vault_id", [None, "label"])
def test_encrypt_file_round_trip(tmp_path: Path, passwords: tuple[Path, Path], vault_id: str | None) -> None:
    pw, prod_pw = passwords
    target = tmp_path / "vars.yml"
    target.write_text(ROUND_TRIP_TEXT * 40)  # several 80-column lines of body
    option = ["--vault-password-file", str(pw)] if vault_id is None else ["--vault-id", f"{vault_id}@{prod_pw}"]
    ansible_vault(tmp_path, "encrypt", *option, str(target))
    text = target.read_text()
    assert is_vaulted(text) and text.count("\n") > 10
    expected_label = "default" if vault_id is None else "label"
    secret = VaultSecret(expected_label, (pw if vault_id is None else prod_pw).read_text().strip().encode())
    assert decrypt(text, [secret], where="vars.yml", what="vars.yml") == ROUND_TRIP_TEXT * 40


@needs_ansible_vault
def test_ansible_vault_reads_what_our_encrypt_helper_writes(tmp_path: Path, passwords: tuple[Path, Path]) -> None:
    """So the cases built with `encrypt` (bad padding, not UTF-8) are the real format with one thing changed."""
    pw, _ = passwords
    (tmp_path / "helper.vault").write_text(encrypt(b"from the helper\n", b"round-trip-pass", label="x"))
    assert ansible_vault(tmp_path, "view", "--vault-password-file", str(pw), "helper.vault") == "from the helper\n"


# -- password sources --------------------------------------------------------------------------------------------


def script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


class Prompter:
    def __init__(self, *answers: str | type[BaseException]) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []

    def __call__(self, question: str) -> str:
        self.asked.append(question)
        answer = self.answers.pop(0)
        if isinstance(answer, str):
            return answer
        raise answer


def never(question: str) -> str:
    raise AssertionError(f"prompted: {question}")


def source_error(files: list[str], ids: list[str], ask: bool, environ: dict[str, str],
                 prompt: Callable[[str], str] = never) -> DeployError:
    with pytest.raises(DeployError) as info:
        vault_secrets(files, ids, ask, environ, prompt=prompt)
    assert info.value.exit_code == ExitCode.INPUT
    return info.value


def test_password_file_is_stripped_as_ansible_strips_it(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("lab-vault-pass\n")
    (tmp_path / "b").write_bytes(b"  \tspaced pass \r\n\n")
    assert vault_secrets([str(tmp_path / "a"), str(tmp_path / "b")], [], False, {}) == [
        DEFAULT, VaultSecret("default", b"spaced pass")]


def test_relative_and_variable_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pw").write_text("lab-vault-pass\n")
    monkeypatch.chdir(tmp_path)
    environ = {"VAULT_DIR": str(tmp_path)}
    assert vault_secrets(["pw", "$VAULT_DIR/pw"], ["x@${VAULT_DIR}/pw"], False, environ) == [
        VaultSecret("x", PASSWORD), DEFAULT, DEFAULT]


def test_executable_script_prints_the_password(tmp_path: Path) -> None:
    # A script's output loses only its line ends (ansible-core's strip(b'\r\n')), not its spaces.
    pw = script(tmp_path / "pass.sh", "printf ' script pass \\r\\n'")
    assert vault_secrets([], [f"ops@{pw}"], False, {}) == [VaultSecret("ops", b" script pass ")]


def test_client_script_is_given_the_vault_id(tmp_path: Path) -> None:
    client = script(tmp_path / "keyring-client.py", 'echo "$#:$*" >> "$0.args"; echo "pass-for-$2"')
    secrets = vault_secrets([str(client)], [f"prod@{client}", str(client)], False, {})
    assert secrets == [VaultSecret("prod", b"pass-for-prod"), VaultSecret("default", b"pass-for-"),
                       VaultSecret("default", b"pass-for-default")]
    # Without a label (--vault-id FILE) it gets no arguments; --vault-password-file's label is `default`.
    assert (tmp_path / "keyring-client.py.args").read_text() == "2:--vault-id prod\n0:\n2:--vault-id default\n"


def test_a_script_not_named_client_gets_no_arguments(tmp_path: Path) -> None:
    plain = script(tmp_path / "client.sh", 'echo "$#" > "$0.args"; echo pw')
    assert vault_secrets([], [f"prod@{plain}"], False, {}) == [VaultSecret("prod", b"pw")]
    assert (tmp_path / "client.sh.args").read_text() == "0\n"


def test_prompts(tmp_path: Path) -> None:
    prompt = Prompter(" typed-pass \n", "other")
    secrets = vault_secrets([], ["dev@prompt"], True, {}, prompt=prompt)
    assert prompt.asked == ["Vault password (dev): ", "Vault password: "]
    assert secrets == [VaultSecret("dev", b"typed-pass"), VaultSecret("default", b"other")]
    unlabelled = Prompter("x")
    assert vault_secrets([], ["prompt_ask_vault_pass"], False, {}, prompt=unlabelled) == [VaultSecret("default", b"x")]
    assert unlabelled.asked == ["Vault password: "]


def test_order_follows_ansible(tmp_path: Path) -> None:
    """ANSIBLE_VAULT_IDENTITY_LIST, --vault-id, --vault-password-file, ANSIBLE_VAULT_PASSWORD_FILE, then the
    --ask-vault-pass prompt."""
    for name in ("list1", "list2", "id", "file", "env"):
        (tmp_path / name).write_text(f"{name}-pass\n")
    environ = {"ANSIBLE_VAULT_IDENTITY_LIST": f" l1@{tmp_path / 'list1'} , 'l2@{tmp_path / 'list2'}',",
               "ANSIBLE_VAULT_PASSWORD_FILE": str(tmp_path / "env")}
    secrets = vault_secrets([str(tmp_path / "file")], [f"id@{tmp_path / 'id'}"], True, environ,
                            prompt=Prompter("asked-pass"))
    assert [(s.label, s.password) for s in secrets] == [
        ("l1", b"list1-pass"), ("l2", b"list2-pass"), ("id", b"id-pass"), ("default", b"file-pass"),
        ("default", b"env-pass"), ("default", b"asked-pass")]


def test_nothing_given_is_no_passwords() -> None:
    assert vault_secrets([], [], False, {"ANSIBLE_VAULT_PASSWORD_FILE": ""}, prompt=never) == []


def test_a_password_file_may_itself_be_vaulted(tmp_path: Path) -> None:
    """As ansible-core's loader does: decrypted with a password given before it."""
    (tmp_path / "first").write_text("lab-vault-pass\n")
    (tmp_path / "inner").write_text(encrypt(b"inner-pass\n", PASSWORD))
    secrets = vault_secrets([str(tmp_path / "first"), str(tmp_path / "inner")], [], False, {})
    assert secrets == [DEFAULT, VaultSecret("default", b"inner-pass")]
    with pytest.raises(InventoryError, match=r"the vault password file \S*inner is encrypted with ansible-vault"):
        vault_secrets([str(tmp_path / "inner")], [], False, {})


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    error = source_error([], [f"prod@{missing}"], False, {})
    assert error.message == f"the vault password file {missing} was not found"
    assert error.where == f"--vault-id prod@{missing}"
    error = source_error([], [], False, {"ANSIBLE_VAULT_PASSWORD_FILE": str(missing)})
    assert error.where == f"ANSIBLE_VAULT_PASSWORD_FILE={missing}"


def test_directory(tmp_path: Path) -> None:
    error = source_error([str(tmp_path)], [], False, {})
    assert error.message == f"the vault password file {tmp_path} is a directory"
    assert error.where == f"--vault-password-file {tmp_path}"


def test_empty_passwords(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text(" \n\n")
    assert source_error([str(tmp_path / "empty")], [], False, {}).message == (
        f"the vault password file {tmp_path / 'empty'} is empty")
    silent = script(tmp_path / "silent.sh", "echo")
    assert source_error([str(silent)], [], False, {}).message == (
        f"the vault password script {silent} printed no password")
    error = source_error([], [], True, {}, prompt=Prompter("  "))
    assert error.message == "the vault password typed for vault id 'default' is empty"
    assert error.where == "--ask-vault-pass"


def test_prompt_input_ended() -> None:
    error = source_error([], ["dev@prompt"], False, {}, prompt=Prompter(EOFError))
    assert error.message == "no vault password was typed for vault id 'dev': the input ended"


def test_failing_script_shows_its_exit_code_never_its_output(tmp_path: Path, capfd: pytest.CaptureFixture[str]
                                                             ) -> None:
    failing = script(tmp_path / "fail.sh", "echo leaked-password; echo 'vault is sealed' >&2; exit 3")
    error = source_error([str(failing)], [], False, {})
    assert error.message == (f"the vault password script {failing} failed (exit code 3); what it wrote on its "
                             "standard error, if anything, is above")
    assert "leaked-password" not in str(error)
    # A plain script's standard error reaches the terminal, as with ansible-core, so it can prompt there.
    assert "vault is sealed" in capfd.readouterr().err


def test_failing_client_script_names_its_last_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = script(tmp_path / "store-client", "echo leaked-password; printf 'looking\\nno such key: prod\\n' >&2; "
                                               'exit "$EXIT"')
    monkeypatch.setenv("EXIT", "2")  # the script's environment is the process's, not the one vault_secrets reads
    error = source_error([], [f"prod@{client}"], False, {})
    assert error.message == (f"the vault password client script {client} has no password for vault id 'prod' "
                             "(exit code 2): no such key: prod")
    monkeypatch.setenv("EXIT", "1")
    error = source_error([], [f"prod@{client}"], False, {})
    assert error.message == (f"the vault password client script {client} failed for vault id 'prod' "
                             "(exit code 1): no such key: prod")
    assert "leaked-password" not in str(error) and "looking" not in str(error)


def test_killed_script(tmp_path: Path) -> None:
    killed = script(tmp_path / "killed.sh", "kill -9 $$")
    assert source_error([str(killed)], [], False, {}).message.startswith(
        f"the vault password script {killed} failed (killed by signal 9)")


def test_script_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vaultpass, "SCRIPT_TIMEOUT_S", 1)
    slow = script(tmp_path / "slow-client", "exec sleep 30")
    error = source_error([], [f"prod@{slow}"], False, {})
    assert error.message == (f"the vault password client script {slow}, run for vault id 'prod', did not finish "
                             "within 1 s and was stopped")


def test_executable_that_is_not_a_script(tmp_path: Path) -> None:
    text = tmp_path / "pw.txt"
    text.write_text("lab-vault-pass\n")
    text.chmod(0o744)  # any execute bit makes it a script, as in ansible-core
    error = source_error([str(text)], [], False, {})
    assert error.message.startswith(f"cannot run the vault password script {text}: ")
    assert error.hint == f"if it is not a script, remove its execute bits (chmod a-x {text})"
    assert "lab-vault-pass" not in str(error)
