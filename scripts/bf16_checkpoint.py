#!/usr/bin/env python3
"""Copies a Hugging Face checkpoint directory with its F32 tensors rounded to BF16 (round to
nearest even) — except DeepSeek's router correction bias, which stays F32 as in the released
checkpoints — everything else as is: how configs/models/dsv3-mtp-trained was made from
../shared/models/dsv3-mtp-trained. Standard library only.

    python3 scripts/bf16_checkpoint.py SRC_DIR DST_DIR
"""
import array
import json
import shutil
import struct
import sys
from pathlib import Path


def to_bf16(raw: bytes) -> bytes:
    words = array.array("I")
    words.frombytes(raw)
    out = array.array("H", bytes(2 * len(words)))
    for i, w in enumerate(words):
        if (w & 0x7F800000) == 0x7F800000 and (w & 0x007FFFFF):  # NaN stays NaN
            out[i] = (w >> 16) | 0x40
        else:
            out[i] = ((w + 0x7FFF + ((w >> 16) & 1)) >> 16) & 0xFFFF
    return out.tobytes()


def convert(src: Path, dst: Path) -> None:
    with open(src, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", None)
    tensors, blobs, offset = {}, [], 0
    for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
        info = dict(header[name])
        b, e = info["data_offsets"]
        blob = data[b:e]
        if info["dtype"] == "F32" and not name.endswith("e_score_correction_bias"):
            blob, info["dtype"] = to_bf16(blob), "BF16"
        info["data_offsets"] = [offset, offset + len(blob)]
        offset += len(blob)
        tensors[name] = info
        blobs.append(blob)
    if meta is not None:
        tensors["__metadata__"] = meta
    head = json.dumps(tensors, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.suffix == ".safetensors":
            convert(p, dst / p.name)
        elif p.name == "config.json":
            cfg = json.loads(p.read_text())
            cfg["torch_dtype"] = "bfloat16"
            (dst / p.name).write_text(json.dumps(cfg, indent=2) + "\n")
        else:
            shutil.copy(p, dst / p.name)


if __name__ == "__main__":
    main()
