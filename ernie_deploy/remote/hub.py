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

from ernie_deploy.planning.provisioning import Entry, HubSource, ProvisionSpec, trusted
from ernie_deploy.remote import filesync
from ernie_deploy.remote.command import Command, Op

RESULT_MARK = "@@ernie-deploy:hub "

# Runs on the host with the venv's python. argv[1]: JSON settings (no secret); stdin: the token line.
PROGRAM = r"""
import hashlib, json, os, sys
cfg = json.loads(sys.argv[1])
token = sys.stdin.readline().rstrip("\n") or None
if cfg.get("endpoint"):
    os.environ["HF_ENDPOINT"] = cfg["endpoint"]
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
def done(**out):
    print(cfg["mark"] + json.dumps(out, sort_keys=True))
    sys.exit(0)
try:
    from huggingface_hub import HfApi, snapshot_download
except ImportError as e:
    done(error="huggingface_hub is not importable by %s (%s)" % (sys.executable, e))
try:
    commit = HfApi(token=token).model_info(cfg["repo"], revision=cfg["revision"]).sha
    source = "hf://%s@%s" % (cfg["repo"], commit)
    if source == cfg["recorded"] and cfg["intact"]:
        done(changed=False, commit=commit, source=source)
    local = os.path.join(cfg["stage"], "hub")
    os.makedirs(local, mode=0o700, exist_ok=True)
    snapshot_download(cfg["repo"], revision=commit, local_dir=local, token=token)
except Exception as e:
    done(error="%s: %s" % (type(e).__name__, str(e).replace(token or "\0", "[REDACTED]")))
files = {}
for base, dirs, names in os.walk(local):
    dirs[:] = sorted(d for d in dirs if d not in (".cache", ".git"))
    for name in sorted(names):
        path = os.path.join(base, name)
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        staged = os.path.join(cfg["stage"], h.hexdigest())
        if not os.path.exists(staged):
            os.link(path, staged)
        files[os.path.relpath(path, local)] = {"size": os.path.getsize(path), "sha256": h.hexdigest()}
done(changed=True, commit=commit, source=source, files=files)
"""


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


def download_command(spec: ProvisionSpec, source: HubSource, state: filesync.DirState, verify: bool,
                     token: str) -> Command:
    """Resolve the revision to a commit; download and stage the snapshot unless the host already holds that
    commit intact (its manifest's files unchanged)."""
    q = shlex.quote
    intact = bool(state.recorded) and set(trusted(state.recorded, state.present)) == set(state.recorded) \
        and not verify
    cfg = {"repo": source.repo, "revision": source.revision, "stage": filesync.staging_dir(spec.model_path),
           "recorded": state.source or "", "intact": intact, "endpoint": spec.hf_endpoint, "mark": RESULT_MARK}
    stage = filesync.staging_dir(spec.model_path)
    script = (f"set -eu\numask 022\nmkdir -p {q(posixpath.dirname(stage) or '/')}\numask 077\nmkdir -p {q(stage)}\n"
              f"py={q(spec.venv + '/bin/python')}; [ -x \"$py\" ] || py=python3\n"
              f"\"$py\" -c {q(PROGRAM)} {q(json.dumps(cfg, sort_keys=True))}\n")
    return Command(Op.HUB_DOWNLOAD, script, stdin=(token + "\n").encode(), timeout=24 * 3600, check=False)


def parse_result(text: str) -> HubResult:
    for line in reversed(text.splitlines()):
        if line.startswith(RESULT_MARK):
            try:
                raw = json.loads(line[len(RESULT_MARK):])
                files = {str(k): Entry(int(v["size"]), str(v["sha256"])) for k, v in dict(raw.get("files", {})).items()}
                return HubResult(bool(raw.get("changed")), raw.get("commit"), raw.get("source"), files,
                                 raw.get("error"))
            except (ValueError, KeyError, TypeError):
                break
    return HubResult(error="no result from the download script")
