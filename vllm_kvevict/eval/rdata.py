"""A small reader for R lazy-load databases (``.rdx`` / ``.rdb``), enough for
character vectors. Pure Python, no R.

How R stores a package's data (``tools:::makeLazyLoadDB``):

  NAME.rdx   gzip of one serialized R list: ``variables`` (a named list of
             ``c(offset, length)`` into the .rdb), ``references``, ``compressed``.
  NAME.rdb   concatenated blobs; each blob = 4-byte big-endian uncompressed
             length + a zlib stream (compressed=TRUE; bzip2/xz use other
             codes) of one serialized object.

Serialization (``R_Serialize``, XDR = big-endian):

  header   b"X\\n", int version (2|3), int writer R version, int min reader
           version; version 3 adds int n + n bytes of native encoding.
  item     int flags: type = flags & 0xFF, has_attr = bit 9, has_tag = bit 10,
           gp/levels = flags >> 12 (CHARSXP encoding bits live there).

Only the item kinds a data object of strings, numbers, lists, attributes and
(for ``.rdx``) pairlists needs are decoded; anything else raises, so an
unexpected file fails loudly instead of yielding garbage.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path
from typing import Any

# SEXP types (Rinternals.h) and serialization pseudo-types (serialize.c).
NILSXP, SYMSXP, LISTSXP, CHARSXP = 0, 1, 2, 9
LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP, EXPRSXP = 10, 13, 14, 16, 19, 20
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP = 255, 254, 253, 242, 241
ATTRLISTSXP = 239
NA_INTEGER = -(2 ** 31)
_LATIN1_MASK, _UTF8_MASK, _BYTES_MASK = 1 << 2, 1 << 3, 1 << 1


class RObject(list):
    """An R vector or list with its attributes (``names``, ``class``, ...)."""

    attributes: dict[str, Any]

    def __init__(self, items=(), attributes=None):
        super().__init__(items)
        self.attributes = attributes or {}

    @property
    def names(self) -> list[str] | None:
        return self.attributes.get("names")


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0
        self.refs: list[Any] = []  # back-references table (symbols, environments)

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos:self.pos + n]
        if len(chunk) != n:
            raise ValueError("truncated R serialization")
        self.pos += n
        return chunk

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def header(self) -> None:
        if self.take(2) != b"X\n":
            raise ValueError("not an XDR R serialization (expected b'X\\n')")
        version = self.int()
        self.int(), self.int()  # writer / min reader R versions
        if version == 3:
            self.take(self.int())  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")

    def item(self) -> Any:
        flags = self.int()
        kind = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in (NILVALUE_SXP, NILSXP, GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP):
            return None
        if kind == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == SYMSXP:
            name = self.item()  # a CHARSXP
            self.refs.append(name)
            return name
        if kind == CHARSXP:
            n = self.int()
            if n == -1:
                return None  # NA_character_
            raw = self.take(n)
            levels = flags >> 12
            if levels & _LATIN1_MASK and not levels & _UTF8_MASK:
                return raw.decode("latin-1")
            return raw.decode("utf-8", errors="replace")
        if kind in (LISTSXP, ATTRLISTSXP):
            return self.pairlist(flags)
        if kind in (LGLSXP, INTSXP):
            n = self.length()
            values = struct.unpack(f">{n}i", self.take(4 * n))
            out = RObject(None if v == NA_INTEGER else v for v in values)
        elif kind == REALSXP:
            n = self.length()
            out = RObject(struct.unpack(f">{n}d", self.take(8 * n)))
        elif kind in (STRSXP, VECSXP, EXPRSXP):  # elements are items (CHARSXPs for strings)
            out = RObject(self.item() for _ in range(self.length()))
        else:
            raise ValueError(f"R SEXP type {kind} is not supported by this reader")
        if has_attr:
            out.attributes = self.attributes()
        del has_tag  # vectors carry no tag
        return out

    def pairlist(self, flags: int) -> RObject:
        """A pairlist (attributes or a tagged list) as an RObject with names."""
        values, names = [], []
        while True:
            attrs = self.attributes() if flags & (1 << 9) else {}
            del attrs  # pairlist-node attributes: never meaningful for data
            names.append(self.item() if flags & (1 << 10) else None)
            values.append(self.item())
            flags = self.int()  # the CDR: another node, or the end
            if flags & 0xFF in (NILVALUE_SXP, NILSXP):
                return RObject(values, {"names": names})
            if flags & 0xFF not in (LISTSXP, ATTRLISTSXP):
                raise ValueError("unexpected pairlist tail")

    def attributes(self) -> dict[str, Any]:
        plist = self.item()
        return dict(zip(plist.names, plist)) if plist else {}


def unserialize(data: bytes) -> Any:
    """One R object from serialized XDR bytes."""
    reader = _Reader(data)
    reader.header()
    return reader.item()


def load_lazy_db(prefix: str | Path) -> dict[str, Any]:
    """Every object in ``prefix.rdx`` / ``prefix.rdb``, by name.

    Returns {name: RObject}; character vectors become RObjects of str/None.
    """
    prefix = Path(prefix)
    index = unserialize(gzip.decompress(prefix.with_suffix(".rdx").read_bytes()))
    fields = dict(zip(index.names, index))
    compressed = fields.get("compressed")
    if compressed and compressed[0] not in (True, 1):
        raise ValueError(f"{prefix}.rdb uses compression {compressed[0]}; only zlib is supported")
    blob = prefix.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (offset, length) in zip(fields["variables"].names, fields["variables"]):
        offset, length = int(offset), int(length)
        # 4-byte big-endian uncompressed size, then the zlib stream.
        raw = zlib.decompress(blob[offset + 4:offset + length])
        out[name] = unserialize(raw)
    return out
