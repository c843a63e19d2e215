"""The peer's rolling restart in pyinfra (run with --serial: one host at a time): restart, poll /health."""

from pyinfra import host
from pyinfra.operations import server, systemd

systemd.service(name="Restart", service="ernie-vllm-0.service", restarted=True)
server.shell(name="Healthy", commands=[
    "python3 -c \"import time, urllib.request as u\nfor _ in range(240):\n    try:\n"
    f"        u.urlopen('http://{host.data.ssh_hostname}:8000/health', timeout=2); break\n"
    "    except Exception: time.sleep(0.5)\nelse: raise SystemExit(1)\""])
