"""Readers of what each tracker stored, through its own library where it has one (run as `python tracker_stores.py
RUN_DIR` in a fresh process, since Trackio fixes its directory when first imported): one JSON object per tracker,
{"steps": {step: {metric: value}}, "params": {...}, "ids": [...], "images": n}."""
from __future__ import annotations

import json
import struct
import sys
from collections import defaultdict
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
    steps, params, ids, images = defaultdict(dict), {}, [], 0
    for file in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for rec in wandb_records(file):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.append(rec.run.run_id)
                params.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                # an image is logged as the fields of one nested key: curves/_type = image-file, curves/width, ...
                pictures = [k.removesuffix("/_type") for k, v in row.items() if k.endswith("/_type")
                            and v == "image-file"]
                images += len(pictures)
                steps[int(row.pop("_step"))].update({k: v for k, v in row.items() if not k.startswith("_")
                                                     and not any(k.startswith(p + "/") for p in pictures)
                                                     and isinstance(v, (int, float))})
    return {"steps": steps, "params": params, "ids": ids, "images": images}


def mlflow_store(run_dir: Path) -> dict:
    import os

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    steps = defaultdict(dict)
    for run in runs:
        for key in run.data.metrics:
            for m in client.get_metric_history(run.info.run_id, key):
                steps[m.step][key] = m.value
    images = sum(f.path.endswith(".png") for r in runs for f in client.list_artifacts(r.info.run_id))
    return {"steps": steps, "params": runs[0].data.params if runs else {}, "ids": [r.info.run_id for r in runs],
            "images": images}


def trackio_store(run_dir: Path, project: str) -> dict:
    import os

    os.environ["TRACKIO_DIR"] = str((run_dir / "trackio").resolve())
    from trackio.sqlite_storage import SQLiteStorage

    steps, images = defaultdict(dict), 0
    names = SQLiteStorage.get_runs(project)
    for name in names:
        for row in SQLiteStorage.get_logs(project, name):
            step = row.pop("step")
            images += sum(isinstance(v, dict) and v.get("_type") == "trackio.image" for v in row.values())
            steps[step].update({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "timestamp"})
    config = SQLiteStorage.get_run_config(project, names[0]) if names else {}
    return {"steps": steps, "params": config or {}, "ids": names, "images": images}


def tensorboard_store(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    steps = defaultdict(dict)
    for key in acc.Tags()["scalars"]:
        for event in acc.Scalars(key):
            steps[event.step][key] = event.value
    return {"steps": steps, "params": {}, "ids": [], "images": sum(len(acc.Images(t)) for t in acc.Tags()["images"])}


if __name__ == "__main__":
    folder, project = Path(sys.argv[1]), sys.argv[2]
    print(json.dumps({"wandb": wandb_store(folder), "mlflow": mlflow_store(folder),
                      "trackio": trackio_store(folder, project), "tensorboard": tensorboard_store(folder)}))
