"""Ray glue of prefix-affinity routing: the RequestRouter that picks the replica, and the small deployment
that HAProxy asks before it forwards a POST.

With HAProxy direct ingress (serve_options.SERVE_CLUSTER_ENV) HTTP never passes through a Serve
RequestRouter, and Serve refuses a custom one on the ingress deployment, except when the app carries an
"ingress request router" (`Application._with_ingress_request_router`, Ray 2.60's hook for Serve LLM's
direct streaming). Then, for each POST to the app, HAProxy's Lua action sends the request body and its
session header to `POST /internal/route` on a `PrefixRouter` replica of its node, which answers
`{"replica_id": ...}`, and HAProxy forwards the original request straight to that replica: still one hop
for the request, plus a side call for the decision. GETs (/v1/models, /health) skip the router.
PrefixRouter picks with `DeploymentHandle.choose_replica(..., _reserve=False)`, which runs LLMServer's
RequestRouter, here `PrefixAffinityRouter`; Serve's own fallback proxy uses it too. A router that cannot
be reached turns the app's POSTs into 503s (HAProxy's rule, no fallback), hence two router replicas per
node.

The decisions themselves are pure (serving/routing.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError
from ray.serve import Application, Deployment
from ray.serve._private.http_util import parse_session_id_header
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from ray.util import metrics
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app.serving.routing import (
    PROBE_DEADLINE_S,
    ROUTING_KEY_KWARG,
    LoadBook,
    choose_replica,
    routing_key,
)

ROUTING_DECISIONS = "headroom_routing_decisions_total"
ROUTER_DEPLOYMENT_NAME = "PrefixRouter"


class PrefixAffinityRouter(RequestRouter):
    """LLMServer's RequestRouter under `deployment.routing: prefix_affinity` (serving/routing.py decides)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._book = LoadBook()
        self._probe: asyncio.Task | None = None  # the probe out, if any
        self._decisions = metrics.Counter(
            ROUTING_DECISIONS,
            description="Prefix-affinity routing decisions: preferred replica, spilled, or no key.",
            tag_keys=("application", "decision"),
        )
        self._decisions.set_default_tags({"application": self.app_name})

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []  # Serve waits for replicas
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if self._book.should_probe(time.monotonic()):
            self._start_probe(candidate_replicas)
        key, tie_break = None, ""
        if pending_request is not None:
            meta = pending_request.metadata
            # The router deployment passes the body's key; Serve's fallback proxy has only the session.
            key = pending_request.kwargs.get(ROUTING_KEY_KWARG) or (
                f"session:{meta.session_id}" if meta.session_id else None
            )
            tie_break = meta.internal_request_id
        capacities = {i: r.max_ongoing_requests for i, r in by_id.items()}
        choice = choose_replica(key, tie_break, self._book.loads(by_id), capacities)
        if choice.decision == "spilled" and self._book.should_confirm(time.monotonic()):
            if not self._book.probe_out:
                self._start_probe(candidate_replicas)
            assert self._probe is not None
            await asyncio.shield(self._probe)  # shared by every decision waiting for it
            choice = choose_replica(key, tie_break, self._book.loads(by_id), capacities)
        self._book.picked(choice.replica_id, time.monotonic())
        self._decisions.inc(tags={"decision": choice.decision})
        return [[by_id[choice.replica_id]]]

    def _start_probe(self, replicas: list[RunningReplica]) -> None:
        self._book.probe_started(time.monotonic())
        self._probe = asyncio.get_running_loop().create_task(self._probe_loads(replicas))

    async def _probe_loads(self, replicas: list[RunningReplica]) -> None:
        """Every replica's in-flight count, in the background: only a spill that rests on picks no probe has
        answered for yet waits for it (LoadBook.should_confirm)."""
        counts: dict[str, int | None] = {}

        async def count(replica: RunningReplica) -> None:
            try:
                counts[replica.replica_id.unique_id] = await asyncio.wait_for(
                    replica.get_queue_len(deadline_s=PROBE_DEADLINE_S), PROBE_DEADLINE_S
                )
            except ActorDiedError:
                self.on_replica_actor_died(replica.replica_id)
            except Exception:  # late or unavailable: keep the estimate until the next probe
                counts[replica.replica_id.unique_id] = None

        try:
            await asyncio.gather(*(count(r) for r in replicas))
        finally:
            self._book.probe_finished(counts)


@serve.ingress()
class PrefixRouter:
    """Answers HAProxy's `POST /internal/route`: which LLMServer replica gets this request."""

    def __init__(self, llm: DeploymentHandle):
        self._llm = llm

    async def __serve_build_asgi_app__(self) -> Starlette:
        return Starlette(routes=[Route("/internal/route", self.route, methods=["POST"])])

    async def route(self, request: Request) -> Response:
        # HAProxy forwards the body (cut at its buffer size: then not JSON, and routed by load alone).
        session_id = parse_session_id_header(dict(request.scope["headers"])) or None
        key = routing_key(await request.body(), session_id)
        try:
            async with self._llm.choose_replica(_reserve=False, **{ROUTING_KEY_KWARG: key}) as selection:
                replica = ReplicaID(selection.replica_id, self._llm.deployment_id)
        except DeploymentUnavailableError as e:  # HAProxy answers the client 503 on any non-200
            return Response(json.dumps({"error": str(e)}), status_code=503, media_type="application/json")
        return JSONResponse({"replica_id": replica.to_full_id_str()})


def with_prefix_router(llm: Deployment, *init_args: Any) -> Application:
    """The LLMServer application routed by PrefixAffinityRouter, with its PrefixRouter attached (through
    Ray 2.60's internal, unstable hook). Serve places the router itself, without CPUs, on every node that
    runs HAProxy (serve_options.ROUTING_CLUSTER_ENV says how many per node)."""
    app = llm.options(request_router_config={"request_router_class": PrefixAffinityRouter}).bind(*init_args)
    router = serve.deployment(PrefixRouter).options(
        name=ROUTER_DEPLOYMENT_NAME,
        max_ongoing_requests=4096,  # never the bottleneck: HAProxy's own limit is 4096 connections
    )
    return app._with_ingress_request_router(router.bind(app))
