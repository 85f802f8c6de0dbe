"""Valkey commands packed as RESP bytes with numpy: the many fixed-width arguments of a
batch (8-byte block keys, 6-byte block values) without Python per argument, which is
where the client library's packer spent a third of a batch's time on Valkey.

>>> import numpy as np
>>> command(b"HMGET", b"h", Fixed(np.array([1], ">u8").view("V8")))
b'*3\\r\\n$5\\r\\nHMGET\\r\\n$1\\r\\nh\\r\\n$8\\r\\n\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x01\\r\\n'
"""

from __future__ import annotations

import numpy as np


class Fixed:
    """Arguments of one width, packed: ``columns`` are equal-length ``V<w>`` arrays
    whose rows interleave (a key column and a value column give key, value, key, ...).

    Cost: one numpy pass over the bytes.

    >>> command(Fixed(np.array([b"ab"], "V2"), np.array([b"c"], "V1")))
    b'*2\\r\\n$2\\r\\nab\\r\\n$1\\r\\nc\\r\\n'
    """

    __slots__ = ("count", "data")

    def __init__(self, *columns: np.ndarray) -> None:
        rows = len(columns[0])
        fields: list[tuple[str, str]] = []
        heads = []
        for i, column in enumerate(columns):
            if len(column) != rows:
                raise ValueError(f"columns of {rows} and {len(column)} rows; pass equal ones")
            head = b"$%d\r\n" % column.dtype.itemsize
            heads.append(head)
            fields += [(f"h{i}", f"V{len(head)}"), (f"c{i}", column.dtype.str),
                       (f"e{i}", "V2")]
        packed = np.empty(rows, np.dtype(fields))
        for i, column in enumerate(columns):
            packed[f"h{i}"] = np.frombuffer(heads[i], packed.dtype[f"h{i}"])[0]
            packed[f"c{i}"] = column
            packed[f"e{i}"] = np.frombuffer(b"\r\n", "V2")[0]
        self.count = rows * len(columns)
        self.data = packed.tobytes()

    @classmethod
    def of(cls, *columns: list[bytes], width: tuple[int, ...]) -> Fixed | None:
        """From lists of bytes of the widths given (one ``join`` each); None when one is
        another width (then pack them one by one)."""
        arrays = []
        for column, w in zip(columns, width, strict=True):
            joined = b"".join(column)
            if len(joined) != w * len(column):
                return None
            arrays.append(np.frombuffer(joined, f"V{w}"))
        return cls(*arrays)


class Keys8:
    """Arguments of 8 bytes each (segment keys), packed with one ``join``: for the few
    of a reader's read, where :class:`Fixed`'s numpy costs more than it saves.

    >>> command(b"HMGET", Keys8([b"12345678"]))
    b'*2\\r\\n$5\\r\\nHMGET\\r\\n$8\\r\\n12345678\\r\\n'
    >>> Keys8([b"12345678", b"short"])
    Traceback (most recent call last):
      ...
    ValueError: Keys8: every argument must be 8 bytes long
    """

    __slots__ = ("count", "data")

    def __init__(self, args: list[bytes]) -> None:
        self.count = len(args)
        self.data = b"$8\r\n" + b"\r\n$8\r\n".join(args) + b"\r\n" if args else b""
        if len(self.data) != 14 * self.count:
            raise ValueError("Keys8: every argument must be 8 bytes long")


def command(*args: bytes | int | Fixed | Keys8) -> bytes:
    """One RESP command: bytes and ints one by one, :class:`Fixed` and :class:`Keys8`
    runs as they are.

    Cost: Python per plain argument; numpy (already done) for a Fixed run.
    """
    count = 0
    parts = []
    for arg in args:
        if isinstance(arg, Fixed | Keys8):
            count += arg.count
            parts.append(arg.data)
            continue
        raw = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
        count += 1
    return b"*%d\r\n" % count + b"".join(parts)
