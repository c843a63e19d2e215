"""Every JSON document's schema name, apart so the command line can name them in --help without loading the
renderers. (The rollout state file's own format name lives with that file, orchestration/resume.py.)"""

RESULTS_SCHEMA = "ernie-deploy/deploy/v5"  # deploy, restart, rollback
# verify: the same host results; its checks are what it is read for. v2: each host's "bench" (--bench)
VERIFY_SCHEMA = "ernie-deploy/verify/v2"
PLAN_SCHEMA = "ernie-deploy/plan/v2"  # plan, explain; v2: the balancers (docs/balancer.md)
RENDER_SCHEMA = "ernie-deploy/render/v1"
EXPORT_SCHEMA = "ernie-deploy/export/v1"
PROVISION_SCHEMA = "ernie-deploy/provision/v1"
RELEASES_SCHEMA = "ernie-deploy/releases/v2"  # v2: each release's "failed" record (docs/releases.md)
# facts v2: each host's driver check against its vLLM (docs/drivers.md); v3: the vLLM each running process uses
FACTS_SCHEMA = "ernie-deploy/facts/v3"
RUN_SCHEMA = "ernie-deploy/run/v1"
# status v2: the vLLM the processes run, and the installed one; v3: balancers; v4: each instance's "progress"
# (state, healthy, evidence, fix, the readings; null when it does not serve), and drift of kind "progress"; v5: each
# instance's "death" (text, fix, serving: how its engine last died and what followed; null when it has not died)
# and the progress state "not-generating"
STATUS_SCHEMA = "ernie-deploy/status/v5"
BENCH_SCHEMA = "ernie-deploy/bench/v1"  # per instance: workload, results, SLO verdicts, vLLM's raw result
CALIBRATE_SCHEMA = "ernie-deploy/calibrate/v1"  # per canary: candidates, measurements, winner, restore
# rounds (instances' progress, restart decisions), end state (docs/watch.md); v2: each instance's "death" and the
# progress state "not-generating"
WATCH_SCHEMA = "ernie-deploy/watch/v2"
