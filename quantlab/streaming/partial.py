"""The folder a streamed quantization fills beside its output, and what lets `--resume` continue it.

The folder is hidden and named for its process (`.OUT.partial-PID-HOST-xxxx`), so it never looks
like a finished checkpoint; it becomes OUT by one rename once everything is written. It holds the
output's safetensors shards (written block by block), the calibration windows, and
`quantlab-partial.json`: the source checkpoint's fingerprint, the config asked for, the config as
resolved (mixed precision's per-layer choices), and for every finished part (a block, or the
tensors outside the blocks) the SHA-256 of its stored tensors. A run that stops (SIGTERM, Ctrl-C,
a full disk, SIGKILL) leaves it in place; `--resume` adopts the folder of a run that is no longer
alive, refuses another source or config in one line, checks every finished part against its hash,
and continues from the first part that is not finished. A run without `--resume` removes such
folders.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any

from quantlab.errors import QuantlabError
from quantlab.utils.atomic import atomic_file, is_staging_of_live_process, make_staging

MANIFEST = "quantlab-partial.json"
WINDOWS = "calibration-windows.safetensors"
FORMAT = 1
_IN_USE: set[Path] = set()  # this process's staging folders still being written (others of its own were interrupted)


class ResumeError(QuantlabError, ValueError):
    """An interrupted quantization cannot be continued with this source, config or state of its files."""


class PartialOutput:
    """A staging folder for `output` and its manifest."""

    def __init__(self, folder: Path, manifest: dict[str, Any]) -> None:
        self.folder, self.manifest = folder, manifest

    @classmethod
    def start(
        cls, output: Path, source: dict[str, Any], config: dict[str, Any], resume: bool, note: Any
    ) -> "PartialOutput":
        """A new staging folder, or with `resume` the one an interrupted run of the same work left."""
        leftovers = interrupted_runs(output)
        if resume and leftovers:
            return cls._adopt(leftovers[-1], output, source, config, note)
        if resume:
            note(f"no interrupted quantization of {output} to resume: starting from the beginning")
        for folder in leftovers:
            note(f"removing {folder.name}, an interrupted quantization of {output} (--resume would continue it)")
            shutil.rmtree(folder, ignore_errors=True)
        folder = make_staging(output.parent, output.name, "partial")
        partial = cls(folder, {"format": FORMAT, "source": source, "config": config, "resolved": None, "done": {}})
        partial.save()
        return partial

    def __enter__(self) -> "PartialOutput":
        _IN_USE.add(self.folder)
        return self

    def __exit__(self, *exc: object) -> None:
        _IN_USE.discard(self.folder)

    @classmethod
    def _adopt(
        cls, folder: Path, output: Path, source: dict[str, Any], config: dict[str, Any], note: Any
    ) -> "PartialOutput":
        manifest = _read_manifest(folder)
        if manifest.get("source") != source:
            raise ResumeError(
                f"{folder.name} was quantizing another checkpoint than this one (its files differ); rerun without "
                f"--resume to start over"
            )
        if manifest.get("config") != config:
            changed = sorted(
                key
                for key in set(config) | set(manifest.get("config") or {})
                if config.get(key) != (manifest.get("config") or {}).get(key)
            )
            raise ResumeError(
                f"{folder.name} was quantizing with other options ({', '.join(changed)} differ); rerun with the "
                f"same options, or without --resume to start over"
            )
        mine = make_staging(output.parent, output.name, "partial")  # empty: renaming onto it replaces it
        try:
            os.rename(folder, mine)  # fails if another --resume took it first
        except OSError as error:
            shutil.rmtree(mine, ignore_errors=True)
            raise ResumeError(f"{folder.name} is being resumed by another run; wait for it") from error
        done = len(manifest.get("done") or {})
        note(f"resuming the interrupted quantization of {output}: {done} part(s) finished")
        return cls(mine, manifest)

    @property
    def resolved_config(self) -> dict[str, Any] | None:
        return self.manifest.get("resolved")

    def set_resolved_config(self, config: dict[str, Any]) -> None:
        self.manifest["resolved"] = config
        self.save()

    def finished(self, part: str) -> bool:
        return part in self.manifest["done"]

    def digest(self, part: str) -> str:
        return self.manifest["done"][part]

    def complete(self, part: str, digest: str) -> None:
        self.manifest["done"][part] = digest
        self.save()

    def forget_parts(self) -> None:
        """Start the stored parts over (their file did not match this run's layout)."""
        self.manifest["done"] = {}
        self.save()

    def save(self) -> None:
        with atomic_file(self.folder / MANIFEST) as staging:
            staging.write_text(json.dumps(self.manifest, indent=1, sort_keys=True), encoding="utf-8")

    def remove_bookkeeping(self) -> None:
        """Drop what only resuming needs, before the folder becomes the output."""
        for name in (MANIFEST, WINDOWS):
            (self.folder / name).unlink(missing_ok=True)

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def interrupted_runs(output: Path) -> list[Path]:
    """Staging folders of `output` whose process is gone, oldest first."""
    if not output.parent.is_dir():
        return []
    own = f".partial-{os.getpid()}-"
    found = [
        path
        for path in output.parent.glob(f".{output.name}.partial-*")
        if path.is_dir() and path not in _IN_USE and (own in path.name or not is_staging_of_live_process(path))
    ]
    return sorted(found, key=lambda path: path.stat().st_mtime)


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ResumeError(f"cannot read {path} ({error}); rerun without --resume to start over") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("done"), dict):
        raise ResumeError(f"{path} is not a quantlab resume manifest; rerun without --resume to start over")
    return manifest
