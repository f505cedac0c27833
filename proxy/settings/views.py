"""The settings' sections: the typed objects each consumer takes, built once from the
flat settings (:class:`~proxy.settings.model.Settings` hands them out). A consumer gets its
whole section as one object: the relay its :class:`RelayOptions`, the server its
:class:`ServerLimits`, every upstream the :class:`UpstreamOptions`, the power service its
:class:`PowerOptions`."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.relay_options import RelayOptions
from ..fleet.balance import BalanceOptions
from ..fleet.upstream import UpstreamOptions
from ..measure.kvcache import kv_dtype
from ..services.power import PowerOptions
from ..services.stall import StallOptions
from ..transport import ClientOptions

if TYPE_CHECKING:
    from .model import Settings


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What the server protocol guards every connection with (proxy.runtime.http1)."""

    max_head_bytes: int
    header_timeout: float
    max_header_fields: int
    max_pipelined_requests: int
    max_pipelined_bytes: int
    max_stalled_streams: int


def relay_options(s: Settings) -> RelayOptions:
    return RelayOptions(
        inject_usage=s.inject_usage,
        max_body_bytes=s.max_body_bytes,
        max_body_memory=s.max_body_memory,
        body_timeout=s.body_timeout,
        max_event_bytes=s.max_event_bytes,
        max_decoded_bytes=s.max_decoded_bytes,
        echo_request_id=s.echo_request_id,
        admin_api=s.admin_api_mode,
    )


def server_limits(s: Settings) -> ServerLimits:
    return ServerLimits(
        max_head_bytes=s.max_head_bytes,
        header_timeout=s.header_timeout,
        max_header_fields=s.max_header_fields,
        max_pipelined_requests=s.max_pipelined_requests,
        max_pipelined_bytes=s.max_pipelined_bytes,
        max_stalled_streams=s.max_stalled_streams,
    )


def balance_options(s: Settings, start_secret: bytes = b"") -> BalanceOptions:
    """The policy; the prefix hash keyed with --affinity-secret, else with a key derived
    from this start's secret (`start_secret`)."""
    given = s.affinity_secret
    if given is not None:
        secret = given.get_secret_value().encode()
    else:
        secret = hmac.new(start_secret, b"phasewatch prefix affinity", hashlib.sha256).digest()
    return BalanceOptions(balance=s.balance, affinity=s.affinity, affinity_secret=secret)


def upstream_options(s: Settings) -> UpstreamOptions:
    """What every upstream shares."""
    return UpstreamOptions(
        client=ClientOptions(
            connect_timeout=s.connect_timeout,
            read_timeout=s.read_timeout,
            write_timeout=s.write_timeout,
            upstream_max_connections=s.upstream_max_connections,
            upstream_pool_timeout=s.upstream_pool_timeout,
            upstream_keepalive=s.upstream_keepalive,
            upstream_max_head_bytes=s.upstream_max_head_bytes,
        ),
        max_concurrency=s.max_concurrency,
        max_queue=s.max_queue,
        queue_timeout=s.queue_timeout,
        max_models=s.max_models,
        models=frozenset(s.models),
        precision=tuple(s._precision.items()),
        model_dir=s.model_dir,
        kv_cache_dtype=tuple(
            (name, kv_dtype(dtype) or dtype)
            for name, _, dtype in (item.partition("=") for item in s.kv_cache_dtype)
        ),
        health_interval=s.health_interval,
        health_backoff_max=s.health_backoff_max,
        eject_backoff_max=s.eject_backoff_max,
        health_timeout=s.health_timeout,
        eject_after_5xx=s.eject_after_5xx,
    )


def power_options(s: Settings) -> PowerOptions:
    return PowerOptions(
        power_source=s.power_source,
        power_dcgm_url=s.power_dcgm_url,
        power_interval=s.power_interval,
        power_gpu=dict(s._power_gpu),
        power_max_watts=s.power_max_watts,
        power_dcgm_max_bytes=s.power_dcgm_max_bytes,
    )


def stall_options(s: Settings) -> StallOptions:
    return StallOptions(
        stall_floor=s.stall_floor,
        stall_prefill_factor=s.stall_prefill_factor,
        stall_gaps=s.stall_gaps,
    )
