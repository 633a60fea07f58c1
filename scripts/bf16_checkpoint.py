#!/usr/bin/env python3
"""Copies a Hugging Face checkpoint directory with its F32 tensors rounded to BF16 (round to
nearest even) — except DeepSeek's router correction bias, which stays F32 as in the released
checkpoints — everything else as is. This is how the default job's model,
configs/models/dsv3-mtp-trained, is made from ../shared/models/dsv3-mtp-trained (by
scripts/quickstart.sh; the tests make their own copy in the build tree). Standard library only.

    python3 scripts/bf16_checkpoint.py SRC_DIR DST_DIR

DST_DIR appears whole or not at all: the files are written into a temporary sibling that is
renamed at the end, so an interrupted run leaves no half-written checkpoint behind, and of two
runs racing for the same DST_DIR one wins and the other leaves it as it is.
"""
import array
import json
import os
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
    if len(sys.argv) != 3:
        sys.exit("usage: python3 scripts/bf16_checkpoint.py SRC_DIR DST_DIR")
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    if not (src / "config.json").is_file():
        sys.exit(f"{src}: not a checkpoint directory (no config.json)")
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for p in sorted(src.iterdir()):
            if p.suffix == ".safetensors":
                convert(p, tmp / p.name)
            elif p.name == "config.json":
                cfg = json.loads(p.read_text())
                cfg["torch_dtype"] = "bfloat16"
                (tmp / p.name).write_text(json.dumps(cfg, indent=2) + "\n")
            else:
                shutil.copy(p, tmp / p.name)
        try:
            tmp.rename(dst)
        except OSError:
            if not (dst / "config.json").is_file():
                raise
            # Another run made DST_DIR first: the same bytes from the same source.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
