"""The import path of headroom's Ray Serve application, for Ray's own CLI and rendered Serve configs:

    serve run serve_app.app:build_app env=local            # configs/base.yaml + configs/local.yaml
    serve run serve_app.app:build_app config=my.yaml       # one file (or several, comma-separated)

on any Ray cluster (RAY_ADDRESS), or `headroom serve`. The deployment itself is in
serve_app/serving/deployment.py.
"""

from serve_app.serving.deployment import build_app

__all__ = ["build_app"]
