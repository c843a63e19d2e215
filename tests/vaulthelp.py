"""ansible-vault's format written independently of ernie_deploy/inventory/vault.py (cryptography's PBKDF2 and HMAC
where the module uses hashlib's), so tests can encrypt without ansible-core and a bug in the module cannot hide
behind the same bug in its test."""

from __future__ import annotations

from binascii import hexlify

from cryptography.hazmat.primitives import hashes, padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.hmac import HMAC
from cryptography.hazmat.primitives.kdf.pbkdf2 import PBKDF2HMAC


def encrypt(plaintext: bytes, password: bytes, *, label: str | None = None, pad: bool = True) -> str:
    """What ansible-vault writes for `plaintext` (salt fixed), with PKCS#7 padding unless `pad` is False."""
    salt = bytes(range(32))
    material = PBKDF2HMAC(algorithm=hashes.SHA256(), length=80, salt=salt, iterations=10000).derive(password)
    if pad:
        padder = padding.PKCS7(128).padder()
        plaintext = padder.update(plaintext) + padder.finalize()
    encryptor = Cipher(algorithms.AES(material[:32]), modes.CTR(material[64:])).encryptor()
    ciphertext = encryptor.update(plaintext) + encryptor.finalize()
    signer = HMAC(material[32:64], hashes.SHA256())
    signer.update(ciphertext)
    body = hexlify(b"\n".join([hexlify(salt), hexlify(signer.finalize()), hexlify(ciphertext)])).decode()
    header = f"$ANSIBLE_VAULT;1.2;AES256;{label}" if label else "$ANSIBLE_VAULT;1.1;AES256"
    return "\n".join([header, *(body[i:i + 80] for i in range(0, len(body), 80))]) + "\n"

