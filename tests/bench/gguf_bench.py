"""Reading a GGUF file's metadata: phasewatch's header reader against the ``gguf``
package's GGUFReader, in one run, on the same file.

    .venv/bin/python tests/bench/gguf_bench.py [FILE.gguf]

Without a file it writes one with the ``gguf`` package: a 262,144-token vocabulary (as
Gemma 3's) and 64 MB of tensors. Prints each reader's seconds and peak RSS growth (each
in a fresh process) and the ratio; both must agree on every shape key.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_MEASURE = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[3])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
if sys.argv[1] == "phasewatch":
    from proxy.engines.gguf import read_metadata
    meta = read_metadata(sys.argv[2])
else:
    from gguf import GGUFReader
    meta = {k: f.contents() for k, f in GGUFReader(sys.argv[2]).fields.items()}
seconds = time.perf_counter() - t
arch = meta["general.architecture"]
shape = {k: meta.get(k) for k in sorted(meta) if k.startswith(arch + ".")}
print(json.dumps({"seconds": seconds, "rss_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, "shape": shape}))
"""


def sample_file(folder: str) -> str:
    import gguf
    import numpy as np

    path = str(Path(folder) / "sample.gguf")
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_block_count(18)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_key_length(256)
    w.add_value_length(256)
    w.add_sliding_window(512)
    w.add_array("tokenizer.ggml.tokens", [f"token{i}" for i in range(262144)])
    w.add_array("tokenizer.ggml.scores", [0.0] * 262144)
    w.add_tensor("weights", np.zeros((4096, 4096), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def measure(reader: str, path: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, reader, path, str(ROOT)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = sys.argv[1] if len(sys.argv) > 1 else sample_file(tmp)
        mine, theirs = measure("phasewatch", path), measure("gguf", path)
        assert mine["shape"] == theirs["shape"], (mine["shape"], theirs["shape"])
        print(f"file: {path} ({Path(path).stat().st_size / 2**20:.0f} MiB)")
        print("| reader | seconds | peak RSS growth MiB |")
        print("| --- | --- | --- |")
        for name, r in (("phasewatch header reader", mine), ("gguf.GGUFReader", theirs)):
            print(f"| {name} | {r['seconds']:.3f} | {r['rss_mib']:.1f} |")
        print(f"| ratio (phasewatch / gguf) | {mine['seconds'] / theirs['seconds']:.3f} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
