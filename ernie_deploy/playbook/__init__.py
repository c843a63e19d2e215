"""Playbooks: plays of the toolkit's own tasks, read and checked completely before any host is touched."""
