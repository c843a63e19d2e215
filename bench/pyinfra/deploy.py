"""The peer job in pyinfra: put the units and env files ernie-deploy rendered (RENDER_DIR/HOST/...), restart
(with daemon-reload) only when one changed, make sure every unit runs and is enabled, poll /health."""

import os
from pathlib import Path

from pyinfra import host
from pyinfra.operations import files, server, systemd
from pyinfra.operations.util import any_changed

render = Path(os.environ["RENDER_DIR"]) / host.name
files.directory(name="Env file directory", path="/etc/ernie-deploy", mode="700")
for unit in sorted((render / "etc/systemd/system").glob("*.service")):
    env = render / "etc/ernie-deploy" / unit.name.replace(".service", ".env")
    put_unit = files.put(name=f"Unit {unit.name}", src=str(unit), dest=f"/etc/systemd/system/{unit.name}", mode="644")
    put_env = files.put(name=f"Env {env.name}", src=str(env), dest=f"/etc/ernie-deploy/{env.name}", mode="600")
    systemd.service(name=f"Restart {unit.name}", service=unit.name, restarted=True, daemon_reload=True,
                    _if=any_changed(put_unit, put_env))
    systemd.service(name=f"Running {unit.name}", service=unit.name, running=True, enabled=True)
server.shell(name="Healthy", commands=[
    "python3 -c \"import time, urllib.request as u\nfor _ in range(240):\n    try:\n"
    f"        u.urlopen('http://{host.data.ssh_hostname}:8000/health', timeout=2); break\n"
    "    except Exception: time.sleep(0.5)\nelse: raise SystemExit(1)\""])
