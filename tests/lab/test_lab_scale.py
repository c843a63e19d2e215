"""The lab must run at least 16 simulated hosts on this machine, and the toolkit must work across them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ernie_deploy.cli.main import main
from ernie_deploy.lab import Lab
from ernie_deploy.lab.spec import parse_spec

pytestmark = pytest.mark.lab


def test_sixteen_hosts_boot_and_report_their_gpus(capsys: pytest.CaptureFixture[str], lab: Lab,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """A second lab beside the session's (own directory, own addresses from 127.0.2.1), torn down at the end."""
    spec = parse_spec({"first_address": "127.0.2.1",
                       "hosts": [{"name": "scale", "count": 16, "gpu_model": "NVIDIA A10", "gpu_count": 2}]})
    big = Lab(tmp_path_factory.mktemp("lab16"))
    try:
        started = time.monotonic()
        state = big.up(spec)
        took = time.monotonic() - started
        statuses = big.status()
        assert [s.state for s in statuses] == ["ssh-ready"] * 16, statuses
        assert [s.address for s in statuses] == [f"127.0.2.{k}" for k in range(1, 17)]
        capsys.readouterr()
        rc = main(["facts", "-i", state.inventory, "--forks", "16", "--json"])
        hosts = json.loads(capsys.readouterr().out)["hosts"]
        assert rc == 0 and sorted(hosts) == sorted(f"scale-{k}" for k in range(1, 17))
        for name, found in hosts.items():
            assert found["error"] is None, (name, found["error"])
            assert [g["name"] for g in found["facts"]["gpus"]] == ["NVIDIA A10", "NVIDIA A10"], name
        print(f"16 hosts SSH-ready in {took:.1f} s")
    finally:
        big.down()
    assert big.status() == [] and not list(Path(big.dir).glob("machines/*"))
