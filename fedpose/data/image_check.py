"""Decode every image of a dataset once, before training, and remember which files were sound.

The dataset decodes lazily, so without this a corrupt file is found only when a batch happens to
draw it — possibly rounds later, after budget was spent, or never. A site therefore checks all of
its files when its data is first loaded. The result is cached per file (:func:`file_stamp`,
SHA-256) so later rounds re-read only files that changed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from fedpose.data.annotations import PoseRecord, file_digest, refuse_image_aliases
from fedpose.data.loaders import ImageLoadError, resolve_image_or_raise
from fedpose.io import atomic_write_json

#: 2: each file's entry also holds its SHA-256 (copies of one photograph are refused); 3: the stamp
#: holds the inode-change time and the inode too
CACHE_VERSION = 3
MAX_NAMED = 5  #: how many bad files the error names (the count is always given)


def file_stamp(path: Path) -> list[int]:
    """What says a file is unchanged since a cache read it: size, modification time, inode-change
    time and inode. The modification time alone is not enough: ``cp -p``, ``rsync -t`` and ``tar x``
    keep it over new content (an image redacted in place would keep training from its old pixels),
    while the inode-change time is set by the kernel on every write and cannot be set back."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def _read_cache(cache_file: Path | None, root: Path) -> dict[str, list]:
    if cache_file is None or not cache_file.exists():
        return {}
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache only costs a re-check
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("root") != str(root):
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def check_images(
    records: Sequence[PoseRecord], root: str | Path, cache_file: str | Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Fully decode each distinct image the records name (skipping files the cache vouches for);
    return how many were decoded now. Raises :class:`ImageLoadError` naming the bad files, their
    count and the data root; sound files are cached even then, so a fixed dataset re-checks fast."""
    from fedpose.data.dataset import load_image

    root = Path(root)
    cache_path = Path(cache_file) if cache_file is not None else None
    known = _read_cache(cache_path, root)
    sound: dict[str, list] = {}
    digests: dict[str, str] = {}
    files: dict[str, Path] = {}
    bad: list[str] = []
    names = sorted({r.image for r in records})
    decoded = 0
    for index, name in enumerate(names):
        try:
            path = resolve_image_or_raise(root, name)
            stamp = file_stamp(path)
            entry = known.get(name)
            if not (isinstance(entry, list) and entry[:-1] == stamp and len(entry) == len(stamp) + 1):
                load_image(path)  # a full decode: truncated files fail only when the pixels are read
                decoded += 1
                entry = [*stamp, file_digest(path)]
            sound[name] = entry
            digests[name] = entry[-1]
            files[name] = path
        except (ImageLoadError, OSError) as exc:
            bad.append(f"{name} ({exc.__class__.__name__}: {str(exc).splitlines()[0][:200]})")
        if progress is not None:
            progress(index + 1, len(names))
    if cache_path is not None and sound != known:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cache_path, {"version": CACHE_VERSION, "root": str(root), "files": sound})
    refuse_image_aliases(root, files, digests)
    if bad:
        listed = "; ".join(bad[:MAX_NAMED]) + (f"; and {len(bad) - MAX_NAMED} more" if len(bad) > MAX_NAMED else "")
        raise ImageLoadError(f"{len(bad)} of {len(names)} images under {root} cannot be read: {listed}")
    return decoded

