"""Images per second the ImageNet JPEG input pipeline can feed, per CPU core.

    .venv/bin/python benchmarks/input_pipeline.py [--images 512] [--batches 40] [--cores 1,2]

Writes ImageNet-like records once (tensorflow/models' layout, TensorFlow's own JPEG encoder): images
of 500 x 375 pixels, ImageNet's most common size, whose content (random fields at four scales and
fine noise) compresses at quality 90 to about ImageNet's mean file size (ILSVRC-2012's training set
is about 110 KB per image); the mean size is printed. Then,
for each core count, a fresh process held to that many cores (its CPU affinity, which TensorFlow's
thread pools and tf.data's autotuner follow, as they follow a Slurm or cgroup CPU set) runs the very
reader a rank runs (`launcher.rank.data.tfrecord.read_dataset`: shuffle, decode of the random crop,
resize to 224 x 224, flip, batches of 64) and times `--batches` batches after 5 of warm-up. Nothing
trains: this is the most the pipeline can feed a model. Prints images/s and images/s per core (wall
clock), and images per CPU-second (the process's user + system time over all its threads), which
a machine shared with other work does not lower.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
HEIGHT, WIDTH = 375, 500
BATCH = 64
WARMUP_BATCHES = 5
SHARDS = 8


def natural_ish(rng: np.random.Generator) -> np.ndarray:
    """A 375 x 500 RGB image with structure at several scales, so JPEG works as hard as on a photo."""
    image = np.zeros((HEIGHT, WIDTH, 3), np.float32)
    for cells, weight in ((4, 120.0), (16, 60.0), (64, 30.0), (250, 30.0)):
        coarse = rng.random((cells * HEIGHT // WIDTH + 2, cells + 2, 3), dtype=np.float32)
        rows = np.linspace(0, coarse.shape[0] - 1.001, HEIGHT)
        cols = np.linspace(0, coarse.shape[1] - 1.001, WIDTH)
        image += weight * coarse[rows.astype(int)][:, cols.astype(int)]
    image += rng.normal(0, 20, image.shape)
    return np.clip(image - image.mean() + 128, 0, 255).astype(np.uint8)


def write_records(folder: Path, count: int) -> float:
    """Writes `count` records in SHARDS files; returns the mean JPEG size in bytes."""
    import tensorflow as tf

    from launcher.rank.data.imagenet import encode_example

    rng = np.random.default_rng(0)
    writers = [tf.io.TFRecordWriter(str(folder / f"train-{s:05d}-of-{SHARDS:05d}")) for s in range(SHARDS)]
    sizes = []
    for index in range(count):
        jpeg = tf.io.encode_jpeg(natural_ish(rng), quality=90).numpy()
        sizes.append(len(jpeg))
        writers[index % SHARDS].write(encode_example(jpeg, 1 + index % 1000, HEIGHT, WIDTH))
    for writer in writers:
        writer.close()
    return float(np.mean(sizes))


def measure(pattern: str, batches: int) -> dict:
    """In this process (already held to its cores): images/s of the rank's reader."""
    from launcher.rank.data.tfrecord import read_dataset

    dataset = read_dataset(pattern, "images", [224, 224, 3], classes=1000, batch_size=BATCH, rank=0, size=1,
                           seed=0, shuffle_buffer=256, prefetch=2, label_offset=1)
    iterator = iter(dataset)
    for _ in range(WARMUP_BATCHES):
        next(iterator)
    cpu_before, started = _cpu_seconds(), time.perf_counter()
    for _ in range(batches):
        x, _ = next(iterator)
    x.numpy()
    seconds, cpu_seconds = time.perf_counter() - started, _cpu_seconds() - cpu_before
    return {"cores": len(os.sched_getaffinity(0)), "images_per_s": batches * BATCH / seconds, "seconds": seconds,
            "images_per_cpu_s": batches * BATCH / cpu_seconds, "cpu_seconds": cpu_seconds}


def _cpu_seconds() -> float:
    """CPU time of this process, all its threads: what the pipeline cost, however busy the machine was."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_on_cores(cores: int, pattern: str, batches: int) -> dict:
    """`measure` in a fresh process held to the first `cores` CPUs, with the rank's thread settings."""
    cpus = sorted(os.sched_getaffinity(0))[:cores]
    code = (f"import os, json, sys; os.sched_setaffinity(0, {cpus}); sys.path.insert(0, {str(REPO)!r}); "
            f"from benchmarks.input_pipeline import measure; print(json.dumps(measure({pattern!r}, {batches})))")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": str(cores),
           "OMP_NUM_THREADS": str(cores), "TF_NUM_INTEROP_THREADS": "2"}  # as a rank sets them (launch/threads.py)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512, help="records written (default 512)")
    parser.add_argument("--batches", type=int, default=40, help="batches of 64 timed per run (default 40)")
    parser.add_argument("--cores", default="1,2", help="core counts to run with (default 1,2)")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.node()}, "
          f"{len(os.sched_getaffinity(0))} usable CPU(s), load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as folder:
        mean_bytes = write_records(Path(folder), args.images)
        print(f"{args.images} JPEG records of {WIDTH}x{HEIGHT} (mean {mean_bytes / 1024:.0f} KiB), {SHARDS} shards; "
              f"read to 224x224 with random crop and flip, batches of {BATCH}, {args.batches} batches timed")
        for cores in (int(text) for text in args.cores.split(",")):
            result = run_on_cores(cores, f"{folder}/train-*", args.batches)
            print(f"{result['cores']} core(s): {result['images_per_s']:.0f} images/s, "
                  f"{result['images_per_s'] / result['cores']:.0f} images/s per core ({result['seconds']:.1f} s); "
                  f"{result['images_per_cpu_s']:.0f} images per CPU-second ({result['cpu_seconds']:.1f} CPU-s)")


if __name__ == "__main__":
    main()
