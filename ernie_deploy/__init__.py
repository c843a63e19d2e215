"""ernie-deploy: plan, render and deploy vLLM services to bare-metal GPU hosts."""

__version__ = "0.1.0"
