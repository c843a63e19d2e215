"""Model files from the Hugging Face Hub, downloaded on the host with the Hub's own client (huggingface_hub,
which every vLLM install brings), into the same content-addressed staging as a controller copy.

The token arrives on stdin and lives only in the download process's memory: never on a command line, in
the audit log or in output. HF_ENDPOINT (a mirror) comes from the host's `vllm_env`.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from dataclasses import dataclass, field
from typing import ClassVar

from ernie_deploy.planning.provisioning import Entry, HubSource, ProvisionSpec, trusted
from ernie_deploy.remote import filesync
from ernie_deploy.remote.command import Command, Intent, Op
from ernie_deploy.remote.programs import program
from ernie_deploy.remote.protocol import marker, records

RESULT_MARK = marker("hub")

PROGRAM = program("hub_download")  # run by the venv's python: huggingface_hub comes with vLLM


@dataclass(frozen=True)
class HubResult:
    changed: bool = False
    commit: str | None = None
    source: str | None = None
    files: dict[str, Entry] = field(default_factory=dict)
    error: str | None = None

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.files.values())


@dataclass(frozen=True)
class HubDownload(Intent):
    """Resolve `revision` of `repo` to a commit; download and stage the snapshot into `stage` unless the host
    already holds that commit `intact` (`recorded` is the source its manifest names), with the venv's python."""

    op: ClassVar[Op] = Op.HUB_DOWNLOAD
    repo: str
    revision: str
    stage: str
    recorded: str
    intact: bool
    endpoint: str | None
    venv: str

    def render(self) -> str:
        q = shlex.quote
        cfg = {"repo": self.repo, "revision": self.revision, "stage": self.stage, "recorded": self.recorded,
               "intact": self.intact, "endpoint": self.endpoint, "mark": RESULT_MARK}
        return (f"set -eu\numask 022\nmkdir -p {q(posixpath.dirname(self.stage) or '/')}\numask 077\n"
                f"mkdir -p {q(self.stage)}\n"
                f"py={q(self.venv + '/bin/python')}; [ -x \"$py\" ] || py=python3\n"
                f"\"$py\" -c {q(PROGRAM)} {q(json.dumps(cfg, sort_keys=True))}\n")


def download_command(spec: ProvisionSpec, source: HubSource, state: filesync.DirState, verify: bool,
                     token: str) -> Command:
    """The download (see HubDownload); the host's files count as intact when its manifest's files are
    unchanged and no --verify-files asks to hash them."""
    intact = bool(state.recorded) and set(trusted(state.recorded, state.present)) == set(state.recorded) \
        and not verify
    intent = HubDownload(source.repo, source.revision, filesync.staging_dir(spec.model_path), state.source or "",
                         intact, spec.hf_endpoint, spec.venv)
    return Command(intent, stdin=(token + "\n").encode(), timeout=24 * 3600, check=False)


def parse_result(text: str) -> HubResult:
    for record in reversed(records(text, "hub")):
        try:
            raw = json.loads(record)
            files = {str(k): Entry(int(v["size"]), str(v["sha256"])) for k, v in dict(raw.get("files", {})).items()}
            return HubResult(bool(raw.get("changed")), raw.get("commit"), raw.get("source"), files,
                             raw.get("error"))
        except (ValueError, KeyError, TypeError):
            break
    return HubResult(error="no result from the download script")
