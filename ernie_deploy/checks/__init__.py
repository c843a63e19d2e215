"""Post-deploy checks: pure judges of what a host said (journal lines, nvidia-smi CSV, HTTP answers).

Nothing here runs a command or opens a socket; orchestration/ gathers the output over
SSH (remote/) and passes it in.
"""

from ernie_deploy.checks.result import CheckInputError, CheckResult, Status, worst

__all__ = ["CheckInputError", "CheckResult", "Status", "worst"]
