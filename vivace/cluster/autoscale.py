"""Queue-depth autoscaling policy for the engine deployments (Ray Serve pickles this module by
value into its controller, so it imports nothing of vivace).

Desired replicas = the engines' own queue depth (requests running + waiting, each replica's
``record_autoscaling_stats``, averaged over the look-back window) summed over replicas, over
``target_ongoing_requests``. Before any replica has reported, Serve's count of ongoing requests
stands in. Serve applies the bounds and the up/down-scale delays around it.
"""

from __future__ import annotations

from typing import Any


def queue_depth_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """A Serve custom autoscaling policy: ``ctx`` is an ``AutoscalingContext``."""
    depths = (ctx.aggregated_metrics or {}).get("queue_depth") or {}
    total = sum(depths.values()) if depths else ctx.total_num_requests
    target = ctx.config.get_target_ongoing_requests()
    return total / target, {}
