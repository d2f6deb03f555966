"""Running a scaled-out server: start (or join) a Ray cluster, deploy the engine replicas and
the ingress as one Serve application, serve until SIGTERM/SIGINT, then drain and stop."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from typing import Any

import ray
from ray import serve
from ray.serve import context as serve_context
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from vivace.cluster import proxy
from vivace.cluster.config import ClusterConfig, Scaling, VersionSpec
from vivace.cluster.ingress import Ingress
from vivace.cluster.replica import EngineReplica
from vivace.cluster.router import ROUTERS
from vivace.server.settings import ServerSettings

logger = logging.getLogger("vivace.cluster")

APP_NAME = "vivace"
MAX_ONGOING = 1024  # per replica: the engine queues and admission control bounds, not Serve
# The variables a cluster started here runs with. Serve pushes autoscaling metrics every 10 s
# by default: too slow to follow queue depth. Its HTTP proxy gets vivace's request ids.
_CLUSTER_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
                "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
                "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": proxy.CALLBACK}


def _scaling_options(scaling: Scaling) -> dict[str, Any]:
    if scaling.replicas is not None:
        return {"num_replicas": scaling.replicas}
    # Queue depth is averaged over the shorter delay, within Serve's bounds: more than its
    # metrics interval (10 s; it warns below) and at most its default look-back (30 s).
    window = min(max(min(scaling.upscale_delay, scaling.downscale_delay), 11.0), 30.0)
    return {"autoscaling_config": {
        "min_replicas": scaling.min_replicas, "max_replicas": scaling.max_replicas,
        "target_ongoing_requests": scaling.target_ongoing_requests,
        "upscale_delay_s": scaling.upscale_delay, "downscale_delay_s": scaling.downscale_delay,
        "look_back_period_s": window,
        "policy": {"policy_function": "vivace.cluster.autoscale:queue_depth_policy"}}}


def _router(routing: str, version: VersionSpec) -> RequestRouterConfig:
    kwargs = {}
    if routing == "prefix":
        kwargs = {"block_size": version.engine.block_size,
                  "capacity_blocks": version.engine.num_kv_blocks or 4096}
    return RequestRouterConfig(request_router_class=ROUTERS[routing], request_router_kwargs=kwargs)


def build_application(config: ClusterConfig, settings: ServerSettings) -> Application:
    """The Serve application: one engine deployment per version, and the ingress."""
    engines = {}
    for i, model in enumerate(config.models):
        for version in model.versions:
            name = config.deployment_names[i, version.name]
            deployment = serve.deployment(EngineReplica).options(
                name=name, max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0},
                health_check_period_s=2.0, graceful_shutdown_timeout_s=settings.shutdown_timeout_s,
                request_router_config=_router(config.routing, version),
                **_scaling_options(version.scaling))
            engines[name] = deployment.bind(version.engine, model.name or settings.served_model_name or "",
                                            version.name)
    ingress = serve.deployment(Ingress).options(
        name="ingress", max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=settings.shutdown_timeout_s)
    return ingress.bind(config, settings, engines)


class _Signals:
    """SIGTERM and SIGINT, heard in the main thread: the first one sets ``stopping`` and wakes
    :meth:`wait`; later ones are ignored (the drain they would interrupt is under way)."""

    def __init__(self) -> None:
        self.stopping: str | None = None
        self._wake = threading.Event()

    def install(self) -> None:
        """Puts the handlers on; again after ``ray.init``, as Ray's core worker then puts a
        handler on SIGTERM that aborts the process, leaving the cluster's processes behind."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._heard)

    def _heard(self, signum: int, frame: object) -> None:
        if self.stopping is None:
            self.stopping = signal.Signals(signum).name
            self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def wait(self) -> None:
        """Until a signal (or :meth:`wake`) since the last call."""
        self._wake.wait()
        self._wake.clear()


class _Deployment(threading.Thread):
    """Starts Serve and deploys the application off the main thread, where a signal can stop
    the start-up at any point (one raised into Ray's calls would not unwind them cleanly).
    ``error`` is what failed; ``submitted`` whether the application was handed to Serve."""

    def __init__(self, config: ClusterConfig, settings: ServerSettings, signals: _Signals) -> None:
        super().__init__(name="vivace-deploy", daemon=True)
        self.config, self.settings, self.signals = config, settings, signals
        self.error: BaseException | None = None
        self.submitted = False

    def run(self) -> None:
        settings = self.settings
        try:
            serve.start(http_options={"host": settings.host, "port": settings.port},
                        logging_config={"log_level": settings.log_level.upper()})
            if self.config.ray_address is not None:
                _check_proxy_address(settings.host, settings.port)
            self.submitted = True
            serve.run(build_application(self.config, settings), name=APP_NAME, route_prefix="/")
        except BaseException as exc:  # handed to the main thread
            self.error = exc
        finally:
            self.signals.wake()


def _check_port_free(host: str, port: int) -> None:
    """Raise ValueError unless ``host:port`` can be listened on (as Ray's HTTP proxy binds it),
    before seconds go into starting Ray."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _check_proxy_address(host: str, port: int) -> None:
    """On a joined cluster whose Serve already runs, its HTTP proxy stays where it listens:
    raise ValueError when that is not ``host:port`` (the application would be served there)."""
    proxy = serve_context._get_global_client().http_config
    if (proxy.host, proxy.port) != (host, port):
        raise ValueError(f"Ray Serve already runs on this cluster with its HTTP proxy on "
                         f"{proxy.host}:{proxy.port}, which a new application cannot move to "
                         f"{host}:{port}: serve there (--host {proxy.host} --port {proxy.port}) "
                         f"or stop Serve first (serve shutdown)")


def run_cluster(config: ClusterConfig, settings: ServerSettings) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit status (0 clean, 1 failed to deploy).
    A cluster started here is stopped on the way out; on a joined one (``ray_address``) only
    this application is deleted; the same when a signal comes during start-up. Raises
    ValueError when the HTTP address cannot be served."""
    local = config.ray_address is None
    if local:
        _check_port_free(settings.host, settings.port)
        for name, value in _CLUSTER_ENV.items():
            os.environ.setdefault(name, value)
    signals = _Signals()
    signals.install()
    deployment = _Deployment(config, settings, signals)
    try:
        ray.init(address=config.ray_address, include_dashboard=False,
                 logging_level=settings.log_level.upper(), log_to_driver=True)
        signals.install()
        deployment.start()
        signals.wait()
        if signals.stopping is None:
            if isinstance(deployment.error, RuntimeError):
                origins = "; ".join(v.origin for m in config.models for v in m.versions)
                logger.error("the application failed to deploy (models from %s): %s", origins, deployment.error)
                return 1
            if deployment.error is not None:
                raise deployment.error
            logger.info("serving on http://%s:%d", settings.host, settings.port)
            signals.wait()
        logger.info("%s: stopping", signals.stopping)
        return 0
    finally:
        if deployment.submitted:
            serve.delete(APP_NAME)  # drains: replicas finish what they have in flight
        if local and ray.is_initialized():
            serve.shutdown()
        ray.shutdown()
