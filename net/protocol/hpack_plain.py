"""Context-free HPACK (RFC 7541) for the server's own header blocks.

Every field is either an indexed static-table entry (`:status: 200`) or a literal without
indexing whose name is a static-table index or a literal, with literal (not Huffman) values.
Such a block never reads or writes the dynamic table, so its bytes do not depend on the
connection's compression state: a block is built once and reused for every stream, and the
peer's decoder table stays exactly as h2's encoder believes it is.

Huffman coding is skipped on purpose: in pure Python it costs tens of microseconds per
block, for a few bytes saved per response.
"""

# RFC 7541 Appendix A: static-table indexes of the names and :status values we send
STATUS_INDEX = {200: 8, 204: 9, 206: 10, 304: 11, 400: 12, 404: 13, 500: 14}
NAME_INDEX = {b":status": 8, b"allow": 22, b"cache-control": 24, b"content-length": 28, b"content-type": 31,
              b"retry-after": 53, b"server": 54, b"www-authenticate": 61}


def encode_int(value: int, prefix_bits: int, first: int) -> bytes:
    """RFC 7541 5.1 integer with an N-bit prefix; `first` holds the representation's flag bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_string(data: bytes) -> bytes:
    return encode_int(len(data), 7, 0x00) + data        # H bit clear: raw octets


def encode_field(name: bytes, value: bytes) -> bytes:
    """Literal header field without indexing (RFC 7541 6.2.2). The names we send are encoded
    once, at import; a value's length prefix is one table lookup below 127 bytes (trailers
    make one block per request)."""
    head = _NAME_PARTS.get(name)
    if head is None:
        head = _name_part(name)
    n = len(value)
    return head + (_SHORT_LENGTHS[n] if n < 127 else encode_int(n, 7, 0x00)) + value


def _name_part(name: bytes) -> bytes:
    index = NAME_INDEX.get(name)
    return encode_int(index, 4, 0x00) if index is not None else b"\x00" + encode_string(name)


_NAME_PARTS = {name: _name_part(name) for name in (*NAME_INDEX, b"server-timing", b"x-request-id")}
_SHORT_LENGTHS = tuple(bytes([n]) for n in range(127))     # H bit clear, 7-bit prefix


def encode_block(status: int | None, headers) -> bytes:
    """A header block: `:status` (for responses; None for trailers) then the fields, in order."""
    parts = []
    if status is not None:
        index = STATUS_INDEX.get(status)
        parts.append(encode_int(index, 7, 0x80) if index else encode_field(b":status", str(status).encode()))
    for name, value in headers:
        parts.append(encode_field(name, value))
    return b"".join(parts)
