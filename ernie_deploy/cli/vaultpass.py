"""Vault passwords from where Ansible takes them: --vault-password-file, --vault-id, --ask-vault-pass, and the
environment (ANSIBLE_VAULT_IDENTITY_LIST, ANSIBLE_VAULT_PASSWORD_FILE).

The order and meaning follow ansible-core's CLI.build_vault_ids / setup_vault_secrets (ansible/cli/__init__.py)
and get_file_vault_secret with its File-, Script-, ClientScript- and PromptVaultSecret
(ansible/parsing/vault/__init__.py):

  * ANSIBLE_VAULT_IDENTITY_LIST's entries, then each --vault-id, then each --vault-password-file, then
    ANSIBLE_VAULT_PASSWORD_FILE, then --ask-vault-pass; a password file is `default@FILE`, --ask-vault-pass is
    `default@prompt_ask_vault_pass`;
  * a vault id is [LABEL@]SOURCE (split at the first @); SOURCE `prompt` asks "Vault password (LABEL): ",
    `prompt_ask_vault_pass` asks "Vault password: "; anything else is a path, with ~ and $VARS expanded;
  * a path with any execute bit is run without arguments and prints the password; one whose name without its
    extension ends in `-client` is run with `--vault-id LABEL` when there is a label (exit code 2: it has no
    password for that label); any other file is read, and may itself be ansible-vault encrypted with a password
    given before it.

One deliberate difference: ansible-core only warns about a password file it cannot use when another password
works; here every source named must work, so a typo in a path is not silently skipped.
"""

from __future__ import annotations

import getpass
import os
import re
import stat
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ernie_deploy.errors import DeployError
from ernie_deploy.inventory.vault import DEFAULT_VAULT_ID, VaultSecret, decrypt, is_vaulted

PROMPT_SOURCES = ("prompt", "prompt_ask_vault_pass")
SCRIPT_TIMEOUT_S = 60
CLIENT_UNKNOWN_VAULT_ID = 2  # a -client script's exit code for "no password for this vault id" (ansible-core's)

# posixpath.expandvars' pattern, applied to the environment given rather than os.environ.
_VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)


def vault_secrets(password_files: Sequence[str], vault_ids: Sequence[str], ask: bool, environ: Mapping[str, str],
                  prompt: Callable[[str], str] = getpass.getpass) -> list[VaultSecret]:
    """The vault passwords the options and environment name, read in Ansible's order (see the module's doc).

    Raises DeployError (exit code 5, bad input) for a password source that cannot be used; messages name the
    source and never hold a password or what a script printed on its standard output.
    """
    # (where the source was named, [LABEL@]SOURCE)
    slugs: list[tuple[str, str]] = [(f"ANSIBLE_VAULT_IDENTITY_LIST entry {v}", v) for v in _identity_list(environ)]
    slugs += [(f"--vault-id {v}", v) for v in vault_ids]
    slugs += [(f"--vault-password-file {f}", f"{DEFAULT_VAULT_ID}@{f}") for f in password_files]
    if env_file := environ.get("ANSIBLE_VAULT_PASSWORD_FILE"):
        slugs.append((f"ANSIBLE_VAULT_PASSWORD_FILE={env_file}", f"{DEFAULT_VAULT_ID}@{env_file}"))
    if ask:
        slugs.append(("--ask-vault-pass", f"{DEFAULT_VAULT_ID}@prompt_ask_vault_pass"))
    secrets: list[VaultSecret] = []
    for where, slug in slugs:
        name, at, source = slug.partition("@")
        if not at:
            name, source = "", slug
        label = name or DEFAULT_VAULT_ID
        if source in PROMPT_SOURCES:
            password = _prompted(label, source, prompt, where)
        else:
            password = _from_path(_resolve(source, environ), name, secrets, where)
        secrets.append(VaultSecret(label=label, password=password))
    return secrets


def _identity_list(environ: Mapping[str, str]) -> list[str]:
    """ANSIBLE_VAULT_IDENTITY_LIST as ansible-core's config reads a list: comma separated, each entry stripped
    and unquoted."""
    entries = [entry.strip() for entry in environ.get("ANSIBLE_VAULT_IDENTITY_LIST", "").split(",")]
    return [e[1:-1] if len(e) > 1 and e[0] == e[-1] and e[0] in "'\"" else e for e in entries if e]


def _resolve(path: str, environ: Mapping[str, str]) -> str:
    """ansible-core's unfrackpath without following links: $VARS and ~ expanded, made absolute (a relative path
    is from the current directory), so a script runs by its path rather than being looked up on PATH."""
    def variable(match: re.Match[str]) -> str:
        return environ.get(match[1].strip("{}"), match[0])

    return os.path.abspath(os.path.expanduser(_VARIABLE.sub(variable, path)))


def _prompted(label: str, source: str, prompt: Callable[[str], str], where: str) -> bytes:
    question = "Vault password: " if source == "prompt_ask_vault_pass" else f"Vault password ({label}): "
    try:
        answer = prompt(question)
    except EOFError:
        raise DeployError(f"no vault password was typed for vault id '{label}': the input ended", where=where,
                          hint="run it on a terminal, or give the password with --vault-password-file FILE"
                          ) from None
    # Stripped as ansible-core strips it; bytes a terminal sent that are not UTF-8 come back as they were typed.
    password = answer.encode("utf-8", "surrogateescape").strip()
    if not password:
        raise DeployError(f"the vault password typed for vault id '{label}' is empty", where=where,
                          hint="type the password the values were encrypted with")
    return password


def _from_path(path: str, name: str, earlier: Sequence[VaultSecret], where: str) -> bytes:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DeployError(f"the vault password file {path} was not found", where=where,
                          hint="check the path (a relative one is taken from the current directory)") from None
    except OSError as exc:
        raise DeployError(f"cannot read the vault password file {path}: {exc.strerror}", where=where,
                          hint="check the path and its permissions") from None
    if stat.S_ISDIR(mode):
        raise DeployError(f"the vault password file {path} is a directory", where=where,
                          hint="name the file that holds the password")
    if mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH):  # ansible-core's is_executable: any execute bit
        return _from_script(path, name, where)
    try:
        content = Path(path).read_bytes().strip()
    except OSError as exc:
        raise DeployError(f"cannot read the vault password file {path}: {exc.strerror}", where=where,
                          hint="check the file's permissions") from None
    if is_vaulted(content):
        # A password file may be encrypted with a password given before it, as ansible-core allows.
        content = decrypt(content, earlier, where=where, what=f"the vault password file {path}").encode("utf-8")
    password = content.strip(b"\r\n")
    if not password:
        raise DeployError(f"the vault password file {path} is empty", where=where,
                          hint="put the password in it, on one line")
    return password


def _from_script(path: str, name: str, where: str) -> bytes:
    client = Path(path).stem.endswith("-client")
    asked = f" for vault id '{name}'" if client and name else ""
    kind = "client script" if client else "script"
    command = [path, "--vault-id", name] if asked else [path]
    try:
        # A plain script's standard error is left on the terminal, as ansible-core leaves it, so a script can
        # prompt there; a client script's is read for the message, as ansible-core reads it.
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE if client else None,
                              timeout=SCRIPT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise DeployError(f"the vault password {kind} {path}, run{asked}, did not finish within {SCRIPT_TIMEOUT_S} s "
                          "and was stopped", where=where,
                          hint="make it print the password and exit; run it alone to see where it waits") from None
    except OSError as exc:
        raise DeployError(f"cannot run the vault password {kind} {path}: {exc.strerror}", where=where,
                          hint=f"if it is not a script, remove its execute bits (chmod a-x {path})") from None
    if done.returncode != 0:
        # Its standard output is never shown: it may hold the password.
        status = f"exit code {done.returncode}" if done.returncode > 0 else f"killed by signal {-done.returncode}"
        if client and done.returncode == CLIENT_UNKNOWN_VAULT_ID:
            message = f"the vault password client script {path} has no password{asked} ({status})"
        else:
            message = f"the vault password {kind} {path} failed{asked} ({status})"
        if client:
            last = _last_line(done.stderr)
            message += f": {last}" if last else ", with nothing on its standard error"
        else:
            message += "; what it wrote on its standard error, if anything, is above"
        raise DeployError(message, where=where, hint="run the script alone to see why it fails")
    password = done.stdout.strip(b"\r\n")
    if not password:
        raise DeployError(f"the vault password {kind} {path} printed no password", where=where,
                          hint="make it print the password on its standard output")
    return password


def _last_line(output: bytes) -> str | None:
    lines = output.decode("utf-8", "replace").strip().splitlines()
    return lines[-1].strip() if lines else None
