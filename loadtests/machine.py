"""One line that says what a benchmark ran on, for the reports."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

import psutil

from serve_app.config import HeadroomConfig
from serve_app.planning.catalogue import CatalogueKeyError, GpuSpec, gpu
from serve_app.planning.from_config import cluster_spec, describe_cluster
from serve_app.planning.request import ClusterSpec


def gpu_names() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    out = subprocess.run(query, capture_output=True, text=True, check=False).stdout
    return [name.strip() for name in out.splitlines() if name.strip()]


def _catalogue_gpu() -> GpuSpec | None:
    """The planner's catalogue entry for this machine's first GPU; None without a GPU or for one it lacks."""
    names = gpu_names()
    try:
        return gpu(names[0]) if names else None
    except CatalogueKeyError:
        return None


def cluster_here(cfg: HeadroomConfig, gpus_per_node: int = 1) -> tuple[ClusterSpec, str]:
    """The cluster to predict this machine's engines for, and a phrase that names it: the config's where this
    machine has its GPU (its memory as the config gives it) or one the catalogue lacks, else the GPU this
    machine has. (The H200 config also runs on H100s, whose engines size their KV cache from their memory.)"""
    configured = cluster_spec(cfg, gpus_per_node=gpus_per_node)
    here = _catalogue_gpu() if configured.gpu is not None else None
    if here is None or here.name == configured.gpu.name:
        where = "the config's" if here is None else "the config's, which this machine has"
        return configured, f"{describe_cluster(cfg, configured)} ({where})"
    cluster = ClusterSpec.of(here.name, gpus_per_node=gpus_per_node)
    return cluster, f"{describe_cluster(cfg, cluster)} (the GPU this machine has, not the config's)"


def describe() -> str:
    """E.g. 'x86_64, 32 CPUs, 252 GiB RAM, 2 x NVIDIA H200' or '..., no GPU (vLLM CPU backend)'."""
    gpus = gpu_names()
    where = f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU (vLLM CPU backend)"
    mem_gib = psutil.virtual_memory().total / 1024**3
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {mem_gib:.0f} GiB RAM, {where}"
