"""Readers of what each tracker stored, through its own library where it has one (run as `python tracker_stores.py
RUN_DIR PROJECT` in a fresh process, since Trackio fixes its directory when first imported): per tracker, each of its
runs by id, in the order they were made: {id: {"points": [[step, metric, value], ...], "params": {...},
"images": n}}, every value the store holds (a step logged twice is there twice)."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path


def wandb_records(path: Path) -> list:
    """The protobuf records of a wandb offline run file (`run-<id>.wandb`): its log format is leveldb's (a 7-byte
    header `:W&B`, 0xBEE1, version 0; 32 KiB blocks of records, each a 7-byte header of crc32, length, type
    FULL/FIRST/MIDDLE/LAST). wandb 0.31 writes it from its Go core and no longer ships a Python reader; the
    records are wandb's own messages (wandb.proto)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, out, pending = path.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left in this block for a header: zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def wandb_store(run_dir: Path) -> dict:
    """The offline run files in the order they were written; a run resumed offline is a second file of the same id."""
    runs: dict = {}
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda f: f.stat().st_mtime)
    for file in files:
        run = None
        for rec in wandb_records(file):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run = runs.setdefault(rec.run.run_id, {"points": [], "params": {}, "images": 0})
                run["params"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                # an image is logged as the fields of one nested key: curves/_type = image-file, curves/width, ...
                pictures = [k.removesuffix("/_type") for k, v in row.items() if k.endswith("/_type")
                            and v == "image-file"]
                run["images"] += len(pictures)
                step = int(row.pop("_step"))
                run["points"] += [[step, k, v] for k, v in row.items() if not k.startswith("_")
                                  and not any(k.startswith(p + "/") for p in pictures) and isinstance(v, (int, float))]
    return runs


def mlflow_store(run_dir: Path) -> dict:
    """Through MLflow's client, on the SQLite store tandem makes in the run directory."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="sqlite:///" + str((run_dir / "mlflow" / "mlflow.db").resolve()))
    found = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    runs = {}
    for run in sorted(found, key=lambda r: r.info.start_time):
        points = [[m.step, key, m.value] for key in run.data.metrics
                  for m in client.get_metric_history(run.info.run_id, key)]
        images = sum(f.path.endswith(".png") for f in client.list_artifacts(run.info.run_id))
        runs[run.info.run_id] = {"points": points, "params": run.data.params, "images": images}
    return runs


def trackio_store(run_dir: Path, project: str) -> dict:
    import os

    os.environ["TRACKIO_DIR"] = str((run_dir / "trackio").resolve())
    from trackio.sqlite_storage import SQLiteStorage

    runs = {}
    for name in SQLiteStorage.get_runs(project):
        points, images = [], 0
        for row in SQLiteStorage.get_logs(project, name):
            step = row.pop("step")
            images += sum(isinstance(v, dict) and v.get("_type") == "trackio.image" for v in row.values())
            points += [[step, k, v] for k, v in row.items() if isinstance(v, (int, float)) and k != "timestamp"]
        runs[name] = {"points": points, "params": SQLiteStorage.get_run_config(project, name) or {}, "images": images}
    return runs


def tensorboard_store(run_dir: Path) -> dict:
    """Through TensorBoard's own reader, which applies the purge a resume writes (values at and after the purge
    step, written before it, are dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    points = [[e.step, key, e.value] for key in acc.Tags()["scalars"] for e in acc.Scalars(key)]
    images = sum(len(acc.Images(t)) for t in acc.Tags()["images"])
    return {"tensorboard": {"points": points, "params": {}, "images": images}}


if __name__ == "__main__":
    folder, project = Path(sys.argv[1]), sys.argv[2]
    print(json.dumps({"wandb": wandb_store(folder), "mlflow": mlflow_store(folder),
                      "trackio": trackio_store(folder, project), "tensorboard": tensorboard_store(folder)}))
