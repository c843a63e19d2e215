"""An Ansible estate deploys as it is (issue 37): the lab's fleet written as a YAML inventory with a `!vault` API
key, an INI file, an inventory directory and an executable inventory script (their API key in a group_vars/ file
encrypted whole), the Hugging Face token from the controller's environment. `deploy` from the first form changes
a10-2; from every other form it finds nothing to change (the same plan), `verify` passes with the key, and the
two secrets are on the host in the env file (and its release copies) only: not in the journal, the audit log,
another file, or any process's command line; on the controller, not in the output or a file the tool wrote."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from estate import FORMS, write_forms

from ernie_deploy.cli.main import main
from ernie_deploy.lab import Lab, LabState
from lab.labhelpers import cleaned

pytestmark = pytest.mark.lab

HOST = "a10-2"
API_KEY = "lab-estate-key-5e0c2a"
HF_TOKEN = "hf_labEstate71d3"
PASSWORD = "lab-estate-vault"


@pytest.fixture(scope="module")
def estate_lab(lab: Lab, lab_state: LabState) -> Iterator[LabState]:
    with cleaned(lab, lab_state):
        yield lab_state


def run(capsys: pytest.CaptureFixture[str], command: str, args: list[str], *more: str) -> tuple[int, str, Any]:
    capsys.readouterr()
    rc = main([command, *args, "--limit", HOST, "--json", *more])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err, json.loads(captured.out)


def test_every_form_of_the_estate_deploys_the_same_and_its_secrets_stay_in_the_env_file(
        lab: Lab, estate_lab: LabState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LAB_HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("ERNIE_DEPLOY_STATE_DIR", str(tmp_path / "state"))
    data = yaml.safe_load(Path(estate_lab.inventory).read_text())
    fleet = {"all": {"vars": {"hf_token": "{{ lookup('env', 'LAB_HF_TOKEN') }}"},
                     "children": {"lab": data["all"]["children"]["lab"]}}}
    forms = write_forms(tmp_path / "estate", fleet, {"lab": {"vllm_api_key": API_KEY}}, PASSWORD)
    outputs: list[str] = []
    for form in FORMS:
        rc, out, doc = run(capsys, "deploy", forms[form], "--startup-budget", "60")
        outputs.append(out)
        (host,) = doc["hosts"]
        assert rc == 0, (form, host["message"])
        assert host["status"] == ("changed" if form == FORMS[0] else "ok"), (form, host["message"])
    rc, out, doc = run(capsys, "verify", forms["script"])
    outputs.append(out)
    assert rc == 0, doc
    rc, out, _ = run(capsys, "status", forms["ini"])
    outputs.append(out)
    assert rc == 0, out
    for secret in (API_KEY, HF_TOKEN):
        assert not [o for o in outputs if secret in o]
        written = [p for p in (tmp_path / "state").rglob("*") if p.is_file() and secret in p.read_text()]
        assert written == []
        # Every file on the host that holds it, the journal, and every process's command line.
        found = lab.ssh(HOST, f"grep -rlF {secret} /etc /var /run /root /tmp /opt 2>/dev/null; "
                              f"journalctl --no-pager -o cat | grep -cF {secret}; "
                              f"ps -eo args | grep -F {secret} | grep -v grep | wc -l").stdout.split()
        files, journal, processes = found[:-2], found[-2], found[-1]
        env_file = "/etc/ernie-deploy/ernie-vllm-0.env"
        assert env_file in files, files
        assert all(f == env_file or (f.startswith("/var/lib/ernie-deploy/releases/") and f.endswith(".env"))
                   for f in files), files
        assert (journal, processes) == ("0", "0")
