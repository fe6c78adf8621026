"""The protocol layer: bytes in, events out, frames back; never a route or a token.

`shell.py` is the one asyncio Protocol per connection (TCP, TLS, deadlines, caps); the
sessions are sans-IO: `http2.py` (our stream table and framing over h2's connection
preface and SETTINGS, with `request_headers.py`, `hpack_plain.py` and the `flood.py`
budgets) and `http1.py` (h11). Both speak `events.py`'s small vocabulary to the app
(net/app.py), which hands requests to the API layer (net/api/); the writer (net/writer/)
writes responses back through the sessions.
"""
