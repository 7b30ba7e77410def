"""Reading and writing weight files without executing code.

Hugging Face directories hold either safetensors (`model.safetensors`, or shards listed by
`model.safetensors.index.json`) or PyTorch pickles (`pytorch_model.bin`, or shards listed by
`pytorch_model.bin.index.json`). Safetensors is plain data; pickles are opened only with
`torch.load(weights_only=True)`, which refuses anything but tensors and containers. Tensors
are read lazily (safetensors by name, pickles memory-mapped), so converting a large model
does not first copy every file into memory.

Every file is written under a temporary name and renamed into place, so an interrupted
export never leaves a truncated file under the final name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megazpp.errors import CheckpointError
from megazpp.unique_keys import JSONObject

CONFIG_FILE = "config.json"
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_SINGLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def read_json(path: Path) -> JSONObject:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: file not found") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _index_files(directory: Path, index_name: str) -> dict[str, Path]:
    """name -> shard file from a `*.index.json` weight map."""
    index = directory / index_name
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: expected a non-empty 'weight_map' object")
    files = {}
    for name, file in weight_map.items():
        path = directory / str(file)
        if path.parent != directory or not path.is_file():
            raise CheckpointError(f"{index}: tensor {name!r} is listed in {file!r}, which is not a file in {directory}")
        files[name] = path
    return files


def _weight_files(directory: Path) -> tuple[str, dict[str, Path] | list[Path]]:
    """('safetensors' | 'pickle', index map or the single file), safetensors preferred."""
    if (directory / SAFETENSORS_INDEX).exists():
        return "safetensors", _index_files(directory, SAFETENSORS_INDEX)
    if (directory / SAFETENSORS_SINGLE).exists():
        return "safetensors", [directory / SAFETENSORS_SINGLE]
    if (directory / PICKLE_INDEX).exists():
        return "pickle", _index_files(directory, PICKLE_INDEX)
    if (directory / PICKLE_SINGLE).exists():
        return "pickle", [directory / PICKLE_SINGLE]
    raise CheckpointError(
        f"{directory}: no weights found (expected {SAFETENSORS_SINGLE}, "
        f"{SAFETENSORS_INDEX}, {PICKLE_SINGLE} or {PICKLE_INDEX})"
    )


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # any unpickling failure means an unusable (or unsafe) file
        raise CheckpointError(f"{path}: cannot be loaded as plain tensors ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a flat name -> tensor dictionary")
    return state


class WeightFiles(Mapping[str, torch.Tensor]):
    """The tensors of a Hugging Face model directory as a read-only mapping, loaded on access."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        kind, files = _weight_files(self.directory)
        paths = sorted(set(files.values())) if isinstance(files, dict) else files
        self._where: dict[str, Path] = {}
        self._readers: dict[Path, dict[str, torch.Tensor] | safe_open] = {}
        for path in paths:
            reader = self._open(kind, path)
            self._readers[path] = reader
            for name in reader.keys():
                self._where[name] = path
        if isinstance(files, dict):
            for name, path in files.items():
                if self._where.get(name) != path:
                    raise CheckpointError(
                        f"{self.directory}: index lists tensor {name!r} in {path.name}, which does not contain it"
                    )

    @staticmethod
    def _open(kind: str, path: Path) -> dict[str, torch.Tensor] | safe_open:
        if kind == "pickle":
            return _load_pickle(path)
        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from exc

    def __getitem__(self, name: str) -> torch.Tensor:
        reader = self._readers[self._where[name]]
        return reader[name] if isinstance(reader, dict) else reader.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where


def _replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(path.name + ".partial")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, value: JSONObject) -> None:
    _replace_atomically(path, lambda tmp: tmp.write_text(json.dumps(value, indent=2) + "\n"))


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """One safetensors file (tensors made contiguous and unshared, as the format needs)."""
    plain = {name: t.detach().clone() if _shares_storage(t) else t.detach().contiguous() for name, t in tensors.items()}

    def write(tmp: Path) -> None:
        save_file(plain, str(tmp), metadata=metadata)
        tmp.chmod(_new_file_mode())  # the writer creates it 0600; every other output is 0666 - umask

    _replace_atomically(Path(path), write)


def _new_file_mode() -> int:
    """The mode `open()` gives a new file under this process's umask (which can only be read by
    setting it, so it is set back at once)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _shares_storage(t: torch.Tensor) -> bool:
    """A view of a larger storage (a TP chunk, a split of qkv) would drag the whole storage
    into the file or be refused by safetensors; such tensors are copied."""
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()


def write_hf_weights(
    directory: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus the index when
    the total exceeds `max_shard_bytes` (HF's own naming, so any HF loader finds them)."""
    out = Path(directory)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        write_safetensors(out / SAFETENSORS_SINGLE, shards[0], meta)
        return [out / SAFETENSORS_SINGLE]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        path = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path, shard, meta)
        paths.append(path)
        weight_map.update({name: path.name for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(out / SAFETENSORS_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return paths
