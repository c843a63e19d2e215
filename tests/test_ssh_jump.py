"""Jump hosts written the way Ansible inventories write them (`ansible_ssh_common_args`)."""

from __future__ import annotations

import logging

import pytest

from ernie_deploy.errors import DeployError
from ernie_deploy.remote.ssh import Hop, Target, jump_hops


@pytest.mark.parametrize(("args", "hops"), [
    ("-o ProxyJump=bastion", (Hop("bastion"),)),
    ("-o ProxyJump=ops@bastion.dc1:2222", (Hop("bastion.dc1", 2222, "ops"),)),
    ("-oProxyJump=bastion", (Hop("bastion"),)),
    ("-o 'ProxyJump bastion'", (Hop("bastion"),)),
    ("-J a@jump1,jump2:2200", (Hop("jump1", 22, "a"), Hop("jump2", 2200))),
    ("-Jjump1", (Hop("jump1"),)),
    ("-o proxyjump=[fd00::1]:2222", (Hop("fd00::1", 2222),)),
    ("-o ProxyJump=none", ()),
    ("", ()),
])
def test_jump_hosts_from_ansible_ssh_args(args: str, hops: tuple[Hop, ...]) -> None:
    assert jump_hops({"ansible_ssh_common_args": args}, "gpu-01") == hops


def test_extra_args_are_read_too_and_first_hop_comes_first() -> None:
    target = Target.from_host("gpu-01", "10.0.0.5", 22, "root", {"ansible_ssh_extra_args": "-J b1,b2"})
    assert [h.host for h in target.jump] == ["b1", "b2"]


def test_other_ssh_options_are_named_as_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        hops = jump_hops({"ansible_ssh_common_args": "-o StrictHostKeyChecking=no -J bastion"}, "gpu-01")
    assert hops == (Hop("bastion"),)
    assert "gpu-01" in caplog.text and "StrictHostKeyChecking=no" in caplog.text


@pytest.mark.parametrize(("args", "message"), [
    ("-J 'bad host'", "'bad host' is not [user@]host[:port]"),
    ("-J bastion:99999", "'bastion:99999' is not [user@]host[:port]"),
    ("-J a,,b", "'' is not [user@]host[:port]"),
    ("-o 'ProxyJump=bastion", "No closing quotation"),
])
def test_bad_jump_specs_name_the_host_and_variable(args: str, message: str) -> None:
    with pytest.raises(DeployError) as err:
        jump_hops({"ansible_ssh_common_args": args}, "gpu-01")
    assert message in err.value.message
    assert "gpu-01" in str(err.value) and "ansible_ssh_common_args" in str(err.value)
