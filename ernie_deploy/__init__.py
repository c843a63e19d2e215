"""ernie-deploy: plan, render and deploy vLLM services to bare-metal GPU hosts."""

try:  # written at build time from git (hatch-vcs): the version and the commit it was built from
    from ernie_deploy._version import __version__ as __version__  # type: ignore[import-not-found, import-untyped, unused-ignore]
except ImportError:  # a tree that was never built (run from a source checkout without installing)
    __version__ = "0.1.0"
