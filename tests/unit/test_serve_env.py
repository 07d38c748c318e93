"""The environment headroom gives a replica's vLLM engine core: `vllm serve`'s, not Ray's worker defaults."""

from __future__ import annotations

import pytest

from serve_app.serving.serve_options import restore_vllm_serve_env


@pytest.mark.parametrize(
    ("environ", "started_with", "removed", "left"),
    [
        # Ray set OMP_NUM_THREADS after the worker started: removed, as `vllm serve` would not have it.
        ({"OMP_NUM_THREADS": "1", "PATH": "/bin"}, {"PATH": "/bin"}, ["OMP_NUM_THREADS"], {"PATH": "/bin"}),
        # The user's own value (in the cluster's or the app's environment) was there at start: kept.
        ({"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "4"}, [], {"OMP_NUM_THREADS": "4"}),
        # Nothing set: nothing to do.
        ({"PATH": "/bin"}, {"PATH": "/bin"}, [], {"PATH": "/bin"}),
        # Other variables set after the start (CUDA_VISIBLE_DEVICES from Ray) are not Ray defaults: kept.
        ({"CUDA_VISIBLE_DEVICES": "1"}, {}, [], {"CUDA_VISIBLE_DEVICES": "1"}),
    ],
)
def test_restore_vllm_serve_env(environ, started_with, removed, left):
    env = dict(environ)
    assert restore_vllm_serve_env(env, started_with) == removed
    assert env == left
