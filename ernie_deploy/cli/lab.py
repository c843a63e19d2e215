"""`ernie-deploy lab up|status|down`: thin commands over ernie_deploy.lab.lab.Lab."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ernie_deploy.lab.lab import Lab

_DESCRIPTION = (
    "The rehearsal lab: one systemd-nspawn container per simulated GPU host, each with real systemd, "
    "journald and sshd on its own loopback address (127.0.0.N:22), a simulated nvidia-smi and a simulated "
    "`vllm serve`, and balancer hosts (`role: balancer`) with Debian's HAProxy for `deploy` to configure. "
    "No GPU, and real vLLM only where the spec asks for it (`vllm: real`). Needs root. State lives in ./.lab "
    "(or $ERNIE_LAB_DIR); the root file system is cached in /var/cache/ernie-deploy (or $ERNIE_LAB_CACHE). "
    "Hosts come with vLLM installed unless booted --bare. See docs/lab.md."
)


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add `lab` and its subcommands to the top-level CLI."""
    lab = subparsers.add_parser("lab", help="boot, inspect or stop the local rehearsal lab (needs root)",
                                description=_DESCRIPTION)
    sub = lab.add_subparsers(dest="lab_command", required=True, metavar="SUBCOMMAND")

    p = sub.add_parser("up", help="build (once) and boot the lab hosts; write an inventory for them",
                       description="Boot every host of the spec and wait until each accepts a strict SSH "
                                   "login. The first run builds a Debian root file system with debootstrap "
                                   "(about a minute); later runs reuse it. If the same lab is already "
                                   "running this only copies the current simulators into it; leftovers of a crashed "
                                   "lab are cleaned first.")
    p.add_argument("--spec", type=Path, metavar="FILE",
                   help="lab spec YAML (default: the bundled four-host lab, ernie_deploy/data/lab-default.yml)")
    p.add_argument("--inventory-out", type=Path, metavar="PATH",
                   help="where to write the Ansible inventory of the lab hosts (default: <lab dir>/inventory.yml)")
    p.add_argument("--bare", action="store_true",
                   help="boot every host as a freshly imaged GPU box: a driver (simulated nvidia-smi) but no vLLM, "
                        "no service user and no model, for `ernie-deploy provision` (docs/provisioning.md)")
    p.add_argument("--json", action="store_true", help="print the lab's hosts, paths and timings as JSON")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("status", help="show each lab host, its address, state and simulated GPUs",
                       description="States: ssh-ready (sshd answers a strict login), running (container up, "
                                   "sshd not answering), stopped (container gone). Balancer hosts are listed with "
                                   "their HAProxy frontend URL (it answers once `deploy` has configured HAProxy).")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("down", help="stop every lab container and remove its trees, keys and state",
                       description="Power off each container this lab started (SIGTERM to its nspawn, "
                                   "SIGKILL after 20 s), unmount and delete the host trees, the keys, "
                                   "known_hosts, inventory and state. The cached root file system stays.")
    p.set_defaults(func=cmd_down)


def _lab() -> Lab:
    from ernie_deploy.lab.lab import Lab
    from ernie_deploy.output import console
    return Lab(progress=console.note)


def cmd_up(args: argparse.Namespace) -> int:
    from ernie_deploy.lab.spec import load_spec
    from ernie_deploy.output import console
    from ernie_deploy.output.lab import show_up
    spec = load_spec(args.spec)
    if args.bare:
        spec = spec.all_bare()
    lab = _lab()
    with console.status(f"lab up: {len(spec.hosts) + len(spec.balancers)} hosts from {spec.source}"):
        state = lab.up(spec, inventory_out=args.inventory_out)
    show_up(state, json=args.json)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ernie_deploy.output.lab import show_status
    lab = _lab()
    show_status(lab.dir, lab.status(), json=args.json, balancers=lab.balancer_status())
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from ernie_deploy.output.lab import show_down
    lab = _lab()
    show_down(lab.down(), lab.dir)
    return 0
