"""Constrained decoding, as the engine sees it: a request may carry a `TokenConstraint`.

Rules:
1. A constraint is made per request from a compiled grammar (kernels/grammar.py, where the
   grammar engine lives) before the request is queued; core/ only moves it along.
2. Each step, the sampler asks the constraints of the rows it samples for a token mask
   (kernels/sampling.py, the whole batch at once); a row without one pays nothing.
3. The engine thread advances the constraint with each token appended to the request
   (core/scheduler.py); once `is_finished()` no further token can extend the output, and
   the request stops (finish reason "stop").

No tensor library here: the mask buffer is the sampler's business.
"""

from typing import NamedTuple, Protocol

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class InvalidConstraint(ValueError):
    """The schema, regex or grammar cannot be compiled; the message names the problem."""


class ConstraintSpec(NamedTuple):
    """What the client asked the output to match; equal specs share one compiled grammar."""
    kind: str                           # one of CONSTRAINT_KINDS
    source: str                         # json_schema: canonical JSON text; regex / grammar: the text;
                                        # choice: a JSON array of strings; json_object: ""


class TokenConstraint(Protocol):
    """One request's grammar state (engine thread only, once queued)."""
    mask_ns: int                        # time spent filling this request's masks, for its timings
    spec: ConstraintSpec                # what it was made from (an engine process compiles it again)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the token breaks the grammar."""
        ...

    def is_finished(self) -> bool:
        """No token but EOS can follow: the output is complete."""
        ...
