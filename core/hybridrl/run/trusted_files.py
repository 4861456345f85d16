"""Files never run code: what a checkpoint may hold, and how it is read.

``torch.load(weights_only=False)`` unpickles: a forged ``driver.pt`` or engine rank file runs whatever it names
(a shell command) the moment it is read, and a manifest does not stop it (it records sizes and checksums, which
a forger rewrites too). So every checkpoint file is plain data, tensors, dicts, lists, str, int, float, read with
``weights_only=True``; and before a checkpoint is used, each pickle in it is checked without being loaded
(``unsafe_files``): a torch file through ``torch.serialization.get_unsafe_globals_in_checkpoint``, DCP's
``.metadata`` (a raw pickle of ``torch.distributed.checkpoint.metadata`` classes) through an unpickler that
builds nothing outside a short list. Anything else is refused with its path, in one sentence.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from hybridrl.errors import HybridRLError

#: DCP writes its index as a plain pickle of these (and of torch dtypes, which are constants, not callables).
_DCP_METADATA = ".metadata"
_DCP_ALLOWED = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
                ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
_DCP_MODULE = "torch.distributed.checkpoint.metadata"


class UntrustedFileError(HybridRLError, ValueError):
    """A checkpoint file holds more than tensors and plain data: loading it could run code."""


def refusal(path: str | Path, found: list[str] | None = None) -> str:
    what = f" ({', '.join(found[:3])}{' ...' if len(found) > 3 else ''})" if found else ""
    return (f"'{path}' holds more than tensors and plain data{what}: loading it could run code, so it is refused "
            "(checkpoints saved before hybridrl saved plain data load only with trainer.resume_unverified=true, "
            "if you trust where they came from)")


#: what checkpoints saved before the driver state was plain data hold besides it: NumPy's RNG state (an array).
#: Building an array runs no code of the file's choosing, so ``trainer.resume_unverified=true`` admits these.
OLD_FORMAT_GLOBALS = frozenset({"numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct",
                                "numpy.core.multiarray._reconstruct", "numpy.dtypes.UInt32DType"})


def _old_format_classes() -> list[Any]:
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_plain(path: str | Path, map_location: Any = "cpu", allow_old: bool = False) -> Any:
    """``torch.load`` of a file that may hold tensors and plain data only; ``UntrustedFileError`` (naming the
    file) for anything else, before any of it is built. ``allow_old`` also admits the NumPy arrays of
    checkpoints saved before the driver state was plain data (``OLD_FORMAT_GLOBALS``)."""
    try:
        if allow_old:
            with torch.serialization.safe_globals(_old_format_classes()):
                return torch.load(path, map_location=map_location, weights_only=True)
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UntrustedFileError(refusal(path, _unsafe_globals(Path(path)))) from exc


def _unsafe_globals(path: Path) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # noqa: BLE001 - not a torch zip file: the refusal needs no list
        return []


class _MetadataCheck(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _DCP_MODULE or (module, name) in _DCP_ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def metadata_problem(path: Path) -> list[str] | None:
    """Why DCP's ``.metadata`` at ``path`` is not plain (the globals it names; None: it is)."""
    try:
        _MetadataCheck(io.BytesIO(path.read_bytes())).load()
    except pickle.UnpicklingError as exc:
        return [str(exc)]
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: not something to unpickle either
        return [f"{type(exc).__name__}"]
    return None


def _is_torch_file(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())


def unsafe_files(folder: str | Path, allow_old: bool = False) -> list[tuple[Path, list[str]]]:
    """Every file under ``folder`` that would run code (or build objects other than tensors and plain data) if
    loaded, with what it names: torch files (``*.pt``, ``*.pth``, ``*.bin``, any zip holding ``data.pkl``)
    and DCP ``.metadata``; a ``.pt`` file that is not a torch zip (an old pickle) counts too. ``allow_old``
    passes the NumPy arrays of older checkpoints (``OLD_FORMAT_GLOBALS``)."""
    found: list[tuple[Path, list[str]]] = []
    for path in sorted(Path(folder).rglob("*")):
        if not path.is_file():
            continue
        if path.name == _DCP_METADATA:
            problem = metadata_problem(path)
            if problem:
                found.append((path, problem))
        elif _is_torch_file(path):
            names = [n for n in _unsafe_globals(path) if not (allow_old and n in OLD_FORMAT_GLOBALS)]
            if names:
                found.append((path, names))
        elif path.suffix in (".pt", ".pth", ".bin", ".pkl", ".pickle"):
            found.append((path, ["not a torch zip file"]))
    return found
