"""Everything that talks to hosts: the one SSH factory, facts, converge, locks."""
