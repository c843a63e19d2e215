"""Export: the plan written as content other engines run (a self-contained Ansible project)."""
