"""Where ernie-deploy keeps its own state on a host (all root-owned, mode 0700)."""

STATE_DIR = "/var/lib/ernie-deploy"
RELEASES_DIR = f"{STATE_DIR}/releases"
STAGING_DIR = f"{STATE_DIR}/staging"
# Units whose files were staged but not activated yet: a later run restarts them even though their files
# already match, so a stage without its activate never reads as "nothing to change".
PENDING_FILE = f"{STATE_DIR}/pending"
# Used GPU memory per GPU right before each unit last started: the release gate waits for it after a stop.
BASELINE_DIR = f"{STATE_DIR}/baseline"
AUDIT_LOG = "/var/log/ernie-deploy/audit.log"
