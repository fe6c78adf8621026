"""RFC 9218 (Extensible Prioritization Scheme for HTTP): the `priority` request header and
the PRIORITY_UPDATE frame's value -> the scheduler's priority.

A Priority field is a Structured Fields dictionary (RFC 8941); tokenwire reads its urgency
`u` (0 most urgent .. 7 least, default 3) and becomes the request's scheduler priority, so
waiting requests are admitted by urgency first, then in arrival order. The incremental flag
`i` says how a client wants responses interleaved; every stream already gets its token as
soon as it is made, so it changes nothing here. Unknown members, parameters and malformed
values are ignored, as the RFC asks (the default urgency applies).
"""

DEFAULT_URGENCY = 3


def urgency(value: str | None) -> int:
    """The `u` member of a Priority field value (e.g. "u=1, i"), else DEFAULT_URGENCY."""
    if not value:
        return DEFAULT_URGENCY
    found = DEFAULT_URGENCY
    for member in value.split(","):
        key, _, rest = member.strip().partition("=")
        if key != "u":
            continue
        item = rest.split(";", 1)[0].strip()      # a member's parameters follow ';'
        found = int(item) if len(item) == 1 and "0" <= item <= "7" else DEFAULT_URGENCY   # last one wins
    return found
