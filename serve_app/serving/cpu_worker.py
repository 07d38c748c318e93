"""Imported by vLLM in each CPU engine's worker process (`--worker-extension-cls`, which engine_args.py sets
for the CPU backend): it asks Linux for the AMX tile registers before the worker's first forward pass.

vLLM's CPU attention runs AMX tile instructions on CPUs that have them (Sapphire Rapids and later) without
first making the request Linux requires for them (arch_prctl ARCH_REQ_XCOMP_PERM, which torch.cpu._init_amx
makes); oneDNN makes it for its own larger matrix products. When a worker's first forward pass is too small
for oneDNN to have made it (vLLM 0.32: a first prompt of a few tokens, with or without a draft model), the
worker dies with SIGILL and the engine with it. On a CPU without AMX the call does nothing.
"""

import torch

torch.cpu._init_amx()


class RequestAMXTiles:
    """The extension class vLLM mixes into its worker class: empty, as importing this module is the point."""
