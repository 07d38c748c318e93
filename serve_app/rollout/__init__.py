"""Config-driven rollouts on Ray Serve's own deploy path: render, diff, roll out (verify, roll back), status.

    headroom render  --env staging --out staging.serve.yaml   # the file `serve deploy` reads
    headroom diff    --env staging --env prod --gpus 8         # field by field, with the plan's consequences
    headroom rollout --env staging --address http://head:8265  # deploy, wait, smoke-test, keep or roll back
    headroom status  --address http://head:8265

The modules, pure first:
- rendering     config -> Ray Serve config (ServeDeploySchema), its hash, the rolling-update surge
- changes       what differs between two rendered deployments, field by field
- serve_state   Serve's reported state as data: what runs, what a deploy changes, whether an app is ready
- smoke_gate    a smoke load's summary judged against the config's SLO (the load is injected)
- history       rendered configs and one JSON line per rollout under the state directory
- dashboard     the dashboard address, Ray's token authentication, and the HTTP calls (ServeCluster)
- run           rollout(): prepare, deploy, verify, roll back, record
- cluster_status status(): what the cluster runs and the last rollout per environment
"""

from serve_app.rollout.changes import FieldChange, diff, diff_rendered, format_changes
from serve_app.rollout.cluster_status import format_status, status
from serve_app.rollout.dashboard import (
    DEFAULT_DASHBOARD_ADDRESS,
    ClusterAPI,
    ServeCluster,
    dashboard_auth_headers,
    dashboard_url,
)
from serve_app.rollout.errors import RolloutError
from serve_app.rollout.history import STATE_DIR_ENV, append_history, last_rollouts, read_history, state_dir
from serve_app.rollout.rendering import (
    DEPLOYMENT_NAME,
    IMPORT_PATH,
    Rendered,
    Target,
    config_hash,
    load_target,
    render,
    render_target,
)
from serve_app.rollout.run import RolloutResult, prepare, rollout
from serve_app.rollout.serve_state import AppHealth, assess_app, deploy_body
from serve_app.rollout.smoke_gate import GateResult, SmokeOptions, SmokeRunner, gate

__all__ = [
    "DEFAULT_DASHBOARD_ADDRESS",
    "DEPLOYMENT_NAME",
    "IMPORT_PATH",
    "STATE_DIR_ENV",
    "AppHealth",
    "ClusterAPI",
    "FieldChange",
    "GateResult",
    "Rendered",
    "RolloutError",
    "RolloutResult",
    "ServeCluster",
    "SmokeOptions",
    "SmokeRunner",
    "Target",
    "append_history",
    "assess_app",
    "config_hash",
    "dashboard_auth_headers",
    "dashboard_url",
    "deploy_body",
    "diff",
    "diff_rendered",
    "format_changes",
    "format_status",
    "gate",
    "last_rollouts",
    "load_target",
    "prepare",
    "read_history",
    "render",
    "render_target",
    "rollout",
    "state_dir",
    "status",
]
