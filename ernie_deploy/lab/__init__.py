"""The rehearsal lab: systemd-nspawn containers that pretend to be GPU hosts (docs/lab.md).

Python API: `Lab(directory=None).up(spec) -> LabState`, `.status()`, `.balancer_status()`, `.ssh(host, command)`,
`.down()`; `load_spec(path)` reads a lab spec.
"""

from ernie_deploy.lab.lab import BalancerStatus, HostStatus, Lab
from ernie_deploy.lab.spec import BalancerSpec, HostSpec, LabSpec, load_spec, parse_spec
from ernie_deploy.lab.state import HostState, LabState

__all__ = ["BalancerSpec", "BalancerStatus", "HostSpec", "HostState", "HostStatus", "Lab", "LabSpec", "LabState",
           "load_spec", "parse_spec"]
