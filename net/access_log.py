"""What a server operator reads in the log: one access line per request, and a periodic
engine line while busy.

- `AccessLog.request(proto, ...)`: one INFO line per finished request on logger
  `tokenwire.access`: peer (the connection's address, looked up only when a line is
  written), method and path, status (a gRPC call: also its grpc-status, since its HTTP
  status is 200 whatever happened), for generations the prompt and completion tokens,
  TTFT, total time and finish reason, and last the response's `x-request-id`. Off with
  `--no-access-log` (the logger is still there; nothing is formatted).
- `EngineLog.tick(stats, now_s)`: called every few seconds on the loop; while the engine
  has running or waiting requests (or had them since the last tick) it logs prompt and
  generation throughput over the interval, running and waiting requests and KV usage,
  like vLLM's periodic line.
"""

import logging
from typing import Optional

from ..core.outputs import EngineStats

access_log = logging.getLogger("tokenwire.access")
engine_log = logging.getLogger("tokenwire.engine")


class AccessLog:
    __slots__ = ("enabled",)

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def request(self, proto, method: str, path: str, status: int, *, request_id: str = "-",
                grpc_status: Optional[int] = None, num_prompt: Optional[int] = None,
                num_output: Optional[int] = None, ttft_us: float = 0.0, total_us: float = 0.0,
                finish: Optional[str] = None) -> None:
        """Once per request, when its response ends (`proto`: its connection's ServerProtocol;
        `request_id`: the response's x-request-id)."""
        if not self.enabled or not access_log.isEnabledFor(logging.INFO):
            return
        peer = peer_name(proto)
        grpc = "" if grpc_status is None else f" grpc-status={grpc_status}"
        if num_prompt is None:
            access_log.info('%s "%s %s" %d%s id=%s', peer, method, path, status, grpc, request_id)
            return
        access_log.info('%s "%s %s" %d%s prompt=%d completion=%d ttft=%.2fms total=%.2fms finish=%s id=%s',
                        peer, method, path, status, grpc, num_prompt, num_output, ttft_us / 1000, total_us / 1000,
                        finish, request_id)


def peer_name(proto) -> str:
    """The client's address for the access log ("-" when the transport has none)."""
    transport = proto.transport
    name = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return "-"


class EngineLog:
    """Throughput between ticks, from the engine's counters and the prompt tokens submitted."""

    def __init__(self):
        self.num_prompt_tokens = 0          # prompt tokens submitted (the app adds them)
        self._last = None                   # (time s, prompt tokens, generated tokens) at the last tick
        self._busy = False

    def tick(self, stats: EngineStats, now_s: float) -> Optional[str]:
        """-> the line logged, or None when the engine was idle over the interval."""
        last, self._last = self._last, (now_s, self.num_prompt_tokens, stats.num_tokens_generated)
        busy = bool(stats.num_running or stats.num_waiting)
        was_busy, self._busy = self._busy, busy
        if last is None or not (busy or was_busy):
            return None
        dt = max(now_s - last[0], 1e-9)
        line = (f"prompt throughput {(self.num_prompt_tokens - last[1]) / dt:.1f} tokens/s, "
                f"generation throughput {(stats.num_tokens_generated - last[2]) / dt:.1f} tokens/s, "
                f"running {stats.num_running}, waiting {stats.num_waiting}, "
                f"KV cache {100 * stats.num_kv_blocks_used / max(stats.num_kv_blocks_total, 1):.1f}% "
                f"({stats.num_kv_blocks_used}/{stats.num_kv_blocks_total} blocks)")
        engine_log.info("%s", line)
        return line
