"""Store transfers vs bare boto3, against a local S3-compatible server (moto's server, its own process).

    .venv/bin/python bench/publish_vs_boto3.py [--mb 512] [--repeats 3]

Side by side, interleaved, median of `--repeats`:
  - upload: `Store.put_folder` of a folder holding a ~0.5 GB safetensors policy (what train writes: checksums for
    the manifest computed while uploading, manifest last) vs a bare `boto3` `upload_file` of the same file with
    the same TransferConfig (multipart, part size and concurrency from StoreConfig);
  - download: `Store.get_folder` (download + sha256 verification of every file) vs a bare `download_file`;
  - publish: the publish step itself (`Store.copy_folder` of the checkpoint's model/ into policy/vN: a
    server-side copy) vs the same bare upload — what publishing would cost if it uploaded the weights;
  - LoRA adapter publish (an r=16 adapter of a 0.5B model is ~9 MB): `copy_folder`, absolute seconds.
Prints seconds, MB/s and ratios (ours / boto3).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("moto server did not start")


def write_policy(folder: Path, mb: int) -> Path:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    n = mb * (1 << 20) // 2 // 8                       # bf16: 2 bytes per element, 8 tensors
    save_file({f"layer{i}.weight": torch.randn(n, dtype=torch.bfloat16) for i in range(8)},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "bench"}')
    return folder / "model.safetensors"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import boto3

    from tasks.core.config import StoreConfig
    from tasks.core.store import Store

    proc, endpoint = start_moto()
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        cfg = StoreConfig(uri="s3://bench/runs", endpoint_url=endpoint)
        store = Store.open(cfg)
        client, transfer = store.client, store.transfer
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Path(tmp) / "ckpt"
            weights = write_policy(ckpt / "model", args.mb)
            (ckpt / "state.json").write_text("{}")
            adapter = Path(tmp) / "adapter"
            (adapter / "model").mkdir(parents=True)
            (adapter / "model" / "adapter_model.safetensors").write_bytes(os.urandom(9 << 20))
            (adapter / "model" / "adapter_config.json").write_text("{}")
            store.put_folder("lora/trainer/ckpt-000001", adapter)
            size = weights.stat().st_size + (ckpt / "model" / "config.json").stat().st_size
            rows = {k: [] for k in ("bare upload", "put_folder", "bare download", "get_folder", "publish", "lora")}
            for r in range(args.repeats):
                t = time.perf_counter()
                client.upload_file(str(weights), "bench", f"bare/{r}/model.safetensors", Config=transfer)
                rows["bare upload"].append(time.perf_counter() - t)
                t = time.perf_counter()
                store.put_folder(f"run/trainer/ckpt-{r:06d}", ckpt)
                rows["put_folder"].append(time.perf_counter() - t)
                t = time.perf_counter()
                client.download_file("bench", f"bare/{r}/model.safetensors", str(Path(tmp) / "dl.bin"), Config=transfer)
                rows["bare download"].append(time.perf_counter() - t)
                t = time.perf_counter()
                store.get_folder(f"run/trainer/ckpt-{r:06d}", Path(tmp) / f"get-{r}")
                rows["get_folder"].append(time.perf_counter() - t)
                t = time.perf_counter()
                store.copy_folder(f"run/trainer/ckpt-{r:06d}", f"run/policy/v{r:06d}", prefix="model/")
                rows["publish"].append(time.perf_counter() - t)
                t = time.perf_counter()
                store.copy_folder("lora/trainer/ckpt-000001", f"lora/policy/v{r:06d}", prefix="model/")
                rows["lora"].append(time.perf_counter() - t)
                (Path(tmp) / "dl.bin").unlink()
    finally:
        proc.kill()
        proc.wait()

    med = {k: statistics.median(v) for k, v in rows.items()}
    mb = size / (1 << 20)
    print(f"policy {mb:.0f} MiB, part {cfg.multipart_chunk_mb} MiB, concurrency {cfg.max_concurrency}, "
          f"median of {args.repeats}")
    for k, v in med.items():
        extra = f"{mb / v:7.1f} MiB/s" if k != "lora" else "   (9 MiB adapter)"
        print(f"  {k:<14} {v:7.2f} s {extra}")
    print(f"upload   put_folder / bare upload_file    = {med['put_folder'] / med['bare upload']:.2f}x")
    print(f"download get_folder / bare download_file  = {med['get_folder'] / med['bare download']:.2f}x")
    print(f"publish  copy_folder / bare upload_file   = {med['publish'] / med['bare upload']:.2f}x")
    print(f"LoRA adapter publish                      = {med['lora']:.2f} s")


if __name__ == "__main__":
    main()
