"""Confinement of checkpoint paths to the configured model roots."""

from __future__ import annotations

import os
from pathlib import Path

from inference.errors import AdapterOutsideRoots, CheckpointError, CheckpointOutsideRoots, storable_text


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
    # No expanduser(): "~" is the shell's to expand, and a server must not
    # resolve a request's "~" (or a relative path) against its own account.
    raw = Path(path)
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
        # Only the file and what lies beside it (a tokenizer, a config) are
        # read, not the other checkpoints that share its folder.
        for entry in [resolved, *resolved.parent.iterdir()]:
            _check_entry(entry, resolved_roots, CheckpointOutsideRoots)
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
    confine_tree(resolved, resolved_roots)


def confine_tree(resolved: Path, resolved_roots: list[Path], *, error: type[CheckpointError] = CheckpointOutsideRoots) -> None:
    """Refuse a folder holding a symlink that resolves outside every root, or a
    file with more than one hard link.

    A hard link has no "target" to check: the same file may also be reachable
    from outside the roots (a link made to a file the server can read but
    users cannot), so its digest would leak what it holds.

    Raises:
        ``error``: the first such entry, named.
    """
    for entry in resolved.rglob("*"):
        _check_entry(entry, resolved_roots, error, base=resolved)


def _refused(error: type[CheckpointError], message: str, entry: Path, base: Path | None, why: str) -> CheckpointError:
    """``error(message)``; a caller of the API is told the entry, relative to the folder it named, and ``why``."""
    exc = error(message)
    if base is not None and isinstance(exc, CheckpointOutsideRoots) and entry.is_relative_to(base):
        exc.public_detail = f"{storable_text(str(entry.relative_to(base)))} {why}"
    return exc


def _check_entry(entry: Path, resolved_roots: list[Path], error: type[CheckpointError], *, base: Path | None = None) -> None:
    if storable_text(entry.name) != entry.name:
        # Such a name cannot be stored, shown or sent back; it would become part of the identity.
        raise CheckpointError(f"{entry} has a file name that is not UTF-8; rename it")
    if entry.is_symlink():
        try:
            target = entry.resolve(strict=True)
        except RuntimeError as exc:  # a loop
            raise _refused(error, f"{entry} is a link that loops: {exc}", entry, base, "is a link that loops") from exc
        except OSError as exc:
            raise _refused(error, f"{entry} links to {entry.resolve()}, which does not exist", entry, base,
                           "is a link to nothing") from exc  # fmt: skip
        if not any(target.is_relative_to(root) for root in resolved_roots):
            raise _refused(error, f"{entry} links to {target}, outside the model roots", entry, base,
                           "is a link leading outside the model roots")  # fmt: skip
    elif entry.is_file() and entry.stat().st_nlink > 1:
        raise _refused(error, f"{entry} has {entry.stat().st_nlink} hard links; copy it into the model roots instead",
                       entry, base, "has several hard links; copy it instead")  # fmt: skip


def resolve_adapter_dir(path: str | os.PathLike[str], roots: list[Path]) -> Path:
    """Resolve a LoRA adapter directory with the same rules as a checkpoint:
    inside the roots after symlinks, no link inside it leading out, no hard links.

    Raises:
        AdapterOutsideRoots: missing, not a directory, outside the roots, or
            holding such a link.
    """
    raw = Path(path)
    try:
        if not raw.is_dir():
            raise AdapterOutsideRoots(f"adapter path is not a directory: {raw}")
        resolved = raw.resolve()
        resolved_roots = [r.resolve() for r in roots]
        if not any(resolved.is_relative_to(r) for r in resolved_roots):
            raise AdapterOutsideRoots(f"adapter path {raw} resolves to {resolved}, outside the model roots")
        confine_tree(resolved, resolved_roots, error=AdapterOutsideRoots)
    except (OSError, RuntimeError) as exc:  # symlink loops, permissions
        raise AdapterOutsideRoots(f"adapter path {raw}: {exc}") from exc
    return resolved


def is_mistral_tokenizer_file(name: str) -> bool:
    """Whether a checkpoint file named ``name`` is a mistral_common tokenizer:
    ``tekken.json`` or a versioned SentencePiece ``tokenizer.model.v*``. A folder
    holding one is served in vLLM's ``--tokenizer-mode mistral``, which renders
    the chat format in mistral_common's code (vLLM 0.32,
    ``vllm/transformers_utils/tokenizers/mistral.py``); identity, tokenization
    and the launcher all use this one rule."""
    return name == "tekken.json" or name.startswith("tokenizer.model.v")


def has_mistral_tokenizer(directory: Path) -> bool:
    """Whether ``directory`` holds a mistral_common tokenizer file (:func:`is_mistral_tokenizer_file`)."""
    try:
        return any(is_mistral_tokenizer_file(entry.name) and entry.is_file() for entry in os.scandir(directory))
    except OSError:
        return False
