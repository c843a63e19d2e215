"""How systemd brings back an instance whose engine died: the unit's restart settings (templates/vllm.service.j2).

vLLM exits 0 when its engine dies (vLLM issue #48966; measured on 0.32.0, docs/systemd.md), the exit status of a
requested stop, so only `Restart=always` restarts it; systemd never restarts a unit after a stop it was asked for
(systemd.service(5), Restart=). The start limit bounds a crash loop: the sixth start within the interval is
refused and the unit stays failed (`start-limit-hit`, systemd.unit(5)). ernie-deploy clears the count before each
start of its own (remote/converge.py), so only systemd's restarts count against it.
"""

RESTART = "always"
RESTART_SEC = 10
START_LIMIT_INTERVAL_S = 600
START_LIMIT_BURST = 5
