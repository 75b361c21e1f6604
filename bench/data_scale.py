#!/usr/bin/env python3
"""What a dataset of N pictures costs each rank before the first step: seconds of data work and resident memory,
on a first launch (nothing cached) and on a relaunch (the same data, launched again: a resume).

Builds a synthetic dataset under --dir (kept there: a second call with the same --dir and size reuses it): N
distinct JPEGs (noise pictures of --side pixels a side, each made distinct by a trailer after its end marker, so
no two pictures share bytes), either as a JSONL file naming picture files (--kind jsonl: the "jsonl" loader) or
as a `datasets` save_to_disk folder whose Image column embeds each picture's bytes (--kind hf: the "hf" loader).
Then launches the ranks twice as 2 processes each, the way `corl train` loads data on a node's ranks
(`vlm_corl.training.run.setup`: `load_examples`, then the content fingerprint `data_fingerprint`). Prints ONE JSON
object:

    {"pictures", "kind", "picture_kb" (mean file size), "build_s",
     "first_launch" and "relaunch": {"ranks": [{"rank", "data_s" (seconds of the rank's own data work: its examples
     and their fingerprint), "wait_s" (rank 1 waits for rank 0's load first, as in a launch: `setup._load_data`),
     "data_rss_mb" (resident memory the data work added, a mapped dataset's pages it touched included),
     "data_anon_mb" (the part of it that is the process's own: its heap, not pages shared with the node's other
     ranks), "picture_mb" (picture bytes the examples hold in the process's own heap: an "hf" dataset's stay in its
     mapped Arrow files), "pictures_checked" (decoded by the rank; the others came from the cache), "examples",
     "fingerprint"}, ...]}}

Both launches share one validation cache (`VLM_CORL_DATA_CACHE`, set to --dir/cache; removed before the first).

    python bench/data_scale.py --pictures 8 --side 32 --in-process    # seconds: tests/test_bench_data_scale.py
    python bench/data_scale.py --pictures 4000 --kind hf
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2
DISTINCT_BASES = 16  # noise pictures made (slow to encode); each file is one of them plus its own trailer


def pictures(n: int, side: int):
    """N distinct JPEG files' bytes: a few noise pictures, each copy given a unique trailer after the end marker
    (decoders stop at the marker, so each decodes in full, as the base picture does)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    bases = []
    for _ in range(min(n, DISTINCT_BASES)):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
        bases.append(buffer.getvalue())
    for i in range(n):
        yield i, bases[i % len(bases)] + f"picture {i}".encode()


def build(folder: Path, n: int, side: int, kind: str) -> tuple[Path, float]:
    """The dataset's path (built unless a complete one is there) and its mean picture size in KB."""
    data = folder / f"{kind}-{n}-{side}"
    done = data / "built.json"
    if done.exists():
        return data, json.loads(done.read_text())["picture_kb"]
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    total = 0
    if kind == "jsonl":
        (data / "images").mkdir()
        with open(data / "train.jsonl", "w") as out:
            for i, blob in pictures(n, side):
                (data / "images" / f"{i:06d}.jpg").write_bytes(blob)
                out.write(json.dumps({"id": f"q{i}", "question": f"what is in picture {i}?", "answer": "noise",
                                      "image": f"images/{i:06d}.jpg"}) + "\n")  # fmt: skip
                total += len(blob)
    else:
        total = _build_hf(data, n, side)
    done.write_text(json.dumps({"picture_kb": total / n / 1024}))
    return data, total / n / 1024


def _build_hf(data: Path, n: int, side: int) -> int:
    """A save_to_disk folder at `data`/hf with an embedded Image column; the pictures' total bytes."""
    import datasets

    sizes = []

    def rows():
        for i, blob in pictures(n, side):
            sizes.append(len(blob))
            yield {"id": f"q{i}", "question": f"what is in picture {i}?", "answer": "noise", "image": {"bytes": blob}}

    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "question": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "image": datasets.Image(),
        }  # fmt: skip
    )
    built = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(data / "build-cache"))
    built.save_to_disk(str(data / "hf"))
    shutil.rmtree(data / "build-cache", ignore_errors=True)
    return sum(sizes)


def rank_work(kind: str, path: Path, barrier: Path) -> dict:
    """One rank's data work as `corl train` does it (`setup._load_data`: rank 0 first, then the others, the
    `barrier` file standing for the launch's barrier), timed, with the memory it added (in its own process)."""
    from vlm_corl.data.image_checks import pictures_checked
    from vlm_corl.data.loaders import load_examples
    from vlm_corl.training.run.checkpoint import data_fingerprint

    rss, anon = _rss(), _rss("RssAnon")
    start = time.perf_counter()
    while os.environ["RANK"] != "0" and not barrier.exists():
        time.sleep(0.01)
    waited = time.perf_counter() - start
    examples = load_examples(kind, path / "hf" if kind == "hf" else path / "train.jsonl").examples
    if os.environ["RANK"] == "0":
        barrier.touch()
    fingerprint = data_fingerprint(examples)
    held = sum(len(image) for ex in examples for image in ex.images if isinstance(image, bytes))
    return {
        "data_s": round(time.perf_counter() - start - waited, 3),
        "wait_s": round(waited, 3),
        "data_rss_mb": round((_rss() - rss) / 2**20, 1),
        "data_anon_mb": round((_rss("RssAnon") - anon) / 2**20, 1),
        "picture_mb": round(held / 2**20, 1),
        "pictures_checked": pictures_checked(),
        "examples": len(examples),
        "fingerprint": fingerprint["sha256"],
    }


def _rss(kind: str = "VmRSS") -> int:
    """This process's resident set (VmRSS), or its own part of it (RssAnon: not the files it maps), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{kind}:"):
            return int(line.split()[1]) * 1024
    return 0


def launch(kind: str, path: Path, cache: Path, in_process: bool) -> dict:
    """The ranks of one launch, run together as processes (the node's ranks load at once), with their numbers;
    `in_process`: one after the other in this process, each reading the cache afresh (as a new process would)."""
    env = {**os.environ, "VLM_CORL_DATA_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    barrier = cache.parent / "rank0-loaded"
    barrier.unlink(missing_ok=True)
    if in_process:
        return {"ranks": [_rank_in_process(rank, kind, path, env, barrier) for rank in range(RANKS)]}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(rank), "--kind", kind, "--data", str(path), "--dir", cache.parent],
            stdout=subprocess.PIPE,
            env={**env, "RANK": str(rank)},
            text=True,
        )
        for rank in range(RANKS)
    ]
    ranks = []
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate()
        if proc.returncode:
            for other in procs:  # a rank 1 would wait for rank 0's load forever
                other.kill()
            raise SystemExit(f"rank {rank} failed (exit {proc.returncode})")
        ranks.append({"rank": rank, **json.loads(out)})
    return {"ranks": ranks}


def _rank_in_process(rank: int, kind: str, path: Path, env: dict, barrier: Path) -> dict:
    from vlm_corl.data import image_checks

    os.environ.update({**env, "RANK": str(rank)})
    image_checks._OPEN.clear()  # what this process read of the cache: a new rank reads it afresh
    return {"rank": rank, **rank_work(kind, path, barrier)}


def main(argv: list[str] | None = None) -> None:
    """Build the dataset, launch twice, print the JSON (or, with --rank, one rank's work: the launcher's child)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pictures", type=int, default=4000)
    parser.add_argument("--side", type=int, default=384, help="pixels a side (384: about 270 KB a JPEG)")
    parser.add_argument("--kind", choices=("jsonl", "hf"), default="jsonl")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/corl-data-scale"))
    parser.add_argument("--in-process", action="store_true", help="ranks in turn in this process (no RSS per rank)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        print(json.dumps(rank_work(args.kind, args.data, args.dir / "rank0-loaded")))
        return
    start = time.perf_counter()
    path, picture_kb = build(args.dir, args.pictures, args.side, args.kind)
    build_s = time.perf_counter() - start
    cache = args.dir / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    first = launch(args.kind, path, cache, args.in_process)
    again = launch(args.kind, path, cache, args.in_process)
    out = {"pictures": args.pictures, "kind": args.kind, "picture_kb": round(picture_kb, 1)}
    print(json.dumps({**out, "build_s": round(build_s, 2), "first_launch": first, "relaunch": again}))


if __name__ == "__main__":
    main()
