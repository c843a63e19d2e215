"""The playbook actions' names, in the order the docs list them: apart from schema.py so `run --help` names
them without loading the playbook checker (a test keeps the two the same)."""

ACTION_NAMES = ("provision", "plan", "converge", "rolling", "restart", "wait_ready", "verify", "gpu_check", "hook",
                "pause", "command")
