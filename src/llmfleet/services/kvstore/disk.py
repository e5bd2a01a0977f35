"""The kvstore's disk tier: one file per block, a byte budget, LRU order kept in file mtimes.

Layout on disk:

    <root>/k_<layout, percent-encoded>/<64 hex digits of the block hash>
    <root>/h_<sha256 of layout>/.layout            (layouts too long for a file name)
    <root>/h_<sha256 of layout>/<64 hex digits>

Writes go to a `.tmp-*` file in the same directory and are renamed into place, so a block file
is either absent or complete (a crash leaves only temp files, deleted at the next start). Each
write or touch sets the file's mtime to a strictly increasing nanosecond clock: at start the
index is rebuilt from the directory in mtime order, oldest first, which is the LRU order the
previous process left behind. Nothing is fsynced: this is a cache, and a block lost in a power
cut is just a miss.

Plain Python; not thread-safe (the store serializes every call).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from urllib.parse import quote, unquote

logger = logging.getLogger(__name__)

Key = tuple[str, bytes]  # (layout, block hash)

_HEX_NAME_LEN = 64
_MAX_DIR_NAME = 200
_LAYOUT_FILE = ".layout"
_TMP_PREFIX = ".tmp-"


def layout_dirname(layout: str) -> str:
    """A file-name-safe, reversible directory name for a layout key."""
    quoted = quote(layout, safe="")  # keeps only letters, digits and "_.-~"; "k_" rules out ".."
    if len(quoted) <= _MAX_DIR_NAME:
        return "k_" + quoted
    return "h_" + hashlib.sha256(layout.encode()).hexdigest()


class DiskTier:
    """Blocks as files under `root`, at most `capacity_bytes` in all; the caller evicts."""

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError("disk capacity must be >= 1 byte")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.index: OrderedDict[Key, int] = OrderedDict()  # LRU first -> block size in bytes
        self.bytes = 0
        self.hits = 0
        self.evictions = 0
        self._dirs: dict[str, Path] = {}
        self._last_ns = 0
        self._tmp_counter = 0
        self.root.mkdir(parents=True, exist_ok=True)

    def __contains__(self, key: Key) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def size_of(self, key: Key) -> int:
        return self.index[key]

    # ---- start-up -------------------------------------------------------------------------

    def scan(self) -> list[Key]:
        """Rebuild the index from the directory (LRU first); returns the keys found."""
        found: list[tuple[int, str, Key, int]] = []
        for sub in sorted(self.root.iterdir()):
            layout = self._layout_of(sub)
            if layout is None:
                continue
            self._dirs[layout] = sub
            for entry in os.scandir(sub):
                if entry.name.startswith(_TMP_PREFIX):
                    _unlink(Path(entry.path))
                    continue
                block_hash = _parse_hex_name(entry.name)
                if block_hash is None or not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, entry.name, (layout, block_hash), st.st_size))
        found.sort()
        for mtime_ns, _, key, size in found:
            self.index[key] = size
            self.bytes += size
            self._last_ns = max(self._last_ns, mtime_ns)
        return [key for _, _, key, _ in found]

    def _layout_of(self, sub: Path) -> str | None:
        if not sub.is_dir():
            return None
        if sub.name.startswith("k_"):
            return unquote(sub.name[2:])
        if sub.name.startswith("h_"):
            try:
                return (sub / _LAYOUT_FILE).read_text(encoding="utf-8")
            except OSError:
                logger.warning("kvstore disk: %s has no readable %s; ignored", sub, _LAYOUT_FILE)
        return None

    # ---- block files ----------------------------------------------------------------------

    def path(self, key: Key) -> Path:
        layout, block_hash = key
        return self._dir(layout) / block_hash.hex()

    def write(self, key: Key, payload: bytes | memoryview) -> bool:
        """Store a block as the most recently used; False (nothing stored) on an I/O error.

        The caller has made room: `bytes + len(payload) <= capacity_bytes`.
        """
        try:
            final = self.path(key)
            self._tmp_counter += 1
            tmp = final.with_name(f"{_TMP_PREFIX}{final.name}-{os.getpid()}-{self._tmp_counter}")
            try:
                with open(tmp, "wb") as f:
                    f.write(payload)
                os.replace(tmp, final)
            except BaseException:
                _unlink(tmp)
                raise
            self._stamp(final)
        except OSError as e:
            logger.warning("kvstore disk: cannot write block %s: %s", key[1].hex()[:16], e)
            return False
        size = len(payload)
        self.index[key] = size
        self.bytes += size
        return True

    def read(self, key: Key) -> bytes | None:
        """The block's bytes, or None when its file is gone or damaged (the entry is dropped)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError as e:
            logger.warning("kvstore disk: cannot read %s: %s; block dropped", path, e)
            self.delete(key)
            return None
        if len(data) != self.index[key]:
            logger.warning("kvstore disk: %s has %d bytes, expected %d; block dropped",
                           path, len(data), self.index[key])  # fmt: skip
            self.delete(key)
            return None
        return data

    def touch(self, key: Key) -> None:
        """Make the block the most recently used (in the index and in its file's mtime)."""
        self.index.move_to_end(key)
        try:
            self._stamp(self.path(key))
        except OSError as e:
            logger.debug("kvstore disk: cannot touch %s: %s", key[1].hex()[:16], e)

    def delete(self, key: Key) -> None:
        size = self.index.pop(key)
        self.bytes -= size
        _unlink(self.path(key))

    def lru(self) -> Key:
        return next(iter(self.index))

    # ---- internals ------------------------------------------------------------------------

    def _dir(self, layout: str) -> Path:
        d = self._dirs.get(layout)
        if d is None:
            d = self.root / layout_dirname(layout)
            d.mkdir(exist_ok=True)
            if d.name.startswith("h_") and not (d / _LAYOUT_FILE).exists():
                tmp = d / f"{_TMP_PREFIX}{_LAYOUT_FILE}-{os.getpid()}"
                tmp.write_text(layout, encoding="utf-8")
                os.replace(tmp, d / _LAYOUT_FILE)
            self._dirs[layout] = d
        return d

    def _stamp(self, path: Path) -> None:
        # Strictly increasing mtimes: file-system timestamps are coarse (a few ms), and the
        # restart order must be exact.
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        os.utime(path, ns=(self._last_ns, self._last_ns))


def _parse_hex_name(name: str) -> bytes | None:
    if len(name) != _HEX_NAME_LEN:
        return None
    try:
        raw = bytes.fromhex(name)
    except ValueError:
        return None
    return raw if len(raw) == _HEX_NAME_LEN // 2 else None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("kvstore disk: cannot delete %s: %s", path, e)
