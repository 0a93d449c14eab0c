"""A policy folder through a store that is some way off: its files one at a time vs `store.TRANSFERS` at once.

    .venv/bin/python bench/store_latency.py [--delay-ms 25] [--repeats 3]

moto's S3 server (its own process) behind a relay on 127.0.0.1 that holds each chunk of bytes, either way, for
`--delay-ms` (a store across a region: every request pays it, and so does every 64 KiB of a large file). The
folder is a small model's as publish writes it (9 files: configs, tokenizer, vocab, 5 MB of weights). For each
of put_folder, get_folder (download + checks) and copy_folder (server-side), interleaved, median of --repeats:
seconds with the files one after another (TRANSFERS 1, as before 2026-12-07) and at once, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

FILES = [("config.json", 700), ("generation_config.json", 150), ("tokenizer.json", 2_000_000),
         ("tokenizer_config.json", 3000), ("special_tokens_map.json", 500), ("vocab.json", 800_000),
         ("merges.txt", 450_000), ("chat_template.jinja", 1200), ("model.safetensors", 5_000_000)]


def relay(target: tuple[str, int], delay: float) -> str:
    """A TCP relay to `target` on a thread of its own that holds each chunk for `delay` s; its URL."""
    async def pipe(r, w) -> None:
        try:
            while data := await r.read(1 << 16):
                await asyncio.sleep(delay)
                w.write(data)
                await w.drain()
        except OSError:
            pass
        finally:
            w.close()

    async def handle(cr, cw) -> None:
        sr, sw = await asyncio.open_connection(*target)
        await asyncio.gather(pipe(cr, sw), pipe(sr, cw))

    ready, port = threading.Event(), []

    def serve() -> None:
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
        port.append(server.sockets[0].getsockname()[1])
        ready.set()
        loop.run_forever()
    threading.Thread(target=serve, daemon=True).start()
    ready.wait()
    return f"http://127.0.0.1:{port[0]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay-ms", type=float, default=25.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ["RLFLOW_CACHE"] = tempfile.mkdtemp(prefix="rlflow-bench-cache-")
    import boto3
    from publish_vs_boto3 import start_moto

    from tasks.core import store as stores

    moto, url = start_moto()
    try:
        host, port = url.removeprefix("http://").split(":")
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket="latency")
        store = stores.S3Store("s3://latency/runs", type("C", (), {"endpoint_url": relay((host, int(port)),
                                                                                         args.delay_ms / 1000)})())
        folder = Path(tempfile.mkdtemp(prefix="rlflow-bench-policy-"))
        for name, size in FILES:
            (folder / name).write_bytes(os.urandom(size))
        took: dict[tuple[str, int], list[float]] = {}
        at_once = stores.TRANSFERS
        for i in range(args.repeats):
            for n in (1, at_once):
                stores.TRANSFERS, key = n, f"r/p{n}-{i}"
                t0 = time.perf_counter()
                store.put_folder(key, folder)
                t1 = time.perf_counter()
                store.get_folder(key, Path(tempfile.mkdtemp(prefix="rlflow-bench-back-")))
                t2 = time.perf_counter()
                store.copy_folder(key, key + "-copy")
                t3 = time.perf_counter()
                for what, s in (("put_folder", t1 - t0), ("get_folder", t2 - t1), ("copy_folder", t3 - t2)):
                    took.setdefault((what, n), []).append(s)
        print(f"{len(FILES)} files, {sum(s for _, s in FILES) / 1e6:.1f} MB, relay delay {args.delay_ms:g} ms, "
              f"median of {args.repeats}")
        for what in ("put_folder", "get_folder", "copy_folder"):
            one, many = statistics.median(took[(what, 1)]), statistics.median(took[(what, at_once)])
            print(f"{what:12s} one at a time {one:6.2f} s   {at_once} at once {many:6.2f} s   ratio {many / one:.2f}x")
    finally:
        moto.kill()


if __name__ == "__main__":
    main()
