"""Checkpoint fingerprint time: the default model's export and a 1 GB folder, without and with the hash cache.

- first:  an empty file-hash cache (every identity file is read and hashed; the files are in the page cache after a
          warm-up read, so this measures hashing, not the disk);
- cached: the same folder again (only stat() calls: the per-file digests come from $EVALDAG_HOME's cache);
- sha256: the same bytes hashed with hashlib.sha256, for the ratio to a cryptographic hash of the whole content.
The default model is exported first if it is not (evaldag.request.checkpoint.prepare_alias). The 1 GB folder is written to a
temporary directory (random weights, a config and a tokenizer file) and removed afterwards.

Usage: .venv/bin/python bench/bench_fingerprint.py [--gb 1.0] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evaldag import paths  # noqa: E402
from evaldag.request import config
from evaldag.request.fingerprint import fingerprint, identity_files  # noqa: E402
from evaldag.request.checkpoint import prepare_alias  # noqa: E402


def _sha256_all(folder: Path) -> None:
    for f in identity_files(folder):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while block := fh.read(8 << 20):
                h.update(block)


def _best(fn, repeat: int, before=None) -> float:
    times = []
    for _ in range(repeat):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(name: str, folder: Path, repeat: int, cache_home: Path) -> None:
    size = sum(f.stat().st_size for f in identity_files(folder))
    _sha256_all(folder)                                   # warm the page cache: measure hashing, not the disk
    cache = cache_home / "cache" / "file-hashes"
    first = _best(lambda: fingerprint(folder), repeat, before=lambda: shutil.rmtree(cache, ignore_errors=True))
    cached = _best(lambda: fingerprint(folder), repeat)
    sha = _best(lambda: _sha256_all(folder), repeat)
    print(f"{name:<22} {size / 1e9:6.3f} GB  first {first * 1000:8.1f} ms ({size / first / 1e9:5.2f} GB/s)   "
          f"cached {cached * 1000:6.2f} ms   sha256 {sha * 1000:8.1f} ms   sha256/first {sha / first:5.2f}x   "
          f"first/cached {first / cached:7.0f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="size of the synthetic weight file")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (the best is printed)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fp-") as tmp:
        os.environ.setdefault("EVALDAG_MODELS_DIR", str(paths.models_dir()))   # the usual export, not a new one
        os.environ["EVALDAG_HOME"] = str(Path(tmp) / "home")     # a private hash cache
        model = prepare_alias(config.load_model("smollm2-135m-instruct"))
        measure("smollm2-135m-instruct", model, args.repeat, Path(tmp) / "home")
        big = Path(tmp) / "big"
        big.mkdir()
        with open(big / "model.safetensors", "wb") as fh:
            for _ in range(int(args.gb * 1024)):
                fh.write(os.urandom(1 << 20))
        for name in ("config.json", "tokenizer.json"):
            shutil.copy(model / name, big / name)
        measure(f"{args.gb:g} GB folder", big, args.repeat, Path(tmp) / "home")


if __name__ == "__main__":
    main()
