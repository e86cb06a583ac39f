"""A directory of compiled artifacts that lets an engine start warm on another machine of the same kind.

    DIR/artifacts.bin    torch.compiler.save_cache_artifacts(): every FX graph (Inductor's generated code,
                         with its Triton kernels bundled on GPU) and AOTAutograd entry this process compiled
                         or found in a cache; path-independent, loaded with load_cache_artifacts()
    DIR/manifest.json    what saved them: torch version, device, the hash of this package's sources, the
                         engine's buckets, when
    DIR/inductor/        Inductor's and Triton's on-disk caches while an engine warms up with this directory:
                         also C++ builds (CPU) and the JIT-compiled Triton kernels of the attention plans

Warm-up loads artifacts.bin (when present) before compiling, compiles every bucket with DIR/inductor as the
on-disk cache, then saves artifacts.bin and manifest.json anew (atomically: replicas may share a directory).
Copying the whole directory to a fresh machine makes every bucket a cache hit there: no Inductor compile,
no Triton or C++ build; Dynamo still traces each bucket and CUDA graphs are still captured. Artifacts saved
by another torch version, on another GPU or by other sources of this package (their hash is in every key,
lowering/cache.py) miss the cache and are compiled again: `load` warns, and the warm-up report says which
buckets compiled.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass

import torch

from b12x_inductor.lowering import _inductor

ARTIFACTS = "artifacts.bin"
MANIFEST = "manifest.json"
INDUCTOR = "inductor"


def _require_api() -> None:
    missing = [name for name in ("save_cache_artifacts", "load_cache_artifacts") if not hasattr(torch.compiler, name)]
    if missing:
        raise RuntimeError(f"ServeConfig.compile_cache needs torch.compiler.{' and '.join(missing)} (torch >= 2.7); "
                           f"torch {torch.__version__} lacks it: upgrade torch or leave compile_cache None")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@dataclass
class Loaded:
    """What `CompileCache.load` found: artifacts (FX graphs and AOTAutograd entries) loaded, the bytes read,
    seconds, and the manifest's warnings (another torch version or device saved them)."""

    artifacts: int = 0
    bytes: int = 0
    seconds: float = 0.0
    warnings: tuple[str, ...] = ()


class CompileCache:
    """The directory `path` (created when missing) for an engine on `device`."""

    def __init__(self, path: str, device: torch.device) -> None:
        _require_api()
        self.path = os.path.abspath(path)
        self.device = device
        os.makedirs(os.path.join(self.path, INDUCTOR), exist_ok=True)

    @property
    def inductor_dir(self) -> str:
        return os.path.join(self.path, INDUCTOR)

    def activate(self):
        """A context in which Inductor's and Triton's on-disk caches are DIR/inductor."""
        return _inductor.cache_dir(self.inductor_dir)

    def _identity(self) -> dict[str, str]:
        """What the artifacts' cache keys depend on, beyond the graphs themselves."""
        from b12x_inductor.lowering.cache import source_hash

        return dict(torch=torch.__version__, device=device_name(self.device), sources=source_hash())

    def manifest(self) -> dict | None:
        try:
            with open(os.path.join(self.path, MANIFEST)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def load(self) -> Loaded:
        """Loads DIR/artifacts.bin into Inductor's caches (call inside `activate`); nothing when absent."""
        file = os.path.join(self.path, ARTIFACTS)
        if not os.path.exists(file):
            return Loaded()
        t = time.perf_counter()
        with open(file, "rb") as f:
            data = f.read()
        warnings = []
        saved = self.manifest() or {}
        for key, here in self._identity().items():
            if saved.get(key) not in (None, here):
                warnings.append(f"{ARTIFACTS} was saved with {key} {saved[key]!r}, this is {here!r}: expect cache "
                                "misses (compiled again)")
        info = torch.compiler.load_cache_artifacts(data)
        count = sum(len(v) for v in info.artifacts.values()) if info is not None else 0
        return Loaded(artifacts=count, bytes=len(data), seconds=time.perf_counter() - t, warnings=tuple(warnings))

    def save(self, buckets: list[tuple[str, int, int]]) -> tuple[int, float]:
        """Writes every artifact this process compiled or hit so far to DIR/artifacts.bin, and the manifest;
        returns (bytes written, seconds). Atomic: a reader sees the old file or the new one."""
        t = time.perf_counter()
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return 0, time.perf_counter() - t
        data, info = saved
        manifest = dict(self._identity(), buckets=[list(b) for b in buckets],
                        artifacts={k: len(v) for k, v in info.artifacts.items()},
                        saved=datetime.datetime.now(datetime.timezone.utc).isoformat())
        _write_atomic(os.path.join(self.path, ARTIFACTS), data)
        _write_atomic(os.path.join(self.path, MANIFEST), json.dumps(manifest, indent=2).encode())
        return len(data), time.perf_counter() - t


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
