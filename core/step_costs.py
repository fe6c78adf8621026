"""What a step costs, learned from the steps themselves: the scheduler's one cost model.

A decode step's time is the baseline; query rows beyond one a request (speculative proposals,
core/speculative.py) and prefill tokens (chunks of prompts) add to it. The scheduler times
every step that carries decodes (`observe`, from `schedule()` to `update()`), and two
decisions read the model:
- `row_costs`: what verifying k proposed rows adds (adaptive k, speculative.py rule 5);
- `prefill_cap`: how many prompt tokens a step that carries decodes may take, so that it
  stays within PREFILL_SLACK of a decode step's time (stall-free batching, as Sarathi-Serve
  and the chunked-prefill budgets of vLLM and SGLang do it): a wave of prompts no longer
  holds every running stream for a step of a second. A step without decodes is not capped
  (a lone prompt's time to first token is unchanged). The cap may be a single token; what
  keeps prompts moving is `prefill_floor` of the prompt tokens pending, the least a capped
  step takes: a backlog of short prompts clears in about MAX_PREFILL_CHUNKS steps (the
  prefill keeps up with arrivals), a long one moves MIN_PREFILL_TOKENS a step.

All figures are kept per batch bucket (decodes in powers of two) as moving averages; a step
descheduled for milliseconds is clipped to OUTLIER decode steps. What rows and prefill tokens
add is fit by a line, fixed + n x per unit, since both pay a fixed part (the prefill path's
attention split, one more pass over the logits); prefill observations are grouped by token
count in powers of two, so the fit sees at most a dozen points.
"""

EWMA_WEIGHT = 0.25              # of the latest observation in the moving averages
OUTLIER = 4.0                   # a step time past this many decode steps (per row) counts as this many
PREFILL_SLACK = 0.25            # a step with prefill tokens may take this much longer than a decode step
                                # (at 0.5 a staggered arrival's 8 tokens rode whole with 8 decodes and those
                                # steps, ~1.5x, were the inter-token p99 at concurrency 8; issue 31)
MIN_PREFILL_TOKENS = 16         # a long backlog of prompt tokens moves at least this many a capped step ...
MAX_PREFILL_CHUNKS = 4          # ... and a short one (under 4 x 16 tokens) a quarter of itself (no starvation)


class StepCosts:
    """The measured model (see the module docstring); only the engine thread touches it."""

    def __init__(self):
        self.decode_ns = {}                 # batch bucket -> moving average of pure decode steps
        self.added_ns = {}                  # batch bucket -> {rows: moving average of the time they add}
        self.fits = {}                      # batch bucket -> (fixed ns, ns per row)
        self.prefill = {}                   # batch bucket -> {token bucket: [mean tokens, mean ns added]}
        self.prefill_fits = {}              # batch bucket -> (fixed ns, ns per prefill token)

    def observe(self, num_decodes: int, num_rows: int, num_prefill: int, step_ns: int) -> None:
        """A step that carried `num_decodes` decodes, `num_rows` proposed rows and `num_prefill`
        prompt tokens took `step_ns` (once per step; a step with both rows and prompt tokens
        teaches nothing about either)."""
        bucket = num_decodes.bit_length()
        decode_ns = self.decode_ns.get(bucket)
        if not num_rows and not num_prefill:
            if decode_ns is not None:
                step_ns = min(step_ns, OUTLIER * decode_ns)
            self.decode_ns[bucket] = step_ns if decode_ns is None else decode_ns + EWMA_WEIGHT * (step_ns - decode_ns)
        elif decode_ns is None or (num_rows and num_prefill):
            return
        elif num_rows:
            added = self.added_ns.setdefault(bucket, {})
            value = min(max(0.0, step_ns - decode_ns), OUTLIER * decode_ns * num_rows)
            old = added.get(num_rows)
            added[num_rows] = value if old is None else old + EWMA_WEIGHT * (value - old)
            self.fits[bucket] = fit_line(added.items())
        else:
            points = self.prefill.setdefault(bucket, {})
            value = min(max(0.0, step_ns - decode_ns), OUTLIER * decode_ns * num_prefill)
            point = points.get(num_prefill.bit_length())
            if point is None:
                points[num_prefill.bit_length()] = [float(num_prefill), value]
            else:
                point[0] += EWMA_WEIGHT * (num_prefill - point[0])
                point[1] += EWMA_WEIGHT * (value - point[1])
            self.prefill_fits[bucket] = fit_line(points.values())

    def row_costs(self, num_decodes: int) -> tuple:
        """(fixed, per row) time that k proposed rows add to a step, over a decode step's time
        ((0, 0) until a decode step and a verifying one were seen; hot path: once per step)."""
        bucket = num_decodes.bit_length()
        decode_ns, fit = self.decode_ns.get(bucket), self.fits.get(bucket)
        if not decode_ns or fit is None:
            return 0.0, 0.0
        return fit[0] / decode_ns, fit[1] / decode_ns

    def prefill_cap(self, num_decodes: int):
        """Prompt tokens a step with `num_decodes` decodes may take (None: no cap yet, until a
        decode step and one with prompt tokens were seen; hot path: once per step)."""
        bucket = num_decodes.bit_length()
        decode_ns, fit = self.decode_ns.get(bucket), self.prefill_fits.get(bucket)
        if not decode_ns or fit is None or fit[1] <= 0:
            return None
        return max(1, int((PREFILL_SLACK * decode_ns - fit[0]) / fit[1] + 1e-6))


def prefill_floor(num_pending: int) -> int:
    """Prompt tokens a capped step takes whatever the cap, with `num_pending` prompt tokens
    still to compute: a short backlog in about MAX_PREFILL_CHUNKS steps, a long one
    MIN_PREFILL_TOKENS at a time; at least one (a prompt always moves)."""
    return max(1, min(MIN_PREFILL_TOKENS, -(-num_pending // MAX_PREFILL_CHUNKS)))


class FixedCosts:
    """StepCosts' interface with costs given, not measured: for tests (and experiments) whose
    decisions must not depend on the machine's timing."""

    def __init__(self, fixed: float = 0.0, per_row: float = 0.0, prefill_cap=None):
        self.costs = (fixed, per_row)
        self.cap = prefill_cap

    def observe(self, num_decodes: int, num_rows: int, num_prefill: int, step_ns: int) -> None:
        pass

    def row_costs(self, num_decodes: int) -> tuple:
        return self.costs

    def prefill_cap(self, num_decodes: int):
        return self.cap


def fit_line(points) -> tuple:
    """(intercept, slope >= 0) of the least-squares line through (x, y) points; proportional
    (through 0) while there is one x."""
    points = list(points)
    if len(points) == 1:
        (x, y), = points
        return 0.0, y / x
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return 0.0, mean_y / mean_x
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / var)
    return max(0.0, mean_y - slope * mean_x), slope
