"""Simulated NVIDIA GPUs (`nvidia-smi`) and vLLM (`vllm serve`) for the rehearsal lab.

The scripts in this directory run inside lab containers on a stock Debian python3: they use only the
standard library and import only each other. See README.md for the knobs and file formats.
"""
