"""A step's DATA frames for one HTTP/2 connection: `frame_data`, in C when it was built.

The per-step batch of `H2Session.send_batch` (http2.py rules 3, 5, 7): a step's chunks for
every stream of one connection become DATA frames in one bytes object, for the
connection's one write. An item is `(data key, *pieces)`: the key is the session's
`_Stream`; the payload is the pieces in order, a `bytes` piece as it is, a `str` piece as
the JSON string orjson makes of it. The SSE splice is such an item, (key, prefix, text,
suffix), so a token's chunk is never built as a Python object of its own.

    frame_data(session, items, out, closing_state) -> the item it stopped at, or None

takes items from the iterator `items` while each payload leaves at once as one frame: the
stream has no queue, its state is below `closing_state`, and the payload fits the connection
window, the stream window and the peer's max frame size. It appends those frames to `out`
(one bytes object) and debits `session.send_window` and each stream's `send_window` by
exactly each frame's length, whether it returns or raises. The first item that does not fit
(or, in C, that the C code cannot encode: a piece that is neither exact bytes nor a str, a
str with no UTF-8 form, where Python raises building its payload) is returned untouched;
the session sends it through its general path (`payload(item)`), which queues, splits or
raises, and asks again for the rest.

`frame_data` is the C extension's (net/protocol/_frames.c, built by setup.py) when it
imported, else `frame_data_py`, the same behaviour in Python and the reference the C code
is tested against byte for byte (tests/test_net_frames.py); `NATIVE` says which.
"""

import struct

from orjson import dumps

# frame header: 24-bit length (as 8 + 16 bits), type, flags, 31-bit stream id
FRAME_HEADER = struct.Struct(">BHBBI")

try:
    from ._frames import frame_data
    NATIVE = True
except ImportError:             # built without a compiler: the Python path, same bytes
    frame_data = None
    NATIVE = False


def payload(item: tuple) -> bytes:
    """The DATA payload of one item: its pieces, a str piece as its JSON string."""
    if len(item) == 2:
        piece = item[1]
        return piece if type(piece) is bytes else dumps(piece)
    if len(item) == 4:              # the SSE splice, the common case: two concatenations
        head, text, tail = item[1], item[2], item[3]
        if type(head) is bytes and type(text) is str and type(tail) is bytes:
            return head + dumps(text) + tail
    return b"".join([piece if type(piece) is bytes else dumps(piece) for piece in item[1:]])


def frame_data_py(session, items, out: list, closing_state: int):
    """`frame_data` in Python (see the module docstring; hot path when C is absent: once per
    step per connection)."""
    frames = []
    window, max_frame = session.send_window, session.max_frame_size
    try:
        for item in items:
            st = item[0]
            data = payload(item)
            n = len(data)
            if st.pending or n > window or n > st.send_window or n > max_frame or st.state >= closing_state:
                return item
            window -= n
            st.send_window -= n
            frames.append(FRAME_HEADER.pack(n >> 16, n & 0xFFFF, 0, 0, st.id))
            frames.append(data)
        return None
    finally:
        session.send_window = window
        if frames:
            out.append(b"".join(frames))


if frame_data is None:
    frame_data = frame_data_py
