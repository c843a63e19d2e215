"""Decrypting ansible-vault data without ansible-core.

The format is the one ansible-core's VaultLib and VaultAES256 (ansible/parsing/vault/__init__.py) read and write,
documented at docs.ansible.com under "Vault" ("Format of files encrypted with Ansible Vault"):

    $ANSIBLE_VAULT;1.1;AES256            (or 1.2;AES256;LABEL when encrypted with --vault-id LABEL@SOURCE)
    hex( hex(salt) \\n hex(hmac) \\n hex(ciphertext) ), in lines of 80 characters

PBKDF2-HMAC-SHA256 (10000 iterations) turns the password and salt into an AES-256 key, an HMAC-SHA256 key and
the initial counter; the ciphertext is the PKCS#7-padded plaintext in AES-256-CTR, signed with HMAC-SHA256.
PBKDF2 and HMAC come from hashlib (the same OpenSSL code); cryptography is needed for AES-CTR and the
PKCS#7 unpadding only.

Pure: the passwords come in as VaultSecrets (cli/vaultpass.py reads them from files, scripts and prompts).
Messages never hold a password, ciphertext or plaintext, since they end up in terminals and CI logs.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from ernie_deploy.errors import InventoryError

VAULT_HEADER = "$ANSIBLE_VAULT"
# The label ansible-core gives a password with none (its DEFAULT_VAULT_IDENTITY), and the vault id it assumes
# for a 1.1 envelope, which has none.
DEFAULT_VAULT_ID = "default"

_KEY_LENGTH = 32  # AES-256
_IV_LENGTH = 16  # AES's block: the CTR mode's initial counter
_ITERATIONS = 10000
_CIPHERS = ("AES256",)  # ansible-core's CIPHER_ALLOWLIST

NO_PASSWORD_HINT = ("give one with --vault-password-file FILE, --vault-id [LABEL@]SOURCE, --ask-vault-pass "
                    "or ANSIBLE_VAULT_PASSWORD_FILE")
MALFORMED_HINT = ("encrypt the value again (ansible-vault encrypt_string, or ansible-vault encrypt for a whole "
                  "file) and copy all of it, from the $ANSIBLE_VAULT line to the last line of hex digits")


@dataclass(frozen=True)
class VaultSecret:
    """A vault password and the label (vault id) it was given under: `default` unless --vault-id LABEL@..."""

    label: str
    password: bytes = field(repr=False)


@dataclass(frozen=True)
class _Vaulttext:
    vault_id: str  # the envelope's label (1.2), DEFAULT_VAULT_ID for a 1.1 envelope
    labelled: bool  # whether the envelope named its vault id, so messages can tell
    salt: bytes
    signature: bytes
    ciphertext: bytes


def is_vaulted(text: str | bytes) -> bool:
    """Whether `text` is vault data, by ansible-core's is_encrypted: ASCII only, and starting with the header
    (no whitespace skipped)."""
    if isinstance(text, str):
        return text.isascii() and text.startswith(VAULT_HEADER)
    return text.isascii() and text.startswith(VAULT_HEADER.encode("ascii"))


def decrypt(vaulttext: str | bytes, secrets: Sequence[VaultSecret], *, where: str, what: str) -> str:
    """The plaintext of `vaulttext`, decrypted with the first of `secrets` whose key verifies its HMAC.

    `what` names the encrypted thing in messages, as a noun phrase ("variable 'db_password'", "the file
    group_vars/all/vault.yml"); `where` is the error's location. Every secret is tried, as ansible-core does
    with its default vault_id_match=False; those labelled with the envelope's vault id go first, which only
    saves key derivations, since the HMAC decides which one decrypts. Raises InventoryError, and only that.
    """
    if not is_vaulted(vaulttext):
        raise _malformed(f"it does not start with {VAULT_HEADER}", where, what)
    data = vaulttext.encode("ascii") if isinstance(vaulttext, str) else vaulttext  # ASCII: is_vaulted checked
    parsed = _parse(data, where, what)
    if not secrets:
        raise InventoryError(f"{what} is encrypted with ansible-vault and no vault password was given",
                             where=where, hint=NO_PASSWORD_HINT)
    ordered = [s for s in secrets if s.label == parsed.vault_id] + [s for s in secrets if s.label != parsed.vault_id]
    for secret in ordered:
        key, signing_key, counter = _derive(secret.password, parsed.salt)
        signature = hmac.new(signing_key, parsed.ciphertext, hashlib.sha256).digest()
        if hmac.compare_digest(signature, parsed.signature):  # constant time: a timing leak would help a forger
            return _plaintext(parsed.ciphertext, key, counter, where, what)
    raise _wrong_password(parsed, ordered, where, what)


def _parse(data: bytes, where: str, what: str) -> _Vaulttext:
    """ansible-core's parse_vaulttext_envelope, then parse_vaulttext."""
    lines = data.splitlines()
    header = lines[0].strip().split(b";")
    if len(header) < 3:
        raise _malformed(f"its first line is not {VAULT_HEADER};VERSION;CIPHER[;VAULT_ID]", where, what)
    # The version is not checked: ansible-core reads 1.1 and 1.2 alike, a vault id being the only difference.
    cipher = header[2].strip().decode("ascii")
    if cipher not in _CIPHERS:
        shown = f" '{cipher}'" if _readable(cipher) else ""
        raise _malformed(f"its cipher{shown} is not supported (ansible-vault writes AES256)", where, what)
    label = header[3].strip().decode("ascii") if len(header) > 3 else ""
    try:
        salt_hex, signature_hex, ciphertext_hex = binascii.unhexlify(b"".join(lines[1:])).split(b"\n", 2)
        return _Vaulttext(vault_id=label or DEFAULT_VAULT_ID, labelled=bool(label),
                          salt=binascii.unhexlify(salt_hex), signature=binascii.unhexlify(signature_hex),
                          ciphertext=binascii.unhexlify(ciphertext_hex))
    except ValueError:  # binascii.Error is a ValueError; so is unpacking fewer than three lines
        raise _malformed("its body is not the hexadecimal salt, HMAC and ciphertext ansible-vault writes",
                         where, what) from None


# A value is often decrypted more than once (a group's vars for each of its hosts); ansible-core caches its key
# derivation the same way. Each costs 10000 HMAC rounds.
@functools.lru_cache(maxsize=1024)
def _derive(password: bytes, salt: bytes) -> tuple[bytes, bytes, bytes]:
    material = hashlib.pbkdf2_hmac("sha256", password, salt, _ITERATIONS, dklen=2 * _KEY_LENGTH + _IV_LENGTH)
    return material[:_KEY_LENGTH], material[_KEY_LENGTH:2 * _KEY_LENGTH], material[2 * _KEY_LENGTH:]


def _plaintext(ciphertext: bytes, key: bytes, counter: bytes, where: str, what: str) -> str:
    decryptor = Cipher(algorithms.AES(key), modes.CTR(counter)).decryptor()
    unpadder = padding.PKCS7(algorithms.AES.block_size).unpadder()
    try:
        padded = decryptor.update(ciphertext) + decryptor.finalize()
        plain = unpadder.update(padded) + unpadder.finalize()
    except ValueError:
        # The HMAC matched, so the password is right and the data is as it was signed: not ansible-vault's output.
        raise _malformed("it decrypts, but its padding is not PKCS#7", where, what) from None
    try:
        return plain.decode("utf-8")
    except UnicodeDecodeError:
        raise InventoryError(f"{what} decrypts to bytes that are not UTF-8 text", where=where,
                             hint="encrypt UTF-8 text (ansible-vault encrypt_string, or ansible-vault encrypt "
                                  "of a YAML file)") from None


def _readable(name: str) -> bool:
    """Whether a cipher name or vault id from a header line may be shown: a damaged header (a line break lost)
    runs on into the ciphertext, which makes it long or unprintable."""
    return len(name) <= 64 and name.isprintable()


def _malformed(detail: str, where: str, what: str) -> InventoryError:
    return InventoryError(f"{what} is a malformed ansible-vault value: {detail}", where=where, hint=MALFORMED_HINT)


def _wrong_password(parsed: _Vaulttext, tried: Sequence[VaultSecret], where: str, what: str) -> InventoryError:
    labels = ", ".join(dict.fromkeys(s.label for s in tried))
    count = "1 password" if len(tried) == 1 else f"{len(tried)} passwords"
    if parsed.labelled and _readable(parsed.vault_id):
        message = (f"no vault password given decrypts {what}: it is encrypted for vault id '{parsed.vault_id}'; "
                   f"tried {count} (labelled {labels})")
        hint = (f"give the password it was encrypted with (--vault-id {parsed.vault_id}@FILE), and check that the "
                "file or script holds that password")
    else:
        message = f"no vault password given decrypts {what}: tried {count} (labelled {labels})"
        hint = "give the password it was encrypted with, and check that the file or script holds that password"
    return InventoryError(message, where=where, hint=hint)
