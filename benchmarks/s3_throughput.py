"""Object-store upload: asyncckpt's publish against a plain s3fs put of the same bytes.

    python benchmarks/s3_throughput.py [--size-mb 512] [--repeats 3] [--endpoint URL --bucket B]

A checkpoint of --size-mb MiB is written and committed by the engine on the local disk; then,
in the same run and alternating order, the same directory goes to the store two ways:

- asyncckpt: ``storage.remote.publish_after_commit`` (what the worker runs after a commit: every
  file in parallel with retries and a time limit, the manifest, the commit marker last, then
  the tracker objects);
- s3fs put: ``fs.put(local_dir, prefix, recursive=True)`` of the same files, nothing else.

The ratio is asyncckpt's throughput over the plain put's (target >= 0.8).

Back-to-back saves (``back_to_back`` in the JSON): an engine with a remote tier saves a
--b2b-kib KiB model --b2b-saves times with nothing in between, once per queue bound
(``RemoteTier(max_queued_uploads=)``, 1 and the default 2): each save's wait (the ``save()``
call's seconds) beside its staging copy and the upload's seconds. A save waits only once the
bound's worth of committed steps wait to upload: with no training between saves, the uploads
fall behind and the queue fills. Without --endpoint,
a moto S3 server runs in a separate process on loopback (its own GIL), so both sides are
measured against the same local server; give --endpoint for a real store.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the moto server did not start")


def main(argv: list[str] | None = None) -> dict:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=512)
    p.add_argument("--tensor-mb", type=int, default=64, help="size of each tensor of the state")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--endpoint", default=None, help="S3 endpoint URL (default: a local moto)")
    p.add_argument("--bucket", default=None, help="an existing bucket (default: a new one)")
    p.add_argument("--b2b-kib", type=int, default=261, help="model of the back-to-back saves")
    p.add_argument("--b2b-saves", type=int, default=6, help="back-to-back saves per bound")
    p.add_argument("--only-b2b", action="store_true", help="skip the throughput comparison")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mb, args.tensor_mb, args.repeats = 16, 4, 1
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import s3fs

    from asyncckpt import SyncCheckpointEngine
    from asyncckpt.core import layout as L
    from asyncckpt.storage import RemoteTier
    from asyncckpt.storage.remote import publish_after_commit

    server = None
    endpoint = args.endpoint
    if endpoint is None:
        server, endpoint = start_moto()
    try:
        options: dict[str, Any] = {"endpoint_url": endpoint}
        if args.endpoint is None:
            options.update(key="testing", secret="testing")
        fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        bucket = args.bucket or f"asyncckpt-bench-{uuid.uuid4().hex[:8]}"
        if args.bucket is None:
            fs.mkdir(bucket)
        back_to_back = {str(bound): _back_to_back(args, bucket, options, bound) for bound in (1, 2)}
        if args.only_b2b:
            return _report_b2b(args, back_to_back)
        scratch = args.dir / f"s3bench-{uuid.uuid4().hex[:8]}"
        state = C.make_state(args.size_mb * C.MiB)
        with SyncCheckpointEngine(scratch) as eng:
            eng.save(1, state)
        step_dir = scratch / L.dir_name("global_step", 1)
        nbytes = C.dir_bytes(step_dir)
        nfiles = sum(1 for f in step_dir.rglob("*") if f.is_file())
        times: dict[str, list[float]] = {"asyncckpt": [], "s3fs.put": []}
        for rep in range(args.repeats):
            order = ["asyncckpt", "s3fs.put"] if rep % 2 == 0 else ["s3fs.put", "asyncckpt"]
            for method in order:
                prefix = f"{bucket}/run-{method}-{rep}"
                t0 = time.perf_counter()
                if method == "asyncckpt":
                    tier = RemoteTier(f"s3://{prefix}", storage_options=options)
                    publish_after_commit(tier.open(), tier, scratch, "global_step", 1)
                else:
                    fs.put(str(step_dir), f"{prefix}/{step_dir.name}", recursive=True)
                times[method].append(time.perf_counter() - t0)
                fs.rm(prefix, recursive=True)
        C.rmtree(scratch)
        del state
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    finally:
        if server is not None:
            server.kill()
            server.wait()
    ours, plain = C.summary(times["asyncckpt"]), C.summary(times["s3fs.put"])
    ratio = C.ratio(plain["median"], ours["median"])  # throughput ratio: ours / plain
    rep = {
        "environment": C.environment("cpu"),
        "package": C.package_source(),
        "endpoint": "moto (local, separate process)" if args.endpoint is None else endpoint,
        "bytes": nbytes,
        "files": nfiles,
        "seconds": {"asyncckpt": ours, "s3fs.put": plain},
        "throughput_mb_s": {
            "asyncckpt": nbytes / ours["median"] / 1e6,
            "s3fs.put": nbytes / plain["median"] / 1e6,
        },
        "targets": {"throughput_vs_s3fs_put": ratio, "target": 0.8, "met": ratio >= 0.8},
        "back_to_back": back_to_back,
    }
    _print_b2b(back_to_back)
    C.print_table(
        f"S3 upload of {nbytes / C.MiB:.0f} MiB in {nfiles} files ({rep['endpoint']})",
        ["method", "median s", "min s", "max s", "MB/s"],
        [
            [
                "asyncckpt publish",
                ours["median"],
                ours["min"],
                ours["max"],
                rep["throughput_mb_s"]["asyncckpt"],
            ],
            [
                "s3fs put",
                plain["median"],
                plain["min"],
                plain["max"],
                rep["throughput_mb_s"]["s3fs.put"],
            ],
        ],  # fmt: skip
    )
    print(f"throughput asyncckpt / s3fs put: {ratio:.2f}x (target >= 0.8x)")
    name = "s3_throughput" + (f"_{args.tag}" if args.tag else "")
    C.write_json(args.out, name, rep)
    if not args.no_plot:
        C.plot_bars(
            args.out / f"{name}.png",
            f"S3 upload, {nbytes / C.MiB:.0f} MiB",
            [("MB/s (higher is better)", ["asyncckpt", "s3fs.put"],
              [rep["throughput_mb_s"]["asyncckpt"], rep["throughput_mb_s"]["s3fs.put"]], None)],
        )  # fmt: skip
    return rep


def _back_to_back(args: Any, bucket: str, options: dict[str, Any], bound: int) -> dict[str, Any]:
    """--b2b-saves saves of a --b2b-kib KiB model, nothing in between: each save's wait."""
    from asyncckpt import SyncCheckpointEngine
    from asyncckpt.storage import RemoteTier

    state = {"model": {"w": torch.randn(args.b2b_kib * 1024 // 4)}}
    scratch = args.dir / f"s3b2b-{uuid.uuid4().hex[:8]}"
    url = f"s3://{bucket}/b2b-{bound}-{uuid.uuid4().hex[:6]}"
    tier = RemoteTier(url, storage_options=options, max_queued_uploads=bound)
    waits, staging, slot_waits, uploads = [], [], [], []
    with SyncCheckpointEngine(scratch, remote=tier) as eng:
        handles = []
        for step in range(1, args.b2b_saves + 1):
            t0 = time.perf_counter()
            handles.append(eng.save(step, state))
            waits.append(time.perf_counter() - t0)
        for h in handles:
            st = h.committed_sync(600)
            staging.append(st.stage_seconds)
            slot_waits.append(st.wait_seconds)
            uploads.append(st.upload_seconds)
    C.rmtree(scratch)
    return {
        "model_bytes": args.b2b_kib * 1024,
        "max_queued_uploads": bound,
        "save_wait_seconds": waits,
        "staging_seconds": staging,
        "staging_slot_wait_seconds": slot_waits,
        "upload_seconds": uploads,
        # Save 1 waits for the worker's start, not for an upload.
        "first_save_wait_seconds": waits[0],
        "first_save_waiting_for_room": next(
            (i + 1 for i, w in enumerate(waits) if i > 0 and w > 2 * max(staging[i], 0.01)), None
        ),
        "max_wait_before_the_queue_filled_seconds": max(waits[1 : bound + 1]),
        "max_wait_once_full_seconds": max(waits[bound + 1 :], default=0.0),
        "median_upload_seconds": C.summary(uploads)["median"],
    }


def _print_b2b(back_to_back: dict[str, Any]) -> None:
    for bound, r in back_to_back.items():
        C.print_table(
            f"back-to-back saves of {r['model_bytes'] / 1024:.0f} KiB, max_queued_uploads={bound}",
            ["save", "wait s", "staging s", "upload s"],
            [
                [i + 1, w, s, u]
                for i, (w, s, u) in enumerate(
                    zip(
                        r["save_wait_seconds"],
                        r["staging_seconds"],
                        r["upload_seconds"],
                        strict=True,
                    )
                )
            ],
        )


def _report_b2b(args: Any, back_to_back: dict[str, Any]) -> dict:
    rep = {
        "environment": C.environment("cpu"),
        "package": C.package_source(),
        "endpoint": "moto (local, separate process)" if args.endpoint is None else args.endpoint,
        "back_to_back": back_to_back,
    }
    _print_b2b(back_to_back)
    C.write_json(args.out, "s3_back_to_back" + (f"_{args.tag}" if args.tag else ""), rep)
    return rep


if __name__ == "__main__":
    main()
