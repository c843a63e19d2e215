"""Every JSON document's schema name, apart so the command line can name them in --help without loading the
renderers. (The rollout state file's own format name lives with that file, orchestration/resume.py.)"""

RESULTS_SCHEMA = "ernie-deploy/deploy/v3"  # deploy, restart, rollback, verify
PLAN_SCHEMA = "ernie-deploy/plan/v1"  # plan, explain
RENDER_SCHEMA = "ernie-deploy/render/v1"
EXPORT_SCHEMA = "ernie-deploy/export/v1"
PROVISION_SCHEMA = "ernie-deploy/provision/v1"
RELEASES_SCHEMA = "ernie-deploy/releases/v1"
FACTS_SCHEMA = "ernie-deploy/facts/v2"  # v2: each host's driver check against its vLLM (docs/drivers.md)
RUN_SCHEMA = "ernie-deploy/run/v1"
STATUS_SCHEMA = "ernie-deploy/status/v1"
