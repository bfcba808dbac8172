"""Confinement of checkpoint paths to the configured model roots."""

from __future__ import annotations

import os
from pathlib import Path

from inference.errors import CheckpointError, CheckpointOutsideRoots


def resolve_checkpoint_dir(path: str | os.PathLike[str], roots: list[Path]) -> Path:
    """Resolve ``path`` to a checkpoint inside one of ``roots``: a directory,
    or one ``.gguf`` file.

    Symlinks are resolved before the check, so a link inside a root that points
    outside it is refused, and so is any file inside the checkpoint that links
    outside every root.

    Args:
        path: directory given by the user.
        roots: allowed directories (``MODEL_ROOTS``).

    Returns:
        The resolved absolute directory.

    Raises:
        CheckpointError: the path does not exist, is neither a directory nor
            a ``.gguf`` file, lies outside every root, contains a file linking
            outside, or has no ``config.json`` (a folder of GGUF files names
            them: each is its own quantization).
    """
    raw = Path(path).expanduser()
    try:
        str(raw).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CheckpointError(f"checkpoint path {raw!r} is not valid UTF-8") from exc
    try:
        return _resolve(raw, roots)
    except (OSError, RuntimeError) as exc:  # symlink loops, permissions
        raise CheckpointOutsideRoots(f"checkpoint path {raw}: {exc}") from exc


def _resolve(raw: Path, roots: list[Path]) -> Path:
    if not raw.exists():
        raise CheckpointOutsideRoots(f"checkpoint path does not exist: {raw}")
    resolved = raw.resolve()
    resolved_roots = [r.resolve() for r in roots]
    if not any(resolved.is_relative_to(root) for root in resolved_roots):
        allowed = ":".join(str(r) for r in resolved_roots)
        raise CheckpointOutsideRoots(f"checkpoint path {raw} resolves to {resolved}, outside the model roots ({allowed})")
    if resolved.is_file() and resolved.suffix.lower() == ".gguf":
        # A GGUF file is a checkpoint of its own (one quantization); what lies
        # beside it (a tokenizer, a config) is confined like a folder's files.
        _check_links(resolved.parent, resolved_roots)
        return resolved
    if not resolved.is_dir():
        raise CheckpointOutsideRoots(f"checkpoint path is neither a directory nor a .gguf file: {raw}")
    if not (resolved / "config.json").is_file():
        ggufs = sorted(p.name for p in resolved.glob("*.gguf"))
        if ggufs:
            raise CheckpointError(
                f"checkpoint {raw} holds GGUF files ({', '.join(ggufs)}); each is its own quantization, "
                "so name the .gguf file to fingerprint"
            )
        raise CheckpointError(f"checkpoint {raw} has no config.json")
    _check_links(resolved, resolved_roots)
    return resolved


def _check_links(resolved: Path, resolved_roots: list[Path]) -> None:
    for entry in resolved.rglob("*"):
        if entry.is_symlink():
            target = entry.resolve()
            if not any(target.is_relative_to(root) for root in resolved_roots):
                raise CheckpointOutsideRoots(f"{entry} links to {target}, outside the model roots")
