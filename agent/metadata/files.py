"""The metadata files and their CDI specs on disk (``document`` names and fills them).

Every write is ``durable.write_atomic`` (temporary, fsync, rename, fsync of the directory),
as for the claims' own CDI specs: a reader or a crash sees the old file or the new one. The
metadata file is written before its spec, and the spec is removed before the file, so a spec
never names a file that is not there. Only names this module generates are listed or
removed: the CDI directory is shared with other vendors. Methods block; callers run them in
a worker thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from agent.dra import cdi
from agent.metadata import document as doc
from agent.metadata.document import RequestMetadata
from agent.node import durable


class MetadataFiles:
    """The metadata files of one driver (under its plugin data directory) and their specs."""

    def __init__(self, driver: str, plugin_dir: Path, cdi_root: Path) -> None:
        self.driver = driver
        self.plugin_dir = Path(plugin_dir)
        self.cdi_root = Path(cdi_root)

    @property
    def root(self) -> Path:
        return self.plugin_dir / doc.SUBDIR

    def host_file(self, metadata: RequestMetadata) -> Path:
        return doc.host_file(self.plugin_dir, metadata.namespace, metadata.claim, metadata.request)

    def spec_path(self, uid: str, request: str) -> Path:
        return self.cdi_root / doc.spec_file_name(self.driver, uid, request)

    def write(self, metadata: RequestMetadata) -> str:
        """Write the request's file, then its spec; returns the CDI id."""
        path = self.host_file(metadata)
        path.parent.mkdir(mode=doc.DIR_MODE, parents=True, exist_ok=True)
        durable.write_atomic(path, doc.encode_stream(metadata), doc.FILE_MODE)
        self._write_spec(metadata, path)
        return doc.cdi_id(self.driver, metadata.uid, metadata.request)

    def ensure(self, metadata: RequestMetadata) -> bool:
        """Rewrite what is missing or differs: the file only when it is missing or unreadable
        (the agent never changes a file it wrote), the spec whenever it differs."""
        path = self.host_file(metadata)
        written = False
        if self.read_stream(path) is None:
            path.parent.mkdir(mode=doc.DIR_MODE, parents=True, exist_ok=True)
            durable.write_atomic(path, doc.encode_stream(metadata), doc.FILE_MODE)
            written = True
        expected = doc.cdi_spec(metadata, path)
        if self._read_spec(metadata.uid, metadata.request) != expected:
            self._write_spec(metadata, path)
            written = True
        return written

    def remove(self, uid: str, namespace: str, claim: str, request: str) -> None:
        """Remove the request's spec, then its file and directory (and the claim's directory
        once empty); what is gone already counts as removed."""
        path = doc.host_file(self.plugin_dir, namespace, claim, request)
        for target in (self.spec_path(uid, request), path):
            with contextlib.suppress(FileNotFoundError):  # its directory is gone: so is it
                durable.remove_durable(target)
        for directory in (path.parent, path.parent.parent):
            with contextlib.suppress(FileNotFoundError, OSError):
                directory.rmdir()  # only when empty (another request's file stays)

    def read_stream(self, path: Path) -> list[dict[str, object]] | None:
        """The objects of a metadata file, or None when it is missing or not a stream."""
        try:
            return doc.decode_stream(path.read_bytes())
        except (OSError, ValueError, UnicodeDecodeError, RecursionError):
            return None

    def spec_files(self) -> dict[Path, str]:
        """Our metadata spec files in the CDI directory, with their claim uid."""
        try:
            names = os.listdir(self.cdi_root)
        except FileNotFoundError:
            return {}
        found = {}
        for name in names:
            uid = doc.spec_file_uid(self.driver, name)
            if uid is not None:
                found[self.cdi_root / name] = uid
        return found

    def claim_dirs(self) -> dict[Path, str | None]:
        """Each claim directory under the metadata root, with the uid its files name (None
        when none of them says)."""
        try:
            entries = sorted(self.root.iterdir())
        except FileNotFoundError:
            return {}
        found: dict[Path, str | None] = {}
        for entry in entries:
            if entry.is_symlink() or not entry.is_dir():
                continue
            found[entry] = None
            for request_file in sorted(entry.glob(f"*/{doc.FILE_NAME}")):
                objects = self.read_stream(request_file)
                meta = objects[0].get("metadata") if objects else None
                uid = meta.get("uid") if isinstance(meta, dict) else None
                if isinstance(uid, str):
                    found[entry] = uid
                    break
        return found

    def remove_spec_file(self, path: Path) -> None:
        durable.remove_durable(path)

    def remove_claim_dir(self, path: Path) -> None:
        """Remove a claim directory the checkpoint does not know, and make it durable."""
        if path.is_symlink():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)
        durable.fsync_directory(path.parent)

    def _read_spec(self, uid: str, request: str) -> object:
        try:
            return json.loads(self.spec_path(uid, request).read_bytes())
        except (OSError, ValueError):
            return None

    def _write_spec(self, metadata: RequestMetadata, host_path: Path) -> None:
        spec = doc.cdi_spec(metadata, host_path)
        target = self.spec_path(metadata.uid, metadata.request)
        try:
            durable.write_atomic(target, cdi.encode_spec(spec), doc.FILE_MODE)
        except FileNotFoundError:  # the CDI directory is made only when it is missing
            self.cdi_root.mkdir(parents=True, exist_ok=True)
            durable.write_atomic(target, cdi.encode_spec(spec), doc.FILE_MODE)
