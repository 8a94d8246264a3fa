"""llm.c token shards (the format of dtrain's `data tokenize`): a 256 x int32 header (magic
20240520, version 1, token count) then uint16 tokens. Shared by the bench scripts."""
import numpy as np

MAGIC = 20240520


def read_tokens(path):
    """The shard's tokens as a uint16 array; SystemExit naming the file when it is not a shard."""
    header = np.fromfile(path, dtype=np.int32, count=256)
    if len(header) < 3 or header[0] != MAGIC:
        raise SystemExit(f"{path}: not an llm.c token shard (magic {header[0] if len(header) else 'missing'})")
    return np.fromfile(path, dtype=np.uint16, offset=256 * 4, count=int(header[2]))


def write_tokens(path, tokens):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (MAGIC, 1, len(tokens))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())
